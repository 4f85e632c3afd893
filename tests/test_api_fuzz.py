"""Nasty request bodies: each is a 4xx with the OpenAI error body or a valid 200, never a 500, never a hang;
and no bad request can fail the good requests batched with it."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest

from server.api.app import create_app
from server.engine.sampling_params import SamplingParams
from server.model.tokenizer import ByteTokenizer
from tests.engine_helpers import collect, started_engine, stream_choice, wait_until

pytestmark = pytest.mark.timeout(120)

CFG = dict(model="tiny", device="cpu", dtype="float32", block_size=16, num_blocks=32, max_num_seqs=8,
           attention_backend="torch")
CMPL = "/v1/completions"
CHAT = "/v1/chat/completions"
HUGE = 2**70


@pytest.fixture(scope="module")
def engine():
    with started_engine(**CFG) as eng:
        yield eng


def cmpl(**kw) -> bytes:
    return json.dumps({"prompt": "hi", "max_tokens": 3, **kw}).encode()


def chat(content="hi", **kw) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": content}], "max_tokens": 3, **kw}).encode()


def nested(depth: int) -> bytes:
    return b'{"prompt": "hi", "max_tokens": 1, "extra": ' + b"[" * depth + b"]" * depth + b"}"


# (path, raw body, expected status)
NASTY = [
    (CMPL, b'{"prompt": "\\ud800 lone high surrogate", "max_tokens": 2}', 400),
    (CMPL, b'{"prompt": "ok", "max_tokens": 2, "stop": ["\\udc00"]}', 400),
    (CHAT, b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}', 400),
    (CMPL, b'{"prompt": "\\ud83d\\ude00 paired surrogates are fine", "max_tokens": 2}', 200),
    (CMPL, nested(100_000), 400),
    (CMPL, b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400),
    (CMPL, b"[" * 300_000 + b"]" * 300_000, 400),
    (CMPL, nested(200), 200),
    (CMPL, cmpl(top_k=2**63), 200),
    (CMPL, cmpl(top_k=HUGE, temperature=0.5), 200),
    (CMPL, cmpl(seed=HUGE), 400),  # outside int64, as vLLM bounds it: the core's wire carries int64
    (CMPL, cmpl(seed=-HUGE), 400),
    (CMPL, cmpl(seed=2**63), 400),
    (CMPL, cmpl(seed=2**63 - 1), 200),
    (CMPL, cmpl(seed=-2**63), 200),
    (CMPL, cmpl(max_tokens=HUGE), 400),
    (CMPL, cmpl(n=HUGE), 400),
    (CMPL, cmpl(logprobs=HUGE), 400),
    (CMPL, cmpl(stop_token_ids=[HUGE]), 400),
    (CMPL, cmpl(prompt=[1, HUGE]), 400),
    (CMPL, cmpl(prompt=[1, -5]), 400),
    (CMPL, cmpl(prompt=[1, True]), 400),
    (CMPL, cmpl(prompt=[1, 2.0]), 400),
    (CMPL, cmpl(prompt=[[1, 2], "a"]), 400),
    (CMPL, cmpl(prompt=[[1, 2], [3, None]]), 400),
    (CMPL, b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}", 400),
    (CMPL, b'{"prompt": "hi", "max_tokens": 2, "temperature": NaN}', 400),
    (CMPL, b'{"prompt": "hi", "max_tokens": 2, "top_p": Infinity}', 400),
    (CMPL, b'{"prompt": "hi", "max_tokens": 1e999}', 400),
    (CMPL, cmpl(temperature=1e-300, logprobs=5), 200),
    (CMPL, cmpl(temperature=1e300, repetition_penalty=1e300, top_p=1e-300), 400),  # overflows float32
    (CMPL, cmpl(temperature=1e30, repetition_penalty=1e30, top_p=1e-300), 200),
    (CMPL, cmpl(repetition_penalty=1e-300, min_p=1.0, top_k=1), 400),  # 0 in float32
    (CMPL, cmpl(repetition_penalty=1e-30, min_p=1.0, top_k=1), 200),
    (CMPL, cmpl(prompt="\u0000\uffff\U0010ffff\u202e", echo=True, stop=["\u0000"]), 200),
    (CMPL, cmpl(stop=[f"stop{i}" for i in range(64)], max_tokens=20, ignore_eos=True), 200),
    (CMPL, cmpl(stop=[f"stop{i}" for i in range(10_000)], max_tokens=20, ignore_eos=True), 400),  # limits
    (CMPL, cmpl(stop=["x" * 256], max_tokens=20, ignore_eos=True, stream=True), 200),
    (CMPL, cmpl(stop=["x" * 100_000], max_tokens=20, ignore_eos=True, stream=True), 400),
    (CMPL, cmpl(stop=[""]), 400),
    (CMPL, cmpl(stop=[None]), 400),
    (CMPL, cmpl(max_tokens=400, n=4), 400),  # n x (prompt + max_tokens) beyond the whole KV cache
    (CMPL, cmpl(max_tokens=5, n=64), 400),  # n beyond max_num_seqs
    (CMPL, cmpl(prompt=[[5]] * 128, max_tokens=1), 200),
    (CMPL, cmpl(prompt=[[5]] * 300, max_tokens=1), 400),  # max_prompts
    (CMPL, cmpl(prompt=[[5]] * 5000, max_tokens=1), 400),  # more prompts than max_waiting: never a 429
    (CMPL, cmpl(prompt="hi", stream_options={"include_usage": "yes"}), 400),
    (CHAT, chat(content=[{"type": "text", "text": "a"}] * 200), 200),
    (CHAT, chat(content="{{ 7*7 }}{% for x in range(10**9) %}{% endfor %}"), 200),
    (CHAT, chat(n=4, max_tokens=None), 200),
    (CHAT, chat(max_completion_tokens=HUGE), 400),
    (CHAT, chat(logprobs=True, top_logprobs=20, stream=True, n=3), 200),
    (CHAT, b'{"messages": [{"role": "user", "content": {"nested": [1, 2]}}]}', 400),
    # no JSON numbers, in a free-form schema too (json.loads read NaN, which the grammar took as null)
    (CHAT, b'{"messages": [{"role": "user", "content": "a"}], "max_tokens": 4, "response_format": {"type": '
           b'"json_schema", "json_schema": {"name": "x", "schema": {"enum": [NaN]}}}}', 400),
    (CHAT, b'{"messages": [{"role": "user", "content": "a"}], "max_tokens": 4, "tools": [{"type": '
           b'"function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": '
           b'{"const": 1e400}}}}}], "tool_choice": "required"}', 400),
    (CHAT, b'{"messages": [' + b'{"role": "user", "content": "a"},' * 3000 + b'{"role": "user"}], '
           b'"max_tokens": 1}', 400),
]


async def post_all(app, cases: list[tuple[str, bytes]]) -> list[httpx.Response]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        async def one(path: str, body: bytes) -> httpx.Response:
            headers = {"content-type": "application/json"}
            return await asyncio.wait_for(c.post(path, content=body, headers=headers), timeout=30)
        return await asyncio.gather(*(one(p, b) for p, b in cases))


def check_response(r: httpx.Response, status: int) -> None:
    assert r.status_code == status, r.text[:300]
    if status != 200:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], err
        assert err["type"] == "invalid_request_error"
    elif r.headers["content-type"].startswith("text/event-stream"):
        events = r.text.split("\n\n")
        assert events[-2:] == ["data: [DONE]", ""] and not any('"error"' in e[:20] for e in events)
    else:
        assert all(c["finish_reason"] in ("stop", "length") for c in r.json()["choices"]), r.text[:300]


def test_nasty_bodies_are_4xx_or_valid_200(engine):
    app = create_app(engine)
    responses = asyncio.run(post_all(app, [(p, b) for p, b, _ in NASTY]))
    for (_, body, status), r in zip(NASTY, responses, strict=True):
        try:
            check_response(r, status)
        except AssertionError as e:
            raise AssertionError(f"{body[:120]!r}: {e}") from None
    assert wait_until(lambda: engine.health()["kv_cache"]["used_blocks"] == 0, timeout=10)
    engine.client.core.kv.check_integrity()


def test_huge_top_k_does_not_fail_its_batch_neighbours(engine):
    cases = [(CMPL, cmpl(prompt="neighbour", max_tokens=30, ignore_eos=True)),
             (CMPL, cmpl(max_tokens=30, top_k=2**63, ignore_eos=True))]
    for r in asyncio.run(post_all(create_app(engine), cases)):
        check_response(r, 200)


def test_bad_prompt_ids_on_the_engine_fail_only_their_own_request(engine):
    params = SamplingParams(max_tokens=20, ignore_eos=True)

    async def main():
        return await asyncio.gather(collect(engine, "good", [1, 5, 6, 7], params),
                                    collect(engine, "bad", [1, 5, engine.vocab_size], params))

    good, bad = asyncio.run(main())
    assert good.error is None and good.choices[0].finish_reason == "length"
    assert "prompt token ids" in bad.error and bad.choices[0].finish_reason == "error"
    assert wait_until(lambda: engine.health()["running"] == 0, timeout=10)


@pytest.mark.parametrize("value", [b"\xb2", b"\xb9\xb2", b"-1", b"1e3"])
def test_bad_content_length_is_400(engine, value):
    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(engine)),
                                     base_url="http://t") as c:
            return await c.post(CMPL, content=cmpl(), headers={"content-length": value})

    check_response(asyncio.run(main()), 400)


def reference_stop(text: str, stops: list[str], max_tokens: int) -> tuple[str, str | None]:
    """The text a client must see and the stop string hit (None: ended by length), feeding one char a step."""
    for i in range(1, min(len(text), max_tokens) + 1):
        hits = [(text[:i].find(s), j) for j, s in enumerate(stops) if s in text[:i]]
        if hits:
            pos, j = min(hits)
            return text[:pos], stops[j]
    return text[:max_tokens], None


@pytest.mark.parametrize("seed", range(300))
def test_stop_strings_match_a_naive_reference(seed):
    rng = random.Random(seed)
    text = "".join(rng.choices("abc", k=rng.randint(1, 40)))
    stops = ["".join(rng.choices("abc", k=rng.choice([1, 2, 3, 5, 60]))) for _ in range(rng.randint(1, 6))]
    max_tokens = rng.randint(1, 45)
    tok = ByteTokenizer()
    token_ids = tok.encode(text, add_bos=False)
    params = SamplingParams(stop=stops, max_tokens=min(max_tokens, len(token_ids)))  # the text's end: length
    deltas = stream_choice(tok, token_ids, params, rng.choice([1, 1, 2, 3]))
    emitted = "".join(d.text for d in deltas)
    stop_reason = deltas[-1].stop_reason
    assert (emitted, stop_reason) == reference_stop(text, stops, max_tokens), (text, stops)
