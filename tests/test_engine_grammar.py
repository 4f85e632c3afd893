"""Structured outputs in the engine core (server/engine/grammar.py): whole engines token by token against a
dense greedy reference that masks the logits with its own llguidance matcher (async scheduling on and off,
eager and static-graph steps, preemption, n = 2 forks, guided and free requests in one batch); seeded
sampled choices whose every output matches the grammar; grammars that do not compile; aborts while a
grammar compiles; the sampler's bitmask against a dense mask."""

from __future__ import annotations

import ctypes
import gc
import itertools
import json
import re
import threading
import time
import traceback
import types

import llguidance
import pytest
import torch

from server.api.choice_stream import ChoiceStream
from server.engine import grammar as grammar_module
from server.engine.engine import EngineConfig, build_core
from server.engine.grammar import Grammars, widened
from server.engine.outputs import EngineRequest, SeqUpdate
from server.engine.sampler import GUIDED, Sampler, mask_tokens, row_fields, step_flags
from server.engine.sampling_params import SamplingParams
from server.model.tokenizer import ByteTokenizer
from tests.test_engine_out_rows import last_logits

EOS = ByteTokenizer.EOS
TOKENIZER = ByteTokenizer()
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "tag": {"enum": ["ab", "c"]}},
          "required": ["n", "tag"], "additionalProperties": False}
REGEX = "(yes|no): [a-d]{2,4}!"


def json_grammar(schema: dict) -> str:
    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})


def regex_grammar(regex: str) -> str:
    return llguidance.LLMatcher.grammar_from_regex(regex)


def config(async_scheduling: bool, num_blocks: int = 64, max_num_seqs: int = 6, device: str = "cpu"
           ) -> EngineConfig:
    return EngineConfig(model="tiny", device=device, dtype="float32", block_size=4, num_blocks=num_blocks,
                        max_num_seqs=max_num_seqs, max_num_batched_tokens=24,
                        attention_backend="torch" if device == "cpu" else "triton",
                        async_scheduling=async_scheduling)


def run(core, reqs, max_steps: int = 3000):
    """Add reqs [(rid, prompt, params)], step until idle -> ({(rid, index): tokens}, {(rid, index): (finish
    reason, error)})."""
    for rid, prompt, params in reqs:
        core.add_request(EngineRequest(rid, prompt, params, 0.0))
    tokens, ends = {}, {}
    for _ in range(max_steps):
        if not core.has_work():
            break
        for u in core.step().updates:
            tokens.setdefault((u.request_id, u.index), []).extend(u.new_token_ids)
            if u.finish_reason is not None:
                ends[(u.request_id, u.index)] = (u.finish_reason, u.error)
    assert not core.has_work()
    return tokens, ends


def dense_guided(model, vocab: llguidance.LLTokenizer, prompt: list[int], params: SamplingParams
                 ) -> list[int]:
    """Greedy through the contiguous forward, each step's logits masked by a matcher of its own; ends as the
    core ends a choice (EOS, the grammar complete, max_tokens)."""
    matcher = llguidance.LLMatcher(vocab, params.grammar, log_level=0) if params.grammar else None
    ids, out = list(prompt), []
    with torch.inference_mode():
        for _ in range(params.max_tokens):
            logits = last_logits(model, ids)
            if matcher is not None:
                allowed = torch.tensor(list(matcher.compute_bitmask()), dtype=torch.uint8)  # bit j of byte b
                bits = ((allowed[:, None] >> torch.arange(8, dtype=torch.uint8)) & 1).flatten()
                logits = logits.masked_fill(bits[:logits.numel()] == 0, float("-inf"))
            t = int(logits.argmax())
            ids.append(t)
            out.append(t)
            if matcher is not None:
                assert matcher.consume_token(t), matcher.get_error()
            if (t == EOS and not params.ignore_eos) or (matcher is not None and matcher.is_stopped()):
                break
    return out


def mixed_requests():
    gen = torch.Generator().manual_seed(3)
    reqs = []
    grammars = [json_grammar(SCHEMA), None, regex_grammar(REGEX), json_grammar(SCHEMA), None,
                regex_grammar("[x-z]+")]
    for i, grammar in enumerate(grammars):
        prompt = torch.randint(3, 250, (5 + 4 * i,), generator=gen).tolist()
        params = SamplingParams(max_tokens=24, temperature=0.0, n=2 if i in (2, 3) else 1, grammar=grammar)
        reqs.append((f"r{i}", prompt, params))
    return reqs


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("static_graphs", [False, True])
def test_engine_tokens_equal_the_dense_guided_reference(static_graphs, async_scheduling):
    core, _ = build_core(config(async_scheduling, num_blocks=20, max_num_seqs=5))  # small: preemptions
    if static_graphs:  # the graph paths on CPU: static buffers, each forward run eagerly on replay
        core.runner.mixed_graphs = core.runner._mixed_graphs(use_cuda_graphs=False)
        core.runner.mixed_graphs.capture()
        core.runner.graphs = core.runner._decode_graphs(use_cuda_graphs=False)
        core.runner.graphs.capture()
    check_against_dense_guided(core)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_gpu_engine_with_graphs_equals_the_dense_guided_reference(async_scheduling):
    """CUDA graphs and the Triton backend: guided decode-graph steps take the sampler's fp32 path, the
    bitmask crosses as a pinned copy, the sampling and argmax kernels draw over the masked logits."""
    core, _ = build_core(config(async_scheduling, num_blocks=20, max_num_seqs=5, device="cuda"))
    assert core.runner.graphs is not None
    check_against_dense_guided(core)
    assert core.runner.graphs.num_replays > 0


def check_against_dense_guided(core) -> None:
    reqs = mixed_requests()
    masks, ended_rows = core.grammars.masks, []

    # with async scheduling a choice ends while its next step runs: no mask
    def spy(matchers, costly=None, owners=None, lanes=None):
        ended_rows.append(matchers.count(None))
        return masks(matchers, costly, owners, lanes)

    core.grammars.masks = spy
    tokens, ends = run(core, reqs)
    assert (sum(ended_rows) > 0) == core.async_scheduling
    vocab = core.grammars._vocabulary()
    completed = 0
    for rid, prompt, params in reqs:
        want = dense_guided(core.runner.model, vocab, prompt, params)
        for i in range(params.n):
            assert tokens[(rid, i)] == want, (rid, i)
            assert ends[(rid, i)][1] is None
        text = TOKENIZER.decode(want)
        if params.grammar == json_grammar(SCHEMA) and ends[(rid, 0)][0] == "stop":
            value = json.loads(text)
            assert set(value) == {"n", "tag"} and value["tag"] in ("ab", "c")
            completed += 1
        if params.grammar == regex_grammar(REGEX) and ends[(rid, 0)][0] == "stop":
            assert re.fullmatch(REGEX, text)
            completed += 1
    assert completed >= 2  # some structured outputs ran to their end
    assert core.scheduler.num_preemptions > 0
    assert not core.requests and not core._guided and not core._compiling
    assert core.kv.num_free_blocks == core.kv.num_blocks - 1  # nothing leaked


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
def test_seeded_sampled_choices_keep_to_the_grammar(device):
    """On CUDA the sampling kernel draws over the masked rows."""
    core, _ = build_core(config(async_scheduling=True, device=device))
    regex = "[a-e]{3}-[0-9]{1,3}"
    reqs = [(f"s{i}", [1, 60 + i, 70], SamplingParams(max_tokens=16, temperature=1.3, top_p=0.95, seed=i, n=2,
                                                      grammar=regex_grammar(regex))) for i in range(4)]
    tokens, ends = run(core, reqs)
    for key, toks in tokens.items():
        assert ends[key] == ("stop", None)
        assert re.fullmatch(regex, TOKENIZER.decode(toks)), TOKENIZER.decode(toks)
    again, _ = run(build_core(config(async_scheduling=False, device=device))[0], reqs)
    assert again == tokens  # seeded: the same draws whatever the scheduling


