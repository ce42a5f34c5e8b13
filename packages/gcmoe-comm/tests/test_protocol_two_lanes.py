"""Two lanes (micro-batches) per rank, each on its own workspace, their kernels competing for a rank's CTA slots
(protocol_model: the two-lane model)."""

import pytest
from protocol_model import Grids, TwoLaneConfig, explore_two_lanes, random_walks_two_lanes


@pytest.mark.parametrize(
    "cfg",
    [TwoLaneConfig(ranks=1, calls=2), TwoLaneConfig(ranks=1, calls=2, orders=((0, 1, 1, 0),))],
    ids=["P1-two-streams", "P1-one-stream"],
)
def test_two_lanes_exhaustive_p1(cfg):
    rep = explore_two_lanes(cfg)
    assert rep.ok, (rep.deadlocks, rep.violations)


@pytest.mark.parametrize(
    "ranks", [2, 3, pytest.param(4, marks=pytest.mark.slow), pytest.param(8, marks=pytest.mark.slow)]
)
def test_two_lanes_random_walks_with_enough_slots(ranks):
    cfg = TwoLaneConfig(ranks=ranks, calls=2, grids=Grids(2, 2, 2, 2, 2), slots=64)
    rep = random_walks_two_lanes(cfg, walks=10, seed=ranks)
    assert rep.ok, (rep.deadlocks, rep.violations)


def test_two_lanes_same_order_on_one_stream_is_safe():
    cfg = TwoLaneConfig(ranks=3, calls=2, orders=((0, 1, 0, 1),) * 3)
    rep = random_walks_two_lanes(cfg, walks=40, seed=1)
    assert rep.ok, (rep.deadlocks, rep.violations)


def test_lane_orders_that_differ_on_one_stream_deadlock():
    # rank 0 runs micro-batch 0 first, rank 1 micro-batch 1: each finalize waits on a call the other rank queued later
    cfg = TwoLaneConfig(ranks=2, calls=1, orders=((0, 1), (1, 0)))
    rep = random_walks_two_lanes(cfg, walks=5)
    assert rep.deadlocks and not rep.violations, rep


def test_a_spinning_grid_that_fills_the_rank_deadlocks_across_lanes():
    # one slot: a lane's dispatch (or finalize) spinning on a peer holds the rank; the peer waits on the other lane
    rep = random_walks_two_lanes(TwoLaneConfig(ranks=2, calls=1, slots=1), walks=200, seed=3)
    assert rep.deadlocks and not rep.violations, rep
    assert "resident {'dispatch': 1}" in rep.deadlocks[0] or "resident {'finalize': 1}" in rep.deadlocks[0]


@pytest.mark.slow
def test_one_slot_deadlock_exhaustive():
    rep = explore_two_lanes(TwoLaneConfig(ranks=2, calls=1, slots=1))
    assert rep.deadlocks and not rep.violations


def test_two_lanes_on_one_workspace_are_caught():
    rep = random_walks_two_lanes(TwoLaneConfig(ranks=2, calls=1, shared_workspace=True), walks=100, seed=2)
    busy = any(e[2] == "BUSY" for e in rep.errors)
    assert busy or rep.violations, rep


def test_a_lane_on_the_other_lanes_tags_is_caught():
    rep = random_walks_two_lanes(TwoLaneConfig(ranks=2, calls=1, cross_tags=True), walks=100, seed=4)
    assert rep.violations or rep.deadlocks, rep


def test_spinning_grids_within_the_cap_do_not_deadlock():
    # the layer's rule (gcmoe.backends.sm90.spin_caps): with two calls in flight per rank, dispatch and finalize keep
    # to (slots - 1) // 2 CTAs each, so some slot is always free for the call the peers wait on; W1 / W2 unbounded
    cfg = TwoLaneConfig(ranks=2, calls=2, grids=Grids(1, 2, 6, 6, 2), slots=5)
    rep = random_walks_two_lanes(cfg, walks=30, seed=1)
    assert rep.ok, (rep.deadlocks, rep.violations)
    over = TwoLaneConfig(ranks=2, calls=2, grids=Grids(1, 5, 3, 3, 5), slots=5)  # the same rank, uncapped: stuck
    rep = random_walks_two_lanes(over, walks=30, seed=1)
    assert rep.deadlocks and not rep.violations, rep
