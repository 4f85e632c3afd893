"""TriggerIndex finds the triggers a text starts with as trying each trigger does: over random triggers and
texts of a small alphabet (so that triggers start one another and texts share long prefixes with them)."""

from __future__ import annotations

import random

from server.api.trigger_index import TriggerIndex


def word(rng: random.Random, longest: int) -> str:
    return "".join(rng.choice("ab") for _ in range(rng.randint(1, longest)))


def test_the_index_finds_what_trying_every_trigger_finds():
    rng = random.Random(0)
    for _ in range(3000):
        triggers = [word(rng, 6) for _ in range(rng.randint(1, 10))]
        index = TriggerIndex(triggers)
        for text in [word(rng, 9) for _ in range(8)] + ["", *triggers]:
            found = [t for t in set(triggers) if text.startswith(t)]
            assert index.count(text) == len(found), (triggers, text)
            assert index.shortest(text) == min(found, key=len, default=None), (triggers, text)
