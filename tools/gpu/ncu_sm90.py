"""One DeepSeek-V3-shaped EP8 rank's W1 and W2 launches, for Nsight Compute (where the sm90 kernels' time goes).

    bash tools/gpu/ncu_sm90.sh deepseek-v3 8      (the counters and the ncu command line: ncu_sm90.sh)

Runs W1 then W2 twice (the first pair compiles and warms up; profile the second pair).
"""

import sys

import torch

from gcmoe_core.config import MoEConfig
from gcmoe_core.grouping import group_rows, prepare_activations
from gcmoe_core.testing import make_tokens, make_weights
from gcmoe_gemm_sm90.ops import MoESm90, w1, w2


def main(model: str, tokens: int) -> None:
    cfg = MoEConfig.ep_slice(model, 8, max_tokens_per_rank=max(256, tokens), num_shared_experts=0)
    moe = MoESm90.from_weights(make_weights(cfg, seed=1, device="cuda"))
    x, ids, w = make_tokens(cfg, tokens, seed=tokens, device="cuda")
    kcfg = moe.config_for(tokens, cfg.top_k)
    layout = group_rows(ids, cfg.num_experts, kcfg.n_tile)
    acts = prepare_activations(x, w, layout, cfg.top_k)
    out = torch.empty(ids.numel(), cfg.hidden_size, dtype=torch.bfloat16, device="cuda")
    for _ in range(2):
        hq, hsT = w1(moe.w13, acts, layout, kcfg)
        w2(moe.w2, hq, hsT, layout, out, kcfg)
    torch.cuda.synchronize()
    print(f"{model} T={tokens} {kcfg} active experts {int(torch.unique(ids).numel())}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
