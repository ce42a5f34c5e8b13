"""gcmoe.multiproc (the layer across processes): its CPU-side pieces here; the run itself on two or more GPUs."""

import subprocess
import sys

import pytest
import torch

from gcmoe.multiproc import ROUTINGS, merge_ranks, pack_slots, rank_tokens
from gcmoe_core.config import MoEConfig

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
