#!/usr/bin/env bash
# kernels-only bench (#15's targets) on f6ac6f9+
set -u
mkdir -p $OUT/f
( timeout 150 python3 tools/gpu/precompile.py --models deepseek-v3 deepseek-v4-flash --tokens 1 8 32 128 --kernels-bench --workers 16 ) > $OUT/f/precompile.log 2>&1; tail -2 $OUT/f/precompile.log
timeout 200 python3 -m gcmoe_gemm_sm90.bench --out $OUT/f --models deepseek-v3 deepseek-v4-flash --tokens 1 8 32 128 --no-peers --split-sweep 0 --variants --l2-flush write --iters 20 > $OUT/f/bench.log 2>&1; echo "bench rc=$?"
cat $OUT/f/sm90_grouped.md 2>/dev/null | tail -20; tail -5 $OUT/f/bench.log
