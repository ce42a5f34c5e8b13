"""Probe kernel: each CTA records the SM it ran on (%smid) after spinning for `spin_ns`, so a grid of a few CTAs
per SM spreads over every SM its stream may use. Used to prove partitions are disjoint and stay inside their SMs.

    out[cta] = %smid        grid = out.numel() CTAs of 32 threads; spin keeps CTAs resident long enough to fill
"""

# No `from __future__ import annotations` in kernel files: the DSL reads the annotations as live objects.
from functools import cache

import torch

from gcmoe_core.cutedsl import as_cute, compile_kernel, cutlass_modules, target_arch

cutlass, cute = cutlass_modules()  # places the DSL cache under GCMOE_CACHE_DIR before the first import
import cuda.bindings.driver as cuda  # noqa: E402
from cutlass import runtime as crt  # noqa: E402
from cutlass.cute.runtime import make_fake_compact_tensor  # noqa: E402


@cute.kernel
def smid_kernel(out: cute.Tensor, spin_ns: cutlass.Int64):
    bidx, _, _ = cute.arch.block_idx()
    tidx, _, _ = cute.arch.thread_idx()
    t0 = cute.arch.globaltimer()
    while cute.arch.globaltimer() - t0 < spin_ns:
        pass
    if tidx == 0:
        out[bidx] = cute.arch.smid()


@cute.jit
def launch(out: cute.Tensor, spin_ns: cutlass.Int64, stream: cuda.CUstream):
    smid_kernel(out, spin_ns).launch(grid=[cute.size(out), 1, 1], block=[32, 1, 1], stream=stream)


@cache
def compiled(arch: str):
    fake = make_fake_compact_tensor(cutlass.Int32, (cute.sym_int(),))
    return compile_kernel(launch, fake, cutlass.Int64(0), crt.make_fake_stream(), arch=arch, name="smid")


def record_smids(out: torch.Tensor, spin_ns: int, stream: torch.cuda.Stream | None = None) -> None:
    """Launch the probe on `stream` (default: current): out[i] = SM id of CTA i. out: int32 CUDA tensor."""
    if out.dtype != torch.int32 or not out.is_cuda or out.dim() != 1:
        raise ValueError("record_smids: out must be a 1-D int32 CUDA tensor")
    stream = stream or torch.cuda.current_stream()
    kern = compiled(target_arch(out.device.index))
    kern(as_cute(out), cutlass.Int64(spin_ns), cuda.CUstream(stream.cuda_stream))
