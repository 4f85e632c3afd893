"""Sampling-kernel launch-config probe (GPU, not a test): `python -m tools.sampling_tile_probe [--out JSON]`.

kernels/sampling.py gives each row one program that walks the row's V logits tile by tile, pass after pass;
with one program per row its passes are bound by how many bytes and exps a program keeps in flight, which
the tile width (BLOCK) and the warps set. This times kernels.sampling.sample_logits (the kernel alone, no
Sampler gathers) for each (BLOCK, num_warps) over V = 128256 logits randn * 3, as bf16 (the decode graph's
output, drawn from directly) and fp32, S in {1, 16, 64, 256} rows, under temperature 0.8 + top_p 0.95
(rejection rounds) and temperature 1.0 alone (one pass and a draw). Each timing is a CUDA graph of four
calls with distinct draw counters, replayed; ms per call. Every token is checked against the float64
filtered set (kernels/sampling_reference.py) and compared with the shipped config's.
The recorded run (docs/benchmarks/sampling_tile_h200.json) also had a software-pipelining axis (num_stages 1
or 3, a knob since removed): 3 stages timed the same as 1 in every case. Prints a table last (per config: ms
at each S and dtype, and the ratio to the shipped config); writes JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton

import kernels.sampling as ks
from kernels.sampling_reference import filtered_sets
from tools.sampler_bench import graph_ms

V = 128256
BATCHES = (1, 16, 64, 256)
PARAMS = {"t0.8_p0.95": (0.8, 0.95), "t1.0": (1.0, 1.0)}
SHIPPED = (ks.BLOCK, ks.NUM_WARPS)
CONFIGS = [SHIPPED] + [c for c in [(2048, 4), (2048, 8), (2048, 16), (4096, 4), (4096, 8), (4096, 16),
                                   (8192, 8), (8192, 32), (16384, 16), (16384, 32)] if c != SHIPPED]
DRAWS = 4  # calls per graph, each with its own counters


def case_inputs(S: int, dtype: torch.dtype, params, gen: torch.Generator) -> dict:
    t, p = params
    dev = torch.device("cuda")
    logits = (torch.randn(S, V, generator=gen, device=dev) * 3).to(dtype)
    return {"logits": logits, "temperature": torch.full((S,), t, device=dev),
            "top_p": torch.full((S,), p, device=dev), "min_p": torch.zeros(S, device=dev),
            "top_k": torch.zeros(S, dtype=torch.int64, device=dev),
            "keys": torch.arange(1000, 1000 + S, dtype=torch.int64, device=dev),
            "counters": [torch.full((S,), 7 + 131 * d, dtype=torch.int64, device=dev) for d in range(DRAWS)]}


def run_config(cfg, case: dict) -> tuple[float, list[torch.Tensor]]:
    ks.BLOCK, ks.NUM_WARPS = cfg

    def calls():
        return [ks.sample_logits(case["logits"], case["temperature"], case["top_p"], case["min_p"],
                                 case["top_k"], case["keys"], c, 1e-5) for c in case["counters"]]

    tokens = calls()
    torch.cuda.synchronize()
    return graph_ms(calls, 20) / DRAWS, tokens


def bad_tokens(case: dict, params, tokens: list[torch.Tensor]) -> int:
    t, p = params
    _, allowed = filtered_sets(case["logits"], t, p, 0, 0.0)
    return sum(int((~allowed.gather(1, tok[:, None])).sum()) for tok in tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("sampling_tile_probe.json"))
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    cases = {(S, str(dt).split(".")[-1], name): case_inputs(S, dt, prm, gen)
             for S in BATCHES for dt in (torch.bfloat16, torch.float32) for name, prm in PARAMS.items()}
    rows, ref_tokens = [], {}
    for cfg in CONFIGS:
        for key, case in cases.items():
            try:
                ms, tokens = run_config(cfg, case)
            except Exception as e:  # a config that does not compile (registers, shared memory)
                rows.append({"config": cfg, "case": key, "error": repr(e)[:200]})
                continue
            row = {"config": cfg, "case": key, "ms": ms, "bad": bad_tokens(case, PARAMS[key[2]], tokens)}
            if cfg == SHIPPED:
                ref_tokens[key] = tokens
            same = sum(int((a == b).sum()) for a, b in zip(tokens, ref_tokens[key], strict=True))
            row["same_as_shipped"] = same / (DRAWS * key[0])
            rows.append(row)
    ks.BLOCK, ks.NUM_WARPS = SHIPPED
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "V": V, "shipped": SHIPPED}
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    base = {r["case"]: r["ms"] for r in rows if r["config"] == SHIPPED and "ms" in r}
    keys = list(cases)
    print(f"{meta['gpu']} torch {meta['torch']} triton {meta['triton']}: sampling kernel ms per call, V={V}")
    print("config (BLOCK, warps) | " + " | ".join(f"{S} {d[:4]} {n}" for S, d, n in keys)
          + " | geo-mean vs shipped | bad | min same")
    for cfg in CONFIGS:
        got = {r["case"]: r for r in rows if r["config"] == cfg}
        if any("error" in got[k] for k in keys):
            print(f"{cfg} | error: {next(got[k]['error'] for k in keys if 'error' in got[k])}")
            continue
        ratio = 1.0
        for k in keys:
            ratio *= got[k]["ms"] / base[k]
        print(f"{cfg} | " + " | ".join(f"{got[k]['ms']:.3f}" for k in keys)
              + f" | {ratio ** (1 / len(keys)):.3f} | {sum(got[k]['bad'] for k in keys)}"
              + f" | {min(got[k]['same_as_shipped'] for k in keys):.3f}")


if __name__ == "__main__":
    main()
