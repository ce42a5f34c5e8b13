"""The operator on a GPU through its public path (MoELayer / gcmoe.moe), per backend, on fresh random inputs:

- values: the reference backend to 1e-5 of the CPU reference; sm90 to the 1e-3 quantisation-emulation bound, and
  bit-identical across every way of calling it (eager = the lane's bucket graph, inside a caller's capture, under
  torch.compile, partitioned at several comm sizes or not at all);
- ownership (issue defect 1): two layers of one shape captured on two streams and replayed concurrently, 200 times,
  and one layer called eagerly from two streams at once, stay exact; two replays of one lane at once fail loudly;
- checks: a bad id is dropped on the device and raised on the next call, silently accepted only with checks off;
- P ranks (virtual, one GPU): bit-exact against the same kernels at world size 1 holding every expert, eagerly and
  over 1,000 replays of one captured step with the routing swapped each time; a dead peer -> CommError within the
  bound, exact again after recover();
- placement: inside a caller's capture the layer's roles run on their green-context partitions (%smid probe
  recorded beside the role nodes);
- teardown: a dropped layer frees its lanes at once; one torn down by the GC inside a capture leaves it valid.
"""

import time

import pytest
import torch

import gcmoe
from gcmoe_core.config import MoEConfig
from gcmoe_core.reference import moe_reference
from gcmoe_core.testing import Case, calc_diff, first_mismatch, make_problem, make_tokens, make_weights

pytestmark = pytest.mark.gpu

CFG = MoEConfig(
    hidden_size=512, intermediate_size=256, num_experts=16, top_k=4, num_shared_experts=1, max_tokens_per_rank=32
)
BACKENDS = [("reference", 1e-5), pytest.param("sm90", 1e-3, marks=pytest.mark.sm90)]
ROUTINGS = ("uniform", "one_expert", "half_empty")


def _tokens(cfg, t, routing, seed):
    return make_tokens(cfg, t, routing, seed, device="cuda")


def _layer(cfg=CFG, weights=None, seed=0, **kw):
    weights = weights if weights is not None else make_weights(cfg, seed, "cuda")
    return gcmoe.MoELayer(cfg, "cuda", "sm90", **kw).load(weights), weights


def _eager_at_once(calls, repeats: int = 200):
    """Each (stream, layer, args, want) called eagerly on its stream, all at once, `repeats` times: every output
    bit-identical to `want`."""
    for i in range(repeats):
        outs = []
        for stream, layer, args, _ in calls:
            with torch.cuda.stream(stream):
                outs.append(layer(*args))
        torch.cuda.synchronize()
        for j, (y, (*_, want)) in enumerate(zip(outs, calls)):
            assert torch.equal(y, want), f"repeat {i}, call {j}"


@pytest.mark.parametrize(("backend", "tol"), BACKENDS)
@pytest.mark.parametrize("routing", ROUTINGS)
def test_gpu_matches_reference(routing, backend, tol):
    x, ids, w, weights, floats = make_problem(Case(CFG, 13, routing, seed=21))
    layer = gcmoe.MoELayer(CFG, device="cuda", backend=backend).load_weights(*floats)
    assert layer.backend == backend
    y = layer(x.cuda(), ids.cuda(), w.cuda())
    assert not y.isnan().any()
    assert calc_diff(y.cpu(), moe_reference(x, ids, w, weights)) < tol


@pytest.mark.sm90
def test_auto_picks_sm90_and_every_bucket_is_exact():
    assert gcmoe.choose(torch.device("cuda"), None, CFG) == "sm90"
    layer, weights = _layer(seed=1)
    for t in (1, 2, 3, 8, 9, 31, 32):  # buckets 1, 2, 4, 8, 16, 32 (and T below the bucket)
        x, ids, w = _tokens(CFG, t, "uniform", 100 + t)
        y = layer(x, ids, w)
        assert calc_diff(y, moe_reference(x, ids, w, weights)) < 1e-3, f"T = {t}"
    layer.check()


