"""docs/grafana/pagewalk.json queries only series /metrics exports (vLLM's names and model_name label), and
every exported metric is on it."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server.api.app import create_app
from tests.engine_helpers import started_engine

pytestmark = pytest.mark.timeout(120)

DASHBOARD = Path(__file__).resolve().parents[1] / "docs" / "grafana" / "pagewalk.json"


def scrape() -> str:
    with started_engine(model="tiny", device="cpu", attention_backend="torch", num_blocks=64) as engine:
        app = create_app(engine)

        async def go():
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
                body = {"prompt": "hello there, a prompt of two blocks or more", "max_tokens": 3}
                for _ in range(2):  # the second one hits the prefix cache
                    assert (await c.post("/v1/completions", json=body, timeout=60)).status_code == 200
                return (await c.get("/metrics")).text

        return asyncio.run(go())


def test_dashboard_and_metrics_agree():
    families = list(text_string_to_metric_families(scrape()))
    samples = {s.name: s for f in families for s in f.samples}
    assert all(s.labels.get("model_name") == "tiny" for s in samples.values())
    assert samples["pagewalk_prefix_cache_hits_total"].value > 0
    assert samples["pagewalk_request_queue_time_seconds_count"].value == 2
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    queried = {name for e in exprs for name in re.findall(r"pagewalk_[a-z0-9_]+", e)}
    assert queried <= samples.keys(), queried - samples.keys()
    assert all('model_name="$model_name"' in e for e in exprs)
    # the text format's _created series parse as families of their own; pagewalk_info is static
    exported = {f.name for f in families if not f.name.endswith("_created")} - {"pagewalk", "pagewalk_info"}
    on_dashboard = {re.sub(r"_(bucket|total)$", "", n) for n in queried}
    assert exported <= on_dashboard, exported - on_dashboard
