"""CUDA graphs of whole steps: the decode forward captured once per batch size, and mixed steps (prefill
chunks, with or without decode rows) once per token count; each replayed with one launch per step.

A step of a small model is host bound (every layer launches ~10 kernels through Python); a graph replays them
all from one call. The graphs read one fixed (static) input buffer and write a static output: a step packs its
flat batch (batch_state.FlatLayout: tokens as (row, position, token id), then the prefill chunks) padded to
the next captured size, copies it into the buffer and replays. Everything else the forward needs is derived
inside the graph from the runner's persistent BatchState: the input ids of rows decoding a token sampled last
step (read from the device, never from the host), the block tables (gathered by row, full max_model_len width,
so each graph's launch config is fixed at capture and valid for any sequence length),
sequence lengths and slots. Padding is inert: padding tokens are the all-null pad row at position -1
(seq_len 0: the attention reads nothing; slot -1: the K/V store writes nothing), padding chunks are empty.

DecodeGraphs (decode rows only) end with the final norm and the lm_head: their static output holds
(size, vocab) logits in the model dtype. Having read its tokens, a decode graph rewrites them in the buffer
as the same rows' next step reads them (kernels/step_inputs.py, ADVANCE: positions one on, ids -1), so a
step that decodes exactly the rows of the previous decode replay one position further replays with no
input copy at all (`replay(None, ...)`; the runner decides when, ModelRunner._repeats_last_decode).
MixedGraphs run the decode kernel over 16, 64 or min(size, max_seqs)
rows (the fewest that hold the step's decodes), of which the step's decode count (a device int in the buffer)
are real and the rest read nothing, and the prefill kernel over every chunk, whose rows it finds from
query_start_loc; their output is the final hidden states of the out rows (min(size, max_seqs) padded
to a logit-row count, hidden): the rows the step's samples read, which the buffer lists (padding: row 0).
The last layer runs its o_proj and MLP for those rows alone (LlamaForCausalLM.forward's out_rows), and the
runner computes their logits after the replay.
All graphs share one memory pool, captured largest first so the smaller ones reuse its blocks (the vLLM /
nano-vllm recipe).
"""

from __future__ import annotations

import bisect
import gc
import logging
import time
from collections.abc import Callable, Hashable, Sequence

import torch

from server.engine.batch_state import BatchState, FlatLayout

log = logging.getLogger(__name__)

# Graph pool headroom beyond the activations measured when sizing the KV cache: cuBLAS workspaces of the
# capture stream, split-KV partial buffers, allocator rounding.
GRAPH_MEMORY_MARGIN = 256 << 20

# forward(input_ids (T,), positions (T,), meta, out_rows (R,)) -> (R, out_width) (mixed steps), or
# forward(..., out) writing (T, out_width) into out (decode steps); T = the padded batch size
DecodeForward = Callable[..., torch.Tensor | None]


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture, ascending: 1, 2, 4, 8, then every 16, and max_num_seqs itself."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = [s for s in (1, 2, 4, 8) if s <= max_num_seqs] + list(range(16, max_num_seqs + 1, 16))
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


# Steps of up to this many tokens replay a mixed graph; larger ones run eagerly. An eager step's launches
# cost ~7 ms of host time on the H200's host (64 decodes + 2048 prefill tokens: 14.6 ms wall, 7.5 ms of
# kernels), which async scheduling cannot hide behind a 1.5 ms decode step: the budget's default is covered.
MAX_MIXED_TOKENS = 8192


def mixed_sizes(max_num_batched_tokens: int) -> list[int]:
    """Token counts to capture mixed steps at, ascending: 16, 32, 64, then every 64 up to 1024, every 128 up
    to 2048, every 256 up to 4096 and every 512 up to MAX_MIXED_TOKENS, capped by the step budget, which is
    itself the last size when below MAX_MIXED_TOKENS. Above ~300 tokens a step's GEMMs are compute bound and
    its padding tokens cost their share: on the H200, 64 decodes + 256 prompt tokens padded to 512 ran 2.94 ms
    of kernels against 2.20 eager, and + 512 padded to 768 3.72 against 3.14; the steps here keep padding
    under 1/5 of a step from 320 tokens on."""
    top = min(max_num_batched_tokens, MAX_MIXED_TOKENS)
    ladder = [16, 32, 64, *range(128, 1025, 64), *range(1152, 2049, 128), *range(2304, 4097, 256),
              *range(4608, MAX_MIXED_TOKENS + 1, 512)]
    sizes = [s for s in ladder if s <= top]
    if not sizes or sizes[-1] != top:
        sizes.append(top)
    return sizes