@pytest.mark.sm90
def test_eager_captured_compiled_and_comm_sizes_are_bit_identical():
    weights = make_weights(CFG, 2, "cuda")
    layers = {c: _layer(weights=weights, comm_sms=c)[0] for c in (0, 16, 24)}
    x, ids, w = _tokens(CFG, 11, "uniform", 5)
    want = layers[16](x, ids, w)
    for c, layer in layers.items():
        assert first_mismatch(layer(x, ids, w), want) == "", f"comm_sms={c}"
    # the shared expert's W1 prefetched into L2 beside the comm kernels (on by default at T = 1) changes no value
    assert len(layers[0].packed.plan.prefetch_ranges) == 2  # its weights, scales
    plain = _layer(weights=weights, comm_sms=0)[0]
    plain.packed.plan.prefetch_ranges = ()  # (the test drops the side branch)
    x1, ids1, w1 = _tokens(CFG, 1, "uniform", 6)
    assert first_mismatch(plain(x, ids, w), want) == ""
    assert first_mismatch(plain(x1, ids1, w1), layers[0](x1, ids1, w1)) == ""
    # inside a caller's capture: replays with new routing, each equal to the eager call on the same inputs
    layer = layers[16]
    sx, sids, sw = x.clone(), ids.clone(), w.clone()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.graph(g, stream=s):
        out = layer(sx, sids, sw)
    for i in range(20):
        nx, nids, nw = _tokens(CFG, 11, ROUTINGS[i % 3], 200 + i)
        sx.copy_(nx), sids.copy_(nids), sw.copy_(nw)
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert first_mismatch(out, layer(sx, sids, sw)) == "", f"replay {i}"
    # under torch.compile (the custom op with its fake implementation)
    compiled = torch.compile(lambda a, b, c: layer(a, b, c) * 2, fullgraph=True, backend="aot_eager")
    assert first_mismatch(compiled(x, ids, w), want * 2) == ""
    layer.check()


@pytest.mark.sm90
def test_two_layers_on_two_streams_replayed_concurrently_stay_exact():
    """Issue defect 1: one layer's output was wrong in ~180 of 200 concurrent replays (a shared workspace)."""
    la, _wa = _layer(seed=10)
    lb, _wb = _layer(seed=11)
    xa, ia, wta = _tokens(CFG, 16, "uniform", 1)
    xb, ib, wtb = _tokens(CFG, 16, "uniform", 2)
    want_a, want_b = la(xa, ia, wta), lb(xb, ib, wtb)
    sa, sb = torch.cuda.Stream(), torch.cuda.Stream()
    ga, gb = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(ga, stream=sa):
        ya = la(xa, ia, wta)
    with torch.cuda.graph(gb, stream=sb):
        yb = lb(xb, ib, wtb)
    bad = 0
    for _ in range(200):
        ya.fill_(float("nan")), yb.fill_(float("nan"))
        torch.cuda.synchronize()
        with torch.cuda.stream(sa):
            ga.replay()
        with torch.cuda.stream(sb):
            gb.replay()
        torch.cuda.synchronize()
        bad += int(not torch.equal(ya, want_a)) + int(not torch.equal(yb, want_b))
    assert bad == 0, f"{bad} wrong outputs in 400"
    _eager_at_once(((sa, la, (xa, ia, wta), want_a), (sb, lb, (xb, ib, wtb), want_b)))
    la.check(), lb.check()


@pytest.mark.sm90
def test_one_layer_on_two_streams_gets_two_lanes_and_shared_lanes_fail_loudly():
    layer, _ = _layer(seed=12)
    xa, ia, wa = _tokens(CFG, 8, "uniform", 3)
    xb, ib, wb = _tokens(CFG, 24, "uniform", 4)
    want_a, want_b = layer(xa, ia, wa), layer(xb, ib, wb)
    sa, sb = torch.cuda.Stream(), torch.cuda.Stream()
    _eager_at_once(((sa, layer, (xa, ia, wa), want_a), (sb, layer, (xb, ib, wb), want_b)))  # a lane per stream
    assert layer.describe()["lanes"] >= 3
    # two captures made on ONE stream share that stream's lane: replayed at once they must not mix silently
    cap = torch.cuda.Stream()
    g1, g2 = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(g1, stream=cap):
        y1 = layer(xa, ia, wa)
    with torch.cuda.graph(g2, stream=cap):
        y2 = layer(xb, ib, wb)
    failed = False
    for _ in range(50):
        with torch.cuda.stream(sa):
            g1.replay()
        with torch.cuda.stream(sb):
            g2.replay()
        torch.cuda.synchronize()
        ok1, ok2 = torch.equal(y1, want_a), torch.equal(y2, want_b)
        try:
            layer.check()
        except gcmoe.CommError as e:
            assert "held by another call" in str(e)
            failed = True
            break
        assert ok1 and ok2, "a concurrent replay of a shared lane was wrong without an error"
    if failed:
        layer.recover()
        assert torch.equal(layer(xa, ia, wa), want_a)


