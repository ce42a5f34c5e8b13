"""What is left of #15's targets: stage ablations and kernel timelines of today's sm90 kernels (run on the GPU, on a
tree with ablate.patch applied: Sm90Config.ablate, never for results).

Per point (an EP8 slice's routed experts on prepared rows, as `python -m gcmoe_gemm_sm90.bench`; CUDA-graph replays,
interleaved, cold L2 by a read pass, median of --iters), on the whole GPU ("full") and on the 116-SM compute partition
of a 16-SM green split ("p116", the configuration choose_config gives for 116 SMs):
    chosen     W1 + W2 as the benchmark runs them
    stream     the same launches with no decode, WGMMA or promotion (the TMA / bulk-copy pipeline, waits, epilogues)
    compute    no weight bytes copied (decode + WGMMA + promotion on whatever the stages hold)
    w1         W1 alone (chosen)
    copy1      one elementwise kernel moving the point's FP4 weight + scale bytes (read half, write half: the traffic
               the floor's copy bandwidth counts), graph-replayed and timed like the kernels
    copy2      the same bytes as two dependent kernels (W1's share, then W2's)
    empty      a graph of one tiny kernel: what event timing of one replay costs with no work
Timelines (full GPU, chosen and stream): one cold replay's kernels from the profiler, µs from the first start, and the
event-timed replay minus the kernels' span.

    python docs/gpu-runs/2026-12-03-c/stages.py --out DIR [--models ...] [--tokens ...] [--iters 20] [--compile-only]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

MODELS = ("deepseek-v3", "deepseek-v4-flash", "glm-4.5", "glm-5")
ABLATIONS = ("", "stream", "compute")


SWEEP = "ablate"  # (main: --sweep)


def configs(model: str, t: int):
    """{(placement, variant): Sm90Config} of a point and the slice's (hidden, inter). --sweep ablate: chosen and the
    two ablations; --sweep stream_k: chosen, W1 stream_k with the chosen stages (sk) and with with_splits' stages
    (sk4: at most STREAM_K_STAGES, W2 too); the whole GPU's configuration on 116 SMs where it differs (c132).
    (Run c's `rows` variant — the operator's grid rows, before bench.kernels_for launched them itself — is gone with
    that fix: every variant now launches them.)"""
    from gcmoe_core.config import MoEConfig
    from gcmoe_gemm_sm90.config import can_implement, with_splits
    from gcmoe_gemm_sm90.ops import layer_config

    cfg = MoEConfig.ep_slice(model, 8, max_tokens_per_rank=256, num_shared_experts=0)
    h, i = cfg.hidden_size, cfg.intermediate_size
    out = {}
    for place, sms in (("full", 132), ("p116", 116)):
        k = layer_config(t, cfg.top_k, cfg.num_experts, h, i, 0, sms=sms)
        if SWEEP == "ablate":
            for ab in ABLATIONS:
                out[(place, ab or "chosen")] = dataclasses.replace(k, ablate=ab)
            continue
        out[(place, "chosen")] = k
        k132 = layer_config(t, cfg.top_k, cfg.num_experts, h, i, 0)
        if k132 != k:  # the whole GPU's configuration on the partition
            out[(place, "c132")] = k132
        if k.stream_k or k.splits[0] != 1:
            continue
        sk = dataclasses.replace(k, stream_k=True, w1_half=False)
        if can_implement(2 * i, h, cfg.num_experts, sk) is None:  # (the stream_k table may not fit the stages)
            out[(place, "sk")] = sk
        out[(place, "sk4")] = with_splits(sk, k.splits, h, i)
    return out, h, i


def compile_job(job) -> str:
    mode, m, k, c = job
    try:
        from gcmoe_gemm_sm90.kernel_grouped import compiled

        compiled(mode, m, k, c)
        return ""
    except Exception as e:
        return f"FAILED {mode} {m} {k} {c}: {e!r}"[:500]


def precompile(models, tokens, workers: int) -> None:
    jobs = []
    for model in models:
        for t in tokens:
            cs, h, i = configs(model, t)
            for c in cs.values():
                jobs += [("w1", 2 * i, h, c), ("w2", h, i, c)]
    jobs = list(dict.fromkeys(jobs))
    t0 = time.time()
    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
        failed = [r for r in ex.map(compile_job, jobs) if r]
    print(*failed, sep="\n")
    print(f"precompile: {len(jobs)} jobs, {len(failed)} failed, {time.time() - t0:.0f} s", flush=True)


def timeline(run, flush, reps: int = 3):
    """[(kernel, start, end)] µs from the first kernel of the last of `reps` cold runs, and the median span."""
    from gcmoe_core.timing import kernel_runs

    runs = kernel_runs(run, flush, reps)
    for r in runs:  # the grouped GEMMs by launch order: w1, w2
        r[:] = [(a, b, f"w{i + 1}" if "rouped" in n else n[:24]) for i, (a, b, n) in enumerate(r)]
    t0 = runs[-1][0][0]
    spans = [max(b for _, b, _ in r) - r[0][0] for r in runs]
    return [(n, round(a - t0, 1), round(b - t0, 1)) for a, b, n in runs[-1]], round(statistics.median(spans), 1)


def with_scratch(run, c, sms: int, scratch):
    """bench.kernels_for's run, whose W1 gets a StreamKScratch and one CTA per SM slot where c is stream_k (the
    benchmark's chosen configurations never are; the 116-SM one of DeepSeek-V3 / GLM-5 at T = 1 is)."""
    if not c.stream_k:
        return run
    from functools import partial

    import gcmoe_gemm_sm90.bench as bench

    def go(w1_only=False):
        orig = bench.launch_w1
        bench.launch_w1 = partial(orig, scratch=scratch, sk_ctas=c.occupancy * sms)
        try:
            run(w1_only)
        finally:
            bench.launch_w1 = orig

    return go


