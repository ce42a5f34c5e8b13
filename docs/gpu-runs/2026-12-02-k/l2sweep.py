"""Side by side at T = 1 (write / read flush): the shared experts' W1 L2 prefetch by 4 / 8 (default) / 16 / 32 CTAs,
half of it, none."""

import json
import sys

import torch

import gcmoe
import gcmoe_gemm_sm90.ops as ops
from gcmoe_core.config import MoEConfig
from gcmoe_core.testing import make_tokens, make_weights
from gcmoe_core.timing import capture_graph, time_interleaved

out = sys.argv[1]
orig = ops.prefetch_l2
VARIANTS = {"w1_8": (8, 1.0), "w1_4": (4, 1.0), "w1_16": (16, 1.0), "w1_32": (32, 1.0), "half_8": (8, 0.5), "off": None}
recs = []
for model in ("deepseek-v3", "glm-5", "deepseek-v4-flash"):
    cfg = MoEConfig.ep_slice(model, 8, max_tokens_per_rank=256)
    weights = make_weights(cfg, 1, "cuda")
    x, ids, w = make_tokens(cfg, 1, "uniform", 1, device="cuda")
    graphs, outs, layers = {}, {}, {}
    for name, v in VARIANTS.items():
        layer = layers[name] = gcmoe.MoELayer(cfg, "cuda", "sm90").load(weights)  # (kept alive: the graphs use it)
        if v is None:
            layer.packed.plan.l2_prefetch = False
        else:
            ctas, frac = v
            base = layer.packed.plan.moe.shared_w1_ranges()
            rng = [(a, (int(n * frac) // 16) * 16) for a, n in base]
            layer.packed.plan.moe.shared_w1_ranges = lambda r=rng: r
            for lane in layer.packed.plan._lanes.values():
                lane.prefetch_ranges = rng
            ops.prefetch_l2 = lambda r, ctas=8, k=ctas: orig(r, k)
        graphs[name], outs[name] = capture_graph(
            lambda layer=layer, x=x, ids=ids, w=w: layer(x, ids, w), warmup=2, stream=torch.cuda.Stream()
        )
        ops.prefetch_l2 = orig
    for flush in ("write", "read"):
        for rep in range(3):
            times = time_interleaved(graphs, 30, l2_flush=flush)
            rec = dict(model=model, tokens=1, flush=flush, rep=rep, **{k: round(v, 2) for k, v in times.items()})
            rec["same"] = all(torch.equal(outs["w1_8"].view(torch.int16), o.view(torch.int16)) for o in outs.values())
            print(json.dumps(rec), flush=True)
            recs.append(rec)
    del graphs, outs, layers
    torch.cuda.empty_cache()
with open(out, "w") as f:
    json.dump(recs, f, indent=1)
