"""Which ways of bringing weights into L2 make the kernels' weight stream faster afterwards (run on the GPU).

The question behind it (docs/benchmarks/l2-warm-h200-2026-12-01.md): L2 prefetches of what W1 / W2 read next (the
shared experts' W1 beside the comm kernels, W1's first windows of the call's routing, W2's first windows during W1's
tail) never made the public layer faster. Does the stream that follows even find those bytes in L2?

For each shape (CTAs x windows of 17 KB, as tools/gpu/stream_probe.py): L2 made cold (read flush), then one warm-up
of the stream's own bytes, ~50 us of sleep (every warm-up has finished), then the timed stream (stream_probe's
kernel: bulk copies into shared-memory stages on mbarriers; `_ef` the same with the L2 evict_first hint):

    cold           nothing                              amax           torch.amax over the bytes (a plain reader)
    sleep          only the sleep                       bulk_prefetch  cp.async.bulk.prefetch.L2, 16 KB each, a CTA
    line_prefetch  prefetch.global.L2::evict_last per                  per SM (gcmoe_gemm_sm90.ops.prefetch_l2)
                   128-byte line                        ld_hinted      16-byte ld.global.nc.L1::no_allocate
    ld_plain       16-byte ld.global of every byte                     .L2::128B of every byte
    ld_nc          16-byte ld.global.nc of every byte   ld_sector      16-byte ld.global per 32-byte sector

    python tools/gpu/l2_warm_probe.py [--iters 25] [--out FILE.json]
"""

import argparse
import json
import statistics
import sys
from functools import cache
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from stream_probe import THREADS, WINDOW_BYTES, compiled

from gcmoe_core.cutedsl import compile_kernel, cutlass_modules
from gcmoe_core.device_ops import st_u32
from gcmoe_core.kernel_helpers import inline_ptx

cutlass, cute = cutlass_modules()
import cuda.bindings.driver as cuda  # noqa: E402
from cutlass import runtime as crt  # noqa: E402
from cutlass.cutlass_dsl import T, dsl_user_op  # noqa: E402

Int32, Int64 = cutlass.Int32, cutlass.Int64
SLEEP_CYCLES = 100_000  # ~50 us at the H200's clocks: every warm-up's loads or prefetches have landed
# warm-up kernels: (PTX of one access at [$1] (loads return a word in $0), bytes between accesses in a 128-byte line)
WARMERS = {
    "line_prefetch": ("prefetch.global.L2::evict_last [$1];", 128),
    "ld_hinted": ("ld.global.nc.L1::no_allocate.L2::128B.v4.u32", 16),
    "ld_plain": ("ld.global.v4.u32", 16),
    "ld_nc": ("ld.global.nc.v4.u32", 16),
    "ld_sector": ("ld.global.v4.u32", 32),
}


@dsl_user_op
def _access(addr, op: str, *, loc=None, ip=None):
    """One warm-up access at addr: a prefetch (returns 0) or a 16-byte load whose four words are xor-ed into one."""
    if op.startswith("prefetch"):
        inline_ptx(None, [Int64(addr)], op.replace("$1", "$0"), "l,~{memory}", loc, ip)
        return Int32(0)
    txt = (
        f"{{\n.reg .b32 a, b, c, d;\n{op} {{a, b, c, d}}, [$1];\n"
        "xor.b32 a, a, b;\nxor.b32 c, c, d;\nxor.b32 $0, a, c;\n}"
    )
    return Int32(inline_ptx(T.i32(), [Int64(addr)], txt, "=r,l", loc, ip))


