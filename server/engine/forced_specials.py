"""A grammar's forced text that holds an added token's text: its mask allows the text's spellings, not the
token the grammar would refuse.

llguidance reads every added token of a tokenizer.json as special: its bytes are a marker byte (0xFF) and its
text, which no text holds, so a grammar's text never takes it. Where a grammar forces text (a JSON schema's
const or enum, a choice's common start, a regex's or a Lark grammar's literal, a structural tag's begin or
end), llguidance's mask is the first token of that text's canonical tokenization, which it reads through the
tokenizer.json with the added tokens matched: where the text holds "<tool_call>" (or EOS's "</s>"), the mask
is that token alone, which the grammar then refuses ("doesn't satisfy the grammar; forced bytes"): the API's
check refuses the grammar, or the choice fails mid-reply. So a mask row that is one special token its
matcher refuses allows instead each plain token that spells a start of the forced text (the model picks one;
llguidance forces the rest canonically again). A grammar that means the token (<[id]>: a structural tag's
literal, special_literals.py) has it taken as it is.

Rather than llguidance's no_forcing option, which lets the model spell every forced text of every grammar
(its docs: lower quality and speed), or a TokenizerWrapper whose encoder spells added tokens (llguidance's
mask threads would call Python at every forced step, and its reading of tokenizer.json be redone here).
"""

from __future__ import annotations

from collections.abc import Iterable

import llguidance
import numpy as np
import torch

# the mask words whose plain tokens tell a row of many tokens at a glance: byte-level and SentencePiece
# vocabularies hold their byte tokens among the first 256 ids, which free text allows
FIRST_WORDS = 8


class ForcedSpecials:
    """A vocabulary's special tokens with text (as mask words and bits) and its plain tokens by their bytes.
    The byte tokenizer's special tokens have no text: no forced text holds one, and its masks stay as
    llguidance computes them."""

    def __init__(self, vocab: llguidance.LLTokenizer) -> None:
        """~0.3 s for a 128K-token vocabulary: built with it, once (server/engine/grammar.py vocabulary)."""
        special, self.spellings = set(), {}  # spellings: bytes -> the plain tokens of exactly those bytes
        for token in range(vocab.vocab_size):
            text = vocab.decode_bytes([token])  # (a special token's without its marker)
            if vocab.is_special_token(token):
                special.update([token] if text else [])
            elif text:
                self.spellings.setdefault(text, []).append(token)
        self.longest = max(map(len, self.spellings), default=0)
        self.eos = frozenset(vocab.eos_tokens)
        self.word_ids = sorted({t // 32 for t in special})
        self.words = np.array(self.word_ids, dtype=np.int64)  # (U,) the mask words holding special tokens
        self.bits = _words_of(special, self.word_ids)  # (U,) int32: their special tokens' bits
        first = list(range(min(FIRST_WORDS, (vocab.vocab_size + 31) // 32)))
        self.first_plain = _words_of(set(range(min(32 * len(first), vocab.vocab_size))) - special, first)

    def spell(self, matchers: list[llguidance.LLMatcher | None], bits: torch.Tensor) -> None:
        """Rewrites in place each row g of `bits` (G, W) int32 host that is one special token matchers[g]
        refuses (llguidance's forced mask is one token) as the forced text's spellings (None: a row of every
        token). A row allowing a plain token among the first ids is no such row: the free text of a
        structural tag allows its trigger's token beside them at every step, which costs no check then; nor
        is a row of several special tokens (a grammar over Llama 3's 256 reserved ones: told apart in numpy,
        16 ms a step at 256 rows where each row's tokens were listed in Python, in a review)."""
        if not self.word_ids:
            return
        words = bits.numpy()
        hits = (words[:, self.words] & self.bits).view(np.uint32)  # (G, U) the special tokens allowed
        plain = (words[:, :len(self.first_plain)] & self.first_plain).any(1)  # (G,)
        one_bit = ((hits & (hits - np.uint32(1))) == 0).all(1) & ((hits != 0).sum(1) == 1)  # (G,)
        rows = [g for g in np.flatnonzero(one_bit & ~plain).tolist() if matchers[g] is not None]
        for g, row_hits in zip(rows, hits[rows].tolist(), strict=True):
            (token,) = self._tokens(row_hits)
            if self._refused(matchers[g], token):
                self._spell_row(matchers[g], words[g])

    def _tokens(self, row_hits: list[int]) -> list[int]:
        """The special tokens of one row's hits (U,)."""
        tokens = []
        for word, value in zip(self.word_ids, row_hits, strict=True):
            while value:
                low = value & -value
                tokens.append(32 * word + low.bit_length() - 1)
                value ^= low
        return tokens

    def _refused(self, matcher: llguidance.LLMatcher, token: int) -> bool:
        """Whether the mask's `token` is one the matcher refuses. EOS: llguidance's check of tokens refuses
        it even where the grammar may end, which is where its mask allows it."""
        if token in self.eos and matcher.is_accepting():
            return False
        return not matcher.validate_tokens([token])

    def _spell_row(self, matcher: llguidance.LLMatcher, row: np.ndarray) -> None:
        """row (W,) int32 -> the plain tokens whose bytes start the forced text and that the matcher takes
        (unchanged where none does: the choice fails on the refused token, as before)."""
        forced = matcher.compute_ff_bytes()
        spelled = [t for n in range(1, min(len(forced), self.longest) + 1)
                   for t in self.spellings.get(forced[:n], ()) if matcher.validate_tokens([t])]
        if spelled:
            words = sorted({t // 32 for t in spelled})
            row[:] = 0
            row[words] = _words_of(spelled, words)


def _words_of(tokens: Iterable[int], words: list[int]) -> np.ndarray:
    """(len(words),) int32: word w's bits of `tokens` (those in other words are left out)."""
    values = dict.fromkeys(words, 0)
    for t in tokens:
        if t // 32 in values:
            values[t // 32] |= 1 << t % 32
    return np.array(list(values.values()), dtype=np.uint32).view(np.int32)