def test_a_grammar_that_does_not_compile_fails_its_request_only():
    core, _ = build_core(config(async_scheduling=True))
    bad = regex_grammar("a(b")  # an unclosed group: only compiling it against the vocabulary finds out
    reqs = [("bad", [1, 70, 71], SamplingParams(max_tokens=8, temperature=0.0, grammar=bad, n=2)),
            ("ok", [1, 70, 71], SamplingParams(max_tokens=8, temperature=0.0, grammar=regex_grammar("ok")))]
    tokens, ends = run(core, reqs)
    for i in range(2):
        reason, error = ends[("bad", i)]
        assert reason == "error" and "does not compile" in error
        assert ("bad", i) not in tokens or tokens[("bad", i)] == []
    assert TOKENIZER.decode(tokens[("ok", 0)]) == "ok" and ends[("ok", 0)] == ("stop", None)
    assert not core.requests and core.kv.num_free_blocks == core.kv.num_blocks - 1


def test_an_abort_while_the_grammar_compiles_forgets_the_request():
    core, _ = build_core(config(async_scheduling=True))
    core.add_request(EngineRequest("g", [1, 70], SamplingParams(max_tokens=8, grammar=json_grammar(SCHEMA)),
                                   0.0))
    assert "g" in core._compiling
    updates = core.abort_request("g")
    assert [(u.index, u.finish_reason) for u in updates] == [(0, "abort")]
    assert not core.requests and not core._compiling and not core._guided and not core.has_work()
    core.step()  # the compile finishing later changes nothing
    assert not core.requests and not core.scheduler.waiting


def test_the_core_refuses_a_grammar_with_allowed_token_ids():
    core, _ = build_core(config(async_scheduling=False))
    params = SamplingParams(grammar=regex_grammar("a"), allowed_token_ids=[70])
    with pytest.raises(ValueError, match="allowed_token_ids cannot be combined"):
        core.add_request(EngineRequest("x", [1, 70], params, 0.0))
    assert not core.requests


def test_a_core_without_grammars_refuses_structured_outputs():
    core, _ = build_core(config(async_scheduling=False))
    core.grammars = None
    with pytest.raises(ValueError, match="structured outputs are unavailable"):
        core.add_request(EngineRequest("x", [1, 70], SamplingParams(grammar=regex_grammar("a")), 0.0))


class Unreadable:
    """A tokenizer llguidance has no vocabulary for."""


def test_the_mask_of_an_unreadable_tokenizer_fails_the_request():
    grammars = Grammars(Unreadable(), 300, {EOS})
    for _ in range(2):  # built once: the refusal is remembered
        with pytest.raises(ValueError, match="llguidance cannot read"):
            grammars.compile(regex_grammar("a")).result()


