#!/usr/bin/env bash
# One GPU call for the serving issues (run from the repo root on the GPU machine with .whl carried):
# install the carried wheels (`../shared/tools/device-wheels pyzmq msgspec jinja2 markupsafe httptools`: the
# FastAPI stack and those; and llguidance >= 1.9, whose wheels are manylinux_2_31, which device-wheels does not
# ask for: `python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --platform
# manylinux_2_31_x86_64 -d .whl llguidance==1.9.1`), then the parts named in PARTS (default: all):
#   tests    the runner/engine GPU tests
#   hazards  tools/step_hazards (Triton compiles after start-up, host-device syncs, under random traffic)
#   forward  tools/decode_forward_bench (the decode step's graph replay, torch vs fused ops, per-kernel split);
#            FORWARD_ARGS are passed to it
#   prefill  tools/prefill_step_bench (prefill and mixed decode+prefill steps: wall, device busy, TFLOP/s);
#            PREFILL_ARGS are passed to it
#   prefill_kernel  the paged-prefill kernel's GPU tests (bf16 grid) and tools/prefill_bench --sweep (against
#            SDPA flash / cuDNN on contiguous K/V), writing prefill_<gpu>.json under OUT
#   skinny   tools/skinny_gemm_probe (the 64 projections of a step chained at 16/64/256 rows: cuBLAS vs a
#            Triton tensor-core GEMM with and without PDL)
#   stalls   tools/closed_loop_stalls at 256 in flight (a fresh process's first burst: slow calls, compiles,
#            allocations, stacks of stalled launches), then again with CUDA_MODULE_LOADING=EAGER (every CUDA
#            module loaded at start-up, none on first use; STALLS_LOADING="LAZY" runs the first only), and
#            tools/lm_head_first_call_probe; STALLS_ARGS are passed to closed_loop_stalls
#   sampler  tools/sampler_bench (the sort-free sampling kernel against the sorted torch path and greedy)
#   guided   structured outputs: the engine's closed loops free and every request guided at 64 and 256 in
#            flight (tools/engine_step_bench :guided), the host phases of the guided loop's steps
#            (tools/guided_stall_probe) and a step's masks (tools/grammar_mask_probe)
#   serving  tools/serving_bench (server under loadtest at concurrency 1/16/64/256, the engine offline,
#            HF generate); SERVING_ARGS are passed to it
# Usage: OUT=/some/dir [PARTS=hazards,prefill] [SERVING_ARGS="--long"] bash tools/serving_gpu_run.sh
set -u
OUT=${OUT:-/tmp/serving_gpu_run}; mkdir -p "$OUT"
PARTS=${PARTS:-tests,hazards,forward,prefill,prefill_kernel,sampler,serving}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
has() { [[ ",$PARTS," == *",$1,"* ]]; }
if has tests; then
  timeout ${TESTS_TIMEOUT:-300} python3 -m pytest -q -m gpu -p no:cacheprovider --durations=15 tests/test_runner_gpu.py tests/test_runner_cuda_graphs.py \
    tests/test_engine_process.py tests/test_engine_async.py tests/test_model_fused_forward.py \
    tests/test_kernels_sampling.py tests/test_engine_logit_bias.py tests/test_engine_bad_words.py tests/test_engine_grammar.py tests/test_kernels_token_mask.py tests/test_kernels_gemv.py tests/test_kernels_splitk_add.py tests/test_kernels_gate_up_silu.py tests/test_kernels_argmax.py tests/test_kernels_new_token_rope.py \
    tests/test_gpu_kernels.py::test_gpu_step_inputs_match_the_torch_derivation 2>&1 | tail -n 30 | tee "$OUT/gpu_tests.txt"
fi
if has hazards; then
  timeout 300 python3 -m tools.step_hazards --out "$OUT/step_hazards.json" > "$OUT/step_hazards.log" 2>&1
  tail -n 25 "$OUT/step_hazards.log"
fi
if has forward; then
  # shellcheck disable=SC2086
  timeout 300 python3 -m tools.decode_forward_bench --out "$OUT" ${FORWARD_ARGS:-} > "$OUT/decode_forward.log" 2>&1
  tail -n 8 "$OUT/decode_forward.log"
fi
if has prefill; then
  # shellcheck disable=SC2086
  timeout 300 python3 -m tools.prefill_step_bench --out "$OUT/prefill_step.json" ${PREFILL_ARGS:-} \
    > "$OUT/prefill_step.log" 2>&1
  grep -v '^\[' "$OUT/prefill_step.log" | tail -n 26
fi
if has prefill_kernel; then
  timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_paged_prefill.py 2>&1 | tail -n 3 \
    | tee "$OUT/prefill_kernel_tests.txt"
  timeout 400 python3 -m tools.prefill_bench --sweep --out "$OUT" > "$OUT/prefill_bench.log" 2>&1
  tail -n 30 "$OUT/prefill_bench.log"
fi
if has skinny; then
  OUT=$OUT timeout 400 python3 -m tools.skinny_gemm_probe > "$OUT/skinny_gemm_probe.log" 2>&1
  tail -n 34 "$OUT/skinny_gemm_probe.log"
fi
if has stalls; then
  timeout 120 python3 -m tools.lm_head_first_call_probe --out "$OUT/lm_head_first_call.json" 2>&1 | tail -n 3 \
    | cut -c1-1500
  for loading in ${STALLS_LOADING:-LAZY EAGER}; do
    # shellcheck disable=SC2086
    CUDA_MODULE_LOADING=$loading timeout 240 python3 -m tools.closed_loop_stalls --concurrency 256 \
      --out "$OUT/closed_loop_stalls_$loading.json" ${STALLS_ARGS:-} > "$OUT/closed_loop_stalls_$loading.log" 2>&1
    echo "== CUDA_MODULE_LOADING=$loading"; grep -v '^\[' "$OUT/closed_loop_stalls_$loading.log" | tail -n 40 | cut -c1-700
  done
fi
if has sampler; then
  timeout 120 python3 -m tools.sampler_bench --out "$OUT" > "$OUT/sampler_bench.log" 2>&1
  tail -n 20 "$OUT/sampler_bench.log"
fi
if has guided; then
  timeout 300 python3 -m tools.engine_step_bench --batches 64 256 --modes greedy --steps 16 --warmup 4 \
    --closed-loop 64:256 64:256:guided 64:256:bad_words 256:256 256:256:guided 256:256:bad_words \
    --out "$OUT/guided_loops.json" \
    > "$OUT/guided_loops.log" 2>&1
  grep -E '^(closed loop|async=|  (with_prompt|decode_only))' "$OUT/guided_loops.log" | tail -n 24
  timeout 200 python3 -m tools.guided_stall_probe > "$OUT/guided_stall_probe.log" 2>&1
  head -c 3000 "$OUT/guided_stall_probe.log"
  timeout 120 python3 -m tools.grammar_mask_probe --steps 20 > "$OUT/grammar_mask_probe.log" 2>&1
  tail -n 12 "$OUT/grammar_mask_probe.log"
fi
if has serving; then
  # shellcheck disable=SC2086
  python3 -m tools.serving_bench --out "$OUT" ${SERVING_ARGS:-} 2>&1 | tail -n 40
  # the per-run reports and logs in one archive: a device call brings back a few files only
  (cd "$OUT" && tar czf serving_runs.tgz loadtest_* ./*.log 2>/dev/null && rm -f loadtest_* server*.log)
fi
