"""The core's masks where a grammar forces text holding an added token's text (server/engine/
forced_specials.py), over the tokenizer with <tool_call> (special) and </tool_call> (added, not special):
llguidance's own mask there is the token alone, which its matcher refuses; the core's mask is the text's
plain spellings, every token it allows is taken, and following it writes the text. A mask whose special
token the grammar takes (a structural tag's trigger or begin, EOS where the grammar may end) is llguidance's
own."""

from __future__ import annotations

import time

import llguidance
import pytest
from model_fixtures import byte_bpe_tokenizer

from server.api.protocol import CompletionRequest
from server.api.structured_output import grammar_of, validate
from server.engine.forced_specials import ForcedSpecials
from server.engine.grammar import LIMITS, Grammars, vocabulary
from server.model.tokenizer import HFTokenizer
from tests.test_api_structural_special import CALL, CALL_ID, END, END_ID, HERMES, HF, ids

EOS = 2
TAGGED = {"type": "object", "properties": {"tag": {"enum": [f"{CALL}x", f"{CALL}y"]}}, "required": ["tag"],
          "additionalProperties": False}
FORCED = {  # a request's structured output -> the text its grammar forces
    "json_const": ({"json": {"const": CALL}}, f'"{CALL}"'),
    "json_enum": ({"json": TAGGED}, f'{{"tag":"{CALL}'),
    "choice": ({"choice": [f"{CALL}a", f"{CALL}b"]}, CALL),
    "regex": ({"regex": f"{CALL}!{END}"}, f"{CALL}!{END}"),
    "lark": ({"grammar": f'start: "a{END}" "{CALL}"'}, f"a{END}{CALL}"),
    "eos_text": ({"grammar": 'start: "a</s>b"'}, "a</s>b"),
}
GRAMMARS = Grammars(HF, HF.vocab_size, HF.eos_token_ids)


def grammar(structured_outputs: dict) -> str:
    return grammar_of(CompletionRequest.model_validate({"prompt": "hi", "structured_outputs":
                                                        structured_outputs}), HF).text


def matcher(text: str) -> llguidance.LLMatcher:
    m = llguidance.LLMatcher(vocabulary(HF, HF.eos_token_ids), text, log_level=0, limits=LIMITS)
    assert not m.is_error(), m.get_error()
    return m


def ids_of(bits) -> set[int]:
    """A (1, W) mask -> its allowed ids."""
    value = int.from_bytes(bits.numpy().tobytes(), "little")
    return {t for t in range(bits.shape[1] * 32) if value >> t & 1}


def core_mask(m: llguidance.LLMatcher) -> set[int]:
    return ids_of(GRAMMARS.masks([m]))


def own_mask(m: llguidance.LLMatcher) -> set[int]:
    value = int.from_bytes(m.compute_bitmask(), "little")
    return {t for t in range(HF.vocab_size) if value >> t & 1}


@pytest.mark.parametrize("case", list(FORCED))
def test_following_the_core_mask_writes_the_forced_text(case):
    """At each step every token the mask allows is taken (on a copy); the lowest goes on, and the text
    written starts with the forced text, its added tokens spelled."""
    so, text = FORCED[case]
    m, written = matcher(grammar(so)), []
    while not m.is_stopped() and len(written) < 40:
        allowed = core_mask(m)
        assert allowed and all(m.deep_copy().consume_token(t) for t in allowed), (written, allowed)
        assert not allowed & {CALL_ID, END_ID} and (EOS not in allowed or m.is_accepting())
        written.append(min(allowed))
        assert m.consume_token(written[-1]), m.get_error()
    assert HF.decode(written, skip_special_tokens=False).startswith(text)


@pytest.mark.parametrize("case", [c for c in FORCED if c != "json_enum"])  # its text is forced at once
def test_the_api_checks_the_grammar_in_the_core_mask(case):
    """The check follows the mask's lowest id: llguidance's own mask made it the refused token, a 400."""
    validate(grammar_of(CompletionRequest.model_validate({"prompt": "hi", "structured_outputs":
                                                          FORCED[case][0]}), HF), HF)


def test_only_a_mask_forcing_a_refused_token_is_respelled():
    """The forced mask is the plain tokens that start the text, then llguidance forces the rest; a mask
    whose special token the grammar takes (a structural tag's trigger or begin, EOS where the grammar may
    end) is llguidance's own."""
    m = matcher(grammar({"regex": f"{CALL}!"}))
    assert own_mask(m) == {CALL_ID}
    starts = {t for t in range(HF.vocab_size) if t not in (CALL_ID, END_ID)
              and CALL.startswith(HF.decode([t], skip_special_tokens=False) or "\0")}
    assert core_mask(m) == starts == set(ids("<"))
    assert m.consume_token(ids("<")[0]) and core_mask(m) == own_mask(m)
    g = grammar({"structural_tag": HERMES})
    for before in [[], ids("Sure. "), [CALL_ID], [CALL_ID, *ids('\n{"city":"x"}\n')]]:
        m = matcher(g)
        assert all(m.consume_token(t) for t in before)
        assert core_mask(m) == own_mask(m), before
    forced_begin = matcher(grammar({"structural_tag": {"format": {
        "type": "tag", "begin": CALL, "content": {"type": "const_string", "value": "1"}, "end": END}}}))
    assert core_mask(forced_begin) == own_mask(forced_begin) == {CALL_ID, *ids("<")}
    ended = matcher(grammar({"regex": "ab?"}))
    assert ended.consume_token(ids("a")[0]) and EOS in core_mask(ended) == own_mask(ended)


def best_ms(f, times: int = 5) -> float:
    best = float("inf")
    for _ in range(times):
        start = time.perf_counter()
        f()
        best = min(best, (time.perf_counter() - start) * 1e3)
    return best


def test_rows_of_many_special_tokens_cost_the_respelling_little(monkeypatch):
    """256 rows of a grammar over Llama 3's 256 reserved tokens (each row many special tokens, no plain one
    among the first ids): such rows are told apart in numpy, not by listing each row's tokens in Python (a
    review: 16 ms a step against 0.4 ms of masks)."""
    tok = byte_bpe_tokenizer()
    names = [f"<|reserved_special_token_{i}|>" for i in range(256)]
    tok.add_special_tokens(names)
    hf = HFTokenizer(tok, bos_token="<s>", eos_tokens=("</s>",), pad_token="<pad>")
    first, last = hf.added_tokens[names[0]], hf.added_tokens[names[-1]]
    grammars = Grammars(hf, hf.vocab_size, hf.eos_token_ids)
    text = llguidance.LLMatcher.grammar_from_lark(f"start: <[{first}-{last}]>+")
    m = llguidance.LLMatcher(vocabulary(hf, hf.eos_token_ids), text, log_level=0, limits=LIMITS)
    matchers = [m.deep_copy() for _ in range(256)]
    grammars.masks(matchers)  # the vocabulary and its ForcedSpecials built
    with_spell = best_ms(lambda: grammars.masks(matchers))
    monkeypatch.setattr(ForcedSpecials, "spell", lambda *args: None)
    masks_alone = best_ms(lambda: grammars.masks(matchers))
    assert with_spell - masks_alone < max(2.0, masks_alone), (with_spell, masks_alone)
