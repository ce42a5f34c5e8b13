"""Build docs/benchmarks/accumulator-range-h200-2026-12-03.json from this run's A/B files (run from the repo root):
per (model, T) the public layer's graph-replayed median of each process (tools/gpu/layer_ab.py: write flush, 30
iterations), old = dc731eb, new = this change, and whether the output bits matched."""

import json
import statistics
from pathlib import Path

RUN = Path(__file__).parent
AB = {"b": "t staged with the rows' own scales in a second array (1 KB more shared memory)", "d": "as landed"}


def ab(folder: str) -> dict:
    runs = sorted((RUN / folder / "ab").glob("*.json"))
    meta = json.loads(runs[0].read_text())["meta"]
    points = {}
    for path in runs:
        tag = path.name.split("-")[0]
        for r in json.loads(path.read_text())["records"]:
            p = points.setdefault(f"{r['model']} T={r['tokens']}", {"old": [], "new": [], "digests": set()})
            p[tag].append(r[tag])
            p["digests"].add(r["digest"])
    out = {}
    for key, p in points.items():
        old, new = statistics.median(p["old"]), statistics.median(p["new"])
        out[key] = {
            "old_us": p["old"],
            "new_us": p["new"],
            "new_over_old": new / old,
            "same_bits": len(p["digests"]) == 1,
        }
    return {"meta": meta, "code": AB[folder], "points": out}


def main():
    record = {folder: ab(folder) for folder in AB if (RUN / folder / "ab").is_dir()}
    Path("docs/benchmarks/accumulator-range-h200-2026-12-03.json").write_text(json.dumps(record, indent=1) + "\n")
    for folder, rec in record.items():
        print(f"{folder}: {rec['code']}")
        for key, p in rec["points"].items():
            print(f"| {key} | {p['old_us']} | {p['new_us']} | {p['new_over_old']:.3f} | {p['same_bits']} |")


if __name__ == "__main__":
    main()
