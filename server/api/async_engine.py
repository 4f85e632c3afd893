"""AsyncEngine: the API process's side of the engine: admission, one output stream per request, and the
per-choice work the core does not do (detokenization, stop strings, logprob token strings, metrics).

The core runs behind a CoreClient (its own process when serving, a thread in unit tests); this class is the
same over both. `generate` registers the request, sends it to the core and awaits its OutputChannel. The
client's thread hands every StepUpdate to `_on_step`, which updates the stats and passes each request's
SeqUpdates to that request's event loop, where `_apply` turns them into RequestOutputs. A stop string ends a
choice here and aborts it in the core. If the core dies, every request in flight ends with an error, /health
answers 503 and `on_core_death` is called (the CLI stops the server with a non-zero exit).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from server.api.choice_stream import ChoiceStream
from server.api.metrics import EngineMetrics
from server.api.output_channel import OutputChannel, call_soon
from server.api.outputs import ChoiceDelta, RequestOutput
from server.engine.core_client import (
    STOP_WAIT_S,
    AttachedCoreClient,
    CoreClient,
    ProcessCoreClient,
    ThreadCoreClient,
)
from server.engine.engine import EngineConfig
from server.engine.outputs import CoreStats, EngineRequest, SeqUpdate, StepUpdate
from server.engine.sampling_params import SamplingParams
from server.engine.wire import Abort, FromCore, Query, Reply
from server.model.loader import load_tokenizer, sampling_defaults

logger = logging.getLogger("pagewalk.engine")

ABORT_WAIT_S = 5.0  # after the drain deadline, how long the aborts of what is left may take
# ... and longer while the core keeps using CPU (a step longer than ABORT_WAIT_S: a long prompt of a real
# checkpoint on the CPU), at least this share of a core, up to ABORT_WAIT_MAX_S in all; a hung core (a
# stopped process, a deadlock) uses none
CORE_WORKING_SHARE = 0.1
ABORT_WAIT_MAX_S = 30.0
# An API server of several (--api-server-count) is killed by its supervisor DRAIN_MARGIN_S (10 s) past
# --shutdown-timeout: its wait stops short of that, so it kills a core past it and exits with errors sent
ATTACHED_ABORT_WAIT_MAX_S = 7.0
RESERVED_POLL_S = 0.05  # how often a drain re-reads the admission's reservations


class RequestRejected(Exception):
    """The request cannot be accepted: `status` is the HTTP status the API answers with."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


@dataclass(frozen=True)
class ApiServer:
    """Which of `count` API servers this process is, and the core they share (count 1: its own core)."""

    index: int = 0
    count: int = 1
    core_address: str = ""
    core_pid: int = 0

    @property
    def records_core_metrics(self) -> bool:
        """The core's own figures (preemptions, prefix-cache counts, KV use) are counted by one server."""
        return self.index == 0


@dataclass(eq=False)
class LiveRequest:
    """A request accepted here and not yet ended by the core."""

    request_id: str
    prompt_token_ids: list[int]
    loop: asyncio.AbstractEventLoop
    channel: OutputChannel
    choices: list[ChoiceStream]
    arrival_time: float
    open_in_core: int  # choices the core has not ended yet (each ends there exactly once)
    last_token_time: list[float | None] = field(default_factory=list)
    scheduled_time: float | None = None  # the core's first step that ran it (from its first update)
    first_token_time: float | None = None  # of any choice
    error: str | None = None
    error_kind: str | None = None  # SeqUpdate.error_kind of the error
    closed: bool = False  # the stream has its last output
    label: tuple[str, int] = ("", 0)  # the id its client sees, and that response's index of its choice 0


