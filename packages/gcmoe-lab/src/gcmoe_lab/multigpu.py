"""The multi-GPU harness: the public layer across processes, one GPU per process, on PyTorch symmetric memory.

    gcmoe-lab multigpu check [--ranks P] [--runs N] [--replays 1000] [--cold-cache] [--delay-s S] --out DIR
    gcmoe-lab multigpu bench [--ranks P] [--models ...] [--tokens 1 8 32 128 256] [--iters 30] [--variants ...]
                             [--routing balanced|uniform] [--align device|host] --out DIR
    gcmoe-lab multigpu dispatch [--ranks P] [--sms 16 24] [--tokens ...] [--align device|host] --out DIR

check: each run spawns P fresh processes (run 0 with an empty kernel cache when --cold-cache: every kernel compiled
while the peers may already wait; odd runs start rank P - 1 --delay-s late, longer than the wait bound). Every rank
builds `gcmoe.MoELayer(MoEConfig(..., ep_size=P), group=WORLD)` — the public path, nothing below it — holding its E/P
experts, and a world-size-1 layer holding all E experts with the same fixed kernel configuration (per token-slot the
same arithmetic, so the P-rank layer must match it bit for bit: the multi-rank reference), then:
    1. eager calls on the routings below, fresh inputs each: bit-exact vs the world-size-1 layer on the rank's own
       tokens, and within the quantisation model's bound (calc_diff <= 1e-3) of the plain-torch reference
          uniform    ids uniform over all E experts
          skewed     every token's first slot on expert 0 (rank 0 receives every token)
          one_rank   every id among rank 0's experts (the other ranks receive nothing)
          idle_rank  rank P - 1 has no tokens and no rank routes to its experts
    2. one captured call replayed `replays` times with inputs and routing swapped between replays: bit-exact
    3. a dead peer: rank 1 skips a call; every other rank's check() raises CommError naming rank 1's ready tag within
       the bound; after recover() on every rank the next call is bit-exact again
bench: per rank, side by side (interleaved, graph replay, cold L2, medians; the max over ranks reported), for each
model's full layer at ep_size = P and T tokens per rank (the shared expert in), routed by --routing (bench_routing):
balanced (default: every rank receives exactly T * k rows, the load p1_equal has) or uniform over all E experts (a
rank receives T * k rows only on average: at T = 1 one rank may hold 9 of V4-Flash's 12 rows, and every rank waits
for it); each point records the rows and active experts every rank received:
    sequential    gcmoe, comm_sms = 0 (every role on one stream)
    partitioned   gcmoe, comm_sms = 16 (green-context split)
    p1_equal      the same rank at world size 1 with equal per-rank load: MoEConfig.ep_slice(model, P), T tokens
                  routed among its E/P experts (same weight bytes, same rows per rank: T * k)
    a2a_baseline  what a user writes with torch.distributed: routed rows packed per destination into fixed-capacity
                  slabs, all_to_all_single, the same gcmoe kernels as a world-size-1 layer over the received rows
                  (top-1 per row; padding rows carry the masked id -1, so they cost no weight bytes or rows),
                  all_to_all_single back, slot sum + shared expert
Every timed replay starts after a host barrier, an L2 flush and (--align device, the default) a one-word NCCL
all-reduce on the timing stream, so the ranks' replays start together on the GPUs; with --align host (what the
2026-11-30 records used) each rank's replay starts when its host gets there after the barrier, and a rank that
starts early waits for its peer's READY inside the timed span: the host skew is counted as layer time.
dispatch: gcmoe's READY + dispatch kernels on a comm partition of N SMs (symmetric memory over NVLink: every rank's
published FP8 rows pulled into the ring; the tokens published once, as in gcmoe_lab.bench_comm) vs
torch.distributed.all_to_all_single (NCCL) of the same payload bytes (T * k rows of FP8 + scales per rank).
NVLink multicast stays off (TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NCCL_NVLS_ENABLE=0, NVSHMEM_DISABLE_NVLS=1).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

from gcmoe_comm.multiproc import init_rank, rank_record, spawn_ranks

ROUTINGS = ("uniform", "skewed", "one_rank", "idle_rank")
CHECK_SHAPE = {"hidden_size": 1024, "intermediate_size": 512, "top_k": 4, "num_shared_experts": 1}


# ----------------------------------------------------------------------------------------------- inputs and routing
def rank_tokens(cfg, p: int, routing: str, seed: int, device) -> list[tuple]:
    """Every rank's (x [T_r, H] bf16, global ids [T_r, k] int32, weights [T_r, k] fp32) for one call: the same on
    every process (drawn on the CPU from seed), each rank takes its own. T_r = 3 + 5 r (idle_rank: T_{P-1} = 0)."""
    import torch

    from gcmoe_core.testing import make_routing

    g = torch.Generator().manual_seed(seed)
    e, el = cfg.num_experts, cfg.num_experts // p
    pool = {"one_rank": el, "idle_rank": e - el}.get(routing, e)  # ids drawn among experts [0, pool)
    kind = "one_expert" if routing == "skewed" else "uniform"
    out = []
    for r in range(p):
        t = 0 if routing == "idle_rank" and r == p - 1 else 3 + 5 * r
        x = torch.randn(t, cfg.hidden_size, generator=g).to(torch.bfloat16)
        ids, w = make_routing(t, cfg.top_k, pool, kind, g)
        out.append((x.to(device), ids.to(device), w.to(device)))
    return out


# ------------------------------------------------------------------------------------------------------------ check
def _check_worker(rank: int, p: int, store: str, out_dir: str, replays: int, bound_ms: float, delay_s: float) -> None:
    res: dict = {"rank": rank, "ranks": p, "checks": []}
    t_start = time.perf_counter()
    with rank_record(out_dir, res):
        if rank == p - 1 and delay_s:
            time.sleep(delay_s)  # a rank still starting (loading, compiling) while its peers are ready
        dev = init_rank(rank, p, store)
        import torch
        import torch.distributed as dist

        import gcmoe
        from gcmoe_core.config import MoEConfig
        from gcmoe_core.reference import moe_reference
        from gcmoe_core.testing import calc_diff, first_mismatch, make_weights
        from gcmoe_gemm_sm90.config import Sm90Config

        res["device"] = torch.cuda.get_device_name(dev)
        kcfg = Sm90Config(n_tile=8, stages=3, prefetch=2)  # the same kernels at every P: per token-slot bit-identical
        cfg1 = MoEConfig(num_experts=8 * p, max_tokens_per_rank=32, **CHECK_SHAPE)
        cfg_p = cfg1.replace(ep_size=p)
        weights = make_weights(cfg1, seed=7, device=dev)  # the same on every rank (seeded device generator)
        layer = gcmoe.MoELayer(
            cfg_p, dev, "sm90", group=dist.group.WORLD, kernel_config=kcfg, timeout_ms=bound_ms
        ).load(weights.rank_slice(rank, p))  # collective: kernels loaded, then the rendezvous
        ref = gcmoe.MoELayer(cfg1, dev, "sm90", kernel_config=kcfg).load(weights)
        res["ready_s"] = time.perf_counter() - t_start
        res["bound_ms"] = bound_ms

        for i, routing in enumerate(ROUTINGS):  # 1. eager, fresh inputs each call
            x, ids, w = rank_tokens(cfg1, p, routing, 100 + i, dev)[rank]
            y = layer(x, ids, w)
            torch.cuda.synchronize()
            layer.check()
            if x.shape[0]:
                assert first_mismatch(y, ref(x, ids, w)) == "", f"eager {routing}: vs world size 1"
                assert calc_diff(y, moe_reference(x, ids, w, weights)) < 1e-3, f"eager {routing}: vs reference"
            res["checks"].append(f"eager {routing}")

        # 2. one captured call, replays with the inputs and routing swapped (same T per rank for every set)
        sets = [rank_tokens(cfg1, p, ROUTINGS[s % 3], 200 + s, dev)[rank] for s in range(4)]
        want = [ref(*st) for st in sets]
        static = [t.clone() for t in sets[0]]
        layer(*static)  # warm the bucket's graph outside the capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=torch.cuda.Stream(dev)):
            out = layer(*static)
        for i in range(replays):
            k = (i + 1) % len(sets)
            for dst, src in zip(static, sets[k]):
                dst.copy_(src)
            g.replay()
            torch.cuda.synchronize()
            if not torch.equal(out, want[k]):
                raise AssertionError(f"replay {i}: {first_mismatch(out, want[k])}")
        layer.check()
        res["checks"].append(f"{replays} graph replays, routing swapped")

        if p > 1:  # 3. rank 1 dies for one call
            x, ids, w = rank_tokens(cfg1, p, "uniform", 300, dev)[rank]
            dist.barrier()
            t0 = time.perf_counter()
            if rank != 1:
                y = layer(x, ids, w)
                torch.cuda.synchronize()
                try:
                    layer.check()
                    raise AssertionError("a dead peer went unnoticed")
                except gcmoe.CommError as e:
                    assert "rank 1's ready tag" in str(e), str(e)
                    res["dead_peer_error"] = str(e)
                    res["dead_peer_s"] = time.perf_counter() - t0
                assert y.isnan().all(), "a failed call's output must be NaN, not stale"
            dist.barrier()
            layer.recover()  # collective
            y = layer(x, ids, w)
            torch.cuda.synchronize()
            layer.check()
            assert first_mismatch(y, ref(x, ids, w)) == "", "after recover"
            res["checks"].append("dead peer reported, recovery exact")


def run_checks(p: int, runs: int, replays: int, out: str, bound_ms: float, delay_s: float, cold: bool) -> dict:
    """`runs` fresh multi-process runs of the checks; returns the summary record."""
    results = []
    for i in range(runs):
        old = os.environ.get("GCMOE_CACHE_DIR")
        tmp = tempfile.mkdtemp(prefix="gcmoe-cold-") if cold and i == 0 else None
        if tmp:
            os.environ["GCMOE_CACHE_DIR"] = tmp  # every kernel compiled in this run (children inherit)
        t0 = time.perf_counter()
        delay = delay_s if i % 2 else 0.0
        recs = spawn_ranks(_check_worker, p, f"{out}/run{i}", replays, bound_ms, delay)
        if tmp:
            if old is None:
                os.environ.pop("GCMOE_CACHE_DIR")
            else:
                os.environ["GCMOE_CACHE_DIR"] = old
        ok = all(r["ok"] for r in recs)
        results.append(
            {
                "run": i,
                "ok": ok,
                "cold_cache": bool(tmp),
                "delay_s": delay,
                "wall_s": time.perf_counter() - t0,
                "ranks": recs,
            }
        )
        errs = "; ".join(f"rank {r['rank']}: {r['error']}" for r in recs if not r["ok"])
        print(
            f"run {i}: {'ok' if ok else 'FAILED'} ({results[-1]['wall_s']:.1f} s{', cold' if tmp else ''}"
            f"{f', rank {p - 1} {delay:.1f} s late' if delay else ''}) {errs}",
            flush=True,
        )
    return {
        "ranks": p,
        "runs": runs,
        "passed": sum(r["ok"] for r in results),
        "replays": replays,
        "bound_ms": bound_ms,
        "results": results,
    }


# ------------------------------------------------------------------------------------------------------------ bench
ALIGNS = ("device", "host")


def make_flush(dev, align: str):
    """The untimed step before every timed replay (module docstring): host barrier, cold L2, and with align="device"
    a one-word all-reduce on the current stream, so every rank's start event follows the same collective."""
    import torch
    import torch.distributed as dist

    from .timing import ColdL2

    if align not in ALIGNS:
        raise ValueError(f"align must be one of {ALIGNS}, got {align!r}")
    cold, word = ColdL2(dev), torch.zeros(1, dtype=torch.int32, device=dev)

    def flush() -> None:
        dist.barrier()
        cold()
        if align == "device":
            dist.all_reduce(word)

    return flush