@pytest.mark.parametrize("vocab", [40, 64, 259])
def test_mask_tokens_equals_a_dense_mask(vocab):
    gen = torch.Generator().manual_seed(vocab)
    words = (vocab + 31) // 32
    bits = torch.randint(-2**31, 2**31, (3, words), generator=gen, dtype=torch.int64).to(torch.int32)
    logits = torch.randn(5, vocab, generator=gen)
    samples = torch.tensor([4, 0, 2])
    got = mask_tokens(logits, samples, bits)
    want = logits.clone()
    for g, s in enumerate(samples.tolist()):
        for t in range(vocab):
            if not (int(bits[g, t // 32]) >> (t % 32)) & 1:
                want[s, t] = float("-inf")
    assert torch.equal(got, want)
    assert torch.isfinite(logits).all()  # the input is left as it was (the raw logits give logprobs)


@pytest.mark.parametrize("kernel", [False, True])
def test_sampled_rows_draw_only_allowed_tokens(kernel):
    """The torch draw and the sampling kernel (the Triton interpreter on CPU) over masked rows."""
    vocab, rows = 64, 4
    sampler = Sampler(max_rows=rows, vocab_size=vocab, device=torch.device("cpu"), kernel=kernel)
    params = SamplingParams(temperature=1.0, top_p=0.9, grammar="x")
    f, i = row_fields(params, 5, 0)
    sampler.init_rows(torch.arange(rows), torch.tensor([f] * rows), torch.tensor([i] * rows))
    allowed = [3, 17, 40, 63]
    bits = torch.zeros(rows, 2, dtype=torch.int64)
    for t in allowed:
        bits[:, t // 32] |= 1 << (t % 32)
    bits = bits.to(torch.int32)  # bit 31 set: a negative int32 word
    gen = torch.Generator().manual_seed(0)
    flags = step_flags(params)
    assert flags & GUIDED
    for _ in range(6):
        logits = torch.randn(rows, vocab, generator=gen) * 3
        out = sampler(logits, torch.arange(rows), flags, token_mask=(torch.arange(rows), bits))
        assert set(out.token_ids.tolist()) <= set(allowed)


@pytest.mark.parametrize("guided", [False, True])
def test_the_api_keeps_a_grammars_last_token_and_drops_eos(guided):
    """A "stop" on a content token is a complete structured output (its text is output); EOS never is."""
    params = SamplingParams(grammar=regex_grammar("ab") if guided else None)
    a, b = TOKENIZER.encode("ab", add_bos=False)
    for last, text in ((b, "ab" if guided else "a"), (EOS, "a")):
        choice = ChoiceStream(0, params, TOKENIZER, TOKENIZER.token_text)
        delta, _ = choice.apply(SeqUpdate("r", 0, [a, last], None, "stop"))
        assert (delta.text, delta.finish_reason) == (text, "stop")


@pytest.mark.parametrize("threads", [None, 2])
def test_masks_cover_the_model_rows_past_the_tokenizer(threads, monkeypatch):
    """The bench preset's 128256-row embedding over the 259-id byte tokenizer: llguidance sees the tokenizer's
    ids alone, the rows past them are never allowed; the core's thread or an executor computes the masks."""
    grammars = Grammars(ByteTokenizer(600), 600, {EOS})
    if threads is not None:
        monkeypatch.setattr(Grammars, "_executor", llguidance.LLExecutor(threads))
        grammars.row_ms = 1.0  # rows costly enough for the executor
    matchers = [grammars.compile(regex_grammar("[a-c]+")).result() for _ in range(3)]
    grammars.accept(matchers[1], TOKENIZER.encode("b", add_bos=False)[0])
    bits = grammars.masks([matchers[0], matchers[1], None])
    assert bits.shape == (3, (ByteTokenizer.NUM_IDS + 31) // 32)
    bits = widened(bits, 600)
    logits = torch.zeros(3, 600)
    allowed = torch.isfinite(mask_tokens(logits, torch.arange(3), bits))
    abc = TOKENIZER.encode("abc", add_bos=False)
    assert allowed[0].nonzero().view(-1).tolist() == abc
    assert allowed[1].nonzero().view(-1).tolist() == sorted([*abc, EOS])  # the regex may end after "b"
    assert allowed[2, :ByteTokenizer.NUM_IDS].all() and not allowed[:, ByteTokenizer.NUM_IDS:].any()


def test_a_step_whose_guided_choices_all_just_ended_serves_its_free_rows():
    """Async scheduling: the guided choice ends at step N, already scheduled in N+1; its mask callback
    then has no live matcher, which llguidance's executor refuses ("No interpreters"): the batch failed,
    the free request with it (a review)."""
    core, _ = build_core(config(async_scheduling=True))
    core.grammars._executor = llguidance.LLExecutor(2)  # the path of hosts with 8 CPUs or more
    core.grammars.row_ms = 1.0  # and of costly rows
    reqs = [("free", [1, 70, 71, 72], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)),
            ("guided", [1, 80, 81], SamplingParams(max_tokens=12, temperature=0.0,
                                                   grammar=regex_grammar("ab")))]
    tokens, ends = run(core, reqs)
    assert ends[("guided", 0)] == ("stop", None) and TOKENIZER.decode(tokens[("guided", 0)]) == "ab"
    assert ends[("free", 0)] == ("length", None) and len(tokens[("free", 0)]) == 12


def test_compiles_of_aborted_requests_that_have_not_started_never_run():
    core, _ = build_core(config(async_scheduling=True))
    slow = json_grammar({"type": "object", "properties": {f"k{i}": {"type": "integer"} for i in range(400)}})
    for i in range(8):
        core.add_request(EngineRequest(f"slow{i}", [1, 70], SamplingParams(max_tokens=4, grammar=slow), 0.0))
    futures = list(core._compiling.values())
    for i in range(8):
        core.abort_request(f"slow{i}")  # the clients hung up
    assert sum(f.cancelled() for f in futures) >= 8 - 2  # 2 compile threads: at most 2 had started
    assert not core.requests and not core._compiling and not core._guided


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_choice_aborted_while_its_grammar_compiles_stays_aborted(async_scheduling):
    """n = 3: choice 1 aborted before the matchers are ready; its parent was in no scheduler list then, and
    the child was forked later all the same (a review)."""
    core, _ = build_core(config(async_scheduling))
    params = SamplingParams(n=3, grammar=regex_grammar("[a-c]{3,5}"), max_tokens=8, temperature=1.0, seed=2)
    core.add_request(EngineRequest("r", [1, 70, 71, 72, 73], params, 0.0))
    updates = core.abort_request("r", 1)
    assert [(u.index, u.finish_reason) for u in updates] == [(1, "abort")]
    tokens, ends = run(core, [])
    assert ("r", 1) not in tokens and set(ends) == {("r", 0), ("r", 2)}
    assert not core.requests and core.kv.num_free_blocks == core.kv.num_blocks - 1


class CountedCompiles:
    """Grammars._matcher counted, and held at a gate for the grammars in `held` until it opens."""

    def __init__(self, monkeypatch, held=()):
        self.count: dict[str, int] = {}
        self.held, self.gate = set(held), threading.Event()
        compile_ = Grammars._matcher

        def matcher(grammars, grammar):
            self.count[grammar] = self.count.get(grammar, 0) + 1
            if grammar in self.held:
                self.gate.wait(10)
            return compile_(grammars, grammar)

        monkeypatch.setattr(Grammars, "_matcher", matcher)


def test_a_grammar_compiles_once_and_each_request_gets_a_matcher_of_its_own(monkeypatch):
    compiles = CountedCompiles(monkeypatch)
    grammars = Grammars(TOKENIZER, 300, {EOS})
    grammar = regex_grammar("(ab|ac)d")
    first, second = (grammars.compile(grammar).result() for _ in range(2))
    assert compiles.count == {grammar: 1} and first is not second
    a = TOKENIZER.encode("a", add_bos=False)[0]
    grammars.accept(first, a)  # advancing one leaves the other (and the kept one) at the start
    bits = grammars.masks([first, second, grammars.compile(grammar).result()])
    allowed = torch.isfinite(mask_tokens(torch.zeros(3, 300), torch.arange(3), widened(bits, 300)))
    assert allowed[0].nonzero().view(-1).tolist() == TOKENIZER.encode("bc", add_bos=False)
    assert allowed[1].nonzero().view(-1).tolist() == allowed[2].nonzero().view(-1).tolist() == [a]
    assert compiles.count == {grammar: 1}


def test_requests_that_ask_while_a_grammar_compiles_share_its_compile(monkeypatch):
    grammar = json_grammar(SCHEMA)
    compiles = CountedCompiles(monkeypatch, held=[grammar])
    grammars = Grammars(TOKENIZER, 300, {EOS})
    futures = [grammars.compile(grammar) for _ in range(5)]
    assert not any(f.done() for f in futures)
    compiles.gate.set()
    matchers = [f.result(10) for f in futures]
    assert len({id(m) for m in matchers}) == 5 and compiles.count == {grammar: 1}


def test_a_grammar_that_failed_fails_again_without_compiling(monkeypatch):
    compiles = CountedCompiles(monkeypatch)
    grammars = Grammars(TOKENIZER, 300, {EOS})
    bad = regex_grammar("a(b")
    for _ in range(3):
        with pytest.raises(ValueError, match="does not compile"):
            grammars.compile(bad).result()
    assert compiles.count == {bad: 1}


def test_the_kept_compiles_are_bounded_least_recently_asked_first(monkeypatch):
    compiles = CountedCompiles(monkeypatch)
    monkeypatch.setattr(grammar_module, "CACHED_GRAMMARS", 2)
    grammars = Grammars(TOKENIZER, 300, {EOS})
    a, b, c = (regex_grammar(r) for r in ("a+", "b+", "c+"))
    for grammar in (a, b, a, c, a, b):  # c evicts b (a was asked after b), then b evicts c
        grammars.compile(grammar).result()
    assert compiles.count == {a: 1, b: 2, c: 1} and [g for _, g in grammars._compiled] == [a, b]
    monkeypatch.setattr(grammar_module, "CACHED_GRAMMAR_CHARS", len(a) + len(b) - 1)
    grammars.compile(c).result()  # over the text bound: only the newest stays
    assert [g for _, g in grammars._compiled] == [c] and grammars._compiled_chars == len(c)


def test_a_compile_every_asker_dropped_before_it_started_never_runs(monkeypatch):
    busy = [regex_grammar(f"busy{i}") for i in range(2)]  # hold both compile threads
    compiles = CountedCompiles(monkeypatch, held=busy)
    grammars = Grammars(TOKENIZER, 300, {EOS})
    running = [grammars.compile(grammar) for grammar in busy]
    dropped, kept = regex_grammar("x+"), regex_grammar("y+")
    askers = [grammars.compile(dropped) for _ in range(3)]
    wanted = [grammars.compile(kept), grammars.compile(kept)]
    assert all(f.cancel() for f in askers) and wanted[0].cancel()  # one asker of `kept` stays
    compiles.gate.set()
    for f in [*running, wanted[1]]:
        f.result(10)
    grammars._small_compiles.shutdown(wait=True)
    assert dropped not in compiles.count and compiles.count[kept] == 1
    assert (None, dropped) not in grammars._compiled and (None, kept) in grammars._compiled


def test_the_kept_compile_holds_no_requests_matcher(monkeypatch):
    """The matchers of the requests that asked while the grammar compiled advance through whole replies: the
    kept compile must not reference them (a Future keeps its done callbacks; a review)."""
    grammar = regex_grammar("a+")
    compiles = CountedCompiles(monkeypatch, held=[grammar])
    grammars = Grammars(TOKENIZER, 300, {EOS})
    future = grammars.compile(grammar)
    compiles.gate.set()
    matcher = future.result(10)
    del future
    gc.collect()
    assert not [r for r in gc.get_referrers(matcher) if not isinstance(r, types.FrameType)]


def test_a_kept_failure_raises_an_error_of_its_own_for_each_request():
    """Raising one kept exception for every request grew its traceback by each raiser's frames (a review)."""
    grammars = Grammars(TOKENIZER, 300, {EOS})
    bad = regex_grammar("a(b")
    errors = []
    for _ in range(20):
        with pytest.raises(ValueError, match="does not compile") as caught:
            grammars.compile(bad).result()
        errors.append(caught.value)
    assert len({id(e) for e in errors}) == 20 and len(traceback.extract_tb(errors[-1].__traceback__)) < 10


class CountedExecutor:
    """An LLExecutor that counts its steps and notes the order of each step's rows."""

    def __init__(self):
        self.executor, self.steps, self.orders = llguidance.LLExecutor(2), 0, []

    def unsafe_compute_mask_ptr(self, rows, *args):
        self.steps += 1
        self.orders.append([g for _, g in rows])
        return self.executor.unsafe_compute_mask_ptr(rows, *args)


def test_cheap_masks_stay_on_the_cores_thread_and_costly_ones_go_to_the_executor(monkeypatch):
    executor = CountedExecutor()
    monkeypatch.setattr(Grammars, "_executor", executor)
    grammars = Grammars(TOKENIZER, 300, {EOS})
    matchers = [grammars.compile(regex_grammar("[a-c]+")).result() for _ in range(3)]
    want = grammars.masks(matchers)  # the first step measures a row on the core's thread
    assert executor.steps == 0 and 0 < grammars.row_ms < grammar_module.PARALLEL_MASKS_MS / 3
    for _ in range(5):
        assert torch.equal(grammars.masks(matchers), want)
    assert executor.steps == 0  # 3 rows of ~a few us: the core's thread
    monkeypatch.setattr(grammar_module, "PARALLEL_MASKS_MS", 0.0)  # every row now worth the executor
    measured = []
    for _ in range(5):
        before = grammars.row_ms
        assert torch.equal(grammars.masks(matchers), want)
        measured.append(grammars.row_ms != before)
    assert executor.steps == 5 and all(measured)  # its steps measure row_ms too (by their wall)
    assert not grammars.masks([None, None]).eq(0).all()  # no live matcher: no executor call (it refuses [])
    assert executor.steps == 5


def test_a_kept_compile_serves_a_bounded_number_of_requests(monkeypatch):
    """Copies share the compiled matcher's lexer, which grows with what each explores (a review)."""
    compiles = CountedCompiles(monkeypatch)
    grammars = Grammars(TOKENIZER, 300, {EOS})
    grammar = regex_grammar("[ab]*a[ab]{3}")
    for _ in range(grammar_module.COPIES_PER_COMPILE + 1):
        grammars.compile(grammar).result()
    assert compiles.count == {grammar: 2} and len(grammars._compiled) == 1
    assert grammars._compiled_chars == len(grammar)
    held = regex_grammar("[ab]*b[ab]{3}")
    compiles.held.add(held)  # a burst's askers share a compile still running, however many they are
    burst = [grammars.compile(held) for _ in range(3 * grammar_module.COPIES_PER_COMPILE)]
    compiles.gate.set()
    assert all(f.result(10) for f in burst) and compiles.count[held] == 1


def test_a_choice_whose_grammar_fails_drops_its_compile(monkeypatch):
    """A parser or lexer limit reached mid-stream (perhaps by the copies' shared lexer) fails the request, and
    its grammar's next request compiles afresh."""
    core, _ = build_core(config(async_scheduling=True))
    grammar = regex_grammar("[a-c]+")
    accept = Grammars.accept

    def failing(matcher, token):
        if failing.calls == 1:
            raise grammar_module.GrammarError("lexer error: too many states")
        failing.calls += 1
        return accept(matcher, token)

    failing.calls = 0
    core.grammars.accept = failing
    reqs = [("g", [1, 70, 71], SamplingParams(max_tokens=8, temperature=0.0, grammar=grammar))]
    tokens, ends = run(core, reqs)
    assert ends[("g", 0)][0] == "error" and "too many states" in ends[("g", 0)][1]
    assert (None, grammar) not in core.grammars._compiled and core.grammars._compiled_chars == 0
    assert not core.requests and core.kv.num_free_blocks == core.kv.num_blocks - 1


def test_rows_over_the_time_limit_are_reported(monkeypatch):
    grammars = Grammars(TOKENIZER, 300, {EOS})
    matchers = [grammars.compile(regex_grammar("[a-c]+")).result() for _ in range(2)]
    costly: list = []
    grammars.masks(matchers, costly)
    assert costly == []  # a few us a row
    monkeypatch.setattr(grammar_module, "MAX_TOKEN_MS", 0.0)
    grammars.masks([matchers[0], None, matchers[1]], costly)
    assert [g for g, _ in costly] == [0, 2] and all(ms > 0 for _, ms in costly)


def test_the_steps_after_an_executor_step_over_the_time_limit_are_timed_row_by_row(monkeypatch):
    """The executor's step tells no row's time, and a matcher keeps its mask until its next token (computed
    again it reads back in microseconds: a review found nothing ever struck that way): the next
    TIMED_AFTER_SLOW_STEP steps' rows are timed, each on the core's thread, then the executor takes over."""
    monkeypatch.setattr(grammar_module, "TIMED_AFTER_SLOW_STEP", 2)
    executor = CountedExecutor()
    monkeypatch.setattr(Grammars, "_executor", executor)
    monkeypatch.setattr(Grammars, "_mask_threads", 2)
    monkeypatch.setattr(grammar_module, "PARALLEL_MASKS_MS", 0.0)
    grammars = Grammars(TOKENIZER, 300, {EOS})
    grammars.row_ms = 1.0
    matchers = [grammars.compile(regex_grammar("[a-c]+")).result() for _ in range(2)]
    want = grammars.masks(matchers)
    assert executor.steps == 1
    monkeypatch.setattr(grammar_module, "MAX_TOKEN_MS", 0.0)  # every step and row "too long" now
    costly: list = []
    assert torch.equal(grammars.masks(matchers, costly), want) and costly == []  # over: the next is timed
    assert torch.equal(grammars.masks(matchers, costly), want)
    assert executor.steps == 2 and sorted(g for g, _ in costly) == [0, 1]
    grammars.masks(matchers, costly)
    assert executor.steps == 2 and sorted(g for g, _ in costly[2:]) == [0, 1]  # the second timed step
    grammars.masks(matchers, costly)
    assert executor.steps == 3


def test_copies_of_one_compile_stay_on_the_cores_thread(monkeypatch):
    """The executor takes a costly step only where no compile's copies hold over half its rows, and gets
    each compile's rows in a block (copies share a lexer: on an H100 host the executor took 3.3 ms over 256
    copies of one compile, 1.5 over copies of 4 in blocks, where this thread took 1.8-2.5); a step the
    core's thread takes has each row timed."""
    executor = CountedExecutor()
    monkeypatch.setattr(Grammars, "_executor", executor)
    monkeypatch.setattr(grammar_module, "PARALLEL_MASKS_MS", 0.0)
    grammars = Grammars(TOKENIZER, 300, {EOS})
    grammars.row_ms = 1.0
    matchers = [grammars.compile(regex_grammar("[a-c]+")).result() for _ in range(4)]
    owners = ["a", "b", "c", "d"]
    want = grammars.masks(matchers, [], owners, [1, 1, 1, 2])
    assert executor.steps == 0  # compile 1's three copies of four rows
    monkeypatch.setattr(grammar_module, "MAX_TOKEN_MS", 0.0)  # every row "too long" now: timed, reported
    costly: list = []
    assert torch.equal(grammars.masks(matchers, costly, owners, [1, 1, 1, 2]), want)
    assert executor.steps == 0 and sorted(g for g, _ in costly) == [0, 1, 2, 3]
    monkeypatch.setattr(grammar_module, "MAX_TOKEN_MS", 1e9)
    assert torch.equal(grammars.masks(matchers, [], owners, [1, 2, 1, 2]), want)
    assert executor.orders == [[0, 2, 1, 3]]  # two compiles of two rows each, each in a block


class SlowEvery:
    """A guided row whose every k-th mask takes `ms` (a slow spot its grammar meets again and again)."""

    def __init__(self, k: int, ms: float):
        self.k, self.ms, self.calls = k, ms, 0

    def unsafe_compute_mask_ptr(self, address: int, nbytes: int) -> None:
        self.calls += 1
        if self.calls % self.k == 0:
            time.sleep(self.ms / 1e3)


class SerialExecutor:
    """An executor that computes its rows one after another on the calling thread (for rows of our own)."""

    def __init__(self):
        self.steps = 0

    def unsafe_compute_mask_ptr(self, rows, address, nbytes, count) -> None:
        self.steps += 1
        for matcher, g in rows:
            matcher.unsafe_compute_mask_ptr(address + g * nbytes, nbytes)


def test_a_slow_spot_between_cheap_tokens_is_struck_on_an_executor_host(monkeypatch):
    """A grammar slow at every 4th token, beside other grammars: the executor's slow step names no row, and
    timing only the step after it (a cheap one) never struck it (a review); the steps after it are timed,
    and its next slow tokens are reported, twice within STRIKE_WINDOW tokens. Slow is 120 ms against a
    budget of 100 (a sleep is never short); a cheap step, microseconds, stays under it unless descheduled
    100 ms (it was 40 against 30 ms)."""
    executor = SerialExecutor()
    monkeypatch.setattr(Grammars, "_executor", executor)
    monkeypatch.setattr(grammar_module, "PARALLEL_MASKS_MS", 0.0)
    monkeypatch.setattr(grammar_module, "MAX_TOKEN_MS", 100.0)
    grammars = Grammars(TOKENIZER, 300, {EOS})
    grammars.row_ms = 1.0
    rows = [SlowEvery(4, 120.0), SlowEvery(10**6, 0.0), SlowEvery(10**6, 0.0)]
    reported = []
    for step in range(1, 13):
        costly: list = []
        grammars.masks(rows, costly, ["slow", "b", "c"], [1, 2, 3])
        reported += [step for g, _ in costly if g == 0]
    assert executor.steps == 4 and reported == [8, 12], reported  # steps 1-4 on the executor (4: slow)


class SleepingRow:
    """A guided row whose mask takes `ms` (a sleep: it lets go of the GIL, as llguidance's masks do), noting
    how many rows of its lane (`active`, shared) run at once, at most."""

    def __init__(self, ms: float, active: dict):
        self.ms, self.active = ms, active

    def unsafe_compute_mask_ptr(self, address: int, nbytes: int) -> None:
        with self.active["lock"]:
            self.active["now"] += 1
            self.active["most"] = max(self.active["most"], self.active["now"])
        time.sleep(self.ms / 1e3)
        with self.active["lock"]:
            self.active["now"] -= 1


def test_a_costly_step_the_executor_refuses_runs_its_lanes_on_threads(monkeypatch):
    """Six requests of one grammar (one lane: the executor refuses the step) beside five of other grammars:
    the lanes run on the mask threads, the popular one in turn, as the budget reads the step (6 rows, none
    struck); in turn on the core's thread, 11 rows, it held every step 55 ms of the real 50 ms budget, none
    struck (a review). Here 50 ms rows against a budget of 500 (MAX_TOKEN_MS and COSTLY_ROW_MS x10): 300 ms
    as it runs, 550 in turn, so each of the lane's six sleeps may wake 33 ms late. (8 ms rows, 48 of 50 ms,
    failed once in CI: one sleep woke 4 ms late on the loaded 2-core box; 5 ms rows, 30 of 50, had rows of
    12-15 ms struck in 3 of 11 runs beside 3 busy processes.)"""
    monkeypatch.setattr(Grammars, "_executor", CountedExecutor())
    monkeypatch.setattr(Grammars, "_mask_threads", 4)
    monkeypatch.setattr(grammar_module, "MAX_TOKEN_MS", 10 * grammar_module.MAX_TOKEN_MS)
    monkeypatch.setattr(grammar_module, "COSTLY_ROW_MS", 10 * grammar_module.COSTLY_ROW_MS)
    grammars = Grammars(TOKENIZER, 300, {EOS})
    grammars.row_ms = 50.0
    popular, others = ({"lock": threading.Lock(), "now": 0, "most": 0} for _ in range(2))
    rows = [SleepingRow(50.0, popular) for _ in range(6)] + [SleepingRow(50.0, others) for _ in range(5)]
    costly: list = []
    grammars.masks(rows, costly, [f"r{g}" for g in range(11)], [1] * 6 + [2, 3, 4, 5, 6])
    assert grammars._executor.steps == 0 and costly == []
    assert popular["most"] == 1 and others["most"] > 1  # the popular lane in turn, the others beside it


class RaisingRow:
    def unsafe_compute_mask_ptr(self, address: int, nbytes: int) -> None:
        raise RuntimeError("a mask failed")


def test_no_mask_runs_on_after_a_timed_step_fails(monkeypatch):
    """Where one lane's mask raises, masks() leaves only once the other lanes' threads are done: they write
    into the step's bits, freed once it returns (a review found 3 of 3 still running)."""
    monkeypatch.setattr(Grammars, "_executor", CountedExecutor())
    monkeypatch.setattr(Grammars, "_mask_threads", 4)
    grammars = Grammars(TOKENIZER, 300, {EOS})
    grammars._timed_steps = 1  # after an executor step over the limit
    ends: list[float] = []

    class TimedRow(SleepingRow):
        def unsafe_compute_mask_ptr(self, address: int, nbytes: int) -> None:
            super().unsafe_compute_mask_ptr(address, nbytes)
            ends.append(time.perf_counter())

    lane = {"lock": threading.Lock(), "now": 0, "most": 0}
    with pytest.raises(RuntimeError, match="a mask failed"):
        grammars.masks([RaisingRow(), *(TimedRow(300.0, lane) for _ in range(3))], [], None, [1, 2, 3, 4])
    returned = time.perf_counter()
    time.sleep(0.4)
    assert len(ends) == 3 and max(ends) <= returned and lane["most"] > 1


def test_the_measured_row_cost_follows_each_steps_rows(monkeypatch):
    """A row over the limit is left out of row_ms, which moves towards a step's mean row at once (a review:
    capped at 4x a step, 8 steps of 20 ms rows ran in turn before the executor took them); the executor's
    steps measure it too, by their wall over the rows they spread (another: measured once in 64 executor
    steps, one slow step kept cheap rows on the executor for ~700 steps). The executor's step sleeps 30 ms,
    which a loaded box may overshoot but never undercut: row_ms lies from the 30 ms step's reading to that of
    a step 60 ms later (a 4 ms step, within 30% of its reading, failed 5 runs of 11 beside 3 busy
    processes: 8 ms read)."""
    grammars = Grammars(TOKENIZER, 300, {EOS})
    matchers = [grammars.compile(regex_grammar("[a-c]+")).result() for _ in range(4)]
    grammars.masks(matchers)
    first = grammars.row_ms
    monkeypatch.setattr(grammar_module, "MAX_TOKEN_MS", 0.0)
    grammars.masks(matchers, [])  # every row over the limit: none measured
    assert grammars.row_ms == first
    monkeypatch.setattr(grammar_module, "MAX_TOKEN_MS", 50.0)
    took = iter([20.0] * 4)  # a step of 20 ms rows
    monkeypatch.setattr(grammar_module, "_mask_ms", lambda call: next(took))
    grammars.masks(matchers)
    weight = grammar_module.ROW_COST_WEIGHT
    assert grammars.row_ms == pytest.approx(first + weight * (20.0 - first))
    grammars._executor, grammars._mask_threads = SleepingExecutor(30.0), 4  # (the instance's cached ones)
    before = grammars.row_ms
    grammars.masks(matchers)  # 4 rows x row_ms over PARALLEL_MASKS_MS, 4 lanes: the executor's step, 30 ms
    least = before + weight * (30.0 * 4 / 4 - before)  # its wall x 4 threads / 4 rows (~9.2 from ~4.0)
    assert least - 1e-9 <= grammars.row_ms <= least + weight * 60.0, (before, grammars.row_ms)


class SleepingExecutor:
    """An executor whose step over any rows takes `ms`."""

    def __init__(self, ms: float):
        self.ms = ms

    def unsafe_compute_mask_ptr(self, rows, address, nbytes, count) -> None:
        time.sleep(self.ms / 1e3)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_grammar_over_the_time_limit_fails_its_request_alone(monkeypatch, async_scheduling):
    core, _ = build_core(config(async_scheduling))
    monkeypatch.setattr(grammar_module, "MAX_TOKEN_MS", 0.0)
    reqs = [("free", [1, 70, 71, 72], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)),
            ("guided", [1, 80, 81], SamplingParams(max_tokens=6, temperature=0.0, n=2,
                                                   grammar=regex_grammar("[a-c]+")))]
    tokens, ends = run(core, reqs)
    assert ends[("free", 0)] == ("length", None) and len(tokens[("free", 0)]) == 6
    for i in range(2):
        reason, error = ends[("guided", i)]
        assert reason == "error" and "ms over one token" in error
    assert not core.requests and not core._too_costly and core.kv.num_free_blocks == core.kv.num_blocks - 1


def test_a_small_grammar_does_not_wait_behind_large_compiles(monkeypatch):
    large = [json_grammar({"type": "object", "properties": {f"k{j}_{i}": {"type": "integer"}
                                                            for i in range(400)}}) for j in range(3)]
    assert all(len(g) > grammar_module.SMALL_GRAMMAR_CHARS for g in large)
    compiles = CountedCompiles(monkeypatch, held=large)  # the large compiles wait at the gate
    grammars = Grammars(TOKENIZER, 300, {EOS})
    waiting = [grammars.compile(g) for g in large]
    small = grammars.compile(regex_grammar("[a-c]+")).result(10)  # its own lane
    assert small is not None and not any(f.done() for f in waiting)
    compiles.gate.set()
    assert all(f.result(30) for f in waiting)


def test_one_token_over_the_time_limit_is_forgiven(monkeypatch):
    """One slow token may be the host's (the core's thread descheduled): a choice fails at its second."""
    core, _ = build_core(config(async_scheduling=True))
    masks = core.grammars.masks

    def once_costly(matchers, costly=None, owners=None, lanes=None):
        bits = masks(matchers, costly, owners, lanes)
        if costly is not None and not once_costly.done:
            costly.append((0, 80.0))
            once_costly.done = True
        return bits

    once_costly.done = False
    core.grammars.masks = once_costly
    reqs = [("g", [1, 80, 81], SamplingParams(max_tokens=6, temperature=0.0, grammar=regex_grammar("ab")))]
    tokens, ends = run(core, reqs)
    assert once_costly.done and ends[("g", 0)] == ("stop", None)
    assert TOKENIZER.decode(tokens[("g", 0)]) == "ab"
    assert not core._strikes and not core._too_costly


def test_each_choice_has_its_own_strikes(monkeypatch):
    """n = 2 choices take their first token from the grammar's start in one step: one slow token each is
    each one's first strike, not the request's second (a review)."""
    core, _ = build_core(config(async_scheduling=True))
    masks = core.grammars.masks

    def first_step_costly(matchers, costly=None, owners=None, lanes=None):
        bits = masks(matchers, costly, owners, lanes)
        if costly is not None and not first_step_costly.done:
            costly.extend((g, 80.0) for g, m in enumerate(matchers) if m is not None)
            first_step_costly.done = True
        return bits

    first_step_costly.done = False
    core.grammars.masks = first_step_costly
    params = SamplingParams(max_tokens=6, temperature=0.0, n=2, grammar=regex_grammar("ab"))
    tokens, ends = run(core, [("g", [1, 80, 81], params)])
    assert first_step_costly.done and ends == {("g", 0): ("stop", None), ("g", 1): ("stop", None)}
    assert not core._strikes and not core._too_costly


def slow_masks_at(core, outputs: set[int]) -> list[int]:
    """Report the mask of one guided choice over MAX_TOKEN_MS at its output tokens `outputs` (0-based: its
    k-th mask is its k-th token's) -> the outputs struck so far."""
    masks = core.grammars.masks
    struck: list[int] = []
    counted = itertools.count()

    def slow_at(matchers, costly=None, owners=None, lanes=None):
        bits = masks(matchers, costly, owners, lanes)
        if costly is not None and matchers[0] is not None:
            k = next(counted)
            if k in outputs:
                costly.append((0, 80.0))
                struck.append(k)
        return bits

    core.grammars.masks = slow_at
    return struck


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_slow_tokens_a_window_apart_are_forgiven(async_scheduling):
    """Two host hiccups far apart in a long reply are no costly grammar: a strike expires after STRIKE_WINDOW
    tokens of the choice (a review)."""
    core, _ = build_core(config(async_scheduling))
    window = grammar_module.STRIKE_WINDOW
    struck = slow_masks_at(core, {2, 2 + window})  # the second is the first's window's next token
    length = window + 8
    params = SamplingParams(max_tokens=length, temperature=0.0, grammar=regex_grammar(f"[a-c]{{{length}}}"))
    tokens, ends = run(core, [("g", [1, 80, 81], params)])
    assert struck == [2, 2 + window] and ends[("g", 0)] == ("stop", None)
    assert re.fullmatch(f"[a-c]{{{length}}}", TOKENIZER.decode(tokens[("g", 0)]))
    assert not core._strikes and not core._too_costly


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_slow_tokens_within_a_window_fail_the_choice(async_scheduling):
    """A struck token counts for STRIKE_WINDOW tokens of its choice: the third slow token, the last of the
    second's window, fails it (the first has expired)."""
    core, _ = build_core(config(async_scheduling))
    window = grammar_module.STRIKE_WINDOW
    last = 2 * window  # 1 + window + (window - 1)
    struck = slow_masks_at(core, {1, 1 + window, last})
    length = last + 8
    params = SamplingParams(max_tokens=length, temperature=0.0, grammar=regex_grammar(f"[a-c]{{{length}}}"))
    tokens, ends = run(core, [("g", [1, 80, 81], params)])
    reason, error = ends[("g", 0)]
    assert struck == [1, 1 + window, last] and reason == "error" and "ms over one token" in error
    assert len(tokens[("g", 0)]) == last  # those before its last strike; that one fails it
    assert not core.requests and not core._strikes and not core._too_costly


class SleepingMatcher:
    """A matcher whose every mask takes `ms` and allows every token (what Grammars.masks times)."""

    def __init__(self, ms: float) -> None:
        self.ms = ms

    def unsafe_compute_mask_ptr(self, ptr: int, nbytes: int) -> None:
        time.sleep(self.ms / 1e3)
        ctypes.memset(ptr, 0xFF, nbytes)


def test_a_step_over_its_budget_strikes_its_costliest_rows(monkeypatch):
    """Three rows of 120 ms each (under MAX_TOKEN_MS alone, 360 ms in all) beside cheap ones: the step
    strikes the costliest until the rest fit in MAX_TOKEN_MS; cheap rows are never struck. Ten requests of
    a 45 ms grammar made every step 450 ms before. The budget is 200 ms here (MAX_TOKEN_MS and COSTLY_ROW_MS
    x4): two strikes need rows over 100 ms, which a sleep of 120 guarantees, and the row kept may wake 80 ms
    late (30 ms rows against the real 50 left it 20)."""
    monkeypatch.setattr(grammar_module, "MAX_TOKEN_MS", 4 * grammar_module.MAX_TOKEN_MS)
    monkeypatch.setattr(grammar_module, "COSTLY_ROW_MS", 4 * grammar_module.COSTLY_ROW_MS)
    grammars = Grammars(ByteTokenizer(), ByteTokenizer.NUM_IDS, {EOS})
    cheap = [grammars.compile(regex_grammar("[a-c]+")).result() for _ in range(4)]
    costly: list[tuple[int, float]] = []
    grammars.masks([cheap[0], SleepingMatcher(120), cheap[1], SleepingMatcher(120), SleepingMatcher(120),
                    cheap[2], None, cheap[3]], costly)
    assert len(costly) == 2 and {g for g, _ in costly} < {1, 3, 4}, costly
    assert all(ms >= 120 for _, ms in costly)


def test_the_struck_rows_of_a_step():
    limit = grammar_module.MAX_TOKEN_MS
    assert grammar_module.struck_rows([(limit + 1, 0), (0.01, 1)]) == [(0, limit + 1)]  # over alone
    assert grammar_module.struck_rows([(45.0, 0), (45.0, 1), (0.01, 2)]) == [(1, 45.0)]  # costliest first
    many_cheap = [(0.9, g) for g in range(100)]  # 90 ms of rows under COSTLY_ROW_MS: slow, not costly
    assert grammar_module.struck_rows(many_cheap) == []
    assert grammar_module.struck_rows([(20.0, 0), (20.0, 1), (5.0, 2)]) == []  # 45 ms in all: within
    # the cheap rows alone are over the budget: striking the costly ones cannot fit it (a review: a 1.5 ms
    # row beside 54 ms of cheap ones was struck every step)
    assert grammar_module.struck_rows([(0.9, g) for g in range(60)] + [(10.0, 60)]) == []
    # on the executor: the rows as it takes them, each whole on one of its threads, not their serial sum (a
    # review: 16 rows of 15 ms on 4 threads, 60 ms of wall time, had 13 struck; 12 rows take 45 ms)
    rows = [(15.0, g) for g in range(16)]
    assert len(grammar_module.struck_rows(rows, threads=4)) == 4
    assert len(grammar_module.struck_rows(rows)) == 13


def test_a_cheap_request_is_not_struck_for_a_costly_row_beside_it():
    """A row over MAX_TOKEN_MS alone makes an executor step's wall (a row runs on one thread): the others
    count at 1 / threads of their serial ms, not at the step's ratio (a review: 40 rows of 2 ms struck
    beside one of 200 ms, at its 0.71)."""
    many = [(2.0, g) for g in range(1, 41)]  # 40 requests of a 2 ms row
    assert grammar_module.struck_rows(many, list(range(41)), threads=4) == []
    rows = [(200.0, 0)] + many  # request 0: one 200 ms row, the whole wall of the step
    assert grammar_module.struck_rows(rows, list(range(41)), threads=4) == [(0, 200.0)]


def test_rows_struck_alone_are_struck_beside_a_costly_row():
    """Each row runs whole on one thread: five rows of 40 ms take 80 ms on 4 threads, four of them 40 ms;
    beside a row over the limit as alone (a review: at an ideal 1 / threads, 50 ms, none of them was struck
    there; by the step's ratio, two where one fits)."""
    five = [(40.0, g) for g in range(1, 6)]  # five requests, one 40 ms row each
    alone = {g for g, _ in grammar_module.struck_rows(five, threads=4)}
    assert len(alone) == 1, alone
    beside = {g for g, _ in grammar_module.struck_rows([(51.0, 0)] + five, threads=4)}
    assert beside == alone | {0}, (alone, beside)


def test_rows_on_the_cores_thread_count_as_the_executor_would_take_them():
    """A step the core's thread took (its measured row cost behind the traffic) while an executor idles
    counts its rows as the executor would take them: 16 requests of a 10 ms row, 40 ms on 4 threads,
    strike nobody (a review: a request failed for the core's choice of path); a request's own rows count
    one after another (its choices share one compiled matcher's lexer, which llguidance computes in turn)."""
    sixteen = [(10.0, g) for g in range(16)]
    assert grammar_module.struck_rows(sixteen, list(range(16)), threads=4) == []
    assert len(grammar_module.struck_rows(sixteen, list(range(16)), threads=1)) == 11  # no executor
    assert len(grammar_module.struck_rows(sixteen, ["r"] * 16, threads=4)) == 16  # one request


def test_a_costly_request_beside_cheap_rows_is_struck_where_they_alone_fit():
    """A 49 ms request beside 40 rows of 4.9 ms on 4 threads: ~64 ms a step; the cheap rows alone take
    49 ms, so the costly one is struck, on the core's thread and on the executor alike (a review: judged by
    the step's ratio, the cheap rows read 51 ms and nothing was ever struck)."""
    rows = [(49.0, 0)] + [(4.9, g) for g in range(1, 41)]
    assert grammar_module.struck_rows(rows, threads=4) == [(0, 49.0)]


def test_no_more_requests_are_struck_than_the_step_needs():
    """Five 45 ms rows on 4 threads take 90 ms; with one struck, 45 (a review: three struck, two of them
    for the fifth's cost), beside a row over the limit too."""
    five = [(45.0, g) for g in range(5)]
    assert len(grammar_module.struck_rows(five, threads=4)) == 1
    struck = {g for g, _ in grammar_module.struck_rows([(60.0, 9)] + five, threads=4)}
    assert len(struck - {9}) == 1 and 9 in struck, struck


def test_a_requests_rows_count_one_after_another():
    """A request of two rows (30 + 35 ms: copies of one compiled matcher, computed in turn) is 65 ms on any
    number of threads: struck, it alone, where the rest fit (a review: by each request's parallel wall the
    40 ms one was struck first, then it too)."""
    rows = [(40.0, 0), (30.0, 1), (35.0, 2), (30.0, 3)]
    struck = grammar_module.struck_rows(rows, ["a", "b", "b", "c"], threads=2)
    assert sorted(g for g, _ in struck) == [1, 2] and all(ms == 65.0 for _, ms in struck)


def test_rows_of_one_compile_count_in_turn_whichever_requests_they_serve():
    """Requests of one grammar get copies of one compile, whose shared lexer llguidance computes in turn
    (MatcherFuture): four requests of a 15 ms row in one lane take 60 ms on any number of threads, and one
    is struck; in four lanes they take 15 ms on 4 threads (a review: read as parallel, never struck)."""
    rows = [(15.0, g) for g in range(4)]
    owners = ["a", "b", "c", "d"]
    assert grammar_module.struck_rows(rows, owners, threads=4, lanes=[7, 8, 9, 10]) == []
    struck = grammar_module.struck_rows(rows, owners, threads=4, lanes=[7] * 4)
    assert len(struck) == 1 and struck[0][1] == 15.0  # a request's own ms
    # a longer lane's request goes first, though a shorter lane's costs more: 3 x 20 ms in lane 7 and a 45
    # ms request of lane 8 take 60 ms; one of lane 7's strikes fit the step (45), lane 8's could not
    rows, owners = [(20.0, 0), (20.0, 1), (20.0, 2), (45.0, 3)], ["a", "b", "c", "d"]
    assert [g for g, _ in grammar_module.struck_rows(rows, owners, 4, [7, 7, 7, 8])] == [2]
    # a row without a lane is its request's: the two rows of "a" in turn, beside "b"'s lane
    assert grammar_module.struck_rows([(30.0, 0), (30.0, 1), (30.0, 2)], ["a", "a", "b"], threads=4,
                                      lanes=[None, None, 7]) == [(0, 60.0), (1, 60.0)]


def test_the_costliest_request_goes_first_unless_one_lane_holds_the_step():
    """A review's two cases where striking from the longest lane first failed an innocent request: on one
    thread the wall is the rows' sum, so the 49 ms request alone is struck (not a 5 ms one of the 50 ms
    lane too); with more lanes than threads, the 30 ms request alone fits the step (35 | 30 ms)."""
    rows = [(5.0, g) for g in range(10)] + [(49.0, 10)]
    assert [g for g, _ in grammar_module.struck_rows(rows, list(range(11)), 1, [7] * 10 + [8])] == [10]
    rows = [(5.0, g) for g in range(13)] + [(30.0, 13)]
    lanes = [1] * 7 + [2] * 6 + [3]
    assert [g for g, _ in grammar_module.struck_rows(rows, list(range(14)), 2, lanes)] == [13]
    # a lane over the budget alone must lose a row: its 45 ms request, not the 49 ms one beside it (a second
    # review: the lane's 51 ms under the rows' share of two threads, the 49 ms request was struck first)
    rows = [(49.0, 0), (6.0, 1), (45.0, 2), (6.0, 3)]
    assert [g for g, _ in grammar_module.struck_rows(rows, list(range(4)), 2, ["a", "c", "b", "b"])] == [2]


def test_a_step_on_the_cores_thread_is_budgeted_as_it_ran(monkeypatch):
    """Three 30 ms rows among cheap ones, while row_ms still reads the cheap rows: the step runs on the core's
    thread (~91 ms) and is budgeted so, two of the three struck (a second review: read as the executor's 4
    threads would take them, nothing was, step after step); row_ms follows the step's mean row, so the
    next step goes to the executor."""
    executor = CountedExecutor()
    monkeypatch.setattr(Grammars, "_executor", executor)
    monkeypatch.setattr(Grammars, "_mask_threads", 4)
    grammars = Grammars(TOKENIZER, 300, {EOS})
    grammars.row_ms = 0.005
    matchers = [grammars.compile(regex_grammar("[a-c]+"), salt=str(g)).result() for g in range(7)]
    took = {id(m): 30.0 if g < 3 else 0.01 for g, m in enumerate(matchers)}
    real = grammar_module._mask_ms
    monkeypatch.setattr(grammar_module, "_mask_ms", lambda call: real(call) + took[id(call[0])])
    costly: list = []
    grammars.masks(matchers, costly, [f"r{g}" for g in range(7)], list(range(7)))
    assert executor.steps == 0 and sorted(g for g, _ in costly) in ([0, 1], [0, 2], [1, 2]), costly
    grammars.masks(matchers, [], [f"r{g}" for g in range(7)], list(range(7)))
    assert executor.steps == 1


def test_copies_of_one_compile_share_a_lane():
    grammars = Grammars(TOKENIZER, 300, {EOS})
    grammar = regex_grammar("[ab]*a[ab]{3}")
    first = [grammars.compile(grammar) for _ in range(grammar_module.COPIES_PER_COMPILE)]
    assert all(f.result(10) for f in first) and len({f.lane for f in first}) == 1
    again = grammars.compile(grammar)  # past COPIES_PER_COMPILE: a compile, and a lane, of its own
    other = grammars.compile(regex_grammar("[ab]+"))
    assert again.result(10) and other.result(10)
    assert len({first[0].lane, again.lane, other.lane}) == 3


def test_the_core_gives_the_budget_each_rows_compile():
    """Two requests of one grammar (one n = 2) share a lane, a request of another grammar has its own."""
    core, _ = build_core(config(async_scheduling=False))
    masks = core.grammars.masks
    seen: list = []

    def spy(matchers, costly=None, owners=None, lanes=None):
        seen.append((list(owners), list(lanes)))
        return masks(matchers, costly, owners, lanes)

    core.grammars.masks = spy
    same, other = regex_grammar("[a-c]{6}"), regex_grammar("[d-f]{6}")
    run(core, [("a", [1, 80], SamplingParams(max_tokens=6, temperature=0.0, n=2, grammar=same)),
               ("b", [1, 81], SamplingParams(max_tokens=6, temperature=0.0, grammar=same)),
               ("c", [1, 82], SamplingParams(max_tokens=6, temperature=0.0, grammar=other))])
    owners, lanes = max(seen, key=lambda step: len(step[0]))
    lane_of = dict(zip(owners, lanes, strict=True))
    assert sorted(owners) == ["a", "a", "b", "c"], owners
    assert lane_of["a"] == lane_of["b"] != lane_of["c"] and None not in lanes


def test_a_real_executor_steps_costly_rows_are_struck_at_the_next_step(monkeypatch):
    """llguidance's executor over five rows of an ambiguous grammar (~30 ms a mask here) holds the step past
    the limit; the next step's masks, each timed on the core's thread, strike the costliest (a review: the
    rows timed again in the same step read their cached masks, ~5 us, and nothing was ever struck)."""
    monkeypatch.setattr(Grammars, "_mask_threads", 2)
    monkeypatch.setattr(grammar_module, "PARALLEL_MASKS_MS", 0.0)
    grammars = Grammars(ByteTokenizer(), 300, {EOS})
    grammars.row_ms = 1.0  # the executor takes the step
    assert isinstance(grammars._executor, llguidance.LLExecutor)
    grammar = llguidance.grammar_from("lark", 'start: s\ns: s s | "x"\n')
    m = llguidance.LLMatcher(grammars._vocabulary(), grammar, log_level=0, limits=grammar_module.LIMITS)
    x = ByteTokenizer.OFFSET + ord("x")
    for _ in range(620):
        assert m.consume_token(x)
    rows = [m.deep_copy() for _ in range(5)]
    costly: list = []
    grammars.masks(rows, costly)
    assert costly == [] and grammars._timed_steps  # the executor's step: over the limit, no row's time
    for row in rows:
        assert row.consume_token(x)
    grammars.masks(rows, costly)
    assert costly and grammars._timed_steps == grammar_module.TIMED_AFTER_SLOW_STEP - 1


def test_a_requests_rows_count_together():
    """Its choices' rows are one cost, however cheap each (a review: 40 rows of 2 ms held every step 80 ms and
    were never struck); struck, every row of it is, at the request's cost."""
    struck = grammar_module.struck_rows
    many = [(2.0, g) for g in range(40)]
    assert struck(many) == []  # 40 requests of 2 ms: a step slow by its cheap rows
    assert struck(many, owners=["r"] * 40) == [(g, 80.0) for g in range(40)]  # one request of 80 ms
    # two requests of 12 x 2 ms beside 30 cheap rows of 0.5 ms (63 ms): the costlier of the two is struck
    rows = [(2.0, g) for g in range(24)] + [(0.5, g) for g in range(24, 54)]
    owners = ["a"] * 12 + ["b"] * 12 + list(range(24, 54))
    assert sorted(g for g, _ in struck(rows, owners=owners)) == list(range(12, 24))


@pytest.mark.parametrize("n,fails", [(1, False), (3, True)])
def test_a_requests_choices_count_together_against_the_step_budget(monkeypatch, n, fails):
    """A 20 ms grammar (under MAX_TOKEN_MS) serves n = 1; with n = 3 the request alone takes 60 ms of every
    step, as one 60 ms row would, and fails (the policy a review questioned; the README states it). Scaled
    x2 here, 40 ms rows against a 100 ms budget (MAX_TOKEN_MS and COSTLY_ROW_MS x2): n = 1 fails only if
    two of its sleeps wake 60 ms late (20 against 50 left 30); n = 3 takes 120 ms or more (sleeps run long,
    never short)."""
    monkeypatch.setattr(grammar_module, "MAX_TOKEN_MS", 2 * grammar_module.MAX_TOKEN_MS)
    monkeypatch.setattr(grammar_module, "COSTLY_ROW_MS", 2 * grammar_module.COSTLY_ROW_MS)
    core, _ = build_core(config(async_scheduling=False))
    masks = core.grammars.masks

    class Slow:
        def __init__(self, matcher):
            self.matcher = matcher

        def unsafe_compute_mask_ptr(self, ptr, nbytes):
            time.sleep(0.040)
            self.matcher.unsafe_compute_mask_ptr(ptr, nbytes)

    core.grammars.masks = lambda matchers, costly=None, owners=None, lanes=None: masks(
        [None if m is None else Slow(m) for m in matchers], costly, owners, lanes)
    params = SamplingParams(max_tokens=12, temperature=0.0, n=n, grammar=regex_grammar("[a-c]{12}"))
    _, ends = run(core, [("g", [1, 80, 81], params)])
    assert all((reason == "error") == fails for reason, _ in ends.values()), ends
    assert not core.requests and not core._strikes and not core._too_costly


def test_tenants_that_salt_apart_share_no_compile(monkeypatch):
    """A kept compile answers at once where a large schema takes ~0.3 s: requests of another cache salt
    compile it again (a review: one tenant could time whether another sent the same schema)."""
    compiles = CountedCompiles(monkeypatch)
    grammars = Grammars(TOKENIZER, 300, {EOS})
    grammar = regex_grammar("[ab]+c")
    for salt in ("tenant-a", "tenant-a", None, "tenant-b", None, "tenant-b"):
        grammars.compile(grammar, salt).result()
    assert compiles.count == {grammar: 3}
    grammars.forget(grammar, "tenant-a")  # its own salt's compile alone
    assert set(grammars._compiled) == {(None, grammar), ("tenant-b", grammar)}


@pytest.mark.parametrize("version,ok", [("1.6.1", False), ("1.8.9", False), ("1.9.0", True), ("1.10.2", True),
                                        ("2.0.0rc1", True), ("1.10+local", True)])
def test_an_llguidance_older_than_pagewalk_needs_is_named_at_import(version, ok):
    """A GPU host's carried wheels brought 1.6.1: every guided request failed with "expected an integer"
    (its tokenizer takes one EOS id). The import now says which version it found."""
    if ok:
        grammar_module.check_llguidance(version)
    else:
        with pytest.raises(ImportError, match=f"llguidance {version} is installed"):
            grammar_module.check_llguidance(version)
