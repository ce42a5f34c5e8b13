"""Summarise a 3-tree A/B folder: per (model, T) each tree's median of its runs' medians, ratios, digests."""
import glob, json, statistics, sys, os
d = sys.argv[1]
rows = {}
for f in sorted(glob.glob(os.path.join(d, "*.json"))):
    tag = os.path.basename(f).split("-")[0]
    for r in json.load(open(f))["records"]:
        key = (r["model"], r["tokens"])
        v = r[tag]
        v = v["median_us"] if isinstance(v, dict) else v
        rows.setdefault(key, {}).setdefault(tag, []).append((v, r["digest"]))
print("| model | T | old µs | mid µs | new µs | old/mid | old/new | mid/new | bits same |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for (m, t), tags in rows.items():
    med = {k: statistics.median(x[0] for x in v) for k, v in tags.items()}
    digs = {x[1] for v in tags.values() for x in v}
    o, mi, n = med.get("old"), med.get("mid"), med.get("new")
    f = lambda a, b: f"{a / b:.3f}" if a and b else "-"
    print(f"| {m} | {t} | {o:.1f} | {mi:.1f} | {n:.1f} | {f(o, mi)} | {f(o, n)} | {f(mi, n)} | {len(digs) == 1} |")
