"""vLLM's `skip_special_tokens`: false spells the special tokens a choice samples mid-text (completions and
chat, unary and streamed, and a completion's echoed prompt); true or omitted leaves them out; EOS, which ends
a choice, is never part of its text. The model is a small Llama checkpoint rewired into a fixed bigram chain:
any token -> 'The' -> <|start_header_id|> (an added special token) -> ' and' -> </s> (EOS)."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from model_fixtures import byte_bpe_tokenizer, hf_config, write_hf_checkpoint

from server.api.app import create_app
from tests.asgi_client import post
from tests.engine_helpers import started_engine

pytestmark = pytest.mark.timeout(120)

CFG = dict(device="cpu", attention_backend="torch", num_blocks=64)
SPECIAL = "<|start_header_id|>"
SPELLED = "The<|start_header_id|> and"  # the chain's text, special spelled
SKIPPED = "The and"  # the same ids with the special left out
CMPL = {"prompt": "hello", "max_tokens": 8, "temperature": 0}
CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 8, "temperature": 0}


def bigram_chain(model, chain: list[int]) -> None:
    """Rewire `model` so that greedy decoding follows `chain`: after chain[i] comes chain[i + 1], after any
    other token chain[0]. Attention and MLP add nothing (o_proj, down_proj zero), so the last hidden state
    is the input token's embedding: a unit vector per chain token (one shared by every other token)."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        other = len(chain) - 1
        embed.zero_()
        embed[:, other] = 1.0
        head.zero_()
        head[chain[0], other] = 1.0
        for i, (token, after) in enumerate(zip(chain, chain[1:], strict=False)):
            embed[token] = 0.0
            embed[token, i] = 1.0
            head[after, i] = 1.0


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    tokenizer = byte_bpe_tokenizer(bos_post_processor=True)
    tokenizer.add_special_tokens([SPECIAL])
    ids = tokenizer.encode(f"The{SPECIAL} and", add_special_tokens=False).ids
    assert len(ids) == 3 and tokenizer.decode(ids) == SKIPPED
    model = write_hf_checkpoint(path, hf_config("llama", tie_word_embeddings=False))
    bigram_chain(model, [*ids, 2])  # 2: </s>, the checkpoint's EOS
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save(str(path / "tokenizer.json"))
    return path, ids


@pytest.fixture(scope="module")
def app(checkpoint):
    path, _ = checkpoint
    with started_engine(model=str(path), **CFG) as engine:
        yield create_app(engine)


def events(r: httpx.Response) -> list[dict]:
    assert r.status_code == 200, r.text
    data = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def completion_text(app, body: dict) -> str:
    r = post(app, "/v1/completions", body)
    if body.get("stream"):
        return "".join(c["text"] for e in events(r) for c in e["choices"])
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"  # on EOS, whose text is not part of the choice's
    return choice["text"]


def chat_text(app, body: dict) -> str:
    r = post(app, "/v1/chat/completions", body)
    if body.get("stream"):
        return "".join(c["delta"].get("content", "") for e in events(r) for c in e["choices"])
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    return choice["message"]["content"]


@pytest.mark.parametrize("stream", [False, True])
def test_completion_spells_special_tokens_unless_skipped(app, stream):
    body = {**CMPL, "stream": stream}
    assert completion_text(app, {**body, "skip_special_tokens": False}) == SPELLED
    assert completion_text(app, {**body, "skip_special_tokens": True}) == SKIPPED
    assert completion_text(app, body) == SKIPPED
    assert completion_text(app, {**body, "skip_special_tokens": None}) == SKIPPED


@pytest.mark.parametrize("stream", [False, True])
def test_chat_spells_special_tokens_unless_skipped(app, stream):
    body = {**CHAT, "stream": stream}
    assert chat_text(app, {**body, "skip_special_tokens": False}) == SPELLED
    assert chat_text(app, {**body, "skip_special_tokens": True}) == SKIPPED
    assert chat_text(app, body) == SKIPPED


def test_the_token_ids_are_the_same_either_way(app, checkpoint):
    _, ids = checkpoint
    for skip in (False, True):
        r = post(app, "/v1/completions", {**CMPL, "skip_special_tokens": skip, "return_token_ids": True})
        assert r.json()["choices"][0]["token_ids"] == [*ids, 2]


@pytest.mark.parametrize("stream", [False, True])
def test_an_echoed_prompt_of_ids_is_decoded_as_the_choice_is(app, checkpoint, stream):
    """The echo of a prompt given as ids spells its specials (BOS included) only with skip false."""
    _, ids = checkpoint
    body = {**CMPL, "prompt": [1, ids[1], 267], "echo": True, "stream": stream}  # <s>, the special, 'he'
    spelled = completion_text(app, {**body, "skip_special_tokens": False})
    assert spelled == "<s><|start_header_id|>he" + SPELLED
    assert completion_text(app, body) == "he" + SKIPPED


@pytest.mark.parametrize(("path", "body"), [("/v1/completions", CMPL), ("/v1/chat/completions", CHAT)])
@pytest.mark.parametrize("value", ["false", 0, [False]])
def test_a_skip_special_tokens_that_is_no_bool_is_400(app, path, body, value):
    r = post(app, path, {**body, "skip_special_tokens": value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == "skip_special_tokens"
    assert err["type"] == "invalid_request_error" and "Traceback" not in r.text
    assert "valid boolean" in err["message"]  # a type error, no longer "not supported by pagewalk"


def echo_offsets(app, body: dict) -> list[int]:
    """The text offsets of an echo with logprobs, streamed or not."""
    chunks = events(post(app, "/v1/completions", body)) if body.get("stream") else \
        [post(app, "/v1/completions", body).json()]
    return [o for c in chunks for ch in c["choices"] if ch["logprobs"] for o in ch["logprobs"]["text_offset"]]


@pytest.mark.parametrize("stream", [False, True])
def test_echo_offsets_run_on_from_the_prompts_token_strings(app, checkpoint, stream):
    """The echo's offsets sum the prompt's token strings (its BOS '<s>', a skipped special token's name),
    which the echoed text leaves out: the generated tokens' offsets go on from there, never back (vLLM
    counts one pass over prompt and output tokens). A text prompt with a BOS, and an id prompt holding a
    special token, cut by truncate_prompt_tokens."""
    _, ids = checkpoint
    for prompt in ({"prompt": "hello"}, {"prompt": [1, ids[1], 267], "truncate_prompt_tokens": 2}):
        offsets = echo_offsets(app, {**CMPL, **prompt, "echo": True, "logprobs": 0, "max_tokens": 3,
                                     "stream": stream})
        assert offsets == sorted(offsets) and len(offsets) >= 5, (prompt, offsets)


@pytest.mark.parametrize("stream", [False, True])
def test_the_eos_that_ends_a_choice_is_spelled_only_as_a_kept_stop(app, stream):
    """README: the ending EOS is spelled with include_stop_str_in_output (the stop token kept, as vLLM's),
    with skip_special_tokens false; never otherwise (a review found the README saying never)."""
    body = {**CMPL, "stream": stream, "skip_special_tokens": False}
    assert not completion_text(app, body).endswith("</s>")
    assert completion_text(app, {**body, "include_stop_str_in_output": True}) == SPELLED + "</s>"
    assert completion_text(app, {**body, "include_stop_str_in_output": True, "skip_special_tokens": True}) \
        == SKIPPED
