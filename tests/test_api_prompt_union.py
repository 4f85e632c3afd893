"""The completion prompt's union, validated left to right for speed, keeps pydantic's smart-union answers:
which member a prompt becomes, and which prompts it refuses."""

from __future__ import annotations

import pydantic
import pytest

from server.api.protocol import CompletionRequest


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
