"""L2 prefetch of byte ranges for sm_90a: weights a call is about to stream, brought into L2 while HBM is idle.

At small T a layer call starts with its comm kernels (publish, dispatch: chains of dependent round trips that read a
few KB) and W1 launches ~7 µs in (H200): HBM idles meanwhile. The shared experts' W1 weights are read by every call
and known before it starts, so the layer prefetches them into L2 on a side branch of its graph, beside the comm
kernels (gcmoe's sm90 backend; docs/benchmarks/l2-hint-h200-2026-12-01.md for why the window loop itself gains nothing
from prefetching: there the HBM is already busy).

    for every range r (address, bytes: by value) and every 16 KB chunk c of it:
        cp.async.bulk.prefetch.L2 [address_r + 16 KB c], min(16 KB, bytes_r - 16 KB c)
Grid [ctas] x THREADS: thread i of CTA j issues chunks j THREADS + i, + ctas THREADS, ... of each range. The kernel
ends once every prefetch is issued; they complete in the memory system on their own. Nothing reads their result and
nothing waits for them, so the prefetch cannot change a value: it only moves when bytes arrive in L2.
"""

# No `from __future__ import annotations` in kernel files: the DSL reads the annotations as live objects.
from functools import cache

from gcmoe_core.cutedsl import compile_kernel, cutlass_modules
from gcmoe_core.device_ops import ld_u32, ld_u64, st_u32
from gcmoe_core.kernel_helpers import bulk_prefetch_l2, inline_ptx

cutlass, cute = cutlass_modules()
import cuda.bindings.driver as cuda  # noqa: E402
from cutlass import runtime as crt  # noqa: E402
from cutlass.cutlass_dsl import T, dsl_user_op  # noqa: E402
from cutlass.memory import SmemAllocator  # noqa: E402

Int32, Int64 = cutlass.Int32, cutlass.Int64
PIECE = 512  # bytes one thread warms per step: 16 loads of 16 bytes, one per 32-byte L2 sector
SINK_MAGIC = 0x5EED1234  # the xor of a thread's loaded words is stored to the sink only if it equals this


@dsl_user_op
def ld_sector_xor(addr, *, loc=None, ip=None):
    """16 bytes at addr by a plain ld.global (L2 keeps the 32-byte sector for the next reader; measured on the H200:
    cp.async.bulk.prefetch.L2, prefetch.global.L2 and loads with the L2::128B hint do not), xor-ed into one word."""
    txt = (
        "{\n.reg .b32 a, b, c, d;\nld.global.v4.u32 {a, b, c, d}, [$1];\n"
        "xor.b32 a, a, b;\nxor.b32 c, c, d;\nxor.b32 $0, a, c;\n}"
    )
    return Int32(inline_ptx(T.i32(), [Int64(addr)], txt, "=r,l", loc, ip))


