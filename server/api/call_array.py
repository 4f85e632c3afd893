"""A "required" tool_choice's reply, scanned as it is generated: the JSON array its grammar forces,
`[{"name":<string>,"parameters":<value>},...]` ("name" first: structured_output compiles the schema's
properties in order), becomes each call's name and the exact text of its "parameters" value, piece by piece.

The text comes in pieces cut anywhere (inside a string, an escape, a literal). The scanner keeps where it
stands in the array's shape and, inside a value, the value's bracket depth and string/escape state, so each
character is read once: the cost is linear in the text, however it is cut. Whitespace between the array's
own tokens is skipped (the grammar compiles compact and writes none); inside a value it is the value's text.
Text that leaves the shape (the grammar does not write it) ends the calls: from there on it is content.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

_NAME, _VALUE, _NEXT, _END = "<name>", "<value>", "<next>", "<end>"  # the steps that are no literal token
# The array's shape, a step at a time: literal tokens, the name's string, the parameters' value, then after
# each item the next item ("," back to _ITEM) or the array's end ("]").
_STEPS = ("[", "{", '"name"', ":", _NAME, ",", '"parameters"', ":", _VALUE, "}", _NEXT, _END)
_ITEM = _STEPS.index("{")
_DONE = _STEPS.index(_END)  # the array closed: only whitespace may follow
_OFF = -1  # the text left the shape
_WHITESPACE = " \t\n\r"
_VALUE_START = frozenset('{["-0123456789tfn')
_IN_STRING = re.compile(r'["\\]')  # what ends a string's plain run: its closing quote or an escape
_IN_CONTAINER = re.compile(r'["{}\[\]]')  # what changes a container's state, outside strings
_SCALAR_END = re.compile(r"[,}\] \t\n\r]")  # a number or literal ends before one of these


@dataclass
class CallPiece:
    """The next piece of call `index`: its first carries the call's name (arguments "" or their first piece),
    each next one (name None) a further piece of the "parameters" value's text."""

    index: int
    name: str | None
    arguments: str


class JsonValueScan:
    """Where one JSON value ends, its text given in pieces: bracket depth, whether in a string, whether just
    after a backslash. The value's text is not checked beyond that (the grammar makes it JSON)."""

    __slots__ = ("depth", "in_string", "escaped", "started", "done")

    def __init__(self) -> None:
        self.depth = 0  # open "{" / "["
        self.in_string = False
        self.escaped = False  # the last character was a string's backslash
        self.started = False
        self.done = False

    def scan(self, text: str, i: int) -> int:
        """Reads the value's text from text[i] (its first character, or where an earlier piece stopped) ->
        the index past its end (`done`), or len(text) where it goes on. A number or literal ends before the
        character that follows it, so its end shows only there."""
        while i < len(text):
            if self.escaped:
                self.escaped, i = False, i + 1
            elif self.in_string:
                i = self._in_string(text, i)
            elif not self.started:
                self.started = True
                self.in_string, self.depth = text[i] == '"', int(text[i] in "{[")
                i += 1
            elif self.depth == 0:  # a number or literal
                m = _SCALAR_END.search(text, i)
                if m is None:
                    return len(text)
                self.done = True
                return m.start()
            else:
                i = self._in_container(text, i)
            if self.done:
                return i
        return i

    def _in_string(self, text: str, i: int) -> int:
        m = _IN_STRING.search(text, i)
        if m is None:
            return len(text)
        if m.group() == "\\":
            self.escaped = True
        else:
            self.in_string = False
            self.done = self.depth == 0  # a string value ends at its closing quote
        return m.end()

    def _in_container(self, text: str, i: int) -> int:
        m = _IN_CONTAINER.search(text, i)
        if m is None:
            return len(text)
        c = m.group()
        if c == '"':
            self.in_string = True
        elif c in "{[":
            self.depth += 1
        else:
            self.depth -= 1
            self.done = self.depth == 0
        return m.end()


