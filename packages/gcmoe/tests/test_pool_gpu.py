"""Layer pools on a GPU (gcmoe.pool), through the public path:

- layers of one shape class share one lane per stream (memory of one call, not N) and stay bit-exact against the
  same layers in pools of their own; a second stream takes a second lane; the last dropped layer frees the lanes;
- a bucket graph is captured on its first eager use without a device sync (the host does not wait for unrelated
  work queued on another stream);
- a captured step's bad routing entry gives a finite output, and one pool.check() without a sync names the layer;
- P = 2 virtual ranks: two micro-batches in flight at once in one captured step (gcmoe.micro_batch), 1,000 replays
  with the routing swapped, bit-exact against world size 1; a dead peer inside a captured step: the output is NaN from
  that layer on, pool.check() names the layer, one pool.recover() and the step is exact again.
"""

import gc
import time
from dataclasses import replace

import pytest
import torch

import gcmoe
from gcmoe_core.config import MoEConfig
from gcmoe_core.testing import first_mismatch, make_tokens, make_weights

pytestmark = [pytest.mark.gpu, pytest.mark.sm90]

CFG = MoEConfig(512, 256, 16, 4, num_shared_experts=1, max_tokens_per_rank=32)


def _layers(n, pool, seed, cfg=CFG, **kw):
    return [
        gcmoe.MoELayer(cfg, "cuda", "sm90", pool=pool, name=f"layers.{i}.mlp", **kw).load(
            make_weights(cfg, seed + i, "cuda")
        )
        for i in range(n)
    ]


def _routes(n, t, seed, cfg=CFG):
    return [make_tokens(cfg, t, "uniform", seed + i, device="cuda")[1:] for i in range(n)]


def _chain(layers, routes, h):
    """Pre-norm residual blocks (without the norm the residual overflows within a few layers)."""
    for layer, (ids, w) in zip(layers, routes):
        h = h + layer(torch.nn.functional.rms_norm(h, (h.shape[-1],)), ids, w)
    return h


def _two_batch_step(plans, streams, ins, ranks, batches):
    """Virtual ranks' layers (plans[i][r]) as pre-norm residual blocks, every (micro-batch m, rank r) on its own
    stream forked from and joined back to the current one, each micro-batch's calls under gcmoe.micro_batch(m)."""
    main = torch.cuda.current_stream()
    outs = {}
    used = [streams[m, r] for m in batches for r in ranks]
    for m in batches:
        with gcmoe.micro_batch(m):
            for r in ranks:
                s = streams[m, r]
                s.wait_stream(main)
                with torch.cuda.stream(s):
                    h, routes = ins[m, r]
                    for layer, (ids, w) in zip(plans, routes):
                        h = h + layer[r].forward(torch.nn.functional.rms_norm(h, (h.shape[-1],)), ids, w, False)
                    outs[m, r] = h
    for s in used:
        main.wait_stream(s)
    return outs


def test_layers_of_one_shape_share_one_lane_per_stream_and_stay_exact():
    pool = gcmoe.LayerPool()
    shared = _layers(6, pool, 100)
    alone = [
        gcmoe.MoELayer(CFG, "cuda", "sm90", pool=gcmoe.LayerPool()).load(make_weights(CFG, 100 + i, "cuda"))
        for i in range(6)
    ]
    assert pool.describe()["lanes"] == 1
    one = pool.memory_bytes()
    assert one > 0
    x, _, _ = make_tokens(CFG, 7, "uniform", 1, device="cuda")
    routes = _routes(6, 7, 10)
    for a, b, (ids, w) in zip(shared, alone, routes):
        assert first_mismatch(a(x, ids, w), b(x, ids, w)) == ""
    assert first_mismatch(_chain(shared, routes, x), _chain(alone, routes, x)) == ""
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        y = _chain(shared, routes, x)
    torch.cuda.synchronize()
    assert first_mismatch(y, _chain(alone, routes, x)) == ""
    assert pool.describe()["lanes"] == 2 and pool.memory_bytes() == 2 * one
    gc.collect()
    del shared, a, b
    assert pool.describe()["lanes"] == 0, "the last dropped layer of a shape class frees its lanes"


def test_a_new_bucket_is_captured_on_first_use_without_a_device_sync():
    weights = make_weights(CFG, 7, "cuda")
    ref = gcmoe.MoELayer(CFG, "cuda", "sm90", pool=gcmoe.LayerPool()).load(weights)
    layer = gcmoe.MoELayer(CFG, "cuda", "sm90", pool=gcmoe.LayerPool()).load(weights)
    x, ids, w = make_tokens(CFG, 3, "uniform", 7, device="cuda")
    want = ref(x, ids, w)  # (the bucket's kernels compiled and loaded in this process)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(int(2e9))  # ~1 s of unrelated work
    t0 = time.perf_counter()
    y = layer(x, ids, w)  # this lane has no graph for bucket 4 yet
    waited = time.perf_counter() - t0
    torch.cuda.synchronize()
    assert waited < 0.3, f"the first call of a bucket waited {waited:.3f} s: a device sync?"
    assert first_mismatch(y, want) == ""


