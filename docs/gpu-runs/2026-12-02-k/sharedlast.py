"""Side by side at T = 1, 2 (write / read flush): the shared experts' grid rows first (today) or last, with the
shared-W1 L2 prefetch at bucket 1 only (today) or at buckets 1-2."""

import json
import sys

import torch

import gcmoe
import gcmoe.backends.sm90 as sm90
from gcmoe_core.config import MoEConfig
from gcmoe_core.testing import make_tokens, make_weights
from gcmoe_core.timing import capture_graph, time_interleaved

out = sys.argv[1]
VARIANTS = {"today": (False, 1), "first_pf2": (False, 2), "last_pf2": (True, 2), "last_pf1": (True, 1)}
recs = []
for model in ("deepseek-v3", "glm-5", "deepseek-v4-flash"):
    cfg = MoEConfig.ep_slice(model, 8, max_tokens_per_rank=256)
    weights = make_weights(cfg, 1, "cuda")
    layers = {}
    for name, (last, _) in VARIANTS.items():
        layer = layers[name] = gcmoe.MoELayer(cfg, "cuda", "sm90").load(weights)  # (kept alive: the graphs use it)
        if last:
            layer.packed.plan.first_row_expert = lambda: 0  # ring experts 0 .. E/P - 1 first, the shared ones last
    for t in (1, 2):
        x, ids, w = make_tokens(cfg, t, "uniform", t, device="cuda")
        graphs, outs = {}, {}
        for name, (_, pf) in VARIANTS.items():
            sm90.L2_PREFETCH_MAX_BUCKET = pf  # (read when the call is enqueued: at capture)
            graphs[name], outs[name] = capture_graph(
                lambda layer=layers[name], x=x, ids=ids, w=w: layer(x, ids, w), warmup=2, stream=torch.cuda.Stream()
            )
        sm90.L2_PREFETCH_MAX_BUCKET = 1
        for flush in ("write", "read"):
            for rep in range(3):
                times = time_interleaved(graphs, 30, l2_flush=flush)
                rec = dict(model=model, tokens=t, flush=flush, rep=rep, **{k: round(v, 2) for k, v in times.items()})
                ref = outs["today"].view(torch.int16)
                rec["same"] = all(torch.equal(ref, o.view(torch.int16)) for o in outs.values())
                print(json.dumps(rec), flush=True)
                recs.append(rec)
    del layers, graphs, outs
    torch.cuda.empty_cache()
with open(out, "w") as f:
    json.dump(recs, f, indent=1)
