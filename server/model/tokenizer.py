"""Tokenizers: byte-level for the presets; a wrapper around a checkpoint's `tokenizers` tokenizer.json.

Both expose the same surface: encode(text, add_bos=True), decode(ids, skip_special_tokens=True),
token_text(id) (the text one token adds after other text: logprob entries), bytes_of(id) (its raw bytes,
part of a character included), added_tokens (each added token's text -> its id), vocab_size, bos_token_id,
eos_token_ids, pad_token_id, chat_template (a ChatTemplate or None),
apply_chat_template(messages, add_generation_prompt=True, variables=None) -> str and
chat_token_ids(messages, ...) -> ids (`variables`: a dict of extra template variables, vLLM's
chat_template_kwargs).
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

from tokenizers import Tokenizer

from server.model.chat_template import ChatTemplate, template_file
from server.model.json_file import read_json_object

# The presets' declared template: one "role: content" line per message, then "assistant:" to prompt the
# reply. The byte tokenizer has no special tokens that text could spell.
PRESET_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


class NoChatTemplateError(ValueError):
    """The model defines no chat template and none was given with --chat-template."""


class ByteTokenizer:
    """UTF-8 bytes as tokens: id = byte + 3; 0 = PAD, 1 = BOS, 2 = EOS.

    `vocab_size` may exceed 259 (the `bench` preset's 128256-row embedding): ids in [259, vocab_size) are
    unused and decode to nothing, like special tokens. Special tokens have no name a text could spell, so they
    decode to nothing with skip_special_tokens False too (as token_text and /detokenize give them).
    """

    PAD, BOS, EOS, OFFSET = 0, 1, 2, 3
    NUM_IDS = 259

    def __init__(self, vocab_size: int = NUM_IDS, chat_template: ChatTemplate | None = None) -> None:
        if vocab_size < self.NUM_IDS:
            raise ValueError(f"ByteTokenizer needs vocab_size >= {self.NUM_IDS}, got {vocab_size}")
        self.vocab_size = vocab_size
        # id -> its bytes (specials and unused ids: none), for streaming detokenization
        self.token_bytes = [b""] * self.OFFSET + [bytes([b]) for b in range(256)]
        self.bos_token_id = self.BOS
        self.pad_token_id = self.PAD
        self.eos_token_ids = {self.EOS}
        self.chat_template = chat_template or ChatTemplate(PRESET_CHAT_TEMPLATE, "the preset")
        self.added_tokens: dict[str, int] = {}  # its special tokens have no text
        self.skipped_token_ids: frozenset[int] = frozenset()

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = [b + self.OFFSET for b in text.encode("utf-8")]
        return [self.BOS, *ids] if add_bos else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """`skip_special_tokens` changes nothing: special and unused ids have no text."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def decode_bytes(self, ids: list[int]) -> bytes:
        return bytes(i - self.OFFSET for i in ids if self.OFFSET <= i < self.NUM_IDS)

    def token_text(self, token_id: int) -> str:
        return self.decode([token_id])

    def bytes_of(self, token_id: int) -> bytes:
        return self.token_bytes[token_id] if 0 <= token_id < len(self.token_bytes) else b""

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            variables: dict | None = None) -> str:
        return self.chat_template.render(messages, add_generation_prompt, variables)

    def chat_token_ids(self, messages: list[dict], add_generation_prompt: bool = True,
                       variables: dict | None = None) -> list[int]:
        # no text can spell BOS here, so the rendered prompt gets it as a plain prompt does
        text = self.apply_chat_template(messages, add_generation_prompt, variables)
        return self.encode(text, add_bos=True)


