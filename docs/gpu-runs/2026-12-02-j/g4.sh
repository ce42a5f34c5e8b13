#!/usr/bin/env bash
# call 5: racecheck on the new kernels (shared-memory row scales, record words)
set -u
mkdir -p $OUT/e
OUT=$OUT/e SANITIZE_ARGS="--cases ring-n80-half ring-stream-k rows-n8 rows-n32-wg4-half ring-splitk layer" SANITIZE_TOOLS="synccheck racecheck" SANITIZE_TIMEOUT=250 timeout 540 bash tools/gpu/sanitize.sh > $OUT/e/sanitize.log 2>&1; echo "racecheck rc=$?"
tail -30 $OUT/e/sanitize.log