# Decode-row counts a mixed graph is captured at below its cap (MixedGraphs.decode_row_counts): the decodes
# of a step beside prefill chunks are few (a burst's first steps, low concurrency) or many (a full batch).
MIXED_DECODE_ROWS = (16, 64)


def padded_size(num_seqs: int, sizes: Sequence[int]) -> int | None:
    """Smallest captured size >= num_seqs (sizes ascending); None above the largest (run eagerly)."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


class StepGraphs:
    """One captured forward per key (a size, or what a subclass keys its graphs by), sharing the static input
    buffer, the output and a pool. Subclasses say what a key holds (layout, decode rows) and what the body
    computes.

    use_cuda_graphs=False keeps every buffer and the padding but runs the forward eagerly on replay: the same
    path minus the capture, so CPU tests cover it.
    """

    kind = "step"

    def __init__(self, forward: DecodeForward, sizes: Sequence[int], state: BatchState, out_width: int,
                 dtype: torch.dtype, device: torch.device, use_cuda_graphs: bool = True) -> None:
        if list(sizes) != sorted(set(sizes)) or sizes[0] < 1:
            raise ValueError(f"sizes must be ascending distinct positive ints, got {list(sizes)}")
        self.forward, self.sizes, self.max_size = forward, list(sizes), sizes[-1]
        self.state = state
        self.use_cuda_graphs = use_cuda_graphs
        self.keys = self._keys()  # capture order: largest first
        self.inputs = torch.zeros(max(self.layout(k).length for k in self.keys), dtype=torch.int32,
                                  device=device)  # (L,) the flat batch of the key replayed last
        rows = max(self.max_size, *(self.layout(k).num_out for k in self.keys))  # out rows may pad past size
        self.output = torch.zeros(rows, out_width, dtype=dtype, device=device)  # (n, out_width)
        self.graphs: dict[Hashable, torch.cuda.CUDAGraph] = {}
        self.num_replays = 0
        self.num_reused_inputs = 0  # replays that ran on the inputs the previous one left (replay(None, ...))
        self.last_key: Hashable | None = None  # what the last replay ran (tests, benchmarks)

    def _keys(self) -> list[Hashable]:
        return list(reversed(self.sizes))

    def layout(self, key) -> FlatLayout:
        raise NotImplementedError

    def fits(self, num: int) -> bool:
        return num <= self.max_size

    def padded_size(self, num: int) -> int | None:
        return padded_size(num, self.sizes)

    # ---- capture ------------------------------------------------------------------------------------

    def _body(self, key) -> None:
        """The captured region: forward of the key's static flat batch into the static output."""
        raise NotImplementedError

    def _pad_inputs(self, key) -> None:
        """Inert inputs to warm up and capture with: padding tokens only, no chunks."""
        layout = self.layout(key)
        pad = self.state.pad_row
        t, c = layout.num_tokens, layout.num_chunks
        flat = layout.pack([pad] * t, [-1] * t, [0] * t, [pad] * c, [0] * (c + 1), [0] * c, 0)
        self.inputs[:layout.length].copy_(torch.from_numpy(flat))

    @torch.inference_mode()
    def capture(self, pool=None) -> None:
        """Warm up (compiles the Triton kernels for these exact shapes) and capture, largest first, into
        `pool` (a new one if None)."""
        if not self.use_cuda_graphs:
            for key in self.keys:
                self._pad_inputs(key)
                self._body(key)
            return
        device = self.output.device
        torch.cuda.synchronize(device)
        free_before, _ = torch.cuda.mem_get_info(device)
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle() if pool is None else pool
        stream = torch.cuda.Stream(device)  # warm-up and capture on one side stream (its cuBLAS workspace)
        gc_was_enabled = gc.isenabled()
        gc.disable()  # a collection inside a capture could unload a Triton module and invalidate it
        try:
            with torch.cuda.stream(stream):
                for key in self.keys:
                    self._pad_inputs(key)
                    self._body(key)  # warm-up: compiles and allocates outside the capture
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool, stream=stream):
                        self._body(key)
                    self.graphs[key] = graph
        finally:
            if gc_was_enabled:
                gc.enable()
        torch.cuda.synchronize(device)
        free_after, _ = torch.cuda.mem_get_info(device)
        log.info("runner: captured %d CUDA %s graphs (sizes %s, %d-block tables) in %.2f s, %.1f MiB of "
                 "device memory", len(self.graphs), self.kind, self.sizes, self.state.max_blocks,
                 time.perf_counter() - start, (free_before - free_after) / 2**20)

    # ---- replay -------------------------------------------------------------------------------------

    def replay(self, flat: torch.Tensor | None, num: int, key) -> torch.Tensor:
        """flat: (layout(key).length,) device int32, the step's flat batch padded to the key's layout, or None
        to run on the buffer as the last replay (of this key) left it. -> (num, out_width), a view of the
        static output that the next replay overwrites."""
        if flat is None:
            self.num_reused_inputs += 1
        else:
            self.inputs[:flat.shape[0]].copy_(flat)
        if self.use_cuda_graphs:
            self.graphs[key].replay()
        else:
            self._body(key)
        self.num_replays += 1
        self.last_key = key
        return self.output[:num]


