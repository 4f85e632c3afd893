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
        dev = logits.device
        processed = logits
        if any(p.has_penalties for p in params):
            processed = apply_penalties(logits, rows)
        tokens = processed.argmax(dim=-1)  # (B,) greedy
        if not all(p.greedy for p in params):
            temps = torch.tensor([p.temperature for p in params], device=dev)
            tokens = torch.where(temps == 0, tokens, _sample(processed, temps, rows))
        out = SamplerOutput(tokens.tolist())
        ks = [p.logprobs for p in params if p.logprobs is not None]
        if ks:
            _add_logprobs(out, logits, tokens, max(ks))
        return out


def _sample(logits: torch.Tensor, temps: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    params = [r.params for r in rows]
    dev, V = logits.device, logits.shape[-1]
    scaled = logits / torch.where(temps == 0, torch.ones_like(temps), temps)[:, None]  # (B, V)
    top_k = torch.tensor([min(p.top_k, V) for p in params], device=dev)  # any int: a huge one means all
    top_p = torch.tensor([p.top_p for p in params], device=dev)
    if bool((top_k > 0).any()) or bool((top_p < 1).any()):
        scaled = apply_top_k_top_p(scaled, top_k, top_p)
    min_p = torch.tensor([p.min_p for p in params], device=dev)
    if bool((min_p > 0).any()):
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
