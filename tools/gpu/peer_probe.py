"""Which torch grouped-GEMM calls run on this build (each variant in its own process: an illegal address kills a
CUDA context). Usage: python tools/gpu/peer_probe.py [variant]"""

import subprocess
import sys

import torch

VARIANTS = ("bf16_padded", "bf16_exact", "fp8_padded", "fp8_exact")


def run(variant: str) -> None:
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


if __name__ == "__main__":
    if len(sys.argv) > 1:
        run(sys.argv[1])
    else:
        for v in VARIANTS:
            r = subprocess.run([sys.executable, __file__, v], capture_output=True, text=True, timeout=120)
            tail = (r.stdout + r.stderr).strip().splitlines()
            print(tail[-1] if r.returncode == 0 else f"{v}: FAILED rc={r.returncode}: {' | '.join(tail[-3:])[:400]}")
