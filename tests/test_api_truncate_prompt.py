"""vLLM's truncate_prompt_tokens: a prompt is served as its last k tokens (-1: as many as the context holds),
completions and chat, with the echo and usage of the prompt served; 0 or more than the context is a 400."""

from __future__ import annotations

import pytest

from server.api.app import create_app
from tests.asgi_client import post
from tests.engine_helpers import started_engine

pytestmark = pytest.mark.timeout(120)

MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def app():
    with started_engine(model="tiny", device="cpu", attention_backend="torch", num_blocks=64,
                        max_model_len=MAX_MODEL_LEN) as engine:
        yield create_app(engine)


def complete(app, **fields) -> dict:
    r = post(app, "/v1/completions", {"max_tokens": 5, "temperature": 0, "return_token_ids": True, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def test_completions_serve_the_prompts_tail(app):
    text = "a prompt that runs long enough to cut"
    ids = complete(app, prompt=text, max_tokens=1)["choices"][0]["prompt_token_ids"]
    assert len(ids) > 8
    cut = complete(app, prompt=text, truncate_prompt_tokens=8, echo=True)
    choice = cut["choices"][0]
    same = complete(app, prompt=ids[-8:], echo=True)["choices"][0]
    assert choice["prompt_token_ids"] == ids[-8:] and cut["usage"]["prompt_tokens"] == 8
    assert choice["token_ids"] == same["token_ids"] and choice["text"] == same["text"]
    assert choice["text"].startswith(text[-8:])  # the echo is the tail the model read (byte tokens)
    whole = complete(app, prompt=text, truncate_prompt_tokens=-1, echo=True)  # it fits: untouched
    assert whole["choices"][0]["text"].startswith(text) and whole["usage"]["prompt_tokens"] == len(ids)
    many = complete(app, prompt=[text, "short"], truncate_prompt_tokens=8)
    assert many["usage"]["prompt_tokens"] == 8 + len(complete(app, prompt="short")["choices"][0]
                                                      ["prompt_token_ids"])


def test_minus_one_keeps_what_the_context_holds(app):
    long_ids = [5 + i % 90 for i in range(200)]
    r = post(app, "/v1/completions", {"prompt": long_ids, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    # -1 keeps MAX_MODEL_LEN tokens: no room for a completion, a 400 as vLLM's, naming the cut
    for keep in (-1, MAX_MODEL_LEN, MAX_MODEL_LEN - 2):
        body = {"prompt": long_ids, "max_tokens": 3, "truncate_prompt_tokens": keep}
        r = post(app, "/v1/completions", body)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "truncate_prompt_tokens", err
        assert err["code"] == "context_length_exceeded" and "keep at most 61" in err["message"]
    messages = [{"role": "user", "content": "x" * 200}]
    r = post(app, "/v1/chat/completions", {"messages": messages, "truncate_prompt_tokens": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"
    body = complete(app, prompt=long_ids, truncate_prompt_tokens=MAX_MODEL_LEN - 5)
    assert body["usage"]["prompt_tokens"] == MAX_MODEL_LEN - 5


def test_chat_serves_the_rendered_prompts_tail(app):
    messages = [{"role": "user", "content": "a chat message long enough to be cut"}]
    full = post(app, "/v1/chat/completions", {"messages": messages, "max_tokens": 3, "temperature": 0,
                                              "return_token_ids": True}).json()
    cut = post(app, "/v1/chat/completions", {"messages": messages, "max_tokens": 3, "temperature": 0,
                                             "return_token_ids": True, "truncate_prompt_tokens": 6}).json()
    assert cut["prompt_token_ids"] == full["prompt_token_ids"][-6:] and cut["usage"]["prompt_tokens"] == 6


@pytest.mark.parametrize("value,message", [(0, "at least 1"), (MAX_MODEL_LEN + 1, "at most"), (-2, ""),
                                           ("4", ""), (2**40, "")])
def test_bad_values_are_400s(app, value, message):
    for path, body in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        r = post(app, path, {**body, "max_tokens": 2, "truncate_prompt_tokens": value})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "truncate_prompt_tokens" and message in err["message"]


@pytest.mark.parametrize("logprobs", [None, 0])
def test_a_prompt_that_fills_the_context_can_be_scored(app, logprobs):
    """echo with max_tokens 0 needs no room beside the prompt (OpenAI: prompt + max_tokens <= the context;
    vLLM checks the 0 asked): a prompt of exactly the context was a 400 (a review). One more is a 400."""
    ids = [5 + i % 90 for i in range(MAX_MODEL_LEN)]
    fields = {"max_tokens": 0, "echo": True} | ({} if logprobs is None else {"logprobs": logprobs})
    body = complete(app, prompt=ids, **fields)
    assert body["usage"] == {"prompt_tokens": MAX_MODEL_LEN, "completion_tokens": 0,
                             "total_tokens": MAX_MODEL_LEN}
    if logprobs is not None:
        lp = body["choices"][0]["logprobs"]
        assert len(lp["tokens"]) == MAX_MODEL_LEN and lp["token_logprobs"][0] is None
    cut = complete(app, prompt=ids + [7, 8], truncate_prompt_tokens=-1, **fields)
    assert cut["usage"]["prompt_tokens"] == MAX_MODEL_LEN
    r = post(app, "/v1/completions", {"prompt": ids + [7], **fields})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = post(app, "/v1/completions", {"prompt": ids, "max_tokens": 1})  # a completion needs its room
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_a_prompt_as_long_as_the_whole_cache_can_be_scored():
    """max_model_len cut to what the KV cache holds (the default when it is smaller than the model's
    positions): the admission's capacity checks counted the dropped token too, a 400 (a review)."""
    with started_engine(model="tiny", device="cpu", attention_backend="torch", num_blocks=8,
                        block_size=16) as engine:
        limit = engine.max_model_len
        assert limit == engine.capacity_tokens
        body = {"prompt": [5 + i % 90 for i in range(limit)], "max_tokens": 0, "echo": True, "logprobs": 0}
        r = post(create_app(engine), "/v1/completions", body)
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == limit, r.text
        body = {**body, "n": 2}  # two such choices are more than the cache
        r = post(create_app(engine), "/v1/completions", body)
        assert r.status_code == 400 and "KV cache capacity" in r.json()["error"]["message"], r.text
