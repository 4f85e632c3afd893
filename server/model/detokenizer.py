"""Streaming detokenization: text deltas that never end in half a UTF-8 character.

The window trick (as in vLLM / TGI): decode a short window of ids ending at the last emitted position and the
same window plus the new ids; the delta is the difference. A trailing U+FFFD means an incomplete byte
sequence, so the text is held back until later ids complete it. At the end of the stream `flush()` returns
the rest, less an incomplete character at its end: a reply that `max_tokens` (or EOS) cuts inside a
character ends before it, as vLLM's detokenizers end it, not in U+FFFD.
The window starts on the last CONTEXT_IDS ids of the prompt: a SentencePiece-style decoder (Llama-2,
Mistral) drops the leading space of a sequence's first token, so a completion's first token decoded alone
would lose it. Concatenating every delta and `flush()` gives exactly
`decode(context + ids, skip)[len(decode(context, skip)):]` (with no context: `decode(ids, skip)`), `skip`
being the stream's `skip_special_tokens` (False: special tokens are spelled, e.g. `<|start_header_id|>`),
less an incomplete character at its end (a tokenizer with `bytes_of` tells one from a U+FFFD of the text's
own and leaves its ids out; without, the window cannot, and drops a trailing U+FFFD whatever gave it);
a context that ends inside a character leaves that character to the completion that completes it. A
ByteFallback decoder (Llama-2, Mistral) reads a run of <0xHH> ids as one UTF-8 string, or as one U+FFFD a
byte if any of it is invalid: a later byte can rewrite what the run's first bytes gave ('é' from C3 A9 turns
into three U+FFFD once FF follows), so a run is held until an id that is not a byte ends it.

A tokenizer whose ids are bytes (ByteTokenizer, the presets') has a cheaper exact way: `token_bytes` maps each
id to its bytes and the stdlib's incremental UTF-8 decoder holds an incomplete character until it completes,
with the same result as decoding the whole stream. `detokenizer_for` picks it. Its table holds no text for
special ids, their text in `decode` whether skipped or not (the byte tokenizer has no spelling for them).
"""

from __future__ import annotations

import codecs
from typing import Protocol

REPLACEMENT = "\ufffd"
UTF8_DECODER = codecs.getincrementaldecoder("utf-8")  # looked up once: a lookup per stream costs more


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


CONTEXT_IDS = 5  # prompt ids the first window starts on (as vLLM's): enough for a word's spacing


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Decoder, context: list[int] = (), skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens  # False: the text spells special tokens
        self.ids: list[int] = list(context[-CONTEXT_IDS:])  # the context's tail, then the pushed ids
        self.prefix_offset = 0  # start of the decode window
        self.read_offset = len(self.ids)  # ids before this are emitted (or the context's)
        # a context that ends inside a character (a reply cut there, continued from its ids): the ids of that
        # character are the completion's, which completes it (it was lost before: a review)
        self.read_offset -= _unfinished_ids(tokenizer, self.ids)
        self.byte_ids: frozenset[int] = getattr(tokenizer, "byte_fallback_ids", frozenset())

    def push(self, token_id: int) -> str:
        """Add one id; return the new text it completes ("" while a character is still incomplete, or a run
        of byte-fallback ids still open)."""
        self.ids.append(token_id)
        if token_id in self.byte_ids:
            return ""
        return self._delta(final=False)

    def flush(self) -> str:
        """End of stream: return what is held back, less the incomplete character at its end: the ids that
        hold its bytes are left out (by bytes_of; a tokenizer without it: every trailing U+FFFD)."""
        if not hasattr(self.tokenizer, "bytes_of"):
            return self._delta(final=True).rstrip(REPLACEMENT)
        unfinished = _unfinished_ids(self.tokenizer, self.ids)
        if unfinished:  # never emitted: text ending inside a character is held
            del self.ids[len(self.ids) - unfinished:]
        return self._delta(final=True)

    def _unfinished(self, text: str) -> bool:
        """Whether `text` (the window's decode) ends inside a character: a trailing U+FFFD, which the
        tokenizer's bytes (bytes_of) tell from a U+FFFD of the text's own (that one was held to the end of
        the stream, and then dropped: a review's property test)."""
        if not text.endswith(REPLACEMENT):
            return False
        return not hasattr(self.tokenizer, "bytes_of") or _unfinished_ids(self.tokenizer, self.ids) > 0

    def _delta(self, final: bool) -> str:
        if self.read_offset == len(self.ids):
            return ""
        skip = self.skip_special_tokens
        prefix_text = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset], skip)
        new_text = self.tokenizer.decode(self.ids[self.prefix_offset :], skip)
        if not final and (len(new_text) <= len(prefix_text) or self._unfinished(new_text)):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return new_text[len(prefix_text) :]


