"""Build docs/benchmarks/ws-decode-once-h200-2026-12-03.json from this run's files (run from the repo root)."""

import json
import re
from pathlib import Path

RUN = Path(__file__).parent
VARIANTS = ("chosen", "whole2", "ws1", "ws4")  # ws_prof.py's launch order, W1 then W2 each
METRICS = {
    "duration_us": "Duration",
    "block": "Block Size",
    "registers": "Registers Per Thread",
    "ipc_active": "Issued Ipc Active",
    "no_eligible_pct": "No Eligible",
    "instructions": "Executed Instructions",
    "cycles_per_issue": "Warp Cycles Per Issued Instruction",
}


def ncu_kernels(path: Path) -> dict:
    """Per variant and kernel: the METRICS and the stall reasons >= 0.15 cycles per issued instruction."""
    blocks = re.split(r"\n  kernel_cutlass\S*", path.read_text())[1:]
    names = [f"{v}.{k}" for v in VARIANTS for k in ("w1", "w2")]
    out = {}
    for name, text in zip(names, blocks, strict=True):
        rec = {}
        for key, label in METRICS.items():
            m = re.search(re.escape(label) + r"\s+\S*\s+([\d.,]+)\s*$", text, re.M)
            rec[key] = float(m.group(1).replace(",", ""))
        stalls = re.finditer(r"issue_stalled_(\w+)_per_issue_active\.ratio\s+\S+\s+([\d.,]+)", text)
        rec["stalls"] = {s: float(v) for s, v in (m.groups() for m in stalls) if float(v) >= 0.15}
        out[name] = rec
    return out


def main():
    points = [json.loads(line) for line in (RUN / "b/ws.jsonl").read_text().splitlines()]
    for p in points:
        p["chosen_over"] = {v: p["write"]["chosen"] / t for v, t in p["write"].items()}
    record = {
        "date": "2026-12-03",
        "device": "NVIDIA H200 (nvidia-h200), driver 580.159.04, torch 2.11.0+cu130, CuTe DSL 4.8.1",
        "base": "755db3f + docs/gpu-runs/2026-12-03-a/kernel_ws.patch",
        "method": "kernels on prepared rows (W1 + W2, routed experts), CUDA-graph replay, write flush, median of 15, "
        "variants interleaved in one process per point; outputs poisoned with NaN and compared bit for bit vs chosen "
        "after the first call and after 50 replays",
        "points": points,
        "ncu": {f.stem.removeprefix("ncu_"): ncu_kernels(f) for f in sorted((RUN / "c").glob("ncu_*.txt"))},
        "earlier_run_2026_12_02": json.loads((RUN / "a/ws.json").read_text()),
    }
    dst = Path("docs/benchmarks/ws-decode-once-h200-2026-12-03.json")
    dst.write_text(json.dumps(record, indent=1) + "\n")
    print("wrote", dst)


if __name__ == "__main__":
    main()
