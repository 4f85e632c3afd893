"""tools/workload_bound.py: its byte and FLOP counts against the model itself, its bounds at their limits."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from server.model.config import preset
from server.model.loader import build_model
from tools import serving_bench
from tools.workload_bound import (
    Device,
    Workload,
    kv_bytes_per_token,
    overlap_bound_tok_s,
    prompt_flops,
    serial_bound_tok_s,
    token_flops,
    weight_bytes,
)

BENCH = preset("bench")


def test_weight_bytes_are_the_bench_models_parameters():
    with torch.device("meta"):
        model = build_model(BENCH, torch.device("meta"), torch.bfloat16)
    unique = {p.data_ptr() if p.device.type != "meta" else id(p): p for p in model.parameters()}
    assert weight_bytes(BENCH) == sum(2 * p.numel() for p in unique.values())
    assert BENCH.tie_word_embeddings and weight_bytes(BENCH) == 2_471_628_800  # Llama-3.2-1B: 1.24B params


def test_kv_bytes_per_token_of_llama_3_2_1b():
    assert kv_bytes_per_token(BENCH) == 16 * 2 * 8 * 64 * 2  # layers x (K, V) x kv heads x head dim x bf16


@pytest.mark.parametrize("tokens", [1, 7])
def test_token_flops_count_the_products_the_forward_runs(tokens):
    """The projections of every token and the lm_head of the last, as torch's FLOP counter sees the forward
    (it counts no FLOPs for the CPU's SDPA: attention, 4 x context x q_size a layer, is checked by hand
    below)."""
    cfg = preset("tiny")
    model = build_model(cfg, torch.device("cpu"), torch.float32)
    ids = torch.randint(0, cfg.vocab_size, (tokens,))
    with FlopCounterMode(display=False) as counter:
        hidden = model(ids, torch.arange(tokens))
        model.compute_logits(hidden[-1:])
    expect = (tokens - 1) * token_flops(cfg, 0, logits=False) + token_flops(cfg, 0, logits=True)
    assert counter.get_total_flops() == expect
    attention = token_flops(cfg, tokens, logits=False) - token_flops(cfg, 0, logits=False)
    q_k_and_p_v = 2 * (2 * tokens * cfg.head_dim * cfg.num_heads)  # (1, D) x (D, L) and (1, L) x (L, D)
    assert attention == cfg.num_layers * q_k_and_p_v


def test_prompt_flops_of_a_causal_prompt():
    cfg = preset("tiny")
    w = Workload(1, 1, prompt_len=10, output_len=4)
    # token p attends p + 1 tokens: sum over p of (p + 1) = 55 = 10 x 5.5
    per_token_linear = token_flops(cfg, 0, logits=False)
    attention = 4 * cfg.num_layers * cfg.q_size * 55
    head = 2 * cfg.vocab_size * cfg.hidden_size
    assert prompt_flops(cfg, w) == pytest.approx(10 * per_token_linear + attention + head)
    # a prefix hit of 8 tokens: tokens 8 and 9 computed, attending 9 and 10
    hit = Workload(1, 1, prompt_len=10, output_len=4, prompt_computed=2)
    assert prompt_flops(cfg, hit) == pytest.approx(
        2 * per_token_linear + 4 * cfg.num_layers * cfg.q_size * 19 + head)


def test_serial_bound_is_the_decode_roofline_when_compute_is_free():
    w = Workload(num_requests=256, concurrency=64, prompt_len=512, output_len=128)
    dev = Device(bandwidth=4.0e12, gemm_rate=float("inf"))
    step_bytes = weight_bytes(BENCH) + 64 * (512 + 64) * kv_bytes_per_token(BENCH)
    steps = 256 * 127 / 64
    assert serial_bound_tok_s(BENCH, w, dev) == pytest.approx(256 * 128 / (steps * step_bytes / 4.0e12))


def test_bounds_meet_when_bandwidth_is_free():
    """With bytes free, both bounds are every FLOP at the rate."""
    w = Workload(num_requests=64, concurrency=16, prompt_len=300, output_len=50)
    dev = Device(bandwidth=float("inf"), gemm_rate=5e14)
    flops = 64 * (prompt_flops(BENCH, w) + 49 * token_flops(BENCH, 300 + 25, logits=True))
    assert serial_bound_tok_s(BENCH, w, dev) == pytest.approx(64 * 50 * 5e14 / flops)
    assert overlap_bound_tok_s(BENCH, w, dev) == pytest.approx(64 * 50 * 5e14 / flops)


@pytest.mark.parametrize("c, prompt, out, cached", list(itertools.product(
    (1, 16, 64, 256), (16, 512, 4096), (2, 128), (None, 1))))
def test_overlap_bound_is_never_below_the_serial_bound(c, prompt, out, cached):
    w = Workload(num_requests=4 * c, concurrency=c, prompt_len=prompt, output_len=out,
                 prompt_computed=cached)
    dev = Device(bandwidth=4.2e12, gemm_rate=7e14)
    serial, overlap = serial_bound_tok_s(BENCH, w, dev), overlap_bound_tok_s(BENCH, w, dev)
    assert 0 < serial <= overlap * (1 + 1e-9)


def test_cached_prompts_raise_the_bound():
    dev = Device(bandwidth=4.2e12, gemm_rate=7e14)
    fresh = serial_bound_tok_s(BENCH, Workload(256, 256, 512, 128), dev)
    cached = serial_bound_tok_s(BENCH, Workload(256, 256, 512, 128, prompt_computed=16), dev)
    assert cached > 2 * fresh


def test_serving_bench_bounds_from_a_run():
    res = {"copy_TBps": 4.22, "gemm_TFLOPs": 700.0}
    serial, overlap = serving_bench.bounds_tok_s(res, 256, 256)
    dev = Device(4.22e12, 7e14)
    assert serial == pytest.approx(serial_bound_tok_s(BENCH, Workload(256, 256, 512, 128), dev))
    assert overlap == pytest.approx(overlap_bound_tok_s(BENCH, Workload(256, 256, 512, 128), dev))
    hit = serving_bench.bounds_tok_s(res, 256, 256, hit_rate=0.97)[0]
    assert hit == pytest.approx(serial_bound_tok_s(BENCH, Workload(256, 256, 512, 128, 15), dev))
    assert serving_bench.bounds_tok_s({"copy_TBps": 4.22}, 256, 256) is None  # a run before the GEMM rate
