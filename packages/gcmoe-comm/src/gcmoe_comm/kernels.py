"""The comm kernels (CuTe DSL, sm_90a and later): publish / ready, dispatch (role1), combined, finalize (role3).

One call on rank r (generation g = the call count since the last recover), each kernel a node of the layer graph:

    publish    x -> FP8 + scales into pub_x/pub_sx, ids/weights into pub_ids/pub_w; the last CTA: g = ++GEN;
               NTOK = T; release(sys) READY = g        (ready: the same signal alone, for buffers filled elsewhere)
    dispatch   C CTAs on the comm partition:
                 1. thread q < P acquires peer q's READY == g (bounded), reads its NTOK
                 2. every CTA: peers' ids -> smem (local expert or -1), counts[q][e] by smem atomics
                 3. per-expert totals, BM-padded exclusive scan -> ring offsets; cursor[q][e] = offset[e] + rows of
                    ranks < q (the (expert, src rank, token, slot) order of gcmoe_core.multirank)
                 4. one warp per source rank ranks its entries 32 at a time (match.any + lanemask_lt): deterministic
                    row of every (q, t, j); a CTA keeps the rows of the blocks it owns (block b -> CTA b mod C)
                 5. per owned block: one warp per row pulls x (16-byte loads from the peer), the scales (into the
                    transposed sxT), the routing weight, and writes src and dst (the source rank's combine row);
                    padding rows get zeros, src = -1 and dst = the sink row; then
                    release(gpu) L1_FULL[b] = g — the tag W1 acquires (no reset pass between calls)
    [W1, W2]   the compute partition; W2 scatters row i to rank src[i,0]'s combine row src[i,1] * k + src[i,2]
    combined   1 warp: for every rank q, atom.add.release.sys q.RECV[g & 1] += 1 (my rows for q landed)
    finalize   F CTAs: acquire RECV[g & 1] == P (bounded); y[t] = bf16(sum_j combine[t k + j] (+ shared rows), fp32,
               slot order = gcmoe_core.reference.combine_slots); the last CTA resets RECV[g & 1] for call g + 2

Why no trailing barrier: rank r publishes call g + 1 only after its finalize of call g saw every peer's `combined`,
which each peer issues after its dispatch of call g finished reading r's published tokens; and a peer scatters
into r's combine buffer for call g + 1 only after acquiring r's READY = g + 1. The receive counters alternate by
parity, so the reset of one never races the next call's arrivals (gcmoe_comm.protocol_model checks all this).

Every wait is bounded (timeout_ns, %globaltimer): on expiry the waiting thread records (kind, rank, generation,
value seen) in the rank's ERR words and the kernel skips its work; every kernel starts by reading ERR and does
nothing once it is set, so a failed call drains in one bound instead of hanging. Workspace.check() raises it.

Peer addresses reach the kernels by value (a tuple of P Int64 kernel parameters, staged once into shared memory).
"""

# No `from __future__ import annotations`: the DSL reads the annotations as live objects.
from dataclasses import dataclass
from functools import cache

from gcmoe_core.cutedsl import compile_kernel, cutlass_modules
from gcmoe_core.kernel_helpers import bits_to_f32, cvt_bf16x2, cvt_e4m3x2, f32_to_bits, fp8_pow2_exponent

from .device_ops import (
    atom_add_u32,
    fence_gpu,
    fence_sys,
    ld_relaxed_u32,
    ld_u32,
    ld_v4,
    record_error,
    st_release_u32,
    st_u32,
    st_v4,
    wait_until_eq,
)
from .ring import RingSpec
from .workspace import (
    SIG_DONE,
    SIG_ERR,
    SIG_GEN,
    SIG_L1_FULL,
    SIG_NTOK,
    SIG_PUB_DONE,
    SIG_READY,
    SIG_RECV,
    WorkspaceLayout,
)

cutlass, cute = cutlass_modules()
import cuda.bindings.driver as cuda  # noqa: E402
from cutlass import runtime as crt  # noqa: E402
from cutlass.memory import SmemAllocator  # noqa: E402

Int16, Int32, Int64, Float32 = cutlass.Int16, cutlass.Int32, cutlass.Int64, cutlass.Float32
THREADS = 256
WARPS = THREADS // 32
KIND_READY, KIND_RECV = 1, 2


