#!/usr/bin/env bash
# One device call for the serving side (run from the repo root on the GPU machine, with .whl carried):
#   host profile of the paged-decode call, GPU tests of the runner, `pagewalk serve --model bench` under
#   loadtest (CUDA-graph decode, then --enforce-eager as the baseline), then HF `generate` on the same weights
#   and workload shape. Results land in $OUT. Overridable: MODEL, DEVICE, PY, NO_WHEELS, OUT, SKIP_PROFILE,
#   SKIP_TESTS, SKIP_EAGER, SWEEP_CONCURRENCY (default 16,64,256), HF_BATCHES (default "1 64"; empty skips HF).
# Usage: bash loadtest/device_serving.sh [INPUT_LEN] [OUTPUT_LEN]
set -u
IN=${1:-512}; OUTLEN=${2:-128}; MODEL=${MODEL:-bench}; DEVICE=${DEVICE:-cuda}; PY=${PY:-python3}
PORT=8011; URL=http://127.0.0.1:$PORT
OUT=${OUT:-/tmp/pagewalk_out}; mkdir -p "$OUT"
[ -n "${NO_WHEELS:-}" ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
$PY -c "import torch, triton; print('gpu', torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu', 'torch', torch.__version__, 'triton', triton.__version__)" \
  | tee "$OUT/versions.txt"

echo "== host profile of the paged-decode call"
[ "$DEVICE" = cuda ] && [ -z "${SKIP_PROFILE:-}" ] && timeout 120 $PY -m kernels.host_profile --out "$OUT" 2>&1 | tail -n 8

echo "== GPU tests (runner, CUDA graphs)"
[ -z "${SKIP_TESTS:-}" ] && timeout 240 $PY -m pytest -q -m gpu tests/test_runner_gpu.py 2>&1 | tail -n 15 | tee "$OUT/runner_gpu_tests.log"

HEALTH="import httpx,sys; r=httpx.get('$URL/health', timeout=2); print(r.text)"
LT="$PY -m loadtest --base-url $URL --input-len $IN --output-len $OUTLEN --no-progress --seed 0"

start_server() {  # $1 = label, rest = extra serve flags
  local label=$1; shift
  $PY -m server.cli serve --model $MODEL --device $DEVICE --port $PORT --max-num-seqs 256 \
    --max-num-batched-tokens 8192 "$@" > "$OUT/server_$label.log" 2>&1 &
  SERVER=$!
  for _ in $(seq 1 240); do $PY -c "$HEALTH" > "$OUT/health_$label.json" 2>/dev/null && break; sleep 1; done
  cat "$OUT/health_$label.json"; echo
}
stop_server() {
  kill -TERM $SERVER; wait $SERVER; echo "server exit code $?"
  grep -iE "backend|capacity|graph|serving" "$OUT/server_$1.log" | head -n 6
}

echo "== serve $MODEL with CUDA-graph decode"
start_server graphs
timeout 120 $LT --num-requests 8 --concurrency 1 --warmup 2 --out "$OUT/serve_graphs_c1.json" | tail -n 22
timeout 240 $LT --num-requests 256 --sweep-concurrency "${SWEEP_CONCURRENCY:-16,64,256}" --warmup 8 \
  --out "$OUT/serve_graphs_sweep.json" | tail -n 8
stop_server graphs

if [ -z "${SKIP_EAGER:-}" ]; then
  echo "== serve $MODEL eager (--enforce-eager), the baseline"
  start_server eager --enforce-eager
  timeout 120 $LT --num-requests 8 --concurrency 1 --warmup 2 --out "$OUT/serve_eager_c1.json" | tail -n 12
  timeout 120 $LT --num-requests 256 --concurrency 64 --warmup 8 --out "$OUT/serve_eager_c64.json" | tail -n 12
  stop_server eager
fi

echo "== HF generate baseline (static cache), same weights and shape"
for B in ${HF_BATCHES-1 64}; do
  timeout 240 $PY -m loadtest.hf_baseline --model $MODEL --device $DEVICE --batch-size $B --input-len $IN \
    --output-len $OUTLEN --iters 2 --out "$OUT/hf_b$B.json" | grep -E "output_throughput|decode_throughput"
done
