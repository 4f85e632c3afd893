#!/usr/bin/env bash
# One GPU call for the decode kernel: its GPU tests, then the benchmark of the previous kernels/ checkout
# (BEFORE=dir holding it, optional) and of this one in the same run, rendered side by side.
# Usage on the device machine, from the repo root: OUT=/some/dir [BEFORE=.before] bash tools/kernel_gpu_check.sh
set -uo pipefail
OUT=${OUT:-/tmp/kernel_gpu_check}
mkdir -p "$OUT"
python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_kernels.py 2>&1 | tail -n 15 | tee "$OUT/gpu_tests.txt"
if [ -n "${BEFORE:-}" ]; then
  # a root whose kernels/ is the old one (python -m puts the working directory first on sys.path)
  ROOT=$(pwd)
  ln -sfn "$ROOT/tools" "$BEFORE/tools" && ln -sfn "$ROOT/tests" "$BEFORE/tests"
  (cd "$BEFORE" && python3 -m tools.kernel_bench --label before --out "$OUT" 2>&1 | tail -n 3)
fi
python3 -m tools.kernel_bench --label after --out "$OUT" 2>&1 | tail -n 12
if [ -n "${BEFORE:-}" ]; then
  python3 -m tools.kernel_bench --compare "$OUT"/kernel_*_before.json "$OUT"/kernel_*_after.json --out "$OUT"
fi
