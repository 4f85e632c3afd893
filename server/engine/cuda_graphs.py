"""CUDA-graph decode: the decode forward captured once per batch size, replayed with one launch per step.

A decode step of a small model is host bound (every layer launches ~25 kernels); a graph replays them all
from one call. The graphs read fixed (static) input buffers and write a static output, so a step copies its
inputs into those buffers, replays the graph of the next captured size >= its batch, and reads the first
rows. Padding rows are inert: seq_len 0 (the attention reads nothing and gives zeros), slot -1 (store_kv
writes nothing), token 0 at position 0, block table row of null blocks.

The block table is (max_size, max_blocks_per_seq) wide, blocks for max_model_len: the split heuristic reads
that width, so each graph's launch config is fixed at capture and valid for any sequence length. Entries
past a sequence's length are never dereferenced, so a step only writes the (size, width) corner it uses.

The runner's forward ends with the final norm and the lm_head, so the static output holds (max_size, vocab)
logits in the model dtype; the runner turns the real rows into fp32 after the replay. All graphs share one
memory pool, captured largest first so the smaller ones reuse its blocks (the vLLM / nano-vllm recipe).
"""

from __future__ import annotations

import bisect
import gc
import logging
import time
from collections.abc import Callable, Sequence

import torch

from server.engine.attention import AttentionMetadata

log = logging.getLogger(__name__)

# Graph pool headroom beyond the activations measured when sizing the KV cache: cuBLAS workspaces of the
# capture stream, split-KV partial buffers, allocator rounding.
GRAPH_MEMORY_MARGIN = 256 << 20
NUM_SCALARS = 4  # input_ids, positions, slot_mapping, seq_lens

# forward(input_ids (T,), positions (T,), meta) -> hidden (T, H); T = the padded batch size
DecodeForward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture, ascending: 1, 2, 4, 8, then every 16, and max_num_seqs itself."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = [s for s in (1, 2, 4, 8) if s <= max_num_seqs] + list(range(16, max_num_seqs + 1, 16))
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


def padded_size(num_seqs: int, sizes: Sequence[int]) -> int | None:
    """Smallest captured size >= num_seqs (sizes ascending); None above the largest (run eagerly)."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


def pack_decode_inputs(
    token_ids: Sequence[int],
    start_pos: Sequence[int],
    slots: Sequence[int],
    tables: Sequence[Sequence[int]],
    size: int,
    max_size: int,
) -> tuple[list[int], int]:
    """Host ints of one padded decode step -> (packed, width).

    packed = [input_ids | positions | slot_mapping | seq_lens], each max_size long (rows >= len(token_ids)
    are padding: token 0, position 0, slot -1, seq_len 0), then the (size, width) block tables row-major,
    width = the longest table, short rows and padding rows filled with the null block 0.
    """
    n = len(token_ids)
    if not 0 < n <= size <= max_size:
        raise ValueError(f"need 0 < num_seqs ({n}) <= size ({size}) <= max_size ({max_size})")
    pad = max_size - n
    width = max(map(len, tables))
    packed = list(token_ids) + [0] * pad
    packed += list(start_pos) + [0] * pad
    packed += list(slots) + [-1] * pad
    packed += [p + 1 for p in start_pos] + [0] * pad
    for t in tables:
        packed += t
        packed += [0] * (width - len(t))
    packed += [0] * ((size - n) * width)
    return packed, width


class DecodeGraphs:
    """One captured decode forward per size in `sizes`, sharing static inputs, the output and a pool.

    use_cuda_graphs=False keeps every buffer and the padding but runs the forward eagerly on replay: the same
    path minus the capture, so CPU tests cover it.
    """

    def __init__(
        self,
        forward: DecodeForward,
        sizes: Sequence[int],
        max_blocks_per_seq: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
        use_cuda_graphs: bool = True,
    ) -> None:
        if list(sizes) != sorted(set(sizes)) or sizes[0] < 1:
            raise ValueError(f"sizes must be ascending distinct positive ints, got {list(sizes)}")
        self.forward, self.sizes, self.max_size = forward, list(sizes), sizes[-1]
        self.max_blocks_per_seq = max_blocks_per_seq
        self.use_cuda_graphs = use_cuda_graphs
        n = self.max_size
        self.scalars = torch.zeros(NUM_SCALARS, n, dtype=torch.int32, device=device)  # (4, n)
        self.input_ids, self.positions, self.slot_mapping, self.seq_lens = self.scalars  # (n,) each
        self.slot_mapping.fill_(-1)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)  # (n, W)
        self.hidden = torch.zeros(n, hidden_size, dtype=dtype, device=device)  # (n, H)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.num_replays = 0

    def fits(self, num_seqs: int, width: int) -> bool:
        return num_seqs <= self.max_size and width <= self.max_blocks_per_seq

    def padded_size(self, num_seqs: int) -> int | None:
        return padded_size(num_seqs, self.sizes)

    # ---- capture ------------------------------------------------------------------------------------

    def _body(self, size: int) -> None:
        """The captured region: forward of the first `size` static rows into the static output."""
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            num_decode=size,
            block_tables=self.block_tables[:size],  # (size, W)
            seq_lens=self.seq_lens[:size],
        )
        hidden = self.forward(self.input_ids[:size], self.positions[:size], meta)  # (size, H)
        self.hidden[:size].copy_(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up (compiles the Triton kernels for these exact shapes) and capture, largest size first."""
        if not self.use_cuda_graphs:
            for size in reversed(self.sizes):
                self._body(size)
            return
        device = self.hidden.device
        torch.cuda.synchronize(device)
        free_before, _ = torch.cuda.mem_get_info(device)
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device)  # warm-up and capture on one side stream (its cuBLAS workspace)
        gc_was_enabled = gc.isenabled()
        gc.disable()  # a collection inside a capture could unload a Triton module and invalidate it
        try:
            with torch.cuda.stream(stream):
                for size in reversed(self.sizes):
                    self._body(size)  # warm-up: compiles and allocates outside the capture
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool, stream=stream):
                        self._body(size)
                    self.graphs[size] = graph
        finally:
            if gc_was_enabled:
                gc.enable()
        torch.cuda.synchronize(device)
        free_after, _ = torch.cuda.mem_get_info(device)
        log.info("runner: captured %d CUDA decode graphs (batch sizes %s, %d-block tables) in %.2f s, "
                 "%.1f MiB of device memory", len(self.graphs), self.sizes, self.max_blocks_per_seq,
                 time.perf_counter() - start, (free_before - free_after) / 2**20)

    # ---- replay -------------------------------------------------------------------------------------

    def replay(self, packed: torch.Tensor, num_seqs: int, size: int, width: int) -> torch.Tensor:
        """packed: pack_decode_inputs(...) on the device. -> (num_seqs, H) hidden, a view of the static
        output that the next replay overwrites."""
        scalars = NUM_SCALARS * self.max_size
        self.scalars.view(-1).copy_(packed[:scalars])
        self.block_tables[:size, :width].copy_(packed[scalars:].view(size, width))
        if self.use_cuda_graphs:
            self.graphs[size].replay()
        else:
            self._body(size)
        self.num_replays += 1
        return self.hidden[:num_seqs]
