"""Continuous-batching scheduler: decodes first, then chunked prefills, then admission in arrival order.

Pure bookkeeping on ints: it asks the KVCacheManager for blocks, hands out batch rows and decides who runs
which token range. It is the one place that advances a Sequence: `schedule` counts a scheduled chunk as
computed (steps run in stream order) and a sampling chunk's token as pending; `postprocess` appends the
sampled tokens when they reach the host. So the next step can be planned while the previous one still runs
(asynchronous scheduling): a pending token is already that step's input, on the device.

When a running sequence cannot get a block, the most recently admitted sequence is preempted by recompute:
its blocks and row are freed and it goes back to the FRONT of the waiting queue; on resume its prompt +
generated tokens are prefilled again (prefix caching usually makes that cheap).
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

from kvcache import KVCacheManager
from server.engine.sequence import SeqStatus, Sequence

# Admission past a waiting sequence that does not fit: how many waiting sequences one step looks at beyond
# the first that does not fit, how many admissions may pass one sequence before it holds the queue, and how
# many block allocations may fail in one step (each walks its prompt's cached prefix: a review measured a
# step's schedule() at 3.1 ms with 33 failing over a 4K-token cached prefix, 0.11 ms with one; a row
# check costs nothing, so wide requests are passed to PASS_DEPTH)
PASS_DEPTH = 32
MAX_PASSES = 32
ALLOCATION_TRIES = 4


@dataclass
class ScheduledChunk:
    seq: Sequence
    start: int  # tokens of seq already in the cache
    end: int  # run tokens [start, end)
    samples: bool  # the chunk reaches the sequence's last token: its logits give the next token
    forked: list[Sequence] = field(default_factory=list)  # children forked off this chunk, sampling with it

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass
class SchedulerOutput:
    decodes: list[Sequence] = field(default_factory=list)  # one token each, at decode_positions
    decode_positions: list[int] = field(default_factory=list)
    prefills: list[ScheduledChunk] = field(default_factory=list)  # chunks of > 1 token
    samples: list[Sequence] = field(default_factory=list)  # who samples this step (forked children too)
    sample_sources: list[int] = field(default_factory=list)  # per sample: its logits row (decodes first)
    new_rows: list[Sequence] = field(default_factory=list)  # took a row this step: its state is (re)set
    copies: list[tuple[int, int]] = field(default_factory=list)  # fork copy-on-write, after the forward
    preempted: list[Sequence] = field(default_factory=list)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not (self.decodes or self.prefills)

    @property
    def chunks(self) -> list[ScheduledChunk]:
        """Every chunk, decodes first (a view for tests and stats, built on demand)."""
        return [ScheduledChunk(s, p, p + 1, True) for s, p in zip(self.decodes, self.decode_positions,
                                                                    strict=True)] + self.prefills


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.block_size = kv.usage().block_size
        self.usable_blocks = kv.usage().usable_blocks
        self.waiting: deque[Sequence] = deque()
        self._finished_waiting = False  # a waiting sequence finished: the queue holds it until schedule()
        self.running: list[Sequence] = []  # admission order: the last one is the first preemption victim
        self.free_rows = list(range(max_num_seqs - 1, -1, -1))  # pop() hands out row 0 first
        self.num_preemptions = 0

    # ---- queue management -------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.running) or any(s.status is not SeqStatus.FINISHED for s in self.waiting)

    def num_running_slots(self) -> int:
        return sum(s.width for s in self.running)

    def finish(self, seq: Sequence) -> None:
        """Drop a sequence (finished, aborted or failed) and release its blocks and row. A token it still
        has in flight is discarded by postprocess."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
            self.kv.free(seq.seq_id)
            self._release_row(seq)
        elif seq.status is SeqStatus.WAITING:  # left in the queue, FINISHED: schedule() drops it
            self._finished_waiting = True
        elif seq.status is SeqStatus.FORK_PENDING:  # one choice aborted before its parent's prefill ended
            for parent in itertools.chain(self.running, self.waiting):
                if seq in parent.fork_children:
                    parent.fork_children.remove(seq)
                    break
        for child in seq.fork_children:
            child.status = SeqStatus.FINISHED
        seq.fork_children = []
        seq.status = SeqStatus.FINISHED

    # ---- one step ---------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        if self._finished_waiting:  # one pass for every choice finished while it waited since the last step:
            # a burst of 10,000 aborts removed one at a time scanned the queue each (1.8 s: a review)
            self.waiting = deque(s for s in self.waiting if s.status is not SeqStatus.FINISHED)
            self._finished_waiting = False
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        prefills: list[Sequence] = []  # running, not decoding (complete unless the budget ran out first)
        ensure_slots, reserve = self.kv.ensure_slots, self._reserve_slots
        for seq in list(self.running):  # 1) decodes, one token each, in admission order
            if budget == 0:
                break
            if seq.status is not SeqStatus.RUNNING:
                continue
            # seq.num_tokens, inlined: once per row per step
            num_tokens = len(seq.token_ids) + seq.num_pending
            if num_tokens - seq.num_computed_tokens != 1 or seq.fork_children:
                prefills.append(seq)  # (a fork parent's last prompt token is a chunk: it forks there)
            elif num_tokens - len(seq.prompt_token_ids) >= seq.params.max_tokens:
                continue  # its last token is in flight: it finishes when that token arrives
            # out of blocks with its last token still in flight, it waits a step rather than preempt another
            # for a token that may end it (async scheduling); the next step it finishes or preempts as ever
            elif ensure_slots(seq.seq_id, num_tokens) or (not seq.num_pending and reserve(seq, out)):
                pos = seq.num_computed_tokens
                seq.num_computed_tokens = pos + 1
                seq.num_pending += 1
                out.decodes.append(seq)
                out.decode_positions.append(pos)
                out.num_decode_tokens += 1
                budget -= 1
        for seq in prefills:  # 2) running prefills (chunked), in admission order
            if budget == 0:
                break
            if (seq.status is SeqStatus.RUNNING and (not seq.is_decode or seq.fork_children)
                    and self._reserve_slots(seq, out)):
                budget -= self._add_prefill(seq, budget, out)
        if self.waiting and not out.preempted:  # 3) admission, in arrival order as far as it fits
            self._admit_waiting(budget, out)
        self._list_samples(out)
        return out

    def postprocess(self, out: SchedulerOutput, tokens: list[int]) -> list[tuple[int, Sequence]]:
        """Step `out` ran and its sampled `tokens` (one per out.samples) reached the host: register the
        computed full blocks in the prefix cache and append each token to its sequence. Returns the
        (sample index, sequence) pairs that took their token; a finished sequence's token is discarded."""
        bs = self.block_size
        for seq, pos in zip(out.decodes, out.decode_positions, strict=True):
            if (pos + 1) % bs == 0 and seq.status is SeqStatus.RUNNING:  # a block just filled up
                self._mark_computed(seq, pos + 1)
        for c in out.prefills:
            if c.seq.status is SeqStatus.RUNNING:
                self._mark_computed(c.seq, c.end)
        taken = []
        for i, (seq, token) in enumerate(zip(out.samples, tokens, strict=True)):
            if seq.status is SeqStatus.FINISHED:
                continue
            seq.num_pending -= 1
            seq.token_ids.append(token)
            taken.append((i, seq))
        return taken

    def _admit_waiting(self, budget: int, out: SchedulerOutput) -> None:
        """Admit waiting sequences in arrival order while rows, blocks and the token budget last. One that
        does not fit (its n choices' rows, its blocks) is passed over, and those behind it tried, up to
        PASS_DEPTH of them and ALLOCATION_TRIES failed block allocations a step; each admission past a
        sequence counts against it, and one passed MAX_PASSES times holds the queue until it fits, as a
        preempted one always does: a small request need not wait behind a large one, and the large one
        waits at most MAX_PASSES admissions longer."""
        slots = self.num_running_slots()  # counted once: admission adds widths
        i = failed_allocations = 0
        while i < len(self.waiting) and budget > 0:
            seq = self.waiting[i]
            fits_rows = slots + seq.width <= self.max_num_seqs
            if fits_rows and self._admit(seq, out):
                del self.waiting[i]
                held = False
                for passed in itertools.islice(self.waiting, i):
                    passed.times_passed += 1
                    held |= passed.times_passed >= MAX_PASSES
                slots += seq.width  # before its prefill forks the children (they keep the same total)
                queued = len(self.waiting)
                budget -= self._add_prefill(seq, budget, out)
                if held or len(self.waiting) != queued:  # (a child that could not fork went to the front)
                    return
                continue
            failed_allocations += fits_rows
            if (i >= PASS_DEPTH or failed_allocations >= ALLOCATION_TRIES or seq.num_preemptions
                    or seq.times_passed >= MAX_PASSES):
                return
            i += 1

    # ---- helpers ----------------------------------------------------------------------------------
    def _mark_computed(self, seq: Sequence, end: int) -> None:
        """Tokens [0, end) of seq are written; their ids are on the host by now."""
        assert end <= len(seq.token_ids), "a computed token's id must be known before its block is hashed"
        self.kv.mark_computed(seq.seq_id, end, seq.token_ids)

    def _add_prefill(self, seq: Sequence, budget: int, out: SchedulerOutput) -> int:
        n = min(seq.num_uncomputed, budget)
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
        samples = end == seq.num_tokens
        out.prefills.append(ScheduledChunk(seq, start, end, samples))
        seq.num_computed_tokens = end
        out.num_prefill_tokens += n
        if samples:
            seq.num_pending += 1
            if seq.fork_children:  # n > 1: the siblings share this prefill and sample from its logits
                self._fork_children(seq, out)
        return n

    @staticmethod
    def _list_samples(out: SchedulerOutput) -> None:
        """Who samples from which logits row: decodes (rows in order), then each sampling prefill chunk's
        sequence and its forked children (the chunk's row; rows are numbered after the decodes)."""
        out.samples = list(out.decodes)
        out.sample_sources = list(range(len(out.decodes)))
        row = len(out.decodes)
        for c in out.prefills:
            if c.samples:
                out.samples += [c.seq, *c.forked]
                out.sample_sources += [row] * (1 + len(c.forked))
                row += 1

    def _fork_children(self, parent: Sequence, out: SchedulerOutput) -> None:
        """Parent's last prefill chunk is scheduled: share its blocks with its n-1 siblings, who sample from
        its logits this step. The partial last block is copied after the forward writes it. A child that
        cannot get a block re-queues at the front and prefills on its own (hitting the prefix cache)."""
        assert len(parent.token_ids) == len(parent.prompt_token_ids), "a parent forks at its prompt's end"
        forked: list[Sequence] = []
        for child in reversed(parent.fork_children):
            pairs = self.kv.fork(parent.seq_id, child.seq_id)
            if pairs is None:
                child.status = SeqStatus.WAITING
                child.times_passed = MAX_PASSES  # it holds the queue until it fits, as a preempted one does
                self.waiting.appendleft(child)
                continue
            out.copies.extend(pairs)
            child.num_computed_tokens = parent.num_computed_tokens
            child.num_pending = 1
            self._mark_running(child, out)
            forked.append(child)
        parent.fork_children = []
        forked.reverse()
        out.prefills[-1].forked = forked

    def _admit(self, seq: Sequence, out: SchedulerOutput) -> bool:
        assert seq.num_pending == 0, "a sequence is admitted only once its tokens are all on the host"
        # blocks kept free for the running decodes; a prompt's prefix-cache hits take none of them (blocks
        # it shares with running sequences are not free, yet cost it nothing)
        keep_free = min(len(self.running), self.usable_blocks // 8)
        if self.kv.allocate(seq.seq_id, seq.token_ids, seq.prefix_keys, keep_free,
                            counts_lookup=seq.num_preemptions == 0, cache_salt=seq.params.cache_salt) is None:
            return False
        seq.num_computed_tokens = self.kv.num_cached_tokens(seq.seq_id)
        self._mark_running(seq, out)
        return True

    def _mark_running(self, seq: Sequence, out: SchedulerOutput) -> None:
        seq.status = SeqStatus.RUNNING
        seq.prefix_keys = []  # held while waiting only (after a preemption the next admission hashes again)
        seq.row = self.free_rows.pop()
        self.running.append(seq)
        out.new_rows.append(seq)

    def _release_row(self, seq: Sequence) -> None:
        self.free_rows.append(seq.row)
        seq.row = -1

    def _reserve_slots(self, seq: Sequence, out: SchedulerOutput) -> bool:
        """Make the cache hold a slot for every token of seq, preempting from the back. False: seq itself
        was preempted."""
        while not self.kv.ensure_slots(seq.seq_id, seq.num_tokens):
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        scheduled = self._unschedule(seq, out)
        if scheduled is not None:  # its full blocks written by earlier steps stay in the prefix cache, so
            # its recompute hits them (their writes precede any reuse of the blocks on the one stream)
            self._mark_computed(seq, min(seq.num_computed_tokens - scheduled, len(seq.token_ids)))
        self.running.remove(seq)
        self.kv.free(seq.seq_id)
        self._release_row(seq)
        if seq in out.new_rows:  # given its row this step (a child forked in it): the runner sets no state
            out.new_rows.remove(seq)  # for it at row -1 (a review)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        out.preempted.append(seq)

    def _unschedule(self, seq: Sequence, out: SchedulerOutput) -> int | None:
        """A victim already scheduled in this step leaves it (its row and blocks are about to be reused).
        -> how many of its computed tokens this step had scheduled (0: none), None for a child forked in
        this step (its blocks are its parent's)."""
        if seq in out.decodes:
            i = out.decodes.index(seq)
            del out.decodes[i], out.decode_positions[i]
            out.num_decode_tokens -= 1
            seq.num_pending -= 1
            return 1
        for c in out.prefills:
            if c.seq is seq:
                out.prefills.remove(c)
                out.num_prefill_tokens -= c.num_tokens
                seq.num_pending -= c.samples
                return c.num_tokens
            if seq in c.forked:
                c.forked.remove(seq)
                seq.num_pending -= 1
                own = set(self.kv.block_table(seq.seq_id))
                out.copies = [(src, dst) for src, dst in out.copies if dst not in own]
                return None
        return 0
