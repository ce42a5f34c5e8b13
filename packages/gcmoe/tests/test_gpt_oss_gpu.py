"""gpt-oss on an H200 through the public layer (sm90 backend: clamped SwiGLU + biases fused into the W1 / W2
epilogues, H = I = 2880 padded to 3072 / 2944 at load), on fresh random inputs:

- values: within calc_diff 1e-3 of the quantisation model (the reference backend, padded the same way) on EP slices
  of gpt-oss-120b / -20b and small shapes, no NaN in y (a contiguous [T, 2880] tensor);
- eager calls (bucket graphs, the per-stream padded input buffer reused across calls of different T) and replays of
  a caller's capture with new inputs and a NaN-poisoned output, and torch.compile: bit-identical;
- the default SwiGLU layers keep the default kernels (no epilogue flags in any bucket's config).
"""

import pytest
import torch

import gcmoe
from gcmoe_core.config import MoEConfig
from gcmoe_core.reference import MoEWeights, moe_reference
from gcmoe_core.testing import calc_diff, first_mismatch, make_tokens, make_weights

pytestmark = [pytest.mark.gpu, pytest.mark.sm90]


def gpt_oss_weights(cfg: MoEConfig, seed: int) -> MoEWeights:
    """Random MXFP4 weights of the config's (unpadded) shape and fp32 biases large enough to hit the clamps."""
    w = make_weights(cfg.replace(has_bias=False), seed, "cuda")
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    e, h, i = cfg.local_experts, cfg.hidden_size, cfg.intermediate_size
    b13 = torch.randn(e, 2 * i, generator=g, device="cuda") * 4.0
    b2 = torch.randn(e, h, generator=g, device="cuda")
    return MoEWeights(w.w13, w.w2, None, None, b13, b2)


def _pair(cfg: MoEConfig, seed: int, **kw):
    weights = gpt_oss_weights(cfg, seed)
    layer = gcmoe.MoELayer(cfg, "cuda", "sm90", **kw).load(weights)
    ref = gcmoe.MoELayer(cfg, "cuda", "reference").load(weights)
    return layer, ref


CASES = [
    ("gpt-oss-120b", 8, 1),
    ("gpt-oss-120b", 8, 8),
    ("gpt-oss-120b", 8, 64),
    ("gpt-oss-20b", 1, 4),
    ("gpt-oss-20b", 4, 256),
]


@pytest.mark.parametrize(("model", "ep", "tokens"), CASES, ids=[f"{m}-ep{e}-T{t}" for m, e, t in CASES])
def test_gpt_oss_slices_match_the_quantisation_model(model, ep, tokens):
    cfg = MoEConfig.ep_slice(model, ep, max_tokens_per_rank=256)
    assert (cfg.hidden_size, cfg.activation, cfg.has_bias) == (2880, "swiglu_clamped", True)
    layer, ref = _pair(cfg, seed=tokens)
    kcfg = layer.packed.plan.kernel_config(tokens)
    assert (kcfg.activation, kcfg.bias, kcfg.swiglu_alpha, kcfg.swiglu_limit) == ("swiglu_clamped", True, 1.702, 7.0)
    for routing in ("uniform", "one_expert", "half_empty"):
        x, ids, w = make_tokens(cfg, tokens, routing, seed=tokens + 7, device="cuda")
        y = layer(x, ids, w)
        assert y.shape == (tokens, 2880) and not y.isnan().any()
        assert calc_diff(y, ref(x, ids, w)) <= 1e-3, routing
    layer.check()


@pytest.mark.parametrize(
    "cfg",
    [
        MoEConfig(320, 192, 8, 2, max_tokens_per_rank=32, activation="swiglu_clamped", has_bias=True),
        MoEConfig(512, 256, 16, 4, max_tokens_per_rank=32, activation="swiglu_clamped", has_bias=True),
        MoEConfig(2880, 2880, 16, 4, max_tokens_per_rank=32, activation="swiglu_clamped", has_bias=True),
        MoEConfig(2880, 2880, 16, 4, max_tokens_per_rank=32, has_bias=True),  # bias alone
        MoEConfig(2880, 2880, 16, 4, max_tokens_per_rank=32, activation="swiglu_clamped", swiglu_limit=0.5),
    ],
    ids=["small-padded", "small-aligned", "2880", "2880-bias-only", "2880-clamp-only"],
)
def test_eager_graph_replay_and_compile_are_bit_identical(cfg):
    weights = gpt_oss_weights(cfg, 3) if cfg.has_bias else make_weights(cfg, 3, "cuda")
    layer = gcmoe.MoELayer(cfg, "cuda", "sm90", comm_sms=0).load(weights)
    ref = gcmoe.MoELayer(cfg, "cuda", "reference").load(weights)
    # eager: several T on one stream (one padded input buffer, reused), each against the quantisation model
    for t in (1, 5, 32, 3):
        x, ids, w = make_tokens(cfg, t, "uniform", seed=t, device="cuda")
        y = layer(x, ids, w)
        assert calc_diff(y, ref(x, ids, w)) <= 1e-3, f"T = {t}"
    # a caller's capture, replayed with new inputs into its static buffers and a poisoned output
    x, ids, w = make_tokens(cfg, 11, "uniform", seed=40, device="cuda")
    sx, sids, sw = x.clone(), ids.clone(), w.clone()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=torch.cuda.Stream()):
        out = layer(sx, sids, sw)
    for i in range(10):
        nx, nids, nw = make_tokens(cfg, 11, ("uniform", "one_expert", "half_empty")[i % 3], seed=50 + i, device="cuda")
        sx.copy_(nx), sids.copy_(nids), sw.copy_(nw)
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert not out.isnan().any(), f"replay {i}: unwritten output"
        assert first_mismatch(out, layer(sx, sids, sw)) == "", f"replay {i}"
    compiled = torch.compile(lambda a, b, c: layer(a, b, c) * 2, fullgraph=True, backend="aot_eager")
    assert first_mismatch(compiled(sx, sids, sw), layer(sx, sids, sw) * 2) == ""
    layer.check()


def test_default_swiglu_layers_keep_the_default_kernels():
    """A SwiGLU layer without biases compiles no epilogue flag into any bucket's kernels and still meets the
    quantisation model (the gpt-oss flags are per layer, never global)."""
    cfg = MoEConfig.ep_slice("deepseek-v4-flash", 8, max_tokens_per_rank=64)
    weights = make_weights(cfg, 5, "cuda")
    layer = gcmoe.MoELayer(cfg, "cuda", "sm90").load(weights)
    for b in (1, 2, 4, 8, 16, 32, 64):
        k = layer.packed.plan.kernel_config(b)
        assert (k.activation, k.bias) == ("swiglu", False), b
    assert layer.packed.plan.moe.epilogue == {} and layer.packed.pad is None
    x, ids, w = make_tokens(cfg, 8, "uniform", seed=5, device="cuda")
    assert calc_diff(layer(x, ids, w), moe_reference(x, ids, w, weights)) <= 1e-3
