"""logit_bias (OpenAI), min_tokens, include_stop_str_in_output, allowed_token_ids and bad_words (vLLM) through
the HTTP API on the tiny preset: what they do to the tokens and text, streamed and not, and the 400s of bad
values."""

from __future__ import annotations

import json

import pytest

from server.api.app import create_app
from server.api.sampling import bad_words_ids
from server.engine.sampling_params import MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS, MAX_LOGIT_BIAS, SamplingParams
from server.model.tokenizer import ByteTokenizer
from tests.asgi_client import post
from tests.engine_helpers import started_engine

pytestmark = pytest.mark.timeout(180)

EOS = ByteTokenizer.EOS
A, Z = ByteTokenizer.OFFSET + ord("a"), ByteTokenizer.OFFSET + ord("z")  # printable: never masked by tiny
PROMPT = "The bias test says"


@pytest.fixture(scope="module")
def app():
    with started_engine(model="tiny", device="cpu", attention_backend="torch", num_blocks=128) as engine:
        yield create_app(engine)


def complete(app, **fields) -> dict:
    r = post(app, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                                      "return_token_ids": True, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def streamed(app, **fields) -> tuple[str, list[int], str | None]:
    """(text, token ids, finish reason) of a streamed completion."""
    r = post(app, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                                      "return_token_ids": True, "stream": True, **fields})
    assert r.status_code == 200, r.text
    text, ids, finish = "", [], None
    for line in r.text.splitlines():
        if line.startswith("data: {"):
            for c in json.loads(line[6:])["choices"]:
                text += c["text"]
                ids += c.get("token_ids") or []
                finish = c["finish_reason"] or finish
    return text, ids, finish


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 3},
                                      {"temperature": 0.8, "top_k": 5, "top_p": 0.9, "seed": 4}])
def test_a_large_bias_forces_a_token_greedy_and_sampled(app, sampling):
    body = complete(app, logit_bias={str(Z): 100}, n=2, **sampling)
    for choice in body["choices"]:
        assert choice["token_ids"] == [Z] * 6 and choice["text"] == "z" * 6


def test_a_negative_bias_moves_the_greedy_token_and_logprobs_stay_the_models(app):
    plain = complete(app, max_tokens=1, logprobs=3)["choices"][0]
    first = plain["token_ids"][0]
    top = plain["logprobs"]["top_logprobs"][0]  # token text -> logprob, the model's own
    biased = complete(app, max_tokens=1, logprobs=3, logit_bias={str(first): -100})["choices"][0]
    second = biased["token_ids"][0]
    assert second != first
    text = biased["text"]
    assert text in top and biased["logprobs"]["token_logprobs"][0] == pytest.approx(top[text], abs=1e-5)


def test_min_tokens_holds_eos_back_until_it_is_reached(app):
    forced_eos = {str(EOS): 100}
    early = complete(app, logit_bias=forced_eos)["choices"][0]
    assert early["token_ids"] == [EOS] and early["finish_reason"] == "stop"
    held = complete(app, logit_bias=forced_eos, min_tokens=4, max_tokens=10)
    choice = held["choices"][0]
    assert len(choice["token_ids"]) == 5 and choice["token_ids"][-1] == EOS
    assert EOS not in choice["token_ids"][:4] and choice["finish_reason"] == "stop"
    assert held["usage"]["completion_tokens"] == 5
    assert streamed(app, logit_bias=forced_eos, min_tokens=4, max_tokens=10)[1] == choice["token_ids"]
    # ignore_eos: min_tokens holds nothing back, and the forced EOS runs to max_tokens
    ignored = complete(app, logit_bias=forced_eos, min_tokens=2, ignore_eos=True)["choices"][0]
    assert ignored["token_ids"] == [EOS] * 6 and ignored["finish_reason"] == "length"


def test_min_tokens_holds_stop_token_ids_back(app):
    choice = complete(app, logit_bias={str(Z): 100}, stop_token_ids=[Z], min_tokens=3,
                      max_tokens=8)["choices"][0]
    assert Z not in choice["token_ids"][:3] and choice["token_ids"][3] == Z
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == Z


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_count_from_min_tokens_on(app, stream):
    fields = dict(logit_bias={str(A): 100}, stop="a", max_tokens=8)
    def run(**f):
        return streamed(app, **f)[0] if stream else complete(app, **f)["choices"][0]["text"]

    assert run(**fields) == ""
    # the first min_tokens tokens' text is output whatever it holds, as vLLM's (v1) and as a held-back EOS
    # shows it: the fourth token's "a" is the first that counts
    assert run(**fields, min_tokens=3) == "aaa"
    assert run(**fields, min_tokens=3, include_stop_str_in_output=True) == "aaaa"
    assert run(**fields, min_tokens=1) == "a"


