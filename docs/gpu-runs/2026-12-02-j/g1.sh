#!/usr/bin/env bash
# call 2: precompile (new with tests, mid, old), sm90 GPU tests, layer GPU tests
set -u
mkdir -p $OUT/a
NEWPP=$PYTHONPATH
pp() { local t=$1; local r=""; for p in $t/packages/*/src; do r="$PWD/$p:$r"; done; echo "$r"; }
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/a/env.txt; python3 -c "import torch, cutlass; print(torch.__version__, cutlass.__version__)" >> $OUT/a/env.txt 2>&1
( timeout 200 python3 tools/gpu/precompile.py --models deepseek-v4-flash deepseek-v3 --tokens 1 8 32 128 256 --tests --workers 16 ) > $OUT/a/precompile.log 2>&1
echo "precompile new rc=$?" >> $OUT/a/precompile.log
for t in mid old; do
  ( PYTHONPATH=$(pp scratch/$t) timeout 150 python3 scratch/$t/tools/gpu/precompile.py --models deepseek-v4-flash deepseek-v3 --tokens 1 8 32 128 256 --workers 16 ) >> $OUT/a/precompile.log 2>&1
  echo "precompile $t rc=$?" >> $OUT/a/precompile.log
done
tail -3 $OUT/a/precompile.log
timeout 260 python3 -m pytest -q -x packages/gcmoe-gemm-sm90/tests -m "sm90 or gpu" -p no:cacheprovider > $OUT/a/sm90-tests.log 2>&1; echo "sm90 rc=$?" >> $OUT/a/sm90-tests.log
tail -4 $OUT/a/sm90-tests.log
timeout 120 python3 -m pytest -q packages/gcmoe/tests/test_layer_gpu.py packages/gcmoe/tests/test_masked_ids_gpu.py -m gpu -p no:cacheprovider > $OUT/a/layer-tests.log 2>&1; echo "layer rc=$?" >> $OUT/a/layer-tests.log
tail -4 $OUT/a/layer-tests.log
