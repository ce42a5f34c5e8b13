#!/usr/bin/env bash
# Nsight Compute counters of one EP8 rank's W1 and W2 launches (tools/gpu/ncu_sm90.py), on the H200:
#   bash tools/gpu/ncu_sm90.sh MODEL TOKENS > log      (after the CuTe DSL install; PYTHONPATH as in run.sh)
# The metrics: ncu_metrics.sh.
set -uo pipefail
. "$(dirname "$0")/ncu_metrics.sh"
exec ncu --kernel-name regex:cutlass --launch-skip 2 --launch-count 2 --metrics "$metrics" \
    python3 tools/gpu/ncu_sm90.py "$@"
