"""The gpt-oss epilogue options of the sm90 kernels on the CPU: the kernel models (emulate_w1 / emulate_w2 with the
clamped activation and biases) on prepared rows equal the reference bit for bit; MoESm90 carries the biases and sets
the flags only for a layer that has them; the launches refuse bias operands without cfg.bias (and the reverse) or
of the wrong shape, before anything is compiled."""

from dataclasses import replace

import pytest
import torch

from gcmoe_core.config import MoEConfig
from gcmoe_core.grouping import group_rows, grouped_forward, prepare_activations
from gcmoe_core.reference import SWIGLU, Activation, MoEWeights, moe_reference
from gcmoe_core.testing import Case, make_problem
from gcmoe_gemm_sm90.config import Sm90Config
from gcmoe_gemm_sm90.ops import MoESm90, emulate_w1, emulate_w2, epilogue_flags, layer_config
from gcmoe_gemm_sm90.prepack import unpack_sm90

CFG = MoEConfig(512, 256, 8, 2, max_tokens_per_rank=64, activation="swiglu_clamped", has_bias=True)


def _biased(weights: MoEWeights, seed: int) -> MoEWeights:
    g = torch.Generator().manual_seed(seed)
    e, two_i, h = weights.w13.shape
    return MoEWeights(weights.w13, weights.w2, None, None, torch.randn(e, two_i, generator=g) * 4, torch.randn(e, h))


@pytest.mark.parametrize("routing", ["uniform", "one_expert", "half_empty"])
@pytest.mark.parametrize("act", [Activation("swiglu_clamped", 1.702, 7.0), Activation("swiglu_clamped", 0.9, 0.3)])
def test_kernel_models_with_clamp_and_biases_equal_the_reference(routing, act):
    x, ids, w, weights, _ = make_problem(Case(CFG.replace(has_bias=False), 13, routing, seed=3))
    weights = _biased(weights, 4)
    moe = MoESm90.from_weights(weights, act=act)
    w13, w2 = unpack_sm90(moe.w13), unpack_sm90(moe.w2)
    n_tile = moe.config_for(*ids.shape).n_tile
    seen = {}

    def run_w1(acts, lay):
        seen["route_w"] = acts.route_w
        return emulate_w1(w13, acts, lay, act, moe.w13_bias)

    y = grouped_forward(
        x,
        ids,
        w,
        moe.num_routed,
        0,
        n_tile,
        moe.hidden,
        run_w1,
        lambda hq, hs, lay, out: emulate_w2(w2, hq, hs, lay, out, seen["route_w"], moe.w2_bias),
    )
    want = moe_reference(x, ids, w, weights, act=act)
    assert torch.equal(y, want)
    assert not torch.equal(want, moe_reference(x, ids, w, MoEWeights(weights.w13, weights.w2), act=SWIGLU))


def test_moe_sm90_carries_biases_and_sets_the_flags_only_when_asked():
    _, _, _, weights, _ = make_problem(Case(CFG.replace(has_bias=False), 4, seed=1))
    plain = MoESm90.from_weights(weights)
    assert plain.epilogue == {} and len(plain.tensors()) == 4
    cfg = plain.config_for(8, 2)
    assert (cfg.activation, cfg.bias) == ("swiglu", False)
    gpt = MoESm90.from_weights(_biased(weights, 2), act=Activation.of(CFG))
    t = gpt.tensors()
    assert len(t) == 6 and t[4] is gpt.w13_bias and t[5] is gpt.w2_bias
    back = MoESm90.from_tensors(t, CFG.local_experts, Activation.of(CFG))
    assert torch.equal(back.w2_bias, gpt.w2_bias) and back.epilogue == gpt.epilogue
    k = gpt.config_for(8, 2)
    assert (k.activation, k.swiglu_alpha, k.swiglu_limit, k.bias) == ("swiglu_clamped", 1.702, 7.0, True)
    # the same configurations without the weights (what tools/gpu/precompile.py compiles ahead of a layer)
    shape = (gpt.num_routed, gpt.hidden, gpt.inter, gpt.num_shared)
    for t in (1, 5, 8, 32):
        assert layer_config(t, 2, *shape, epilogue=epilogue_flags(Activation.of(CFG), True)) == gpt.config_for(t, 2)
        assert layer_config(t, 2, *shape, epilogue=epilogue_flags(SWIGLU, False)) == plain.config_for(t, 2)
    gpt.cfg = Sm90Config(n_tile=16)  # a forced config gets the layer's epilogue flags too
    assert gpt.config_for(8, 2) == replace(Sm90Config(n_tile=16), **gpt.epilogue)
    with pytest.raises(ValueError, match="activation"):
        Sm90Config(activation="gelu")
    with pytest.raises(ValueError, match="swiglu_limit"):
        Sm90Config(swiglu_limit=0.0)


class Launched(Exception):
    pass


def test_bias_operands_go_with_cfg_bias(monkeypatch):
    monkeypatch.setenv("GCMOE_ARCH", "sm_90a")
    import gcmoe_gemm_sm90.ops as ops
    from gcmoe_gemm_sm90.ops import launch_w1, launch_w2

    def not_compiled(*args, **kwargs):
        raise Launched(args[0])

    monkeypatch.setattr(ops, "compiled", not_compiled)
    x, ids, w, weights, _ = make_problem(Case(CFG.replace(has_bias=False), 5, seed=1))
    moe = MoESm90.from_weights(_biased(weights, 1), act=Activation.of(CFG))
    cfg = replace(moe.config_for(5, 2), n_tile=8, prefetch=2)
    lay = group_rows(ids, CFG.num_experts, 8)
    acts = prepare_activations(x, w, lay, CFG.top_k)
    r, i = lay.rows, CFG.intermediate_size
    hq, hsT = torch.zeros(r, i, dtype=torch.uint8), torch.zeros(2 * i // 256, r)
    dst, src, comb = lay.src_slot, torch.zeros(r, 3, dtype=torch.int32), torch.zeros(1, dtype=torch.int64)

    def run_w1(c, bias):
        launch_w1(moe.w13, acts.x_rows, acts.sxT, acts.route_w, lay.offsets, lay.counts, hq, hsT, c, bias=bias)

    def run_w2(c, route_w, bias):
        launch_w2(moe.w2, hq, hsT, lay.offsets, lay.counts, dst, src, comb, c, None, route_w, bias)

    off = replace(cfg, bias=False)
    b13, b2, rw = moe.w13_bias, moe.w2_bias, acts.route_w
    for call in (
        lambda: run_w1(cfg, None),
        lambda: run_w1(off, b13),
        lambda: run_w2(cfg, rw, None),
        lambda: run_w2(cfg, None, b2),
        lambda: run_w2(off, rw, b2),
    ):
        with pytest.raises(ValueError, match="go with cfg.bias"):
            call()
    for call in (lambda: run_w1(cfg, b13[:, :-1]), lambda: run_w2(cfg, rw[:-1], b2), lambda: run_w2(cfg, rw, b2.t())):
        with pytest.raises(ValueError, match="must be contiguous fp32"):
            call()
    for call in (lambda: run_w1(cfg, b13), lambda: run_w2(cfg, rw, b2), lambda: run_w1(off, None)):
        with pytest.raises(Launched):
            call()
