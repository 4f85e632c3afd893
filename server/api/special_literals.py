"""A structural tag's literals over the model's special tokens: where a literal (a trigger, a begin, an end, a
const_string, a separator) holds the text of one of the tokenizer's special tokens, the grammar takes that
token there, or the text spelled in plain pieces.

llguidance reads every added token of a tokenizer.json as special (Qwen2.5's <tool_call>, though its
tokenizer.json calls it no special token; Llama 3's <|python_tag|>): its bytes are a marker byte (0xFF) and
its text, which no text holds, so neither free text nor a quoted literal ever takes it: a model trained to
write <tool_call> as one token would have to spell it (where a literal is forced, the core's mask offers its
spellings: server/engine/forced_specials.py). So a special token's text in a literal becomes
`(<[id]> | "text")`. Taking the spelling too is sound, and is xgrammar's behaviour (it reads an added token
as its text): both read the same once the reply spells special tokens, which a grammar that takes one the
reply would drop asks for (Literals.special: skip_special_tokens defaults to false).

The EOS ids stay text: sampling one ends the choice (a forced literal holding EOS's text is spelled, as
forced_specials.py spells any). The byte tokenizer's special tokens have no text: its literals stay text.
"""

from __future__ import annotations

import json
import weakref
from dataclasses import dataclass

import llguidance


@dataclass(frozen=True)
class SpecialTokens:
    """The special tokens a literal may hold: text -> id; their texts' lengths, the longest first; the ids a
    reply drops unless it spells special tokens (the tokenizer's skipped_token_ids)."""

    ids: dict[str, int]
    lengths: tuple[int, ...] = ()
    skipped: frozenset[int] = frozenset()

    def pieces(self, text: str) -> list[tuple[str, int | None]]:
        """`text` split at the special tokens' texts, leftmost first and the longest there (as a tokenizer
        matches added tokens): (piece, the token's id, or None for plain text). A lookup per position and
        length, no pattern: a regex of a tokenizer's 100K added tokens took 5.6 s to compile (a review)."""
        pieces, at, i = [], 0, 0
        while i < len(text):
            found = next((text[i:i + n] for n in self.lengths if text[i:i + n] in self.ids), None)
            if found is None:
                i += 1
                continue
            if i > at:
                pieces.append((text[at:i], None))
            pieces.append((found, self.ids[found]))
            i = at = i + len(found)
        if at < len(text) or not pieces:
            pieces.append((text[at:], None))
        return pieces


NO_SPECIAL_TOKENS = SpecialTokens({})

_known: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> its SpecialTokens


def special_tokens(tokenizer, vocab: llguidance.LLTokenizer) -> SpecialTokens:
    """The tokenizer's added tokens that `vocab` (its llguidance vocabulary) reads as special, but EOS: built
    once per tokenizer."""
    known = _known.get(tokenizer)
    if known is None:
        ids = {text: i for text, i in tokenizer.added_tokens.items()
               if text and i not in tokenizer.eos_token_ids and i < vocab.vocab_size
               and vocab.is_special_token(i)}
        lengths = tuple(sorted({len(t) for t in ids}, reverse=True))
        skipped = frozenset(tokenizer.skipped_token_ids) & frozenset(ids.values())
        known = _known[tokenizer] = SpecialTokens(ids, lengths, skipped)
    return known


class Literals:
    """One grammar's literals as Lark over `specials`; `special`: whether it takes a special token the reply
    drops unless it spells special tokens."""

    def __init__(self, specials: SpecialTokens = NO_SPECIAL_TOKENS) -> None:
        self.specials = specials
        self.special = False

    def lark(self, text: str) -> str:
        """`text` as a Lark expression: quoted plain pieces, each special token's text the token or its
        spelling ("": the empty string)."""
        return " ".join(self._piece(piece, token) for piece, token in self.specials.pieces(text))

    def leading(self, text: str) -> tuple[str, str] | None:
        """(the token's Lark, the rest of `text`) where `text` starts with a special token's text."""
        (piece, token), *_ = self.specials.pieces(text)
        return None if token is None else (self.token(token), text[len(piece):])

    def token(self, token: int) -> str:
        self.special = self.special or token in self.specials.skipped
        return f"<[{token}]>"

    def _piece(self, piece: str, token: int | None) -> str:
        return json.dumps(piece) if token is None else f"({self.token(token)} | {json.dumps(piece)})"
