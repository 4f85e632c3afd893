"""Tokenizers: byte-level for the presets; a wrapper around a checkpoint's `tokenizers` tokenizer.json.

Both expose the same surface: encode(text, add_bos=True), decode(ids), vocab_size, bos_token_id,
eos_token_ids, pad_token_id, apply_chat_template(messages, add_generation_prompt=True).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

# The template presets use (and checkpoints without a chat_template): one "role: content" line per message,
# then "assistant:" to prompt the reply. The byte tokenizer has no special tokens that text could spell.
SIMPLE_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


class ByteTokenizer:
    """UTF-8 bytes as tokens: id = byte + 3; 0 = PAD, 1 = BOS, 2 = EOS.

    `vocab_size` may exceed 259 (the `bench` preset's 128256-row embedding): ids in [259, vocab_size) are
    unused and decode to nothing, like special tokens.
    """

    PAD, BOS, EOS, OFFSET = 0, 1, 2, 3
    NUM_IDS = 259

    def __init__(self, vocab_size: int = NUM_IDS) -> None:
        if vocab_size < self.NUM_IDS:
            raise ValueError(f"ByteTokenizer needs vocab_size >= {self.NUM_IDS}, got {vocab_size}")
        self.vocab_size = vocab_size
        self.bos_token_id = self.BOS
        self.pad_token_id = self.PAD
        self.eos_token_ids = {self.EOS}
        self.chat_template = SIMPLE_CHAT_TEMPLATE

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = [b + self.OFFSET for b in text.encode("utf-8")]
        return [self.BOS, *ids] if add_bos else ids

    def decode(self, ids: list[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def decode_bytes(self, ids: list[int]) -> bytes:
        return bytes(i - self.OFFSET for i in ids if self.OFFSET <= i < self.NUM_IDS)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return render_chat_template(self.chat_template, messages, add_generation_prompt)


class HFTokenizer:
    """A checkpoint's tokenizer.json (Hugging Face `tokenizers`) plus tokenizer_config.json conventions."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        bos_token: str | None = None,
        eos_tokens: tuple[str, ...] = (),
        eos_token_ids: tuple[int, ...] = (),
        pad_token: str | None = None,
        chat_template: str | None = None,
        add_bos: bool = True,
    ) -> None:
        self._tok = tokenizer
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.bos_token = bos_token
        self.bos_token_id = self._token_id(bos_token) if add_bos else None
        eos = {self._token_id(t) for t in eos_tokens} | set(eos_token_ids)
        self.eos_token_ids: set[int] = {i for i in eos if i is not None}
        self.eos_token = eos_tokens[0] if eos_tokens else None
        self.pad_token_id = self._token_id(pad_token)
        self.chat_template = chat_template or SIMPLE_CHAT_TEMPLATE

    def _token_id(self, token: str | None) -> int | None:
        if token is None:
            return None
        tid = self._tok.token_to_id(token)
        if tid is None:
            raise ValueError(f"special token {token!r} from tokenizer_config.json is not in tokenizer.json")
        return tid

    @classmethod
    def from_dir(cls, path: str | Path, extra_eos_ids: tuple[int, ...] = ()) -> HFTokenizer:
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"{tok_file} not found: checkpoints need a `tokenizers` tokenizer.json")
        cfg = _read_json(path / "tokenizer_config.json")
        eos = _token_str(cfg.get("eos_token"))
        return cls(
            Tokenizer.from_file(str(tok_file)),
            bos_token=_token_str(cfg.get("bos_token")),
            eos_tokens=(eos,) if eos else (),
            eos_token_ids=extra_eos_ids,
            pad_token=_token_str(cfg.get("pad_token")),
            chat_template=_chat_template(path, cfg),
            add_bos=cfg.get("add_bos_token", True) is not False,
        )

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        # special tokens spelled in the text (from a chat template) are still parsed; the post-processor's
        # automatic BOS is not applied: we add BOS ourselves, once.
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_bos and self.bos_token_id is not None and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return render_chat_template(
            self.chat_template,
            messages,
            add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )


def render_chat_template(template: str, messages: list[dict], add_generation_prompt: bool, **extra) -> str:
    """Render a jinja2 chat template the way transformers does (sandboxed, trim_blocks, lstrip_blocks)."""
    return _compile(template).render(
        messages=[_plain_message(m) for m in messages], add_generation_prompt=add_generation_prompt, **extra
    )


def _plain_message(message: dict) -> dict:
    """OpenAI content parts ([{"type": "text", "text": ...}]) are joined into one string."""
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return {**message, "content": "" if content is None else content}


_COMPILED: dict[str, jinja2.Template] = {}


def _compile(template: str) -> jinja2.Template:
    if template not in _COMPILED:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = _raise_template_error
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        _COMPILED[template] = env.from_string(template)
    return _COMPILED[template]


def _raise_template_error(message: str):
    raise ValueError(f"chat template error: {message}")


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_str(token) -> str | None:
    """tokenizer_config.json spells special tokens as strings or as AddedToken dicts."""
    if isinstance(token, dict):
        return token.get("content")
    return token


def _chat_template(path: Path, cfg: dict) -> str | None:
    jinja_file = path / "chat_template.jinja"  # transformers >= 4.43 may save it beside the config
    if jinja_file.is_file():
        return jinja_file.read_text()
    template = cfg.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t["name"]: t["template"] for t in template}
        return named.get("default", next(iter(named.values()), None))
    return template