@pytest.mark.sm90
def test_bad_ids_are_dropped_on_the_device_and_raised_on_the_next_call(monkeypatch):
    layer, weights = _layer(seed=13)
    x, ids, w = _tokens(CFG, 6, "uniform", 6)
    bad = ids.clone()
    bad[2, 1] = 99
    y = layer(x, bad, w)  # the check runs on the device: this call returns, the next one raises
    with pytest.raises(ValueError, match=r"topk_ids: holds expert id 99 at token 2, slot 1"):
        layer(x, ids, w)
    kept = bad.clone()
    kept[2, 1] = ids[2, 1]
    dropped_w = w.clone()
    dropped_w[2, 1] = 0.0  # a dropped slot contributes nothing
    ref = moe_reference(x, kept, dropped_w, weights)
    assert calc_diff(y, ref) < 1e-3 and not y.isnan().any()
    monkeypatch.setenv("GCMOE_CHECK_VALUES", "0")
    layer(x, bad, w)
    layer(x, ids, w)  # no error with checks off
    monkeypatch.setenv("GCMOE_CHECK_VALUES", "1")
    w_nan = w.clone()
    w_nan[1, 0] = float("nan")
    y = layer(x, ids, w_nan)
    assert y[1].isnan().any() and not y[0].isnan().any()
    with pytest.raises(ValueError, match="non-finite routing weight"):
        layer(x, ids, w)


# ------------------------------------------------------------------------------------------------ P virtual ranks
def _rank_inputs(cfg, p, routing, seed):
    g = torch.Generator().manual_seed(seed)
    return [make_tokens(cfg, 3 + 5 * r + seed % 4, routing, generator=g, device="cuda") for r in range(p)]


@pytest.mark.sm90
@pytest.mark.parametrize("p", [2, 4])
def test_virtual_ranks_bit_exact_replays_and_dead_peer(p):
    from gcmoe.backends import LayerOptions
    from gcmoe.backends.sm90 import virtual_ranks
    from gcmoe_comm.workspace import CommError
    from gcmoe_gemm_sm90.config import Sm90Config

    kcfg = Sm90Config(n_tile=8, stages=3, prefetch=2)  # the same kernels at every P: per token-slot bit-identical
    cfg1 = CFG
    cfg_p = CFG.replace(ep_size=p)
    weights = make_weights(cfg1, seed=30 + p, device="cuda")
    ref = gcmoe.MoELayer(cfg1, "cuda", "sm90", kernel_config=kcfg, comm_sms=16).load(weights)
    opts = LayerOptions(comm_sms=16, kernel_config=kcfg, timeout_ms=200)
    ranks = virtual_ranks(cfg_p, weights, torch.device("cuda"), opts)
    streams = [torch.cuda.Stream() for _ in range(p)]

    def step(inputs, outs=None):
        main = torch.cuda.current_stream()
        ys = []
        for r, (plan, s) in enumerate(zip(ranks, streams)):
            s.wait_stream(main)
            with torch.cuda.stream(s):
                ys.append(plan.forward(*inputs[r], True) if outs is None else outs[r])
        for s in streams:
            main.wait_stream(s)
        return ys

    # eager, every routing, fresh inputs: each rank equals the world-size-1 layer on its own tokens
    for i, routing in enumerate(ROUTINGS):
        inputs = _rank_inputs(cfg1, p, routing, 40 + i)
        ys = step(inputs)
        torch.cuda.synchronize()
        for r in range(p):
            assert first_mismatch(ys[r], ref(*inputs[r])) == "", f"{routing}: rank {r}"
            assert calc_diff(ys[r], moe_reference(*inputs[r], weights)) < 1e-3
    # an idle rank (T = 0: no tokens this step) still takes part; every other rank stays exact
    inputs = _rank_inputs(cfg1, p, "uniform", 60)
    inputs[-1] = tuple(a[:0] for a in inputs[-1])
    ys = step(inputs)
    torch.cuda.synchronize()
    assert ys[-1].shape == (0, cfg1.hidden_size)
    for r in range(p - 1):
        assert first_mismatch(ys[r], ref(*inputs[r])) == "", f"idle last rank: rank {r}"
    for plan in ranks:
        plan.check()
    # one captured step (every rank on its stream), 1,000 replays with the routing swapped in each time
    sets = [_rank_inputs(cfg1, p, ROUTINGS[k % 3], 4 * k) for k in range(4)]  # same T per rank (seed % 4 == 0)
    static = [[t.clone() for t in rank_in] for rank_in in sets[0]]
    want = [[ref(*rank_in) for rank_in in st] for st in sets]
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=torch.cuda.Stream()):
        outs = step(static)
    for i in range(1000):
        k = i % len(sets)
        for dst, src in zip(static, sets[k]):
            for a, b in zip(dst, src):
                a.copy_(b)
        g.replay()
        torch.cuda.synchronize()
        for r in range(p):
            assert torch.equal(outs[r], want[k][r]), f"replay {i}, rank {r}"
    for plan in ranks:
        plan.check()
    # a dead peer: rank 1 skips a call; the others fail within the bound, loudly; recover; exact again
    inputs = _rank_inputs(cfg1, p, "uniform", 77)
    t0 = time.perf_counter()
    live = [r for r in range(p) if r != 1]
    main = torch.cuda.current_stream()
    ys = {}
    for r in live:
        streams[r].wait_stream(main)
        with torch.cuda.stream(streams[r]):
            ys[r] = ranks[r].forward(*inputs[r], True)
    torch.cuda.synchronize()
    assert time.perf_counter() - t0 < 5.0
    with pytest.raises(CommError, match="rank 1's ready tag"):
        ranks[0].check()
    assert ys[0].isnan().all(), "a failed call's output must be NaN, not stale"
    for plan in ranks:
        plan.recover()
    ys = step(inputs)
    torch.cuda.synchronize()
    for r in range(p):
        assert first_mismatch(ys[r], ref(*inputs[r])) == "", f"after recover: rank {r}"


