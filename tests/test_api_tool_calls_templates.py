"""Chat tool calls beside real template shapes (Qwen2.5's and Llama 3.1's tool parts): an earlier turn's
call arguments reach the template as objects, the tools render; and the request-side rules a review of
ed882f7 found missing: hermes keeps special tokens, /tokenize renders the tools, parallel_tool_calls false
keeps one call, whitespace before a streamed call is no content."""

from __future__ import annotations

import json

import pytest

from server.api.app import create_app
from server.api.chat import _job
from server.api.outputs import ChoiceDelta, RequestOutput
from server.api.prompts import chat_prompt_ids
from server.api.protocol import ChatCompletionRequest, ChatMessage
from server.model.chat_template import ChatTemplate
from server.model.tokenizer import HFTokenizer
from tests.asgi_client import post

pytestmark = pytest.mark.timeout(120)

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL2 = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'

# Qwen2.5's template, the tool parts as published (tools block, assistant tool_calls, tool results)
QWEN25 = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}{{- '# Tools\\n\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}{{- '<|im_start|>user\\n<tool_response>\\n' }}"
    "{{- message.content }}{{- '\\n</tool_response><|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Llama 3.1's template, the tool parts (tools in the first user message, a call as {"name", "parameters"})
LLAMA31 = (
    "{%- if tools is not none %}{%- set first = messages[0]['content'] %}"
    "{%- set messages = messages[1:] %}"
    "{{- '<|start_header_id|>user<|end_header_id|>\\n\\nGiven the following functions:\\n\\n' }}"
    "{%- for t in tools %}{{- t | tojson(indent=4) }}{{- '\\n\\n' }}{%- endfor %}"
    "{{- first + '<|eot_id|>' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if 'tool_calls' in message %}{%- set tool_call = message.tool_calls[0].function %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{{- '{\"name\": \"' + tool_call.name + '\", ' }}{{- '\"parameters\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}' }}{{- '<|eot_id|>' }}"
    "{%- elif message.role == 'tool' %}{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' }}"
    "{{- message.content }}{{- '<|eot_id|>' }}"
    "{%- else %}{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content"
    " + '<|eot_id|>' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None,
     "tool_calls": [{"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]


def _tok(template: str) -> HFTokenizer:
    from model_fixtures import byte_bpe_tokenizer

    return HFTokenizer(byte_bpe_tokenizer(), chat_template=ChatTemplate(template, "test"))


@pytest.mark.parametrize("template,key", [(QWEN25, "arguments"), (LLAMA31, "parameters")])
def test_history_tool_call_arguments_reach_the_template_as_objects(template, key):
    """OpenAI clients send an earlier call's `arguments` as a JSON *string*; Qwen2.5 / Llama 3.1 / Hermes
    templates render `arguments | tojson`, so the model is shown a double-encoded string
    ("arguments": "{\\"city\\": \\"Paris\\"}") instead of the object it was trained on and itself wrote.
    vLLM's chat_utils._postprocess_messages json.loads them into dicts before rendering (transformers'
    documented convention)."""
    tok = _tok(template)
    messages = [ChatMessage.model_validate(m) for m in HISTORY]
    shown = tok.decode(chat_prompt_ids(tok, messages, True, None, {"tools": TOOLS}))
    assert "get_weather" in shown and "sunny" in shown
    assert f'"{key}": {{"city": "Paris"}}' in shown, shown


@pytest.mark.parametrize("template", [QWEN25, LLAMA31])
def test_the_tools_render_in_the_real_template_shapes(template):
    """The request's tools reach Qwen2.5- and Llama-3.1-style templates whole."""
    tok = _tok(template)
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                                "tools": TOOLS})
    variables = {"tools": [t.model_dump(exclude_none=True) for t in req.tools]}
    shown = tok.decode(chat_prompt_ids(tok, req.messages, True, None, variables))
    assert '"name": "get_weather"' in shown and '"description": "Weather of a city"' in shown


def scripted(parts: list[str], finish: str = "stop"):
    def generate(request_id, prompt, params, admitted=False, **_):
        async def outputs():
            for k, part in enumerate(parts):
                last = k == len(parts) - 1
                yield RequestOutput(request_id, prompt, [
                    ChoiceDelta(i, part, [3 + k], None, finish if last else None) for i in range(params.n)],
                    finished=last)
        return outputs()
    return generate


def chat(app, **fields):
    return post(app, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Weather?"}],
                                              "max_tokens": 30, **fields})


def test_hermes_keeps_special_tokens_so_the_call_tags_survive(engine):
    """Hermes-2-Pro (and others) mark <tool_call> / </tool_call> as *special* added tokens; with the
    default skip_special_tokens=True the detokenized reply has no tags and no call is ever found. vLLM's
    Hermes2ProToolParser.adjust_request sets skip_special_tokens=False whenever tools are given and
    tool_choice != "none"; so does pagewalk where the request leaves skip_special_tokens unset."""
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                                "max_tokens": 5, "tools": TOOLS})
    job = _job(engine, req, None, "hermes")
    assert job.tool_call_parser == "hermes"
    assert job.params.skip_special_tokens is False


