#!/usr/bin/env bash
# call 3: 3-tree A/B on the public layer (old 32b9a29, mid e1026a7, new = working tree), twice alternated
set -u
mkdir -p $OUT/b/ab
NEWPP=$PYTHONPATH
BASEPP=$(echo "$PYTHONPATH" | tr ':' '\n' | grep -v "/packages/.*/src" | paste -sd:)
pp() { local t=$1; local r=""; for p in $t/packages/*/src; do r="$PWD/$p:$r"; done; echo "$r$BASEPP"; }
for t in mid old; do
  ( PYTHONPATH=$(pp scratch/$t) timeout 150 python3 scratch/$t/tools/gpu/precompile.py --models deepseek-v4-flash deepseek-v3 --tokens 1 8 32 128 256 --workers 8 ) > $OUT/b/precompile-$t.log 2>&1 &
done
wait; tail -2 $OUT/b/precompile-*.log
for r in 1 2; do for t in old mid new; do
  if [ $t = new ]; then P=$NEWPP; else P=$(pp scratch/$t); fi
  PYTHONPATH=$P timeout 120 python3 tools/gpu/layer_ab.py --tag $t --out $OUT/b/ab/$t-$r.json --models deepseek-v4-flash deepseek-v3 --tokens 1 8 32 128 256 --iters 20 >> $OUT/b/ab.log 2>&1
  echo "$t-$r rc=$?" >> $OUT/b/ab.log
done; done
grep rc= $OUT/b/ab.log
python3 scratch/ab_summary.py $OUT/b/ab > $OUT/b/summary.md 2>&1; cat $OUT/b/summary.md
