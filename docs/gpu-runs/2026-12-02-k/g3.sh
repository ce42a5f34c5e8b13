#!/usr/bin/env bash
# call: the kernel tests' new in-order variants on the final kernels; the shared W1 + W2 L2 prefetch side by side
set -u
mkdir -p $OUT/c
( timeout 150 python3 tools/gpu/precompile.py --models deepseek-v4-flash deepseek-v3 glm-5 --tokens 1 2 --tests --test-variants '*in-order' --workers 16 ) > $OUT/c/precompile.log 2>&1; tail -2 $OUT/c/precompile.log
timeout 150 python3 -m pytest -q packages/gcmoe-gemm-sm90/tests/test_grouped_gpu.py -m "sm90 or gpu" -k "in-order or in_order or ring" -p no:cacheprovider > $OUT/c/inorder-tests.log 2>&1; echo "tests rc=$?" >> $OUT/c/inorder-tests.log
tail -3 $OUT/c/inorder-tests.log
timeout 250 python3 docs/gpu-runs/2026-12-02-k/l2w2.py $OUT/c/l2w2.json > $OUT/c/l2w2.log 2>&1; echo "l2w2 rc=$?"
cat $OUT/c/l2w2.log | grep -v Warn
