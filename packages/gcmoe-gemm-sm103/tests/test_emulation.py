"""The sm_103a kernels' tile schedule, indexing and math in torch, on the prepacked tensors, against the reference;
and every can_implement rejection (CPU)."""

import pytest
import torch

from gcmoe_core.config import MoEConfig
from gcmoe_core.formats import quantize_fp8_e4m3_1x128
from gcmoe_core.reference import moe_reference
from gcmoe_core.testing import Case, calc_diff, make_problem
from gcmoe_gemm_sm103.config import Sm103Config, can_implement, layer_missing
from gcmoe_gemm_sm103.emulate import token_scale_atoms
from gcmoe_gemm_sm103.ops import MoESm103
from gcmoe_gemm_sm103.prepack import sf_atom_offsets

CFG = MoEConfig(
    hidden_size=256, intermediate_size=128, num_experts=4, top_k=2, num_shared_experts=1, max_tokens_per_rank=512
)


@pytest.mark.parametrize("routing", ["uniform", "one_expert", "half_empty"])
@pytest.mark.parametrize("tokens", [3, 130])  # 130: an expert with more than one 128-token tile (one_expert)
def test_emulated_kernels_match_reference(routing, tokens):
    x, ids, w, weights, _ = make_problem(Case(CFG, tokens, routing, seed=tokens))
    y = MoESm103.from_weights(weights).forward(x, ids, w, emulate=True)
    ref = moe_reference(x, ids, w, weights)
    assert calc_diff(y, ref) < 1e-5


def test_emulation_is_sensitive_to_the_layout():
    """A wrong scale-atom position (swapping two rows' scales) must show: the check is not vacuous."""
    x, ids, w, weights, _ = make_problem(Case(CFG, 9, "uniform", seed=4))
    moe = MoESm103.from_weights(weights)
    off = sf_atom_offsets()
    a, b = int(off[0, 0]), int(off[1, 0])
    moe.w13.sf[..., [a, b]] = moe.w13.sf[..., [b, a]]
    y = moe.forward(x, ids, w, emulate=True)
    assert calc_diff(y, moe_reference(x, ids, w, weights)) > 1e-5


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
    assert "weight format" in can_implement("w1", 256, 256, 8, "nvfp4")
    assert "W1" in layer_missing(256, 64, 8)
    with pytest.raises(ValueError, match="n_tile"):
        Sm103Config(n_tile=64)
    with pytest.raises(ValueError, match="stages"):
        Sm103Config(stages=1)
