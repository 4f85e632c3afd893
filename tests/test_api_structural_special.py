"""Structural tags over a tokenizer with special tokens: where a trigger, begin, end or other literal holds
the text of an added token (<tool_call> here special, as Hermes-2-Pro's; </tool_call> not, as Qwen2.5's:
llguidance reads both as special), the grammar takes that token there or the text spelled, and free text
elsewhere never takes it (checked with an llguidance matcher over the tokenizer's vocabulary); over the
byte tokenizer the literals stay text and the structures form keeps llguidance's StructTag meaning; the
reply spells the tokens unless skip_special_tokens says otherwise; and a checkpoint rewired to write
<tool_call> as its one token follows a structural tag end to end."""

from __future__ import annotations

import json
import time

import llguidance
import pytest
from model_fixtures import byte_bpe_tokenizer, hf_config, write_hf_checkpoint
from tokenizers import AddedToken

from server.api.app import create_app
from server.api.grammar_texts import compact_schema
from server.api.protocol import ChatCompletionRequest, CompletionRequest
from server.api.sampling import sampling_params
from server.api.special_literals import special_tokens
from server.api.structured_output import grammar_of, validate
from server.engine.grammar import LIMITS, vocabulary
from server.model.tokenizer import ByteTokenizer, HFTokenizer
from tests.engine_helpers import started_engine
from tests.test_api_special_tokens import bigram_chain
from tests.test_api_structured_output_engine import text_of

pytestmark = pytest.mark.timeout(300)

CALL, END = "<tool_call>", "</tool_call>"
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
        "additionalProperties": False}
INT = {"type": "integer"}
# Hermes' form: the trigger is the begin's first token, the end holds the other after a newline
HERMES = {"structures": [{"begin": f"{CALL}\n", "schema": CITY, "end": f"\n{END}"}], "triggers": [CALL]}


def added_tokenizer():
    """The byte-level BPE with <tool_call> (special) and </tool_call> (an added token, not special)."""
    tok = byte_bpe_tokenizer()
    tok.add_special_tokens([CALL])
    tok.add_tokens([AddedToken(END, special=False)])
    return tok


HF = HFTokenizer(added_tokenizer(), bos_token="<s>", eos_tokens=("</s>",), pad_token="<pad>")
CALL_ID, END_ID = HF.added_tokens[CALL], HF.added_tokens[END]


def tag_grammar(tag: dict, tokenizer=HF):
    g = grammar_of(CompletionRequest.model_validate({"prompt": "hi", "structured_outputs": {
        "structural_tag": tag}}), tokenizer)
    validate(g, tokenizer)
    return g


def matcher(text: str, tokenizer=HF) -> llguidance.LLMatcher:
    m = llguidance.LLMatcher(vocabulary(tokenizer, tokenizer.eos_token_ids), text, log_level=0,
                             limits=LIMITS)
    assert not m.is_error(), m.get_error()
    return m


def allowed(m: llguidance.LLMatcher) -> set[int]:
    bits = int.from_bytes(m.compute_bitmask(), "little")
    return {t for t in range(HF.vocab_size) if bits >> t & 1}


def ids(*parts: str | int) -> list[int]:
    """Token ids: a str's as the tokenizer encodes it (its added tokens' texts as them), an int as is."""
    out = []
    for part in parts:
        out += [part] if isinstance(part, int) else HF.encode(part, add_bos=False)
    return out


def spelled(text: str) -> list[int]:
    """`text`'s plain pieces, one character at a time: never an added token."""
    return [t for ch in text for t in HF.encode(ch, add_bos=False)]


def follows(text: str, tokens: list[int]) -> bool:
    """Whether the grammar's mask allows each token in turn and the grammar may end after them."""
    m = matcher(text)
    for t in tokens:
        if t not in allowed(m) or not m.consume_token(t):
            return False
    return m.is_accepting()


def takes(text: str, tokens: list[int]) -> bool:
    """Whether the grammar takes the tokens and may end after them, mask aside: where it forces text,
    llguidance's mask offers that text's own tokens only, though any spelling of it is taken."""
    m = matcher(text)
    return all(m.consume_token(t) for t in tokens) and m.is_accepting()


def mask_after(text: str, tokens: list[int]) -> set[int]:
    m = matcher(text)
    assert all(m.consume_token(t) for t in tokens), m.get_error()
    return allowed(m)


# ---- the grammar ----------------------------------------------------------------------------------------

FORMAT_HERMES = {"format": {"type": "triggered_tags", "triggers": [CALL], "tags": [
    {"begin": f"{CALL}\n", "content": {"type": "json_schema", "json_schema": CITY}, "end": f"\n{END}"}]}}