def test_tokenize_messages_with_tools_counts_the_tools(engine, monkeypatch):
    """vLLM's /tokenize (TokenizeChatRequest) takes `tools` and renders them, so a client can count the
    prompt a chat request with tools will run. Here TokenizeRequest has no `tools` (extra="ignore"): they
    were silently dropped and the count was of a shorter prompt than /v1/chat/completions runs."""
    template = ChatTemplate("{% if tools %}TOOLS:{{ tools | tojson }}\n{% endif %}"
                            "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}", "test")
    monkeypatch.setattr(engine.tokenizer, "chat_template", template)
    app = create_app(engine, tool_call_parser="hermes")
    messages = [{"role": "user", "content": "hi"}]
    r = post(app, "/tokenize", {"messages": messages, "tools": TOOLS})
    assert r.status_code == 200, r.text
    req = ChatCompletionRequest.model_validate({"messages": messages, "tools": TOOLS, "max_tokens": 1})
    expected = _job(engine, req, None, "hermes").prompt
    assert r.json()["tokens"] == expected


def test_parallel_tool_calls_false_keeps_the_first_call(engine, monkeypatch):
    """OpenAI: parallel_tool_calls=false -> at most one call per reply (it was accepted and ignored: a reply
    with two calls returned both); true or unset returns every call."""
    monkeypatch.setattr(engine, "generate", scripted([CALL, "\n", CALL2]))
    app = create_app(engine, tool_call_parser="hermes")
    (call,) = chat(app, tools=TOOLS, parallel_tool_calls=False).json()["choices"][0]["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert len(chat(app, tools=TOOLS).json()["choices"][0]["message"]["tool_calls"]) == 2


def test_whitespace_before_a_call_is_not_content_when_streamed(engine, monkeypatch):
    """Unary, whitespace before <tool_call> is no content (content null, tool_calls.py:53); streamed, it
    goes out as content ("\\n\\n") before the call is seen, so the two shapes of one reply differ and
    clients that show content get an empty assistant bubble. Hold leading whitespace in ToolCallStream
    (as its llama3_json branch does) until non-space text or the opening arrives."""
    monkeypatch.setattr(engine, "generate", scripted(["\n\n", CALL]))
    app = create_app(engine, tool_call_parser="hermes")
    assert chat(app, tools=TOOLS).json()["choices"][0]["message"]["content"] is None
    r = chat(app, tools=TOOLS, stream=True)
    content = ""
    for line in r.text.splitlines():
        if line.startswith("data: {"):
            for c in json.loads(line[6:])["choices"]:
                content += c["delta"].get("content") or ""
    assert content == "", repr(content)
