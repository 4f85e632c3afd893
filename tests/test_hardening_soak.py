"""`make soak` in small (issue 17): ~10 s of the mixed workload with hang-ups against a real CPU server; no
error of any kind, the server idle at the end (no KV block held) and a clean exit without a traceback."""

from __future__ import annotations

import pytest

from tools.soak import soak

pytestmark = pytest.mark.timeout(180)


def test_soak_ten_seconds():
    r = soak(duration=10, concurrency=6, seed=1, url=None, out=None)
    assert r["served"] > 20 and r["hangups"] > 0, r
    assert r["errors"] == {} and r["idle_at_end"] and r["exit_code"] == 0 and r["tracebacks"] == 0, r
