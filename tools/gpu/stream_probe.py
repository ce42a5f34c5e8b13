"""How fast the sm90 kernels' weight stream can be with no compute at all (run on the GPU): the grid shapes the layer
launches at small T, streamed through the same pipeline (bulk copies of 16 KB weight windows + 1 KB scale records
into `stages` shared-memory stages on mbarriers, PipelineTmaAsync), each window released as soon as it has landed.

The question behind it (docs/benchmarks/layer-bounds-h200-2026-12-01.md): at T <= 32 the layer is neither bound by the
decode (no decode at all buys <= 1.11x), nor by more stages or an L2 prefetch; the 2026-11-29 stage ablations
(sm90-grouped-v6) streamed W1 + W2 of DeepSeek-V4-Flash at T = 1 in 1.83x the floor with no compute. This separates
the grid's shape (CTAs, windows per CTA, CTAs per SM, stages, one wave or two) from everything else: a shape that
cannot stream at the floor here cannot in the kernels either, and a persistent schedule (#15 item 1) is worth
building only if its shape streams faster.

Each CTA streams its own contiguous `windows` x 17 KB of the buffer (L2 made cold before each replay: ColdL2); one
word per window per warp is read back (summed into `out`, checked against torch) so every consumer waits for every
window. Rate = bytes / time of a CUDA-graph replay, median, against the device-to-device copy bandwidth of the run.

    python tools/gpu/stream_probe.py [--out FILE.json]
"""

import argparse
import json
import statistics

import torch

from gcmoe_core.cutedsl import cutlass_modules
from gcmoe_core.kernel_helpers import bulk_copy_g2s
from gcmoe_gemm_sm90.config import WINDOW_SCALE_BYTES, WINDOW_WEIGHT_BYTES

cutlass, cute = cutlass_modules()
import cuda.bindings.driver as cuda  # noqa: E402
import cutlass.pipeline as pipeline  # noqa: E402
import cutlass.utils as utils  # noqa: E402

Int32, Int64 = cutlass.Int32, cutlass.Int64
WINDOW_BYTES = WINDOW_WEIGHT_BYTES + WINDOW_SCALE_BYTES  # one window as the kernels stream it: weights, scale records
THREADS = 256  # two warpgroups, as the kernels at N <= 24


