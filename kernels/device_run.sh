#!/usr/bin/env bash
# One device call: versions, GPU tests (-m gpu), then the benchmark (with --sweep when SWEEP=1).
# Usage on the device machine, from the repo root: OUT=/some/dir bash kernels/device_run.sh
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/env.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$OUT/env.txt"
timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -m gpu --noconftest -p no:cacheprovider -n 8 \
    tests/test_gpu_kernels.py > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests rc=$?"; tail -n 15 "$OUT/gpu_tests.log"
if [ -n "${DIAG:-}" ]; then python3 -m kernels.device_check --out "$OUT" 2>&1 | tee "$OUT/device_check.log"; fi
python3 -m kernels.benchmark --out "$OUT" ${SWEEP:+--sweep} --budget-s "${BUDGET:-200}" 2>&1 | tee "$OUT/bench.log"
