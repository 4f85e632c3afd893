"""The fused decoder forward (server/model/fused_forward.py) against the torch one: how it is chosen, the same
logits and K/V cache on the Triton interpreter (eager prefill, static-graph decode), and in bf16 on the GPU
with real CUDA graphs over batch and block sizes."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from runner_chunks import Chunk, RaggedBatch, run_chunks

from server.engine.runner import ModelRunner
from server.model import load_model


@pytest.fixture(scope="module")
def tiny():
    model, _ = load_model("tiny", "cpu", torch.float32)
    return model


def run_steps(model, runner: ModelRunner, ops: str, batches: list[list[Chunk]]) -> list[torch.Tensor]:
    model.set_decoder_ops(ops)
    try:
        return [run_chunks(runner, chunks) for chunks in batches]
    finally:
        model.set_decoder_ops("auto")


def teacher_forced_batches(lengths, block_size, num_blocks, steps, seed=0) -> list[list[Chunk]]:
    tf = RaggedBatch(lengths, block_size, num_blocks, seed)
    return [tf.prefill()] + [tf.decode() for _ in range(steps)]


# ---- the choice -----------------------------------------------------------------------------------------


class FakeAttention:
    def __init__(self, backend: str) -> None:
        self.backend = backend


def test_decoder_ops_follow_device_and_backend(tiny, caplog):
    assert tiny.resolve_decoder_ops(None) == "torch"  # the contiguous path is the reference
    assert tiny.resolve_decoder_ops(FakeAttention("torch")) == "torch"
    assert tiny.resolve_decoder_ops(FakeAttention("triton")) == "torch"  # CPU: eager torch ops
    tiny.set_decoder_ops("fused")
    try:
        assert tiny.resolve_decoder_ops(FakeAttention("torch")) == "fused"
        assert tiny.resolve_decoder_ops(None) == "torch"
    finally:
        tiny.set_decoder_ops("auto")
    with pytest.raises(ValueError, match="decoder ops"):
        tiny.set_decoder_ops("compiled")
    runner = ModelRunner(tiny, block_size=4, num_blocks=16, attention_backend="torch")
    tiny._logged_ops = None
    with caplog.at_level(logging.INFO, logger="server.model.llama"):
        run_chunks(runner, [Chunk([5, 6], 0, [1], [4, 5])])
    assert "model: decoder ops torch (cpu device, torch attention backend)" in caplog.text


# ---- interpreter: fused == torch ------------------------------------------------------------------------


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter")
@pytest.mark.parametrize("lengths,block_size", [([5, 1, 7], 1), ([5, 1, 7], 16), ([6], 16)])
def test_fused_forward_equals_torch_on_the_interpreter(tiny, block_size, lengths):
    """Fused: prefill (eager), then decode through the static-graph path (the captured body: forward, final
    norm and lm_head). Torch: all eager. 3 ragged sequences decode in one padded bucket, 3 -> 4, with a slot
    -1 row; one sequence decodes one row, through the GEMV route."""
    num_blocks = 48
    batches = teacher_forced_batches(lengths, block_size, num_blocks, steps=2, seed=block_size)
    runners = {ops: ModelRunner(tiny, block_size=block_size, num_blocks=num_blocks,
                                attention_backend="triton", max_num_seqs=4, max_model_len=32)
               for ops in ("torch", "fused")}
    runners["fused"].graphs = runners["fused"]._decode_graphs(use_cuda_graphs=False)
    runners["fused"].graphs.capture()
    for runner in runners.values():  # a finite poison (the kernels mask, never multiply, unread slots)
        runner.kv.data.fill_(-3.0)
    expect = run_steps(tiny, runners["torch"], "torch", batches)
    got = run_steps(tiny, runners["fused"], "fused", batches)
    assert runners["fused"].graphs.num_replays == 2
    for a, b in zip(got, expect, strict=True):
        assert a.dtype == torch.float32 and a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    # the same slots written with the same K/V (to fp32 rounding: the fused forward scales each row after the
    # qkv GEMM, on folded norms); the poison left everywhere else, the null block included
    torch.testing.assert_close(runners["fused"].kv.data, runners["torch"].kv.data, rtol=1e-4, atol=1e-4)
    assert (runners["fused"].kv.data[:, :, 0] == -3.0).all()


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter")
@pytest.mark.parametrize("arch,overrides,lengths", [
    ("qwen2", {"tie_word_embeddings": True}, [9, 2]),  # qkv bias, tied lm_head
    ("qwen2", {"tie_word_embeddings": True}, [9]),  # the biases through the one-row GEMVs
    ("mistral", {"sliding_window": 5}, [9, 2]),  # the window cuts into the 9-token sequence
])
def test_fused_forward_equals_torch_on_checkpoints(tmp_path, arch, overrides, lengths):
    pytest.importorskip("transformers")
    from model_fixtures import hf_config, write_hf_checkpoint

    write_hf_checkpoint(tmp_path, hf_config(arch, **overrides))
    model, _ = load_model(str(tmp_path), "cpu", torch.float32)
    batches = teacher_forced_batches(lengths, 4, 16, steps=2, seed=3)
    out = {}
    for ops in ("torch", "fused"):
        runner = ModelRunner(model, block_size=4, num_blocks=16, attention_backend="triton", max_num_seqs=2,
                             max_model_len=32)
        out[ops] = run_steps(model, runner, ops, batches)
    for a, b in zip(out["fused"], out["torch"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def every_row_through_the_last_layer(runner: ModelRunner) -> ModelRunner:
    """The runner with out_rows applied after the forward instead of inside it: every row runs the whole
    last layer, then the out rows are gathered (what the forward computed before it took out_rows)."""
    inner = runner._forward

    def forward(input_ids, positions, meta, out_rows=None):
        hidden = inner(input_ids, positions, meta)  # (T, H)
        return hidden if out_rows is None else hidden.index_select(0, out_rows)

    runner._forward = forward
    return runner


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter")
@pytest.mark.parametrize("ops", ["torch", "fused"])
def test_last_layer_over_the_out_rows_equals_every_row(tiny, ops):
    """A step's last layer past its attention runs on the rows whose logits are read (out_rows): the logits
    and the K/V it stores equal those of the whole last layer run on every row, in both decoder ops; prompts
    of 2-9 tokens and decodes mixed in one eager step, so the out rows are scattered over the flat batch."""
    batches = teacher_forced_batches([9, 1, 6, 2], 4, 48, steps=1, seed=5)
    out, caches = {}, {}
    for name in ("out rows", "every row"):
        runner = ModelRunner(tiny, block_size=4, num_blocks=48, attention_backend="triton", max_num_seqs=4,
                             max_model_len=32)
        if name == "every row":
            every_row_through_the_last_layer(runner)
        runner.kv.data.fill_(-3.0)
        out[name], caches[name] = run_steps(tiny, runner, ops, batches), runner.kv.data
    for a, b in zip(out["out rows"], out["every row"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert torch.equal(caches["out rows"], caches["every row"])


def test_model_forward_out_rows_gathers_in_their_order(tiny):
    """LlamaForCausalLM.forward's out_rows (torch ops over the runner's paged attention): any order, repeats
    allowed, each row's hidden state as the full forward gives it."""
    batches = teacher_forced_batches([7, 5], 4, 16, steps=0, seed=2)
    rows = torch.tensor([11, 0, 6, 6])  # the 5-token prompt's last row, the 7-token prompt's first, ...
    got = {}
    for name in ("out rows", "every row"):
        runner = ModelRunner(tiny, block_size=4, num_blocks=16, attention_backend="torch", max_num_seqs=2,
                             max_model_len=32)
        inner = runner._forward

        def forward(input_ids, positions, meta, out_rows=None, inner=inner, name=name):
            if name == "out rows":
                got[name] = inner(input_ids, positions, meta, rows)
            else:
                got[name] = inner(input_ids, positions, meta).index_select(0, rows)
            return inner(input_ids, positions, meta, out_rows)

        runner._forward = forward
        run_steps(tiny, runner, "torch", batches)
    assert got["out rows"].shape == (4, tiny.config.hidden_size)
    torch.testing.assert_close(got["out rows"], got["every row"], rtol=1e-5, atol=1e-5)


