#!/usr/bin/env bash
# call 2: precompile (with the kernel tests' variants), sm90 GPU tests, layer GPU tests
set -u
mkdir -p $OUT/a
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/a/env.txt; python3 -c "import torch, cutlass; print(torch.__version__, cutlass.__version__)" >> $OUT/a/env.txt 2>&1
( timeout 220 python3 tools/gpu/precompile.py --models deepseek-v4-flash deepseek-v3 --tokens 1 8 32 128 256 --tests --test-variants '*in-order' --workers 16 ) > $OUT/a/precompile.log 2>&1
echo "precompile rc=$?" >> $OUT/a/precompile.log
tail -3 $OUT/a/precompile.log
timeout 250 python3 -m pytest -q packages/gcmoe-gemm-sm90/tests -m "sm90 or gpu" -p no:cacheprovider > $OUT/a/sm90-tests.log 2>&1; echo "sm90 rc=$?" >> $OUT/a/sm90-tests.log
tail -6 $OUT/a/sm90-tests.log
timeout 110 python3 -m pytest -q packages/gcmoe/tests/test_layer_gpu.py packages/gcmoe/tests/test_masked_ids_gpu.py -m gpu -p no:cacheprovider > $OUT/a/layer-tests.log 2>&1; echo "layer rc=$?" >> $OUT/a/layer-tests.log
tail -4 $OUT/a/layer-tests.log
