"""Benchmark of the sm90 grouped GEMMs (run on an H200): W1+W2 of one EP rank's routed experts, per model shape and
token count, side by side in one run with the FP4 floor, the operator's layer and the torch peers doing the same
W1 -> SwiGLU -> W2.

    gcmoe-lab probe bench_sm90 --out DIR [--models ...] [--tokens 1 8 32 128 256] [--variants ...]

Writes DIR/sm90_grouped.json (run metadata + one record per point) and DIR/sm90_grouped.md (the table).
Per point (CUDA-graph replay, cold L2, medians; variants interleaved A B C A B C):
    ours_kernels   our W1 + W2 launches (gcmoe_gemm_sm90.ops.launch_w1 / launch_w2, every operand made once) on rows
                   grouped and quantised beforehand: the kernels' own time, as the operator's compute partition runs
                   them, with the grid rows the operator launches (gcmoe.backends.sm90.grid_rows for a layer of the
                   bench's shape at world size 1; the torch peers are launched eagerly, see bench_point: after the
                   read flush's ~57 µs the GPU can wait for their host-side launches, which inflates their times at
                   small T; compare against them under --l2-flush write)
    ours_w1        the W1 launch alone (W2's share is the difference)
    ours_kernels_<variant>  (--variants, see variant_config) the chosen configuration with one public knob
                   (a gcmoe_gemm_sm90.config.Sm90Config field) changed: grid-row order, 2 / 4 warpgroups, another N tile
    ours_kernels_splitAB  (T <= --split-sweep) W1 / W2 with A / B K splits instead of the chosen ones
    ours_layer     the operator's layer: gcmoe.MoELayer(sm90, comm_sms = 0) of the same shape and weights at world
                   size 1 (routing, FP8 quantisation, the ring, W1, W2, finalize), captured in a caller's graph
    torch_fp8      torch._scaled_grouped_mm (FP8 rowwise) W1, SwiGLU + routing weight in torch, FP8 requant, W2
    torch_bf16     torch._grouped_mm (BF16) for the same
    floor          active experts x 3 H I x (0.5 + 1/32) B / copy bandwidth measured in this run
    tensor_floor   the point's FP8 tensor work (2 x 3 H I FLOP per expert row: valid rows, and rows padded to the N
                   tile as the kernels run them) / the FP8 GEMM rate measured in this run (torch._scaled_mm, 8192^3)

History: the stage ablations, the v4 register weight stream, three CTAs per SM, the decode's shifts on the FMA pipe,
the per-CTA launch timelines (up to sm90-grouped-v7), the overlap / PDL ablations and the ring-free layer on prepared
rows (gcmoe_core.grouping.grouped_forward, up to the lab's first version) were measured here and removed with their
switches; the records keep them (docs/benchmarks/index.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch

from gcmoe import MoELayer
from gcmoe.backends.sm90 import grid_rows, ring_spec, token_bucket
from gcmoe_core.config import MoEConfig
from gcmoe_core.grouping import group_rows, prepare_activations
from gcmoe_core.testing import capture_graph, make_tokens, make_weights
from gcmoe_gemm_sm90.config import N_TILES, can_implement, tile_shape, with_halves, with_splits
from gcmoe_gemm_sm90.ops import MoESm90, StreamKScratch, launch_w1, launch_w2

from .baselines import quantize_fp8_rowwise
from .timing import L2_FLUSHES, copy_bandwidth, fp4_floor_us, run_meta, time_gpu, time_interleaved

MODELS = ("deepseek-v4-flash", "deepseek-v3", "glm-5", "glm-4.5")


def _graph(fn) -> torch.cuda.CUDAGraph:
    return capture_graph(fn)[0]


class TorchPeer:
    """W1 -> SwiGLU * w -> W2 with torch's grouped GEMMs over the same expert-sorted, 16-padded rows."""

    def __init__(self, cfg: MoEConfig, fp8: bool, seed: int = 0):
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
        g = torch.Generator(device="cuda").manual_seed(seed)
        w13 = torch.randn(e, 2 * i, h, generator=g, device="cuda", dtype=torch.bfloat16) * h**-0.5
        w2_ = torch.randn(e, h, i, generator=g, device="cuda", dtype=torch.bfloat16) * i**-0.5
        self.fp8, self.i = fp8, i
        if fp8:  # [E, K, N] column-major views of the rowwise-quantised [E, N, K], scales [E, N]
            (q13, self.s13), (q2, self.s2) = quantize_fp8_rowwise(w13), quantize_fp8_rowwise(w2_)
            self.w13, self.w2 = q13.transpose(1, 2), q2.transpose(1, 2)
        else:
            self.w13, self.w2 = w13.transpose(1, 2), w2_.transpose(1, 2)  # [E, K, N] column-major views

    def __call__(self, x_rows: torch.Tensor, offs_end: torch.Tensor, route_w: torch.Tensor) -> torch.Tensor:
        if self.fp8:
            xa, sa = quantize_fp8_rowwise(x_rows)
            gu = torch._scaled_grouped_mm(xa, self.w13, sa, self.s13, offs=offs_end, out_dtype=torch.bfloat16)
            hh = (torch.nn.functional.silu(gu[:, : self.i].float()) * gu[:, self.i :].float()) * route_w.unsqueeze(1)
            ha, sh = quantize_fp8_rowwise(hh)
            return torch._scaled_grouped_mm(ha, self.w2, sh, self.s2, offs=offs_end, out_dtype=torch.bfloat16)
        gu = torch._grouped_mm(x_rows, self.w13, offs=offs_end)
        hh = (torch.nn.functional.silu(gu[:, : self.i].float()) * gu[:, self.i :].float()) * route_w.unsqueeze(1)
        return torch._grouped_mm(hh.to(torch.bfloat16), self.w2, offs=offs_end)


