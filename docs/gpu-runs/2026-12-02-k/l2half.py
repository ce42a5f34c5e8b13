"""Side by side at T = 1 (write / read flush): the shared experts' W1 L2 prefetch whole (the default), its first
half, its second half (of each range: the weights' first / last M tiles, the records' likewise), none."""

import json
import sys

import torch

import gcmoe
from gcmoe_core.config import MoEConfig
from gcmoe_core.testing import make_tokens, make_weights
from gcmoe_core.timing import capture_graph, time_interleaved

out = sys.argv[1]


def part(ranges, which):
    """The first / second half of each (address, bytes) range, 16-byte aligned."""
    res = []
    for a, n in ranges:
        h = (n // 2) // 16 * 16
        res.append((a, h) if which == "first" else (a + h, n - h))
    return res


recs = []
for model in ("deepseek-v3", "glm-5"):
    cfg = MoEConfig.ep_slice(model, 8, max_tokens_per_rank=256)
    weights = make_weights(cfg, 1, "cuda")
    x, ids, w = make_tokens(cfg, 1, "uniform", 1, device="cuda")
    graphs, outs, layers = {}, {}, {}
    for name in ("all", "first", "second", "none"):
        layer = layers[name] = gcmoe.MoELayer(cfg, "cuda", "sm90").load(weights)  # (kept alive: the graphs use it)
        plan = layer.packed.plan
        if name == "none":
            plan.l2_prefetch = False
        elif name != "all":
            rng = part(plan.moe.shared_w1_ranges(), name)
            plan.moe.shared_w1_ranges = lambda r=rng: r
            for lane in plan._lanes.values():
                lane.prefetch_ranges = rng
        graphs[name], outs[name] = capture_graph(
            lambda layer=layer, x=x, ids=ids, w=w: layer(x, ids, w), warmup=2, stream=torch.cuda.Stream()
        )
    for flush in ("write", "read"):
        for rep in range(3):
            times = time_interleaved(graphs, 30, l2_flush=flush)
            rec = dict(model=model, tokens=1, flush=flush, rep=rep, **{k: round(v, 2) for k, v in times.items()})
            rec["same"] = all(torch.equal(outs["all"].view(torch.int16), o.view(torch.int16)) for o in outs.values())
            print(json.dumps(rec), flush=True)
            recs.append(rec)
    del graphs, outs, layers
    torch.cuda.empty_cache()
with open(out, "w") as f:
    json.dump(recs, f, indent=1)
