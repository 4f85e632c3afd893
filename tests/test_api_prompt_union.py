"""The completion prompt's union, validated left to right for speed, keeps pydantic's smart-union answers:
which member a prompt becomes, and which prompts it refuses."""

from __future__ import annotations

import pydantic
import pytest

from server.api.protocol import CompletionRequest
from tests.asgi_client import post


def prompt_of(prompt):
    return CompletionRequest.model_validate({"model": "m", "prompt": prompt}).prompt


class SmartUnion(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(strict=True)  # as the request models
    prompt: str | list[str] | list[int] | list[list[int]]  # the union as declared before


@pytest.mark.parametrize("prompt", ["hi", ["1", "2"], ["a", "b"], [1, 2], [[1, 2], [3]], list(range(512))])
def test_each_prompt_becomes_what_the_smart_union_made_it(prompt):
    got, want = prompt_of(prompt), SmartUnion(prompt=prompt).prompt
    assert got == want and type(got) is type(want)
    assert [type(x) for x in got] == [type(x) for x in want] if isinstance(got, list) else True


@pytest.mark.parametrize("prompt", [["a", 1], [1, "a"], [[1], "a"], {"x": 1}, 3, [None], [[1, "a"]],
                                    [1.0, 2.0], [True, 2], [[1.0]]])
def test_what_the_smart_union_refuses_is_refused(prompt):
    with pytest.raises(pydantic.ValidationError):
        SmartUnion(prompt=prompt)
    with pytest.raises(pydantic.ValidationError):
        prompt_of(prompt)


@pytest.mark.parametrize("body,forms", [
    ({"prompt": [[1, 2], "ab"]},
     "a string, a list of integers, a list of strings or a list of lists of integers"),
    ({"prompt": [[[1]]]}, "a list of lists of integers"),
    ({"prompt": None}, "a list of strings"),
    ({"prompt": "a", "stop": [1]}, "it must be a string or a list of strings"),
])
def test_a_value_no_member_takes_names_the_forms(app, body, forms):
    """Each member's complaint is reported; the first ("Input should be a valid string") told a client that
    sent a list that only a string is taken (a review): the message names every form."""
    r = post(app, "/v1/completions", {"max_tokens": 1, **body})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == next(k for k in ("stop", "prompt") if k in body)
    assert forms in err["message"], err["message"]


@pytest.mark.parametrize("prompt", [["a"], [[5]]])
def test_prompts_past_the_limit_are_refused_before_any_is_read(app, engine, monkeypatch, prompt):
    """A request of 10x max_prompts prompts tokenized (or range-checked and decoded for its echo) every one
    before its 400 (a review: a 1 MiB body of 200,000 prompts held 2.4 s of API CPU)."""
    read = []
    encode, decode = engine.tokenizer.encode, engine.tokenizer.decode
    monkeypatch.setattr(engine.tokenizer, "encode", lambda *a, **k: read.append(1) or encode(*a, **k))
    monkeypatch.setattr(engine.tokenizer, "decode", lambda *a, **k: read.append(1) or decode(*a, **k))
    r = post(app, "/v1/completions", {"prompt": prompt * (10 * app.state.limits.max_prompts), "echo": True,
                                      "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert read == []
