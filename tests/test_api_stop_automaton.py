"""server/api/stop_strings.py's automaton at the API's bounds: what it holds, and the cache of them (a review:
a dict a trie state held ~5 MB alive a list of 64 stop strings of 256 characters, and an LRU of 256 lists
kept ~1.4 GB). Its matching is checked against a naive reference in test_api_fuzz.py."""

from __future__ import annotations

import gc
import random
import tracemalloc

from server.api.admission import RequestLimits
from server.api.stop_strings import (
    CACHED_STATES,
    ENTRY_STATES,
    AutomatonCache,
    StopAutomaton,
    StopStrings,
    compiled,
)

# the API's default bounds of a request's stop strings
MAX_STOP_STRINGS, MAX_STOP_CHARS = RequestLimits().max_stop_strings, RequestLimits().max_stop_string_length


def bounds_list(rng: random.Random) -> tuple[str, ...]:
    return tuple("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(MAX_STOP_CHARS))
                 for _ in range(MAX_STOP_STRINGS))


def test_a_list_at_the_bounds_holds_under_a_megabyte():
    stops = bounds_list(random.Random(0))
    gc.collect()
    tracemalloc.start()
    try:
        automaton = StopAutomaton(stops)
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(automaton.only) > 15_000  # ~16K states: nearly every character its own
    assert held < 1_000_000, f"{held / 1e6:.1f} MB"


def test_the_cache_keeps_a_bounded_number_of_states_and_shares_a_repeated_list():
    rng = random.Random(1)
    cache = AutomatonCache(max_states=4 * MAX_STOP_STRINGS * MAX_STOP_CHARS)  # four lists at the bounds
    small = ("\n\n", "User:")
    first = cache.get(small)
    for _ in range(12):
        cache.get(bounds_list(rng))
        assert cache.get(small) is first  # asked again each time: the most recent, never dropped
    assert sum(len(a.only) + ENTRY_STATES for a in cache.kept.values()) == cache.states <= cache.max_states
    assert 2 <= len(cache.kept) <= 5
    assert compiled(small) is compiled(small)  # the API's cache


def test_many_small_lists_are_charged_for_their_entries_and_one_set_is_one_key():
    """65K one-character lists filled the state bound with 82 MB when an entry cost only its 2 states (a
    review): each is charged ENTRY_STATES more. Stop lists that are one set in another order or with repeats
    share one automaton (the match does not depend on either)."""
    cache = AutomatonCache()
    for i in range(20_000):
        cache.get((chr(0x4E00 + i),))
    assert len(cache.kept) <= CACHED_STATES // ENTRY_STATES
    a = StopStrings(["b", "a", "b"]).automaton
    assert StopStrings(["a", "b"]).automaton is a


def test_a_stop_string_that_shares_a_branching_prefix_is_found_across_deltas():
    # "abd" fails over to "bd" after "ab" took the branch from "b" to "c": the link runs through a branching
    # state whose children live in its dict
    s = StopStrings(["abc", "bd", "bx"])
    assert s.feed("xa") == ("x", None)
    assert s.feed("b") == ("", None)  # "ab": a prefix of "abc", held
    assert s.feed("d") == ("a", "bd")


def test_a_list_is_kept_per_cache_salt():
    """A list one tenant sent is built again for another salt: a kept one answered ~25 ms sooner, telling the
    second tenant that someone had sent it (a review); the unsalted requests share theirs."""
    a = StopStrings(["User:"], salt="alice").automaton
    assert StopStrings(["User:"], salt="alice").automaton is a
    assert StopStrings(["User:"], salt="bob").automaton is not a
    unsalted = StopStrings(["User:"]).automaton
    assert unsalted is not a and unsalted is compiled(("User:",))
