"""gpt-oss on the CPU: the clamped SwiGLU with biases and the H / I padding at load.

- the reference (MoELayer, reference backend, H and I padded internally) against an independent float64 gpt-oss
  expert block written here from the formula: calc_diff <= 1e-6 on the bf16 path (the block rounds where a bf16
  layer stores: h, each slot's row, y), <= 1e-3 with the FP8 x MXFP4 quantisation model (the block unquantised);
- padding is exact: the layer (padded internally) equals the fp64 loop on the unpadded weights bit for bit (bf16
  path), a padded intermediate channel is exactly zero after the clamped activation with biases for any input,
  and the FP8 block scales of the intermediate are the unpadded layer's (partial last block);
- the emulated sm90 pipeline (ring dispatch, kernel models, scatter, finalize) equals the reference bit for bit;
- config and weight validation (ValueError naming the argument).
"""

from dataclasses import dataclass

import pytest
import torch

import gcmoe
from gcmoe_core.config import MODEL_SHAPES, MoEConfig
from gcmoe_core.formats import fp8_scale_for_amax
from gcmoe_core.reference import Activation, MoEWeights, activation_input, moe_reference_loop_fp64, w1_reference
from gcmoe_core.testing import calc_diff, make_tokens

ALPHA, LIMIT = 1.702, 7.0


@dataclass(frozen=True)
class Case:
    hidden: int
    inter: int
    experts: int
    top_k: int
    tokens: int
    routing: str = "uniform"
    seed: int = 0

    def cfg(self, quant: str = "fp8_mxfp4") -> MoEConfig:
        return MoEConfig(
            self.hidden,
            self.inter,
            self.experts,
            self.top_k,
            max_tokens_per_rank=32,
            quant=quant,
            activation="swiglu_clamped",
            has_bias=True,
        )


# H, I off the kernels' multiples (padded 2880 -> 3072 / 2944 like gpt-oss, smaller here), and one already aligned
CASES = [
    Case(320, 192, 8, 2, 5, seed=1),
    pytest.param(Case(2880, 2880, 4, 4, 3, "one_expert", seed=2), marks=pytest.mark.slow),  # the real H, I
    Case(384, 160, 6, 3, 9, "half_empty", seed=3),
    Case(512, 256, 8, 4, 7, seed=4),
]


def gpt_oss_float_weights(case: Case, seed: int):
    """w13 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I] ~ N(0, 1/fan_in); biases large enough that a fair
    share of gate / up values fall outside +-limit (so the clamps matter)."""
    g = torch.Generator().manual_seed(seed)
    e, h, i = case.experts, case.hidden, case.inter
    w13 = torch.randn(e, 2 * i, h, generator=g) * h**-0.5
    w2 = torch.randn(e, h, i, generator=g) * i**-0.5
    b13 = torch.randn(e, 2 * i, generator=g) * 4.0
    b2 = torch.randn(e, h, generator=g)
    return w13, w2, b13, b2


def gpt_oss_block_fp64(x, ids, route_w, w13, w2, b13, b2, bf16_points: bool = False):
    """Independent float64 gpt-oss MoE block, from the formula: per token t and slot j on expert e,
    gu = W13_e x + b13_e; gate, up = gu[:I], gu[I:]; gate = min(gate, limit); up = clamp(up, -limit, limit);
    act = (up + 1) * gate * sigmoid(alpha * gate); y_t += w_tj * (W2_e act + b2_e). bf16_points: round where a
    bf16 layer stores (w * act, each slot's row, y) — the bf16 path's storage, not its arithmetic."""

    def store(v):
        return v.to(torch.bfloat16).double() if bf16_points else v

    x = x.double()
    i = w13.shape[1] // 2
    y = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gu = w13[e].double() @ x[t] + b13[e].double()
            gate = torch.minimum(gu[:i], torch.tensor(LIMIT, dtype=torch.float64))
            up = torch.maximum(torch.minimum(gu[i:], torch.tensor(LIMIT)), torch.tensor(-LIMIT)).double()
            act = (up + 1.0) * gate / (1.0 + torch.exp(-ALPHA * gate))
            wt = float(route_w[t, j])
            y[t] += store(w2[e].double() @ store(wt * act) + wt * b2[e].double())
    return store(y)


