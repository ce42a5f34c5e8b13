#!/usr/bin/env bash
# call 3: code A/B on the public layer (old 3e8b5b5 / new = working tree), alternated twice; then gcmoe bench
set -u
mkdir -p $OUT/b/ab $OUT/c
NEWPP=$PYTHONPATH
BASEPP=$(echo "$PYTHONPATH" | tr ':' '\n' | grep -v "/packages/.*/src" | paste -sd:)
pp() { local t=$1; local r=""; for p in $t/packages/*/src; do r="$PWD/$p:$r"; done; echo "$r$BASEPP"; }
( PYTHONPATH=$(pp scratch/old) timeout 150 python3 scratch/old/tools/gpu/precompile.py --models deepseek-v4-flash deepseek-v3 --tokens 1 8 32 128 256 --workers 8 ) > $OUT/b/precompile-old.log 2>&1 &
( timeout 150 python3 tools/gpu/precompile.py --models deepseek-v4-flash deepseek-v3 glm-5 --tokens 1 8 32 128 256 --workers 8 ) > $OUT/b/precompile-new.log 2>&1 &
wait; tail -2 $OUT/b/precompile-*.log
for r in 1 2; do for t in old new; do
  if [ $t = new ]; then P=$NEWPP; else P=$(pp scratch/old); fi
  PYTHONPATH=$P timeout 100 python3 tools/gpu/layer_ab.py --tag $t --out $OUT/b/ab/$t-$r.json --models deepseek-v4-flash deepseek-v3 --tokens 1 8 32 128 256 --iters 20 >> $OUT/b/ab.log 2>&1
  echo "$t-$r rc=$?" >> $OUT/b/ab.log
done; done
grep rc= $OUT/b/ab.log
python3 docs/gpu-runs/2026-12-02-j/ab_summary.py $OUT/b/ab > $OUT/b/summary.md 2>&1; cat $OUT/b/summary.md
OUT=$OUT/c timeout 180 bash tools/gpu/bench.sh --models deepseek-v4-flash deepseek-v3 glm-5 --tokens 1 8 32 128 256 --variants sequential --iters 20 > $OUT/c/bench-run.log 2>&1; echo "bench rc=$?"
tail -30 $OUT/c/bench.md 2>/dev/null
