#!/usr/bin/env bash
# Nsight Compute source counters (warp stall samples per SASS instruction) of the public layer's W1 and W2 on the H200:
#   bash tools/gpu/ncu_source.sh MODEL TOKENS OUTDIR     (after the CuTe DSL install; ~30 s per point)
# writes OUTDIR/source-MODEL-T.csv (ncu's source page, both kernels) and OUTDIR/source-MODEL-T.txt (the ncu_source probe's
# summary: stall reasons, by opcode, the hottest instructions). The launches: layer_gemms of ncu_metrics.sh.
set -uo pipefail
. "$(dirname "$0")/ncu_metrics.sh"
model=$1; t=$2; out=$3
mkdir -p "$out"
rep=$(mktemp -d)/ncu-$model-$t
ncu "${layer_gemms[@]}" --section SourceCounters \
    --section WarpStateStats --import-source no -f -o "$rep" python3 -m gcmoe_lab probe ncu_layer "$model" "$t" \
    > "$out/source-$model-$t.log" 2>&1 || { tail -5 "$out/source-$model-$t.log"; exit 1; }
ncu --import "$rep.ncu-rep" --page source --csv --print-source sass > "$out/source-$model-$t.csv"
python3 -m gcmoe_lab probe ncu_source "$out/source-$model-$t.csv" | tee "$out/source-$model-$t.txt"
