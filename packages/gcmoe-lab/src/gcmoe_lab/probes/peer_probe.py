"""Which torch grouped-GEMM calls run on this build (each variant in its own process: an illegal address kills a
CUDA context): torch._grouped_mm (BF16) and torch._scaled_grouped_mm (FP8 rowwise), with the rows exactly filling
the groups and with padding rows after the last group.

    gcmoe-lab probe peer_probe [variant]
"""

from __future__ import annotations

import argparse
import subprocess
import sys

VARIANTS = ("bf16_padded", "bf16_exact", "fp8_padded", "fp8_exact")


def run(variant: str) -> None:
    import torch

    e, h, i, m = 32, 4096, 2048, 16
    counts = torch.full((e,), m, dtype=torch.int32)
    offs = torch.cumsum(counts, 0).to(torch.int32).cuda()
    rows = int(counts.sum()) + (64 if variant.endswith("padded") else 0)
    x = torch.randn(rows, h, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(e, 2 * i, h, device="cuda", dtype=torch.bfloat16) * h**-0.5
    if variant.startswith("bf16"):
        out = torch._grouped_mm(x, w.transpose(1, 2), offs=offs)
    else:
        s_b = w.float().abs().amax(2) / 448
        wq = (w.float() / s_b.unsqueeze(2)).to(torch.float8_e4m3fn).transpose(1, 2)
        s_a = x.float().abs().amax(1) / 448
        xq = (x.float() / s_a.unsqueeze(1)).to(torch.float8_e4m3fn)
        out = torch._scaled_grouped_mm(xq, wq, s_a, s_b, offs=offs, out_dtype=torch.bfloat16)
    torch.cuda.synchronize()
    ref = x[:m].float() @ w[0].float().T
    err = float((out[:m].float() - ref).norm() / ref.norm())
    print(f"{variant}: OK shape={tuple(out.shape)} rel_err_group0={err:.3e}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="gcmoe-lab probe peer_probe", description=__doc__.split("\n\n")[0])
    ap.add_argument("variant", nargs="?", choices=VARIANTS, help="run this one here (default: each in a subprocess)")
    a = ap.parse_args(argv)
    if a.variant:
        run(a.variant)
        return 0
    failed = 0
    for v in VARIANTS:
        cmd = [sys.executable, "-m", "gcmoe_lab", "probe", "peer_probe", v]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        tail = (r.stdout + r.stderr).strip().splitlines()
        failed += r.returncode != 0
        print(tail[-1] if r.returncode == 0 else f"{v}: FAILED rc={r.returncode}: {' | '.join(tail[-3:])[:400]}")
    return 1 if failed else 0
