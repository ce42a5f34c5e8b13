"""Dispatch bandwidth on a green-context comm partition, side by side with a copy of the same bytes there.

    gcmoe-lab probe bench_comm --out DIR [--sms 16 24] [--tokens 1 8 32 128 256]

One rank (P = 1: its dispatch pulls from its own published buffer, i.e. HBM to HBM on this one GPU) of a
DeepSeek-V3 EP8 slice: 32 local experts, k = 8, H = 7168, uniform routing, so T tokens move T * k rows: the same rows
a rank of P = 8 receives on average. Per partition size and token count, graph-replayed medians with a cold L2:
    dispatch      READY + dispatch kernels (routing scan, pulls, padding, L1_FULL tags); tokens published once
    publish       the publish kernel: FP8 quantisation of the tokens + routing copy into the workspace + READY
    copy_same     torch copy of the same payload bytes (T * k rows of x + scales), on the same partition
    copy_bw       large-copy bandwidth of the partition (1 GiB, eager; bytes read + written)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from gcmoe_comm.comm import CommRank
from gcmoe_comm.ring import RingSpec
from gcmoe_comm.workspace import Workspace
from gcmoe_core.testing import capture_graph, make_routing
from gcmoe_greenctx.partition import split_device

from .timing import copy_bandwidth, run_meta, time_interleaved


def run(sms_list: list[int], tokens: list[int], iters: int = 50) -> dict:
    h, el, k, bm = 7168, 32, 8, 16
    spec = RingSpec(1, el, h, k, max(tokens), bm)
    ws = Workspace.virtual(spec, "cuda")[0]
    g = torch.Generator().manual_seed(0)
    rows = []
    res = {"spec": spec.__dict__, "points": rows}
    for sms in sms_list:
        part = split_device(sms)
        rank = CommRank(ws, dispatch_ctas=2 * part.comm_sms, timeout_ms=5000)  # dispatch grid: 2 CTAs per SM
        with torch.cuda.stream(part.comm_stream):  # an eager copy runs as a kernel on the partition's SMs
            bw = copy_bandwidth(torch.device("cuda"))
        for t in tokens:
            x = torch.randn(t, h, generator=g).to(torch.bfloat16).cuda()
            ids, w = make_routing(t, k, el, "uniform", g)
            ids, w = ids.cuda(), w.cuda()

            rank.publish(x, ids, w)  # the published buffers hold this call's tokens from here on

            def dispatch(t=t, rank=rank):  # READY (generation + 1) + dispatch: the ring refilled every replay
                rank.ready(t)
                rank.dispatch()

            gd = capture_graph(dispatch, stream=part.comm_stream)[0]
            payload = t * k * (h + h // 128 * 4)
            src = torch.empty(payload, dtype=torch.uint8, device="cuda")
            dst = torch.empty_like(src)
            gc = capture_graph(lambda src=src, dst=dst: dst.copy_(src), stream=part.comm_stream)[0]
            gp = capture_graph(lambda x=x, ids=ids, w=w, rank=rank: rank.publish(x, ids, w), stream=part.comm_stream)[0]
            us = time_interleaved({"dispatch": gd, "copy": gc, "publish": gp}, iters)  # side by side
            d_us, c_us = us["dispatch"], us["copy"]
            ws.check()
            rows.append(
                {
                    "comm_sms": part.comm_sms,
                    "tokens": t,
                    "rows": t * k,
                    "payload_bytes": payload,
                    "dispatch_us": d_us,
                    "copy_same_bytes_us": c_us,
                    "dispatch_gb_s": 2 * payload / (d_us * 1e-6) / 1e9,
                    "partition_copy_tb_s": bw / 1e12,
                    "dispatch_vs_copy": d_us / c_us,
                    "publish_us": us["publish"],
                }
            )
            print(json.dumps(rows[-1]), flush=True)
        part.close()
    return res


def markdown(res: dict) -> str:
    lines = [
        f"# Dispatch on a green-context comm partition — {res['device']}, {res['date']}",
        "",
        f"torch {res['torch']}, CuTe DSL {res['cutlass_dsl']}. One rank, DeepSeek-V3 EP8 slice (32 local experts, "
        "k = 8, H = 7168), uniform routing; T tokens move T * k rows. Graph replay on the comm partition's stream, "
        "median of 50 (variants interleaved), cold L2. `dispatch` = the READY kernel + the dispatch kernel "
        "(routing scan, pulls, padding, "
        "L1_FULL tags); `publish` = the publish kernel (FP8 quantisation of the tokens, routing copy, READY). "
        "Reproduce: `gcmoe-lab probe bench_comm --out DIR`.",
        "",
        "| comm SMs | T | rows | payload MB | dispatch µs | publish µs | copy of same bytes µs | "
        "dispatch / copy | dispatch GB/s (r+w) | partition copy TB/s |",
        "|" + " --- |" * 10,
    ]
    for r in res["points"]:
        lines.append(
            f"| {r['comm_sms']} | {r['tokens']} | {r['rows']} | {r['payload_bytes'] / 1e6:.2f} | "
            f"{r['dispatch_us']:.1f} | {r['publish_us']:.1f} | {r['copy_same_bytes_us']:.1f} | "
            f"{r['dispatch_vs_copy']:.2f}× | "
            f"{r['dispatch_gb_s']:.0f} | {r['partition_copy_tb_s']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="gcmoe-lab probe bench_comm", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--sms", nargs="*", type=int, default=[16, 24])
    ap.add_argument("--tokens", nargs="*", type=int, default=[1, 8, 32, 128, 256])
    args = ap.parse_args(argv)
    res = run(args.sms, args.tokens)
    res.update(run_meta())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    day = res["date"][:10]
    (out / f"comm-dispatch-h200-{day}.json").write_text(json.dumps(res, indent=2))
    (out / f"comm-dispatch-h200-{day}.md").write_text(markdown(res))
    print(markdown(res))
    return 0
