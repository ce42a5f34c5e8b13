"""The in-register E2M1 -> E4M3 decode: bit-exact Python models of its PTX (CPU), and the standard-layout decode as a
standalone elementwise kernel (defined here: the sm_90a toolchain's smallest compile, its SASS read offline, and on
an SM90 GPU against gcmoe_core.formats); the grouped kernels' split-sign decode against the standard one."""

from functools import cache

import pytest
import torch

from gcmoe_core.formats import e2m1_decode, pack_nibbles

# The standard code layout's decode, 9 instructions per 8 values (the prepacked split-sign layout needs 7:
# decode_ptx.DECODE8_SPLIT_SIGN_PTX): $0, $1 = out words (codes 0-3, codes 4-7); $2 = 8 codes; $3, $4 = the LUT.
#   magnitude: prmt over the 8-byte LUT with the code's low 3 bits;
#   sign:      prmt in sign-replicate mode over (word << 4, word) gives 0xFF/0x00 per byte from each code's bit 3;
#   merge:     lop3  out = mag | (sign & 0x80808080)
DECODE8_PTX = """{
.reg .b32 idx, idxh, w4, pos, msk;
and.b32 idx, $2, 0x77777777;
shl.b32 w4, $2, 4;
prmt.b32 pos, $3, $4, idx;
prmt.b32 msk, w4, $2, 0xD9C8;
lop3.b32 $0, pos, msk, 0x80808080, 0xF8;
shr.u32 idxh, idx, 16;
prmt.b32 pos, $3, $4, idxh;
prmt.b32 msk, w4, $2, 0xFBEA;
lop3.b32 $1, pos, msk, 0x80808080, 0xF8;
}"""
E4M3_OF_E2M1 = (0x00, 0x30, 0x38, 0x3C, 0x40, 0x44, 0x48, 0x4C)
LUT_LO = E4M3_OF_E2M1[0] | E4M3_OF_E2M1[1] << 8 | E4M3_OF_E2M1[2] << 16 | E4M3_OF_E2M1[3] << 24
LUT_HI = E4M3_OF_E2M1[4] | E4M3_OF_E2M1[5] << 8 | E4M3_OF_E2M1[6] << 16 | E4M3_OF_E2M1[7] << 24
WORDS_PER_THREAD = 4  # one LDG.E.128 of codes, two STG.E.128 of E4M3 bytes per thread
THREADS = 128


def prmt_reference(a: int, b: int, sel: int) -> int:
    """PTX prmt.b32 (default and sign-replicate modes) on Python ints."""
    pool = (a | b << 32).to_bytes(8, "little")
    out = 0
    for i in range(4):
        s = (sel >> (4 * i)) & 0xF
        byte = pool[s & 7]
        if s & 8:  # sign-replicate mode
            byte = 0xFF if byte & 0x80 else 0x00
        out |= byte << (8 * i)
    return out


def decode8_split_sign_reference(word: int, lut_lo: int = LUT_LO, lut_hi: int = LUT_HI) -> tuple[int, int]:
    """Bit-exact Python model of DECODE8_SPLIT_SIGN_PTX."""
    idx = word & 0x77777777
    lo = prmt_reference(lut_lo, lut_hi, idx) | ((word << 4) & 0x80808080)
    hi = prmt_reference(lut_lo, lut_hi, idx >> 16) | (word & 0x80808080)
    return lo, hi


def decode8_reference(word: int, lut_lo: int = LUT_LO, lut_hi: int = LUT_HI) -> tuple[int, int]:
    """Bit-exact Python model of DECODE8_PTX (prmt semantics included)."""
    idx = word & 0x77777777
    w4 = (word << 4) & 0xFFFFFFFF
    lo = prmt_reference(lut_lo, lut_hi, idx) | (prmt_reference(w4, word, 0xD9C8) & 0x80808080)
    hi = prmt_reference(lut_lo, lut_hi, idx >> 16) | (prmt_reference(w4, word, 0xFBEA) & 0x80808080)
    return lo, hi


