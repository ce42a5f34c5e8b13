"""Standalone MXFP4 -> E4M3 decode kernel: the W1/W2 mainloop's in-register decode as an elementwise kernel.

    out_e4m3[r, 8w : 8w+8] = E4M3(E2M1 codes of packed word w of row r)      (unscaled: the group scale stays apart)

It is the compile smoke test of the sm_90a toolchain (CI compiles it on a CPU and reads its SASS: PRMT, 128-bit
loads/stores, no local memory) and is checked bit-exactly on the GPU against gcmoe_core.formats.
Each thread loads 4 packed words (16 bytes, one LDG.E.128) and stores 8 output words (2 x STG.E.128).
"""

# No `from __future__ import annotations` in kernel files: the DSL reads the annotations as live objects.
from functools import cache

import torch

from gcmoe_core.cutedsl import as_cute, compile_kernel, cutlass_modules, target_arch
from gcmoe_core.kernel_helpers import inline_ptx

from .decode_ptx import DECODE8_PTX, LUT_HI, LUT_LO

cutlass, cute = cutlass_modules()  # places the DSL cache under GCMOE_CACHE_DIR before the first import
import cuda.bindings.driver as cuda  # noqa: E402
from cutlass import runtime as crt  # noqa: E402
from cutlass._mlir.dialects import llvm  # noqa: E402
from cutlass.cute.runtime import make_fake_compact_tensor  # noqa: E402
from cutlass.cutlass_dsl import T, dsl_user_op  # noqa: E402

WORDS_PER_THREAD = 4
THREADS = 128


@dsl_user_op
def decode8(word, lut_lo, lut_hi, ptx: str = DECODE8_PTX, *, loc=None, ip=None):
    """8 E2M1 codes (one word) -> 8 E4M3 bytes (two words) through the LUT; ptx: the code layout's decode."""
    i32 = T.i32()
    args = [cutlass.Int32(word), cutlass.Int32(lut_lo), cutlass.Int32(lut_hi)]
    res = inline_ptx(llvm.StructType.get_literal([i32, i32]), args, ptx, "=r,=r,r,r,r", loc, ip, side_effects=False)
    lo = llvm.extractvalue(i32, res, [0], loc=loc, ip=ip)
    hi = llvm.extractvalue(i32, res, [1], loc=loc, ip=ip)
    return cutlass.Int32(lo), cutlass.Int32(hi)


@cute.kernel
def decode_kernel(packed: cute.Tensor, out: cute.Tensor):
    # packed: Int32 [n / WPT, WPT]; out: Int32 [n / WPT, 2 * WPT]  (rows of one thread's vector)
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    row = bidx * THREADS + tidx
    if row < cute.size(packed, mode=[0]):
        src = cute.make_rmem_tensor(cute.make_layout(WORDS_PER_THREAD), cutlass.Int32)
        dst = cute.make_rmem_tensor(cute.make_layout(2 * WORDS_PER_THREAD), cutlass.Int32)
        cute.autovec_copy(packed[row, None], src)
        for i in cutlass.range_constexpr(WORDS_PER_THREAD):
            lo, hi = decode8(src[i], LUT_LO, LUT_HI)
            dst[2 * i] = lo
            dst[2 * i + 1] = hi
        cute.autovec_copy(dst, out[row, None])


@cute.jit
def launch(packed: cute.Tensor, out: cute.Tensor, stream: cuda.CUstream):
    rows = cute.size(packed, mode=[0])
    decode_kernel(packed, out).launch(
        grid=[(rows + THREADS - 1) // THREADS, 1, 1], block=[THREADS, 1, 1], stream=stream
    )


@cache
def compiled(arch: str):
    rows = cute.sym_int()
    src = make_fake_compact_tensor(cutlass.Int32, (rows, WORDS_PER_THREAD), stride_order=(1, 0), assumed_align=16)
    dst = make_fake_compact_tensor(cutlass.Int32, (rows, 2 * WORDS_PER_THREAD), stride_order=(1, 0), assumed_align=16)
    return compile_kernel(launch, src, dst, crt.make_fake_stream(), arch=arch, name="mxfp4_decode")


def decode_mxfp4_to_e4m3(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] MXFP4 codes (CUDA) -> float8_e4m3fn [..., K] E2M1 values (unscaled)."""
    if packed.dtype != torch.uint8 or not packed.is_cuda or not packed.is_contiguous():
        raise ValueError("decode_mxfp4_to_e4m3: packed must be a contiguous uint8 CUDA tensor")
    if packed.numel() % (4 * WORDS_PER_THREAD):
        raise ValueError(f"decode_mxfp4_to_e4m3: element count must be a multiple of {4 * WORDS_PER_THREAD} bytes")
    out = torch.empty(*packed.shape[:-1], packed.shape[-1] * 2, dtype=torch.float8_e4m3fn, device=packed.device)
    src = packed.view(torch.int32).view(-1, WORDS_PER_THREAD)
    dst = out.view(torch.int32).view(-1, 2 * WORDS_PER_THREAD)
    kern = compiled(target_arch(packed.device.index))
    kern(
        as_cute(src, assumed_align=16),
        as_cute(dst, assumed_align=16),
        cuda.CUstream(torch.cuda.current_stream().cuda_stream),
    )
    return out
