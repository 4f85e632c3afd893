#!/usr/bin/env bash
# One GPU call for the fused decode forward (issue 16): its GPU tests, with SWEEPS=1 the greedy argmax
# against torch's (tools/argmax_bench) and the fused gate_up + SiLU against cuBLAS + SiLU-and-mul with its
# tile sweep (tools/gate_up_silu_bench --sweep), then tools/decode_forward_bench on the previous checkout
# (BEFORE=dir holding it, optional) and on this one in the same run, and with ENGINE=1 the engine core's
# decode steps and the 64:256 closed loop on each (tools/engine_step_bench); the tables last.
# Usage on the device machine, from the repo root: OUT=/some/dir [BEFORE=.base] [BATCHES=16,64,256]
#   [PROFILE=1,64] [ENGINE=1] [SWEEPS=1] [BEFORE_FORWARD=0] [TESTS="tests/a.py ..."] \
#   bash tools/decode_forward_gpu_run.sh
set -uo pipefail
OUT=${OUT:-/tmp/decode_forward_gpu_run}
BATCHES=${BATCHES:-1,16,64,256}
PROFILE=${PROFILE:-64}  # the batches whose replayed step is profiled per kernel
mkdir -p "$OUT/before" "$OUT/after"
if ls .whl/*.whl >/dev/null 2>&1; then  # msgspec and the rest, for the engine's closed loop
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
fi
# the GPU tests of the decoder's kernels, the runner and the async engine took 395 s on an H100 (214 tests);
# TESTS=... names fewer files
TESTS=${TESTS:-"tests/test_kernels_argmax.py tests/test_kernels_splitk_add.py tests/test_kernels_gate_up_silu.py
  tests/test_kernels_new_token_rope.py tests/test_gpu_kernels.py tests/test_model_fused_forward.py
  tests/test_kernels_gemv.py tests/test_runner_gpu.py tests/test_engine_async.py"}
# shellcheck disable=SC2086  # TESTS is a list of paths
python3 -m pytest -q -m gpu -p no:cacheprovider $TESTS 2>&1 | tail -n 8 | tee "$OUT/gpu_tests.txt"
if [ -n "${SWEEPS:-}" ]; then
  python3 -m tools.argmax_bench --out "$OUT/argmax.json" > "$OUT/argmax.txt" 2>&1
  tail -n 11 "$OUT/argmax.txt"
  python3 -m tools.gate_up_silu_bench --sweep --out "$OUT/gate_up_silu.json" > "$OUT/gate_up_silu.txt" 2>&1
  tail -n 20 "$OUT/gate_up_silu.txt"
fi
bench() {  # $1: before | after, run in the current directory; BEFORE_FORWARD=0: the engine alone before
  if [ "$1" = after ] || [ "${BEFORE_FORWARD:-1}" != 0 ]; then
    python3 -m tools.decode_forward_bench --batches "$BATCHES" --profile-batches "$PROFILE" --out "$OUT/$1" \
      > "$OUT/$1/log.txt" 2>&1
  fi
  if [ -n "${ENGINE:-}" ]; then
    python3 -m tools.engine_step_bench --batches 16 64 --modes greedy --steps 32 --closed-loop 64:256 \
      --out "$OUT/$1/engine.json" > "$OUT/$1/engine.txt" 2>&1
  fi
}
if [ -n "${BEFORE:-}" ]; then
  (cd "$BEFORE" && bench before)
fi
bench after
for side in before after; do
  echo "== $side"
  [ -s "$OUT/$side/log.txt" ] && tail -n $(( $(echo "$BATCHES" | tr ',' '\n' | wc -l) + 4 )) "$OUT/$side/log.txt"
  [ -s "$OUT/$side/engine.txt" ] && tail -n 8 "$OUT/$side/engine.txt"
done
