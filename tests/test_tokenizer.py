"""Tokenizers (byte-level and the tokenizer.json wrapper), chat templates, and streaming detokenization."""

from __future__ import annotations

import codecs
import json

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from model_fixtures import CHAT_TEMPLATE, byte_bpe_tokenizer, sentencepiece_tokenizer

from server.model import IncrementalDetokenizer
from server.model.chat_template import ChatTemplate
from server.model.detokenizer import Utf8Detokenizer, detokenizer_for
from server.model.tokenizer import ByteTokenizer, HFTokenizer

TEXTS = ["", "hello", "héllo wörld", "東京 🙂 \n\t tabs", "\x00\x7f control"]
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


def complete_text(raw: bytes) -> str:
    """`raw` decoded as a stream that ends: what the stdlib's incremental decoder gives without its final
    call, an incomplete character at the end left out (invalid bytes are U+FFFD)."""
    return codecs.getincrementaldecoder("utf-8")(errors="replace").decode(raw)


def stream(tokenizer, ids: list[int], detokenizer=IncrementalDetokenizer) -> list[str]:
    detok = detokenizer(tokenizer)
    return [detok.push(i) for i in ids] + [detok.flush()]


BYTE_DETOKENIZERS = pytest.mark.parametrize("detokenizer", [IncrementalDetokenizer, Utf8Detokenizer])


@pytest.fixture(scope="module")
def hf_tok(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    byte_bpe_tokenizer(bos_post_processor=True).save(str(path / "tokenizer.json"))
    cfg = {"bos_token": {"content": "<s>"}, "eos_token": "</s>", "pad_token": "<pad>",
           "chat_template": CHAT_TEMPLATE}  # fmt: skip
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return HFTokenizer.from_dir(path, extra_eos_ids=(7,))


@pytest.mark.parametrize("text", TEXTS)
def test_byte_tokenizer_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id and len(ids) == 1 + len(text.encode())
    assert tok.encode(text, add_bos=False) == ids[1:]
    assert all(3 <= i < tok.vocab_size for i in ids[1:])
    assert tok.decode(ids + [tok.EOS, tok.PAD]) == text


def test_byte_tokenizer_larger_vocab_ignores_unused_ids():
    tok = ByteTokenizer(vocab_size=128256)
    assert tok.vocab_size == 128256 and tok.eos_token_ids == {2}
    assert tok.decode([ord("a") + 3, 300, 128255, ord("b") + 3]) == "ab"
    with pytest.raises(ValueError, match="vocab_size >= 259"):
        ByteTokenizer(vocab_size=100)


def test_simple_chat_template():
    text = ByteTokenizer().apply_chat_template(MESSAGES)
    assert text == "system: be brief\nuser: hi\nassistant:"
    # text parts joined by "\n", as vLLM joins them
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert ByteTokenizer().apply_chat_template(parts, add_generation_prompt=False) == "user: a\nb\n"


# Qwen2.5-Instruct's shape: a system turn, or its default one; any other role but user/assistant is dropped
QWEN_LIKE = ("{% if messages[0]['role'] == 'system' %}<s>{{ messages[0]['content'] }}</s>{% else %}"
             "<s>You are Qwen.</s>{% endif %}{% for m in messages %}{% if m['role'] == 'user' %}"
             "<u>{{ m['content'] }}</u>{% endif %}{% endfor %}")


def test_a_developer_message_is_the_system_turn_where_the_template_does_not_name_it():
    """OpenAI's developer message is the system instruction: a template without a "developer" branch
    renders it as "system" (before, Qwen2.5's template dropped it for its default system prompt: a review
    with the openai SDK); one that names the role gets it as sent."""
    developer = [{"role": "developer", "content": "Answer in French."}, {"role": "user", "content": "hi"}]
    system = [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "hi"}]
    qwen = ChatTemplate(QWEN_LIKE, "test")
    assert qwen.render(developer) == qwen.render(system) == "<s>Answer in French.</s><u>hi</u>"
    named = ChatTemplate("{% for m in messages %}{% if m.role == \"developer\" %}[dev]{% endif %}"
                         "{{ m.role }}:{{ m.content }};{% endfor %}", "test")
    assert named.render(developer) == "[dev]developer:Answer in French.;user:hi;"
    assert ByteTokenizer().apply_chat_template(developer, add_generation_prompt=False) == \
        "system: Answer in French.\nuser: hi\n"


