#!/usr/bin/env bash
# One device call of the 2026-12-03-b run (after the CuTe DSL install; PYTHONPATH as in tools/gpu/run.sh):
#   kernel — precompile the sm90 tests' kernels; the new range test, the fuzz test on the GPU
#   sm90   — the sm90 package's GPU tests; the layer's kernels of this checkout and of scratch/old (git archive dc731eb
#            packages) precompiled; the code A/B of the public layer (tools/gpu/ab_commits.sh)
#   rest   — the GPU tests of every package but the sm90 one, and tests-integration
#   again  — (the kernels with the unit's t in shared memory by piece parity) all the sm90 tests' kernels and the
#            layer's of both checkouts precompiled; the range test, the fuzz test, the sm90 ring / prepack tests (the
#            end of the suite the sm90 step's bound cut); the code A/B
set -uo pipefail
cd "$(dirname "$0")/../../.."
OUT=${OUT:-/tmp/gcmoe-gpu-out}
mkdir -p "$OUT"
PT=(python3 -m pytest -rs -q -p no:cacheprovider -p timeout --timeout=300 --timeout-method=thread)
case "$1" in
  kernel)
    nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv | tee "$OUT/info.txt"; date -u | tee -a "$OUT/info.txt"
    timeout 330 python3 tools/gpu/precompile.py --tests --test-variants '*' 2>&1 | tail -5 | tee "$OUT/precompile.log"
    timeout 120 "${PT[@]}" packages/gcmoe-gemm-sm90/tests/test_grouped_gpu.py -m sm90 -k both_ends 2>&1 \
      | tail -15 | tee "$OUT/range.log"
    timeout 120 "${PT[@]}" packages/gcmoe/tests/test_fuzz.py -m sm90 2>&1 | tail -40 | tee "$OUT/fuzz.log"
    date -u | tee -a "$OUT/info.txt" ;;
  sm90)
    date -u | tee "$OUT/info.txt"
    timeout 280 "${PT[@]}" packages/gcmoe-gemm-sm90 -m "sm90 or gpu" 2>&1 | tail -30 | tee "$OUT/sm90-tests.log"
    OLDPP=$PYTHONPATH; for p in "$PWD"/scratch/old/packages/*/src; do OLDPP="$p:$OLDPP"; done
    args=(--models deepseek-v4-flash deepseek-v3 --tokens 1 8 32 128 256 --workers 8)
    timeout 100 python3 tools/gpu/precompile.py "${args[@]}" 2>&1 | tail -3 | tee -a "$OUT/precompile.log" &
    PYTHONPATH=$OLDPP timeout 100 python3 tools/gpu/precompile.py "${args[@]}" 2>&1 | tail -3 \
      | tee -a "$OUT/precompile.log"
    wait
    timeout 200 bash tools/gpu/ab_commits.sh scratch/old/packages --models deepseek-v4-flash deepseek-v3 \
      --tokens 1 8 32 128 256 --iters 30 2>&1 | tee "$OUT/ab.log" | tail -40
    date -u | tee -a "$OUT/info.txt" ;;
  rest)
    timeout 500 "${PT[@]}" packages tests-integration --ignore=packages/gcmoe-gemm-sm90 \
      -m "gpu or sm90 or sm103 or multigpu" 2>&1 | tail -30 | tee "$OUT/tests-layer.log" ;;
  again)
    nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv | tee "$OUT/info.txt"; date -u | tee -a "$OUT/info.txt"
    OLDPP=$PYTHONPATH; for p in "$PWD"/scratch/old/packages/*/src; do OLDPP="$p:$OLDPP"; done
    args=(--models deepseek-v4-flash deepseek-v3 --tokens 1 8 32 128 256)
    { timeout 150 python3 tools/gpu/precompile.py --tests --test-variants '*' "${args[@]}" 2>&1 | tail -3
      PYTHONPATH=$OLDPP timeout 100 python3 tools/gpu/precompile.py "${args[@]}" 2>&1 | tail -3; } \
      | tee "$OUT/precompile.log"
    { timeout 100 "${PT[@]}" packages/gcmoe-gemm-sm90/tests/test_grouped_gpu.py -m sm90 -k both_ends 2>&1 | tail -3
      timeout 100 "${PT[@]}" packages/gcmoe/tests/test_fuzz.py -m sm90 2>&1 | tail -3
      timeout 150 "${PT[@]}" packages/gcmoe-gemm-sm90 -m "sm90 or gpu" -k "ring or prepack" 2>&1 | tail -3; } \
      | tee "$OUT/tests.log"
    timeout 200 bash tools/gpu/ab_commits.sh scratch/old/packages --models deepseek-v4-flash deepseek-v3 \
      --tokens 1 8 32 128 256 --iters 30 2>&1 | tee "$OUT/ab.log" | tail -40
    date -u | tee -a "$OUT/info.txt" ;;
esac
