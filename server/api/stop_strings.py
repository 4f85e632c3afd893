"""Stop strings over a stream of text deltas, in O(new text) per delta whatever the number of stop strings.

A stop string is never emitted: the text is cut before the first one to end, character by character, as a
generation stops at the first stop string it writes (of several ending at one character, the one that
starts earliest: the longest). So the cut does not depend on how the text is split into tokens or deltas. A
tail of the text that could still grow into a stop string is held back until later text decides it. With
`include` (vLLM's include_stop_str_in_output) the cut falls after the stop string instead, and nothing is
held back: text before the cut is emitted whether or not a stop string completes.

One Aho-Corasick automaton over all the stop strings of a request (built once per distinct list, shared by
its choices) walks each new character once. Its state after a character is the longest suffix of the text
that is a prefix of some stop string, so the state's depth is exactly the tail to hold back, and a stop
string ends at a character when the state (or one of its suffix states) is a whole stop string.
"""

from __future__ import annotations

from collections import deque
from functools import lru_cache


class StopAutomaton:
    """goto[state]: char -> state; fail[state]: the state of its longest proper suffix in the trie;
    match[state]: the longest stop string that is a suffix of the state's text ("" if none)."""

    __slots__ = ("goto", "fail", "depth", "match")

    def __init__(self, stops: tuple[str, ...]):
        assert stops and all(stops), "stop strings are non-empty"
        self.goto: list[dict[str, int]] = [{}]
        self.depth = [0]
        ends: dict[int, str] = {}
        for stop in stops:
            state = 0
            for ch in stop:
                nxt = self.goto[state].get(ch)
                if nxt is None:
                    nxt = len(self.goto)
                    self.goto[state][ch] = nxt
                    self.goto.append({})
                    self.depth.append(self.depth[state] + 1)
                state = nxt
            ends[state] = stop
        self.fail = [0] * len(self.goto)
        self.match = [""] * len(self.goto)
        queue = deque(self.goto[0].values())
        while queue:  # breadth first: a state's suffix states are shallower, so already final
            state = queue.popleft()
            self.match[state] = ends.get(state) or self.match[self.fail[state]]
            for ch, nxt in self.goto[state].items():
                self.fail[nxt] = self.step(self.fail[state], ch) if state else 0
                queue.append(nxt)

    def step(self, state: int, ch: str) -> int:
        goto, fail = self.goto, self.fail
        while True:
            nxt = goto[state].get(ch)
            if nxt is not None:
                return nxt
            if state == 0:
                return 0
            state = fail[state]


@lru_cache(maxsize=256)
def compiled(stops: tuple[str, ...]) -> StopAutomaton:
    """The automaton of a stop list; the n choices (and repeated requests) of one list share it."""
    return StopAutomaton(stops)


class StopStrings:
    """One choice's matcher: the automaton's state and the text held back (the state's depth)."""

    __slots__ = ("automaton", "state", "held", "include")

    def __init__(self, stops: list[str], include: bool = False):
        self.automaton = compiled(tuple(stops))
        self.state = 0
        self.held = ""  # text not yet emitted: a proper prefix of some stop string
        self.include = include  # the stop string is part of the output

    def feed(self, text: str, armed: bool = True) -> tuple[str, str | None]:
        """New text -> (text safe to emit now, the stop string that ends the choice or None). Unarmed (the
        choice is short of its min_tokens) a stop string ending in `text` does not count."""
        a = self.automaton
        s = self.held + text
        base = len(self.held)  # the held text is already walked: the state covers it
        state, depth, match = self.state, a.depth, a.match
        for i in range(base, len(s)):
            state = a.step(state, s[i])
            stop = match[state]  # the longest stop string ending here: the earliest start
            if stop and armed:
                self.state, self.held = 0, ""
                return s[:i + 1 if self.include else i + 1 - len(stop)], stop
        self.state = state
        keep = 0 if self.include else depth[state]
        self.held = s[len(s) - keep:] if keep else ""
        return s[:len(s) - keep], None

    def release(self) -> str:
        """The choice ends without a stop string: the held tail is ordinary text."""
        held, self.held, self.state = self.held, "", 0
        return held