class CallArrayScanner:
    """One reply's scan: feed(piece) -> (the calls' pieces it gives, the content it gives). A call's name goes
    out once its string is complete. While no call has begun the text is held: where the reply leaves the
    shape or ends (a cut reply) before a call begins, it is all content, as the unary parse makes it."""

    def __init__(self) -> None:
        self.step = 0  # index into _STEPS; _OFF once the text left the shape
        self.matched = 0  # characters of the step's literal token read so far
        self.calls = 0  # calls begun (their names given)
        self.held: list[str] = []  # the text so far, while no call has begun
        self.value: JsonValueScan | None = None  # the name's or the parameters' value being read
        self.name: list[str] = []  # the name's JSON string so far
        self.closed = False  # the array has closed: its calls are whole, whatever text follows

    @property
    def complete(self) -> bool:
        """Whether the array has closed (and nothing but whitespace followed)."""
        return self.step == _DONE

    def feed(self, text: str) -> tuple[list[CallPiece], str]:
        """The reply's next piece -> (the calls' pieces it gives, in order; the content it gives: "" while the
        text keeps the shape)."""
        if self.step == _OFF:
            return [], text
        pieces: list[CallPiece] = []
        i = 0
        while i < len(text):
            i = self._advance(text, i, pieces)
            if self.step == _OFF:
                return pieces, self._off(text, i)
        if self.calls == 0:
            self.held.append(text)
        return pieces, ""

    def finish(self) -> str:
        """The reply ended: the content it leaves (the held text of a reply in which no call began)."""
        held, self.held = "".join(self.held), []
        return held

    def _advance(self, text: str, i: int, pieces: list[CallPiece]) -> int:
        """Reads text from i at the current step -> the index it got to. Each call reads a character or moves
        to another step, so the scan always ends."""
        step = _STEPS[self.step]
        if self.value is not None:
            return self._read_value(text, i, pieces)
        c = text[i]
        if self.matched == 0 and c in _WHITESPACE:
            return i + 1  # between tokens
        if step in (_NAME, _VALUE):  # the value starts here: a name is a string
            starts = c == '"' if step == _NAME else c in _VALUE_START
            self.step = self.step if starts else _OFF
            self.value = JsonValueScan() if starts else None
            return i
        if step == _NEXT:
            self.step = _ITEM if c == "," else _DONE if c == "]" else _OFF
            self.closed = self.step == _DONE
        elif step == _END or c != step[self.matched]:
            self.step = _OFF
        else:
            self.matched += 1
            if self.matched == len(step):
                self.matched, self.step = 0, self.step + 1
        return i if self.step == _OFF else i + 1

    def _read_value(self, text: str, i: int, pieces: list[CallPiece]) -> int:
        """Reads the value from text[i]: a name is kept until its string closes (its call begins there), the
        parameters' text goes out as it comes."""
        end = self.value.scan(text, i)
        is_name = _STEPS[self.step] == _NAME
        if is_name:
            self.name.append(text[i:end])
        elif end > i:
            self._arguments(text[i:end], pieces)
        if self.value.done:
            self.value, self.step = None, self.step + 1
            if is_name:
                self._begin_call(pieces)
        return end

    def _begin_call(self, pieces: list[CallPiece]) -> None:
        raw, self.name = "".join(self.name), []
        try:
            name = json.loads(raw)
        except json.JSONDecodeError:  # an escape JSON has not (the grammar writes none)
            self.step = _OFF
            return
        pieces.append(CallPiece(self.calls, name, ""))
        self.calls += 1
        self.held = []

    def _arguments(self, piece: str, pieces: list[CallPiece]) -> None:
        index = self.calls - 1
        if pieces and pieces[-1].index == index:
            pieces[-1].arguments += piece
        else:
            pieces.append(CallPiece(index, None, piece))

    def _off(self, text: str, i: int) -> str:
        """The text left the shape at text[i]: the content from there (with the held text before it, the
        whole reply, where no call has begun)."""
        if self.calls == 0:
            return self.finish() + text
        return text[i:]
