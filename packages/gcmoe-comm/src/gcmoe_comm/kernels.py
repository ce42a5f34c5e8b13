"""The comm kernels (CuTe DSL, sm_90a and later): publish / ready, dispatch (role1) and finalize (role3).

One call on rank r (generation g = the call count since the last recover), each kernel a node of the layer graph:

    publish    take the workspace (INUSE = ticket; a call finding another's ticket records ERR kind BUSY and does
               nothing); x -> FP8 + scales into pub_x/pub_sx; routing into pub_ids/pub_w: the caller's k slots, each
               id checked (outside [0, E): BAD recorded, id -1 = dropped by every dispatch, never dereferenced;
               compiled with masked_ids, an id of -1 is dropped unrecorded; non-finite weight of a kept slot: BAD
               recorded, kept), then S shared slots (ids E .. E + S - 1, weight 1); the last
               CTA: g = ++GEN; NTOK = T; OUT = the output pointer; release(sys) READY = g. Arguments come by value
               or, on the slot path, from an argument block in device memory (the host copies each call's pointers
               into it just before replaying the graph, so one captured graph serves every eager call; the last CTA
               mirrors the calls consumed (SEQ) and BAD to the host's status words)
               (ready: the READY signal alone, for buffers filled elsewhere)
    dispatch   C CTAs (the launch's grid; comm.CommRank.dispatch_grid), a programmatic dependent launch after publish:
                 0. griddepcontrol.wait (publish has finished) before anything is read
                 1. thread q < P acquires peer q's READY == g (bounded), checks its GEN == g (written before
                    READY by the same publish: a READY = g beside another GEN is a forged or corrupted tag, recorded
                    like an expired wait with GEN as the value seen), reads its NTOK
                 2. every CTA: peers' ids -> smem (ring expert or -1: routed ids of this rank's experts, and the
                    shared ids only from this rank's own tokens), counts[w][q][e] by smem atomics, where warp w
                    takes the w-th of WARPS equal chunks of all ranks' entries in (q, t, j) order
                 3. per-expert totals, BM-padded exclusive scan -> ring offsets; cursor[w][q][e] = offset[e] + rows
                    of ranks < q + rows of rank q in chunks < w (the (expert, src rank, token, slot) order of
                    gcmoe_core.multirank); CTA 0 writes offsets and counts
                 4. each warp ranks its chunk 32 entries at a time (match.any + lanemask_lt): deterministic row of
                    every (q, t, j); a CTA keeps the rows of the blocks it owns (block b -> CTA b mod C); then
                    the CTA lets W1 launch (griddepcontrol.launch_dependents) and counts itself in RANKED (acq_rel);
                    the last CTA resets it and releases (gpu) OFFS = g — what W1 and W2 acquire before reading the
                    offsets. Past this point a CTA reads published buffers only for blocks whose L1_FULL tag W1
                    acquires: OFFS and the tags W1 acquires imply every read of the peers' buffers done
                 5. per owned block: one warp per row pulls x (16-byte loads from the peer), the scales (into the
                    transposed sxT), the routing weight, and writes src and dst (the source rank's combine row);
                    padding rows get src = -1 and dst = the sink row (their payload is not written: the GEMMs never
                    store a padding column); then release(gpu) L1_FULL[b] = g — the tag W1 acquires
    [W1, W2]   the compute partition (gcmoe-gemm-sm90): W1 acquires OFFS and each block's L1_FULL; W2 scatters row i
               to rank src[i,0]'s combine row src[i,1] * (k + S) + src[i,2] through the combine peer table
    finalize   F CTAs (comm.CommRank.finalize_grid), a programmatic dependent launch in W2's tail that waits for W2
               (griddepcontrol.wait) before anything else: CTA 0 first tells every rank q its rows for q landed
               (atom.add.release.sys q.RECV[g & 1]; W2 has finished); then each CTA acquires RECV[g & 1] == P
               (bounded; compiled out at world size 1, where W2's rows are all this rank's and W2 has finished);
               y[t] = bf16(sum_j combine[t (k+S) + j] (+ shared rows), fp32, slot order =
               gcmoe_core.reference.combine_slots); the last CTA resets RECV[g & 1] for call g + 2, sets CGEN = g and
               frees INUSE. A failed call (ERR set) writes NaN rows instead, so its output is never silently wrong.

Why no trailing barrier: rank r publishes call g + 1 only after its finalize of call g saw every peer's combined
signal, which each peer issues after its dispatch of call g finished reading r's published tokens (the peer's W1
acquired every block its dispatch filled; its W2 and finalize follow in stream order); and a peer scatters into r's
combine buffer for call g + 1 only after acquiring r's READY = g + 1. The receive counters alternate by parity, so
the reset of one never races the next call's arrivals (gcmoe_comm.protocol_model checks all this).

Latency: at small T each kernel is a chain of dependent round trips to L2 (or a peer), not bandwidth; wherever the
words a thread reads do not depend on each other they are loaded together before the first is used (publish: the
argument block beside ERR, then the last CTA's ERR / GEN / SEQ / BAD; dispatch: a peer's GEN and NTOK after its
READY, a row's FP8 bytes, scales and weight before its stores; finalize: INUSE, ERR, GEN, OUT, NTOK).

Every wait is bounded (timeout_ns, %globaltimer) and also ends when ERR is set: on expiry the waiting thread records
(kind, rank, generation, value seen) in the rank's ERR words and the kernel skips its work; every kernel starts by
reading ERR and does nothing once it is set, so a failed call drains in one bound instead of hanging.
Workspace.check() raises it. While kernels are loaded (CommRank.load) the host sets ERR to WARMUP: each kernel
launches once and returns at once.

Peer addresses reach the kernels by value (a tuple of P Int64 kernel parameters, staged once into shared memory).
"""

