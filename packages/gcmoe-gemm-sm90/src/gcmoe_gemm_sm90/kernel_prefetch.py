"""L2 prefetch of byte ranges for sm_90a: the layer's shared-expert W1 weights, beside its comm kernels.

At small T a layer call starts with its comm kernels (publish, dispatch: chains of dependent round trips that read a
few KB) and W1 launches only after them: HBM idles meanwhile. The shared experts' W1 weights are read by every call
and known before it starts, so the layer prefetches them on a side branch of its graph, beside the comm kernels
(gcmoe's sm90 backend). It gains where L2 holds dirty lines (their write-back leaves W1's stream), and mostly through
the second half of each range: the shared expert's last W1 tiles, which stream_k puts last, on the CTAs launched
last. Prefetching W1's or W2's next windows this way, or warming them by loads, made the layer slower (the records:
docs/benchmarks/index.md).

    for every range r (address, bytes: by value) and every 16 KB chunk c of it:
        cp.async.bulk.prefetch.L2 [address_r + 16 KB c], min(16 KB, bytes_r - 16 KB c)
Grid [ctas] x THREADS: thread i of CTA j issues chunks j THREADS + i, + ctas THREADS, ... of each range. The kernel
ends once every prefetch is issued; they complete in the memory system on their own. Nothing reads their result and
nothing waits for them, so the prefetch cannot change a value: it only moves when bytes arrive in L2.
"""

# No `from __future__ import annotations` in kernel files: the DSL reads the annotations as live objects.
from functools import cache

from gcmoe_core.cutedsl import compile_kernel, cutlass_modules
from gcmoe_core.kernel_helpers import bulk_prefetch_l2

cutlass, cute = cutlass_modules()
import cuda.bindings.driver as cuda  # noqa: E402
from cutlass import runtime as crt  # noqa: E402

Int32, Int64 = cutlass.Int32, cutlass.Int64
CHUNK = 16384  # bytes per prefetch instruction (one weight window)
THREADS = 128
MAX_RANGES = 8


class PrefetchL2:
    """`ranges` (address, bytes) pairs, each bytes a multiple of 16 and the address 16-byte aligned."""

    def __init__(self, ranges: int):
        if not 1 <= ranges <= MAX_RANGES:
            raise ValueError(f"PrefetchL2: 1..{MAX_RANGES} ranges, got {ranges}")
        self.ranges = ranges

    @cute.jit
    def __call__(self, addrs: tuple, nbytes: tuple, ctas: Int32, stream: cuda.CUstream):
        self.kernel(addrs, nbytes).launch(grid=[ctas, 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, addrs: tuple, nbytes: tuple):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        step = cute.arch.grid_dim()[0] * THREADS
        for r in cutlass.range_constexpr(self.ranges):
            n = nbytes[r]
            for c in cutlass.range(cta * THREADS + tidx, (n + CHUNK - 1) // CHUNK, step, unroll=1):
                bulk_prefetch_l2(addrs[r] + Int64(c) * CHUNK, cutlass.min(n - c * CHUNK, CHUNK))


@cache
def compiled(ranges: int, arch: str = "sm_90a"):
    return compile_kernel(
        PrefetchL2(ranges),
        tuple(Int64(0) for _ in range(ranges)),
        tuple(Int32(16) for _ in range(ranges)),
        Int32(1),
        crt.make_fake_stream(),
        arch=arch,
        name=f"prefetch_l2_r{ranges}",
    )
