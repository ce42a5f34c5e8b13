"""gcmoe.fused_experts, the serving engines' call shape, on a CPU (reference backend), against the layer and the
reference on fresh random problems:

- raw weights (vLLM's w13 / w2) give what a MoELayer on the same weights gives, bit for bit, per quantisation mode;
- expert parallelism vLLM's way: global ids + expert_map on a 2-rank split (contiguous and scattered placements):
  each rank's output equals the reference on its experts with the ids mapped by a plain Python loop (exact), and
  the ranks' outputs summed equal the unsplit call (the engine's all-reduce) within bf16 rounding;
- a PackedMoE handle (also with expert_map under torch.compile, fullgraph), inplace, bf16 routing weights, vLLM's
  interleaved "swigluoai" layout (where MoEConfig has the clamped activation);
- the pack cache: one pack per weight tensor, a re-pack after an in-place write or for a different tensor, entries
  that die with their tensor;
- every rejection a ValueError naming the argument.
"""

import gc

import pytest
import torch

import gcmoe
from gcmoe import engine
from gcmoe.layer import PackedMoE
from gcmoe_core.config import MoEConfig
from gcmoe_core.reference import MoEWeights, moe_reference
from gcmoe_core.testing import calc_diff, make_routing

H, INTER, E, K = 256, 128, 8, 3
CPU = torch.device("cpu")