# No `from __future__ import annotations`: the DSL reads the annotations as live objects.
from dataclasses import dataclass
from functools import cache

from gcmoe_core.cutedsl import compile_kernel, cutlass_modules
from gcmoe_core.device_ops import (
    atom_add_u32,
    atom_cas_u32,
    fence_gpu,
    fence_scope,
    fence_sys,
    ld_relaxed_u32,
    ld_u32,
    ld_u64,
    ld_v4,
    record_error,
    st_release_u32,
    st_u32,
    st_v4,
    wait_until_eq,
)
from gcmoe_core.kernel_helpers import bits_to_f32, cvt_bf16x2, cvt_e4m3x2, f32_to_bits, fp8_pow2_exponent
from gcmoe_core.signals import KIND_BUSY, KIND_READY, KIND_RECV

from .comm import THREADS, WARPS
from .ring import RingSpec
from .workspace import (
    BAD_ID,
    BAD_WEIGHT,
    SIG_BAD,
    SIG_CGEN,
    SIG_DONE,
    SIG_ERR,
    SIG_GEN,
    SIG_INUSE,
    SIG_L1_FULL,
    SIG_NTOK,
    SIG_OFFS,
    SIG_OUT,
    SIG_PUB_DONE,
    SIG_RANKED,
    SIG_READY,
    SIG_RECV,
    SIG_SEQ,
    WorkspaceLayout,
)

cutlass, cute = cutlass_modules()
import cuda.bindings.driver as cuda  # noqa: E402
from cutlass import runtime as crt  # noqa: E402
from cutlass.memory import SmemAllocator  # noqa: E402

Int16, Int32, Int64, Float32 = cutlass.Int16, cutlass.Int32, cutlass.Int64, cutlass.Float32
ID_BATCH = 4  # dispatch: routing ids a lane loads before using the first (one round trip for four)
NSLOTS = 64  # the host's pinned staging slots of the argument block (slot path): in flight at once, at most
SLOT_WORDS = 8  # int64 per argument block: x, ids, weights, out, T, ids are int64, -, -
STATUS_WORDS = 16  # int32 host status: [0] SEQ done, [1:5] BAD of that call, [8:13] ERR
ONE_F32 = 0x3F800000


@dataclass(frozen=True)
class CommShape:
    """What a compiled set of comm kernels is specialised on."""

    spec: RingSpec
    shared_rows: int  # shared-expert rows finalize adds from a separate tensor (0: none; the layer's ride the ring)
    masked_ids: bool = False  # publish takes id -1 as a masked slot: dropped, not recorded as BAD


