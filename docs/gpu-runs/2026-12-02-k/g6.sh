#!/usr/bin/env bash
# call: the shared-W1 prefetch's halves side by side; kernel timelines with the write flush, prefetch on / off
set -u
mkdir -p $OUT/f
( timeout 120 python3 tools/gpu/precompile.py --models deepseek-v3 glm-5 --tokens 1 --workers 16 ) > $OUT/f/precompile.log 2>&1; tail -1 $OUT/f/precompile.log
timeout 200 python3 docs/gpu-runs/2026-12-02-k/l2half.py $OUT/f/l2half.json > $OUT/f/l2half.log 2>&1; echo "l2half rc=$?"
grep -v Warn $OUT/f/l2half.log
timeout 200 python3 tools/gpu/layer_probe.py --models deepseek-v3 glm-5 --tokens 1 --comm 0 --l2-prefetch on off --flush write --out $OUT/f > $OUT/f/probe.log 2>&1; echo "probe rc=$?"
grep -v Warn $OUT/f/probe.log | grep -v "_warn_once"
