"""ModelRunner: runs one scheduled step on the device (inputs, decoder over the paged KV cache, fork copies,
sampling) and hands back the sampled ids without waiting for them.

The running sequences' block tables and last sampled tokens stay on the device between steps (BatchState,
in row space), so a step sends only a few ints per scheduled row plus the block-table entries that are new,
in one packed int32 copy (pinned, non-blocking on CUDA). A decode row whose token is still being sampled by
the previous step (asynchronous scheduling) reads it from the device. Single-token rows come first and
share one paged-decode call; the longer chunks follow and share one paged-prefill call. On CUDA (Triton
backend) a batch of only single-token rows replays a captured CUDA graph instead
(server/engine/cuda_graphs.py); mixed and prefill batches, and batches above the largest graph, run eagerly.
A decode-graph step that decodes exactly the previous one's rows, one position on (steady decoding), sends
nothing but the block-table entries of rows entering a new block: the graph left its inputs advanced in
place, and the sampler-side tensors are the previous step's. On an H200 host that took a batch-1 step's host
work from 0.25 to 0.10 ms, and 0.86 to 0.53 ms at 256 rows (tools/engine_step_bench, old and new tree in one
call: docs/benchmarks/serving_h200.md).
The step's sampled ids reach the host through a non-blocking copy into pinned memory and an event
(StepResult.wait), so the caller may plan and launch the next step first.

Inputs are validated at the engine's boundary (prompt ids, sampling parameters, lengths); here they are
asserted, not range-checked per step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

import kernels
from server.engine.attention import (
    AttentionMetadata,
    PagedAttention,
    rope_in_decode_refused,
    warm_up_attention,
)
from server.engine.bad_words import placed_rows
from server.engine.batch_state import BatchState, FlatLayout, StepPacker, floats_as_int32
from server.engine.bias_table import bias_entries
from server.engine.cuda_graphs import (
    GRAPH_MEMORY_MARGIN,
    DecodeGraphs,
    MixedGraphs,
    StepGraphs,
    capture_sizes,
    mixed_sizes,
    padded_size,
)
from server.engine.grammar import TokenMask, widened
from server.engine.kv_cache_tensors import KVCacheTensors
from server.engine.sampler import (
    BAD_WORDS,
    BIAS,
    FLOAT_FIELDS,
    INT_FIELDS,
    LOGPROBS,
    PENALTIES,
    TOP,
    Sampler,
    draws_from_best,
    row_fields,
)
from server.engine.sampling_params import SamplingParams
from server.engine.scheduler import ScheduledChunk, SchedulerOutput
from server.engine.sequence import Sequence as Seq
from server.model.llama import LlamaForCausalLM

log = logging.getLogger(__name__)

CPU_CACHE_TOKENS = 8192  # default KV capacity on CPU (block 0 included)
CPU_CACHE_MAX_BYTES = 1 << 30
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default
# ModelRunner.logit_counts: an eager step's logits product (mixed, prefill steps) runs over its logit rows
# rounded up to the next decode-graph batch size (capture_sizes: 1, 2, 4, 8, then every 16; the padding rows
# repeat hidden row 0 and are dropped), and start-up runs it once at each of those counts: cuBLAS's first call
# at a new row count of the bench preset's (rows, 2048) x (2048, 128256) head takes ~4-5 ms of host time at
# every eighth count (H200, torch 2.11: tools/lm_head_first_call_probe), and three prompt steps of a 256-wide
# first burst stalled for 30-56 ms in it with the device idle (tools/closed_loop_stalls). The head is memory-
# bound at these counts, so the padding costs ~nothing; at a graph's own batch size the eager product is the
# graph's.

TableOf = Callable[[int], Sequence[int]]  # seq_id -> its live block table (KVCacheManager.table_view)


@dataclass
class HostSamples:
    token_ids: list[int]  # (S,) one per SchedulerOutput.samples
    logprobs: list[float] | None = None  # (S,) when some row asked
    top_ids: list[list[int]] | None = None  # (S, k), k = the largest logprobs asked in the step
    top_logprobs: list[list[float]] | None = None


@dataclass
class StepLogits:
    """What a step hands the sampler (ModelRunner.forward_step)."""

    logits: torch.Tensor | None  # (S, V) each sample draws from: fp32, or the model dtype where the sampler
    # reads it (forward_step); None when `greedy` stands in for them
    rows: torch.Tensor  # (S,) int64 device: each sample's batch row
    flags: int  # OR of the samples' sampler flags
    num_logprobs: int  # the largest logprobs any sample asked
    greedy: torch.Tensor | None = None  # (S,) argmax ids of an all-greedy decode-graph step (no forks)
    compact: torch.Tensor | None = None  # (K,) int64 device: the samples that draw from their best tokens


@dataclass
class NewRowWidths:
    """What a step's new rows need of the sampler's tables: the bias table's width (entries of one row) and
    the bad words' (words of one row, tokens of one word)."""

    bias: int
    bad_words: tuple[int, int]


