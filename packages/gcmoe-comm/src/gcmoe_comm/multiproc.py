"""The comm checks across processes, one GPU per process, on PyTorch symmetric memory (issue: multi-GPU run).

    python -m gcmoe_comm.multiproc [--ranks P] [--replays 1000] [--out DIR] [--bound-ms MS] [--delay-rank R --delay-s S]

P processes (default: every visible GPU; P = 1 runs the same code at world size 1) each build their rank's
Workspace.symmetric, load every comm kernel (CommRank.load) and meet at a rendezvous (dist.barrier) before the first
call, so a rank still starting (loading, compiling: seconds) never looks dead to a peer that already waits with the
bound — --delay-rank R --delay-s S makes rank R start S seconds late to show it. The bound on every wait is --bound-ms
(default GCMOE_COMM_TIMEOUT_MS). Then, with the W1/W2 stand-in scattering into the peers' combine buffers through
their symmetric-memory mappings:
    1. every routing of gcmoe_comm.testing.ROUTINGS once, eagerly: own ring and own output bit-exact
    2. one CUDA graph of the call, replayed `replays` times with the routing swapped between replays: bit-exact
    3. (P > 1) a dead peer: rank 1 skips one call; every other rank must raise CommError naming rank 1's ready tag
       within the bound; after recover() on every rank the next call is exact again
Each rank writes rank<r>.json; the parent prints a summary and exits non-zero if any check failed. NVLink multicast
stays off (TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NCCL_NVLS_ENABLE=0, NVSHMEM_DISABLE_NVLS=1).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
import time
import traceback
from pathlib import Path

H, E, K, S, TMAX, BM = 1024, 16, 4, 1, 32, 8
NO_MULTICAST = {"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1"}
COLLECTIVE_TIMEOUT_S = 90.0  # a rank that fails leaves its peers in a collective: this ends it instead of a hang


# ------------------------------------------------------------- one process per GPU (also gcmoe.multiproc's harness)
def init_rank(rank: int, p: int, store: str):
    """This process's GPU and its membership of the P-rank NCCL group (file rendezvous at `store`), multicast off."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    os.environ.update(NO_MULTICAST)
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    dist.init_process_group(
        "nccl", init_method=f"file://{store}", rank=rank, world_size=p, device_id=dev, timeout=timeout
    )
    return dev


@contextlib.contextmanager
def rank_record(out_dir: str, res: dict):
    """The body's outcome in res (ok, or error + traceback: recorded for the parent, which reports every rank), its
    wall time, written to out_dir/rank<r>.json; the process group torn down. Never raises."""
    import torch.distributed as dist

    t0 = time.perf_counter()
    try:
        yield res
        res["ok"] = True
    except Exception as e:
        res["ok"] = False
        res["error"] = f"{type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc()
    finally:
        res["wall_s"] = time.perf_counter() - t0
        Path(out_dir, f"rank{res['rank']}.json").write_text(json.dumps(res, indent=2))
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn_ranks(worker, p: int, out: str, *args) -> list[dict]:
    """worker(rank, p, store, out, *args) in P fresh processes; their rank records (a rank that died without one:
    {"ok": False, "error": "no record"})."""
    import torch.multiprocessing as mp

    os.environ.update(NO_MULTICAST)
    Path(out).mkdir(parents=True, exist_ok=True)
    for f in Path(out).glob("rank*.json"):
        f.unlink()
    with tempfile.TemporaryDirectory() as d:
        try:
            mp.spawn(worker, args=(p, f"{d}/store", out, *args), nprocs=p, join=True)
        except Exception as e:  # a rank that died: reported below through its missing or failed record
            print(f"spawn: {type(e).__name__}: {e}")
    recs = []
    for r in range(p):
        f = Path(out, f"rank{r}.json")
        recs.append(json.loads(f.read_text()) if f.exists() else {"rank": r, "ok": False, "error": "no record"})
    return recs