def pack_slots(ids, experts_per_rank: int, ranks: int, cap: int):
    """Where each routed row (token, slot) of ids [T, k] goes in the per-destination send slabs [ranks * cap]:
    (slot index [T * k] int64, destination-local expert id [T * k] int64). Rows keep (token, slot) order within a
    destination; capture-safe (no host sync, no data-dependent shapes)."""
    import torch

    flat = ids.reshape(-1).long()
    dest = flat // experts_per_rank
    onehot = torch.zeros(flat.numel(), ranks, dtype=torch.int32, device=ids.device).scatter_(1, dest[:, None], 1)
    pos = (torch.cumsum(onehot, 0) - onehot).gather(1, dest[:, None]).squeeze(1)
    return dest * cap + pos, flat - dest * experts_per_rank


class AllToAllBaseline:
    """The layer a user writes with torch.distributed around gcmoe's kernels (see the module docstring).
    Capturable: fixed-capacity slabs (T * k rows per destination for a call of T tokens), equal splits, no host
    sync. Padding rows carry the masked id -1: they cross the all-to-alls (their bytes are the baseline's cost) but
    reach no expert. backend: the experts' backend (sm90 on the GPU; reference for the CPU test over gloo)."""

    def __init__(self, cfg, weights, device, group, backend: str = "sm90"):
        import torch

        import gcmoe
        from gcmoe_core.config import MoEConfig
        from gcmoe_core.reference import MoEWeights

        p, t_max, k = cfg.ep_size, cfg.max_tokens_per_rank, cfg.top_k
        self.p, self.el, self.group = p, cfg.local_experts, group
        self.cap = t_max * k
        # padding rows carry id -1 (masked_ids): dropped by publish, they load no expert's weights and fill no ring
        # rows (weight 0 on a real expert instead overstated the baseline: every padding row activated an expert)
        inner = MoEConfig(
            cfg.hidden_size, cfg.intermediate_size, self.el, 1, 0, max_tokens_per_rank=p * self.cap, masked_ids=True
        )
        self.experts = gcmoe.MoELayer(inner, device, backend).load(MoEWeights(weights.w13, weights.w2))
        s = cfg.num_shared_experts
        shared_cfg = MoEConfig(cfg.hidden_size, cfg.intermediate_size, s, s, 0, max_tokens_per_rank=t_max)
        self.shared = gcmoe.MoELayer(shared_cfg, device, backend).load(
            MoEWeights(weights.shared_w13, weights.shared_w2)
        )
        h, rows = cfg.hidden_size, p * self.cap
        self.send_x = torch.zeros(rows, h, dtype=torch.bfloat16, device=device)
        self.recv_x = torch.empty_like(self.send_x)
        self.pad_meta = torch.stack(  # (local id, weight) of a padding row: masked
            [torch.full((rows,), -1.0, device=device), torch.zeros(rows, device=device)], 1
        )
        self.send_meta = self.pad_meta.clone()
        self.recv_meta = torch.empty_like(self.send_meta)
        self.back = torch.empty_like(self.send_x)
        self.shared_ids = torch.arange(s, dtype=torch.int32, device=device).expand(t_max, s).contiguous()
        self.shared_w = torch.ones(t_max, s, device=device)

    def __call__(self, x, ids, w):
        import torch
        import torch.distributed as dist

        t, k = ids.shape
        cap = t * k  # rows one destination can get from this call (all of them): a slab each, equal splits
        n = self.p * cap
        send_x, recv_x, back = self.send_x[:n], self.recv_x[:n], self.back[:n]
        send_meta, recv_meta = self.send_meta[:n], self.recv_meta[:n]
        slot, local = pack_slots(ids, self.el, self.p, cap)
        send_meta.copy_(self.pad_meta[:n])
        send_x.index_copy_(0, slot, x.repeat_interleave(k, 0))
        send_meta.index_copy_(0, slot, torch.stack([local.float(), w.reshape(-1).float()], 1))
        dist.all_to_all_single(recv_x, send_x, group=self.group)
        dist.all_to_all_single(recv_meta, send_meta, group=self.group)
        rows = self.experts(recv_x, recv_meta[:, :1].to(torch.int32), recv_meta[:, 1:].contiguous())
        dist.all_to_all_single(back, rows, group=self.group)
        y = back.index_select(0, slot).view(t, k, -1).float().sum(1)
        return (y + self.shared(x, self.shared_ids[:t], self.shared_w[:t]).float()).to(torch.bfloat16)


