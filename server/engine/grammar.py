"""Structured outputs in the core: an llguidance matcher per guided choice, and a step's token masks.

A request whose SamplingParams.grammar is set (an llguidance grammar: JSON schema, regex, Lark, choice; the
API builds it, server/api/structured_output.py) gets one LLMatcher per choice. Building one compiles the
grammar against the vocabulary: about a millisecond for a small JSON schema, more for a large one (llguidance
bounds it by its parser limits), so it runs on a worker thread, which llguidance lets run without the GIL, and
the request joins the scheduler only when its matchers are ready (EngineCore.step). Each grammar compiles
once: its requests get copies of its matcher (the CACHED_GRAMMARS most recent are kept). The vocabulary as
llguidance reads it is built there too, by the first compile: ~1 s for a 128K-token tokenizer.json, paid by
the first structured request rather than by every start-up.

Each step, the matchers of the step's guided samples write the tokens they allow as a bitmask (G, W) int32,
W = ceil(V / 32), bit j of word w allowing token 32 w + j (on the core's thread, or on LLExecutor's threads
in parallel where the rows cost more and spread over several compiles: PARALLEL_MASKS_MS, MatcherFuture; a
row that forces an added token
the grammar would refuse then offers the forced text's spellings: forced_specials.py, ~30 us a step over a
128K-token vocabulary, none over the byte tokenizer's); the runner sends it with the step
(pinned buffers it reuses) and the sampler sets every other logit to -inf (Sampler: after biases and
penalties). Each sampled token then advances its matcher (`accept`); the choice ends ("stop") when the
grammar is complete, which is also when the mask allows only EOS.

A guided choice's next mask needs its last token on the host: the runner asks for a step's masks once its
forward is launched, and EngineCore post-processes the previous step then, while the device runs the
forward (EngineCore._token_mask), so async scheduling keeps its overlap.
"""

from __future__ import annotations

import functools
import heapq
import importlib.metadata
import itertools
import os
import re
import threading
import time
import weakref
from collections import OrderedDict, defaultdict, deque
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import llguidance
import torch

from server.engine.forced_specials import ForcedSpecials
from server.model.tokenizer import ByteTokenizer, HFTokenizer

LLGUIDANCE_MIN = (1, 9)  # 1.6 takes one EOS id where the tokenizer gives a list: every guided request failed


def check_llguidance(version: str) -> None:
    """ImportError naming the version where llguidance is older than LLGUIDANCE_MIN (pyproject asks it, but a
    carried wheel set or a pinned environment may bring an older one)."""
    parts = tuple(int(p) for p in re.findall(r"\d+", version)[:2])  # "1.10+local" -> (1, 10)
    if parts < LLGUIDANCE_MIN:
        raise ImportError(f"llguidance {version} is installed; pagewalk needs >= "
                          f"{'.'.join(map(str, LLGUIDANCE_MIN))} (pip install -U llguidance)")


check_llguidance(importlib.metadata.version("llguidance"))

