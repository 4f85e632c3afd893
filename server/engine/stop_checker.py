"""Per-choice detokenization and stop logic: stop token ids, EOS, stop strings, max_tokens.

Stop strings are never emitted: the text is cut before the first one, and any tail that could still grow
into one is held back until the next token decides it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from server.engine.sampling_params import SamplingParams


class Detokenizer(Protocol):
    def push(self, token_id: int) -> str: ...  # delta text, never half a UTF-8 character

    def flush(self) -> str: ...  # end of stream: whatever is still held back


@dataclass
class StopResult:
    text: str  # text safe to emit now
    finish_reason: str | None  # None | "stop" | "length"
    stop_reason: str | int | None = None


class StopChecker:
    def __init__(self, params: SamplingParams, detokenizer: Detokenizer, eos_token_ids: set[int]):
        self.params = params
        self.detokenizer = detokenizer
        self.eos_token_ids = set() if params.ignore_eos else set(eos_token_ids)
        self.stop_token_ids = set(params.stop_token_ids)
        self.max_stop_len = max((len(s) for s in params.stop), default=0)
        self.stop_firsts = {s[0] for s in params.stop if s}  # a held-back tail starts with one of these
        self.text = ""  # everything decoded so far (cut at a stop string once one is found)
        self.emitted = 0  # chars of self.text already handed out
        self.num_tokens = 0

    def append(self, token_id: int) -> StopResult:
        """Account for one new token; return the text that may be emitted and whether the choice ended."""
        self.num_tokens += 1
        if token_id in self.stop_token_ids:
            return StopResult(self.finish(), "stop", token_id)
        if token_id in self.eos_token_ids:
            return StopResult(self.finish(), "stop", None)
        start = len(self.text)
        self.text += self.detokenizer.push(token_id)
        hit = self._find_stop(start) if self.params.stop else None
        if hit is not None:
            pos, stop = hit
            self.text = self.text[:pos]
            return StopResult(self.flush(), "stop", stop)
        if self.num_tokens >= self.params.max_tokens:
            return StopResult(self.finish(), "length")
        held = self._held_back() if self.max_stop_len > 1 else 0  # only a proper prefix is held
        return StopResult(self._emit(len(self.text) - held), None)

    def flush(self) -> str:
        """All not yet emitted text."""
        return self._emit(len(self.text))

    def finish(self) -> str:
        """The choice ends without a stop string: release held bytes and held stop-string prefixes."""
        self.text += self.detokenizer.flush()
        return self.flush()

    def _emit(self, end: int) -> str:
        out = self.text[self.emitted:end]
        self.emitted = max(self.emitted, end)
        return out

    def _find_stop(self, new_from: int) -> tuple[int, str] | None:
        """Earliest stop string that ends inside the newly decoded text."""
        best: tuple[int, str] | None = None
        for stop in self.params.stop:  # each scans only where it could end in the new text
            pos = self.text.find(stop, max(0, new_from - len(stop) + 1))
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, stop)
        return best

    def _held_back(self) -> int:
        """Length of the longest unemitted tail that is a proper prefix of some stop string."""
        pending = len(self.text) - self.emitted
        for k in range(min(self.max_stop_len - 1, pending), 0, -1):
            if self.text[-k] not in self.stop_firsts:
                continue
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self.params.stop):
                return k
        return 0
