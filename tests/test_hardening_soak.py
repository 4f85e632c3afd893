"""`make soak` in small (issue 17): ~10 s of the mixed workload with hang-ups against a real CPU server (6 s
with two API servers over the one core); no error of any kind, the server idle at the end (no KV block held)
and a clean exit without a traceback."""

from __future__ import annotations

import pytest

from tools.soak import soak

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("api_servers,duration", [(1, 10), (2, 6)])
def test_soak(api_servers, duration):
    r = soak(duration=duration, concurrency=6, seed=1, url=None, out=None, api_servers=api_servers)
    assert r["served"] > 20 and r["hangups"] > 0, r
    assert r["errors"] == {} and r["idle_at_end"] and r["exit_code"] == 0 and r["tracebacks"] == 0, r
