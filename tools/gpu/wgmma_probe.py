"""How many cycles one FP8 WGMMA costs an SM (run on the GPU): the throughput question behind the sm90 kernels'
per-SM rate at small N (docs/benchmarks/stream-k-h200-2026-11-30.md inferred the tensor pipe as the limit at
N = 8 from stall counters; this measures it).

Each CTA (`wgs` warpgroups) repeats `iters` times: wgmma.fence, 2 subtiles x 4 k32 steps of m64 x N x k32 E4M3
WGMMAs (A from registers, RS, or from shared memory, SS; B from shared memory), commit, wait_group(0) — the
kernels' per-window issue pattern without decode or loads. The grid is `ctas_per_sm` x the SM count; the result is
SM-cycles per WGMMA = elapsed x SM clock x SMs / (all WGMMAs), and the weights (64 x 32 per WGMMA for RS, N x 32 when
the weights are the N operand) per SM-cycle.

    python tools/gpu/wgmma_probe.py [--out FILE.json]
"""

import argparse
import json

import torch

from gcmoe_core.cutedsl import cutlass_modules

cutlass, cute = cutlass_modules()
import cuda.bindings.driver as cuda  # noqa: E402
import cutlass.utils as utils  # noqa: E402
import cutlass.utils.hopper_helpers as sm90_utils  # noqa: E402
from cutlass.cute.nvgpu import warpgroup  # noqa: E402

Int32, Float32 = cutlass.Int32, cutlass.Float32
K = 128