@pytest.mark.parametrize("tag", [HERMES, FORMAT_HERMES], ids=["structures", "format"])
def test_a_special_trigger_is_taken_wherever_a_trigger_may_start(tag):
    g = tag_grammar(tag)
    assert g.special and f"<[{CALL_ID}]>" in g.text
    for before in ["", "Sure. ", 'Two: <tool_call>\n{"city":"Oslo"}\n</tool_call> and ']:
        assert CALL_ID in mask_after(g.text, ids(before)), before
    call = [CALL_ID, *ids('\n{"city":"Paris"}\n'), END_ID]
    assert follows(g.text, [*ids("Checking. "), *call, *ids(" Done.")])
    assert follows(g.text, [*call, *call])
    assert not follows(g.text, [CALL_ID, *ids('\n{"town":"Paris"}')])  # the token opens the structure
    assert not follows(g.text, [CALL_ID, *ids(" hello")])


@pytest.mark.parametrize("tag", [HERMES, FORMAT_HERMES], ids=["structures", "format"])
def test_the_spelled_trigger_opens_a_structure_too(tag):
    g = tag_grammar(tag).text
    assert takes(g, spelled(f'Ok {CALL}\n{{"city":"Rome"}}\n{END} bye'))
    assert not takes(g, spelled(f'{CALL}\n{{"town":"Rome"}}'))


@pytest.mark.parametrize("tag", [HERMES, FORMAT_HERMES], ids=["structures", "format"])
def test_free_text_never_takes_a_special_token_outside_a_trigger(tag):
    g = tag_grammar(tag).text
    specials = {CALL_ID, END_ID, HF.bos_token_id, HF.pad_token_id}
    inside = [[CALL_ID, *ids('\n{"city":"')],  # in a JSON string
              [CALL_ID, *ids('\n{"city":"x"}\n')]]  # where the end is due: its token, not the trigger's
    for tokens in inside:
        assert not mask_after(g, tokens) & (specials - {END_ID}), tokens
    assert END_ID not in mask_after(g, ids("Sure. "))  # the end outside a structure
    assert not mask_after(g, ids("Sure. ")) & {HF.bos_token_id, HF.pad_token_id}
    other = tag_grammar({"structures": [{"begin": "<f>", "schema": INT, "end": "</f>"}], "triggers": ["<f"]})
    assert not other.special
    for before in ["", "text ", "<f>1</f> then "]:
        assert not mask_after(other.text, ids(before)) & specials, before


SHORT_TRIGGER = {"structures": [{"begin": f"{CALL}\n", "schema": CITY, "end": f"\n{END}"}],
                 "triggers": ["<tool"]}
FORMAT_SHORT_TRIGGER = {"format": {"type": "triggered_tags", "triggers": ["<tool"], "tags": [
    {"begin": f"{CALL}\n", "content": {"type": "json_schema", "json_schema": CITY}, "end": f"\n{END}"}]}}


@pytest.mark.parametrize("tag", [SHORT_TRIGGER, FORMAT_SHORT_TRIGGER], ids=["structures", "format"])
def test_a_trigger_that_starts_a_special_tokens_text_takes_the_token(tag):
    """A trigger shorter than the special token whose text starts the begin: free text ends at the token too
    (it was spelled only: a model writing <tool_call> as its token could not open the tag)."""
    g = tag_grammar(tag)
    assert g.special
    for before in ["", "Sure. ", f'{CALL}\n{{"city":"Oslo"}}\n{END} and ']:
        assert CALL_ID in mask_after(g.text, ids(before)), before
    call = [CALL_ID, *ids('\n{"city":"Paris"}\n'), END_ID]
    assert follows(g.text, [*ids("Checking. "), *call, *ids(" Done.")])
    assert not follows(g.text, [CALL_ID, *ids(" hello")])
    assert takes(g.text, spelled(f'Ok {CALL}\n{{"city":"Rome"}}\n{END} bye'))
    assert not takes(g.text, spelled('Ok <tool_x> bye'))  # the spelled trigger still opens the tag


def test_free_text_ends_at_a_special_literals_token_or_its_spelling():
    """Free text before a const_string that starts with a special token's text (here the one an any_text
    in a sequence runs up to) ends at that token, or at the literal's spelling; no other special token."""
    fmt = {"format": {"type": "sequence", "elements": [
        {"type": "any_text"}, {"type": "const_string", "value": f"{END}!"}]}}
    g = tag_grammar(fmt).text
    assert END_ID in mask_after(g, ids("Some text ")) and CALL_ID not in mask_after(g, ids("Some text "))
    assert follows(g, [*ids("Some text "), END_ID, *ids("!")])
    assert not follows(g, [*ids("Some text "), END_ID, *ids("more")])
    assert takes(g, spelled(f"Some text{END}!"))
    assert not takes(g, spelled(f"Some text{END}! more"))  # the first end written ends the text