def _problem(case: Case, quant: str):
    cfg = case.cfg(quant)
    x, ids, w = make_tokens(cfg, case.tokens, case.routing, seed=case.seed)
    return cfg, x, ids, w, gpt_oss_float_weights(case, case.seed + 100)


@pytest.mark.parametrize(("quant", "tol"), [("bf16", 1e-6), ("fp8_mxfp4", 1e-3)])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"H{c.hidden}-I{c.inter}-E{c.experts}-k{c.top_k}-{c.routing}")
def test_reference_matches_independent_gpt_oss_block(case, quant, tol):
    cfg, x, ids, w, (w13, w2, b13, b2) = _problem(case, quant)
    layer = gcmoe.MoELayer(cfg, "cpu").load_weights(w13, w2, w13_bias=b13, w2_bias=b2)
    y = layer(x, ids, w)
    assert y.shape == (case.tokens, case.hidden) and y.dtype == torch.bfloat16
    # the independent block sees the weights as the layer holds them (bf16 or MXFP4, dequantised exactly)
    held = MoEWeights.from_float(w13, w2, quant=quant)
    wq13, wq2 = (t.dequantize() if quant == "fp8_mxfp4" else t.float() for t in (held.w13, held.w2))
    want = gpt_oss_block_fp64(x.float(), ids, w, wq13, wq2, b13, b2, bf16_points=quant == "bf16")
    assert calc_diff(y, want) <= tol
    # the reference's own float64 loop (the layer's rounding points) on the padded weights agrees closely
    kcfg = cfg.padded()
    held = MoEWeights(held.w13, held.w2, None, None, b13, b2).padded(kcfg.hidden_size, kcfg.intermediate_size)
    x_pad = torch.nn.functional.pad(x, (0, kcfg.hidden_size - cfg.hidden_size))
    loop = moe_reference_loop_fp64(x_pad, ids, w, held, Activation.of(cfg))[:, : cfg.hidden_size]
    assert calc_diff(y, loop) <= 1e-5


@pytest.mark.parametrize("case", CASES[:3], ids=lambda c: f"H{c.hidden}-I{c.inter}" if isinstance(c, Case) else None)
def test_padding_is_exact_on_the_bf16_path(case):
    """The layer pads H and I at load; the fp64 loop on the UNPADDED weights (bf16 rounding points, no tiles) gives
    the same bits: zero columns, rows and bias entries change no value."""
    cfg, x, ids, w, (w13, w2, b13, b2) = _problem(case, "bf16")
    assert cfg.needs_padding and cfg.padded().hidden_size % 256 == 0 and cfg.padded().intermediate_size % 128 == 0
    layer = gcmoe.MoELayer(cfg, "cpu").load_weights(w13, w2, w13_bias=b13, w2_bias=b2)
    assert layer.packed.plan.weights.w13.shape[1:] == (2 * cfg.padded_intermediate, cfg.padded_hidden)
    y = layer(x, ids, w)
    held = MoEWeights.from_float(w13, w2, quant="bf16", w13_bias=b13, w2_bias=b2)
    want = moe_reference_loop_fp64(x, ids, w, held, Activation.of(cfg))
    padded = moe_reference_loop_fp64(
        torch.nn.functional.pad(x, (0, cfg.padded_hidden - cfg.hidden_size)),
        ids,
        w,
        held.padded(cfg.padded_hidden, cfg.padded_intermediate),
        Activation.of(cfg),
    )
    assert torch.equal(padded[:, : cfg.hidden_size], want)  # the padded evaluation, sliced, is the unpadded one
    assert not padded[:, cfg.hidden_size :].any()  # padded output columns are exactly zero
    assert calc_diff(y, want) <= 1e-5  # (the layer is the fp32 reference: its own rounding, no padding effect)