@dataclass(frozen=True)
class CommShape:
    """What a compiled set of comm kernels is specialised on."""

    spec: RingSpec
    dispatch_ctas: int
    finalize_ctas: int
    shared_rows: int  # shared-expert rows added by finalize (0: none)


class CommKernels:
    """The four kernels for one CommShape; byte offsets of the workspace are compile-time constants."""

    def __init__(self, shape: CommShape):
        self.shape = shape
        s = shape.spec
        lay = WorkspaceLayout(s)
        self.P, self.TM, self.K, self.EL, self.BM = s.ranks, s.max_tokens, s.top_k, s.local_experts, s.bm
        self.H, self.HS, self.CAP = s.hidden, s.hidden // 128, s.capacity
        self.C, self.F, self.S = shape.dispatch_ctas, shape.finalize_ctas, shape.shared_rows
        self.o = {k: v for k, v in lay.offsets.items()}
        self.CHUNKS = s.hidden // 16  # 16-byte pieces of one FP8 token row
        self.LANE_CHUNKS = -(-self.CHUNKS // 32)
        P, TM, K, EL = self.P, self.TM, self.K, self.EL

        @cute.struct
        class DispatchShared:
            peer: cute.struct.MemRange[Int64, P]
            ntok: cute.struct.MemRange[Int32, P]
            flag: cute.struct.MemRange[Int32, 4]
            ids: cute.struct.MemRange[Int16, P * TM * K]  # local expert of each published (token, slot), or -1
            cur: cute.struct.MemRange[Int32, P * EL]  # counts, then row cursors, per (src rank, local expert)
            off: cute.struct.MemRange[Int32, EL + 1]
            tot: cute.struct.MemRange[Int32, EL]
            scan: cute.struct.MemRange[Int32, WARPS]

        @cute.struct
        class PeerShared:
            peer: cute.struct.MemRange[Int64, P]

        @cute.struct
        class FlagShared:
            flag: cute.struct.MemRange[Int32, 4]

        self.dispatch_shared, self.peer_shared, self.flag_shared = DispatchShared, PeerShared, FlagShared

    # ---------------------------------------------------------------- shared helpers
    @cute.jit
    def _stage_peers(self, peers: tuple, speer: cute.Tensor, tid: Int32):
        for i in cutlass.range_constexpr(self.P):
            if tid == i:
                speer[i] = peers[i]

    @cute.jit
    def _copy_row(self, src: Int64, dst: Int64, lane: Int32):
        """One FP8 token row (H bytes), a warp: every lane's 16-byte loads are issued before its stores (a lane past
        the row's end re-reads the last piece and stores nothing)."""
        vals = []
        for c in cutlass.range_constexpr(self.LANE_CHUNKS):
            idx = cutlass.min(lane + 32 * c, self.CHUNKS - 1)
            vals.append(ld_v4(src + Int64(idx) * 16))
        for c in cutlass.range_constexpr(self.LANE_CHUNKS):
            idx = lane + 32 * c
            if idx < self.CHUNKS:
                a, b, cc, d = vals[c]
                st_v4(dst + Int64(idx) * 16, a, b, cc, d)

    # ---------------------------------------------------------------- ready / publish
    @cute.jit
    def _signal_ready(self, own: Int64, ntok: Int32):
        """One thread: g = ++GEN, NTOK = ntok, then release(sys) READY = g — unless an earlier wait failed."""
        if ld_u32(own + SIG_ERR * 4) == 0:
            g = ld_u32(own + SIG_GEN * 4) + 1
            st_u32(own + SIG_GEN * 4, g)
            st_u32(own + SIG_NTOK * 4, ntok)
            fence_sys()
            st_release_u32(own + SIG_READY * 4, g, "sys")

    @cute.kernel
    def k_ready(self, own: Int64, ntok: Int32):
        tid, _, _ = cute.arch.thread_idx()
        if tid == 0:
            self._signal_ready(own, ntok)

    @cute.jit
    def ready(self, own: Int64, ntok: Int32, stream: cuda.CUstream):
        self.k_ready(own, ntok).launch(grid=[1, 1, 1], block=[32, 1, 1], stream=stream)

    @cute.kernel
    def k_publish(self, own: Int64, x: Int64, ids: Int64, wts: Int64, ntok: Int32):
        """x bf16 [T, H] -> pub_x (FP8 E4M3) + pub_sx (power-of-two scale per 128), bit-exact with
        gcmoe_core.formats.quantize_fp8_e4m3_1x128 (a NaN or Inf in a group makes its scale and bytes NaN); ids int32
        and weights fp32 [T, k] copied; the last CTA to finish signals READY."""
        H, HS, K, o = self.H, self.HS, self.K, self.o
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        nctas, _, _ = cute.arch.grid_dim()
        warp = tid // 32
        lane = tid % 32
        for gi in cutlass.range(cta * WARPS + warp, ntok * HS, nctas * WARPS, unroll=1):
            t = gi // HS
            c = gi - t * HS
            col = Int64(t) * H + c * 128 + lane * 4
            w0 = ld_u32(x + col * 2)
            w1 = ld_u32(x + col * 2 + 4)
            v = (bits_to_f32(w0 << 16), bits_to_f32(w0 & -65536), bits_to_f32(w1 << 16), bits_to_f32(w1 & -65536))
            m = cute.arch.fmax(
                cute.arch.fmax(cute.math.absf(v[0]), cute.math.absf(v[1])),
                cute.arch.fmax(cute.math.absf(v[2]), cute.math.absf(v[3])),
            )
            bad = (
                (v[0] != v[0])
                or (v[1] != v[1])
                or (v[2] != v[2])
                or (v[3] != v[3])
                or m > Float32(3.4028234663852886e38)
            )
            for off in cutlass.range_constexpr(5):
                m = cute.arch.fmax(m, cute.arch.shuffle_sync_bfly(m, offset=1 << off))
            ex = fp8_pow2_exponent(m)
            inv = bits_to_f32((127 - ex) << 23)
            scale = bits_to_f32((127 + ex) << 23)
            if cute.arch.vote_any_sync(bad):
                inv = bits_to_f32(0x7FC00000)
                scale = inv
            q = (cvt_e4m3x2(v[1] * inv, v[0] * inv) & 0xFFFF) | (cvt_e4m3x2(v[3] * inv, v[2] * inv) << 16)
            st_u32(own + o["pub_x"] + col, q)
            if lane == 0:
                st_u32(own + o["pub_sx"] + (Int64(t) * HS + c) * 4, f32_to_bits(scale))
        for i in cutlass.range(cta * THREADS + tid, ntok * K, nctas * THREADS, unroll=1):
            st_u32(own + o["pub_ids"] + Int64(i) * 4, ld_u32(ids + Int64(i) * 4))
            st_u32(own + o["pub_w"] + Int64(i) * 4, ld_u32(wts + Int64(i) * 4))
        cute.arch.sync_threads()
        if tid == 0:
            fence_gpu()
            if atom_add_u32(own + SIG_PUB_DONE * 4, 1, "acq_rel", "gpu") == nctas - 1:
                st_u32(own + SIG_PUB_DONE * 4, 0)
                self._signal_ready(own, ntok)

    @cute.jit
    def publish(self, own: Int64, x: Int64, ids: Int64, wts: Int64, ntok: Int32, nctas: Int32, stream: cuda.CUstream):
        self.k_publish(own, x, ids, wts, ntok).launch(grid=[nctas, 1, 1], block=[THREADS, 1, 1], stream=stream)

    # ---------------------------------------------------------------- dispatch
    @cute.kernel
    def k_dispatch(self, peers: tuple, rank: Int32, timeout_ns: Int64):
        P, TM, K, EL, BM, C = self.P, self.TM, self.K, self.EL, self.BM, self.C
        H, HS, CAP, o = self.H, self.HS, self.CAP, self.o
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        warp = tid // 32
        lane = tid % 32

        st = SmemAllocator().allocate(self.dispatch_shared)
        speer = st.peer.get_tensor(cute.make_layout(P))
        sntok = st.ntok.get_tensor(cute.make_layout(P))
        sflag = st.flag.get_tensor(cute.make_layout(4))
        sids = st.ids.get_tensor(cute.make_layout(P * TM * K))
        scur = st.cur.get_tensor(cute.make_layout(P * EL))
        soff = st.off.get_tensor(cute.make_layout(EL + 1))
        stot = st.tot.get_tensor(cute.make_layout(EL))
        sscan = st.scan.get_tensor(cute.make_layout(WARPS))

        self._stage_peers(peers, speer, tid)
        if tid == 0:
            sflag[0] = 0
        cute.arch.sync_threads()
        own = speer[rank]
        g = ld_u32(own + SIG_GEN * 4)
        failed = ld_u32(own + SIG_ERR * 4)
        if failed == 0 and tid < P:
            pa = speer[tid]
            seen = wait_until_eq(pa + SIG_READY * 4, g, timeout_ns, "sys")
            if seen != g:
                record_error(own + SIG_ERR * 4, KIND_READY, tid, g, seen)
                sflag[0] = 1
            sntok[tid] = ld_relaxed_u32(pa + SIG_NTOK * 4, "sys")
        cute.arch.sync_threads()
        if failed == 0 and sflag[0] == 0:
            # 2. ids -> smem, counts per (src rank, local expert)
            for i in cutlass.range(tid, P * EL, THREADS, unroll=1):
                scur[i] = 0
            cute.arch.sync_threads()
            lo = rank * EL
            for q in cutlass.range(P, unroll=1):
                n = sntok[q] * K
                pa = speer[q] + o["pub_ids"]
                for j in cutlass.range(tid, n, THREADS, unroll=1):
                    e = ld_u32(pa + Int64(j) * 4) - lo
                    v = Int32(-1)
                    if e >= 0 and e < EL:
                        v = e
                        cute.arch.atomic_add(scur.iterator + (q * EL + e), Int32(1))
                    sids[q * TM * K + j] = Int16(v)
            cute.arch.sync_threads()
            # 3. totals, cursors over source ranks, BM-padded offsets (block-wide exclusive scan)
            for e in cutlass.range(tid, EL, THREADS, unroll=1):
                acc = Int32(0)
                for q in cutlass.range(P, unroll=1):
                    c = scur[q * EL + e]
                    scur[q * EL + e] = acc
                    acc = acc + c
                stot[e] = acc
            cute.arch.sync_threads()
            per = -(-EL // THREADS)
            mine = Int32(0)
            for c in cutlass.range_constexpr(per):
                e = tid * per + c
                if e < EL:
                    mine = mine + (stot[e] + BM - 1) // BM * BM
            incl = mine
            for d in cutlass.range_constexpr(5):
                up = cute.arch.shuffle_sync_up(incl, 1 << d)
                if lane >= (1 << d):
                    incl = incl + up
            if lane == 31:
                sscan[warp] = incl
            cute.arch.sync_threads()
            before = Int32(0)
            for w in cutlass.range_constexpr(WARPS):
                if w < warp:
                    before = before + sscan[w]
            run = before + incl - mine
            for c in cutlass.range_constexpr(per):
                e = tid * per + c
                if e < EL:
                    soff[e] = run
                    run = run + (stot[e] + BM - 1) // BM * BM
            if tid == THREADS - 1:
                soff[EL] = run
            cute.arch.sync_threads()
            for i in cutlass.range(tid, P * EL, THREADS, unroll=1):
                scur[i] = scur[i] + soff[i % EL]
            if cta == 0:
                for e in cutlass.range(tid, EL + 1, THREADS, unroll=1):
                    st_u32(own + o["ring_offsets"] + e * 4, soff[e])
                for e in cutlass.range(tid, EL, THREADS, unroll=1):
                    st_u32(own + o["ring_counts"] + e * 4, stot[e])
            cute.arch.sync_threads()
            # 4. rank the entries of each source rank: row of (q, t, j), kept when this CTA owns its block
            for q in cutlass.range(warp, P, WARPS, unroll=1):
                n = sntok[q] * K
                for b0 in cutlass.range(0, n, 32, unroll=1):
                    i = b0 + lane
                    e = Int32(-1)
                    if i < n:
                        e = Int32(sids[q * TM * K + i])
                    peers_mask = cute.arch.match_sync(-1, e)
                    rank_in = cute.arch.popc(peers_mask & cute.arch.lanemask_lt())
                    if e >= 0:
                        row = scur[q * EL + e] + rank_in
                        if (row // BM) % C == cta:
                            dst = own + o["ring_src"] + Int64(row) * 12
                            st_u32(dst, q)
                            st_u32(dst + 4, i // K)
                            st_u32(dst + 8, i % K)
                    cute.arch.sync_warp()
                    if e >= 0 and rank_in == 0:
                        scur[q * EL + e] = scur[q * EL + e] + cute.arch.popc(peers_mask)
                    cute.arch.sync_warp()
            cute.arch.sync_threads()
            # 5. pull the rows of the owned blocks, then tag each block with the generation
            nblk = soff[EL] // BM
            for b in cutlass.range(cta, nblk, C, unroll=1):
                row0 = b * BM
                lo_e = Int32(0)
                hi_e = Int32(EL)
                while hi_e - lo_e > 1:
                    mid = (lo_e + hi_e) // 2
                    if soff[mid] <= row0:
                        lo_e = mid
                    else:
                        hi_e = mid
                valid_end = soff[lo_e] + stot[lo_e]
                for r in cutlass.range(warp, BM, WARPS, unroll=1):
                    row = row0 + r
                    xdst = own + o["ring_x"] + Int64(row) * H
                    srow = own + o["ring_src"] + Int64(row) * 12
                    if row < valid_end:
                        q = ld_u32(srow)
                        t = ld_u32(srow + 4)
                        j = ld_u32(srow + 8)
                        pa = speer[q]
                        self._copy_row(pa + o["pub_x"] + Int64(t) * H, xdst, lane)
                        for s in cutlass.range(lane, HS, 32, unroll=1):
                            v = ld_u32(pa + o["pub_sx"] + Int64(t * HS + s) * 4)
                            st_u32(own + o["ring_sxT"] + (Int64(s) * CAP + row) * 4, v)
                        if lane == 0:
                            st_u32(own + o["ring_w"] + Int64(row) * 4, ld_u32(pa + o["pub_w"] + Int64(t * K + j) * 4))
                            st_u32(own + o["ring_dst"] + Int64(row) * 4, t * K + j)
                    else:
                        for c in cutlass.range_constexpr(self.LANE_CHUNKS):
                            idx = lane + 32 * c
                            if idx < self.CHUNKS:
                                st_v4(xdst + Int64(idx) * 16, 0, 0, 0, 0)
                        for s in cutlass.range(lane, HS, 32, unroll=1):
                            st_u32(own + o["ring_sxT"] + (Int64(s) * CAP + row) * 4, 0)
                        if lane == 0:
                            st_u32(own + o["ring_w"] + Int64(row) * 4, 0)
                            st_u32(own + o["ring_dst"] + Int64(row) * 4, TM * K)  # the combine buffer's sink row
                            st_u32(srow, -1)
                            st_u32(srow + 4, -1)
                            st_u32(srow + 8, -1)
                cute.arch.sync_threads()
                if tid == 0:
                    fence_gpu()
                    st_release_u32(own + SIG_L1_FULL * 4 + Int64(b) * 4, g, "gpu")

    @cute.jit
    def dispatch(self, peers: tuple, rank: Int32, timeout_ns: Int64, stream: cuda.CUstream):
        self.k_dispatch(peers, rank, timeout_ns).launch(
            grid=[self.C, 1, 1], block=[THREADS, 1, 1], smem=self.dispatch_shared.size_in_bytes(), stream=stream
        )

    # ---------------------------------------------------------------- combined
    @cute.kernel
    def k_combined(self, peers: tuple, rank: Int32):
        tid, _, _ = cute.arch.thread_idx()

        st = SmemAllocator().allocate(self.peer_shared)
        speer = st.peer.get_tensor(cute.make_layout(self.P))
        self._stage_peers(peers, speer, tid)
        cute.arch.sync_threads()
        own = speer[rank]
        if ld_u32(own + SIG_ERR * 4) == 0:
            par = ld_u32(own + SIG_GEN * 4) & 1
            fence_sys()
            for q in cutlass.range(tid, self.P, 32, unroll=1):
                atom_add_u32(speer[q] + (SIG_RECV + par) * 4, 1, "release", "sys")

    @cute.jit
    def combined(self, peers: tuple, rank: Int32, stream: cuda.CUstream):
        self.k_combined(peers, rank).launch(
            grid=[1, 1, 1], block=[32, 1, 1], smem=self.peer_shared.size_in_bytes(), stream=stream
        )

    # ---------------------------------------------------------------- finalize
    @cute.kernel
    def k_finalize(self, own: Int64, rank: Int32, out: Int64, shared: Int64, timeout_ns: Int64):
        K, H, S, F, P = self.K, self.H, self.S, self.F, self.P
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()

        st = SmemAllocator().allocate(self.flag_shared)
        sflag = st.flag.get_tensor(cute.make_layout(4))
        g = ld_u32(own + SIG_GEN * 4)
        par = g & 1
        if tid == 0:
            sflag[0] = ld_u32(own + SIG_ERR * 4)
            if sflag[0] == 0:
                seen = wait_until_eq(own + (SIG_RECV + par) * 4, P, timeout_ns, "sys")
                if seen != P:
                    record_error(own + SIG_ERR * 4, KIND_RECV, rank, g, seen)
                    sflag[0] = 1
        cute.arch.sync_threads()
        if sflag[0] == 0:
            t_count = ld_u32(own + SIG_NTOK * 4)
            per_tok = H // 8
            comb = own + self.o["combine"]
            for it in cutlass.range(cta * THREADS + tid, t_count * per_tok, F * THREADS, unroll=1):
                t = it // per_tok
                c = it - t * per_tok
                acc = [Float32(0.0)] * 8
                for j in cutlass.range_constexpr(K + S):
                    if cutlass.const_expr(j < K):
                        w = ld_v4(comb + (Int64(t * K + j) * H + c * 8) * 2)
                    else:
                        w = ld_v4(shared + (Int64(t * S + j - K) * H + c * 8) * 2)
                    for h in cutlass.range_constexpr(4):
                        lo_v = bits_to_f32(w[h] << 16)
                        hi_v = bits_to_f32(w[h] & -65536)
                        if cutlass.const_expr(j == 0):
                            acc[2 * h] = lo_v
                            acc[2 * h + 1] = hi_v
                        else:
                            acc[2 * h] = acc[2 * h] + lo_v
                            acc[2 * h + 1] = acc[2 * h + 1] + hi_v
                st_v4(
                    out + (Int64(t) * H + c * 8) * 2,
                    cvt_bf16x2(acc[1], acc[0]),
                    cvt_bf16x2(acc[3], acc[2]),
                    cvt_bf16x2(acc[5], acc[4]),
                    cvt_bf16x2(acc[7], acc[6]),
                )
            cute.arch.sync_threads()
            if tid == 0:
                fence_gpu()
                if atom_add_u32(own + SIG_DONE * 4, 1, "acq_rel", "gpu") == F - 1:
                    st_u32(own + SIG_DONE * 4, 0)
                    st_release_u32(own + (SIG_RECV + par) * 4, 0, "sys")

    @cute.jit
    def finalize(self, own: Int64, rank: Int32, out: Int64, shared: Int64, timeout_ns: Int64, stream: cuda.CUstream):
        self.k_finalize(own, rank, out, shared, timeout_ns).launch(
            grid=[self.F, 1, 1], block=[THREADS, 1, 1], smem=self.flag_shared.size_in_bytes(), stream=stream
        )


@cache
def compiled(shape: CommShape, arch: str) -> dict:
    """The four kernels compiled for `arch` (no GPU needed)."""
    k = CommKernels(shape)
    peers = tuple(Int64(0) for _ in range(shape.spec.ranks))
    stream = crt.make_fake_stream()
    tag = f"p{shape.spec.ranks}_h{shape.spec.hidden}_e{shape.spec.local_experts}_bm{shape.spec.bm}"
    return {
        "ready": compile_kernel(k.ready, Int64(0), Int32(0), stream, arch=arch, name=f"comm_ready_{tag}"),
        "publish": compile_kernel(
            k.publish, *(Int64(0),) * 4, Int32(0), Int32(1), stream, arch=arch, name=f"comm_publish_{tag}"
        ),
        "dispatch": compile_kernel(
            k.dispatch, peers, Int32(0), Int64(0), stream, arch=arch, name=f"comm_dispatch_{tag}"
        ),
        "combined": compile_kernel(k.combined, peers, Int32(0), stream, arch=arch, name=f"comm_combined_{tag}"),
        "finalize": compile_kernel(
            k.finalize, Int64(0), Int32(0), Int64(0), Int64(0), Int64(0), stream, arch=arch, name=f"comm_finalize_{tag}"
        ),
    }