def test_a_forced_special_literal_takes_the_token_or_its_spelling():
    """A literal the grammar forces (a tag's begin with nothing before it): its text alone made llguidance's
    mask offer only the forced text's own token, <tool_call>, which the quoted literal then refused."""
    fmt = {"format": {"type": "tag", "begin": CALL, "content": {"type": "json_schema", "json_schema": INT},
                      "end": END}}
    g = tag_grammar(fmt).text
    assert mask_after(g, []) == {CALL_ID, *ids("<")}
    assert follows(g, [CALL_ID, *ids("12"), END_ID])
    assert takes(g, spelled(f"{CALL}12{END}"))
    assert not follows(g, [CALL_ID, *ids("12"), CALL_ID])


def test_a_literal_holding_special_texts_splits_at_them():
    fmt = {"format": {"type": "sequence", "elements": [
        {"type": "const_string", "value": f"a{CALL}b{END}"}, {"type": "json_schema", "json_schema": INT}]}}
    g = tag_grammar(fmt).text
    assert follows(g, [*ids("a"), CALL_ID, *ids("b"), END_ID, *ids("7")])
    assert takes(g, spelled(f"a{CALL}b{END}7"))
    assert takes(g, [*ids("a"), CALL_ID, *spelled(f"b{END}7")])


def test_eos_stays_text():
    """A literal holding EOS's text is not its token: sampling EOS ends the choice. BOS is a special token
    like the others."""
    specials = special_tokens(HF, vocabulary(HF, HF.eos_token_ids)).ids
    assert specials == {CALL: CALL_ID, END: END_ID, "<s>": HF.bos_token_id, "<pad>": HF.pad_token_id}


# ---- the byte tokenizer ---------------------------------------------------------------------------------

BYTES = ByteTokenizer()


def byte_matcher_follows(text: str, line: str) -> bool:
    m = matcher(text, BYTES)
    return all(m.consume_token(t) for t in BYTES.encode(line, add_bos=False)) and m.is_accepting()


def test_the_byte_tokenizers_literals_stay_text():
    for tag in (HERMES, FORMAT_HERMES):
        g = tag_grammar(tag, BYTES)
        assert not g.special and "<[" not in g.text


def test_the_structures_form_keeps_structtags_meaning():
    """The structures form is built as a triggered_tags tree; over the byte tokenizer it takes exactly what
    llguidance's StructTag (triggers as text) takes."""
    structures = [{"begin": "<f=a>", "schema": INT, "end": "</f>"},
                  {"begin": "<function=b>", "schema": CITY, "end": ""},
                  {"begin": f"{CALL}\n", "schema": CITY, "end": f"\n{END}"}]
    tag = {"structures": structures, "triggers": ["<function", "<f", CALL]}
    ours = tag_grammar(tag, BYTES).text
    theirs = llguidance.StructTag.to_grammar([
        llguidance.StructTag(trigger=t, begin=s["begin"], grammar=compact_schema(s["schema"]), end=s["end"])
        for t, s in zip(["<f", "<f", CALL], structures, strict=True)], assume_special=False)
    lines = ["", "free < text", "<f=a>12</f>", "<f=a>x", '<function=b>{"city":"x"} after', "<fun>",
             f'{CALL}\n{{"city":"y"}}\n{END}', f"{CALL} no", '<f=a>1</f><function=b>{"city":""}',
             '<function=b>{ "city":"x"}', "<f=a>1"]
    for line in lines:
        assert byte_matcher_follows(ours, line) == byte_matcher_follows(theirs, line), line


# ---- the reply's text -----------------------------------------------------------------------------------

@pytest.mark.parametrize("fields,skip", [({}, False), ({"skip_special_tokens": True}, True),
                                         ({"skip_special_tokens": False}, False)])
def test_a_grammar_taking_special_tokens_spells_them_unless_asked_not_to(fields, skip):
    for req in (CompletionRequest.model_validate({"prompt": "hi", **fields}),
                ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                                      **fields})):
        params = sampling_params(req, 8, None, HF, grammar=tag_grammar(HERMES))
        assert params.skip_special_tokens is skip
    plain = sampling_params(CompletionRequest.model_validate({"prompt": "hi"}), 8, None, BYTES,
                            grammar=tag_grammar(HERMES, BYTES))
    assert plain.skip_special_tokens is True


# ---- end to end -----------------------------------------------------------------------------------------

