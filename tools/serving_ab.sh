#!/usr/bin/env bash
# One GPU call, an A/B of the served path over HTTP: the tree before (BEFORE=dir, e.g. `git archive`d into
# .base) and this one, each `tools/serving_bench --levels LEVELS --no-sampled --skip engine,hf` (a fresh
# server under loadtest: fresh and cached prompts at each level), in the order before, after, before, after
# (a host or clock drift shows as a gap between the two runs of one side); first the GPU tests named in TESTS
# on this tree. Output tok/s per run kind, a table last; each run's serving JSON under OUT/<side><round>/.
# Usage on the device machine, from the repo root, the FastAPI stack's wheels in .whl:
#   OUT=/some/dir BEFORE=.base [LEVELS="64 256"] [TESTS="tests/x.py"] bash tools/serving_ab.sh
set -uo pipefail
OUT=${OUT:-/tmp/serving_ab}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1
if [[ -n "${TESTS:-}" ]]; then
  # shellcheck disable=SC2086
  PYTHONPATH=/tmp/site:$PWD timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider $TESTS 2>&1 | tail -n 3 \
    | tee "$OUT/gpu_tests.txt"
fi
side() {  # $1: before | after, $2: round; runs in the current directory
  # shellcheck disable=SC2086
  PYTHONPATH=/tmp/site:$PWD timeout 240 python3 -m tools.serving_bench --out "$OUT/$1$2" \
    --levels ${LEVELS:-64 256} --no-sampled --skip engine,hf > "$OUT/$1$2.txt" 2>&1
  rm -f "$OUT/$1$2"/loadtest_* "$OUT/$1$2"/server*.log
}
for round in 1 2; do
  (cd "${BEFORE:-.base}" && side before "$round")
  side after "$round"
done
python3 - "$OUT" <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
runs = {}  # side -> [(round, {kind: tok/s})]
gpu = "?"
for path in sorted(out.glob("*/serving_*.json")):
    res = json.loads(path.read_text())
    gpu = f"{res['gpu']}, torch {res['torch']}, triton {res['triton']}"
    side = path.parent.name
    runs[side] = {k: r["output_throughput"] for k, r in res["serving"]["reports"].items() if r}
kinds = sorted({k for r in runs.values() for k in r}, key=lambda k: (int(k[1:].split("_")[0]), k))
sides = sorted(runs, key=lambda s: (s[-1], s.startswith("after")))
print(gpu)
print("| HTTP run | " + " | ".join(sides) + " |")
print("|---|" + "---|" * len(sides))
for k in kinds:
    print(f"| {k} | " + " | ".join(f"{runs[s].get(k, 0):,.0f}" for s in sides) + " |")
EOF
