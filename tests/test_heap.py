"""server.heap.freeze_startup_heap: once per process, the heap out of the collector's reach, full collections
rarer. Run in a fresh interpreter: freezing is process-wide."""

from __future__ import annotations

import json
import subprocess
import sys

from server_helpers import REPO

SCRIPT = """
import gc, json
from server.heap import FULL_COLLECTION_EVERY, freeze_startup_heap
keep = [[i] for i in range(50_000)]  # tracked objects that outlive start-up
first = freeze_startup_heap()
after_first = gc.get_freeze_count()
second = freeze_startup_heap()
print(json.dumps({"first": first, "after_first": after_first, "second": second,
                  "after_second": gc.get_freeze_count(), "threshold": gc.get_threshold(),
                  "every": FULL_COLLECTION_EVERY}))
"""


def test_freeze_startup_heap_freezes_once_and_spaces_full_collections():
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, check=True)
    r = json.loads(out.stdout)
    assert r["first"] == r["after_first"] >= 50_000
    assert r["second"] == 0 and r["after_second"] == r["after_first"]  # the second call leaves it as it was
    assert r["threshold"][2] == r["every"] == 100
