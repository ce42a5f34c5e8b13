"""One process of a code A/B on the public layer (run on the GPU; tools/gpu/ab_commits.sh alternates the processes of
two checkouts): gcmoe.MoELayer with its default policy (world size 1: sequential), each (model, T) captured in a
CUDA graph and timed interleaved, cold L2 (write flush), medians; per point a digest of the output bits, which must
match between the two checkouts' processes wherever the change keeps the results bit-exact. --finalize-ctas-per-sm /
--local-dispatch-max-bytes: layers of this checkout with other values of gcmoe_comm.comm's FINALIZE_CTAS_PER_SM (the
cap on finalize's grid) / LOCAL_DISPATCH_MAX_BYTES (world size 1: publish + dispatch in one kernel up to this many ring
bytes), every combination timed side by side in this process.

    python tools/gpu/layer_ab.py --tag new --out new-1.json [--models ...] [--tokens ...] [--finalize-ctas-per-sm 1 4]
        [--local-dispatch-max-bytes 0 1000000000]
"""

import argparse
import itertools
import json

import torch

import gcmoe
import gcmoe_comm.comm as comm
from gcmoe_core.config import MoEConfig
from gcmoe_core.testing import make_tokens, make_weights
from gcmoe_core.timing import capture_graph, run_meta, time_interleaved

ap = argparse.ArgumentParser()
ap.add_argument("--tag", required=True, help="names this checkout's variants in the JSON")
ap.add_argument("--out", required=True)
ap.add_argument("--models", nargs="+", default=["deepseek-v4-flash", "deepseek-v3"])
ap.add_argument("--tokens", nargs="+", type=int, default=[1, 32, 128, 256])
ap.add_argument("--finalize-ctas-per-sm", nargs="+", type=int, default=[None])
ap.add_argument("--local-dispatch-max-bytes", nargs="+", type=int, default=[None])
ap.add_argument("--iters", type=int, default=30)
args = ap.parse_args()


def digest(y: torch.Tensor) -> int:
    """A position-weighted sum of the output's bits (equal digests: equal bits, but for a vanishing chance)."""
    v = y.view(torch.int16).to(torch.int64).flatten()
    return int((v * torch.arange(1, v.numel() + 1, device=v.device)).sum())


recs = []
for model in args.models:
    cfg = MoEConfig.ep_slice(model, 8, max_tokens_per_rank=256)
    weights = make_weights(cfg, 1, "cuda")
    caps = {}
    for cap, local in itertools.product(args.finalize_ctas_per_sm, args.local_dispatch_max_bytes):
        name = args.tag + ("" if cap is None else f"_fin{cap}") + ("" if local is None else f"_local{local}")
        pairs = (("FINALIZE_CTAS_PER_SM", cap), ("LOCAL_DISPATCH_MAX_BYTES", local))
        values = {k: v for k, v in pairs if v is not None}
        caps[name] = (values, gcmoe.MoELayer(cfg, "cuda", "sm90").load(weights))
    for t in args.tokens:
        x, ids, w = make_tokens(cfg, t, "uniform", t, device="cuda")
        graphs, outs = {}, {}
        for name, (values, layer) in caps.items():
            for k, v in values.items():  # read when a bucket's graph is captured (finalize_grid, local_dispatch)
                setattr(comm, k, v)
            graphs[name], outs[name] = capture_graph(
                lambda layer=layer, x=x, ids=ids, w=w: layer(x, ids, w), warmup=2, stream=torch.cuda.Stream()
            )
        times = time_interleaved(graphs, args.iters, l2_flush="write")
        for g in graphs.values():
            g.replay()
        torch.cuda.synchronize()
        digests = {name: digest(y) for name, y in outs.items()}
        rec = dict(model=model, tokens=t, digest=next(iter(digests.values())), **times)
        rec["bitwise_same"] = len(set(digests.values())) == 1
        recs.append(rec)
        print(json.dumps(rec), flush=True)
with open(args.out, "w") as f:
    json.dump({"meta": run_meta(), "records": recs}, f, indent=1)
