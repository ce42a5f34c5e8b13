#!/usr/bin/env bash
# call: the shared experts' grid rows last + the prefetch at bucket 2, side by side at T = 1, 2
set -u
mkdir -p $OUT/g
( timeout 120 python3 tools/gpu/precompile.py --models deepseek-v4-flash deepseek-v3 glm-5 --tokens 1 2 --workers 16 ) > $OUT/g/precompile.log 2>&1; tail -1 $OUT/g/precompile.log
timeout 300 python3 docs/gpu-runs/2026-12-02-k/sharedlast.py $OUT/g/sharedlast.json > $OUT/g/sharedlast.log 2>&1; echo "sharedlast rc=$?"
grep -v Warn $OUT/g/sharedlast.log
