"""Real CUDA faults in a step (skipped without a GPU). `test_hardening_faults` covers the rules on CPU with
the faults and the device probe patched; here the device raises them.

- A device-side assert is sticky: every later launch and synchronize fails, and PyTorch's caching host
  allocator aborts the process (`terminate` from an event it creates while freeing a pinned tensor) at the
  next free of a pinned buffer the step used, before or after the runner's probe finds the device unusable
  (seen on an H100: the in-process core took its test process down). So the served shape is what is tested:
  the core in its own process ends, by exit 1 or that abort, and the API process fails the request, answers
  503 and exits non-zero for its supervisor.
- An out-of-memory error is not sticky: the step's request fails, the probe finds the device usable and the
  next request is served (in-process, in a fresh process of its own)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from server_helpers import GREEDY, Server

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(240),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
ROOT = Path(__file__).resolve().parents[1]


# Imported first by every interpreter the served test starts (its dir heads PYTHONPATH): in the core process
# the runner's next step after the flag file appears launches an index kernel that reads past its tensor.
SITECUSTOMIZE = """
import os
FLAG = os.environ.get("PAGEWALK_TEST_FAULT_FLAG")
if FLAG:
    from server.engine.runner import ModelRunner

    _execute = ModelRunner.execute

    def execute(self, *args, **kwargs):
        if os.path.exists(FLAG):
            os.unlink(FLAG)
            import torch
            x = torch.zeros(4, device="cuda")
            x[torch.tensor([1 << 20], device="cuda")] += 1
        return _execute(self, *args, **kwargs)

    ModelRunner.execute = execute
"""


def out_of_memory() -> None:
    torch.empty(1 << 50, dtype=torch.uint8, device="cuda")


def oom_scenario() -> None:
    """Runs in a fresh process: a greedy stream whose third step runs out of memory -> prints its error, the
    engine's /health status, then a second request's error and token count."""
    import asyncio

    from _pytest.monkeypatch import MonkeyPatch
    from test_hardening_faults import on_third_step

    from server.engine.sampling_params import SamplingParams
    from tests.engine_helpers import collect, started_engine

    with started_engine(model="tiny", device="cuda", num_blocks=64, max_num_seqs=8) as engine:
        on_third_step(MonkeyPatch(), engine.client.core.runner, out_of_memory)
        prompt = engine.tokenizer.encode("hello")
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        first = asyncio.run(collect(engine, "a", prompt, params))
        print("error:", first.error)
        print("status:", engine.health()["status"], "| dead:", engine.dead)
        after = asyncio.run(collect(engine, "b", prompt, params))
        print("after:", after.error, len(after.choices[0].token_ids))


def test_a_device_side_assert_in_a_step_ends_the_served_core_and_the_server(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(SITECUSTOMIZE)
    flag = tmp_path / "fault"
    path = os.pathsep.join(filter(None, [str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {"PYTHONPATH": path, "PAGEWALK_TEST_FAULT_FLAG": str(flag)}
    srv = Server(tmp_path, "--device", "cuda", "--attention-backend", "triton", "--num-blocks", "256",
                 env=env)
    try:
        flag.touch()
        r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "hello", "max_tokens": 16, **GREEDY},
                       timeout=60)
        assert r.status_code == 500 and r.json()["error"]["message"], r.text
        assert srv.proc.wait(timeout=60) != 0
        assert not flag.exists()  # the fault ran in the core
        log = srv.log.read_text()
        assert "device-side assert" in log, log[-3000:]
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()


def test_an_out_of_memory_step_fails_its_request_and_the_device_stays_usable():
    code = (f"import sys; sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'tests')!r}]; "
            "import test_hardening_device as t; t.oom_scenario()")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "OutOfMemoryError" in out.split("status:")[0], out
    assert "status: ok" in out, out
    assert "after: None 12" in out, out
