#!/usr/bin/env bash
# One device call for the serving side (run from the repo root on the GPU machine, with .whl carried):
#   GPU tests of runner/engine, then `pagewalk serve --model bench` under loadtest at several concurrency
#   levels, then the HF `generate` baseline on the same weights and workload shape. Results land in $OUT.
# Usage: bash loadtest/device_serving.sh [INPUT_LEN] [OUTPUT_LEN]
set -u
IN=${1:-512}; OUTLEN=${2:-128}; MODEL=${MODEL:-bench}; DEVICE=${DEVICE:-cuda}; PY=${PY:-python3}; PORT=8011; URL=http://127.0.0.1:$PORT
OUT=${OUT:-/tmp/pagewalk_out}; mkdir -p "$OUT"
[ -n "${NO_WHEELS:-}" ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
$PY -c "import torch, triton; print('gpu', torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu', 'torch', torch.__version__, 'triton', triton.__version__)" \
  | tee "$OUT/versions.txt"

echo "== host profile of the paged-decode call"
[ "$DEVICE" = cuda ] && timeout 120 $PY -m kernels.host_profile --out "$OUT" 2>&1 | tail -n 45

echo "== GPU tests (runner, engine)"
timeout 240 $PY -m pytest -q -m gpu tests/test_runner_gpu.py 2>&1 | tail -n 15 | tee "$OUT/gpu_tests.log"

echo "== serve bench preset"
$PY -m server.cli serve --model $MODEL --device $DEVICE --port $PORT --max-num-seqs 256 \
  --max-num-batched-tokens 8192 > "$OUT/server.log" 2>&1 &
SERVER=$!
HEALTH="import httpx,sys; r=httpx.get('$URL/health', timeout=2); print(r.text)"
for _ in $(seq 1 180); do $PY -c "$HEALTH" > "$OUT/health.json" 2>/dev/null && break; sleep 1; done
cat "$OUT/health.json"; echo
LT="$PY -m loadtest --base-url $URL --input-len $IN --output-len $OUTLEN --no-progress --seed 0"
timeout 120 $LT --num-requests 8 --concurrency 1 --warmup 2 --out "$OUT/serve_c1.json" | tail -n 25
timeout 240 $LT --num-requests 256 --sweep-concurrency 16,64,256 --warmup 8 --out "$OUT/serve_sweep.json" \
  | tail -n 30
kill -TERM $SERVER; wait $SERVER; echo "server exit code $?"
grep -iE "backend|capacity|listening" "$OUT/server.log" | head -n 5

echo "== HF generate baseline (static cache), same weights and shape"
for B in 1 64; do
  timeout 240 $PY -m loadtest.hf_baseline --model $MODEL --device $DEVICE --batch-size $B --input-len $IN \
    --output-len $OUTLEN --iters 2 --out "$OUT/hf_b$B.json" | tail -n 12
done
