"""Does one persistent launch over a unit queue, W2 units waiting for their expert's W1, stream the layer's weights
faster than W1 and W2 as two launches? (run on the GPU; no compute, only the weights' stream)

#15 item 1 (one persistent W1 -> W2 launch) is worth building only if its schedule streams faster than the two
launches the layer runs. docs/benchmarks/l2-hint-h200-2026-12-01.md bounded it with W1 + W2's bytes balanced over
every CTA slot and no dependency (V4-Flash T = 1: 29.8 µs against 35 as two launches, write flush + evict_first);
this adds what the real kernel must keep: W2's units of expert e start only when all of e's W1 windows are consumed.

Kernel: `ctas` persistent CTAs (two per SM), 8 consumer warps + 1 producer warp. The producer claims units in queue
order from a global counter (atom.add), for a W2 unit first waits (acquire) until done[e] reaches the expert's W1
window count, writes the unit's index into a shared ring (read by the consumers once its first window has landed:
the stage's full mbarrier orders it), and bulk-copies the unit's windows (17 KB each: 16 KB of weights + 1 KB of
scale records, as the kernels' stages) into `stages` stages. Consumers read one word of each window; after a W1
unit's last window, consumer warp 0 adds the unit's windows to done[e] (release). A claimed index past the queue is
sent down the pipe as one last (dummy) window that tells the consumers to stop.

Queue (int32 [units, 4]: first window record, windows, expert a W2 unit waits for (-1: none), expert a W1 unit counts
in (-1: none)), built on the host (`queue`):
    w1_then_w2   every W1 unit (experts in order; in an expert, window chunk-major over its tiles, so all CTAs stream
                 the same expert at once and experts finish one after another), then every W2 unit the same way
    interleaved  W1(e0), W1(e1), W2(e0), W1(e2), W2(e1), ..., W2(e_last): W2 of an expert one expert behind its W1
    two_launch   W1's units as one launch, then W2's as a second on the same stream (today's structure, as a
                 baseline; without PDL, so W2's CTAs start only once W1's have all exited, a little later than the
                 layer's W2)
A unit is `unit` windows of one tile (the tile's windows split in chunks; `unit` >= a tile's windows: whole tiles).
Two kernels: the producer waits for a W2 unit's expert before copying its windows; `_prefill`: the producer streams
them at once (the stages fill ahead, as the real W2 copies its weights before its wait) and the consumers wait
instead.

    python tools/gpu/schedule_probe.py [--units 2 4 8] [--iters 25] [--flush write read] [--out FILE.json]
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from stream_probe import WINDOW_BYTES, window_pipeline

from gcmoe_core.cutedsl import compile_kernel, cutlass_modules
from gcmoe_core.device_ops import atom_add_u32, ld_acquire_u32, ld_u32, nanosleep, st_u32
from gcmoe_core.kernel_helpers import bulk_copy_g2s

cutlass, cute = cutlass_modules()
import cuda.bindings.driver as cuda  # noqa: E402
import cutlass.pipeline as pipeline  # noqa: E402
import cutlass.utils as utils  # noqa: E402

Int32, Int64 = cutlass.Int32, cutlass.Int64
CONSUMER_WARPS = 8
THREADS = 32 * (CONSUMER_WARPS + 1)  # the last warp produces
RING = 16  # claimed unit indices in flight per CTA (a unit has at least one window; stages <= 8)
SLEEP_CYCLES = 100_000  # ~50 us at the H200's clocks
SPIN_LIMIT = 1 << 20  # a W2 unit's wait gives up after ~0.2 s (and is counted): a probe must not hang the device


class ScheduleProbe:
    def __init__(self, stages: int, evict_first: bool = True, prefill: bool = False):
        if not 2 <= stages < RING:
            raise ValueError(f"ScheduleProbe: 2..{RING - 1} stages, got {stages}")
        self.stages, self.evict_first, self.prefill = stages, evict_first, prefill

    @cute.jit
    def __call__(
        self,
        base: Int64,
        queue: Int64,
        units: Int32,
        need: Int32,
        experts: Int32,
        sync: Int64,
        out: Int64,
        ctas: Int32,
        stream: cuda.CUstream,
    ):
        @cute.struct
        class Shared:
            mbar: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            ring: cute.struct.MemRange[Int32, RING]
            sW: cute.struct.Align[cute.struct.MemRange[Int32, WINDOW_BYTES // 4 * self.stages], 128]

        self.shared = Shared
        self.kernel(base, queue, units, need, experts, sync, out).launch(
            grid=[ctas, 1, 1],
            block=[THREADS, 1, 1],
            smem=Shared.size_in_bytes(),
            stream=stream,
            min_blocks_per_mp=2,
            preferred_smem_carveout=100,
        )

    @cute.kernel
    def kernel(self, base: Int64, queue: Int64, units: Int32, need: Int32, experts: Int32, sync: Int64, out: Int64):
        """sync: int32 words [0] = the queue's claim counter, [1 + e] = done[e] (W1 windows consumed), [1 + E] = W2
        waits that gave up."""
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = tidx % 32
        st = utils.SmemAllocator().allocate(self.shared)
        sw = st.sW.get_tensor(cute.make_layout(WINDOW_BYTES // 4 * self.stages))
        ring = st.ring.get_tensor(cute.make_layout(RING))
        pipe = window_pipeline(st.mbar.data_ptr(), self.stages, CONSUMER_WARPS)
        cute.arch.barrier()
        dst = st.sW.data_ptr().toint()
        if warp == CONSUMER_WARPS:  # the producer warp
            prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
            k = Int32(0)  # units claimed by this CTA
            more = Int32(1)
            while more != 0:
                u = Int32(0)
                if lane == 0:
                    u = atom_add_u32(sync, 1, "relaxed", "gpu")
                u = cute.arch.shuffle_sync(u, 0)
                rec0 = Int32(0)
                nwin = Int32(1)  # (past the queue: one dummy window, record 0, that tells the consumers to stop)
                if u < units:
                    q = queue + Int64(u) * 16
                    rec0 = ld_u32(q)
                    nwin = ld_u32(q + 4)
                    if cutlass.const_expr(not self.prefill):  # a W2 unit's windows only once its W1 is consumed
                        self.wait_w1(sync, ld_u32(q + 8), need, experts, lane)
                else:
                    u = Int32(-1)
                    more = Int32(0)
                if lane == 0:
                    ring[k % RING] = u  # ordered before the first window's full barrier by its arrive (release)
                cute.arch.sync_warp()
                for w in cutlass.range(nwin, unroll=1):
                    pipe.producer_acquire(prod)
                    bar = pipe.producer_get_barrier(prod).toint()
                    with cute.arch.elect_one():
                        bulk_copy_g2s(
                            dst + prod.index * WINDOW_BYTES,
                            base + Int64(rec0 + w) * WINDOW_BYTES,
                            WINDOW_BYTES,
                            bar,
                            self.evict_first,
                        )
                    prod.advance()
                k = k + 1
        else:
            cons = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            acc = Int32(0)
            k = Int32(0)
            more = Int32(1)
            while more != 0:
                pipe.consumer_wait(cons)
                u = ring[k % RING]
                nwin = Int32(1)
                count_e = Int32(-1)
                if u >= 0:
                    q = queue + Int64(u) * 16
                    nwin = ld_u32(q + 4)
                    count_e = ld_u32(q + 12)
                    if cutlass.const_expr(self.prefill):  # the windows stream ahead; what consumes them waits
                        self.wait_w1(sync, ld_u32(q + 8), need, experts, lane)
                else:
                    more = Int32(0)
                for w in cutlass.range(nwin, unroll=1):
                    if w > 0:
                        pipe.consumer_wait(cons)
                    if lane == 0:
                        acc = acc + sw[cons.index * (WINDOW_BYTES // 4) + warp]
                    pipe.consumer_release(cons)
                    cons.advance()
                if count_e >= 0 and warp == 0 and lane == 0:  # a W1 unit consumed
                    atom_add_u32(sync + 4 * (1 + Int64(count_e)), nwin, "release", "gpu")
                k = k + 1
            if lane == 0:
                st_u32(out + 4 * Int64(cta * CONSUMER_WARPS + warp), acc)

    @cute.jit
    def wait_w1(self, sync: Int64, wait_e: Int32, need: Int32, experts: Int32, lane: Int32):
        """(a warp) wait_e >= 0: until done[wait_e] reaches `need` (acquire; lane 0 polls, the warp waits for it); a
        wait past SPIN_LIMIT polls gives up and is counted in sync[1 + experts]."""
        if wait_e >= 0 and lane == 0:
            tries = Int32(0)
            while ld_acquire_u32(sync + 4 * (1 + Int64(wait_e)), "gpu") < need and tries < SPIN_LIMIT:
                nanosleep(200)
                tries = tries + 1
            if tries == SPIN_LIMIT:
                atom_add_u32(sync + 4 * (1 + Int64(experts)), 1, "relaxed", "gpu")
        cute.arch.sync_warp()


def compiled(stages: int, evict_first: bool = True, prefill: bool = False, arch: str = "sm_90a"):
    from cutlass import runtime as crt

    z64 = Int64(0)
    return compile_kernel(
        ScheduleProbe(stages, evict_first, prefill),
        z64,
        z64,
        Int32(1),
        Int32(1),
        Int32(1),
        z64,
        z64,
        Int32(1),
        crt.make_fake_stream(),
        arch=arch,
        name=f"schedule_probe_s{stages}{'_ef' if evict_first else ''}{'_pf' if prefill else ''}",
    )


# (name, experts with rows, W1 tiles, W1 windows, W2 tiles, W2 windows): EP8 slices at small T (H200)
SHAPES = [
    ("v4flash_t1", 7, 16, 32, 16, 16),
    ("v3_t1", 9, 16, 56, 28, 16),
    ("v4flash_t8", 27, 16, 32, 16, 16),
    ("v4flash_t32", 33, 16, 32, 16, 16),
]


def queue(shape: tuple, order: str, unit: int) -> list[list[tuple[int, int, int, int]]]:
    """The launches of an order, each a list of units (first record, windows, wait expert, count expert). Records:
    W1's E x MT1 x W1 windows first, then W2's E x MT2 x W2 windows."""
    _, experts, mt1, nw1, mt2, nw2 = shape
    w2_base = experts * mt1 * nw1

    def units(e: int, w2: bool) -> list[tuple[int, int, int, int]]:
        mt, nw, first = (mt2, nw2, w2_base + e * mt2 * nw2) if w2 else (mt1, nw1, e * mt1 * nw1)
        out = []
        for c0 in range(0, nw, unit):  # chunk-major: every tile's first chunk, then every tile's second, ...
            for t in range(mt):
                out.append((first + t * nw + c0, min(unit, nw - c0), e if w2 else -1, -1 if w2 else e))
        return out

    w1 = [u for e in range(experts) for u in units(e, False)]
    w2 = [u for e in range(experts) for u in units(e, True)]
    if order == "two_launch":  # (the launch order is W2's dependency: nothing to wait for inside either)
        return [w1, [(r, n, -1, -1) for r, n, _, _ in w2]]
    if order == "w1_then_w2":
        return [w1 + w2]
    if order == "interleaved":
        q = []
        for e in range(experts + 1):
            if e < experts:
                q += units(e, False)
            if e >= 1:
                q += units(e - 1, True)
        return [q]
    raise ValueError(f"unknown order {order!r}")


def measure(kern, shape, order: str, unit: int, src, out, ctas: int, flushes: dict, iters: int, variant: str) -> dict:
    """One order x unit x kernel variant: checked once (every claim, every W1 window counted, no wait gave up), then
    timed per flush; {key: median µs}."""
    from gcmoe_core.timing import time_once

    name, experts, mt1, nw1, _, _ = shape
    dev = src.device
    launches = [torch.tensor(q, dtype=torch.int32, device=dev) for q in queue(shape, order, unit)]
    syncs = [torch.zeros(2 + experts, dtype=torch.int32, device=dev) for _ in launches]

    def run():
        for q, sync in zip(launches, syncs):
            kern(
                Int64(src.data_ptr()),
                Int64(q.data_ptr()),
                Int32(q.shape[0]),
                Int32(mt1 * nw1),
                Int32(experts),
                Int64(sync.data_ptr()),
                Int64(out.data_ptr()),
                Int32(ctas),
                cuda.CUstream(torch.cuda.current_stream().cuda_stream),
            )

    run()
    torch.cuda.synchronize()
    for q, sync in zip(launches, syncs):  # the claim counter past each queue by one per CTA
        assert int(sync[0]) == q.shape[0] + ctas, (name, order, unit, variant, int(sync[0]))
    assert syncs[0][1:].tolist() == [mt1 * nw1] * experts + [0], (name, order, variant, syncs[0].tolist())
    assert all(int(sync[-1]) == 0 for sync in syncs), (name, order, variant, "a W2 wait gave up")
    res = {}
    for m, flush in flushes.items():

        def reset(flush=flush):
            """(untimed) cold L2, the counters zeroed, then ~50 µs of sleep: the launches are queued while it runs,
            so no host launch gap lands between the timing events"""
            flush()
            for sync in syncs:
                sync.zero_()
            torch.cuda._sleep(SLEEP_CYCLES)

        res[f"{order}{variant}_u{unit}_{m}_us"] = round(
            statistics.median(time_once(run, reset) for _ in range(iters)), 1
        )
    return res


def main() -> None:
    from gcmoe_core.timing import L2_FLUSHES, ColdL2, copy_bandwidth, run_meta

    ap = argparse.ArgumentParser()
    ap.add_argument("--units", nargs="+", type=int, default=[2, 4, 8])
    ap.add_argument("--orders", nargs="+", default=["two_launch", "w1_then_w2", "interleaved"])
    ap.add_argument("--stages", type=int, default=5)
    ap.add_argument("--iters", type=int, default=25)
    ap.add_argument("--flush", nargs="+", default=["write", "read"], choices=L2_FLUSHES)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    ctas = 2 * torch.cuda.get_device_properties(dev).multi_processor_count
    kernels = {"": compiled(args.stages), "_prefill": compiled(args.stages, prefill=True)}
    flushes = {m: ColdL2(dev, m) for m in args.flush}
    rows = []
    for shape in SHAPES:
        name, experts, mt1, nw1, mt2, nw2 = shape
        records = experts * (mt1 * nw1 + mt2 * nw2)
        src = torch.randint(0, 1 << 30, (records * WINDOW_BYTES // 4,), dtype=torch.int32, device=dev)
        out = torch.zeros(ctas * CONSUMER_WARPS, dtype=torch.int32, device=dev)
        row = dict(shape=name, experts=experts, mb=round(records * WINDOW_BYTES / 1e6, 1))
        row["floor_us"] = records * WINDOW_BYTES / bw * 1e6
        for order in args.orders:
            for unit in args.units if order != "two_launch" else args.units[:1]:
                for variant, kern in kernels.items() if order != "two_launch" else [("", kernels[""])]:
                    row.update(measure(kern, shape, order, unit, src, out, ctas, flushes, args.iters, variant))
        rows.append(row)
        print(json.dumps(row), flush=True)
        del src
    if args.out:
        Path(args.out).write_text(json.dumps(dict(meta=run_meta(copy_tb_s=bw / 1e12), rows=rows)))


if __name__ == "__main__":
    main()