def _worker(
    rank: int, p: int, store: str, out_dir: str, replays: int, bound_ms: float, delay: tuple[int, float]
) -> None:
    import torch
    import torch.distributed as dist

    from gcmoe_core.timing import capture_graph

    from .comm import CommRank
    from .ring import RingSpec
    from .testing import ROUTINGS, check_ring, expected_outputs, make_inputs
    from .virtual import scatter_stand_in
    from .workspace import CommError, Workspace

    if rank == delay[0]:
        time.sleep(delay[1])  # a rank that is still starting (loading, compiling) when its peers are ready
    dev = init_rank(rank, p, store)
    res: dict = {"rank": rank, "ranks": p, "device": torch.cuda.get_device_name(dev), "checks": []}
    with rank_record(out_dir, res):
        spec = RingSpec(p, E // p, H, K, TMAX, BM)
        ws = Workspace.symmetric(spec)
        comm = CommRank(ws, dispatch_ctas=4, finalize_ctas=4, shared_rows=S, timeout_ms=bound_ms)
        combine_of = [ws.peer_views(q).combine for q in range(p)]
        scatter_stand_in(ws, combine_of)  # its torch kernels loaded too
        comm.load()  # every comm kernel compiled and loaded before the first cross-rank wait ...
        torch.cuda.synchronize()
        dist.barrier()  # ... and every rank past that point before any rank's first call
        res["bound_ms"] = bound_ms

        def call(x, ids, w, shared, out):
            ws.views.combine.fill_(float("nan"))  # poison: a row nobody wrote shows in the output
            comm.publish(x, ids, w)
            comm.dispatch()
            scatter_stand_in(ws, combine_of)
            comm.finalize(out, shared)

        gen = 0
        for i, routing in enumerate(ROUTINGS):  # 1. eager, fresh routing each call
            xs, ids, wts, sh = make_inputs(p, routing, 10 + i, H, E, K, TMAX, S)
            out = torch.full_like(xs[rank], float("nan"))
            call(xs[rank], ids[rank], wts[rank], sh[rank], out)
            torch.cuda.synchronize()
            ws.check()
            gen += 1
            check_ring(ws.views, rank, spec, xs, ids, wts, gen)
            assert torch.equal(out, expected_outputs(xs, ids, wts, sh)[rank]), f"eager {routing}: output"
            res["checks"].append(f"eager {routing}")
        # 2. graph replays with the routing swapped between replays (same token counts: seeds 4 s)
        sets = [make_inputs(p, r, 4 * s, H, E, K, TMAX, S) for s, r in enumerate(ROUTINGS[:4])]
        static = [t.clone() for t in (sets[0][0][rank], sets[0][1][rank], sets[0][2][rank], sets[0][3][rank])]
        out = torch.full_like(static[0], float("nan"))
        graph, _ = capture_graph(lambda: call(*static, out))
        gen += 1  # the capture's warm-up call
        want = [expected_outputs(*st)[rank] for st in sets]
        for i in range(replays):
            k = i % len(sets)
            for dst, src in zip(static, (sets[k][0][rank], sets[k][1][rank], sets[k][2][rank], sets[k][3][rank])):
                dst.copy_(src)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, want[k]), f"replay {i}: output"
        gen += replays
        ws.check()
        check_ring(ws.views, rank, spec, *sets[(replays - 1) % len(sets)][:3], gen)
        res["checks"].append(f"{replays} graph replays")
        if p > 1:  # 3. rank 1 dies for one call
            xs, ids, wts, sh = make_inputs(p, "uniform", 99, H, E, K, TMAX, S)
            dist.barrier()
            t0 = time.perf_counter()
            if rank != 1:
                call(xs[rank], ids[rank], wts[rank], sh[rank], torch.empty_like(xs[rank]))
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
            call(xs[rank], ids[rank], wts[rank], sh[rank], out)
            torch.cuda.synchronize()
            ws.check()
            check_ring(ws.views, rank, spec, xs, ids, wts, 1)
            assert torch.equal(out, expected_outputs(xs, ids, wts, sh)[rank]), "after recovery: output"
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