class StreamProbe:
    def __init__(self, stages: int, occupancy: int, chunks: int = 1, evict_first: bool = False):
        self.stages, self.occupancy, self.chunks, self.evict_first = stages, occupancy, chunks, evict_first

    @cute.jit
    def __call__(self, src: cute.Tensor, out: cute.Tensor, windows: Int32, ctas: Int32, stream: cuda.CUstream):
        @cute.struct
        class Shared:
            mbar: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            sW: cute.struct.Align[cute.struct.MemRange[Int32, WINDOW_BYTES // 4 * self.stages], 128]

        self.shared = Shared
        self.kernel(src, out, windows).launch(
            grid=[ctas, 1, 1],
            block=[THREADS, 1, 1],
            smem=Shared.size_in_bytes(),
            stream=stream,
            min_blocks_per_mp=self.occupancy,
            preferred_smem_carveout=100,  # (also keeps the DSL from querying a device at compile time)
        )

    @cute.kernel
    def kernel(self, src: cute.Tensor, out: cute.Tensor, windows: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = tidx % 32
        st = utils.SmemAllocator().allocate(self.shared)
        sw = st.sW.get_tensor(cute.make_layout(WINDOW_BYTES // 4 * self.stages))
        pipe = window_pipeline(st.mbar.data_ptr(), self.stages, THREADS // 32)
        cute.arch.barrier()
        base = src.iterator.toint() + Int64(cta) * Int64(windows) * WINDOW_BYTES
        dst = st.sW.data_ptr().toint()
        prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        cons = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        issued = Int32(0)
        if warp == 0:  # the whole warp (the arrive elects one lane itself), as the kernels' producer
            for _ in cutlass.range_constexpr(self.stages - 1):
                if issued < windows:
                    self.produce(pipe, prod, base, dst, issued)
                    prod.advance()
                    issued += 1
        acc = Int32(0)
        for _w in cutlass.range(windows, unroll=1):
            pipe.consumer_wait(cons)
            if lane == 0:  # one word of the stage per warp: the window has landed
                acc = acc + sw[cons.index * (WINDOW_BYTES // 4) + warp]
            pipe.consumer_release(cons)
            cons.advance()
            if warp == 0 and issued < windows:
                self.produce(pipe, prod, base, dst, issued)
                prod.advance()
                issued += 1
        if lane == 0:
            out[cta * (THREADS // 32) + warp] = acc

    @cute.jit
    def produce(self, pipe: pipeline.PipelineTmaAsync, prod: pipeline.PipelineState, base: Int64, dst: Int32, w: Int32):
        """Window w of this CTA into the next stage: its weights and scale records, two bulk copies on its mbarrier."""
        pipe.producer_acquire(prod)
        bar = pipe.producer_get_barrier(prod).toint()
        with cute.arch.elect_one():
            at = base + Int64(w) * WINDOW_BYTES
            stage = dst + prod.index * WINDOW_BYTES
            for c in cutlass.range_constexpr(self.chunks):  # the weights in `chunks` bulk copies
                part = WINDOW_WEIGHT_BYTES // self.chunks
                bulk_copy_g2s(stage + c * part, at + c * part, part, bar, self.evict_first)
            bulk_copy_g2s(
                stage + WINDOW_WEIGHT_BYTES, at + WINDOW_WEIGHT_BYTES, WINDOW_SCALE_BYTES, bar, self.evict_first
            )


def window_pipeline(mbar, stages: int, consumer_warps: int) -> pipeline.PipelineTmaAsync:
    """(inside a kernel) The kernels' stage pipeline: `stages` stages of one window (WINDOW_BYTES by bulk copy) on the
    mbarriers at `mbar` (2 x stages), one producer thread, every warp of `consumer_warps` releasing each stage."""
    return pipeline.PipelineTmaAsync.create(
        barrier_storage=mbar,
        num_stages=stages,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumer_warps),
        tx_count=WINDOW_BYTES,
        cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
    )


def compiled(stages: int, occupancy: int, chunks: int = 1, evict_first: bool = False, arch: str = "sm_90a"):
    from cutlass import runtime as crt
    from cutlass.cute.runtime import make_fake_compact_tensor

    from gcmoe_core.cutedsl import compile_kernel

    src = make_fake_compact_tensor(Int32, (cute.sym_int(),), assumed_align=16)
    out = make_fake_compact_tensor(Int32, (cute.sym_int(),), assumed_align=16)
    return compile_kernel(
        StreamProbe(stages, occupancy, chunks, evict_first),
        src,
        out,
        Int32(1),
        Int32(1),
        crt.make_fake_stream(),
        arch=arch,
        name=f"stream_probe_s{stages}_o{occupancy}_c{chunks}{'_ef' if evict_first else ''}",
    )


# (name, CTAs, windows per CTA, CTAs per SM its shared memory allows, stages[, bulk copies per window's weights]):
# the layer's W1 / W2 grids at small T on an EP8 rank (H200, 132 SMs), and the same bytes balanced over every SM slot
SHAPES = [
    ("v4flash_t1_w1_ksplit", 224, 16, 2, 5),  # 7 experts x 16 tiles x 2 K splits
    ("v4flash_t1_w1_ksplit_s3", 224, 16, 2, 3),
    ("v4flash_t1_w1_unsplit", 112, 32, 2, 6),
    ("v4flash_t1_w2_split", 224, 8, 2, 5),
    ("v4flash_t1_balanced_264", 264, 14, 2, 5),  # ~the K-split W1's bytes, every slot the same
    ("v4flash_t1_balanced_132", 132, 27, 1, 12),  # one CTA per SM, deep
    ("v3_t1_w1_stream_k", 264, 31, 2, 4),  # 144 tiles x 56 windows over 264 slots
    ("v3_t1_w1_stream_k_s6", 264, 31, 2, 6),
    ("v3_t1_w2", 252, 16, 2, 6),  # 9 experts x 28 tiles
    ("v4flash_t8_w1", 432, 32, 2, 6),  # 27 experts x 16 tiles: 1.6 waves
    ("v4flash_t32_w1", 528, 32, 2, 5),  # 33 x 16: two waves
    ("steady_264x64", 264, 64, 2, 6),  # long streams: the pipeline's steady rate
    ("steady_264x64_chunks4", 264, 64, 2, 6, 4),  # the same, each window's weights in four 4 KB copies
    ("steady_132x128", 132, 128, 1, 12),
    ("steady_396x43", 396, 43, 3, 4),
    ("steady_528x32", 528, 32, 2, 6),  # two waves of the same bytes
    # a persistent layer: W1 + W2's bytes (V4-Flash T = 1: 5,440 windows; V3 T = 1: 12,240) over every slot evenly
    ("v4flash_t1_layer_balanced_264", 264, 21, 2, 5),
    ("v4flash_t1_layer_balanced_132", 132, 41, 1, 12),
    ("v3_t1_layer_balanced_264", 264, 46, 2, 5),
    ("v3_t1_layer_balanced_132", 132, 93, 1, 12),
]


def main() -> None:
    from gcmoe_core.cutedsl import as_cute
    from gcmoe_core.timing import L2_FLUSHES, ColdL2, capture_graph, copy_bandwidth, time_once

    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--flush", nargs="+", default=["write", "read"], choices=L2_FLUSHES)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    flushes = {m: ColdL2(dev, m) for m in args.flush}
    rows = []
    for name, ctas, windows, occupancy, stages, *chunks in SHAPES:
        kernels = {
            "probe": compiled(stages, occupancy, *chunks),
            "probe_ef": compiled(stages, occupancy, *chunks or [1], True),
        }
        nbytes = ctas * windows * WINDOW_BYTES
        src = torch.randint(0, 1 << 30, (nbytes // 4,), dtype=torch.int32, device=dev)
        out = torch.zeros(ctas * THREADS // 32, dtype=torch.int32, device=dev)
        red = torch.zeros((), dtype=torch.int32, device=dev)
        operands = (as_cute(src), as_cute(out), Int32(windows), Int32(ctas))
        # probe_ef: the same with the evict_first L2 hint on every bulk copy. (The stream at call time: the capture's.)
        graphs = {
            v: capture_graph(
                lambda k=k, a=operands: k(*a, cuda.CUstream(torch.cuda.current_stream().cuda_stream)), 2, dev
            )[0]
            for v, k in kernels.items()
        }
        # the same bytes read by torch's reduction kernel (vectorised loads, no shared memory): a reference reader
        graphs["torch_amax"] = capture_graph(lambda s=src, r=red: torch.amax(s, dim=0, out=r), 2, dev)[0]
        torch.cuda.synchronize()
        times = {(v, m): [] for v in graphs for m in flushes}
        for _ in range(args.iters):
            for (v, m), ts in times.items():
                ts.append(time_once(graphs[v].replay, flushes[m]))
        out.zero_()
        graphs["probe_ef"].replay()  # (the last replays were the hint's: both kernels' read-back checked)
        torch.cuda.synchronize()
        ok_ef = out.clone()
        out.zero_()
        graphs["probe"].replay()
        torch.cuda.synchronize()
        expect = src.view(ctas, windows, WINDOW_BYTES // 4)[:, :, : THREADS // 32].sum(1, dtype=torch.int64)
        expect = (expect + (1 << 31)) % (1 << 32) - (1 << 31)
        ok = all(torch.equal(o.view(ctas, -1).to(torch.int64), expect) for o in (out, ok_ef))
        floor_us = nbytes / bw * 1e6
        row = dict(
            shape=name,
            ctas=ctas,
            windows=windows,
            occupancy=occupancy,
            stages=stages,
            chunks=(chunks or [1])[0],
            mb=round(nbytes / 1e6, 1),
            floor_us=round(floor_us, 1),
            read_back_ok=ok,
        )
        for (v, m), ts in times.items():
            t = statistics.median(ts)
            row[f"{v}_{m}_us"] = round(t, 1)
            row[f"{v}_{m}_x_floor"] = round(t / floor_us, 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
        del src, out, graphs
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), copy_tb_s=bw / 1e12, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
