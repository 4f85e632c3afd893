"""kernels.sass_probe compiles the decode kernel for sm_90 without a GPU and finds its tile loop.

Run in a subprocess: the probe needs real (not interpreted) Triton functions, and `make test` sets
TRITON_INTERPRET=1 for the whole session.
"""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")
from kernels.sass_probe import BIN  # noqa: E402

pytestmark = pytest.mark.skipif(not (BIN / "cuobjdump").exists() or not (BIN / "ptxas").exists(),
                                reason="this Triton build has no NVIDIA backend tools")


def _probe(*args) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-m", "kernels.sass_probe", "--json", *args], env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_split_shape_with_workspace_compiles_to_a_tensor_core_tile_loop():
    rep = _probe("--shape", "1x4096", "--workspace")
    assert rep["splits"] > 1 and rep["fused_merge"] and rep["constexprs"]["OFFSETS_32"]
    assert rep["registers"] > 0 and rep["shared_bytes"] > 0
    loop = rep["tile_loop_mix"]
    assert loop["HMMA"] > 0 and loop["LDGSTS"] > 0        # tensor cores, and the cp.async K/V pipeline
    assert 0 < rep["tile_loop_instructions"] < rep["instructions"]


def test_a_given_config_is_compiled_as_given():
    rep = _probe("--shape", "4x1024", "--splits", "1", "--config", "32,4,2", "--flags", "offsets_32=0")
    assert rep["splits"] == 1 and not rep["fused_merge"]
    assert rep["constexprs"]["BLOCK_N"] == 32 and rep["constexprs"]["OFFSETS_32"] is False
