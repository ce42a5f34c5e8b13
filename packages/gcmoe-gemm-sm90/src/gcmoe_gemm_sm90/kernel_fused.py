"""W1 and W2 in one persistent launch (Sm90Config.fused, ring mode): #15's "one persistent W1 -> W2 launch".

    units: every W1 tile (expert, N tile, M tile) of the experts with rows, experts ascending, then every W2 tile in
           the same order (kernel_grouped.locate_tile's order)
    CTA (C of them, any number; normally the CTA slots of the partition):
        claim unit u (atom.add on a queue word); while u is a unit:
            claim the next unit u' (so the producer can stream into it), stage u's activation scales
            u's windows through the CTA's one pipeline (decode + register-A WGMMA, kernel_grouped's window loop)
            W1: SwiGLU + FP8 epilogue, count the tile in W1_DONE[e] (the expert's last releases its tag = g)
            W2: bf16 scatter through the peer table
            u = u'

Why (tools/gpu/schedule_probe.py, H200, 2026-12-01): the layer's weights streamed by whole-tile units claimed at run
time, W1's before W2's, were 1.05-1.10x faster than the same units as two launches at DeepSeek-V4-Flash T = 8 / 32
(95.3 vs 104.8 us, 113.0 vs 118.3); the two launches' CTAs each end in a pipeline drain and a wave tail, and W2's
reach the SMs only as W1's leave them. A first form with static window ranges per CTA (stream_k, partial tiles
reduced through global memory) measured 1.07-1.25x slower than the two launches (split_sweep --sweep fused at
565dfd4): the partial reductions and their epilogues cost more than the schedule saved.

One pipeline for the whole CTA: warp 0 issues the loads (a stage: the window's weights and scale records by bulk
copy, its activation box by TMA from x for a W1 unit or from W1's FP8 rows for a W2 unit) up to `stages` windows
ahead of the consumers, across unit boundaries into the next claimed unit. Before a unit's first activation box it
checks, without waiting, that the rows are there: W1, the L1_FULL tags (== g) of the ring blocks under the N tile;
W2, the W1_DONE tag of its expert. If not, it stops issuing and the consumers, once at that unit (so this CTA's own
W1 tiles before it are stored and counted), wait for it (bounded, failing into ERR as every ring wait, and then the
CTA stops). No deadlock whatever the CTA count: a W2 unit waits only for W1 tiles claimed before it, each by a CTA
that is running.

The queue word and an exit word (the caller's int32 [2]; sig[6] is their address): each CTA that acquired the call
counts its exit, and the last resets both to 0 for the next launch (stream order). A launch that did not acquire (a
warm-up on WARMUP signal words, a failed INUSE / OFFS wait) touches neither. The layer's recover() zeroes them.

Unit table in shared memory: two slots (the current unit and the next), UNIT_FIELDS words each.
By-value words (sig): INUSE, CGEN, OFFS, ERR, L1_FULL, W1_DONE, the queue words, 0; with cfg.bias then b13, b2,
route_w (the W1 epilogue reads its b13 as word 8, the W2 epilogue b2 / route_w as words 8 / 9).
"""

# No `from __future__ import annotations` in kernel files: the DSL reads the annotations as live objects.
from functools import cache

from gcmoe_core.cutedsl import compile_kernel, cutlass_modules
from gcmoe_core.device_ops import atom_add_u32, ld_acquire_u32, ld_u32, record_error, st_u32, wait_until_eq
from gcmoe_core.signals import KIND_BLOCK, KIND_W1

from .config import WINDOW_K, WINDOW_SCALE_BYTES, WINDOW_WEIGHT_BYTES, Sm90Config, can_implement
from .kernel_grouped import GroupedGemmSm90, fake_operands

cutlass, cute = cutlass_modules()
import cuda.bindings.driver as cuda  # noqa: E402
import cutlass.pipeline as pipeline  # noqa: E402
import cutlass.utils as utils  # noqa: E402
from cutlass import runtime as crt  # noqa: E402
from cutlass.cute.nvgpu import cpasync, warpgroup  # noqa: E402

