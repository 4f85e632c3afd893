"""The engine step: schedule -> launch (runner: forward, fork copies, sampling) -> finish checks \
-> SeqUpdates.

With asynchronous scheduling (the default) a step launches step N+1 before it post-processes step N: the
host schedules and packs N+1 while the device still runs N, N's sampled ids feed N+1 on the device, and
N's ids reach the host (pinned copy + event) while N+1 runs. A choice that finishes at N has computed one
token more in N+1; the scheduler discards it, nothing emits it. `async_scheduling=False` post-processes
each step before planning the next; the tokens are the same.

A request with a structured output (SamplingParams.grammar) waits for its matchers to compile
(server/engine/grammar.py) before it is scheduled. A step that samples guided choices needs their token
masks, which need the previous step's tokens: the runner asks for them once the step's forward is launched,
and the previous step is post-processed then, while the device runs that forward (so with async scheduling
the overlap stays; a guided choice that ended there computes one wasted token, as any choice does).

Ints only: the core never sees text. It ends a choice on EOS, a stop token id or max_tokens; stop strings
are found in the API process, which aborts the choice here. A failure inside one request's post-processing
fails that request; a failure of the batch (runner, fork copies, sampler) fails the requests in that batch;
the core goes on.
"""

from __future__ import annotations

import itertools
import logging
import numbers
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import NamedTuple

import torch

from kvcache import KVCacheManager
from kvcache.snapshot import block_map
from server.engine import grammar
from server.engine.grammar import GrammarError, Grammars, TokenMask, too_costly
from server.engine.outputs import (
    BAD_WORDS_CONFLICT,
    STRUCTURED_OUTPUT_FAILED,
    CoreStats,
    EngineRequest,
    SeqUpdate,
    StepUpdate,
    TokenLogprobs,
)
from server.engine.prompt_logprobs import prompt_logprobs
from server.engine.request import Request
from server.engine.runner import HostSamples, StepResult
from server.engine.sampler import seed_key
from server.engine.sampling_params import SamplingParams, bad_token_ids
from server.engine.scheduler import Scheduler, SchedulerOutput
from server.engine.sequence import SeqStatus, Sequence

logger = logging.getLogger("pagewalk.engine")

COMPILE_WAIT_S = 0.01  # a core with nothing but grammars compiling waits this long for one, not spinning
# This many failed steps in a row (none ran between them) and the engine cannot run a step: a sticky device
# error (CUDA's illegal memory access poisons the context: every later launch fails) or a broken state. One
# failed step (an out-of-memory batch) fails its requests only; this many end the core, so that /health
# answers 503 and the server exits non-zero for its supervisor to restart it (a review).
FATAL_FAILED_STEPS = 3


class _Launched(NamedTuple):
    """A step on the device: its plan and its samples on their way."""

    sched: SchedulerOutput
    result: StepResult