def test_a_captured_steps_bad_entry_is_named_by_one_check_without_a_sync():
    pool = gcmoe.LayerPool()
    layers = _layers(8, pool, 200)
    routes = _routes(8, 5, 20)
    x = torch.randn(5, CFG.hidden_size, dtype=torch.bfloat16, device="cuda")
    warm = torch.cuda.Stream()
    with torch.cuda.stream(warm):
        want = _chain(layers, routes, x)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = _chain(layers, routes, x)
    g.replay()
    torch.cuda.synchronize()
    assert torch.isfinite(want).all() and first_mismatch(y, want) == ""
    pool.check()
    ids3 = routes[3][0]
    good = ids3.clone()
    ids3[2, 1] = 99
    g.replay()
    torch.cuda.synchronize()
    assert torch.isfinite(y).all(), "a dropped slot leaves the step finite"
    with torch.cuda.stream(warm):
        torch.cuda._sleep(int(1e9))  # the device busy: check() must not wait for it
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=r"expert id 99 at token 2, slot 1.*layers\.3\.mlp"):
        pool.check()
    assert time.perf_counter() - t0 < 0.1
    pool.check()  # reported once
    ids3.copy_(good)
    y.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert first_mismatch(y, want) == ""
    pool.check()


def test_two_micro_batches_at_p2_in_one_captured_step_and_a_dead_peer():
    from gcmoe.backends import LayerOptions
    from gcmoe.backends.sm90 import virtual_ranks
    from gcmoe_gemm_sm90.config import Sm90Config

    p, n = 2, 3
    kcfg = Sm90Config(n_tile=8, stages=3, prefetch=2)  # the same kernels at every P: per token-slot bit-identical
    weights = [make_weights(CFG, 300 + i, "cuda") for i in range(n)]
    ref_pool = gcmoe.LayerPool()
    refs = [
        gcmoe.MoELayer(CFG, "cuda", "sm90", kernel_config=kcfg, comm_sms=16, pool=ref_pool).load(w) for w in weights
    ]
    pool = gcmoe.LayerPool()
    opts = LayerOptions(comm_sms=16, kernel_config=kcfg, timeout_ms=200, pool=pool)
    cfg_p = CFG.replace(ep_size=p)
    plans = [
        virtual_ranks(cfg_p, w, torch.device("cuda"), replace(opts, name=f"layers.{i}")) for i, w in enumerate(weights)
    ]
    assert len(pool.lanes()) == p * gcmoe.pool.MICRO_BATCHES
    streams = {(m, r): torch.cuda.Stream() for m in range(2) for r in range(p)}

    def inputs(seed):
        g = torch.Generator().manual_seed(seed)
        out = {}
        for m in range(2):
            for r in range(p):
                x = make_tokens(CFG, 4 + 3 * r + m, "uniform", generator=g, device="cuda")[0]
                out[m, r] = (
                    x,
                    [make_tokens(CFG, x.shape[0], "uniform", generator=g, device="cuda")[1:] for _ in plans],
                )
        return out

    def step(ins, ranks=range(p), batches=range(2)):
        return _two_batch_step(plans, streams, ins, ranks, batches)

    def want(ins):
        return {key: _chain(refs, routes, x) for key, (x, routes) in ins.items()}

    sets = [inputs(10 * k) for k in range(3)]
    wants = [want(ins) for ins in sets]
    static = {key: (x.clone(), [(i.clone(), w.clone()) for i, w in routes]) for key, (x, routes) in sets[0].items()}
    ys = step(sets[0])  # eager, both micro-batches in flight
    torch.cuda.synchronize()
    for key in ys:
        assert first_mismatch(ys[key], wants[0][key]) == "", f"eager {key}"
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=torch.cuda.Stream()):
        outs = step(static)
    for i in range(1000):
        k = i % len(sets)
        for key, (x, routes) in sets[k].items():
            static[key][0].copy_(x)
            for (di, dw), (si, sw) in zip(static[key][1], routes):
                di.copy_(si), dw.copy_(sw)
        g.replay()
        torch.cuda.synchronize()
        for key in outs:
            assert torch.equal(outs[key], wants[k][key]), f"replay {i}, micro-batch / rank {key}"
    pool.check()
    # a dead peer inside a captured step: rank 1 never runs micro-batch 0's step
    g0 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g0, stream=torch.cuda.Stream()):
        outs0 = step(static, ranks=[0], batches=[0])
    t0 = time.perf_counter()
    g0.replay()
    torch.cuda.synchronize()
    assert time.perf_counter() - t0 < 5.0
    assert outs0[0, 0].isnan().all(), "a failed wait: the step's output from that layer on is NaN"
    with pytest.raises(gcmoe.CommError, match=r"rank 1's ready tag.*layers\.0"):
        pool.check()
    pool.recover()
    g.replay()
    torch.cuda.synchronize()
    for key in outs:  # (the static inputs hold the last replay's set)
        assert torch.equal(outs[key], wants[999 % len(sets)][key]), f"after recover: {key}"
    pool.check()