BENCH_VARIANTS = ("sequential", "partitioned", "p1_equal", "a2a_baseline")
BENCH_ROUTINGS = ("balanced", "uniform")


def bench_routing(p: int, t: int, k: int, e: int, routing: str, g) -> tuple[list, list]:
    """One bench point's routing, drawn for every rank at once from g (every process draws the same):
    (for the P-rank layer, per rank: ids [T, k] int32 global, weights [T, k] fp32;
     for p1_equal, per rank: ids [T, k] int32 over the rank's E / P experts, weights).
        uniform   the P-rank layer's ids by gcmoe_core.testing.make_routing over all E experts (a rank receives T * k
                  rows on average); p1_equal's drawn the same way over E / P experts, independently
        balanced  p1_equal's ids first (make_routing over E / P, per rank); then rank r's T * k (row, expert) pairs,
                  in order, fill the global slots s = token * k + j (tokens in rank order) with s mod P = r: every
                  rank receives exactly the rows of its p1_equal call, on the same experts (a token may then carry
                  one expert twice where the pairs straddle two rows: duplicates are legal routing)"""
    import torch

    from gcmoe_core.testing import make_routing

    n, el = p * t, e // p

    def split(ids, w):
        return [(ids[r * t : (r + 1) * t], w[r * t : (r + 1) * t]) for r in range(p)]

    p1 = [make_routing(t, k, el, "uniform", g) for _ in range(p)]
    if routing == "uniform":
        return split(*make_routing(n, k, e, "uniform", g)), p1
    if routing != "balanced":
        raise ValueError(f"unknown bench routing {routing!r}; known: {BENCH_ROUTINGS}")
    ids = torch.empty(n * k, dtype=torch.int32)
    dest = torch.arange(n * k) % p
    for r, (local, _) in enumerate(p1):
        ids[dest == r] = r * el + local.reshape(-1)
    w = torch.softmax(torch.randn(n, k, generator=g), dim=1).float()
    return split(ids.view(n, k), w), p1