def _problem(t: int, seed: int, e: int = E, k: int = K):
    """x bf16 [T, H], global ids [T, k] int32, fp32 weights, and float w13 [E, 2I, H] / w2 [E, H, I] (fresh)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, H, generator=g).to(torch.bfloat16)
    ids, w = make_routing(t, k, e, "uniform", g)
    w13 = torch.randn(e, 2 * INTER, H, generator=g) * H**-0.5
    w2 = torch.randn(e, H, INTER, generator=g) * INTER**-0.5
    return x, ids, w, w13, w2


def _cfg(e=E, k=K, quant="fp8_mxfp4") -> MoEConfig:
    return MoEConfig(H, INTER, e, k, quant=quant, masked_ids=True)


@pytest.fixture(autouse=True)
def _fresh_cache():
    engine.clear_cache()
    yield
    engine.clear_cache()


@pytest.mark.parametrize("quant", ["fp8_mxfp4", "bf16"])
def test_raw_weights_equal_the_layer(quant):
    x, ids, w, w13, w2 = _problem(11, seed=1)
    y = gcmoe.fused_experts(x, w13, w2, w, ids, quant=quant)  # vLLM's positional order
    weights = MoEWeights.from_float(w13, w2, quant=quant)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape and not y.isnan().any()
    assert torch.equal(y, gcmoe.MoELayer(_cfg(quant=quant)).load(weights)(x, ids, w))
    assert torch.equal(y, moe_reference(x, ids, w, weights))
    # bf16 routing weights are taken (cast to fp32 once: the same values)
    wb = w.to(torch.bfloat16)
    assert torch.equal(
        gcmoe.fused_experts(x, w13, w2, wb, ids, quant=quant), moe_reference(x, ids, wb.float(), weights)
    )


@pytest.mark.parametrize("placement", ["contiguous", "scattered"])
def test_expert_map_two_rank_split(placement):
    x, ids, w, w13, w2 = _problem(13, seed=2)
    experts = (
        torch.arange(E) if placement == "contiguous" else torch.randperm(E, generator=torch.Generator().manual_seed(3))
    )
    owned = [experts[: E // 2], experts[E // 2 :]]  # global ids each rank holds, in its local order
    full = gcmoe.fused_experts(x, w13, w2, w, ids)
    ys = []
    for mine in owned:
        expert_map = torch.full((E,), -1, dtype=torch.int32)
        expert_map[mine] = torch.arange(mine.numel(), dtype=torch.int32)
        w13_q, w2_q = w13[mine].contiguous(), w2[mine].contiguous()  # the rank's weights, as the engine holds them
        y = gcmoe.fused_experts(x, w13_q, w2_q, w, ids, expert_map=expert_map, global_num_experts=E)
        # the ids mapped independently: a Python loop over (token, slot), -1 where the expert is another rank's
        local = {int(g): j for j, g in enumerate(mine)}
        ids_q = torch.tensor([[local.get(int(g), -1) for g in row] for row in ids], dtype=torch.int32)
        assert (ids_q == -1).any() and (ids_q >= 0).any(), "both ranks must own some of the routed slots"
        assert torch.equal(y, moe_reference(x, ids_q, w, MoEWeights.from_float(w13_q, w2_q)))
        ys.append(y)
    summed = (ys[0].float() + ys[1].float()).to(torch.bfloat16)  # the engine's all-reduce of the partial sums
    assert calc_diff(summed, full) < 1e-5
    assert calc_diff(ys[0], full) > 1e-2  # (one rank alone is not the answer)


def test_expert_map_masked_global_ids_and_bad_global_ids():
    x, ids, w, w13, w2 = _problem(6, seed=4)
    expert_map = torch.tensor([0, 1, 2, 3, -1, -1, -1, -1], dtype=torch.int64)
    w13_q, w2_q = w13[:4].contiguous(), w2[:4].contiguous()
    padded = ids.clone()
    padded[5] = -1  # a padded CUDA-graph row: every slot masked
    y = gcmoe.fused_experts(x, w13_q, w2_q, w, padded, expert_map=expert_map)
    assert not y[5].any() and y[:5].any()
    for bad in (E, -2):
        b = ids.clone()
        b[0, 0] = bad
        with pytest.raises(ValueError, match=r"holds expert id 4, .*global id outside \[-1, 8\)"):
            gcmoe.fused_experts(x, w13_q, w2_q, w, b, expert_map=expert_map)
    broken = expert_map.clone()
    broken[int(ids[0, 0])] = 7  # an entry outside [-1, E_local)
    with pytest.raises(ValueError, match=r"holds expert id 7.*expert_map entry outside \[-1, E_local\)"):
        gcmoe.fused_experts(x, w13_q, w2_q, w, ids, expert_map=broken)


def test_handle_and_inplace():
    x, ids, w, w13, w2 = _problem(9, seed=5)
    packed = gcmoe.prepack(_cfg(), MoEWeights.from_float(w13, w2))
    want = gcmoe.moe(x, ids, w, packed)
    assert torch.equal(gcmoe.fused_experts(x, packed, None, w, ids), want)
    assert torch.equal(gcmoe.fused_experts(x, w13, w2, w, ids), want)  # raw weights: the same pack's arithmetic
    hs = x.clone()
    out = gcmoe.fused_experts(hs, packed, None, w, ids, inplace=True)
    assert out is hs and torch.equal(hs, want)
    out = gcmoe.fused_experts(x.clone(), w13, w2, w, ids, inplace=True)
    assert torch.equal(out, want)
    y = gcmoe.fused_experts(x, packed, None, w, ids)  # out of place: x untouched
    assert torch.equal(y, want) and not torch.equal(x, want)
    # a handle with the global ids of a split: expert_map on a handle of the rank's experts
    half = gcmoe.prepack(_cfg(e=E // 2), MoEWeights.from_float(w13[4:].contiguous(), w2[4:].contiguous()))
    expert_map = torch.tensor([-1] * 4 + [0, 1, 2, 3], dtype=torch.int32)
    ids_q = torch.where(ids >= 4, ids - 4, -1).to(torch.int32)
    assert torch.equal(
        gcmoe.fused_experts(x, half, None, w, ids, expert_map=expert_map, global_num_experts=E),
        gcmoe.moe(x, ids_q, w, half),
    )


def test_handle_with_expert_map_under_torch_compile():
    x, ids, w, w13, w2 = _problem(6, seed=9)
    half = gcmoe.prepack(_cfg(e=E // 2), MoEWeights.from_float(w13[:4].contiguous(), w2[:4].contiguous()))
    expert_map = torch.tensor([0, 1, 2, 3, -1, -1, -1, -1], dtype=torch.int32)

    def step(a, b, c, m):
        return gcmoe.fused_experts(a, half, None, b, c, expert_map=m, global_num_experts=E) * 2

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x, w, ids, expert_map), step(x, w, ids, expert_map))


def test_interleaved_swigluoai_matches_the_clamped_layer():
    x, ids, w, w13, w2 = _problem(7, seed=6)
    # vLLM's gpt-oss layout: rows gate 0, up 0, gate 1, up 1, ...
    w13_vllm = torch.stack((w13[:, :INTER], w13[:, INTER:]), dim=2).reshape(E, 2 * INTER, H)
    y = gcmoe.fused_experts(x, w13_vllm, w2, w, ids, activation="swigluoai")
    layer = gcmoe.MoELayer(_cfg().replace(activation="swiglu_clamped")).load_weights(w13, w2)
    assert torch.equal(y, layer(x, ids, w))
    assert calc_diff(y, gcmoe.fused_experts(x, w13, w2, w, ids)) > 1e-3  # (the activation is not silu's)
    with pytest.raises(ValueError, match="activation: 'silu' .* but the handle's layer has 'swiglu_clamped'"):
        gcmoe.fused_experts(x, layer.packed, None, w, ids)


def test_biases_as_vllm_passes_them_interleaved_with_the_cache_watching_them(monkeypatch):
    """w1_bias / w2_bias (vLLM's gpt-oss keywords, rows interleaved like w1's): the same as the clamped, biased layer
    loaded in gate-then-up order; a bias written in place is re-packed; biases with a handle are refused."""
    packs = CountingPrepack()
    monkeypatch.setattr(engine, "prepack", packs)
    x, ids, w, w13, w2 = _problem(6, seed=10)
    g = torch.Generator().manual_seed(11)
    b13, b2 = torch.randn(E, 2 * INTER, generator=g), torch.randn(E, H, generator=g) * 0.1
    inter = lambda t: torch.stack((t[:, :INTER], t[:, INTER:]), dim=2).reshape(t.shape[0], 2 * INTER, *t.shape[2:])
    y = gcmoe.fused_experts(x, inter(w13), w2, w, ids, activation="swigluoai", w1_bias=inter(b13), w2_bias=b2)
    cfg = _cfg().replace(activation="swiglu_clamped", has_bias=True)
    layer = gcmoe.MoELayer(cfg).load_weights(w13, w2, w13_bias=b13, w2_bias=b2)
    assert torch.equal(y, layer(x, ids, w))
    w13_i, b13_i = inter(w13), inter(b13)
    y1 = gcmoe.fused_experts(x, w13_i, w2, w, ids, activation="swigluoai", w1_bias=b13_i, w2_bias=b2)
    calls = packs.calls
    with torch.no_grad():
        b2.mul_(3.0)  # a bias reload (visible to the version counter)
    y2 = gcmoe.fused_experts(x, w13_i, w2, w, ids, activation="swigluoai", w1_bias=b13_i, w2_bias=b2)
    assert packs.calls == calls + 1 and torch.equal(y1, y) and not torch.equal(y2, y1)
    with pytest.raises(ValueError, match="w1_bias and w2_bias go together"):
        gcmoe.fused_experts(x, w13, w2, w, ids, w1_bias=b13)
    with pytest.raises(ValueError, match=r"w2_bias: must be a floating tensor of shape \(8, 256\)"):
        gcmoe.fused_experts(x, w13, w2, w, ids, w1_bias=b13, w2_bias=b2[:, :8])
    with pytest.raises(ValueError, match="w1_bias: must be None with a PackedMoE handle"):
        gcmoe.fused_experts(x, layer.packed, None, w, ids, activation="swigluoai", w1_bias=b13, w2_bias=b2)


class CountingPrepack:
    def __init__(self):
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return gcmoe.prepack(*args, **kwargs)


def test_pack_cache_repacks_what_changed_and_dies_with_the_tensor(monkeypatch):
    packs = CountingPrepack()
    monkeypatch.setattr(engine, "prepack", packs)
    x, ids, w, w13, w2 = _problem(5, seed=7)
    y = gcmoe.fused_experts(x, w13, w2, w, ids)
    assert torch.equal(gcmoe.fused_experts(x, w13, w2, w, ids), y) and packs.calls == 1  # cached
    with torch.no_grad():
        w13.mul_(-0.5)  # written in place (as a weight reload would): its version moves
    y2 = gcmoe.fused_experts(x, w13, w2, w, ids)
    assert packs.calls == 2 and torch.equal(y2, moe_reference(x, ids, w, MoEWeights.from_float(w13, w2)))
    assert calc_diff(y2, y) > 1e-2
    other = w2.clone()  # a different tensor with the same values: never the old pack
    assert torch.equal(gcmoe.fused_experts(x, w13, other, w, ids), y2) and packs.calls == 3
    gcmoe.fused_experts(x, w13, other, w, ids, quant="bf16")  # another option: another pack
    assert packs.calls == 4
    gcmoe.fused_experts(x, w13, other, w[:, :2].contiguous(), ids[:, :2].contiguous())  # top_k 2: another pack
    assert packs.calls == 5
    assert len(engine._PACKS) == 1 and len(engine._PACKS[w13]) == 4  # (the stale pack of (w13, w2) was dropped)
    del w13
    gc.collect()
    assert len(engine._PACKS) == 0, "a pack must not keep its weight tensor alive"


def test_what_the_cache_cannot_see_is_warned_once_and_cleared_by_clear_cache(monkeypatch):
    """A reload through .data (vLLM's weight loader) bypasses the version counter: the stale pack stays until
    clear_cache() — documented, and warned the first time a raw weight is packed."""
    monkeypatch.setattr(engine, "_WARNED", False)
    x, ids, w, w13, w2 = _problem(5, seed=9)
    with pytest.warns(UserWarning, match=r"clear_cache\(\) after it"):
        y = gcmoe.fused_experts(x, w13, w2, w, ids)
    new = torch.randn_like(w13) * H**-0.5
    w13.data.copy_(new)  # invisible to the cache
    assert torch.equal(gcmoe.fused_experts(x, w13, w2, w, ids), y)  # the old weights: what the docs warn about
    engine.clear_cache()
    y2 = gcmoe.fused_experts(x, w13, w2, w, ids)
    assert torch.equal(y2, moe_reference(x, ids, w, MoEWeights.from_float(new, w2)))


def test_rejections_are_value_errors_naming_the_argument():
    x, ids, w, w13, w2 = _problem(4, seed=8)
    packed = gcmoe.prepack(_cfg(), MoEWeights.from_float(w13, w2))
    call = gcmoe.fused_experts
    with pytest.raises(ValueError, match="apply_router_weight_on_input: True is not supported"):
        call(x, w13, w2, w, ids, apply_router_weight_on_input=True)
    with pytest.raises(ValueError, match=r"activation: 'gelu' is not supported; supported: 'silu'"):
        call(x, w13, w2, w, ids, activation="gelu")
    with pytest.raises(ValueError, match="w2: must be None when w1 is a PackedMoE handle"):
        call(x, packed, w2, w, ids)
    with pytest.raises(ValueError, match="hidden_states: must be a bf16"):
        call(x.half(), w13, w2, w, ids)
    with pytest.raises(ValueError, match=r"w2: shape \(8, 256, 64\) does not match w1"):
        call(x, w13, w2[..., :64], w, ids)
    with pytest.raises(ValueError, match="w1: must be a floating 3-D tensor"):
        call(x, w13[0], w2, w, ids)
    fp8 = torch.float8_e4m3fn  # an engine's FP8 weight without its block scales: codes, not values
    with pytest.raises(ValueError, match="w1: dtype must be bf16, fp16 or fp32"):
        call(x, w13.to(fp8), w2, w, ids, quant="bf16")
    with pytest.raises(ValueError, match="w2: dtype must be bf16, fp16 or fp32"):
        call(x, w13, w2.to(fp8), w, ids)
    with pytest.raises(ValueError, match="expert_map: dtype must be torch.int32 or torch.int64"):
        call(x, w13, w2, w, ids, expert_map=torch.arange(E).float())
    with pytest.raises(ValueError, match="expert_map: must be a 1-D int tensor"):
        call(x, w13, w2, w, ids, expert_map=torch.arange(E).view(2, 4))
    with pytest.raises(ValueError, match="global_num_experts: 16 but expert_map has 8 entries"):
        call(x, w13, w2, w, ids, expert_map=torch.arange(E), global_num_experts=16)
    with pytest.raises(ValueError, match="global_num_experts: 16 but the layer has E = 8 experts and no expert_map"):
        call(x, w13, w2, w, ids, global_num_experts=16)
    unmasked = gcmoe.prepack(_cfg().replace(masked_ids=False), MoEWeights.from_float(w13, w2))
    with pytest.raises(ValueError, match=r"expert_map: needs a handle built with MoEConfig\(..., masked_ids=True\)"):
        call(x, unmasked, None, w, ids, expert_map=torch.arange(E))
    ep = PackedMoE(MoEConfig(H, INTER, 16, K, ep_size=2, masked_ids=True), "sm90", CPU, (), plan=None)
    with pytest.raises(ValueError, match="expert_map: not with an ep_size > 1 handle"):
        call(x, ep, None, w, ids, expert_map=torch.arange(16))
    with pytest.raises(ValueError, match="T = 5 tokens exceeds max_tokens_per_rank = 4"):
        call(torch.cat((x, x[:1])), w13, w2, torch.cat((w, w[:1])), torch.cat((ids, ids[:1])), max_tokens_per_rank=4)
    bad = ids.clone()
    bad[0, 0] = E
    with pytest.raises(ValueError, match=r"topk_ids: holds expert id 8, out of range \[0, 8\)"):
        call(x, w13, w2, w, bad)
