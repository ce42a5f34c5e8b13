#!/usr/bin/env bash
# call: W1's stream_k CTAs at T = 1, side by side
set -u
mkdir -p $OUT/e
( timeout 120 python3 tools/gpu/precompile.py --models deepseek-v3 glm-5 --tokens 1 --workers 16 ) > $OUT/e/precompile.log 2>&1; tail -1 $OUT/e/precompile.log
timeout 300 python3 docs/gpu-runs/2026-12-02-k/sksweep.py $OUT/e/sksweep.json > $OUT/e/sksweep.log 2>&1; echo "sksweep rc=$?"
grep -v Warn $OUT/e/sksweep.log
