"""The synchronous engine step: schedule -> runner -> fork -> sample -> stop checks -> outputs.

Touched by the engine thread only. A failure inside one request's post-processing fails that request; a
failure of the batch (runner, fork copies, sampler) fails the requests in that batch; the engine goes on.
"""

from __future__ import annotations

import itertools
import logging
import numbers
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvcache import KVCacheManager
from server.engine.metrics import EngineMetrics
from server.engine.outputs import ChoiceDelta, RequestOutput, TokenLogprob
from server.engine.request import Request
from server.engine.runner import SeqChunk
from server.engine.sampler import Sampler, SamplerOutput, make_generator
from server.engine.scheduler import Scheduler, SchedulerOutput
from server.engine.sequence import SeqStatus, Sequence
from server.engine.stop_checker import Detokenizer, StopChecker

logger = logging.getLogger("pagewalk.engine")


@dataclass
class StepOutput:
    outputs: list[tuple[Request, RequestOutput]] = field(default_factory=list)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_preempted: int = 0
    scheduled: bool = False  # some chunk ran (or failed) this step


class EngineCore:
    def __init__(self, runner, tokenizer, kv: KVCacheManager, metrics: EngineMetrics,
                 detokenizer_factory: Callable[[], Detokenizer], max_num_seqs: int,
                 max_num_batched_tokens: int):
        self.runner = runner
        self.tokenizer = tokenizer
        self.kv = kv
        self.metrics = metrics
        self.detokenizer_factory = detokenizer_factory
        self.scheduler = Scheduler(kv, max_num_seqs, max_num_batched_tokens)
        self.sampler = Sampler()
        self.device = torch.device(getattr(runner, "device", "cpu"))
        self.requests: dict[str, Request] = {}
        self.num_prefill_tokens = 0  # prompt (and recomputed) tokens run through the model, all time
        self._seq_ids = itertools.count()
        self._token_text: dict[int, str] = {}

    # ---- requests ---------------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        """ValueError (request not added) for prompt ids outside the vocabulary: caught here, not in a
        batch, they fail this request only."""
        _check_prompt(req.prompt_token_ids, self.runner.config.vocab_size)
        p = req.params
        req.seqs = [self._new_seq(req, i) for i in range(p.n)]
        parent = req.seqs[0]
        for child in req.seqs[1:]:
            child.status = SeqStatus.FORK_PENDING
            parent.fork_children.append(child)
        self.requests[req.request_id] = req
        self.scheduler.add(parent)
        self.metrics.prompt_tokens.inc(len(req.prompt_token_ids))

    def make_stop_checker(self, seq: Sequence) -> StopChecker:
        return StopChecker(seq.params, self.detokenizer_factory(), set(self.tokenizer.eos_token_ids))

    def _new_seq(self, req: Request, index: int) -> Sequence:
        seq = Sequence(next(self._seq_ids), req.request_id, index, req.prompt_token_ids, req.params)
        if req.params.seed is not None:
            seq.generator = make_generator(req.params.seed, index, self.device)
        seq.stop_checker = self.make_stop_checker(seq)
        return seq

    def has_work(self) -> bool:
        return bool(self.requests)

    def abort_request(self, request_id: str, reason: str = "abort",
                      error: str | None = None) -> tuple[Request, RequestOutput] | None:
        """End every unfinished choice with `reason`; free their blocks now."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        deltas = []
        for seq in req.unfinished():
            seq.finish_reason = reason
            self.scheduler.finish(seq)
            self.metrics.request_success.labels(finish_reason=reason).inc()
            text = _safe_flush(seq) if reason == "abort" else ""
            deltas.append(ChoiceDelta(seq.index, text, [], None, reason, None))
        return req, self._finish_output(req, deltas, error)

    def _finish_output(self, req: Request, deltas: list[ChoiceDelta], error: str | None) -> RequestOutput:
        # a delta without finish_reason is a choice still running: no need to look at every choice
        finished = all(d.finish_reason is not None for d in deltas) and req.finished
        if finished:
            del self.requests[req.request_id]
            self.metrics.e2e_request_latency.observe(time.monotonic() - req.arrival_time)
        return RequestOutput(req.request_id, req.prompt_token_ids, deltas, finished, error)

    # ---- one step ---------------------------------------------------------------------------------
    def step(self) -> StepOutput:
        sched = self.scheduler.schedule()
        step = StepOutput(num_prefill_tokens=sched.num_prefill_tokens,
                          num_decode_tokens=sched.num_decode_tokens, num_preempted=len(sched.preempted))
        if sched.preempted:
            self.metrics.num_preemptions.inc(len(sched.preempted))
        if sched.is_empty:
            return step
        step.scheduled = True
        try:
            rows, sampled = self._run_batch(sched)
        except Exception as e:  # the whole batch failed: fail its requests, keep serving
            logger.exception("engine step failed; failing %d sequences", len(sched.chunks))
            batch = {c.seq.request_id for c in sched.chunks}
            step.outputs = [o for rid in batch if (o := self.abort_request(rid, "error", _describe(e)))]
            return step
        self.num_prefill_tokens += sched.num_prefill_tokens
        step.outputs = self._process(rows, sampled)
        return step

    def _run_batch(self, sched: SchedulerOutput) -> tuple[list[Sequence], SamplerOutput | None]:
        view = self.kv.chunk_view
        chunks = [SeqChunk(_token_range(c.seq, c.start, c.end), c.start, *view(c.seq.seq_id, c.start, c.end))
                  for c in sched.chunks]
        logits = self.runner.execute(chunks)  # (len(chunks), V) fp32
        self.scheduler.after_step(sched)
        rows: list[Sequence] = []
        row_index: list[int] = []
        for i, c in enumerate(sched.chunks):
            if not c.samples:
                continue
            rows.append(c.seq)
            row_index.append(i)
            if c.seq.fork_children:  # n > 1: the siblings share this prefill and sample from its logits
                children, copies = self.scheduler.fork_children(c.seq)
                if copies:
                    self.runner.copy_blocks(copies)
                rows.extend(children)
                row_index.extend([i] * len(children))
        if not rows:
            return rows, None
        if row_index != list(range(logits.shape[0])):  # some chunks do not sample, or forks share a row
            logits = logits.index_select(0, torch.tensor(row_index, device=logits.device))
        return rows, self.sampler(logits, rows)  # (R, V)

    def _process(self, rows: list[Sequence],
                 sampled: SamplerOutput | None) -> list[tuple[Request, RequestOutput]]:
        by_request: dict[str, list[int]] = {}
        for r, seq in enumerate(rows):
            by_request.setdefault(seq.request_id, []).append(r)
        outputs = []
        now = time.monotonic()
        self.metrics.generation_tokens.inc(len(rows))
        for rid, row_ids in by_request.items():
            req = self.requests[rid]
            try:
                deltas = [self._append_token(req, rows[r], sampled, r, now) for r in row_ids]
                outputs.append((req, self._finish_output(req, deltas, None)))
            except Exception as e:  # this request only
                logger.exception("request %s failed", rid)
                outputs.append(self.abort_request(rid, "error", _describe(e)))
        return outputs

    def _append_token(self, req: Request, seq: Sequence, sampled: SamplerOutput, r: int,
                      now: float) -> ChoiceDelta:
        token = sampled.token_ids[r]
        seq.output_token_ids.append(token)
        self._observe_latency(req, seq, now)
        res = seq.stop_checker.append(token)
        wants_logprobs = sampled.logprobs is not None and seq.params.logprobs is not None
        logprobs = [self._logprob(seq, sampled, r, token)] if wants_logprobs else None
        if res.finish_reason is not None:
            seq.finish_reason, seq.stop_reason = res.finish_reason, res.stop_reason
            self.scheduler.finish(seq)
            self.metrics.request_success.labels(finish_reason=res.finish_reason).inc()
        return ChoiceDelta(seq.index, res.text, [token], logprobs, res.finish_reason, res.stop_reason)

    def _observe_latency(self, req: Request, seq: Sequence, now: float) -> None:
        if seq.last_token_time is None:
            self.metrics.time_to_first_token.observe(now - req.arrival_time)
        else:
            self.metrics.inter_token_latency.observe(now - seq.last_token_time)
        seq.last_token_time = now

    def _logprob(self, seq: Sequence, sampled: SamplerOutput, r: int, token: int) -> TokenLogprob:
        k = seq.params.logprobs or 0  # the batch's top lists are as long as its largest request
        pairs = zip(sampled.top_ids[r][:k], sampled.top_logprobs[r][:k], strict=True)
        top = [(t, self._text_of(t), lp) for t, lp in pairs]
        return TokenLogprob(token, self._text_of(token), sampled.logprobs[r], top)

    def _text_of(self, token: int) -> str:
        text = self._token_text.get(token)
        if text is None:
            text = self._token_text[token] = self.tokenizer.decode([token])
        return text


def _token_range(seq: Sequence, start: int, end: int) -> list[int]:
    p = len(seq.prompt_token_ids)
    if start >= p:
        return seq.output_token_ids[start - p:end - p]
    return seq.all_token_ids[start:end]


def _check_prompt(token_ids: list[int], vocab_size: int) -> None:
    bad = [t for t in token_ids if not (isinstance(t, numbers.Integral) and 0 <= t < vocab_size)]
    if bad:
        raise ValueError(f"prompt token ids must be integers in [0, {vocab_size}), got {bad[0]!r}")


def _safe_flush(seq: Sequence) -> str:
    """Held-back text of an aborted choice; nothing if its detokenizer is what broke."""
    try:
        return seq.stop_checker.flush()
    except Exception:
        return ""


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"