@pytest.mark.sm90
def test_world_size_one_on_symmetric_memory_is_bit_identical(tmp_path):
    """MoELayer(group=...) at P = 1: the workspace from PyTorch symmetric memory (the P > 1 path's allocation and
    peer table), eager and replayed, bit-identical to the layer on a plain buffer."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("nccl", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    weights = make_weights(CFG, 15, "cuda")
    sym = gcmoe.MoELayer(CFG, "cuda", "sm90", group=dist.group.WORLD).load(weights)
    plain = gcmoe.MoELayer(CFG, "cuda", "sm90").load(weights)
    assert sym.packed.plan.lane(torch.cuda.current_stream()).ws.group is not None
    x, ids, w = _tokens(CFG, 9, "uniform", 9)
    assert first_mismatch(sym(x, ids, w), plain(x, ids, w)) == ""
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=torch.cuda.Stream()):
        y = sym(x, ids, w)
    for i in range(10):
        nx, nids, nw = _tokens(CFG, 9, ROUTINGS[i % 3], 300 + i)
        x.copy_(nx), ids.copy_(nids), w.copy_(nw)
        g.replay()
        torch.cuda.synchronize()
        assert first_mismatch(y, plain(x, ids, w)) == "", f"replay {i}"
    sym.check()


@pytest.mark.sm90
def test_roles_keep_their_partitions_inside_a_callers_capture(monkeypatch):
    """The %smid probe kernel recorded beside the dispatch and finalize roles (the test wraps the role nodes the
    backend hands to gcmoe_greenctx.enqueue_roles) lands on disjoint SM sets of the lane's partition sizes."""
    import gcmoe_greenctx
    from gcmoe_lab.kernel_smid import record_smids

    layer, _ = _layer(seed=14, comm_sms=16)
    x, ids, w = _tokens(CFG, 8, "uniform", 8)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        want = layer(x, ids, w)  # the lane of s and its 16-SM split made, every kernel loaded
    torch.cuda.synchronize()
    part = layer.packed.plan.lane(s).partitions[16]
    comm_ids = torch.full((4 * part.comm_sms,), -1, dtype=torch.int32, device="cuda")
    comp_ids = torch.full((4 * part.compute_sms,), -1, dtype=torch.int32, device="cuda")
    record_smids(comm_ids, 1_000)  # the probe kernel loaded before the capture, as the layer's own kernels are
    torch.cuda.synchronize()
    plain_enqueue = gcmoe_greenctx.enqueue_roles

    def probed(p, roles, overlap):
        def dispatch():
            roles.dispatch()
            record_smids(comm_ids, 20_000)

        def finalize():
            roles.finalize()
            record_smids(comp_ids, 20_000)

        plain_enqueue(p, gcmoe_greenctx.RoleNodes(dispatch, roles.compute, finalize), overlap)

    monkeypatch.setattr(gcmoe_greenctx, "enqueue_roles", probed)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        y = layer(x, ids, w)
    monkeypatch.undo()
    comm_ids.fill_(-1), comp_ids.fill_(-1)
    g.replay()
    torch.cuda.synchronize()
    a, b = set(comm_ids.tolist()), set(comp_ids.tolist())
    assert -1 not in a and -1 not in b
    assert not a & b, "comm and compute roles shared SMs inside the caller's graph"
    assert len(a) <= part.comm_sms and len(b) <= part.compute_sms
    assert first_mismatch(y, want) == ""


