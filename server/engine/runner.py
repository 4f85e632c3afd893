"""ModelRunner: turns the scheduler's integer chunks into tensors, runs the decoder over the paged KV cache,
and returns the logits of each chunk's last token.

Per step it builds every index tensor (input ids, positions, slot mapping, decode and prefill block tables and
seq lens, prefill query offsets, logits rows) from one packed int32 host buffer: one (pinned, non-blocking)
copy on CUDA. Single-token chunks (decode, or a one-token prefill) are placed first and share one paged-decode
call; the longer chunks follow and share one paged-prefill call.
On CUDA (Triton backend) a batch of only single-token chunks replays a captured CUDA graph instead
(server/engine/cuda_graphs.py); mixed and prefill batches, and batches above the largest graph, run eagerly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

import kernels
from server.engine.attention import AttentionMetadata, PagedAttention, PrefillMetadata
from server.engine.cuda_graphs import GRAPH_MEMORY_MARGIN, DecodeGraphs, capture_sizes, pack_decode_inputs
from server.engine.kv_cache_tensors import KVCacheTensors
from server.model.llama import LlamaForCausalLM

log = logging.getLogger(__name__)

CPU_CACHE_TOKENS = 8192  # default KV capacity on CPU (block 0 included)
CPU_CACHE_MAX_BYTES = 1 << 30
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default


@dataclass
class SeqChunk:
    token_ids: list[int]  # the new tokens to run this step (1 for decode)
    start_pos: int  # tokens of this sequence already in the cache before these
    block_table: list[int]  # physical blocks covering start_pos + len(token_ids) tokens
    slot_mapping: list[int]  # slot of each new token (block_id * block_size + offset)


@dataclass
class StepBatch:
    input_ids: torch.Tensor  # (T,) int32
    positions: torch.Tensor  # (T,) int32
    logits_rows: torch.Tensor  # (len(chunks),) int32: flat row of each chunk's last token, in chunk order
    meta: AttentionMetadata


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        block_size: int = 16,
        num_blocks: int | None = None,
        gpu_memory_utilization: float | None = None,
        attention_backend: str = "auto",
        max_num_batched_tokens: int = 2048,
        max_num_seqs: int = 256,
        max_model_len: int | None = None,
        enforce_eager: bool = False,
        decode_num_splits: int | None = None,
    ) -> None:
        kernels.check_block_size(block_size)
        self.model, self.config = model, model.config
        self.device, self.dtype = model.device, model.dtype
        self.block_size = block_size
        self.attention_backend = kernels.resolve_backend(self.device, attention_backend)
        self.sliding_window = self.config.sliding_window
        self.max_num_batched_tokens, self.max_num_seqs = max_num_batched_tokens, max_num_seqs
        self.max_model_len = max_model_len or self.config.max_position_embeddings
        self.decode_num_splits = decode_num_splits  # None: the kernel's heuristic; int: batch-invariant
        # graphs need CUDA and the Triton kernels (the torch reference syncs on seq_lens.max())
        on_triton_cuda = self.device.type == "cuda" and self.attention_backend == "triton"
        self.cuda_graphs = on_triton_cuda and not enforce_eager
        self.graphs: DecodeGraphs | None = None  # captured after the KV cache is allocated
        if self.device.type == "cpu":
            _limit_cpu_threads_for_small_model(model)
        # the decode kernel's split-merge counters: one workspace, as every layer's launch runs on one stream
        # in order (eager steps and graph replays alike); allocated before the profiling step and any capture
        self.decode_workspace = (kernels.DecodeWorkspace(max_num_seqs, self.config.num_kv_heads, self.device)
                                 if self.attention_backend == "triton" else None)
        if num_blocks is None:
            num_blocks = self._auto_num_blocks(gpu_memory_utilization)
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.capacity_tokens = (num_blocks - 1) * block_size
        self.kv = self._allocate_cache(num_blocks)
        log.info(
            "runner: attention backend %s, %d KV blocks of %d tokens (%.1f MiB) on %s %s",
            self.attention_backend, num_blocks, block_size,
            self.kv.data.numel() * self.kv.data.element_size() / 2**20, self.device, self.dtype,
        )
        if self.cuda_graphs:
            self._capture_graphs()
        else:
            log.info("runner: CUDA graphs off (%s)", "enforce_eager" if enforce_eager else
                     f"{self.device.type} device, {self.attention_backend} backend")

    # ---- public API -------------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, chunks: list[SeqChunk]) -> torch.Tensor:
        """-> (len(chunks), vocab) fp32 logits of each chunk's last token."""
        if not chunks:
            return torch.empty(0, self.config.vocab_size, device=self.device)
        for i, chunk in enumerate(chunks):
            self._check_chunk(i, chunk)
        logits = self._replay_decode(chunks)  # (N, V) in the model dtype, or None: not a graph batch
        if logits is None:
            batch = self._prepare(chunks)
            hidden = self._forward(batch.input_ids, batch.positions, batch.meta)[batch.logits_rows]
            return self.model.compute_logits(hidden)  # (N, V)
        return logits.to(torch.float32, copy=True)  # fresh: the next replay overwrites the static output

    @torch.inference_mode()
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write after a kvcache fork: block dst <- block src, every layer, K and V."""
        for src, dst in pairs:
            if not (0 < src < self.num_blocks and 0 < dst < self.num_blocks):
                raise ValueError(f"copy_blocks pair ({src}, {dst}) outside blocks 1..{self.num_blocks - 1}")
        self.kv.copy_blocks(pairs)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata):
        # input_ids, positions (T,) -> hidden (T, H)
        attn = PagedAttention(self.kv, meta, self.attention_backend, self.sliding_window,
                              self.decode_num_splits, self.decode_workspace)
        return self.model(input_ids, positions, attn)

    def _forward_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata):
        # the captured decode step: the forward (final norm included) and the lm_head -> (T, V), model dtype
        return self.model.lm_head(self._forward(input_ids, positions, meta))

    # ---- CUDA-graph decode --------------------------------------------------------------------------------

    def _decode_graphs(self, use_cuda_graphs: bool) -> DecodeGraphs:
        """Graphs for decode batches up to min(max_num_seqs, max_num_batched_tokens) sequences of up to
        max_model_len tokens (capture() still to be called)."""
        sizes = capture_sizes(min(self.max_num_seqs, self.max_num_batched_tokens))
        max_blocks = -(-self.max_model_len // self.block_size)
        return DecodeGraphs(self._forward_logits, sizes, max_blocks, self.config.vocab_size, self.dtype,
                            self.device, use_cuda_graphs)

    def _capture_graphs(self) -> None:
        """A failed capture leaves the runner eager (cuda_graphs False) with a warning, not a dead server."""
        graphs = self._decode_graphs(use_cuda_graphs=True)
        try:
            graphs.capture()
        except Exception:  # any capture failure: serve eagerly, loudly
            log.warning("runner: CUDA graph capture failed; decoding eagerly", exc_info=True)
            self.cuda_graphs = False
            return
        self.graphs = graphs

    def _replay_decode(self, chunks: list[SeqChunk]) -> torch.Tensor | None:
        """(N, V) logits (model dtype) from a captured graph; None if the batch is not all single-token
        chunks or is larger / longer than the graphs were captured for."""
        graphs = self.graphs
        if graphs is None or any(len(c.token_ids) != 1 for c in chunks):
            return None
        tables = [c.block_table[: self._blocks_for(c)] for c in chunks]
        width = max(map(len, tables))
        if not graphs.fits(len(chunks), width):
            return None
        ids = [c.token_ids[0] for c in chunks]
        slots = [c.slot_mapping[0] for c in chunks]
        self._check_ranges(ids, slots, [b for t in tables for b in t])
        size = graphs.padded_size(len(chunks))
        packed, width = pack_decode_inputs(ids, [c.start_pos for c in chunks], slots, tables, size,
                                           graphs.max_size)
        return graphs.replay(self._to_device(packed), len(chunks), size, width)

    # ---- step inputs ------------------------------------------------------------------------------------

    def _prepare(self, chunks: list[SeqChunk]) -> StepBatch:
        order = [i for i, c in enumerate(chunks) if len(c.token_ids) == 1]
        num_decode = len(order)
        order += [i for i, c in enumerate(chunks) if len(c.token_ids) > 1]
        ids, positions, slots, rows = [], [], [], [0] * len(chunks)
        for i in order:
            c = chunks[i]
            ids += c.token_ids
            positions += range(c.start_pos, c.start_pos + len(c.token_ids))
            slots += c.slot_mapping
            rows[i] = len(ids) - 1
        # decode rows, then prefill chunks: each group's (padded) block tables and seq lens; the chunks' query
        # start offsets, relative to the first prefill row
        groups = ([chunks[i] for i in order[:num_decode]], [chunks[i] for i in order[num_decode:]])
        tables, lens, widths = [], [], []
        for group in groups:
            group_tables = [list(c.block_table[: self._blocks_for(c)]) for c in group]
            widths.append(max(map(len, group_tables), default=1))
            tables.append([b for t in group_tables for b in t + [0] * (widths[-1] - len(t))])
            lens.append([c.start_pos + len(c.token_ids) for c in group])
        qsl = [0]
        for c in groups[1]:
            qsl.append(qsl[-1] + len(c.token_ids))
        self._check_ranges(ids, slots, tables[0] + tables[1])
        parts = [ids, positions, slots, lens[0], tables[0], lens[1], tables[1], qsl, rows]
        dev = self._to_device([v for part in parts for v in part])
        input_ids, pos_t, slot_t, lens_t, tables_t, p_lens_t, p_tables_t, qsl_t, rows_t = dev.split(
            [len(p) for p in parts])
        prefill = None
        if groups[1]:
            prefill = PrefillMetadata(p_tables_t.view(len(groups[1]), widths[1]), qsl_t, p_lens_t)
        meta = AttentionMetadata(
            slot_mapping=slot_t,
            num_decode=num_decode,
            block_tables=tables_t.view(num_decode, widths[0]),
            seq_lens=lens_t,
            prefill=prefill,
        )
        return StepBatch(input_ids, pos_t, rows_t, meta)

    def _blocks_for(self, c: SeqChunk) -> int:
        return -(-(c.start_pos + len(c.token_ids)) // self.block_size)

    def _check_chunk(self, i: int, c: SeqChunk) -> None:
        n = len(c.token_ids)
        if n == 0 or len(c.slot_mapping) != n:
            raise ValueError(f"chunk {i}: needs >= 1 token and one slot per token, got {n} and "
                             f"{len(c.slot_mapping)}")
        if len(c.block_table) < self._blocks_for(c):
            raise ValueError(f"chunk {i}: block_table has {len(c.block_table)} blocks, "
                             f"{c.start_pos + n} tokens need {self._blocks_for(c)}")

    def _check_ranges(self, ids: list[int], slots: list[int], blocks: list[int]) -> None:
        """Out-of-range ids or slots would be an illegal memory access on CUDA, fatal to the process."""
        if min(ids) < 0 or max(ids) >= self.config.vocab_size:
            raise ValueError(f"token ids must be in [0, {self.config.vocab_size}), "
                             f"got {min(ids)}..{max(ids)}")
        if min(slots) < 0 or max(slots) >= self.num_blocks * self.block_size:
            raise ValueError(f"slots must be in [0, {self.num_blocks * self.block_size}), "
                             f"got {min(slots)}..{max(slots)}")
        if blocks and (min(blocks) < 0 or max(blocks) >= self.num_blocks):
            raise ValueError(f"block ids must be in [0, {self.num_blocks}), got {min(blocks)}..{max(blocks)}")

    def _to_device(self, values: list[int]) -> torch.Tensor:
        host = torch.tensor(values, dtype=torch.int32)
        if self.device.type != "cuda":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    # ---- KV cache sizing ----------------------------------------------------------------------------------

    def _allocate_cache(self, num_blocks: int) -> KVCacheTensors:
        cfg = self.config
        return KVCacheTensors(cfg.num_layers, num_blocks, self.block_size, cfg.num_kv_heads, cfg.head_dim,
                              self.dtype, self.device)

    def _bytes_per_block(self) -> int:
        cfg = self.config
        return KVCacheTensors.bytes_per_block(cfg.num_layers, self.block_size, cfg.num_kv_heads, cfg.head_dim,
                                              self.dtype)

    def _auto_num_blocks(self, gpu_memory_utilization: float | None) -> int:
        if self.device.type != "cuda":
            by_memory = CPU_CACHE_MAX_BYTES // self._bytes_per_block()
            return max(2, min(CPU_CACHE_TOKENS // self.block_size, by_memory))
        fraction = DEFAULT_GPU_MEMORY_UTILIZATION if gpu_memory_utilization is None else gpu_memory_utilization
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {fraction}")
        return self._profile_num_blocks(fraction)

    def _profile_num_blocks(self, fraction: float) -> int:
        """vLLM's gpu_memory_utilization: the process may use `fraction` of the device's total memory. Run a
        dummy maximal batch; the KV cache gets that share minus what is in use already (weights, other
        processes on the device), the activation peak, memory outside torch's allocator and the graph pool."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        reserved_before = torch.cuda.memory_reserved(self.device)
        chunks, blocks_needed = self._dummy_chunks()
        self.kv = self._allocate_cache(blocks_needed)
        self.num_blocks = blocks_needed
        self.execute(chunks)
        torch.cuda.synchronize(self.device)
        cache_bytes = self.kv.data.numel() * self.kv.data.element_size()
        activations = torch.cuda.max_memory_allocated(self.device) - before - cache_bytes
        del self.kv
        torch.cuda.empty_cache()
        # memory taken outside torch's allocator by the run (cuBLAS workspaces, compiled kernels, ...)
        free_after, _ = torch.cuda.mem_get_info(self.device)
        non_torch = max(0, free - free_after - (torch.cuda.memory_reserved(self.device) - reserved_before))
        # The graph pool is captured after the cache is allocated and is not shared with eager steps; its
        # peak is one decode step of <= max_num_batched_tokens rows, bounded by the dummy prefill's peak.
        graph_pool = activations + GRAPH_MEMORY_MARGIN if self.cuda_graphs else 0
        budget = total * fraction - (total - free) - activations - non_torch - graph_pool
        num_blocks = int(budget // self._bytes_per_block())
        log.info("runner: %.0f%% of %.2f GiB; %.2f GiB in use after weights, activations %.2f GiB, other "
                 "%.2f GiB, CUDA graphs %.2f GiB -> %d KV blocks", fraction * 100, total / 2**30,
                 (total - free) / 2**30, activations / 2**30, non_torch / 2**30, graph_pool / 2**30, num_blocks)
        if num_blocks < 2:
            raise RuntimeError(
                f"not enough GPU memory for the KV cache: {fraction:.0%} of {total / 2**30:.2f} GiB allowed, "
                f"{(total - free) / 2**30:.2f} GiB in use after weights, {activations / 2**30:.2f} GiB activation "
                f"peak; raise gpu_memory_utilization or use a smaller model"
            )
        return num_blocks

    def _dummy_chunks(self) -> tuple[list[SeqChunk], int]:
        """max_num_batched_tokens tokens over min(max_num_seqs, tokens) prefill chunks, in fresh blocks."""
        tokens = min(self.max_num_batched_tokens, self.config.max_position_embeddings)
        num_seqs = max(1, min(self.max_num_seqs, tokens))
        lengths = [tokens // num_seqs + (1 if i < tokens % num_seqs else 0) for i in range(num_seqs)]
        chunks, next_block = [], 1
        for n in lengths:
            nb = -(-n // self.block_size)
            table = list(range(next_block, next_block + nb))
            next_block += nb
            slots = [table[t // self.block_size] * self.block_size + t % self.block_size for t in range(n)]
            chunks.append(SeqChunk([0] * n, 0, table, slots))
        return chunks, next_block


SMALL_MODEL_PARAMS = 50_000_000


def _limit_cpu_threads_for_small_model(model: LlamaForCausalLM) -> None:
    """A small model's matmuls (one decode token, hidden 256) are far cheaper than waking intra-op threads;
    on a loaded machine the spin-waits cost 10x. One thread is the faster choice below SMALL_MODEL_PARAMS."""
    num_params = sum(p.numel() for p in model.parameters())
    if num_params < SMALL_MODEL_PARAMS and torch.get_num_threads() > 1:
        log.info("runner: %d parameters on CPU: torch intra-op threads %d -> 1", num_params,
                 torch.get_num_threads())
        torch.set_num_threads(1)
