"""Review of the last layer over the out rows (FlatLayout.num_out, LlamaForCausalLM.forward's out_rows): whole
engines (chunked prefill that stops short of a prompt's end, forks sharing a logits row, preemption and
resume, logprobs, prefix hits) checked token by token against the dense contiguous forward, on the eager
path and on the static mixed-graph path (a budget below max_num_seqs: mixed sizes below the cap, one of
them no multiple of 16), on Llama / Qwen2 (biases) / Mistral (sliding window) weights, with the torch ops
(the fused ops' out rows: tests/test_model_fused_forward.py); and the tools that wrap the model's forward."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

from server.engine.engine import EngineConfig, build_core
from server.engine.outputs import EngineRequest
from server.engine.sampling_params import SamplingParams

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def last_logits(model, ids: list[int]) -> torch.Tensor:
    """The contiguous forward over `ids` (attn None: no KV cache, no out rows) -> the last position's
    logits (V,) fp32 on the CPU: the dense references' step."""
    dev = next(model.parameters()).device
    hidden = model(torch.tensor(ids, device=dev), torch.arange(len(ids), device=dev))
    return model.compute_logits(hidden[-1:])[0].float().cpu()


def dense_greedy(model, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy continuation through the contiguous forward (attn None: no KV cache, no out rows) ->
    (tokens, the chosen tokens' logprobs)."""
    ids, lps = list(prompt), []
    dev = next(model.parameters()).device
    with torch.inference_mode():
        for _ in range(n):
            hidden = model(torch.tensor(ids, device=dev), torch.arange(len(ids), device=dev))
            logp = model.compute_logits(hidden[-1:]).log_softmax(-1)[0]
            t = int(logp.argmax())
            ids.append(t)
            lps.append(float(logp[t]))
    return ids[len(prompt):], lps


def requests(vocab: int, seed: int = 0):
    """Prompts of 3-29 tokens, two of them sharing a 12-token prefix (a prefix hit), n = 2 forks, logprobs."""
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, vocab, (12,), generator=gen).tolist()
    reqs = []
    for i, n_tok in enumerate([29, 5, 17, 3, 22, 9]):
        prompt = torch.randint(3, vocab, (n_tok,), generator=gen).tolist()
        if i in (2, 4):
            prompt = prefix + prompt[:n_tok - 12]
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, n=2 if i % 3 == 1 else 1,
                                logprobs=2 if i % 2 else None)
        reqs.append((f"r{i}", prompt, params))
    return reqs


def run_engine(config: EngineConfig, reqs, static_graphs: bool = False, ops: str | None = None):
    """-> ({(rid, index): tokens}, {(rid, index): chosen logprobs}, stats, core, the dense references)."""
    core, _ = build_core(config)
    runner = core.runner
    model = runner.model
    refs = {rid: dense_greedy(model, prompt, params.max_tokens) for rid, prompt, params in reqs}
    if ops is not None:
        model.set_decoder_ops(ops)
    if static_graphs:  # the graph paths on CPU: static buffers, each forward run eagerly on replay
        runner.mixed_graphs = runner._mixed_graphs(use_cuda_graphs=False)
        runner.mixed_graphs.capture()
        runner.graphs = runner._decode_graphs(use_cuda_graphs=False)
        runner.graphs.capture()
    stats = {"no_samples": 0, "shared_rows": 0, "mixed_keys": []}
    execute = runner.execute

    def spy(step, table_of, token_mask=None):
        if not step.samples:
            stats["no_samples"] += 1
        if len(set(step.sample_sources)) < len(step.sample_sources):
            stats["shared_rows"] += 1
        graphs, key, _ = runner._plan(step)
        if graphs is runner.mixed_graphs and graphs is not None:
            stats["mixed_keys"].append(key)
        return execute(step, table_of, token_mask)

    runner.execute = spy
    for rid, prompt, params in reqs:
        core.add_request(EngineRequest(rid, prompt, params, 0.0))
    tokens, lps = {}, {}
    try:
        for _ in range(2000):
            if not core.has_work():
                break
            for u in core.step().updates:
                tokens.setdefault((u.request_id, u.index), []).extend(u.new_token_ids)
                lps.setdefault((u.request_id, u.index), []).extend(lp[0] for lp in u.logprobs or [])
    finally:
        model.set_decoder_ops("auto")
    stats["preemptions"] = core.scheduler.num_preemptions
    return tokens, lps, stats, core, refs


def check_against_dense(reqs, tokens, lps, refs, atol=1e-4):
    for rid, _, params in reqs:
        want, want_lps = refs[rid]
        for i in range(params.n):
            assert tokens[(rid, i)] == want, (rid, i)
            if params.logprobs is not None:
                assert lps[(rid, i)] == pytest.approx(want_lps, abs=atol), (rid, i)


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("static_graphs", [False, True])
def test_engine_tokens_equal_the_dense_forward(static_graphs, async_scheduling):
    """tiny, torch backend: a 20-token budget under 24 rows (mixed graphs of sizes 16 and 20, below the cap),
    12 blocks of 4 (preemption and resume), forks, logprobs, a prefix hit, chunks that stop short."""
    config = EngineConfig(model="tiny", device="cpu", dtype="float32", block_size=4, num_blocks=12,
                          max_num_seqs=24, max_num_batched_tokens=20, attention_backend="torch",
                          async_scheduling=async_scheduling)
    reqs = requests(250)
    tokens, lps, stats, core, refs = run_engine(config, reqs, static_graphs)
    check_against_dense(reqs, tokens, lps, refs)
    assert stats["no_samples"] > 0 and stats["shared_rows"] > 0 and stats["preemptions"] > 0
    if static_graphs:
        assert core.runner.mixed_graphs.sizes == [16, 20] and stats["mixed_keys"]


