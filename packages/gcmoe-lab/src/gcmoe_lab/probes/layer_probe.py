"""Where a layer call's time goes (run on the GPU): per-kernel timelines of cold-L2 replays from the profiler (start
and end of every kernel relative to the first, per stream), partitioned vs sequential, the eager path's host time
per call next to its GPU time, and the replay overhead of the layer's graph: a cold-L2 replay timed by CUDA events on
its stream minus the span of its kernels (first start to last end, profiler; medians). `main_span_us`: the call's
first comm kernel's start to the last kernel's end (what a side branch beside the comm kernels may delay).

--flush write: cold L2 by overwriting it (dirty lines, as `gcmoe-lab bench`) instead of reading it (the default).

    gcmoe-lab probe layer_probe [--models deepseek-v3] [--tokens 1 8 32] [--comm 0 16] [--flush read] [--out DIR]

Everything goes through the public layer (gcmoe.MoELayer) captured in a caller's graph; the layer's own internals
are not touched. (Up to the lab's first version it also switched the shared experts' L2 prefetch off through the
plan and timed the bucket graph's host replay through the lane: both were internals, since removed.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from ..timing import L2_FLUSHES, ColdL2, kernel_runs, time_once


def short(name: str) -> str:
    """A kernel's role; the grouped GEMMs are "gemm" here (W1 / W2 by launch order: timeline)."""
    low = name.lower()
    for key, role in (
        ("publish", "publish"),
        ("dispatch", "dispatch"),
        ("finalize", "finalize"),
        ("prefetchl2", "prefetch_l2"),
        ("groupedgemm", "gemm"),
        ("amax", "amax"),
        ("fill", "fill"),
    ):
        if key in low:
            return role
    return name[:30]


def name_gemms(run: list[tuple[float, float, str]]) -> list[tuple[float, float, str]]:
    """One run's kernels with its two grouped GEMMs named w1 / w2 in launch order (else left as gemm)."""
    gemms = [i for i, (_, _, n) in enumerate(run) if n == "gemm"]
    out = list(run)
    for j, i in enumerate(gemms):
        out[i] = (run[i][0], run[i][1], f"w{j + 1}" if len(gemms) == 2 else "gemm")
    return out


def timeline(run, flush: ColdL2, reps=3):
    """Kernels of `reps` cold-L2 runs: ((name, start, end) µs from the first kernel of the last run, the median span
    of a run (its first kernel's start to its last one's end), the median main-branch span (the first comm kernel's
    start to the run's last end))."""
    runs = [name_gemms([(a, b, short(n)) for a, b, n in r]) for r in kernel_runs(run, flush, reps, skip=("amax",))]
    last = runs[-1]
    t0 = last[0][0]
    spans = [max(b for _, b, _ in r) - r[0][0] for r in runs]
    # the main branch starts with the call's first comm kernel: publish, or at world size 1 with small calls the one
    # kernel doing publish + dispatch (its name says dispatch)
    mains = [max(b for _, b, _ in r) - min(a for a, _, n in r if n in ("publish", "dispatch")) for r in runs]
    tl = [(n, round(a - t0, 1), round(b - t0, 1)) for a, b, n in last]
    return tl, round(statistics.median(spans), 1), round(statistics.median(mains), 1)


def busy(tl) -> float:
    """µs during which at least one of the run's kernels ran (the union of their intervals)."""
    total, end = 0.0, None
    for _, a, b in sorted(tl, key=lambda k: k[1]):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return round(total, 1)


def main(argv=None) -> int:
    import gcmoe
    from gcmoe_core.config import MoEConfig
    from gcmoe_core.testing import make_tokens, make_weights

    ap = argparse.ArgumentParser(prog="gcmoe-lab probe layer_probe", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["deepseek-v3"])
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 8, 32])
    ap.add_argument("--comm", nargs="+", type=int, default=[0, 16])
    ap.add_argument("--flush", choices=L2_FLUSHES, default="read")
    ap.add_argument("--out", default=".")
    args = ap.parse_args(argv)
    flush = ColdL2(torch.device("cuda"), args.flush)

    def event_us(run, reps=20) -> float:
        """Median µs of cold-L2 runs timed by CUDA events on the current stream (what a caller sees of a replay)."""
        return round(statistics.median(time_once(run, flush) for _ in range(reps)), 1)

    records = []
    for model in args.models:
        cfg = MoEConfig.ep_slice(model, 8, max_tokens_per_rank=256)
        weights = make_weights(cfg, 1, "cuda")
        for c in args.comm:
            layer = gcmoe.MoELayer(cfg, "cuda", "sm90", comm_sms=c).load(weights)
            for t in args.tokens:
                x, ids, w = make_tokens(cfg, t, "uniform", t, device="cuda")
                layer(x, ids, w)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, stream=torch.cuda.Stream()):
                    layer(x, ids, w)
                g.replay()
                torch.cuda.synchronize()
                tl_graph, span_graph, main_span = timeline(g.replay, flush, reps=10)
                tl_eager, span_eager, _ = timeline(lambda layer=layer, x=x, ids=ids, w=w: layer(x, ids, w), flush)
                host = []
                for _ in range(40):
                    t0 = time.perf_counter()
                    layer(x, ids, w)
                    host.append((time.perf_counter() - t0) * 1e6)
                    torch.cuda.synchronize()
                replay_us = event_us(g.replay)
                rec = {
                    "model": model,
                    "tokens": t,
                    "comm_sms": c,
                    "flush": args.flush,
                    "graph_replay_event_us": replay_us,
                    "graph_span_us": span_graph,
                    "main_span_us": main_span,
                    "graph_replay_overhead_us": round(replay_us - span_graph, 1),
                    "graph_busy_us": busy(tl_graph),
                    "graph_gaps_us": round(span_graph - busy(tl_graph), 1),
                    "eager_span_us": span_eager,
                    "eager_busy_us": busy(tl_eager),
                    "host_call_us_median": statistics.median(host),
                    "graph_timeline": tl_graph,
                    "eager_timeline": tl_eager,
                }
                records.append(rec)
                print(json.dumps({k: v for k, v in rec.items() if "timeline" not in k}), flush=True)
                print("  graph:", tl_graph, flush=True)
                print("  eager:", tl_eager, flush=True)
            del layer
            torch.cuda.empty_cache()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "layer-probe.json").write_text(json.dumps(records, indent=1))
    return 0
