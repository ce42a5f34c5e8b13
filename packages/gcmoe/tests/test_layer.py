"""The public API on the reference backend: values, weight loading paths, the custom op, torch.compile, errors."""

import pytest
import torch

import gcmoe
from gcmoe import backends
from gcmoe_core.config import MoEConfig
from gcmoe_core.reference import MoEWeights, moe_reference, moe_reference_loop_fp64
from gcmoe_core.testing import Case, calc_diff, cosine, make_problem

CFG = MoEConfig(
    hidden_size=256, intermediate_size=128, num_experts=8, top_k=2, num_shared_experts=1, max_tokens_per_rank=32
)


@pytest.mark.parametrize("quant", ["fp8_mxfp4", "bf16"])
def test_layer_matches_references(quant):
    cfg = CFG.replace(quant=quant)
    x, ids, w, weights, floats = make_problem(Case(cfg, 7, "uniform", seed=11))
    layer = gcmoe.MoELayer(cfg, backend="reference").load_weights(*floats)
    y = layer(x, ids, w)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape and not y.isnan().any()
    assert torch.equal(y, moe_reference(x, ids, w, weights))
    assert calc_diff(y, moe_reference_loop_fp64(x, ids, w, weights)) < 1e-5


@pytest.mark.parametrize("emulate", [False, True])
def test_zero_tokens_give_an_empty_output(emulate):
    """T = 0 is a valid call (an idle rank of P > 1 must still take part in the step); at P = 1 nothing runs."""
    x, ids, w, weights, _ = make_problem(Case(CFG, 3, seed=15))
    layer = gcmoe.MoELayer(CFG, backend="sm90" if emulate else "reference", emulate=emulate).load(weights)
    y = layer(x[:0], ids[:0], w[:0])
    assert y.shape == (0, CFG.hidden_size) and y.dtype == torch.bfloat16
    assert torch.equal(layer(x, ids, w), moe_reference(x, ids, w, weights))  # and the next call is exact


def test_load_mxfp4_directly_equals_load_weights():
    x, ids, w, weights, floats = make_problem(Case(CFG, 5, "one_expert", seed=12))
    a = gcmoe.MoELayer(CFG).load_weights(*floats)(x, ids, w)
    b = gcmoe.MoELayer(CFG).load_mxfp4(weights.w13, weights.w2, weights.shared_w13, weights.shared_w2)(x, ids, w)
    assert torch.equal(a, b)


def test_functional_form_and_cosine_vs_bf16():
    x, ids, w, _, floats = make_problem(Case(CFG, 9, "half_empty", seed=13))
    packed = gcmoe.prepack(CFG, MoEWeights.from_float(*floats))
    y = gcmoe.moe(x, ids, w, packed)
    yb = gcmoe.MoELayer(CFG.replace(quant="bf16")).load_weights(*floats)(x, ids, w)
    assert cosine(y, yb) >= 0.97


def test_custom_op_passes_opcheck():
    x, ids, w, _, floats = make_problem(Case(CFG, 4, seed=14))
    packed = gcmoe.prepack(CFG, MoEWeights.from_float(*floats))
    torch.library.opcheck(torch.ops.gcmoe.moe_forward.default, (x, ids, w, list(packed.tensors), packed.handle, True))
    y = torch.ops.gcmoe.moe_forward(x, ids, w, list(packed.tensors), packed.handle, True)
    assert torch.equal(y, gcmoe.moe(x, ids, w, packed))


def test_op_handle_dies_with_its_layer():
    import gc

    x, ids, w, _, floats = make_problem(Case(CFG, 3, seed=19))
    packed = gcmoe.prepack(CFG, MoEWeights.from_float(*floats))
    handle, tensors = packed.handle, list(packed.tensors)
    del packed
    gc.collect()
    with pytest.raises(RuntimeError, match=f"layer handle {handle} is not live"):
        torch.ops.gcmoe.moe_forward(x, ids, w, tensors, handle, True)


def test_torch_compile_fullgraph():
    x, ids, w, _, floats = make_problem(Case(CFG, 6, seed=15))
    layer = gcmoe.MoELayer(CFG).load_weights(*floats)
    compiled = torch.compile(lambda a, b, c: layer(a, b, c) * 2, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x, ids, w), layer(x, ids, w) * 2)