@cute.jit
def warm_piece(addr: Int64, acc: Int32) -> Int32:
    """PIECE bytes at addr into L2 (one load per sector, all in flight at once); returns acc xor their words."""
    for q in cutlass.range_constexpr(PIECE // 32):
        acc = acc ^ ld_sector_xor(addr + q * 32)
    return acc


CHUNK = 16384  # bytes per prefetch instruction (one weight window)
THREADS = 128
MAX_RANGES = 8


class PrefetchL2:
    """`ranges` (address, bytes) pairs, each bytes a multiple of 16 and the address 16-byte aligned."""

    def __init__(self, ranges: int, loads: bool = False):
        if not 1 <= ranges <= MAX_RANGES:
            raise ValueError(f"PrefetchL2: 1..{MAX_RANGES} ranges, got {ranges}")
        self.ranges, self.loads = ranges, loads

    @cute.jit
    def __call__(self, addrs: tuple, nbytes: tuple, sink: Int64, ctas: Int32, stream: cuda.CUstream):
        self.kernel(addrs, nbytes, sink).launch(grid=[ctas, 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, addrs: tuple, nbytes: tuple, sink: Int64):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        step = cute.arch.grid_dim()[0] * THREADS
        acc = Int32(0)
        for r in cutlass.range_constexpr(self.ranges):
            n = nbytes[r]
            if cutlass.const_expr(self.loads):  # (loads: sizes are multiples of PIECE)
                for c in cutlass.range(cta * THREADS + tidx, n // PIECE, step, unroll=1):
                    acc = warm_piece(addrs[r] + Int64(c) * PIECE, acc)
            else:
                for c in cutlass.range(cta * THREADS + tidx, (n + CHUNK - 1) // CHUNK, step, unroll=1):
                    bulk_prefetch_l2(addrs[r] + Int64(c) * CHUNK, cutlass.min(n - c * CHUNK, CHUNK))
        if cutlass.const_expr(self.loads):
            if acc == SINK_MAGIC:  # (keeps the loads: their words are used)
                st_u32(sink, acc)


@cache
def compiled(ranges: int, arch: str = "sm_90a", loads: bool = False):
    return compile_kernel(
        PrefetchL2(ranges, loads),
        tuple(Int64(0) for _ in range(ranges)),
        tuple(Int32(16) for _ in range(ranges)),
        Int64(0),
        Int32(1),
        crt.make_fake_stream(),
        arch=arch,
        name=f"prefetch_l2_r{ranges}{'_ld' if loads else ''}",
    )


# ------------------------------------------------------------------------------------------------ W1's first loads
STARTS_THREADS = 256
WINDOW_BYTES = 16384 + 1024  # one window record: weights + scale records (config.WINDOW_*_BYTES)


class PrefetchW1Starts:
    """L2 prefetch of the first `d` window records every W1 CTA of the call will load, from the call's routing (read
    at the layer's start, beside publish): the CTAs' first loads then hit L2 when W1 starts, ~7 us later.

        cnt[e]   = routed ids of this rank's experts (id - lo in [0, EL)), + T for each shared expert (EL .. EL+S-1)
        experts  = those with cnt > 0 in the W1 grid's order: first, first + 1, ... (mod REL) for active-first grid
                   rows (row y runs the y-th), ascending for stream_k (first = 0; its tiles: ceil(cnt / N) x MT)
        CTAs     row grid: (row y, K split ks, M tile mt) for y < experts, at most `wave` of them (the SM slots: the
                   CTAs that start at once); their loads it < d: window ks nw + it of (expert_y, mt), N tile 0
                 stream_k: its `wave` CTAs, CTA c from unit c units / wave, load it: the global window
                   u0 depth + it, tile-major (kernel_grouped.load_coords)
        d        = min(dmax, budget / (CTAs x WINDOW_BYTES)): the byte budget spread over every CTA's first loads
    Window record r: weights at wq + 16 KB r, scale records at ws + 1 KB r. Issue order: every CTA's first load,
    then every CTA's second, ... (what W1 asks for first comes first). At P > 1 the counts are this rank's own
    tokens' only (the peers' arrive by dispatch): the prefetch is partial there, never wrong — it moves when bytes
    reach L2, never a value. `grid` CTAs of STARTS_THREADS threads, each finding the CTAs' records on its own and
    issuing every (grid x STARTS_THREADS)-th pair: one SM issues bulk prefetches at a few hundred GB/s only (one CTA
    issuing 8 MB made the H200 layer 19 us slower at T = 1), so the bytes are spread over every SM. trace != 0 (tests): int32 words, [-2] = CTAs, [-1] = d,
    [it x CTAs + c] = the record of CTA c's load it (-1: none).
    Arguments: by value (x_ids, ntok, ids64) or, with slots != 0, the argument block (gcmoe_comm's slot words:
    ids at +8, T at +32, ids-are-int64 at +40)."""

    def __init__(
        self,
        local_experts: int,
        shared: int,
        top_k: int,
        m_tiles: int,
        windows: int,
        splits: int,
        n_tile: int,
        depth: int,
        stream_k: bool,
        loads: bool = False,
    ):
        self.loads = loads
        self.EL, self.S, self.KR = local_experts, shared, top_k
        self.REL = local_experts + shared
        self.MT, self.W, self.splits, self.N = m_tiles, windows, splits, n_tile
        self.nw = windows // splits
        self.depth, self.stream_k = depth, stream_k

        @cute.struct
        class Shared:
            cnt: cute.struct.MemRange[Int32, self.REL]
            ex: cute.struct.MemRange[Int32, self.REL]  # the experts with rows, in grid order
            t0: cute.struct.MemRange[Int32, self.REL + 1]  # stream_k: their first tile (exclusive prefix)
            flag: cute.struct.MemRange[Int32, 4]
            arg: cute.struct.MemRange[Int64, 1]

        self.shared = Shared

    @cute.jit
    def __call__(
        self,
        wq: Int64,
        ws: Int64,
        slots: Int64,
        ids_arg: Int64,
        ntok_arg: Int32,
        ids64_arg: Int32,
        lo: Int32,
        first: Int32,
        wave: Int32,
        budget: Int32,
        dmax: Int32,
        trace: Int64,
        sink: Int64,
        grid: Int32,
        stream: cuda.CUstream,
    ):
        self.kernel(wq, ws, slots, ids_arg, ntok_arg, ids64_arg, lo, first, wave, budget, dmax, trace, sink).launch(
            grid=[grid, 1, 1], block=[STARTS_THREADS, 1, 1], smem=self.shared.size_in_bytes(), stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        wq: Int64,
        ws: Int64,
        slots: Int64,
        ids_arg: Int64,
        ntok_arg: Int32,
        ids64_arg: Int32,
        lo: Int32,
        first: Int32,
        wave: Int32,
        budget: Int32,
        dmax: Int32,
        trace: Int64,
        sink: Int64,
    ):
        REL, EL, KR, MT, W, N = self.REL, self.EL, self.KR, self.MT, self.W, self.N
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        step = cute.arch.grid_dim()[0] * STARTS_THREADS
        lane = tid % 32
        st = SmemAllocator().allocate(self.shared)
        scnt = st.cnt.get_tensor(cute.make_layout(REL))
        sex = st.ex.get_tensor(cute.make_layout(REL))
        st0 = st.t0.get_tensor(cute.make_layout(REL + 1))
        sflag = st.flag.get_tensor(cute.make_layout(4))
        sarg = st.arg.get_tensor(cute.make_layout(1))
        if tid == 0:
            sarg[0] = ids_arg
            sflag[0] = ntok_arg
            sflag[1] = ids64_arg
            if slots != 0:
                sarg[0] = ld_u64(slots + 8)
                sflag[0] = Int32(ld_u64(slots + 32))
                sflag[1] = Int32(ld_u64(slots + 40))
        cute.arch.sync_threads()
        ntok, ids, ids64 = sflag[0], sarg[0], sflag[1]
        for e in cutlass.range(tid, REL, STARTS_THREADS, unroll=1):
            scnt[e] = 0 if e < EL else ntok
        cute.arch.sync_threads()
        for i in cutlass.range(tid, ntok * KR, STARTS_THREADS, unroll=1):
            gid = Int32(0)
            if ids64 != 0:
                gid = Int32(ld_u64(ids + Int64(i) * 8))  # (an id outside int32 lands outside [lo, lo + EL) too)
            else:
                gid = ld_u32(ids + Int64(i) * 4)
            e = gid - lo
            if e >= 0 and e < EL:
                cute.arch.atomic_add(scnt.iterator + e, Int32(1))
        cute.arch.sync_threads()
        if tid < 32:  # the experts with rows in grid order, and (stream_k) each one's first tile
            seen = Int32(0)
            tiles = Int32(0)
            for base in cutlass.range(0, REL, 32, unroll=1):
                e = (base + lane + first) % REL
                c = Int32(0)
                if base + lane < REL:
                    c = scnt[e]
                t = (c + N - 1) // N * MT
                incl = t
                for s in cutlass.range_constexpr(5):
                    up = cute.arch.shuffle_sync_up(incl, 1 << s)
                    if lane >= (1 << s):
                        incl = incl + up
                active = cute.arch.vote_ballot_sync(c > 0)
                if c > 0:
                    pos = seen + Int32(cute.arch.popc(active & cute.arch.lanemask_lt()))
                    sex[pos] = e
                    st0[pos] = tiles + incl - t
                seen = seen + Int32(cute.arch.popc(active))
                tiles = tiles + cute.arch.shuffle_sync(incl, 31)
            if lane == 0:
                sflag[2] = seen
                sflag[3] = tiles
                st0[seen] = tiles
        cute.arch.sync_threads()
        nex, tiles = sflag[2], sflag[3]
        ctas = cutlass.min(wave, nex * MT * self.splits)
        if cutlass.const_expr(self.stream_k):
            ctas = wave
        d = Int32(0)
        if ctas > 0 and tiles > 0:
            d = cutlass.min(cutlass.min(dmax, self.nw), budget // (ctas * WINDOW_BYTES))
        units = tiles * (W // self.depth)
        pieces = 1  # (loads) a pair's window record in PIECE-byte pieces: weights, then scale records
        if cutlass.const_expr(self.loads):
            pieces = WINDOW_BYTES // PIECE
        acc = Int32(0)
        for pp in cutlass.range(cta * STARTS_THREADS + tid, ctas * d * pieces, step, unroll=1):
            p = pp // pieces
            piece = pp - p * pieces
            it = p // ctas
            c = p - it * ctas
            rec = Int32(-1)
            if cutlass.const_expr(self.stream_k):
                v = c * units // ctas * self.depth + it
                a = v // W
                if a < tiles:
                    j = Int32(0)  # the expert of tile a: the last j with t0[j] <= a (binary search)
                    span = nex
                    while span > 1:
                        half = span // 2
                        if st0[j + half] <= a:
                            j = j + half
                        span = span - half
                    off = a - st0[j]
                    rec = (sex[j] * MT + off % MT) * W + (v - a * W)
            else:
                per_row = MT * self.splits
                y = c // per_row
                r = c - y * per_row
                ks = r // MT
                rec = (sex[y] * MT + (r - ks * MT)) * W + ks * self.nw + it
            if rec >= 0:
                if cutlass.const_expr(self.loads):
                    at = wq + Int64(rec) * 16384 + piece * PIECE
                    if piece >= 16384 // PIECE:
                        at = ws + Int64(rec) * 1024 + (piece - 16384 // PIECE) * PIECE
                    acc = warm_piece(at, acc)
                else:
                    bulk_prefetch_l2(wq + Int64(rec) * 16384, 16384)
                    bulk_prefetch_l2(ws + Int64(rec) * 1024, 1024)
            if trace != 0 and piece == 0:  # (tests) the record of every (load, CTA) pair, -1 where none
                st_u32(trace + Int64(p) * 4, rec)
        if cutlass.const_expr(self.loads):
            if acc == SINK_MAGIC:  # (keeps the loads: their words are used)
                st_u32(sink, acc)
        if trace != 0 and cta == 0 and tid == 0:
            st_u32(trace - 8, ctas)
            st_u32(trace - 4, d)


@cache
def compiled_starts(
    local_experts: int,
    shared: int,
    top_k: int,
    m_tiles: int,
    windows: int,
    splits: int,
    n_tile: int,
    depth: int,
    stream_k: bool,
    arch: str = "sm_90a",
    loads: bool = False,
):
    z64, z32 = Int64(0), Int32(0)
    return compile_kernel(
        PrefetchW1Starts(local_experts, shared, top_k, m_tiles, windows, splits, n_tile, depth, stream_k, loads),
        z64,
        z64,
        z64,
        z64,
        z32,
        z32,
        z32,
        z32,
        Int32(1),
        z32,
        z32,
        z64,
        z64,
        Int32(1),
        crt.make_fake_stream(),
        arch=arch,
        name=f"prefetch_w1_starts_e{local_experts}_{shared}_k{top_k}_m{m_tiles}_w{windows}_s{splits}_n{n_tile}"
        f"_d{depth}{'_sk' if stream_k else ''}{'_ld' if loads else ''}",
    )
