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

import threading
from array import array
from collections import OrderedDict, deque

BRANCHES = -2  # only[state] of a state with several children (those in branch[state])


class StopAutomaton:
    """The trie of the stop strings with Aho-Corasick's failure links, in flat arrays. A state has one child
    (`only[state]` its code point, `child[state]` the child), none (only -1) or several (only BRANCHES,
    `branch[state]`: code point -> child; the root's children are always in `root`); fail[state]: the state
    of its longest proper suffix in the trie; depth[state]: its text's length; match[state]: the longest stop
    string that is a suffix of the state's text ("" if none). A list at the API's bounds (64 strings of 256
    characters) is ~16K states, nearly all of one child: with a dict a state it held ~5 MB alive (a review),
    in these arrays ~0.4 MB."""

    __slots__ = ("root", "only", "child", "branch", "fail", "depth", "match")

    def __init__(self, stops: tuple[str, ...]):
        assert stops and all(stops), "stop strings are non-empty"
        self.root: dict[int, int] = {}
        self.only, self.child, self.depth = array("i", [BRANCHES]), array("i", [0]), array("i", [0])
        self.branch: dict[int, dict[int, int]] = {0: self.root}
        ends: dict[int, str] = {}
        for stop in stops:
            state = 0
            for ch in stop:
                state = self._child_or_new(state, ord(ch))
            ends[state] = stop
        self.fail = array("i", bytes(4 * len(self.only)))
        self.match = [""] * len(self.only)
        queue = deque(self.root.values())
        while queue:  # breadth first: a state's suffix states are shallower, so already final
            state = queue.popleft()
            self.match[state] = ends.get(state) or self.match[self.fail[state]]
            for code, nxt in self._children(state).items():
                self.fail[nxt] = self.step(self.fail[state], code) if state else 0
                queue.append(nxt)

    def _children(self, state: int) -> dict[int, int]:
        only = self.only[state]
        if only == BRANCHES:
            return self.branch[state]
        return {only: self.child[state]} if only >= 0 else {}

    def _child_or_new(self, state: int, code: int) -> int:
        """The child of `state` on `code`, made if it has none."""
        only = self.only[state]
        if only == code:
            return self.child[state]
        if only == BRANCHES and code in self.branch[state]:
            return self.branch[state][code]
        nxt = len(self.only)
        self.only.append(-1)
        self.child.append(0)
        self.depth.append(self.depth[state] + 1)
        if only == -1:
            self.only[state], self.child[state] = code, nxt
        else:
            if only >= 0:  # a second child: the state branches
                self.branch[state] = {only: self.child[state]}
                self.only[state], self.child[state] = BRANCHES, 0
            self.branch[state][code] = nxt
        return nxt

    def step(self, state: int, code: int) -> int:
        """The state after `state` reads the character of code point `code`."""
        only, child, branch, fail = self.only, self.child, self.branch, self.fail
        while state:
            o = only[state]
            if o == code:
                return child[state]
            if o == BRANCHES:
                nxt = branch[state].get(code)
                if nxt is not None:
                    return nxt
            state = fail[state]
        return self.root.get(code, 0)


CACHED_STATES = 1 << 17  # trie states the automata kept hold in all (~24 bytes each: ~3 MB)
# what an automaton costs beyond its states, in states: its arrays, dicts and key (~1.2 KB; charged as
# nothing, 65K one-character lists filled the bound with 82 MB: a review)
ENTRY_STATES = 64


def cost(automaton: StopAutomaton) -> int:
    return len(automaton.only) + ENTRY_STATES


class AutomatonCache:
    """The automata of recent stop lists, for the requests that repeat one, the least recently asked dropped
    first: bounded in trie states (each list charged ENTRY_STATES more), not in lists, since a list's states
    go up to the API's bounds (16K). Kept per request cache salt, as the prefix blocks and the grammars are:
    a list kept for one tenant answered another's request ~25 ms sooner, telling it that someone had sent
    that list (a review)."""

    def __init__(self, max_states: int = CACHED_STATES):
        self.max_states = max_states
        self.kept: OrderedDict[tuple[str | None, tuple[str, ...]], StopAutomaton] = OrderedDict()
        self.states = 0  # of the automata kept
        self._lock = threading.Lock()  # (the API's handlers may build matchers on several threads)

    def get(self, stops: tuple[str, ...], salt: str | None = None) -> StopAutomaton:
        key = (salt, stops)
        with self._lock:
            automaton = self.kept.get(key)
            if automaton is not None:
                self.kept.move_to_end(key)
                return automaton
        automaton = StopAutomaton(stops)  # (built outside the lock: up to ~30 ms at the bounds)
        with self._lock:
            if key not in self.kept:  # (another thread may have built it meanwhile)
                self.kept[key] = automaton
                self.states += cost(automaton)
            while self.states > self.max_states and len(self.kept) > 1:
                self.states -= cost(self.kept.popitem(last=False)[1])
        return automaton


_CACHE = AutomatonCache()


def compiled(stops: tuple[str, ...], salt: str | None = None) -> StopAutomaton:
    """The automaton of a stop list; the n choices (and repeated requests of one cache salt) share it."""
    return _CACHE.get(stops, salt)


class StopStrings:
    """One choice's matcher: the automaton's state and the text held back (the state's depth)."""

    __slots__ = ("automaton", "state", "held", "include")

    def __init__(self, stops: list[str], include: bool = False, salt: str | None = None):
        # one key per set of stops: the match does not depend on their order or repeats
        self.automaton = compiled(tuple(sorted(set(stops))), salt)
        self.state = 0
        self.held = ""  # text not yet emitted: a proper prefix of some stop string
        self.include = include  # the stop string is part of the output

    def feed(self, text: str, armed: bool = True) -> tuple[str, str | None]:
        """New text -> (text safe to emit now, the stop string that ends the choice or None). Unarmed (the
        choice is short of its min_tokens) a stop string ending in `text` does not count."""
        a = self.automaton
        s = self.held + text
        base = len(self.held)  # the held text is already walked: the state covers it
        state, depth, match, root, step = self.state, a.depth, a.match, a.root, a.step
        for i in range(base, len(s)):
            code = ord(s[i])
            state = step(state, code) if state else root.get(code, 0)  # (the text mostly leaves no state)
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