def received_load(per_rank: list, p: int, el: int) -> dict:
    """Rows and active experts each rank receives from a bench_routing draw."""
    import torch

    ids = torch.cat([i for i, _ in per_rank]).reshape(-1).long()
    mine = [ids[ids // el == r] for r in range(p)]
    return {"rows_by_rank": [m.numel() for m in mine], "active_by_rank": [m.unique().numel() for m in mine]}


def _bench_variant(name: str, cfg, slice_cfg, w_rank, dev, group):
    """One bench variant's callable (BENCH_VARIANTS; the module docstring says what each is)."""
    import gcmoe

    if name == "a2a_baseline":
        return AllToAllBaseline(cfg, w_rank, dev, group)
    if name == "p1_equal":
        return gcmoe.MoELayer(slice_cfg, dev, "sm90").load(w_rank)
    comm_sms = {"sequential": 0, "partitioned": 16}[name]
    return gcmoe.MoELayer(cfg, dev, "sm90", comm_sms=comm_sms, group=group).load(w_rank)


def _bench_worker(
    rank, p, store, out_dir, models, tokens, iters, variants=BENCH_VARIANTS, align="device", routing="balanced"
) -> None:
    res: dict = {"rank": rank, "ranks": p, "points": []}
    with rank_record(out_dir, res):
        dev = init_rank(rank, p, store)
        import torch
        import torch.distributed as dist

        import gcmoe
        from gcmoe_core.config import MoEConfig
        from gcmoe_core.testing import calc_diff, capture_graph, make_weights

        from .timing import time_once

        group = dist.group.WORLD
        cs = torch.cuda.Stream(dev)  # warm-up and capture stream: every layer's lane exists before its capture
        flush = make_flush(dev, align)  # every rank starts each timed replay together, L2 cold
        for model in models:
            cfg = MoEConfig.from_model(model, ep_size=p, max_tokens_per_rank=max(tokens))
            slice_cfg = MoEConfig.ep_slice(model, p, max_tokens_per_rank=max(tokens))
            w_rank = make_weights(cfg, seed=11 + rank, device=dev)
            layers = {name: _bench_variant(name, cfg, slice_cfg, w_rank, dev, group) for name in variants}
            for t in tokens:
                g = torch.Generator().manual_seed(1000 * t + rank)
                x = torch.randn(t, cfg.hidden_size, generator=g).to(torch.bfloat16).to(dev)
                draw = torch.Generator().manual_seed(t)  # the same on every rank
                per_rank, p1 = bench_routing(p, t, cfg.top_k, cfg.num_experts, routing, draw)
                args = [x, *(a.to(dev) for a in per_rank[rank])]
                args1 = [x, *(a.to(dev) for a in p1[rank])]
                graphs, outs = {}, {}
                for name, layer in layers.items():
                    dist.barrier()
                    fn = partial(layer, *(args1 if name == "p1_equal" else args))
                    graphs[name], outs[name] = capture_graph(fn, warmup=2, device=dev, stream=cs)
                times = {name: [] for name in graphs}
                for _ in range(iters):
                    for name, gr in graphs.items():
                        times[name].append(time_once(gr.replay, flush))
                us = {n: statistics.median(v) for n, v in times.items()}
                point = {"model": model, "tokens": t, "routing": routing, "us": us}
                point.update(received_load(per_rank, p, cfg.local_experts))
                if "sequential" in outs and "a2a_baseline" in outs:
                    point["a2a_vs_sequential_calc_diff"] = calc_diff(outs["a2a_baseline"], outs["sequential"])
                if "sequential" in outs and "partitioned" in outs:
                    point["partitioned_equal_sequential"] = bool(torch.equal(outs["partitioned"], outs["sequential"]))
                for layer in layers.values():
                    if isinstance(layer, gcmoe.MoELayer):
                        layer.check()
                res["points"].append(point)
                Path(out_dir, f"rank{rank}.json").write_text(json.dumps(res, indent=2))  # kept if a later point hangs
                if rank == 0:
                    print(f"{model} T={t}: " + ", ".join(f"{n} {u:.1f}" for n, u in point["us"].items()), flush=True)
            layers.clear()
            torch.cuda.empty_cache()


def _dispatch_worker(rank, p, store, out_dir, sms_list, tokens, iters, align="device") -> None:
    res: dict = {"rank": rank, "ranks": p, "points": []}
    with rank_record(out_dir, res):
        dev = init_rank(rank, p, store)
        import torch
        import torch.distributed as dist

        from gcmoe_comm.comm import CommRank
        from gcmoe_comm.ring import RingSpec
        from gcmoe_comm.workspace import Workspace
        from gcmoe_core.testing import capture_graph, make_routing
        from gcmoe_greenctx.partition import split_device

        from .timing import time_once

        h, e, k, bm = 7168, 256, 8, 16  # DeepSeek-V3 routing over P ranks
        spec = RingSpec(p, e // p, h, k, max(tokens), bm)
        ws = Workspace.symmetric(spec)
        flush = make_flush(dev, align)  # every rank starts each timed replay together, L2 cold
        for sms in sms_list:
            part = split_device(sms)
            comm = CommRank(ws, timeout_ms=5000)
            comm.load()
            for t in tokens:
                g = torch.Generator().manual_seed(t * 31 + rank)
                x = torch.randn(t, h, generator=g).to(torch.bfloat16).to(dev)
                ids, w = (a.to(dev) for a in make_routing(t, k, e, "uniform", g))
                payload_row = h + h // 128 * 4  # FP8 row + fp32 scales

                comm.publish(x, ids, w, ticket=rank + 1)  # once (one ticket: INUSE is never released here); replays:
                # READY (generation + 1) + dispatch
                torch.cuda.synchronize()
                ctas = comm.dispatch_grid(t, 2 * sms)

                def dispatch(t=t, comm=comm, ctas=ctas):
                    comm.ready(t)
                    comm.dispatch(ctas)

                dist.barrier()
                gd = capture_graph(dispatch, stream=part.comm_stream)[0]
                rows = t * k  # rows this rank sends on average = rows it receives on average
                send = torch.empty(p * ((rows * payload_row + p - 1) // p), dtype=torch.uint8, device=dev)
                recv = torch.empty_like(send)
                dist.barrier()
                ga = capture_graph(lambda send=send, recv=recv: dist.all_to_all_single(recv, send), device=dev)[0]
                dist.barrier()
                times = {"gcmoe_dispatch": [], "nccl_all_to_all": []}
                for _ in range(iters):
                    times["gcmoe_dispatch"].append(time_once(gd.replay, flush))
                    times["nccl_all_to_all"].append(time_once(ga.replay, flush))
                us = {n: statistics.median(v) for n, v in times.items()}
                res["points"].append({"comm_sms": sms, "tokens": t, "bytes": rows * payload_row, "us": us})
                if rank == 0:
                    print(f"sms={sms} T={t}: " + ", ".join(f"{n} {u:.1f}" for n, u in us.items()), flush=True)
                ws.check()  # every replay's waits succeeded (else the times above are of kernels that gave up)


def merge_ranks(recs: list[dict]) -> list[dict]:
    """Per point, the slowest rank's median of each variant (a step waits for its slowest rank)."""
    merged = []
    for i, point in enumerate(recs[0]["points"]):
        us = {n: max(r["points"][i]["us"][n] for r in recs) for n in point["us"]}
        merged.append({**point, "us": us, "us_by_rank": [r["points"][i]["us"] for r in recs]})
    return merged


def main(argv=None) -> int:
    import torch

    from gcmoe_core import env

    from .timing import run_meta

    ap = argparse.ArgumentParser(prog="gcmoe-lab multigpu", description="the layer across GPUs: checks and benches")
    ap.add_argument("what", choices=("check", "bench", "dispatch"))
    ap.add_argument("--ranks", type=int, default=torch.cuda.device_count())
    ap.add_argument("--out", default="gcmoe-multiproc")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--replays", type=int, default=1000)
    ap.add_argument("--bound-ms", type=float, default=None, help="wait bound (default GCMOE_COMM_TIMEOUT_MS)")
    ap.add_argument("--delay-s", type=float, default=3.0, help="odd runs: rank P-1 starts this late")
    ap.add_argument("--cold-cache", action="store_true", help="run 0 with an empty kernel cache")
    ap.add_argument("--models", nargs="+", default=["deepseek-v3", "deepseek-v4-flash"])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 128, 256])
    ap.add_argument("--sms", type=int, nargs="+", default=[16, 24])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--variants", nargs="+", choices=BENCH_VARIANTS, default=list(BENCH_VARIANTS), help="bench only")
    ap.add_argument("--routing", choices=BENCH_ROUTINGS, default="balanced", help="bench only: bench_routing")
    ap.add_argument("--align", choices=ALIGNS, default="device", help="bench, dispatch: how the ranks' replays start")
    a = ap.parse_args(argv)
    if a.ranks < 1:
        raise SystemExit("--ranks: needs at least one GPU")
    bound = float(env.get_int("GCMOE_COMM_TIMEOUT_MS")) if a.bound_ms is None else a.bound_ms
    meta = run_meta(ranks=a.ranks, command="gcmoe-lab multigpu " + " ".join(sys.argv[1:] if argv is None else argv))
    if a.what == "check":
        rec = {**meta, **run_checks(a.ranks, a.runs, a.replays, a.out, bound, a.delay_s, a.cold_cache)}
        ok = rec["passed"] == a.runs
        print(f"{rec['passed']} of {a.runs} runs passed at P = {a.ranks}")
    else:
        if a.what == "bench":
            worker, extra = _bench_worker, (a.models, a.tokens, a.iters, tuple(a.variants), a.align, a.routing)
        else:
            worker, extra = _dispatch_worker, (a.sms, a.tokens, a.iters, a.align)
        recs = spawn_ranks(worker, a.ranks, f"{a.out}/{a.what}", *extra)
        ok = all(r["ok"] for r in recs)
        rec = {
            **meta,
            "align": a.align,
            "routing": a.routing if a.what == "bench" else None,
            "ok": ok,
            "errors": [r.get("error") for r in recs if not r["ok"]],
        }
        if ok:
            rec["points"] = merge_ranks(recs)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    Path(a.out, f"{a.what}-p{a.ranks}.json").write_text(json.dumps(rec, indent=2))
    return 0 if ok else 1
