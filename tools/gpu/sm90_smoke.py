"""One small W1 + W2 launch with a hard wall-clock guard: the first thing to run after a kernel change on the GPU.
Prints PASS/FAIL with calc_diff, or dies after --timeout seconds (a hung kernel costs seconds, not the call)."""

import argparse
import faulthandler
import sys

import torch

from gcmoe_core.config import MoEConfig
from gcmoe_core.reference import moe_reference
from gcmoe_core.testing import Case, calc_diff, make_problem
from gcmoe_gemm_sm90.config import Sm90Config
from gcmoe_gemm_sm90.ops import MoESm90

ap = argparse.ArgumentParser()
ap.add_argument("--timeout", type=int, default=60)
args = ap.parse_args()
faulthandler.dump_traceback_later(args.timeout, exit=True)
cfg = MoEConfig(hidden_size=512, intermediate_size=256, num_experts=8, top_k=2, max_tokens_per_rank=64)
ok = True
for n_tile in (8, 16, 32):
    x, ids, w, weights, _ = make_problem(Case(cfg, 21, "uniform", seed=n_tile), device="cuda")
    y = MoESm90.from_weights(weights, Sm90Config(n_tile, 3, 2)).forward(x, ids, w)
    torch.cuda.synchronize()
    d = calc_diff(y, moe_reference(x, ids, w, weights))
    print(
        f"n_tile={n_tile}: calc_diff={d:.3e} nan={bool(y.isnan().any())} {'PASS' if d < 1e-3 else 'FAIL'}", flush=True
    )
    ok &= d < 1e-3
sys.exit(0 if ok else 1)