WRITTEN = f"The{CALL}1{END}"  # the chain's text, specials spelled


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    """A checkpoint whose greedy reply is The <tool_call> 1 </tool_call> </s>, the tags as their tokens."""
    path = tmp_path_factory.mktemp("ckpt")
    tokenizer = added_tokenizer()
    chain = tokenizer.encode(WRITTEN, add_special_tokens=False).ids
    assert chain[1:4:2] == [CALL_ID, END_ID] and len(chain) == 4
    model = write_hf_checkpoint(path, hf_config("llama", tie_word_embeddings=False))
    bigram_chain(model, [*chain, 2])  # 2: </s>, the checkpoint's EOS
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save(str(path / "tokenizer.json"))
    with started_engine(model=str(path), device="cpu", attention_backend="torch", num_blocks=64) as engine:
        yield create_app(engine)


TAG = {"structures": [{"begin": CALL, "schema": INT, "end": END}], "triggers": [CALL]}
FORMAT = {"format": {"type": "triggered_tags", "triggers": [CALL], "tags": [
    {"begin": CALL, "content": {"type": "json_schema", "json_schema": INT}, "end": END}]}}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path,base,fields", [
    ("/v1/completions", {"prompt": "hello"}, {"response_format": {"type": "structural_tag", **TAG}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}]},
     {"structured_outputs": {"structural_tag": json.dumps(FORMAT)}}),
])
def test_the_model_writes_the_trigger_as_its_token(app, path, base, fields, stream):
    """Its text spells <tool_call> by default; skip_special_tokens true leaves it out (</tool_call>, an
    added token that is not special, stays)."""
    assert text_of(app, path, {**base, **fields}, stream) == (WRITTEN, "stop")
    skipped = text_of(app, path, {**base, **fields, "skip_special_tokens": True}, stream)
    assert skipped == (f"The1{END}", "stop")


@pytest.mark.parametrize("tag", [
    {"structures": [{"begin": CALL, "schema": INT, "end": END}], "triggers": ["<tool"]},
    {"format": {"type": "triggered_tags", "triggers": ["<"], "tags": [
        {"begin": CALL, "content": {"type": "json_schema", "json_schema": INT}, "end": END}]}},
], ids=["structures", "format"])
def test_the_model_writes_the_token_where_the_trigger_starts_its_text(app, tag):
    """The trigger (<tool, <) is shorter than <tool_call>, which the model writes as its token."""
    body = {"prompt": "hello", "structured_outputs": {"structural_tag": tag}}
    assert text_of(app, "/v1/completions", body, False) == (WRITTEN, "stop")


def test_a_tag_taking_only_unskipped_added_tokens_keeps_the_skip_default():
    """</tool_call> is added but not special (Qwen2.5's): skip_special_tokens never drops it, so a grammar
    taking only it keeps the request's default (a review: the default flipped, and the reply then spelled
    EOS with include_stop_str_in_output where the same request without the tag did not)."""
    g = tag_grammar({"structures": [{"begin": "<f>", "schema": INT, "end": END}], "triggers": ["<f"]})
    assert f"<[{END_ID}]>" in g.text and not g.special
    params = sampling_params(CompletionRequest.model_validate({"prompt": "hi"}), 8, None, HF, grammar=g)
    assert params.skip_special_tokens is True


class ManyAdded:
    """special_tokens' view of a tokenizer with 100K added tokens (image codes, reserved ids), EOS id 0."""

    def __init__(self, n: int) -> None:
        self.added_tokens = {f"<|visual token {i:06d}|>": i + 1 for i in range(n)}
        self.eos_token_ids = {0}
        self.skipped_token_ids = frozenset(self.added_tokens.values())


class AllSpecial:
    vocab_size = 200_000

    @staticmethod
    def is_special_token(i: int) -> bool:
        return True


def test_the_special_tokens_of_a_large_added_set_are_found_quickly():
    """One regex over 100K added texts took 5.6 s to compile, on the first structured output of any kind
    (a review); a lookup per position and text length takes none: 0.13-0.21 s here, 0.48-0.59 beside 3 busy
    processes (with the test's tokenizer built inside the timing, against a bound of 1 s), so the bound is
    2.5 s, under half the regex's."""
    tokenizer = ManyAdded(100_000)
    start = time.perf_counter()
    specials = special_tokens(tokenizer, AllSpecial())
    assert specials.pieces("a<|visual token 000007|>b<|visual token 099999|>") == [
        ("a", None), ("<|visual token 000007|>", 8), ("b", None), ("<|visual token 099999|>", 100_000)]
    took = time.perf_counter() - start
    assert took < 2.5, f"{took:.2f} s"
