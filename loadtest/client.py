"""One request against an OpenAI-compatible server, timed per streamed chunk.

Times are `time.perf_counter()` seconds. `send_time` is taken just before the request goes out (after the
concurrency slot is acquired), each content chunk is stamped when the piece of body carrying it is read
(sse.py), `end_time` when the stream ends; E2EL ends at the last event with choices (`last_chunk_time`, as
vLLM's latency: a usage block or [DONE] sent later is no token). A content chunk is one whose choice carries
non-empty text (completions) or delta content or reasoning content (chat), as in vLLM's `bench serve`, or
non-empty `token_ids`: streaming requests ask for them (`return_token_ids`, which pagewalk and vLLM honour and
other servers ignore), so a token whose text is not yet printable (half a UTF-8 character, or an id outside a
byte tokenizer's range) still counts as arriving.
The output token count is the server's `usage.completion_tokens` when the response has it, else the number
of token ids streamed; a response with neither fails (`no_usage`): a server may merge several tokens into
one chunk, so counting chunks would under-count its output (vLLM's bench re-tokenizes the text instead,
which needs the model's tokenizer).

Failures never raise: they come back as a record with `error_kind` set
(`http_<status>`, `timeout`, `connect_error`, `stream_dropped`, `incomplete_stream`, `stream_error`,
`bad_response`, `no_content`, `no_usage`, `finish_abort`, `finish_error`).
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field

import httpx
import numpy as np

from loadtest.sse import StreamReader, unary_counts
from loadtest.workload import ChatCalibration, RequestSpec, text_prompt


@dataclass(frozen=True)
class ClientConfig:
    base_url: str
    model: str
    endpoint: str = "completions"  # "completions" | "chat"
    stream: bool = True
    api_key: str | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    timeout_s: float = 600.0
    return_token_ids: bool = True

    @property
    def url(self) -> str:
        path = "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"
        return self.base_url.rstrip("/") + path

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass
class RequestRecord:
    index: int
    input_len: int  # prompt tokens: server usage if reported, else the spec's length
    expected_output_len: int
    send_time: float
    end_time: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # arrival of each content chunk
    output_tokens: int = 0
    streamed: bool = True  # False: the whole response came at once (no ITL, no TPOT)
    last_chunk_time: float | None = None  # streamed: the last event with choices (the E2EL's end, as vLLM's)
    error_kind: str | None = None
    error: str = ""

    @property
    def success(self) -> bool:
        return self.error_kind is None

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.send_time if self.chunk_times else None

    @property
    def e2el(self) -> float:
        """To the last event with choices where streamed (a usage block or [DONE] sent later is no token's
        time: vLLM ends its latency there too), else to the response's end."""
        end = self.last_chunk_time if self.last_chunk_time is not None else self.end_time
        return end - self.send_time

    @property
    def tpot(self) -> float | None:
        """(e2el - ttft) / (output_tokens - 1): the first token excluded, as vLLM defines it."""
        if not self.streamed or self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:], strict=False)]


def build_payload(spec: RequestSpec, cfg: ClientConfig) -> dict:
    payload: dict = {
        "model": cfg.model,
        "max_tokens": spec.output_len,
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "ignore_eos": True,
        "stream": cfg.stream,
    }
    if cfg.stream:
        payload["stream_options"] = {"include_usage": True}
        if cfg.return_token_ids:
            payload["return_token_ids"] = True
    if cfg.endpoint == "chat":
        payload["messages"] = [{"role": "user", "content": spec.prompt}]
    else:
        payload["prompt"] = spec.prompt
    return payload


async def send_request(client: httpx.AsyncClient, spec: RequestSpec, cfg: ClientConfig) -> RequestRecord:
    rec = RequestRecord(spec.index, spec.input_len, spec.output_len, send_time=time.perf_counter())
    try:
        if cfg.stream:
            await _stream(client, spec, cfg, rec)
        else:
            await _unary(client, spec, cfg, rec)
    except httpx.TimeoutException as e:
        _fail(rec, "timeout", repr(e))
    except httpx.ConnectError as e:
        _fail(rec, "connect_error", repr(e))
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as e:
        _fail(rec, "stream_dropped", repr(e))
    except httpx.HTTPError as e:
        _fail(rec, "http_error", repr(e))
    rec.end_time = time.perf_counter()
    return rec


def _fail(rec: RequestRecord, kind: str, message: str) -> None:
    if rec.error_kind is None:
        rec.error_kind, rec.error = kind, message[:500]


