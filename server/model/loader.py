"""load_model / load_tokenizer: a preset name or a Hugging Face checkpoint directory -> (model, tokenizer).

Checkpoints: config.json (LlamaForCausalLM / MistralForCausalLM / Qwen2ForCausalLM), safetensors weights
(model.safetensors, or shards listed in model.safetensors.index.json), tokenizer.json
(+ tokenizer_config.json, generation_config.json). Tensors are read memory-mapped and copied once into
parameters already on the target device in the target dtype; q/k/v and gate/up are stacked into the fused
parameters.
"""

from __future__ import annotations

import contextlib
import logging
import re
from pathlib import Path

import torch
from safetensors import safe_open

from server.model.chat_template import load_chat_template
from server.model.config import PRESETS, ModelConfig
from server.model.json_file import read_json_object
from server.model.llama import LlamaForCausalLM
from server.model.random_init import init_random_weights, restrict_to_printable
from server.model.tokenizer import ByteTokenizer, HFTokenizer

log = logging.getLogger(__name__)

# checkpoint tensor suffix -> (our parameter suffix, shard index within the fused parameter)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
_FUSED_RE = re.compile(
    r"^(model\.layers\.\d+\.)(" + "|".join(re.escape(k) for k in _FUSED) + r")\.(weight|bias)$"
)
# buffers older transformers saved with the weights (RoPE's, recomputed from config.json)
_IGNORED = re.compile(r"rotary_emb\.(inv_freq|cos_cached|sin_cached)$")
_PROJECTION_BIAS = re.compile(
    r"^model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.bias$")

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """None/"auto": fp32 on CPU, bf16 on CUDA (fp16 where bf16 is unsupported)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; use one of {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def load_model(name_or_path: str, device=None, dtype=None, tokenizer: str | None = None,
               chat_template: str | None = None):
    """-> (LlamaForCausalLM in eval mode without grads, ByteTokenizer | HFTokenizer); see load_tokenizer."""
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    cfg = model_config(name_or_path)
    tok = load_tokenizer(name_or_path, tokenizer, chat_template)
    if name_or_path not in PRESETS:
        check_sizes(cfg, Path(name_or_path))
    model = build_model(cfg, dev, dt)
    if name_or_path in PRESETS:
        init_random_weights(model, cfg)
        if cfg.printable_output:
            restrict_to_printable(model)
    else:
        load_weights(model, Path(name_or_path))
    return model, tok


def load_tokenizer(name_or_path: str, tokenizer: str | None = None, chat_template: str | None = None):
    """The tokenizer that serves a preset or checkpoint; reads no weights (an API process can call it).

    `tokenizer`: a directory holding tokenizer.json to use instead of the model's own; `chat_template`: a
    template file or text overriding the tokenizer's (vLLM's --tokenizer and --chat-template).
    """
    cfg = model_config(name_or_path)
    template = load_chat_template(chat_template) if chat_template is not None else None
    if name_or_path in PRESETS and tokenizer is None:
        return _templates_checked(ByteTokenizer(cfg.vocab_size, template))
    eos_ids = cfg.eos_token_ids
    if name_or_path not in PRESETS:
        eos_ids = _generation_eos_ids(Path(name_or_path)) or eos_ids
    tok_dir = Path(tokenizer or name_or_path)
    if not tok_dir.is_dir():
        raise FileNotFoundError(f"tokenizer {tokenizer!r} is not a directory holding tokenizer.json")
    tok = HFTokenizer.from_dir(tok_dir, extra_eos_ids=tuple(eos_ids), chat_template=template)
    if tok.vocab_size > cfg.vocab_size:
        raise ValueError(f"the tokenizer in {tok_dir} has ids up to {tok.vocab_size - 1} but the model only "
                         f"{cfg.vocab_size} embedding rows")
    return _templates_checked(tok)


def _templates_checked(tok):
    """The tokenizer, once its chat templates render a conversation in time (ChatTemplate.check_renders)."""
    template = tok.chat_template
    for t in (template, template.tool_use if template is not None else None):
        if t is not None:
            t.check_renders()
    return tok


def model_config(name_or_path: str) -> ModelConfig:
    """A preset's config, or a checkpoint directory's config.json."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    path = Path(name_or_path)
    if not path.is_dir():
        if _HUB_ID.match(name_or_path) and not path.exists():
            raise FileNotFoundError(
                f"model {name_or_path!r} is not a local directory and pagewalk does not download from the "
                f"Hugging Face Hub: download it first (`hf download {name_or_path} --local-dir DIR`) "
                "and pass DIR")
        raise FileNotFoundError(
            f"model {name_or_path!r} is neither a preset ({', '.join(PRESETS)}) nor a checkpoint directory")
    return ModelConfig.from_hf(read_json_object(path / "config.json", required=True),
                               name=path.resolve().name)  # `serve .` is its directory's name (a review)


