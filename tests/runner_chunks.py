"""Drive a ModelRunner with hand-made chunks (token ids, start position, block table), as a test would
before the scheduler exists: each chunk becomes a one-step sequence in its own batch row (rows 0, 1, ...
in chunk order, their tables written whole), so the tests exercise the runner's real device-side inputs."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from server.engine.runner import ModelRunner
from server.engine.sampling_params import SamplingParams
from server.engine.scheduler import ScheduledChunk, SchedulerOutput
from server.engine.sequence import Sequence

GREEDY = SamplingParams(temperature=0.0)


@dataclass
class Chunk:
    token_ids: list[int]  # the new tokens to run this step (1 for decode)
    start_pos: int  # tokens of the sequence already in the cache before these
    block_table: list[int]  # physical blocks covering start_pos + len(token_ids) tokens
    slot_mapping: list[int] | None = None  # if given: asserted to be the slots the table implies

    def check_slots(self, block_size: int) -> None:
        if self.slot_mapping is None:
            return
        t, bs = self.block_table, block_size
        implied = [t[p // bs] * bs + p % bs
                   for p in range(self.start_pos, self.start_pos + len(self.token_ids))]
        assert self.slot_mapping == implied, "the runner derives slots from the block table"


def step_of(chunks: list[Chunk]) -> tuple[SchedulerOutput, dict[int, list[int]], list[int]]:
    """-> (step, tables by seq id, the sample index of each chunk)."""
    step, tables = SchedulerOutput(), {}
    singles, longer = [], []
    for i, c in enumerate(chunks):
        seq = Sequence(i, "test", 0, [0] * c.start_pos + list(c.token_ids), GREEDY, row=i)
        tables[i] = list(c.block_table)
        step.new_rows.append(seq)
        (singles if len(c.token_ids) == 1 else longer).append(i)
        if len(c.token_ids) == 1:
            step.decodes.append(seq)
            step.decode_positions.append(c.start_pos)
        else:
            step.prefills.append(ScheduledChunk(seq, c.start_pos, c.start_pos + len(c.token_ids), True))
    step.samples = step.decodes + [c.seq for c in step.prefills]
    step.sample_sources = list(range(len(step.samples)))
    order = singles + longer
    return step, tables, [order.index(i) for i in range(len(chunks))]


def run_chunks(runner: ModelRunner, chunks: list[Chunk]) -> torch.Tensor:
    """-> (len(chunks), V) fp32 logits of each chunk's last token, in chunk order."""
    for c in chunks:
        c.check_slots(runner.block_size)
    step, tables, index = step_of(chunks)
    logits = runner.forward_step(step, tables.__getitem__).logits
    return logits[torch.tensor(index, device=logits.device)]


class RaggedBatch:
    """Sequences of random tokens with ragged lengths in shuffled physical blocks, fed one token per step."""

    def __init__(self, lengths: list[int], block_size: int, num_blocks: int, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.free = list(range(1, num_blocks))
        self.rng.shuffle(self.free)
        self.block_size = block_size
        self.seqs = [[self.rng.randrange(3, 259) for _ in range(n)] for n in lengths]
        self.tables: list[list[int]] = [[] for _ in lengths]

    def _chunk(self, i: int, start: int) -> Chunk:
        seq, table, bs = self.seqs[i], self.tables[i], self.block_size
        while len(table) * bs < len(seq):
            table.append(self.free.pop())
        return Chunk(seq[start:], start, list(table))

    def prefill(self) -> list[Chunk]:
        return [self._chunk(i, 0) for i in range(len(self.seqs))]

    def decode(self) -> list[Chunk]:
        for seq in self.seqs:
            seq.append(self.rng.randrange(3, 259))
        return [self._chunk(i, len(s) - 1) for i, s in enumerate(self.seqs)]