def test_two_micro_batches_at_p2_whose_grids_could_fill_the_device_stay_exact():
    """Virtual P = 2, both micro-batches in flight (4 calls on one GPU), T = 256 of a shape whose dispatch grid alone
    (one CTA per ring block) would cover every SM and whose finalize grid (4 per SM) too: with every one of them
    waiting on a peer, uncapped, each call's spinning CTAs could starve the call its peers wait on. Within
    Sm90Plan.spin_caps they stay exact against world size 1, eager and captured, and no wait runs out."""
    from gcmoe.backends import LayerOptions
    from gcmoe.backends.sm90 import virtual_ranks
    from gcmoe_gemm_sm90.config import Sm90Config

    p, t = 2, 256
    cfg = MoEConfig(2048, 512, 32, 8, num_shared_experts=1, max_tokens_per_rank=t)
    kcfg = Sm90Config(n_tile=8, stages=3, prefetch=2)  # the same kernels at every P: per token-slot bit-identical
    weights = [make_weights(cfg, 400 + i, "cuda") for i in range(2)]
    refs = [gcmoe.MoELayer(cfg, "cuda", "sm90", kernel_config=kcfg, comm_sms=0).load(w) for w in weights]
    opts = LayerOptions(comm_sms=0, kernel_config=kcfg, timeout_ms=3000, pool=gcmoe.LayerPool())
    cfg_p = cfg.replace(ep_size=p)
    plans = [
        virtual_ranks(cfg_p, w, torch.device("cuda"), replace(opts, name=f"big.{i}")) for i, w in enumerate(weights)
    ]
    plan = plans[0][0]
    comm = plan.lane(torch.cuda.current_stream()).comm
    assert comm.dispatch_grid(t) == plan.sm_count and comm.finalize_grid(t) >= plan.sm_count  # uncapped: all SMs
    dispatch_cap, finalize_cap = plan.spin_caps(0, True)
    assert 2 * p * max(dispatch_cap, finalize_cap) < plan.sm_count
    streams = {(m, r): torch.cuda.Stream() for m in range(2) for r in range(p)}
    g = torch.Generator().manual_seed(7)
    ins = {}
    for m in range(2):
        for r in range(p):
            x = make_tokens(cfg, t - 19 * (2 * m + r), "uniform", generator=g, device="cuda")[0]
            ins[m, r] = (x, [make_tokens(cfg, x.shape[0], "uniform", generator=g, device="cuda")[1:] for _ in plans])
    want = {key: _chain(refs, routes, x) for key, (x, routes) in ins.items()}
    for _ in range(3):
        ys = _two_batch_step(plans, streams, ins, range(p), range(2))
        torch.cuda.synchronize()
        for key in ys:
            assert first_mismatch(ys[key], want[key]) == "", f"eager {key}"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=torch.cuda.Stream()):
        outs = _two_batch_step(plans, streams, ins, range(p), range(2))
    for i in range(20):
        graph.replay()
        torch.cuda.synchronize()
        for key in outs:
            assert torch.equal(outs[key], want[key]), f"replay {i}, micro-batch / rank {key}"
    opts.pool.check()


def test_eager_calls_launch_through_ctypes_and_fall_back_exactly():
    """The eager path's copy + graph launch (gcmoe_greenctx.launch, ctypes) against its slow path (cuda-python +
    CUDAGraph.replay, taken when the handle is missing or another device is current): bit-identical outputs over
    60+ calls that wrap the 64 staging slots, and from a fresh thread (its own current-context state)."""
    import threading

    pool = gcmoe.LayerPool()
    layers = _layers(3, pool, 300)
    x, _, _ = make_tokens(CFG, 5, "uniform", 3, device="cuda")
    routes = _routes(3, 5, 30)
    fast = [_chain(layers, routes, x) for _ in range(25)]
    plans = [layer.packed.plan for layer in layers]
    saved = [dict(p._execs) for p in plans]
    for p in plans:
        p._execs = dict.fromkeys(p._execs, 0)  # no handle: every call takes the slow path
    slow = [_chain(layers, routes, x) for _ in range(25)]
    for p, execs in zip(plans, saved):
        p._execs = execs
    box = {}
    th = threading.Thread(target=lambda: box.update(y=_chain(layers, routes, x), s=torch.cuda.current_stream()))
    th.start()
    th.join()
    box["s"].synchronize()
    torch.cuda.synchronize()
    assert all(torch.equal(a, fast[0]) for a in fast + slow + [box["y"]]), first_mismatch(slow[0], fast[0])
    assert torch.isfinite(fast[0]).all()
