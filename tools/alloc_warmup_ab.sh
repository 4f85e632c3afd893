#!/usr/bin/env bash
# One GPU call: the engine core's closed loops (256 then 64 in flight, 256 requests of 512 in / 128 out,
# the first loop of a fresh process: what a server's first burst meets) on the tree before (BEFORE=dir) and
# this one, then GPU tests (TESTS; default the runner's test of the start-up allocator warm-up). Tables
# last; JSON under OUT.
# Usage on the device machine, from the repo root: OUT=/some/dir BEFORE=.base bash tools/alloc_warmup_ab.sh
set -uo pipefail
OUT=${OUT:-/tmp/alloc_warmup_ab}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1
loops() {  # $1: before | after, run in the current directory
  PYTHONPATH=/tmp/site:$PWD timeout 300 python3 -m tools.engine_step_bench --batches 256 --modes greedy \
    --steps 8 --warmup 2 --closed-loop 256:256 64:256 --out "$OUT/$1.json" > "$OUT/$1.txt" 2>&1
}
(cd "${BEFORE:-.base}" && loops before)
loops after
# shellcheck disable=SC2086
PYTHONPATH=/tmp/site:$PWD timeout ${TESTS_TIMEOUT:-200} python3 -m pytest -q -m gpu -p no:cacheprovider \
  ${TESTS:-tests/test_runner_gpu.py::test_a_burst_of_requests_takes_no_new_device_memory} 2>&1 | tail -n 6
for side in before after; do echo "== $side"; grep -A3 "^closed loop" "$OUT/$side.txt"; done