class HFTokenizer:
    """A checkpoint's tokenizer.json (Hugging Face `tokenizers`) plus tokenizer_config.json conventions.

    Special tokens are added exactly where the tokenizer.json post-processor adds them (as transformers does
    with add_special_tokens=True); chat prompts are tokenized without it, as `apply_chat_template` does:
    a template spells its BOS itself.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        bos_token: str | None = None,
        eos_tokens: tuple[str, ...] = (),
        eos_token_ids: tuple[int, ...] = (),
        pad_token: str | None = None,
        unk_token: str | None = None,
        chat_template: ChatTemplate | None = None,
        template_tokens: dict[str, str | None] | None = None,
    ) -> None:
        self._tok = tokenizer
        # the id range, not the count: a tokenizer.json may leave ids unused (a review: a count of 300 with an
        # id 400 passed the embedding check, and the API refused id 400 as out of range)
        self.vocab_size = max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        self.bos_token_id = self._token_id(bos_token)
        eos = {self._token_id(t) for t in eos_tokens} | set(eos_token_ids)
        self.eos_token_ids: set[int] = {i for i in eos if i is not None}
        self.pad_token_id = self._token_id(pad_token)
        tokens = {"bos_token": bos_token, "eos_token": eos_tokens[0] if eos_tokens else None,
                  "pad_token": pad_token, "unk_token": unk_token, **(template_tokens or {})}
        self.special_tokens = {k: v for k, v in tokens.items() if v is not None}  # what templates may use
        self.chat_template = chat_template
        anchor = tokenizer.encode("a", add_special_tokens=False).ids  # token_text's plain left neighbour
        self._anchor: tuple[int, str] | None = (anchor[-1], tokenizer.decode(anchor[-1:])) if anchor else None

    def to_json(self) -> str:
        """The tokenizer.json text (`tokenizers`' own serialisation): what llguidance reads."""
        return self._tok.to_str()

    def _token_id(self, token: str | None) -> int | None:
        if token is None:
            return None
        tid = self._tok.token_to_id(token)
        if tid is None:
            raise ValueError(f"special token {token!r} from tokenizer_config.json is not in tokenizer.json")
        return tid

    @classmethod
    def from_dir(cls, path: str | Path, extra_eos_ids: tuple[int, ...] = (),
                 chat_template: ChatTemplate | None = None) -> HFTokenizer:
        """`chat_template` overrides the one the directory defines (chat_template.jinja, tokenizer_config)."""
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"{tok_file} not found: checkpoints need a `tokenizers` tokenizer.json")
        try:
            tokenizer = Tokenizer.from_file(str(tok_file))
        except Exception as e:  # noqa: BLE001 -- `tokenizers` raises a bare Exception for a bad file
            raise ValueError(f"{tok_file} does not load: {e}") from None
        cfg = _tokenizer_config(path)
        try:
            eos = _token_str(cfg.get("eos_token"))
            return cls(
                tokenizer,
                bos_token=_token_str(cfg.get("bos_token")),
                eos_tokens=(eos,) if eos else (),
                eos_token_ids=extra_eos_ids,
                pad_token=_token_str(cfg.get("pad_token")),
                unk_token=_token_str(cfg.get("unk_token")),
                chat_template=chat_template or _chat_template(path, cfg),
                template_tokens={k: _token_str(cfg.get(k)) for k in TEMPLATE_ONLY_TOKENS},
            )
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{path / 'tokenizer_config.json'} has a field of the wrong shape: "
                             f"{type(e).__name__}: {e}") from None

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """`add_bos`: apply the post-processor (transformers' add_special_tokens). Special tokens spelled in
        the text (by a chat template) are parsed either way."""
        return self._tok.encode(text, add_special_tokens=add_bos).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """The text `token_id` adds after other text, special tokens spelled: decoded after an anchor
        token, because a SentencePiece-style decoder (Metaspace: Llama-2, Mistral) drops the leading space
        of a sequence's first token ('▁x' alone decodes to 'x', after 'a' to ' x')."""
        if self._anchor is not None:
            anchor, anchor_text = self._anchor
            text = self._tok.decode([anchor, token_id], skip_special_tokens=False)
            if text.startswith(anchor_text):
                return text[len(anchor_text):]
        return self._tok.decode([token_id], skip_special_tokens=False)

    def bytes_of(self, token_id: int) -> bytes:
        """The token's raw bytes (a byte-fallback or byte-level token may hold part of a character)."""
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # byte fallback <0xHH>
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        if self._is_byte_level() and piece not in self.added_tokens:
            table = _byte_level_table()
            if all(ch in table for ch in piece):
                return bytes(table[ch] for ch in piece)
        return self.token_text(token_id).encode("utf-8")

    def _is_byte_level(self) -> bool:
        """Whether the decoder maps pieces through GPT-2's byte-to-character table (Llama-3, Qwen2)."""
        return "ByteLevel" in self._decoder_kinds

    @functools.cached_property
    def _decoder_kinds(self) -> frozenset[str]:
        """The decoder's type and its sequence's (found on first use: it reads the whole json)."""
        decoder = json.loads(self._tok.to_str()).get("decoder") or {}
        return frozenset([decoder.get("type")] + [d.get("type") for d in decoder.get("decoders") or []])

    @functools.cached_property
    def byte_fallback_ids(self) -> frozenset[int]:
        """The <0xHH> ids where the decoder is ByteFallback (Llama-2, Mistral): it decodes a run of them as
        UTF-8 as a whole, or as one U+FFFD a byte if any of it is invalid, so a later byte of a run can
        rewrite the text of its earlier ones (the detokenizer holds a run until it ends). Empty otherwise."""
        if "ByteFallback" not in self._decoder_kinds:
            return frozenset()
        vocab = self._tok.get_vocab(with_added_tokens=False)
        return frozenset(i for piece, i in vocab.items() if _BYTE_PIECE.fullmatch(piece))

    @functools.cached_property
    def added_tokens(self) -> dict[str, int]:
        """Each added token's text -> its id (the special tokens among them): stored as their text, not
        through the byte table; text that spells one is encoded as it (structural tags' literals take it)."""
        return {t.content: i for i, t in self._tok.get_added_tokens_decoder().items()}

    @functools.cached_property
    def skipped_token_ids(self) -> frozenset[int]:
        """The added tokens decode(..., skip_special_tokens=True) leaves out: those marked special (Qwen2.5's
        <tool_call> is added but not special: its text stays)."""
        return frozenset(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            variables: dict | None = None) -> str:
        if self.chat_template is None:
            raise NoChatTemplateError(
                "this model defines no chat template (none in its tokenizer_config.json or "
                "chat_template.jinja) and the server was started without --chat-template; use "
                "/v1/completions, or restart with --chat-template FILE")
        variables = {**self.special_tokens, **(variables or {})}
        return self.chat_template.render(messages, add_generation_prompt, variables)

    def chat_token_ids(self, messages: list[dict], add_generation_prompt: bool = True,
                       variables: dict | None = None) -> list[int]:
        text = self.apply_chat_template(messages, add_generation_prompt, variables)
        return self.encode(text, add_bos=False)


