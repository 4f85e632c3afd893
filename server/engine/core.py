"""The synchronous engine step: schedule -> runner -> fork -> sample -> finish checks -> SeqUpdates.

Ints only: the core never sees text. It ends a choice on EOS, a stop token id or max_tokens; stop strings
are found in the API process, which aborts the choice here. A failure inside one request's post-processing
fails that request; a failure of the batch (runner, fork copies, sampler) fails the requests in that batch;
the core goes on.
"""

from __future__ import annotations

import itertools
import logging
import numbers

import torch

from kvcache import KVCacheManager
from kvcache.snapshot import block_map
from server.engine.outputs import CoreStats, EngineRequest, SeqUpdate, StepUpdate, TokenLogprobs
from server.engine.prompt_logprobs import prompt_logprobs
from server.engine.request import Request
from server.engine.runner import SeqChunk
from server.engine.sampler import Sampler, SamplerOutput, make_generator
from server.engine.scheduler import Scheduler, SchedulerOutput
from server.engine.sequence import SeqStatus, Sequence

logger = logging.getLogger("pagewalk.engine")


class EngineCore:
    def __init__(self, runner, kv: KVCacheManager, eos_token_ids: set[int], max_num_seqs: int,
                 max_num_batched_tokens: int):
        self.runner = runner
        self.kv = kv
        self.eos_token_ids = frozenset(eos_token_ids)
        self.scheduler = Scheduler(kv, max_num_seqs, max_num_batched_tokens)
        self.sampler = Sampler()
        self.device = torch.device(getattr(runner, "device", "cpu"))
        self.requests: dict[str, Request] = {}
        self._seq_ids = itertools.count()

    # ---- requests ---------------------------------------------------------------------------------
    def add_request(self, er: EngineRequest) -> None:
        """ValueError (request not added) for prompt ids outside the vocabulary or an id in use: caught
        here, not in a batch, they fail this request only."""
        _check_prompt(er.prompt_token_ids, self.runner.config.vocab_size)
        if er.request_id in self.requests:
            raise ValueError(f"request id {er.request_id!r} is already in the engine")
        req = Request(er.request_id, list(er.prompt_token_ids), er.params, er.arrival_time)
        if er.params.prompt_logprobs is not None:
            req.prompt_logprobs = prompt_logprobs(self.runner.model, req.prompt_token_ids,
                                                  er.params.prompt_logprobs)
        req.seqs = [self._new_seq(req, i) for i in range(er.params.n)]
        parent = req.seqs[0]
        for child in req.seqs[1:]:
            child.status = SeqStatus.FORK_PENDING
            parent.fork_children.append(child)
        self.requests[req.request_id] = req
        self.scheduler.add(parent)

    def _new_seq(self, req: Request, index: int) -> Sequence:
        seq = Sequence(next(self._seq_ids), req.request_id, index, req.prompt_token_ids, req.params)
        if req.params.seed is not None:
            seq.generator = make_generator(req.params.seed, index, self.device)
        return seq

    def has_work(self) -> bool:
        return bool(self.requests)

    def abort_request(self, request_id: str, index: int | None = None, reason: str = "abort",
                      error: str | None = None) -> list[SeqUpdate]:
        """End choice `index` (None: every unfinished choice) with `reason`; free their blocks now.
        Unknown requests and finished choices are ignored (empty list)."""
        req = self.requests.get(request_id)
        if req is None:
            return []
        seqs = req.unfinished() if index is None else [s for s in req.unfinished() if s.index == index]
        updates = []
        for seq in seqs:
            seq.finish_reason = reason
            self.scheduler.finish(seq)
            updates.append(SeqUpdate(request_id, seq.index, [], None, reason, None, error))
        self._forget_if_finished(req)
        return updates

    def _forget_if_finished(self, req: Request) -> None:
        if req.finished:
            del self.requests[req.request_id]

    # ---- one step ---------------------------------------------------------------------------------
    def step(self) -> StepUpdate:
        sched = self.scheduler.schedule()
        updates: list[SeqUpdate] = []
        if not sched.is_empty:
            try:
                rows, sampled = self._run_batch(sched)
                updates = self._process(rows, sampled)
            except Exception as e:  # the whole batch failed: fail its requests, keep serving
                logger.exception("engine step failed; failing %d sequences", len(sched.chunks))
                batch = {c.seq.request_id for c in sched.chunks}
                updates = [u for rid in batch for u in self.abort_request(rid, None, "error", _describe(e))]
        return StepUpdate(updates, self.stats(sched.num_prefill_tokens, sched.num_decode_tokens,
                                              len(sched.preempted)))

    def stats(self, num_prefill_tokens: int = 0, num_decode_tokens: int = 0,
              num_preemptions: int = 0) -> CoreStats:
        """Requests running (some choice holds KV blocks: it is in the scheduler's running list) / waiting,
        KV occupancy, and what the step just taken did."""
        running = len({seq.request_id for seq in self.scheduler.running})
        u = self.kv.usage()
        return CoreStats(running, len(self.requests) - running, u.free_blocks, u.used_blocks, u.cached_blocks,
                         u.prefix_hit_rate, num_prefill_tokens, num_decode_tokens, num_preemptions)

    def kv_snapshot(self) -> dict:
        """The block map (kvcache.snapshot.block_map), each holder labelled with its request and choice;
        built only when asked, between steps."""
        owners = {seq.seq_id: {"request_id": req.request_id, "index": seq.index}
                  for req in self.requests.values() for seq in req.seqs}
        return block_map(self.kv, owners)

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

    def _process(self, rows: list[Sequence], sampled: SamplerOutput | None) -> list[SeqUpdate]:
        updates = []
        failed: dict[str, str] = {}
        for r, seq in enumerate(rows):
            if seq.request_id in failed:
                continue
            try:
                updates.append(self._append_token(seq, sampled, r))
            except Exception as e:  # this request only
                logger.exception("request %s failed", seq.request_id)
                failed[seq.request_id] = _describe(e)
        for rid, error in failed.items():  # its choices already updated this step keep their update
            updates += self.abort_request(rid, None, "error", error)
        return updates

    def _append_token(self, seq: Sequence, sampled: SamplerOutput, r: int) -> SeqUpdate:
        token = sampled.token_ids[r]
        seq.output_token_ids.append(token)
        p = seq.params
        logprobs = [self._logprobs(seq, sampled, r)] if sampled.logprobs is not None and p.logprobs is not None \
            else None
        first = len(seq.output_token_ids) == 1
        prompt_lps = self.requests[seq.request_id].prompt_logprobs if first else None
        reason, stop_token = None, None
        if token in p.stop_token_ids:
            reason, stop_token = "stop", token
        elif token in self.eos_token_ids and not p.ignore_eos:
            reason = "stop"
        elif len(seq.output_token_ids) >= p.max_tokens:
            reason = "length"
        if reason is not None:
            seq.finish_reason, seq.stop_reason = reason, stop_token
            self.scheduler.finish(seq)
            self._forget_if_finished(self.requests[seq.request_id])
        return SeqUpdate(seq.request_id, seq.index, [token], logprobs, reason, stop_token,
                         prompt_logprobs=prompt_lps)

    @staticmethod
    def _logprobs(seq: Sequence, sampled: SamplerOutput, r: int) -> TokenLogprobs:
        k = seq.params.logprobs or 0  # the batch's top lists are as long as its largest request
        top = list(zip(sampled.top_ids[r][:k], sampled.top_logprobs[r][:k], strict=True))
        return sampled.logprobs[r], top


def _token_range(seq: Sequence, start: int, end: int) -> list[int]:
    p = len(seq.prompt_token_ids)
    if start >= p:
        return seq.output_token_ids[start - p:end - p]
    return seq.all_token_ids[start:end]


def _check_prompt(token_ids: list[int], vocab_size: int) -> None:
    bad = [t for t in token_ids if not (isinstance(t, numbers.Integral) and 0 <= t < vocab_size)]
    if bad:
        raise ValueError(f"prompt token ids must be integers in [0, {vocab_size}), got {bad[0]!r}")


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"
