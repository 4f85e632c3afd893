"""The OpenAI surface through httpx's ASGITransport against create_app(real engine, tiny model)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server.api.app import create_app
from tests.asgi_client import get, post
from tests.engine_helpers import started_engine

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def engine():
    with started_engine(model="tiny", device="cpu", attention_backend="torch", num_blocks=256) as eng:
        yield eng


@pytest.fixture(scope="module")
def app(engine):
    return create_app(engine)


def sse_payloads(text: str) -> list:
    """The data payloads of an SSE body; asserts the framing and the final [DONE]."""
    events = text.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]", text[-200:]
    out = []
    for ev in events[:-2]:
        assert ev.startswith("data: "), ev
        out.append(json.loads(ev[len("data: "):]))
    return out


GREEDY = {"temperature": 0, "ignore_eos": True}


def test_completion_shape_usage_and_token_ids(app, engine):
    r = post(app, "/v1/completions", {"model": "tiny", "prompt": "Hello", "max_tokens": 7,
                                      "return_token_ids": True, **GREEDY})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-") and body["model"] == "tiny"
    (choice,) = body["choices"]
    prompt_ids = engine.tokenizer.encode("Hello", add_bos=True)
    assert choice["index"] == 0 and choice["finish_reason"] == "length"
    assert choice["prompt_token_ids"] == prompt_ids and len(choice["token_ids"]) == 7
    assert all(0 <= t < engine.tokenizer.vocab_size for t in choice["token_ids"])
    assert choice["text"] == engine.tokenizer.decode(choice["token_ids"])
    assert body["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": 7,
                             "total_tokens": len(prompt_ids) + 7}


def test_completion_batch_prompts_times_n(app, engine):
    ids = engine.tokenizer.encode("abc", add_bos=True)
    r = post(app, "/v1/completions", {"prompt": [ids, ids + [70, 71]], "n": 2, "max_tokens": 3,
                                      "temperature": 0.9, "seed": 5, "ignore_eos": True,
                                      "return_token_ids": True})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert [c["prompt_token_ids"] for c in choices] == [ids, ids, ids + [70, 71], ids + [70, 71]]
    assert all(len(c["token_ids"]) == 3 for c in choices)
    assert r.json()["usage"]["prompt_tokens"] == 2 * len(ids) + 2
    assert r.json()["usage"]["completion_tokens"] == 12


def test_greedy_is_deterministic_and_echo_prepends_prompt(app):
    a = post(app, "/v1/completions", {"prompt": "The cat", "max_tokens": 6, **GREEDY}).json()
    b = post(app, "/v1/completions", {"prompt": "The cat", "max_tokens": 6, "echo": True, **GREEDY}).json()
    assert b["choices"][0]["text"] == "The cat" + a["choices"][0]["text"]


def test_completion_logprobs_shape(app, engine):
    r = post(app, "/v1/completions", {"prompt": "xy", "max_tokens": 5, "logprobs": 3,
                                      "return_token_ids": True, **GREEDY})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 5
    assert all(x <= 0 for x in lp["token_logprobs"])
    assert all(1 <= len(top) <= 3 for top in lp["top_logprobs"])
    # greedy: the sampled token is the most likely one
    assert all(max(top.values()) == pytest.approx(x, abs=1e-5)
               for top, x in zip(lp["top_logprobs"], lp["token_logprobs"], strict=True))
    offsets = [0]
    for tok in lp["tokens"][:-1]:
        offsets.append(offsets[-1] + len(tok))
    assert lp["text_offset"] == offsets


def test_chat_completion_and_logprobs(app, engine):
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi "},
                                             {"type": "text", "text": "there"}]}]
    r = post(app, "/v1/chat/completions", {"messages": messages, "max_completion_tokens": 4, "logprobs": True,
                                           "top_logprobs": 2, "return_token_ids": True, **GREEDY})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    flat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    prompt = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(flat), add_bos=True)
    assert body["prompt_token_ids"] == prompt and body["usage"]["prompt_tokens"] == len(prompt)
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"
    assert choice["message"]["content"] == engine.tokenizer.decode(choice["token_ids"])
    content = choice["logprobs"]["content"]
    assert len(content) == 4 and all(len(c["top_logprobs"]) == 2 for c in content)
    assert all(c["bytes"] == list(c["token"].encode()) for c in content)


def test_stream_completion_matches_non_streaming(app):
    req = {"prompt": "Streaming", "max_tokens": 6, **GREEDY}
    whole = post(app, "/v1/completions", req).json()
    r = post(app, "/v1/completions", {**req, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    chunks = sse_payloads(r.text)
    assert all(c["object"] == "text_completion" for c in chunks)
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == whole["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    assert all("usage" in c and c["usage"] is None for c in chunks[:-1])  # OpenAI's null before the last
    plain = sse_payloads(post(app, "/v1/completions", {**req, "stream": True}).text)
    assert plain and all("usage" not in c for c in plain)


def test_stream_chat_first_chunk_has_role(app):
    req = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 5, **GREEDY}
    whole = post(app, "/v1/chat/completions", req).json()
    chunks = sse_payloads(post(app, "/v1/chat/completions", {**req, "stream": True}).text)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == whole["choices"][0]["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and "usage" not in chunks[-1]
    with_usage = sse_payloads(post(app, "/v1/chat/completions", {
        **req, "stream": True, "n": 2, "logprobs": True, "stream_options": {"include_usage": True}}).text)
    assert with_usage[-1]["choices"] == [] and with_usage[-1]["usage"]["completion_tokens"] == 10
    assert all("usage" in c and c["usage"] is None for c in with_usage[:-1])  # role, logprob, plain chunks


def test_stop_token_ids_end_the_choice(app):
    first = post(app, "/v1/completions", {"prompt": "stop here", "max_tokens": 6, "return_token_ids": True,
                                          **GREEDY}).json()["choices"][0]
    stop_at = first["token_ids"][2]
    k = first["token_ids"].index(stop_at)
    r = post(app, "/v1/completions", {"prompt": "stop here", "max_tokens": 6, "return_token_ids": True,
                                      "stop_token_ids": [stop_at], **GREEDY})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop_at
    assert choice["token_ids"] == first["token_ids"][:k + 1]


def test_concurrent_greedy_streams_equal_solo_runs(app):
    prompts = [f"request number {i} says" for i in range(32)]

    async def stream(c: httpx.AsyncClient, prompt: str) -> str:
        body = {"prompt": prompt, "max_tokens": 6, "stream": True, **GREEDY}
        r = await c.post("/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return "".join(ch["choices"][0]["text"] for ch in sse_payloads(r.text) if ch["choices"])

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            solo = [await stream(c, p) for p in prompts]
            together = await asyncio.gather(*(stream(c, p) for p in prompts))
        return solo, together

    solo, together = asyncio.run(go())
    assert together == solo


def test_models_health_metrics(app, engine):
    models = get(app, "/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["tiny"]
    card = models["data"][0]
    assert card["object"] == "model" and card["max_model_len"] == engine.max_model_len
    health = get(app, "/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert set(health.json()["kv_cache"]) >= {"block_size", "num_blocks", "free_blocks", "used_blocks",
                                              "cached_blocks"}
    metrics = get(app, "/metrics")
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(metrics.text)}
    assert "pagewalk_time_to_first_token_seconds" in families
    generated = [s.value for s in families["pagewalk_generation_tokens"].samples if s.name.endswith("_total")]
    assert generated and generated[0] > 0


@pytest.mark.parametrize("echo", [False, True])
def test_stream_completion_logprob_offsets_match_non_streaming(app, echo):
    req = {"prompt": "Offsets", "max_tokens": 7, "logprobs": 1, "echo": echo, **GREEDY}
    whole = post(app, "/v1/completions", req).json()["choices"][0]["logprobs"]
    chunks = sse_payloads(post(app, "/v1/completions", {**req, "stream": True}).text)
    offsets = [o for c in chunks for ch in c["choices"] if ch["logprobs"]
               for o in ch["logprobs"]["text_offset"]]
    assert offsets == whole["text_offset"] and len(offsets) >= 7
    usage_null = sse_payloads(post(app, "/v1/completions", {
        **req, "stream": True, "stream_options": {"include_usage": True}}).text)
    assert usage_null[-1]["choices"] == [] and usage_null[-1]["usage"]["completion_tokens"] == 7
    assert all(c["usage"] is None for c in usage_null[:-1])  # the echo chunk and the logprob chunks


def test_streamed_offsets_count_text_held_back_for_a_stop_string(app):
    # the tiny model's greedy continuation of "Hello" starts with "r", which might begin the stop string
    # "r&e": the stream holds "r" back and sends it with the next token, whose offset is still 1
    req = {"prompt": "Hello", "max_tokens": 12, "logprobs": 0, "stop": "r&e", **GREEDY}
    whole = post(app, "/v1/completions", req).json()["choices"][0]
    assert whole["text"].startswith("r") and not whole["text"].startswith("r&e")  # the case under test
    chunks = sse_payloads(post(app, "/v1/completions", {**req, "stream": True}).text)
    offsets = [o for c in chunks for ch in c["choices"] if ch["logprobs"]
               for o in ch["logprobs"]["text_offset"]]
    assert offsets == whole["logprobs"]["text_offset"]


@pytest.mark.parametrize("n", [1, 2])
def test_echo_with_max_tokens_0_scores_the_prompt(app, n):
    # OpenAI's legacy completions (and vLLM) answer echo + max_tokens 0 with the prompt and its logprobs,
    # generating nothing: how evaluation harnesses score a prompt. Streamed and not, the same answer.
    req = {"prompt": "Score me", "max_tokens": 0, "echo": True, "logprobs": 1, "n": n, **GREEDY}
    body = post(app, "/v1/completions", req).json()
    prompt_ids = post(app, "/tokenize", {"prompt": "Score me"}).json()["tokens"]
    assert body["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": 0,
                             "total_tokens": len(prompt_ids)}, body
    for choice in body["choices"]:
        assert choice["text"] == "Score me" and choice["finish_reason"] == "length"
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(prompt_ids) and lp["token_logprobs"][0] is None
        assert all(isinstance(x, float) for x in lp["token_logprobs"][1:])
    chunks = sse_payloads(post(app, "/v1/completions", {**req, "stream": True}).text)
    for index in range(n):
        mine = [ch for c in chunks for ch in c["choices"] if ch["index"] == index]
        assert "".join(ch["text"] for ch in mine) == "Score me"
        assert [ch["finish_reason"] for ch in mine if ch["finish_reason"]] == ["length"]
        tokens = [t for ch in mine if ch["logprobs"] for t in ch["logprobs"]["tokens"]]
        assert tokens == body["choices"][index]["logprobs"]["tokens"]


def test_max_tokens_0_without_echo_is_a_400(app):
    r = post(app, "/v1/completions", {"prompt": "x", "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    r = post(app, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text


def test_chat_message_carries_refusal_and_the_response_a_system_fingerprint(app):
    # OpenAI's chat response: message.refusal (null unless the model refused) and system_fingerprint
    req = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **GREEDY}
    body = post(app, "/v1/chat/completions", req).json()
    assert "system_fingerprint" in body and body["system_fingerprint"] is None
    assert body["choices"][0]["message"]["refusal"] is None


def test_an_assistant_refusal_part_is_replayed_as_its_text(app):
    # a history that holds an assistant's refusal part (OpenAI allows text or refusal parts there; vLLM
    # reads the refusal as text) renders as the same history with that text
    turn = {"role": "user", "content": "hi"}
    as_part = [turn, {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]}, turn]
    as_text = [turn, {"role": "assistant", "content": "No."}, turn]
    req = {"max_tokens": 4, "return_token_ids": True, **GREEDY}
    a = post(app, "/v1/chat/completions", {**req, "messages": as_part})
    b = post(app, "/v1/chat/completions", {**req, "messages": as_text})
    assert a.status_code == 200, a.text
    assert a.json()["prompt_token_ids"] == b.json()["prompt_token_ids"]
    user_refusal = [{"role": "user", "content": [{"type": "refusal", "refusal": "No."}]}]
    r = post(app, "/v1/chat/completions", {**req, "messages": user_refusal})
    assert r.status_code == 400 and "refusal" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("fields, param", [
    ({"max_completion_tokens": 1400}, "max_completion_tokens"),
    ({"max_tokens": 1400}, "max_tokens"),
])  # fmt: skip
def test_a_refusal_of_the_requests_tokens_names_the_field_sent(app, fields, param):
    # 3 x (prompt + 1400) tokens fit the context but not this engine's KV cache (255 blocks of 16): the 400
    # names the limit the client sent
    body = {"messages": [{"role": "user", "content": "hi"}], "n": 3, **fields, **GREEDY}
    r = post(app, "/v1/chat/completions", body)
    assert r.status_code == 400 and "KV cache capacity" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == param
