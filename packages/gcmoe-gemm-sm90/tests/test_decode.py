"""The in-register E2M1 -> E4M3 decode: a bit-exact Python model of its PTX (CPU), its SASS (offline compile), and
the kernel on an SM90 GPU against gcmoe_core.formats."""

import pytest
import torch

from gcmoe_core.formats import e2m1_decode, pack_nibbles
from gcmoe_gemm_sm90.decode_ptx import (
    E4M3_OF_E2M1,
    decode8_reference,
    decode8_split_sign_reference,
)


def _e4m3_bytes(values: torch.Tensor) -> list[int]:
    return values.to(torch.float8_e4m3fn).view(torch.uint8).tolist()


def test_lut_is_e4m3_of_e2m1():
    mags = e2m1_decode(torch.arange(8, dtype=torch.uint8))
    assert list(E4M3_OF_E2M1) == _e4m3_bytes(mags)


def test_decode8_model_exhaustive_per_nibble():
    g = torch.Generator().manual_seed(0)
    words = [int(v) for v in torch.randint(0, 2**32, (4000,), generator=g, dtype=torch.int64)]
    words += [0, 0xFFFFFFFF, 0x88888888, 0x76543210, 0xFEDCBA98]
    for word in words:
        lo, hi = decode8_reference(word)
        codes = torch.tensor([(word >> (4 * i)) & 0xF for i in range(8)], dtype=torch.uint8)
        want = _e4m3_bytes(e2m1_decode(codes))
        got = list(lo.to_bytes(4, "little") + hi.to_bytes(4, "little"))
        # E2M1 -0 (code 8) decodes to E4M3 -0 (0x80); torch gives -0.0 -> 0x80 too
        assert got == want, hex(word)


def test_split_sign_decode_matches_standard():
    """The grouped kernels' decode of the split-sign layout gives the same bytes as the standard decode, for every
    LUT (each relative exponent's table)."""
    from gcmoe_gemm_sm90.prepack import lut_words, sign_layout

    g = torch.Generator().manual_seed(3)
    words = [int(v) for v in torch.randint(0, 2**32, (2000,), generator=g, dtype=torch.int64)]
    words += [0, 0xFFFFFFFF, 0x88888888, 0x76543210, 0xFEDCBA98, 0x80000008]
    luts = [(int(lo) & 0xFFFFFFFF, int(hi) & 0xFFFFFFFF) for lo, hi in lut_words().tolist()]
    std = torch.tensor(words, dtype=torch.int64)
    std = torch.where(std >= 2**31, std - 2**32, std).to(torch.int32)
    split = sign_layout(std.view(torch.uint8), to_split=True).view(torch.int32).tolist()  # the prepack's own mapping
    for i, word in enumerate(words):
        lo, hi = luts[i % len(luts)]
        got = decode8_split_sign_reference(split[i] & 0xFFFFFFFF, lo, hi)
        assert got == decode8_reference(word, lo, hi), hex(word)


@pytest.mark.compile
def test_decode_kernel_sass_offline():
    from gcmoe_core.cutedsl import sass_opcodes
    from gcmoe_gemm_sm90.kernel_decode import compiled

    k = compiled("sm_90a")
    ops = sass_opcodes(k.sass())
    assert "PRMT" in ops
    assert "LDG.E.128" in ops and "STG.E.128" in ops, sorted(ops)
    assert not ({"LDL", "STL"} & {o.split(".")[0] for o in ops})
    assert k.resources()["LOCAL"] == 0


@pytest.mark.sm90
def test_decode_kernel_on_gpu():
    from gcmoe_gemm_sm90.kernel_decode import decode_mxfp4_to_e4m3

    g = torch.Generator().manual_seed(1)
    for rows, k in ((3, 64), (257, 512), (64, 4096)):
        codes = torch.randint(0, 16, (rows, k), generator=g, dtype=torch.uint8)
        packed = pack_nibbles(codes).cuda()
        out = decode_mxfp4_to_e4m3(packed)
        want = e2m1_decode(codes).to(torch.float8_e4m3fn)
        assert torch.equal(out.cpu().view(torch.uint8), want.view(torch.uint8))
