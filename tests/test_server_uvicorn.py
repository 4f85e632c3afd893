"""A real `pagewalk serve` subprocess (uvicorn) driven by the official openai client and httpx."""

from __future__ import annotations

import asyncio
import json
import signal

import httpx
import openai
import pytest
from server_helpers import GREEDY, Server

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # a 24-block KV cache (23 usable x 16 = 368 tokens): a handful of requests forces preemption
    srv = Server(tmp_path_factory.mktemp("srv"), "--num-blocks", "24", "--max-num-seqs", "8")
    yield srv
    srv.stop()


def test_startup_log_names_what_runs(server):
    log = server.log.read_text()
    for fact in ("model=tiny", "device=cpu", "dtype=float32", "attention_backend=torch",
                 "kv_cache=368 tokens", f"url={server.url}"):
        assert fact in log, log


def test_openai_client_completions_chat_and_streams(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    done = client.completions.create(model="tiny", prompt="Hello", max_tokens=5, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 5
    streamed = client.completions.create(model="tiny", prompt="Hello", max_tokens=5, temperature=0,
                                         stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed) == done.choices[0].text

    messages = [{"role": "user", "content": "Say something"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 4
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 4
    assert chunks[-1].usage.total_tokens == chat.usage.total_tokens
    assert [m.id for m in client.models.list()] == ["tiny"]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="x", max_tokens=0)


def test_preemption_completes_every_request_exactly(server):
    prompts = [f"prompt {i}: the quick brown fox" for i in range(6)]
    body = {"max_tokens": 90, "return_token_ids": True, **GREEDY}

    async def run(c: httpx.AsyncClient, prompt: str) -> dict:
        r = await c.post("/v1/completions", json={"prompt": prompt, **body}, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]

    async def go():
        async with httpx.AsyncClient(base_url=server.url) as c:
            solo = [await run(c, p) for p in prompts]
            before = server.metric("pagewalk_num_preemptions_total")
            together = await asyncio.gather(*(run(c, p) for p in prompts))
            return solo, together, server.metric("pagewalk_num_preemptions_total") - before

    solo, together, preemptions = asyncio.run(go())
    assert preemptions > 0  # 6 x ~120 tokens cannot share 368 KV slots
    for s, t in zip(solo, together, strict=True):
        assert t["finish_reason"] == "length" and len(t["token_ids"]) == 90
        assert t["token_ids"] == s["token_ids"] and t["text"] == s["text"]
    server.wait_idle()


def test_disconnect_aborts_and_frees_blocks(server):
    aborted = server.metric("pagewalk_request_success_total", {"finished_reason": "abort"})
    body = {"prompt": "disconnect me", "max_tokens": 340, **GREEDY}

    async def streaming_then_gone():
        async with httpx.AsyncClient(base_url=server.url) as c:
            async with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                lines = r.aiter_lines()
                seen = 0
                while seen < 3:
                    seen += (await anext(lines)).startswith("data: ")
                assert server.health()["kv_cache"]["used_blocks"] > 0
        # leaving the block closed the connection mid-stream

    asyncio.run(streaming_then_gone())
    server.wait_idle()
    assert server.metric("pagewalk_request_success_total", {"finished_reason": "abort"}) == aborted + 1

    async def non_streaming_then_gone():
        async with httpx.AsyncClient(base_url=server.url) as c:
            task = asyncio.create_task(c.post("/v1/completions", json=body, timeout=60))
            while server.health()["running"] == 0:
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(non_streaming_then_gone())
    server.wait_idle()
    assert server.metric("pagewalk_request_success_total", {"finished_reason": "abort"}) == aborted + 2


@pytest.mark.parametrize("core", ["process", "thread"])
def test_auth_and_sigterm_mid_stream_exits_zero(tmp_path, core):
    extra = ["--engine-in-process"] if core == "thread" else []
    srv = Server(tmp_path, "--shutdown-timeout", "0.5", *extra, env={"PAGEWALK_API_KEY": "k3y"})
    try:
        assert httpx.get(f"{srv.url}/v1/models").status_code == 401
        headers = {"Authorization": "Bearer k3y"}
        assert httpx.get(f"{srv.url}/v1/models", headers=headers).status_code == 200
        body = {"prompt": "keep going", "max_tokens": 2000, "stream": True, **GREEDY}
        events = []
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, headers=headers, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: "):])
                    if len(events) == 2:
                        srv.proc.send_signal(signal.SIGTERM)
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])["choices"][0]
        assert last["finish_reason"] == "abort"
        assert srv.proc.wait(timeout=60) == 0, srv.log.read_text()
        assert f"engine_core={core}" in srv.log.read_text()
    finally:
        srv.stop()


def test_port_0_logs_the_port_the_os_chose(tmp_path):
    import re
    import subprocess
    import sys
    import time

    from server_helpers import REPO

    log = tmp_path / "port0.log"
    cmd = [sys.executable, "-m", "server.cli", "serve", "--port", "0", "--device", "cpu",
           "--attention-backend", "torch", "--num-blocks", "64", "--engine-in-process"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not (m := re.search(r"url=http://127\.0\.0\.1:(\d+)", log.read_text())):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        port = int(m.group(1))
        assert port != 0
        while True:
            try:
                assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
                break
            except httpx.ConnectError:
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.1)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
