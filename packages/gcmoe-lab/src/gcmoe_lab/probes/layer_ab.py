"""One process of a code A/B on the public layer (run on the GPU; tools/gpu/ab_commits.sh alternates the processes of
two checkouts): gcmoe.MoELayer with its default policy, each (model, T) captured in a CUDA graph and timed
interleaved, cold L2 (write flush), medians; per point a digest of the output bits, which must match between the two
checkouts' processes wherever the change keeps the results bit-exact (the public layer is bit-identical before and
after a refactor). Only the public layer is used, so the other checkout's packages may be older than the lab.

    gcmoe-lab probe layer_ab --tag new --out new-1.json [--models ...] [--tokens ...] [--iters 30] [--test-shapes]

--test-shapes adds, untimed, the GPU tests' small layer (and with masked ids, and routing to one expert) and an
unpadded gpt-oss-20b layer (clamped SwiGLU, biases, H = I = 2880) at world size 1; every point records the digest of
an eager call beside the captured one's.

(Up to the lab's first version it also set gcmoe_comm.comm's FINALIZE_CTAS_PER_SM / LOCAL_DISPATCH_MAX_BYTES module
constants per variant: internals of a component, not knobs of the layer; git keeps that version.)
"""

from __future__ import annotations

import argparse
import json

import torch


def digest(y: torch.Tensor) -> int:
    """A position-weighted sum of the output's bits (equal digests: equal bits, but for a vanishing chance)."""
    v = y.contiguous().view(torch.int16).to(torch.int64).flatten()
    return int((v * torch.arange(1, v.numel() + 1, device=v.device)).sum())


def main(argv=None) -> int:
    import gcmoe
    from gcmoe_core.config import MoEConfig
    from gcmoe_core.testing import make_tokens, make_weights

    from ..timing import capture_graph, run_meta, time_interleaved

    ap = argparse.ArgumentParser(prog="gcmoe-lab probe layer_ab", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tag", required=True, help="names this checkout's process in the JSON")
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", nargs="+", default=["deepseek-v4-flash", "deepseek-v3"])
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 32, 128, 256])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--test-shapes", action="store_true", help="also the GPU tests' shapes, untimed")
    args = ap.parse_args(argv)

    small = dict(hidden_size=512, intermediate_size=256, num_experts=16, top_k=4, num_shared_experts=1)
    cases = [(m, MoEConfig.ep_slice(m, 8, max_tokens_per_rank=256), args.tokens, "uniform", True) for m in args.models]
    if args.test_shapes:
        cases += [
            ("small", MoEConfig(**small, max_tokens_per_rank=32), (1, 5, 11, 32), "uniform", False),
            ("small-one-expert", MoEConfig(**small, max_tokens_per_rank=32), (9,), "one_expert", False),
            ("small-masked", MoEConfig(**small, max_tokens_per_rank=32, masked_ids=True), (3, 16), "uniform", False),
            ("gpt-oss-20b", MoEConfig.ep_slice("gpt-oss-20b", 1, max_tokens_per_rank=64), (1, 32), "uniform", False),
        ]
    recs = []
    for name, cfg, tokens, routing, timed in cases:
        weights = make_weights(cfg, 1, "cuda")
        layer = gcmoe.MoELayer(cfg, "cuda", "sm90").load(weights)
        stream = torch.cuda.Stream()  # one capture stream: the layer keeps one lane for it
        for t in tokens:
            x, ids, w = make_tokens(cfg, t, routing, t, device="cuda")
            if cfg.masked_ids:
                ids[:, -1] = -1  # every token's last slot masked
            eager = digest(layer(x, ids, w))
            call = lambda x=x, ids=ids, w=w, layer=layer: layer(x, ids, w)
            graph, out = capture_graph(call, warmup=2, stream=stream)
            times = time_interleaved({args.tag: graph}, args.iters, l2_flush="write") if timed else {}
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            rec = dict(model=name, tokens=t, digest=digest(out), eager_digest=eager, **times)
            recs.append(rec)
            print(json.dumps(rec), flush=True)
        del layer
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"meta": run_meta(tag=args.tag), "records": recs}, f, indent=1)
    return 0
