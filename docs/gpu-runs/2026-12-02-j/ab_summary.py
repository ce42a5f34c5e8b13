"""Summarise a 3-tree A/B folder: per (model, T) each tree's median of its runs' medians, ratios, digests."""

import glob
import json
import os
import statistics
import sys

rows = {}
for path in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
    tag = os.path.basename(path).split("-")[0]
    with open(path) as f:
        records = json.load(f)["records"]
    for r in records:
        rows.setdefault((r["model"], r["tokens"]), {}).setdefault(tag, []).append((r[tag], r["digest"]))
print("| model | T | old µs | mid µs | new µs | old/mid | old/new | mid/new | bits same |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for (m, t), tags in rows.items():
    med = {k: statistics.median(x[0] for x in v) for k, v in tags.items()}
    same = len({x[1] for v in tags.values() for x in v}) == 1
    us = [med.get(k) for k in ("old", "mid", "new")]  # (a tree whose files are absent: -)
    cells = [f"{v:.1f}" if v else "-" for v in us]
    cells += [f"{us[a] / us[b]:.3f}" if us[a] and us[b] else "-" for a, b in ((0, 1), (0, 2), (1, 2))]
    print(f"| {m} | {t} | " + " | ".join(cells) + f" | {same} |")
