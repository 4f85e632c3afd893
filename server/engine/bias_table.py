"""The sampler's per-row bias table: logit_bias, min_tokens' hold-back and allowed_token_ids on the device.

A row's entries (bias_entries) are token ids with a value and a kind: ADDED (logit_bias: the value is added),
HELD_BACK (EOS and stop_token_ids: out of the draw while the row has fewer samples than its min_tokens) and
ALLOWED (allowed_token_ids: every other token is at -inf). They are written when a sequence takes the row,
from the host, and a step applies them to an fp32 copy of its rows' logits with no host sync: the min_tokens
test reads the row's sample count on the device. The table is as wide as the widest row so far (the host
knows each row's width and grows it between steps); padding entries add 0 to token 0.
"""

from __future__ import annotations

import torch

from server.engine.sampling_params import SamplingParams

ADDED, HELD_BACK, ALLOWED = 0, 1, 2  # entry kinds
# What an allowed id the model masks (-inf) is raised to, and what a held-back (or banned: bad_words.py) id is
# lowered to: finite, so a row never ends all -inf (its argmax would be token 0, a draw any token), yet below
# any logit a model gives. A held-back id ranks below every other, a masked allowed one included (a review
# found EOS drawn before min_tokens where -3e38 - 1e30 rounded back to the floor), and is drawn only where
# nothing else can be. The hold-back is a minimum taken after the penalties, not a sum: no repetition penalty
# or floor moves it, and nothing overflows to -inf.
ALLOWED_FLOOR = -3e38
HOLD_BACK = -3.2e38


def bias_entries(params: SamplingParams, held_back: list[int]) -> tuple[list[int], list[float], list[int]]:
    """A row's entries -> (token ids, values, kinds): logit_bias's, then while min_tokens is unmet the
    `held_back` ids (EOS, stop_token_ids), then allowed_token_ids."""
    ids, values = list(params.logit_bias), list(params.logit_bias.values())
    kinds = [ADDED] * len(ids)
    for extra, kind in ((held_back if params.min_tokens > 0 else [], HELD_BACK),
                        (params.allowed_token_ids or [], ALLOWED)):
        ids += extra
        values += [0.0] * len(extra)
        kinds += [kind] * len(extra)
    return ids, values, kinds


class BiasTable:
    """(R, W) token ids (int64), values (fp32) and kinds (int8), allocated on first use."""

    def __init__(self, num_rows: int, device: torch.device) -> None:
        self.num_rows, self.device = num_rows, device
        self.ids: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.kinds: torch.Tensor | None = None

    @property
    def width(self) -> int:
        return 0 if self.ids is None else self.ids.shape[1]

    def clear(self, rows: torch.Tensor) -> None:
        """rows (N,) int64 changed owner: none of the last owner's entries stay (a step with entries applies
        every row of the step)."""
        if self.ids is not None:
            self.ids.index_fill_(0, rows, 0)
            self.values.index_fill_(0, rows, 0.0)
            self.kinds.index_fill_(0, rows, ADDED)

    def write(self, rows: torch.Tensor, cols: torch.Tensor, token_ids: torch.Tensor, values: torch.Tensor,
              kinds: torch.Tensor, width: int) -> None:
        """Entries (E,) of cleared rows at (row, col); `width`: the widest of these rows' entry counts."""
        self._ensure_width(width)
        at = (rows.long(), cols.long())
        self.ids.index_put_(at, token_ids.long())
        self.values.index_put_(at, values)
        self.kinds.index_put_(at, kinds.to(torch.int8))

    def _ensure_width(self, width: int) -> None:
        have = self.width
        if width <= have:
            return
        width = max(width, 2 * have, 8)
        n = self.num_rows
        ids = torch.zeros(n, width, dtype=torch.int64, device=self.device)
        values = torch.zeros(n, width, device=self.device)
        kinds = torch.full((n, width), ADDED, dtype=torch.int8, device=self.device)
        if have:
            ids[:, :have], values[:, :have], kinds[:, :have] = self.ids, self.values, self.kinds
        self.ids, self.values, self.kinds = ids, values, kinds

    def apply(self, logits: torch.Tensor, rows: torch.Tensor, keep_allowed: bool) -> torch.Tensor:
        """logits (S, V) fp32 of `rows` (S,) -> a biased copy: rows with allowed entries keep only those
        tokens (where `keep_allowed`: the host knows a step has such rows), then the added values."""
        if self.ids is None:  # no row has had an entry yet
            return logits
        ids, values, kinds = self.ids[rows], self.values[rows], self.kinds[rows]  # (S, W)
        allowed = kinds == ALLOWED
        if keep_allowed:
            logits = _keep_allowed(logits, ids, allowed)
        return logits.scatter_add(1, ids, torch.where(kinds == ADDED, values, 0.0))

    def hold_back(self, logits: torch.Tensor, rows: torch.Tensor, samples: torch.Tensor,
                  min_tokens: torch.Tensor) -> torch.Tensor:
        """After apply and the penalties: logits (S, V) fp32 of `rows` (S,), their sample counts and
        min_tokens (S,) -> a copy with the held-back ids at HOLD_BACK (at most) while samples < min_tokens."""
        if self.ids is None:
            return logits
        held = (self.kinds[rows] == HELD_BACK) & (samples < min_tokens)[:, None]  # (S, W)
        values = torch.where(held, HOLD_BACK, float("inf"))  # +inf: the amin keeps the logit
        return logits.scatter_reduce(1, self.ids[rows], values, "amin")


    def floor_allowed(self, logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """After the penalties: a repetition penalty multiplies an allowed id at ALLOWED_FLOOR past fp32's
        range (-inf), and a row of masked allowed ids would end all -inf again; this raises them back."""
        ids, kinds = self.ids[rows], self.kinds[rows]
        return _keep_allowed(logits, ids, kinds == ALLOWED)


def _keep_allowed(logits: torch.Tensor, ids: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """logits (S, V), ids / allowed (S, W): rows with an allowed entry keep those tokens' logits (at least
    ALLOWED_FLOOR), every other token at -inf; other rows as they are. The max-scatter leaves a token that is
    both allowed and padding (id 0) at its logit, whatever the order of the writes."""
    only = allowed.any(dim=1, keepdim=True)  # (S, 1)
    kept = torch.where(allowed, logits.gather(1, ids).clamp(min=ALLOWED_FLOOR), float("-inf"))  # (S, W)
    return torch.where(only, float("-inf"), logits).scatter_reduce(1, ids, kept, "amax")
