"""Batched sampler: every step's rows are sampled together on the logits' device.

Order per row: penalties -> greedy argmax (temperature 0) or: temperature -> top-k/top-p -> min-p -> softmax
-> exponential-race sampling `argmax(p / q), q ~ Exp(1)`, which is an exact draw from p. Each seeded row
draws its q from its own torch.Generator, so its tokens do not depend on its batch neighbours; unseeded rows
share one batched draw. Logprobs are those of the model (raw logits), as OpenAI reports them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from server.engine.sampling_params import SamplingParams


class SamplingRow(Protocol):
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None


@dataclass
class SamplerOutput:
    token_ids: list[int]  # (B,)
    logprobs: list[float] | None = None  # (B,) logprob of the sampled token; None when no row asked
    top_ids: list[list[int]] | None = None  # (B, k) best tokens, k = the largest logprobs asked in the batch
    top_logprobs: list[list[float]] | None = None  # (B, k)


def make_generator(seed: int, index: int, device: torch.device | str) -> torch.Generator:
    """Generator of choice `index` of a request seeded with `seed` (choices get distinct streams)."""
    mixed = (seed * 0x9E3779B1 + index * 0x85EBCA77) & 0x7FFF_FFFF_FFFF_FFFF
    return torch.Generator(device=device).manual_seed(mixed)


class Sampler:
    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        logits = logits.float()  # (B, V)
        params = [r.params for r in rows]
        processed = logits
        if any(p.has_penalties for p in params):
            processed = apply_penalties(logits, rows)
        if all(p.greedy for p in params):
            tokens = processed.argmax(dim=-1)  # (B,)
        else:
            tokens = _sample_or_argmax(processed, rows)
        out = SamplerOutput(tokens.tolist())
        ks = [p.logprobs for p in params if p.logprobs is not None]
        if ks:
            _add_logprobs(out, logits, tokens, max(ks))
        return out


def _sample_or_argmax(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """(B,) sampled tokens; argmax for rows whose temperature is 0 (in fp32)."""
    knobs = torch.tensor([[r.params.temperature, r.params.top_p, r.params.min_p] for r in rows])  # (B, 3)
    greedy = knobs[:, 0] == 0  # on the host: the flags below need no device sync
    sampled = _sample(logits, knobs, greedy, rows)
    if not bool(greedy.any()):
        return sampled
    return torch.where(greedy.to(logits.device), logits.argmax(dim=-1), sampled)


def _sample(logits: torch.Tensor, knobs: torch.Tensor, greedy: torch.Tensor,
            rows: Sequence[SamplingRow]) -> torch.Tensor:
    """knobs: (B, 3) host fp32 temperature, top_p, min_p; greedy rows are scaled by 1 (and overridden)."""
    dev, V = logits.device, logits.shape[-1]
    top_k = [min(r.params.top_k, V) for r in rows]  # any int: a huge one means all
    use_top = any(k > 0 for k in top_k) or bool((knobs[:, 1] < 1).any())
    use_min_p = bool((knobs[:, 2] > 0).any())
    knobs[:, 0].masked_fill_(greedy, 1.0)  # greedy rows: divide by 1
    temps, top_p, min_p = knobs.to(dev).unbind(1)  # one copy to the device
    scaled = logits / temps[:, None]  # (B, V)
    if use_top:
        scaled = apply_top_k_top_p(scaled, torch.tensor(top_k, device=dev), top_p)
    if use_min_p:
        scaled = apply_min_p(scaled, min_p)
    probs = scaled.softmax(dim=-1)  # (B, V)
    q = exponential_noise(probs.shape, [r.generator for r in rows], dev)
    return (probs / q).argmax(dim=-1)


def exponential_noise(shape: torch.Size, generators: Sequence[torch.Generator | None],
                      device: torch.device) -> torch.Tensor:
    """(B, V) Exp(1) draws; rows with a generator draw from it alone (batch-independent)."""
    q = torch.empty(shape, device=device).exponential_()
    for i, g in enumerate(generators):
        if g is not None:
            q[i].exponential_(generator=g)
    return q.clamp_min_(1e-30)


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """presence/frequency (OpenAI, over generated tokens) and repetition (CTRL, over prompt + generated)."""
    B, V = logits.shape
    dev = logits.device
    params = [r.params for r in rows]
    counts = token_counts([r.output_token_ids for r in rows], V, dev)  # (B, V) generated-token counts
    in_prompt = token_counts([r.prompt_token_ids for r in rows], V, dev) > 0  # (B, V)
    rep = torch.tensor([p.repetition_penalty for p in params], device=dev)[:, None]  # (B, 1)
    seen = in_prompt | (counts > 0)
    out = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    freq = torch.tensor([p.frequency_penalty for p in params], device=dev)[:, None]
    pres = torch.tensor([p.presence_penalty for p in params], device=dev)[:, None]
    return out - freq * counts - pres * (counts > 0).float()


def token_counts(token_lists: Sequence[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """(B, V) float counts of each token id per row, via one scatter_add over a padded id tensor."""
    width = max((len(t) for t in token_lists), default=0)
    ids = torch.full((len(token_lists), width + 1), vocab, dtype=torch.long)  # pad id = vocab (dropped)
    for i, t in enumerate(token_lists):
        ids[i, :len(t)] = torch.tensor(t, dtype=torch.long)
    ids = ids.to(device)
    counts = torch.zeros(len(token_lists), vocab + 1, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=counts.dtype))
    return counts[:, :vocab]


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) all but each row's top_k (0 = all) tokens, then beyond its top_p probability mass.

    The most likely token always survives."""
    B, V = logits.shape
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # (B, V)
    k = torch.where(top_k > 0, top_k.clamp(max=V), torch.full_like(top_k, V))  # (B,)
    ranks = torch.arange(V, device=logits.device)[None, :]  # (1, V)
    sorted_logits = sorted_logits.masked_fill(ranks >= k[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # (B, V) mass of strictly better tokens
    beyond_p = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1)
    sorted_logits = sorted_logits.masked_fill(beyond_p, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below min_p times the row's best probability."""
    probs = logits.softmax(dim=-1)  # (B, V)
    threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, float("-inf"))


def _add_logprobs(out: SamplerOutput, logits: torch.Tensor, tokens: torch.Tensor, k: int) -> None:
    logprobs = logits.log_softmax(dim=-1)  # (B, V)
    out.logprobs = logprobs.gather(1, tokens[:, None]).squeeze(1).tolist()
    if k > 0:
        top = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
        out.top_ids = top.indices.tolist()
        out.top_logprobs = top.values.tolist()
    else:
        out.top_ids = [[] for _ in out.token_ids]
        out.top_logprobs = [[] for _ in out.token_ids]
