"""A scripted OpenAI-compatible SSE server with known token timing, for testing the load generator.

Every request gets its first token `first_token_delay_s` after its body is read and the k-th token
(k = 0, 1, ...) at `first_token_delay_s + k * inter_token_delay_s`, so TTFT, ITL and TPOT have known values.
`behaviours` is cycled over requests in arrival order: "ok", "429", "500", "drop" (the connection is cut after
the first token), "no_done" (the stream ends cleanly without `data: [DONE]`), "error" (an error event
after the first token, then `data: [DONE]`, as servers report failures once the stream has started) or
"abort" (half the tokens, then finish_reason "abort" and a clean end, as a draining server ends a stream).
Prompt tokens: token-id prompts count their ids; text counts one token per character (byte-level), plus
`chat_template_tokens` for a chat request. Token ids are streamed when the request sets `return_token_ids`.

`python -m loadtest.mock_server --port 8000` serves it for dry runs of the load generator; with `--reuse-port`
several such processes share one port, to stream faster than one load-generator process reads
(tools/loadtest_capacity).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import uvicorn


class DropConnection(Exception):
    """Raised inside the app after the response started: uvicorn closes the socket mid-body."""


@dataclass(frozen=True)
class MockScript:
    first_token_delay_s: float = 0.05
    inter_token_delay_s: float = 0.02
    behaviours: tuple[str, ...] = ("ok",)
    chat_template_tokens: int = 5
    model: str = "mock"
    send_usage: bool = True  # honour stream_options.include_usage
    text_every: int = 1  # token k has text "x" when k % text_every == 0, else "" (text not printable yet)


class MockServer:
    def __init__(self, script: MockScript) -> None:
        self.script = script
        self.requests_started = 0  # completion requests received so far

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        t0 = time.perf_counter()
        path = scope["path"]
        if path == "/health":
            return await _json(send, 200, {"status": "ok", "model": self.script.model, "device": "mock"})
        if path == "/v1/models":
            models = [{"id": self.script.model, "object": "model"}]
            return await _json(send, 200, {"object": "list", "data": models})
        if path not in ("/v1/completions", "/v1/chat/completions"):
            return await _json(send, 404, _error("not found", "not_found_error"))
        behaviour = self.script.behaviours[self.requests_started % len(self.script.behaviours)]
        self.requests_started += 1
        if behaviour in ("429", "500"):
            return await _json(send, int(behaviour), _error(f"scripted {behaviour}", "server_error"))
        request = json.loads(body)
        chat = path.endswith("chat/completions")
        if request.get("stream"):
            await self._stream(send, request, chat, behaviour, t0)
        else:
            await self._unary(send, request, chat, t0)

    def _usage(self, request: dict, chat: bool, completion_tokens: int | None = None) -> dict:
        if chat:
            prompt = sum(len(m["content"]) for m in request["messages"]) + self.script.chat_template_tokens
        else:
            prompt = len(request["prompt"])
        completion = request["max_tokens"] if completion_tokens is None else completion_tokens
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _token_time(self, t0: float, k: int) -> float:
        return t0 + self.script.first_token_delay_s + k * self.script.inter_token_delay_s

    async def _stream(self, send, request: dict, chat: bool, behaviour: str, t0: float) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})  # fmt: skip
        n = request["max_tokens"] // 2 if behaviour == "abort" else request["max_tokens"]
        for k in range(n):
            await asyncio.sleep(max(0.0, self._token_time(t0, k) - time.perf_counter()))
            text = "x" if k % self.script.text_every == 0 else ""
            ids = [120] if request.get("return_token_ids") else None
            await _event(send, _chunk(chat, text, None, ids))
            if behaviour == "drop":
                raise DropConnection("scripted mid-stream drop")
            if behaviour == "error":
                await _event(send, _error("scripted mid-stream error", "server_error"))
                break
        if behaviour != "error":
            await _event(send, _chunk(chat, "", "abort" if behaviour == "abort" else "length"))
        if self.script.send_usage and (request.get("stream_options") or {}).get("include_usage"):
            usage = self._usage(request, chat, n)
            await _event(send, {"object": "text_completion", "choices": [], "usage": usage})
        if behaviour != "no_done":
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    async def _unary(self, send, request: dict, chat: bool, t0: float) -> None:
        n = request["max_tokens"]
        await asyncio.sleep(max(0.0, self._token_time(t0, n - 1) - time.perf_counter()))
        text = "x" * n
        choice = {"index": 0, "finish_reason": "length"}
        choice |= {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
        usage = self._usage(request, chat)
        await _json(send, 200, {"object": "text_completion", "choices": [choice], "usage": usage})


def _chunk(chat: bool, text: str, finish_reason: str | None, token_ids: list[int] | None = None) -> dict:
    choice = {"index": 0, "finish_reason": finish_reason}
    choice |= {"delta": {"content": text}} if chat else {"text": text}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {"object": "chat.completion.chunk" if chat else "text_completion", "choices": [choice]}


def _error(message: str, kind: str) -> dict:
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


async def _event(send, payload: dict) -> None:
    data = b"data: " + json.dumps(payload).encode() + b"\n\n"
    await send({"type": "http.response.body", "body": data, "more_body": True})


async def _json(send, status: int, payload: dict) -> None:
    body = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json")]})  # fmt: skip
    await send({"type": "http.response.body", "body": body})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_in_thread(app) -> Iterator[str]:
    """Run `app` under a real uvicorn in a daemon thread, on a free port; yields its base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical",
                                           lifespan="off", access_log=False))  # fmt: skip
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20.0
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("mock server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10.0)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m loadtest.mock_server")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--first-token-ms", type=float, default=50.0)
    p.add_argument("--inter-token-ms", type=float, default=20.0)
    p.add_argument("--reuse-port", action="store_true",
                   help="bind with SO_REUSEPORT: several servers share the port (the kernel spreads them)")
    args = p.parse_args(argv)
    script = MockScript(args.first_token_ms / 1000.0, args.inter_token_ms / 1000.0)
    config = uvicorn.Config(MockServer(script), host="127.0.0.1", port=args.port, lifespan="off",
                            log_level="warning", access_log=False)  # fmt: skip
    sock = None
    if args.reuse_port:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(("127.0.0.1", args.port))
    uvicorn.Server(config).run(sockets=[sock] if sock else None)


if __name__ == "__main__":
    main()
