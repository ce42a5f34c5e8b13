"""One small W1 + W2 launch with a hard wall-clock guard: the first thing to run after a kernel change on the GPU.
Prints PASS/FAIL per step, or dies after --timeout seconds (a hung kernel costs seconds, not the call).

    layer  n_tile 8 / 16 / 32: the layer on prepared rows (gcmoe_core.grouping.grouped_forward around ops.w1 / w2)
           against the quantisation-emulating reference (calc_diff)
    ring   n_tile 16 in ring mode (Sm90Config.ring) with every signal word already published: bit-identical to the
           launch on prepared rows, ERR left clear (a wait that never ends would trip the guard)
"""

import argparse
import faulthandler
import sys
from dataclasses import replace

import torch

from gcmoe_core.config import MoEConfig
from gcmoe_core.grouping import group_rows, prepare_activations
from gcmoe_core.reference import moe_reference
from gcmoe_core.testing import Case, calc_diff, make_problem
from gcmoe_gemm_sm90.bench import layer_for
from gcmoe_gemm_sm90.config import Sm90Config
from gcmoe_gemm_sm90.ops import MoESm90, RingSync, launch_w1, launch_w2

ap = argparse.ArgumentParser()
ap.add_argument("--timeout", type=int, default=60)
args = ap.parse_args()
faulthandler.dump_traceback_later(args.timeout, exit=True)
cfg = MoEConfig(hidden_size=512, intermediate_size=256, num_experts=8, top_k=2, max_tokens_per_rank=64)
ok = True
for n_tile in (8, 16, 32):
    x, ids, w, weights, _ = make_problem(Case(cfg, 21, "uniform", seed=n_tile), device="cuda")
    moe = MoESm90.from_weights(weights)
    kc = Sm90Config(n_tile, 3, 2)
    y = layer_for(moe, x, w, ids, kc)  # the kernels' layer on prepared rows
    torch.cuda.synchronize()
    d = calc_diff(y, moe_reference(x, ids, w, weights))
    print(
        f"layer n_tile={n_tile}: calc_diff={d:.3e} nan={bool(y.isnan().any())} {'PASS' if d < 1e-3 else 'FAIL'}",
        flush=True,
    )
    ok &= d < 1e-3

# ring mode on the routed experts' rows; signal words: INUSE = ticket, CGEN = 0, OFFS = 1, ERR (5) clear, L1_FULL = 1,
# W1_DONE clear
routed = cfg.replace(num_shared_experts=0)
x, ids, w, weights, _ = make_problem(Case(routed, 21, "uniform", seed=3), device="cuda")
moe, kc = MoESm90.from_weights(weights), Sm90Config(16, 3, 2)
lay = group_rows(ids, routed.num_experts, kc.n_tile)
acts = prepare_activations(x, w, lay, routed.top_k)
blocks = lay.rows // kc.ring_bm
sig = torch.zeros(16 + blocks + 2 * routed.num_experts, dtype=torch.int32, device="cuda")  # + W1_DONE pairs, clear
sig[0], sig[2], sig[16 : 16 + blocks] = 5, 1, 1
ring = RingSync(*(sig.data_ptr() + 4 * i for i in (0, 1, 2, 8, 16, 16 + blocks)), ticket=5, timeout_ns=10**9)
src = torch.zeros(lay.rows, 3, dtype=torch.int32, device="cuda")
results = []
for c, r in ((kc, None), (replace(kc, ring=True), ring)):
    hq = torch.zeros(lay.rows, moe.inter, dtype=torch.uint8, device="cuda")
    hsT = torch.zeros(2 * moe.inter // 256, lay.rows, device="cuda")
    out = torch.zeros(ids.numel(), moe.hidden, dtype=torch.bfloat16, device="cuda")
    comb = torch.tensor([out.data_ptr()], dtype=torch.int64, device="cuda")
    launch_w1(moe.w13, acts.x_rows, acts.sxT, acts.route_w, lay.offsets, lay.counts, hq, hsT, c, r)
    launch_w2(moe.w2, hq, hsT, lay.offsets, lay.counts, lay.src_slot, src, comb, c, r)
    results.append((hq, hsT, out))
torch.cuda.synchronize()
same = all(torch.equal(a, b) for a, b in zip(*results, strict=True))
err = sig[8:13].tolist()
print(f"ring n_tile=16: bit-identical={same} ERR={err} {'PASS' if same and not any(err) else 'FAIL'}", flush=True)
ok &= same and not any(err)
sys.exit(0 if ok else 1)
