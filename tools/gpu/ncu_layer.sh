#!/usr/bin/env bash
# Nsight Compute counters of the public layer's W1 and W2 (tools/gpu/ncu_layer.py), on the H200:
#   bash tools/gpu/ncu_layer.sh MODEL TOKENS [chosen|unsplit|stream_k] > log   (PYTHONPATH as in run.sh)
# The metrics: ncu_metrics.sh; the layer's third call (each call: publish, dispatch, W1, W2, finalize).
set -uo pipefail
. "$(dirname "$0")/ncu_metrics.sh"
exec ncu --kernel-name regex:gcmoe_gemm --launch-skip 4 --launch-count 2 --metrics "$metrics" \
    python3 tools/gpu/ncu_layer.py "$@"
