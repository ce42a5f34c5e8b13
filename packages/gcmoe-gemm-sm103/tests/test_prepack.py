"""K128 prepack: exact round trips, the documented byte positions, and rejections (CPU)."""

import pytest
import torch

from gcmoe_core.formats import quantize_mxfp4, random_mxfp4
from gcmoe_core.layouts import gate_up_permutation, inverse_permutation
from gcmoe_gemm_sm103.prepack import BM, GATE_UP_GROUP, PackedK128, prepack_mxfp4_k128, sf_atom_offsets


def unpack_k128(p: PackedK128) -> tuple[torch.Tensor, torch.Tensor]:
    """The prepack's exact inverse: (packed bytes [E, N, K/2], UE8M0 scale [E, N, K/32]) in logical row order."""
    e, nt, kt, bm, b = p.data.shape
    data = p.data.permute(0, 1, 3, 2, 4).reshape(e, nt * bm, kt * b)
    tiles = p.sf[..., sf_atom_offsets(p.sf.device).reshape(-1)].view(e, nt, kt, BM, 4)
    scale = tiles.permute(0, 1, 3, 2, 4).reshape(e, nt * BM, kt * 4)
    if p.gate_up:
        inv = inverse_permutation(gate_up_permutation(p.n // 2, GATE_UP_GROUP, data.device))
        data, scale = data[:, inv], scale[:, inv]
    return data.contiguous(), scale.contiguous()


@pytest.mark.parametrize("gate_up", [False, True])
@pytest.mark.parametrize(("e", "n", "k"), [(1, 128, 128), (3, 256, 512), (2, 512, 384)])
def test_mxfp4_roundtrip_exact(e, n, k, gate_up):
    w = random_mxfp4((e, n, k), torch.Generator().manual_seed(e * n + k))
    p = prepack_mxfp4_k128(w, gate_up=gate_up)
    assert p.data.shape == (e, n // 128, k // 128, 128, 64) and p.sf.shape == (e, n // 128, k // 128, 512)
    packed, scale = unpack_k128(p)
    assert torch.equal(packed, w.packed) and torch.equal(scale, w.scale)


def test_documented_positions():
    """Element (row n, K k) of expert e sits where the docstring says; so does its scale."""
    e, n, k = 2, 256, 256
    w = random_mxfp4((e, n, k), torch.Generator().manual_seed(9))
    p = prepack_mxfp4_k128(w)
    for ee, nn, kk in [(0, 0, 0), (1, 255, 255), (1, 130, 77), (0, 37, 200)]:
        byte = w.packed[ee, nn, kk // 2]
        assert p.data[ee, nn // 128, kk // 128, nn % 128, (kk % 128) // 2] == byte
        r, j = nn % 128, (kk % 128) // 32
        assert p.sf[ee, nn // 128, kk // 128, (r % 32) * 16 + (r // 32) * 4 + j] == w.scale[ee, nn, kk // 32]


def test_sf_atom_is_a_permutation():
    off = sf_atom_offsets().reshape(-1)
    assert sorted(off.tolist()) == list(range(512))


def test_gate_up_interleave_tiles_hold_matching_rows():
    i = 256
    w = quantize_mxfp4(torch.arange(2 * i).float().view(1, -1, 1).expand(1, 2 * i, 128).contiguous() / 1000)
    p = prepack_mxfp4_k128(w, gate_up=True)
    perm = gate_up_permutation(i, 64)
    # tile t rows 0..63 are gate rows t*64.., rows 64..127 the up rows of the same columns
    assert perm[:64].tolist() == list(range(64)) and perm[64:128].tolist() == list(range(i, i + 64))
    assert perm[128:192].tolist() == list(range(64, 128))
    assert torch.equal(unpack_k128(p)[0], w.packed)


@pytest.mark.parametrize(
    ("shape", "match"),
    [((1, 100, 128), "N = 100 rows must be a multiple of 128"), ((1, 128, 96), "K = 96 must be a multiple of 128")],
)
def test_rejects_untileable_shapes(shape, match):
    with pytest.raises(ValueError, match=match):
        prepack_mxfp4_k128(random_mxfp4(shape, torch.Generator().manual_seed(0)))