_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")  # "org/name", as the Hub spells model ids


def build_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> LlamaForCausalLM:
    """Allocate (uninitialised) parameters straight on `device` in `dtype`."""
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to(dtype).to_empty(device=device)
    model.tie_weights()
    model.model.rotary.inv_freq = model.model.rotary.inv_freq.to(device)  # fp32, outside inference mode
    return model.eval().requires_grad_(False)


_LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.")


def check_sizes(cfg: ModelConfig, path: Path) -> None:
    """config.json's layer count and embedding against the checkpoint's tensor names and shapes (headers
    alone), before the model is allocated: a 2-layer checkpoint whose config said 5,000 layers was refused
    only after 13 s of allocation, a vocabulary of 10^9 in the allocator (a review)."""
    layers, embedding = 0, None
    for file in checkpoint_files(path):
        with _open_weights(file) as f:
            for key in f.keys():
                if match := _LAYER_KEY.match(key):
                    layers = max(layers, int(match.group(1)) + 1)
                elif key == TIED_EMBEDDING or (key == TIED_HEAD and embedding is None):
                    embedding = tuple(f.get_slice(key).get_shape())
    if layers != cfg.num_layers:
        raise ValueError(f"config.json says {cfg.num_layers} layers (num_hidden_layers) but checkpoint "
                         f"{path} holds {layers}")
    if embedding is not None and embedding != (cfg.vocab_size, cfg.hidden_size):
        raise ValueError(f"config.json says vocab_size {cfg.vocab_size} and hidden_size {cfg.hidden_size} "
                         f"but the checkpoint's embedding is {embedding}")


@torch.no_grad()
def load_weights(model: LlamaForCausalLM, path: Path) -> None:
    params = dict(model.named_parameters())
    pending = {(name, shard) for name, p in params.items() for shard in _shards_of(name)}
    tied_head = None  # a tied checkpoint's lm_head.weight, if it stores one
    dropped: list[str] = []  # biases the architecture never applies
    for file in checkpoint_files(path):
        with _open_weights(file) as f:
            for key in f.keys():
                if key == TIED_HEAD and model.config.tie_word_embeddings:
                    tied_head = _weight(f, key, file)
                    continue
                if _bias_the_architecture_lacks(key, model.config):
                    dropped.append(key)
                    continue
                target = _target(key, model.config)
                if target is None:
                    continue
                name, shard = target
                if name not in params:
                    raise ValueError(f"unexpected tensor {key!r} in {file.name}: no such parameter")
                dest = _destination(params[name], name, shard, model.config)
                tensor = _weight(f, key, file)
                if tuple(tensor.shape) != tuple(dest.shape):
                    raise ValueError(f"tensor {key!r} in {file.name} has shape {tuple(tensor.shape)}, "
                                     f"expected {tuple(dest.shape)} from config.json")
                dest.copy_(tensor)
                _check_finite(dest, key, file.name)
                pending.discard((name, shard))
    if dropped:
        log.warning("%d bias tensors that %s never applies are not loaded (as transformers ignores them), "
                    "e.g. %s", len(dropped), model.config.architecture, dropped[0])
    if tied_head is not None:
        _check_tied_head(params[TIED_EMBEDDING], tied_head, (TIED_EMBEDDING, None) in pending)
        pending.discard((TIED_EMBEDDING, None))
    if pending:
        missing = sorted(_hf_name(n, s) for n, s in pending)
        raise ValueError(f"checkpoint {path} lacks {len(missing)} tensors, e.g. {', '.join(missing[:5])}")


