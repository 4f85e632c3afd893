"""Structured outputs whose forced text holds an added token's text, end to end over a checkpoint whose
tokenizer has <tool_call> (special) and </tool_call> (added, not special): a JSON schema's const or enum, a
choice's common start, a regex, a Lark grammar, a response format's schema, a forced tool call's argument, a
structural tag's literal, and EOS's text (</s>) in a literal. llguidance's mask forced each such text as its
added token, which the grammar then refused: the API's check answered 400, or the choice failed mid-reply.
The replies spell the text now."""

from __future__ import annotations

import json
import re

import pytest
from model_fixtures import hf_config, write_hf_checkpoint

from server.api.app import create_app
from tests.asgi_client import post
from tests.engine_helpers import started_engine
from tests.test_api_structural_special import CALL, END, added_tokenizer
from tests.test_api_structured_output_engine import text_of

pytestmark = pytest.mark.timeout(300)

TAGGED = {"type": "object", "properties": {"tag": {"enum": [f"{CALL}x", f"{CALL}y"]}}, "required": ["tag"],
          "additionalProperties": False}
QUOTED_END = {"type": "object", "properties": {"end": {"const": END}}, "required": ["end"],
              "additionalProperties": False}
CASES = {  # fields -> the pattern the whole reply matches
    "json_const": ({"structured_outputs": {"json": {"const": CALL}}}, re.escape(json.dumps(CALL))),
    "json_enum": ({"guided_json": TAGGED}, re.escape(f'{{"tag":"{CALL}') + "[xy]" + re.escape('"}')),
    "choice": ({"guided_choice": [f"{CALL}a", f"{CALL}b"]}, re.escape(CALL) + "[ab]"),
    "regex": ({"structured_outputs": {"regex": f"{CALL}[0-9]{END}"}},
              re.escape(CALL) + "[0-9]" + re.escape(END)),
    "lark": ({"guided_grammar": f'start: "{CALL}" /[a-c]/ "{END}"'},
             re.escape(CALL) + "[a-c]" + re.escape(END)),
    "response_format": ({"response_format": {"type": "json_schema",
                                             "json_schema": {"name": "end", "schema": QUOTED_END}}},
                        re.escape(json.dumps({"end": END}, separators=(",", ":")))),
    "eos_text": ({"guided_grammar": 'start: "a</s>b"'}, re.escape("a</s>b")),
    "eos_in_a_tag": ({"structured_outputs": {"structural_tag": {"format": {
        "type": "const_string", "value": "end</s>"}}}}, re.escape("end</s>")),
}


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    """A random checkpoint over the tokenizer with <tool_call> and </tool_call> added."""
    path = tmp_path_factory.mktemp("ckpt")
    write_hf_checkpoint(path, hf_config("llama", tie_word_embeddings=False))
    added_tokenizer().save(str(path / "tokenizer.json"))
    with started_engine(model=str(path), device="cpu", attention_backend="torch", num_blocks=64) as engine:
        yield create_app(engine)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("case", list(CASES))
def test_a_forced_added_tokens_text_is_spelled(app, case, stream):
    fields, pattern = CASES[case]
    text, finish = text_of(app, "/v1/completions", {"prompt": "hello", **fields}, stream)
    assert re.fullmatch(pattern, text) and finish == "stop", text


def test_a_forced_tool_calls_argument_holds_the_text(app):
    tools = [{"type": "function", "function": {"name": "close", "parameters": QUOTED_END}}]
    r = post(app, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": tools,
                                           "tool_choice": {"type": "function", "function": {"name": "close"}},
                                           "temperature": 0, "max_tokens": 48})
    assert r.status_code == 200, r.text
    (call,) = r.json()["choices"][0]["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"end": END}
