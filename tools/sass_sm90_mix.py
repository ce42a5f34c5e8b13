"""Offline (CPU): the instruction mix of the sm90 grouped kernels' window loop, per warp and 128-K window, for the
configurations choose_config picks on a model shape's EP8 rank (what the decode, promotion and bookkeeping cost in
issue slots, beside the window's memory time).

    GCMOE_ARCH=sm_90a python tools/sass_sm90_mix.py [--model deepseek-v3] [--tokens 1 8 32 128 256] [--ring]

--ring: the kernels in ring mode (Sm90Config.ring, as the operator runs them beside the comm dispatch); its acquires
sit before the window loop, so the loop's mix should not move.

Counts come from the innermost SASS loop that holds the QGMMAs (gcmoe_core.cutedsl.sass_loop_opcodes), divided by the
windows one pass of it covers (its QGMMAs / (4 k32 steps x subtiles per warp)), searched in the listing up to the
kernel's last unconditional EXIT: in ring mode ptxas moves mbarrier wait retries out of line past it, and their
branches back into the body would read as shorter loops around half the window loop and the epilogue.
"""

import argparse
import re
from dataclasses import replace

from gcmoe_core.config import MoEConfig
from gcmoe_core.cutedsl import sass_loop_opcodes
from gcmoe_gemm_sm90.config import choose_config
from gcmoe_gemm_sm90.kernel_grouped import compiled

GROUPS = {  # column -> opcodes (without modifiers)
    "PRMT": ("PRMT",),
    "LOP3": ("LOP3",),
    "SHF": ("SHF",),
    "IMAD": ("IMAD",),
    "FP32": ("FFMA", "FMUL", "FADD"),
    "LDS": ("LDS",),
    "uniform": None,  # every U* opcode
    "QGMMA": ("QGMMA",),
}


def main_body(sass: str) -> str:
    """The listing up to its last unconditional EXIT (without the out-of-line blocks after it)."""
    lines = sass.splitlines()
    ends = [i for i, ln in enumerate(lines) if re.search(r"\*/\s+EXIT\s*;", ln)]
    return "\n".join(lines[: ends[-1] + 1]) if ends else sass


def window_mix(mode: str, m: int, k: int, cfg) -> dict[str, float]:
    counts, qgmma = sass_loop_opcodes(main_body(compiled(mode, m, k, cfg, "sm_90a").sass()), "QGMMA")
    half = cfg.w1_half if mode == "w1" else cfg.w2_half  # (a half-tile CTA: one subtile per warp, as 4 warpgroups)
    subs = 1 if half or cfg.warpgroups == 4 else 2
    windows = qgmma / (4 * subs)
    row = {}
    for name, ops in GROUPS.items():
        n = sum(v for op, v in counts.items() if (op.startswith("U") if ops is None else op in ops))
        row[name] = n / windows
    row["all"] = sum(counts.values()) / windows
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="deepseek-v3")
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 8, 32, 128, 256])
    ap.add_argument("--ring", action="store_true", help="ring mode (Sm90Config.ring), the operator's kernels")
    args = ap.parse_args(argv)
    mc = MoEConfig.ep_slice(args.model, 8, max_tokens_per_rank=max(256, *args.tokens), num_shared_experts=0)
    h, i = mc.hidden_size, mc.intermediate_size
    mode = " in ring mode" if args.ring else ""
    print(f"{args.model} EP8 rank{mode}: instructions per warp per 128-K window of the window loop (SASS, sm_90a)\n")
    print("| T | GEMM | N tile | warpgroups | " + " | ".join(GROUPS) + " | all |")
    print("|" + " --- |" * (len(GROUPS) + 5))
    for t in args.tokens:
        cfg = replace(choose_config(t, mc.top_k, mc.num_experts, h, i), ring=args.ring)
        for mode, m, k in (("w1", 2 * i, h), ("w2", h, i)):
            r = window_mix(mode, m, k, cfg)
            cells = " | ".join(f"{r[g]:.0f}" for g in (*GROUPS, "all"))
            print(f"| {t} | {mode.upper()} | {cfg.n_tile} | {cfg.warpgroups} | {cells} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
