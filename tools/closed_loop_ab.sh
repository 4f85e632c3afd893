#!/usr/bin/env bash
# One GPU call, an A/B of the engine core without HTTP: the tree before (BEFORE=dir, e.g. `git archive`d into
# .base) and the one after (AFTER=dir, default this one), each in fresh processes, in the order before, after,
# before, after (a host or clock drift shows as a gap between the two runs of one side):
#   - the closed loops LOOPS (default 256 then 64 in flight, 256 requests of 512 in / 128 out; the 256 loop
#     is the first of its process, what a server's first burst meets; engine_step_bench's C:N[:KIND]), with
#     each step's wall, prompt tokens and decode rows;
#   - with PREFILL_ARGS, in the first round, tools/prefill_step_bench (prefill and mixed steps, each step's
#     top kernels);
# then the GPU tests named in TESTS (default: the runner, mixed graphs, fused forward and engine ones) on the
# after tree (TEST_ARGS: pytest's arguments in place of `-m gpu TESTS`). With CLOCKS=1, nvidia-smi samples the SM clock, power and throttle reasons every 100 ms during each
# side's runs (clocks_<side><round>.csv, summarised last): a prompt step's time moves with the clock.
# Tables last; JSON under OUT.
# Usage on the device machine, from the repo root, the FastAPI stack's wheels in .whl:
#   OUT=/some/dir BEFORE=.base [AFTER=.mid] [LOOPS="64:256:bad_words 64:256"] [PREFILL_ARGS="..."] \
#     [TESTS="tests/x.py"] bash tools/closed_loop_ab.sh
set -uo pipefail
OUT=${OUT:-/tmp/closed_loop_ab}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1
side() {  # $1: before | after, $2: round; runs in the current directory
  local sampler=""
  if [[ "${CLOCKS:-0}" == 1 ]]; then
    nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active \
      --format=csv,noheader,nounits -lms 100 > "$OUT/clocks_$1$2.csv" &
    sampler=$!
  fi
  PYTHONPATH=/tmp/site:$PWD timeout 300 python3 -m tools.engine_step_bench --batches 256 --modes greedy \
    --steps 8 --warmup 2 --closed-loop ${LOOPS:-256:256 64:256} --out "$OUT/$1$2.json" > "$OUT/$1$2.txt" 2>&1
  if [[ -n "${PREFILL_ARGS:-}" && $2 == 1 ]]; then
    # shellcheck disable=SC2086
    PYTHONPATH=/tmp/site:$PWD timeout 300 python3 -m tools.prefill_step_bench --modes graphs \
      --out "$OUT/prefill_$1$2.json" $PREFILL_ARGS > "$OUT/prefill_$1$2.txt" 2>&1
  fi
  if [[ -n "$sampler" ]]; then kill "$sampler"; wait "$sampler" 2>/dev/null; fi
}
for round in 1 2; do
  (cd "${BEFORE:-.base}" && side before $round)
  (cd "${AFTER:-.}" && side after $round)
done
# shellcheck disable=SC2086
(cd "${AFTER:-.}" && PYTHONPATH=/tmp/site:$PWD timeout ${TESTS_TIMEOUT:-240} python3 -m pytest -q \
  -p no:cacheprovider ${TEST_ARGS:--m gpu ${TESTS:-tests/test_runner_gpu.py tests/test_runner_cuda_graphs.py \
  tests/test_model_fused_forward.py tests/test_engine_async.py}} 2>&1 | tail -n 6)
for run in before1 after1 before2 after2; do
  echo "== $run"; grep -A3 "^closed loop" "$OUT/$run.txt"
  if [[ -f "$OUT/prefill_$run.txt" ]]; then
    grep -v '^\[' "$OUT/prefill_$run.txt" | grep -E "^ *graphs" | cut -c1-100
  fi
done
for csv in "$OUT"/clocks_*.csv; do  # SM MHz and W over the samples: min / median / max
  [[ -f "$csv" ]] || continue
  sort -t, -k2,2n "$csv" | awk -F', *' -v f="$(basename "$csv")" \
    '{sm[NR]=$2; w+=$3; if ($3>wmax) wmax=$3} END {if (NR) printf "%s: %d samples, SM MHz %s / %s / %s, mean %.0f W, max %.0f W\n", f, NR, sm[1], sm[int((NR+1)/2)], sm[NR], w/NR, wmax}'
done
# the logs in one archive: a device call brings back 8 files (4 loop JSONs, 2 prefill JSONs, this)
(cd "$OUT" && tar czf logs.tgz ./*.txt ./clocks_*.csv 2>/dev/null; rm -f ./*.txt ./clocks_*.csv)
