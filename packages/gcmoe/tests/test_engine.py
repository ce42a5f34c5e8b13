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
- vLLM's positional order (all twelve) and its quantisation arguments, as keywords or through a quant_config;
- quantised engine weights: gpt-oss MXFP4 blocks taken bit for bit (the pack holds the caller's bytes), DeepSeek-V3
  FP8 128x128 blocks dequantised once (against a block-by-block loop), both watched by the cache with their scales;
- fp16 / fp32 activations and out_dtype, out=, routed_scaling_factor, apply_router_weight_on_input (top-1);
- DeepEP's masked layout (fused_experts_masked): valid rows against the reference, rows past masked_m zero even
  when they hold NaN;
- a trainable router (grad mode on) refused with one ValueError, eager and under torch.compile, and by the op;
- every rejection a ValueError naming the argument.
"""

import gc
from types import SimpleNamespace

import pytest
import torch

import gcmoe
from gcmoe import engine
from gcmoe.layer import PackedMoE
from gcmoe_core.config import MoEConfig
from gcmoe_core.formats import random_mxfp4
from gcmoe_core.reference import Activation, MoEWeights, moe_reference
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


def _interleave(t: torch.Tensor) -> torch.Tensor:
    """Gate rows then up rows -> vLLM's gpt-oss rows: gate 0, up 0, gate 1, up 1, ..."""
    i = t.shape[1] // 2
    return torch.stack((t[:, :i], t[:, i:]), dim=2).reshape(t.shape[0], 2 * i, *t.shape[2:])


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
    y = gcmoe.fused_experts(x, _interleave(w13), w2, w, ids, activation="swigluoai")
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
    inter = _interleave
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
    with pytest.raises(ValueError, match="apply_router_weight_on_input: True needs top-1 routing .*got k = 3"):
        call(x, w13, w2, w, ids, apply_router_weight_on_input=True)
    with pytest.raises(ValueError, match=r"activation: 'gelu' is not supported; supported: 'silu'"):
        call(x, w13, w2, w, ids, activation="gelu")
    with pytest.raises(ValueError, match="w2: must be None when w1 is a PackedMoE handle"):
        call(x, packed, w2, w, ids)
    with pytest.raises(ValueError, match="hidden_states: must be a bf16, fp16 or fp32 \\[T, H\\] tensor"):
        call(x.to(torch.float64), w13, w2, w, ids)
    with pytest.raises(ValueError, match=r"w2: shape \(8, 256, 64\) does not match w1"):
        call(x, w13, w2[..., :64], w, ids)
    with pytest.raises(ValueError, match="w1: must be a 3-D tensor"):
        call(x, w13[0], w2, w, ids)
    fp8 = torch.float8_e4m3fn  # an engine's FP8 weight without its block scales: codes, not values
    with pytest.raises(ValueError, match="w1_scale: required with torch.float8_e4m3fn w1"):
        call(x, w13.to(fp8), w2, w, ids, quant="bf16")
    with pytest.raises(ValueError, match="w2: dtype must be bf16, fp16, fp32, uint8 .MXFP4 blocks. or float8_e4m3fn"):
        call(x, w13, w2.to(torch.int8), w, ids)
    with pytest.raises(ValueError, match="w2: is torch.float8_e4m3fn but w1 is torch.float32"):
        call(x, w13, w2.to(fp8), w, ids, w2_scale=torch.ones(E, 2, 1))
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


# ------------------------------------------------------------------------------------------- the wider call contract
def test_vllm_positional_order_and_its_quantisation_arguments():
    """vLLM's twelve positional parameters in its order (inplace, activation, apply_router_weight_on_input,
    global_num_experts, expert_map, quant_config, allow_deep_gemm); the quantisation arguments gcmoe cannot honour
    refused by name, as keywords and through a quant_config alike."""
    x, ids, w, w13, w2 = _problem(5, seed=20)
    expert_map = torch.arange(E, dtype=torch.int32)
    want = gcmoe.fused_experts(x, w13, w2, w, ids)
    assert torch.equal(gcmoe.fused_experts(x, w13, w2, w, ids, False, "silu", False, E, expert_map, None, True), want)
    hs = x.clone()
    assert gcmoe.fused_experts(hs, w13, w2, w, ids, True, "silu", False, -1, None, SimpleNamespace()) is hs
    assert torch.equal(hs, want)
    refused = {
        "use_int8_w8a8": True, "use_int8_w8a16": True, "use_int4_w4a16": True, "per_channel_quant": True,
        "w1_zp": torch.zeros(1), "w2_zp": torch.zeros(1), "a1_scale": torch.ones(1), "a2_scale": torch.ones(1),
    }  # fmt: skip
    for name, value in refused.items():
        with pytest.raises(ValueError, match=f"fused_experts: {name}: .* is not supported: gcmoe quantises"):
            gcmoe.fused_experts(x, w13, w2, w, ids, **{name: value})
        attr = "per_act_token_quant" if name == "per_channel_quant" else name  # vLLM's FusedMoEQuantConfig name
        with pytest.raises(ValueError, match=f"fused_experts: {name}: .* is not supported"):
            gcmoe.fused_experts(x, w13, w2, w, ids, quant_config=SimpleNamespace(**{attr: value}))
    with pytest.raises(TypeError, match="unexpected keyword argument 'use_int2'"):
        gcmoe.fused_experts(x, w13, w2, w, ids, use_int2=True)
    with pytest.raises(ValueError, match="w1_bias: given both as a keyword and in quant_config"):
        gcmoe.fused_experts(x, w13, w2, w, ids, quant_config=SimpleNamespace(), w1_bias=torch.zeros(E, 2 * INTER))
    with pytest.raises(ValueError, match=r"block_shape: \[128, 128\] is not supported: only \[128, 128\], with float8"):
        gcmoe.fused_experts(x, w13, w2, w, ids, block_shape=[128, 128])
    with pytest.raises(ValueError, match="use_fp8_w8a8: True, but w1 is torch.float32"):
        gcmoe.fused_experts(x, w13, w2, w, ids, use_fp8_w8a8=True)
    with pytest.raises(ValueError, match="w1_scale: given, but w1 is torch.float32 .unquantised."):
        gcmoe.fused_experts(x, w13, w2, w, ids, w1_scale=torch.ones(E, 2, 2))
    packed = gcmoe.prepack(_cfg(), MoEWeights.from_float(w13, w2))
    with pytest.raises(ValueError, match="w1_scale: must be None with a PackedMoE handle"):
        gcmoe.fused_experts(x, packed, None, w, ids, w1_scale=torch.ones(1))


class CapturingPrepack(CountingPrepack):
    def __call__(self, cfg, weights, *args, **kwargs):
        self.weights = weights
        return super().__call__(cfg, weights, *args, **kwargs)


def test_mxfp4_blocks_as_gpt_oss_holds_them_are_taken_bit_for_bit(monkeypatch):
    """gpt-oss / vLLM MXFP4: uint8 blocks [E, N, K/2] + e8m0 [E, N, K/32], rows interleaved ("swigluoai"), biases,
    all through a quant_config: the pack holds the caller's bytes (de-interleaved), the output is the clamped, biased
    layer's on the same MXFP4 tensors; quant="bf16" dequantises them exactly; a scale written in place re-packs."""
    packs = CapturingPrepack()
    monkeypatch.setattr(engine, "prepack", packs)
    x, ids, w, _, _ = _problem(6, seed=21)
    g = torch.Generator().manual_seed(22)
    w13, w2 = random_mxfp4((E, 2 * INTER, H), g, rms=H**-0.5), random_mxfp4((E, H, INTER), g, rms=INTER**-0.5)
    b13, b2 = torch.randn(E, 2 * INTER, generator=g) * 0.1, torch.randn(E, H, generator=g) * 0.1
    blocks13, scales13 = _interleave(w13.packed), _interleave(w13.scale)  # as the engine holds them
    qc = SimpleNamespace(w1_scale=scales13, w2_scale=w2.scale, w1_bias=_interleave(b13), w2_bias=b2)
    y = gcmoe.fused_experts(x, blocks13, w2.packed, w, ids, activation="swigluoai", quant_config=qc)
    held = packs.weights
    assert torch.equal(held.w13.packed, w13.packed) and torch.equal(held.w13.scale, w13.scale)
    assert torch.equal(held.w2.packed, w2.packed) and held.w2.packed.data_ptr() != w2.packed.data_ptr()  # a copy
    cfg = _cfg().replace(activation="swiglu_clamped", has_bias=True)
    assert torch.equal(y, gcmoe.MoELayer(cfg).load_mxfp4(w13, w2, w13_bias=b13, w2_bias=b2)(x, ids, w))
    y_bf16 = gcmoe.fused_experts(x, blocks13, w2.packed, w, ids, activation="swigluoai", quant_config=qc, quant="bf16")
    exact = MoEWeights.from_float(w13.dequantize(), w2.dequantize(), quant="bf16", w13_bias=b13, w2_bias=b2)
    assert torch.equal(y_bf16, moe_reference(x, ids, w, exact, quant="bf16", act=Activation("swiglu_clamped")))
    calls = packs.calls
    assert torch.equal(gcmoe.fused_experts(x, blocks13, w2.packed, w, ids, activation="swigluoai", quant_config=qc), y)
    assert packs.calls == calls  # cached
    scales13.sub_(1)  # every weight of w1 halved, through its scales: watched like the weights
    y2 = gcmoe.fused_experts(x, blocks13, w2.packed, w, ids, activation="swigluoai", quant_config=qc)
    assert packs.calls == calls + 1 and calc_diff(y2, y) > 1e-3
    with pytest.raises(ValueError, match=r"w2: scale shape \(8, 256, 2\) != \(8, 256, 4\)"):
        gcmoe.fused_experts(x, blocks13, w2.packed, w, ids, w1_scale=scales13, w2_scale=w2.scale[..., :2])
    with pytest.raises(ValueError, match="w2_scale: required with torch.uint8 w2"):
        gcmoe.fused_experts(x, blocks13, w2.packed, w, ids, w1_scale=scales13)


def _fp8_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [E, N, K] -> DeepSeek-V3's FP8 weight: e4m3 [E, N, K] + float32 scale_inv per 128x128 block (amax/448)."""
    e, n, k = w.shape
    nb, kb = -(-n // 128), -(-k // 128)
    scale = torch.zeros(e, nb, kb)
    q = torch.empty(e, n, k, dtype=torch.float8_e4m3fn)
    for i in range(nb):
        for j in range(kb):
            block = w[:, i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]
            scale[:, i, j] = block.abs().amax(dim=(1, 2)) / 448
            q[:, i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] = (block / scale[:, i, j, None, None]).to(q.dtype)
    return q, scale


def _fp8_values(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The FP8 weight's values, block by block (fp32 products)."""
    out = torch.empty(q.shape)
    for i in range(scale.shape[1]):
        for j in range(scale.shape[2]):
            rows, cols = slice(i * 128, (i + 1) * 128), slice(j * 128, (j + 1) * 128)
            out[:, rows, cols] = q[:, rows, cols].float() * scale[:, i, j, None, None]
    return out


@pytest.mark.parametrize("quant", ["fp8_mxfp4", "bf16"])
def test_fp8_block_weights_as_deepseek_v3_holds_them(quant):
    """FP8 e4m3 weights + float32 scale_inv [E, ceil(N/128), ceil(K/128)] (I = 96: a partial block), keywords as
    vLLM's older signature names them: dequantised once, then packed like float weights of those values."""
    inter = 96
    g = torch.Generator().manual_seed(23)
    x, ids, w, _, _ = _problem(6, seed=24)
    q13, s13 = _fp8_blocks(torch.randn(E, 2 * inter, H, generator=g) * H**-0.5)
    q2, s2 = _fp8_blocks(torch.randn(E, H, inter, generator=g) * inter**-0.5)
    assert s13.shape == (E, 2, 2) and s2.shape == (E, 2, 1)
    y = gcmoe.fused_experts(
        x, q13, q2, w, ids, use_fp8_w8a8=True, w1_scale=s13, w2_scale=s2, block_shape=[128, 128], quant=quant
    )
    weights = MoEWeights.from_float(_fp8_values(q13, s13), _fp8_values(q2, s2), quant=quant)
    assert torch.equal(y, gcmoe.MoELayer(MoEConfig(H, inter, E, K, quant=quant)).load(weights)(x, ids, w))
    with pytest.raises(ValueError, match=r"w1_scale: must be float32 \(8, 2, 2\) \(a scale_inv per 128x128 block\)"):
        gcmoe.fused_experts(x, q13, q2, w, ids, w1_scale=s13[:, :1], w2_scale=s2)
    with pytest.raises(ValueError, match=r"block_shape: \[1, 128\] is not supported"):
        gcmoe.fused_experts(x, q13, q2, w, ids, w1_scale=s13, w2_scale=s2, block_shape=[1, 128])


def test_output_dtype_out_and_routed_scaling_factor():
    x, ids, w, w13, w2 = _problem(7, seed=25)
    ref = moe_reference(x, ids, w, MoEWeights.from_float(w13, w2))  # bf16
    for dtype in (torch.float16, torch.float32):
        y = gcmoe.fused_experts(x.to(dtype), w13, w2, w, ids)  # (x is bf16-valued: the cast back is exact)
        assert y.dtype == dtype and torch.equal(y, ref.to(dtype))
    assert torch.equal(gcmoe.fused_experts(x, w13, w2, w, ids, out_dtype=torch.float16), ref.half())
    out = torch.full((7, H), float("nan"), dtype=torch.float16)
    assert gcmoe.fused_experts(x.half(), w13, w2, w, ids, out=out) is out and torch.equal(out, ref.half())
    hs = x.half()
    assert gcmoe.fused_experts(hs, w13, w2, w, ids, inplace=True) is hs and torch.equal(hs, ref.half())
    y = gcmoe.fused_experts(x, w13, w2, w, ids, routed_scaling_factor=2.5)  # DeepSeek-V3's: the output times it
    assert torch.equal(y, (ref.float() * 2.5).to(torch.bfloat16)) and not torch.equal(y, ref)
    assert torch.equal(gcmoe.fused_experts(x, w13, w2, w, ids, routed_scaling_factor=None), ref)
    with pytest.raises(ValueError, match=r"out: must be a torch.bfloat16 tensor of shape \(7, 256\) on cpu, got .*"):
        gcmoe.fused_experts(x, w13, w2, w, ids, out=out)
    with pytest.raises(ValueError, match=r"out: must be .* got torch.bfloat16 \(6, 256\) on cpu"):
        gcmoe.fused_experts(x, w13, w2, w, ids, out=x[:6].clone())
    with pytest.raises(ValueError, match="inplace: writes into hidden_states .*not with out= or another out_dtype"):
        gcmoe.fused_experts(x, w13, w2, w, ids, inplace=True, out_dtype=torch.float32)
    with pytest.raises(ValueError, match="out_dtype: must be torch.bfloat16, torch.float16 or torch.float32"):
        gcmoe.fused_experts(x, w13, w2, w, ids, out_dtype=torch.int32)
    with pytest.raises(ValueError, match="routed_scaling_factor: must be a finite number, got nan"):
        gcmoe.fused_experts(x, w13, w2, w, ids, routed_scaling_factor=float("nan"))
    shared = MoEConfig(H, INTER, E, K, num_shared_experts=1, masked_ids=True)
    packed = gcmoe.prepack(shared, MoEWeights.from_float(w13, w2, w13[:1], w2[:1]))
    with pytest.raises(ValueError, match="routed_scaling_factor: not with a handle's shared experts"):
        gcmoe.fused_experts(x, packed, None, w, ids, routed_scaling_factor=2.5)


def test_apply_router_weight_on_input_top1():
    """vLLM's top-1 form (Llama 4): x times its weight (fp32, rounded once to bf16), then weight 1."""
    x, ids, _, w13, w2 = _problem(6, seed=26, k=1)
    w = torch.rand(6, 1, generator=torch.Generator().manual_seed(30)) + 0.5  # (top-1 routing normalises to 1)
    scaled = (x.float() * w).to(torch.bfloat16)
    weights = MoEWeights.from_float(w13, w2)
    y = gcmoe.fused_experts(x, w13, w2, w, ids, apply_router_weight_on_input=True)
    assert torch.equal(y, moe_reference(scaled, ids, torch.ones_like(w), weights))
    assert calc_diff(y, gcmoe.fused_experts(x, w13, w2, w, ids)) > 1e-4  # (not where the weight goes otherwise)
    packed = gcmoe.prepack(_cfg(k=1), weights)
    assert torch.equal(gcmoe.fused_experts(x, packed, None, w, ids, False, "silu", True), y)
    bad = w.clone()
    bad[2, 0] = float("inf")
    with pytest.raises(ValueError, match="topk_weights: holds a non-finite routing weight"):
        gcmoe.fused_experts(x, w13, w2, bad, ids, apply_router_weight_on_input=True)


def test_masked_layout_for_deepep_low_latency():
    """hidden_states [E_local, max_tokens, H] + masked_m: each valid row through its expert (weight 1), rows past
    masked_m zero though they hold NaN; fp16 in / out, out=, a top-1 handle; the refusals."""
    m = 5
    g = torch.Generator().manual_seed(27)
    _, _, _, w13, w2 = _problem(1, seed=28)
    masked_m = torch.tensor([5, 0, 2, 1, 5, 3, 0, 4], dtype=torch.int32)
    valid = torch.arange(m)[None, :] < masked_m[:, None]
    hx = torch.randn(E, m, H, generator=g).to(torch.bfloat16)
    hx[~valid] = float("nan")  # DeepEP leaves the rows past masked_m as they were
    y = gcmoe.fused_experts_masked(hx, w13, w2, masked_m)
    rows, experts = hx[valid], torch.arange(E).repeat_interleave(masked_m).to(torch.int32)[:, None]
    ref = moe_reference(rows, experts, torch.ones(rows.shape[0], 1), MoEWeights.from_float(w13, w2))
    assert y.shape == hx.shape and torch.equal(y[valid], ref) and not y[~valid].any()
    out = torch.full((E, m, H), float("nan"), dtype=torch.float16)
    assert gcmoe.fused_experts_masked(hx.half(), w13, w2, masked_m.long(), out=out) is out
    assert torch.equal(out, y.half())
    packed = gcmoe.prepack(_cfg(k=1).replace(max_tokens_per_rank=E * m), MoEWeights.from_float(w13, w2))
    assert torch.equal(gcmoe.fused_experts_masked(hx, packed, None, masked_m), y)
    call = gcmoe.fused_experts_masked
    with pytest.raises(ValueError, match=r"w1: a handle for the masked form needs MoEConfig\(num_experts=8, top_k=1"):
        call(hx, gcmoe.prepack(_cfg(), MoEWeights.from_float(w13, w2)), None, masked_m)
    with pytest.raises(ValueError, match="hidden_states: holds rows of 4 experts but w1 has 8"):
        call(hx[:4], w13, w2, masked_m[:4])
    with pytest.raises(ValueError, match=r"hidden_states: must be a \[E_local, max_tokens, H\] tensor"):
        call(hx[0], w13, w2, masked_m)
    with pytest.raises(ValueError, match=r"masked_m: must be an int32 / int64 tensor \[8\] on cpu, got torch.float32"):
        call(hx, w13, w2, masked_m.float())
    with pytest.raises(ValueError, match=r"out: must be a contiguous tensor of shape \(8, 5, 256\)"):
        call(hx, w13, w2, masked_m, out=out.transpose(0, 1).contiguous().transpose(0, 1))
    with pytest.raises(ValueError, match="expert_map: does not apply to fused_experts_masked"):
        call(hx, w13, w2, masked_m, expert_map=torch.arange(E))


def test_a_trainable_router_is_refused_eager_and_under_torch_compile():
    """Grad mode on and routing weights that require grad: one ValueError, eager and compiled (fullgraph=True
    carries it in dynamo's error); the op itself refuses (a layer's call traced by torch.compile); no_grad runs."""
    x, ids, _, w13, w2 = _problem(4, seed=29)
    packed = gcmoe.prepack(_cfg(), MoEWeights.from_float(w13, w2))
    router = torch.nn.Linear(H, E, dtype=torch.bfloat16)

    def step(a, b):
        weights = torch.softmax(router(a).float(), dim=-1).gather(1, b.long())
        return gcmoe.fused_experts(a, packed, None, weights, b)

    message = r"topk_weights: requires grad, but the MoE operator has no backward .*torch.no_grad\(\)"
    with pytest.raises(ValueError, match="gcmoe: " + message):
        step(x, ids)
    with pytest.raises(ValueError, match="gcmoe: " + message):
        torch.compile(step, backend="eager")(x, ids)
    with pytest.raises(Exception, match=message):
        torch.compile(step, backend="eager", fullgraph=True)(x, ids)
    with torch.no_grad():
        y = step(x, ids)
    assert not y.requires_grad and y.any()
    with pytest.raises(ValueError, match="gcmoe: hidden_states: requires grad"):
        gcmoe.fused_experts(x.float().requires_grad_(), packed, None, torch.ones(4, K), ids)
    w = torch.ones(4, K, requires_grad=True)
    with pytest.raises(ValueError, match="gcmoe: topk_weights: requires grad"):
        torch.ops.gcmoe.moe_forward(x, ids, w, list(packed.tensors), packed.handle, True)