class AsyncEngine:
    def __init__(self, config: EngineConfig, in_process: bool = False, log_level: str = "info",
                 api_server: ApiServer | None = None, tokenizer=None):
        """`api_server`: this process is one of several API servers sharing a core that their supervisor
        started; else this process starts its own core (in a process, or on a thread with `in_process`).
        `tokenizer`: config's tokenizer, loaded already (start-up loads it before it binds the port)."""
        self.config = config
        self.api_server = api_server or ApiServer()
        self.tokenizer = tokenizer or load_tokenizer(config.model, config.tokenizer, config.chat_template)
        # generation_config.json's sampling values, for the fields a request leaves out
        self.sampling_defaults = checked_sampling_defaults(config.model)
        if api_server is not None:
            self.client: CoreClient = AttachedCoreClient(api_server.core_address, api_server.core_pid)
        else:
            self.client = ThreadCoreClient(config) if in_process else ProcessCoreClient(config, log_level)
        try:
            self._set_up(config)
        except BaseException:  # a signal (cli's Terminated) or an error now: a core of ours must not outlive
            # us (killed at once); a shared one is only left
            self.client.close(timeout=STOP_WAIT_S, hung=api_server is None)
            raise

    def _set_up(self, config: EngineConfig) -> None:
        """The state around the client's core, from its facts."""
        info = self.info = self.client.info
        self.model_name, self.device, self.dtype = info.model, info.device, info.dtype
        self.model_name = (config.served_model_name or (info.model,))[0]
        self.attention_backend, self.max_model_len = info.attention_backend, info.max_model_len
        self.vocab_size, self.capacity_tokens = info.vocab_size, info.capacity_tokens
        self.metrics = EngineMetrics(self.model_name, self.attention_backend, self.device, self.dtype)
        self.on_core_death: Callable[[str], None] | None = None
        self.dead: str | None = None  # why the core is gone
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified when the last live request ends
        self._live: dict[str, LiveRequest] = {}
        self._stats = CoreStats(0, 0, info.num_blocks - 1, 0, 0, 0.0)
        self._running_here = 0  # of the core's running requests, this process's
        # the waiting bound, shared out exactly (the parts sum to it; the command line holds it at least one
        # a server): each API server admits up to its part, and its refusals name the part and the setting
        count, index = self.api_server.count, self.api_server.index
        self.max_waiting = config.max_waiting // count + (index < config.max_waiting % count)
        self.waiting_bound = (f"max_waiting={config.max_waiting}" if count == 1 else
                              f"this API server's {self.max_waiting} of max_waiting={config.max_waiting}")
        # the prompts one request may bring: the smallest part, so that every server gives one answer (the
        # kernel picks the server; with unequal parts a request was a 400 on one and served by another)
        self.max_request_prompts = config.max_waiting // count
        self.request_prompts_bound = self.waiting_bound if count == 1 else (
            f"the smallest API server's share, {self.max_request_prompts} of "
            f"max_waiting={config.max_waiting}")
        # the core's all-time (prefix queries, prefix hits, preemptions, steps, prompt steps) last counted
        # into the metrics: the counters advance by their change, so that a server attaching late counts the
        # core's whole history
        self._core_counts = (0, 0, 0, 0, 0)
        self._accepting = True
        self._serving_admitted = True  # False once the drain's wait is over: _drain_ended
        # queue places the API's admission (server/api/admission.py) holds for prompts of admitted
        # requests not registered here yet (a window's later prompts): the drain waits for them too
        self.reserved = 0
        self._started = self._closed = False
        self._calls: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._call_ids = itertools.count()
        self._token_text: dict[int, str] = {}

    # ---- lifecycle --------------------------------------------------------------------------------
    def start(self) -> None:
        if not self._started:
            self._started = True
            self.client.start(self._on_message, self._on_death)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop accepting; let in-flight requests finish for up to `timeout` s, abort the rest; stop the
        core. Blocking: the app runs it on a thread so streams keep flowing while it drains."""
        with self._lock:
            self._accepting = False
            if self._closed:
                return
            self._closed = True
        hung = False
        if self._started:
            self._wait_idle(timeout)
            with self._lock:
                self._serving_admitted = False
                left = list(self._live)
            for rid in left:
                self.client.send(Abort(rid))
            unanswered, waited = self._wait_for_aborts()
            hung = unanswered > 0  # a working core answers an abort within a step
            if hung:
                self.dead = (f"the engine core is hung: {unanswered} aborts unanswered in "
                             f"{waited:.0f} s; it was killed")
                logger.error("%s", self.dead)
        self.client.close(timeout=STOP_WAIT_S, hung=hung)
        if hung:
            self._fail_everything(self.dead)
        with self._lock:  # a query sent behind the Shutdown gets no reply: it is answered here
            calls, self._calls = self._calls, {}
        for loop, future in calls.values():
            call_soon(loop, _resolve, future, None, RequestRejected(503, "the engine core has stopped"))

    def _wait_for_aborts(self) -> tuple[int, float]:
        """Waits for the drain's aborts to be answered: ABORT_WAIT_S, and on while the core used at least
        CORE_WORKING_SHARE of a core over the last ABORT_WAIT_S (working through a long step, not hung), up
        to ABORT_WAIT_MAX_S (ATTACHED_ABORT_WAIT_MAX_S for one of several API servers) -> (aborts
        unanswered, seconds waited)."""
        waited, cpu = 0.0, self.client.core_cpu_seconds()
        most = ATTACHED_ABORT_WAIT_MAX_S if isinstance(self.client, AttachedCoreClient) else ABORT_WAIT_MAX_S
        while True:
            self._wait_idle(ABORT_WAIT_S)
            waited += ABORT_WAIT_S
            with self._lock:
                unanswered = len(self._live) if self.dead is None else 0
            used, cpu = _used(cpu, self.client.core_cpu_seconds())
            if not unanswered or used < CORE_WORKING_SHARE * ABORT_WAIT_S or waited >= most:
                return unanswered, waited
            logger.info("the engine core is still working (%.1f s of CPU in %.0f s): its %d aborts wait",
                        used, ABORT_WAIT_S, unanswered)

    def _wait_idle(self, timeout: float) -> None:
        """Until no request is live and no admitted prompt is still to come (or the core died, or
        `timeout` s). The reservations change on the event loop's thread, unnotified: polled."""
        deadline = time.monotonic() + timeout
        with self._idle:
            while ((self._live or self.reserved) and self.dead is None
                   and (left := deadline - time.monotonic()) > 0):
                # a wait longer than threading.TIMEOUT_MAX (~292 years) overflows: `timeout` may be any
                # --shutdown-timeout
                self._idle.wait(min(left, RESERVED_POLL_S if self.reserved else threading.TIMEOUT_MAX))

    def _drain_ended(self) -> bool:
        """Under the lock: the drain's wait is over (shutdown aborts what runs). An admitted request's prompt
        that has not started then ends "abort" as they do, where a 503 failed the whole request, the choices
        already generated with it (a request of several prompts, windowed: a review)."""
        return not self._accepting and not self._serving_admitted and self.dead is None

    # ---- admission --------------------------------------------------------------------------------
    def check_admissible(self, num_prompt_tokens: int, params: SamplingParams,
                         admitted: bool = False) -> None:
        """Raise RequestRejected(status, message, param) if a request of this size cannot be served now.
        `admitted`: a prompt of a request already admitted (it holds a reservation), which a drain still
        serves until its wait is over, and which a full queue does not refuse: its place is the one
        reserved (preempted requests may have refilled the queue since its status line went out)."""
        if self.dead is not None:
            raise RequestRejected(503, f"the engine is not running: {self.dead}")
        if not self._accepting and not (admitted and self._serving_admitted):
            raise RequestRejected(503, "the engine is shutting down")
        if num_prompt_tokens < 1:
            raise RequestRejected(400, "the prompt must contain at least one token", "prompt")
        if params.n > self.config.max_num_seqs:
            raise RequestRejected(
                400, f"n ({params.n}) exceeds max_num_seqs ({self.config.max_num_seqs})", "n")
        if params.prompt_logprobs is not None and num_prompt_tokens > self.config.max_num_batched_tokens:
            raise RequestRejected(
                400, f"prompt logprobs come from one forward over the prompt, of at most "
                f"max_num_batched_tokens ({self.config.max_num_batched_tokens}) tokens; this prompt has "
                f"{num_prompt_tokens}", "prompt_logprobs")
        total = num_prompt_tokens + params.max_tokens
        positions = total - 1  # KV positions a choice takes: its last token, sampled, none (the core's rule)
        if positions > self.max_model_len:
            raise RequestRejected(
                400, f"prompt ({num_prompt_tokens} tokens) + max_tokens ({params.max_tokens}) = {total} "
                f"tokens exceeds the maximum context length of {self.max_model_len} tokens by more than the "
                f"last token sampled", "max_tokens")
        if positions * params.n > self.capacity_tokens:
            raise RequestRejected(
                400, f"prompt ({num_prompt_tokens} tokens) + max_tokens ({params.max_tokens}) - 1 = "
                f"{positions} KV positions per choice x n={params.n} = {positions * params.n} exceeds the "
                f"whole KV cache capacity of {self.capacity_tokens} tokens", "max_tokens")
        if not admitted:
            self._refuse_if_queue_full(self._num_waiting(), 1)

    def reserve_places(self, prompt_lengths: list[int], params: SamplingParams) -> None:
        """Admission of one request's prompts (server/api/admission.py): each admissible now and room in
        the queue for all, then their places reserved -- one step under the lock the drain reads the
        reservations under, so a drain that starts meanwhile either waits for them or refused them.
        Raises RequestRejected (503, 400, 429)."""
        with self._lock:
            for n in prompt_lengths:
                self.check_admissible(n, params)
            self._refuse_if_queue_full(self._num_waiting() + self.reserved, len(prompt_lengths))
            self.reserved += len(prompt_lengths)

    def _refuse_if_queue_full(self, waiting: int, incoming: int) -> None:
        if waiting + incoming > self.max_waiting:
            raise RequestRejected(429, f"too many requests waiting ({waiting}, {self.waiting_bound}); "
                                  "retry later")

    @property
    def accepting(self) -> bool:
        """New requests are taken: no drain has begun."""
        return self._accepting

    def last_core_stats(self) -> CoreStats:
        """The core's stats as its last step reported them."""
        return self._stats

    @property
    def num_prefill_tokens(self) -> int:
        """Prompt (and recomputed) tokens the core ran, all time: the core's count, so every API server
        gives the same figure, whenever it attached."""
        return self._stats.prefill_tokens

    def _num_waiting(self) -> int:
        """Requests accepted here and not running in the core: queued there, or on their way to it."""
        return max(0, len(self._live) - self._running_here)

    def _waiting_everywhere(self) -> int:
        """Requests waiting, as /health and the gauge report them: this process's (its in-transit ones and
        the prompts admitted and not handed over yet, a request's held behind its window included: a
        review), or the core's count when that is larger (other API servers' requests)."""
        return max(self._stats.waiting, self._num_waiting() + self.reserved)

    # ---- requests ---------------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       admitted: bool = False, group: str | None = None,
                       label: tuple[str, int] | None = None,
                       arrival_time: float | None = None) -> AsyncIterator[RequestOutput]:
        """Stream of RequestOutputs, the last with finished=True; what arrived while the reader was busy
        comes merged into one. Closing the stream early aborts the request. `admitted`: as
        check_admissible's; `group`: EngineRequest.group; `label`: the id the client sees for it and its
        response's index of this request's choice 0 (the block map names its choices so), else its own;
        `arrival_time` (time.monotonic()): its HTTP request's, where it waited for its turn before (a
        request's later prompts), else now: the latencies count from it."""
        try:
            params.validate(self.vocab_size)
        except ValueError as e:
            raise RequestRejected(400, str(e)) from None
        loop = asyncio.get_running_loop()
        live = LiveRequest(request_id, list(prompt_token_ids), loop, OutputChannel(loop),
                           [ChoiceStream(i, params, self.tokenizer, self._text_of, prompt_token_ids)
                            for i in range(params.n)],
                           arrival_time or time.monotonic(), params.n, [None] * params.n,
                           label=label or (request_id, 0))
        with self._lock:
            drain_ended = admitted and self._drain_ended()
            if not drain_ended:
                self._register(live, params, admitted, group)
        if drain_ended:  # its own prompts that ran ended "abort" at the deadline too
            for _ in range(params.n):
                self.metrics.finished("abort")
            self._observe_finished(live, time.monotonic())  # every request counted finished is observed
            yield RequestOutput(request_id, live.prompt_token_ids,
                                [ChoiceDelta(i, "", [], None, "abort", None) for i in range(params.n)], True)
            return
        finished = False
        try:
            while not finished:
                out = await live.channel.get_merged()
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.abort(request_id)

    def _register(self, live: LiveRequest, params: SamplingParams, admitted: bool, group: str | None) -> None:
        """Under the lock: check_admissible, then `live` is live and sent to the core; RequestRejected if
        it cannot be served now."""
        request_id = live.request_id
        self.check_admissible(len(live.prompt_token_ids), params, admitted)
        if request_id in self._live:
            raise RequestRejected(400, f"request id {request_id!r} is already in use")
        self._live[request_id] = live
        # sent under the lock that shutdown copies _live under: its Abort of this request comes after the add
        # (the core ignores an Abort of an id it does not hold, and the drain would then take a working core
        # for a hung one)
        try:
            self.client.send(EngineRequest(request_id, live.prompt_token_ids, params, live.arrival_time,
                                           group))
        except BaseException:  # never reached the core: nothing will ever end it there
            del self._live[request_id]
            if not self._live:  # the drain's wait ends with the last
                self._idle.notify_all()
            raise

    def abort(self, request_id: str) -> None:
        """Abort a request (its blocks are freed at the core's next turn). Unknown ids are ignored."""
        with self._lock:
            known = request_id in self._live
        if known and self.dead is None:
            self.client.send(Abort(request_id))

    async def kv_snapshot(self) -> dict:
        """The core's block map (EngineCore.kv_snapshot; the core builds it only when asked), each choice
        named as its client sees it: its response's id and choice index (its label), from the requests live
        when it was asked or answered (one may end in between: a review saw it under its engine id). Where
        two live requests under one client id would name a choice alike, both keep their engine ids."""
        labels = self._labels()
        snapshot = await self._query("kv_snapshot")
        labels |= self._labels()
        seqs = snapshot.get("seqs", ())
        named = {id(seq): _client_name(seq, labels.get(seq.get("request_id"))) for seq in seqs}
        engine_ids: dict[tuple, set] = defaultdict(set)  # a client's name -> the engine requests it names
        for seq in seqs:
            engine_ids[named[id(seq)]].add(seq.get("request_id"))
        clashing = {rid for ids in engine_ids.values() if len(ids) > 1 for rid in ids}
        for seq in seqs:
            if seq.get("request_id") in labels and seq.get("request_id") not in clashing:
                seq["request_id"], seq["index"] = named[id(seq)]
        return snapshot

    def _labels(self) -> dict[str, tuple[str, int]]:
        with self._lock:
            return {request_id: live.label for request_id, live in self._live.items()}

    async def core_stats(self) -> dict:
        """The core's stats now (CoreStats as a dict), asked of the core itself."""
        return await self._query("stats")

    async def _query(self, name: str) -> dict:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:  # the check and the registration together: _on_death takes the calls under it
            if self.dead is not None or not self._started or self._closed:
                raise RequestRejected(503, "the engine core is not running")
            call_id = next(self._call_ids)
            self._calls[call_id] = (loop, future)
        self.client.send(Query(call_id, name))
        return await future

    def health(self) -> dict:
        with self._lock:
            s, waiting, accepting = self._stats, self._waiting_everywhere(), self._accepting
        status = "dead" if self.dead is not None else "ok" if accepting else "shutting_down"
        info = self.info
        return {
            "status": status, "model": self.model_name, "device": self.device, "dtype": self.dtype,
            "attention_backend": self.attention_backend, "cuda_graphs": info.cuda_graphs,
            "decoder_ops": info.decoder_ops, "kernels_refused": list(info.kernels_refused),
            "engine_core": self.client.mode, "api_servers": self.api_server.count,
            "kv_cache": {"block_size": info.block_size, "num_blocks": info.num_blocks,
                         "free_blocks": s.free_blocks, "used_blocks": s.used_blocks,
                         "cached_blocks": s.cached_blocks},
            "running": s.running, "waiting": waiting,
        }

    # ---- the client's thread ----------------------------------------------------------------------
    def _on_message(self, msg: FromCore) -> None:
        if isinstance(msg, StepUpdate):
            self._on_step(msg)
        elif isinstance(msg, Reply):
            with self._lock:
                call = self._calls.pop(msg.call_id, None)
            if call is not None:
                call_soon(call[0], _resolve, call[1], msg.value, None)

    def _on_step(self, step: StepUpdate) -> None:
        s = step.stats
        batches: dict[asyncio.AbstractEventLoop, list[tuple[LiveRequest, SeqUpdate]]] = {}
        loop = items = None  # the last update's loop and its batch (serving: one loop for all)
        with self._lock:
            self._stats = s
            self._running_here = step.client_running
            live_map = self._live
            for u in step.updates:
                live = live_map.get(u.request_id)
                if live is None:
                    continue
                if u.finish_reason is not None:
                    live.open_in_core -= 1
                    if live.open_in_core == 0:
                        del live_map[u.request_id]
                if live.loop is not loop:
                    loop = live.loop
                    items = batches.get(loop)
                    if items is None:
                        items = batches[loop] = []
                items.append((live, u))
            if not live_map:
                self._idle.notify_all()
            waiting = self._waiting_everywhere()
        for loop, items in batches.items():
            call_soon(loop, self._apply, items)
        if self.api_server.records_core_metrics:  # after the tokens are handed on: they never wait on it
            self._record_core_metrics(s, waiting)

    def _record_core_metrics(self, s: CoreStats, waiting: int) -> None:
        m = self.metrics
        m.num_requests_running.set(s.running)
        m.num_requests_waiting.set(waiting)
        m.kv_cache_usage_perc.set(s.used_blocks / max(1, self.info.num_blocks - 1))
        queries, hits, preemptions, steps, prompt_steps = self._core_counts
        m.prefix_cache_queries.inc(s.prefix_queries - queries)
        m.prefix_cache_hits.inc(s.prefix_hits - hits)
        m.num_preemptions.inc(s.preemptions - preemptions)
        m.engine_steps["prompt"].inc(s.prompt_steps - prompt_steps)
        m.engine_steps["decode"].inc(s.steps - steps - (s.prompt_steps - prompt_steps))
        if s.num_prefill_tokens or s.num_decode_tokens:  # the step this update reports (an idle one: none)
            m.iteration_tokens.observe(s.num_prefill_tokens + s.num_decode_tokens)
        self._core_counts = (s.prefix_queries, s.prefix_hits, s.preemptions, s.steps, s.prompt_steps)

    def _on_death(self, reason: str) -> None:
        error = f"the engine core died ({reason})"
        self.dead = error
        self._fail_everything(error)
        if self.on_core_death is not None:
            self.on_core_death(error)

    def _fail_everything(self, error: str) -> None:
        """The core is gone: every live request and every pending query fails with `error`."""
        with self._lock:
            lives = list(self._live.values())
            self._live.clear()
            self._idle.notify_all()
            calls, self._calls = self._calls, {}
        for live in lives:
            call_soon(live.loop, self._fail, live, error)
        for loop, future in calls.values():
            call_soon(loop, _resolve, future, None, RequestRejected(503, error))

    # ---- each request's event loop ----------------------------------------------------------------
    def _apply(self, items: list[tuple[LiveRequest, SeqUpdate]]) -> None:
        outputs: dict[LiveRequest, list[ChoiceDelta]] = {}
        ending: set[LiveRequest] = set()  # a choice of theirs finished in this call
        now = time.monotonic()
        m = self.metrics
        itl = m.inter_token_latency.observe
        num_tokens = 0
        for live, u in items:
            if live.closed:
                continue
            try:
                delta, abort = live.choices[u.index].apply(u)
            except Exception as e:  # a detokenizer failure fails this request only
                logger.exception("request %s: could not process its tokens", live.request_id)
                # the other choices' deltas of this call go out first, in the failure's final output
                self._fail(live, f"{type(e).__name__}: {e}", outputs.pop(live, []))
                self.abort(live.request_id)
                continue
            if delta is None:
                continue
            if abort:
                self.client.send(Abort(live.request_id, u.index))
            if u.scheduled_time is not None and live.scheduled_time is None:
                live.scheduled_time = u.scheduled_time
                m.request_queue_time.observe(max(0.0, u.scheduled_time - live.arrival_time))
                if u.received_time is not None:
                    m.request_handoff_time.observe(max(0.0, u.received_time - live.arrival_time))
            if delta.token_ids:
                num_tokens += len(delta.token_ids)
                last_times = live.last_token_time
                last = last_times[u.index]
                if last is None:
                    m.time_to_first_token.observe(now - live.arrival_time)
                else:
                    itl(now - last)
                last_times[u.index] = now
                if live.first_token_time is None:
                    live.first_token_time = now
                    # counted once its prefill has run, as vLLM's prompt tokens: a request aborted or failed
                    # while it waits was never processed
                    m.prompt_tokens.inc(len(live.prompt_token_ids))
                    if live.scheduled_time is not None:
                        m.request_prefill_time.observe(max(0.0, now - live.scheduled_time))
            if delta.finish_reason is not None:
                m.finished(delta.finish_reason)
                ending.add(live)
            if u.error is not None:
                live.error, live.error_kind = u.error, u.error_kind
            deltas = outputs.get(live)
            if deltas is None:
                outputs[live] = [delta]
            else:
                deltas.append(delta)
        if num_tokens:
            m.generation_tokens.inc(num_tokens)
        for live, deltas in outputs.items():
            # closed here: _fail ended its other choices in this call
            finished = live.closed or (live in ending and all(c.finished for c in live.choices))
            if finished:
                live.closed = True
                self._observe_finished(live, now)
            live.channel.put_merged(RequestOutput(live.request_id, live.prompt_token_ids, deltas, finished,
                                                  live.error, live.error_kind))

    def _fail(self, live: LiveRequest, error: str, pending: list[ChoiceDelta] = ()) -> None:
        """End every choice still open with finish_reason "error", after `pending` (deltas not sent yet)."""
        if live.closed:
            return
        live.closed = True
        deltas = list(pending)
        for c in live.choices:
            if not c.finished:
                c.finish_reason = "error"
                self.metrics.finished("error")
                deltas.append(ChoiceDelta(c.index, "", [], None, "error", None))
        self._observe_finished(live, time.monotonic())  # as a request the core failed is (a review)
        live.channel.put(RequestOutput(live.request_id, live.prompt_token_ids, deltas, True, error))

    def _observe_finished(self, live: LiveRequest, now: float) -> None:
        m = self.metrics
        m.e2e_request_latency.observe(now - live.arrival_time)
        m.request_prompt_tokens.observe(len(live.prompt_token_ids))
        m.request_generation_tokens.observe(sum(c.num_tokens for c in live.choices))
        if live.first_token_time is not None:
            m.request_decode_time.observe(now - live.first_token_time)
        if live.scheduled_time is not None:
            m.request_inference_time.observe(max(0.0, now - live.scheduled_time))

    def _text_of(self, token: int) -> str:
        text = self._token_text.get(token)
        if text is None:
            text = self._token_text[token] = self.tokenizer.token_text(token)
        return text


def _resolve(future: asyncio.Future, value, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


def _client_name(seq: dict, label: tuple[str, int] | None) -> tuple:
    """A block-map choice's (request id, index) as its client names it: its label's response id and the
    response's index of it; its engine's where it has no label."""
    if label is None:
        return (seq.get("request_id"), seq.get("index"))
    return (label[0], label[1] + seq.get("index", 0))


def checked_sampling_defaults(model: str) -> dict[str, float | int]:
    """The model's generation_config.json sampling values, each held to the rules of a request's own: out of
    range, one would refuse every request that leaves its field out, with a 400 that blames the client (a
    review). ValueError at start-up, the file named."""
    defaults = sampling_defaults(model)
    try:
        SamplingParams(**defaults).validate(vocab_size=0)
    except ValueError as e:
        raise ValueError(f"{model}/generation_config.json: {e}") from None
    return defaults


def _used(before: float | None, now: float | None) -> tuple[float, float | None]:
    """CPU seconds between two readings (0 where either is missing) and the reading to go on from."""
    if before is None or now is None:
        return 0.0, now
    return now - before, now