@BYTE_DETOKENIZERS
@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64), st.lists(st.sampled_from([0, 1, 2, 300]), max_size=4), st.randoms())
def test_byte_detokenizer_concat_equals_decode(detokenizer, data, specials, rnd):
    tok = ByteTokenizer(vocab_size=512)
    ids = [b + 3 for b in data]
    for special in specials:
        ids.insert(rnd.randint(0, len(ids)), special)
    deltas = stream(tok, ids, detokenizer)
    assert "".join(deltas) == complete_text(tok.decode_bytes(ids))


@BYTE_DETOKENIZERS
@settings(max_examples=200, deadline=None)
@given(st.text(max_size=40))
@example(text="\ufffd")
def test_byte_detokenizer_never_emits_half_a_character(detokenizer, text):
    tok = ByteTokenizer()
    deltas = stream(tok, tok.encode(text), detokenizer)
    # a U+FFFD of the text's own is text (the window detokenizer tells it from an incomplete character by
    # the tokenizer's bytes: it held it to the end of the stream and dropped it there before)
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas if "\ufffd" not in text)
    assert deltas[-1] == ""  # nothing is left to flush after valid UTF-8


@BYTE_DETOKENIZERS
def test_detokenizer_holds_incomplete_bytes_until_completed(detokenizer):
    tok = ByteTokenizer()
    ids = tok.encode("a€", add_bos=False)  # € is 3 bytes
    detok = detokenizer(tok)
    assert [detok.push(i) for i in ids] == ["a", "", "", "€"]
    detok.push(0xE2 + 3)  # a lead byte the stream ends after: its character never completes
    assert detok.flush() == ""
    assert [detok.push(i) for i in tok.encode("b", add_bos=False)] == ["b"]  # nothing left held


@BYTE_DETOKENIZERS
@pytest.mark.parametrize("raw", [b"\xc3A", b"x\xe2\x82y\xe2\x82\xac", b"\xf0\x9f\x99A\x80 ok", b"\xffab\xc3"])
def test_detokenizer_broken_sequences_decode_as_the_whole_stream(detokenizer, raw):
    """An ASCII byte after a lead byte ends that character as U+FFFD first (what decode gives); an
    incomplete character at the end of the stream is dropped."""
    tok = ByteTokenizer()
    ids = [b + ByteTokenizer.OFFSET for b in raw]
    assert tok.decode(ids) == raw.decode("utf-8", "replace")
    complete = raw[:-1] if raw.endswith(b"\xc3") else raw
    assert "".join(stream(tok, ids, detokenizer)) == complete.decode("utf-8", "replace") == complete_text(raw)


def test_detokenizer_for_picks_the_byte_table_where_there_is_one(hf_tok):
    assert isinstance(detokenizer_for(ByteTokenizer()), Utf8Detokenizer)
    assert isinstance(detokenizer_for(hf_tok), IncrementalDetokenizer)


def test_hf_tokenizer_bos_eos_and_round_trip(hf_tok):
    assert hf_tok.bos_token_id == 1 and hf_tok.pad_token_id == 0 and hf_tok.eos_token_ids == {2, 7}
    assert hf_tok.vocab_size == 300
    for text in TEXTS:
        ids = hf_tok.encode(text)
        assert ids[0] == 1 and hf_tok.decode(ids) == text
        assert hf_tok.encode(text, add_bos=False) == ids[1:]


def test_hf_chat_template_from_config_and_single_bos(hf_tok):
    text = hf_tok.apply_chat_template(MESSAGES)
    assert text == "<s><|system|>\nbe brief</s>\n<|user|>\nhi</s>\n<|assistant|>\n"
    ids = hf_tok.chat_token_ids(MESSAGES)
    assert ids.count(1) == 1 and ids[0] == 1  # the template's BOS is parsed, not doubled
    assert hf_tok.encode(text).count(1) == 2  # as in transformers, add_special_tokens would add another
    assert 2 in ids  # </s> is parsed as the special token


