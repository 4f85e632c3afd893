"""Schemathesis against the app's own OpenAPI schema, in-process (ASGI), with bounded examples: whatever it
generates for every operation, the server never answers 5xx and every error has the OpenAI error body.

schemathesis 4.32's pytest plugin (`schemathesis.pytest.from_fixture` + `parametrize`) fails on pytest 9
(`'Function' object has no attribute '_nodeid'`), so the test drives each operation's hypothesis strategy
itself."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from server.api.admission import RequestLimits
from server.api.app import create_app
from tests.engine_helpers import started_engine

pytestmark = pytest.mark.timeout(120)

CFG = dict(model="tiny", device="cpu", attention_backend="torch", num_blocks=64, max_num_seqs=8)
EXAMPLES = 20  # per operation, the same examples every run (derandomize): seconds for the whole schema


def test_every_operation_fuzzed_from_the_schema():
    with started_engine(**CFG) as engine:
        # small bounds keep the generated requests that are accepted cheap to run
        app = create_app(engine, limits=RequestLimits(max_prompts=4, max_choices=8, max_request_tokens=512))
        schema = schemathesis.openapi.from_asgi("/openapi.json", app)
        operations = [result.ok() for result in schema.get_all_operations()]
        assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/health"}
        statuses: dict[str, set[int]] = {}
        for op in operations:
            if op.path == "/metrics":
                continue  # Prometheus text, no JSON to check

            # the schema's own example bodies (served: the handlers are reached), then generated ones
            for strategy in [*op.get_strategies_from_examples(), op.as_strategy()]:
                @given(case=strategy)
                @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                          suppress_health_check=list(HealthCheck))
                def check(case) -> None:
                    response = case.call()
                    statuses.setdefault(case.path, set()).add(response.status_code)
                    assert response.status_code < 500, (case.path, case.body, response.text[:500])
                    if response.status_code >= 400:
                        assert set(response.json()["error"]) == {"message", "type", "param", "code"}, \
                            (case.path, case.body, response.text[:500])

                check()
        for path in ("/v1/completions", "/v1/chat/completions"):  # served and refused with a 4xx
            assert {200, 400} <= statuses[path], statuses