@pytest.mark.parametrize("stream", [False, True])
def test_include_stop_str_in_output(app, stream):
    plain = complete(app, max_tokens=8)["choices"][0]["text"]
    stop = plain[2:4]
    cut = plain[:plain.index(stop)]
    for include, expected in ((False, cut), (True, cut + stop)):
        fields = dict(max_tokens=8, stop=[stop], include_stop_str_in_output=include)
        text = streamed(app, **fields)[0] if stream else complete(app, **fields)["choices"][0]["text"]
        assert text == expected
    # a stop token's text is kept as well
    fields = dict(logit_bias={str(Z): 100}, stop_token_ids=[Z], include_stop_str_in_output=True)
    choice = complete(app, **fields)["choices"][0]
    assert choice["text"] == "z" and choice["stop_reason"] == Z
    assert complete(app, **{**fields, "include_stop_str_in_output": False})["choices"][0]["text"] == ""


def test_chat_takes_the_same_fields(app):
    r = post(app, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
                                           "temperature": 0, "logit_bias": {str(Z): 100}})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "zzzzz"
    r = post(app, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 9,
                                           "logit_bias": {str(EOS): 100}, "min_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def test_allowed_token_ids_are_the_only_tokens_sampled(app):
    allowed = [A, A + 1, Z]
    for sampling in ({"temperature": 0}, {"temperature": 1.5, "seed": 5, "n": 3}):
        body = complete(app, allowed_token_ids=allowed, max_tokens=12, **sampling)
        for choice in body["choices"]:
            assert set(choice["token_ids"]) <= set(allowed) and len(choice["token_ids"]) == 12
    forced = complete(app, allowed_token_ids=allowed, logit_bias={str(Z): 100})["choices"][0]
    assert forced["token_ids"] == [Z] * 6
    # EOS among them, held back by min_tokens
    held = complete(app, allowed_token_ids=[A, EOS], logit_bias={str(EOS): 50}, min_tokens=2)["choices"][0]
    assert held["token_ids"] == [A, A, EOS] and held["text"] == "aa"


def test_allowed_ids_the_model_masks_are_still_the_only_ones(app):
    """Byte 0x01 (id 4) is masked by the tiny preset (logit -inf): allowed alone, it is what comes out."""
    for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 1}):
        choice = complete(app, allowed_token_ids=[4], max_tokens=3, **sampling)["choices"][0]
        assert choice["token_ids"] == [4, 4, 4]
    # EOS alone allowed and held back by min_tokens: the allowed id wins (it ends the choice at once)
    choice = complete(app, allowed_token_ids=[EOS], min_tokens=3)["choices"][0]
    assert choice["token_ids"] == [EOS] and choice["finish_reason"] == "stop"


@pytest.mark.parametrize("fields,param,message", [
    ({"logit_bias": {"1" * 5000: 1}}, "logit_bias", "token ids"),  # int() of it raised a 500
    ({"logit_bias": {"00000000001": 1}}, "logit_bias", "token ids"),
    ({"allowed_token_ids": []}, "allowed_token_ids", "1 to 1024"),
    ({"allowed_token_ids": [5, 100000]}, "allowed_token_ids", "[0, "),
    ({"allowed_token_ids": [-1]}, "allowed_token_ids", ""),
    ({"allowed_token_ids": "5"}, "allowed_token_ids", ""),
    ({"logit_bias": {"z": 1}}, "logit_bias", "token ids"),
    ({"logit_bias": {"-1": 1}}, "logit_bias", "token ids"),
    ({"logit_bias": {"٣": 1}}, "logit_bias", "token ids"),  # a decimal digit, not ASCII
    ({"logit_bias": {"100000": 1}}, "logit_bias", "[0, "),
    ({"logit_bias": {str(Z): 100.5}}, "logit_bias", "[-100, 100]"),
    ({"logit_bias": {str(Z): "1"}}, "logit_bias", ""),
    ({"logit_bias": {str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}}, "logit_bias", "at most"),
    ({"min_tokens": 7}, "min_tokens", "max_tokens=6"),
    ({"min_tokens": -1}, "min_tokens", ""),
    ({"min_tokens": "2"}, "min_tokens", ""),
    ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output", ""),
    ({"bad_words": "ab"}, "bad_words", ""),
    ({"bad_words": [""]}, "bad_words", ""),
    ({"bad_words": [3]}, "bad_words", ""),
    ({"bad_words": ["w"] * (MAX_BAD_WORDS + 1)}, "bad_words", ""),
    ({"bad_words": ["x" * MAX_BAD_WORD_TOKENS]}, "bad_words", "1 to 64 tokens"),  # its spaced spelling: 65
])
def test_bad_values_are_400s_naming_the_field(app, fields, param, message):
    r = post(app, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, **fields})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"].startswith(param) and message in err["message"], err