class Probe:
    def __init__(self, n: int, source: str, wgs: int, subs: int):
        self.n, self.source, self.wgs, self.subs = n, source, wgs, subs

    @cute.jit
    def __call__(self, out: cute.Tensor, iters: Int32, ctas: Int32, stream: cuda.CUstream):
        f8 = cutlass.Float8E4M3FN
        src = warpgroup.OperandSource.RMEM if self.source == "rs" else warpgroup.OperandSource.SMEM
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            f8, f8, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K, Float32, (1, 1, 1), (64, self.n), src
        )
        b_staged = sm90_utils.make_smem_layout_b(utils.LayoutEnum.ROW_MAJOR, (64, self.n, K), f8, 1)
        a_staged = sm90_utils.make_smem_layout_a(utils.LayoutEnum.ROW_MAJOR, (64, self.n, K), f8, 1)

        @cute.struct
        class Shared:
            sB: cute.struct.Align[cute.struct.MemRange[f8, cute.cosize(b_staged)], 1024]
            sA: cute.struct.Align[cute.struct.MemRange[f8, cute.cosize(a_staged)], 1024]

        self.shared = Shared
        self.kernel(out, iters, tiled_mma, b_staged, a_staged).launch(
            grid=[ctas, 1, 1], block=[128 * self.wgs, 1, 1], smem=Shared.size_in_bytes(), stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        out: cute.Tensor,
        iters: Int32,
        tiled_mma: cute.TiledMma,
        b_staged: cute.ComposedLayout,
        a_staged: cute.ComposedLayout,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        tw = tidx % 128
        st = utils.SmemAllocator().allocate(self.shared)
        sB = st.sB.get_tensor(b_staged.outer, swizzle=b_staged.inner)
        sA = st.sA.get_tensor(a_staged.outer, swizzle=a_staged.inner)
        # small finite E4M3 bytes everywhere (0x30 = 0.5): the sums stay finite
        rawb = cute.recast_tensor(st.sB.get_tensor(cute.make_layout(cute.cosize(b_staged))), Int32)
        for i in cutlass.range(tidx, cute.size(rawb), 128 * self.wgs, unroll=1):
            rawb[i] = Int32(0x30303030)
        rawa = cute.recast_tensor(st.sA.get_tensor(cute.make_layout(cute.cosize(a_staged))), Int32)
        for i in cutlass.range(tidx, cute.size(rawa), 128 * self.wgs, unroll=1):
            rawa[i] = Int32(0x30303030)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier()
        thr = tiled_mma.get_slice(tw)
        tCrB = tiled_mma.make_fragment_B(thr.partition_B(sB))
        c_shape = thr.partition_shape_C((64, self.n))
        acc0 = cute.make_rmem_tensor(c_shape, Float32)
        acc1 = cute.make_rmem_tensor(c_shape, Float32)
        acc0.fill(0.0)
        acc1.fill(0.0)
        if cutlass.const_expr(self.source == "rs"):
            frag0 = cute.make_rmem_tensor(thr.partition_shape_A((64, K)), cutlass.Float8E4M3FN)
            frag1 = cute.make_rmem_tensor(thr.partition_shape_A((64, K)), cutlass.Float8E4M3FN)
            fw0 = cute.recast_tensor(frag0, Int32)
            fw1 = cute.recast_tensor(frag1, Int32)
            for i in cutlass.range_constexpr(cute.size(fw0)):
                fw0[i] = Int32(0x30303030) + (tidx & 1)
                fw1[i] = Int32(0x30303030)
            for _ in cutlass.range(iters, unroll=1):
                warpgroup.fence()
                for kb in cutlass.range_constexpr(4):
                    tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
                    cute.gemm(tiled_mma, acc0, frag0[(None, None, kb)], tCrB[(None, None, kb, 0)], acc0)
                if cutlass.const_expr(self.subs == 2):
                    for kb in cutlass.range_constexpr(4):
                        cute.gemm(tiled_mma, acc1, frag1[(None, None, kb)], tCrB[(None, None, kb, 0)], acc1)
                warpgroup.commit_group()
                warpgroup.wait_group(0)
        else:
            tCrA = tiled_mma.make_fragment_A(thr.partition_A(sA))
            for _ in cutlass.range(iters, unroll=1):
                warpgroup.fence()
                for kb in cutlass.range_constexpr(4):
                    tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
                    cute.gemm(tiled_mma, acc0, tCrA[(None, None, kb, 0)], tCrB[(None, None, kb, 0)], acc0)
                if cutlass.const_expr(self.subs == 2):
                    for kb in cutlass.range_constexpr(4):
                        cute.gemm(tiled_mma, acc1, tCrA[(None, None, kb, 0)], tCrB[(None, None, kb, 0)], acc1)
                warpgroup.commit_group()
                warpgroup.wait_group(0)
        s = Float32(0.0)
        for i in cutlass.range_constexpr(cute.size(acc0)):
            s = s + acc0[i] + acc1[i]
        out[cta * 128 * self.wgs + tidx] = s


def compiled(n: int, source: str, wgs: int, subs: int, arch: str = "sm_90a"):
    from cutlass import runtime as crt
    from cutlass.cute.runtime import make_fake_compact_tensor

    from gcmoe_core.cutedsl import compile_kernel

    out = make_fake_compact_tensor(Float32, (cute.sym_int(),), assumed_align=16)
    return compile_kernel(
        Probe(n, source, wgs, subs),
        out,
        Int32(1),
        Int32(1),
        crt.make_fake_stream(),
        arch=arch,
        name=f"wgmma_probe_{source}_n{n}_wg{wgs}_s{subs}",
    )


VARIANTS = [  # (N, source, warpgroups per CTA, subtiles, CTAs per SM)
    (8, "rs", 2, 2, 1),
    (8, "rs", 2, 2, 2),
    (8, "rs", 4, 2, 1),
    (16, "rs", 2, 2, 1),
    (32, "rs", 2, 2, 1),
    (64, "rs", 2, 2, 1),
    (128, "rs", 2, 1, 1),
    (8, "ss", 2, 2, 1),
    (64, "ss", 2, 2, 1),
    (128, "ss", 2, 1, 1),
    (256, "ss", 2, 1, 1),
]


def main() -> None:
    from gcmoe_core.cutedsl import as_cute
    from gcmoe_core.timing import time_gpu

    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=4000)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    clock_hz = props.clock_rate * 1e3 if hasattr(props, "clock_rate") else 1.98e9
    rows = []
    for n, source, wgs, subs, per_sm in VARIANTS:
        k = compiled(n, source, wgs, subs)
        ctas = sms * per_sm
        out = torch.empty(ctas * 128 * wgs, dtype=torch.float32, device="cuda")
        stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
        run = lambda k=k, out=out, ctas=ctas, stream=stream: k(as_cute(out), Int32(args.iters), Int32(ctas), stream)
        # no operand leaves L2 and nothing is captured: a plain median of launches
        t = time_gpu(run, iters=5, warmup=1, graph=False, cold_l2=False)["median_us"] * 1e-6
        wgmmas_per_sm = per_sm * wgs * subs * 4 * args.iters
        cyc = t * clock_hz / wgmmas_per_sm
        weights = 64 * 32 if source == "rs" else n * 32  # RS: weights are A (64 rows); SS: weights as the N operand
        row = dict(
            n=n,
            source=source,
            warpgroups=wgs,
            subtiles=subs,
            ctas_per_sm=per_sm,
            seconds=t,
            sm_cycles_per_wgmma=round(cyc, 2),
            weights_per_sm_cycle=round(weights / cyc, 1),
            finite=bool(torch.isfinite(out).all()),
        )
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=props.name, clock_hz=clock_hz, iters=args.iters, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
