#!/usr/bin/env bash
# A code A/B of the public layer on the device machine: tools/gpu/layer_ab.py run alternately (old, new, old, new)
# from an older checkout's packages and from this one's, each process its own CUDA context; JSON under $OUT/ab/.
#   here:    rm -rf scratch/old && mkdir -p scratch/old && git archive REV packages | tar -x -C scratch/old
#   device:  bash tools/gpu/ab_commits.sh scratch/old/packages [layer_ab.py options, e.g. --tokens 1 32 128 256]
# (after the CuTe DSL install; PYTHONPATH as in run.sh: this checkout's packages/*/src and the wheels)
set -uo pipefail
cd "$(dirname "$0")/../.."
OLD=$(cd "$1" && pwd); shift
OUT=${OUT:-/tmp/gcmoe-gpu-out}
mkdir -p "$OUT/ab"
OLDPP=$PYTHONPATH
for p in "$OLD"/*/src; do OLDPP="$p:$OLDPP"; done
for r in 1 2; do
  PYTHONPATH=$OLDPP python3 tools/gpu/layer_ab.py --tag old --out "$OUT/ab/old-$r.json" "$@"
  python3 tools/gpu/layer_ab.py --tag new --out "$OUT/ab/new-$r.json" "$@"
done
