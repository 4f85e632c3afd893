"""A structural tag's triggers, indexed so that the triggers a text (a tag's begin) starts with are found in
time linear in the text and logarithmic in the triggers, not by trying every trigger on every begin
(structures x triggers startswith calls held the API's event loop for seconds in a review).

The triggers are sorted, and each keeps its parent: the longest other trigger it starts with. In sorted
order, every string between a trigger t and a text that starts with t starts with t too; so the last trigger
at or before the text (one bisection) starts with every trigger the text starts with, and those are its
ancestors no longer than the text's common prefix with it.
"""

from __future__ import annotations

from bisect import bisect_right


class TriggerIndex:
    """Distinct triggers sorted; per trigger (by its place): its parent (-1: none), its root (the shortest
    trigger it starts with, itself if none) and its depth (how many triggers it starts with, itself
    included)."""

    def __init__(self, triggers: list[str]) -> None:
        self.sorted = sorted(set(triggers))
        self.parents: list[int] = []
        self.roots: list[int] = []
        self.depths: list[int] = []
        chain: list[int] = []  # the previous trigger's ancestors and itself, shortest first
        for i, trigger in enumerate(self.sorted):
            while chain and not trigger.startswith(self.sorted[chain[-1]]):
                chain.pop()  # (a chain's ancestors of this trigger are its shortest ones)
            parent = chain[-1] if chain else -1
            self.parents.append(parent)
            self.roots.append(i if parent < 0 else self.roots[parent])
            self.depths.append(1 if parent < 0 else self.depths[parent] + 1)
            chain.append(i)

    def shortest(self, text: str) -> str | None:
        """The shortest trigger `text` starts with; None for none."""
        i = self._longest(text)
        return None if i < 0 else self.sorted[self.roots[i]]

    def count(self, text: str) -> int:
        """How many of the triggers `text` starts with."""
        i = self._longest(text)
        return 0 if i < 0 else self.depths[i]

    def _longest(self, text: str) -> int:
        """The place of the longest trigger `text` starts with; -1 for none."""
        i = bisect_right(self.sorted, text) - 1
        if i < 0:
            return -1
        shared = _common_prefix(self.sorted[i], text)
        while i >= 0 and len(self.sorted[i]) > shared:
            i = self.parents[i]
        return i


def _common_prefix(a: str, b: str) -> int:
    """The length of the longest common prefix of `a` and `b`: a bisection of startswith calls, each on the
    part not yet known to match (linear in the shorter string)."""
    low, high = 0, min(len(a), len(b))  # the common prefix's length is in [low, high]
    while low < high:
        mid = (low + high + 1) // 2
        if a.startswith(b[low:mid], low):
            low = mid
        else:
            high = mid - 1
    return low
