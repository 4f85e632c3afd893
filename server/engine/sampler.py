"""Batched sampling on the logits' device, with no host sync.

Every row's parameters live on the device in row space (one slot per batch row, written when a sequence
takes the row), so a step hands the sampler only its rows. Order per row: penalties -> greedy argmax
(temperature below GREEDY_TEMPERATURE) or: temperature -> top-k -> top-p -> min-p -> an inverse-CDF draw
with one uniform per row. The uniform is a counter-based hash of (the row's seed key, its sample count), so
a row's tokens depend on its own seed and history alone, never on its batch neighbours, and no
torch.Generator is kept. Logprobs are those of the model (raw logits), as OpenAI reports them.
Penalties read per-row output-token counts and a prompt-token mask on the device, kept incrementally.

Two draws with one semantics: on CUDA a sampled step is one Triton launch (kernels/sampling.py: rejection
with a rising pivot, no sort of the vocabulary, greedy rows' argmax included); on CPU (and where the kernel is
turned off, e.g. as a benchmark baseline) the torch path below, which sorts the rows that use top-k / top-p.
Both keep every token tied with the k-th of top-k (as vLLM's), but for one case of the CUDA path: a row
whose top_k is at most COMPACT_TOP_K draws from its COMPACT_TOP_K best tokens, so where the tokens tied with
its k-th value reach past those (more than COMPACT_TOP_K - k + 1 of them), torch.topk keeps an arbitrary
subset of the tie (a review; each of them is as likely as the k-th token, the least likely one kept). They
differ in ties at the top-p threshold (the kernel keeps all of them) and in which token a given uniform
picks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from server.engine.bad_words import BadWords
from server.engine.bias_table import BiasTable
from server.engine.sampling_params import GREEDY_TEMPERATURE, SamplingParams

MASK32 = 0xFFFF_FFFF

# SamplingParams.flags bits: what a step's rows need, OR-ed on the host to skip work nobody asked for
# (ALLOW comes with BIAS; GUIDED: a structured output's token mask, server/engine/grammar.py; BAD_WORDS:
# server/engine/bad_words.py)
SAMPLED, TOP, MIN_P, PENALTIES, LOGPROBS, BIAS, ALLOW, GUIDED, BAD_WORDS = 1, 2, 4, 8, 16, 32, 64, 128, 256
FP32_ROW = PENALTIES | LOGPROBS | BIAS | GUIDED | BAD_WORDS  # what changes or reads a row's logits in fp32
FLOAT_FIELDS = 6  # temperature, top_p, min_p, presence, frequency, repetition
INT_FIELDS = 4  # top_k, seed key, samples drawn so far, min_tokens


def step_flags(params: SamplingParams) -> int:
    f = 0
    if not params.greedy:
        f |= SAMPLED
        if params.top_k > 0 or params.top_p < 1.0:
            f |= TOP
        if params.min_p > 0.0:
            f |= MIN_P
    if params.has_penalties:
        f |= PENALTIES
    if params.logprobs is not None:
        f |= LOGPROBS
    if params.has_bias:
        f |= BIAS
    if params.allowed_token_ids is not None:
        f |= ALLOW
    if params.grammar is not None:
        f |= GUIDED
    if params.bad_words_ids:
        f |= BAD_WORDS
    return f


# Sampled rows with 0 < top_k <= COMPACT_TOP_K draw (on CUDA) from their COMPACT_TOP_K best tokens: torch.topk
# picks them, and the kernel then runs over those alone, in vocabulary order. Measured on an H200 at V 128256
# (docs/benchmarks/sampler_h200.json): the kernel's top-k search over the whole row took 0.45 ms at one row
# and 0.98 ms at 64 (the sorted path 0.20 / 1.45 ms), against ~0.1-0.2 ms for top-p alone. The choice
# depends on the row's own top_k, never on its neighbours, so seeded rows stay reproducible in any batch.
COMPACT_TOP_K = 256


def draws_from_best(params: SamplingParams) -> bool:
    """Whether a row draws from its COMPACT_TOP_K best tokens (the runner lists these rows per step)."""
    return not params.greedy and 0 < params.top_k <= COMPACT_TOP_K


# The largest temperature a row samples at: the floors of held-back and banned ids (HOLD_BACK) stay floors
# after scaling only well below their magnitude (with a floor of -1e30, (-1e30 - top) / 1e30 ~ -1 kept e^-1
# of a free token's weight: a banned word drawn a quarter of the time, in a review). At 1e20 every model
# logit (and +-100 of bias) is within 1e-18 of the row's best after scaling, so the draw is already exactly
# uniform in fp32 over the ids not held back: a larger temperature would draw the same but for the floors.
MAX_TEMPERATURE = 1e20


def row_fields(params: SamplingParams, seed_key: int, num_sampled: int) -> tuple[list[float], list[int]]:
    p = params
    floats = [min(p.temperature, MAX_TEMPERATURE), p.top_p, p.min_p, p.presence_penalty, p.frequency_penalty,
              p.repetition_penalty]
    # any top_k >= the vocab keeps all
    return floats, [min(p.top_k, 2**31 - 1), seed_key, num_sampled, p.min_tokens]


MASK64 = (1 << 64) - 1


def seed_key(seed: int, index: int) -> int:
    """31-bit key of choice `index` of a request seeded with `seed` (choices get distinct streams): the
    splitmix64 finalizer over all 64 bits of the seed, so seeds that differ only in their high bits (5 and
    5 + 2**62) get different streams, which a key of the seed's low 31 bits would not give them."""
    x = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xD1B54A32D192ED03) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return (x ^ (x >> 31)) & 0x7FFF_FFFF


