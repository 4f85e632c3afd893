"""Float64 reference of the set the sampling kernel (kernels/sampling.py) draws from, for tests and benches.

top-k, then top-p over the renormalised top-k, then min-p relative to the best token, the best token always
kept, ties at a threshold all kept: token i is kept if no token has a larger p, or if fewer than k tokens have
a larger p, their mass is below top_p * Z_k, and p_i >= min_p (p = exp((x - max) * (1 / T)), the best has 1).
"""

from __future__ import annotations

import torch

FMAX = torch.finfo(torch.float32).max


def filtered_sets(logits: torch.Tensor, temperature, top_p, top_k, min_p, tol: float = 1e-4
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(kept, allowed) (S, V) bool for logits (S, V) and per-row (S,) parameters or scalars. `allowed` adds
    the tokens whose mass above lies within tol * Z_k over the top-p bound (fp32 sums may keep them). The
    scaled logits are formed in fp32 as the kernel forms them; the masses are summed in float64."""
    S, V = logits.shape
    dev = logits.device
    t, tp, tk, mp = (torch.as_tensor(v, device=dev).expand(S) for v in (temperature, top_p, top_k, min_p))
    x = logits.float().nan_to_num(nan=float("-inf"), posinf=FMAX, neginf=float("-inf"))
    p = ((x - x.max(-1, keepdim=True).values) * (1.0 / t.float())[:, None]).double().exp()  # (S, V), best 1
    asc = p.sort(-1).values
    above = V - torch.searchsorted(asc, p, right=True)  # (S, V) tokens with a larger p
    prefix = torch.cat([torch.zeros(S, 1, dtype=p.dtype, device=dev), asc.flip(-1).cumsum(-1)], -1)
    mass_above = prefix.gather(1, above)  # (S, V) their mass
    k = torch.where((tk > 0) & (tk < V), tk, V)[:, None]
    in_k = above < k
    z_k = (p * in_k).sum(-1, keepdim=True)  # (S, 1)
    bound = tp.float().double()[:, None] * z_k
    base = in_k & (p >= mp.float().double()[:, None]) & (p > 0)
    kept = (above == 0) | (base & (mass_above < bound))
    return kept, kept | (base & (mass_above < bound + tol * z_k))