@pytest.mark.sm90
# UNSEEN: shapes no other test of this process compiles, so the first captured call is the first launch of their
# W1 / W2 anywhere (comm_sms 0) or in a green partition's context (comm_sms 16: module loads are lazy per context)
@pytest.mark.parametrize(
    ("cfg", "comm_sms"),
    [
        (CFG, None),
        (MoEConfig.ep_slice("deepseek-v4-flash", 8, max_tokens_per_rank=256), None),
        (MoEConfig(1536, 512, 8, 2, num_shared_experts=1, max_tokens_per_rank=16), 0),  # UNSEEN
        (MoEConfig(2560, 512, 8, 2, num_shared_experts=1, max_tokens_per_rank=16), 16),  # UNSEEN
    ],
)
def test_first_call_inside_a_callers_capture_on_a_fresh_stream(cfg, comm_sms):
    """A layer whose very first call is captured (torch.cuda.graph's default global capture mode) on a stream it never
    ran on: its lane is made under the capture (the multi-GPU bench found that the lane's kernel loads
    synchronised a stream during a capture and invalidated it) and the bucket's GEMMs are loaded outside it, into
    every context they launch in (a first launch inside the capture loaded the module there and invalidated it:
    found the same day), and the replay equals an eager call."""
    weights = make_weights(cfg, 21, "cuda")
    layer = gcmoe.MoELayer(cfg, "cuda", "sm90", comm_sms=comm_sms).load(weights)
    x, ids, w = _tokens(cfg, 8, "uniform", 21)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=torch.cuda.Stream()):
        y = layer(x, ids, w)
    y.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert first_mismatch(y, layer(x, ids, w)) == ""


@pytest.mark.sm90
def test_a_dropped_layer_frees_its_lanes_at_once():
    """No reference cycle holds a layer's plan or lanes: dropping the last layer of a pool's shape class frees its
    graphs, streams and workspaces at once, not when the cyclic GC runs (which can be inside someone else's
    capture)."""
    import gc
    import weakref

    gc.collect()
    gc.disable()
    try:
        layer, _ = _layer(comm_sms=16, pool=gcmoe.LayerPool())
        x, ids, w = _tokens(CFG, 6, "uniform", 31)
        layer(x, ids, w)
        with torch.cuda.stream(torch.cuda.Stream()):
            layer(x, ids, w)  # a second lane
        torch.cuda.synchronize()
        plan = layer.packed.plan
        refs = [weakref.ref(plan), *(weakref.ref(lane) for lane in plan._lanes.values())]
        refs += [weakref.ref(lane.ws) for lane in plan._lanes.values()]
        assert len(refs) == 5
        del layer, plan
        assert [r() is None for r in refs] == [True] * 5
    finally:
        gc.enable()


@pytest.mark.sm90
def test_a_layer_torn_down_during_a_capture_does_not_invalidate_it(monkeypatch):
    """A layer held in a reference cycle is freed by the cyclic GC, which may run inside a capture (forced here): its
    lanes release their graphs, streams, green contexts and buffers in relaxed capture mode, which must leave the
    capture valid (destroying them in the default global mode invalidated it: cudaErrorStreamCaptureInvalidated)."""
    import gc
    import weakref

    if hasattr(torch.compiler.config, "force_cudagraph_gc"):  # (torch.cuda.graph would collect before capturing)
        monkeypatch.setattr(torch.compiler.config, "force_cudagraph_gc", False)
    gc.collect()
    gc.disable()  # the cycle below is collected where the test says, not earlier
    try:
        old, _ = _layer(comm_sms=16, seed=32, pool=gcmoe.LayerPool())
        x, ids, w = _tokens(CFG, 6, "uniform", 32)
        old(x, ids, w)  # a lane with its bucket graph
        torch.cuda.synchronize()
        lanes = [weakref.ref(lane) for lane in old.packed.plan._lanes.values()]
        cycle = [old]
        cycle.append(cycle)
        del old, cycle
        layer, _ = _layer(seed=33)
        x, ids, w = _tokens(CFG, 9, "uniform", 33)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=torch.cuda.Stream()):
            gc.collect()  # the dropped layer's lanes are torn down here, inside the capture
            y = layer(x, ids, w)
    finally:
        gc.enable()
    assert lanes and all(r() is None for r in lanes), "the dropped layer's lanes were torn down inside the capture"
    y.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert first_mismatch(y, layer(x, ids, w)) == ""


