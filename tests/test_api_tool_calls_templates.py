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


def _render(template: str, messages: list[dict], tools: list | None = None) -> str:
    tok = _tok(template)
    req = ChatCompletionRequest.model_validate({"messages": messages, **({"tools": tools} if tools else {})})
    variables = {"tools": [t.model_dump(exclude_none=True) for t in req.tools]} if tools else None
    return tok.decode(chat_prompt_ids(tok, req.messages, True, None, variables))


def test_an_empty_tool_calls_list_is_a_plain_assistant_turn():
    """LangChain sends `"tool_calls": []` on plain assistant turns; Llama 3.1's `'tool_calls' in message`
    branch then took the turn for a call and failed (a 400). vLLM drops an empty list; so does pagewalk."""
    shown = _render(LLAMA31, [{"role": "user", "content": "hi"},
                              {"role": "assistant", "content": "Hello!", "tool_calls": []},
                              {"role": "user", "content": "Weather in Paris?"}])
    assert "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>" in shown, shown


@pytest.mark.parametrize("arguments,shown", [("", "{}"), (None, "{}"), ("{cut", "{}"), ("[1, 2]", "[1, 2]"),
                                             ("7", "7"), ("missing", "{}")])
def test_history_arguments_that_are_no_json_render_as_an_empty_object(arguments, shown):
    """A no-argument call's `arguments` "" (as several clients send it), none at all, or text that is no
    JSON: the template gets {}; JSON of another kind stays what it is (vLLM's rules). Llama 3.1's showed
    the model `"parameters": ""` before, and a call without the key was a 500 (reviews)."""
    function = {"name": "get_weather"} if arguments == "missing" else {"name": "get_weather",
                                                                        "arguments": arguments}
    history = [HISTORY[0], {**HISTORY[1], "tool_calls": [{"id": "call_1", "type": "function",
                                                          "function": function}]}, HISTORY[2]]
    assert f'{{"name": "get_weather", "parameters": {shown}}}' in _render(LLAMA31, history, TOOLS)


def test_text_parts_are_joined_by_newlines_and_ipython_is_a_role():
    """A message's text parts reach the template joined by "\\n", as vLLM joins them ("" before); Llama 3's
    own role for a tool's result, "ipython", is taken (a 400 before; vLLM takes any role)."""
    parts = [{"type": "text", "text": "Summarize this:"}, {"type": "text", "text": "The cat sat."}]
    assert "<|im_start|>user\nSummarize this:\nThe cat sat.<|im_end|>" in _render(QWEN25, [
        {"role": "user", "content": parts}])
    shown = _render(LLAMA31, [*HISTORY[:2], {"role": "ipython", "content": "sunny"}], TOOLS)
    assert "<|start_header_id|>ipython<|end_header_id|>\n\nsunny<|eot_id|>" in shown, shown


def test_a_checkpoints_tool_use_template_renders_requests_with_tools(tmp_path):
    """tokenizer_config.json's named templates "default" and "tool_use" (Hermes-2-Pro's, Hermes-3's): a
    request with tools gets "tool_use", as transformers' apply_chat_template and vLLM pick it (it was never
    used: the model was never shown its tools, a review); one without gets "default". transformers 5 saves
    it as additional_chat_templates/tool_use.jinja beside chat_template.jinja: the same there."""
    import transformers
    from model_fixtures import byte_bpe_tokenizer

    default = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    tool_use = "<|im_start|>system\n<tools>{{ tools | tojson }}</tools><|im_end|>\n" + default
    byte_bpe_tokenizer().save(str(tmp_path / "tokenizer.json"))
    templates = [{"name": "default", "template": default}, {"name": "tool_use", "template": tool_use}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": templates}))
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    hf.chat_template = {"default": default, "tool_use": tool_use}
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "tokenizer.json").write_bytes((tmp_path / "tokenizer.json").read_bytes())
    (saved / "chat_template.jinja").write_text(default)
    (saved / "additional_chat_templates").mkdir()
    (saved / "additional_chat_templates" / "tool_use.jinja").write_text(tool_use)
    for directory in (tmp_path, saved):
        tok = HFTokenizer.from_dir(directory)
        for tools in (TOOLS, None):
            req = ChatCompletionRequest.model_validate({"messages": messages, "tools": tools})
            variables = {"tools": [t.model_dump(exclude_none=True) for t in req.tools]} if tools else None
            shown = tok.decode(chat_prompt_ids(tok, req.messages, True, None, variables),
                               skip_special_tokens=False)
            assert shown == hf.apply_chat_template(messages, tools=tools, tokenize=False), (directory, shown)
            assert ("get_weather" in shown) == (tools is not None)
