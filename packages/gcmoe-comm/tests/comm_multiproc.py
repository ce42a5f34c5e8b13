"""The comm checks across processes, one GPU per process, on PyTorch symmetric memory.

    python packages/gcmoe-comm/tests/comm_multiproc.py [--ranks P] [--replays 1000] [--out DIR] [--bound-ms MS]
                                                       [--delay-rank R --delay-s S]

P processes (default: every visible GPU; P = 1 runs the same code at world size 1) each build their rank's
Workspace.symmetric, load every comm kernel (CommRank.load) and meet at a rendezvous (dist.barrier) before the first
call, so a rank still starting (loading, compiling: seconds) never looks dead to a peer that already waits with the
bound — --delay-rank R --delay-s S makes rank R start S seconds late to show it. The bound on every wait is --bound-ms
(default GCMOE_COMM_TIMEOUT_MS). Then, with the W1/W2 stand-in scattering into the peers' combine buffers through
their symmetric-memory mappings:
    1. every routing of virtual_ranks.ROUTINGS once, eagerly: own ring and own output bit-exact
    2. one CUDA graph of the call, replayed `replays` times with the routing swapped between replays: bit-exact
    3. (P > 1) a dead peer: rank 1 skips one call; every other rank must raise CommError naming rank 1's ready tag
       within the bound; after recover() on every rank the next call is exact again
Each rank writes rank<r>.json (gcmoe_comm.multiproc.rank_record); the parent prints a summary and exits non-zero if
any check failed.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __name__ == "__main__":  # run as a script: the sibling helper modules import as the tests' conftest puts them
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from gcmoe_comm.multiproc import init_rank, rank_record, spawn_ranks

H, E, K, S, TMAX, BM = 1024, 16, 4, 1, 32, 8


def _worker(
    rank: int, p: int, store: str, out_dir: str, replays: int, bound_ms: float, delay: tuple[int, float]
) -> None:
    import torch
    import torch.distributed as dist
    from virtual_ranks import ROUTINGS, check_ring, expected_outputs, make_inputs, scatter_stand_in

    from gcmoe_comm.comm import CommRank
    from gcmoe_comm.ring import RingSpec
    from gcmoe_comm.workspace import CommError, Workspace
    from gcmoe_core.testing import capture_graph

    if rank == delay[0]:
        time.sleep(delay[1])  # a rank that is still starting (loading, compiling) when its peers are ready
    dev = init_rank(rank, p, store)
    res: dict = {"rank": rank, "ranks": p, "device": torch.cuda.get_device_name(dev), "checks": []}
    with rank_record(out_dir, res):
        spec = RingSpec(p, E // p, H, K, TMAX, BM, S)
        ws = Workspace.symmetric(spec)
        comm = CommRank(ws, dispatch_ctas=4, finalize_ctas=4, timeout_ms=bound_ms)
        combine_of = [ws.peer_views(q).combine for q in range(p)]
        scatter_stand_in(ws, combine_of)  # its torch kernels loaded too
        comm.load()  # every comm kernel compiled and loaded before the first cross-rank wait ...
        torch.cuda.synchronize()
        dist.barrier()  # ... and every rank past that point before any rank's first call
        res["bound_ms"] = bound_ms

        def call(x, ids, w, out):
            ws.views.combine.fill_(float("nan"))  # poison: a row nobody wrote shows in the output
            comm.publish(x, ids, w)
            comm.dispatch()
            scatter_stand_in(ws, combine_of)
            comm.finalize(out)

        gen = 0
        for i, routing in enumerate(ROUTINGS):  # 1. eager, fresh routing each call
            xs, ids, wts = make_inputs(p, routing, 10 + i, H, E, K, TMAX)
            out = torch.full_like(xs[rank], float("nan"))
            call(xs[rank], ids[rank], wts[rank], out)
            torch.cuda.synchronize()
            ws.check()
            gen += 1
            check_ring(ws.views, rank, spec, xs, ids, wts, gen)
            assert torch.equal(out, expected_outputs(spec, xs, ids, wts)[rank]), f"eager {routing}: output"
            res["checks"].append(f"eager {routing}")
        # 2. graph replays with the routing swapped between replays (same token counts: seeds 4 s)
        sets = [make_inputs(p, r, 4 * s, H, E, K, TMAX) for s, r in enumerate(ROUTINGS[:4])]
        static = [part[rank].clone() for part in sets[0]]
        out = torch.full_like(static[0], float("nan"))
        graph, _ = capture_graph(lambda: call(*static, out))
        gen += 1  # the capture's warm-up call
        want = [expected_outputs(spec, *st)[rank] for st in sets]
        for i in range(replays):
            k = i % len(sets)
            for dst, part in zip(static, sets[k]):
                dst.copy_(part[rank])
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, want[k]), f"replay {i}: output"
        gen += replays
        ws.check()
        check_ring(ws.views, rank, spec, *sets[(replays - 1) % len(sets)], gen)
        res["checks"].append(f"{replays} graph replays")
        if p > 1:  # 3. rank 1 dies for one call
            xs, ids, wts = make_inputs(p, "uniform", 99, H, E, K, TMAX)
            dist.barrier()
            t0 = time.perf_counter()
            if rank != 1:
                call(xs[rank], ids[rank], wts[rank], torch.empty_like(xs[rank]))
                torch.cuda.synchronize()
                try:
                    ws.check()
                    raise AssertionError("a dead peer went unnoticed")
                except CommError as e:
                    assert "rank 1's ready tag" in str(e) and f"generation {gen + 1}" in str(e), str(e)
                    res["dead_peer_error"] = str(e)
                    res["dead_peer_s"] = time.perf_counter() - t0
            ws.recover()  # collective
            out = torch.full_like(xs[rank], float("nan"))
            call(xs[rank], ids[rank], wts[rank], out)
            torch.cuda.synchronize()
            ws.check()
            check_ring(ws.views, rank, spec, xs, ids, wts, 1)
            assert torch.equal(out, expected_outputs(spec, xs, ids, wts)[rank]), "after recovery: output"
            res["checks"].append("dead peer reported, recovery exact")


def run(
    ranks: int,
    replays: int,
    out: str,
    bound_ms: float | None = None,
    delay_rank: int = -1,
    delay_s: float = 0.0,
) -> list[dict]:
    """Spawn the ranks and return their result records. bound_ms: the wait bound (default GCMOE_COMM_TIMEOUT_MS);
    delay_rank / delay_s: that rank starts delay_s seconds late."""
    from gcmoe_core import env

    bound = float(env.get_int("GCMOE_COMM_TIMEOUT_MS")) if bound_ms is None else float(bound_ms)
    return spawn_ranks(_worker, ranks, out, replays, bound, (delay_rank, delay_s))


def main(argv=None) -> int:
    import torch

    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=torch.cuda.device_count())
    ap.add_argument("--replays", type=int, default=1000)
    ap.add_argument("--out", default="comm-multiproc")
    ap.add_argument("--bound-ms", type=float, default=None, help="wait bound (default GCMOE_COMM_TIMEOUT_MS)")
    ap.add_argument("--delay-rank", type=int, default=-1, help="this rank starts --delay-s seconds late")
    ap.add_argument("--delay-s", type=float, default=0.0)
    args = ap.parse_args(argv)
    results = run(args.ranks, args.replays, args.out, args.bound_ms, args.delay_rank, args.delay_s)
    for r in results:
        print(f"rank {r['rank']}/{r['ranks']} on {r.get('device')}: {'ok' if r['ok'] else r['error']}; {r['checks']}")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
