"""The public layer's W1 and W2 launches, for Nsight Compute (the GEMMs as the layer runs them: ring mode, shared
expert included; ncu serialises the kernels, so this is each kernel alone, not their overlap).

    bash tools/gpu/ncu_layer.sh deepseek-v3 1 [chosen|unsplit|stream_k]     (the counters: ncu_metrics.sh)
    gcmoe-lab probe ncu_layer deepseek-v3 1 [chosen|unsplit|stream_k]       (what ncu_layer.sh runs under ncu)

unsplit / stream_k: the chosen configuration with W1 unsplit, or W1 stream_k, forced through the layer's public
kernel_config (Sm90Config fields). Calls the layer three times; ncu_layer.sh profiles the third call's GEMMs.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch

VARIANTS = ("chosen", "unsplit", "stream_k")


def kernel_config(kcfg, variant: str, hidden: int, inter: int):
    """kcfg for `variant`: as chosen, or W1 unsplit / stream_k (with_splits sizes its stages; stream_k runs whole W1
    tiles)."""
    from gcmoe_gemm_sm90.config import with_splits

    if variant == "chosen":
        return kcfg
    sk = variant == "stream_k"
    kcfg = replace(kcfg, stream_k=sk, w1_half=kcfg.w1_half and not sk)
    return with_splits(kcfg, (1, kcfg.splits[1]), hidden, inter)


def main(argv=None) -> int:
    import gcmoe
    from gcmoe_core.config import MoEConfig
    from gcmoe_core.testing import make_tokens, make_weights
    from gcmoe_gemm_sm90.ops import MoESm90

    ap = argparse.ArgumentParser(prog="gcmoe-lab probe ncu_layer", description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("tokens", type=int)
    ap.add_argument("variant", nargs="?", default="chosen", choices=VARIANTS)
    a = ap.parse_args(argv)
    cfg = MoEConfig.ep_slice(a.model, 8, max_tokens_per_rank=256)
    weights = make_weights(cfg, seed=1, device="cuda")
    x, ids, w = make_tokens(cfg, a.tokens, "uniform", a.tokens, device="cuda")
    chosen = MoESm90.from_weights(weights).config_for(a.tokens, cfg.top_k)
    kcfg = kernel_config(chosen, a.variant, cfg.hidden_size, cfg.intermediate_size)
    layer = gcmoe.MoELayer(cfg, "cuda", "sm90", comm_sms=0, kernel_config=kcfg).load(weights)
    for _ in range(3):
        layer(x, ids, w)
    torch.cuda.synchronize()
    print(f"{a.model} T={a.tokens} {a.variant}: {kcfg}")
    return 0
