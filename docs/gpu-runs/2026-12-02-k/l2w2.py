"""Side by side at T = 1 (write / read flush): the shared experts' L2 prefetch of W1 (the default) vs W1 + W2 vs off."""

import json
import sys

import torch

import gcmoe
from gcmoe_core.config import MoEConfig
from gcmoe_core.testing import make_tokens, make_weights
from gcmoe_core.timing import capture_graph, time_interleaved

out = sys.argv[1]
recs = []
for model in ("deepseek-v3", "glm-5", "deepseek-v4-flash"):
    cfg = MoEConfig.ep_slice(model, 8, max_tokens_per_rank=256)
    weights = make_weights(cfg, 1, "cuda")
    layers = {}
    for name in ("w1", "w1w2", "off"):
        layer = gcmoe.MoELayer(cfg, "cuda", "sm90").load(weights)
        moe = layer.packed.plan.moe
        if name == "w1w2":
            base = moe.shared_w1_ranges()
            extra = []
            for e in range(moe.num_routed, moe.w2.experts):
                for t in (moe.w2.data[e], moe.w2.scales[e]):
                    extra.append((t.data_ptr(), t.numel() * t.element_size()))
            moe.shared_w1_ranges = lambda r=base + extra: r
            for lane in layer.packed.plan._lanes.values():  # (a lane made at load)
                lane.prefetch_ranges = base + extra
        if name == "off":
            layer.packed.plan.l2_prefetch = False
        layers[name] = layer
    for t in (1, 2):
        x, ids, w = make_tokens(cfg, t, "uniform", t, device="cuda")
        graphs, outs = {}, {}
        for name, layer in layers.items():
            graphs[name], outs[name] = capture_graph(
                lambda layer=layer, x=x, ids=ids, w=w: layer(x, ids, w), warmup=2, stream=torch.cuda.Stream()
            )
        for flush in ("write", "read"):
            for rep in range(2):
                times = time_interleaved(graphs, 30, l2_flush=flush)
                rec = dict(model=model, tokens=t, flush=flush, rep=rep, **{k: round(v, 2) for k, v in times.items()})
                rec["same"] = all(torch.equal(outs["w1"].view(torch.int16), o.view(torch.int16)) for o in outs.values())
                print(json.dumps(rec), flush=True)
                recs.append(rec)
with open(out, "w") as f:
    json.dump(recs, f, indent=1)