class EngineCore:
    def __init__(self, runner, kv: KVCacheManager, eos_token_ids: set[int], max_num_seqs: int,
                 max_num_batched_tokens: int, async_scheduling: bool = True,
                 grammars: Grammars | None = None):
        """grammars: the structured outputs' vocabulary and compile threads; None refuses them."""
        self.runner = runner
        self.kv = kv
        self.eos_token_ids = frozenset(eos_token_ids)
        self.scheduler = Scheduler(kv, max_num_seqs, max_num_batched_tokens)
        self.async_scheduling = async_scheduling
        self.requests: dict[str, Request] = {}
        self._seq_ids = itertools.count()
        self._in_flight: _Launched | None = None  # launched, not post-processed
        self.grammars = grammars
        self._compiling: dict[str, Future] = {}  # request id -> its matcher, compiling (not yet scheduled)
        # guided choice -> the positions (in its token_ids) of its tokens over MAX_TOKEN_MS, those within
        # STRIKE_WINDOW of its latest: at most GRAMMAR_STRIKES
        self._strikes: dict[tuple[str, int], list[int]] = {}
        self._too_costly: dict[str, float] = {}  # -> the mask's ms that made GRAMMAR_STRIKES: it fails
        self._guided: set[str] = set()  # the requests with a structured output
        self.generated_tokens = 0  # output tokens in the updates, all time
        self.prefill_tokens = 0  # prompt (and recomputed) tokens scheduled, all time
        self.steps = 0  # steps that ran tokens, all time
        self.prompt_steps = 0  # of them, those with prompt tokens
        self.failed_steps = 0  # steps in a row whose batch failed
        self.fatal: str | None = None  # why this core can run no step: its loop ends once it is set

    # ---- requests ---------------------------------------------------------------------------------
    def add_request(self, er: EngineRequest) -> None:
        """ValueError (request not added) for an empty prompt or prompt ids outside the vocabulary, sampling
        parameters SamplingParams.validate refuses (token ids the sampler's tables would index out of range
        among them), an id in use, or a request this core can never run (past max_model_len, more choices
        than rows, a choice larger than the whole KV cache): caught here, not in a batch, they fail this
        request only (the API refuses them first; a client of the core alone does not)."""
        if not er.prompt_token_ids:  # the scheduler's allocation needs a token: the step would fail all
            raise ValueError("the prompt must hold at least one token")
        _check_prompt(er.prompt_token_ids, self.runner.config.vocab_size)
        er.params.validate(self.runner.config.vocab_size)
        if er.params.grammar is not None and self.grammars is None:
            raise ValueError("structured outputs are unavailable: this core has no vocabulary for grammars")
        if er.request_id in self.requests:
            raise ValueError(f"request id {er.request_id!r} is already in the engine")
        self._check_fits(len(er.prompt_token_ids), er.params)
        req = Request(er.request_id, list(er.prompt_token_ids), er.params, er.arrival_time, er.group,
                      received_time=time.monotonic())
        if er.params.prompt_logprobs is not None:
            req.prompt_logprobs = prompt_logprobs(self.runner.model, req.prompt_token_ids,
                                                  er.params.prompt_logprobs)
        held_back = self._held_back(er.params)
        req.seqs = [self._new_seq(req, i, held_back) for i in range(er.params.n)]
        parent = req.seqs[0]
        # every choice's admissions look them up, in the chain of the request's salt
        keys = self.kv.prefix_keys(req.prompt_token_ids, er.params.cache_salt)
        for seq in req.seqs:
            seq.prefix_keys = keys
        for child in req.seqs[1:]:
            child.status = SeqStatus.FORK_PENDING
            parent.fork_children.append(child)
        self.requests[req.request_id] = req
        if er.params.grammar is None:
            self.scheduler.add(parent)
        else:  # scheduled once its matchers are built (_admit_compiled)
            self._guided.add(req.request_id)
            self._compiling[req.request_id] = self.grammars.compile(er.params.grammar, er.params.cache_salt)

    def _check_fits(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        # the positions a choice takes: its last token is sampled, never forwarded (the scheduler stops a
        # choice at max_tokens), so a prompt of max_model_len tokens can be scored (max_tokens 1, dropped)
        total = num_prompt_tokens + params.max_tokens - 1
        if total > self.runner.max_model_len:
            raise ValueError(f"prompt ({num_prompt_tokens}) + max_tokens ({params.max_tokens}) - 1 = {total} "
                             f"positions exceeds max_model_len ({self.runner.max_model_len})")
        if params.prompt_logprobs is not None and num_prompt_tokens > self.scheduler.max_num_batched_tokens:
            # one dense forward on this thread: no longer than the steps memory was sized for
            raise ValueError(f"prompt logprobs take a prompt of at most max_num_batched_tokens "
                             f"({self.scheduler.max_num_batched_tokens}) tokens, got {num_prompt_tokens}")
        if params.n > self.scheduler.max_num_seqs:
            raise ValueError(f"n ({params.n}) exceeds max_num_seqs ({self.scheduler.max_num_seqs})")
        if total > self.runner.capacity_tokens:
            raise ValueError(f"a choice of {total} tokens exceeds the KV cache "
                             f"({self.runner.capacity_tokens} tokens)")

    def _new_seq(self, req: Request, index: int, held_back: list[int]) -> Sequence:
        # unseeded choices draw their stream from torch's generator (EngineConfig.seed seeds it)
        seed = req.params.seed if req.params.seed is not None else int(torch.randint(0, 2**31, ()).item())
        return Sequence(next(self._seq_ids), req.request_id, index, req.prompt_token_ids, req.params,
                        seed_key=seed_key(seed, index), held_back=held_back)

    def _held_back(self, params: SamplingParams) -> list[int]:
        """The ids the sampler keeps out while a choice has fewer than min_tokens: those that would end it
        here (stop_token_ids, and EOS unless ignore_eos)."""
        if params.min_tokens == 0:
            return []
        eos = () if params.ignore_eos else self.eos_token_ids
        return sorted(set(params.stop_token_ids).union(eos))

    def has_work(self) -> bool:
        return bool(self.requests) or self._in_flight is not None

    def abort_request(self, request_id: str, index: int | None = None, reason: str = "abort",
                      error: str | None = None, error_kind: str | None = None) -> list[SeqUpdate]:
        """End choice `index` (None: every unfinished choice) with `reason` (and, for "error", `error` and
        its SeqUpdate.error_kind); free their blocks now.
        Unknown requests and finished choices are ignored (empty list). Choices waiting to fork from an
        ended one end with it (they had no prompt of their own yet): each gets its update too."""
        req = self.requests.get(request_id)
        if req is None:
            return []
        open_before = req.unfinished()
        seqs = open_before if index is None else [s for s in open_before if s.index == index]
        parent = req.seqs[0]
        for seq in seqs:
            seq.finish_reason = reason
            if seq in parent.fork_children:  # (a parent whose grammar compiles is in no scheduler list)
                parent.fork_children.remove(seq)
            self.scheduler.finish(seq)
        updates = []
        for seq in open_before:
            if seq.is_finished:
                seq.finish_reason = seq.finish_reason or reason
                updates.append(SeqUpdate(request_id, seq.index, [], None, seq.finish_reason, None, error,
                                         error_kind=error_kind))
        self._forget_if_finished(req)
        return updates

    def _forget_if_finished(self, req: Request) -> None:
        if req.finished:
            del self.requests[req.request_id]
            self._guided.discard(req.request_id)
            self._too_costly.pop(req.request_id, None)
            for seq in req.seqs:
                self._strikes.pop((req.request_id, seq.index), None)
            compiling = self._compiling.pop(req.request_id, None)
            if compiling is not None:  # aborted while compiling: a compile not started yet never starts
                compiling.cancel()

    def _admit_compiled(self) -> list[SeqUpdate]:
        """Schedule the requests whose matcher has compiled, each choice with its own; fail those whose
        grammar does not compile."""
        sched = self.scheduler
        if self._in_flight is None and not sched.running and not sched.waiting:
            wait(self._compiling.values(), COMPILE_WAIT_S, FIRST_COMPLETED)
        updates: list[SeqUpdate] = []
        for rid, future in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[rid]
            try:
                matcher = future.result()
            except Exception as e:  # GrammarError, or llguidance's own
                updates += self.abort_request(rid, None, "error", _describe(e), STRUCTURED_OUTPUT_FAILED)
                continue
            req = self.requests[rid]
            for seq in req.seqs:  # none has a token yet: each starts from the grammar's start
                seq.matcher = matcher if seq is req.seqs[0] else matcher.deep_copy()
                seq.lane = future.lane
            self.scheduler.add(req.seqs[0])
        return updates

    # ---- one step ---------------------------------------------------------------------------------
    def step(self) -> StepUpdate:
        """Schedule and launch a step; return the updates of the step that finished on the device (the
        previous one with async scheduling, this one without)."""
        updates = self._admit_compiled() if self._compiling else []
        sched = self.scheduler.schedule()
        launched = None
        now = time.monotonic()
        for c in sched.prefills:  # a request first runs in a prefill chunk
            req = self.requests[c.seq.request_id]
            req.scheduled_time = req.scheduled_time or now
        if not sched.is_empty:
            try:
                mask = self._token_mask(sched, updates) if self._guided else None
                launched = _Launched(sched, self.runner.execute(sched, self.kv.table_view, mask))
            except Exception as e:  # the whole batch failed: fail its requests, keep serving
                updates += self._fail_batch(sched, e)
        if self.async_scheduling:
            done, self._in_flight = self._in_flight, launched
        else:
            done = launched
        if done is not None:
            updates += self._postprocess(done)
        self.generated_tokens += sum(len(u.new_token_ids) for u in updates)
        self.prefill_tokens += sched.num_prefill_tokens
        if not sched.is_empty:
            self.steps += 1
            self.prompt_steps += sched.num_prefill_tokens > 0
        return StepUpdate(updates, self.stats(sched.num_prefill_tokens, sched.num_decode_tokens,
                                              len(sched.preempted)))

    def _token_mask(self, sched: SchedulerOutput, updates: list[SeqUpdate]
                    ) -> Callable[[], TokenMask] | None:
        """For a step with guided samples: what the runner calls for their masks once the step's forward is
        launched. It first post-processes the step in flight (its updates join `updates`), so that every
        matcher has consumed every token its choice sampled; a choice that ended there gets no mask (its
        token in this step is discarded)."""
        guided = [g for g, seq in enumerate(sched.samples) if seq.matcher is not None]
        if not guided:
            return None

        def masks() -> TokenMask:
            if self._in_flight is not None:
                updates.extend(self._postprocess(self._in_flight))
                self._in_flight = None
            seqs = [sched.samples[g] for g in guided]
            matchers = [None if seq.is_finished else seq.matcher for seq in seqs]
            costly: list[tuple[int, float]] = []
            bits = self.grammars.masks(matchers, costly, [self._owner(seq) for seq in seqs],
                                       [seq.lane for seq in seqs])
            for i, took_ms in costly:  # at its last strike, its token in this step fails it (_finish_checks)
                if self._strike(seqs[i], len(seqs[i].token_ids)):  # where this mask's token lands
                    self._too_costly[seqs[i].request_id] = took_ms
            return TokenMask(guided, bits)

        return masks

    def _owner(self, seq: Sequence) -> str:
        """The client's request a choice counts in against a step's grammar budget (its request's group)."""
        req = self.requests.get(seq.request_id)
        return (req.group or req.request_id) if req is not None else seq.request_id

    def _accept(self, seq: Sequence, token: int) -> bool:
        """The guided choice's matcher takes its token (Grammars.accept) -> whether the grammar is complete;
        GrammarError where its request's grammar made its last strike (its mask, or this parse)."""
        if seq.request_id in self._too_costly:
            raise GrammarError(too_costly(self._too_costly[seq.request_id]))
        start = time.perf_counter()
        complete = self.grammars.accept(seq.matcher, token)
        took_ms = (time.perf_counter() - start) * 1e3
        if took_ms > grammar.MAX_TOKEN_MS and self._strike(seq, len(seq.token_ids) - 1):
            raise GrammarError(too_costly(took_ms))
        return complete

    def _strike(self, seq: Sequence, position: int) -> bool:
        """The choice's grammar took over MAX_TOKEN_MS over its token at `position` (in its token_ids; its
        mask and its parse may both strike it) -> whether that fails its request: GRAMMAR_STRIKES of its
        tokens within STRIKE_WINDOW consecutive ones (each choice's own: n choices take their first token from
        the grammar's start in one step)."""
        key = (seq.request_id, seq.index)
        recent = [p for p in self._strikes.get(key, ()) if position - p < grammar.STRIKE_WINDOW]
        self._strikes[key] = recent + [position]
        return len(self._strikes[key]) >= grammar.GRAMMAR_STRIKES

    def _postprocess(self, launched: _Launched) -> list[SeqUpdate]:
        try:
            samples = launched.result.wait()
        except Exception as e:  # the device failed this batch
            return self._fail_batch(launched.sched, e)
        self.failed_steps = 0
        taken = self.scheduler.postprocess(launched.sched, samples.token_ids)
        return self._process(taken, samples)

    def _fail_batch(self, sched: SchedulerOutput, e: Exception) -> list[SeqUpdate]:
        """Fails the requests the batch ran (the engine goes on), or sets `fatal` when the device is no longer
        usable or FATAL_FAILED_STEPS steps in a row failed."""
        logger.exception("engine step failed; failing %d sequences", len(sched.samples))
        self.failed_steps += 1
        if self.fatal is None and not self.runner.device_usable():
            self.fatal = f"the device is unusable after a failed step ({_describe(e)})"
        elif self.fatal is None and self.failed_steps >= FATAL_FAILED_STEPS:
            self.fatal = f"{self.failed_steps} engine steps in a row failed, the last with {_describe(e)}"
        # the requests the batch ran, by their sequences: with async scheduling the failure shows a step
        # later, when a client may have aborted one and sent a new request under its id (a review)
        batch = set()
        for seq in [*sched.samples, *(c.seq for c in sched.prefills)]:
            req = self.requests.get(seq.request_id)
            if req is not None and any(own is seq for own in req.seqs):
                batch.add(seq.request_id)
        return [u for rid in batch for u in self.abort_request(rid, None, "error", _describe(e))]

    def stats(self, num_prefill_tokens: int = 0, num_decode_tokens: int = 0,
              num_preemptions: int = 0) -> CoreStats:
        """Requests running (some choice holds KV blocks: it is in the scheduler's running list) / waiting,
        KV occupancy, and what the step just taken did."""
        running = len(self.running_request_ids())
        u = self.kv.usage()
        return CoreStats(running, len(self.requests) - running, u.free_blocks, u.used_blocks, u.cached_blocks,
                         u.prefix_hit_rate, num_prefill_tokens, num_decode_tokens, num_preemptions,
                         u.prefix_queries, u.prefix_hits, self.generated_tokens,
                         self.scheduler.num_preemptions, self.prefill_tokens, self.steps,
                         self.prompt_steps)

    def running_request_ids(self) -> set[str]:
        """Requests with a choice holding KV blocks (in the scheduler's running list)."""
        return {seq.request_id for seq in self.scheduler.running}

    def kv_snapshot(self) -> dict:
        """The block map (kvcache.snapshot.block_map), each holder labelled with its request and choice;
        built only when asked, between steps."""
        owners = {seq.seq_id: {"request_id": req.request_id, "index": seq.index}
                  for req in self.requests.values() for seq in req.seqs}
        return block_map(self.kv, owners)

    def _process(self, taken: list[tuple[int, Sequence]], samples: HostSamples) -> list[SeqUpdate]:
        updates = []
        failed: dict[str, tuple[str, str | None]] = {}  # request -> its error, its SeqUpdate.error_kind
        for r, seq in taken:
            if seq.request_id in failed:
                continue
            try:
                updates.append(self._finish_checks(seq, samples, r))
            except GrammarError as e:  # its own grammar's: its grammar compiles afresh for the next request
                logger.warning("request %s failed: %s", seq.request_id, e)
                failed[seq.request_id] = _describe(e), STRUCTURED_OUTPUT_FAILED
                self.grammars.forget(seq.params.grammar, seq.params.cache_salt)
            except BadWordsConflict as e:
                logger.warning("request %s failed: %s", seq.request_id, e)
                failed[seq.request_id] = str(e), BAD_WORDS_CONFLICT
            except Exception as e:  # this request only
                logger.exception("request %s failed", seq.request_id)
                failed[seq.request_id] = _describe(e), None
        for rid, (error, kind) in failed.items():  # its choices already updated this step keep their update
            updates += self.abort_request(rid, None, "error", error, kind)
        return updates

    def _finish_checks(self, seq: Sequence, samples: HostSamples, r: int) -> SeqUpdate:
        """seq just took sampled token r (Scheduler.postprocess): does it end here?"""
        token_ids = seq.token_ids
        token = token_ids[-1]
        p = seq.params
        logprobs = [self._logprobs(seq, samples, r)] \
            if samples.logprobs is not None and p.logprobs is not None else None
        num_output = len(token_ids) - len(seq.prompt_token_ids)
        if p.bad_words_ids:
            _check_bad_words(p, token_ids, num_output)
        reason, stop_token = None, None
        complete = seq.matcher is not None and self._accept(seq, token)
        if token in self.eos_token_ids and not p.ignore_eos:  # first, as vLLM: EOS has no stop_reason
            reason = "stop"
        elif p.stop_token_ids and token in p.stop_token_set:
            reason, stop_token = "stop", token
        elif complete:  # the structured output is whole (its last token, or EOS where the grammar ends)
            reason = "stop"
        elif num_output >= p.max_tokens:
            reason = "length"
        if num_output == 1:  # a choice's first update carries its request's prompt logprobs and times
            req = self.requests[seq.request_id]
            prompt_lps, scheduled, received = req.prompt_logprobs, req.scheduled_time, req.received_time
        else:
            prompt_lps = scheduled = received = None
        if reason is not None:
            seq.finish_reason, seq.stop_reason = reason, stop_token
            for child in reversed(seq.fork_children):  # never forked off it: each prefills on its own
                child.status = SeqStatus.WAITING
                self.scheduler.waiting.appendleft(child)
            seq.fork_children = []
            self.scheduler.finish(seq)
            self._forget_if_finished(self.requests[seq.request_id])
        return SeqUpdate(seq.request_id, seq.index, [token], logprobs, reason, stop_token, None, prompt_lps,
                         scheduled, received)

    @staticmethod
    def _logprobs(seq: Sequence, samples: HostSamples, r: int) -> TokenLogprobs:
        k = seq.params.logprobs or 0  # the step's top lists are as long as its largest request
        top = list(zip(samples.top_ids[r][:k], samples.top_logprobs[r][:k], strict=True))
        return samples.logprobs[r], top


def _check_prompt(token_ids: list[int], vocab_size: int) -> None:
    bad = bad_token_ids(token_ids, vocab_size, numbers.Integral)
    if bad:
        raise ValueError(f"prompt token ids must be integers in [0, {vocab_size}), got {bad[0]!r}")


class BadWordsConflict(Exception):
    """A choice completed one of its bad_words: the sampler draws a banned token (HOLD_BACK, finite) only
    where nothing else is left (bad_words.py), so its other constraints and its bad words cannot both hold
    (a reply of a banned word with finish_reason "stop" before: a review)."""


def _check_bad_words(p: SamplingParams, token_ids: list[int], num_output: int) -> None:
    """BadWordsConflict where the output's last tokens (sampled ones only, vLLM's rule) are a bad word."""
    for word in p.bad_words_by_last.get(token_ids[-1], ()):
        if len(word) <= num_output and token_ids[len(token_ids) - len(word):] == word:
            left = ("its structured output" if p.grammar is not None else
                    "allowed_token_ids" if p.allowed_token_ids is not None else "the model")
            raise BadWordsConflict(f"bad_words ban every token {left} leaves at output token {num_output} "
                                   f"(it completed the bad word of token ids {word})")


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"
