"""The sm_103a kernels' models (tile schedule, indexing and math in torch, on the prepacked tensors): W1 and W2 each
against the per-expert reference; and every can_implement rejection (CPU). The layer around them is gcmoe's sm103
backend, tested end to end in packages/gcmoe/tests/test_backends.py."""

import pytest
import torch

from gcmoe_core.config import MoEConfig
from gcmoe_core.formats import dequantize_fp8_1x128, quantize_fp8_e4m3_1x128
from gcmoe_core.grouping import append_shared, group_rows, prepare_activations
from gcmoe_core.reference import w1_reference, w2_reference
from gcmoe_core.testing import Case, calc_diff, make_problem, poison_
from gcmoe_gemm_sm103.config import Sm103Config, can_implement, layer_missing
from gcmoe_gemm_sm103.emulate import emulate_w1, emulate_w2, prepack_layer, token_scale_atoms
from gcmoe_gemm_sm103.prepack import sf_atom_offsets

CFG = MoEConfig(
    hidden_size=256, intermediate_size=128, num_experts=4, top_k=2, num_shared_experts=1, max_tokens_per_rank=512
)
N_TILE = Sm103Config().n_tile
ROUTINGS = ["uniform", "one_expert", "half_empty"]
TOKENS = [3, 130]  # 130: an expert with more than one 128-token tile (one_expert, and the shared expert)


def grouped_problem(tokens: int, routing: str, seed: int):
    """MXFP4 experts (shared ones appended), their K128 prepacks, the expert-sorted rows and FP8 activations."""
    x, ids, w, weights, _ = make_problem(Case(CFG, tokens, routing, seed=seed))
    w13, w2 = weights.shared_as_experts()
    ids, w = append_shared(ids, w, CFG.num_experts, CFG.num_shared_experts)
    layout = group_rows(ids, w13.shape[0], N_TILE)
    return (w13, w2), prepack_layer(w13, w2), layout, prepare_activations(x, w, layout, ids.shape[1])


def experts_rows(layout) -> list[tuple[int, slice]]:
    """(expert, its valid rows) of every expert that has rows."""
    spans = zip(layout.offsets.tolist(), layout.counts.tolist())
    return [(e, slice(off, off + cnt)) for e, (off, cnt) in enumerate(spans) if cnt]


def fp8_rows(q_bits: torch.Tensor, sT: torch.Tensor, rows: slice) -> torch.Tensor:
    """fp32 values of FP8 rows (uint8 bits [R, K], transposed per-128 scales [K/128, R])."""
    return dequantize_fp8_1x128(q_bits[rows].view(torch.float8_e4m3fn), sT[:, rows].t())


def w1_against_reference(p13, w13, layout, acts) -> float:
    """calc_diff of the W1 model's h (valid rows, FP8 values) against the per-expert reference."""
    hq, hsT = emulate_w1(p13, acts, token_scale_atoms(acts.sxT), layout)
    got, want = [], []
    for e, rows in experts_rows(layout):
        ref = w1_reference(fp8_rows(acts.x_rows, acts.sxT, rows), w13[e], acts.route_w[rows], "fp8_mxfp4")
        want.append(dequantize_fp8_1x128(*ref))
        got.append(fp8_rows(hq, hsT, rows))
    return calc_diff(torch.cat(got), torch.cat(want))


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("tokens", TOKENS)
def test_emulated_w1_matches_reference(routing, tokens):
    """SwiGLU of the gate/up-interleaved tile pairs, routing weight, FP8 requant per 128 columns: every valid row."""
    (w13, _), (p13, _), layout, acts = grouped_problem(tokens, routing, seed=tokens)
    assert w1_against_reference(p13, w13, layout, acts) < 1e-5


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("tokens", TOKENS)
def test_emulated_w2_writes_every_slot_as_reference(routing, tokens):
    """W2 on the W1 model's FP8 h: out[slot] of every (token, slot) pair; a poisoned (NaN) row would show."""
    (_, w2), (p13, p2), layout, acts = grouped_problem(tokens, routing, seed=tokens)
    hq, hsT = emulate_w1(p13, acts, token_scale_atoms(acts.sxT), layout)
    slots = int((layout.src_slot >= 0).sum())
    out = poison_(torch.empty(slots, CFG.hidden_size, dtype=torch.bfloat16))
    want = poison_(torch.empty_like(out))
    for e, rows in experts_rows(layout):
        want[layout.src_slot[rows].long()] = w2_reference(fp8_rows(hq, hsT, rows), w2[e])
    emulate_w2(p2, hq, token_scale_atoms(hsT), layout, out)
    assert not out.isnan().any() and not want.isnan().any()
    assert calc_diff(out, want) < 1e-5


def test_emulation_is_sensitive_to_the_layout():
    """A wrong scale-atom position (swapping two rows' scales) must show: the check is not vacuous."""
    (w13, _), (p13, _), layout, acts = grouped_problem(9, "uniform", seed=4)
    off = sf_atom_offsets()
    a, b = int(off[0, 0]), int(off[1, 0])
    p13.sf[..., [a, b]] = p13.sf[..., [b, a]]
    assert w1_against_reference(p13, w13, layout, acts) > 1e-5


def test_token_scale_atoms_replicate_per_128_scales():
    x = torch.randn(256, 512) * torch.logspace(-2, 2, 256).unsqueeze(1)
    _, s = quantize_fp8_e4m3_1x128(x)
    atoms = token_scale_atoms(s.t().contiguous())
    assert atoms.shape == (2, 4, 512)
    off = sf_atom_offsets()
    for row in (0, 37, 130, 255):
        for kt in range(4):
            got = atoms[row // 128, kt, off[row % 128]].to(torch.int32) - 127
            want = torch.log2(s[row, kt]).round().to(torch.int32)
            assert got.tolist() == [int(want)] * 4


CHECKS = [
    (("w3", 256, 256, 8), "mode must be"),
    (("w1", 384, 256, 8), "multiple of the 256-row CTA tile"),
    (("w2", 256, 200, 8), "K = 200 must be a positive multiple of 128"),
    (("w2", 256, 0, 8), "K = 0"),
    (("w2", 256, 256, 0), "experts = 0"),
    (("w2", 256, 256, 4096), "experts = 4096"),
]


@pytest.mark.parametrize(("args", "match"), CHECKS, ids=[m for _, m in CHECKS])
def test_can_implement_rejections(args, match):
    assert match in can_implement(*args)


def test_can_implement_accepts_model_shapes_and_other_rejections():
    for h, i in ((4096, 2048), (7168, 2048), (6144, 2048), (5120, 1536), (7168, 3072)):
        assert layer_missing(h, i, 33) is None
    assert "W1" in layer_missing(256, 64, 8)
    with pytest.raises(ValueError, match="n_tile"):
        Sm103Config(n_tile=64)
    with pytest.raises(ValueError, match="stages"):
        Sm103Config(stages=1)
