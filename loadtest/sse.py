"""The per-event path: an OpenAI streaming body, as bytes, to content-chunk times and token counts.

At tens of thousands of streamed tokens a second every SSE event passes through here, so the path is kept
short: the body is read as bytes (`aiter_bytes`, no text decoding of the stream and no per-line strings
from httpx's line decoder), the clock is read once per piece of body httpx hands over (one HTTP chunk,
which servers write per event; the events of one piece arrived together), and each `data:` payload is
decoded by msgspec into a schema holding only the fields the count needs (unknown fields are skipped
without building objects). What is counted is unchanged: see client.py.

Events one process takes per CPU second (the best of 4 runs; 2-core shared CPU VM, Python 3.11, httpx
0.28; `python -m tools.loadtest_capacity --processes 1`: one mock server streaming without delay, 256
requests x 256 tokens, the server the slower side so each read carries one event):

| concurrency | before: `aiter_lines` + json.loads, one client | after: this path, <= 16 connections/client |
|---|---|---|
| 16 | 26,900 | 33,400 |
| 64 | 16,300 | 37,800 |
| 256 | 14,300 | 27,700 |

At 16 streams (one client either way) the gain is this module's; above it most of it is benchmark.py's
split of the slots over small connection pools. What remains is mostly httpx/httpcore/h11 per read.
"""

from __future__ import annotations

import msgspec


class _Delta(msgspec.Struct):
    content: str | None = None
    reasoning_content: str | None = None  # a reasoning model's thinking tokens (vLLM, SGLang, DeepSeek)
    reasoning: str | None = None  # the same under vLLM's newer name

    @property
    def has_text(self) -> bool:
        return bool(self.content or self.reasoning_content or self.reasoning)


class _Choice(msgspec.Struct):
    text: str | None = None  # completions
    delta: _Delta | None = None  # chat
    token_ids: list[int] | None = None  # return_token_ids
    finish_reason: str | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


class _Chunk(msgspec.Struct):
    choices: list[_Choice] | None = None
    usage: _Usage | None = None
    error: msgspec.Raw = msgspec.field(default_factory=lambda: _NO_ERROR)


_NO_ERROR = msgspec.Raw(b"")
_DECODE = msgspec.json.Decoder(_Chunk).decode
_DECODE_ANY = msgspec.json.Decoder().decode


def _is_json(payload: bytes) -> bool:
    try:
        _DECODE_ANY(payload)
    except msgspec.DecodeError:
        return False
    return True


def unary_counts(body: bytes) -> tuple[int | None, int | None, int, str | None]:
    """A non-streamed response's body -> (usage completion_tokens, usage prompt_tokens, token ids returned,
    the last choice's finish_reason), read through the same schema as an event's: ValueError where it is not
    a JSON object of that shape (a `usage` that is no object, a count that is no integer, `choices` that is
    no list), so one malformed body fails its request rather than the run."""
    try:
        response = _DECODE(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ValueError(str(e)) from None
    usage = response.usage or _Usage()
    choices = response.choices or []
    ids = sum(len(c.token_ids) for c in choices if c.token_ids)
    return usage.completion_tokens, usage.prompt_tokens, ids, choices[-1].finish_reason if choices else None


class StreamReader:
    """Fed the body's byte chunks in order; appends the arrival time of each content chunk to `chunk_times`.

    After the body: `done` (saw `data: [DONE]`), `completion_tokens` and `prompt_tokens` (from the last usage
    block; None without one), `streamed_ids` (token ids seen), `finish_reason` (the last one given),
    `last_choices_time`, `failure` ((error_kind, message) of the first bad or error event, which ends the
    reading).
    """

    __slots__ = ("chunk_times", "done", "completion_tokens", "prompt_tokens", "streamed_ids", "finish_reason",
                 "failure", "last_choices_time", "_tail", "_data", "_started")  # fmt: skip

    def __init__(self, chunk_times: list[float]) -> None:
        self.chunk_times = chunk_times
        self.done = False
        self.completion_tokens: int | None = None
        self.prompt_tokens: int | None = None
        self.streamed_ids = 0
        self.finish_reason: str | None = None
        self.failure: tuple[str, str] | None = None
        # the arrival of the last event with choices (a finish chunk without text too; not a usage block or
        # [DONE]): where vLLM's latency ends ("only token chunks advance the request end")
        self.last_choices_time: float | None = None
        self._tail = b""  # a line not yet ended (a CR last in a piece waits: its LF may start the next)
        self._data: list[bytes] = []  # the `data:` values of the event the next blank line ends
        self._started = False  # the first piece is in (its byte-order mark, if any, is dropped)

    def feed(self, data: bytes, now: float) -> bool:
        """Takes the next piece of the body; False once a failure is seen (stop reading). Framing as the
        event-stream spec reads it: lines end with LF, CRLF or a lone CR; an event's `data:` lines are joined
        with LF and it ends at a blank line; a leading byte-order mark is dropped; other fields (event, id,
        comments) are skipped."""
        if not self._started:
            self._started, data = True, data.removeprefix(b"\xef\xbb\xbf")
        if self._tail:
            data = self._tail + data
        if b"\r" in data:
            keep_cr = data.endswith(b"\r")
            data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
            if keep_cr:  # the CR may be half of a CRLF: read it as the line's end once the next piece is in
                data = data[:-1] + b"\r"
        lines = data.split(b"\n")
        self._tail = lines.pop()
        pending = self._data
        for line in lines:
            if line.startswith(b"data:"):
                pending.append(line[5:])
            elif not line and pending:  # a blank line ends the event
                if not self._dispatch(now):
                    return False
                pending = self._data
        return True

    def close(self, now: float) -> bool:
        """The body ended: a last event without its blank line (or its newline) still counts."""
        tail, self._tail = self._tail.removesuffix(b"\r"), b""
        if tail.startswith(b"data:"):
            self._data.append(tail[5:])
        return not self._data or self._dispatch(now)

    def _dispatch(self, now: float) -> bool:
        """The pending event's data -> its payload read (False on a failure)."""
        values, self._data = self._data, []
        if len(values) == 1:
            payload = values[0].strip()
            return not payload or self._event(payload, now)  # `data:` with nothing (a keep-alive): no event
        payload = b"\n".join(values).strip()
        if _is_json(payload):
            return self._event(payload, now)
        # a server leaving out the blank lines between one-line events
        return all(self._event(v.strip(), now) for v in values if v.strip())

    def _event(self, payload: bytes, now: float) -> bool:
        if payload == b"[DONE]":
            self.done = True  # read on to the end of the body so the connection returns to the pool
            return True
        try:
            chunk = _DECODE(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            self.failure = ("bad_response", payload.decode(errors="replace"))
            return False
        if chunk.error is not _NO_ERROR and bytes(chunk.error).strip() != b"null":  # "error": null is none
            self.failure = ("stream_error", bytes(chunk.error).decode(errors="replace"))
            return False
        usage = chunk.usage
        if usage is not None:  # a later usage block wins, field by field
            if usage.completion_tokens is not None:
                self.completion_tokens = usage.completion_tokens
            if usage.prompt_tokens is not None:
                self.prompt_tokens = usage.prompt_tokens
        if chunk.choices:
            self.last_choices_time = now
            ids = 0
            text = False
            for c in chunk.choices:
                if c.token_ids:
                    ids += len(c.token_ids)
                text = text or bool(c.text or (c.delta is not None and c.delta.has_text))
                if c.finish_reason is not None:
                    self.finish_reason = c.finish_reason
            if ids or text:
                self.chunk_times.append(now)
                self.streamed_ids += ids
        return True
