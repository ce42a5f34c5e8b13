"""The sm90 grouped W1/W2 kernels on an H200 against their torch models and the quantisation-emulating reference:
fresh random data, poisoned outputs, uniform / one-expert / half-empty routing, bitwise-stable graph replays."""

import pytest
import torch

from gcmoe_core.config import MoEConfig
from gcmoe_core.grouping import group_rows, prepare_activations
from gcmoe_core.reference import MoEWeights, moe_reference
from gcmoe_core.testing import (
    Case,
    calc_diff,
    cosine,
    first_mismatch,
    make_problem,
    make_tokens,
    make_weights,
)
from gcmoe_core.timing import capture_graph
from gcmoe_gemm_sm90.config import Sm90Config
from gcmoe_gemm_sm90.ops import MoESm90, emulate_w1, emulate_w2, w1, w2
from gcmoe_gemm_sm90.prepack import unpack_sm90

pytestmark = pytest.mark.sm90

SMALL = MoEConfig(
    hidden_size=512, intermediate_size=256, num_experts=8, top_k=2, num_shared_experts=1, max_tokens_per_rank=512
)


def _dequant_rows(hq, hsT):
    k = hq.shape[1] // 128
    return (hq.view(torch.float8_e4m3fn).float().view(-1, k, 128) * hsT.t().unsqueeze(-1)).view(hq.shape[0], -1)


