"""Kernel configurations of the layer side by side (run on the GPU): the public call captured in a CUDA graph with the
chosen kernel configuration and with variants of it forced, interleaved, cold L2, medians.

    --sweep splits       other (W1, W2) K splits (at small T; each with expert_sync where its W1 is unsplit)
    --sweep expert_sync  W2 per expert after its W1 tiles (W1_DONE tags) vs after the whole W1 grid
    --sweep stream_k     the chosen config vs W1 unsplit vs W1 stream_k (equal window ranges per CTA slot), also at
                         the stages its occupancy holds where with_splits caps stream_k's (stream_k_deep)
    --sweep first        the shared experts' grid rows first (the default) vs every ring expert in expert order
    --sweep grid         W1 / W2 grid rows bounded by the experts that can have rows (the default with active-first
                         rows) vs one row per ring expert vs half the bound (CTAs running rows y, y + R: what a peer's
                         call larger than the bound costs) vs the bound of every rank of P = 2 / 8 calling with the
                         bucket (rows_p2 / rows_p8: P x bucket x top_k + shared; the idle CTAs such a rank launched,
                         here with one rank's work) vs those bounds capped at the rows whose W1 CTAs fit the SM slots
                         at once (fit_p1 / fit_p2) vs the grid a rank of P = 2 / 8 gets (plan_p2 / plan_p8:
                         Sm90Plan.grid_rows); and 4 warpgroups at N tiles <= 24
    --sweep stages       the chosen pipeline depth vs up to two stages fewer and more (bytes in flight per CTA)
    --sweep evict_first  the weight streams with the L2 evict_first hint vs without (run it with --l2-flush write:
                         the hint matters where L2 holds dirty lines)
    --sweep l2_prefetch  the shared experts' W1 prefetched into L2 beside the comm kernels (the default) vs not
    --sweep w1_half      the chosen W1 vs the other cfg.w1_half (flipped; W1 unsplit, not stream_k); where neither
                         GEMM runs half tiles also W2 in half tiles (w2_half), and both (both); where a GEMM is
                         K-split or stream_k, both unsplit in half tiles (halves_unsplit): precompile.half_variants
    --sweep w2_half      the chosen W2 vs the other cfg.w2_half (flipped: half an M tile per CTA, two CTAs per SM, or
                         whole tiles; W2 unsplit)

    python tools/gpu/split_sweep.py [--sweep splits] [--models deepseek-v3 deepseek-v4-flash] [--tokens 1 2]
                                    [--l2-flush read] [--out DIR]
"""

import argparse
import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import torch
from precompile import half_variants  # (tools/gpu, the script's own folder)

import gcmoe
from gcmoe.backends.sm90 import Sm90Plan
from gcmoe_core.config import MoEConfig
from gcmoe_core.reference import Activation
from gcmoe_core.testing import calc_diff, make_tokens, make_weights
from gcmoe_core.timing import L2_FLUSHES, capture_graph, copy_bandwidth, fp4_floor_us, run_meta, time_interleaved
from gcmoe_gemm_sm90.config import TILE_M, can_implement, half_tiles_ok, with_splits
from gcmoe_gemm_sm90.ops import epilogue_flags, layer_config