@dataclass
class SampleOutput:
    token_ids: torch.Tensor  # (S,) int64 on the device
    logprobs: torch.Tensor | None = None  # (S,) fp32 logprob of the sampled token; None when no row asked
    top_ids: torch.Tensor | None = None  # (S, k) best tokens, k = the largest logprobs asked in the step
    top_logprobs: torch.Tensor | None = None  # (S, k)


class Sampler:
    """Row-space sampling state (rows 0..max_rows, the last one padding) and the batched draw."""

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device, kernel: bool | None = None
                 ) -> None:
        """kernel: draw sampled steps with the Triton kernel; by default on CUDA only (the CPU interpreter
        runs it, slowly: tests call it directly)."""
        n = max_rows + 1
        self.vocab_size, self.device = vocab_size, device
        self.kernel = torch.device(device).type == "cuda" if kernel is None else kernel
        # greedy ids (S, V) -> (S,) int64: on CUDA the split-row kernel (kernels/argmax.py: 64 rows of 128256
        # in bf16 take it 7.5 us on an H200, torch.argmax 27, one block per row)
        self.argmax = _torch_argmax
        if self.kernel:
            from kernels import argmax  # Triton loads only where the kernels run
            from kernels.sampling import sample_logits
            self._sample_logits = sample_logits
            self.argmax, self._warm_up_argmax = argmax.argmax_rows, argmax.warm_up
            from kernels.token_mask import mask_tokens_
            self._mask_tokens_ = mask_tokens_
        self.floats = torch.zeros(n, FLOAT_FIELDS, device=device)  # (R, 6)
        self.ints = torch.zeros(n, INT_FIELDS, dtype=torch.int64, device=device)  # (R, 4)
        self.counts: torch.Tensor | None = None  # (R, V) int32 generated-token counts, once penalties appear
        self.bias = BiasTable(n, device)  # logit_bias, min_tokens' hold-back, allowed_token_ids
        self.bad_words = BadWords(n, device, self.kernel)
        self._prompt_mask: torch.Tensor | None = None  # (R, V + 1) bool; column V absorbs output tokens
        self.in_prompt: torch.Tensor | None = None  # (R, V) bool view of _prompt_mask

    def warm_up(self, model_dtype: torch.dtype = torch.float32) -> None:
        """Compiles the sampling kernel's variants (the whole vocabulary over fp32 logits and over the
        model's own, and a compact top-k row of COMPACT_TOP_K tokens), the argmax's (1..max_rows rows of
        either dtype), the token mask's and the bad-words ban's before the first request: a Triton compile
        mid-serving stalls every stream for about a second. Reads row 0's parameters as a step would and
        changes no state."""
        if not self.kernel:
            return
        rows = torch.zeros(1, dtype=torch.long, device=self.device)
        floats, ints = self.floats[rows], self.ints[rows]
        for dtype in dict.fromkeys((torch.float32, model_dtype)):
            self._warm_up_argmax(self.floats.shape[0] - 1, self.vocab_size, dtype, self.device)
            logits = torch.zeros(1, self.vocab_size, dtype=dtype, device=self.device)  # (1, V)
            self._sample(logits, floats, ints, SAMPLED | TOP)
        self._sample(logits.float(), floats, ints, SAMPLED | TOP, compact=rows)
        words = torch.full((1, (self.vocab_size + 31) // 32), -1, dtype=torch.int32, device=self.device)
        self._mask_tokens_(logits.float(), rows, words)  # a structured output's token mask
        self.bad_words.warm_up()

    def reads_model_dtype(self, flags: int, compact: torch.Tensor | None) -> bool:
        """Whether a step with these flags draws straight from logits in the model's dtype: the kernel
        widens each one to fp32 as it loads it (exactly the values of an fp32 copy), so the runner skips
        that copy (22 us at 64 rows of 128256 on an H200) and each of the kernel's passes over a row reads
        half the bytes. Penalties, biases, bad words and logprobs work on an fp32 row, compact top-k rows on
        fp32 values."""
        return self.kernel and not flags & FP32_ROW and compact is None

    # ---- row state --------------------------------------------------------------------------------
    def init_rows(self, rows: torch.Tensor, floats: torch.Tensor, ints: torch.Tensor) -> None:
        """rows (N,), floats (N, 6) fp32, ints (N, 4): parameters of the sequences that took these rows."""
        rows = rows.long()
        self.floats.index_copy_(0, rows, floats)
        self.ints.index_copy_(0, rows, ints.long())
        self.bias.clear(rows)
        self.bad_words.clear(rows)

    def init_penalty_rows(self, rows: torch.Tensor, token_rows: torch.Tensor, token_ids: torch.Tensor,
                          is_output: torch.Tensor) -> None:
        """Reset the penalty state of `rows`, then count each (row, token): output tokens into the counts,
        prompt tokens into the mask. Allocates the (R, V) state on first use.

        No host sync (this runs whenever a penalised sequence takes a row, between async steps): no boolean
        indexing (its nonzero syncs) and no Python scalars written through an index (their copy syncs).
        Prompt tokens count 0 in the counts; output tokens set column V of the mask, which nobody reads."""
        V = self.vocab_size
        if self.counts is None:
            n = self.floats.shape[0]
            self.counts = torch.zeros(n, V, dtype=torch.int32, device=self.device)
            self._prompt_mask = torch.zeros(n, V + 1, dtype=torch.bool, device=self.device)
            self.in_prompt = self._prompt_mask[:, :V]  # (R, V) view
        rows, token_rows, token_ids = rows.long(), token_rows.long(), token_ids.long()
        self.counts.index_fill_(0, rows, 0)
        self._prompt_mask.index_fill_(0, rows, False)
        out = is_output.bool()
        self.counts.index_put_((token_rows, token_ids), out.int(), accumulate=True)
        columns = torch.where(out, V, token_ids)
        self._prompt_mask.index_put_((token_rows, columns), torch.ones_like(out))

    # ---- one step ---------------------------------------------------------------------------------
    def __call__(self, logits: torch.Tensor | None, rows: torch.Tensor, flags: int, num_logprobs: int = 0,
                 greedy: torch.Tensor | None = None, compact: torch.Tensor | None = None,
                 token_mask: tuple[torch.Tensor, torch.Tensor] | None = None) -> SampleOutput:
        """logits (S, V), rows (S,) device -> SampleOutput; advances each row's sample count. `greedy`: the
        step's argmax ids (S,), computed already (a decode graph's); then logits may be None, and the flags
        must ask for nothing but the argmax. `compact` (K,): the samples for which draws_from_best holds.
        `token_mask`: (G,) int64 sample indices and their (G, W) int32 allowed-token bits (GUIDED rows)."""
        rows = rows.long()
        if greedy is not None:
            assert not flags & (FP32_ROW | SAMPLED), "precomputed argmax: greedy"
            tokens = greedy
        else:
            tokens, raw = self._draw_step(logits, rows, flags, compact, token_mask)
        # the sample counters (the draws' offsets, min_tokens' count): a step without draws or biases, whose
        # rows read neither, leaves them be
        if flags & (SAMPLED | BIAS):
            self.ints[:, 2].index_add_(0, rows, torch.ones_like(rows))
        if flags & BAD_WORDS:
            self.bad_words.record(rows, tokens)
        if self.counts is not None:
            self.counts.index_put_((rows, tokens), torch.ones_like(tokens, dtype=torch.int32),
                                   accumulate=True)
        out = SampleOutput(tokens)
        if flags & LOGPROBS:
            logprobs = raw.log_softmax(dim=-1)  # (S, V)
            out.logprobs = logprobs.gather(1, tokens[:, None]).squeeze(1)
            top = logprobs.topk(min(num_logprobs, logprobs.shape[-1]), dim=-1)
            out.top_ids, out.top_logprobs = top.indices, top.values
        return out

    def _draw_step(self, logits: torch.Tensor, rows: torch.Tensor, flags: int, compact: torch.Tensor | None,
                   token_mask: tuple[torch.Tensor, torch.Tensor] | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> the step's tokens (S,) and its raw logits (S, V): fp32, or as given where reads_model_dtype."""
        raw = logits if self.reads_model_dtype(flags, compact) else logits.float()  # (S, V)
        logits = raw
        if flags & (PENALTIES | SAMPLED | BIAS):  # a plain all-greedy step reads no parameters
            floats, ints = self.floats[rows], self.ints[rows]  # (S, 6), (S, 4)
        if flags & BIAS:
            logits = self.bias.apply(logits, rows, bool(flags & ALLOW))
        if flags & PENALTIES and self.counts is not None:
            logits = self._apply_penalties(logits, rows, floats)
            if flags & ALLOW:
                logits = self.bias.floor_allowed(logits, rows)
        if flags & BIAS:  # after the penalties and the floor: neither moves a held-back id
            logits = self.bias.hold_back(logits, rows, ints[:, 2], ints[:, 3])
        if flags & BAD_WORDS:  # after the floor, which would lift a banned allowed id back
            logits = self.bad_words.ban_(_writable(logits, raw, flags), rows)
        if token_mask is not None:  # last: no bias, penalty or floor lifts a token the grammar refuses
            if not self.kernel:
                logits = mask_tokens(logits, *token_mask)
            else:  # in place (kernels/token_mask.py)
                logits = _writable(logits, raw, flags)
                self._mask_tokens_(logits, *token_mask)
        if flags & SAMPLED:
            return self._sample(logits, floats, ints, flags, compact), raw
        return self.argmax(logits), raw

    def _apply_penalties(self, logits: torch.Tensor, rows: torch.Tensor,
                         floats: torch.Tensor) -> torch.Tensor:
        counts = self.counts[rows].float()  # (S, V)
        return apply_penalties(logits, counts, self.in_prompt[rows], floats[:, 3:6])

    def _sample(self, logits: torch.Tensor, floats: torch.Tensor, ints: torch.Tensor, flags: int,
                compact: torch.Tensor | None = None) -> torch.Tensor:
        temperature, top_p, min_p = floats[:, 0], floats[:, 1], floats[:, 2]  # (S,) views, stride 6
        if self.kernel:  # one launch, whatever the flags: the whole row pipeline below in passes over V
            logits = logits.contiguous()
            if compact is None:
                return self._sample_logits(logits, temperature, top_p, min_p, ints[:, 0], ints[:, 1],
                                           ints[:, 2], GREEDY_TEMPERATURE)
            # the compact rows take the argmax here (one pass) and their draw below replaces it; the
            # temperatures stay a column of a (S, 6) copy, strided as above (Triton specialises on stride 1)
            greedy_compact = floats.clone()
            greedy_compact[:, 0].index_fill_(0, compact, 0.0)
            tokens = self._sample_logits(logits, greedy_compact[:, 0], top_p, min_p, ints[:, 0], ints[:, 1],
                                         ints[:, 2], GREEDY_TEMPERATURE)
            tokens.index_copy_(0, compact, self._sample_best(logits, floats, ints, compact))
            return tokens
        greedy = temperature < GREEDY_TEMPERATURE
        temp = torch.where(greedy, torch.ones_like(temperature), temperature)
        fmax = torch.finfo(torch.float32).max  # NaN and -inf stay out of every draw; +inf is the largest
        finite = torch.nan_to_num(logits, nan=float("-inf"), posinf=fmax, neginf=float("-inf"))
        top = finite.max(dim=-1, keepdim=True).values.clamp(min=-fmax)  # (S, 1); a masked row: no -inf - -inf
        scaled = (finite - top) / temp[:, None]  # (S, V), max 0
        u = uniform(ints[:, 1], ints[:, 2])  # (S,) in (0, 1)
        if flags & TOP:
            sampled = _draw_sorted(scaled, ints[:, 0], top_p, min_p, u)
        else:
            probs = scaled.exp()  # (S, V), the best token has 1
            if flags & MIN_P:
                probs = probs.masked_fill(probs < min_p[:, None], 0.0)
            sampled = _draw(probs, u)
        return torch.where(greedy, logits.argmax(dim=-1), sampled)

    def _sample_best(self, logits: torch.Tensor, floats: torch.Tensor, ints: torch.Tensor,
                     compact: torch.Tensor) -> torch.Tensor:
        """The kernel's draw for the compact samples (K,), over their COMPACT_TOP_K best tokens -> (K,) ids.
        Same semantics as over the whole row (top-k, top-p over it, min-p): the kept tokens are among them,
        but for ties at the k-th value that reach past them (the module's docstring)."""
        values, ids = _best_tokens(logits.index_select(0, compact), COMPACT_TOP_K)  # (K, C)
        f, i = floats.index_select(0, compact), ints.index_select(0, compact)
        picked = self._sample_logits(values, f[:, 0], f[:, 1], f[:, 2], i[:, 0], i[:, 1], i[:, 2],
                                     GREEDY_TEMPERATURE)
        return ids.gather(1, picked[:, None]).squeeze(1)


def _writable(logits: torch.Tensor, raw: torch.Tensor, flags: int) -> torch.Tensor:
    """A step's logits to change in place: a copy where they are still the raw logits its logprobs read."""
    return logits.clone() if logits is raw and flags & LOGPROBS else logits


def mask_tokens(logits: torch.Tensor, samples: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """logits (S, V) fp32; samples (G,) int64; bits (G, W) int32, bit j of word w allowing token 32 w + j ->
    a copy of logits with every token row samples[g] does not allow at -inf."""
    shifts = torch.arange(32, dtype=torch.int32, device=bits.device)
    allowed = ((bits[:, :, None] >> shifts) & 1).view(bits.shape[0], -1)[:, :logits.shape[1]]  # (G, V)
    masked = logits.index_select(0, samples).masked_fill_(allowed == 0, float("-inf"))
    return logits.index_copy(0, samples, masked)


def _torch_argmax(logits: torch.Tensor) -> torch.Tensor:
    """(S, V) -> (S,) int64: the first index of each row's max."""
    return logits.argmax(dim=-1)


def _best_tokens(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(K, V) -> the k best logits of each row and their ids (K, k), in vocabulary order: the draw walks
    them in that order, and topk's own order among ties is not specified."""
    values, ids = logits.topk(min(k, logits.shape[-1]), dim=-1, sorted=False)
    ids, order = ids.sort(dim=-1)
    return values.gather(1, order).contiguous(), ids


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, in_prompt: torch.Tensor,
                    penalties: torch.Tensor) -> torch.Tensor:
    """logits, counts (S, V) fp32, in_prompt (S, V) bool, penalties (S, 3) presence, frequency, repetition."""
    pres, freq, rep = penalties[:, 0:1], penalties[:, 1:2], penalties[:, 2:3]  # (S, 1) each
    seen = in_prompt | (counts > 0)
    out = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    return out - freq * counts - pres * (counts > 0).float()


def _draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse CDF: the first token whose cumulative (unnormalised) mass exceeds u * total. A token of zero
    mass never is the first to exceed it."""
    cdf = probs.cumsum(dim=-1)  # (S, V)
    target = u[:, None] * cdf[:, -1:]
    idx = torch.searchsorted(cdf, target, right=True).squeeze(1)
    return idx.clamp_(max=probs.shape[-1] - 1)


def _draw_sorted(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                 u: torch.Tensor) -> torch.Tensor:
    """top-k, then top-p over the renormalised top-k, then min-p, found on the sorted row; the best token
    always survives (so a top_p that underflows to 0 keeps exactly it). The kept masses go back to
    vocabulary order for the draw, and a row without top-k or top-p keeps its masses untouched: its token is
    the one the plain draw gives, whether or not a batch neighbour's filter sent the step here."""
    V = scaled.shape[-1]
    sorted_scaled, order = scaled.sort(dim=-1, descending=True)  # (S, V)
    ranks = torch.arange(V, device=scaled.device)[None, :]  # (1, V)
    k = torch.where(top_k > 0, top_k.clamp(max=V), torch.full_like(top_k, V))  # (S,)
    kth = sorted_scaled.gather(1, (k - 1)[:, None])  # (S, 1): ties with the k-th stay (vLLM's, the kernel's)
    probs = sorted_scaled.exp().masked_fill(sorted_scaled < kth, 0.0)  # unnormalised, best = 1
    cdf = probs.cumsum(dim=-1)
    beyond_p = (cdf - probs >= top_p[:, None] * cdf[:, -1:]) & (ranks > 0) & (top_p < 1.0)[:, None]
    probs = probs.masked_fill(beyond_p | (probs < min_p[:, None]), 0.0)
    return _draw(torch.zeros_like(probs).scatter_(1, order, probs), u)  # (S, V) kept masses, vocab order


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (xor-shift-multiply) on int64 values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & MASK32
    return x ^ (x >> 16)


def uniform(keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """(S,) fp32 uniforms in (0, 1) from (key, counter): the counter-th draw of stream `key`."""
    x = _mix32((keys & MASK32) ^ _mix32((counters * 0x9E3779B1 + 0x632BE59B) & MASK32))
    return ((x >> 8).float() + 0.5) * (1.0 / (1 << 24))
