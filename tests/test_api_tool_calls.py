"""Chat tool calls over HTTP: tools reach the chat template, a reply's calls come back as OpenAI's
tool_calls (finish "tool_calls"), unary and streamed alike, only where the server parses them
(--enable-auto-tool-choice --tool-call-parser) and the request lets the model call (tool_choice "auto").
The replies are scripted: the tiny engine's generate is replaced by one that streams a given text."""

from __future__ import annotations

import json

import pytest

from server.api.app import create_app
from server.api.outputs import ChoiceDelta, RequestOutput
from server.api.prompts import chat_prompt_ids
from server.api.protocol import ChatMessage
from server.cli import main
from server.model.chat_template import ChatTemplate
from server.model.tokenizer import HFTokenizer
from tests.asgi_client import post

pytestmark = pytest.mark.timeout(120)

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def nested(depth: int) -> dict:
    """An object schema whose one property is such an object, `depth` levels down to a string."""
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


NESTED_300 = nested(300)


def scripted(engine, reply: str, pieces: int = 5, seen: list | None = None, finish: str = "stop"):
    """engine.generate streams `reply` in about `pieces` deltas per choice, each choice ending with `finish`;
    `seen` records the SamplingParams it gets."""
    def generate(request_id, prompt, params, admitted=False, **_):
        if seen is not None:
            seen.append(params)

        async def outputs():
            step = max(1, len(reply) // pieces)
            parts = [reply[i:i + step] for i in range(0, len(reply), step)]
            for k, part in enumerate(parts):
                last = k == len(parts) - 1
                yield RequestOutput(request_id, prompt, [
                    ChoiceDelta(i, part, [3 + k], None, finish if last else None) for i in range(params.n)],
                    finished=last)
        return outputs()
    return generate


def chat(app, stream: bool = False, **fields):
    return post(app, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Weather in Paris?"}],
                                              "max_tokens": 30, "stream": stream, **fields})


def streamed(r) -> tuple[str, list[dict], list[str]]:
    """(content, tool call deltas, finish reasons) of a streamed chat answer."""
    assert r.status_code == 200, r.text
    content, calls, finishes = "", [], []
    for line in r.text.splitlines():
        if line.startswith("data: {"):
            for c in json.loads(line[6:])["choices"]:
                content += c["delta"].get("content") or ""
                calls += c["delta"].get("tool_calls") or []
                finishes += [c["finish_reason"]] if c["finish_reason"] else []
    return content, calls, finishes


@pytest.mark.parametrize("reply,content", [(CALL, None), ("Let me look.\n" + CALL, "Let me look.\n")])
def test_a_reply_of_calls_comes_back_as_tool_calls(engine, monkeypatch, reply, content):
    monkeypatch.setattr(engine, "generate", scripted(engine, reply))
    app = create_app(engine, tool_call_parser="hermes")
    body = chat(app, tools=TOOLS, n=2).json()
    for choice in body["choices"]:
        message = choice["message"]
        assert choice["finish_reason"] == "tool_calls" and message["content"] == content
        (call,) = message["tool_calls"]
        assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
        assert call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    text, calls, finishes = streamed(chat(app, stream=True, tools=TOOLS, tool_choice="auto"))
    assert text == (content or "") and finishes == ["tool_calls"]
    (call,) = calls
    assert call["index"] == 0 and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}


def test_plain_replies_and_choices_without_calls_are_text(engine, monkeypatch):
    app = create_app(engine, tool_call_parser="hermes")
    monkeypatch.setattr(engine, "generate", scripted(engine, "It is sunny in <b>Paris</b>."))
    message = chat(app, tools=TOOLS).json()["choices"][0]["message"]
    assert message["content"] == "It is sunny in <b>Paris</b>." and "tool_calls" not in message
    assert streamed(chat(app, stream=True, tools=TOOLS))[:2] == ("It is sunny in <b>Paris</b>.", [])
    monkeypatch.setattr(engine, "generate", scripted(engine, CALL))
    # tool_choice "none", or no tools: the reply is text, as written
    for fields in ({"tools": TOOLS, "tool_choice": "none"}, {}):
        choice = chat(app, **fields).json()["choices"][0]
        assert choice["message"]["content"] == CALL and choice["finish_reason"] == "stop"
        assert streamed(chat(app, stream=True, **fields)) == (CALL, [], ["stop"])


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_that_does_not_parse_is_content_as_written_whitespace_included(engine, monkeypatch, stream):
    reply = '  <tool_call>\n{"name": oops}</tool_call>'
    monkeypatch.setattr(engine, "generate", scripted(engine, reply, pieces=len(reply)))
    r = chat(create_app(engine, tool_call_parser="hermes"), stream=stream, tools=TOOLS)
    content = streamed(r)[0] if stream else r.json()["choices"][0]["message"]["content"]
    assert content == reply