def test_padding_buffer_made_under_inference_mode_serves_later_calls():
    """The eager input-padding buffer is made on a layer's first call; a first call under torch.inference_mode (an
    engine's warm-up) must not leave an inference tensor that a later call outside it cannot write into."""
    case = CASES[0]
    cfg, x, ids, w, (w13, w2, b13, b2) = _problem(case, "bf16")
    assert cfg.padded_hidden != cfg.hidden_size
    layer = gcmoe.MoELayer(cfg, "cpu").load_weights(w13, w2, w13_bias=b13, w2_bias=b2)
    with torch.inference_mode():
        first = layer(x, ids, w)
    with torch.no_grad():
        assert torch.equal(layer(x, ids, w), first)


@pytest.mark.parametrize("limit", [7.0, 0.25])
def test_padded_intermediate_channels_are_zero_and_keep_the_fp8_block_scales(limit):
    """Why padding I is exact for any alpha / limit > 0: a padded channel has gate = up = 0 (zero rows and bias), so
    min(0, limit) = 0 and act = 0 * sigmoid(0) * (0 + 1) = 0; the FP8 1x128 block holding padded channels keeps the
    amax (the scale) of its real ones — the unpadded layer's partial last block."""
    case = Case(384, 192, 3, 1, 6)
    _, x, _, _, (w13, w2, b13, b2) = _problem(case, "fp8_mxfp4")
    act = Activation("swiglu_clamped", 3.0, limit)
    held = MoEWeights.from_float(w13, w2, w13_bias=b13, w2_bias=b2).padded(512, 256)
    x_in = activation_input(x, "fp8_mxfp4")
    route_w = torch.rand(case.tokens) + 0.5
    for e in range(case.experts):
        x_pad = torch.nn.functional.pad(x_in, (0, 512 - case.hidden))
        q, s = w1_reference(x_pad, held.w13[e], route_w, "fp8_mxfp4", act, held.w13_bias[e])
        assert not q.float()[:, case.inter :].any()
        # the unpadded activation's blocks: [0, 128) and the partial last one [128, 192), whose amax alone
        # decides the scale of the padded block [128, 256)
        gu = x_in @ held.w13[e].dequantize()[:, : case.hidden].T  # (x_in: the unpadded x)
        gu = torch.cat((gu[:, : case.inter], gu[:, 256 : 256 + case.inter]), dim=1) + b13[e]
        h = act(gu[:, : case.inter], gu[:, case.inter :]) * route_w.unsqueeze(1)
        amax = torch.stack((h[:, :128].abs().amax(1), h[:, 128:].abs().amax(1)), dim=1)
        assert torch.equal(s, fp8_scale_for_amax(amax))


@pytest.mark.parametrize("routing", ["uniform", "one_expert", "half_empty"])
@pytest.mark.parametrize("model", ["gpt-oss-120b", "gpt-oss-20b"])
def test_emulated_sm90_pipeline_equals_the_reference(model, routing):
    """The sm90 backend's pipeline in torch (publish, ring dispatch, W1 / W2 kernel models with the clamped
    activation and biases, scatter, finalize) on a small gpt-oss-shaped layer (H, I padded internally)."""
    full = MoEConfig.from_model(model)
    cfg = MoEConfig(320, 192, 8, full.top_k, max_tokens_per_rank=16, activation=full.activation, has_bias=True)
    case = Case(320, 192, 8, full.top_k, 11, routing, seed=7)
    x, ids, w = make_tokens(cfg, case.tokens, routing, seed=case.seed)
    w13, w2, b13, b2 = gpt_oss_float_weights(case, 8)
    ref = gcmoe.MoELayer(cfg, "cpu").load_weights(w13, w2, w13_bias=b13, w2_bias=b2)
    emu = gcmoe.MoELayer(cfg, "cpu", backend="sm90", emulate=True).load_weights(w13, w2, w13_bias=b13, w2_bias=b2)
    y = emu(x, ids, w)
    assert y.shape == x.shape and y.is_contiguous()  # the padded columns cut off, a plain tensor
    assert torch.equal(y, ref(x, ids, w))
    assert calc_diff(y, gpt_oss_block_fp64(x.float(), ids, w, *_exact(w13, w2), b13, b2)) <= 1e-3