VARIANTS = ("in_order", "active_first", "wg2", "wg4", *(f"n{n}" for n in N_TILES))
DEFAULT_VARIANTS: tuple[str, ...] = ()


def variant_config(name: str, kcfg, hidden: int, inter: int):
    """The configuration of variant `name` against the chosen kcfg, or None where it does not apply:
    in_order / active_first  grid row y runs expert y (empty experts' CTAs launch among the others) / the y-th
                expert with rows (where the chosen configuration has the other)
    wg2 / wg4   for N 32-64 points, whole tiles of 2 warpgroups / 4 warpgroups keeping the chosen half tiles (where
                the chosen configuration has the other)
    n<N>        another N tile (with its tile_shape), e.g. n64 for the v5 choice at 128-256 tokens; the chosen half
                tiles kept where that shape holds an SM alone (occupancy 1), as choose_config runs them"""
    if name in ("in_order", "active_first"):
        first = name == "active_first"
        return None if kcfg.active_first == first else dataclasses.replace(kcfg, active_first=first)
    if name in ("wg2", "wg4"):
        wgs = int(name[2])
        if kcfg.n_tile < 32 or kcfg.n_tile > 64 or kcfg.warpgroups == wgs:
            return None
        return with_splits(_tile_shape(kcfg, kcfg.n_tile, 1, wgs, wgs == 4), kcfg.splits, hidden, inter)
    if name.startswith("n") and name[1:].isdigit() and int(name[1:]) in N_TILES:
        n = int(name[1:])
        if n == kcfg.n_tile:
            return None
        occ, wgs = tile_shape(n)
        return with_splits(_tile_shape(kcfg, n, occ, wgs, occ == 1), kcfg.splits, hidden, inter)
    raise ValueError(f"unknown variant {name!r}: one of {VARIANTS}")


def _tile_shape(kcfg, n_tile: int, occupancy: int, warpgroups: int, keep_halves: bool):
    """kcfg with another N tile / tile shape; its half tiles (w1_half / w2_half) kept where keep_halves and
    half_tiles_ok allows them (with_halves: e.g. not W2's bias epilogue above N 64)."""
    c = dataclasses.replace(
        kcfg, n_tile=n_tile, occupancy=occupancy, warpgroups=warpgroups, w1_half=False, w2_half=False
    )
    return with_halves(c, kcfg.w1_half and keep_halves, kcfg.w2_half and keep_halves)


