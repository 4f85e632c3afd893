"""A real sticky CUDA error in a step (skipped without a GPU): the runner's device probe sees it and the core
ends at once, with the step's request failed; an out-of-memory error is not sticky and the engine goes on.
`test_hardening_faults` covers the same rules on CPU with the probe patched; this runs the probe itself.
Each case runs in a fresh process: a device-side assert leaves that process's CUDA context unusable."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(240),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
ROOT = Path(__file__).resolve().parents[1]


def out_of_bounds_index() -> None:
    """Launches an index kernel that reads past its tensor: a device-side assert, sticky for the context
    (every later launch and synchronize fails), reported at the step's wait."""
    x = torch.zeros(4, device="cuda")
    x[torch.tensor([1 << 20], device="cuda")] += 1


def out_of_memory() -> None:
    torch.empty(1 << 50, dtype=torch.uint8, device="cuda")


def scenario(fault: str) -> None:
    """Runs in the child: a greedy stream whose third step meets `fault` -> prints the stream's error, the
    engine's /health status and its reason of death, then the status after a second request."""
    import asyncio

    from _pytest.monkeypatch import MonkeyPatch
    from test_hardening_faults import on_third_step

    from server.engine.sampling_params import SamplingParams
    from tests.engine_helpers import collect, started_engine, wait_until

    act = {"assert": out_of_bounds_index, "oom": out_of_memory}[fault]
    with started_engine(model="tiny", device="cuda", num_blocks=64, max_num_seqs=8) as engine:
        on_third_step(MonkeyPatch(), engine.client.core.runner, act)
        prompt = engine.tokenizer.encode("hello")
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        first = asyncio.run(collect(engine, "a", prompt, params))
        if fault == "assert":
            wait_until(lambda: engine.health()["status"] == "dead", timeout=20)
        print("error:", first.error)
        print("status:", engine.health()["status"], "| dead:", engine.dead)
        if fault == "oom":
            after = asyncio.run(collect(engine, "b", prompt, params))
            print("after:", after.error, len(after.choices[0].token_ids))


def run_scenario(fault: str) -> str:
    code = (f"import sys; sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'tests')!r}]; "
            f"import test_hardening_device as t; t.scenario({fault!r})")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_a_device_side_assert_in_a_step_ends_the_core_at_once():
    out = run_scenario("assert")
    assert "status: dead" in out, out
    assert "the device is unusable after a failed step" in out, out
    assert "error: None" not in out, out


def test_an_out_of_memory_step_fails_its_request_and_the_device_stays_usable():
    out = run_scenario("oom")
    assert "OutOfMemoryError" in out.split("status:")[0], out
    assert "status: ok" in out, out
    assert "after: None 12" in out, out