def _exact(w13, w2):
    held = MoEWeights.from_float(w13, w2)
    return held.w13.dequantize(), held.w2.dequantize()


def test_model_shapes_and_padded_config():
    for name, experts in (("gpt-oss-120b", 128), ("gpt-oss-20b", 32)):
        s = MODEL_SHAPES[name]
        assert (s.hidden_size, s.intermediate_size, s.num_experts, s.top_k, s.num_shared_experts) == (
            2880,
            2880,
            experts,
            4,
            0,
        )
        cfg = MoEConfig.ep_slice(name, 8)
        assert (cfg.num_experts, cfg.activation, cfg.has_bias) == (experts // 8, "swiglu_clamped", True)
        assert (cfg.swiglu_alpha, cfg.swiglu_limit) == (ALPHA, LIMIT)
        k = cfg.padded()
        assert (k.hidden_size, k.intermediate_size, cfg.hidden_size) == (3072, 2944, 2880)
        assert k.padded() is k and not k.needs_padding
    plain = MoEConfig.from_model("deepseek-v3")
    assert plain.padded() is plain and (plain.activation, plain.has_bias) == ("swiglu", False)


BAD = [
    (dict(activation="gelu"), "activation"),
    (dict(swiglu_alpha=0.0), "swiglu_alpha"),
    (dict(swiglu_limit=float("nan")), "swiglu_limit"),
    (dict(swiglu_limit=-7.0), "swiglu_limit"),
    (dict(swiglu_alpha="1.7"), "swiglu_alpha"),
    (dict(has_bias=1), "has_bias"),
    (dict(has_bias=True, num_shared_experts=1), "has_bias.*shared"),
    (dict(intermediate_size=4000), None),  # fine: padded to 4096
    (dict(intermediate_size=4097), "intermediate_size.*padded to 4224"),
]


@pytest.mark.parametrize(("change", "match"), BAD, ids=[str(c) for c, _ in BAD])
def test_config_validation(change, match):
    base = dict(hidden_size=2880, intermediate_size=2880, num_experts=8, top_k=4, activation="swiglu_clamped")
    if match is None:
        assert MoEConfig(**{**base, **change}).padded().intermediate_size == 4096
        return
    with pytest.raises(ValueError, match=match):
        MoEConfig(**{**base, **change})


def test_weight_validation():
    case = Case(320, 192, 4, 2, 3)
    cfg = case.cfg()
    w13, w2, b13, b2 = gpt_oss_float_weights(case, 0)
    with pytest.raises(ValueError, match="w13_bias.*no biases were given"):
        gcmoe.MoELayer(cfg, "cpu").load_weights(w13, w2)
    with pytest.raises(ValueError, match="w13_bias.*biases were given"):
        gcmoe.MoELayer(cfg.replace(has_bias=False), "cpu").load_weights(w13, w2, w13_bias=b13, w2_bias=b2)
    with pytest.raises(ValueError, match="given together"):
        MoEWeights.from_float(w13, w2, w13_bias=b13)
    with pytest.raises(ValueError, match=r"w2_bias must be fp32 \(4, 320\)"):
        MoEWeights.from_float(w13, w2, w13_bias=b13, w2_bias=b2[:, :100])
    bad = b13.index_fill(1, torch.tensor([3]), torch.nan)
    with pytest.raises(ValueError, match="w13_bias.*non-finite"):
        gcmoe.MoELayer(cfg, "cpu").load_weights(w13, w2, w13_bias=bad, w2_bias=b2)
    sh = torch.randn(1, 2 * 192, 320), torch.randn(1, 320, 192)
    with pytest.raises(ValueError, match="shared experts are not supported"):
        MoEWeights.from_float(w13, w2, *sh, w13_bias=b13, w2_bias=b2)
