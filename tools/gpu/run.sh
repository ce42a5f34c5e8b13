#!/usr/bin/env bash
# The GPU runner: on the device machine (the image's python3 with CUDA torch), make our packages and the shipped
# CuTe DSL importable, then run the requested steps and leave results under $OUT.
#
#   one-time per session, here:  bash ../shared/device/pack-cutlass-dsl.sh .gpu-wheels
#   device call 1 (carry .gpu-wheels/a):  bash .gpu-wheels/a/stash.sh
#   device call 2 (carry .gpu-wheels/b):  source .gpu-wheels/b/install.sh && bash tools/gpu/run.sh info tests greenctx bench
#   later calls on the warm machine:      source .gpu-wheels/b/install.sh && bash tools/gpu/run.sh <steps>
#
# steps: info | precompile | tests | tests-layer | tests-sm90 | greenctx | layersmoke | bench | sanitize | sm90 |
# sm90bench | comm | multiproc | commbench | soak | benchmark | all
# (default: all). Each step's log and results land in $OUT. BENCH_ARGS / SM90_BENCH_ARGS / PRECOMPILE_ARGS /
# SOAK_ARGS / BENCHMARK_ARGS / COMM_TEST_ARGS / MULTIPROC_ARGS pass through. The measuring steps run the lab
# (packages/gcmoe-lab: `python3 -m gcmoe_lab ...`, the same as the `gcmoe-lab` command).
# precompile: the precompile probe (the layer's GEMM variants for PRECOMPILE_ARGS, default V4-Flash and V3 at
# T = 1 8 32 128, and the sm90 ring tests' variants, compiled in parallel into the DSL cache: the later steps load
# them instead of compiling one by one). tests: each test bounded by 300 s (pytest-timeout), so a hang costs one test;
# the whole GPU suite outlasts one 600 s device call after precompile (~440 of 486 tests in 390 s), so run it as
# tests-layer (every package but gcmoe-gemm-sm90, and tests-integration) and tests-sm90 in two calls.
# bench: `gcmoe-lab bench` without the peers (tools/gpu/bench.sh runs it with them). layersmoke: the layer_smoke probe.
# soak: the soak probe (100,000 checked graph replays, ~3 min; SOAK_ARGS, e.g. "--replays 20000") -> $OUT/soak/;
# benchmark: pytest-benchmark over the layer (packages/gcmoe-lab/tests/test_bench_layer.py; BENCHMARK_ARGS, e.g.
# "-k deepseek-v3") -> $OUT/benchmark.json. greenctx / sm90bench / commbench: the lab's component benches.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/gcmoe-gpu-out}
mkdir -p "$OUT"
for p in packages/*/src; do PYTHONPATH="$PWD/$p${PYTHONPATH:+:$PYTHONPATH}"; done
export PYTHONPATH PYTHONUNBUFFERED=1 GCMOE_CACHE_DIR=${GCMOE_CACHE_DIR:-/tmp/gcmoe-cache}
steps=("$@"); [ ${#steps[@]} -eq 0 ] && steps=(all)
rc=0
run_step() {
  case "$1" in
    info)     python3 -m gcmoe.cli info --json > "$OUT/info.json" && python3 -m gcmoe.cli info | tee "$OUT/info.txt" ;;
    precompile) timeout 300 python3 -m gcmoe_lab probe precompile ${PRECOMPILE_ARGS:---tests} 2>&1 | tee "$OUT/precompile.log"
              return "${PIPESTATUS[0]}" ;;
    tests|tests-layer|tests-sm90)
              local sel=(packages tests-integration) tag=""
              [ "$1" = tests-layer ] && sel+=(--ignore=packages/gcmoe-gemm-sm90) && tag=-layer
              [ "$1" = tests-sm90 ] && sel=(packages/gcmoe-gemm-sm90) && tag=-sm90
              python3 -m pytest "${sel[@]}" -m "gpu or sm90 or sm103 or multigpu or compile" -rs -q \
                -p timeout --timeout=300 --timeout-method=thread \
                --junitxml="$OUT/junit$tag.xml" -p no:cacheprovider 2>&1 | tee "$OUT/pytest$tag.log"
              return "${PIPESTATUS[0]}" ;;
    greenctx) python3 -m gcmoe_lab probe bench_greenctx --out "$OUT" 2>&1 | tee "$OUT/greenctx.log"
              return "${PIPESTATUS[0]}" ;;
    bench)    python3 -m gcmoe_lab bench --json "$OUT/bench.json" --markdown "$OUT/bench.md" --plot "$OUT/bench.png" \
                ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
              return "${PIPESTATUS[0]}" ;;
    sanitize) bash tools/gpu/sanitize.sh 2>&1 | tee "$OUT/sanitize.log"; return "${PIPESTATUS[0]}" ;;
    soak)     timeout 420 python3 -m gcmoe_lab probe soak --out "$OUT/soak" ${SOAK_ARGS:-} 2>&1 | tee "$OUT/soak.log"
              return "${PIPESTATUS[0]}" ;;
    benchmark) timeout 540 python3 -m pytest packages/gcmoe-lab/tests/test_bench_layer.py -m gpu -rs -q -p no:cacheprovider \
                --benchmark-json "$OUT/benchmark.json" ${BENCHMARK_ARGS:-} 2>&1 | tee "$OUT/benchmark.log"
              return "${PIPESTATUS[0]}" ;;
    layersmoke) timeout 300 python3 -m gcmoe_lab probe layer_smoke --timeout 280 2>&1 | tee "$OUT/layer-smoke.log"
              return "${PIPESTATUS[0]}" ;;
    sm90)     timeout 420 python3 -m pytest packages/gcmoe-gemm-sm90 -m "sm90 or compile" -rs -q -p no:cacheprovider \
                -p timeout --timeout=120 --timeout-method=thread 2>&1 | tee "$OUT/sm90-tests.log"; return "${PIPESTATUS[0]}" ;;
    comm)     timeout 420 python3 -m pytest packages/gcmoe-comm -m "gpu or compile" -rs -q -p no:cacheprovider \
                -p timeout --timeout=150 --timeout-method=thread ${COMM_TEST_ARGS:-} 2>&1 | tee "$OUT/comm-tests.log"
              return "${PIPESTATUS[0]}" ;;
    multiproc) python3 packages/gcmoe-comm/tests/comm_multiproc.py --out "$OUT/comm-multiproc" ${MULTIPROC_ARGS:-} 2>&1 \
                | tail -20
              return "${PIPESTATUS[0]}" ;;
    commbench) python3 -m gcmoe_lab probe bench_comm --out "$OUT" 2>&1 | tail -30; return "${PIPESTATUS[0]}" ;;
    sm90bench) python3 -m gcmoe_lab probe bench_sm90 --out "$OUT" ${SM90_BENCH_ARGS:-} 2>&1 | tail -40
              return "${PIPESTATUS[0]}" ;;
    all)      for s in info precompile tests greenctx bench sm90bench; do run_step "$s" || rc=1; done ;;
    *)        echo "unknown step $1" >&2; return 2 ;;
  esac
}
for s in "${steps[@]}"; do echo "=== $s ==="; run_step "$s" || rc=1; done
exit $rc
