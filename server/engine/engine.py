"""AsyncEngine: the engine thread and the asyncio side of every request.

The thread owns the EngineCore (scheduler, KV cache manager, runner, sampler) and steps it while there is
work, sleeping on a condition otherwise. The asyncio side never waits on compute: `generate` puts a request
in an inbox under a lock and awaits its own OutputChannel, which the thread fills through
`loop.call_soon_threadsafe`: one call per event loop per step, carrying every output of that step.
Aborts travel the same way and take effect at the start of the next step.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import partial

from kvcache import KVCacheManager
from server.engine.core import EngineCore
from server.engine.metrics import EngineMetrics
from server.engine.outputs import ChoiceDelta, RequestOutput
from server.engine.request import Request
from server.engine.runner import ModelRunner
from server.engine.sampling_params import SamplingParams
from server.model import IncrementalDetokenizer, load_model

logger = logging.getLogger("pagewalk.engine")


@dataclass
class EngineConfig:
    model: str = "tiny"
    device: str = "auto"
    dtype: str | None = None
    block_size: int = 16
    num_blocks: int | None = None
    gpu_memory_utilization: float | None = None  # vLLM's meaning: share of the GPU's total memory
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_waiting: int = 1024
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    attention_backend: str = "auto"
    enable_prefix_caching: bool = True
    enforce_eager: bool = False  # True: no CUDA-graph decode


class RequestRejected(Exception):
    """The request cannot be accepted: `status` is the HTTP status the API answers with."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


class AsyncEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        model, self.tokenizer = load_model(config.model, config.device, config.dtype)
        self.model_name = model.config.name
        self.device = str(next(model.parameters()).device)
        self.dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        self.max_model_len = config.max_model_len or model.config.max_position_embeddings
        self.vocab_size = model.config.vocab_size  # width of the logits
        self.runner = ModelRunner(model, block_size=config.block_size, num_blocks=config.num_blocks,
                                  gpu_memory_utilization=config.gpu_memory_utilization,
                                  attention_backend=config.attention_backend,
                                  max_num_batched_tokens=config.max_num_batched_tokens,
                                  max_num_seqs=config.max_num_seqs, max_model_len=self.max_model_len,
                                  enforce_eager=config.enforce_eager)
        self.attention_backend = self.runner.attention_backend
        self.kv = KVCacheManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.capacity_tokens = self.runner.capacity_tokens  # usable blocks x block_size (block 0 is null)
        self.metrics = EngineMetrics(self.model_name, self.attention_backend, self.device, self.dtype)
        self.core = EngineCore(self.runner, self.tokenizer, self.kv, self.metrics,
                               partial(IncrementalDetokenizer, self.tokenizer), config.max_num_seqs,
                               config.max_num_batched_tokens)
        self._cond = threading.Condition()
        self._inbox: list[Request] = []
        self._aborts: list[str] = []
        self._live: set[str] = set()  # request ids accepted and not yet finished
        self._accepting = True
        self._deadline: float | None = None  # set by shutdown()
        self._thread: threading.Thread | None = None
        self._snapshot = self._take_snapshot()

    # ---- lifecycle --------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        logger.info("pagewalk engine: model=%s device=%s dtype=%s attention_backend=%s "
                    "kv_cache=%d blocks x %d = %d tokens, max_model_len=%d", self.model_name, self.device,
                    self.dtype, self.attention_backend, self.runner.num_blocks, self.config.block_size,
                    self.capacity_tokens, self.max_model_len)
        self._thread = threading.Thread(target=self._run, name="pagewalk-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop accepting; let in-flight requests finish for up to `timeout` s, abort the rest; join."""
        with self._cond:
            self._accepting = False
            self._deadline = time.monotonic() + timeout
            self._cond.notify_all()
        if self._thread is None:
            self._abort_inbox()
            return
        self._thread.join()

    # ---- admission --------------------------------------------------------------------------------
    def check_admissible(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """Raise RequestRejected(status, message, param) if a request of this size cannot be served now."""
        if not self._accepting:
            raise RequestRejected(503, "the engine is shutting down")
        if num_prompt_tokens < 1:
            raise RequestRejected(400, "the prompt must contain at least one token", "prompt")
        if params.n > self.config.max_num_seqs:
            raise RequestRejected(
                400, f"n ({params.n}) exceeds max_num_seqs ({self.config.max_num_seqs})", "n")
        total = num_prompt_tokens + params.max_tokens
        if total > self.max_model_len:
            raise RequestRejected(
                400, f"prompt ({num_prompt_tokens} tokens) + max_tokens ({params.max_tokens}) = {total} "
                f"tokens exceeds the maximum context length of {self.max_model_len} tokens", "max_tokens")
        if total * params.n > self.capacity_tokens:
            raise RequestRejected(
                400, f"prompt ({num_prompt_tokens} tokens) + max_tokens ({params.max_tokens}) = {total} "
                f"tokens per choice x n={params.n} = {total * params.n} tokens exceeds the whole KV cache "
                f"capacity of {self.capacity_tokens} tokens", "max_tokens")
        waiting = len(self._inbox) + self._snapshot["waiting"]
        if waiting >= self.config.max_waiting:
            raise RequestRejected(429, f"too many requests waiting ({waiting}, max_waiting="
                                  f"{self.config.max_waiting}); retry later")

    # ---- requests ---------------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Stream of RequestOutputs, the last with finished=True. Closing it early aborts the request."""
        loop = asyncio.get_running_loop()
        channel = OutputChannel(loop)
        req = Request(request_id, list(prompt_token_ids), params, ChannelSink(loop, channel))
        self._submit(req)
        finished = False
        try:
            while not finished:
                out = await channel.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.abort(request_id)

    def _submit(self, req: Request) -> None:
        try:
            req.params.validate(self.vocab_size)
        except ValueError as e:
            raise RequestRejected(400, str(e)) from None
        with self._cond:
            self.check_admissible(len(req.prompt_token_ids), req.params)
            if req.request_id in self._live:
                raise RequestRejected(400, f"request id {req.request_id!r} is already in use")
            self._live.add(req.request_id)
            self._inbox.append(req)
            self._cond.notify()

    def abort(self, request_id: str) -> None:
        """Abort a request (its blocks are freed at the start of the next step). Unknown ids are ignored."""
        with self._cond:
            if request_id in self._live:
                self._aborts.append(request_id)
                self._cond.notify()

    def health(self) -> dict:
        with self._cond:
            snap = dict(self._snapshot)
            waiting = snap["waiting"] + len(self._inbox)
            accepting = self._accepting
        kv = snap["kv"]
        return {
            "status": "ok" if accepting else "shutting_down",
            "model": self.model_name, "device": self.device, "dtype": self.dtype,
            "attention_backend": self.attention_backend, "cuda_graphs": self.runner.cuda_graphs,
            "kv_cache": {"block_size": kv.block_size, "num_blocks": kv.num_blocks,
                         "free_blocks": kv.free_blocks, "used_blocks": kv.used_blocks,
                         "cached_blocks": kv.cached_blocks},
            "running": snap["running"], "waiting": waiting,
        }

    # ---- the engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        core = self.core
        while True:
            with self._cond:
                while not (self._inbox or self._aborts or core.has_work() or self._deadline is not None):
                    self._cond.wait()
                inbox, self._inbox = self._inbox, []
                aborts, self._aborts = self._aborts, []
                deadline = self._deadline
                if inbox:  # keep them counted as waiting until the next snapshot
                    self._snapshot = {**self._snapshot, "waiting": self._snapshot["waiting"] + len(inbox)}
            outputs = [o for req in inbox if (o := self._add(req))]
            outputs += [o for rid in aborts if (o := core.abort_request(rid))]
            stop = deadline is not None and (not core.has_work() or time.monotonic() >= deadline)
            if stop:
                outputs += [o for rid in list(core.requests) if (o := core.abort_request(rid))]
            elif core.has_work():
                outputs += self._step()
            self._publish(outputs)
            if stop:
                self._abort_inbox()
                return

    def _add(self, req: Request) -> tuple[Request, RequestOutput] | None:
        try:
            self.core.add_request(req)
            return None
        except Exception as e:
            logger.exception("could not add request %s", req.request_id)
            error = f"{type(e).__name__}: {e}"
            if req.request_id in self.core.requests:
                return self.core.abort_request(req.request_id, "error", error)
            deltas = [ChoiceDelta(i, "", [], None, "error", None) for i in range(req.params.n)]
            return req, RequestOutput(req.request_id, req.prompt_token_ids, deltas, True, error)

    def _step(self) -> list:
        try:
            step = self.core.step()
            if not step.scheduled:  # nothing could run (should not happen): do not spin
                with self._cond:
                    self._cond.wait(0.01)
            return step.outputs
        except Exception as e:  # a bug outside the batch guard: fail everything in flight, keep serving
            logger.exception("engine step crashed")
            msg = f"{type(e).__name__}: {e}"
            core = self.core
            return [o for rid in list(core.requests) if (o := core.abort_request(rid, "error", msg))]

    def _publish(self, outputs: list) -> None:
        finished = [req.request_id for req, out in outputs if out.finished]
        if finished:
            with self._cond:
                self._live.difference_update(finished)
        batches: dict[asyncio.AbstractEventLoop, list[tuple[OutputChannel, RequestOutput]]] = {}
        for req, out in outputs:
            sink = req.emit
            if isinstance(sink, ChannelSink):
                batches.setdefault(sink.loop, []).append((sink.channel, out))
                continue
            try:
                sink(out)
            except Exception:
                logger.exception("could not deliver an output of request %s", req.request_id)
        for loop, items in batches.items():
            _deliver(loop, items)
        snapshot = self._take_snapshot()
        with self._cond:
            self._snapshot = snapshot
        m, kv = self.metrics, snapshot["kv"]
        m.num_requests_running.set(snapshot["running"])
        m.num_requests_waiting.set(snapshot["waiting"])
        m.kv_cache_usage_ratio.set(kv.used_blocks / max(1, kv.num_blocks - 1))
        m.prefix_cache_hit_rate.set(kv.prefix_hit_rate)

    def _take_snapshot(self) -> dict:
        """Requests running (some choice holds KV blocks: it is in the scheduler's running list) / waiting."""
        running = len({seq.request_id for seq in self.core.scheduler.running})
        return {"kv": self.kv.usage(), "running": running, "waiting": len(self.core.requests) - running}

    def _abort_inbox(self) -> None:
        """Requests accepted but never started (engine stopping): end them with finish_reason abort."""
        with self._cond:
            inbox, self._inbox = self._inbox, []
            self._live.difference_update(r.request_id for r in inbox)
        for req in inbox:
            deltas = [ChoiceDelta(i, "", [], None, "abort", None) for i in range(req.params.n)]
            req.emit(RequestOutput(req.request_id, req.prompt_token_ids, deltas, True))


class OutputChannel:
    """One request's outputs, on its event loop: an unbounded FIFO with one waiting reader (lighter than
    asyncio.Queue, which keeps getter/putter queues and task accounting)."""

    __slots__ = ("loop", "items", "waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.items: deque[RequestOutput] = deque()
        self.waiter: asyncio.Future | None = None

    def put(self, out: RequestOutput) -> None:
        self.items.append(out)
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():  # done: its reader was cancelled
            waiter.set_result(None)

    async def get(self) -> RequestOutput:
        while not self.items:
            self.waiter = self.loop.create_future()
            await self.waiter
        return self.items.popleft()


@dataclass(frozen=True)
class ChannelSink:
    """A request's `emit`: its OutputChannel on its event loop. `_publish` batches sinks by loop."""

    loop: asyncio.AbstractEventLoop
    channel: OutputChannel

    def __call__(self, out: RequestOutput) -> None:
        _deliver(self.loop, [(self.channel, out)])


def _deliver(loop: asyncio.AbstractEventLoop, items: list[tuple[OutputChannel, RequestOutput]]) -> None:
    try:
        loop.call_soon_threadsafe(_put_all, items)
    except RuntimeError:  # the event loop is closed: nobody is listening any more
        pass


def _put_all(items: list[tuple[OutputChannel, RequestOutput]]) -> None:
    for channel, out in items:
        channel.put(out)

