#!/usr/bin/env bash
# call: the shared experts' W1 L2 prefetch, by CTA count and size, side by side at T = 1
set -u
mkdir -p $OUT/d
( timeout 150 python3 tools/gpu/precompile.py --models deepseek-v4-flash deepseek-v3 glm-5 --tokens 1 --workers 16 ) > $OUT/d/precompile.log 2>&1; tail -1 $OUT/d/precompile.log
timeout 400 python3 docs/gpu-runs/2026-12-02-k/l2sweep.py $OUT/d/l2sweep.json > $OUT/d/l2sweep.log 2>&1; echo "l2sweep rc=$?"
grep -v Warn $OUT/d/l2sweep.log
