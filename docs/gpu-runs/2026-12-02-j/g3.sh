#!/usr/bin/env bash
# call 4: gcmoe bench (3 models, sequential), then sanitizers on the new kernels
set -u
mkdir -p $OUT/c $OUT/d
( timeout 150 python3 tools/gpu/precompile.py --models deepseek-v4-flash deepseek-v3 glm-5 --tokens 1 8 32 128 256 --workers 16 ) > $OUT/c/precompile.log 2>&1; tail -2 $OUT/c/precompile.log
OUT=$OUT/c timeout 200 bash tools/gpu/bench.sh --models deepseek-v4-flash deepseek-v3 glm-5 --tokens 1 8 32 128 256 --variants sequential --iters 20 > $OUT/c/bench-run.log 2>&1; echo "bench rc=$?"
tail -40 $OUT/c/bench.md 2>/dev/null | head -60
OUT=$OUT/d SANITIZE_ARGS="--cases 'ring-*' 'rows-*' layer" SANITIZE_TOOLS="memcheck synccheck" SANITIZE_TIMEOUT=120 timeout 250 bash tools/gpu/sanitize.sh > $OUT/d/sanitize.log 2>&1; echo "sanitize rc=$?"
tail -20 $OUT/d/sanitize.log
