"""ncu of one W1 + W2 call per variant (chosen, whole2, ws1, ws4): profiled between cudaProfilerStart / Stop."""

import sys

import torch

import gcmoe_gemm_sm90.kernel_grouped as kg
from gcmoe_core.config import MoEConfig
from gcmoe_core.testing import make_tokens, make_weights
from gcmoe_gemm_sm90 import bench as B
from gcmoe_gemm_sm90.kernel_ws import compiled_ws, ws_config
from gcmoe_gemm_sm90.ops import MoESm90

WS = {"on": 0}
_orig = kg.compiled
kg.compiled = lambda mode, m, k, cfg, arch="sm_90a": (
    compiled_ws(mode, m, k, cfg, arch, WS["on"]) if WS["on"] else _orig(mode, m, k, cfg, arch)
)
model, tokens = sys.argv[1].split(":")
tokens = int(tokens)
cfg = MoEConfig.ep_slice(model, 8, max_tokens_per_rank=max(256, tokens), num_shared_experts=0)
moe = MoESm90.from_weights(make_weights(cfg, seed=1, device="cuda"))
x, ids, w = make_tokens(cfg, tokens, seed=tokens, device="cuda")
kcfg = moe.config_for(tokens, cfg.top_k)
h, i = cfg.hidden_size, cfg.intermediate_size
wcfg = ws_config(kcfg, h, i)
variants = {"chosen": kcfg, "whole2": B.variant_config("wg2", kcfg, h, i) or kcfg, "ws1": wcfg, "ws4": wcfg}
runs = {}
for name, c in variants.items():
    out = torch.empty((ids.numel(), h), dtype=torch.bfloat16, device="cuda")
    WS["on"] = int(name[2:]) if name.startswith("ws") else 0
    run, _ = B.kernels_for(moe, x, w, ids, cfg, c, out)
    run()
    run()
    runs[name] = (run, out)
    WS["on"] = 0
torch.cuda.synchronize()
print("order:", list(runs), "cfg", kcfg, "ws", wcfg, flush=True)
torch.cuda.cudart().cudaProfilerStart()
for name, (run, _) in runs.items():
    WS["on"] = int(name[2:]) if name.startswith("ws") else 0  # launch_w1 / w2 look the kernel up on every call
    run()
    WS["on"] = 0
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
