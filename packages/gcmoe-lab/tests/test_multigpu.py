"""gcmoe_lab.multigpu (the layer across processes): its CPU-side pieces here; the run itself on two or more GPUs."""

import socket
import subprocess
import sys

import pytest
import torch

from gcmoe_core.config import MoEConfig
from gcmoe_lab.multigpu import ROUTINGS, merge_ranks, pack_slots, rank_tokens

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


A2A_WORKER = """
import json, os, sys
import torch.distributed as dist
import gcmoe
from gcmoe_lab.multigpu import AllToAllBaseline
from gcmoe_core.config import MoEConfig
from gcmoe_core.testing import calc_diff, make_tokens, make_weights

rank, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
dist.init_process_group("gloo", rank=rank, world_size=2)
cfg = MoEConfig(256, 128, 8, 2, 1, ep_size=2, max_tokens_per_rank=6)
full_cfg = cfg.replace(ep_size=1)
tokens = lambda q: make_tokens(full_cfg, 4, "uniform", 40 + q)  # (equal splits: the same T on every rank)
full = make_weights(full_cfg, seed=5)
base = AllToAllBaseline(cfg, full.rank_slice(rank, 2), "cpu", dist.group.WORLD, backend="reference")
seen, inner = [], base.experts
base.experts = lambda x, ids, w: (seen.append(ids.clone()), inner(x, ids, w))[1]
x, ids, w = tokens(rank)
y = base(x, ids, w)
want = gcmoe.MoELayer(full_cfg, "cpu", "reference").load(full)(x, ids, w)
routed_here = sum(int((tokens(q)[1] // 4 == rank).sum()) for q in range(2))  # 4 experts per rank
res = dict(diff=calc_diff(y, want), seen=int((seen[0] >= 0).sum()), routed=routed_here, rows=seen[0].shape[0])
open(out, "w").write(json.dumps(res))
dist.destroy_process_group()
"""


def test_all_to_all_baseline_equals_the_layer_and_padding_reaches_no_expert(tmp_path):
    """The bench's user-written baseline (all_to_all_single around gcmoe layers) on two CPU processes over gloo, with
    the reference backend: each rank's output equals a world-size-1 layer holding every expert, and its experts see
    exactly the rows routed to them: the slabs' padding rows carry the masked id -1 (padding routed to real experts
    with weight 0 once made the baseline pay for experts nobody chose)."""
    import json

    script = tmp_path / "a2a_worker.py"
    script.write_text(A2A_WORKER)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    outs = [tmp_path / f"rank{r}.json" for r in range(2)]
    procs = [
        subprocess.Popen([sys.executable, str(script), str(r), port, str(outs[r])], stderr=subprocess.PIPE, text=True)
        for r in range(2)
    ]
    errs = [proc.communicate(timeout=240)[1] for proc in procs]
    for rank, (proc, err) in enumerate(zip(procs, errs)):
        assert proc.returncode == 0, f"rank {rank}: {err[-3000:]}"
        res = json.loads(outs[rank].read_text())
        assert res["diff"] < 1e-5, f"rank {rank}: calc_diff {res['diff']}"
        assert res["seen"] == res["routed"], f"rank {rank}: its experts saw {res['seen']} rows, {res['routed']} routed"
        assert res["rows"] == 2 * 4 * 2  # P slabs of T x k rows each (padding included)


@pytest.mark.multigpu
@pytest.mark.sm90
def test_two_ranks_cold_cache_and_a_late_rank(tmp_path):
    """Two runs across two GPUs: run 0 compiles every kernel (empty cache), run 1 starts rank 1 three seconds late,
    longer than the 500 ms bound: every check passes in both (routings, 200 replays, dead peer + recovery)."""
    cmd = [sys.executable, "-m", "gcmoe_lab", "multigpu", "check", "--ranks", "2", "--runs", "2", "--replays", "200"]
    cmd += ["--bound-ms", "500", "--delay-s", "3", "--cold-cache", "--out", str(tmp_path)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=480)  # < a device command's 600 s
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "2 of 2 runs passed at P = 2" in r.stdout


@pytest.mark.parametrize(("p", "t", "k", "e"), [(2, 1, 6, 256), (2, 8, 8, 256), (4, 3, 6, 64), (8, 2, 6, 256)])
def test_balanced_bench_routing_gives_every_rank_its_p1_equal_rows(p, t, k, e):
    from collections import Counter

    from gcmoe_lab.multigpu import bench_routing, received_load

    per_rank, p1 = bench_routing(p, t, k, e, "balanced", torch.Generator().manual_seed(t + p))
    el = e // p
    assert [ids.shape for ids, _ in per_rank] == [(t, k)] * p
    ids = torch.cat([i for i, _ in per_rank]).reshape(-1)
    assert ids.dtype == torch.int32 and int(ids.min()) >= 0 and int(ids.max()) < e
    for r, (local, _) in enumerate(p1):
        mine = ids[ids.long() // el == r] - r * el
        assert Counter(mine.tolist()) == Counter(local.reshape(-1).tolist())  # the same rows on the same experts
    load = received_load(per_rank, p, el)
    assert load["rows_by_rank"] == [t * k] * p
    assert load["active_by_rank"] == [local.unique().numel() for local, _ in p1]
    for _, w in per_rank:
        assert torch.allclose(w.sum(1), torch.ones(t))


def test_uniform_bench_routing_and_bad_options():
    from gcmoe_lab.multigpu import bench_routing, make_flush, received_load

    per_rank, _ = bench_routing(2, 8, 6, 256, "uniform", torch.Generator().manual_seed(0))
    assert sum(received_load(per_rank, 2, 128)["rows_by_rank"]) == 2 * 8 * 6
    with pytest.raises(ValueError, match="unknown bench routing"):
        bench_routing(2, 1, 6, 256, "skewed", torch.Generator())
    with pytest.raises(ValueError, match="align must be one of"):
        make_flush(torch.device("cpu"), "never")