class DecodeGraphs(StepGraphs):
    """Decode steps of `size` rows (the step's, then padding rows); the forward writes their logits into the
    static output (forward(input_ids, positions, meta, out))."""

    kind = "decode"

    def layout(self, size: int) -> FlatLayout:
        return FlatLayout(size, 0)

    def _body(self, size: int) -> None:
        tokens = self.layout(size).views(self.inputs)[0]
        input_ids, positions, meta = self.state.step_inputs(tokens, size, advance=True)
        self.forward(input_ids, positions, meta, self.output[:size])  # writes the (size, vocab) logits


class MixedGraphs(StepGraphs):
    """Steps of `size` tokens holding prefill chunks: decode rows first, then up to min(size, max_seqs)
    chunks, then padding tokens; the forward gives the hidden states of the out rows (the samples'
    logit rows, padded with row 0 to the logit-row count of min(size, max_seqs) samples). Graphs are keyed
    (size, decode rows): (size, 0) for steps of chunks only, which launch no decode attention, and (size, d)
    for d in decode_row_counts(size), the decode call covering d rows of which the buffer's decode count are
    real. A spare row costs its share of the decode launch (on an H200, 128 spare rows were ~70 us of a
    2.1 ms step of 64 decodes + 128 prompt tokens), so a step takes the smallest d that holds its decodes."""

    kind = "mixed"

    def __init__(self, forward: DecodeForward, sizes: Sequence[int], state: BatchState, max_seqs: int,
                 out_width: int, dtype: torch.dtype, device: torch.device,
                 use_cuda_graphs: bool = True) -> None:
        self.max_seqs = max_seqs
        # the runner's logit-row counts (ModelRunner.logit_counts), which out rows pad to; layout() reads
        # them at every step
        self.logit_counts = capture_sizes(max_seqs)
        super().__init__(forward, sizes, state, out_width, dtype, device, use_cuda_graphs)

    def decode_row_counts(self, size: int) -> list[int]:
        """The decode-row counts captured at `size`, ascending: those of MIXED_DECODE_ROWS below the cap
        min(size, max_seqs), then the cap."""
        cap = min(size, self.max_seqs)
        return [d for d in MIXED_DECODE_ROWS if d < cap] + [cap]

    def _keys(self) -> list[tuple[int, int]]:
        return [(s, d) for s in reversed(self.sizes) for d in [*reversed(self.decode_row_counts(s)), 0]]

    def layout(self, key: tuple[int, int]) -> FlatLayout:
        cap = min(key[0], self.max_seqs)  # chunks, and samples: one per running sequence at most
        # out rows: the padded logit-row count of `cap` samples, so the padded rows of any step of this size
        # fit and the logits product runs at a count start-up warmed (a budget below max_seqs can make the
        # last size, and cap, any number)
        return FlatLayout(key[0], cap, num_out=padded_size(cap, self.logit_counts))

    def takes(self, num_tokens: int, num_decode: int, num_chunks: int) -> tuple[int, int] | None:
        """The key a step of these counts replays, or None (it runs eagerly)."""
        size = self.padded_size(num_tokens)
        cap = None if size is None else min(size, self.max_seqs)
        if cap is None or num_decode > cap or num_chunks > cap:
            return None
        if not num_decode:
            return size, 0
        return size, next(d for d in self.decode_row_counts(size) if d >= num_decode)

    def _body(self, key: tuple[int, int]) -> None:
        size, decode_rows = key
        tokens, chunk_rows, qsl, lens, num_decode, out_rows = self.layout(key).views(self.inputs)
        input_ids, positions, meta = self.state.step_inputs(tokens, decode_rows,
                                                            num_decode if decode_rows else None,
                                                            (chunk_rows, qsl, lens))
        hidden = self.forward(input_ids, positions, meta, out_rows.long())  # (num_out, hidden)
        self.output[:hidden.shape[0]].copy_(hidden)
