"""MoEConfig(masked_ids=True) on the real sm90 path (gcmoe-comm's publish compiled with the option) and
gcmoe.fused_experts with expert_map on it, on fresh random inputs; the masked slots' routing weights are NaN
throughout (neither used nor checked):

- eager: against the reference with the masked slots zeroed (valid id, weight 0; 1e-3, the quantisation bound) and,
  bit for bit, against the same kernels given that zeroed routing (a masked slot adds the exact zero a zero-weight
  slot adds; the kernels compute every token column on its own);
- a caller's graph captured with unmasked routing and replayed with masks swapped in: each replay equal to the eager
  call on the same inputs, bit for bit;
- tokens with every slot masked: the shared expert's output alone, zeros without shared experts;
- errors: id = E and id = -2 still dropped on the device and raised at the next call (also from a captured replay,
  at layer.check()), a kept slot's NaN weight too; without the option a -1 is an error;
- fused_experts: two "ranks" (two world-size-1 packs of half the experts each) with global ids + expert_map: each
  equal to the layer on its experts with the ids mapped on the host, their sum to the unsplit call; captured and
  replayed with new routing.
"""

import pytest
import torch

import gcmoe
from gcmoe_core.config import MoEConfig
from gcmoe_core.reference import activation_input, combine_slots, moe_reference, shared_slot_rows
from gcmoe_core.testing import calc_diff, first_mismatch, make_tokens, make_weights

pytestmark = [pytest.mark.gpu, pytest.mark.sm90]

CFG = MoEConfig(
    hidden_size=512,
    intermediate_size=256,
    num_experts=16,
    top_k=4,
    num_shared_experts=1,
    max_tokens_per_rank=32,
    masked_ids=True,
)
ROUTINGS = ("uniform", "one_expert", "half_empty")


def _kernel_config():
    from gcmoe_gemm_sm90.config import Sm90Config

    return Sm90Config(n_tile=8, stages=3, prefetch=2)  # fixed kernels for the bit-for-bit comparisons


def _masked_tokens(cfg, t, routing, seed, fraction=0.3, all_masked=(0,)):
    """(x, ids with -1, weights NaN there) and the zeroed formulation (original ids, weight 0), on the GPU."""
    x, ids, w = make_tokens(cfg, t, routing, seed, device="cuda")
    g = torch.Generator().manual_seed(500 + seed)
    mask = (torch.rand(ids.shape, generator=g) < fraction).cuda()
    mask[list(all_masked)] = True
    return (x, ids.masked_fill(mask, -1), w.masked_fill(mask, float("nan"))), (x, ids, w.masked_fill(mask, 0.0))


def _shared_only(x, weights, quant="fp8_mxfp4"):
    rows = shared_slot_rows(activation_input(x, quant), weights, quant)
    return torch.zeros_like(x) if rows.shape[1] == 0 else combine_slots(rows)


def _layer(cfg, weights, **kw):
    return gcmoe.MoELayer(cfg, "cuda", "sm90", **kw).load(weights)


@pytest.mark.parametrize("shared", [0, 1])
@pytest.mark.parametrize("routing", ROUTINGS)
def test_eager_masked_slots(routing, shared):
    cfg = CFG.replace(num_shared_experts=shared)
    weights = make_weights(cfg, seed=1 + shared, device="cuda")
    layer = _layer(cfg, weights, kernel_config=_kernel_config())
    for seed, t in enumerate((1, 7, 32), start=10):  # buckets 1, 8, 32
        masked, zeroed = _masked_tokens(cfg, t, routing, seed)
        y = layer(*masked)
        assert not y.isnan().any(), f"T = {t}"
        assert calc_diff(y, moe_reference(*zeroed, weights)) < 1e-3, f"T = {t}"
        assert first_mismatch(y, layer(*zeroed)) == "", f"T = {t}: masked vs zero-weight slots"
        want0 = _shared_only(masked[0], weights)[0]
        if shared:
            assert calc_diff(y[0], want0) < 1e-3
        else:
            assert not y[0].any()
    layer.check()


def test_caller_graph_replayed_with_masks_swapped_in():
    weights = make_weights(CFG, seed=3, device="cuda")
    layer = _layer(CFG, weights, comm_sms=16)
    x, ids, w = make_tokens(CFG, 11, "uniform", 20, device="cuda")  # captured with nothing masked
    sx, sids, sw = x.clone(), ids.clone(), w.clone()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=torch.cuda.Stream()):
        out = layer(sx, sids, sw)
    for i in range(24):
        fraction = (0.0, 0.3, 1.0)[i % 3]  # none, some, every slot of every token
        masked, zeroed = _masked_tokens(CFG, 11, ROUTINGS[i % 3], 30 + i, fraction, all_masked=(i % 11,))
        for dst, src in zip((sx, sids, sw), masked):
            dst.copy_(src)
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert first_mismatch(out, layer(*masked)) == "", f"replay {i}"
        assert calc_diff(out, moe_reference(*zeroed, weights)) < 1e-3, f"replay {i}"
        if fraction == 1.0:
            assert calc_diff(out, _shared_only(masked[0], weights)) < 1e-3
    layer.check()


