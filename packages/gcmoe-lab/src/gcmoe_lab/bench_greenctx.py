"""Green-context partition measurements (run on a GPU): isolation, disjointness, graph replay, comm-size sweep.

    gcmoe-lab probe bench_greenctx --out DIR        -> DIR/greenctx.json and DIR/greenctx.md

- isolation: a bandwidth-bound copy on the comm partition and a bf16 GEMM on the compute partition, each alone and
  both at once (each stream timed with its own events while the other runs); interference both ways; the same pair
  on two ordinary streams (unpartitioned) for comparison.
- disjointness: %smid of CTAs launched on each partition concurrently.
- graph: a layer of three role nodes (dispatch on the comm partition; compute, finalize on the compute partition,
  after dispatch; forked from and joined back to the caller's stream) captured once, replayed 10^4 times with
  changing inputs (checked against eager every 500th replay), µs per layer replayed vs enqueued eagerly.
- sweep: the copy/GEMM pair for comm partitions of 8, 16, 24, 32, 48 SMs.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from gcmoe_greenctx.partition import Partition, device_facts, split_device

from .timing import run_meta

COPY_BYTES = 1 << 30  # 1 GiB copied per copy op (read + write = 2 GiB of traffic)
GEMM_N = 8192


def _elapsed_ms(start: torch.cuda.Event, end: torch.cuda.Event) -> float:
    end.synchronize()
    return start.elapsed_time(end)


def _run_on(stream: torch.cuda.Stream, fn, reps: int) -> tuple[torch.cuda.Event, torch.cuda.Event]:
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        a.record()
        for _ in range(reps):
            fn()
        b.record()
    return a, b


def isolation(part: Partition, copy_reps: int = 20, gemm_reps: int = 20) -> dict:
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    a = torch.randn(GEMM_N, GEMM_N, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(GEMM_N, GEMM_N, device="cuda", dtype=torch.bfloat16)
    c = torch.empty_like(a)
    copy = lambda: dst.copy_(src)
    gemm = lambda: torch.matmul(a, b, out=c)
    for s, f in ((part.comm_stream, copy), (part.compute_stream, gemm)):  # warm up (cuBLAS handles per stream)
        _run_on(s, f, 2)
    torch.cuda.synchronize()
    copy_alone = _elapsed_ms(*_run_on(part.comm_stream, copy, copy_reps)) / copy_reps
    gemm_alone = _elapsed_ms(*_run_on(part.compute_stream, gemm, gemm_reps)) / gemm_reps
    torch.cuda.synchronize()
    # together: size both loops to last about as long as each other, so each is measured while the other runs
    both_copy_reps = max(copy_reps, round(gemm_reps * gemm_alone / copy_alone))
    ev_copy = _run_on(part.comm_stream, copy, both_copy_reps)
    ev_gemm = _run_on(part.compute_stream, gemm, gemm_reps)
    copy_both = _elapsed_ms(*ev_copy) / both_copy_reps
    gemm_both = _elapsed_ms(*ev_gemm) / gemm_reps
    tb = lambda ms: 2 * COPY_BYTES / (ms * 1e-3) / 1e12
    tf = lambda ms: 2 * GEMM_N**3 / (ms * 1e-3) / 1e12
    return {
        "mode": part.mode,
        "comm_sms": part.comm_sms,
        "compute_sms": part.compute_sms,
        "copy_tb_s_alone": tb(copy_alone),
        "copy_tb_s_together": tb(copy_both),
        "gemm_tflops_alone": tf(gemm_alone),
        "gemm_tflops_together": tf(gemm_both),
        "copy_slowdown": copy_both / copy_alone,
        "gemm_slowdown": gemm_both / gemm_alone,
    }


def disjointness(part: Partition) -> dict:
    from gcmoe_lab.kernel_smid import record_smids

    sms = torch.cuda.get_device_properties(part.device).multi_processor_count
    a = torch.full((4 * sms,), -1, dtype=torch.int32, device="cuda")
    b = torch.full((4 * sms,), -1, dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    record_smids(a, 200_000, part.comm_stream)
    record_smids(b, 200_000, part.compute_stream)
    torch.cuda.synchronize()
    sa, sb = sorted(set(a.tolist())), sorted(set(b.tolist()))
    return {
        "comm_smids": sa,
        "compute_smids": sb,
        "intersection": sorted(set(sa) & set(sb)),
        "comm_count": len(sa),
        "compute_count": len(sb),
        "expected": [part.comm_sms, part.compute_sms],
    }


def enqueue_roles(part: Partition, dispatch, compute, finalize) -> None:
    """One layer's three role nodes on the partitions, forked from and joined back to the current stream (eagerly,
    or inside a capture: then the nodes keep their partitions' SMs); compute waits for dispatch."""
    origin = torch.cuda.current_stream()
    part.comm_stream.wait_stream(origin)
    part.compute_stream.wait_stream(origin)
    with torch.cuda.stream(part.comm_stream):
        dispatch()
    part.compute_stream.wait_stream(part.comm_stream)
    with torch.cuda.stream(part.compute_stream):
        compute()
        finalize()
    origin.wait_stream(part.compute_stream)


