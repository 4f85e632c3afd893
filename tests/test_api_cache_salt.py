"""vLLM's cache_salt through the HTTP API on the tiny preset: completions and chat take it, a prompt finds
its cached prefix (the prefix-cache hits of /metrics) only under the same salt, and a bad salt is a 400 naming
the field."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from server.api.app import create_app
from tests.asgi_client import get, post
from tests.engine_helpers import started_engine, wait_until

pytestmark = pytest.mark.timeout(180)

PROMPT = "The salted prompt runs past several blocks of sixteen byte tokens, so that a repeat finds them."
MESSAGES = [{"role": "user", "content": PROMPT}]


@pytest.fixture(scope="module")
def app():
    with started_engine(model="tiny", device="cpu", attention_backend="torch", num_blocks=256) as engine:
        yield create_app(engine)


def hits(app) -> float:
    """pagewalk_prefix_cache_hits_total of /metrics: prompt tokens served from the prefix cache."""
    text = get(app, "/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    return sum(s.value for s in families["pagewalk_prefix_cache_hits"].samples if s.name.endswith("_total"))


def served(app, path: str, salt: str | None, **fields) -> float:
    """Run one request with `salt` (None: the field left out) -> the prefix-cache hits it added."""
    before = hits(app)
    body = {"max_tokens": 2, "temperature": 0, **fields}
    if salt is not None:
        body["cache_salt"] = salt
    r = post(app, path, body)
    assert r.status_code == 200, r.text
    # the core's counts reach /metrics with its step updates, the admission's before the last token's
    wait_until(lambda: hits(app) > before, timeout=0.5)
    return hits(app) - before


@pytest.mark.parametrize("path,fields", [("/v1/completions", {"prompt": PROMPT}),
                                         ("/v1/chat/completions", {"messages": MESSAGES})],
                         ids=["completions", "chat"])
def test_a_prompt_finds_its_cached_prefix_under_its_own_salt_only(app, path, fields):
    tenant = f"tenant-{path.count('chat')}"
    served(app, path, tenant, **fields)                    # computes and caches the prompt's blocks
    assert served(app, path, f"{tenant}-other", **fields) == 0
    assert served(app, path, tenant, **fields) > 0
    assert served(app, path, tenant, stream=True, **fields) > 0
    served(app, path, None, **fields)                      # unsalted requests share with each other only
    assert served(app, path, None, **fields) > 0


def test_the_longest_salt_and_any_other_character_are_accepted(app):
    for salt in ("x" * 4096, "é-🙂 tenant:1|a.b", "alice@example.com", "org/team-7", "a\\b", "a\x00b", None):
        r = post(app, "/v1/completions", {"prompt": "Hi", "max_tokens": 1, "cache_salt": salt})
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("salt,message", [
    ("", "1 to 4096"), ("x" * 4097, "1 to 4096"), (7, ""), (["a"], ""), ({"salt": "a"}, ""), (True, ""),
])
@pytest.mark.parametrize("path,fields", [("/v1/completions", {"prompt": "Hi"}),
                                         ("/v1/chat/completions", {"messages": MESSAGES})],
                         ids=["completions", "chat"])
def test_a_bad_salt_is_a_400_naming_it(app, path, fields, salt, message):
    r = post(app, path, {**fields, "max_tokens": 1, "cache_salt": salt})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "cache_salt" and message in err["message"], err