def test_hf_chat_template_file_and_named_list(tmp_path):
    byte_bpe_tokenizer().save(str(tmp_path / "tokenizer.json"))
    templates = [{"name": "tool_use", "template": "T"},
                 {"name": "default", "template": "{{ messages[0].role }}"}]  # fmt: skip
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": templates}))
    tok = HFTokenizer.from_dir(tmp_path)
    assert tok.bos_token_id is None and tok.encode("ab") == tok.encode("ab", add_bos=False)
    assert tok.apply_chat_template(MESSAGES) == "system"
    (tmp_path / "chat_template.jinja").write_text("{{ messages | length }}")
    assert HFTokenizer.from_dir(tmp_path).apply_chat_template(MESSAGES) == "2"
    override = ChatTemplate("{{ messages[1].content }}", "test")
    assert HFTokenizer.from_dir(tmp_path, chat_template=override).apply_chat_template(MESSAGES) == "hi"


def test_hf_tokenizer_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        HFTokenizer.from_dir(tmp_path)


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=30))
def test_hf_detokenizer_concat_equals_decode(hf_tok, text):
    ids = hf_tok.encode(text)
    deltas = stream(hf_tok, ids)
    assert "".join(deltas) == hf_tok.decode(ids) == text


@pytest.fixture(scope="module")
def sp_tok():
    return HFTokenizer(sentencepiece_tokenizer(), bos_token="<s>", eos_tokens=("</s>",))


def completion(tok, prompt_ids: list[int], ids: list[int]) -> str:
    """What a completion of `ids` after `prompt_ids` reads: the whole decode past the prompt's."""
    return tok.decode(prompt_ids + ids)[len(tok.decode(prompt_ids)):]


def test_a_sentencepiece_completion_keeps_its_first_space(sp_tok):
    """Metaspace decoders drop the leading space of a sequence's first token: the completion's window
    starts on the prompt's tail, so ' fox' stays ' fox' (decoded alone it reads 'fox')."""
    prompt, ids = sp_tok.encode("The quick brown"), sp_tok.encode(" fox jumps", add_bos=False)
    assert sp_tok.decode(ids) == "fox jumps"  # the decoder's own behaviour that the context corrects
    detok = detokenizer_for(sp_tok, prompt)
    streamed = "".join(detok.push(i) for i in ids) + detok.flush()
    assert streamed == " fox jumps" == completion(sp_tok, prompt, ids)


@settings(max_examples=60, deadline=None)
@given(st.text(min_size=1, max_size=12), st.text(max_size=20))
@example("héllo", " wörld ✓")
def test_a_completion_streams_what_the_whole_decode_adds(sp_tok, hf_tok, prompt_text, text):
    for tok in (sp_tok, hf_tok):
        prompt, ids = tok.encode(prompt_text), tok.encode(text, add_bos=False)
        detok = detokenizer_for(tok, prompt)
        deltas = [detok.push(i) for i in ids]
        assert "".join(deltas) + detok.flush() == completion(tok, prompt, ids).rstrip("\ufffd")
        assert not any(d.endswith("\ufffd") for d in deltas)


def test_a_context_ending_inside_a_character_leaves_it_to_the_completion():
    """A client continuing a reply from its ids, cut inside a character: the character the first generated
    token completes was lost, with byte fallback the next word's space too (a review). '中' is E4 B8 AD."""
    byte_level = HFTokenizer(byte_bpe_tokenizer())
    b = byte_level._tok.token_to_id  # byte-level alphabet: one token per byte
    detok = detokenizer_for(byte_level, [b("a"), b("ä"), b("¸")])
    assert "".join([detok.push(b("Ń")), detok.push(b("b")), detok.flush()]) == "中b"
    fallback = HFTokenizer(sentencepiece_tokenizer())
    t = fallback._tok.token_to_id
    detok = detokenizer_for(fallback, [1, t("▁a"), t("<0xE4>"), t("<0xB8>")])
    assert "".join([detok.push(t("<0xAD>")), detok.push(t("▁fox")), detok.flush()]) == "中 fox"
    # a context ending in a real U+FFFD (its bytes complete) keeps it: the completion starts after it
    detok = detokenizer_for(byte_level, byte_level.encode("ok\ufffd", add_bos=False))
    assert "".join([detok.push(b("b")), detok.flush()]) == "b"