def measure(args) -> None:
    import torch

    from gcmoe_core.config import MoEConfig
    from gcmoe_core.testing import make_tokens, make_weights
    from gcmoe_core.timing import (
        ColdL2,
        capture_graph,
        copy_bandwidth,
        fp4_layer_bytes,
        run_meta,
        time_interleaved,
        time_once,
    )
    from gcmoe_gemm_sm90.bench import kernels_for
    from gcmoe_gemm_sm90.ops import MoESm90, StreamKScratch
    from gcmoe_greenctx import split_device

    dev = torch.device("cuda")
    part = split_device(16, mode="green")
    streams = {"full": torch.cuda.Stream(), "p116": part.compute_stream}
    bw = copy_bandwidth(dev)
    meta = run_meta(copy_bw=bw, partition=part.describe(), l2_flush=args.flush, iters=args.iters)
    print(json.dumps(meta), flush=True)
    flush = ColdL2(dev, args.flush)
    out_dir = Path(args.out)
    recs = []
    tiny = torch.zeros(1024, device=dev)
    scratch = StreamKScratch.make(dev, n_tile_max=80)
    for model in args.models:
        mcfg = MoEConfig.ep_slice(model, 8, max_tokens_per_rank=256, num_shared_experts=0)
        weights = make_weights(mcfg, seed=1, device="cuda")
        moe = MoESm90.from_weights(weights)
        for t in args.tokens:
            t_start = time.time()
            x, ids, w = make_tokens(mcfg, t, seed=t, device="cuda")
            cs, h, i = configs(model, t)
            out = torch.empty(ids.numel(), h, dtype=torch.bfloat16, device="cuda")
            active = int(torch.unique(ids).numel())
            nbytes = fp4_layer_bytes(h, i, active)
            src = torch.empty(nbytes // 8, dtype=torch.int32, device=dev).random_()  # (int32: 16-byte vectors)
            dst = torch.empty_like(src)
            s1 = src.numel() * 2 // 3 // 4 * 4  # W1's share of the traffic (2 I x H of 3 I x H)

            def copy2(src=src, dst=dst, s1=s1):
                torch.bitwise_not(src[:s1], out=dst[:s1])
                torch.bitwise_not(src[s1:], out=dst[s1:])

            keep, graphs = [], {}
            for (place, var), c in cs.items():
                run, _ = kernels_for(moe, x, w, ids, mcfg, c, out)
                run = with_scratch(run, c, 132 if place == "full" else part.compute_sms, scratch)
                keep.append(run)
                graphs[f"{place}_{var}"] = capture_graph(run, stream=streams[place])[0]
                if var == "chosen":
                    graphs[f"{place}_w1"] = capture_graph(lambda r=run: r(w1_only=True), stream=streams[place])[0]
                    graphs[f"{place}_copy1"] = capture_graph(
                        lambda src=src, dst=dst: torch.bitwise_not(src, out=dst), stream=streams[place]
                    )[0]
                    graphs[f"{place}_copy2"] = capture_graph(copy2, stream=streams[place])[0]
            graphs["empty"] = capture_graph(lambda: tiny.add_(1), stream=streams["full"])[0]
            times = time_interleaved(graphs, args.iters, l2_flush=args.flush)
            rec = {
                "model": model,
                "tokens": t,
                "active_experts": active,
                "floor_us": nbytes / bw * 1e6,
                "configs": {f"{p}_{v}": repr(c) for (p, v), c in cs.items() if v == "chosen"},
                "us": {k: round(v, 2) for k, v in times.items()},
            }
            rec["timelines"] = {}
            for name in ("full_chosen", "full_stream") if SWEEP == "ablate" else ():
                g = graphs[name]
                tl, span = timeline(g.replay, flush)
                ev = statistics.median(time_once(g.replay, flush) for _ in range(10))
                rec["timelines"][name] = {"kernels": tl, "span_us": span, "event_us": round(ev, 1)}
            recs.append(rec)
            u, f = rec["us"], rec["floor_us"]
            print(
                f"{model} T={t} active={active} floor={f:.1f} "
                + " ".join(f"{k}={v:.1f}" for k, v in u.items())
                + f" tl={rec['timelines'].get('full_chosen')} ({time.time() - t_start:.0f} s)",
                flush=True,
            )
            (out_dir / f"{SWEEP}.json").write_text(json.dumps({"meta": meta, "points": recs}, indent=1))
            del graphs, keep
            torch.cuda.empty_cache()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 8, 32, 128, 256])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--flush", default="read")
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--sweep", choices=("ablate", "stream_k"), default="ablate")
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--no-compile", action="store_true")
    args = ap.parse_args(argv)
    global SWEEP
    SWEEP = args.sweep
    if not args.no_compile:
        precompile(args.models, args.tokens, args.workers)
    if not args.compile_only:
        measure(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