ap = argparse.ArgumentParser()
ap.add_argument(
    "--sweep",
    choices=(
        "splits",
        "expert_sync",
        "stream_k",
        "grid",
        "first",
        "stages",
        "evict_first",
        "l2_prefetch",
        "w1_half",
        "w2_half",
    ),
    default="splits",
)
ap.add_argument("--splits", nargs="+", default=["11", "21", "22", "41", "42"], help="(W1, W2) K splits, e.g. 21")
ap.add_argument("--models", nargs="+", default=["deepseek-v3", "deepseek-v4-flash"])
ap.add_argument("--tokens", nargs="+", type=int, default=[1, 2])
ap.add_argument("--ep", type=int, default=8, help="the expert parallelism each model's slice is of")
ap.add_argument("--iters", type=int, default=20)
ap.add_argument("--l2-flush", choices=L2_FLUSHES, default="read")
ap.add_argument("--out", default=".")
args = ap.parse_args()
bw = copy_bandwidth(torch.device("cuda"))
recs = []
for model in args.models:
    cfg = MoEConfig.ep_slice(model, args.ep, max_tokens_per_rank=256)
    weights = make_weights(cfg, 1, "cuda")
    h, i = cfg.padded_hidden, cfg.padded_intermediate  # (the kernels' shapes: gpt-oss pads 2880 to 3072 / 2944)
    shape = (cfg.local_experts, h, i, cfg.num_shared_experts)
    flags = epilogue_flags(Activation.of(cfg), cfg.has_bias)
    for t in args.tokens:
        chosen = layer_config(t, cfg.top_k, *shape, epilogue=flags)  # (what MoESm90.config_for returns)
        x, ids, w = make_tokens(cfg, t, "uniform", t, device="cuda")
        graphs, outs, layers = {}, {}, []
        if args.sweep == "splits":
            variants = {
                "chosen" if sp is chosen.splits else f"split{sp[0]}{sp[1]}": with_splits(chosen, sp, h, i)
                for sp in [chosen.splits, *(divmod(int(x), 10) for x in args.splits)]
            }
        elif args.sweep == "stream_k":
            unsplit = with_splits(replace(chosen, stream_k=False), (1, chosen.splits[1]), h, i)
            # (with_splits: its stages; stream_k runs whole W1 tiles)
            streamk = with_splits(replace(unsplit, stream_k=True, w1_half=False), unsplit.splits, h, i)
            variants = {"chosen": chosen, "w1_unsplit": unsplit, "stream_k": streamk}
            if streamk.stages < unsplit.stages:  # the stages its occupancy holds (with_splits caps stream_k's)
                variants["stream_k_deep"] = replace(streamk, stages=unsplit.stages)
        elif args.sweep == "stages":
            depths = range(max(2, chosen.stages - 2), min(8, chosen.stages + 2) + 1)
            variants = {
                "chosen": chosen,
                **{f"stages{d}": replace(chosen, stages=d) for d in depths if d != chosen.stages},
            }
        elif args.sweep == "evict_first":
            variants = {"chosen": chosen, "flipped": replace(chosen, evict_first=not chosen.evict_first)}
        elif args.sweep == "first":
            variants = {"chosen": chosen, "shared_last": chosen}
        elif args.sweep == "w1_half":
            variants = {"chosen": chosen, **half_variants(chosen, h, i)}
        elif args.sweep == "w2_half":
            variants = {"chosen": chosen}
            if half_tiles_ok(chosen, False):
                variants["flipped"] = replace(chosen, w2_half=not chosen.w2_half)
        elif args.sweep == "l2_prefetch":
            variants = {"chosen": chosen, "no_prefetch": chosen}
        elif args.sweep == "grid":
            variants = {
                "chosen": chosen,
                "full_grid": chosen,
                "half_rows": chosen,
                "rows_p2": chosen,
                "rows_p8": chosen,
                "fit_p1": chosen,
                "fit_p2": chosen,
                "plan_p2": chosen,
                "plan_p8": chosen,
            }
            if chosen.n_tile <= 24:
                variants["wg4"] = with_splits(replace(chosen, warpgroups=4, occupancy=1), chosen.splits, h, i)
        else:
            variants = {
                "expert_sync": replace(chosen, expert_sync=True),
                "grid_wait": replace(chosen, expert_sync=False),
            }
        for name, kcfg in variants.items():
            sp = kcfg.splits
            shapes = zip(((2 * i, h, kcfg.w1_half), (h, i, kcfg.w2_half)), sp)
            if any(can_implement(m, k, 1, kcfg, splits=s, half=half) for (m, k, half), s in shapes):
                continue
            layer = gcmoe.MoELayer(cfg, "cuda", "sm90", kernel_config=kcfg).load(weights)
            plan = layer.packed.plan  # (its grid patched before the first call captures anything)
            if name == "full_grid":  # one grid row per ring expert
                plan.grid_rows = lambda bucket, kcfg, comm_sms=0: None
            if name == "half_rows":  # half the bounded rows: CTAs run rows y, y + R, ... (kernel_grouped: Grid)

                def half(bucket, kcfg, comm_sms=0, bound=plan.grid_rows):
                    rows = bound(bucket, kcfg, comm_sms)
                    return None if rows is None else max(1, rows // 2)

                plan.grid_rows = half
            if name.startswith(("rows_p", "fit_p", "plan_p")):  # the grid of a rank of P, one rank's work here
                ranks = int(name.split("_p")[1])
                # (the rule reads the slice's H and I from cfg; E need not divide by P here)
                rank_plan = SimpleNamespace(spec=replace(plan.spec, ranks=ranks), cfg=cfg, sm_count=plan.sm_count)
                kind = name.split("_p")[0]
                w1_tiles = 2 * i // TILE_M

                def rank_rows(bucket, kcfg, comm_sms=0, p=rank_plan, kind=kind, slots=plan.sm_count, tiles=w1_tiles):
                    """plan: Sm90Plan.grid_rows of a rank of P (the product's rule); rows: the bound of every rank
                    calling with this bucket (P x bucket x top_k + shared; the rule until 2026-12-01); fit: that
                    bound capped at the rows whose W1 CTAs all fit the SMs' CTA slots at once"""
                    if kind == "plan":
                        return Sm90Plan.grid_rows(p, bucket, kcfg, comm_sms)
                    rows = Sm90Plan.experts_reached(p.spec, bucket, p.spec.ranks)
                    if not kcfg.active_first or kind == "rows":
                        return rows if kcfg.active_first else None
                    return min(rows, max(1, kcfg.occupancy * slots // (tiles * kcfg.splits[0])))

                plan.grid_rows = rank_rows
            if name == "shared_last":  # grid rows in expert order: the shared experts (the last ring experts) last
                plan.first_row_expert = lambda: 0
            if name == "no_prefetch":
                plan.l2_prefetch = False
            layers.append(layer)
            fn = lambda layer=layer, x=x, ids=ids, w=w: layer(x, ids, w)
            graphs[name], outs[name] = capture_graph(fn, warmup=2, stream=torch.cuda.Stream())
        times = time_interleaved(graphs, args.iters, l2_flush=args.l2_flush)
        for g in graphs.values():  # every variant's output of the same call against the first's
            g.replay()
        torch.cuda.synchronize()
        first = next(iter(outs.values()))
        diffs = {f"{name}_calc_diff": calc_diff(y, first) for name, y in outs.items()}
        active = int(torch.unique(ids).numel()) + cfg.num_shared_experts
        floor = fp4_floor_us(cfg.hidden_size, cfg.intermediate_size, active, bw)
        rec = {
            "model": model,
            "ep": args.ep,
            "tokens": t,
            "sweep": args.sweep,
            "l2_flush": args.l2_flush,
            "chosen_evict_first": chosen.evict_first,
            "chosen_splits": list(chosen.splits),
            "floor_us": floor,
        }
        rec.update(times)
        rec.update(diffs)
        rec["bitwise_same"] = all(torch.equal(y, first) for y in outs.values())
        recs.append(rec)
        print(json.dumps(rec), flush=True)
        del layers, graphs
        torch.cuda.empty_cache()
Path(args.out).mkdir(parents=True, exist_ok=True)
Path(
    args.out, f"{args.sweep.replace('_', '-')}-sweep-{args.l2_flush}{'' if args.ep == 8 else f'-ep{args.ep}'}.json"
).write_text(json.dumps({"meta": run_meta(copy_tb_s=bw / 1e12), "records": recs}))