def test_all_masked_tokens_without_shared_experts_are_zero():
    cfg = CFG.replace(num_shared_experts=0)
    layer = _layer(cfg, make_weights(cfg, seed=4, device="cuda"))
    for t in (1, 5, 32):
        x, ids, w = make_tokens(cfg, t, "uniform", 40 + t, device="cuda")
        y = layer(x, torch.full_like(ids, -1), torch.full_like(w, float("nan")))
        torch.cuda.synchronize()
        assert torch.equal(y, torch.zeros_like(y)), f"T = {t}"
    layer.check()


def test_bad_ids_are_still_raised():
    weights = make_weights(CFG, seed=5, device="cuda")
    layer = _layer(CFG, weights)
    (x, ids_m, w_m), _ = _masked_tokens(CFG, 6, "uniform", 50)
    layer(x, ids_m, w_m)
    layer(x, ids_m, w_m)  # the previous call's masked slots raised nothing
    layer.check()
    for bad in (CFG.num_experts, -2):
        b = ids_m.clone()
        b[2, 1] = bad
        layer(x, b, w_m)  # checked on the device: this call returns, the next one raises
        with pytest.raises(ValueError, match=rf"topk_ids: holds expert id {bad} at token 2, slot 1"):
            layer(x, ids_m, w_m)
    w_nan = w_m.clone()
    t, j = (ids_m[1:] >= 0).nonzero()[0].tolist()  # a kept slot: its weight is still checked
    w_nan[1 + t, j] = float("nan")
    layer(x, ids_m, w_nan)
    with pytest.raises(ValueError, match="non-finite routing weight"):
        layer(x, ids_m, w_m)
    # from a caller's captured replay: raised at layer.check()
    sids = ids_m.clone()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=torch.cuda.Stream()):
        layer(x, sids, w_m)
    sids[1, 0] = CFG.num_experts
    g.replay()
    with pytest.raises(ValueError, match=rf"holds expert id {CFG.num_experts}"):
        layer.check()
    # without the option a -1 is an out-of-range id like any other
    plain = _layer(CFG.replace(masked_ids=False), weights)
    plain(x, ids_m, w_m.nan_to_num(0.0))
    with pytest.raises(ValueError, match="holds expert id -1"):
        plain(x, ids_m.clamp(min=0), w_m.nan_to_num(0.0))


def test_fused_experts_expert_map_on_sm90():
    e, k, h, inter = 16, 4, 512, 256
    g = torch.Generator().manual_seed(60)
    w13 = (torch.randn(e, 2 * inter, h, generator=g) * h**-0.5).cuda()
    w2 = (torch.randn(e, h, inter, generator=g) * inter**-0.5).cuda()
    cfg = MoEConfig(h, inter, e, k, max_tokens_per_rank=32, masked_ids=True)
    owned = [torch.arange(0, 16, 2), torch.arange(1, 16, 2)]  # a scattered placement
    ranks = []
    for mine in owned:
        expert_map = torch.full((e,), -1, dtype=torch.int32)
        expert_map[mine] = torch.arange(8, dtype=torch.int32)
        ranks.append((w13[mine.cuda()].contiguous(), w2[mine.cuda()].contiguous(), expert_map.cuda()))

    def call(x, ids, w, rank):
        w13_q, w2_q, expert_map = ranks[rank]
        return gcmoe.fused_experts(
            x, w13_q, w2_q, w, ids, expert_map=expert_map, global_num_experts=e, max_tokens_per_rank=32, backend="sm90"
        )

    for seed, t in enumerate((3, 16), start=61):
        x, ids, w = make_tokens(cfg, t, "uniform", seed, device="cuda")
        full = gcmoe.fused_experts(x, w13, w2, w, ids, max_tokens_per_rank=32, backend="sm90")
        ys = [call(x, ids, w, r) for r in range(2)]
        for r, mine in enumerate(owned):
            local = {int(gid): j for j, gid in enumerate(mine)}
            ids_r = torch.tensor([[local.get(int(gid), -1) for gid in row] for row in ids.cpu()], dtype=torch.int32)
            layer = _layer(cfg.replace(num_experts=8), gcmoe.MoEWeights.from_float(*ranks[r][:2]))
            assert first_mismatch(ys[r], layer(x, ids_r.cuda(), w)) == "", f"T = {t}, rank {r}"
        assert calc_diff((ys[0].float() + ys[1].float()).to(torch.bfloat16), full) < 1e-4
    # the engine's capture: the mapping gather and the layer both in the graph, replayed with new routing
    x, ids, w = make_tokens(cfg, 9, "uniform", 70, device="cuda")
    call(x, ids, w, 0)  # packed eagerly first (an engine's warm-up run)
    sx, sids, sw = x.clone(), ids.clone(), w.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=torch.cuda.Stream()):
        out = call(sx, sids, sw, 0)
    for i in range(8):
        nx, nids, nw = make_tokens(cfg, 9, ROUTINGS[i % 3], 80 + i, device="cuda")
        sx.copy_(nx), sids.copy_(nids), sw.copy_(nw)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert first_mismatch(out, call(nx, nids, nw, 0)) == "", f"replay {i}"