def graph_replay(part: Partition, replays: int = 10_000) -> dict:
    n = 1 << 14
    src = torch.randn(n, device="cuda")
    mid, dst = torch.empty_like(src), torch.empty_like(src)
    scale = torch.ones((), device="cuda")
    roles = (lambda: mid.copy_(src), lambda: torch.mul(mid, scale, out=dst), lambda: dst.add_(1.0))
    g = torch.cuda.CUDAGraph()
    capture = torch.cuda.Stream()
    with torch.cuda.graph(g, stream=capture):
        enqueue_roles(part, *roles)
    mismatches = 0
    for i in range(replays):
        if i % 500 == 0:
            src.normal_()
            scale.fill_(float(i % 13))
        g.replay()
        if i % 500 == 499:
            torch.cuda.synchronize()
            mismatches += int(not torch.equal(dst, src * float((i - 499) % 13) + 1.0))
    torch.cuda.synchronize()

    def per_layer_us(fn, reps=2000):
        fn()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        return _elapsed_ms(a, b) * 1e3 / reps

    replay_us = statistics.median(per_layer_us(g.replay) for _ in range(5))
    eager_us = statistics.median(per_layer_us(lambda: enqueue_roles(part, *roles)) for _ in range(5))
    return {
        "replays": replays,
        "checked": replays // 500,
        "mismatches": mismatches,
        "replay_us_per_layer": replay_us,
        "eager_us_per_layer": eager_us,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="gcmoe-lab probe bench_greenctx", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--sweep", nargs="*", type=int, default=[8, 16, 24, 32, 48])
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    facts = device_facts(0)
    res: dict = run_meta(facts=facts.as_dict())
    part = split_device(16)
    res["isolation_green16"] = isolation(part)
    res["disjointness_green16"] = disjointness(part)
    res["graph_green16"] = graph_replay(part)
    part.close()
    res["isolation_unpartitioned"] = isolation(split_device(16, mode="unpartitioned"))
    res["sweep"] = []
    for sms in args.sweep:
        p = split_device(sms)
        res["sweep"].append(isolation(p))
        p.close()
    (out / "greenctx.json").write_text(json.dumps(res, indent=2))
    rows = [
        "| partition | comm SMs | compute SMs | copy TB/s alone | copy TB/s together | GEMM TFLOP/s alone | "
        "GEMM TFLOP/s together | copy slowdown | GEMM slowdown |",
        "|" + " --- |" * 9,
    ]
    for r in [res["isolation_unpartitioned"], *res["sweep"]]:
        rows.append(
            f"| {r['mode']} | {r['comm_sms']} | {r['compute_sms']} | {r['copy_tb_s_alone']:.2f} | "
            f"{r['copy_tb_s_together']:.2f} | {r['gemm_tflops_alone']:.0f} | {r['gemm_tflops_together']:.0f} |"
            f" {r['copy_slowdown']:.2f}× | {r['gemm_slowdown']:.2f}× |"
        )
    d, gr = res["disjointness_green16"], res["graph_green16"]
    md = (
        f"# Green-context partitions — {res['device']}, {res['date']}\n\n"
        f"torch {res['torch']}, driver CUDA {facts.driver_version}, split granularity {facts.granularity} SMs, "
        f"workqueue isolation: {'yes' if facts.workqueue_config else 'no (driver < 13.1)'}\n\n"
        + "\n".join(rows)
        + "\n\n"
        f"Disjointness (16-SM split): comm CTAs ran on {d['comm_count']} SMs, compute CTAs on {d['compute_count']} "
        f"SMs, intersection {d['intersection']}.\n\n"
        f"Graph: {gr['replays']} replays, {gr['checked']} checked against eager, {gr['mismatches']} mismatches; "
        f"{gr['replay_us_per_layer']:.1f} µs per layer replayed vs {gr['eager_us_per_layer']:.1f} µs enqueued "
        f"eagerly.\n"
    )
    (out / "greenctx.md").write_text(md)
    print(md)
    return 0
