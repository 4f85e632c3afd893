"""The running sequences' batch state, kept on the device between steps and updated where a row changed.

Every RUNNING sequence holds a row (Sequence.row, handed out by the scheduler). Per row the device keeps its
block table and the last token sampled for it; row `pad_row` stays all null blocks and feeds padding rows.
A step's host input is then a few ints per scheduled row (row, position, token id or -1 for "the token the
row sampled last step") plus the block-table entries that are new since the row was last synced: a decode
row touches its table once per block_size tokens, not every step. Positions, sequence lengths and slots
are derived on the device, so the previous step's sampled ids feed the next step without the host.

Host ints travel in one packed int32 buffer per step (`StepPacker`), copied with one non-blocking copy from
pinned memory on CUDA; two pinned buffers alternate, each reused only after its previous copy ran.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from server.engine.attention import AttentionMetadata

DECODE_FIELDS = 3  # row, position, token id (-1: the row's last sampled token, on the device)


class BatchState:
    def __init__(self, max_rows: int, max_blocks: int, block_size: int, device: torch.device) -> None:
        self.max_rows, self.max_blocks, self.block_size = max_rows, max_blocks, block_size
        self.pad_row = max_rows
        # (R+1, W)
        self.block_tables = torch.zeros(max_rows + 1, max_blocks, dtype=torch.int32, device=device)
        # (R+1,), the sampler's dtype
        self.last_token = torch.zeros(max_rows + 1, dtype=torch.int64, device=device)
        self._synced = [0] * (max_rows + 1)  # blocks of each row's table already on the device
        # tokens those blocks cover: a decode below it needs no sync
        self.synced_tokens = [0] * (max_rows + 1)

    def reset_row(self, row: int) -> None:
        """A new sequence took `row`: its whole table is written at the next sync."""
        self._synced[row] = self.synced_tokens[row] = 0

    def table_writes(self, row: int, table: Sequence[int], out: list[int]) -> None:
        """Append (row, col, block) triples for the entries of `table` the device lacks."""
        done = self._synced[row]
        if len(table) > done:
            assert len(table) <= self.max_blocks, f"row {row}: {len(table)} blocks > {self.max_blocks}"
            for col in range(done, len(table)):
                out += (row, col, table[col])
            self._synced[row] = len(table)
            self.synced_tokens[row] = len(table) * self.block_size

    def apply_table_writes(self, writes: torch.Tensor) -> None:
        """writes: (3K,) int32 device triples from table_writes."""
        if writes.numel():
            rows, cols, blocks = writes.view(-1, 3).long().unbind(1)
            self.block_tables[rows, cols] = blocks.int()

    def record_samples(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """rows (S,), tokens (S,): the next decode step of each row reads its token from here."""
        self.last_token.index_copy_(0, rows.long(), tokens)

    def decode_inputs(self, dec: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """dec: (3, B) device int32 [rows | positions (-1: padding) | token ids (-1: last sampled)]
        -> input_ids (B,), positions (B,), decode-only AttentionMetadata. Pure device ops
        (graph-capturable)."""
        rows, pos, ids = dec.long().unbind(0)  # (B,) each
        input_ids = torch.where(ids >= 0, ids, self.last_token[rows])
        tables = self.block_tables.index_select(0, rows)  # (B, W)
        valid = pos >= 0
        pos = pos.clamp(min=0)
        bs = self.block_size
        block = tables.gather(1, (pos // bs)[:, None]).squeeze(1).long()
        slots = torch.where(valid, block * bs + pos % bs, torch.full_like(pos, -1))
        seq_lens = torch.where(valid, pos + 1, torch.zeros_like(pos)).int()
        meta = AttentionMetadata(slot_mapping=slots, num_decode=dec.shape[1], block_tables=tables,
                                 seq_lens=seq_lens)
        return input_ids, pos, meta

    def prefill_slots(self, rows: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """rows, pos (P,) per prefill token -> (P,) int64 cache slots."""
        bs = self.block_size
        rows, pos = rows.long(), pos.long()
        return self.block_tables[rows, pos // bs].long() * bs + pos % bs


class StepPacker:
    """One step's host ints as named int32 sections of one buffer (floats travel bit-cast). Each section
    starts on a 16-byte boundary: Triton specializes a pointer argument on 16-byte alignment, so sections
    at offsets that vary with the step's sizes would compile each kernel again for every new alignment
    pattern (a 1.6 s stall of every stream, measured mid-run on an H200)."""

    NUM_BUFFERS = 2
    ALIGN = 4  # int32 elements: 16 bytes

    def __init__(self, device: torch.device, capacity: int = 1 << 14) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        self._next = 0
        self._alloc(capacity)

    def _alloc(self, capacity: int) -> None:
        self.capacity = capacity
        self.host = [torch.empty(capacity, dtype=torch.int32, pin_memory=self.pinned)
                     for _ in range(self.NUM_BUFFERS)]
        self.views = [h.numpy() for h in self.host]
        self.done = [None] * self.NUM_BUFFERS  # CUDA event after each buffer's last copy
        self.dev = torch.empty(capacity, dtype=torch.int32, device=self.device) if self.pinned else None

    def send(self, sections: Sequence[Sequence[int] | np.ndarray]) -> list[torch.Tensor]:
        """Copy the sections to the device in one transfer -> one int32 device tensor per section."""
        sizes = [len(s) for s in sections]
        starts, total = [], 0
        for n in sizes:
            starts.append(-(-total // self.ALIGN) * self.ALIGN)  # the next 16-byte boundary
            total = starts[-1] + n
        if total > self.capacity:
            if self.pinned:
                torch.cuda.current_stream(self.device).synchronize()  # the old buffers may be in flight
            self._alloc(max(total, 2 * self.capacity))
        k = self._next
        self._next = (k + 1) % self.NUM_BUFFERS
        if self.done[k] is not None:
            self.done[k].synchronize()  # its previous copy has run: safe to overwrite
        view = self.views[k]
        for s, start, n in zip(sections, starts, sizes, strict=True):
            view[start:start + n] = s
        if not self.pinned:
            host = self.host[k][:total].clone()
            return [host[start:start + n] for start, n in zip(starts, sizes, strict=True)]
        dev = self.dev[:total]
        dev.copy_(self.host[k][:total], non_blocking=True)
        event = self.done[k] = torch.cuda.Event()
        event.record()
        return [dev[start:start + n] for start, n in zip(starts, sizes, strict=True)]


def floats_as_int32(values: Sequence[float]) -> np.ndarray:
    return np.asarray(values, dtype=np.float32).view(np.int32)
