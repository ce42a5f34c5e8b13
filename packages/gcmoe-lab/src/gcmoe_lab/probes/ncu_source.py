"""Summary of Nsight Compute's source page (`ncu --import R --page source --csv --print-source sass`, written by
ncu_source.sh): per kernel, the warp stall samples by reason, by opcode and at the hottest SASS instructions.

    gcmoe-lab probe ncu_source source-deepseek-v4-flash-128.csv [--top 16]

The page lists each profiled kernel as a '"Kernel Name",...' line and then a CSV table, one row per SASS instruction.
The layer's W1 and W2 share one mangled name; W2 is the one that stores bf16 (STG.E.U16: its scatter through the peer
table). Samples are per warp: a share here is the share of the warps' time at that instruction, summed over the SMs.
"""

from __future__ import annotations

import argparse
import csv
import io
import re
from collections import Counter, defaultdict


def kernels(text: str) -> list[list[dict]]:
    """The rows of each kernel's table, in the page's order."""
    parts = re.split(r'^"Kernel Name",[^\n]*\n', text, flags=re.M)[1:]
    return [list(csv.DictReader(io.StringIO(p))) for p in parts]


def _num(x: str) -> float:
    try:
        return float(x.replace(",", ""))
    except (AttributeError, ValueError):
        return 0.0


def label(rows: list[dict]) -> str:
    return "W2" if any("STG.E.U16" in r.get("Source", "") for r in rows) else "W1"


def opcode(source: str) -> str:
    """The opcode of a SASS line without its predicate and modifiers ('@!P0 BRA ...' -> 'BRA')."""
    return re.sub(r"^@!?U?P\w+\s+", "", source.strip()).split(" ")[0].split(".")[0]


def summary(rows: list[dict], top: int = 16) -> dict:
    """{'samples', 'reasons': [(reason, share)], 'opcodes': [(op, share, [(reason, share)])], 'hot': [(source,
    executed, share, [(reason, share)])], 'outside_loop': (share, barrier share, long-scoreboard share)}: shares of
    the kernel's samples, largest first. Outside the loop: instructions executed under a quarter as often as the most
    executed one (the window loop's) — each CTA's start, staging and epilogue."""
    cols = [c for c in rows[0] if c.startswith("stall_") and "Not Issued" not in c] if rows else []
    total = sum(_num(r[c]) for r in rows for c in cols) or 1.0
    reasons, by_op = Counter(), defaultdict(Counter)
    for r in rows:
        for c in cols:
            reasons[c[6:]] += _num(r[c])
            by_op[opcode(r["Source"])][c[6:]] += _num(r[c])

    def shares(cnt: Counter, n: int) -> list[tuple[str, float]]:
        return [(k, v / total) for k, v in cnt.most_common(n)]

    most = max((_num(r.get("Instructions Executed", "0")) for r in rows), default=0.0)
    outside = [r for r in rows if _num(r.get("Instructions Executed", "0")) < most / 4]
    ops = sorted(by_op.items(), key=lambda kv: -sum(kv[1].values()))[:top]
    hot = sorted(rows, key=lambda r: -sum(_num(r[c]) for c in cols))[:top]
    return {
        "samples": total,
        "reasons": shares(reasons, 10),
        "opcodes": [(op, sum(c.values()) / total, shares(c, 3)) for op, c in ops],
        "hot": [
            (
                r["Source"].strip(),
                _num(r.get("Instructions Executed", "0")),
                sum(_num(r[c]) for c in cols) / total,
                shares(Counter({c[6:]: _num(r[c]) for c in cols}), 3),
            )
            for r in hot
        ],
        "outside_loop": tuple(
            sum(_num(r[c]) for r in outside for c in cols if c[6:] in want) / total
            for want in ({c[6:] for c in cols}, {"barrier"}, {"long_sb"})
        ),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="gcmoe-lab probe ncu_source", description=__doc__.split("\n\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=16)
    args = ap.parse_args(argv)
    with open(args.csv) as f:
        page = f.read()
    for rows in kernels(page):
        s = summary(rows, args.top)
        print(f"== {label(rows)}: {s['samples']:.0f} samples, {len(rows)} instructions")
        print("  " + ", ".join(f"{k} {100 * v:.1f}%" for k, v in s["reasons"]))
        out, bar, lsb = s["outside_loop"]
        print(
            f"  outside the window loop {100 * out:.1f}% (barrier {100 * bar:.1f}%, long scoreboard {100 * lsb:.1f}%)"
        )
        for op, share, why in s["opcodes"]:
            print(f"  {op:12s} {100 * share:5.1f}%  " + ", ".join(f"{k} {100 * v:.1f}" for k, v in why))
        for src, executed, share, why in s["hot"]:
            print(
                f"  {100 * share:5.1f}% x{executed:<9.0f} {src[:60]:60s} "
                + ", ".join(f"{k} {100 * v:.1f}" for k, v in why)
            )
    return 0
