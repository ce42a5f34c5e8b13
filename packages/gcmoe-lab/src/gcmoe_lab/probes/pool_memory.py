"""Memory beyond the packed weights of a model's layers at P > 1, measured with virtual ranks on one GPU (GPU): the
allocator's growth after load and after one eager two-batch step, less the packed weights, per rank, beside the lane
formula the model-step record computes its P = 8 figure with (gcmoe_lab.model_step.lane_bytes: one lane per
micro-batch, each a workspace + W1's output + its scales) and beside the pool's own count (LayerPool.memory_bytes).

    gcmoe-lab probe pool_memory [--model deepseek-v3] [--ranks 2 4] [--layers 2] [--json PATH]

The P virtual ranks of a layer live in one process, so the growth covers P ranks' lanes: per rank = growth / P.
Every layer runs one kernel configuration (--n-tile, no stream-K: one compile per rank count instead of one per
token bucket); a configuration with stream-K would add its W1 scratch to each lane, which the formula leaves out.
"""

from __future__ import annotations

import argparse
import json

import torch


def _allocated(device) -> int:
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device)


def measure(model: str, ranks: int, layers: int, n_tile: int, tokens: int, device) -> dict:
    """One rank count: {ranks, layers, packed_gb, beyond_packed_gb {loaded, stepped} per rank, pool_gb and
    formula_gb per rank}."""
    import gcmoe
    from gcmoe.backends import LayerOptions
    from gcmoe.backends.sm90 import virtual_ranks
    from gcmoe_core.config import MoEConfig
    from gcmoe_core.testing import make_tokens, make_weights
    from gcmoe_gemm_sm90.config import Sm90Config

    from ..model_step import GB, MAX_TOKENS, MICRO_BATCH_LANES, lane_bytes, storage_bytes

    cfg = MoEConfig.from_model(model, ep_size=ranks, max_tokens_per_rank=MAX_TOKENS)
    weights = make_weights(cfg.replace(ep_size=1), 0, device)  # every expert: each rank prepacks its slice
    base = _allocated(device)
    pool = gcmoe.LayerPool()
    opts = LayerOptions(comm_sms=0, kernel_config=Sm90Config(n_tile=n_tile), pool=pool)
    plans = [virtual_ranks(cfg, weights, device, opts) for _ in range(layers)]
    packed = storage_bytes(t for p in plans for q in p for t in q.moe.tensors())
    loaded = _allocated(device) - base - packed
    streams = {(m, r): torch.cuda.Stream(device) for m in range(MICRO_BATCH_LANES) for r in range(ranks)}
    ins = {key: make_tokens(cfg, tokens, "uniform", 100 + 10 * key[0] + key[1], device=device) for key in streams}
    before_step = _allocated(device)
    main = torch.cuda.current_stream(device)
    outs = []
    for (m, r), s in streams.items():
        s.wait_stream(main)
        with gcmoe.micro_batch(m), torch.cuda.stream(s):
            x, ids, w = ins[m, r]
            for p in plans:
                outs.append(p[r].forward(x, ids, w, False))
    for s in streams.values():
        main.wait_stream(s)
    out_bytes = sum(o.numel() * o.element_size() for o in outs)
    stepped = loaded + _allocated(device) - before_step - out_bytes
    pool.check()
    return {
        "ranks": ranks,
        "layers": layers,
        "packed_gb": packed / GB,
        "beyond_packed_gb_per_rank": {"loaded": loaded / ranks / GB, "stepped": stepped / ranks / GB},
        "pool_gb_per_rank": pool.memory_bytes() / ranks / GB,
        "formula_gb_per_rank": MICRO_BATCH_LANES * lane_bytes(cfg) / GB,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gcmoe-lab probe pool_memory", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="deepseek-v3")
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--layers", type=int, default=2, help="layers per rank count (memory must not grow with them)")
    ap.add_argument("--n-tile", type=int, default=8, help="the one kernel configuration's token tile")
    ap.add_argument("--tokens", type=int, default=8, help="tokens per micro-batch and rank of the eager step")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    device = torch.device("cuda", torch.cuda.current_device())
    rows = []
    for p in a.ranks:
        row = measure(a.model, p, a.layers, a.n_tile, a.tokens, device)
        rows.append(row)
        print(json.dumps(row))
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": a.model, "rows": rows}, f, indent=1)
    return 0