def _unfinished_ids(tokenizer, ids: list[int]) -> int:
    """How many of the last ids hold the bytes of a character they leave unfinished (0 where the tokenizer
    has no `bytes_of`): by bytes, as a decoded U+FFFD may be the text's own. The last ids with 4 bytes (a
    character's most) are read: special ids hold none (at most MAX_TAIL_IDS)."""
    bytes_of = getattr(tokenizer, "bytes_of", None)
    if bytes_of is None:
        return 0
    tail: list[bytes] = []
    held = 0  # bytes of the tail
    for token_id in reversed(ids[-MAX_TAIL_IDS:]):
        tail.append(bytes_of(token_id))
        held += len(tail[-1])
        if held >= 4:
            break
    tail.reverse()
    decoder = UTF8_DECODER(errors="replace")
    decoder.decode(b"".join(tail), final=False)
    unfinished, n = len(decoder.getstate()[0]), 0
    while unfinished > 0 and n < len(tail):
        n += 1
        unfinished -= len(tail[-n])
    return n


MAX_TAIL_IDS = 64  # ids _unfinished_ids reads back at most (special ids between a character's bytes)


class Utf8Detokenizer:
    """push/flush as IncrementalDetokenizer, for tokenizers with a `token_bytes` table (id -> bytes): one
    lookup and one incremental decode per id instead of two window decodes (tools/api_bench: the API
    process's cost per streamed token, docs/benchmarks/api_cpu.md). While the decoder holds no bytes, an id
    whose bytes are complete UTF-8 by themselves is its text, looked up (what the decoder would return)."""

    __slots__ = ("token_bytes", "token_text", "decoder", "pending")

    def __init__(self, tokenizer) -> None:
        self.token_bytes: list[bytes] = tokenizer.token_bytes
        self.token_text = _complete_texts(self.token_bytes)
        self.decoder = UTF8_DECODER(errors="replace")
        self.pending = False  # the decoder holds the start of a character

    def push(self, token_id: int) -> str:
        table = self.token_bytes
        if not 0 <= token_id < len(table):
            return ""
        if not self.pending:
            text = self.token_text[token_id]
            if text is not None:
                return text
        text = self.decoder.decode(table[token_id])
        self.pending = self.decoder.getstate()[0] != b""
        return text

    def flush(self) -> str:
        """End of stream: "" (the decoder holds at most the start of a character, which never completes)."""
        self.pending = False
        self.decoder.reset()
        return ""


_TEXTS: dict[int, tuple[list[bytes], list[str | None]]] = {}  # id(token_bytes) -> (it, its texts)


def _complete_texts(token_bytes: list[bytes]) -> list[str | None]:
    """Each id's text where its bytes are complete UTF-8 alone, else None; once per table."""
    entry = _TEXTS.get(id(token_bytes))
    if entry is None or entry[0] is not token_bytes:
        texts = []
        for b in token_bytes:
            try:
                texts.append(b.decode("utf-8"))
            except UnicodeDecodeError:
                texts.append(None)
        entry = _TEXTS[id(token_bytes)] = (token_bytes, texts)
    return entry[1]


def detokenizer_for(tokenizer, context: list[int] = (),
                    skip_special_tokens: bool = True) -> IncrementalDetokenizer | Utf8Detokenizer:
    """`context`: the prompt's ids (bytes need none: a byte's text does not depend on its neighbours).
    `skip_special_tokens`: as `decode`'s (a byte table's special ids have no text either way)."""
    if hasattr(tokenizer, "token_bytes"):
        return Utf8Detokenizer(tokenizer)
    return IncrementalDetokenizer(tokenizer, context, skip_special_tokens)