@pytest.mark.parametrize("arch,overrides", [
    ("qwen2", {"tie_word_embeddings": True}),  # qkv bias
    ("mistral", {"sliding_window": 5}),  # the window cuts into every longer prompt
])
@pytest.mark.parametrize("static_graphs", [False, True])
def test_checkpoint_engines_equal_the_dense_forward(tmp_path, arch, overrides, static_graphs):
    pytest.importorskip("transformers")
    from model_fixtures import hf_config, write_hf_checkpoint

    write_hf_checkpoint(tmp_path, hf_config(arch, **overrides))
    config = EngineConfig(model=str(tmp_path), device="cpu", dtype="float32", block_size=4, num_blocks=12,
                          max_num_seqs=24, max_num_batched_tokens=20, attention_backend="torch",
                          async_scheduling=False)
    reqs = requests(300, seed=1)
    tokens, lps, stats, _, refs = run_engine(config, reqs, static_graphs)
    check_against_dense(reqs, tokens, lps, refs)
    assert stats["no_samples"] > 0 and stats["shared_rows"] > 0


def test_a_mixed_graph_below_the_cap_holds_the_padded_logit_rows():
    """Budget 20 under 24 rows: 17 decodes and a fresh 3-token prompt replay the (20, 20) mixed graph, whose
    out rows are the padded count of its 20 possible samples (24, a count start-up warms: logit_counts),
    so the 18 logit rows' padding fits; every sample's logits equal the dense forward's."""
    from runner_chunks import Chunk, run_chunks

    from server.engine.runner import ModelRunner
    from server.model import load_model

    model, _ = load_model("tiny", "cpu", torch.float32)
    runner = ModelRunner(model, block_size=4, num_blocks=64, attention_backend="torch", max_num_seqs=24,
                         max_model_len=32, max_num_batched_tokens=20)
    runner.mixed_graphs = runner._mixed_graphs(use_cuda_graphs=False)
    runner.mixed_graphs.capture()
    gen = torch.Generator().manual_seed(11)
    seqs = [torch.randint(3, 250, (4,), generator=gen).tolist() for _ in range(18)]
    tables = [[1 + 2 * i, 2 + 2 * i] for i in range(18)]
    run_chunks(runner, [Chunk(s[:3], 0, t) for s, t in zip(seqs[:17], tables, strict=False)])  # eager
    chunks = [Chunk([s[3]], 3, t) for s, t in zip(seqs[:17], tables, strict=False)]
    chunks.append(Chunk(seqs[17][:3], 0, tables[17]))
    got = run_chunks(runner, chunks)
    assert runner.mixed_graphs.last_key == (20, 20)
    num_out = runner.mixed_graphs.layout((20, 20)).num_out
    assert num_out == 24 and num_out in runner.logit_counts and runner._padded_logit_count(18) <= num_out
    with torch.inference_mode():
        want = torch.stack([model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)))[-1:])[0]
                            for ids in [s[:4] for s in seqs[:17]] + [seqs[17][:3]]])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


# ---- tools that wrap the model's forward ------------------------------------------------------------------


class _FakeStream:
    def wait_stream(self, other) -> None:
        pass


@pytest.mark.skipif(not INTERPRET, reason="needs the Triton interpreter")
def test_l2_prefetch_probe_forward_runs_a_step(monkeypatch):
    """tools/l2_prefetch_probe swaps server.model.fused_forward.fused_forward (which LlamaForCausalLM.forward
    reads at each call) for its prefetching wrapper while it builds and captures its runners: a step through
    the wrapper (its CUDA streams and prefetch stubbed out on CPU) gives the shipped forward's logits."""
    pytest.importorskip("triton")
    from runner_chunks import Chunk, run_chunks

    import server.model.fused_forward as ff
    from server.engine.runner import ModelRunner
    from server.model import load_model
    from tools import l2_prefetch_probe as probe

    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: _FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(probe, "prefetch_weights", lambda layer, v: None)
    model, _ = load_model("tiny", "cpu", torch.float32)
    model.set_decoder_ops("fused")
    chunks = [Chunk([5, 6, 7], 0, [1]), Chunk([9], 0, [2])]
    runner = ModelRunner(model, block_size=4, num_blocks=8, attention_backend="triton", max_num_seqs=2,
                         max_model_len=16)
    want = run_chunks(runner, chunks)
    monkeypatch.setattr(ff, "fused_forward", probe.forward_with_prefetch(probe.VARIANTS[0], _FakeStream(),
                                                                         model.model.layers))
    runner = ModelRunner(model, block_size=4, num_blocks=8, attention_backend="triton", max_num_seqs=2,
                         max_model_len=16)
    torch.testing.assert_close(run_chunks(runner, chunks), want)
