"""The loadtest's chat prompts against what the server counts (client.calibrate_chat): a BPE-like tokenizer
gets prompts of about --input-len tokens, with a warning; the calibration waits as long as the run's request
timeout; a workload that cannot be built is a usage error, not a traceback (cases from a review)."""

from __future__ import annotations

import asyncio
import json
import math

import httpx
import pytest

from loadtest.cli import main
from loadtest.mock_server import MockScript, MockServer, serve_in_thread
from loadtest.session import RunSettings, discover
from loadtest.workload import ChatCalibration

pytestmark = pytest.mark.timeout(60)
TEMPLATE, LETTERS_PER_TOKEN = 20, 4


class BpeLikeServer(MockServer):
    """The mock, but a chat prompt counts 20 template tokens and one token per 4 letters."""

    def _usage(self, request, chat, completion_tokens=None):
        usage = super()._usage(request, chat, completion_tokens)
        if chat:
            letters = sum(len(m["content"]) for m in request["messages"])
            usage["prompt_tokens"] = TEMPLATE + math.ceil(letters / LETTERS_PER_TOKEN)
            usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        return usage


def test_chat_prompts_are_scaled_to_what_a_bpe_tokenizer_counts(tmp_path, capsys):
    """One letter a token sent 34-token prompts at --input-len 64 to such a server, and said nothing."""
    out = tmp_path / "r.json"
    with serve_in_thread(BpeLikeServer(MockScript(0.001, 0.001))) as url:
        rc = main(["--base-url", url, "--endpoint", "chat", "--input-len", "64", "--output-len", "2",
                   "--num-requests", "4", "--concurrency", "2", "--no-progress", "--out", str(out)])
    report = json.loads(out.read_text())
    assert rc == 0 and {row["input_len"] for row in report["requests"]} == {64}  # the server's count
    assert report["config"]["chat_tokens_per_letter"] == pytest.approx(1 / LETTERS_PER_TOKEN, abs=0.01)
    assert "not byte-level" in capsys.readouterr().err


class SlowUnary(MockServer):
    async def _unary(self, send, request, chat, t0):
        await asyncio.sleep(0.5)  # a busy server, or one compiling on its first request
        await super()._unary(send, request, chat, t0)


def test_the_calibration_waits_as_long_as_the_request_timeout():
    """It ran on httpx's default 5 s timeout: a server slower than that failed the run before it began."""
    with serve_in_thread(SlowUnary(MockScript(0.001, 0.001))) as url:
        settings = RunSettings(base_url=url, endpoint="chat", timeout_s=0.2, progress=False)
        with pytest.raises(httpx.TimeoutException):
            asyncio.run(discover(settings))
        settings = RunSettings(base_url=url, endpoint="chat", timeout_s=10.0, progress=False)
        server = asyncio.run(discover(settings))
    assert server.chat == ChatCalibration(MockScript().chat_template_tokens, 1.0)


@pytest.mark.parametrize("extra", [["--seed", "-1"], ["--endpoint", "chat", "--input-len", "5"]])
def test_a_workload_that_cannot_be_built_is_a_usage_error(extra, capsys):
    """--seed -1 (numpy's seeds are >= 0) and a chat --input-len the template alone fills (the mock's is 5
    tokens) ended in tracebacks."""
    with serve_in_thread(MockServer(MockScript(0.001, 0.001))) as url:
        try:
            rc = main(["--base-url", url, "--num-requests", "2", "--output-len", "2", "--no-progress",
                       *extra])
        except SystemExit as e:
            rc = e.code
    assert rc == 2 and "Traceback" not in capsys.readouterr().err
