"""CUDA-graph decode: the decode forward captured once per batch size, replayed with one launch per step.

A decode step of a small model is host bound (every layer launches ~25 kernels); a graph replays them all
from one call. The graphs read one fixed (static) input buffer and write a static output: a step writes its
decode rows (row, position, token id) into the buffer, replays the graph of the next captured size >= its
batch, and reads the first rows. Everything else the forward needs is derived inside the graph from the
runner's persistent BatchState: the input ids of rows decoding a token sampled last step (read from the
device, never from the host), the block tables (gathered by row, full max_model_len width: the split
heuristic reads that width, so each graph's launch config is fixed at capture and valid for any sequence
length), sequence lengths and slots. Padding rows are inert: the all-null pad row at position -1 (seq_len 0:
the attention reads nothing and gives zeros; slot -1: store_kv writes nothing).

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
from server.engine.batch_state import BatchState

log = logging.getLogger(__name__)

# Graph pool headroom beyond the activations measured when sizing the KV cache: cuBLAS workspaces of the
# capture stream, split-KV partial buffers, allocator rounding.
GRAPH_MEMORY_MARGIN = 256 << 20

# forward(input_ids (T,), positions (T,), meta) -> (T, out_width); T = the padded batch size
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


class DecodeGraphs:
    """One captured decode forward per size in `sizes`, sharing static inputs, the output and a pool.

    use_cuda_graphs=False keeps every buffer and the padding but runs the forward eagerly on replay: the same
    path minus the capture, so CPU tests cover it.
    """

    def __init__(
        self,
        forward: DecodeForward,
        sizes: Sequence[int],
        state: BatchState,
        out_width: int,
        dtype: torch.dtype,
        device: torch.device,
        use_cuda_graphs: bool = True,
    ) -> None:
        if list(sizes) != sorted(set(sizes)) or sizes[0] < 1:
            raise ValueError(f"sizes must be ascending distinct positive ints, got {list(sizes)}")
        self.forward, self.sizes, self.max_size = forward, list(sizes), sizes[-1]
        self.state = state
        self.use_cuda_graphs = use_cuda_graphs
        n = self.max_size
        self.inputs = torch.tensor([[state.pad_row], [-1], [0]], dtype=torch.int32, device=device).repeat(
            1, n)  # (DECODE_FIELDS, n): padding rows until a step writes them
        self.output = torch.zeros(n, out_width, dtype=dtype, device=device)  # (n, out_width)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.num_replays = 0

    def fits(self, num_seqs: int) -> bool:
        return num_seqs <= self.max_size

    def padded_size(self, num_seqs: int) -> int | None:
        return padded_size(num_seqs, self.sizes)

    # ---- capture ------------------------------------------------------------------------------------

    def _body(self, size: int) -> None:
        """The captured region: forward of the first `size` static rows into the static output."""
        input_ids, positions, meta = self.state.decode_inputs(self.inputs[:, :size])
        self.output[:size].copy_(self.forward(input_ids, positions, meta))  # (size, out_width)

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up (compiles the Triton kernels for these exact shapes) and capture, largest size first."""
        if not self.use_cuda_graphs:
            for size in reversed(self.sizes):
                self._body(size)
            return
        device = self.output.device
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
                 "%.1f MiB of device memory", len(self.graphs), self.sizes, self.state.max_blocks,
                 time.perf_counter() - start, (free_before - free_after) / 2**20)

    # ---- replay -------------------------------------------------------------------------------------

    def replay(self, decode: torch.Tensor, num_seqs: int, size: int) -> torch.Tensor:
        """decode: (DECODE_FIELDS, size) device int32, the step's rows then padding rows. -> (num_seqs,
        out_width), a view of the static output that the next replay overwrites."""
        self.inputs[:, :size].copy_(decode)
        if self.use_cuda_graphs:
            self.graphs[size].replay()
        else:
            self._body(size)
        self.num_replays += 1
        return self.output[:num_seqs]
