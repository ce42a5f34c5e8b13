"""MXFP4 and FP8 formats: hand-computed encodings, round trips, saturation, NaN handling, ties."""

import math

import pytest
import torch

from gcmoe_core.formats import (
    E2M1_VALUES,
    MXFP4Tensor,
    dequantize_fp8_1x128,
    dequantize_mxfp4,
    e2m1_decode,
    e2m1_encode,
    fp8_scale_for_amax,
    pack_nibbles,
    quantize_fp8_e4m3_1x128,
    quantize_mxfp4,
    ue8m0_decode,
    ue8m0_encode_for_amax,
    unpack_nibbles,
)


def test_e2m1_codes_of_every_representable_value():
    # [s e1 e0 m]: 0.5 = subnormal 0b001, 1.0 = 0b010, 1.5 = 0b011, 2 = 0b100, 3 = 0b101, 4 = 0b110, 6 = 0b111
    vals = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
    want = [0, 1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 12, 13, 14, 15]
    assert e2m1_encode(vals).tolist() == want
    assert torch.equal(e2m1_decode(torch.tensor(want, dtype=torch.uint8)), vals)


@pytest.mark.parametrize(
    ("v", "code"),
    [
        (0.25, 0),
        (0.75, 2),
        (1.25, 2),
        (1.75, 4),
        (2.5, 4),
        (3.5, 6),
        (5.0, 6),  # ties -> even code
        (0.2501, 1),
        (0.7499, 1),
        (1.2501, 3),
        (1.7499, 3),
        (2.5001, 5),
        (3.4999, 5),
        (5.0001, 7),
        (-0.75, 10),
        (-5.0, 14),
        (-0.1, 0),  # negatives; a value rounding to zero is +0
    ],
)
def test_e2m1_round_to_nearest_even(v, code):
    assert e2m1_encode(torch.tensor([v])).item() == code


def test_e2m1_saturates_and_rejects_nan():
    assert e2m1_encode(torch.tensor([7.0, 1e30, -100.0, float("inf")])).tolist() == [7, 7, 15, 7]
    with pytest.raises(ValueError, match="NaN"):
        e2m1_encode(torch.tensor([1.0, float("nan")]))


def test_nibble_order_low_first():
    codes = torch.tensor([[0x1, 0x2, 0xF, 0x8]], dtype=torch.uint8)
    packed = pack_nibbles(codes)
    assert packed.tolist() == [[0x21, 0x8F]]
    assert torch.equal(unpack_nibbles(packed), codes)


def test_ue8m0_known_values():
    b = torch.tensor([127, 128, 126, 0, 254, 255], dtype=torch.uint8)
    d = ue8m0_decode(b)
    assert d[:5].tolist() == [1.0, 2.0, 0.5, 2.0**-127, 2.0**127]
    assert math.isnan(d[5].item())


@pytest.mark.parametrize(
    ("amax", "byte"),
    [(6.0, 127), (6.0001, 128), (3.0, 126), (3.01, 127), (12.0, 128), (0.75, 124), (1.0, 125), (0.0, 0)],
)
def test_mxfp4_scale_is_smallest_power_of_two_that_fits(amax, byte):
    assert ue8m0_encode_for_amax(torch.tensor([amax])).item() == byte


def test_mxfp4_known_group():
    # amax 12 -> scale 2 (byte 128); 12/2 = 6 -> code 7; 1/2 = 0.5 -> 1; -3/2 = -1.5 -> 0xB; 0.6/2 = 0.3 -> 1 (0.5)
    w = torch.zeros(1, 32)
    w[0, :4] = torch.tensor([12.0, 1.0, -3.0, 0.6])
    q = quantize_mxfp4(w)
    assert q.scale.tolist() == [[128]]
    assert q.packed[0, :2].tolist() == [0x17, 0x1B]
    assert q.dequantize()[0, :4].tolist() == [12.0, 1.0, -3.0, 1.0]


def test_mxfp4_roundtrip_exact_on_representable_values():
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (7, 64, 256), generator=g, dtype=torch.uint8)
    exps = torch.randint(100, 150, (7, 64, 8), generator=g, dtype=torch.uint8)
    w = dequantize_mxfp4(pack_nibbles(codes), exps)
    q = quantize_mxfp4(w)
    assert torch.equal(q.dequantize(), w)  # representable values survive a requantisation bit for bit