def test_a_byte_run_made_invalid_by_a_later_byte_streams_what_the_whole_decode_adds(sp_tok):
    """ByteFallback reads C3 A9 as 'é' but C3 A9 FF as three U+FFFD: the stream held the run until a
    non-byte id ended it, so it does not read 'é' then two U+FFFD (a review)."""
    t = sp_tok._tok.token_to_id
    prompt, ids = sp_tok.encode("The"), [t("<0xC3>"), t("<0xA9>"), t("<0xFF>"), t("▁fox")]
    detok = detokenizer_for(sp_tok, prompt)
    deltas = [detok.push(i) for i in ids]
    assert deltas == ["", "", "", "\ufffd\ufffd\ufffd fox"]
    assert "".join(deltas) + detok.flush() == completion(sp_tok, prompt, ids)
    assert sp_tok.byte_fallback_ids == {t(f"<0x{b:02X}>") for b in range(256)}
    assert HFTokenizer(byte_bpe_tokenizer()).byte_fallback_ids == frozenset()  # byte-level: no runs


@settings(max_examples=150, deadline=None)
@given(st.lists(st.one_of(st.integers(0x00, 0xFF).map(lambda b: f"<0x{b:02X}>"),
                          st.sampled_from(["▁fox", "▁the", "e", "é"])), max_size=12))
def test_any_mix_of_byte_and_word_ids_streams_what_the_whole_decode_adds(sp_tok, pieces):
    ids = [sp_tok._tok.token_to_id(p) for p in pieces]
    ids = [i for i in ids if i is not None]
    prompt = sp_tok.encode("The")
    detok = detokenizer_for(sp_tok, prompt)
    deltas = [detok.push(i) for i in ids]
    pending = codecs.getincrementaldecoder("utf-8")("replace")
    pending.decode(b"".join(sp_tok.bytes_of(i) for i in prompt + ids))
    left, whole = len(pending.getstate()[0]), len(ids)  # the bytes of a character the ids end inside
    while left > 0:  # its ids are left out
        whole -= 1
        left -= len(sp_tok.bytes_of(ids[whole]))
    assert "".join(deltas) + detok.flush() == completion(sp_tok, prompt, ids[:whole])


def test_token_text_is_what_a_token_adds_after_other_text(sp_tok, hf_tok):
    the = sp_tok.encode("the", add_bos=False)[0]  # '▁the' (or '▁t'): a word's first piece
    assert sp_tok.token_text(the).startswith(" t") and sp_tok.decode([the]).startswith("t")
    assert sp_tok.token_text(sp_tok.eos_token_ids.copy().pop()) == "</s>"  # specials spelled
    for i in hf_tok.encode("the quick fox", add_bos=False):
        assert hf_tok.token_text(i) == hf_tok.decode([i])  # byte-level: a token's text is its own


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=20))
@example("é ✓ 𝄞")
def test_bytes_of_each_token_join_into_the_text(sp_tok, hf_tok, text):
    """bytes_of gives a token's raw bytes, part of a character included (byte-level pieces through the
    GPT-2 table, <0xHH> byte-fallback tokens as that byte)."""
    ids = hf_tok.encode(text, add_bos=False)
    assert b"".join(hf_tok.bytes_of(i) for i in ids) == text.encode()
    byte = ByteTokenizer()
    assert b"".join(byte.bytes_of(i) for i in byte.encode(text)) == text.encode()
    ids = sp_tok.encode(text, add_bos=False)  # a Metaspace '▁' first word gains its space
    joined = b"".join(sp_tok.bytes_of(i) for i in ids)
    assert joined == (" " + text).encode() or joined == text.encode()