@pytest.mark.sm90
def test_a_layer_loaded_and_first_called_under_inference_mode_serves_calls_outside_it():
    """An engine warms up under torch.inference_mode: the lanes made there must not be inference tensors, or the next
    call / recover() outside it fails on their in-place writes."""
    weights = make_weights(CFG, 23, "cuda")
    with torch.inference_mode():
        layer = gcmoe.MoELayer(CFG, "cuda", "sm90").load(weights)
        x, ids, w = _tokens(CFG, 5, "uniform", 23)
        y0 = layer(x, ids, w)
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):  # a second lane, made inside inference mode too
            y1 = layer(x, ids, w)
        torch.cuda.synchronize()
    x, ids, w = _tokens(CFG, 5, "uniform", 23)
    assert first_mismatch(layer(x, ids, w), y0) == "" and first_mismatch(y1, y0) == ""
    layer.check()
    layer.recover()  # zeroes the lanes' signals in place
    assert first_mismatch(layer(x, ids, w), y0) == ""


@pytest.mark.sm90
def test_model_shaped_layers_match_the_reference():
    for model, t in (("deepseek-v3", 1), ("deepseek-v4-flash", 8), ("glm-4.5", 32), ("deepseek-v3", 128)):
        cfg = MoEConfig.ep_slice(model, 8, max_tokens_per_rank=256)
        weights = make_weights(cfg, seed=t, device="cuda")
        layer = gcmoe.MoELayer(cfg, "cuda", "sm90", comm_sms=16).load(weights)
        x, ids, w = _tokens(cfg, t, "uniform", t)
        y = layer(x, ids, w)
        if t <= 32:
            assert calc_diff(y, moe_reference(x, ids, w, weights)) < 1e-3, f"{model} T={t}"
        seq = gcmoe.MoELayer(cfg, "cuda", "sm90", comm_sms=0).load(weights)
        assert first_mismatch(seq(x, ids, w), y) == "", f"{model} T={t}: partitioned vs sequential"
        layer.check()
        del layer, seq
        torch.cuda.empty_cache()


@pytest.mark.sm90
def test_a_hundred_layer_step_captures_on_the_default_capture_stream_after_an_eager_warm_up():
    """An engine's shape: N pre-norm residual MoE blocks warmed up eagerly on one stream, then the whole step captured
    with torch.cuda.graph's own capture stream (drawn from torch's stream pool, like every stream a layer used to
    take for itself: past ~32 layers a layer's "new" stream was the capturing one, and its synchronisation broke the
    capture). The replayed step equals the eager step, bit for bit, with new inputs."""
    layers_n, t = 100, 4
    cfg = MoEConfig(256, 128, 8, 2, num_shared_experts=1, max_tokens_per_rank=8)
    base = make_weights(cfg, 40, "cuda")
    layers = [gcmoe.MoELayer(cfg, "cuda", "sm90").load(base) for _ in range(layers_n)]
    routes = [_tokens(cfg, t, "uniform", 400 + i)[1:] for i in range(layers_n)]
    x = torch.randn(t, cfg.hidden_size, dtype=torch.bfloat16, device="cuda")

    def step(h):
        for layer, (ids, w) in zip(layers, routes):
            h = h + layer(torch.nn.functional.rms_norm(h, (cfg.hidden_size,)), ids, w)
        return h

    warm = torch.cuda.Stream()
    with torch.cuda.stream(warm):
        want = step(x)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = step(x)
    for i in range(3):
        x.copy_(torch.randn_like(x))
        with torch.cuda.stream(warm):
            want = step(x)
        torch.cuda.synchronize()
        y.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.isfinite(want).all() and first_mismatch(y, want) == "", f"replay {i}"