def test_auto_tool_choice_needs_the_server_to_parse_calls(engine):
    r = chat(create_app(engine), tools=TOOLS)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    assert "--enable-auto-tool-choice" in r.json()["error"]["message"]
    assert chat(create_app(engine), tools=TOOLS, tool_choice="none").status_code == 200


@pytest.mark.parametrize("fields,param", [
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a+"}, "tool_choice"),  # two grammars
    # a tool_choice but "none" needs tools (OpenAI's and vLLM's 400s)
    ({"tool_choice": "auto"}, "tool_choice"), ({"tool_choice": "required"}, "tool_choice"),
    # "required" merges the tools' schemas into one: 300 levels of properties were a RecursionError there
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": NESTED_300}}],
      "tool_choice": "required"}, "tools"),
])
def test_bad_tools_and_forced_choices_are_400s(engine, fields, param):
    r = chat(create_app(engine, tool_call_parser="hermes"), **fields)
    assert r.status_code == 400 and r.json()["error"]["param"].startswith(param), r.text


def test_the_template_shows_the_tools_to_the_model():
    from model_fixtures import byte_bpe_tokenizer

    template = ChatTemplate("{% if tools %}TOOLS:{{ tools | tojson }}\n{% endif %}"
                            "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}", "test")
    tok = HFTokenizer(byte_bpe_tokenizer(), chat_template=template)
    messages = [ChatMessage(role="user", content="hi")]
    shown = tok.decode(chat_prompt_ids(tok, messages, True, None, {"tools": TOOLS}))
    assert shown.startswith('TOOLS:[{"type": "function"') and '"name": "get_weather"' in shown
    assert tok.decode(chat_prompt_ids(tok, messages, True, None, {})) == "user: hi\n"


def test_enable_auto_tool_choice_needs_a_parser(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "tiny", "--enable-auto-tool-choice"])
    assert "--tool-call-parser" in capsys.readouterr().err


@pytest.mark.parametrize("per_token", [{}, {"return_token_ids": True}])
def test_no_empty_deltas_while_a_call_is_written(engine, monkeypatch, per_token):
    """Streamed "auto" calls: text goes out until a call opens, then nothing until the calls come whole; an
    empty delta per token in between is sent only where the request asked for each token's ids."""
    monkeypatch.setattr(engine, "generate", scripted(engine, "Let me look.\n" + CALL, pieces=30))
    r = chat(create_app(engine, tool_call_parser="hermes"), stream=True, tools=TOOLS, **per_token)
    deltas = [c["delta"] for line in r.text.splitlines() if line.startswith("data: {")
              for c in json.loads(line[6:])["choices"]]
    empty = [d for d in deltas[1:] if not d.get("content") and not d.get("tool_calls")]
    assert bool(empty) == bool(per_token), deltas
    text, calls, finishes = streamed(r)
    assert text == "Let me look.\n" and len(calls) == 1 and finishes == ["tool_calls"]


@pytest.mark.parametrize("parser,reply", [
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "\\ud800"}}</tool_call>'),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "\\ud800"}}')])
def test_a_call_holding_a_lone_surrogate_escape_arrives(engine, monkeypatch, parser, reply):
    """The model wrote "\\ud800" (six ASCII characters) in a call: the unary answer was a 500 and the stream
    stopped without the call or [DONE] (a review). Both carry the call, the escape kept."""
    monkeypatch.setattr(engine, "generate", scripted(engine, reply))
    app = create_app(engine, tool_call_parser=parser)
    r = chat(app, tools=TOOLS)
    assert r.status_code == 200, r.text
    (call,) = r.json()["choices"][0]["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"city": "\ud800"}
    r = chat(app, stream=True, tools=TOOLS)
    _, calls, finishes = streamed(r)
    assert finishes == ["tool_calls"] and [c["function"]["name"] for c in calls] == ["get_weather"]
    assert r.text.rstrip().endswith("data: [DONE]")


def test_an_earlier_call_holding_a_lone_surrogate_escape_is_a_400(engine, monkeypatch):
    """An earlier turn's arguments '{"city": "\\ud800"}' pass the body's surrogate check (the escape is
    inside a string) and decode for the template into a str no tokenizer encodes: a 500 before (a review)."""
    template = ("{%- for m in messages %}{%- for tc in m.tool_calls or [] %}"
                "{%- for k, v in tc.function.arguments|items %}<parameter={{ k }}>{{ v }}</parameter>"
                "{%- endfor %}{%- endfor %}"
                "{{ m.role }}: {{ m.content }}\n{%- endfor %}assistant:")  # strings raw, as Qwen3-Coder's
    monkeypatch.setattr(engine.tokenizer, "chat_template", ChatTemplate(template, "test"))
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "\\ud800"}'}}
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    app = create_app(engine)
    r = post(app, "/v1/chat/completions", {"messages": messages, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[1].tool_calls", r.text
    call["function"]["arguments"] = '{"city": "\\u00e9"}'  # an escape of a character is fine
    assert post(app, "/v1/chat/completions", {"messages": messages, "max_tokens": 2}).status_code == 200
