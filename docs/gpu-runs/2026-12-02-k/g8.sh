#!/usr/bin/env bash
# call: the archived side-by-side scripts (on side_by_side.py) rerun as committed: they run, and repeat the numbers
set -u
mkdir -p $OUT/h
( timeout 120 python3 tools/gpu/precompile.py --models deepseek-v4-flash deepseek-v3 glm-5 --tokens 1 2 --workers 16 ) > $OUT/h/precompile.log 2>&1; tail -1 $OUT/h/precompile.log
for s in l2half sksweep sharedlast l2sweep l2w2; do
  timeout 120 python3 docs/gpu-runs/2026-12-02-k/$s.py $OUT/h/$s.json > $OUT/h/$s.log 2>&1; echo "$s rc=$?"
done
python3 - <<'PY'
import json, os, statistics as st
out = os.environ["OUT"] + "/h"
for s in ("l2half", "sksweep", "sharedlast", "l2sweep", "l2w2"):
    try:
        recs = json.load(open(f"{out}/{s}.json"))
    except Exception as e:
        print(s, "no json", e); continue
    g = {}
    for r in recs:
        g.setdefault((r["model"], r["tokens"], r["flush"]), []).append(r)
    for k, rs in g.items():
        keys = [x for x in rs[0] if x not in ("model", "tokens", "flush", "rep", "same", "max_diff")]
        m = {x: st.median(r[x] for r in rs) for x in keys}
        print(s, k, " ".join(f"{x}={m[x]:.1f}({m[keys[0]] / m[x]:.3f})" for x in keys))
PY
