"""EngineConfig and build_core: the model, runner, KV cache manager and EngineCore of one engine.

Runs where the core runs (its own process, or a thread of the API process in tests); what the API process
needs to know about the result travels back as a CoreInfo.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvcache import KVCacheManager
from server.engine.core import EngineCore
from server.engine.grammar import Grammars
from server.engine.runner import ModelRunner
from server.engine.wire import CoreInfo
from server.model import load_model

logger = logging.getLogger("pagewalk.engine")


@dataclass
class EngineConfig:
    model: str = "tiny"
    device: str = "auto"
    dtype: str | None = None
    block_size: int = 16
    num_blocks: int | None = None
    gpu_memory_utilization: float | None = None  # vLLM's meaning: share of the GPU's total memory
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_waiting: int = 1024
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    attention_backend: str = "auto"
    enable_prefix_caching: bool = True
    enforce_eager: bool = False  # True: no CUDA-graph decode
    # plan step N+1 while the device runs step N; None: where the device runs asynchronously (CUDA). On CPU a
    # step's forward runs inside the launch, so overlap would only hold each step's tokens back by one step.
    async_scheduling: bool | None = None
    tokenizer: str | None = None  # a tokenizer directory overriding the model's own
    chat_template: str | None = None  # a template file or text overriding the tokenizer's
    served_model_name: tuple[str, ...] = ()  # the model ids clients use; () -> the model's own name
    seed: int | None = None  # seeds the RNG of requests that bring no seed


def build_core(config: EngineConfig) -> tuple[EngineCore, CoreInfo]:
    if config.seed is not None:
        torch.manual_seed(config.seed)
    model, tokenizer = load_model(config.model, config.device, config.dtype, config.tokenizer,
                                  config.chat_template)
    max_model_len = config.max_model_len or model.config.max_position_embeddings
    if max_model_len > model.config.max_position_embeddings:  # RoPE past its range: refused, as vLLM does
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's max_position_embeddings "
                         f"({model.config.max_position_embeddings})")
    runner = ModelRunner(model, block_size=config.block_size, num_blocks=config.num_blocks,
                         gpu_memory_utilization=config.gpu_memory_utilization,
                         attention_backend=config.attention_backend,
                         max_num_batched_tokens=config.max_num_batched_tokens,
                         max_num_seqs=config.max_num_seqs, max_model_len=max_model_len,
                         enforce_eager=config.enforce_eager)
    max_model_len = _fitted_max_model_len(max_model_len, runner.capacity_tokens, config.max_model_len)
    runner.max_model_len = max_model_len  # what requests are checked against (its tables are as wide or more)
    kv = KVCacheManager(runner.num_blocks, config.block_size, config.enable_prefix_caching)
    async_scheduling = config.async_scheduling
    if async_scheduling is None:
        async_scheduling = runner.device.type == "cuda"
    eos = set(_checked_eos_ids(tokenizer.eos_token_ids, model.config.vocab_size))
    grammars = Grammars(tokenizer, model.config.vocab_size, eos)
    core = EngineCore(runner, kv, eos, config.max_num_seqs, config.max_num_batched_tokens, async_scheduling,
                      grammars)
    param = next(model.parameters())
    decoder_ops, refused = runner.decoder_kernels()
    info = CoreInfo(model=model.config.name, device=str(param.device),
                    dtype=str(param.dtype).removeprefix("torch."), attention_backend=runner.attention_backend,
                    cuda_graphs=bool(runner.cuda_graphs), block_size=config.block_size,
                    num_blocks=runner.num_blocks, capacity_tokens=runner.capacity_tokens,
                    max_model_len=max_model_len, vocab_size=model.config.vocab_size, decoder_ops=decoder_ops,
                    kernels_refused=refused)
    logger.info("pagewalk engine core: model=%s device=%s dtype=%s attention_backend=%s decoder_ops=%s%s "
                "kv_cache=%d blocks x %d = %d tokens, max_model_len=%d", info.model, info.device, info.dtype,
                info.attention_backend, decoder_ops, f" (refused: {', '.join(refused)})" if refused else "",
                info.num_blocks, info.block_size, info.capacity_tokens, max_model_len)
    return core, info


def _checked_eos_ids(ids, vocab_size: int) -> list[int]:
    """The checkpoint's EOS ids (config.json, generation_config.json, the tokenizer's), each a token of the
    model: one that is not would index past the logits in a min_tokens request."""
    for token in ids:
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
            raise ValueError(f"eos_token_id {token!r} is not a token of the model (vocab_size {vocab_size})")
    return list(ids)


def _fitted_max_model_len(max_model_len: int, capacity_tokens: int, asked: int | None) -> int:
    """A sequence of max_model_len tokens must fit the KV cache. An asked --max-model-len that does not is a
    start-up error, as vLLM's; the model's own length is cut to the cache's (a log line says so)."""
    if max_model_len <= capacity_tokens:
        return max_model_len
    if asked is not None:
        raise ValueError(f"max_model_len {max_model_len} is more than the KV cache holds ({capacity_tokens} "
                         "tokens): lower --max-model-len, or give the cache more blocks (--num-blocks, "
                         "--gpu-memory-utilization)")
    logger.warning("max_model_len %d (the model's) is more than the KV cache holds: serving %d tokens a "
                   "sequence", max_model_len, capacity_tokens)
    return capacity_tokens
