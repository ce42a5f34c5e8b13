"""One model-shaped EP8 rank's W1 and W2 launches on prepared rows, for Nsight Compute (where the sm90 kernels' time
goes): gcmoe_gemm_sm90.ops.w1 / w2 with the configuration MoESm90.config_for chooses.

    bash tools/gpu/ncu_sm90.sh deepseek-v3 8      (the counters and the ncu command line: ncu_sm90.sh)
    gcmoe-lab probe ncu_sm90 deepseek-v3 8        (what ncu_sm90.sh runs under ncu)

Runs W1 then W2 twice (the first pair compiles and warms up; profile the second pair).
"""

from __future__ import annotations

import argparse

import torch


def main(argv=None) -> int:
    from gcmoe_core.config import MoEConfig
    from gcmoe_core.grouping import group_rows, prepare_activations
    from gcmoe_core.testing import make_tokens, make_weights
    from gcmoe_gemm_sm90.ops import MoESm90, w1, w2

    ap = argparse.ArgumentParser(prog="gcmoe-lab probe ncu_sm90", description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("tokens", type=int)
    a = ap.parse_args(argv)
    cfg = MoEConfig.ep_slice(a.model, 8, max_tokens_per_rank=max(256, a.tokens), num_shared_experts=0)
    moe = MoESm90.from_weights(make_weights(cfg, seed=1, device="cuda"))
    x, ids, w = make_tokens(cfg, a.tokens, seed=a.tokens, device="cuda")
    kcfg = moe.config_for(a.tokens, cfg.top_k)
    layout = group_rows(ids, cfg.num_experts, kcfg.n_tile)
    acts = prepare_activations(x, w, layout, cfg.top_k)
    out = torch.empty(ids.numel(), cfg.hidden_size, dtype=torch.bfloat16, device="cuda")
    for _ in range(2):
        hq, hsT = w1(moe.w13, acts, layout, kcfg)
        w2(moe.w2, hq, hsT, layout, out, kcfg)
    torch.cuda.synchronize()
    print(f"{a.model} T={a.tokens} {kcfg} active experts {int(torch.unique(ids).numel())}")
    return 0