def test_a_call_autograd_would_differentiate_is_refused_eager_and_compiled_alike():
    """No backward: a trainable router's weights (or x) requiring grad outside no_grad is one ValueError, eager and
    under torch.compile; under no_grad the same call runs."""
    x, ids, w, _, floats = make_problem(Case(CFG, 4, seed=16))
    layer = gcmoe.MoELayer(CFG).load_weights(*floats)
    compiled = torch.compile(lambda a, b, c: layer(a, b, c), fullgraph=True, backend="aot_eager")
    for arg, args in (("topk_weights", (x, ids, w.requires_grad_())), ("x", (x.clone().requires_grad_(), ids, w))):
        for fn in (layer, compiled):
            with pytest.raises(Exception, match=f"gcmoe: {arg}: requires grad, but the MoE operator has no backward"):
                fn(*args)
        with torch.no_grad():
            assert torch.equal(layer(*args), layer(x, ids, w.detach()))


def test_bad_arguments_raise_before_any_launch(monkeypatch):
    x, ids, w, _, floats = make_problem(Case(CFG, 4, seed=16))
    layer = gcmoe.MoELayer(CFG).load_weights(*floats)

    def boom(*a, **k):
        raise AssertionError("the backend ran on bad input")

    monkeypatch.setattr(backends.reference.ReferencePlan, "forward", boom)
    bad = ids.clone()
    bad[0, 0] = 99
    with pytest.raises(ValueError, match="x: dtype"):
        layer(x.float(), ids, w)
    with pytest.raises(ValueError, match="T = 40 tokens exceeds max_tokens_per_rank = 32"):
        layer(x.repeat(10, 1), ids.repeat(10, 1), w.repeat(10, 1))
    monkeypatch.undo()
    with pytest.raises(ValueError, match=r"topk_ids: holds expert id 99, out of range \[0, 8\)"):
        layer(x, bad, w)


def test_value_checks_can_be_disabled(monkeypatch):
    x, ids, w, _, floats = make_problem(Case(CFG, 4, seed=17))
    layer = gcmoe.MoELayer(CFG).load_weights(*floats)
    w_nan = w.clone()
    w_nan[1, 1] = float("nan")
    with pytest.raises(ValueError, match="non-finite routing weight"):
        layer(x, ids, w_nan)
    monkeypatch.setenv("GCMOE_CHECK_VALUES", "0")
    assert layer(x, ids, w_nan)[1].isnan().any()  # NaN in, NaN out for that token only
    assert not layer(x, ids, w_nan)[0].isnan().any()


def test_backend_choice_and_errors(monkeypatch):
    assert gcmoe.choose(torch.device("cpu")) == "reference"
    with pytest.raises(
        gcmoe.BackendUnavailable,
        match="backend 'sm90' cannot run on cpu: it needs a CUDA device of compute capability 9.0",
    ):
        gcmoe.MoELayer(CFG, backend="sm90")
    with pytest.raises(gcmoe.BackendUnavailable, match="sm103.*compute capability 10.3"):
        gcmoe.choose(torch.device("cpu"), "sm103")
    assert "sm103" not in backends.AUTO_ORDER  # compiled and emulated, never run on hardware: explicit only
    with pytest.raises(ValueError, match="unknown backend 'tpu'"):
        gcmoe.choose(torch.device("cpu"), "tpu")
    monkeypatch.setenv("GCMOE_BACKEND", "sm90")
    with pytest.raises(gcmoe.BackendUnavailable):
        gcmoe.MoELayer(CFG)
    monkeypatch.setenv("GCMOE_BACKEND", "reference")
    assert gcmoe.MoELayer(CFG).backend == "reference"


def test_layer_level_errors():
    with pytest.raises(gcmoe.BackendUnavailable, match="reference.*ep_size = 1"):
        gcmoe.MoELayer(MoEConfig.from_model("deepseek-v3", ep_size=8), backend="reference")
    layer = gcmoe.MoELayer(CFG)
    x, ids, w, weights, floats = make_problem(Case(CFG, 2, seed=18))
    with pytest.raises(RuntimeError, match="no weights loaded"):
        layer(x, ids, w)
    with pytest.raises(ValueError, match="w13: shape"):
        layer.load_weights(floats[0][:, :100], *floats[1:])
    with pytest.raises(ValueError, match="weights are bf16 but the config says quant='fp8_mxfp4'"):
        layer.load(MoEWeights.from_float(*floats, quant="bf16"))
    with pytest.raises(ValueError, match="MXFP4 weights need quant='fp8_mxfp4'"):
        gcmoe.MoELayer(CFG.replace(quant="bf16")).load_mxfp4(weights.w13, weights.w2)
    with pytest.raises(ValueError, match="0 shared expert"):
        layer.load(MoEWeights(weights.w13, weights.w2))
