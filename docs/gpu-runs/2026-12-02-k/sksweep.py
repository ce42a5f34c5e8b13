"""Side by side at T = 1 (write / read flush): W1's stream_k grid over 2 x (132 - d) CTAs, d = 0 (default) .. 16: the
CTAs that cannot be resident at launch (SM slots held by dispatch's and the L2 prefetch's CTAs) start late."""

import json
import sys

import torch

import gcmoe
from gcmoe_core.config import MoEConfig
from gcmoe_core.testing import calc_diff, make_tokens, make_weights
from gcmoe_core.timing import capture_graph, time_interleaved

out = sys.argv[1]
recs = []
for model in ("deepseek-v3", "glm-5"):
    cfg = MoEConfig.ep_slice(model, 8, max_tokens_per_rank=256)
    weights = make_weights(cfg, 1, "cuda")
    x, ids, w = make_tokens(cfg, 1, "uniform", 1, device="cuda")
    graphs, outs, layers = {}, {}, {}
    for d in (0, 4, 8, 12, 16, 24):
        name = f"sk{2 * (132 - d)}"
        layer = layers[name] = gcmoe.MoELayer(cfg, "cuda", "sm90").load(weights)
        layer.packed.plan.sm_count = 132 - d  # (sets stream_k's CTAs: occupancy x SMs)
        graphs[name], outs[name] = capture_graph(
            lambda layer=layer, x=x, ids=ids, w=w: layer(x, ids, w), warmup=2, stream=torch.cuda.Stream()
        )
    for flush in ("write", "read"):
        for rep in range(3):
            times = time_interleaved(graphs, 30, l2_flush=flush)
            rec = dict(model=model, tokens=1, flush=flush, rep=rep, **{k: round(v, 2) for k, v in times.items()})
            rec["max_diff"] = max(float(calc_diff(outs["sk264"], o)) for o in outs.values())
            print(json.dumps(rec), flush=True)
            recs.append(rec)
    del graphs, outs, layers
    torch.cuda.empty_cache()
with open(out, "w") as f:
    json.dump(recs, f, indent=1)