async def _stream(client: httpx.AsyncClient, spec: RequestSpec, cfg: ClientConfig, rec: RequestRecord):
    payload = build_payload(spec, cfg)
    reader = StreamReader(rec.chunk_times)
    async with client.stream("POST", cfg.url, json=payload, headers=cfg.headers()) as resp:
        if resp.status_code != 200:
            body = (await resp.aread()).decode(errors="replace")
            return _fail(rec, f"http_{resp.status_code}", body)
        async for data in resp.aiter_bytes():
            if not reader.feed(data, time.perf_counter()):
                return _fail(rec, *reader.failure)
        if not reader.close(time.perf_counter()):
            return _fail(rec, *reader.failure)
    if not reader.done:
        return _fail(rec, "incomplete_stream", "stream ended without data: [DONE]")
    if not rec.chunk_times:  # no TTFT to report, yet its usage tokens would count in the throughput
        return _fail(rec, "no_content", "stream ended without a content chunk")
    rec.last_chunk_time = reader.last_choices_time
    _apply_usage(rec, reader.completion_tokens, reader.prompt_tokens, reader.streamed_ids)
    _check_finish(rec, reader.finish_reason)
    if reader.completion_tokens is None and not reader.streamed_ids:  # an event may carry several tokens
        _fail(rec, "no_usage", "a stream without usage or token ids: its output tokens are unknown")


async def _unary(client: httpx.AsyncClient, spec: RequestSpec, cfg: ClientConfig, rec: RequestRecord):
    resp = await client.post(cfg.url, json=build_payload(spec, cfg), headers=cfg.headers())
    if resp.status_code != 200:
        return _fail(rec, f"http_{resp.status_code}", resp.text)
    try:
        completion_tokens, prompt_tokens, counted, finish_reason = unary_counts(resp.content)
    except ValueError:  # a 200 whose body is not JSON, not UTF-8, or not a response's shape
        return _fail(rec, "bad_response", resp.content[:500].decode(errors="replace"))
    # Without streaming the first token is seen with the whole response: TTFT = e2el, no ITL, no TPOT.
    rec.chunk_times.append(time.perf_counter())
    rec.streamed = False
    if completion_tokens is None and not counted:  # 0 tokens would read as a success
        return _fail(rec, "no_usage", "a response without usage or token ids: its output tokens are unknown")
    _apply_usage(rec, completion_tokens, prompt_tokens, counted)
    _check_finish(rec, finish_reason)


def _check_finish(rec: RequestRecord, finish_reason: str | None) -> None:
    """A request the server ended early ("abort": a drain or a disconnect; "error") is a failure, not a
    short success: its tokens would count in the throughput and its TPOT would read as a whole request's."""
    if finish_reason in ("abort", "error"):
        _fail(rec, f"finish_{finish_reason}", f"finish_reason {finish_reason!r} after {rec.output_tokens} of "
                                              f"{rec.expected_output_len} tokens")


def _apply_usage(rec: RequestRecord, completion_tokens: int | None, prompt_tokens: int | None, counted: int):
    """The server's usage counts win over what the client counted."""
    rec.output_tokens = counted if completion_tokens is None else int(completion_tokens)
    if prompt_tokens is not None:
        rec.input_len = int(prompt_tokens)


async def fetch_text(client: httpx.AsyncClient, base_url: str, path: str, api_key: str | None) -> str | None:
    """GET a small document (/health, /v1/models, /metrics); None when the server does not answer it."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = await client.get(base_url.rstrip("/") + path, headers=headers, timeout=10.0)
    except httpx.HTTPError:
        return None
    return resp.text if resp.status_code == 200 else None


async def fetch_json(client: httpx.AsyncClient, base_url: str, path: str, api_key: str | None) -> dict | None:
    """GET a small JSON document (/health, /v1/models); None when the server does not answer it."""
    text = await fetch_text(client, base_url, path, api_key)
    try:
        return None if text is None else json.loads(text)
    except json.JSONDecodeError:
        return None


CHAT_PROBES = (16, 272)  # characters of the two calibration prompts (random letters, as the workload's)


async def calibrate_chat(client: httpx.AsyncClient, cfg: ClientConfig) -> ChatCalibration:
    """How many prompt tokens the server counts for a chat prompt of random letters: two prompts of
    CHAT_PROBES characters give the tokens a character (1 on a byte-level tokenizer) and the template's own
    tokens around the message. A BPE tokenizer merges letters (~0.3 tokens a character): the workload scales
    its prompts by it, where one letter a token sent prompts of a third of --input-len, silently (a
    review)."""
    unary = dataclasses.replace(cfg, endpoint="chat", stream=False)
    counts = []
    for chars in CHAT_PROBES:
        prompt = text_prompt(np.random.default_rng([7, chars]), chars)
        probe = RequestSpec(index=-1, prompt=prompt, input_len=chars, output_len=1)
        resp = await client.post(unary.url, json=build_payload(probe, unary), headers=unary.headers())
        resp.raise_for_status()
        prompt_tokens = (resp.json().get("usage") or {}).get("prompt_tokens")
        if prompt_tokens is None:
            raise RuntimeError("chat calibration needs usage.prompt_tokens in the server's response")
        counts.append(int(prompt_tokens))
    per_char = (counts[1] - counts[0]) / (CHAT_PROBES[1] - CHAT_PROBES[0])
    if not per_char > 0:
        raise RuntimeError(f"chat calibration: {CHAT_PROBES[1]} letters counted {counts[1]} prompt tokens, "
                           f"{CHAT_PROBES[0]} counted {counts[0]}")
    return ChatCalibration(counts[0] - per_char * CHAT_PROBES[0], per_char)