def fp8_gemm_rate(n: int = 8192) -> float:
    """FLOP/s of one n^3 FP8 E4M3 GEMM (torch._scaled_mm, per-tensor scales, bf16 out), graph-replayed, warm L2: the
    device's measured tensor ceiling for this run."""
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm takes it
    one = torch.ones((), device="cuda")
    t = time_gpu(lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16), iters=20, cold_l2=False)
    return 2 * n**3 / (t["median_us"] * 1e-6)


def layer_grid_rows(cfg: MoEConfig, tokens: int, kcfg, sm_count: int) -> int | None:
    """The W1 / W2 grid rows the operator launches for a call of `tokens` tokens on a world-size-1 layer of cfg's
    shape with configuration kcfg: gcmoe.backends.sm90.grid_rows at the call's token bucket (the one rule; the bench
    keeps no copy of it)."""
    return grid_rows(cfg, ring_spec(cfg), token_bucket(tokens), kcfg, sm_count)


def kernel_launches(moe: MoESm90, x, w, ids, mcfg: MoEConfig, c, out, sm_count: int):
    """(run, layout): our W1 + W2 launches with configuration c on rows grouped and quantised for its N tile outside
    (the compute partition's work), every operand made here once, with the grid rows the operator launches
    (layer_grid_rows); run(w1_only=True) launches W1 alone. W2 stores row i to out[layout.src_slot[i]] (a one-entry
    peer table: every row to "rank 0", out). The closure owns the rows and buffers: keep it alive as long as a
    graph captured from it."""
    layout = group_rows(ids, mcfg.num_experts, c.n_tile)
    acts = prepare_activations(x, w, layout, mcfg.top_k)
    rows, dev = layout.rows, x.device
    hq = torch.empty(rows, moe.inter, dtype=torch.uint8, device=dev)
    hsT = torch.empty(2 * moe.inter // 256, rows, dtype=torch.float32, device=dev)
    src = torch.zeros(rows, 3, dtype=torch.int32, device=dev)
    comb = torch.tensor([out.data_ptr()], dtype=torch.int64, device=dev)
    offs, cnt = layout.offsets, layout.counts
    scratch = StreamKScratch.make(dev, c.n_tile) if c.stream_k else None
    grid = layer_grid_rows(mcfg, ids.shape[0], c, sm_count)

    def run(w1_only=False):
        launch_w1(moe.w13, acts.x_rows, acts.sxT, acts.route_w, offs, cnt, hq, hsT, c, None, scratch, grid_rows=grid)
        if not w1_only:
            launch_w2(moe.w2, hq, hsT, offs, cnt, layout.src_slot, src, comb, c, grid_rows=grid)

    return run, layout


def bench_point(
    model: str,
    tokens: int,
    ep: int,
    bw: float,
    iters: int,
    peers: bool,
    split_sweep: bool,
    variant_names=DEFAULT_VARIANTS,
    fp8_rate: float | None = None,
    l2_flush: str = "write",
) -> dict:
    cfg = MoEConfig.ep_slice(model, ep, max_tokens_per_rank=max(256, tokens), num_shared_experts=0)
    weights = make_weights(cfg, seed=1, device="cuda")
    moe = MoESm90.from_weights(weights)
    x, ids, w = make_tokens(cfg, tokens, seed=tokens, device="cuda")
    kcfg = moe.config_for(tokens, cfg.top_k)
    h, i = cfg.hidden_size, cfg.intermediate_size
    out = torch.empty(ids.numel(), cfg.hidden_size, dtype=torch.bfloat16, device="cuda")

    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    run, layout = kernel_launches(moe, x, w, ids, cfg, kcfg, out, sms)
    layer = MoELayer(cfg, x.device, "sm90", comm_sms=0).load(weights)
    stream = torch.cuda.Stream()  # the layer keeps one lane per caller stream: warm up and capture on one
    graphs = {
        "ours_kernels": _graph(run),
        "ours_w1": _graph(lambda: run(w1_only=True)),
        "ours_layer": capture_graph(lambda: layer(x, ids, w), stream=stream)[0],
    }
    # variants, timed interleaved with the chosen configuration (--variants)
    # (each variant's closure owns its rows: keep it alive as long as its graph, which only holds their addresses)
    variants = {
        f"ours_kernels_{name}": kernel_launches(moe, x, w, ids, cfg, c, out, sms)[0]
        for name in variant_names
        if (c := variant_config(name, kcfg, h, i)) is not None
    }
    if split_sweep:  # K splits of W1 and W2 other than the chosen ones
        for sp in ((1, 1), (2, 1), (2, 2), (4, 2), (4, 4)):
            try:
                c = with_splits(kcfg, sp, h, i)
            except ValueError:  # no stage count fits the partial buffers
                continue
            shapes = ((2 * i, h), (h, i))
            if sp != kcfg.splits and all(
                can_implement(m, k, cfg.num_experts, c, splits=s) is None for (m, k), s in zip(shapes, sp, strict=True)
            ):
                variants[f"ours_kernels_split{sp[0]}{sp[1]}"] = kernel_launches(moe, x, w, ids, cfg, c, out, sms)[0]
    graphs.update({name: _graph(fn) for name, fn in variants.items()})
    rec = {
        "model": model,
        "ep": ep,
        "tokens": tokens,
        "n_tile": kcfg.n_tile,
        "prefetch": kcfg.prefetch,
        "stages": kcfg.stages,
        "splits": list(kcfg.splits),
        "occupancy": kcfg.occupancy,
        "warpgroups": kcfg.warpgroups,
        "active_first": kcfg.active_first,
        "active_experts": int(torch.unique(ids).numel()),
        "max_rows_per_expert": int(layout.counts.max()),
    }
    if peers:
        lay16 = group_rows(ids, cfg.num_experts, 16)
        x16 = x[(lay16.src_slot.long().clamp(min=0) // cfg.top_k)]
        rw16 = torch.where(lay16.src_slot >= 0, w.reshape(-1)[lay16.src_slot.long().clamp(min=0)], 0.0)
        offs_end = lay16.offsets[1:].contiguous()
        for name, fp8 in (("torch_fp8", True), ("torch_bf16", False)):
            try:
                peer = TorchPeer(cfg, fp8)
                fn = lambda p=peer: p(x16, offs_end, rw16)
                fn()
                torch.cuda.synchronize()
                # eager: replaying torch's grouped GEMMs from a CUDA graph hit an illegal address on torch 2.11
                # (2026-11-29, H200), while the same calls run eagerly (gcmoe-lab probe peer_probe)
                graphs[name] = fn
            except Exception as ex:  # a peer this torch build cannot run is reported, not hidden
                rec[f"{name}_error"] = f"{type(ex).__name__}: {str(ex).splitlines()[0][:200]}"
    times = time_interleaved(graphs, iters, l2_flush=l2_flush)
    floor = fp4_floor_us(cfg.hidden_size, cfg.intermediate_size, rec["active_experts"], bw)
    rec.update(
        {f"{k}_us": v for k, v in times.items()},
        floor_us=floor,
        x_floor=times["ours_kernels"] / floor,
        floor_plus_us=times["ours_kernels"] - floor,
    )
    for k in ("torch_fp8", "torch_bf16"):
        if k in times:
            rec[f"speedup_vs_{k}"] = times[k] / times["ours_kernels"]
    if fp8_rate:
        cnt = layout.counts.long()
        flop_per_row = 2 * 3 * h * i
        padded = int(((cnt + kcfg.n_tile - 1) // kcfg.n_tile * kcfg.n_tile).sum())
        rec.update(
            tensor_floor_us=int(cnt.sum()) * flop_per_row / fp8_rate * 1e6,
            tensor_floor_padded_us=padded * flop_per_row / fp8_rate * 1e6,
        )
        rec["tensor_x_floor"] = rec["tensor_floor_us"] / floor
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="gcmoe-lab probe bench_sm90", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 8, 32, 128, 256])
    ap.add_argument("--ep", type=int, default=8)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--split-sweep", type=int, default=8, help="time other K splits up to this token count")
    ap.add_argument(
        "--variants", nargs="*", default=list(DEFAULT_VARIANTS), choices=VARIANTS, help="variant_config names to time"
    )
    ap.add_argument(
        "--l2-flush",
        default="read",
        choices=L2_FLUSHES,
        help="how L2 is made cold (gcmoe_lab.timing.ColdL2): read (default since v7) leaves clean lines; write (up to "
        "v6) leaves ~L2 of dirty lines whose write-back shares HBM with the timed run (6-10 µs more per replay on the "
        "H200)",
    )
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bw = copy_bandwidth(torch.device("cuda"))
    rate = fp8_gemm_rate()
    recs = []
    for model in args.models:
        for t in args.tokens:
            r = bench_point(
                model,
                t,
                args.ep,
                bw,
                args.iters,
                not args.no_peers,
                t <= args.split_sweep,
                args.variants,
                rate,
                args.l2_flush,
            )
            torch.cuda.empty_cache()  # the point's weights and graphs are gone with its frame
            recs.append(r)
            print(json.dumps(r), flush=True)
    meta = run_meta(
        copy_tb_s=bw / 1e12,
        fp8_gemm_tflops=rate / 1e12,
        l2_flush=args.l2_flush,
        method=f"CUDA-graph replay, cold L2 (4x L2 {'overwritten' if args.l2_flush == 'write' else 'read'} before each "
        "replay), median, variants interleaved",
    )
    (out / "sm90_grouped.json").write_text(json.dumps({"meta": meta, "records": recs}, indent=2))
    head = (
        "| model | T | N tile | warpgroups | active | floor µs | W1+W2 µs | × floor | W1 µs | layer µs | torch FP8 µs |"
        " torch BF16 µs | vs FP8 | vs BF16 | tensor µs (× floor) | variants: W1+W2 µs (× floor) |"
    )
    rows = [head, "|" + " --- |" * 16]
    for r in recs:
        f = lambda k, r=r: f"{r[k]:.1f}" if k in r else "–"
        s = lambda k, r=r: f"{r[k]:.2f}×" if k in r else "–"
        others = ", ".join(
            f"{k[len('ours_kernels_') : -3]} {v:.1f} ({v / r['floor_us']:.2f})"
            for k, v in r.items()
            if k.startswith("ours_kernels_") and k.endswith("_us") and not k.startswith("ours_kernels_split")
        )
        rows.append(
            f"| {r['model']} | {r['tokens']} | {r['n_tile']} | {r['warpgroups']} | {r['active_experts']} | "
            f"{r['floor_us']:.1f} | **{r['ours_kernels_us']:.1f}** | **{r['x_floor']:.2f}** | {f('ours_w1_us')} | "
            f"{f('ours_layer_us')} | {f('torch_fp8_us')} | {f('torch_bf16_us')} | {s('speedup_vs_torch_fp8')} | "
            f"{s('speedup_vs_torch_bf16')} | {f('tensor_floor_us')} ({r.get('tensor_x_floor', 0):.2f}) | "
            f"{others or '–'} |"
        )
    sweep = [
        f"| {r['model']} | {r['tokens']} | {r['splits'][0]}/{r['splits'][1]} | {r['ours_kernels_us']:.1f} | "
        + " | ".join(
            f"{k[len('ours_kernels_split') : -3]}: {v:.1f}" for k, v in r.items() if k.startswith("ours_kernels_split")
        )
        + " |"
        for r in recs
        if any(k.startswith("ours_kernels_split") for k in r)
    ]
    if sweep:
        rows += ["", "K splits (W1 W2): µs of the chosen and of the others", "", "| model | T | chosen | µs | others |"]
        rows += ["| --- | --- | --- | --- | --- |", *sweep]
    md = (
        f"# sm90 grouped FP8×MXFP4 GEMMs — {meta['device']}, {meta['date']}\n\n"
        f"torch {meta['torch']}, cutlass-dsl {meta['cutlass_dsl']}, copy bandwidth {meta['copy_tb_s']:.2f} TB/s; "
        f"{meta['method']}. EP={args.ep} rank slices, uniform routing.\n\n" + "\n".join(rows) + "\n"
    )
    (out / "sm90_grouped.md").write_text(md)
    print(md)
    return 0
