"""The fastest a serving workload can run on a device: bytes at the copy bandwidth, FLOPs at the GEMM rate.

The memory roofline of a decode step (tools/serving_bench's `roofline_tok_s`) leaves out the prompts. At 512
prompt and 128 output tokens a request computes 640 tokens' products, so at high concurrency the prompts'
FLOPs, not the decode steps' bytes, set the pace. For N requests of P prompt and T output tokens, C in flight:

- a decode token at context L costs 2 x (linear weights) + 4 x L x (num_heads x head_dim) x layers FLOPs
  and the lm_head's 2 x vocab x hidden; a prompt token at position p the same with L = p + 1, and only the
  prompt's last token runs the lm_head (its logits give the first output token);
- a step reads every weight once (the lm_head included) and the K/V of every context token of its rows;
  a closed loop of N requests at C in flight runs at least N x (T - 1) / C decode steps and
  N x P / budget prompt steps.

Two bounds, in output tokens/s:
- `overlap`: max(all bytes / bandwidth, all FLOPs / rate), the device's limit whatever the schedule
  (prompt FLOPs hidden under decode bytes in mixed steps, perfectly);
- `serial`: the prompts' FLOPs at the GEMM rate, then T - 1 decode steps each at the larger of its bytes and
  its FLOPs: what steps that run prompts and decodes one after the other can reach, as a wave of C requests
  sent together runs (all prefill, then all decode).
Both take the GEMM rate measured on the device (cuBLAS at the prompt steps' largest product) as the compute
ceiling: the kernels a step actually runs reach at most that.
"""

from __future__ import annotations

from dataclasses import dataclass

from server.model.config import ModelConfig


@dataclass(frozen=True)
class Workload:
    """N requests of `prompt_len` prompt tokens (of which `prompt_computed` are computed: the rest are
    prefix-cache hits) and `output_len` output tokens each, `concurrency` in flight, prompt steps of up to
    `budget` tokens."""

    num_requests: int
    concurrency: int
    prompt_len: int
    output_len: int
    prompt_computed: int | None = None
    budget: int = 8192

    @property
    def computed(self) -> int:
        return self.prompt_len if self.prompt_computed is None else self.prompt_computed


@dataclass(frozen=True)
class Device:
    """The copy bandwidth (bytes/s, read + write of a device-to-device copy) and GEMM rate (FLOP/s)."""

    bandwidth: float
    gemm_rate: float


def weight_bytes(cfg: ModelConfig, elem: int = 2) -> int:
    """Bytes a step reads of weights: every projection, the norms and the lm_head (read whole once)."""
    return elem * (cfg.num_layers * (linear_params(cfg) + 2 * cfg.hidden_size)
                   + cfg.vocab_size * cfg.hidden_size + cfg.hidden_size)


def linear_params(cfg: ModelConfig) -> int:
    """Weights of one layer's projections (qkv, o_proj, gate_up, down)."""
    qkv = cfg.hidden_size * (cfg.q_size + 2 * cfg.kv_size)
    return qkv + cfg.q_size * cfg.hidden_size + 3 * cfg.hidden_size * cfg.intermediate_size


def kv_bytes_per_token(cfg: ModelConfig, elem: int = 2) -> int:
    return elem * cfg.num_layers * 2 * cfg.kv_size


def token_flops(cfg: ModelConfig, context: float, logits: bool) -> float:
    """FLOPs of one token attending `context` tokens (itself included), the lm_head if `logits`."""
    linear = 2 * cfg.num_layers * linear_params(cfg)
    attention = 4 * cfg.num_layers * context * cfg.q_size  # q k^T and p v over the context
    return linear + attention + (2 * cfg.vocab_size * cfg.hidden_size if logits else 0)


def prompt_flops(cfg: ModelConfig, w: Workload) -> float:
    """One request's prompt: its computed tokens at positions prompt_len - computed .. prompt_len - 1."""
    n, first = w.computed, w.prompt_len - w.computed
    mean_context = first + (n + 1) / 2  # token at position p attends p + 1 tokens
    return n * token_flops(cfg, mean_context, logits=False) + 2 * cfg.vocab_size * cfg.hidden_size


def decode_contexts(w: Workload) -> float:
    """The mean context of a request's decode tokens: the k-th (k = 1 .. T-1) attends P + k tokens."""
    return w.prompt_len + w.output_len / 2


def _totals(cfg: ModelConfig, w: Workload) -> tuple[float, float, float, float]:
    """(prompt FLOPs, decode FLOPs, decode steps, decode K/V bytes) of the whole workload."""
    decodes = w.output_len - 1
    ctx = decode_contexts(w)
    prompt = w.num_requests * prompt_flops(cfg, w)
    decode = w.num_requests * decodes * token_flops(cfg, ctx, logits=True)
    steps = w.num_requests * decodes / w.concurrency
    kv = w.num_requests * decodes * ctx * kv_bytes_per_token(cfg)
    return prompt, decode, steps, kv


def overlap_bound_tok_s(cfg: ModelConfig, w: Workload, dev: Device) -> float:
    """Output tokens/s with every byte at the bandwidth and every FLOP at the rate, overlapped."""
    prompt, decode, steps, kv = _totals(cfg, w)
    prompt_steps = w.num_requests * w.computed / w.budget
    prompt_kv_writes = w.num_requests * w.computed * kv_bytes_per_token(cfg)
    mem = ((steps + prompt_steps) * weight_bytes(cfg) + kv + prompt_kv_writes) / dev.bandwidth
    return w.num_requests * w.output_len / max(mem, (prompt + decode) / dev.gemm_rate)


def serial_bound_tok_s(cfg: ModelConfig, w: Workload, dev: Device) -> float:
    """Output tokens/s with the prompts computed at the rate, then decode steps bound by the larger of
    their bytes and their FLOPs (each step C rows)."""
    prompt, decode, steps, kv = _totals(cfg, w)
    step_bytes = weight_bytes(cfg) + kv / steps if steps else 0.0
    step_flops = decode / steps if steps else 0.0
    decode_s = steps * max(step_bytes / dev.bandwidth, step_flops / dev.gemm_rate)
    return w.num_requests * w.output_len / (prompt / dev.gemm_rate + decode_s)
