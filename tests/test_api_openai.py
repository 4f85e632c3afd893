"""The OpenAI surface through httpx's ASGITransport against create_app(real engine, tiny model)."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.asgi_client import get, post

pytestmark = pytest.mark.timeout(120)


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
    # the text parts joined by "\n", as vLLM joins them
    flat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi \nthere"}]
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


SEEDED = {"temperature": 0.9, "seed": 11, "ignore_eos": True}  # n choices that differ, the same each run
LOGPROB_LISTS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")


def completion_choices(app, body: dict) -> list[dict]:
    """A completion's choices in index order; a stream's merged per index (text, token ids and logprob
    lists joined, its finish)."""
    r = post(app, "/v1/completions", body)
    assert r.status_code == 200, r.text
    if not body.get("stream"):
        return r.json()["choices"]
    merged: dict[int, dict] = {}
    for chunk in sse_payloads(r.text):
        for ch in chunk["choices"]:
            m = merged.setdefault(ch["index"], {"text": "", "token_ids": [], "logprobs": None,
                                                "finish_reason": None})
            m["text"] += ch["text"]
            m["token_ids"] += ch.get("token_ids") or []
            if ch["logprobs"] is not None:
                m["logprobs"] = m["logprobs"] or {key: [] for key in LOGPROB_LISTS}
                for key in LOGPROB_LISTS:
                    m["logprobs"][key] += ch["logprobs"][key]
            m["finish_reason"] = ch["finish_reason"] or m["finish_reason"]
    return [merged[i] for i in sorted(merged)]


def chat_choices(app, body: dict) -> list[dict]:
    """A chat's choices in index order as {content, token_ids, logprobs (the entries), finish_reason}; a
    stream's merged per index, with every delta's content kept in `pieces`."""
    r = post(app, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    if not body.get("stream"):
        return [{"content": c["message"]["content"], "token_ids": c.get("token_ids"),
                 "logprobs": c["logprobs"]["content"] if c["logprobs"] else None,
                 "finish_reason": c["finish_reason"]} for c in r.json()["choices"]]
    merged: dict[int, dict] = {}
    for chunk in sse_payloads(r.text):
        for ch in chunk["choices"]:
            m = merged.setdefault(ch["index"], {"content": "", "token_ids": [], "logprobs": None,
                                                "finish_reason": None, "pieces": []})
            m["pieces"].append(ch["delta"].get("content"))
            m["content"] += ch["delta"].get("content") or ""
            m["token_ids"] += ch.get("token_ids") or []
            if ch["logprobs"] is not None:
                m["logprobs"] = (m["logprobs"] or []) + ch["logprobs"]["content"]
            m["finish_reason"] = ch["finish_reason"] or m["finish_reason"]
    return [merged[i] for i in sorted(merged)]


def is_id_string(token: str, vocab_size: int) -> bool:
    return re.fullmatch(r"token_id:\d+", token) is not None and int(token[len("token_id:"):]) < vocab_size


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_as_token_ids(app, engine, stream):
    # vLLM's return_tokens_as_token_ids: each entry of tokens and each top_logprobs key is "token_id:{id}"
    # (the byte tokenizer's tokens above 0x7f all read U+FFFD as text); the text and the logprobs stay
    req = {"prompt": "Token ids", "max_tokens": 6, "n": 2, "logprobs": 2, "return_token_ids": True,
           "stream": stream, **SEEDED}
    plain = completion_choices(app, req)
    as_ids = completion_choices(app, {**req, "return_tokens_as_token_ids": True})
    assert plain[0]["token_ids"] != plain[1]["token_ids"]  # n choices of their own
    for p, c in zip(plain, as_ids, strict=True):
        assert (c["text"], c["token_ids"], c["finish_reason"]) == (p["text"], p["token_ids"], "length")
        lp = c["logprobs"]
        assert lp["tokens"] == [f"token_id:{t}" for t in c["token_ids"]]
        assert lp["token_logprobs"] == p["logprobs"]["token_logprobs"]
        for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True):
            assert top[token] == logprob and 1 <= len(top) <= 3
            assert all(is_id_string(key, engine.tokenizer.vocab_size) for key in top)
        # the offsets count the strings in tokens, as vLLM's do
        assert lp["text_offset"] == [sum(map(len, lp["tokens"][:i])) for i in range(len(lp["tokens"]))]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_as_token_ids_keep_each_tokens_bytes(app, engine, stream):
    req = {"messages": [{"role": "user", "content": "ids please"}], "max_tokens": 5, "n": 2,
           "logprobs": True, "top_logprobs": 2, "return_token_ids": True, "stream": stream, **SEEDED}
    plain = chat_choices(app, req)
    as_ids = chat_choices(app, {**req, "return_tokens_as_token_ids": True})
    bytes_of = engine.tokenizer.bytes_of
    for p, c in zip(plain, as_ids, strict=True):
        assert (c["content"], c["token_ids"]) == (p["content"], p["token_ids"]) and len(c["token_ids"]) == 5
        assert [e["token"] for e in c["logprobs"]] == [f"token_id:{t}" for t in c["token_ids"]]
        assert [e["logprob"] for e in c["logprobs"]] == [e["logprob"] for e in p["logprobs"]]
        assert [e["bytes"] for e in c["logprobs"]] == [list(bytes_of(t)) for t in c["token_ids"]]
        for entry in c["logprobs"]:
            assert len(entry["top_logprobs"]) == 2
            for top in entry["top_logprobs"]:
                assert is_id_string(top["token"], engine.tokenizer.vocab_size)
                assert top["bytes"] == list(bytes_of(int(top["token"][len("token_id:"):])))


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("logprobs", [None, 1])
def test_completion_without_detokenize_sends_ids_and_no_text(app, stream, logprobs):
    # vLLM's detokenize false: "" for the text, echo's too; the ids and the logprobs as with text
    req = {"prompt": "No text", "max_tokens": 6, "n": 2, "logprobs": logprobs, "return_token_ids": True,
           "return_tokens_as_token_ids": True, "stream": stream, **SEEDED}
    with_text = completion_choices(app, req)
    for echo in (False, True):
        without = completion_choices(app, {**req, "detokenize": False, "echo": echo})
        for w, c in zip(with_text, without, strict=True):
            assert w["text"] and c["text"] == ""
            assert (c["token_ids"], c["finish_reason"]) == (w["token_ids"], w["finish_reason"])
            if logprobs is not None and not echo:
                assert c["logprobs"] == w["logprobs"]


@pytest.mark.parametrize("stream", [False, True])
def test_scoring_a_prompt_as_token_ids_without_text(app, engine, stream):
    # echo + max_tokens 0 + logprobs: the prompt's entries spelled as ids, no text decoded
    ids = engine.tokenizer.encode("Score me", add_bos=True)
    req = {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 1, "n": 2, "detokenize": False,
           "return_tokens_as_token_ids": True, "stream": stream, **GREEDY}
    for choice in completion_choices(app, req):
        lp = choice["logprobs"]
        assert choice["text"] == "" and lp["tokens"] == [f"token_id:{t}" for t in ids]
        assert lp["top_logprobs"][0] is None and all(lp["tokens"][i] in lp["top_logprobs"][i]
                                                     for i in range(1, len(ids)))
        assert lp["text_offset"] == [sum(map(len, lp["tokens"][:i])) for i in range(len(ids))]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_without_detokenize_sends_ids_and_empty_content(app, stream):
    req = {"messages": [{"role": "user", "content": "no text"}], "max_tokens": 5, "n": 2,
           "return_token_ids": True, "stream": stream, **SEEDED}
    with_text = chat_choices(app, req)
    without = chat_choices(app, {**req, "detokenize": False})
    for w, c in zip(with_text, without, strict=True):
        assert w["content"] and c["content"] == ""
        assert (c["token_ids"], c["finish_reason"]) == (w["token_ids"], w["finish_reason"])
        if stream:  # the role chunk's "" and then "" in every delta beside its ids
            assert len(c["pieces"]) > 2 and all(piece == "" for piece in c["pieces"])


def test_structured_output_without_detokenize(app, engine):
    # the grammar constrains the tokens in the engine: the ids it allows come without their text
    req = {"prompt": "Answer:", "max_tokens": 8, "structured_outputs": {"choice": ["yes", "no"]},
           "detokenize": False, "return_token_ids": True, "temperature": 0}
    (choice,) = completion_choices(app, req)
    assert choice["text"] == "" and choice["finish_reason"] == "stop"
    assert engine.tokenizer.decode(choice["token_ids"]) in ("yes", "no")


@pytest.mark.parametrize("path,base", [
    ("/v1/completions", {"prompt": "No text"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "No text"}]}),
])
@pytest.mark.parametrize("fields,spelled", [({"detokenize": False}, None),
                                            ({"return_tokens_as_token_ids": True}, "token_id:"),
                                            ({"detokenize": False, "return_tokens_as_token_ids": True},
                                             "token_id:")])
def test_prompt_logprobs_follow_the_text_options(app, path, base, fields, spelled):
    """prompt_logprobs' decoded_token: None with detokenize false, the id's string with
    return_tokens_as_token_ids, as every other logprob string (a review: they carried the text)."""
    r = post(app, path, {**base, "max_tokens": 2, "prompt_logprobs": 1, "temperature": 0, **fields})
    assert r.status_code == 200, r.text
    body = r.json()
    entries = body["prompt_logprobs"] if "prompt_logprobs" in body else body["choices"][0]["prompt_logprobs"]
    decoded = [e["decoded_token"] for position in entries if position for e in position.values()]
    assert decoded and all(d is None if spelled is None else d.startswith(spelled) for d in decoded), decoded
