"""`python -m tools.hf_baseline`: the loadtest workload shape through HF transformers `generate`.

What a user would write by hand: one batch of `--batch-size` prompts of `--input-len` random token ids,
`generate(max_new_tokens=min_new_tokens=--output-len)` (EOS cannot end it early, like `ignore_eos`), greedy,
static KV cache (`cache_implementation="static"`), optionally `torch.compile`d. Reported as JSON: output
tokens/s over whole `generate` calls, plus the prefill time (a 1-token `generate`) and the decode rate
without it.

`--model tiny|bench` builds a transformers `LlamaForCausalLM` from pagewalk's preset config with the very
weights pagewalk serves (its seeded state dict, fused q/k/v and gate/up split back apart);
`--model PATH` loads a checkpoint directory with `AutoModelForCausalLM`.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch


def hf_config(cfg):
    """pagewalk ModelConfig (a preset) -> transformers LlamaConfig."""
    from transformers import LlamaConfig

    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling.rope_type == "llama3":
        s = cfg.rope_scaling
        rope |= {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                 "high_freq_factor": s.high_freq_factor,
                 "original_max_position_embeddings": s.original_max_position_embeddings}  # fmt: skip
    if cfg.architecture != "LlamaForCausalLM" or cfg.sliding_window or cfg.qkv_bias != cfg.o_bias:
        raise ValueError(f"hf_baseline converts Llama presets only, not {cfg.architecture} ({cfg.name})")
    return LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_norm_eps,
        rope_parameters=rope, tie_word_embeddings=cfg.tie_word_embeddings, attention_bias=cfg.qkv_bias,
        mlp_bias=cfg.mlp_bias, bos_token_id=cfg.bos_token_id,
        eos_token_id=list(cfg.eos_token_ids) or None, pad_token_id=0,
    )  # fmt: skip


def hf_state_dict(state: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """Split pagewalk's fused qkv_proj / gate_up_proj back into transformers' q/k/v and gate/up."""
    out = {}
    for name, t in state.items():
        if ".qkv_proj." in name:
            q, k, v = t.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=0)
            for part, tensor in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                out[name.replace("qkv_proj", part)] = tensor
        elif ".gate_up_proj." in name:
            gate, up = t.split([cfg.intermediate_size, cfg.intermediate_size], dim=0)
            out[name.replace("gate_up_proj", "gate_proj")] = gate
            out[name.replace("gate_up_proj", "up_proj")] = up
        elif "rotary" not in name:
            out[name] = t
    return out


def load_hf_model(name: str, device: torch.device, dtype: torch.dtype):
    """-> (transformers causal LM in eval mode on device, description of where it came from)."""
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    if Path(name).is_dir():
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype).to(device)
        return model.eval(), f"checkpoint {name}"
    from server.model import PRESETS, load_model

    if name not in PRESETS:
        raise ValueError(f"--model {name!r} is neither a preset ({', '.join(PRESETS)}) nor a directory")
    ours, _ = load_model(name, device, dtype)
    with torch.device(device):
        model = LlamaForCausalLM(hf_config(ours.config)).to(dtype)
    state = hf_state_dict(ours.state_dict(), ours.config)
    if "lm_head.bias" in state:  # the presets' printable-id mask (-inf logits); transformers' Llama has none
        model.lm_head.bias = torch.nn.Parameter(state.pop("lm_head.bias"), requires_grad=False)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if m != "lm_head.bias"
               and not (m == "lm_head.weight" and ours.config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"weight conversion mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    del ours
    return model.eval(), f"pagewalk preset {name} (seeded weights)"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def timed_generate(model, input_ids: torch.Tensor, new_tokens: int) -> float:
    sync(input_ids.device)
    start = time.perf_counter()
    out = model.generate(
        input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
        min_new_tokens=new_tokens, do_sample=False, cache_implementation="static", pad_token_id=0,
    )  # fmt: skip
    sync(input_ids.device)
    elapsed = time.perf_counter() - start
    if out.shape != (input_ids.shape[0], input_ids.shape[1] + new_tokens):
        raise RuntimeError(f"generate returned shape {tuple(out.shape)}, expected {new_tokens} new tokens")
    return elapsed


def run_baseline(model, batch_size: int, input_len: int, output_len: int, iters: int = 3, warmup: int = 1,
                 seed: int = 0, vocab_range: tuple[int, int] = (32, 126)) -> dict:  # fmt: skip
    device = next(model.parameters()).device
    rng = np.random.default_rng(seed)
    ids = rng.integers(vocab_range[0], vocab_range[1] + 1, size=(batch_size, input_len))
    input_ids = torch.tensor(ids, dtype=torch.long, device=device)
    for _ in range(warmup):
        timed_generate(model, input_ids, output_len)
        timed_generate(model, input_ids, 1)
    full = [timed_generate(model, input_ids, output_len) for _ in range(iters)]
    prefill = [timed_generate(model, input_ids, 1) for _ in range(iters)]
    mean_full, mean_prefill = statistics.mean(full), statistics.mean(prefill)
    decode_s = mean_full - mean_prefill
    decode = batch_size * (output_len - 1) / decode_s if output_len > 1 and decode_s > 0 else None
    return {
        "batch_size": batch_size, "input_len": input_len, "output_len": output_len, "iters": iters,
        "warmup": warmup, "latency_s": {"mean": mean_full, "min": min(full), "max": max(full)},
        "prefill_latency_s": mean_prefill,
        "output_throughput": batch_size * output_len / mean_full,
        "total_token_throughput": batch_size * (input_len + output_len) / mean_full,
        "decode_throughput": decode,
    }  # fmt: skip


def environment(device: torch.device, dtype: torch.dtype) -> dict:
    import transformers

    env = {"device": str(device), "dtype": str(dtype).removeprefix("torch."),
           "python": platform.python_version(), "torch": torch.__version__,
           "transformers": transformers.__version__, "cuda": torch.version.cuda,
           "num_threads": torch.get_num_threads()}  # fmt: skip
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    return env


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.hf_baseline", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", help="pagewalk preset (tiny | bench) or checkpoint directory")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "float16", "bfloat16"))
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-range", default="32,126", metavar="LOW,HIGH")
    p.add_argument("--compile", action="store_true", help="torch.compile the forward (static shapes)")
    p.add_argument("--out", default=None, metavar="JSON")
    args = p.parse_args(argv)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)  # fmt: skip
    if args.dtype == "auto":
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    else:
        dtype = getattr(torch, args.dtype)
    low, high = (int(x) for x in args.vocab_range.split(","))
    model, source = load_hf_model(args.model, device, dtype)
    if args.compile:
        mode = "reduce-overhead" if device.type == "cuda" else None  # CUDA graphs on GPU
        model.forward = torch.compile(model.forward, mode=mode, fullgraph=True)
    command = shlex.join(["python", "-m", "tools.hf_baseline", *(sys.argv[1:] if argv is None else argv)])
    result = {"tool": "hf_baseline", "model": args.model, "source": source, "cache_implementation": "static",
              "compile": args.compile, "command": command}  # fmt: skip
    result |= run_baseline(model, args.batch_size, args.input_len, args.output_len, args.iters, args.warmup,
                           args.seed, (low, high))  # fmt: skip
    result |= environment(device, dtype)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
