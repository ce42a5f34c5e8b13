"""The routed(+shared)-expert layer of one EP8 rank three ways, side by side on the GPU (graph replay, cold L2,
medians, interleaved): the two grouped kernels alone on prepared rows, the torch-glue layer (MoESm90.forward) and
the comm-path layer (gcmoe.rank_layer: publish, dispatch, W1, W2, combined, finalize), next to the FP4 floor.

    python -m gcmoe.rank_bench --out docs/benchmarks [--models ...] [--tokens 1 8 32 128 256]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from gcmoe_core.config import MoEConfig
from gcmoe_core.grouping import append_shared, group_rows, prepare_activations
from gcmoe_core.testing import make_tokens, make_weights
from gcmoe_core.timing import capture_graph, copy_bandwidth, fp4_floor_us, run_meta, time_interleaved
from gcmoe_gemm_sm90.ops import MoESm90, w1, w2

from .rank_layer import CommSm90Path

MODELS = ("deepseek-v4-flash", "deepseek-v3", "glm-5", "glm-4.5")


def point(model: str, tokens: int, bw: float, iters: int) -> dict:
    cfg = MoEConfig.ep_slice(model, 8, max_tokens_per_rank=max(256, tokens))
    moe = MoESm90.from_weights(make_weights(cfg, seed=1, device="cuda"))
    x, ids, w = make_tokens(cfg, tokens, seed=tokens, device="cuda")
    kcfg = moe.config_for(tokens, cfg.top_k)
    path = CommSm90Path(moe, cfg.top_k, cfg.max_tokens_per_rank, kcfg.n_tile)
    comm = lambda x, ids, w: path(moe, kcfg, x, ids, w)
    s = cfg.num_shared_experts
    all_ids, all_w = append_shared(ids, w, cfg.num_experts, s)
    layout = group_rows(all_ids, cfg.num_experts + s, kcfg.n_tile)
    acts = prepare_activations(x, all_w, layout, cfg.top_k + s)
    out = torch.empty(all_ids.numel(), cfg.hidden_size, dtype=torch.bfloat16, device="cuda")

    def kernels():
        hq, hsT = w1(moe.w13, acts, layout, kcfg)
        w2(moe.w2, hq, hsT, layout, out, kcfg)

    graphs = {
        "kernels": capture_graph(kernels)[0],
        "glue_layer": capture_graph(lambda: moe.forward(x, ids, w))[0],
        "comm_layer": capture_graph(lambda: comm(x, ids, w))[0],
    }
    identical = torch.equal(comm(x, ids, w), moe.forward(x, ids, w))
    path.ws.check()
    times = time_interleaved(graphs, iters)
    active = int(torch.unique(ids).numel()) + s
    floor = fp4_floor_us(cfg.hidden_size, cfg.intermediate_size, active, bw)
    return {
        "model": model,
        "tokens": tokens,
        "n_tile": kcfg.n_tile,
        "active_experts_incl_shared": active,
        "floor_us": floor,
        **{f"{k}_us": v for k, v in times.items()},
        "comm_vs_glue": times["glue_layer"] / times["comm_layer"],
        "comm_layer_x_floor": times["comm_layer"] / floor,
        "comm_bit_identical_to_glue": identical,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 8, 32, 128, 256])
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args(argv)
    bw = copy_bandwidth(torch.device("cuda"))
    recs = []
    for m in args.models:
        for t in args.tokens:
            recs.append(point(m, t, bw, args.iters))
            torch.cuda.empty_cache()
            print(json.dumps(recs[-1]), flush=True)
    meta = run_meta(copy_tb_s=bw / 1e12)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    day = meta["date"][:10]
    (out / f"rank-layer-h200-{day}.json").write_text(json.dumps({"meta": meta, "records": recs}, indent=2))
    rows = [
        "| model | T | N tile | active (+shared) | floor µs | W1+W2 µs | glue layer µs | comm layer µs | "
        "comm vs glue | comm layer × floor | bit-identical |",
        "|" + " --- |" * 11,
    ]
    for r in recs:
        rows.append(
            f"| {r['model']} | {r['tokens']} | {r['n_tile']} | {r['active_experts_incl_shared']} | "
            f"{r['floor_us']:.1f} | {r['kernels_us']:.1f} | {r['glue_layer_us']:.1f} | {r['comm_layer_us']:.1f} | "
            f"{r['comm_vs_glue']:.2f}× | {r['comm_layer_x_floor']:.2f} | {r['comm_bit_identical_to_glue']} |"
        )
    md = (
        f"# One EP8 rank's expert layer: kernels, torch glue, comm path — {meta['device']}, {meta['date']}\n\n"
        f"torch {meta['torch']}, copy bandwidth {meta['copy_tb_s']:.2f} TB/s. CUDA-graph replay, cold L2, median of "
        f"{args.iters}, the three variants interleaved. Shared experts included (they ride as always-routed "
        "experts). `W1+W2` = the two grouped kernels on rows already grouped and quantised; `glue layer` = "
        "MoESm90.forward (torch routing metadata, quantisation, gathers, combine around the kernels); `comm layer` "
        "= gcmoe.rank_layer, the sm90 backend's forward (publish, dispatch, W1, W2, combined, finalize kernels).\n"
        "Reproduce: `python -m gcmoe.rank_bench --out docs/benchmarks`.\n\n" + "\n".join(rows) + "\n"
    )
    (out / f"rank-layer-h200-{day}.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
