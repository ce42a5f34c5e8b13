"""The reference operator against an independent float64 loop, both evaluation paths, and the multi-rank reference."""

import pytest
import torch

from gcmoe_core.config import MoEConfig
from gcmoe_core.multirank import multirank_reference
from gcmoe_core.reference import MoEWeights, moe_reference, moe_reference_loop_fp64
from gcmoe_core.testing import Case, calc_diff, cosine, first_mismatch, make_problem

SMALL = MoEConfig(
    hidden_size=256, intermediate_size=128, num_experts=8, top_k=2, num_shared_experts=1, max_tokens_per_rank=64
)
CASES = [
    Case(SMALL, 5, "uniform", seed=1),
    Case(SMALL, 9, "one_expert", seed=2),
    Case(SMALL, 7, "half_empty", seed=3),
    Case(SMALL.replace(num_shared_experts=0, top_k=3), 4, "uniform", seed=4),
    Case(SMALL.replace(quant="bf16"), 6, "uniform", seed=5),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id + "-" + c.cfg.quant)
@pytest.mark.parametrize("capturable", [False, True], ids=["sparse", "dense"])
def test_reference_matches_fp64_loop(case, capturable):
    x, ids, w, weights, _ = make_problem(case)
    y = moe_reference(x, ids, w, weights, capturable=capturable)
    ref = moe_reference_loop_fp64(x, ids, w, weights)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    assert calc_diff(y, ref) < (1e-5 if case.cfg.quant == "fp8_mxfp4" else 1e-6)


def test_sparse_and_dense_paths_agree():
    x, ids, w, weights, _ = make_problem(Case(SMALL, 11, "uniform", seed=7))
    a = moe_reference(x, ids, w, weights, capturable=False)
    b = moe_reference(x, ids, w, weights, capturable=True)
    assert calc_diff(a, b) < 1e-6


def test_quantised_path_close_to_bf16_path():
    x, ids, w, _, floats = make_problem(Case(SMALL, 16, "uniform", seed=8))
    yq = moe_reference(x, ids, w, MoEWeights.from_float(*floats, quant="fp8_mxfp4"))
    yb = moe_reference(x, ids, w, MoEWeights.from_float(*floats, quant="bf16"))
    assert cosine(yq, yb) > 0.97


def test_routing_weight_and_slots_matter():
    """A reference that ignored routing weights or a slot would fail here."""
    x, ids, w, weights, _ = make_problem(Case(SMALL, 6, "uniform", seed=9))
    y = moe_reference(x, ids, w, weights)
    w2 = w.clone()
    w2[:, 1] *= 2
    assert calc_diff(y, moe_reference(x, ids, w2, weights)) > 1e-3
    ids2 = ids.clone()
    ids2[:, 0] = (ids2[:, 0] + 1) % SMALL.num_experts
    assert calc_diff(y, moe_reference(x, ids2, w, weights)) > 1e-3


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("routing", ["uniform", "one_expert", "half_empty"])
def test_multirank_reference_consistent_with_single_rank(p, routing):
    cfg = SMALL.replace(num_experts=8, ep_size=1)
    xs, idss, ws = [], [], []
    weights = None
    for r in range(p):
        x, ids, w, wts, _ = make_problem(Case(cfg, 3 + r, routing, seed=0 if r == 0 else 100 + r))
        weights = weights or wts  # same seed 0 weights for every rank
        xs.append(x), idss.append(ids), ws.append(w)
    dispatch, combine = multirank_reference(xs, idss, ws, weights)
    el = cfg.num_experts // p
    for r in range(p):
        # each rank's combined output equals the single-rank layer on its tokens with all experts
        y1 = moe_reference(xs[r], idss[r], ws[r], weights)
        assert calc_diff(combine[r].y, y1) < 1e-6
    for q in range(p):
        d = dispatch[q]
        assert int(d.expert_counts.sum()) == d.src.shape[0] == int(d.expert_offsets[-1])
        for n in range(d.src.shape[0]):
            r, t, j = d.src[n].tolist()
            e_loc = int(torch.searchsorted(d.expert_offsets, torch.tensor(n), right=True)) - 1
            assert int(idss[r][t, j]) == q * el + e_loc
        # payload rows are bit copies of the source rank's quantised token
        from gcmoe_core.formats import quantize_fp8_e4m3_1x128

        for n in range(d.src.shape[0]):
            r, t, _ = d.src[n].tolist()
            qx, sx = quantize_fp8_e4m3_1x128(xs[r][t : t + 1])
            assert first_mismatch(d.x_payload[n : n + 1], qx) == "" and torch.equal(d.x_scale[n : n + 1], sx)
    total = sum(int(i.numel()) for i in idss)
    assert sum(d.src.shape[0] for d in dispatch) == total  # every (token, slot) delivered exactly once


def test_rank_slice_holds_the_ranks_experts_and_biases():
    e, i, h = 8, 128, 256
    g = torch.Generator().manual_seed(3)
    w = MoEWeights.from_float(
        torch.randn(e, 2 * i, h, generator=g), torch.randn(e, h, i, generator=g),
        w13_bias=torch.randn(e, 2 * i, generator=g), w2_bias=torch.randn(e, h, generator=g),
    )  # fmt: skip
    q = w.rank_slice(2, 4)
    assert (
        q.num_experts == 2 and torch.equal(q.w13.packed, w.w13.packed[4:6]) and torch.equal(q.w2.scale, w.w2.scale[4:6])
    )
    assert torch.equal(q.w13_bias, w.w13_bias[4:6]) and torch.equal(q.w2_bias, w.w2_bias[4:6])
    with pytest.raises(ValueError, match="rank 4 of 4"):
        w.rank_slice(4, 4)
