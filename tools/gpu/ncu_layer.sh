#!/usr/bin/env bash
# Nsight Compute counters of the public layer's W1 and W2 (the lab's ncu_layer probe), on the H200:
#   bash tools/gpu/ncu_layer.sh MODEL TOKENS [chosen|unsplit|stream_k] > log   (after the CuTe DSL install)
# The metrics and the launches (layer_gemms): ncu_metrics.sh.
set -uo pipefail
. "$(dirname "$0")/ncu_metrics.sh"
exec ncu "${layer_gemms[@]}" --metrics "$metrics" \
    python3 -m gcmoe_lab probe ncu_layer "$@"