VARIANTS = {  # tma: weights by bulk copy into the pipeline's stages; registers: per-thread global loads (v4)
    "tma": dict(prefetch=2),
    "tma-global-scales": dict(prefetch=2, smem_scales=False),
    "registers": dict(prefetch=2, tma_weights=False),
    # K splits over a cluster (SMALL: W1 has 4 windows, W2 2): partial sums pushed to the leader
    "split2": dict(prefetch=1, splits=(2, 2)),
    "split4": dict(prefetch=1, splits=(4, 2)),
    # 4 warpgroups of one 64-row subtile each (512 threads), also with K splits
    "4wg": dict(prefetch=2, warpgroups=4),
    "4wg-split2": dict(prefetch=1, splits=(2, 2), warpgroups=4),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("n_tile", [8, 16, 24, 32, 48, 64, 80])
@pytest.mark.parametrize("routing", ["uniform", "one_expert", "half_empty"])
def test_w1_then_w2_match_models(n_tile, routing, variant):
    if "split" in variant and n_tile >= 48:
        pytest.skip("K splits are for small token counts (N <= 32): the leader's partial buffers exceed shared memory")
    if "4wg" in variant and n_tile > 64:
        pytest.skip("4 warpgroups hold N <= 64 in 128 registers")
    cfg = Sm90Config(n_tile=n_tile, stages=3, **VARIANTS[variant])
    routed = SMALL.replace(num_shared_experts=0)  # the kernels alone: routed experts only
    x, ids, w, weights, _ = make_problem(Case(routed, 37, routing, seed=n_tile), device="cuda")
    moe = MoESm90.from_weights(weights, cfg)
    layout = group_rows(ids, SMALL.num_experts, n_tile)
    acts = prepare_activations(x, w, layout, SMALL.top_k)
    valid = layout.src_slot >= 0
    hq, hsT = w1(moe.w13, acts, layout, cfg)
    eq, es = emulate_w1(unpack_sm90(moe.w13), acts, layout)
    # power-of-two scales: equal, except that one whose amax lies at a 448 * 2^e boundary (within FP32 rounding of
    # the two summation orders) may sit one binade off; the dequantised values below must match either way
    ratio = hsT[:, valid] / es[:, valid]
    assert ((ratio == 1) | (ratio == 2) | (ratio == 0.5)).all(), "activation scales off by more than a binade"
    assert int((ratio != 1).sum()) <= 2, f"{int((ratio != 1).sum())} activation scales one binade off"
    d = calc_diff(_dequant_rows(hq, hsT)[valid], _dequant_rows(eq, es)[valid])
    assert d < 1e-3, d
    out = torch.full((ids.numel(), SMALL.hidden_size), float("nan"), dtype=torch.bfloat16, device="cuda")
    w2(moe.w2, hq, hsT, layout, out, cfg)
    ref = emulate_w2(unpack_sm90(moe.w2), hq, hsT, layout, torch.full_like(out, float("nan")))
    assert not out.isnan().any(), "unwritten output rows"
    assert calc_diff(out, ref) < 1e-3


@pytest.mark.parametrize(
    ("model", "tokens"), [("deepseek-v4-flash", 1), ("deepseek-v4-flash", 32), ("glm-4.5", 8), ("deepseek-v3", 128)]
)
def test_layer_vs_reference_on_model_shapes(model, tokens):
    cfg = MoEConfig.ep_slice(model, 8, max_tokens_per_rank=512)
    weights = make_weights(cfg, seed=tokens, device="cuda")
    x, ids, w = make_tokens(cfg, tokens, seed=tokens, device="cuda")
    y = MoESm90.from_weights(weights).forward(x, ids, w)
    ref = moe_reference(x, ids, w, weights.exact_bf16(), quant="fp8_mxfp4")
    assert calc_diff(y, ref) < 1e-3


def test_cosine_vs_bf16_path():
    x, ids, w, weights, floats = make_problem(Case(SMALL, 64, "uniform", seed=5), device="cuda")
    y = MoESm90.from_weights(weights).forward(x, ids, w)
    yb = moe_reference(x, ids, w, MoEWeights.from_float(*floats, quant="bf16").to("cuda"))
    assert cosine(y, yb) >= 0.97


@pytest.mark.parametrize("splits", [(1, 1), (2, 2)], ids=["no-splits", "k-splits"])
def test_graph_replays_bitwise_identical_with_new_routing(splits):
    x, ids, w, weights, _ = make_problem(Case(SMALL, 16, "uniform", seed=9), device="cuda")
    prefetch = 2 if splits == (1, 1) else 1  # SMALL's W2 has 2 windows: 2 splits x 1
    moe = MoESm90.from_weights(weights, Sm90Config(n_tile=16, stages=3, prefetch=prefetch, splits=splits))
    g, y = capture_graph(lambda: moe.forward(x, ids, w), warmup=2)
    for seed in range(3):
        nx, nids, nw, _, _ = make_problem(Case(SMALL, 16, ("uniform", "one_expert", "half_empty")[seed], 50 + seed))
        x.copy_(nx), ids.copy_(nids), w.copy_(nw)
        g.replay()
        torch.cuda.synchronize()
        assert calc_diff(y, moe_reference(x, ids, w, weights)) < 1e-3
    first = None
    for _ in range(100):
        g.replay()
        torch.cuda.synchronize()
        first = y.clone() if first is None else first
        assert first_mismatch(y, first) == ""


def test_trace_leaves_outputs_bitwise_equal_and_stamps_every_cta():
    """cfg.trace changes no output bit and stamps every CTA; grid row y ran the y-th expert with rows (CTAs of empty
    experts last)."""
    from dataclasses import replace

    from gcmoe_gemm_sm90.ops import trace_shape

    cfg = Sm90Config(n_tile=16, stages=3, prefetch=2)
    routed = SMALL.replace(num_shared_experts=0)
    x, ids, w, weights, _ = make_problem(Case(routed, 37, "half_empty", seed=3), device="cuda")
    moe = MoESm90.from_weights(weights, cfg)
    layout = group_rows(ids, SMALL.num_experts, cfg.n_tile)
    acts = prepare_activations(x, w, layout, SMALL.top_k)
    outs = []
    for c in (cfg, replace(cfg, trace=True)):
        tr = [
            torch.zeros(trace_shape(m, p, c), dtype=torch.int64, device="cuda")
            for m, p in (("w1", moe.w13), ("w2", moe.w2))
        ]
        hq, hsT = w1(moe.w13, acts, layout, c, tr[0] if c.trace else None)
        out = torch.full((ids.numel(), SMALL.hidden_size), float("nan"), dtype=torch.bfloat16, device="cuda")
        w2(moe.w2, hq, hsT, layout, out, c, tr[1] if c.trace else None)
        valid = layout.src_slot >= 0
        outs.append((hq[valid], hsT[:, valid], out))
    for a, b in zip(outs[0], outs[1], strict=True):
        assert first_mismatch(a, b) == ""
    cnt = layout.counts.cpu()
    tiles_by_row = torch.cat([cnt[cnt > 0], cnt[cnt == 0]])  # grid row y: the y-th expert with rows
    assert (cnt == 0).any(), "half_empty routing leaves experts empty"
    for t, m_tiles in ((tr[0].cpu(), moe.w13.m // 256), (tr[1].cpu(), moe.w2.m // 256)):
        assert (t[:, 0] > 0).all() and (t[:, 0] <= t[:, 1]).all() and (t[:, 1] <= t[:, 2]).all()
        n_tiles = (t[:, 3] & 0xFFFFFFFF).view(-1, m_tiles)  # [expert, m tile]
        assert (n_tiles == ((tiles_by_row + 15) // 16).unsqueeze(1)).all()
        assert ((t[:, 3] >> 32) < torch.cuda.get_device_properties(0).multi_processor_count).all()
    assert int(tr[1][:, 1].min()) >= int(tr[0][:, 2].max()) - 1000  # W2 past its wait only after W1's last CTA
    with pytest.raises(ValueError, match="trace buffer"):
        w1(moe.w13, acts, layout, replace(cfg, trace=True))