COMPILE_THREADS = 2  # grammars compiling at once, beside the core's own thread
# grammars of up to this many characters compile on a thread of their own: a realistic schema (~1 ms) never
# waits behind large ones (a 4,000-property schema takes ~1 s; a review saw a regex wait 8.6 s behind six)
SMALL_GRAMMAR_CHARS = 8 * 1024
# compiled grammars kept, most recently asked for first: requests repeat a few grammars (a tool set, a
# response format), and a copy of a compiled matcher takes ~1 us where compiling takes ~1 ms (a 300-property
# schema 5-12 ms). Bounded in count and in grammar text, which their compiled size follows.
CACHED_GRAMMARS = 64
CACHED_GRAMMAR_CHARS = 2 * 1024 * 1024
# llguidance's copies share the compiled matcher's lexer, whose states (a lazily built DFA) grow with what
# every copy explores: over the bench vocabulary a regex like [ab]*a[ab]{40} grew it ~60 KB a request (a
# review: 160 MiB and its lexer's state limit after ~2,700 requests, when every later copy failed). A kept
# compile serves this many copies, then the grammar compiles afresh; a choice whose grammar fails drops it.
COPIES_PER_COMPILE = 32
# threads computing a step's masks: llguidance's default (80% of the CPUs) took 8.0 ms for 64 rows of the
# bench vocabulary on a 16-core H100 host, 4 threads 0.09 ms (1: 0.11, 2: 0.11; 256 rows: default 2.8 ms, 4
# threads 0.27, 1: 0.55; tools/grammar_mask_probe). Its worker threads spin a while after each batch: on a
# 2-core machine they starved the core's own thread (a 256 KB torch.zeros after the masks took ~8 ms), so
# below CPUS_PER_MASK_THREAD cores a thread each, the core's thread computes the masks itself.
MASK_THREADS = 4
CPUS_PER_MASK_THREAD = 4
# Where the executor runs at all, it takes a step's masks only when the core's thread would take longer than
# PARALLEL_MASKS_MS over them (rows x the measured ms a row) and no compile's copies hold over half the rows
# (copies of one compile share its lexer: on a 16-core H100 host, 4 threads, tools/mask_lane_probe,
# 256 rows of a JSON schema over a 128K-token vocabulary took the executor 3.3-3.5 ms as copies of one
# compile, 1.5 as copies of 4 (in blocks), 1.1 compiled apart; this thread 1.8-2.5 in every case; 64 rows:
# 0.77-0.82, 0.53 and 0.43 against 0.45-0.56). Cheap rows stay on the core's thread: over the
# bench preset's 259-id vocabulary (~3 us a row: 0.2 ms at 64 rows, 0.8 at 256) the executor's steps stalled
# for 3-10 ms 15-22 times in 512 at 64 in flight (the core's thread: 5-6, 2 of them collector passes;
# tools/guided_stall_probe), and the guided closed loops ran 0.5-3.6% faster without it at 64 and at 256 in
# flight (an H100 host, 16 cores). A synthetic 128K-token vocabulary took 4-7 us a row on the 2-core CI box
# (tools/mask_row_cost_probe), the executor 3x less at 256 rows of a regex, no less at 64 or over JSON.
PARALLEL_MASKS_MS = 1.0
# A guided choice whose grammar takes longer than this over one token (its mask, or its accept) fails: every
# stream's step waits for it. A small grammar takes ~3-30 us a token; an ambiguous one (s: s s | "x") grows
# without a bound llguidance's parser limits catch (a review: 16 ms at 400 tokens, 1.1 s a token over a
# 128K-token vocabulary at 100), a 3,000-property schema takes ~40 ms at its "{" over the bench vocabulary.
MAX_TOKEN_MS = 50.0
# ... and a step's masks in all take at most MAX_TOKEN_MS of wall time: where they take longer, the costliest
# rows of COSTLY_ROW_MS or more are struck, costliest first, until the rest fit (ten requests of a grammar at
# 45 ms a token, each under the limit, made every step 450 ms); where the rows under COSTLY_ROW_MS alone
# take longer, none is (a batch slow by its many cheap rows). A row of a realistic grammar takes 3-60 us
# over a 128K-token vocabulary; a tenth of the budget is far past that. The n choices of one request count
# together, as one row: a request whose choices take over MAX_TOKEN_MS a step together fails as one slow row
# would, however cheap each choice's row (struck_rows).
COSTLY_ROW_MS = MAX_TOKEN_MS / 10
GRAMMAR_STRIKES = 2  # tokens over MAX_TOKEN_MS that fail a choice: one may be the host's (thread descheduled)
# ... within this many consecutive tokens of the choice: a host's hiccups far apart in a long reply do not
# add up, while a costly grammar meets its strikes in a row (slow at every token once its parse has grown) or
# where its structure repeats a slow spot (each "{" of a list of large objects). 64 tokens fail a slow spot
# that repeats within 64 tokens and let a rarer one hold every stream's step at most once in 64 of the
# choice's tokens; two hiccups of the host (seconds apart) rarely fall within 64 decode steps of one choice.
STRIKE_WINDOW = 64
# An executor step over MAX_TOKEN_MS tells no row's time: the next this many steps run on the mask threads,
# each row timed, so that a slow spot that repeats within STRIKE_WINDOW tokens meets its two strikes there (a
# slow token between cheap ones, found by timing only the next step, was never struck: a review). They cost
# the threads' hand-offs and each row's Python work beside the executor's (256 rows of ~8 us: ~2.5 ms a
# step against ~1.1-1.5, tools/mask_lane_probe), after a step that held every stream 50 ms.
TIMED_AFTER_SLOW_STEP = 2 * STRIKE_WINDOW
ROW_COST_WEIGHT = 0.2  # a new measurement's weight in row_ms (a wave's first masks cost a few times more)
# llguidance's parser limits, for the API's check of a grammar and the core's matchers alike: its defaults but
# - a lexer step's fuel, 200K (~14 ms of one mask, ~14K a ms) -> 50K, so that no lexer step holds every
#   stream's step for more than a few ms (MAX_TOKEN_MS bounds a token's mask and its parse);
# - the Earley items of one row, 2,000 -> 20,000: an object's optional properties take ~4 items each and a
#   choice's strings one, so 500 properties or 2,000 strings already failed, at whichever token first
#   predicts them (mid-stream where they sit behind other fields); 20,000 holds any such fan-out that fits
#   MAX_GRAMMAR_CHARS (3,000 properties: 12,007 items), at ~20K items a ms.
# A grammar over a limit fails its request: at the API's check, or where the limit bites mid-stream.
LIMITS = llguidance.LLParserLimits(step_lexer_fuel=50_000, max_items_in_row=20_000)
CHECKED_TOKENS = 2  # the API's check follows a grammar this many tokens (its limits may bite at the first)
MAX_ERROR_CHARS = 300  # llguidance's messages may quote the grammar and its parser state


