"""vLLM's legacy request fields and two edge refusals: top-level guided fields are served or refused, never
dropped; a scoring request's min_tokens is checked against the max_tokens sent; a content part without its
text names the missing field."""

from __future__ import annotations

import json

import pytest
from asgi_client import post

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MESSAGES = [{"role": "user", "content": "hi"}]


def error_of(r, status=400) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


@pytest.mark.parametrize("path,body", [(COMPLETIONS, {"prompt": "hi", "max_tokens": 8}),
                                       (CHAT, {"messages": MESSAGES, "max_tokens": 8})])
def test_guided_whitespace_pattern_is_refused_as_structured_outputs_own(app, path, body):
    body = {**body, "guided_json": {"type": "object"}, "guided_whitespace_pattern": "[ ]{3}"}
    assert error_of(post(app, path, body))["param"] == "guided_whitespace_pattern"


@pytest.mark.parametrize("path,body", [(COMPLETIONS, {"prompt": "hi"}), (CHAT, {"messages": MESSAGES})])
def test_a_top_level_structural_tag_is_served_as_structured_outputs_one(app, path, body):
    """vLLM's legacy structural_tag (the JSON text of a tag) constrains the reply as
    structured_outputs.structural_tag does; beside another structured output it is a 400 naming it."""
    tag = json.dumps({"type": "structural_tag", "format": {"type": "const_string", "value": "hello"}})
    r = post(app, path, {**body, "max_tokens": 5, "temperature": 0, "structural_tag": tag})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert (choice["text"] if path == COMPLETIONS else choice["message"]["content"]) == "hello"
    both = post(app, path, {**body, "max_tokens": 5, "structural_tag": tag, "guided_regex": "a+"})
    assert error_of(both)["param"] in ("structural_tag", "guided_regex")


def test_min_tokens_of_a_scoring_request_is_checked_against_max_tokens_zero(app):
    """echo with max_tokens 0 samples one token that is dropped; min_tokens is checked against the 0 sent."""
    for min_tokens in (1, 5):
        err = error_of(post(app, COMPLETIONS, {"prompt": "hi", "echo": True, "max_tokens": 0,
                                               "min_tokens": min_tokens}))
        assert err["param"] == "min_tokens" and "max_tokens=0" in err["message"], err
    ok = post(app, COMPLETIONS, {"prompt": "hi", "echo": True, "max_tokens": 0, "min_tokens": 0})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 0


def test_a_text_part_without_its_text_names_the_missing_field(app):
    body = {"messages": [{"role": "user", "content": [{"type": "text"}]}], "max_tokens": 2}
    err = error_of(post(app, CHAT, body))
    assert "needs its 'text' field" in err["message"] and "not supported" not in err["message"], err