class Warmer:
    """Every 128-byte line of [base, base + 128 lines): one thread per line, grid-stride; the loads' words xor-ed and
    stored to `sink` only if they equal a magic value (so no load is dropped as unused)."""

    def __init__(self, op: str, stride: int):
        self.op, self.stride = op, stride

    @cute.jit
    def __call__(self, base: Int64, lines: Int32, sink: Int64, ctas: Int32, stream: cuda.CUstream):
        self.kernel(base, lines, sink).launch(grid=[ctas, 1, 1], block=[256, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, base: Int64, lines: Int32, sink: Int64):
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        acc = Int32(0)
        for i in cutlass.range(cta * 256 + tid, lines, cute.arch.grid_dim()[0] * 256, unroll=4):
            for q in cutlass.range_constexpr(128 // self.stride):
                acc = acc ^ _access(base + Int64(i) * 128 + q * self.stride, self.op)
        if acc == 0x5EED1234:
            st_u32(sink, acc)


@cache
def _warmer(name: str):
    op, stride = WARMERS[name]
    return compile_kernel(
        Warmer(op, stride),
        Int64(0),
        Int32(1),
        Int64(0),
        Int32(1),
        crt.make_fake_stream(),
        arch="sm_90a",
        name=f"l2_warm_{name}",
    )


# (name, CTAs, windows per CTA, CTAs per SM, stages): DeepSeek-V4-Flash's T = 1 W2 grid (31 MB, fits L2) and a
# slightly larger one (33 MB)
SHAPES = [("v4flash_t1_w2", 224, 8, 2, 5), ("w2_240_ctas", 240, 8, 2, 5)]


def measure(shape: tuple, flush, sink: torch.Tensor, sms: int, bw: float, iters: int) -> dict:
    """One shape: every warm-up then the stream (plain and with the evict_first hint), medians of `iters`."""
    from gcmoe_core.cutedsl import as_cute
    from gcmoe_core.timing import time_once
    from gcmoe_gemm_sm90.ops import prefetch_l2

    name, ctas, windows, occupancy, stages = shape
    dev = sink.device
    nbytes = ctas * windows * WINDOW_BYTES
    src = torch.randint(0, 1 << 30, (nbytes // 4,), dtype=torch.int32, device=dev)
    out = torch.zeros(ctas * THREADS // 32, dtype=torch.int32, device=dev)
    red = torch.zeros((), dtype=torch.int32, device=dev)
    operands = (as_cute(src), as_cute(out), Int32(windows), Int32(ctas))
    kernels = {"": compiled(stages, occupancy, 1, False), "_ef": compiled(stages, occupancy, 1, True)}
    streams = {k: lambda k=k: kernels[k](*operands, _stream()) for k in kernels}
    span = (Int64(src.data_ptr()), Int32(nbytes // 128), Int64(sink.data_ptr()), Int32(sms))

    def warm(fn):
        def run():
            flush()
            fn()
            torch.cuda._sleep(SLEEP_CYCLES)

        return run

    warmups = {
        "cold": flush,
        "sleep": warm(lambda: None),
        "amax": warm(lambda: torch.amax(src, dim=0, out=red)),
        "bulk_prefetch": warm(lambda: prefetch_l2([(src.data_ptr(), nbytes)], sms)),
        **{w: warm(lambda w=w: _warmer(w)(*span, _stream())) for w in WARMERS},
    }
    for run in (*streams.values(), *warmups.values()):  # compile + load everything first
        run()
    torch.cuda.synchronize()
    row = dict(shape=name, ctas=ctas, windows=windows, mb=round(nbytes / 1e6, 1), floor_us=nbytes / bw * 1e6)
    for wname, w in warmups.items():
        for suffix, s in streams.items():
            row[f"{wname}{suffix}_us"] = round(statistics.median(time_once(s, w) for _ in range(iters)), 2)
    out.zero_()
    streams[""]()
    torch.cuda.synchronize()
    expect = src.view(ctas, windows, WINDOW_BYTES // 4)[:, :, : THREADS // 32].sum(1, dtype=torch.int64)
    expect = (expect + (1 << 31)) % (1 << 32) - (1 << 31)
    row["read_back_ok"] = torch.equal(out.view(ctas, -1).to(torch.int64), expect)
    return row


def _stream() -> cuda.CUstream:
    return cuda.CUstream(torch.cuda.current_stream().cuda_stream)


def main() -> None:
    from gcmoe_core.timing import ColdL2, copy_bandwidth, run_meta

    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=25)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    flush = ColdL2(dev, "read")
    sink = torch.zeros(4, dtype=torch.int32, device=dev)
    rows = []
    for shape in SHAPES:
        rows.append(measure(shape, flush, sink, sms, bw, args.iters))
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(dict(meta=run_meta(copy_tb_s=bw / 1e12), rows=rows)))


if __name__ == "__main__":
    main()