@cache
def decode_kernel(arch: str):
    """out_e4m3[r, 8w : 8w + 8] = E4M3(E2M1 codes of packed word w of row r) (unscaled), compiled for arch."""
    from gcmoe_core.cutedsl import compile_kernel, cutlass_modules
    from gcmoe_core.kernel_helpers import inline_ptx

    cutlass, cute = cutlass_modules()
    import cuda.bindings.driver as cuda
    from cutlass import runtime as crt
    from cutlass._mlir.dialects import llvm
    from cutlass.cute.runtime import make_fake_compact_tensor
    from cutlass.cutlass_dsl import T, dsl_user_op

    i32 = cutlass.Int32

    @dsl_user_op
    def decode8(word, lut_lo, lut_hi, *, loc=None, ip=None):
        ret = llvm.StructType.get_literal([T.i32(), T.i32()])
        args = [i32(word), i32(lut_lo), i32(lut_hi)]
        res = inline_ptx(ret, args, DECODE8_PTX, "=r,=r,r,r,r", loc, ip, side_effects=False)
        return i32(llvm.extractvalue(T.i32(), res, [0])), i32(llvm.extractvalue(T.i32(), res, [1]))

    @cute.kernel
    def kernel(packed: cute.Tensor, out: cute.Tensor):  # Int32 [n / WPT, WPT] -> Int32 [n / WPT, 2 WPT]
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        row = bidx * THREADS + tidx
        if row < cute.size(packed, mode=[0]):
            src = cute.make_rmem_tensor(cute.make_layout(WORDS_PER_THREAD), i32)
            dst = cute.make_rmem_tensor(cute.make_layout(2 * WORDS_PER_THREAD), i32)
            cute.autovec_copy(packed[row, None], src)
            for i in cutlass.range_constexpr(WORDS_PER_THREAD):
                lo, hi = decode8(src[i], LUT_LO, LUT_HI)
                dst[2 * i] = lo
                dst[2 * i + 1] = hi
            cute.autovec_copy(dst, out[row, None])

    @cute.jit
    def launch(packed: cute.Tensor, out: cute.Tensor, stream: cuda.CUstream):
        rows = cute.size(packed, mode=[0])
        kernel(packed, out).launch(grid=[(rows + THREADS - 1) // THREADS, 1, 1], block=[THREADS, 1, 1], stream=stream)

    rows = cute.sym_int()
    src = make_fake_compact_tensor(i32, (rows, WORDS_PER_THREAD), stride_order=(1, 0), assumed_align=16)
    dst = make_fake_compact_tensor(i32, (rows, 2 * WORDS_PER_THREAD), stride_order=(1, 0), assumed_align=16)
    return compile_kernel(launch, src, dst, crt.make_fake_stream(), arch=arch, name="mxfp4_decode")


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

    k = decode_kernel("sm_90a")
    ops = sass_opcodes(k.sass())
    assert "PRMT" in ops
    assert "LDG.E.128" in ops and "STG.E.128" in ops, sorted(ops)
    assert not ({"LDL", "STL"} & {o.split(".")[0] for o in ops})
    assert k.resources()["LOCAL"] == 0


def decode_mxfp4_to_e4m3(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] MXFP4 codes (CUDA, contiguous) -> float8_e4m3fn [..., K] E2M1 values (unscaled)."""
    import cuda.bindings.driver as cuda

    from gcmoe_core.cutedsl import as_cute, target_arch

    out = torch.empty(*packed.shape[:-1], packed.shape[-1] * 2, dtype=torch.float8_e4m3fn, device=packed.device)
    src = packed.view(torch.int32).view(-1, WORDS_PER_THREAD)
    dst = out.view(torch.int32).view(-1, 2 * WORDS_PER_THREAD)
    stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
    decode_kernel(target_arch(packed.device.index))(
        as_cute(src, assumed_align=16), as_cute(dst, assumed_align=16), stream
    )
    return out


@pytest.mark.sm90
def test_decode_kernel_on_gpu():
    g = torch.Generator().manual_seed(1)
    for rows, k in ((3, 64), (257, 512), (64, 4096)):
        codes = torch.randint(0, 16, (rows, k), generator=g, dtype=torch.uint8)
        packed = pack_nibbles(codes).cuda()
        out = decode_mxfp4_to_e4m3(packed)
        want = e2m1_decode(codes).to(torch.float8_e4m3fn)
        assert torch.equal(out.cpu().view(torch.uint8), want.view(torch.uint8))