@dataclass
class _LastDecode:
    """The last decode-graph step, for ModelRunner._repeats_last_decode: its graphs and key, rows and
    positions in flat-batch order, and its StepLogits (the sampler-side device tensors)."""

    graphs: StepGraphs
    key: object
    rows: list[int]
    positions: list[int]
    out: StepLogits


class StepResult:
    """A launched step's samples on their way to the host: wait() blocks until they are there."""

    def __init__(self, ints: torch.Tensor, floats: torch.Tensor | None, event: torch.cuda.Event | None):
        self._ints, self._floats, self._event = ints, floats, event  # (S, 1 + k) host, (S, 1 + k) host

    def wait(self) -> HostSamples:
        if self._event is not None:
            self._event.synchronize()
        if self._floats is None:
            return HostSamples(self._ints.view(-1).tolist())
        ints, floats = self._ints.tolist(), self._floats.tolist()
        return HostSamples([r[0] for r in ints], [r[0] for r in floats], [r[1:] for r in ints],
                           [r[1:] for r in floats])


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
        self.attention_backend = self._attention_backend(attention_backend)
        model.prepare_decoder_ops(model.decoder_ops_for(self.attention_backend))  # before the profiling step
        self.sliding_window = self.config.sliding_window
        self.max_num_batched_tokens, self.max_num_seqs = max_num_batched_tokens, max_num_seqs
        self.logit_counts = capture_sizes(max_num_seqs)  # an eager logits product's row counts, ascending
        self.max_model_len = max_model_len or self.config.max_position_embeddings
        self.decode_num_splits = decode_num_splits  # None: the kernel's heuristic; int: batch-invariant
        # graphs need CUDA and the Triton kernels (the torch reference syncs on seq_lens.max())
        on_triton_cuda = self.device.type == "cuda" and self.attention_backend == "triton"
        self.cuda_graphs = on_triton_cuda and not enforce_eager
        self.graphs: DecodeGraphs | None = None  # captured after the KV cache is allocated
        self.mixed_graphs: MixedGraphs | None = None
        if self.device.type == "cpu":
            _limit_cpu_threads_for_small_model(model)
        # the decode kernel's split-merge counters: one workspace, as every layer's launch runs on one stream
        # in order (eager steps and graph replays alike); allocated before the profiling step and any capture
        self.decode_workspace = (kernels.DecodeWorkspace(max_num_seqs, self.config.num_kv_heads, self.device)
                                 if self.attention_backend == "triton" else None)
        self.state = self._new_batch_state()
        self.sampler = Sampler(max_num_seqs, self.config.vocab_size, self.device)
        self.packer = StepPacker(self.device)
        # a structured output's masks (1 MB a step at 64 rows of 128256), through pinned buffers of their own,
        # reused under events as the inputs' are
        self.mask_packer = StepPacker(self.device)
        self._last_decode: _LastDecode | None = None  # the last step, if it replayed a decode graph
        if num_blocks is None:
            num_blocks = self._auto_num_blocks(gpu_memory_utilization)
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.capacity_tokens = (num_blocks - 1) * block_size
        self.kv = self._allocate_cache(num_blocks)
        self.state = self._new_batch_state(self.capacity_tokens)  # the profiling step's rows are reset
        log.info(
            "runner: attention backend %s, %d KV blocks of %d tokens (%.1f MiB) on %s %s",
            self.attention_backend, num_blocks, block_size,
            self.kv.data.numel() * self.kv.data.element_size() / 2**20, self.device, self.dtype,
        )
        if self.attention_backend == "triton" and self.device.type == "cuda":
            fused = self.model.decoder_ops_for(self.attention_backend) == "fused"
            if fused:
                from server.model.fused_forward import (  # triton
                    scratch_new_tokens,
                    warm_up_mlp,
                    warm_up_one_row,
                )
            variants = warm_up_attention(self.kv, self.sliding_window, self.max_num_seqs,
                                         self.state.block_tables.shape[1], self.config.num_heads,
                                         self.decode_num_splits, self.decode_workspace,
                                         scratch_new_tokens(self.model) if fused else None)
            self.sampler.warm_up(self.dtype)
            one_row = ""
            if fused:
                warm_up_one_row(self.model, *self.kv.layer(0))
                warm_up_mlp(self.model)
                one_row = ", the one-row GEMVs, the MLP's GEMMs"
            log.info("runner: %d decode attention variants, the prefill kernel, the sampling kernel%s "
                     "compiled", variants, one_row)
        if self.cuda_graphs:
            self._capture_graphs()
        else:
            log.info("runner: CUDA graphs off (%s)", "enforce_eager" if enforce_eager else
                     f"{self.device.type} device, {self.attention_backend} backend")
        if self.device.type == "cuda":  # after the captures: torch.cuda.graph() empties the cache
            self._warm_up_step_tail()

    # ---- public API -------------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput, table_of: TableOf,
                token_mask: Callable[[], TokenMask] | None = None) -> StepResult:
        """Launch `step` (inputs, forward, fork copies, sampling) and start copying its samples to the host;
        returns without waiting for the device. token_mask: gives the guided samples' allowed tokens; called
        once the forward is launched (its host work overlaps the forward on the device)."""
        s = self.forward_step(step, table_of, need_logits=False)
        if not step.samples:  # a step of prefill chunks that all stop short of their prompt's end
            return StepResult(torch.empty(0, 1, dtype=torch.int64), None, None)
        mask = None
        if token_mask is not None:  # (G,) sample indices, (G, W) bits: one pinned copy on CUDA, not awaited
            m = token_mask()
            samples, bits = self.mask_packer.send([m.samples, m.bits.numpy().reshape(-1)])
            mask = (samples.long(), widened(bits.view(len(m.samples), -1), self.config.vocab_size))
        out = self.sampler(s.logits, s.rows, s.flags, s.num_logprobs, s.greedy, s.compact, mask)
        self.state.record_samples(s.rows, out.token_ids)
        return self._to_host(out)

    @torch.inference_mode()
    def forward_step(self, step: SchedulerOutput, table_of: TableOf, need_logits: bool = True) -> StepLogits:
        """The step up to sampling (StepLogits). An all-greedy decode-graph step (no forks) carries its argmax
        ids, and then logits only if `need_logits`; without `need_logits` a sampled one whose draw reads the
        model dtype (Sampler.reads_model_dtype) carries the graph's static output itself, which the next
        replay overwrites (the sampler's launch comes first on the stream)."""
        assert not step.is_empty, "a step runs some chunk"
        graphs, key, layout = self._plan(step)
        decode_graph = graphs is self.graphs and graphs is not None
        if decode_graph and self._repeats_last_decode(step, graphs, key):
            flat, num_products, copies, sample_sources = None, None, None, None
            out = self._repeat_inputs(step, table_of)
        else:
            flat, out, num_products, copies, sample_sources = self._send_inputs(step, table_of, layout)
        if decode_graph:  # its output is the logits
            num_decode = len(step.decodes)
            logits = graphs.replay(flat, num_decode, key)
            self._last_decode = _LastDecode(graphs, key, [s.row for s in step.decodes],
                                            step.decode_positions, out)
            one_per_row = not step.copies and len(step.samples) == num_decode  # no forks: sample i, row i
            if one_per_row and not out.flags:  # greedy
                # the argmax of the model-dtype logits, read before the next replay overwrites them: the
                # fp32 copy below costs 22 us at batch 64 on an H200 (an in-graph argmax instead cost every
                # sampled step 28 us more)
                out.greedy = self.sampler.argmax(logits)
                out.logits = logits.float() if need_logits else None
                return out
            if one_per_row and not need_logits and self.sampler.reads_model_dtype(out.flags, out.compact):
                out.logits = logits  # the static output: sampled (stream-ordered) before the next replay
                return out
            logits = logits.to(torch.float32, copy=True)  # fresh: the next replay overwrites the output
        else:
            self._last_decode = None
            # (R, H): the out rows' hidden states, the samples' logit rows first (FlatLayout.num_out)
            if graphs is not None:
                hidden = graphs.replay(flat, layout.num_out, key)  # a view of the static output
            else:
                hidden = self._forward(*self._flat_inputs(flat, layout, len(step.decodes)))
            if not step.samples:
                out.logits = hidden[:0]
                return out
            # (L, V) fp32, through a product over the padded count of logit rows (logit_counts)
            logits = self.model.compute_logits(hidden[:num_products])[:_num_logit_rows(step)]
        if copies is not None and copies.numel():
            self.kv.copy_blocks(copies.view(-1, 2))
        if len(step.sample_sources) != logits.shape[0] or step.sample_sources[-1] != len(step.samples) - 1:
            logits = logits.index_select(0, sample_sources.long())  # (S, V): forks share their parent's row
        out.logits = logits
        return out

    def _send_inputs(self, step: SchedulerOutput, table_of: TableOf, layout: FlatLayout):
        """Pack and send the step's host ints; apply its table writes and its new rows' sampler state. ->
        (flat batch, StepLogits without logits, the logits product's row count, fork copies, sample
        sources), on the device but the count."""
        sections, num_products, num_logprobs, flags, widths = self._pack(step, table_of, layout)
        (flat, writes, init_rows, init_floats, init_ints, pen_rows, pen_token_rows, pen_tokens, pen_is_output,
         bias_rows, bias_cols, bias_ids, bias_values, bias_kinds, *bad_words,  # BadWords.write's 7 sections
         sample_rows, sample_sources, copies, compact) = self.packer.send(sections)
        self.state.apply_table_writes(writes)
        out = StepLogits(None, sample_rows.long(), flags, num_logprobs,  # int64 once: sampler and state index
                         compact=compact.long() if compact.numel() else None)
        if init_rows.numel():
            n = init_rows.numel()
            self.sampler.init_rows(init_rows, init_floats.view(torch.float32).view(n, FLOAT_FIELDS),
                                   init_ints.view(n, INT_FIELDS))
        if pen_rows.numel():
            self.sampler.init_penalty_rows(pen_rows, pen_token_rows, pen_tokens, pen_is_output)
        if bias_rows.numel():
            self.sampler.bias.write(bias_rows, bias_cols, bias_ids, bias_values.view(torch.float32),
                                    bias_kinds, widths.bias)
        if bad_words[0].numel():
            self.sampler.bad_words.write(*bad_words, *widths.bad_words)
        return flat, out, num_products, copies, sample_sources

    def _repeats_last_decode(self, step: SchedulerOutput, graphs: StepGraphs, key) -> bool:
        """Whether `step` decodes exactly the rows of the last decode-graph replay, in its order, each one
        position further, with the same samples and nothing else (no new rows, chunks or forks): the inputs
        that replay left in the buffer (advanced in place) are then this step's, and its sampler-side
        tensors too. Every row's token is then the one it sampled last, on the device."""
        last = self._last_decode
        if (last is None or last.graphs is not graphs or last.key != key or step.prefills or step.new_rows
                or step.copies or len(step.decodes) != len(last.rows) or len(step.samples) != len(last.rows)):
            return False  # (without chunks the samples are the decodes, each from its own logits row)
        for seq, pos, row, prev in zip(step.decodes, step.decode_positions, last.rows, last.positions,
                                       strict=True):
            if seq.row != row or pos != prev + 1:
                return False
        return True

    def _repeat_inputs(self, step: SchedulerOutput, table_of: TableOf) -> StepLogits:
        """A repeated decode step's only host input: the block-table entries of rows whose token starts a new
        block (sent alone). -> its StepLogits without logits (the last decode's, reused)."""
        writes: list[int] = []
        covered = self.state.synced_tokens
        for seq, pos in zip(step.decodes, step.decode_positions, strict=True):
            if pos >= covered[seq.row]:
                self.state.table_writes(seq.row, table_of(seq.seq_id), writes)
        if writes:
            self.state.apply_table_writes(self.packer.send([writes])[0])
        last = self._last_decode.out
        return StepLogits(None, last.rows, last.flags, last.num_logprobs, compact=last.compact)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 out_rows: torch.Tensor | None = None):
        # input_ids, positions (T,) -> hidden (T, H), or (R, H) of out_rows (R,) int64
        attn = PagedAttention(self.kv, meta, self.attention_backend, self.sliding_window,
                              self.decode_num_splits, self.decode_workspace)
        return self.model(input_ids, positions, attn, out_rows)

    def _forward_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                        out: torch.Tensor) -> None:
        # the captured decode step: the forward (final norm included), then the lm_head into out (T, V)
        self.model.logits_into(self._forward(input_ids, positions, meta), out)

    def _to_host(self, out) -> StepResult:
        ints = out.token_ids[:, None]  # (S, 1)
        floats = None
        if out.logprobs is not None:
            ints = torch.cat([ints, out.top_ids], dim=1)  # (S, 1 + k)
            floats = torch.cat([out.logprobs[:, None], out.top_logprobs], dim=1)
        if self.device.type != "cuda":
            return StepResult(ints, floats, None)
        ints_host = torch.empty(ints.shape, dtype=ints.dtype, pin_memory=True)
        ints_host.copy_(ints, non_blocking=True)
        floats_host = None
        if floats is not None:
            floats_host = torch.empty(floats.shape, dtype=floats.dtype, pin_memory=True)
            floats_host.copy_(floats, non_blocking=True)
        event = torch.cuda.Event()
        event.record(self.packer.stream)
        return StepResult(ints_host, floats_host, event)

    # ---- step inputs ------------------------------------------------------------------------------------

    def _plan(self, step: SchedulerOutput) -> tuple[StepGraphs | None, object, FlatLayout]:
        """The captured graphs and key this step replays ((None, None): it runs eagerly) and the layout of its
        flat batch (the graph's padded one, or exactly the step's tokens and chunks)."""
        num_decode, num_chunks = len(step.decodes), len(step.prefills)
        num_tokens = num_decode + sum(c.end - c.start for c in step.prefills)
        graphs, key = None, None
        if not num_chunks:
            if self.graphs is not None and self.graphs.fits(num_decode):
                graphs, key = self.graphs, self.graphs.padded_size(num_decode)
        elif self.mixed_graphs is not None:
            key = self.mixed_graphs.takes(num_tokens, num_decode, num_chunks)
            graphs = self.mixed_graphs if key is not None else None
        if graphs is None:  # every eager step reads its logit rows alone (a decode-only one: all of them)
            # at least 2 out rows when the step has more than one token: Triton specialises a row count of 1,
            # and no warm-up compiles the last layer's multi-row kernels for one row (a compile mid-serving
            # stalls every stream); one token takes the one-row route, whose one row is its out row
            least = 2 if num_tokens > 1 else 1
            return None, None, FlatLayout(num_tokens, num_chunks,
                                          max(least, self._padded_logit_count(_num_logit_rows(step))))
        return graphs, key, graphs.layout(key)

    def _pack(self, step: SchedulerOutput, table_of: TableOf, layout: FlatLayout):
        """The step's host ints, one list per section (see forward_step), the logits product's row count,
        the logprobs width, the OR of the samples' sampler flags and the new rows' NewRowWidths."""
        for seq in step.new_rows:
            self.state.reset_row(seq.row)
        writes: list[int] = []
        flat, num_products = self._pack_flat(step, table_of, layout, writes)
        inits, widths = self._pack_new_rows(step.new_rows)
        flags = 0
        for seq in step.samples:
            flags |= seq.sample_flags
        num_logprobs = max(s.params.logprobs or 0 for s in step.samples) if flags & LOGPROBS else 0
        compact = [i for i, s in enumerate(step.samples) if draws_from_best(s.params)] if flags & TOP else []
        sections = [flat, writes, *inits, [s.row for s in step.samples], step.sample_sources,
                    [b for pair in step.copies for b in pair], compact]
        return sections, num_products, num_logprobs, flags, widths

    def _pack_flat(self, step: SchedulerOutput, table_of: TableOf, layout: FlatLayout, writes: list[int]):
        """-> the flat batch as `layout` packs it (decode rows, then the prefill chunks' tokens, then padding
        tokens and empty chunks; its out rows: the rows whose logits the samples read) and the logits
        product's row count; appends the block-table entries the device lacks to `writes`."""
        state = self.state
        rows, ids = [], []
        covered = state.synced_tokens
        for seq, pos in zip(step.decodes, step.decode_positions, strict=True):
            rows.append(seq.row)
            ids.append(seq.token_ids[pos] if pos < len(seq.token_ids) else -1)  # -1: pending, on the device
            if pos >= covered[seq.row]:  # the row's token starts a block the device table lacks
                state.table_writes(seq.row, table_of(seq.seq_id), writes)
        positions = list(step.decode_positions)
        num_decode = len(rows)
        qsl, lens, chunk_rows = [num_decode], [], []  # query_start_loc counts from the first chunk row
        logit_rows = list(range(num_decode))
        for c in step.prefills:
            seq, n = c.seq, c.end - c.start
            assert c.end <= len(seq.token_ids), "a prefill chunk's token ids are on the host"
            rows += [seq.row] * n
            positions += range(c.start, c.end)
            ids += seq.token_ids[c.start:c.end]
            qsl.append(qsl[-1] + n)
            lens.append(c.end)
            chunk_rows.append(seq.row)
            state.table_writes(seq.row, table_of(seq.seq_id), writes)
            if c.samples:
                logit_rows.append(qsl[-1] - 1)
        # padding rows (hidden row 0, dropped after the product): see logit_counts. A decode graph has no
        # out rows (every row's logits are its output); a mixed graph's and an eager step's hold these
        logit_rows += [0] * (self._padded_logit_count(len(logit_rows)) - len(logit_rows))
        logit_rows = logit_rows[:layout.num_out]
        pad = layout.num_tokens - len(rows)
        rows += [state.pad_row] * pad
        positions += [-1] * pad
        ids += [0] * pad
        pad = layout.num_chunks - len(chunk_rows)
        chunk_rows += [state.pad_row] * pad
        qsl += [qsl[-1]] * pad
        lens += [0] * pad
        flat = layout.pack(rows, positions, ids, chunk_rows, qsl, lens, num_decode, logit_rows)
        return flat, len(logit_rows)

    @staticmethod
    def _pack_new_rows(seqs: list[Seq]) -> tuple[list, NewRowWidths]:
        """Sampler state of the sequences that took a row: parameters; for rows with penalties the prompt
        tokens (mask) and the tokens generated so far (counts, after a preemption); for rows with biases
        their entries (bias_entries): row, column, token id, value, kind; for rows with bad words their
        words' tokens (row, word, position from its end, id) and their last sampled tokens (row, position
        from the latest, id). -> (the sections, the table sizes they need)."""
        rows, floats, ints = [], [], []
        pen_rows, pen_token_rows, pen_tokens, pen_is_output = [], [], [], []
        bias_rows, bias_cols, bias_ids, bias_values, bias_kinds = [], [], [], [], []
        placed = []  # rows with bad words: bad_words.placed_rows
        bias_width = 0
        for seq in seqs:
            num_sampled = len(seq.token_ids) - seq.num_prompt_tokens
            f, i = row_fields(seq.params, seq.seed_key, num_sampled)
            rows.append(seq.row)
            floats += f
            ints += i
            if seq.sample_flags & PENALTIES:
                pen_rows.append(seq.row)
                pen_token_rows += [seq.row] * len(seq.token_ids)
                pen_tokens += seq.token_ids
                pen_is_output += [0] * seq.num_prompt_tokens + [1] * num_sampled
            if seq.sample_flags & BIAS:
                ids, values, kinds = bias_entries(seq.params, seq.held_back)
                bias_rows += [seq.row] * len(ids)
                bias_cols += range(len(ids))
                bias_ids += ids
                bias_values += values
                bias_kinds += kinds
                bias_width = max(bias_width, len(ids))
            if seq.sample_flags & BAD_WORDS:
                placed.append((seq.row, seq.params, seq.output_token_ids))
        word_sections, word_shape = placed_rows(placed)
        return [rows, floats_as_int32(floats), ints, pen_rows, pen_token_rows, pen_tokens, pen_is_output,
                bias_rows, bias_cols, bias_ids, floats_as_int32(bias_values), bias_kinds, *word_sections,
                ], NewRowWidths(bias_width, word_shape)

    def _flat_inputs(self, flat: torch.Tensor, layout: FlatLayout, num_decode: int
                     ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """An eager step's flat batch (exactly its tokens and chunks) -> input_ids (T,), positions (T,),
        AttentionMetadata, out rows (R,) int64."""
        tokens, chunk_rows, qsl, lens, _, out_rows = layout.views(flat)
        chunks = (chunk_rows, qsl, lens) if layout.num_chunks else None
        return *self.state.step_inputs(tokens, num_decode, None, chunks), out_rows.long()

    def device_usable(self) -> bool:
        """After a failed step: whether the device still runs work. A CUDA error such as an illegal memory
        access is sticky (every later call fails, a synchronize included); an out-of-memory error is not."""
        if self.device.type != "cuda":
            return True
        try:
            torch.cuda.synchronize(self.device)
        except Exception:  # the error that failed the step, or the next
            return False
        return True

    def decoder_kernels(self) -> tuple[str, tuple[str, ...]]:
        """The decoder's ops ("fused" | "torch") and the fused kernels a start-up check turned off on this
        device ("gate_up_silu", "rope_in_decode": their unfused launches run instead)."""
        ops = self.model.decoder_ops_for(self.attention_backend)
        if ops != "fused" or self.attention_backend != "triton":
            return ops, ()
        from server.model.fused_forward import gate_up_silu_refused  # triton

        refused = {"gate_up_silu": gate_up_silu_refused(self.device),
                   "rope_in_decode": rope_in_decode_refused(self.device)}
        return ops, tuple(name for name, off in refused.items() if off)

    def _attention_backend(self, requested: str) -> str:
        """The backend that serves this model: resolve_backend's, unless the Triton kernels cannot take its
        dtype or head_dim (open_llama_3b's 100, a toy's 8). Then "auto" takes the torch backend, with a
        warning, and "triton" is refused here: before, every request failed at its first KV store, and
        "auto" on CUDA refused the model naming a backend the user never chose (a review)."""
        backend = kernels.resolve_backend(self.device, requested)
        if backend != "triton":
            return backend
        try:
            kernels.check_supported("triton", self.dtype, self.config.head_dim, self.block_size)
        except ValueError as e:
            if requested == "triton":
                raise ValueError(f"--attention-backend triton cannot serve this model: {e}") from None
            log.warning("attention backend torch (no CUDA graphs): %s", e)
            return "torch"
        return backend

    # ---- CUDA-graph decode --------------------------------------------------------------------------------

    def _new_batch_state(self, capacity_tokens: int | None = None) -> BatchState:
        """Rows for max_num_seqs sequences; tables for the longest sequence served, max_model_len tokens cut
        to what the KV cache holds (`capacity_tokens`; None before the cache is sized: for the profiling
        step), and at least one profiling chunk. Sized by max_model_len alone, a config's 2**40 positions
        asked for terabytes of tables (a review)."""
        chunk = min(self.max_num_batched_tokens, self.config.max_position_embeddings)
        longest = chunk if capacity_tokens is None else min(self.max_model_len, capacity_tokens)
        tokens = max(longest, chunk)
        return BatchState(self.max_num_seqs, -(-tokens // self.block_size), self.block_size, self.device,
                          kernel_inputs=self.attention_backend == "triton")

    def _decode_graphs(self, use_cuda_graphs: bool) -> DecodeGraphs:
        """Graphs for decode batches up to min(max_num_seqs, max_num_batched_tokens) sequences (capture()
        still to be called)."""
        sizes = capture_sizes(min(self.max_num_seqs, self.max_num_batched_tokens))
        return DecodeGraphs(self._forward_logits, sizes, self.state, self.config.vocab_size, self.dtype,
                            self.device, use_cuda_graphs)

    def _mixed_graphs(self, use_cuda_graphs: bool) -> MixedGraphs:
        """Graphs for steps with prefill chunks of up to min(max_num_batched_tokens, MAX_MIXED_TOKENS) tokens
        (capture() still to be called)."""
        return MixedGraphs(self._forward, mixed_sizes(self.max_num_batched_tokens), self.state,
                           self.max_num_seqs, self.config.hidden_size, self.dtype, self.device,
                           use_cuda_graphs)

    def _padded_logit_count(self, n: int) -> int:
        """The row count an eager logits product over n rows runs at: the next of logit_counts."""
        return padded_size(n, self.logit_counts) or n if n else 0

    @torch.inference_mode()
    def _warm_up_step_tail(self) -> None:
        """Runs the eager logits product once at each row count it takes (logit_counts, largest first), so no
        first call at a new count stalls a served step; leaves the caching allocator holding blocks for the
        eager tail of a step at its largest: logits of max_num_seqs rows (the lm_head's model-dtype product,
        its fp32 copy) and the forks' gathered copy.
        The profiling step's blocks went back to the device (empty_cache, to size the KV cache; each graph
        capture empties the cache too), so without this the first burst of requests grows its logit rows
        step by step and takes a new, larger block from cudaMalloc at each one: a 256-wide burst of
        512-token prompts on an H200 took 14 segments (32-126 MiB) in its first 16 steps, 30-57 ms each
        step that did (tools/alloc_trace, tools/closed_loop_stalls). Later steps split these blocks (best
        fit): none of them calls cudaMalloc."""
        rows = self.max_num_seqs
        hidden = torch.zeros(rows, self.config.hidden_size, dtype=self.dtype, device=self.device)
        logits = self.model.compute_logits(hidden)  # (rows, V) fp32, through a (rows, V) model-dtype product
        for count in reversed(self.logit_counts[:-1]):
            self.model.compute_logits(hidden[:count])
        gathered = logits.index_select(0, torch.zeros(rows, dtype=torch.long, device=self.device))
        del hidden, logits, gathered  # back to the allocator's cache, not to the device

    def _capture_graphs(self) -> None:
        """Mixed graphs, then decode graphs, in one pool. A failed capture leaves the runner eager
        (cuda_graphs False) with a warning, not a dead server."""
        mixed, decode = self._mixed_graphs(use_cuda_graphs=True), self._decode_graphs(use_cuda_graphs=True)
        try:
            pool = torch.cuda.graph_pool_handle()
            mixed.capture(pool)
            decode.capture(pool)
        except Exception:  # any capture failure: serve eagerly, loudly
            log.warning("runner: CUDA graph capture failed; running eagerly", exc_info=True)
            self.cuda_graphs = False
            return
        self.graphs, self.mixed_graphs = decode, mixed

    # ---- KV cache sizing ----------------------------------------------------------------------------------

    def _allocate_cache(self, num_blocks: int) -> KVCacheTensors:
        cfg = self.config
        try:
            return KVCacheTensors(cfg.num_layers, num_blocks, self.block_size, cfg.num_kv_heads, cfg.head_dim,
                                  self.dtype, self.device)
        except RuntimeError as e:  # (torch.OutOfMemoryError among them) the allocator's message names no flag
            gib = num_blocks * self._bytes_per_block() / 2**30
            raise ValueError(f"the KV cache of {num_blocks} blocks ({gib:.1f} GiB) does not fit on "
                             f"{self.device}: lower --num-blocks, or size it with --gpu-memory-utilization "
                             "instead") from e

    def _bytes_per_block(self) -> int:
        cfg = self.config
        return KVCacheTensors.bytes_per_block(cfg.num_layers, self.block_size, cfg.num_kv_heads, cfg.head_dim,
                                              self.dtype)

    def _auto_num_blocks(self, gpu_memory_utilization: float | None) -> int:
        if self.device.type != "cuda":
            if gpu_memory_utilization is not None:  # said, not silently dropped (a review)
                log.warning("--gpu-memory-utilization sizes a GPU's cache; on %s the KV cache holds up to %d "
                            "tokens (--num-blocks sets it)", self.device.type, CPU_CACHE_TOKENS)
            by_memory = CPU_CACHE_MAX_BYTES // self._bytes_per_block()
            return max(2, min(CPU_CACHE_TOKENS // self.block_size, by_memory))
        fraction = DEFAULT_GPU_MEMORY_UTILIZATION if gpu_memory_utilization is None \
            else gpu_memory_utilization
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
        step, tables, blocks_needed = self._dummy_step()
        self.kv = self._allocate_cache(blocks_needed)
        self.num_blocks = blocks_needed
        self.execute(step, tables.__getitem__).wait()
        cache_bytes = self.kv.data.numel() * self.kv.data.element_size()
        activations = torch.cuda.max_memory_allocated(self.device) - before - cache_bytes
        del self.kv
        torch.cuda.empty_cache()
        # memory taken outside torch's allocator by the run (cuBLAS workspaces, compiled kernels, ...)
        free_after, _ = torch.cuda.mem_get_info(self.device)
        non_torch = max(0, free - free_after - (torch.cuda.memory_reserved(self.device) - reserved_before))
        # The graph pool is captured after the cache is allocated and is not shared with eager steps. Its
        # largest graph is a mixed step of <= max_num_batched_tokens tokens, whose activations the dummy
        # step's peak bounds; captures of different sizes do not reuse each other's blocks perfectly: on the
        # H200 (bench preset, 8192-token budget) 68 captures took 718 + 136 MiB for 0.51 GiB of activations.
        # The mixed graphs' decode-row ladder (cuda_graphs.MIXED_DECODE_ROWS) adds up to two graphs a mixed
        # size; with them the server captured within this reserve and kept its 242,078 KV blocks (H200).
        graph_pool = 2 * activations + GRAPH_MEMORY_MARGIN if self.cuda_graphs else 0
        budget = total * fraction - (total - free) - activations - non_torch - graph_pool
        num_blocks = int(budget // self._bytes_per_block())
        log.info("runner: %.0f%% of %.2f GiB; %.2f GiB in use after weights, activations %.2f GiB, other "
                 "%.2f GiB, CUDA graphs %.2f GiB -> %d KV blocks", fraction * 100, total / 2**30,
                 (total - free) / 2**30, activations / 2**30, non_torch / 2**30, graph_pool / 2**30,
                 num_blocks)
        if num_blocks < 2:
            raise RuntimeError(
                f"not enough GPU memory for the KV cache: {fraction:.0%} of {total / 2**30:.2f} GiB allowed, "
                f"{(total - free) / 2**30:.2f} GiB in use after weights, "
                f"{activations / 2**30:.2f} GiB activation "
                f"peak; raise gpu_memory_utilization or use a smaller model"
            )
        return num_blocks

    def _dummy_step(self) -> tuple[SchedulerOutput, dict[int, list[int]], int]:
        """max_num_batched_tokens tokens over min(max_num_seqs, tokens) prefill chunks in fresh blocks, each
        sampling with top-p (the sampler's largest temporaries) -> (step, block tables, blocks needed)."""
        tokens = min(self.max_num_batched_tokens, self.config.max_position_embeddings)
        num_seqs = max(1, min(self.max_num_seqs, tokens))
        lengths = [tokens // num_seqs + (1 if i < tokens % num_seqs else 0) for i in range(num_seqs)]
        step, tables, next_block = SchedulerOutput(), {}, 1
        params = SamplingParams(temperature=1.0, top_p=0.9)
        for i, n in enumerate(lengths):
            nb = -(-n // self.block_size)
            tables[i] = list(range(next_block, next_block + nb))
            next_block += nb
            seq = Seq(i, "profile", 0, [0] * n, params, row=i, num_computed_tokens=n)
            step.prefills.append(ScheduledChunk(seq, 0, n, True))
            step.new_rows.append(seq)
            step.samples.append(seq)
            step.sample_sources.append(i)
            step.num_prefill_tokens += n
        return step, tables, next_block

SMALL_MODEL_PARAMS = 50_000_000


def _num_logit_rows(step: SchedulerOutput) -> int:
    """The rows of a step's flat batch whose logits its samples read: every decode row and each chunk that
    samples (its last token); forks share their parent's."""
    return len(step.decodes) + sum(1 for c in step.prefills if c.samples)


def _limit_cpu_threads_for_small_model(model: LlamaForCausalLM) -> None:
    """A small model's matmuls (one decode token, hidden 256) are far cheaper than waking intra-op threads;
    on a loaded machine the spin-waits cost 10x. One thread is the faster choice below SMALL_MODEL_PARAMS."""
    num_params = sum(p.numel() for p in model.parameters())
    if num_params < SMALL_MODEL_PARAMS and torch.get_num_threads() > 1:
        log.info("runner: %d parameters on CPU: torch intra-op threads %d -> 1", num_params,
                 torch.get_num_threads())
        torch.set_num_threads(1)
