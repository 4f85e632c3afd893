"""Continuous-batching scheduler: decodes first, then chunked prefills, then FCFS admission.

Pure bookkeeping on ints: it asks the KVCacheManager for blocks and decides who runs which token range.
When a running sequence cannot get a block, the most recently admitted sequence is preempted by recompute:
its blocks are freed and it goes back to the FRONT of the waiting queue; on resume its prompt + generated
tokens are prefilled again (prefix caching usually makes that cheap).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvcache import KVCacheManager
from server.engine.sequence import SeqStatus, Sequence


@dataclass
class ScheduledChunk:
    seq: Sequence
    start: int  # tokens of seq already in the cache
    end: int  # run tokens [start, end)
    samples: bool  # the chunk reaches the sequence's last token: its logits give the next token

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)  # decodes first, then prefill chunks
    preempted: list[Sequence] = field(default_factory=list)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.block_size = kv.usage().block_size
        self.usable_blocks = kv.usage().usable_blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order (admit_order increasing)
        self.num_preemptions = 0
        self._admit_counter = 0

    # ---- queue management -------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def num_running_slots(self) -> int:
        return sum(s.width for s in self.running)

    def num_waiting_seqs(self) -> int:
        return sum(s.width for s in self.waiting)

    def finish(self, seq: Sequence) -> None:
        """Drop a sequence (finished, aborted or failed) and release its blocks."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
            self.kv.free(seq.seq_id)
        elif seq.status is SeqStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        for child in seq.fork_children:
            child.status = SeqStatus.FINISHED
        seq.fork_children = []
        seq.status = SeqStatus.FINISHED

    # ---- one step ---------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        prefills: list[Sequence] = []  # running, not decoding (complete unless the budget ran out first)
        for seq in list(self.running):  # 1) decodes, one token each, in admission order
            if budget == 0:
                break
            if seq.status is not SeqStatus.RUNNING:
                continue
            start, end = seq.num_computed_tokens, seq.num_tokens
            if end - start != 1:
                prefills.append(seq)
            elif self._reserve_slots(seq, out):
                out.chunks.append(ScheduledChunk(seq, start, end, True))
                out.num_decode_tokens += 1
                budget -= 1
        for seq in prefills:  # 2) running prefills (chunked), in admission order
            if budget == 0:
                break
            if seq.status is SeqStatus.RUNNING and not seq.is_decode and self._reserve_slots(seq, out):
                budget -= self._add_prefill(seq, budget, out)
        while self.waiting and budget > 0 and not out.preempted:  # 3) FCFS admission
            seq = self.waiting[0]
            if self.num_running_slots() + seq.width > self.max_num_seqs or not self._admit(seq):
                break
            self.waiting.popleft()
            budget -= self._add_prefill(seq, budget, out)
        return out

    def after_step(self, out: SchedulerOutput) -> None:
        """The chunks' K/V are written: advance progress and let the prefix cache register full blocks."""
        for chunk in out.chunks:
            if chunk.seq.status is SeqStatus.RUNNING:
                chunk.seq.num_computed_tokens = chunk.end
                self.kv.mark_computed(chunk.seq.seq_id, chunk.end)

    def fork_children(self, parent: Sequence) -> tuple[list[Sequence], list[tuple[int, int]]]:
        """Parent finished its prefill: share its blocks with its n-1 siblings.

        Returns the children now running (they sample from the parent's logits this step) and the
        (src, dst) block copies the runner must do first. A child that cannot get a block re-queues at the
        front and prefills on its own (hitting the prefix cache).
        """
        forked: list[Sequence] = []
        copies: list[tuple[int, int]] = []
        for child in reversed(parent.fork_children):
            pairs = self.kv.fork(parent.seq_id, child.seq_id)
            if pairs is None:
                child.status = SeqStatus.WAITING
                self.waiting.appendleft(child)
                continue
            copies.extend(pairs)
            child.num_computed_tokens = parent.num_computed_tokens
            self._mark_running(child)
            forked.append(child)
        parent.fork_children = []
        forked.reverse()
        return forked, copies

    # ---- helpers ----------------------------------------------------------------------------------
    def _add_prefill(self, seq: Sequence, budget: int, out: SchedulerOutput) -> int:
        n = min(seq.num_uncomputed, budget)
        start = seq.num_computed_tokens
        out.chunks.append(ScheduledChunk(seq, start, start + n, start + n == seq.num_tokens))
        out.num_prefill_tokens += n
        return n

    def _admit(self, seq: Sequence) -> bool:
        tokens = seq.all_token_ids
        reserve = min(len(self.running), self.usable_blocks // 8) * self.block_size  # room for decodes
        if reserve and not self.kv.can_allocate(len(tokens) + reserve):
            return False
        if self.kv.allocate(seq.seq_id, tokens) is None:
            return False
        seq.num_computed_tokens = self.kv.num_cached_tokens(seq.seq_id)
        self._mark_running(seq)
        return True

    def _mark_running(self, seq: Sequence) -> None:
        seq.status = SeqStatus.RUNNING
        seq.admit_order = self._admit_counter
        self._admit_counter += 1
        self.running.append(seq)

    def _reserve_slots(self, seq: Sequence, out: SchedulerOutput) -> bool:
        """Make the cache hold a slot for every token of seq, preempting from the back. False: seq itself
        was preempted."""
        have = self.kv.num_tokens(seq.seq_id)
        num_prompt = len(seq.prompt_token_ids)
        need = num_prompt + len(seq.output_token_ids) - have
        if need <= 0:
            return True
        new_ids = seq.all_token_ids[have:] if have < num_prompt else seq.output_token_ids[have - num_prompt:]
        while not self.kv.append_slots(seq.seq_id, need, new_ids):
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.kv.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        out.preempted.append(seq)