class CommKernels:
    """The kernels for one CommShape; byte offsets of the workspace are compile-time constants."""

    def __init__(self, shape: CommShape):
        self.shape = shape
        s = shape.spec
        lay = WorkspaceLayout(s)
        self.P, self.TM, self.EL, self.BM = s.ranks, s.max_tokens, s.local_experts, s.bm
        self.KR, self.SH, self.K = s.top_k, s.shared, s.slots  # routed slots, shared slots, published slots
        self.REL, self.E = s.ring_experts, s.num_experts
        self.H, self.HS, self.CAP = s.hidden, s.hidden // 128, s.capacity
        self.S = shape.shared_rows
        self.ID_MIN = -1 if shape.masked_ids else 0  # the lowest id publish does not record as BAD
        self.o = {k: v for k, v in lay.offsets.items()}
        # the scope of the cross-rank signals: other GPUs (sys) for P > 1; one GPU's own workspace for P = 1
        self.SCOPE = "sys" if s.ranks > 1 else "gpu"
        self.CHUNKS = s.hidden // 16  # 16-byte pieces of one FP8 token row
        self.LANE_CHUNKS = -(-self.CHUNKS // 32)
        P, TM, K, REL = self.P, self.TM, self.K, self.REL

        @cute.struct
        class DispatchShared:
            peer: cute.struct.MemRange[Int64, P]
            ntok: cute.struct.MemRange[Int32, P]
            flag: cute.struct.MemRange[Int32, 4]
            ids: cute.struct.MemRange[Int16, P * TM * K]  # ring expert of each published (token, slot), or -1
            # counts, then row cursors, per (warp chunk, src rank, ring expert)
            cur: cute.struct.MemRange[Int32, WARPS * P * REL]
            off: cute.struct.MemRange[Int32, REL + 1]
            tot: cute.struct.MemRange[Int32, REL]
            scan: cute.struct.MemRange[Int32, WARPS]

        @cute.struct
        class PublishShared:
            flag: cute.struct.MemRange[Int32, 4]
            arg: cute.struct.MemRange[Int64, 4]

        @cute.struct
        class FinalizeShared:
            peer: cute.struct.MemRange[Int64, P]
            out: cute.struct.MemRange[Int64, 1]
            flag: cute.struct.MemRange[Int32, 4]

        self.dispatch_shared, self.publish_shared, self.finalize_shared = DispatchShared, PublishShared, FinalizeShared

    # ---------------------------------------------------------------- shared helpers
    @cute.jit
    def _stage_peers(self, peers: tuple, speer: cute.Tensor, tid: Int32):
        for i in cutlass.range_constexpr(self.P):
            if tid == i:
                speer[i] = peers[i]

    @cute.jit
    def _pull_row(self, pa: Int64, own: Int64, t: Int32, j: Int32, row: Int32, xdst: Int64, lane: Int32):
        """Ring row `row` from token t, slot j of the peer at pa, a warp: the FP8 row, its scales (into the transposed
        ring_sxT), the routing weight and the combine row; every load is issued before the first store (one round
        trip to the peer, not one per kind)."""
        H, HS, K, CAP, o = self.H, self.HS, self.K, self.CAP, self.o
        src = pa + o["pub_x"] + Int64(t) * H
        vals = []
        for c in cutlass.range_constexpr(self.LANE_CHUNKS):
            vals.append(ld_v4(src + Int64(cutlass.min(lane + 32 * c, self.CHUNKS - 1)) * 16))
        scales = []
        for c in cutlass.range_constexpr(-(-HS // 32)):
            scales.append(ld_u32(pa + o["pub_sx"] + Int64(t * HS + cutlass.min(lane + 32 * c, HS - 1)) * 4))
        wb = ld_u32(pa + o["pub_w"] + Int64(t * K + j) * 4)
        for c in cutlass.range_constexpr(self.LANE_CHUNKS):
            idx = lane + 32 * c
            if idx < self.CHUNKS:
                a, b, cc, d = vals[c]
                st_v4(xdst + Int64(idx) * 16, a, b, cc, d)
        for c in cutlass.range_constexpr(-(-HS // 32)):
            s = lane + 32 * c
            if s < HS:
                st_u32(own + o["ring_sxT"] + (Int64(s) * CAP + row) * 4, scales[c])
        if lane == 0:
            st_u32(own + o["ring_w"] + Int64(row) * 4, wb)
            st_u32(own + o["ring_dst"] + Int64(row) * 4, t * K + j)

    @cute.jit
    def _record_bad(self, own: Int64, code: Int32, t: Int32, j: Int32, value: Int32):
        """The first invalid routing entry of the call: code, token, slot, value."""
        bad = own + SIG_BAD * 4
        if atom_cas_u32(bad, 0, code, "gpu") == 0:
            st_u32(bad + 4, t)
            st_u32(bad + 8, j)
            st_u32(bad + 12, value)

    # ---------------------------------------------------------------- ready / publish
    @cute.jit
    def _signal_ready(self, own: Int64, ntok: Int32, out: Int64, err: Int32, gen: Int32):
        """One thread: g = ++GEN, NTOK = ntok, OUT = out, then release(sys) READY = g — unless a wait failed. err,
        gen: the ERR and GEN words, loaded by the caller (with its other loads: one round trip for all)."""
        if err == 0:
            g = gen + 1
            st_u32(own + SIG_GEN * 4, g)
            st_u32(own + SIG_NTOK * 4, ntok)
            st_u32(own + SIG_OUT * 4, Int32(out & 0xFFFFFFFF))
            st_u32(own + SIG_OUT * 4 + 4, Int32(out >> 32))
            fence_scope(self.SCOPE)
            st_release_u32(own + SIG_READY * 4, g, self.SCOPE)

    @cute.kernel
    def k_ready(self, own: Int64, ntok: Int32):
        tid, _, _ = cute.arch.thread_idx()
        if tid == 0:
            err = ld_u32(own + SIG_ERR * 4)
            gen = ld_u32(own + SIG_GEN * 4)
            self._signal_ready(own, ntok, Int64(0), err, gen)

    @cute.jit
    def ready(self, own: Int64, ntok: Int32, stream: cuda.CUstream):
        self.k_ready(own, ntok).launch(grid=[1, 1, 1], block=[32, 1, 1], stream=stream)

    @cute.kernel
    def k_publish(
        self,
        own: Int64,
        slots: Int64,
        status: Int64,
        x_arg: Int64,
        ids_arg: Int64,
        wts_arg: Int64,
        out_arg: Int64,
        ntok_arg: Int32,
        ids64_arg: Int32,
        ticket: Int32,
    ):
        """x bf16 [T, H] -> pub_x (FP8 E4M3) + pub_sx (power-of-two scale per 128), bit-exact with
        gcmoe_core.formats.quantize_fp8_e4m3_1x128 (a NaN or Inf in a group makes its scale and bytes NaN); the
        routing checked and copied, the shared slots appended; the last CTA to finish signals READY. slots != 0:
        the arguments come from the argument block at `slots` (device memory) instead of x_arg .. ids64_arg."""
        H, HS, K, KR, o = self.H, self.HS, self.K, self.KR, self.o
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        nctas, _, _ = cute.arch.grid_dim()
        warp = tid // 32
        lane = tid % 32
        # dispatch (PDL) may launch now: it waits for this whole grid (griddepcontrol.wait) before reading anything
        cute.arch.griddepcontrol_launch_dependents()
        st = SmemAllocator().allocate(self.publish_shared)
        sflag = st.flag.get_tensor(cute.make_layout(4))
        sarg = st.arg.get_tensor(cute.make_layout(4))
        if tid == 0:
            sflag[1] = ntok_arg
            sflag[2] = ids64_arg
            sarg[0] = x_arg
            sarg[1] = ids_arg
            sarg[2] = wts_arg
            sarg[3] = out_arg
            if slots != 0:  # the argument block the host's copy wrote just before this launch (loaded beside ERR)
                for i in cutlass.range_constexpr(4):
                    sarg[i] = ld_u64(slots + 8 * i)
                sflag[1] = Int32(ld_u64(slots + 32))
                sflag[2] = Int32(ld_u64(slots + 40))
            ok = Int32(0)
            if ld_u32(own + SIG_ERR * 4) == 0:
                held = atom_cas_u32(own + SIG_INUSE * 4, 0, ticket, "gpu", "acq_rel")
                if held == 0 or held == ticket:
                    ok = Int32(1)
                else:
                    record_error(own + SIG_ERR * 4, KIND_BUSY, 0, ticket, held)
            sflag[0] = ok
        cute.arch.sync_threads()
        ntok = sflag[1]
        if sflag[0] == 1:
            x, ids, wts, ids64 = sarg[0], sarg[1], sarg[2], sflag[2]
            for gi in cutlass.range(cta * WARPS + warp, ntok * HS, nctas * WARPS, unroll=1):
                t = gi // HS
                c = gi - t * HS
                col = Int64(t) * H + c * 128 + lane * 4
                w0 = ld_u32(x + col * 2)
                w1 = ld_u32(x + col * 2 + 4)
                v = (
                    bits_to_f32(w0 << 16),
                    bits_to_f32(w0 & -65536),
                    bits_to_f32(w1 << 16),
                    bits_to_f32(w1 & -65536),
                )
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
                t = i // K
                j = i - t * K
                e = Int32(self.E) + j - KR  # shared slot j >= k: id E + j - k, weight 1
                wb = Int32(ONE_F32)
                if j < KR:
                    src = Int64(t) * KR + j
                    wb = ld_u32(wts + src * 4)
                    if ids64 != 0:
                        e64 = ld_u64(ids + src * 8)
                        e = Int32(e64)
                        if e64 < self.ID_MIN or e64 >= self.E:
                            self._record_bad(own, BAD_ID, t, j, Int32(e64))
                            e = Int32(-1)
                    else:
                        e = ld_u32(ids + src * 4)
                        if e < self.ID_MIN or e >= self.E:
                            self._record_bad(own, BAD_ID, t, j, e)
                            e = Int32(-1)
                    if e < 0:  # dropped (or masked): no rank writes this slot's combine row, so it adds zero
                        row = own + o["combine"] + Int64(i) * (H * 2)
                        for c in cutlass.range(H // 8, unroll=1):
                            st_v4(row + Int64(c) * 16, 0, 0, 0, 0)
                    elif (wb & 0x7F800000) == 0x7F800000:
                        self._record_bad(own, BAD_WEIGHT, t, j, wb)
                st_u32(own + o["pub_ids"] + Int64(i) * 4, e)
                st_u32(own + o["pub_w"] + Int64(i) * 4, wb)
        cute.arch.sync_threads()
        if tid == 0 and sflag[0] == 1:
            fence_gpu()
            if atom_add_u32(own + SIG_PUB_DONE * 4, 1, "acq_rel", "gpu") == nctas - 1:
                # the words read below, all loaded before any is used (one round trip, not one each)
                err = ld_u32(own + SIG_ERR * 4)
                gen = ld_u32(own + SIG_GEN * 4)
                seq = Int32(0)
                bad = [Int32(0)] * 4
                if slots != 0:
                    seq = ld_u32(own + SIG_SEQ * 4)
                    if status != 0:
                        for w in cutlass.range_constexpr(4):
                            bad[w] = ld_u32(own + SIG_BAD * 4 + 4 * w)
                st_u32(own + SIG_PUB_DONE * 4, 0)
                if slots != 0:
                    st_u32(own + SIG_SEQ * 4, seq + 1)
                    if status != 0:  # the BAD entry of this call to the host, then the SEQ it completes
                        for w in cutlass.range_constexpr(4):
                            st_u32(status + 4 + 4 * w, bad[w])
                            st_u32(own + SIG_BAD * 4 + 4 * w, 0)
                        fence_sys()
                        st_release_u32(status, seq + 1, "sys")
                self._signal_ready(own, ntok, sarg[3], err, gen)

    @cute.jit
    def publish(
        self,
        own: Int64,
        slots: Int64,
        status: Int64,
        x: Int64,
        ids: Int64,
        wts: Int64,
        out: Int64,
        ntok: Int32,
        ids64: Int32,
        ticket: Int32,
        nctas: Int32,
        stream: cuda.CUstream,
    ):
        self.k_publish(own, slots, status, x, ids, wts, out, ntok, ids64, ticket).launch(
            grid=[nctas, 1, 1], block=[THREADS, 1, 1], smem=self.publish_shared.size_in_bytes(), stream=stream
        )

    # ---------------------------------------------------------------- dispatch
    @cute.kernel
    def k_dispatch(self, peers: tuple, rank: Int32, timeout_ns: Int64):
        P, TM, K, EL, REL, BM = self.P, self.TM, self.K, self.EL, self.REL, self.BM
        H, o = self.H, self.o
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        C, _, _ = cute.arch.grid_dim()
        # PDL: launched while publish runs; nothing of the call is read before publish has finished (GEN included)
        cute.arch.griddepcontrol_wait()
        warp = tid // 32
        lane = tid % 32

        st = SmemAllocator().allocate(self.dispatch_shared)
        speer = st.peer.get_tensor(cute.make_layout(P))
        sntok = st.ntok.get_tensor(cute.make_layout(P))
        sflag = st.flag.get_tensor(cute.make_layout(4))
        sids = st.ids.get_tensor(cute.make_layout(P * TM * K))
        scur = st.cur.get_tensor(cute.make_layout(WARPS * P * REL))
        soff = st.off.get_tensor(cute.make_layout(REL + 1))
        stot = st.tot.get_tensor(cute.make_layout(REL))
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
            seen = wait_until_eq(pa + SIG_READY * 4, g, timeout_ns, self.SCOPE, own + SIG_ERR * 4)
            peer_gen = ld_relaxed_u32(pa + SIG_GEN * 4, self.SCOPE)  # (both loads in flight at once)
            sntok[tid] = ld_relaxed_u32(pa + SIG_NTOK * 4, self.SCOPE)
            if seen == g:  # READY = g beside another GEN is a forged / corrupted tag: recorded as READY, seen = GEN
                seen = peer_gen
            if seen != g:
                record_error(own + SIG_ERR * 4, KIND_READY, tid, g, seen)
                sflag[0] = 1
        cute.arch.sync_threads()
        if failed == 0 and sflag[0] == 0:
            # 2. ids -> smem, counts per (warp chunk, src rank, ring expert); shared ids only from this rank's own
            #    tokens. Warp w takes entries [w c, (w + 1) c) of all ranks' entries in (src rank, token, slot)
            #    order, c = the total over WARPS rounded up to 32: steps 2 and 4 split the entries the same way
            for i in cutlass.range(tid, WARPS * P * REL, THREADS, unroll=1):
                scur[i] = 0
            total = Int32(0)
            for q in cutlass.range(P, unroll=1):
                total = total + sntok[q] * K
            chunk = (total + WARPS * 32 - 1) // (WARPS * 32) * 32
            c0 = warp * chunk
            c1 = cutlass.min(c0 + chunk, total)
            cute.arch.sync_threads()
            lo = rank * EL
            start = Int32(0)
            for q in cutlass.range(P, unroll=1):
                n = sntok[q] * K
                pa = speer[q] + o["pub_ids"]
                i_hi = cutlass.min(c1 - start, n)
                for j0 in cutlass.range(cutlass.max(c0 - start, 0), i_hi, 32 * ID_BATCH, unroll=1):
                    gids = []  # ID_BATCH loads in flight at once (clamped in range; the extra ones unused)
                    for u in cutlass.range_constexpr(ID_BATCH):
                        gids.append(ld_u32(pa + Int64(cutlass.min(j0 + 32 * u + lane, i_hi - 1)) * 4))
                    for u in cutlass.range_constexpr(ID_BATCH):
                        j = j0 + 32 * u + lane
                        if j < i_hi:
                            e = gids[u] - lo
                            v = Int32(-1)
                            if e >= 0 and e < EL:
                                v = e
                            if q == rank and gids[u] >= self.E:
                                v = EL + gids[u] - self.E
                            if v >= 0:
                                cute.arch.atomic_add(scur.iterator + ((warp * P + q) * REL + v), Int32(1))
                            sids[q * TM * K + j] = Int16(v)
                start = start + n
            cute.arch.sync_threads()
            # 3. totals; cursors in (src rank, warp chunk) order per expert; BM-padded offsets (block-wide scan)
            for e in cutlass.range(tid, REL, THREADS, unroll=1):
                acc = Int32(0)
                for q in cutlass.range(P, unroll=1):
                    for w in cutlass.range_constexpr(WARPS):
                        c = scur[(w * P + q) * REL + e]
                        scur[(w * P + q) * REL + e] = acc
                        acc = acc + c
                stot[e] = acc
            cute.arch.sync_threads()
            per = -(-REL // THREADS)
            mine = Int32(0)
            for c in cutlass.range_constexpr(per):
                e = tid * per + c
                if e < REL:
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
                if e < REL:
                    soff[e] = run
                    run = run + (stot[e] + BM - 1) // BM * BM
            if tid == THREADS - 1:
                soff[REL] = run
            cute.arch.sync_threads()
            for i in cutlass.range(tid, WARPS * P * REL, THREADS, unroll=1):
                scur[i] = scur[i] + soff[i % REL]
            if cta == 0:
                for e in cutlass.range(tid, REL + 1, THREADS, unroll=1):
                    st_u32(own + o["ring_offsets"] + e * 4, soff[e])
                for e in cutlass.range(tid, REL, THREADS, unroll=1):
                    st_u32(own + o["ring_counts"] + e * 4, stot[e])
            cute.arch.sync_threads()
            # 4. each warp ranks its chunk 32 entries at a time: row of (q, t, j), kept when this CTA owns its block
            start = Int32(0)
            for q in cutlass.range(P, unroll=1):
                n = sntok[q] * K
                i_hi = cutlass.min(c1 - start, n)
                cur = (warp * P + q) * REL
                for b0 in cutlass.range(cutlass.max(c0 - start, 0), i_hi, 32, unroll=1):
                    i = b0 + lane
                    e = Int32(-1)
                    if i < i_hi:
                        e = Int32(sids[q * TM * K + i])
                    peers_mask = cute.arch.match_sync(-1, e)
                    rank_in = cute.arch.popc(peers_mask & cute.arch.lanemask_lt())
                    if e >= 0:
                        row = scur[cur + e] + rank_in
                        if (row // BM) % C == cta:
                            dst = own + o["ring_src"] + Int64(row) * 12
                            st_u32(dst, q)
                            st_u32(dst + 4, i // K)
                            st_u32(dst + 8, i % K)
                    cute.arch.sync_warp()
                    if e >= 0 and rank_in == 0:
                        scur[cur + e] = scur[cur + e] + cute.arch.popc(peers_mask)
                    cute.arch.sync_warp()
                start = start + n
            cute.arch.sync_threads()
            # W1 (PDL) may launch once every CTA is here: it acquires OFFS and each block's L1_FULL, so it streams
            # weights beside the row pulls below; a CTA past this point reads the peers' rows only for blocks whose
            # tags W1 acquires, so a finished call leaves no dispatch CTA still reading published buffers
            cute.arch.griddepcontrol_launch_dependents()
            if tid == 0:
                # the ring's shape for call g (what W1 and W2 acquire before reading it), released by the last CTA
                # past its reads of the routing: OFFS = g also says no CTA of this dispatch still reads the peers'
                # routing (on a partition W1 is not launched after this grid; CTAs without blocks release no tag)
                fence_gpu()
                if atom_add_u32(own + SIG_RANKED * 4, 1, "acq_rel", "gpu") == C - 1:
                    st_u32(own + SIG_RANKED * 4, 0)  # for the next call (ordered before OFFS by the release)
                    st_release_u32(own + SIG_OFFS * 4, g, "gpu")
            # 5. pull the rows of the owned blocks, then tag each block with the generation
            nblk = soff[REL] // BM
            for b in cutlass.range(cta, nblk, C, unroll=1):
                row0 = b * BM
                lo_e = Int32(0)
                hi_e = Int32(REL)
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
                        self._pull_row(speer[q], own, t, j, row, xdst, lane)
                    else:
                        if lane == 0:
                            st_u32(own + o["ring_dst"] + Int64(row) * 4, TM * K)  # the combine buffer's sink row
                            st_u32(srow, -1)
                            st_u32(srow + 4, -1)
                            st_u32(srow + 8, -1)
                cute.arch.sync_threads()
                if tid == 0:
                    fence_gpu()
                    st_release_u32(own + SIG_L1_FULL * 4 + Int64(b) * 4, g, "gpu")

    @cute.jit
    def dispatch(self, peers: tuple, rank: Int32, timeout_ns: Int64, nctas: Int32, stream: cuda.CUstream):
        self.k_dispatch(peers, rank, timeout_ns).launch(
            grid=[nctas, 1, 1],
            block=[THREADS, 1, 1],
            smem=self.dispatch_shared.size_in_bytes(),
            stream=stream,
            use_pdl=True,
        )

    # ---------------------------------------------------------------- finalize (+ the combined signal)
    @cute.kernel
    def k_finalize(
        self,
        peers: tuple,
        rank: Int32,
        out_arg: Int64,
        ntok_arg: Int32,
        shared: Int64,
        timeout_ns: Int64,
        ticket: Int32,
        status: Int64,
    ):
        K, H, S, P = self.K, self.H, self.S, self.P
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        F, _, _ = cute.arch.grid_dim()
        # PDL: launched in W2's tail (W2 lets its dependents launch early); W2 has finished, its scatter visible,
        # before anything below
        cute.arch.griddepcontrol_wait()

        st = SmemAllocator().allocate(self.finalize_shared)
        speer = st.peer.get_tensor(cute.make_layout(P))
        sflag = st.flag.get_tensor(cute.make_layout(4))
        sout = st.out.get_tensor(cute.make_layout(1))
        self._stage_peers(peers, speer, tid)
        cute.arch.sync_threads()
        own = speer[rank]
        if tid == 0:
            # every word this call's state is read from, loaded at once (one round trip): INUSE, ERR and GEN were
            # written by this call's earlier kernels, which finished before W2 did (W1 acquired INUSE, W2 waited
            # for W1), so relaxed gpu-scope loads see them; OUT / NTOK (the slot path) likewise, from publish
            inuse = ld_relaxed_u32(own + SIG_INUSE * 4, "gpu")
            err = ld_relaxed_u32(own + SIG_ERR * 4, "gpu")
            gen = ld_relaxed_u32(own + SIG_GEN * 4, "gpu")
            out_lo = Int32(0)
            out_hi = Int32(0)
            if out_arg == 0:
                out_lo = ld_relaxed_u32(own + SIG_OUT * 4, "gpu")
                out_hi = ld_relaxed_u32(own + SIG_OUT * 4 + 4, "gpu")
            ntok = ntok_arg
            if ntok_arg < 0:
                ntok = ld_relaxed_u32(own + SIG_NTOK * 4, "gpu")
            mine = Int32(0)
            if inuse == ticket:
                mine = Int32(1)
            sflag[0] = Int32(0)
            if mine == 1 and err == 0:
                sflag[0] = Int32(1)
            sflag[1] = mine
            sflag[2] = gen
            sflag[3] = ntok
            sout[0] = Int64(out_lo) & 0xFFFFFFFF | (Int64(out_hi) << 32)
        cute.arch.sync_threads()
        g = sflag[2]
        par = g & 1
        if cutlass.const_expr(P > 1):  # (world size 1: W2's rows are all this rank's, and W2 has finished)
            if sflag[0] == 1:
                if cta == 0 and tid < P:  # combined: my W2 rows for every rank have landed (its launch has finished)
                    fence_scope(self.SCOPE)
                    atom_add_u32(speer[tid] + (SIG_RECV + par) * 4, 1, "release", self.SCOPE)
                if tid == 0:
                    seen = wait_until_eq(own + (SIG_RECV + par) * 4, P, timeout_ns, self.SCOPE, own + SIG_ERR * 4)
                    if seen != P:
                        record_error(own + SIG_ERR * 4, KIND_RECV, rank, g, seen)
                        sflag[0] = 0
            cute.arch.sync_threads()
        out = out_arg
        t_count = ntok_arg
        if sflag[1] == 1:
            if out == 0:
                out = sout[0]
            t_count = sflag[3]
        per_tok = H // 8
        comb = own + self.o["combine"]
        if sflag[0] == 1:
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
                    if cutlass.const_expr(P > 1):
                        st_release_u32(own + (SIG_RECV + par) * 4, 0, self.SCOPE)
                    st_u32(own + SIG_CGEN * 4, g)
                    fence_gpu()
                    st_release_u32(own + SIG_INUSE * 4, 0, "gpu")
        else:
            # a failed call (or one that never held the workspace) writes NaN rows where it knows its output
            if out != 0:
                nan2 = Int32(0x7FC07FC0)
                for it in cutlass.range(cta * THREADS + tid, t_count * per_tok, F * THREADS, unroll=1):
                    st_v4(out + Int64(it) * 16, nan2, nan2, nan2, nan2)
        if cta == 0 and tid == 0 and status != 0:  # the ERR words to the host (the slot path's status)
            for w in cutlass.range_constexpr(5):
                st_u32(status + 32 + 4 * w, ld_u32(own + SIG_ERR * 4 + 4 * w))

    @cute.jit
    def finalize(
        self,
        peers: tuple,
        rank: Int32,
        out: Int64,
        ntok: Int32,
        shared: Int64,
        timeout_ns: Int64,
        ticket: Int32,
        status: Int64,
        nctas: Int32,
        stream: cuda.CUstream,
    ):
        self.k_finalize(peers, rank, out, ntok, shared, timeout_ns, ticket, status).launch(
            grid=[nctas, 1, 1],
            block=[THREADS, 1, 1],
            smem=self.finalize_shared.size_in_bytes(),
            stream=stream,
            use_pdl=True,
        )


@cache
def compiled(shape: CommShape, arch: str) -> dict:
    """The kernels compiled for `arch` (no GPU needed)."""
    k = CommKernels(shape)
    i64 = Int64(0)
    peers = tuple(Int64(0) for _ in range(shape.spec.ranks))
    stream = crt.make_fake_stream()
    s = shape.spec
    masked = "_m" if shape.masked_ids else ""
    tag = f"p{s.ranks}_h{s.hidden}_e{s.local_experts}s{s.shared}_k{s.top_k}_bm{s.bm}{masked}"
    return {
        "ready": compile_kernel(k.ready, i64, Int32(0), stream, arch=arch, name=f"comm_ready_{tag}"),
        "publish": compile_kernel(
            k.publish,
            *(i64,) * 7,
            Int32(0),
            Int32(0),
            Int32(1),
            Int32(1),
            stream,
            arch=arch,
            name=f"comm_publish_{tag}",
        ),
        "dispatch": compile_kernel(
            k.dispatch, peers, Int32(0), i64, Int32(1), stream, arch=arch, name=f"comm_dispatch_{tag}"
        ),
        "finalize": compile_kernel(
            k.finalize,
            peers,
            Int32(0),
            i64,
            Int32(0),
            i64,
            i64,
            Int32(1),
            i64,
            Int32(1),
            stream,
            arch=arch,
            name=f"comm_finalize_{tag}",
        ),
    }
