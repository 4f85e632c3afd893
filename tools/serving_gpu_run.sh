#!/usr/bin/env bash
# One GPU call for the serving issues (run from the repo root on the GPU machine with .whl carried):
# install the carried wheels (FastAPI stack, pyzmq, msgspec), the runner/engine GPU tests, then
# tools/serving_bench (server under loadtest at concurrency 1/16/64/256, the engine offline, HF generate).
# Usage: OUT=/some/dir [SKIP_TESTS=1] bash tools/serving_gpu_run.sh
set -u
OUT=${OUT:-/tmp/serving_gpu_run}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_runner_gpu.py tests/test_runner_cuda_graphs.py \
    tests/test_engine_process.py 2>&1 | tail -n 12 | tee "$OUT/gpu_tests.txt"
fi
python3 -m tools.serving_bench --out "$OUT" 2>&1 | tail -n 30