def test_a_byte_fallback_token_is_its_byte(sp_tok):
    ids = sp_tok.encode("𐀀", add_bos=False)  # outside the tiny vocabulary: 4 <0xHH> tokens (after '▁')
    assert [sp_tok.bytes_of(i) for i in ids][-4:] == [b"\xf0", b"\x90", b"\x80", b"\x80"]


SPECIALS = ["<|start_header_id|>", "<|end_header_id|>"]  # added special tokens, as Llama-3's


def with_specials(tokenizer) -> HFTokenizer:
    """`tokenizer` plus two added special tokens and an added plain one (spelled whether skipped or not)."""
    tokenizer.add_special_tokens(SPECIALS)
    tokenizer.add_tokens(["<|plain|>"])
    return HFTokenizer(tokenizer, bos_token="<s>", eos_tokens=("</s>",))


@pytest.fixture(scope="module")
def special_toks():
    byte_level = with_specials(byte_bpe_tokenizer(bos_post_processor=True))
    return byte_level, with_specials(sentencepiece_tokenizer())


def spelled_completion(tok, prompt_ids: list[int], ids: list[int]) -> str:
    """completion() with special tokens spelled: the whole decode past the prompt's."""
    whole = tok.decode(prompt_ids + ids, skip_special_tokens=False)
    return whole[len(tok.decode(prompt_ids, skip_special_tokens=False)):]


def test_a_completion_not_skipping_special_tokens_spells_them(special_toks):
    for tok in special_toks:
        prompt, start = tok.encode("The quick"), tok.encode(SPECIALS[0], add_bos=False)
        ids = tok.encode(" fox", add_bos=False) + start + tok.encode(" jumps", add_bos=False) + [1]
        detok = detokenizer_for(tok, prompt, skip_special_tokens=False)
        streamed = "".join(detok.push(i) for i in ids) + detok.flush()
        assert streamed == spelled_completion(tok, prompt, ids)
        assert streamed.replace(" ", "") == "fox<|start_header_id|>jumps<s>"  # Metaspace spaces differ
        skipped = detokenizer_for(tok, prompt)
        assert "".join(skipped.push(i) for i in ids) + skipped.flush() == completion(tok, prompt, ids)


@settings(max_examples=60, deadline=None)
@given(st.text(min_size=1, max_size=12),
       st.lists(st.one_of(st.text(max_size=8), st.sampled_from([*SPECIALS, "<s>", "</s>", "<|plain|>"])),
                max_size=8))
@example("héllo", ["<|start_header_id|>", "wörld", "</s>", " ✓"])
def test_a_completion_spelling_special_tokens_streams_what_the_whole_decode_adds(special_toks, prompt_text,
                                                                                 pieces):
    """Specials sampled between words (ids of each piece in turn): the deltas join into the whole decode's
    text with specials spelled, and none ends in half a character."""
    for tok in special_toks:
        prompt = tok.encode(prompt_text)
        ids = [i for piece in pieces for i in tok.encode(piece, add_bos=False)]
        detok = detokenizer_for(tok, prompt, skip_special_tokens=False)
        deltas = [detok.push(i) for i in ids]
        assert "".join(deltas) + detok.flush() == spelled_completion(tok, prompt, ids)
        assert not any(d.endswith("\ufffd") for d in deltas)


@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=32), st.lists(st.sampled_from([0, 1, 2, 300]), max_size=4), st.randoms())
def test_a_byte_table_has_no_special_text_to_spell(data, specials, rnd):
    """The byte tokenizer's special and unused ids have no spelling: skipped or not, they add nothing (as
    their token_text)."""
    tok = ByteTokenizer(vocab_size=512)
    ids = [b + 3 for b in data]
    for special in specials:
        ids.insert(rnd.randint(0, len(ids)), special)
    detok = detokenizer_for(tok, [1], skip_special_tokens=False)
    assert isinstance(detok, Utf8Detokenizer)
    text = "".join(detok.push(i) for i in ids) + detok.flush()
    assert tok.decode(ids, skip_special_tokens=False) == tok.decode(ids)
    assert text == complete_text(tok.decode_bytes(ids))
    assert all(tok.token_text(s) == "" for s in specials)
