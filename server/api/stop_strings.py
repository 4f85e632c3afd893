"""Stop strings over a stream of text deltas, in O(new text) per delta.

A stop string is never emitted: the text is cut before the first one. A tail of the text that could still
grow into a stop string (a proper prefix of one) is held back until later text decides it. Only that held
tail, shorter than the longest stop string, is scanned again with the new text: any match starts inside
it, since a longer suffix of the text that prefixed a stop string would have been held already.
"""

from __future__ import annotations


class StopStrings:
    def __init__(self, stops: list[str]):
        assert stops and all(stops), "stop strings are non-empty"
        self.stops = stops
        self.max_len = max(len(s) for s in stops)
        self.firsts = {s[0] for s in stops}  # a held tail starts with one of these
        self.held = ""  # text not yet emitted: a proper prefix of some stop string

    def feed(self, text: str) -> tuple[str, str | None]:
        """New text -> (text safe to emit now, the stop string that ends the choice or None)."""
        s = self.held + text
        hit = self._earliest(s)
        if hit is not None:
            pos, stop = hit
            self.held = ""
            return s[:pos], stop
        k = self._held_len(s)
        self.held = s[len(s) - k:]
        return s[:len(s) - k], None

    def release(self) -> str:
        """The choice ends without a stop string: the held tail is ordinary text."""
        held, self.held = self.held, ""
        return held

    def _earliest(self, s: str) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for stop in self.stops:
            pos = s.find(stop)
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, stop)
        return best

    def _held_len(self, s: str) -> int:
        """Length of the longest suffix of s that is a proper prefix of some stop string."""
        for k in range(min(self.max_len - 1, len(s)), 0, -1):
            if s[-k] in self.firsts:
                tail = s[-k:]
                if any(stop.startswith(tail) for stop in self.stops):
                    return k
        return 0
