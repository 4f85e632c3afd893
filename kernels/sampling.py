"""Triton sampling without a sort: one token per row of logits under temperature, top-k, top-p and min-p.

One launch, grid (S,): a program owns one row and walks its V logits in tiles, in passes. p_i = exp((x_i -
max) * (1 / T)) is recomputed from the logits in every pass (cheaper than writing it), so the best token has
p = 1.
  1. max, first argmax and Z = sum p, online. Greedy rows (T < greedy_below) and rows whose logits are all
     -inf store the argmax and stop.
  2. top-k rows (0 < top_k < V): a floor t_k with {p >= t_k} = the top k, by a search over fp32 bit patterns
     (p >= 0, so the patterns order like the values) that counts NT thresholds per pass: at most
     ceil(30 / log2 NT) passes, fewer when a threshold holds exactly k tokens. Z_k is the mass of p >= t_k.
     In-kernel rather than torch.topk: topk needs the step's largest k on the host (a sync, or a bound the
     runner does not have), and these passes run on the top-k rows only.
  3. rows whose min_p is above t_k: the mass of p >= min_p, one pass.
  4. rejection rounds with a rising pivot over the candidates C = {p >= lo}, lo = max(t_k, min_p): draw j by
     inverse CDF over C with the round's uniform (a prefix-sum pass that stops at the tile where u * Z_C is
     crossed); unless top_p is 1, one pass sums the mass and counts the tokens with p > p_j. j is kept if no
     token is above it or if mass_above < top_p * Z_ref (Z_ref = Z_k on top-k rows, else Z); otherwise C =
     {p > p_j} with Z_C = mass_above: every token with p <= p_j has at least that mass above it and fails
     too, so C always holds the kept set and the kept token follows p restricted to the kept set exactly.
     After MAX_ROUNDS rejections the row takes its argmax (always kept). A rejection keeps the tokens above
     the drawn one, about half of C on a flat row and fewer on a peaked one, so the worst case (a tiny top_p
     on a flat row) takes ~ln |C| rounds, ~12 at V = 128256: MAX_ROUNDS = 32 is far in the tail.
Semantics are the torch path's (server/engine/sampler.py): top-k, then top-p over the renormalised top-k,
then min-p relative to the best token, the best token always kept; except that ties at a threshold are all
kept (top-k keeps every token equal to the k-th; top-p keeps every token tied with the last one it needs).
Uniforms are a counter-based hash of (seed key, sample counter, round), computed in the kernel: a row's
token depends on its own logits, key and counter alone, never on its batch neighbours; round 0 is the
torch path's `uniform(key, counter)`. NaN logits count as -inf, +inf as the largest float.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch_cache import CachedLauncher

FLOAT_MAX = tl.constexpr(3.4028234663852886e38)
ONE_BITS = tl.constexpr(0x3F800000)  # fp32 bit pattern of 1.0: every p's pattern is in [0, ONE_BITS]
MAX_ROUNDS = 32


@triton.jit
def _mix32(x):
    """The 32-bit integer finaliser of server/engine/sampler.py's _mix32, on uint32 (wrapping multiplies)."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _uniform(key, counter, r):
    """fp32 in (0, 1): round r of draw `counter` of stream `key` (uint32 scalars); round 0 is
    sampler.uniform."""
    x = _mix32(key ^ _mix32(counter * 0x9E3779B1 + 0x632BE59B + r * 0x2545F491))
    return ((x >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)


@triton.jit
def _tile_probs(row, start, m, inv_t, V: tl.constexpr, BLOCK: tl.constexpr):
    """Offsets (BLOCK,) and p = exp((x - m) * inv_t) (BLOCK,): 0 for -inf or NaN logits and past V."""
    offs = start + tl.arange(0, BLOCK)
    x = tl.load(row + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    x = tl.minimum(tl.where(x != x, float("-inf"), x), FLOAT_MAX)
    return offs, tl.exp((x - m) * inv_t)


@triton.jit
def _max_argmax_mass(row, inv_t, V: tl.constexpr, BLOCK: tl.constexpr):
    """Pass 1: the row's max logit, its first index, and Z = sum exp((x - max) * inv_t). Each lane keeps its
    own running max, first index of it and rescaled mass (no reduction inside the loop); the lanes merge
    last."""
    m_lane = tl.full([BLOCK], float("-inf"), tl.float32)
    best_lane = tl.zeros([BLOCK], tl.int32)
    z_lane = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        # NaN as -inf, +inf as the largest float, as torch.nan_to_num in the torch path
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(row + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        x = tl.minimum(tl.where(x != x, float("-inf"), x), FLOAT_MAX)
        best_lane = tl.where(x > m_lane, offs, best_lane)           # strictly: a lane keeps its first max
        m_new = tl.maximum(m_lane, x)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)       # no -inf - -inf before a finite logit
        z_lane = z_lane * tl.exp((m_lane - m_safe) * inv_t) + tl.exp((x - m_safe) * inv_t)
        m_lane = m_new
    m = tl.max(m_lane, 0)
    best = tl.min(tl.where(m_lane == m, best_lane, V), 0)          # the first max of the row, as torch's
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    z = tl.sum(z_lane * tl.exp((m_lane - m_safe) * inv_t), 0)
    return m, best, z


@triton.jit
def _top_k_floor(row, m, inv_t, k, z, V: tl.constexpr, BLOCK_K: tl.constexpr, NT: tl.constexpr):
    """(t_k, Z_k): a floor with {p >= t_k} = the k largest p (all ties at the k-th kept), and its mass; z is
    the row's whole mass. A search over fp32 bit patterns with the invariant count(p >= bits lo) >= k >
    count(p >= bits hi): each pass counts NT thresholds in [lo, hi) and narrows to one step of them; it stops
    early when a threshold holds exactly k tokens (that upper set is the top k)."""
    lo = 0
    hi = ONE_BITS + 1
    z_lo = z                                                        # every p >= 0
    slots = tl.arange(0, NT)
    while hi - lo > 1:
        step = (hi - lo + NT - 1) // NT
        th_bits = lo + step * slots                                 # (NT,) th_bits[0] = lo
        th = th_bits.to(tl.float32, bitcast=True)
        counts = tl.zeros([NT, BLOCK_K], tl.int32)                  # per (threshold, lane): no reduction
        masses = tl.zeros([NT, BLOCK_K], tl.float32)                # inside the loop
        for start in range(0, V, BLOCK_K):
            _, p = _tile_probs(row, start, m, inv_t, V, BLOCK_K)
            ge = p[None, :] >= th[:, None]                          # (NT, BLOCK_K)
            counts += ge.to(tl.int32)
            masses += tl.where(ge, p[None, :], 0.0)
        count = tl.sum(counts, 1)                                   # (NT,)
        ok = (count >= k) & (th_bits < hi)                          # slot 0 always holds
        pick = tl.max(tl.where(ok, slots, 0), 0)
        z_lo = tl.sum(tl.where(slots == pick, tl.sum(masses, 1), 0.0), 0)
        exact = tl.sum(tl.where(slots == pick, count, 0), 0) == k
        lo = lo + step * pick
        hi = tl.where(exact, lo + 1, tl.minimum(hi, lo + step))
    return lo.to(tl.float32, bitcast=True), z_lo


@triton.jit
def _mass_at_least(row, m, inv_t, lo, V: tl.constexpr, BLOCK: tl.constexpr):
    z = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        _, p = _tile_probs(row, start, m, inv_t, V, BLOCK)
        z += tl.where(p >= lo, p, 0.0)
    return tl.sum(z, 0)


@triton.jit
def _draw(row, m, inv_t, pivot, target, best, V: tl.constexpr, BLOCK: tl.constexpr):
    """(j, p_j): the first token of C = {p > pivot} whose running mass exceeds target (its p is > 0: the
    running mass rises only at such tokens). If float rounding leaves target uncrossed (target within an
    ulp of Z_C), the best token, which is in every C."""
    j = best
    pj = 1.0
    run = 0.0
    found = 0
    start = 0
    while (start < V) & (found == 0):
        offs, p = _tile_probs(row, start, m, inv_t, V, BLOCK)
        p = tl.where(p > pivot, p, 0.0)
        cum = tl.cumsum(p, 0) + run                                 # (BLOCK,) mass of C up to each token
        first = tl.min(tl.where(cum > target, offs, V), 0)
        if first < V:
            j = first
            pj = tl.sum(tl.where(offs == first, p, 0.0), 0)
            found = 1
        run = tl.max(cum, 0)
        start += BLOCK
    return j, pj


@triton.jit
def _above(row, m, inv_t, pj, V: tl.constexpr, BLOCK: tl.constexpr):
    """(count, mass) of the tokens with p > pj."""
    count = tl.zeros([BLOCK], tl.int32)
    mass = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        _, p = _tile_probs(row, start, m, inv_t, V, BLOCK)
        gt = p > pj
        count += gt.to(tl.int32)
        mass += tl.where(gt, p, 0.0)
    return tl.sum(count, 0), tl.sum(mass, 0)


@triton.jit
def _sample_kernel(
    LOGITS, TEMPERATURE, TOP_P, MIN_P, TOP_K, KEY, COUNTER, OUT,
    greedy_below,
    stride_ls, stride_t, stride_p, stride_m, stride_k, stride_key, stride_c,
    V: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, NT: tl.constexpr, MAX_ROUNDS: tl.constexpr,
):
    s = tl.program_id(0)
    row = LOGITS + s.to(tl.int64) * stride_ls
    t = tl.load(TEMPERATURE + s * stride_t)
    greedy = t < greedy_below
    t = tl.where(greedy, 1.0, t)                                    # a tiny T would make every p 0 or NaN
    inv_t = 1.0 / t                                                 # each pass multiplies (no division)

    # ---- pass 1: max, argmax, Z
    m, best, z = _max_argmax_mass(row, inv_t, V, BLOCK)
    if greedy | (m == float("-inf")):
        tl.store(OUT + s, best.to(tl.int64))
        return

    # ---- the candidates' floor lo, their mass z_lo, and the mass top-p is relative to, z_ref
    top_p = tl.load(TOP_P + s * stride_p)
    min_p = tl.load(MIN_P + s * stride_m)
    k = tl.load(TOP_K + s * stride_k)
    lo = 0.0
    z_lo = z
    if (k > 0) & (k < V):
        lo, z_lo = _top_k_floor(row, m, inv_t, k.to(tl.int32), z, V, BLOCK_K, NT)
    z_ref = z_lo
    if min_p > lo:
        lo = min_p
        z_lo = _mass_at_least(row, m, inv_t, lo, V, BLOCK)
    # C = {p > pivot}: the float just below lo, or below 0 when everything is a candidate
    pivot = tl.where(lo > 0.0, (lo.to(tl.int32, bitcast=True) - 1).to(tl.float32, bitcast=True), -1.0)

    # ---- rejection rounds with a rising pivot
    key = (tl.load(KEY + s * stride_key) & 0xFFFFFFFF).to(tl.uint32)
    counter = (tl.load(COUNTER + s * stride_c) & 0xFFFFFFFF).to(tl.uint32)
    token = best                                                    # taken if every round rejects
    r = 0
    done = 0
    while (r < MAX_ROUNDS) & (done == 0):
        u = _uniform(key, counter, r.to(tl.uint32))
        j, pj = _draw(row, m, inv_t, pivot, u * z_lo, best, V, BLOCK)
        keep = top_p >= 1.0                                         # every candidate passes top-p = 1
        if top_p < 1.0:
            count, mass = _above(row, m, inv_t, pj, V, BLOCK)
            keep = (count == 0) | (mass < top_p * z_ref)
            z_lo = mass                                             # C's mass if j is rejected
        if keep:
            token = j
            done = 1
        pivot = pj
        r += 1
    tl.store(OUT + s, token.to(tl.int64))


# direct launches after the first call of a specialisation (kernels/launch_cache.py)
_sample = CachedLauncher(_sample_kernel, num_tensors=8)

# The config shipped (CUDA): 8192-wide tiles over 16 warps for the 1-D passes. One program walks a whole
# row, so a pass is bound by the bytes and exps it keeps in flight: on an H200 (tools/sampling_tile_probe, V
# 128256, docs/benchmarks/sampling_tile_h200.json) this took bf16 rows under top_p 0.95 from 0.079 / 0.137 /
# 0.234 ms (2048 over 8 warps) to 0.052 / 0.089 / 0.170 ms at 1 / 64 / 256 rows, 0.66x over the probe's 16
# cases; 16384-wide tiles, 32 warps or software-pipelining stages did no better. The threshold search counts
# 16 thresholds over 256-wide tiles ((16, 256) compares per tile: 4 bits per pass, 8 passes over the row).
BLOCK, BLOCK_K, NT, NUM_WARPS = 8192, 256, 16, 16
# The interpreter (CPU) pays per tile op, not per element: small tiles keep the tests' rows multi-tile, and
# 1024 thresholds a pass (10 bits) keep the top-k search to at most 3 passes
INTERPRETER_BLOCK, INTERPRETER_BLOCK_K, INTERPRETER_NT = 32, 16, 1024


def _launch(logits, temperature, top_p, min_p, top_k, keys, counters, out, greedy_below):
    S, V = logits.shape
    cuda = logits.is_cuda
    block = min(BLOCK if cuda else INTERPRETER_BLOCK, triton.next_power_of_2(V))
    block_k = min(BLOCK_K if cuda else INTERPRETER_BLOCK_K, block)
    _sample(
        (S,), logits, temperature, top_p, min_p, top_k, keys, counters, out,
        float(greedy_below),
        logits.stride(0), temperature.stride(0), top_p.stride(0), min_p.stride(0), top_k.stride(0),
        keys.stride(0), counters.stride(0),
        V=V, BLOCK=block, BLOCK_K=block_k, NT=NT if cuda else INTERPRETER_NT, MAX_ROUNDS=MAX_ROUNDS,
        num_warps=NUM_WARPS if cuda else 1, num_stages=1,
    )
    return out


def sample_logits(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                  top_k: torch.Tensor, keys: torch.Tensor, counters: torch.Tensor,
                  greedy_below: float) -> torch.Tensor:
    """Checked public wrapper: logits (S, V) fp32/bf16/fp16 with unit stride over V; temperature, top_p,
    min_p (S,) fp32; top_k, keys, counters (S,) int64 (any strides: columns of the sampler's row tables).
    top_k <= 0 or >= V disables top-k. Returns (S,) int64 tokens; rows with T < greedy_below take the
    argmax."""
    if logits.dim() != 2 or logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"logits must be (S, V) fp32/bf16/fp16, got {tuple(logits.shape)} {logits.dtype}")
    S, V = logits.shape
    if V == 0 or logits.stride(1) != 1 or V >= 2**31:
        raise ValueError(f"logits must have 0 < V < 2**31 and unit stride over V, got {tuple(logits.shape)} "
                         f"strides {logits.stride()}")
    for name, x, dtype in (("temperature", temperature, torch.float32), ("top_p", top_p, torch.float32),
                           ("min_p", min_p, torch.float32), ("top_k", top_k, torch.int64),
                           ("keys", keys, torch.int64), ("counters", counters, torch.int64)):
        if x.shape != (S,) or x.dtype != dtype or x.device != logits.device:
            raise ValueError(f"{name} must be ({S},) {dtype} on {logits.device}, got {tuple(x.shape)} "
                             f"{x.dtype} on {x.device}")
    out = torch.empty(S, dtype=torch.int64, device=logits.device)
    if S == 0:
        return out
    return _launch(logits, temperature, top_p, min_p, top_k, keys, counters, out, greedy_below)