Int32, Int64, Float32 = cutlass.Int32, cutlass.Int64, cutlass.Float32
FUSED_SIG_WORDS = 8
W1, W2, NONE = 0, 1, 2  # a unit's mode
# the unit table's fields (per slot): mode, expert, N tile, M tile, windows, first window record, the expert's first
# row, its row count
F_MODE, F_E, F_NT, F_MT, F_NW, F_REC, F_ROW, F_CNT = range(8)
UNIT_FIELDS = 8
# the expert tables (N tiles before each expert, its first row, its rows) kept in shared memory where the ring has at
# most TABLE_EXPERTS experts, so a claim locates its tile without global loads (else kernel_grouped.locate_tile)
TABLE_EXPERTS = 64
T_PRE, T_OFFS, T_CNT = (2 * UNIT_FIELDS + k * (TABLE_EXPERTS + 1) for k in range(3))
TABLE_WORDS = 2 * UNIT_FIELDS + 3 * (TABLE_EXPERTS + 1)
# sflag words: 0 ok (the call acquired), 1 g, 2..6 release_expert's, 7 stop (a wait failed)
S_STOP = 7


def fused_sig_words(cfg: Sm90Config) -> int:
    return FUSED_SIG_WORDS + (3 if cfg.bias else 0)


class FusedGemmSm90:
    """W1 (gate/up rows 2I, K = H) then W2 (rows H, K = I) of one layer in one persistent launch."""

    def __init__(self, hidden: int, inter: int, cfg: Sm90Config):
        if not (cfg.fused and cfg.ring):
            raise ValueError("FusedGemmSm90: needs cfg.fused and ring mode")
        self.cfg = cfg
        self.g1 = GroupedGemmSm90("w1", 2 * inter, hidden, cfg)
        self.g2 = GroupedGemmSm90("w2", hidden, inter, cfg)
        self.windows = max(self.g1.windows, self.g2.windows)

    @cute.jit
    def __call__(
        self,
        wq1: cute.Tensor,
        ws1: cute.Tensor,
        x: cute.Tensor,
        sxT: cute.Tensor,
        wq2: cute.Tensor,
        ws2: cute.Tensor,
        h: cute.Tensor,
        hsT: cute.Tensor,
        offs: cute.Tensor,
        cnt: cute.Tensor,
        lut: cute.Tensor,
        rw: cute.Tensor,
        hq: cute.Tensor,
        hs_out: cute.Tensor,
        dst: cute.Tensor,
        src: cute.Tensor,
        comb: cute.Tensor,
        sig: tuple,
        ticket: Int32,
        timeout_ns: Int64,
        num_experts: Int32,
        ctas: Int32,
        stream: cuda.CUstream,
    ):
        mma, b_smem_staged, tma_atom1, tma_x = self.g1.operands(x)
        _, _, tma_atom2, tma_h = self.g2.operands(h)
        self.shared = self.g1.shared_struct(b_smem_staged, self.windows, TABLE_WORDS)
        self.kernel(
            wq1,
            ws1,
            tma_atom1,
            tma_x,
            sxT,
            wq2,
            ws2,
            tma_atom2,
            tma_h,
            hsT,
            offs,
            cnt,
            lut,
            rw,
            hq,
            hs_out,
            dst,
            src,
            comb,
            sig,
            ticket,
            timeout_ns,
            num_experts,
            mma,
            b_smem_staged,
        ).launch(
            grid=[ctas, 1, 1],
            block=[self.g1.threads, 1, 1],
            use_pdl=self.cfg.pdl,
            smem=self.shared.size_in_bytes(),
            stream=stream,
            min_blocks_per_mp=self.cfg.occupancy,
            preferred_smem_carveout=100,
        )

    @cute.kernel
    def kernel(
        self,
        wq1: cute.Tensor,
        ws1: cute.Tensor,
        tma_atom1: cute.CopyAtom,
        tma_x: cute.Tensor,
        sxT: cute.Tensor,
        wq2: cute.Tensor,
        ws2: cute.Tensor,
        tma_atom2: cute.CopyAtom,
        tma_h: cute.Tensor,
        hsT: cute.Tensor,
        offs: cute.Tensor,
        cnt: cute.Tensor,
        lut: cute.Tensor,
        rw: cute.Tensor,
        hq: cute.Tensor,
        hs_out: cute.Tensor,
        dst: cute.Tensor,
        src: cute.Tensor,
        comb: cute.Tensor,
        sig: tuple,
        ticket: Int32,
        timeout_ns: Int64,
        num_experts: Int32,
        tiled_mma: cute.TiledMma,
        b_smem_staged: cute.ComposedLayout,
    ):
        n_tile, depth, stages = self.g1.n, self.g1.prefetch, self.g1.stages
        bias = self.cfg.bias
        sig1 = tuple(sig[:8]) + ((sig[8],) if bias else ())
        sig2 = tuple(sig[:8]) + ((sig[9], sig[10]) if bias else ())
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg = tidx // 128 if self.g1.wgs == 2 else tidx // 256
        sb = 0 if self.g1.wgs == 2 else (tidx // 128) % 2
        tw = tidx % 128
        lane = tidx % 32
        g = lane // 4
        t0 = lane % 4
        wwarp = tw // 32

        st = utils.SmemAllocator().allocate(self.shared)
        slut = st.lut.get_tensor(cute.make_layout(32))
        sflag = st.flag.get_tensor(cute.make_layout(8))
        sred = st.red.get_tensor(cute.make_layout((n_tile, self.g1.threads // 32)))
        ssx = st.ssx.get_tensor(cute.make_layout((self.windows, n_tile), stride=(n_tile, 1)))
        sB = st.sB.get_tensor(b_smem_staged.outer, swizzle=b_smem_staged.inner)
        sq = st.skt.get_tensor(cute.make_layout((UNIT_FIELDS, 2)))  # the unit table: [field, slot]
        stab = st.skt.get_tensor(cute.make_layout(TABLE_WORDS))  # (the expert tables at T_PRE, T_OFFS, T_CNT)

        # the call holds the workspace and dispatch published the ring's layout (sflag[0] ok, [1] g)
        ok, gen = self.g1.acquire_ring(sig1, ticket, timeout_ns, sflag, tidx, Int32(0))
        cute.arch.griddepcontrol_launch_dependents()  # (finalize waits for this whole grid)
        _, _, _, u1 = self.g1.locate_tile(cnt, Int32(-1), num_experts, lane)
        _, _, _, u2 = self.g2.locate_tile(cnt, Int32(-1), num_experts, lane)
        units = u1 + u2
        if ok == 0:
            units = Int32(0)
        queue = sig[6]  # (the claim word; the exit word after it)
        table = num_experts <= TABLE_EXPERTS
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_atom1)
            cpasync.prefetch_descriptor(tma_atom2)
        if warp_idx == 1 and table:
            self.fill_tables(stab, cnt, offs, num_experts, lane)
        if tidx < 32:
            slut[tidx] = lut[tidx]
        if tidx == 0:
            sflag[S_STOP] = Int32(0)
        b_bytes = cute.size_in_bytes(cutlass.Float8E4M3FN, cute.slice_(b_smem_staged, (None, None, 0)))
        pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=st.mbar.data_ptr(),
            num_stages=stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.g1.threads // 32),
            tx_count=b_bytes + WINDOW_WEIGHT_BYTES + WINDOW_SCALE_BYTES,
            cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
        )
        cute.arch.barrier()
        if warp_idx == 0:
            raw = self.claim_take(queue, units, ok, lane)
            self.claim(sq, stab, table, Int32(0), raw, u1, units, cnt, offs, num_experts, lane)
        cute.arch.barrier()

        sW = st.sW.get_tensor(cute.make_layout((4, 128, 8, stages), stride=(1, 4, 512, 4096)))
        sS = st.sS.get_tensor(cute.make_layout((256, stages), stride=(1, 256)))
        thr_mma = tiled_mma.get_slice(tw)
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
        a_shape = thr_mma.partition_shape_A((64, WINDOW_K))
        c_shape = thr_mma.partition_shape_C((64, n_tile))
        frag0 = cute.make_rmem_tensor(a_shape, cutlass.Float8E4M3FN)
        frag1 = cute.make_rmem_tensor(a_shape, cutlass.Float8E4M3FN)
        fw0 = cute.recast_tensor(frag0, Int32)
        fw1 = cute.recast_tensor(frag1, Int32)
        accw0 = cute.make_rmem_tensor(c_shape, Float32)
        accw1 = cute.make_rmem_tensor(c_shape, Float32)
        acc0 = cute.make_rmem_tensor(c_shape, Float32)
        acc1 = cute.make_rmem_tensor(c_shape, Float32)
        abuf = cute.make_rmem_tensor((4, 2, 2, depth), Int32)
        sbuf = cute.make_rmem_tensor((2, 2, depth), Int32)
        rs = cute.make_rmem_tensor((2, 2), Float32)
        srow0 = 128 * wg + 16 * wwarp + g
        bases = (
            wq1.iterator.toint(),
            ws1.iterator.toint(),
            wq2.iterator.toint(),
            ws2.iterator.toint(),
            st.sW.data_ptr().toint(),
            st.sS.data_ptr().toint(),
        )
        acts = (tma_atom1, tma_x, tma_atom2, tma_h, sB)

        trace = sig[7]  # (experiment: per-unit globaltimer stamps, int32 [C, 64]; 0: none)
        cta, _, _ = cute.arch.block_idx()
        if trace != 0 and tidx == 0:
            st_u32(trace + Int64(cta * 64) * 4, Int32(cute.arch.globaltimer() & 0x7FFFFFFF))
        cons = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
        prev = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
        # the producer (warp 0): loads issued, its unit (a count of units from the CTA's first) and window in it,
        # whether that unit's rows are known to be there; the consumers: windows released, their unit
        issued = Int32(0)
        pu = Int32(0)
        pw = Int32(0)
        pready = Int32(0)
        # (the producer's unit's windows, mode, first window record and first row, in registers)
        pn, pm, prec, prow0 = sq[F_NW, 0], sq[F_MODE, 0], sq[F_REC, 0], sq[F_ROW, 0] + sq[F_NT, 0] * n_tile
        released = Int32(0)
        cu = Int32(0)
        last = Int32(0)  # (warp 0: the last unit claimed)
        raw = Int32(0)  # (warp 0, lane 0: the next unit's claim in flight)
        running = Int32(1)
        while running != 0:
            cur = cu % 2
            if warp_idx == 0:
                # fill the stages from this unit; if nothing of it could be issued, its rows must come first (bounded)
                issued, pu, pw, pready, pn, pm, prec, prow0 = self.produce(
                    pipe,
                    sq,
                    cu,
                    cu,
                    released,
                    issued,
                    pu,
                    pw,
                    pready,
                    pn,
                    pm,
                    prec,
                    prow0,
                    bases,
                    acts,
                    sig1,
                    gen,
                    lane,
                )
                if pu == cu and pready != 1 and pm != NONE:
                    pready = self.rows_ready(sq, cur, sig1, gen, timeout_ns, lane, Int32(1))
                    if pready == 0:
                        if lane == 0:
                            sflag[S_STOP] = Int32(1)
                    else:
                        issued, pu, pw, pready, pn, pm, prec, prow0 = self.produce(
                            pipe,
                            sq,
                            cu,
                            cu,
                            released,
                            issued,
                            pu,
                            pw,
                            pready,
                            pn,
                            pm,
                            prec,
                            prow0,
                            bases,
                            acts,
                            sig1,
                            gen,
                            lane,
                        )
            cute.arch.barrier()  # (also orders warp 0's writes of this unit's slot before the reads below)
            mode, e, nt, mt, nw = sq[F_MODE, cur], sq[F_E, cur], sq[F_NT, cur], sq[F_MT, cur], sq[F_NW, cur]
            prow, pcount = sq[F_ROW, cur], sq[F_CNT, cur]
            if sflag[S_STOP] != 0 or mode == NONE:
                running = Int32(0)  # (after a failed wait nothing of this unit was issued: no load left in flight)
            else:
                if warp_idx == 0:  # the next unit's claim, read (into the other slot) at this unit's second window
                    raw = self.claim_take(queue, units, ok, lane)
                    last = cu
                if trace != 0 and tidx == 0 and cu < 15:
                    at = trace + Int64(cta * 64 + 4 + 4 * cu) * 4
                    st_u32(at, mode * 1000 + e)
                    st_u32(at + 4, Int32(cute.arch.globaltimer() & 0x7FFFFFFF))
                col_base = nt * n_tile
                acc0.fill(0.0)
                acc1.fill(0.0)
                # the unit's activation scales of every window into shared memory once (the previous unit's
                # readers are past the barrier above)
                for r in cutlass.range_constexpr(-(-self.windows * n_tile // self.g1.threads)):
                    i = tidx + self.g1.threads * r
                    if i < nw * n_tile:
                        wi = i // n_tile
                        c = i - wi * n_tile
                        v = Float32(0.0)
                        if col_base + c < pcount:
                            if mode == W1:
                                v = sxT[wi, prow + col_base + c]
                            else:
                                v = hsT[wi, prow + col_base + c]
                        ssx[wi, c] = v
                cute.arch.barrier()
                for w0 in cutlass.range(0, nw, depth, unroll=1):
                    for j in cutlass.range_constexpr(depth):
                        w = w0 + j
                        warpgroup.wait_group(0)
                        if w > 0:
                            pipe.consumer_release(prev)
                            released += 1
                            if warp_idx == 0:
                                if w == 1:  # (the previous unit's fields in that slot are in registers)
                                    self.claim(sq, stab, table, 1 - cur, raw, u1, units, cnt, offs, num_experts, lane)
                                    last = cu + 1
                                issued, pu, pw, pready, pn, pm, prec, prow0 = self.produce(
                                    pipe,
                                    sq,
                                    cu,
                                    last,
                                    released,
                                    issued,
                                    pu,
                                    pw,
                                    pready,
                                    pn,
                                    pm,
                                    prec,
                                    prow0,
                                    bases,
                                    acts,
                                    sig1,
                                    gen,
                                    lane,
                                )
                            self.g1.promote(acc0, accw0, rs, ssx, w - 1, t0, 0)
                            if cutlass.const_expr(self.g1.subs == 2):
                                self.g1.promote(acc1, accw1, rs, ssx, w - 1, t0, 1)
                        pipe.consumer_wait(cons)
                        self.g1.load_window_smem(sW, sS, abuf, sbuf, cons.index, wg, sb, tw, srow0, j)
                        self.g1.decode_subtile(abuf, sbuf, slut, fw0, rs, j, 0)
                        if cutlass.const_expr(self.g1.subs == 2 and not self.cfg.overlap):
                            self.g1.decode_subtile(abuf, sbuf, slut, fw1, rs, j, 1)
                        warpgroup.fence()
                        self.g1.mma_window(tiled_mma, accw0, frag0, tCrB, cons.index)
                        if cutlass.const_expr(self.g1.subs == 2):
                            if cutlass.const_expr(self.cfg.overlap):
                                warpgroup.commit_group()
                                self.g1.decode_subtile(abuf, sbuf, slut, fw1, rs, j, 1)
                                warpgroup.fence()
                            self.g1.mma_window(tiled_mma, accw1, frag1, tCrB, cons.index)
                        warpgroup.commit_group()
                        prev = cons.clone()
                        cons.advance()
                warpgroup.wait_group(0)
                pipe.consumer_release(prev)
                released += 1
                if warp_idx == 0:
                    if last == cu:  # (a unit of one window)
                        self.claim(sq, stab, table, 1 - cur, raw, u1, units, cnt, offs, num_experts, lane)
                        last = cu + 1
                    issued, pu, pw, pready, pn, pm, prec, prow0 = self.produce(
                        pipe,
                        sq,
                        cu,
                        last,
                        released,
                        issued,
                        pu,
                        pw,
                        pready,
                        pn,
                        pm,
                        prec,
                        prow0,
                        bases,
                        acts,
                        sig1,
                        gen,
                        lane,
                    )
                self.g1.promote(acc0, accw0, rs, ssx, nw - 1, t0, 0)
                if cutlass.const_expr(self.g1.subs == 2):
                    self.g1.promote(acc1, accw1, rs, ssx, nw - 1, t0, 1)
                if trace != 0 and tidx == 0 and cu < 15:
                    st_u32(trace + Int64(cta * 64 + 4 + 4 * cu + 2) * 4, Int32(cute.arch.globaltimer() & 0x7FFFFFFF))
                if mode == W1:
                    self.g1.epilogue_w1(
                        acc0,
                        acc1,
                        sred,
                        rw,
                        hq,
                        hs_out,
                        mt,
                        wg,
                        sb,
                        wwarp,
                        g,
                        t0,
                        prow + col_base,
                        pcount - col_base,
                        e,
                        sig1,
                    )
                    # this (N tile, M tile) counts once in W1_DONE[e] (kernel_grouped.release_expert), by warp 1:
                    # warp 0 goes on to the next unit's loads
                    if tidx == 32:
                        sflag[2] = e
                        sflag[3] = pcount
                        sflag[4] = Int32(sig1[5] & 0xFFFFFFFF)
                        sflag[5] = Int32(sig1[5] >> 32)
                        sflag[6] = (pcount + n_tile - 1) // n_tile * self.g1.m_tiles
                    self.g1.release_expert(sig1, sflag, tidx, 32)
                else:
                    valid = pcount - col_base
                    if ld_u32(sig2[3]) != 0:  # a wait of this call failed: store nothing
                        valid = Int32(0)
                    self.g2.epilogue_w2(
                        acc0, acc1, dst, src, comb, mt, wg, sb, wwarp, g, t0, prow + col_base, valid, e, sig2
                    )
                if trace != 0 and tidx == 0 and cu < 15:
                    st_u32(trace + Int64(cta * 64 + 4 + 4 * cu + 3) * 4, Int32(cute.arch.globaltimer() & 0x7FFFFFFF))
                cu += 1
        if trace != 0 and tidx == 0:
            st_u32(trace + Int64(cta * 64 + 1) * 4, cu)
            st_u32(trace + Int64(cta * 64 + 2) * 4, Int32(cute.arch.globaltimer() & 0x7FFFFFFF))
        # the last CTA of the call out resets the queue words for the next launch
        if tidx == 0 and ok != 0:
            if atom_add_u32(queue + 4, 1, "acq_rel", "gpu") == cute.arch.grid_dim()[0] - 1:
                st_u32(queue, 0)
                st_u32(queue + 4, 0)

    @cute.jit
    def fill_tables(self, stab: cute.Tensor, cnt: cute.Tensor, offs: cute.Tensor, num_experts: Int32, lane: Int32):
        """One warp: the expert tables (N tiles before each expert, its first row, its rows) for E <= TABLE_EXPERTS."""
        before = Int32(0)
        if lane == 0:
            stab[T_PRE] = Int32(0)
        for base in cutlass.range_constexpr(0, TABLE_EXPERTS, 32):
            e = base + lane
            c = Int32(0)
            if e < num_experts:
                c = cnt[e]
                stab[T_OFFS + e] = offs[e]
                stab[T_CNT + e] = c
            incl = (c + self.g1.n - 1) // self.g1.n
            for d in cutlass.range_constexpr(5):
                up = cute.arch.shuffle_sync_up(incl, 1 << d)
                if lane >= (1 << d):
                    incl = incl + up
            if e < num_experts:
                stab[T_PRE + e + 1] = before + incl
            before = before + cute.arch.shuffle_sync(incl, 31)

    @cute.jit
    def claim_take(self, queue: Int64, units: Int32, ok: Int32, lane: Int32) -> Int32:
        """Warp 0: lane 0's claim of the next unit (the atomic's result is read later, by claim: its latency overlaps
        the loads issued meanwhile); a call that did not acquire claims none."""
        raw = units
        if lane == 0 and ok != 0:
            raw = atom_add_u32(queue, 1, "relaxed", "gpu")
        return raw

    @cute.jit
    def claim(
        self,
        sq: cute.Tensor,
        stab: cute.Tensor,
        table: cutlass.Boolean,
        slot: Int32,
        raw: Int32,
        u1: Int32,
        units: Int32,
        cnt: cute.Tensor,
        offs: cute.Tensor,
        num_experts: Int32,
        lane: Int32,
    ):
        """Warp 0: write the unit lane 0 claimed (raw, from claim_take) into `slot`: mode, expert, N tile, M tile, its
        windows and first window record, the expert's first row and rows (from the expert tables where there are
        few experts, else from global memory)."""
        u = cute.arch.shuffle_sync(raw, 0)
        mode = Int32(NONE)
        e = Int32(0)
        nt = Int32(0)
        mt = Int32(0)
        nw = Int32(0)
        rec = Int32(0)
        if u < units:
            v = u
            mode = Int32(W1)
            m_tiles = Int32(self.g1.m_tiles)
            windows = Int32(self.g1.windows)
            if u >= u1:
                v = u - u1
                mode = Int32(W2)
                m_tiles = Int32(self.g2.m_tiles)
                windows = Int32(self.g2.windows)
            if table:
                # the expert whose tiles hold unit v: pre[e] * MT <= v < pre[e + 1] * MT (lanes e and e + 32)
                for base in cutlass.range_constexpr(0, TABLE_EXPERTS, 32):
                    x = base + lane
                    hit = cutlass.Boolean(False)
                    if x < num_experts:
                        hit = (stab[T_PRE + x] * m_tiles <= v) & (v < stab[T_PRE + x + 1] * m_tiles)
                    found = cute.arch.vote_ballot_sync(hit)
                    if found != 0:
                        e = base + 31 - Int32(cute.arch.clz(found))
                off = v - stab[T_PRE + e] * m_tiles
                nt = off // m_tiles
                mt = off - nt * m_tiles
            elif u < u1:
                e, nt, mt, _ = self.g1.locate_tile(cnt, v, num_experts, lane)
            else:
                e, nt, mt, _ = self.g2.locate_tile(cnt, v, num_experts, lane)
            nw = windows
            rec = (e * m_tiles + mt) * windows
        if lane == 0:
            sq[F_MODE, slot] = mode
            sq[F_E, slot] = e
            sq[F_NT, slot] = nt
            sq[F_MT, slot] = mt
            sq[F_NW, slot] = nw
            sq[F_REC, slot] = rec
            if mode != NONE:
                if table:
                    sq[F_ROW, slot] = stab[T_OFFS + e]
                    sq[F_CNT, slot] = stab[T_CNT + e]
                else:
                    sq[F_ROW, slot] = offs[e]
                    sq[F_CNT, slot] = cnt[e]
        cute.arch.sync_warp()

    @cute.jit
    def produce(
        self,
        pipe: pipeline.PipelineTmaAsync,
        sq: cute.Tensor,
        cu: Int32,
        last: Int32,
        released: Int32,
        issued: Int32,
        pu: Int32,
        pw: Int32,
        pready: Int32,
        pn: Int32,
        pm: Int32,
        prec: Int32,
        prow0: Int32,
        bases: tuple,
        acts: tuple,
        sig: tuple,
        gen: Int32,
        lane: Int32,
    ):
        """Warp 0: issue loads while a stage is free (`released` windows released: `stages` more may be in flight),
        moving on to the next unit once one's windows are all issued, up to unit `last` (the last claimed; cu is the
        consumers'), never into a unit whose rows are not known to be there: rows_ready without waiting, asked on
        entering the unit and, if they were not there, again only for the consumers' unit or once the pipeline is
        nearly dry (each look costs warp 0 a global round trip, which holds up its warpgroup's MMAs). The producer's
        state: loads issued, its unit and window in it, ready (0 not asked yet, 1 there, 2 not there when last
        asked), and the unit's windows, mode, first window record and first row; returned updated."""
        stages = self.g1.stages
        go = Int32(1)
        while go != 0:
            if issued >= released + stages:
                go = Int32(0)
            else:
                if pw == pn:
                    if pu < last:  # the next unit is claimed: move on (its fields into registers)
                        pu = pu + 1
                        pw = Int32(0)
                        pready = Int32(0)
                        slot = pu % 2
                        pn, pm, prec = sq[F_NW, slot], sq[F_MODE, slot], sq[F_REC, slot]
                        prow0 = sq[F_ROW, slot] + sq[F_NT, slot] * self.g1.n
                    else:
                        go = Int32(0)
                if go != 0:
                    if pm == NONE:
                        go = Int32(0)
                    elif pready != 1:
                        if pready == 0 or pu == cu or issued - released <= 2:
                            pready = 2 - self.rows_ready(sq, pu % 2, sig, gen, Int64(0), lane, Int32(0))
                        if pready != 1:
                            go = Int32(0)
                if go != 0:
                    state = pipeline.PipelineState(stages, issued, issued % stages, 1 ^ ((issued // stages) % 2))
                    self.issue(pipe, state, pm, prec + pw, prow0, pw, bases, acts)
                    pw = pw + 1
                    issued = issued + 1
        return issued, pu, pw, pready, pn, pm, prec, prow0

    @cute.jit
    def issue(
        self,
        pipe: pipeline.PipelineTmaAsync,
        state: pipeline.PipelineState,
        mode: Int32,
        rec: Int32,
        row0: Int32,
        w: Int32,
        bases: tuple,
        acts: tuple,
    ):
        """Warp 0: window w (window record rec) of a unit of `mode` whose N tile starts at row0 into the stage of
        `state`: weights and scale records (of W1 or W2), then the activation box (from x or from W1's FP8 rows)."""
        wq1, ws1, wq2, ws2, w_dst, s_dst = bases
        tma_atom1, tma_x, tma_atom2, tma_h, sB = acts
        if mode == W1:
            self.g1.produce_weights(pipe, state, rec, wq1, ws1, w_dst, s_dst)
            self.g1.produce_acts(pipe, state, tma_atom1, tma_x, sB, row0, w)
        else:
            self.g2.produce_weights(pipe, state, rec, wq2, ws2, w_dst, s_dst)
            self.g2.produce_acts(pipe, state, tma_atom2, tma_h, sB, row0, w)

    @cute.jit
    def rows_ready(
        self, sq: cute.Tensor, slot: Int32, sig: tuple, gen: Int32, timeout_ns: Int64, lane: Int32, wait: Int32
    ) -> Int32:
        """Warp 0: are the unit's activation rows there? W1: the L1_FULL tags (== g) of the ring blocks under its N
        tile (dispatch pulled them); W2: its expert's W1_DONE tag (every W1 tile of it stored). wait = 0: look once;
        1: wait, bounded by timeout_ns (ended early by a non-zero ERR), a failure recorded in ERR. 1 when they are
        (the async proxy then ordered after the acquire, for the TMA reads), else 0."""
        bm = self.cfg.ring_bm
        e, n = sq[F_E, slot], self.g1.n
        first_row = sq[F_ROW, slot] + sq[F_NT, slot] * n
        rows = cutlass.min(n, sq[F_CNT, slot] - sq[F_NT, slot] * n)
        b0 = first_row // bm
        nb = (first_row + rows - 1) // bm - b0 + 1
        addr = sig[5] + Int64(2 * e + 1) * 4  # W2: W1_DONE[e]'s tag
        active = lane == 0
        if sq[F_MODE, slot] == W1:
            addr = sig[4] + Int64(b0 + lane) * 4  # L1_FULL of block b0 + lane
            active = lane < nb
        bad = Int32(0)
        if active:
            if wait != 0:
                seen = wait_until_eq(addr, gen, timeout_ns, "gpu", sig[3])
                if seen != gen:
                    bad = Int32(1)
                    if sq[F_MODE, slot] == W1:
                        record_error(sig[3], KIND_BLOCK, b0 + lane, gen, seen)
                    else:
                        record_error(sig[3], KIND_W1, e, gen, seen)
            elif ld_acquire_u32(addr, "gpu") != gen:
                bad = Int32(1)
        ready = Int32(1)
        if cute.arch.vote_ballot_sync(bad != 0) != 0:
            ready = Int32(0)
        else:
            cute.arch.fence_proxy("async.global")
        return ready


def fake_fused_operands(hidden: int, inter: int):
    """The fused kernel's tensor operands as fakes (see FusedGemmSm90.__call__'s order)."""
    f1 = fake_operands("w1", 2 * inter, hidden)
    f2 = fake_operands("w2", hidden, inter)
    return f1[:4] + f2[:4] + f1[4:7] + f1[7:10] + f2[7:10]


@cache
def compiled_fused(hidden: int, inter: int, cfg: Sm90Config, arch: str = "sm_90a"):
    """Compile the fused launch against fake tensors (dynamic expert and row counts); refuses a shape either GEMM
    cannot run with this config."""
    for m, k in ((2 * inter, hidden), (hidden, inter)):
        why = can_implement(m, k, 1, cfg)
        if why:
            raise ValueError(f"sm90 fused: {why}")
    kern = FusedGemmSm90(hidden, inter, cfg)
    sig = tuple(Int64(0) for _ in range(fused_sig_words(cfg)))
    return compile_kernel(
        kern,
        *fake_fused_operands(hidden, inter),
        sig,
        Int32(1),
        Int64(0),
        Int32(1),
        Int32(1),
        crt.make_fake_stream(),
        arch=arch,
        name=f"fused_h{hidden}_i{inter}_n{cfg.n_tile}{'_clamp' if cfg.activation == 'swiglu_clamped' else ''}"
        f"{'_bias' if cfg.bias else ''}{'_ef' if cfg.evict_first else ''}",
    )