@dataclass
class TokenMask:
    """A step's token masks: samples (G,) the indices (in SchedulerOutput.samples) of its guided samples,
    bits (G, W) int32 host their allowed tokens, W words of the tokenizer's ids (the runner widens them to the
    logits' width on the device: the ids past the tokenizer's are never allowed)."""

    samples: list[int]
    bits: torch.Tensor


def widened(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(G, W) mask words of the tokenizer's ids -> (G, ceil(vocab_size / 32)), on their device: the ids past
    the tokenizer's (an embedding's padding rows) never allowed. The runner widens them on the device, not
    the host: the bench preset's 259 ids are 9 words a row against 4,008, which cost the host a 4 MB fill
    and copy a step at 256 rows."""
    words = (vocab_size + 31) // 32
    if bits.shape[1] == words:
        return bits
    wide = bits.new_zeros(bits.shape[0], words)
    wide[:, :bits.shape[1]] = bits
    return wide


class GrammarError(ValueError):
    """A grammar that does not compile, or a sampled token it refuses."""


class Grammars:
    """The model's vocabulary as llguidance reads it, the compile threads, and the masks of a step."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: set[int]) -> None:
        """tokenizer: the model's (server/model/tokenizer.py); vocab_size: the logits' width (ids past the
        tokenizer's, an embedding's padding rows, are never allowed)."""
        self._source = (tokenizer, eos_token_ids)
        self.words = (vocab_size + 31) // 32  # the step's bitmask rows
        self._compiles = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="pagewalk-grammar")
        self._small_compiles = ThreadPoolExecutor(1, thread_name_prefix="pagewalk-grammar-small")
        # (cache salt, grammar text) -> its compile, LRU order: tenants that salt apart share no compile (a
        # kept one answers at once where a large schema takes ~0.3 s to compile: a timing side channel)
        self._compiled: OrderedDict[tuple[str | None, str], _Compile] = OrderedDict()
        self._compiled_chars = 0
        self._lock = threading.Lock()  # the core adds compiles, a compile thread drops one nobody wants
        self.row_ms = 0.0  # a mask row's cost on the core's thread, measured (a moving average)
        self._lane_costs: dict = {}  # lane -> its rows' ms in the last step timed on the mask threads
        self._timed_steps = 0  # steps left to time on the mask threads after a slow executor step

    @functools.cached_property
    def _mask_threads(self) -> int:
        """Threads a step's masks run on: 1 (the core's own) below 2 x CPUS_PER_MASK_THREAD cores."""
        return max(1, min(MASK_THREADS, (os.cpu_count() or 1) // CPUS_PER_MASK_THREAD))

    @functools.cached_property
    def _executor(self) -> llguidance.LLExecutor | None:
        return llguidance.LLExecutor(self._mask_threads) if self._mask_threads >= 2 else None

    def compile(self, grammar: str, salt: str | None = None) -> MatcherFuture:
        """A matcher of its own for `grammar`, at its start; the future's result is the LLMatcher, or
        GrammarError. A copy of the grammar's compiled matcher: compiled once on a compile thread for every
        request of the same cache `salt` that asks while it compiles, and kept for the CACHED_GRAMMARS most
        recently asked (a grammar that fails fails again at once), for COPIES_PER_COMPILE requests each.
        Cancelling the future drops the request's interest: a compile that every asker dropped before it
        started never runs."""
        key = (salt, grammar)
        with self._lock:
            compile_ = self._compiled.get(key)
            if compile_ is not None and compile_.copies >= COPIES_PER_COMPILE and compile_.done.done():
                self._drop(key)
                compile_ = None
            if compile_ is None:
                compile_ = self._compiled[key] = _Compile()
                self._compiled_chars += len(grammar)
                self._evict()
                # the job takes the lock first, so it cannot finish (and call _deliver) while this holds it
                lane = self._small_compiles if len(grammar) <= SMALL_GRAMMAR_CHARS else self._compiles
                compile_.done = lane.submit(self._first_matcher, key, compile_)
                compile_.done.add_done_callback(functools.partial(self._deliver, compile_))
            else:
                self._compiled.move_to_end(key)
            compile_.copies += 1
            mine = MatcherFuture(compile_.lane)
            ready = compile_.done.done()
            if not ready:
                compile_.askers.append(mine)
        if ready:
            _deliver_copy(mine, compile_.done)
        return mine

    def forget(self, grammar: str, salt: str | None = None) -> None:
        """A choice failed in `grammar` (a parser or lexer limit, which the copies' shared lexer may have
        reached): its next request (of this cache salt) compiles it afresh."""
        with self._lock:
            self._drop((salt, grammar))

    def _drop(self, key: tuple[str | None, str]) -> None:
        if self._compiled.pop(key, None) is not None:
            self._compiled_chars -= len(key[1])

    def _evict(self) -> None:
        """Drops the least recently asked compiles past the bounds (the newest stays, however large)."""
        while len(self._compiled) > 1 and (len(self._compiled) > CACHED_GRAMMARS
                                           or self._compiled_chars > CACHED_GRAMMAR_CHARS):
            self._drop(next(iter(self._compiled)))

    def _first_matcher(self, key: tuple[str | None, str], compile_: _Compile) -> llguidance.LLMatcher:
        """The compile thread's job: the grammar's matcher, which is never advanced (askers get copies)."""
        with self._lock:
            if all(asker.cancelled() for asker in compile_.askers):  # every request went away meanwhile
                if self._compiled.get(key) is compile_:
                    self._drop(key)
                raise CancelledError
        return self._matcher(key[1])

    def _deliver(self, compile_: _Compile, done: Future) -> None:
        """The compile's callback: each request that asked while it ran gets its copy. The list is emptied:
        the kept compile holds none of their futures, whose matchers advance through whole replies."""
        with self._lock:
            askers, compile_.askers = compile_.askers, []
        for asker in askers:
            _deliver_copy(asker, done)

    def _vocabulary(self) -> llguidance.LLTokenizer:
        return vocabulary(*self._source)

    def _forced_specials(self) -> ForcedSpecials:
        return forced_specials(*self._source)

    def _matcher(self, grammar: str) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self._vocabulary(), grammar, log_level=0, limits=LIMITS)
        if matcher.is_error():
            raise GrammarError(f"the structured output's grammar does not compile: "
                               f"{brief(matcher.get_error())}")
        return matcher

    def masks(self, matchers: list[llguidance.LLMatcher | None],
              costly: list[tuple[int, float]] | None = None, owners: list | None = None,
              lanes: list | None = None) -> torch.Tensor:
        """(G, W) int32 host bitmask: row g the tokens matchers[g] allows next (None: every token the
        tokenizer has). Appends to `costly` (row, ms) the rows to strike (struck_rows; owners[g]: row g's
        request, lanes[g]: the compile its matcher copies), each row timed, budgeted as the step ran. A
        cheap step (rows x row_ms within PARALLEL_MASKS_MS) runs on the core's thread; a costly one on the
        executor where no lane holds over half its rows, else each lane's rows in turn on the mask threads
        (_costly_rows). The executor's step tells no row's time, and a matcher keeps its mask until its next
        token (a second computation reads it back in microseconds: a review found nothing struck there), so
        after an executor step over MAX_TOKEN_MS the next TIMED_AFTER_SLOW_STEP steps run on the mask
        threads, each row timed."""
        vocab = self._vocabulary().vocab_size
        own = (vocab + 31) // 32  # the tokenizer's words
        bits = torch.empty((len(matchers), own), dtype=torch.int32)  # a mask writes its whole row
        rows = [(m, g) for g, m in enumerate(matchers) if m is not None]
        if len(rows) < len(matchers):  # the None rows: every id of the tokenizer's
            free = torch.tensor([g for g, m in enumerate(matchers) if m is None])
            bits[free] = -1
            if vocab % 32:
                bits[free, -1] = (1 << vocab % 32) - 1
        # (llguidance.torch's fill_next_token_bitmask_par, whose module torch.compiles a function on import)
        base = bits.data_ptr()  # row g at base + g * own * 4 (a view per row, bits[g], cost 2 us on CI's CPU)
        calls = [(g, (m, base + g * own * 4, own * 4)) for m, g in rows]
        if not calls:
            pass  # (the executor refuses an empty list: each guided choice of the step ended the step before)
        elif self._timed_steps:
            self._timed_steps -= 1
            self._costly_rows(calls, bits, costly, owners, lanes, executor=False)
        elif self._executor is None or len(calls) * self.row_ms <= PARALLEL_MASKS_MS:
            self._judge(_lane_ms(calls), costly, owners, 1, lanes)
        else:
            self._costly_rows(calls, bits, costly, owners, lanes, executor=True)
        self._forced_specials().spell(matchers, bits)
        return bits[:, :self.words]  # a bad model's tokenizer has more ids than logits

    def _costly_rows(self, calls: list, bits: torch.Tensor, costly: list | None, owners: list | None,
                     lanes: list | None, executor: bool) -> None:
        """A costly step's masks ((row, call) each): on the executor (`executor`, where no lane holds over
        half the rows: its threads take the rows in blocks, so each lane's go in one; copies of one compile
        wait for each other there, slower than one thread), else each lane's rows in turn on one of
        _mask_threads threads, whole lanes a job packed by their last known ms (lane_jobs), the core's thread
        taking one.
        llguidance's mask lets go of the GIL while it computes (a review: two rows of ~30 ms compiled apart
        took 23 ms on 2 threads, 32 in turn), so the step takes about the wall its budget reads (struck_rows
        on the mask threads: a review measured 2-4x the budget, nothing struck, while such steps ran on the
        core's thread alone)."""
        by_lane: dict = defaultdict(list)  # lane -> its rows' (row, call), in the step's order
        for g, call in calls:
            by_lane[lane_key(g, owners, lanes)].append((g, call))
        if executor and 2 * max(map(len, by_lane.values())) <= len(calls):
            start = time.perf_counter()
            blocks = [(call[0], g) for lane in by_lane.values() for g, call in lane]
            self._executor.unsafe_compute_mask_ptr(blocks, bits.data_ptr(), calls[0][1][2], bits.shape[0])
            wall_ms = (time.perf_counter() - start) * 1e3
            self._measure([wall_ms * self._mask_threads / len(calls)])  # the rows' mean cost, as spread
            if wall_ms > MAX_TOKEN_MS:  # which rows? the next steps' timed
                self._timed_steps = TIMED_AFTER_SLOW_STEP
            return
        guess = [self._lane_costs.get(key, len(rows) * self.row_ms) for key, rows in by_lane.items()]
        first, *rest = lane_jobs(list(by_lane.values()), guess, self._mask_threads)
        futures = [self._timing_threads.submit(_lane_ms, job) for job in rest]
        try:
            took = _lane_ms(first)
        finally:
            wait(futures)  # every mask done (writing `bits`) before any error leaves this step
        for f in futures:
            took += f.result()
        ms_of = dict(took)
        self._lane_costs = {key: sum(ms_of[g] for g, _ in rows) for key, rows in by_lane.items()}
        self._judge(took, costly, owners, self._mask_threads, lanes)

    def _judge(self, took: list[tuple[int, float]], costly: list | None, owners: list | None, threads: int,
               lanes: list | None) -> None:
        """A step's (row, ms) of each mask, timed as it ran on `threads`: the rows to strike go to `costly`
        (struck_rows), those under MAX_TOKEN_MS into row_ms."""
        times = [(ms, g) for g, ms in took]  # (ms, row)
        if costly is not None:
            costly += struck_rows(times, owners, threads, lanes)
        self._measure([ms for ms, _ in times if ms <= MAX_TOKEN_MS])

    @functools.cached_property
    def _timing_threads(self) -> ThreadPoolExecutor:
        """The threads that time a costly step's lanes beside the core's (made at the first such step)."""
        return ThreadPoolExecutor(max(1, self._mask_threads - 1), thread_name_prefix="pagewalk-mask-timing")

    def _measure(self, cheap: list[float]) -> None:
        """The ms of a step's rows under MAX_TOKEN_MS (or the mean an executor step read): row_ms moves
        towards their mean. Every path measures (the executor's steps by their wall over the rows it spread),
        so one row held by a descheduled thread or a collector pass moves row_ms for a few steps only (a
        review: measured once in 64 executor steps, one such step kept cheap rows on the executor for ~700
        steps), and a step of costlier rows moves it at once (another: capped at 4x a step, 8 steps of 20 ms
        rows ran in turn before the executor took them)."""
        if cheap:
            measured = sum(cheap) / len(cheap)
            self.row_ms += ROW_COST_WEIGHT * (measured - self.row_ms) if self.row_ms else measured

    @staticmethod
    def accept(matcher: llguidance.LLMatcher, token: int) -> bool:
        """Advance `matcher` by the sampled `token`; -> whether the grammar is complete. GrammarError where
        the matcher refuses it: a token the mask did not allow is drawn where the model gives every allowed
        token probability 0 (the presets' -inf logits outside printable ASCII against a grammar of "café").
        """
        if not matcher.consume_token(token) or matcher.is_error():
            raise GrammarError(f"the structured output allows no token the model can produce here (token "
                               f"{token} was drawn outside it: {brief(matcher.get_error())})")
        return matcher.is_stopped()


@dataclass
class _Compile:
    """One grammar's compile: `done`, the future of its matcher; `askers`, the requests' futures that wait
    for it to finish; `copies`, how many requests it served; `lane`, its number (MatcherFuture.lane)."""

    done: Future | None = None
    askers: list[Future] = field(default_factory=list)
    copies: int = 0  # handed out (COPIES_PER_COMPILE)
    lane: int = field(default_factory=itertools.count().__next__)


class MatcherFuture(Future):
    """A request's matcher (Grammars.compile), and `lane`, the compile it copies. Copies of one compile share
    its lexer, and llguidance computes their masks one after another: its executor took 81-85 ms over four
    copies where one took 20 (a review), and 2 rows copied from one compile took 8.1-9.2 ms on 2 threads
    where 2 compiled apart took 4.1-4.6 and one 4.0 (an ambiguous grammar, this box). The step budget counts
    a lane's rows in turn, whichever requests they serve (_Step)."""

    def __init__(self, lane: int) -> None:
        super().__init__()
        self.lane = lane


def lane_jobs(lanes: list[list], costs: list[float], threads: int) -> list[list]:
    """Lanes (each a list of its rows' (row, call)) and their expected ms -> at most `threads` jobs of whole
    lanes, the costliest lane first into the job of the least ms, then of the fewest rows (lanes of no known
    cost yet spread by their rows), as the budget reads a step (_Step.wall;
    packed by rows alone, a review's 45 and 20 ms lanes shared a job beside one of three 9 ms rows, 66-70 ms
    a step against the budget's 47)."""
    jobs: list = [(0.0, 0, k, []) for k in range(max(1, min(threads, len(lanes))))]  # (ms, rows, k, calls)
    for n in sorted(range(len(lanes)), key=lambda n: (-costs[n], -len(lanes[n]), n)):  # the costliest first
        ms, rows, k, job = heapq.heappop(jobs)
        job.extend(lanes[n])
        heapq.heappush(jobs, (ms + costs[n], rows + len(lanes[n]), k, job))
    return [job for *_, k, job in sorted(jobs, key=lambda job: job[2])]


def _lane_ms(calls: list[tuple[int, tuple]]) -> list[tuple[int, float]]:
    """Writes one job's masks in turn ((row, call) each) -> (row, the ms it took) each."""
    return [(g, _mask_ms(call)) for g, call in calls]


def _mask_ms(call: tuple[llguidance.LLMatcher, int, int]) -> float:
    """Writes one row's mask (matcher, row address, row bytes) -> the ms it took."""
    matcher, address, nbytes = call
    start = time.perf_counter()
    matcher.unsafe_compute_mask_ptr(address, nbytes)
    return (time.perf_counter() - start) * 1e3


def _deliver_copy(mine: Future, compiled: Future) -> None:
    """Completes a request's future with a copy of the compiled matcher (or with the compile's error), unless
    the request went away (its future cancelled)."""
    if not mine.set_running_or_notify_cancel():
        return
    error = compiled.exception()
    if error is not None:  # GrammarError, llguidance's own
        mine.set_exception(_own_error(error))
    else:
        mine.set_result(compiled.result().deep_copy())


def _own_error(error: BaseException) -> BaseException:
    """A kept error as a new exception for one request: raising the kept one again would grow its traceback
    (and keep each raiser's frames) for as long as it is kept."""
    try:
        return type(error)(*error.args)
    except Exception:  # noqa: BLE001 -- an exception type that takes other arguments
        return GrammarError(str(error))


# tokenizer -> (its vocabulary, the vocabulary's ForcedSpecials), or the error reading it
_vocabularies: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_vocabularies_lock = threading.Lock()  # its first users (compile threads, the API's checks) build it once


def vocabulary(tokenizer, eos_token_ids) -> llguidance.LLTokenizer:
    """The tokenizer (server/model/tokenizer.py) as llguidance reads it, built once per tokenizer (~1 s for a
    128K-token tokenizer.json) for every user in the process; GrammarError where llguidance cannot read it,
    from then on at once."""
    return _read(tokenizer, eos_token_ids)[0]


def forced_specials(tokenizer, eos_token_ids) -> ForcedSpecials:
    """The vocabulary's special tokens, for the masks that force one (forced_specials.py): built with it."""
    return _read(tokenizer, eos_token_ids)[1]


def _read(tokenizer, eos_token_ids) -> tuple[llguidance.LLTokenizer, ForcedSpecials]:
    with _vocabularies_lock:
        if tokenizer not in _vocabularies:
            _vocabularies[tokenizer] = _built_vocabulary(tokenizer, eos_token_ids)
        read = _vocabularies[tokenizer]
    if isinstance(read, GrammarError):
        raise _own_error(read)
    return read


def _built_vocabulary(tokenizer, eos_token_ids
                      ) -> tuple[llguidance.LLTokenizer, ForcedSpecials] | GrammarError:
    """Its own ids only: the 128K empty padding ids of the bench preset's byte vocabulary made every mask
    ~0.5 ms a row."""
    try:
        vocab = llguidance.LLTokenizer(_llguidance_source(tokenizer), eos_token=sorted(eos_token_ids))
    except Exception as e:  # noqa: BLE001 -- llguidance raises plain exceptions for tokenizers it cannot read
        return GrammarError(f"structured outputs are unavailable: llguidance cannot read this model's "
                            f"tokenizer ({type(e).__name__}: {brief(str(e))})")
    return vocab, ForcedSpecials(vocab)


def check(vocab: llguidance.LLTokenizer, grammar: str, forced: ForcedSpecials) -> str | None:
    """Why `grammar` cannot serve a request over `vocab` (None: it can): it does not compile within LIMITS,
    allows no token, or fails within its first CHECKED_TOKENS tokens (following its lowest allowed id each
    time, in the mask the core computes: `forced`, the vocabulary's ForcedSpecials; a parser limit bites
    where a wide choice or object is first predicted, the first token when it is the grammar's top level).
    Best effort: a limit that bites further in ends the choice with an error."""
    matcher = llguidance.LLMatcher(vocab, grammar, log_level=0, limits=LIMITS)
    bits = torch.empty((1, (vocab.vocab_size + 31) // 32), dtype=torch.int32)
    for _ in range(CHECKED_TOKENS):
        if matcher.is_error():
            return brief(matcher.get_error())
        if matcher.is_stopped():
            return None
        matcher.unsafe_compute_mask_ptr(bits.data_ptr(), bits.numel() * 4)
        forced.spell([matcher], bits)
        allowed = int.from_bytes(bits.numpy().tobytes(), "little")  # bit t: token t
        if matcher.is_error():
            return brief(matcher.get_error())
        if not allowed:
            return "the grammar allows no token"
        matcher.consume_token((allowed & -allowed).bit_length() - 1)
    return brief(matcher.get_error()) if matcher.is_error() else None


@dataclass
class _Step:
    """A step's mask rows as the budget reads them: each row's ms, request and lane, and the wall ms a set
    of rows holds the step for: each lane's rows one after another (copies of one compile share its lexer:
    MatcherFuture; a request's choices are copies of one), the lanes whole on `threads` (the executor's, 1
    on the core's thread alone), the longest first on the least loaded."""

    ms: dict[int, float]
    owner: dict[int, object]
    lane: dict[int, object]
    threads: int

    def wall(self, rows: list[int]) -> float:
        jobs: dict = defaultdict(float)  # lane -> its rows' ms
        for g in rows:
            jobs[self.lane[g]] += self.ms[g]
        if len(jobs) <= 1:  # most requests' own rows
            return sum(jobs.values())
        loads = [0.0] * self.threads  # a heap: the least loaded thread first
        for ms in sorted(jobs.values(), reverse=True):
            heapq.heapreplace(loads, loads[0] + ms)
        return max(loads)


def struck_rows(times: list[tuple[float, int]], owners: list | None = None, threads: int = 1,
                lanes: list | None = None) -> list[tuple[int, float]]:
    """A step's (ms, row) of each mask, timed one by one, `threads`, those it ran on (1: the core's thread),
    `owners`, each row's request (None: a request each), and `lanes`, each row's compile (None: its
    request's) -> (row, its request's ms) of the rows it strikes. The rows of a request count together (its n
    choices, a completion's prompts: 40 rows of 2 ms held every step 80 ms, never struck, in a review), the
    rows of a lane in turn, and any set of rows holds the step as `threads` take it (_Step; by the step's
    ratio or a serial share, reviews found requests struck beside a costly row or more than needed): each
    request over MAX_TOKEN_MS is struck, then, while the rest is over MAX_TOKEN_MS, requests of COSTLY_ROW_MS
    or more (_strikes: the costliest, or the longest lane's while it alone holds the step), unless the
    cheaper ones alone are over it."""
    if sum(ms for ms, _ in times) <= MAX_TOKEN_MS:
        return []  # no set of these rows can hold the step longer than their sum
    step = _Step({g: ms for ms, g in times}, {g: g if owners is None else owners[g] for _, g in times},
                 {g: lane_key(g, owners, lanes) for _, g in times}, max(1, threads))
    requests: dict = {}  # request -> its rows, in the step's order
    for g, owner in step.owner.items():
        requests.setdefault(owner, []).append(g)
    walls = {key: step.wall(rows) for key, rows in requests.items()}
    struck = [key for key in requests if walls[key] > MAX_TOKEN_MS]
    rest = [key for key in requests if walls[key] <= MAX_TOKEN_MS]
    cheap = [g for key in rest if walls[key] < COSTLY_ROW_MS for g in requests[key]]
    if step.wall(cheap) <= MAX_TOKEN_MS:  # else slow by its cheap rows: striking cannot fit the step
        struck += _strikes(step, requests, walls, [key for key in rest if walls[key] >= COSTLY_ROW_MS],
                           set(rest))
    return [(g, walls[key]) for key in struck for g in requests[key]]


def _strikes(step: _Step, requests: dict, walls: dict, costly: list, rest: set) -> list:
    """The `costly` requests (each under MAX_TOKEN_MS alone) struck until the `rest` fit MAX_TOKEN_MS: the
    costliest first, but from the longest lane while it alone holds the step (a lane over MAX_TOKEN_MS, or
    of at least the rows' share of a thread: striking elsewhere leaves its wall as it is). Reviews found
    each rule wrong alone: on one thread a 5 ms request of the longest lane struck beside a 49 ms one whose
    strike alone fitted; three 20 ms copies of one compile beside a 45 ms request, the 45 ms one struck
    first for nothing. A request whose rows span two lanes (a completion's prompts across a compile's
    rollover) counts by its own wall, not by what its strike frees in each lane. Each
    request and lane is handled a bounded number of times a strike (a review: 0.55 s over 1024 rows)."""
    lane_ms: dict = defaultdict(float)  # lane -> the ms of its rows not struck
    for key in rest:
        for g in requests[key]:
            lane_ms[step.lane[g]] += step.ms[g]
    total = sum(lane_ms.values())
    order = sorted(costly, key=lambda k: (walls[k], requests[k][-1]), reverse=True)  # costliest first
    by_lane: dict = defaultdict(deque)  # lane -> its costly requests, costliest first
    for key in order:
        for lane in dict.fromkeys(step.lane[g] for g in requests[key]):
            by_lane[lane].append(key)
    everyone = deque(order)
    tick = itertools.count()  # ties broken by age, never by lane (lanes of mixed key types do not compare)
    longest = [(-ms, next(tick), lane) for lane, ms in lane_ms.items()]  # a heap, stale entries kept
    heapq.heapify(longest)
    struck: list = []
    while rest:
        while -longest[0][0] != lane_ms[longest[0][2]]:  # a lane's entry from before a strike
            heapq.heappop(longest)
        lane = longest[0][2]
        # the longest lane and the rows' sum over the threads bound the wall from below: a step far over the
        # budget strikes its way down without scheduling its rows each time (~0.2 ms a schedule of 256)
        if (lane_ms[lane] <= MAX_TOKEN_MS and total / step.threads <= MAX_TOKEN_MS
                and step.wall([g for k in rest for g in requests[k]]) <= MAX_TOKEN_MS):
            return struck
        # a lane over the budget alone must lose a row (a review: beside it a 49 ms request was struck first)
        holds = lane_ms[lane] > MAX_TOKEN_MS or lane_ms[lane] * step.threads >= total
        key = _first_left(by_lane[lane], rest) if holds else None
        key = key if key is not None else _first_left(everyone, rest)
        if key is None:
            return struck
        rest.discard(key)
        struck.append(key)
        for g in requests[key]:
            lane_ms[step.lane[g]] -= step.ms[g]
            total -= step.ms[g]
        for lane in dict.fromkeys(step.lane[g] for g in requests[key]):
            heapq.heappush(longest, (-lane_ms[lane], next(tick), lane))
    return struck


def _first_left(queue: deque, rest: set):
    """The first of `queue` still in `rest` (the ones before it, struck, dropped), or None."""
    while queue and queue[0] not in rest:
        queue.popleft()
    return queue[0] if queue else None


def lane_key(g: int, owners: list | None, lanes: list | None) -> tuple:
    """Row g's lane: its compile's (lanes[g]), else its request's (owners[g], else its own)."""
    if lanes is not None and lanes[g] is not None:
        return "compile", lanes[g]
    return "request", g if owners is None else owners[g]


def too_costly(took_ms: float) -> str:
    return (f"the structured output's grammar took {took_ms:.0f} ms over one token; a step's grammars may "
            f"take {MAX_TOKEN_MS:.0f} ms in all, which every stream waits for")


def brief(error: str) -> str:
    """llguidance's message without the parser state it dumps after its first line (which quotes the
    grammar and the tokens so far), at most MAX_ERROR_CHARS. A regex's parse error says why on a line of
    its own below the caret ("...: regex parse error:" / "    (a" / "    ^" / "error: unclosed group"): that
    line is kept (a review: the message ended at "regex parse error:")."""
    first, *rest = error.strip().split("\n")
    reason = next((line for line in rest if line.startswith("error: ")), None)
    if first.endswith(":") and reason is not None:
        first = f"{first} {reason.removeprefix('error: ')}"
    return first if len(first) <= MAX_ERROR_CHARS else first[:MAX_ERROR_CHARS] + "..."


def _llguidance_source(tokenizer):
    """What llguidance.LLTokenizer reads: a `tokenizers` JSON string, or a TokenizerWrapper of token bytes."""
    if isinstance(tokenizer, HFTokenizer):
        return tokenizer.to_json()
    if isinstance(tokenizer, ByteTokenizer):
        return llguidance.TokenizerWrapper(_ByteVocabulary(tokenizer))
    raise TypeError(f"no llguidance vocabulary for {type(tokenizer).__name__}")


class _ByteVocabulary:
    """The byte tokenizer as llguidance.TokenizerWrapper reads it: each id's bytes (the specials' empty), the
    special ids, and an encoder of bytes. The ids past NUM_IDS (unused) are left out."""

    def __init__(self, tokenizer: ByteTokenizer) -> None:
        self.eos_token_id = ByteTokenizer.EOS
        self.bos_token_id = ByteTokenizer.BOS
        self.tokens = tokenizer.token_bytes
        self.special_token_ids = [ByteTokenizer.PAD, ByteTokenizer.BOS, ByteTokenizer.EOS]

    def __call__(self, text: bytes) -> list[int]:
        return [b + ByteTokenizer.OFFSET for b in text]
