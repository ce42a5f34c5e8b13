"""The comm kernels (CuTe DSL, sm_90a and later): publish / ready, dispatch (role1) and finalize (role3).

One call on rank r (generation g = the call count since the last recover), each kernel a node of the layer graph:

    publish    take the workspace (INUSE = ticket; a call finding another's ticket records ERR kind BUSY and does
               nothing); x -> FP8 + scales into pub_x/pub_sx; routing into pub_ids/pub_w: the caller's k slots, each
               checked (_check_slot: a bad id is recorded and dropped as -1, never dereferenced), then S shared slots
               (ids E .. E + S - 1, weight 1); the last CTA: g = ++GEN; NTOK = T; OUT = the output pointer;
               release(sys) READY = g. Arguments come by value or, on the slot path, from an argument block in device
               memory the host fills just before replaying the graph, so one captured graph serves every eager call
               (_call_args, _mirror_status). ready: the READY signal alone, for buffers filled elsewhere.
    dispatch   C CTAs (the launch's grid; comm.CommRank.dispatch_grid), a programmatic dependent launch after publish:
                 0. griddepcontrol.wait (publish has finished) before anything is read
                 1. thread q < P acquires peer q's READY == g (bounded), checks its GEN == g (written before
                    READY by the same publish: a READY = g beside another GEN is a forged or corrupted tag, recorded
                    like an expired wait with GEN as the value seen), reads its NTOK. P = 1: the only publish has
                    finished (step 0), so READY is read and checked, not awaited
                 2. every CTA: peers' ids -> smem (ring expert or -1: routed ids of this rank's experts, and the
                    shared ids only from this rank's own tokens), counts[w][q][e] by smem atomics, where warp w
                    takes the w-th of WARPS equal chunks of all ranks' entries in (q, t, j) order
                 3. per-expert totals, BM-padded exclusive scan -> ring offsets (_offsets)
                 4. each warp ranks its chunk (_assign_rows): deterministic row of every (q, t, j); a CTA keeps the
                    rows of the blocks it owns (block b -> CTA b mod C); then the CTA lets W1 launch
                    (griddepcontrol.launch_dependents) and the last CTA releases (gpu) OFFS = g (_release_offs) —
                    what W1 and W2 acquire before reading the offsets. Past this point a CTA reads published buffers
                    only for blocks whose L1_FULL tag W1 acquires
                 5. per owned block: one warp per row pulls x, its scales (into the transposed sxT), the routing
                    weight, and writes src and dst (padding rows: src = -1, dst = the sink row); then release(gpu)
                    L1_FULL[b] = g — the tag W1 acquires
    dispatch_local  world size 1, calls whose ring rows are small (comm.LOCAL_DISPATCH_MAX_BYTES): publish and
               dispatch as one kernel (k_dispatch_local): no published copy, one kernel boundary fewer
    [W1, W2]   the compute partition (gcmoe-gemm-sm90): W1 acquires OFFS and each block's L1_FULL; W2 scatters row i
               to rank src[i,0]'s combine row src[i,1] * (k + S) + src[i,2] through the combine peer table
    finalize   F CTAs (comm.CommRank.finalize_grid), a programmatic dependent launch in W2's tail that waits for W2
               (griddepcontrol.wait) before anything else: CTA 0 first tells every rank q its rows for q landed
               (atom.add.release.sys q.RECV[g & 1]; W2 has finished); then each CTA acquires RECV[g & 1] == P
               (bounded; compiled out at world size 1, where W2's rows are all this rank's and W2 has finished);
               y[t] = bf16(sum_j combine[t (k+S) + j], fp32, slot order =
               gcmoe_core.reference.combine_slots); the last CTA resets RECV[g & 1] for call g + 2, sets CGEN = g and
               frees INUSE. A failed call (ERR set) writes NaN rows instead, so its output is never silently wrong.

Why no trailing barrier: rank r publishes call g + 1 only after its finalize of call g saw every peer's combined
signal, which each peer issues after its dispatch of call g finished reading r's published tokens (the peer's W1
acquired every block its dispatch filled; its W2 and finalize follow in stream order); and a peer scatters into r's
combine buffer for call g + 1 only after acquiring r's READY = g + 1. The receive counters alternate by parity, so
the reset of one never races the next call's arrivals (the protocol model, packages/gcmoe-comm/tests/protocol_model.py,
checks all this).

Latency: at small T each kernel is a chain of dependent round trips to L2 (or a peer), not bandwidth, so wherever the
words a thread reads do not depend on each other they are loaded together before the first is used, and loads that
do not depend on a round trip are issued before it. Every wait is bounded and ends when ERR is set
(gcmoe_core.signals); peer addresses come by value (a tuple of P Int64 kernel parameters, staged into shared memory).
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
from gcmoe_core.kernel_helpers import F32_ONE, bits_to_f32, cvt_bf16x2, cvt_e4m3x2, f32_to_bits, fp8_pow2_exponent
from gcmoe_core.signals import KIND_BUSY, KIND_READY, KIND_RECV

from .launch import THREADS, WARPS
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
ID_BATCH = 4  # dispatch: routing ids a lane loads before using the first (one round trip for four); _load_ids
SRC_BLOCKS = 4  # dispatch: a CTA's first owned ring blocks whose rows' sources step 4 keeps in shared memory for step 5
QUANT_BATCH = 16  # local dispatch: (row, group) items a warp loads before quantising the first (_quantize_rows)
NSLOTS = 64  # the host's pinned staging slots of the argument block (slot path): in flight at once, at most
SLOT_WORDS = 8  # int64 per argument block: x, ids, weights, out, T, ids are int64, -, -
STATUS_WORDS = 16  # int32 host status: [0] SEQ done, [1:5] BAD of that call, [5] its ticket, [8:13] ERR, [13] ticket
STATUS_BAD_TICKET, STATUS_ERR_TICKET = 5, 13  # of the call whose BAD entry / failed wait the words hold


@dataclass(frozen=True)
class CommShape:
    """What a compiled set of comm kernels is specialised on."""

    spec: RingSpec
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
            src: cute.struct.MemRange[Int32, 3 * SRC_BLOCKS * self.BM]  # (q, t, j) of owned rows (SRC_BLOCKS)

        @cute.struct
        class PublishShared:
            flag: cute.struct.MemRange[Int32, 4]

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

    @cute.jit
    def _call_args(self, slots: Int64, x: Int64, ids: Int64, wts: Int64, out: Int64, ntok: Int32, ids64: Int32):
        """The call's (x, ids, weights, out, T, ids-are-int64): as given (by value), or with slots != 0 from the
        argument block the host's copy wrote just before this launch (every thread reads it)."""
        if slots != 0:
            x, ids, wts, out = ld_u64(slots), ld_u64(slots + 8), ld_u64(slots + 16), ld_u64(slots + 24)
            ntok = Int32(ld_u64(slots + 32))
            ids64 = Int32(ld_u64(slots + 40))
        return x, ids, wts, out, ntok, ids64

    @cute.jit
    def _take_workspace(self, own: Int64, ticket: Int32) -> Int32:
        """One thread: 1 if this call holds the workspace (ERR clear and INUSE taken by CAS 0 -> ticket, or held by
        the ticket already: another CTA of the call), else 0 (held by another ticket: ERR kind BUSY recorded).
        ERR is read before the CAS, not beside it: the round trip that would save measured no faster on the layer
        (docs/benchmarks/index.md: window pipelining)."""
        ok = Int32(0)
        if ld_u32(own + SIG_ERR * 4) == 0:
            held = atom_cas_u32(own + SIG_INUSE * 4, 0, ticket, "gpu", "acq_rel")
            if held == 0 or held == ticket:
                ok = Int32(1)
            else:
                record_error(own + SIG_ERR * 4, KIND_BUSY, 0, ticket, held)
        return ok

    @cute.jit
    def _load_group(self, x: Int64, t: Int32, c: Int32, lane: Int32):
        """Lane's 4 bf16 values (two 32-bit words) of token t's 128-value group c of x."""
        col = Int64(t) * self.H + c * 128 + lane * 4
        return ld_u32(x + col * 2), ld_u32(x + col * 2 + 4)

    @cute.jit
    def _quantize_group(self, w0: Int32, w1: Int32, qdst: Int64, sdst: Int64, lane: Int32):
        """A warp: one 128-value group from each lane's words w0, w1 (_load_group) -> lane's 4 FP8 E4M3 bytes at qdst
        and (lane 0) the group's power-of-two scale (fp32) at sdst."""
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
        bad = (v[0] != v[0]) or (v[1] != v[1]) or (v[2] != v[2]) or (v[3] != v[3]) or m > Float32(3.4028234663852886e38)
        for off in cutlass.range_constexpr(5):
            m = cute.arch.fmax(m, cute.arch.shuffle_sync_bfly(m, offset=1 << off))
        ex = fp8_pow2_exponent(m)
        inv = bits_to_f32((127 - ex) << 23)
        scale = bits_to_f32((127 + ex) << 23)
        if cute.arch.vote_any_sync(bad):
            inv = bits_to_f32(0x7FC00000)
            scale = inv
        q = (cvt_e4m3x2(v[1] * inv, v[0] * inv) & 0xFFFF) | (cvt_e4m3x2(v[3] * inv, v[2] * inv) << 16)
        st_u32(qdst, q)
        if lane == 0:
            st_u32(sdst, f32_to_bits(scale))

    @cute.jit
    def _load_slot(self, ids: Int64, wts: Int64, ids64: Int32, i: Int32):
        """(id as Int64, weight bits) of published slot i = t K + j (a routed slot j < k; the values of a shared slot
        j >= k are made by _check_slot, these are then unused loads of slot t k + 0)."""
        t = i // self.K
        src = Int64(t) * self.KR + cutlass.min(i - t * self.K, self.KR - 1)
        wb = ld_u32(wts + src * 4)
        e64 = Int64(0)
        if ids64 != 0:
            e64 = ld_u64(ids + src * 8)
        else:
            e64 = Int64(ld_u32(ids + src * 4))
        return e64, wb

    @cute.jit
    def _check_slot(self, own: Int64, i: Int32, e64: Int64, wb: Int32, first: Int32):
        """(id, weight bits) of slot i = t K + j from its loaded id and weight (_load_slot): a routed id checked
        (outside [ID_MIN, E): dropped as -1; a non-finite weight of a kept slot kept); shared slot j >= k: id
        E + j - k, weight 1. first != 0 (one thread per slot of the call): a bad id or weight is recorded (BAD) and
        a dropped slot's combine row zeroed (no rank writes it, so it adds zero)."""
        H, K, KR, o = self.H, self.K, self.KR, self.o
        t = i // K
        j = i - t * K
        e = Int32(self.E) + j - KR
        w = Int32(F32_ONE)
        if j < KR:
            w = wb
            e = Int32(e64)
            if e64 < self.ID_MIN or e64 >= self.E:
                if first != 0:
                    self._record_bad(own, BAD_ID, t, j, Int32(e64))
                e = Int32(-1)
            if first != 0:
                if e < 0:
                    row = own + o["combine"] + Int64(i) * (H * 2)
                    for c in cutlass.range(H // 8, unroll=1):
                        st_v4(row + Int64(c) * 16, 0, 0, 0, 0)
                elif (w & 0x7F800000) == 0x7F800000:
                    self._record_bad(own, BAD_WEIGHT, t, j, w)
        return e, w

    @cute.jit
    def _mirror_status(self, own: Int64, slots: Int64, status: Int64, ticket: Int32):
        """One thread, once the call's routing is checked. The slot path (slots != 0): SEQ += 1, and with status
        words the call's BAD entry and ticket to the host, then the SEQ it completes (release, sys). A call with its
        arguments by value (a caller's capture) and status words (a step's words, STEP_STATUS): its BAD entry and
        ticket to the host only if the call had one and the words hold none yet (the first of a step is kept until
        the host clears it)."""
        if slots != 0:
            seq = ld_u32(own + SIG_SEQ * 4)
            bad = [Int32(0)] * 4
            if status != 0:
                for w in cutlass.range_constexpr(4):
                    bad[w] = ld_u32(own + SIG_BAD * 4 + 4 * w)
            st_u32(own + SIG_SEQ * 4, seq + 1)
            if status != 0:
                for w in cutlass.range_constexpr(4):
                    st_u32(status + 4 + 4 * w, bad[w])
                    st_u32(own + SIG_BAD * 4 + 4 * w, 0)
                st_u32(status + 4 * STATUS_BAD_TICKET, ticket)
                fence_sys()
                st_release_u32(status, seq + 1, "sys")
        elif status != 0:
            code = ld_u32(own + SIG_BAD * 4)
            if code != 0:
                if ld_u32(status + 4) == 0:
                    for w in cutlass.range_constexpr(4):
                        st_u32(status + 4 + 4 * w, ld_u32(own + SIG_BAD * 4 + 4 * w))
                    st_u32(status + 4 * STATUS_BAD_TICKET, ticket)
                for w in cutlass.range_constexpr(4):
                    st_u32(own + SIG_BAD * 4 + 4 * w, 0)
                fence_sys()

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
        the arguments come from the argument block at `slots` (device memory) instead of x_arg .. ids64_arg.
        Each thread loads its first x group and routing slot before thread 0's ERR / INUSE round trips complete (the
        stores wait for them): at small T those are all its loads, one round trip for all instead of three."""
        HS, K, o = self.HS, self.K, self.o
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        nctas, _, _ = cute.arch.grid_dim()
        warp = tid // 32
        lane = tid % 32
        # dispatch (PDL) may launch now: it waits for this whole grid (griddepcontrol.wait) before reading anything
        cute.arch.griddepcontrol_launch_dependents()
        st = SmemAllocator().allocate(self.publish_shared)
        sflag = st.flag.get_tensor(cute.make_layout(4))
        x, ids, wts, out, ntok, ids64 = self._call_args(slots, x_arg, ids_arg, wts_arg, out_arg, ntok_arg, ids64_arg)
        ngroups = ntok * HS
        nslots = ntok * K
        gi0 = cta * WARPS + warp
        i0 = cta * THREADS + tid
        w0, w1 = Int32(0), Int32(0)
        e64, wb = Int64(0), Int32(0)
        if gi0 < ngroups:
            w0, w1 = self._load_group(x, gi0 // HS, gi0 % HS, lane)
        if i0 < nslots:
            e64, wb = self._load_slot(ids, wts, ids64, i0)
        if tid == 0:
            sflag[0] = self._take_workspace(own, ticket)
        cute.arch.sync_threads()
        if sflag[0] == 1:
            for gi in cutlass.range(gi0, ngroups, nctas * WARPS, unroll=1):
                t = gi // HS
                c = gi - t * HS
                if gi != gi0:
                    w0, w1 = self._load_group(x, t, c, lane)
                pos = Int64(t) * HS + c
                self._quantize_group(w0, w1, own + o["pub_x"] + pos * 128 + lane * 4, own + o["pub_sx"] + pos * 4, lane)
            for i in cutlass.range(i0, nslots, nctas * THREADS, unroll=1):
                if i != i0:
                    e64, wb = self._load_slot(ids, wts, ids64, i)
                e, w = self._check_slot(own, i, e64, wb, Int32(1))
                st_u32(own + o["pub_ids"] + Int64(i) * 4, e)
                st_u32(own + o["pub_w"] + Int64(i) * 4, w)
        cute.arch.sync_threads()
        if tid == 0 and sflag[0] == 1:
            fence_gpu()
            if atom_add_u32(own + SIG_PUB_DONE * 4, 1, "acq_rel", "gpu") == nctas - 1:
                # the words read here and in _mirror_status, loaded before any is used (one round trip)
                err = ld_u32(own + SIG_ERR * 4)
                gen = ld_u32(own + SIG_GEN * 4)
                st_u32(own + SIG_PUB_DONE * 4, 0)
                self._mirror_status(own, slots, status, ticket)
                self._signal_ready(own, ntok, out, err, gen)

    # ---------------------------------------------------------------- dispatch
    @cute.jit
    def _chunk(self, total: Int32, warp: Int32):
        """Warp's entries [c0, c1) of all ranks' `total` routing entries: WARPS equal chunks rounded up to 32."""
        chunk = (total + WARPS * 32 - 1) // (WARPS * 32) * 32
        c0 = warp * chunk
        return c0, cutlass.min(c0 + chunk, total)

    @cute.jit
    def _load_ids(self, pa: Int64, j0: Int32, i_hi: Int32, lane: Int32):
        """Lane's ID_BATCH published ids j0 + 32 u + lane of the ids at pa, all in flight at once (clamped into
        [0, i_hi): the extra ones unused)."""
        return tuple(ld_u32(pa + Int64(cutlass.min(j0 + 32 * u + lane, i_hi - 1)) * 4) for u in range(ID_BATCH))

    @cute.jit
    def _ring_expert(self, e: Int32, lo: Int32, own_tokens: Int32) -> Int32:
        """The ring expert of published id e on the rank whose routed experts are [lo, lo + EL): e - lo for those,
        EL + e - E for a shared id (>= E) of the rank's own tokens (own_tokens != 0), else -1 (another rank's
        expert, or a dropped slot)."""
        v = Int32(-1)
        d = e - lo
        if d >= 0 and d < self.EL:
            v = d
        if own_tokens != 0 and e >= self.E:
            v = self.EL + e - self.E
        return v

    @cute.jit
    def _count_entry(self, v: Int32, q: Int32, j: Int32, warp: Int32, scur: cute.Tensor, sids: cute.Tensor):
        """Step 2 for one entry j of rank q's routing: its ring expert v (-1: not this rank's) into smem, counted in
        the warp's table."""
        if v >= 0:
            cute.arch.atomic_add(scur.iterator + ((warp * self.P + q) * self.REL + v), Int32(1))
        sids[q * self.TM * self.K + j] = Int16(v)

    @cute.jit
    def _offsets(self, own: Int64, scur, soff, stot, sscan, tid: Int32, warp: Int32, lane: Int32, write: Int32):
        """Step 3: per-expert totals; row cursors in (src rank, warp chunk) order per expert; BM-padded ring
        offsets (block-wide scan); write != 0: the offsets and counts to the ring (one CTA)."""
        P, REL, BM, o = self.P, self.REL, self.BM, self.o
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
        if write != 0:
            for e in cutlass.range(tid, REL + 1, THREADS, unroll=1):
                st_u32(own + o["ring_offsets"] + e * 4, soff[e])
            for e in cutlass.range(tid, REL, THREADS, unroll=1):
                st_u32(own + o["ring_counts"] + e * 4, stot[e])
        cute.arch.sync_threads()

    @cute.jit
    def _assign_rows(self, own: Int64, sntok, sids, scur, ssrc, c0: Int32, c1: Int32, warp: Int32, lane: Int32):
        """Step 4: each warp ranks its chunk 32 entries at a time: the ring row of every (q, t, j), its source
        written (ring_src, and shared memory for the CTA's first SRC_BLOCKS owned blocks) where this CTA owns the
        row's block (block b -> CTA b mod C)."""
        P, TM, K, REL, BM, o = self.P, self.TM, self.K, self.REL, self.BM, self.o
        cta, _, _ = cute.arch.block_idx()
        C, _, _ = cute.arch.grid_dim()
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
                        lb = row // BM // C  # the CTA's lb-th owned block: its sources also kept here
                        if lb < SRC_BLOCKS:
                            k3 = (lb * BM + row % BM) * 3
                            ssrc[k3] = q
                            ssrc[k3 + 1] = i // K
                            ssrc[k3 + 2] = i % K
                cute.arch.sync_warp()
                if e >= 0 and rank_in == 0:
                    scur[cur + e] = scur[cur + e] + cute.arch.popc(peers_mask)
                cute.arch.sync_warp()
            start = start + n
        cute.arch.sync_threads()

    @cute.jit
    def _release_offs(
        self,
        own: Int64,
        g: Int32,
        local: cutlass.Constexpr,
        slots: Int64,
        status: Int64,
        ntok: Int32,
        out: Int64,
        ticket: Int32,
    ):
        """Thread 0 of each CTA past its reads of the routing: the last of them releases (gpu) OFFS = g, the ring's
        shape for call g that W1 and W2 acquire (also saying no CTA still reads the routing). The local dispatch
        ends the call's publish first, under the same release: the slot path's SEQ and status words, GEN = READY =
        g, NTOK, OUT."""
        C, _, _ = cute.arch.grid_dim()
        fence_gpu()
        if atom_add_u32(own + SIG_RANKED * 4, 1, "acq_rel", "gpu") == C - 1:
            st_u32(own + SIG_RANKED * 4, 0)  # for the next call (ordered before OFFS by the release)
            if cutlass.const_expr(local):
                self._mirror_status(own, slots, status, ticket)
                st_u32(own + SIG_GEN * 4, g)
                st_u32(own + SIG_READY * 4, g)
                st_u32(own + SIG_NTOK * 4, ntok)
                st_u32(own + SIG_OUT * 4, Int32(out & 0xFFFFFFFF))
                st_u32(own + SIG_OUT * 4 + 4, Int32(out >> 32))
            st_release_u32(own + SIG_OFFS * 4, g, "gpu")

    @cute.jit
    def _row_src(self, own: Int64, ssrc, lb: Int32, r: Int32, row: Int32):
        """(q, t, j) of ring row `row`, row r of the CTA's lb-th owned block: from shared memory (step 4 kept it)
        or, past the first SRC_BLOCKS blocks, from ring_src."""
        q, t, j = Int32(0), Int32(0), Int32(0)
        if lb < SRC_BLOCKS:
            k3 = (lb * self.BM + r) * 3
            q, t, j = ssrc[k3], ssrc[k3 + 1], ssrc[k3 + 2]
        else:
            srow = own + self.o["ring_src"] + Int64(row) * 12
            q, t, j = ld_u32(srow), ld_u32(srow + 4), ld_u32(srow + 8)
        return q, t, j

    @cute.jit
    def _pad_row(self, own: Int64, row: Int32):
        """A padding row of a ring block: src = -1, dst = the combine buffer's sink row (its payload is never read:
        the GEMMs store no padding column)."""
        srow = own + self.o["ring_src"] + Int64(row) * 12
        st_u32(own + self.o["ring_dst"] + Int64(row) * 4, self.TM * self.K)
        st_u32(srow, -1)
        st_u32(srow + 4, -1)
        st_u32(srow + 8, -1)

    @cute.jit
    def _quantize_rows(self, own: Int64, x: Int64, wts: Int64, ssrc, lb: Int32, row0: Int32, nvalid: Int32):
        """The local dispatch's rows [row0, row0 + nvalid) of the CTA's lb-th owned block, from the caller's x and
        weights: the CTA's warps take (row, 128-value group) items QUANT_BATCH at a time, every load of a batch in
        flight before its first store; FP8 bytes, the transposed scale, and with a row's group 0 its routing weight
        (a routed slot's as given, a shared slot's 1) and combine row t K + j."""
        H, HS, K, KR, CAP, o = self.H, self.HS, self.K, self.KR, self.CAP, self.o
        tid, _, _ = cute.arch.thread_idx()
        warp = tid // 32
        lane = tid % 32
        n = nvalid * HS
        for k0 in cutlass.range(warp * QUANT_BATCH, n, WARPS * QUANT_BATCH, unroll=1):
            words = []  # per item: the lane's two x words, the row's routing weight bits, its combine row
            for u in cutlass.range_constexpr(QUANT_BATCH):
                kk = cutlass.min(k0 + u, n - 1)
                r = kk // HS
                _, t, j = self._row_src(own, ssrc, lb, r, row0 + r)
                words.extend(self._load_group(x, t, kk - r * HS, lane))
                w = Int32(F32_ONE)
                if kk == r * HS and j < KR:  # a row's group 0 also stores its routing weight
                    w = ld_u32(wts + (Int64(t) * KR + j) * 4)
                words.extend((w, t * K + j))
            for u in cutlass.range_constexpr(QUANT_BATCH):
                k = k0 + u
                if k < n:
                    r = k // HS
                    c = k - r * HS
                    row = row0 + r
                    qdst = own + o["ring_x"] + Int64(row) * H + c * 128 + lane * 4
                    sdst = own + o["ring_sxT"] + (Int64(c) * CAP + row) * 4
                    self._quantize_group(words[4 * u], words[4 * u + 1], qdst, sdst, lane)
                    if c == 0 and lane == 0:
                        st_u32(own + o["ring_w"] + Int64(row) * 4, words[4 * u + 2])
                        st_u32(own + o["ring_dst"] + Int64(row) * 4, words[4 * u + 3])

    @cute.jit
    def _fill_blocks(
        self, own: Int64, speer, soff, stot, ssrc, g: Int32, local: cutlass.Constexpr, x: Int64, wts: Int64
    ):
        """Step 5: the rows of the CTA's owned blocks (pulled from the peers' published buffers, or quantised from
        the caller's x and weights: the local dispatch), padding rows marked, then each block tagged (release, gpu)
        L1_FULL[b] = g — what W1 acquires."""
        REL, BM, H, o = self.REL, self.BM, self.H, self.o
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        C, _, _ = cute.arch.grid_dim()
        warp = tid // 32
        lane = tid % 32
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
            lb = b // C
            if cutlass.const_expr(local):
                self._quantize_rows(own, x, wts, ssrc, lb, row0, cutlass.max(cutlass.min(valid_end - row0, BM), 0))
            for r in cutlass.range(warp, BM, WARPS, unroll=1):
                row = row0 + r
                if row < valid_end:
                    if cutlass.const_expr(not local):
                        q, t, j = self._row_src(own, ssrc, lb, r, row)
                        self._pull_row(speer[q], own, t, j, row, own + o["ring_x"] + Int64(row) * H, lane)
                elif lane == 0:
                    self._pad_row(own, row)
            cute.arch.sync_threads()
            if tid == 0:
                fence_gpu()
                st_release_u32(own + SIG_L1_FULL * 4 + Int64(b) * 4, g, "gpu")

    def _dispatch_smem(self):
        """Dispatch's shared memory: (speer, sntok, sflag, sids, scur, soff, stot, sscan, ssrc)."""
        P, TM, K, REL, BM = self.P, self.TM, self.K, self.REL, self.BM
        st = SmemAllocator().allocate(self.dispatch_shared)
        return (
            st.peer.get_tensor(cute.make_layout(P)),
            st.ntok.get_tensor(cute.make_layout(P)),
            st.flag.get_tensor(cute.make_layout(4)),
            st.ids.get_tensor(cute.make_layout(P * TM * K)),
            st.cur.get_tensor(cute.make_layout(WARPS * P * REL)),
            st.off.get_tensor(cute.make_layout(REL + 1)),
            st.tot.get_tensor(cute.make_layout(REL)),
            st.scan.get_tensor(cute.make_layout(WARPS)),
            st.src.get_tensor(cute.make_layout(3 * SRC_BLOCKS * BM)),
        )

    @cute.kernel
    def k_dispatch(self, peers: tuple, rank: Int32, timeout_ns: Int64, ntok_arg: Int32):
        P, K, EL, REL = self.P, self.K, self.EL, self.REL
        o = self.o
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        # PDL: launched while publish runs; nothing of the call is read before publish has finished (GEN included)
        cute.arch.griddepcontrol_wait()
        warp = tid // 32
        lane = tid % 32
        speer, sntok, sflag, sids, scur, soff, stot, sscan, ssrc = self._dispatch_smem()

        self._stage_peers(peers, speer, tid)
        if tid == 0:
            sflag[0] = 0
        # P = 1 with T by value (ntok_arg >= 0; -1 on the slot path): this lane's first routing ids loaded now, beside
        # the state words below (publish has finished: nothing to wait for), so both take one round trip
        pre = Int32(0)
        ids = (Int32(-1),) * ID_BATCH
        if cutlass.const_expr(P == 1):  # noqa: SIM102  (a compile-time branch around a run-time one)
            if ntok_arg >= 0:
                p0, p1 = self._chunk(ntok_arg * K, warp)
                if p0 < p1:
                    pre = Int32(1)
                    ids = self._load_ids(peers[0] + o["pub_ids"], p0, p1, lane)
        cute.arch.sync_threads()
        own = speer[rank]
        g = ld_u32(own + SIG_GEN * 4)
        failed = ld_u32(own + SIG_ERR * 4)
        if cutlass.const_expr(P == 1):
            # publish (this rank's own, the only one) finished before griddepcontrol.wait returned: READY and NTOK
            # are read, not awaited; READY = g is still checked (GEN and READY written by the same publish)
            if tid == 0:
                ready = ld_u32(own + SIG_READY * 4)
                nt = ntok_arg
                if ntok_arg < 0:
                    nt = ld_u32(own + SIG_NTOK * 4)
                sntok[0] = nt
                if failed == 0 and ready != g:
                    record_error(own + SIG_ERR * 4, KIND_READY, 0, g, ready)
                    sflag[0] = 1
        elif failed == 0 and tid < P:
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
            # 2. ids -> smem, counts per (warp chunk, src rank, ring expert): steps 2 and 4 split the entries alike
            for i in cutlass.range(tid, WARPS * P * REL, THREADS, unroll=1):
                scur[i] = 0
            total = Int32(0)
            for q in cutlass.range(P, unroll=1):
                total = total + sntok[q] * K
            c0, c1 = self._chunk(total, warp)
            cute.arch.sync_threads()
            lo = rank * EL
            start = Int32(0)
            for q in cutlass.range(P, unroll=1):
                n = sntok[q] * K
                pa = speer[q] + o["pub_ids"]
                i_hi = cutlass.min(c1 - start, n)
                for j0 in cutlass.range(cutlass.max(c0 - start, 0), i_hi, 32 * ID_BATCH, unroll=1):
                    if pre == 0 or j0 != c0:  # (P = 1: the first batch was loaded before the state words)
                        ids = self._load_ids(pa, j0, i_hi, lane)
                    for u in cutlass.range_constexpr(ID_BATCH):
                        j = j0 + 32 * u + lane
                        if j < i_hi:
                            v = self._ring_expert(ids[u], lo, Int32(q == rank))
                            self._count_entry(v, q, j, warp, scur, sids)
                start = start + n
            cute.arch.sync_threads()
            # 3. totals, cursors, offsets (CTA 0 writes them); 4. rows of the owned blocks' entries
            self._offsets(own, scur, soff, stot, sscan, tid, warp, lane, Int32(cta == 0))
            self._assign_rows(own, sntok, sids, scur, ssrc, c0, c1, warp, lane)
            # W1 (PDL) may launch once every CTA is here: it acquires OFFS and each block's L1_FULL, so it streams
            # weights beside the row pulls below; a CTA past this point reads the peers' rows only for blocks whose
            # tags W1 acquires, so a finished call leaves no dispatch CTA still reading published buffers (on a
            # partition W1 is not launched after this grid; CTAs without blocks release no tag)
            cute.arch.griddepcontrol_launch_dependents()
            if tid == 0:
                self._release_offs(own, g, False, Int64(0), Int64(0), Int32(0), Int64(0), Int32(0))
            # 5. pull the rows of the owned blocks, then tag each block with the generation
            self._fill_blocks(own, speer, soff, stot, ssrc, g, False, Int64(0), Int64(0))

    @cute.jit
    def dispatch(self, peers: tuple, rank: Int32, timeout_ns: Int64, ntok: Int32, nctas: Int32, stream: cuda.CUstream):
        self.k_dispatch(peers, rank, timeout_ns, ntok).launch(
            grid=[nctas, 1, 1],
            block=[THREADS, 1, 1],
            smem=self.dispatch_shared.size_in_bytes(),
            stream=stream,
            use_pdl=True,
        )

    # ---------------------------------------------------------------- publish + dispatch in one kernel (P = 1)
    @cute.jit
    def _load_slots(self, ids: Int64, wts: Int64, ids64: Int32, j0: Int32, i_hi: Int32, lane: Int32):
        """(id, weight bits) of lane's ID_BATCH slots j0 + 32 u + lane (clamped into [0, i_hi)), all in flight at
        once, flattened."""
        words = []
        for u in cutlass.range_constexpr(ID_BATCH):
            words.extend(self._load_slot(ids, wts, ids64, cutlass.min(j0 + 32 * u + lane, i_hi - 1)))
        return tuple(words)

    @cute.kernel
    def k_dispatch_local(
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
        """World size 1: publish and dispatch as one kernel, the ring rows quantised straight from the caller's x
        (bit-identical to publish + dispatch: the same quantisation, routing checks and row order), so the call's
        first kernel boundary and the published copy are gone. Each CTA: its first routing entries loaded at once
        beside one thread's ERR -> INUSE (CAS) -> GEN round trips; then as dispatch steps 2-4 (with publish's
        checks: BAD recorded and dropped slots' combine rows zeroed by CTA 0); the last CTA past the ranking ends
        the publish (GEN = READY = g, NTOK, OUT) and releases OFFS = g; then step 5 quantises the owned rows.
        Arguments by value or from the slot path's argument block, as publish."""
        K, REL = self.K, self.REL
        tid, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        warp = tid // 32
        lane = tid % 32
        speer, sntok, sflag, sids, scur, soff, stot, sscan, ssrc = self._dispatch_smem()
        x, ids, wts, out, ntok, ids64 = self._call_args(slots, x_arg, ids_arg, wts_arg, out_arg, ntok_arg, ids64_arg)
        c0, c1 = self._chunk(ntok * K, warp)
        # this lane's first ID_BATCH entries (id, weight), in flight beside the state words
        pre = (Int64(0), Int32(0)) * ID_BATCH
        if c0 < c1:
            pre = self._load_slots(ids, wts, ids64, c0, c1, lane)
        # the state, on one thread of the last warp (whose chunk is the last to hold entries): the workspace taken
        # (ERR clear, INUSE CAS 0 -> ticket), then the generation this call makes (read after the CAS: the GEN of
        # the last call that held the workspace)
        gen = Int32(0)
        if tid == THREADS - 32:
            ok = self._take_workspace(own, ticket)
            if ok == 1:
                gen = ld_u32(own + SIG_GEN * 4)
            sflag[0] = ok
            sntok[0] = ntok
        for i in cutlass.range(tid, WARPS * REL, THREADS, unroll=1):
            scur[i] = 0
        cute.arch.sync_threads()
        if sflag[0] == 1:
            # W1 (PDL) may launch now: it acquires INUSE (taken above), OFFS and each block's L1_FULL before it reads
            # anything of the call, so it streams its first weights while the rows are made
            cute.arch.griddepcontrol_launch_dependents()
            # 2. this warp's entries: checked (CTA 0 records BAD, zeroes dropped slots' combine rows), counted
            for j0 in cutlass.range(c0, c1, 32 * ID_BATCH, unroll=1):
                loaded = pre
                if j0 != c0:
                    loaded = self._load_slots(ids, wts, ids64, j0, c1, lane)
                for u in cutlass.range_constexpr(ID_BATCH):
                    i = j0 + 32 * u + lane
                    if i < c1:
                        e, _ = self._check_slot(own, i, loaded[2 * u], loaded[2 * u + 1], Int32(cta == 0))
                        self._count_entry(self._ring_expert(e, Int32(0), Int32(1)), Int32(0), i, warp, scur, sids)
            if tid == THREADS - 32:
                sflag[1] = gen + 1
            cute.arch.sync_threads()
            # 3. totals, cursors, offsets (CTA 0 writes them); 4. rows of the owned blocks' entries
            self._offsets(own, scur, soff, stot, sscan, tid, warp, lane, Int32(cta == 0))
            self._assign_rows(own, sntok, sids, scur, ssrc, c0, c1, warp, lane)
            g = sflag[1]
            if tid == 0:
                self._release_offs(own, g, True, slots, status, ntok, out, ticket)
            # 5. quantise the rows of the owned blocks, then tag each block with the generation
            self._fill_blocks(own, speer, soff, stot, ssrc, g, True, x, wts)

    # ---------------------------------------------------------------- finalize (+ the combined signal)
    @cute.jit
    def _load_pieces(self, comb: Int64, it: Int32):
        """The k + S 16-byte pieces output piece `it` (token it // (H / 8), 8 columns) sums, all loads in flight at
        once: its k + S combine rows, as (k + S) x 4 words."""
        K, H = self.K, self.H
        t = it // (H // 8)
        c = it - t * (H // 8)
        words = []
        for j in cutlass.range_constexpr(K):
            words.extend(ld_v4(comb + (Int64(t * K + j) * H + c * 8) * 2))
        return tuple(words)

    @cute.jit
    def _store_sum(self, out: Int64, it: Int32, words: tuple):
        """out piece `it` = bf16 of the fp32 sum of its pieces' bf16 values in slot order (_load_pieces)."""
        H = self.H
        t = it // (H // 8)
        c = it - t * (H // 8)
        acc = [Float32(0.0)] * 8
        for j in cutlass.range_constexpr(self.K):
            for h in cutlass.range_constexpr(4):
                w = words[4 * j + h]
                lo_v = bits_to_f32(w << 16)
                hi_v = bits_to_f32(w & -65536)
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

    @cute.kernel
    def k_finalize(
        self,
        peers: tuple,
        rank: Int32,
        out_arg: Int64,
        ntok_arg: Int32,
        timeout_ns: Int64,
        ticket: Int32,
        status: Int64,
    ):
        K, H, P = self.K, self.H, self.P
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
        # P = 1 with the output and T by value: this thread's first output piece's combine rows loaded now,
        # beside the state words below (W2, the only writer, has finished), so both take one round trip
        it0 = cta * THREADS + tid
        pre = Int32(0)
        words = (Int32(0),) * (4 * K)
        if cutlass.const_expr(P == 1):  # noqa: SIM102  (a compile-time branch around a run-time one)
            if out_arg != 0 and it0 < ntok_arg * (H // 8):
                pre = Int32(1)
                words = self._load_pieces(peers[0] + self.o["combine"], it0)
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
            for it in cutlass.range(it0, t_count * per_tok, F * THREADS, unroll=1):
                if pre == 0 or it != it0:
                    words = self._load_pieces(comb, it)
                self._store_sum(out, it, words)
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
        if cta == 0 and tid == 0 and status != 0:  # the ERR words to the host, the first failed call's ticket
            err = ld_u32(own + SIG_ERR * 4)
            for w in cutlass.range_constexpr(5):
                st_u32(status + 32 + 4 * w, ld_u32(own + SIG_ERR * 4 + 4 * w))
            if err != 0 and ld_u32(status + 4 * STATUS_ERR_TICKET) == 0:
                st_u32(status + 4 * STATUS_ERR_TICKET, ticket)

    @cute.jit
    def finalize(
        self,
        peers: tuple,
        rank: Int32,
        out: Int64,
        ntok: Int32,
        timeout_ns: Int64,
        ticket: Int32,
        status: Int64,
        nctas: Int32,
        stream: cuda.CUstream,
    ):
        self.k_finalize(peers, rank, out, ntok, timeout_ns, ticket, status).launch(
            grid=[nctas, 1, 1],
            block=[THREADS, 1, 1],
            smem=self.finalize_shared.size_in_bytes(),
            stream=stream,
            use_pdl=True,
        )


class CallLaunch:
    """The launch of a kernel that takes a call's arguments (by value, or from the slot path's argument block):
    publish, or with `local` the world-size-1 publish + dispatch (k_dispatch_local). One signature for both."""

    def __init__(self, kernels: CommKernels, local: bool):
        self.kernels, self.local = kernels, local

    @cute.jit
    def __call__(
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
        k = self.kernels
        kernel, shared = (k.k_dispatch_local, k.dispatch_shared) if self.local else (k.k_publish, k.publish_shared)
        kernel(own, slots, status, x, ids, wts, out, ntok, ids64, ticket).launch(
            grid=[nctas, 1, 1], block=[THREADS, 1, 1], smem=shared.size_in_bytes(), stream=stream
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

    def call_kernel(local: bool, name: str):
        args = (*(i64,) * 7, Int32(0), Int32(0), Int32(1), Int32(1), stream)
        return compile_kernel(CallLaunch(k, local), *args, arch=arch, name=f"comm_{name}_{tag}")

    ks = {
        "ready": compile_kernel(k.ready, i64, Int32(0), stream, arch=arch, name=f"comm_ready_{tag}"),
        "publish": call_kernel(False, "publish"),
        "dispatch": compile_kernel(
            k.dispatch, peers, Int32(0), i64, Int32(0), Int32(1), stream, arch=arch, name=f"comm_dispatch_{tag}"
        ),
        "finalize": compile_kernel(
            k.finalize,
            peers,
            Int32(0),
            i64,
            Int32(0),
            i64,
            Int32(1),
            i64,
            Int32(1),
            stream,
            arch=arch,
            name=f"comm_finalize_{tag}",
        ),
    }
    if s.ranks == 1:  # publish + dispatch in one kernel
        ks["dispatch_local"] = call_kernel(True, "dispatch_local")
    return ks
