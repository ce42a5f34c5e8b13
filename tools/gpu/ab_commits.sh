#!/usr/bin/env bash
# A code A/B of the public layer on the device machine: the lab's layer_ab probe run alternately (old, new, old, new)
# on an older checkout's packages and on this one's, each process its own CUDA context; JSON under $OUT/ab/. The
# probe comes from this checkout's lab either way (it uses the public layer only); compare the digests per point.
#   here:    rm -rf scratch/old && mkdir -p scratch/old && git archive REV packages | tar -x -C scratch/old
#   device:  bash tools/gpu/ab_commits.sh scratch/old/packages [layer_ab options, e.g. --tokens 1 32 128 256]
# (after the CuTe DSL install)
set -uo pipefail
cd "$(dirname "$0")/../.."
OLD=$(cd "$1" && pwd); shift
OUT=${OUT:-/tmp/gcmoe-gpu-out}
mkdir -p "$OUT/ab"
LAB=$PWD/packages/gcmoe-lab/src
NEWPP=${PYTHONPATH:-}
for p in packages/*/src; do NEWPP="$PWD/$p${NEWPP:+:$NEWPP}"; done
OLDPP="$LAB${PYTHONPATH:+:$PYTHONPATH}"
for p in "$OLD"/*/src; do OLDPP="$p:$OLDPP"; done
for r in 1 2; do
  PYTHONPATH=$OLDPP python3 -m gcmoe_lab probe layer_ab --tag old --out "$OUT/ab/old-$r.json" "$@"
  PYTHONPATH=$NEWPP python3 -m gcmoe_lab probe layer_ab --tag new --out "$OUT/ab/new-$r.json" "$@"
done