TIED_HEAD, TIED_EMBEDDING = "lm_head.weight", "model.embed_tokens.weight"
# the checkpoint dtypes a parameter takes by a cast (int8 / fp8 / packed tensors under the plain names of a
# checkpoint whose config.json names no quantization would load as garbage)
WEIGHT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _weight(f, key: str, file: Path) -> torch.Tensor:
    """Tensor `key` of the open checkpoint file `f`, refused unless a cast to the serving dtype keeps it."""
    tensor = f.get_tensor(key)
    if tensor.dtype not in WEIGHT_DTYPES:
        raise ValueError(f"tensor {key!r} in {file.name} is {tensor.dtype}: pagewalk loads fp16, bf16 or "
                         "fp32 weights, and a quantized tensor cast to them is not the model (quantized "
                         "checkpoints are not supported)")
    return tensor


def _check_finite(dest: torch.Tensor, key: str, where: str) -> None:
    """A weight that is NaN or infinite in the serving dtype (stored so, or past fp16's 65504) makes every
    reply garbage: served before without a word, token 0 on repeat (a review)."""
    if not bool(torch.isfinite(dest).all()):
        raise ValueError(f"tensor {key!r} in {where} holds NaN or infinite values in {dest.dtype} "
                         "(stored so, or past the serving dtype's range: serve it in a wider --dtype)")


def _check_tied_head(embedding: torch.Tensor, head: torch.Tensor, embedding_missing: bool) -> None:
    """config.json ties the head to the embedding and the checkpoint stores lm_head.weight: with no embedding
    stored it is the embedding (transformers ties them the same way); a head that differs from the stored
    embedding is refused (transformers versions disagree on which one such a checkpoint serves)."""
    if tuple(head.shape) != tuple(embedding.shape):
        raise ValueError(f"tensor {TIED_HEAD!r} has shape {tuple(head.shape)}, expected "
                         f"{tuple(embedding.shape)} from config.json")
    if embedding_missing:
        embedding.copy_(head)
        _check_finite(embedding, TIED_HEAD, "the checkpoint")
    elif not torch.equal(embedding, head.to(embedding.device, embedding.dtype)):
        raise ValueError(f"config.json sets tie_word_embeddings but the checkpoint's {TIED_HEAD} differs "
                         f"from its {TIED_EMBEDDING}: set tie_word_embeddings to false in config.json to "
                         "serve the separate head")


@contextlib.contextmanager
def _open_weights(file: Path):
    """safe_open, with the file named when it is not a safetensors file (a git-lfs pointer, a truncated
    download)."""
    try:
        f = safe_open(str(file), framework="pt", device="cpu")
    except Exception as e:  # noqa: BLE001 -- safetensors raises its own SafetensorError (no public class)
        raise ValueError(f"{file} is not a readable safetensors file ({type(e).__name__}: {e}); a git-lfs "
                         "pointer or an incomplete download reads so") from None
    with f:
        yield f


def checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json_object(index, required=True).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} has no weight_map object")
        names = sorted({_shard_name(index, name) for name in weight_map.values()})
        if names != ["model.safetensors"] and (path / "model.safetensors").is_file():  # one of them is left
            # from another save (save_pretrained deletes stale shards, not a stale single file): transformers
            # loads the single file, vLLM the index's shards; neither can be known to be the checkpoint meant
            raise ValueError(f"{path} holds model.safetensors beside an index of other shards (one of them "
                             "is left from an earlier save): remove the one that is not the checkpoint")
        files = [path / f for f in names]
    elif (path / "model.safetensors").is_file():
        files = [path / "model.safetensors"]
    else:
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(
                f"no safetensors weights in {path} "
                "(expected model.safetensors or model.safetensors.index.json)"
            )
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"weight shard {f} listed in model.safetensors.index.json is missing")
    return files


