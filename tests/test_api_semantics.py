"""OpenAI semantics the API layer owes a client: the sampled token among its top_logprobs, a chat rendered
without the reply's opening when add_generation_prompt is false, logprob bytes that are the token's own,
the optional message fields reaching the chat template."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from server.api.app import create_app
from server.api.logprobs import chat_logprobs
from server.api.outputs import TokenLogprob
from server.api.prompts import chat_messages
from server.api.protocol import ChatMessage
from server.model.tokenizer import ByteTokenizer
from tests.engine_helpers import started_engine

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def app():
    with started_engine(model="tiny", device="cpu", attention_backend="torch", num_blocks=64) as eng:
        yield create_app(eng)


def post(app, path: str, body: dict) -> dict:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.post(path, json=body, timeout=60)
    r = asyncio.run(go())
    assert r.status_code == 200, r.text
    return r.json()


def test_the_sampled_token_is_among_its_top_logprobs(app):
    """Hot sampling draws tokens outside the top 1: each position still lists the drawn token."""
    body = {"prompt": "Hello", "max_tokens": 12, "temperature": 5.0, "seed": 7, "logprobs": 1}
    lp = post(app, "/v1/completions", body)["choices"][0]["logprobs"]
    outside = 0
    for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True):
        assert top[token] == logprob and 1 <= len(top) <= 2
        outside += len(top) == 2
    assert outside > 0  # the seed draws some token that is not the most likely one
    lp = post(app, "/v1/completions", {**body, "logprobs": 0})["choices"][0]["logprobs"]
    assert all(list(top) == [token] for token, top in zip(lp["tokens"], lp["top_logprobs"], strict=True))


def test_add_generation_prompt_false_renders_without_the_reply_opening(app):
    messages = [{"role": "user", "content": "Hi"}]
    on = post(app, "/v1/chat/completions", {"messages": messages, "max_tokens": 1, "return_token_ids": True})
    off = post(app, "/v1/chat/completions", {"messages": messages, "max_tokens": 1, "return_token_ids": True,
                                             "add_generation_prompt": False})
    tok = ByteTokenizer()
    assert tok.decode(on["prompt_token_ids"]) == "user: Hi\nassistant:"
    assert tok.decode(off["prompt_token_ids"]) == "user: Hi\n"
    assert off["usage"]["prompt_tokens"] == on["usage"]["prompt_tokens"] - len("assistant:")


def test_chat_logprob_bytes_are_each_tokens_own():
    """'é' is two byte tokens: each entry's text is U+FFFD, its bytes the one byte it holds."""
    tok = ByteTokenizer()
    first, second = tok.encode("é", add_bos=False)
    tokens = [TokenLogprob(first, "\ufffd", -0.1, [(first, "\ufffd", -0.1)]),
              TokenLogprob(second, "\ufffd", -0.2, [(second, "\ufffd", -0.2)])]
    out = chat_logprobs(tokens, 1, tok).content
    assert [e.bytes for e in out] == [[0xC3], [0xA9]] and bytes(out[0].bytes + out[1].bytes).decode() == "é"
    assert [e.top_logprobs[0].bytes for e in out] == [[0xC3], [0xA9]]


def test_optional_message_fields_reach_the_template():
    messages = [ChatMessage(role="user", content="hi", name="ann"),
                ChatMessage(role="assistant", tool_calls=[{"id": "c1", "type": "function"}]),
                ChatMessage(role="tool", content="42", tool_call_id="c1")]
    assert chat_messages(messages) == [
        {"role": "user", "content": "hi", "name": "ann"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function"}]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"}]


def test_echo_with_logprobs_scores_prompts_up_to_the_step_budget():
    """Prompt logprobs run one dense forward on the engine's thread: a prompt past max_num_batched_tokens
    (the forward memory was sized for) is a 400 naming `echo`, and the core refuses it too."""
    from server.engine.engine import EngineConfig, build_core
    from server.engine.outputs import EngineRequest
    from server.engine.sampling_params import SamplingParams

    cfg = dict(model="tiny", device="cpu", attention_backend="torch", num_blocks=64,
               max_num_batched_tokens=64)
    with started_engine(**cfg) as eng:
        app = create_app(eng)
        body = {"prompt": "x" * 40, "max_tokens": 1, "echo": True, "logprobs": 1}
        echoed = post(app, "/v1/completions", body)["choices"][0]["logprobs"]["tokens"]
        assert len(echoed) == 42  # BOS + 40 prompt tokens + 1 generated

        async def go():
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
                return await c.post("/v1/completions", json={**body, "prompt": "x" * 100}, timeout=60)
        r = asyncio.run(go())
        assert r.status_code == 400 and r.json()["error"]["param"] == "echo", r.text
    core, _ = build_core(EngineConfig(**cfg))
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        core.add_request(EngineRequest("p", [5] * 100, SamplingParams(max_tokens=1, prompt_logprobs=1), 0.0))