# ---- GPU: bf16, real CUDA graphs ------------------------------------------------------------------------

# bf16 keeps ~3 significant digits; the fused path rounds once per kernel where the torch ops round after
# every elementwise op, so the two differ by a few bf16 ulps of the logits' scale, and the fused one is at
# least as close to fp32
GPU_REL_TOL = 5e-2


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| over b's finite logits (a preset masks ids with -inf), which a shares."""
    finite = torch.isfinite(b)
    assert torch.equal(torch.isfinite(a), finite)
    a, b = a[finite].float(), b[finite].float()
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("num_seqs", [1, 8, 64])
def test_fused_graph_decode_equals_torch_in_bf16(num_seqs, block_size):
    """The fused graphs against the torch ops on the same folded bf16 weights, both against fp32; and what the
    fold's one rounding of W * g to bf16 adds: the torch ops on the unfolded bf16 weights against fp32."""
    model, _ = load_model("tiny", "cuda", torch.bfloat16)
    unfolded, _ = load_model("tiny", "cuda", torch.bfloat16)
    ref_model, _ = load_model("tiny", "cuda", torch.float32)
    model.prepare_decoder_ops("fused")  # the torch ops below run on the folded weights too
    lengths = [(7 * i) % 40 + 1 for i in range(num_seqs)]
    num_blocks = num_seqs * (-(-60 // block_size)) + 1
    batches = teacher_forced_batches(lengths, block_size, num_blocks, steps=12, seed=num_seqs)
    out = {}
    runs = (("torch", model, "torch"), ("fused", model, "fused"), ("unfolded", unfolded, "torch"),
            ("fp32", ref_model, "torch"))
    for name, m, ops in runs:
        m.set_decoder_ops(ops)  # before the runner captures its graphs
        try:
            runner = ModelRunner(m, block_size=block_size, num_blocks=num_blocks, max_num_seqs=64,
                                 max_model_len=256)
            assert runner.cuda_graphs and runner.graphs is not None
            out[name] = [run_chunks(runner, chunks) for chunks in batches]
            decode_only = sum(all(len(c.token_ids) == 1 for c in chunks) for chunks in batches)
            assert runner.graphs.num_replays == decode_only   # a 1-token prompt's prefill replays too
        finally:
            m.set_decoder_ops("auto")
    for step, ref in enumerate(out["fp32"]):
        fused, unfused = out["fused"][step], out["torch"][step]
        assert not fused.isnan().any()
        errs = {name: rel_err(out[name][step], ref) for name in ("fused", "torch", "unfolded")}
        # each is within bf16 reach of fp32 (the torch ops alone were measured 5.4e-2 from it at one step,
        # the fused graphs 3.6e-2), so of each other within twice that
        assert rel_err(fused, unfused) < 2 * GPU_REL_TOL, errs
        assert errs["fused"] <= 1.5 * errs["torch"] + 1e-3, errs
        assert errs["torch"] <= 2 * errs["unfolded"] + 1e-3, errs  # the fold's rounding of the weights
    # the start-up checks kept the one-launch kernels on this device, so the fused graphs above ran them
    import server.engine.attention as attention
    import server.model.fused_forward as ff

    assert not attention._ROPE_IN_DECODE_REFUSED and not ff._GATE_UP_SILU_REFUSED


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter")
def test_one_row_warm_up_launches_what_a_one_row_step_launches(tiny, monkeypatch):
    """warm_up_one_row (the runner calls it at start-up on CUDA) must launch every kernel specialisation a
    one-row decode step launches through the GEMVs, so an eager server compiles none mid-serving; and it
    stores no K/V (slot -1)."""
    from kernels import gemv as gemv_mod
    from kernels.launch_cache import CachedLauncher
    from server.model.fused_forward import warm_up_one_row

    seen: list[tuple] = []
    original = CachedLauncher.__call__

    def record(self, grid, *args, num_warps, num_stages, **kw):
        if self in (gemv_mod._gemv, gemv_mod._gemv_rope_store):
            seen.append((id(self), self.key(args, num_warps, num_stages, kw)))
        return original(self, grid, *args, num_warps=num_warps, num_stages=num_stages, **kw)

    monkeypatch.setattr(CachedLauncher, "__call__", record)
    runner = ModelRunner(tiny, block_size=4, num_blocks=16, attention_backend="triton", max_num_seqs=2,
                         max_model_len=32)
    runner.kv.data.fill_(-3.0)
    warm_up_one_row(tiny, *runner.kv.layer(0))
    assert (runner.kv.data == -3.0).all()
    warm = set(seen)
    assert {launcher for launcher, _ in warm} == {id(gemv_mod._gemv), id(gemv_mod._gemv_rope_store)}
    seen.clear()
    run_steps(tiny, runner, "fused", teacher_forced_batches([3], 4, 16, steps=1))  # prefill 3, decode 1
    assert seen and set(seen) <= warm


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter")
def test_mlp_warm_up_compiles_what_steps_launch(tiny, monkeypatch):
    """warm_up_mlp (start-up on CUDA) must launch every Triton specialisation of the fused gate_up + SiLU
    and the split-K down projection that decode and small prefill steps launch: the tile config and the
    row count's M == 1 / M % 16 == 0 cases (Triton specialises integers on those)."""
    from kernels import gate_up_silu as gus_mod
    from kernels import splitk_add as splitk_mod
    from kernels.launch_cache import CachedLauncher
    from server.model.fused_forward import warm_up_mlp

    seen: list[tuple] = []
    original = CachedLauncher.__call__
    rows_arg = {id(splitk_mod._kernel): 5, id(gus_mod._kernel): 4}  # the M argument's index

    def record(self, grid, *args, num_warps, num_stages, **kw):
        if id(self) in rows_arg:
            m = args[rows_arg[id(self)]]
            seen.append((id(self), tuple(sorted(kw.items())), m == 1, m % 16 == 0))
        return original(self, grid, *args, num_warps=num_warps, num_stages=num_stages, **kw)

    monkeypatch.setattr(CachedLauncher, "__call__", record)
    runner = ModelRunner(tiny, block_size=4, num_blocks=32, attention_backend="triton", max_num_seqs=4,
                         max_model_len=32)
    seen.clear()
    warm_up_mlp(tiny)
    warm = set(seen)
    assert {launcher for launcher, *_ in warm} == set(rows_arg)
    seen.clear()
    run_steps(tiny, runner, "fused", teacher_forced_batches([20, 17, 2], 4, 32, steps=2))  # 39 rows, then 3
    assert {launcher for launcher, *_ in seen} == set(rows_arg)
    assert set(seen) <= warm


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter")
def test_a_fused_gate_up_silu_that_disagrees_at_start_up_is_not_used(tiny, monkeypatch, caplog):
    """warm_up_mlp checks the fused gate_up + SiLU against cuBLAS's GEMM + SiLU-and-mul; where it disagrees
    (a compiler hazard the CPU cannot see), that device keeps the two launches, and the forward is right."""
    import server.model.fused_forward as ff

    monkeypatch.setattr(ff, "_GATE_UP_SILU_REFUSED", set())
    ff.warm_up_mlp(tiny)
    assert not ff._GATE_UP_SILU_REFUSED and ff.fuses_gate_up_silu(8, tiny.model.layers[0].mlp.gate_up_proj)
    runner = ModelRunner(tiny, block_size=4, num_blocks=32, attention_backend="triton", max_num_seqs=4,
                         max_model_len=32)
    batches = teacher_forced_batches([9, 5, 3], 4, 32, steps=2)
    want = run_steps(tiny, runner, "torch", batches)
    real = ff.gate_up_silu
    monkeypatch.setattr(ff, "gate_up_silu", lambda x, w, eps: real(x, w, eps) * 1.5)  # wrong
    with caplog.at_level(logging.WARNING, logger="server.model.fused_forward"):
        ff.warm_up_mlp(tiny)
    assert ff._GATE_UP_SILU_REFUSED == {torch.device("cpu")} and "keeps the two launches" in caplog.text
    assert not ff.fuses_gate_up_silu(8, tiny.model.layers[0].mlp.gate_up_proj)
    got = run_steps(tiny, runner, "fused", batches)  # the wrong kernel is never called
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-3, rtol=1e-3)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter")
def test_the_runner_names_the_fused_kernels_a_start_up_check_refused(tiny, monkeypatch):
    """/health's decoder_ops and kernels_refused come from ModelRunner.decoder_kernels: the fused ops on
    the Triton backend name the kernels whose start-up check failed on the runner's device."""
    import server.engine.attention as attention
    import server.model.fused_forward as ff

    monkeypatch.setattr(ff, "_GATE_UP_SILU_REFUSED", set())
    monkeypatch.setattr(attention, "_ROPE_IN_DECODE_REFUSED", set())
    runner = ModelRunner(tiny, block_size=4, num_blocks=32, attention_backend="triton", max_num_seqs=4,
                         max_model_len=32)
    assert runner.decoder_kernels() == ("torch", ())  # "auto" on the CPU
    tiny.set_decoder_ops("fused")
    try:
        assert runner.decoder_kernels() == ("fused", ())
        ff._GATE_UP_SILU_REFUSED.add(torch.device("cpu"))
        attention._ROPE_IN_DECODE_REFUSED.add(torch.device("cpu"))
        assert runner.decoder_kernels() == ("fused", ("gate_up_silu", "rope_in_decode"))
    finally:
        tiny.set_decoder_ops("auto")
