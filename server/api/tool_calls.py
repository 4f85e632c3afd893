"""Tool calls in a chat reply: OpenAI's `tools` with tool_choice "auto", as vLLM's --enable-auto-tool-choice.

The chat template shows the model the tools; the model writes its calls as text in its own format, and the
parser that `--tool-call-parser` names turns that text into OpenAI's tool_calls:
- hermes (Qwen2.5, Hermes, and other templates in that format): `<tool_call>{"name": ..., "arguments": ...}
  </tool_call>`, one block per call, after any plain text;
- llama3_json (Llama 3.1 / 3.2): the whole reply is one JSON object `{"name": ..., "parameters": ...}`, or
  several separated by ";".
A reply whose calls are not valid JSON objects with a string "name" is plain content, as it was written:
the JSON of RFC 8259 (no NaN or Infinity, no number past the float range; `json_text`), so that every call's
arguments are JSON text a client's strict parser reads. Arguments the model wrote as a string are taken as
that string's JSON text; a string that is none makes the call invalid.
Streamed, text is sent until a call opens and held from there until the choice ends (ToolCallStream); the
calls then go out whole in one delta, which OpenAI's clients accumulate like any other.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass

from server.api.json_text import FINITE_DECODER, dumps_unicode, is_unicode, loads_finite

PARSERS = ("hermes", "llama3_json")
HERMES_OPEN = "<tool_call>"
_HERMES_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)  # the last may be unclosed
_PYTHON_TAG = "<|python_tag|>"  # Llama's, where a template spells it (a special token, mostly skipped)


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as OpenAI sends them
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or f"chatcmpl-tool-{uuid.uuid4().hex}"


def parse(parser: str, text: str) -> tuple[str | None, list[ToolCall]]:
    """A reply's text -> (its content: the text before the calls, None if there is none; the calls). A reply
    without valid calls is all content, with no calls."""
    content, calls = _hermes(text) if parser == "hermes" else _llama3_json(text)
    return (text, []) if calls is None else (content, calls)


def _hermes(text: str) -> tuple[str | None, list[ToolCall] | None]:
    start = text.find(HERMES_OPEN)
    if start < 0:
        return text, None
    calls = [_call(body.strip(), "arguments") for body in _HERMES_CALL.findall(text, start)]
    if not calls or None in calls:
        return text, None
    return (text[:start] if text[:start].strip() else None), calls


def _llama3_json(text: str) -> tuple[str | None, list[ToolCall] | None]:
    body = text.strip().removeprefix(_PYTHON_TAG).strip()
    if not body.startswith("{"):
        return text, None
    calls, i = [], 0
    while i < len(body):
        try:
            obj, end = FINITE_DECODER.raw_decode(body, i)
            calls.append(_named_call(obj, "parameters"))  # (its json.dumps recurses one frame deeper)
        except (ValueError, RecursionError):  # nested past Python's stack: a 500 before (a review)
            return text, None
        i = end
        while i < len(body) and body[i] in " \t\r\n;":
            i += 1
    return None, calls if None not in calls else None


def _call(body: str, arguments_key: str) -> ToolCall | None:
    try:
        return _named_call(loads_finite(body), arguments_key)
    except (ValueError, RecursionError):  # the model's text: any JSON, nested arbitrarily deep
        return None


def _named_call(obj, arguments_key: str) -> ToolCall | None:
    """{"name": str, arguments_key or "arguments": a value or its JSON text} -> a ToolCall; else None. Where
    the model escaped a lone surrogate ("\\ud800"), the arguments keep the escape (dumps_unicode); in the
    name, which the reply carries as a str, it makes the call invalid."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not is_unicode(obj["name"]):
        return None
    args = obj.get(arguments_key, obj.get("arguments", {}))
    if isinstance(args, str):
        args = loads_finite(args)  # (a ValueError, as the call's own syntax: the caller's None)
    return ToolCall(obj["name"], dumps_unicode(args))


class ToolCallStream:
    """One streamed choice's text while its reply may hold calls: `feed` returns the text to send now, the
    rest is held (a hermes reply from its first `<tool_call>`, and the tail that may begin one; a
    llama3_json reply whole once it opens with "{"); `finish` parses what was held when the choice ends."""

    def __init__(self, parser: str) -> None:
        self.parser = parser
        self.held = ""
        self.calling = False  # a call has opened: everything from there is held
        self.decided = parser == "hermes"  # llama3_json decides at the reply's first visible character
        self.visible_sent = False  # hermes: whitespace before a call is no content (as the unary parse)

    def feed(self, text: str) -> str:
        s = self.held + text
        if self.calling:
            self.held = s
            return ""
        if self.parser == "hermes":
            return self._feed_hermes(s)
        if self.decided:
            self.held = ""
            return s
        visible = s.lstrip()
        if not visible or (len(visible) < len(_PYTHON_TAG) and _PYTHON_TAG.startswith(visible)):
            self.held = s  # whitespace so far, or the start of the tag: not decided yet
            return ""
        self.decided = True
        self.calling = visible.removeprefix(_PYTHON_TAG).lstrip()[:1] in ("{", "")
        self.held = s if self.calling else ""
        return "" if self.calling else s

    def _feed_hermes(self, s: str) -> str:
        start = s.find(HERMES_OPEN)
        if start >= 0:
            before = s[:start]
            if self.visible_sent or before.strip():
                self.calling, self.held = True, s[start:]
                return before
            # only whitespace before the call: held with it, so that a call that does not parse is all
            # content as written (as the unary reply's), and one that does gets parse's content
            self.calling, self.held = True, s
            return ""
        keep = next((k for k in range(min(len(HERMES_OPEN) - 1, len(s)), 0, -1)
                     if s.endswith(HERMES_OPEN[:k])), 0)  # a tail that may grow into the opening
        if not self.visible_sent and not s[:len(s) - keep].strip():
            self.held = s  # only whitespace so far: content only if visible text follows
            return ""
        self.visible_sent = True
        self.held = s[len(s) - keep:] if keep else ""
        return s[:len(s) - keep]

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The choice ended: (the held text to send as content, the calls). Held text without valid calls is
        all content."""
        held, self.held = self.held, ""
        if not self.calling:
            return held, []
        content, calls = parse(self.parser, held)
        return (content or "", calls) if calls else (held, [])
