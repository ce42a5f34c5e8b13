"""Where an eager layer call's host time goes (GPU): the public call and its steps, each timed as host µs per call
with the device kept busy (a sleep kernel queued first, so no call waits for the device), median and min of
several batches, the steps interleaved. GCMOE_CHECK_VALUES=0 for the batches (with checks on, a call waits for the
previous call's publish).

    gcmoe-lab probe host_time [--model deepseek-v3] [--tokens 1] [--calls 40] [--batches 15] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch


def _per_call_us(steps: dict, calls: int, batches: int) -> dict:
    """Host µs per call of each step: batches of `calls` calls behind a sleep kernel, the steps interleaved batch by
    batch (a host whose clock drifts shifts them all alike); median and min over the batches."""
    out: dict = {name: [] for name in steps}
    for _ in range(batches):
        for name, fn in steps.items():
            fn()
            torch.cuda.synchronize()
            torch.cuda._sleep(int(50e-3 * 2.0e9))  # 50 ms of device work ahead of the calls
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            out[name].append((time.perf_counter() - t0) / calls * 1e6)
            torch.cuda.synchronize()
    return {name: {"median": statistics.median(v), "min": min(v)} for name, v in out.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gcmoe-lab probe host_time", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="deepseek-v3")
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--calls", type=int, default=40, help="calls per batch (< the lane's 64 argument slots)")
    ap.add_argument("--batches", type=int, default=15)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    import gcmoe
    from gcmoe_core import env
    from gcmoe_core.config import MoEConfig, validate_call
    from gcmoe_core.testing import make_tokens, make_weights

    os.environ["GCMOE_CHECK_VALUES"] = "0"
    cfg = MoEConfig.ep_slice(a.model, 8, max_tokens_per_rank=256)
    layer = gcmoe.MoELayer(cfg, "cuda").load(make_weights(cfg, 0, "cuda"))
    x, ids, w = make_tokens(cfg, a.tokens, "uniform", 0, device="cuda")
    packed = layer.packed
    plan = packed.plan
    stream = torch.cuda.current_stream()
    raw = stream.cuda_stream
    lane = plan.lane(stream)
    layer(x, ids, w)
    torch.cuda.synchronize()
    graph = plan.graph(lane, 1 << (max(1, a.tokens) - 1).bit_length())
    from cuda.bindings import driver

    from gcmoe_greenctx.launch import copy_then_launch

    def copy():
        driver.cuMemcpyHtoDAsync(lane.args_addr, lane.slot0, lane.slot_bytes, driver.CUstream(raw))

    graph_exec = graph.raw_cuda_graph_exec()

    launch = None
    try:  # the graph's executable launched directly (what replay() wraps)
        exec_ = driver.CUgraphExec(graph.raw_cuda_graph_exec())
        launch = lambda: driver.cuGraphLaunch(exec_, driver.CUstream(raw))
    except Exception as e:
        print("raw graph exec:", repr(e))

    def slow_call():  # the same call through cuda-python + CUDAGraph.replay (no graph handle: the slow path)
        saved, plan._execs = plan._execs, dict.fromkeys(plan._execs, 0)
        try:
            return plan.call(lane, x, ids, w, False, raw)
        finally:
            plan._execs = saved

    steps = {
        "layer(x, ids, w)": lambda: layer(x, ids, w),
        "layer.forward": lambda: layer.forward(x, ids, w),
        "gcmoe.moe": lambda: gcmoe.moe(x, ids, w, packed),
        "plan.forward": lambda: plan.forward(x, ids, w, False),
        "plan.call": lambda: plan.call(lane, x, ids, w, False, raw),
        "plan.call, slow path": slow_call,
        "graph.replay": graph.replay,
        "cuMemcpyHtoDAsync": copy,
        "cuGraphLaunch": launch,
        "copy_then_launch (ctypes)": lambda: copy_then_launch(
            lane.args_addr, lane.slot0, lane.slot_bytes, graph_exec, raw
        ),
        "torch.empty": lambda: torch.empty((a.tokens, cfg.hidden_size), dtype=torch.bfloat16, device=plan.device),
        "torch.empty_like": lambda: torch.empty_like(x),
        "validate_call": lambda: validate_call(cfg, x, ids, w, device=packed.device, check_values=False),
        "env.get_bool": lambda: env.get_bool("GCMOE_CHECK_VALUES"),
        "x + x (one torch op, for scale)": lambda: x + x,
        "raw stream": lambda: torch._C._cuda_getCurrentRawStream(0),
        "is capturing": torch._C._cuda_isCurrentStreamCapturing,
    }
    res = _per_call_us({name: fn for name, fn in steps.items() if fn is not None}, a.calls, a.batches)
    nodes = None
    try:
        from cuda.bindings import runtime

        nodes = int(runtime.cudaGraphGetNodes(graph.raw_cuda_graph(), 0)[2])
    except Exception as e:  # (torch / cuda-python without these)
        nodes = repr(e)
    out = {"model": a.model, "tokens": a.tokens, "host_us": res, "graph_nodes": nodes, "describe": layer.describe()}
    for name, us in res.items():
        print(f"{name:>26}: {us['median']:7.2f} µs (min {us['min']:.2f})")
    print("graph nodes:", nodes)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return 0
