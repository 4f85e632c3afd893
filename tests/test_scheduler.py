"""Scheduler on a real KVCacheManager, driven by a paged token-memory simulator.

The simulator writes each chunk's token ids into the physical slots the kvcache handed out and "predicts" the
next token from what it reads back through the block table. Any wrong token range, slot, block table,
prefix-cache reuse, fork copy or preemption resume reads back the wrong history and changes the tokens.
"""

from __future__ import annotations

import itertools
import zlib

import pytest

from kvcache import KVCacheManager
from kvcache.prefix_hash import chain_root
from server.engine import scheduler as scheduler_module
from server.engine.sampling_params import SamplingParams
from server.engine.scheduler import Scheduler, SchedulerOutput
from server.engine.sequence import SeqStatus, Sequence

VOCAB = 97


def predict(history: list[int]) -> int:
    return zlib.crc32(bytes(str(history), "ascii")) % VOCAB


class PagedMemory:
    """slot -> token id: what a real KV cache would hold."""

    def __init__(self, kv: KVCacheManager):
        self.kv, self.slots = kv, {}
        self.bs = kv.usage().block_size

    def write(self, seq: Sequence, start: int, ids: list[int]) -> None:
        for slot, tok in zip(self.kv.slot_mapping(seq.seq_id, start, start + len(ids)), ids, strict=True):
            self.slots[slot] = tok

    def history(self, seq: Sequence, end: int) -> list[int]:
        table = self.kv.block_table(seq.seq_id)
        return [self.slots[table[t // self.bs] * self.bs + t % self.bs] for t in range(end)]

    def copy_blocks(self, pairs):
        for src, dst in pairs:
            for o in range(self.bs):
                if src * self.bs + o in self.slots:
                    self.slots[dst * self.bs + o] = self.slots[src * self.bs + o]


class Harness:
    """Drives the scheduler like the engine core: launch (the "device": write K/V, sample by reading the
    history back) then postprocess; with async_=True step N+1 is scheduled and launched before step N is
    post-processed, its pending tokens read from the "device" (`last`)."""

    def __init__(self, num_blocks=64, block_size=4, max_num_seqs=8, max_tokens_per_step=64, caching=True,
                 async_=False):
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching)
        self.sched = Scheduler(self.kv, max_num_seqs, max_tokens_per_step)
        self.mem = PagedMemory(self.kv)
        self.ids = itertools.count()
        self.finished: list[Sequence] = []
        self.async_ = async_
        self.last: dict[int, int] = {}  # seq id -> the token its last sample drew (the device's copy)
        self.in_flight = None

    def add(self, prompt: list[int], max_tokens: int, n: int = 1, cache_salt: str | None = None
            ) -> list[Sequence]:
        params = SamplingParams(max_tokens=max_tokens, n=n, cache_salt=cache_salt)
        seqs = [Sequence(next(self.ids), "r", i, prompt, params) for i in range(n)]
        for child in seqs[1:]:
            child.status = SeqStatus.FORK_PENDING
            seqs[0].fork_children.append(child)
        self.sched.add(seqs[0])
        return seqs

    def token_at(self, seq: Sequence, t: int) -> int:
        return seq.token_ids[t] if t < len(seq.token_ids) else self.last[seq.seq_id]

    def launch(self, out) -> list[int]:
        for c in out.chunks:
            self.mem.write(c.seq, c.start, [self.token_at(c.seq, t) for t in range(c.start, c.end)])
        self.mem.copy_blocks(out.copies)
        sampling = [c for c in out.chunks if c.samples]
        tokens = []
        for seq, src in zip(out.samples, out.sample_sources, strict=True):
            chunk = sampling[src]
            history = self.mem.history(chunk.seq, chunk.end)
            assert history == [self.token_at(chunk.seq, t) for t in range(chunk.end)], "KV history corrupted"
            tokens.append(predict(history))
            self.last[seq.seq_id] = tokens[-1]
        return tokens

    def step(self):
        out = self.sched.schedule()
        # the runner sets the state of each new row: a sequence preempted in the step it took one is not there
        assert all(s.row >= 0 and s.status is SeqStatus.RUNNING for s in out.new_rows)
        launched = (out, self.launch(out)) if not out.is_empty else None
        done = launched
        if self.async_:
            done, self.in_flight = self.in_flight, launched
        if done is not None:
            for _, seq in self.sched.postprocess(*done):
                if len(seq.output_token_ids) == seq.params.max_tokens:
                    self.sched.finish(seq)
                    self.finished.append(seq)
        self.kv.check_integrity()
        return out

    def run(self, max_steps=500):
        for _ in range(max_steps):
            if not self.sched.has_work() and self.in_flight is None:
                return
            self.step()
        raise AssertionError("did not finish")


def expected_output(prompt: list[int], max_tokens: int) -> list[int]:
    toks = list(prompt)
    for _ in range(max_tokens):
        toks.append(predict(toks))
    return toks[len(prompt):]


def test_long_prompt_is_chunked_and_samples_only_at_its_end():
    h = Harness(max_tokens_per_step=8)
    (seq,) = h.add(list(range(20)), max_tokens=3)
    sizes = []
    for _ in range(3):
        out = h.step()
        sizes.append([(c.num_tokens, c.samples) for c in out.chunks])
    assert sizes == [[(8, False)], [(8, False)], [(4, True)]]
    h.run()
    assert seq.output_token_ids == expected_output(list(range(20)), 3)


def test_decodes_go_first_and_prefill_takes_the_rest_of_the_budget():
    h = Harness(max_tokens_per_step=8)
    (a,) = h.add([1, 2, 3], max_tokens=10)
    h.step()  # a prefilled, now decoding
    (b,) = h.add(list(range(30, 50)), max_tokens=2)
    out = h.step()
    assert [(c.seq is a, c.num_tokens) for c in out.chunks] == [(True, 1), (False, 7)]
    assert (out.num_decode_tokens, out.num_prefill_tokens) == (1, 7)
    h.run()
    assert a.output_token_ids == expected_output([1, 2, 3], 10)
    assert b.output_token_ids == expected_output(list(range(30, 50)), 2)


def test_admission_is_fcfs_and_bounded_by_max_num_seqs():
    h = Harness(max_num_seqs=2)
    seqs = [h.add([i, i + 1], max_tokens=4)[0] for i in range(3)]
    h.step()
    assert [s.status for s in seqs] == [SeqStatus.RUNNING, SeqStatus.RUNNING, SeqStatus.WAITING]
    h.run()
    assert all(s.output_token_ids == expected_output([i, i + 1], 4) for i, s in enumerate(seqs))


def test_one_step_admits_by_rows_counting_the_widths_it_admitted():
    """Rows are counted once per step and grow with each admission: an n=3 request admitted first leaves
    one of four rows, so of the two n=1 requests behind it only the first joins in the same step."""
    h = Harness(max_num_seqs=4)
    wide = h.add([1, 2, 3], max_tokens=2, n=3)
    a, b = h.add([4, 5], max_tokens=2)[0], h.add([6, 7], max_tokens=2)[0]
    out = h.step()
    assert [c.seq for c in out.chunks] == [wide[0], a]
    assert sum(s.width for s in h.sched.running) == 4 and b.status is SeqStatus.WAITING
    h.run()
    assert all(s.output_token_ids == expected_output([1, 2, 3], 2) for s in wide)
    assert b.output_token_ids == expected_output([6, 7], 2)


def first_steps(h: Harness, seqs: list[Sequence], max_steps: int = 200) -> list[int]:
    """Run h to the end; -> the step at which each of seqs first took a batch row."""
    started: dict[int, int] = {}
    for step in range(max_steps):
        if not h.sched.has_work() and h.in_flight is None:
            return [started[s.seq_id] for s in seqs]
        for s in h.step().new_rows:
            started.setdefault(s.seq_id, step)
    raise AssertionError("did not finish")


def test_a_request_that_fits_is_admitted_past_a_wide_one_that_does_not():
    """Rows: `long` holds one of three; the n=3 request behind it needs all three, so the small ones behind
    it enter first (each counted against it), and it enters once `long` ends. Every output stays exact."""
    h = Harness(max_num_seqs=3)
    long = h.add([1, 2], max_tokens=8)[0]
    wide = h.add([3, 4, 5], max_tokens=2, n=3)
    small = [h.add([6, i], max_tokens=2)[0] for i in range(2)]
    steps = first_steps(h, [long, wide[0], *small])
    assert steps[0] == steps[2] == steps[3] == 0 and steps[1] > 0
    assert wide[0].times_passed == 2 and small[0].times_passed == small[1].times_passed == 0
    assert long.output_token_ids == expected_output([1, 2], 8)
    assert all(s.output_token_ids == expected_output([3, 4, 5], 2) for s in wide)
    assert all(s.output_token_ids == expected_output([6, i], 2) for i, s in enumerate(small))
    assert h.kv.usage().used_blocks == 0


def test_a_short_prompt_is_admitted_past_a_long_one_that_lacks_blocks():
    h = Harness(num_blocks=9, block_size=4, caching=False)  # 8 usable blocks = 32 slots
    held = h.add(list(range(10, 26)), max_tokens=6)[0]  # 16 + 6 tokens: 6 blocks at the end
    big = h.add(list(range(30, 46)), max_tokens=1)[0]  # needs 4 blocks, finds 4 free less those kept free
    short = h.add([50, 51], max_tokens=1)[0]  # needs 1
    steps = first_steps(h, [held, big, short])
    assert steps[2] < steps[1] and big.times_passed >= 1
    assert big.output_token_ids == expected_output(list(range(30, 46)), 1)
    assert short.output_token_ids == expected_output([50, 51], 1)


def test_a_request_passed_max_passes_times_holds_the_queue(monkeypatch):
    monkeypatch.setattr(scheduler_module, "MAX_PASSES", 2)
    h = Harness(max_num_seqs=2)
    long = h.add([1, 2], max_tokens=12)[0]
    wide = h.add([3, 4], max_tokens=2, n=2)
    small = [h.add([6, i], max_tokens=1)[0] for i in range(4)]
    steps = first_steps(h, [long, wide[0], *small])
    # two small ones pass the wide one; the third and fourth wait for it, which waits for `long`
    assert max(steps[2:4]) < steps[1] <= min(steps[4:6]) and wide[0].times_passed == 2
    assert steps[1] == 12  # `long` runs steps 0-11 (prefill + 11 decodes) before its row frees
    assert all(s.output_token_ids == expected_output([3, 4], 2) for s in wide)


def test_one_step_admits_at_most_max_passes_past_a_waiting_request():
    """A step with rows for many small requests stops admitting past the wide one once it has been passed
    MAX_PASSES times (a review: the bound was checked only when the scan reached it, and 60 entered)."""
    h = Harness(max_num_seqs=64, max_tokens_per_step=1024, num_blocks=512)
    h.add([1, 2], max_tokens=8)
    wide = h.add([3, 4, 5], max_tokens=2, n=64)
    small = [h.add([6, i], max_tokens=2)[0] for i in range(60)]
    out = h.step()
    assert wide[0].times_passed == scheduler_module.MAX_PASSES
    assert len(out.new_rows) == 1 + scheduler_module.MAX_PASSES
    assert sum(s.status is SeqStatus.WAITING for s in small) == 60 - scheduler_module.MAX_PASSES


def test_a_step_stops_after_allocation_tries_failed_block_allocations():
    """Each failed allocation walks its prompt's cached prefix: a step makes at most ALLOCATION_TRIES."""
    h = Harness(num_blocks=41, block_size=4, max_num_seqs=64, max_tokens_per_step=1024)
    h.add(list(range(100, 132)), max_tokens=200)  # 8 blocks, growing
    for _ in range(3):
        h.step()
    for i in range(20):  # 40 blocks each: none fits
        h.add([7 + i] * 160, max_tokens=1)
    calls = []
    allocate = h.kv.allocate
    h.kv.allocate = lambda *a, **k: calls.append(r := allocate(*a, **k)) or r
    for _ in range(5):
        calls.clear()
        h.step()
        assert calls == [None] * scheduler_module.ALLOCATION_TRIES


def test_admission_looks_at_most_pass_depth_sequences_past_the_first_that_does_not_fit(monkeypatch):
    monkeypatch.setattr(scheduler_module, "PASS_DEPTH", 1)
    h = Harness(max_num_seqs=2)
    long = h.add([1, 2], max_tokens=6)[0]
    wide = [h.add([3, i], max_tokens=1, n=2)[0] for i in range(2)]
    small = h.add([6, 7], max_tokens=1)[0]
    out = h.step()
    assert [c.seq for c in out.chunks] == [long] and small.status is SeqStatus.WAITING
    assert first_steps(h, [small])  # it still runs, once the wide ones have
    assert all(w.output_token_ids == expected_output([3, i], 1) for i, w in enumerate(wide))


@pytest.mark.parametrize("preempted", [True, False])
def test_a_preempted_sequence_holds_the_queue(monkeypatch, preempted):
    """A preempted sequence at the front that cannot get its blocks back is never passed; a new one is."""
    h = Harness(max_num_seqs=3)
    a = h.add([1, 2], max_tokens=3)[0]
    h.step()
    h.sched._preempt(a, SchedulerOutput())  # as _reserve_slots does when blocks run out
    a.num_preemptions = int(preempted)
    small = h.add([6, 7], max_tokens=1)[0]
    admit = h.sched._admit
    monkeypatch.setattr(h.sched, "_admit", lambda seq, out: seq is not a and admit(seq, out))
    h.step()
    assert h.sched.waiting[0] is a
    assert (small.status is SeqStatus.WAITING) is preempted


def test_preemption_frees_latest_requeues_at_front_and_resumes_exactly():
    h = Harness(num_blocks=7, block_size=4, caching=False)  # 6 usable blocks = 24 slots
    a = h.add(list(range(1, 7)), max_tokens=12)[0]  # 18 tokens = 5 blocks at the end
    b = h.add(list(range(11, 17)), max_tokens=12)[0]
    c = h.add([20, 21], max_tokens=2)[0]
    preempted_seen = False
    while h.sched.has_work():
        out = h.step()
        if out.preempted:
            preempted_seen = True
            victim = out.preempted[0]
            assert victim is b  # the most recently admitted one still running
            assert h.sched.waiting[0] is b and b.num_computed_tokens == 0
            assert not h.kv.has_seq(b.seq_id)
    assert preempted_seen and h.sched.num_preemptions >= 1 and b.num_preemptions >= 1
    assert a.output_token_ids == expected_output(list(range(1, 7)), 12)
    assert b.output_token_ids == expected_output(list(range(11, 17)), 12)
    assert c.output_token_ids == expected_output([20, 21], 2)
    assert h.kv.usage().used_blocks == 0


@pytest.mark.parametrize("async_", [False, True])
@pytest.mark.parametrize("caching", [True, False])
def test_many_sequences_through_a_small_cache_all_exact(caching, async_):
    h = Harness(num_blocks=13, block_size=4, max_num_seqs=6, max_tokens_per_step=10, caching=caching,
                async_=async_)
    prompts = [[7, 7, 7, 7, 7, 7, 7, 7, i] for i in range(8)]  # shared prefix: prefix-cache hits
    seqs = [h.add(p, max_tokens=8 + i)[0] for i, p in enumerate(prompts)]
    h.run()
    for i, (p, s) in enumerate(zip(prompts, seqs, strict=True)):
        assert s.output_token_ids == expected_output(p, 8 + i)
    assert h.sched.num_preemptions > 0
    assert h.kv.usage().used_blocks == 0
    if caching:
        assert h.kv.usage().prefix_hits > 0


@pytest.mark.parametrize("async_", [False, True])
def test_salted_sequences_hit_their_own_salt_only_through_forks_and_preemptions(async_):
    """Identical prompts under three salts through a small cache: after every step each running sequence's
    first block, once hashed, roots at its own salt (check_integrity chains the rest on it); hits within each
    salt still come."""
    h = Harness(num_blocks=13, block_size=4, max_num_seqs=6, max_tokens_per_step=10, async_=async_)
    prompt = [7, 7, 7, 7, 7, 7, 7, 7, 1]
    salts = [None, "a", "b"] * 3
    seqs = [h.add(prompt, max_tokens=6 + i, n=1 + i % 2, cache_salt=salt) for i, salt in enumerate(salts)]
    pool = h.kv.pool
    for _ in range(500):
        if not h.sched.has_work() and h.in_flight is None:
            break
        h.step()
        for seq in h.sched.running:
            first = h.kv.block_table(seq.seq_id)[0]
            if pool.block_hash(first) is not None:
                salt = seq.params.cache_salt
                assert pool.block_parent_tag(first) == chain_root(salt), salt
    for i, choices in enumerate(seqs):
        assert all(s.output_token_ids == expected_output(prompt, 6 + i) for s in choices)
    assert h.sched.num_preemptions > 0 and h.kv.usage().prefix_hits > 0
    assert h.kv.usage().used_blocks == 0


@pytest.mark.parametrize("async_", [False, True])
def test_fork_shares_the_prefill_and_copies_the_partial_block(async_):
    h = Harness(block_size=4, async_=async_)
    prompt = [5, 6, 7, 8, 9, 10]  # one full block + a partial one
    seqs = h.add(prompt, max_tokens=3, n=3)
    out = h.step()
    assert [c.num_tokens for c in out.chunks] == [6]  # one prefill for three choices
    assert all(s.status is SeqStatus.RUNNING for s in seqs)
    tables = [h.kv.block_table(s.seq_id) for s in seqs]
    assert tables[0][0] == tables[1][0] == tables[2][0]  # the full block is shared
    assert len({t[1] for t in tables}) == 3  # the partial block was copied
    out = h.step()
    assert sorted(c.seq.index for c in out.chunks) == [0, 1, 2] and out.num_prefill_tokens == 0
    h.run()
    assert all(s.output_token_ids == expected_output(prompt, 3) for s in seqs)


@pytest.mark.parametrize("async_", [False, True])
def test_a_prompt_ending_in_a_one_token_chunk_still_forks_there(async_):
    """n = 3 and a 7-token prompt over a 6-token budget: the last prompt token runs alone. That chunk is
    the parent's prefill end, so the siblings fork from it and all three decode side by side (it was taken
    for a decode: the children stayed pending while the parent decoded, and a preemption of the parent
    then forked them with its generated tokens counted as computed)."""
    h = Harness(block_size=4, max_tokens_per_step=6, async_=async_)
    prompt = [5, 6, 7, 8, 9, 10, 11]
    seqs = h.add(prompt, max_tokens=4, n=3)
    assert [c.num_tokens for c in h.step().chunks] == [6]
    out = h.step()
    assert [(c.seq.index, c.num_tokens) for c in out.prefills] == [(0, 1)] and not out.decodes
    assert all(s.status is SeqStatus.RUNNING for s in seqs) and len(out.samples) == 3
    h.run()
    assert all(s.output_token_ids == expected_output(prompt, 4) for s in seqs)
    assert h.kv.usage().used_blocks == 0


def test_an_aborted_pending_choice_is_never_forked():
    """One choice of n = 2 aborted while its parent still prefills: it leaves the parent's fork list (it was
    marked finished but forked anyway, and finished a second time)."""
    h = Harness(block_size=4, max_tokens_per_step=4)
    parent, child = h.add(list(range(1, 11)), max_tokens=3, n=2)
    h.step()
    h.sched.finish(child)
    assert parent.fork_children == [] and parent.width == 1
    h.run()
    assert child.status is SeqStatus.FINISHED and child.output_token_ids == []
    assert parent.output_token_ids == expected_output(list(range(1, 11)), 3)


def test_finish_of_waiting_and_running_sequences_releases_everything():
    h = Harness(max_num_seqs=1)
    a = h.add([1, 2, 3], max_tokens=50)[0]
    b = h.add([4, 5, 6], max_tokens=50, n=2)[0]
    h.step()
    h.sched.finish(b)  # waiting, with a pending child
    h.sched.finish(a)  # running
    assert not h.sched.has_work() and h.kv.usage().used_blocks == 0
    assert b.fork_children == [] and a.is_finished and b.is_finished


def test_async_token_of_a_finished_sequence_is_discarded_and_its_blocks_freed():
    """Finished at step N (say EOS) while step N+1 already computes its next token: that token is dropped."""
    h = Harness(async_=True)
    (a,) = h.add([1, 2, 3], max_tokens=20)
    (b,) = h.add([4, 5, 6], max_tokens=20)
    first = h.sched.schedule()
    tokens = h.launch(first)
    second = h.sched.schedule()  # planned while `first` runs: both decode their pending token
    assert second.decodes == [a, b] and a.num_pending == 2  # its tokens of both steps
    tokens2 = h.launch(second)
    taken = h.sched.postprocess(first, tokens)
    assert [s for _, s in taken] == [a, b]
    h.sched.finish(a)  # a's first token ended it
    assert not h.kv.has_seq(a.seq_id)
    taken = h.sched.postprocess(second, tokens2)
    assert [s for _, s in taken] == [b]  # a's wasted token is discarded
    assert a.output_token_ids == expected_output([1, 2, 3], 1)
    assert b.output_token_ids == expected_output([4, 5, 6], 2)


def test_async_a_last_token_in_flight_is_not_scheduled_again():
    h = Harness(async_=True)
    (a,) = h.add([1, 2, 3], max_tokens=1)
    (b,) = h.add([4, 5], max_tokens=5)
    h.step()  # both prefilled: a's only token is in flight
    out = h.step()
    assert out.decodes == [b]
    h.run()
    assert a.output_token_ids == expected_output([1, 2, 3], 1) and a.is_finished
    assert b.output_token_ids == expected_output([4, 5], 5)


def test_rows_are_unique_among_running_and_returned_on_finish():
    h = Harness(max_num_seqs=3, async_=True)
    seqs = [h.add([i, i + 1, i + 2], max_tokens=3 + i)[0] for i in range(6)]
    for _ in range(200):
        if not h.sched.has_work() and h.in_flight is None:
            break
        h.step()
        rows = [s.row for s in h.sched.running]
        assert len(set(rows)) == len(rows) and all(0 <= r < 3 for r in rows)
    assert sorted(h.sched.free_rows) == [0, 1, 2]
    assert all(s.output_token_ids == expected_output([i, i + 1, i + 2], 3 + i) for i, s in enumerate(seqs))
