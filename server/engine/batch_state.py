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
from dataclasses import dataclass

import numpy as np
import torch

from server.engine.attention import AttentionMetadata, PrefillMetadata

TOKEN_FIELDS = 3  # row, position, token id (-1: the row's last sampled token, on the device)


class BatchState:
    def __init__(self, max_rows: int, max_blocks: int, block_size: int, device: torch.device,
                 kernel_inputs: bool = False) -> None:
        self.max_rows, self.max_blocks, self.block_size = max_rows, max_blocks, block_size
        self.kernel_inputs = kernel_inputs  # step inputs through the Triton kernel (else torch ops)
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

    def step_inputs(self, tokens: torch.Tensor, num_decode_rows: int, num_decode: torch.Tensor | None = None,
                    chunks: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                    advance: bool = False) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """A step's flat batch from device ints -> input_ids (T,), positions (T,), AttentionMetadata. Pure
        device ops (graph-capturable).

        tokens: (TOKEN_FIELDS, T) int32 [rows | positions (-1: padding) | token ids (-1: last sampled)],
        the decode rows first, then the prefill chunks' tokens, then padding. The decode kernel runs over the
        first num_decode_rows; with `num_decode` (a (1,) device count, the captured mixed steps) only that
        many of them are decode rows and the rest read nothing (seq_len 0). chunks: the prefill chunks'
        table rows (C,), query_start_loc (C + 1,) into the flat batch (chunk 0 starts after the decode rows)
        and seq_lens (C,). advance: then rewrite tokens in place as the same rows' next decode step reads
        them (real positions one on, their ids -1: the token this step samples, recorded on the device)."""
        d = num_decode_rows
        if self.kernel_inputs:  # one Triton launch; imported here: triton is not on every CPU-only install
            from kernels.step_inputs import step_inputs as kernel

            input_ids, pos, slots, seq_lens = kernel(tokens, self.last_token, self.block_tables,
                                                     self.block_size, d, num_decode, advance)
        else:
            input_ids, pos, slots, seq_lens = self._derive(tokens, d, num_decode)
            if advance:
                valid = tokens[1] >= 0
                tokens[1] += valid.int()
                tokens[2].masked_fill_(valid, -1)
        prefill = None
        if chunks is not None:
            table_rows, qsl, lens = chunks
            prefill = PrefillMetadata(self.block_tables.index_select(0, table_rows), qsl, lens)
        meta = AttentionMetadata(slot_mapping=slots, num_decode=d,
                                 block_tables=self.block_tables.index_select(0, tokens[0, :d]),
                                 seq_lens=seq_lens, prefill=prefill)
        return input_ids, pos, meta

    def _derive(self, tokens: torch.Tensor, d: int, num_decode: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """step_inputs' per-token part in torch ops (CPU, the torch backend; the kernel's reference) ->
        input_ids, positions, slots (T,) int64 and the decode rows' seq_lens (d,) int32."""
        rows, pos, ids = tokens.long().unbind(0)  # (T,) each
        input_ids = torch.where(ids >= 0, ids, self.last_token[rows])
        valid = pos >= 0
        pos = pos.clamp(min=0)
        bs = self.block_size
        block = self.block_tables[rows, pos // bs].long()
        slots = torch.where(valid, block * bs + pos % bs, torch.full_like(pos, -1))
        seq_lens = torch.where(valid[:d], pos[:d] + 1, 0)
        if num_decode is not None:
            seq_lens = torch.where(torch.arange(d, device=pos.device) < num_decode, seq_lens, 0)
        return input_ids, pos, slots, seq_lens.int()


def _aligned(n: int) -> int:
    """The first int32 offset >= n on a 16-byte boundary."""
    return -(-n // StepPacker.ALIGN) * StepPacker.ALIGN


@dataclass(frozen=True)
class FlatLayout:
    """Where a step's flat-batch ints sit in its one packed section: tokens (TOKEN_FIELDS, T), then the
    prefill chunks' table rows (C,), query_start_loc (C + 1,), seq_lens (C,), the decode count (1,) and the
    out rows (R,): the flat-batch rows whose final hidden states the step reads (its samples' logit rows,
    padded with row 0); the forward runs the last layer past its attention for those rows only. Each part
    starts on a 16-byte boundary (see StepPacker): the kernels take query_start_loc and seq_lens as they lie
    here."""

    num_tokens: int
    num_chunks: int
    num_out: int = 0  # 0: every row's hidden state (the decode graphs: every row samples)

    def _starts(self) -> list[int]:
        t, c = self.num_tokens, self.num_chunks
        starts, end = [], 0
        for n in (TOKEN_FIELDS * t, c, c + 1, c, 1, self.num_out):
            starts.append(_aligned(end))
            end = starts[-1] + n
        return starts + [end]

    @property
    def length(self) -> int:
        return self._starts()[-1]

    def pack(self, rows: list[int], positions: list[int], ids: list[int], chunk_rows: list[int],
             qsl: list[int], lens: list[int], num_decode: int, out_rows: list[int] = ()) -> np.ndarray:
        """-> (length,) int32: the parts in place, zeros between them (and after out_rows, up to num_out:
        padding out rows read row 0)."""
        assert len(out_rows) <= self.num_out, "more out rows than the layout holds"
        starts = self._starts()
        out = np.zeros(starts[-1], dtype=np.int32)
        t = self.num_tokens
        out[0:t], out[t:2 * t], out[2 * t:3 * t] = rows, positions, ids
        for part, start in zip((chunk_rows, qsl, lens, [num_decode], out_rows), starts[1:6], strict=True):
            out[start:start + len(part)] = part
        return out

    def views(self, flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """flat (length,) device int32 -> tokens (TOKEN_FIELDS, T), chunk rows (C,), query_start_loc (C + 1,),
        seq_lens (C,), decode count (1,), out rows (R,), views of `flat`."""
        s, t, c = self._starts(), self.num_tokens, self.num_chunks
        return (flat[:TOKEN_FIELDS * t].view(TOKEN_FIELDS, t), flat[s[1]:s[1] + c], flat[s[2]:s[2] + c + 1],
                flat[s[3]:s[3] + c], flat[s[4]:s[4] + 1], flat[s[5]:s[5] + self.num_out])


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
        # the stream the steps launch on (the core thread's current one), looked up once: torch's
        # current_stream() walks ~8 Python calls per lookup (an environment read among them)
        self.stream = torch.cuda.current_stream(device) if self.pinned else None
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
            starts.append(_aligned(total))  # the next 16-byte boundary
            total = starts[-1] + n
        if total > self.capacity:
            if self.pinned:
                self.stream.synchronize()  # the old buffers may be in flight
            self._alloc(max(total, 2 * self.capacity))
        k = self._next
        self._next = (k + 1) % self.NUM_BUFFERS
        if self.done[k] is not None:
            self.done[k].synchronize()  # its previous copy has run: safe to overwrite
        view = self.views[k]
        for s, start, n in zip(sections, starts, sizes, strict=True):
            if n:
                view[start:start + n] = s
        if not self.pinned:
            dev = self.host[k][:total].clone()
        else:
            dev = self.dev[:total]
            dev.copy_(self.host[k][:total], non_blocking=True)
            event = self.done[k] = torch.cuda.Event()
            event.record(self.stream)
        # most sections of a decode step are empty: they share one empty view (a tensor slice costs ~2 us
        # of host time, and a batch-1 step has 14 sections, ~10 of them empty)
        empty = dev[:0]
        return [dev[start:start + n] if n else empty for start, n in zip(starts, sizes, strict=True)]


def floats_as_int32(values: Sequence[float]) -> np.ndarray:
    return np.asarray(values, dtype=np.float32).view(np.int32)