def _shard_name(index: Path, name) -> str:
    """A shard's name from the index, which must name a file in the checkpoint's directory: "../x" or an
    absolute path loaded weights from anywhere on the host (a review; vLLM reads only the directory's files,
    a symlink there stays a file there)."""
    if not isinstance(name, str) or not name or Path(name).name != name or name in (".", ".."):
        raise ValueError(f"{index} names the shard {name!r}: shards are file names in its directory")
    return name


def _bias_the_architecture_lacks(key: str, cfg: ModelConfig) -> bool:
    """A projection's bias that the architecture has no config flag for and never applies: Mistral's (any),
    Qwen2's o_proj and MLP ones. transformers loads such a checkpoint and ignores them (its config's
    `attention_bias` / `mlp_bias` are Llama's alone), so its output is the model without them. A Llama bias
    that its config's flag turns off is still an unexpected tensor."""
    if cfg.architecture == "LlamaForCausalLM" or not _PROJECTION_BIAS.match(key):
        return False
    return cfg.architecture == "MistralForCausalLM" or not key.endswith(("q_proj.bias", "k_proj.bias",
                                                                         "v_proj.bias"))


def _target(key: str, cfg: ModelConfig) -> tuple[str, int | None] | None:
    """Checkpoint name -> (our parameter name, shard index or None); None for tensors we skip."""
    if _IGNORED.search(key):
        return None
    m = _FUSED_RE.match(key)
    if m is None:
        return key, None
    prefix, module, kind = m.groups()
    fused, shard = _FUSED[module]
    return f"{prefix}{fused}.{kind}", shard


def _destination(param: torch.Tensor, name: str, shard: int | None, cfg: ModelConfig) -> torch.Tensor:
    """The rows of `param` that checkpoint shard `shard` fills (all of it when not fused)."""
    if shard is None:
        return param
    if name.endswith(("qkv_proj.weight", "qkv_proj.bias")):
        sizes = [cfg.q_size, cfg.kv_size, cfg.kv_size]
    else:
        sizes = [cfg.intermediate_size, cfg.intermediate_size]
    start = sum(sizes[:shard])
    return param[start : start + sizes[shard]]


def _shards_of(name: str) -> list[int | None]:
    if ".qkv_proj." in name:
        return [0, 1, 2]
    if ".gate_up_proj." in name:
        return [0, 1]
    return [None]


def _hf_name(name: str, shard: int | None) -> str:
    if shard is None:
        return name
    fused = "self_attn.qkv_proj" if ".qkv_proj." in name else "mlp.gate_up_proj"
    module = next(k for k, v in _FUSED.items() if v == (fused, shard))
    return name.replace(fused, module)


SAMPLING_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_defaults(name_or_path: str) -> dict[str, float | int]:
    """A checkpoint's generation_config.json sampling values ({} for a preset or none): what a request that
    leaves those fields out samples with, as vLLM's --generation-config auto (Llama-3 instruct: temperature
    0.6, top_p 0.9). Values of the wrong type are refused with the file named."""
    if name_or_path in PRESETS or not Path(name_or_path).is_dir():
        return {}
    file = Path(name_or_path) / "generation_config.json"
    cfg = read_json_object(file)
    out = {}
    for key in SAMPLING_DEFAULT_FIELDS:
        value = cfg.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{file}: {key} must be a number, got {value!r}")
        out[key] = value
    return out


def _generation_eos_ids(path: Path) -> list[int]:
    file = path / "generation_config.json"
    eos = read_json_object(file).get("eos_token_id")
    if eos is None:
        return []
    ids = eos if isinstance(eos, list) else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"{file}: eos_token_id must be a token id or a list of them, got {eos!r}")
    return ids
