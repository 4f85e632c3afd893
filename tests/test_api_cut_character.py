"""A reply that max_tokens cuts inside a multi-byte character ends before that character, unary and
streamed, as vLLM's detokenizers end it: no U+FFFD for the bytes that never complete (a review found the
end of the stream flushing them as one). The model is a small Llama checkpoint with a SentencePiece
byte-fallback tokenizer, rewired into a fixed bigram chain: any token -> ' The' -> ' fox' -> <0xE2> <0x82>
<0xAC> ('€' as three byte tokens) -> ' jumps' -> </s>."""

from __future__ import annotations

import pytest
from model_fixtures import hf_config, sentencepiece_tokenizer, write_hf_checkpoint
from test_api_special_tokens import bigram_chain, events

from server.api.app import create_app
from tests.asgi_client import post
from tests.engine_helpers import started_engine

pytestmark = pytest.mark.timeout(120)

TEXT = "The fox€ jumps"
PROMPTS = {"/v1/completions": {"prompt": "hello"},
           "/v1/chat/completions": {"messages": [{"role": "user", "content": "hello"}]}}


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    tokenizer = sentencepiece_tokenizer()
    ids = tokenizer.encode(TEXT, add_special_tokens=False).ids
    assert [tokenizer.id_to_token(i) for i in ids[2:5]] == ["<0xE2>", "<0x82>", "<0xAC>"]
    model = write_hf_checkpoint(path, hf_config("llama", vocab_size=tokenizer.get_vocab_size(),
                                                tie_word_embeddings=False))
    bigram_chain(model, [*ids, 2])  # 2: </s>, the checkpoint's EOS
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save(str(path / "tokenizer.json"))
    with started_engine(model=str(path), device="cpu", attention_backend="torch", num_blocks=64) as engine:
        yield create_app(engine)


def reply(app, path: str, max_tokens: int, stream: bool) -> tuple[list[str], str]:
    """-> (the text deltas, the finish reason)."""
    body = {**PROMPTS[path], "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    r = post(app, path, body)
    if not stream:
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return [choice["text"] if "text" in choice else choice["message"]["content"]], choice["finish_reason"]
    choices = [c for e in events(r) for c in e["choices"]]
    deltas = [c["text"] if "text" in c else c["delta"].get("content") or "" for c in choices]
    return deltas, next(c["finish_reason"] for c in choices if c["finish_reason"])


@pytest.mark.parametrize("path", list(PROMPTS))
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("max_tokens", "text"), [(3, " The fox"), (4, " The fox"), (5, " The fox€"),
                                                  (6, " The fox€ jumps")])
def test_a_reply_cut_inside_a_character_ends_before_it(app, path, stream, max_tokens, text):
    deltas, finish = reply(app, path, max_tokens, stream)
    assert "".join(deltas).removeprefix(" ") == text.removeprefix(" ")
    assert not any("\ufffd" in d for d in deltas)
    assert finish == "length"
