"""A small workload for compute-sanitizer (racecheck / memcheck / synccheck): the sm90 W1 + W2 kernels on prepared rows
at N tiles 8, 16 and 32 (occupancy 2 and 4 warpgroups, smem scales on and off, a K split), then one eager call of the
public sm90 layer (comm kernels included). Small, so the tools finish in seconds; exits non-zero on a wrong value.

    compute-sanitizer --tool racecheck --report-api-errors no python3 tools/gpu/sanitize_case.py [--only kernels]
"""

import argparse
import sys

import torch

from gcmoe_core.config import MoEConfig
from gcmoe_core.reference import moe_reference
from gcmoe_core.testing import Case, calc_diff, make_problem
from gcmoe_gemm_sm90.bench import layer_for
from gcmoe_gemm_sm90.config import Sm90Config
from gcmoe_gemm_sm90.ops import MoESm90

ap = argparse.ArgumentParser()
ap.add_argument("--only", choices=("kernels", "layer"), default=None)
args = ap.parse_args()
# the shape of the racecheck report: H 2048, I 768, 16 experts, top-4, 12 tokens
CFG = MoEConfig(hidden_size=2048, intermediate_size=768, num_experts=16, top_k=4, max_tokens_per_rank=32)
ok = True
if args.only in (None, "kernels"):
    configs = (
        Sm90Config(8, 3, 2, occupancy=2, smem_scales=False),
        Sm90Config(16, 3, 2, occupancy=2, smem_scales=True, splits=(2, 1)),
        Sm90Config(32, 2, 2, occupancy=1, warpgroups=4),
    )
    for kc in configs:
        x, ids, w, weights, _ = make_problem(Case(CFG, 12, "uniform", seed=kc.n_tile), device="cuda")
        moe = MoESm90.from_weights(weights)
        y = layer_for(moe, x, w, ids, kc)  # the kernels' layer on prepared rows
        torch.cuda.synchronize()
        d = calc_diff(y, moe_reference(x, ids, w, weights))
        print(f"kernels {kc.n_tile=} {kc.splits=} {kc.warpgroups=}: calc_diff {d:.2e}", flush=True)
        ok &= d < 1e-3
if args.only in (None, "layer"):
    import gcmoe

    x, ids, w, weights, _ = make_problem(Case(CFG, 12, "uniform", seed=1), device="cuda")
    layer = gcmoe.MoELayer(CFG, "cuda", "sm90", timeout_ms=60_000).load(weights)  # sanitizers slow the waits
    y = layer(x, ids, w)
    torch.cuda.synchronize()
    layer.check()
    d = calc_diff(y, moe_reference(x, ids, w, weights))
    print(f"layer (public path, eager): calc_diff {d:.2e}", flush=True)
    ok &= d < 1e-3
sys.exit(0 if ok else 1)
