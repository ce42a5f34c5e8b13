"""The public layer's W1 and W2 launches, for Nsight Compute (the GEMMs as the layer runs them: ring mode, shared
expert included; ncu serialises the kernels, so this is each kernel alone, not their overlap).

    bash tools/gpu/ncu_layer.sh deepseek-v3 1 [stream_k]     (the counters: ncu_sm90.sh's)

Calls the layer three times (graph replays of its eager path); ncu_layer.sh profiles the third call's GEMMs.
"""

import sys
from dataclasses import replace

import torch

import gcmoe
from gcmoe_core.config import MoEConfig
from gcmoe_core.testing import make_tokens, make_weights
from gcmoe_gemm_sm90.config import with_splits
from gcmoe_gemm_sm90.ops import MoESm90


def main(model: str, tokens: int, variant: str) -> None:
    cfg = MoEConfig.ep_slice(model, 8, max_tokens_per_rank=256)
    weights = make_weights(cfg, seed=1, device="cuda")
    x, ids, w = make_tokens(cfg, tokens, "uniform", tokens, device="cuda")
    kcfg = MoESm90.from_weights(weights).config_for(tokens, cfg.top_k)
    if variant in ("unsplit", "stream_k"):
        sk = variant == "stream_k"  # (with_splits sizes its stages; stream_k runs whole W1 tiles)
        kcfg = replace(kcfg, stream_k=sk, w1_half=kcfg.w1_half and not sk)
        kcfg = with_splits(kcfg, (1, kcfg.splits[1]), cfg.hidden_size, cfg.intermediate_size)
    layer = gcmoe.MoELayer(cfg, "cuda", "sm90", comm_sms=0, kernel_config=kcfg).load(weights)
    for _ in range(3):
        layer(x, ids, w)
    torch.cuda.synchronize()
    print(f"{model} T={tokens} {variant}: {kcfg}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else "chosen")