_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # a piece the ByteFallback decoder reads as its byte


@functools.cache
def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet inverted: the printable character each byte is spelled as -> the byte
    (printable Latin-1 bytes stand for themselves; the other 68 are shifted past 255, in byte order)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    shifted = [b for b in range(256) if chr(b) not in table]
    table.update({chr(256 + i): b for i, b in enumerate(shifted)})
    return table


# transformers' other special-token attributes: chat templates may spell them; nothing else uses them here
TEMPLATE_ONLY_TOKENS = ("sep_token", "cls_token", "mask_token")


def _token_str(token) -> str | None:
    """tokenizer_config.json spells special tokens as strings or as AddedToken dicts."""
    if isinstance(token, dict):
        return token.get("content")
    return token


def _tokenizer_config(path: Path) -> dict:
    """tokenizer_config.json with special_tokens_map.json's tokens, merged as transformers merges them: a
    legacy config (no `added_tokens_decoder`: saved before transformers 4.34) takes the map's tokens over its
    own and where it has null (a review); a newer one keeps its own, the map supplying only the tokens it
    lacks (transformers reads no map then)."""
    config = read_json_object(path / "tokenizer_config.json")
    tokens = read_json_object(path / "special_tokens_map.json")
    if "added_tokens_decoder" in config:
        return {**tokens, **config}
    return {**config, **{k: v for k, v in tokens.items() if v is not None}}


def _chat_template(path: Path, cfg: dict) -> ChatTemplate | None:
    """The directory's chat template, with its "tool_use" one (Hermes-2-Pro's and Hermes-3's layout), which
    transformers and vLLM render for a request with tools (a review: it was never used)."""
    jinja_file = path / "chat_template.jinja"  # transformers >= 4.43 may save it beside the config
    tool_file = path / "additional_chat_templates" / "tool_use.jinja"  # ... and the others there (>= 4.54)
    if jinja_file.is_file():
        return template_file(jinja_file, template_file(tool_file) if tool_file.is_file() else None)
    template = cfg.get("chat_template")
    origin = str(path / "tokenizer_config.json")
    tool_use = None
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t["name"]: t["template"] for t in template}
        if "default" not in named and len(named) != 1:  # as transformers: which one is not ours to guess
            raise ValueError(f"{origin} names chat templates {sorted(named)} and none 'default': pass the "
                             "one to serve with --chat-template")
        template = named.get("default", next(iter(named.values()), None))
        if "default" in named and named.get("tool_use"):
            tool_use = ChatTemplate(named["tool_use"], f"{origin} (tool_use)")
    elif tool_file.is_file():  # one template here, the tool one in its file (a review: it went unread)
        tool_use = template_file(tool_file)
    return ChatTemplate(template, origin, tool_use) if template else None