def test_mxfp4_error_bound_on_random_weights():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(128, 512, generator=g)
    d = quantize_mxfp4(w).dequantize()
    # the widest E2M1 step is 4 -> 6 (2 units of the group scale): an element is off by at most 1 scale unit
    err = (d - w).abs()
    scale = ue8m0_decode(quantize_mxfp4(w).scale).repeat_interleave(32, -1)
    assert bool((err <= scale).all())
    assert float((d - w).norm() / w.norm()) < 0.12


def test_mxfp4_rejects_non_finite_and_bad_shapes():
    w = torch.randn(4, 64)
    w[2, 5] = float("nan")
    with pytest.raises(ValueError, match=r"non-finite weight.*\(2, 5\)"):
        quantize_mxfp4(w)
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp4(torch.randn(4, 48))
    with pytest.raises(ValueError, match="scale shape"):
        MXFP4Tensor(torch.zeros(4, 32, dtype=torch.uint8), torch.zeros(4, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        MXFP4Tensor(torch.zeros(4, 32, dtype=torch.int8), torch.zeros(4, 2, dtype=torch.uint8))


def test_mxfp4_nan_scale_decodes_group_to_nan():
    packed = torch.full((1, 32), 0x22, dtype=torch.uint8)
    scale = torch.tensor([[127, 255]], dtype=torch.uint8)
    d = dequantize_mxfp4(packed, scale)
    assert d[0, :32].eq(1.0).all() and d[0, 32:].isnan().all()


def test_mxfp4_matches_ocp_bit_layout_on_a_known_byte_stream():
    # OCP MX: element i of a block is nibble i; low nibble first. 0x7F: element0 = 0xF (-6), element1 = 0x7 (+6)
    packed = torch.tensor([[0xF7] + [0] * 15], dtype=torch.uint8)
    scale = torch.tensor([[126]], dtype=torch.uint8)  # 0.5
    assert dequantize_mxfp4(packed, scale)[0, :2].tolist() == [3.0, -3.0]


@pytest.mark.parametrize(("amax", "scale"), [(448.0, 1.0), (448.1, 2.0), (224.0, 0.5), (1.0, 2.0**-8), (0.0, 1.0)])
def test_fp8_scale_power_of_two(amax, scale):
    assert fp8_scale_for_amax(torch.tensor([amax])).item() == scale


def test_fp8_quantise_known_values_and_roundtrip():
    x = torch.zeros(2, 256)
    x[0, 0], x[0, 1], x[0, 2] = 896.0, 1.0, -3.3  # amax 896 -> scale 2
    x[1, 128] = 1e-3
    q, s = quantize_fp8_e4m3_1x128(x)
    assert s.tolist() == [[2.0, 1.0], [1.0, fp8_scale_for_amax(torch.tensor([1e-3])).item()]]
    d = dequantize_fp8_1x128(q, s)
    assert d[0, 0].item() == 896.0 and d[0, 1].item() == 1.0
    assert d[0, 2].item() == -3.25  # E4M3 near 1.65: step 0.125 -> 1.625 * 2 = 3.25 (RNE)
    assert abs(d[1, 128].item() - 1e-3) / 1e-3 < 2**-4
    # a representable tensor survives requantisation bit for bit
    q2, s2 = quantize_fp8_e4m3_1x128(d)
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(s2, s)


def test_fp8_random_relative_error():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 1024, generator=g) * torch.logspace(-3, 3, 64).unsqueeze(1)
    d = dequantize_fp8_1x128(*quantize_fp8_e4m3_1x128(x))
    assert float((d - x).norm() / x.norm()) < 2**-4


def test_fp8_nan_propagates_to_its_block_only():
    x = torch.randn(2, 256)
    x[1, 200] = float("nan")
    q, s = quantize_fp8_e4m3_1x128(x)
    d = dequantize_fp8_1x128(q, s)
    assert d[1, 128:].isnan().all()
    assert not d[0].isnan().any() and not d[1, :128].isnan().any()
    assert torch.isnan(s[1, 1]) and not torch.isnan(s[0]).any()


def test_e2m1_values_table_is_the_format():
    # 2^(e-1) * (1 + m/2) for normal codes, m/2 for the subnormal code
    for c in range(8):
        e, m = c >> 1, c & 1
        want = (m / 2) if e == 0 else 2.0 ** (e - 1) * (1 + m / 2)
        assert E2M1_VALUES[c] == want
