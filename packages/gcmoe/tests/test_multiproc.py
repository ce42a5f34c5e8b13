"""gcmoe.multiproc (the layer across processes): its CPU-side pieces here; the run itself on two or more GPUs."""

import os
import socket
import subprocess
import sys

import pytest
import torch

from gcmoe.multiproc import ROUTINGS, AllToAllBaseline, merge_ranks, pack_slots, rank_tokens
from gcmoe_core.config import MoEConfig
from gcmoe_core.testing import calc_diff, make_tokens, make_weights

CFG = MoEConfig(1024, 512, 16, 4, 1)


@pytest.mark.parametrize("p", [2, 4])
def test_routings_send_what_they_say(p):
    el = CFG.num_experts // p
    for routing in ROUTINGS:
        calls = rank_tokens(CFG, p, routing, seed=3, device="cpu")
        assert len(calls) == p
        again = rank_tokens(CFG, p, routing, seed=3, device="cpu")  # the same on every process
        for (x, ids, w), (x2, ids2, w2) in zip(calls, again):
            assert torch.equal(x, x2) and torch.equal(ids, ids2) and torch.equal(w, w2)
        ids = torch.cat([c[1] for c in calls])
        assert ((ids >= 0) & (ids < CFG.num_experts)).all()
        assert all((c[1].sort(1).values.diff(dim=1) > 0).all() for c in calls if c[1].numel())  # distinct per token
        if routing == "skewed":
            assert (ids[:, 0] == 0).all()
        if routing == "one_rank":
            assert (ids < el).all()
        if routing == "idle_rank":
            assert calls[-1][0].shape[0] == 0 and (ids < CFG.num_experts - el).all()
        else:
            assert [c[0].shape[0] for c in calls] == [3 + 5 * r for r in range(p)]


def test_pack_slots_places_each_row_once_in_its_destinations_slab():
    g = torch.Generator().manual_seed(0)
    p, el, t, k = 4, 8, 13, 6
    ids = torch.stack([torch.randperm(p * el, generator=g)[:k] for _ in range(t)]).to(torch.int32)
    cap = t * k
    slot, local = pack_slots(ids, el, p, cap)
    flat = ids.reshape(-1).long()
    assert slot.unique().numel() == t * k  # no two rows share a slot
    assert torch.equal(slot // cap, flat // el)  # each row in its destination's slab
    assert torch.equal(local, flat % el)
    for q in range(p):  # slabs filled from their start, in (token, slot) order
        mine = slot[flat // el == q] - q * cap
        assert torch.equal(mine, torch.arange(mine.numel()))


def test_merge_takes_the_slowest_rank():
    recs = [
        {"points": [{"tokens": 1, "us": {"a": 10.0, "b": 5.0}}]},
        {"points": [{"tokens": 1, "us": {"a": 8, "b": 7}}]},
    ]
    (m,) = merge_ranks(recs)
    assert m["us"] == {"a": 10.0, "b": 7} and m["us_by_rank"][1] == {"a": 8, "b": 7}


A2A_CFG = MoEConfig(256, 128, 8, 2, 1, ep_size=2, max_tokens_per_rank=6)


def _a2a_tokens(rank):  # (the baseline's equal splits need the same T on every rank)
    return make_tokens(A2A_CFG.replace(ep_size=1), 4, "uniform", 40 + rank)


def _a2a_worker(rank, port, results):
    import torch.distributed as dist

    import gcmoe

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        full_cfg = A2A_CFG.replace(ep_size=1)
        full = make_weights(full_cfg, seed=5)
        base = AllToAllBaseline(A2A_CFG, full.rank_slice(rank, 2), "cpu", dist.group.WORLD, backend="reference")
        seen, inner = [], base.experts
        base.experts = lambda x, ids, w: (seen.append(ids.clone()), inner(x, ids, w))[1]
        x, ids, w = _a2a_tokens(rank)
        y = base(x, ids, w)
        want = gcmoe.MoELayer(full_cfg, "cpu", "reference").load(full)(x, ids, w)
        sent_here = sum(int((_a2a_tokens(q)[1] // 4 == rank).sum()) for q in range(2))  # 4 experts per rank
        results.put((rank, calc_diff(y, want), int((seen[0] >= 0).sum()), sent_here, seen[0].shape[0]))
    finally:
        dist.destroy_process_group()


def test_all_to_all_baseline_equals_the_layer_and_padding_reaches_no_expert():
    """The bench's user-written baseline (all_to_all_single around gcmoe layers) on two CPU processes over gloo, with
    the reference backend: each rank's output equals a world-size-1 layer holding every expert, and its experts see
    exactly the rows routed to them: the slabs' padding rows carry the masked id -1 (padding routed to real experts
    with weight 0 once made the baseline pay for experts nobody chose)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = torch.multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_a2a_worker, args=(r, port, results)) for r in range(2)]
    for proc in procs:
        proc.start()
    got = sorted(results.get(timeout=120) for _ in procs)
    for proc in procs:
        proc.join(timeout=30)
    for rank, diff, real, sent_here, rows in got:
        assert diff < 1e-5, f"rank {rank}: calc_diff {diff}"
        assert real == sent_here, f"rank {rank}: its experts saw {real} rows, {sent_here} were routed to it"
        assert rows == 2 * 4 * 2  # P slabs of T x k rows each (padding included)


@pytest.mark.multigpu
@pytest.mark.sm90
def test_two_ranks_cold_cache_and_a_late_rank(tmp_path):
    """Two runs across two GPUs: run 0 compiles every kernel (empty cache), run 1 starts rank 1 three seconds late,
    longer than the 500 ms bound: every check passes in both (routings, 200 replays, dead peer + recovery)."""
    cmd = [sys.executable, "-m", "gcmoe.multiproc", "check", "--ranks", "2", "--runs", "2", "--replays", "200"]
    cmd += ["--bound-ms", "500", "--delay-s", "3", "--cold-cache", "--out", str(tmp_path)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=480)  # < a device command's 600 s
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "2 of 2 runs passed at P = 2" in r.stdout
