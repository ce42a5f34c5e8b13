"""The scaffold of this run's side-by-side scripts (l2w2, l2sweep, sksweep, l2half, sharedlast): one gcmoe.MoELayer
per variant of each model (EP8 slice, the same weights), each captured in a CUDA graph per token count, timed
interleaved (time_interleaved: cold L2 before every replay, median of `iters`) `reps` times per flush; one JSON record
per (model, T, flush, repetition) with every variant's µs and whether the outputs agree with the first variant's."""

import json
import sys
from contextlib import nullcontext

import torch

import gcmoe
from gcmoe_core.config import MoEConfig
from gcmoe_core.testing import calc_diff, make_tokens, make_weights
from gcmoe_core.timing import capture_graph, time_interleaved


def run(models, tokens, variants, prepare=None, capture_ctx=None, reps=3, iters=30, compare="bits"):
    """variants: names; prepare(name, layer): patch a fresh layer (before its first call); capture_ctx(name): a
    context around that variant's capture (default none); compare: "bits" (rec["same"]: every output bit-identical to
    the first variant's) or "calc_diff" (rec["max_diff"]). Writes the records to sys.argv[1]."""
    recs = []
    for model in models:
        cfg = MoEConfig.ep_slice(model, 8, max_tokens_per_rank=256)
        weights = make_weights(cfg, 1, "cuda")
        layers = {}
        for name in variants:  # (kept alive: the graphs use them)
            layers[name] = gcmoe.MoELayer(cfg, "cuda", "sm90").load(weights)
            if prepare is not None:
                prepare(name, layers[name])
        for t in tokens:
            x, ids, w = make_tokens(cfg, t, "uniform", t, device="cuda")
            graphs, outs = {}, {}
            for name, layer in layers.items():
                with capture_ctx(name) if capture_ctx is not None else nullcontext():
                    graphs[name], outs[name] = capture_graph(
                        lambda layer=layer, x=x, ids=ids, w=w: layer(x, ids, w), warmup=2, stream=torch.cuda.Stream()
                    )
            ref = outs[variants[0]]
            for flush in ("write", "read"):
                for rep in range(reps):
                    times = time_interleaved(graphs, iters, l2_flush=flush)
                    rec = dict(
                        model=model, tokens=t, flush=flush, rep=rep, **{k: round(v, 2) for k, v in times.items()}
                    )
                    if compare == "bits":
                        rec["same"] = all(
                            torch.equal(ref.view(torch.int16), o.view(torch.int16)) for o in outs.values()
                        )
                    else:
                        rec["max_diff"] = max(float(calc_diff(ref, o)) for o in outs.values())
                    print(json.dumps(rec), flush=True)
                    recs.append(rec)
        del layers, graphs, outs
        torch.cuda.empty_cache()
    with open(sys.argv[1], "w") as f:
        json.dump(recs, f, indent=1)


def set_prefetch_ranges(layer, ranges):
    """The layer's shared-expert L2 prefetch ranges (read when a lane is made; a lane made at load gets them too)."""
    plan = layer.packed.plan
    plan.moe.shared_w1_ranges = lambda r=ranges: r
    for lane in plan._lanes.values():
        lane.prefetch_ranges = ranges
