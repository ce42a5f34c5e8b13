#!/usr/bin/env bash
# Nsight Compute counters of one EP8 rank's W1 and W2 launches (the lab's ncu_sm90 probe), on the H200:
#   bash tools/gpu/ncu_sm90.sh MODEL TOKENS > log      (after the CuTe DSL install)
# The metrics: ncu_metrics.sh.
set -uo pipefail
. "$(dirname "$0")/ncu_metrics.sh"
exec ncu --kernel-name regex:cutlass --launch-skip 2 --launch-count 2 --metrics "$metrics" \
    python3 -m gcmoe_lab probe ncu_sm90 "$@"
