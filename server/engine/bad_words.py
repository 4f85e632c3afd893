"""The sampler's per-row bad words on the device: token sequences a choice never completes.

A bad word is a token sequence w_0 .. w_{n-1} (vLLM's `bad_words`, encoded by the API). Its last token is
banned at a step whose row's last n - 1 sampled tokens are w_0 .. w_{n-2}; a one-token word is banned at every
step. Only sampled tokens count, never the prompt's (vLLM's rule). Both tables live in row space and change
with no host sync:
- words (R, B, L) int32: each row's words right-aligned (the last token in column L - 1), PAD on their left;
  a slot with no word is all PAD;
- recent (R, L - 1) int64: each row's last L - 1 sampled tokens, the latest in the last column, NONE where it
  has sampled fewer.
A step compares the two for its rows and moves each banned token to HOLD_BACK: finite, so a row whose every
allowed token completes a bad word (a grammar or allowed_token_ids that leave no other) still draws one, and
the core then fails its request (core.BadWordsConflict: a 400), its constraints being in conflict.
The tables grow (B words, L tokens) when a new row needs more; a row that takes a slot writes its words and
its recent tokens from the host (after a preemption it has sampled some already).
"""

from __future__ import annotations

import numpy as np
import torch

from server.engine.bias_table import HOLD_BACK
from server.engine.sampling_params import SamplingParams

PAD = -1  # a word's column left of its first token: matches any recent token
NONE = -2  # a recent column the row has not sampled: matches no word token (every id is >= 0)


def word_entries(words: list[list[int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A row's words -> (word index, position from the word's end (0: its last token), token id) per token,
    (E,) int32 each: a request computes them once (SamplingParams.bad_word_entries), and each of its rows'
    placements (forks, resumes) copies them whole."""
    lens = np.array([len(w) for w in words], dtype=np.int64)
    ends = np.cumsum(lens)
    slots = np.repeat(np.arange(len(words), dtype=np.int32), lens)
    backs = (np.repeat(ends, lens) - 1 - np.arange(int(ends[-1]) if len(words) else 0)).astype(np.int32)
    tokens = np.array([t for w in words for t in w], dtype=np.int32)
    return slots, backs, tokens


def recent_entries(words: list[list[int]], output_ids: list[int]) -> tuple[list[int], list[int]]:
    """The sampled tokens a row's words can read: its last (longest word - 1) -> (position from the latest
    (0), token id) each."""
    need = max(map(len, words)) - 1
    last = output_ids[max(0, len(output_ids) - need):] if need else []
    return list(range(len(last) - 1, -1, -1)), last


def placed_rows(placed: list[tuple[int, SamplingParams, list[int]]]) -> tuple[list, tuple[int, int]]:
    """The rows that sequences with bad words took: (row, their request's params, sampled ids) each ->
    (BadWords.write's 7 sections: the words' rows, slots, backs, tokens and the recent tokens' rows, backs,
    tokens; the (words, tokens per word) these rows need)."""
    word_rows, slots, backs, tokens = [], [], [], []
    recent_rows, recent_backs, recent_tokens = [], [], []
    num_words = word_len = 0
    for row, params, output_ids in placed:
        words, (s, b, t) = params.bad_words_ids, params.bad_word_entries
        word_rows.append(np.full(len(t), row, dtype=np.int32))
        slots.append(s)
        backs.append(b)
        tokens.append(t)
        back, last = recent_entries(words, output_ids)
        recent_rows += [row] * len(last)
        recent_backs += back
        recent_tokens += last
        num_words, word_len = max(num_words, len(words)), max(word_len, max(map(len, words)))
    words_sections = [np.concatenate(a) if a else [] for a in (word_rows, slots, backs, tokens)]
    return [*words_sections, recent_rows, recent_backs, recent_tokens], (num_words, word_len)


class BadWords:
    """(R, B, L) words and (R, L - 1) recent tokens, allocated on first use."""

    def __init__(self, num_rows: int, device: torch.device, kernel: bool = False) -> None:
        """kernel: ban with one Triton launch (kernels/bad_words_ban.py), as the sampler draws on CUDA."""
        self.num_rows, self.device = num_rows, device
        self._kernel = None
        if kernel:
            from kernels import bad_words_ban  # Triton loads only where the kernels run
            self._kernel = bad_words_ban
        self.words: torch.Tensor | None = None
        self.recent: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        """(words per row B, tokens per word L); (0, 0) before the first row's words."""
        return (0, 0) if self.words is None else tuple(self.words.shape[1:])

    def warm_up(self) -> None:
        """Compiles the ban's kernel before serving: a compile mid-serving stalls every stream."""
        if self._kernel is not None:
            self._kernel.warm_up(self.device)

    def clear(self, rows: torch.Tensor) -> None:
        """rows (N,) int64 changed owner: no word of the last owner stays (a step with bad words reads every
        row of the step)."""
        if self.words is not None:
            self.words.index_fill_(0, rows, PAD)
            self.recent.index_fill_(0, rows, NONE)

    def write(self, rows: torch.Tensor, slots: torch.Tensor, backs: torch.Tensor, tokens: torch.Tensor,
              recent_rows: torch.Tensor, recent_backs: torch.Tensor, recent_tokens: torch.Tensor,
              num_words: int, word_len: int) -> None:
        """Cleared rows' word tokens (E,) at (row, slot, position from the word's end) and their recent
        tokens (K,) at (row, position from the latest); num_words, word_len: the most these rows need."""
        self._ensure_shape(num_words, word_len)
        L = self.words.shape[2]
        self.words.index_put_((rows.long(), slots.long(), L - 1 - backs.long()), tokens)
        if recent_rows.numel():
            self.recent.index_put_((recent_rows.long(), L - 2 - recent_backs.long()), recent_tokens.long())

    def ban_(self, logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """logits (S, V) fp32 of `rows` (S,), in place -> them, each word's last token at HOLD_BACK (or
        below) where the row's recent tokens are the word's others."""
        if self.words is None:
            return logits
        if self._kernel is not None:
            return self._kernel.ban_(logits, rows, self.words, self.recent, HOLD_BACK)
        words = self.words[rows]  # (S, B, L)
        before = words[:, :, :-1]  # (S, B, L - 1)
        match = ((before == PAD) | (before == self.recent[rows][:, None, :])).all(dim=2)  # (S, B)
        last = words[:, :, -1].long()  # (S, B), PAD in an empty slot
        match &= last >= 0
        values = torch.where(match, HOLD_BACK, float("inf"))  # +inf: the amin keeps the logit
        return logits.scatter_reduce_(1, last.clamp(min=0), values, "amin")

    def record(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """The step's sampled tokens (S,) int64 of `rows` (S,) join their rows' recent tokens."""
        if self.words is None or self.recent.shape[1] == 0:
            return
        shifted = torch.cat([self.recent[rows, 1:], tokens[:, None]], dim=1)  # (S, L - 1)
        self.recent.index_copy_(0, rows, shifted)

    def _ensure_shape(self, num_words: int, word_len: int) -> None:
        have_b, have_l = self.shape
        if num_words <= have_b and word_len <= have_l:
            return
        b, L = max(num_words, have_b), max(word_len, have_l)
        words = torch.full((self.num_rows, b, L), PAD, dtype=torch.int32, device=self.device)
        recent = torch.full((self.num_rows, L - 1), NONE, dtype=torch.int64, device=self.device)
        if have_b:  # right-aligned: the old columns are the new last ones
            words[:, :have_b, L - have_l:] = self.words
            recent[:, L - have_l:] = self.recent
        self.words, self.recent = words, recent
