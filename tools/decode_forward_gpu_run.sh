#!/usr/bin/env bash
# One GPU call for the fused decode forward (issue 16): its GPU tests, the gated-GEMM probe, then
# tools/decode_forward_bench on the previous checkout (BEFORE=dir holding it, optional) and on this one in
# the same run; the two step tables last.
# Usage on the device machine, from the repo root: OUT=/some/dir [BEFORE=.base] [BATCHES=16,64,256]
#   [PROBE_ROWS="8 16 32 64 128"] bash tools/decode_forward_gpu_run.sh
set -uo pipefail
OUT=${OUT:-/tmp/decode_forward_gpu_run}
BATCHES=${BATCHES:-1,16,64,256}
PROBE_ROWS=${PROBE_ROWS:-8 16 32 64 128}
mkdir -p "$OUT/before" "$OUT/after"
python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_fused_gemm.py tests/test_model_fused_forward.py \
  tests/test_kernels_gemv.py 2>&1 | tail -n 8 | tee "$OUT/gpu_tests.txt"
if [ -n "$PROBE_ROWS" ]; then
  # shellcheck disable=SC2086
  python3 -m tools.fused_gemm_probe --rows $PROBE_ROWS > "$OUT/fused_gemm_probe.txt" 2>&1
  tail -n 12 "$OUT/fused_gemm_probe.txt"
fi
if [ -n "${BEFORE:-}" ]; then
  (cd "$BEFORE" && python3 -m tools.decode_forward_bench --batches "$BATCHES" --profile-batches 64 \
     --out "$OUT/before" > "$OUT/before/log.txt" 2>&1)
fi
python3 -m tools.decode_forward_bench --batches "$BATCHES" --profile-batches 64 --out "$OUT/after" \
  > "$OUT/after/log.txt" 2>&1
for side in before after; do
  [ -s "$OUT/$side/log.txt" ] && { echo "== $side"; tail -n $(( $(echo "$BATCHES" | tr ',' '\n' | wc -l) + 4 )) "$OUT/$side/log.txt"; }
done