def test_a_no_op_logit_bias_is_accepted(app):
    assert complete(app, logit_bias={})["choices"][0]["token_ids"] == complete(app)["choices"][0]["token_ids"]
    zero = complete(app, logit_bias={str(A): 0})["choices"][0]["token_ids"]
    assert zero == complete(app)["choices"][0]["token_ids"]


def test_min_tokens_holds_back_a_bounded_number_of_stop_token_ids():
    """The sampler keeps a row's held-back ids in its bias table: min_tokens bounds them as logit_bias."""
    ids = list(range(MAX_LOGIT_BIAS + 1))
    SamplingParams(stop_token_ids=ids).validate(100_000)  # without min_tokens: no bound
    SamplingParams(stop_token_ids=ids[:-1], min_tokens=1).validate(100_000)
    with pytest.raises(ValueError, match="min_tokens holds back at most"):
        SamplingParams(stop_token_ids=ids, min_tokens=1).validate(100_000)


def test_bad_words_never_appear_in_the_text(app):
    """Words taken from the plain greedy reply: the reply changes and holds none of them, streamed or not,
    through the completions and the chat API."""
    plain = complete(app, max_tokens=12)["choices"][0]["text"]
    words = [plain[2:5], plain[7]]
    for n in (1, 2):
        for choice in complete(app, max_tokens=12, bad_words=words, n=n)["choices"]:
            text = choice["text"]
            assert text != plain and not any(w in text for w in words), (text, words)
    text, _, _ = streamed(app, max_tokens=12, bad_words=words)
    assert text != plain and not any(w in text for w in words)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10, "temperature": 0}
    plain = post(app, "/v1/chat/completions", chat).json()["choices"][0]["message"]["content"]
    r = post(app, "/v1/chat/completions", {**chat, "bad_words": [plain[1:3]]})
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["message"]["content"]
    assert text != plain and plain[1:3] not in text
    assert complete(app, bad_words=[])["choices"][0]["text"] == complete(app)["choices"][0]["text"]


def test_bad_words_encode_bare_and_after_a_space():
    """Each word as it starts the text and after a space; a word of whitespace alone is itself ("\n" bans a
    newline: stripped, it had banned a space alone, a review)."""
    tok = ByteTokenizer()
    ids = bad_words_ids(tok, ["  ab", "ab", "\n"])
    assert ids == [tok.encode(t, add_bos=False) for t in ("ab", " ab", "\n", " \n")]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("fields", [
    {"structured_outputs": {"regex": "[ab]"}, "bad_words": ["a", "b"]},
    {"structured_outputs": {"choice": ["yes", "no"]}, "bad_words": ["yes", "no"]},
    {"allowed_token_ids": [A, A + 1], "bad_words": ["a", "b"]},
])
def test_bad_words_that_ban_every_token_left_are_a_400(app, fields, stream):
    """A banned token is drawn only where the grammar or allowed_token_ids leave no other: the request fails
    with a 400 naming bad_words (its reply was a banned word with finish_reason "stop": a review). Streamed,
    the error comes as the stream's error event."""
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "stream": stream, **fields}
    r = post(app, "/v1/completions", body)
    if not stream:
        assert r.status_code == 400, r.text
        error = r.json()["error"]
    else:
        events = [json.loads(line[6:]) for line in r.text.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        error = next(e["error"] for e in events if "error" in e)
    assert error["code"] == "bad_words_conflict" and error["param"] == "bad_words", error
    assert "ban every token" in error["message"]
    allowed = {k: v for k, v in fields.items() if k != "bad_words"}
    assert complete(app, **allowed, bad_words=["zz"])["choices"][0]["finish_reason"] in ("stop", "length")
