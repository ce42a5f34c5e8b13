"""The comm kernels on a GPU: P = 1 on real symmetric memory and virtual, P = 2 and 4 as virtual ranks on one GPU.
Dispatch (the ring) and combine (finalize's output) bit-exact against gcmoe_core's multi-rank reference and the
stand-in expert's direct computation, for uniform, skewed, empty-rank and idle-rank routing; 1,000 graph replays with
changing routing; a dead peer turns into a CommError naming rank, counter and generation within the bound, and the
next call after recovery is exact. The shared expert rides the ring, as the layer's do."""

import time

import pytest
import torch
from virtual_ranks import ROUTINGS, VirtualRanks, check_ring, expected_outputs, make_inputs

from gcmoe_comm.ring import RingSpec
from gcmoe_comm.workspace import SIG_GEN, CommError, Workspace
from gcmoe_core.formats import quantize_fp8_e4m3_1x128
from gcmoe_core.testing import capture_graph, make_routing

pytestmark = pytest.mark.gpu

H, E, K, S, TMAX, BM = 1024, 16, 4, 1, 32, 8


def _spec(p, tmax=TMAX):
    return RingSpec(p, E // p, H, K, tmax, BM, S)


def _inputs(p, routing, seed):
    return make_inputs(p, routing, seed, H, E, K, TMAX)


def _check_rings(wss, xs, ids, weights, gen):
    for q, w in enumerate(wss):
        check_ring(w.views, q, w.spec, xs, ids, weights, gen)


def _outs(xs):
    return [torch.full_like(x, float("nan")) for x in xs]


def _step_exactly(vr, xs, ids, ws, gen):
    """One call on every virtual rank (call `gen` since the last reset): no error, every ring and combine exact."""
    outs = _outs(xs)
    vr.step(xs, ids, ws, outs)
    torch.cuda.synchronize()
    vr.check()
    _check_rings(vr.ws, xs, ids, ws, gen=gen)
    for r, (y, want) in enumerate(zip(outs, expected_outputs(vr.spec, xs, ids, ws))):
        assert torch.equal(y, want), f"rank {r}: combine differs in {(y != want).sum().item()} elements"


@pytest.mark.parametrize(
    "p, fused", [(1, True), (1, False), (2, False), (4, False)], ids=["P1", "P1-two-kernels", "P2", "P4"]
)
@pytest.mark.parametrize("routing", ROUTINGS)
def test_virtual_ranks_bit_exact(p, fused, routing):
    """P = 1 runs publish + dispatch as the layer does (one kernel, straight from x) and as the two kernels."""
    vr = VirtualRanks(_spec(p), "cuda", fused=fused, dispatch_ctas=4, finalize_ctas=4, timeout_ms=2000)
    for call in range(1, 4):  # fresh routing each call; generations 1..3 without any reset
        xs, ids, ws = _inputs(p, routing, seed=10 * p + call)
        _step_exactly(vr, xs, ids, ws, gen=call)


@pytest.mark.parametrize("p, tokens", [(1, [256]), (1, [197]), (2, [256, 131]), (4, [64, 250, 0, 97])])
def test_dispatch_ranks_long_routing_exactly_in_every_warp_chunk(p, tokens):
    """Dispatch ranks all ranks' entries in 8 warp chunks, each with cursors of its own: with hundreds of entries per
    rank every chunk has work, chunks end inside a rank's entries and inside a 32-entry group, and at P > 1 a chunk
    spans two source ranks (one of them idle); the ring's rows and the combine must be exactly the reference's for
    uniform and one-expert routing (a chunk whose entries all go to one expert), over 8 dispatch CTAs that each own
    many blocks, and finalize on its default grid."""
    tmax = 256
    vr = VirtualRanks(_spec(p, tmax), "cuda", dispatch_ctas=8, timeout_ms=2000)
    for call, routing in enumerate(("uniform", "one_expert"), start=1):
        xs, ids, ws = make_inputs(p, routing, 100 * p + call, H, E, K, tmax, tokens=tokens)
        _step_exactly(vr, xs, ids, ws, gen=call)


def _symmetric_one_rank(tmp_path) -> list[Workspace]:
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("nccl", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    return [Workspace.symmetric(_spec(1))]


@pytest.mark.parametrize("p", [1, 2, 4], ids=["P1-symmetric-memory", "P2-virtual", "P4-virtual"])
def test_graph_replays_bit_exact(p, tmp_path):
    spec = _spec(p)
    wss = _symmetric_one_rank(tmp_path) if p == 1 else None
    vr = VirtualRanks(spec, "cuda", wss, dispatch_ctas=4, finalize_ctas=4, timeout_ms=2000)
    # four routings with the same token counts (seed % 4 fixes T), swapped into the graph's static inputs
    sets = [_inputs(p, r, seed=4 * s) for s, r in enumerate(["uniform", "one_expert", "one_rank", "half_empty"])]
    static = [[t.clone() for t in part] for part in sets[0]]
    outs = _outs(static[0])
    vr.step(*static, outs)  # eager first: generation 1
    torch.cuda.synchronize()
    vr.check()
    _check_rings(vr.ws, *sets[0], gen=1)
    graph, _ = capture_graph(lambda: vr.step(*static, outs))
    expected = [expected_outputs(spec, *st) for st in sets]
    replays = 1000
    for i in range(replays):
        k = i % len(sets)
        for dst, src in zip(static, sets[k]):
            for a, b in zip(dst, src):
                a.copy_(b)
        for o in outs:
            o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for r in range(p):
            assert torch.equal(outs[r], expected[k][r]), f"replay {i}, rank {r}"
    vr.check()
    gen = int(vr.ws[0].views.signals[SIG_GEN])
    assert gen == replays + 2  # eager call + capture warm-up + the replays, no reset in between
    _check_rings(vr.ws, *sets[(replays - 1) % len(sets)], gen=gen)


@pytest.mark.parametrize("p", [2, 4])
def test_dead_peer_is_reported_and_recovery_works(p):
    bound_ms = 100
    vr = VirtualRanks(_spec(p), "cuda", dispatch_ctas=4, finalize_ctas=4, timeout_ms=bound_ms)
    xs, ids, ws = _inputs(p, "uniform", seed=5)
    vr.step(xs, ids, ws, _outs(xs))  # generation 1 works
    torch.cuda.synchronize()
    vr.check()
    t0 = time.perf_counter()
    vr.step(xs, ids, ws, _outs(xs), silent=frozenset({1}))  # rank 1 never publishes generation 2
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    assert elapsed < 10 * bound_ms / 1e3, f"a failed call took {elapsed:.3f} s with a {bound_ms} ms bound"
    with pytest.raises(CommError, match=r"rank 0: timed out waiting on rank 1's ready tag .*generation 2, saw 1"):
        vr.ws[0].check()
    vr.recover()
    outs = _outs(xs)
    vr.step(xs, ids, ws, outs)
    torch.cuda.synchronize()
    vr.check()
    _check_rings(vr.ws, xs, ids, ws, gen=1)
    for y, want in zip(outs, expected_outputs(vr.spec, xs, ids, ws)):
        assert torch.equal(y, want)


def test_publish_quantises_bit_exactly_including_special_groups():
    """The publish kernel against gcmoe_core.formats on groups that are all zero, hold a NaN or an Inf, sit near
    the bf16 extremes, or are subnormal; routing copied as given (int64 ids, bf16 weights converted)."""
    spec = RingSpec(1, E, H, K, TMAX, BM)
    ws = Workspace.virtual(spec, "cuda")[0]
    rank = VirtualRanks(spec, "cuda", [ws], timeout_ms=2000).ranks[0]
    g = torch.Generator().manual_seed(9)
    x = torch.randn(TMAX, H, generator=g) * torch.logspace(-30, 30, TMAX).unsqueeze(1)
    x[0, :128] = 0.0
    x[1, 5] = float("nan")
    x[2, 300] = float("inf")
    x[3, 600:700] = 3.0e38
    x[4, :] = 1e-40  # bf16 subnormals
    x = x.to(torch.bfloat16).cuda()
    ids, w = make_routing(TMAX, K, E, "uniform", g)
    ids, w = ids.long().cuda(), w.to(torch.bfloat16).cuda()
    rank.publish(x, ids, w)
    torch.cuda.synchronize()
    q, s = quantize_fp8_e4m3_1x128(x)
    v = ws.views
    got_q = v.pub_x.view(torch.float8_e4m3fn).float()
    both_nan = got_q.isnan() & q.float().isnan()
    assert torch.equal(got_q[~both_nan], q.float()[~both_nan]) and bool((got_q.isnan() == q.float().isnan()).all())
    assert torch.equal(v.pub_sx.isnan(), s.isnan()) and torch.equal(v.pub_sx[~s.isnan()], s[~s.isnan()])
    assert torch.equal(v.pub_ids, ids.int()) and torch.equal(v.pub_w, w.float())
    assert int(v.signals[SIG_GEN]) == 1
