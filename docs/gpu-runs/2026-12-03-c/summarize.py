"""stages.json (stages.py) -> the markdown tables of docs/benchmarks/stage-ablations-h200-2026-12-03.md.

python docs/gpu-runs/2026-12-03-c/summarize.py docs/gpu-runs/2026-12-03-c/b/stages.json
"""

import json
import sys
from pathlib import Path


def vs_floor(u: dict, f: float, k: str) -> str:
    return f"{u[k]:.1f} ({u[k] / f:.2f}×, {u[k] - f:+.1f})"


def vs_full(u: dict, v: str) -> str:
    return f"{u['full_' + v]:.1f} / {u['p116_' + v]:.1f} ({u['p116_' + v] / u['full_' + v]:.3f})"


def main(path: str) -> None:
    d = json.loads(Path(path).read_text())
    print(
        "| model | T | floor µs | chosen µs (× floor, − floor) | stream only | compute only | W1 alone µs |"
        " copy, 1 kernel | copy, 2 kernels | empty graph µs |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for p in d["points"]:
        u, f = p["us"], p["floor_us"]
        cols = [vs_floor(u, f, k) for k in ("full_chosen", "full_stream", "full_compute")]
        print(
            f"| {p['model']} | {p['tokens']} | {f:.1f} | **{cols[0]}** | {cols[1]} | {cols[2]} | {u['full_w1']:.1f} | "
            f"{vs_floor(u, f, 'full_copy1')} | {vs_floor(u, f, 'full_copy2')} | {u['empty']:.1f} |"
        )
    print()
    print("| model | T | chosen: full / 116 SMs µs (ratio) | stream only | compute only | copy, 1 kernel |")
    print("| --- | --- | --- | --- | --- | --- |")
    for p in d["points"]:
        u = p["us"]
        cols = " | ".join(vs_full(u, v) for v in ("chosen", "stream", "compute", "copy1"))
        print(f"| {p['model']} | {p['tokens']} | {cols} |")
    print()
    print("| model | T | variant | W1 µs | W2 µs | kernels' span µs | event-timed µs | outside the kernels µs |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for p in d["points"]:
        for name, tl in p["timelines"].items():
            ks = {k: (a, b) for k, a, b in tl["kernels"]}
            w1, w2 = ks.get("w1", (0, 0)), ks.get("w2", (0, 0))
            print(
                f"| {p['model']} | {p['tokens']} | {name[5:]} | {w1[0]:.1f}–{w1[1]:.1f} | {w2[0]:.1f}–{w2[1]:.1f} | "
                f"{tl['span_us']:.1f} | {tl['event_us']:.1f} | {tl['event_us'] - tl['span_us']:.1f} |"
            )


RUNS = {  # folder file -> what it is (README.md: the commands)
    "b/stages.json": "stage ablations, T = 1-256, before the bench grid-rows fix (T = 1: one grid row per expert)",
    "c/stream_k.json": "W1 stream_k on both placements (T >= 8) and the operator's grid rows at T = 1 (rows)",
    "d/read/sm90_grouped.json": "python -m gcmoe_gemm_sm90.bench with the grid-rows fix, read flush: #15's targets",
    "d/write/sm90_grouped.json": "the same, write flush",
    "e/a/stream_k.json": "GLM-4.5 T = 8 / 32: W1 stream_k",
    "e/b/stream_k.json": "DeepSeek-V3 T = 1 on 116 SMs: the 132-SM configuration (c132) against the 116-SM one",
    "f/ablate.json": "stage ablations at T = 1 with the grid-rows fix (the operator's grid rows)",
}


def merged() -> dict:
    here = Path(__file__).parent
    return {name: {"what": what, **json.loads((here / name).read_text())} for name, what in RUNS.items()}


if __name__ == "__main__":
    if sys.argv[1] == "--json":
        Path(sys.argv[2]).write_text(json.dumps(merged(), indent=1) + "\n")
    else:
        main(sys.argv[1])
