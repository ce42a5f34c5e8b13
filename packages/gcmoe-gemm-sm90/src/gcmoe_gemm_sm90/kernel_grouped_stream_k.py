"""The stream_k schedule of the sm90 grouped W1 (cfg.stream_k; what the schedules share: kernel_grouped_common): one
CTA per SM slot over equal ranges of all active tiles' K windows, so every SM streams the same bytes whatever the tile
count.

    grid [ctas] (one per SM slot: occupancy x SMs), no cluster; tiles: every expert with rows (ascending), its N tiles,
    its M tiles (locate_tile), each in nw / prefetch units of `prefetch` windows, in order; CTA c runs units
    [c U / ctas, (c + 1) U / ctas) of the U units:
        for each tile a its range touches (a piece; the first SK_TABLE tiles' coordinates kept in shared memory):
            acc = the piece's windows of tile a                              (kernel_grouped_common: mainloop)
            a part of the tile's windows: store acc (fp32, scratch sig[6], the CTA's slot), count the arrival on
            the counter of the tile's last CTA (sig[7], acq_rel); the last to arrive adds every piece in CTA order
            (deterministic: the same sum whichever arrives last) and runs the epilogue (reduce_pieces)
        with expert_sync each (N tile, M tile) counts once in W1_DONE

Where it is chosen: config.choose_config. Each piece's row scales are its own tile's (loaded per piece, not once per
CTA). W1 only, unsplit (splits[0] = 1), whole tiles.
"""

# No `from __future__ import annotations` in kernel files: the DSL reads the annotations as live objects.
from gcmoe_core.device_ops import atom_add_u32, fence_gpu, ld_relaxed_u32, st_u32
from gcmoe_core.kernel_helpers import bits_to_f32, f32_to_bits

from .kernel_grouped_common import F32_INV_POW2, SK_TABLE, GroupedGemmSm90Base, Int32, cpasync, cute, cutlass, pipeline


class GroupedGemmStreamKSm90(GroupedGemmSm90Base):
    """W1 over equal window ranges of every active tile, one CTA per SM slot; tiles split between CTAs finished by
    their last arriver."""

    schedule = "stream_k"

    def launch_grid(self, ctas: Int32) -> list:
        return [ctas, 1, 1]

    def launch_cluster(self) -> list | None:
        return None

    @cute.jit
    def body(
        self,
        args: tuple,
        first: Int32,
        tiled_mma: cute.TiledMma,
        b_smem_staged: cute.ComposedLayout,
        mt: Int32,
        ey: Int32,
        rows: Int32,
        ks: Int32,
        st,
    ):
        """The CTA's work: CTA mt of the grid's, on the shared memory struct st; args: the kernel's operands wq ..
        num_experts. Returns 0 (the kernel's loop over grid rows runs once)."""
        wq, ws, tma_atom, tma_x, sxT, offs, cnt, lut, ep_a, ep_b, ep_c, sig, ticket, timeout_ns, num_experts = args
        n_tile, depth = self.n, self.prefetch
        nw = self.nwk  # the tile's windows
        tidx, _, _ = cute.arch.thread_idx()
        w_lo = ks * nw
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        mt, wg, sb, wg_stage, half_at, crank = self.cta_rows(tidx, mt, ks)
        tw = tidx % 128
        lane = tidx % 32
        g = lane // 4
        t0 = lane % 4
        wwarp = tw // 32  # warp within the warpgroup
        slut, lut_at, srs, sunit, _, sflag, sred, ssx, srw, xchg, sB, skt = self.shared_views(st, b_smem_staged)

        if cutlass.const_expr(not self.cfg.ring):
            cute.arch.griddepcontrol_wait()  # (W1's rows, scales and counts may come from the kernel before it)
        ok, gen = self.acquire_ring(sig, ticket, timeout_ns, sflag, tidx, crank)
        # the CTA's units [u0, u1) of `units` (depth windows each), its loads and its pieces
        e = Int32(0)
        count = Int32(0)
        row_base = Int32(0)
        npieces = Int32(0)
        _, _, _, tiles = self.locate_tile(cnt, Int32(-1), num_experts, lane)
        if ok == 0:
            tiles = Int32(0)
        units = tiles * (nw // depth)
        ctas = cute.arch.grid_dim()[0]
        u0 = mt * units // ctas  # (block index x = the CTA's index)
        u1 = (mt + 1) * units // ctas
        total = (u1 - u0) * depth
        if u1 > u0:
            npieces = (u1 - 1) // (nw // depth) - u0 // (nw // depth) + 1
        # the table of the CTA's first tiles (each warp locates them, thread 0 writes; read after the pipeline's
        # barrier): what the loads and pieces of those tiles read instead of locating them again
        for p in cutlass.range(cutlass.min(npieces, SK_TABLE), unroll=1):
            pe, pnt, pmt, _ = self.locate_tile(cnt, u0 // (nw // depth) + p, num_experts, lane)
            if tidx == 0:
                skt[0, p] = pe * self.m_tiles + pmt
                skt[1, p] = offs[pe] + pnt * n_tile
                skt[2, p] = pe
                skt[3, p] = pnt
                skt[4, p] = pmt
        # W2 may launch once every W1 CTA has read the row layout (see kernel_grouped_common: PDL)
        cute.arch.griddepcontrol_launch_dependents()
        if cutlass.const_expr(self.expert_sync):
            self.keep_release_words(sflag, sig, e, count, ks, tidx)  # (the expert and count: per tile, below)

        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_atom)
        self.copy_lut(slut, lut, tidx)
        pipe = self.start_pipeline(st, b_smem_staged)

        sW, sS, tCrB, frag0, frag1, fw0, fw1, accw0, accw1, acc0, acc1, abuf, sbuf = self.mma_operands(
            st, tiled_mma, sB, tw
        )
        swrd0 = 64 * wg_stage + 8 * wwarp + g  # the stage's record word of r0, r0 + 8 in subtile 0 (subtile s: + 32)
        trow0 = 128 * wg + 64 * sb + 16 * wwarp + g  # the tile's row r0 in subtile 0 (subtile s adds 64, row u 8)
        w_base, s_base, w_dst, s_dst = self.stage_addresses(wq, ws, st, half_at)
        lc = (u0, num_experts, skt)  # what load_coords needs
        stream = (pipe, cnt, offs, lc, w_base, s_base, w_dst, s_dst, tma_atom, tma_x, sB)
        compute = (tiled_mma, tCrB, sW, sS, abuf, sbuf, lut_at, frag0, frag1, fw0, fw1, accw0, accw1, acc0, acc1, ssx)
        compute += (wg_stage, sb, tw, swrd0, t0)

        prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        cons = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        prev = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        issued = Int32(0)
        self.load_first_weights(stream, prod, total, warp_idx, lane)
        if cutlass.const_expr(self.cfg.ring):
            for p in cutlass.range(npieces, unroll=1):  # every expert the CTA's pieces read
                pe, _, _, _, _, _ = self.work_piece(cnt, p, e, mt, u0, u1, num_experts, lane, skt)
                self.acquire_blocks(sig, gen, timeout_ns, offs[pe], cnt[pe], tidx)
        issued, prod = self.load_first_acts(stream, prod, issued, total, warp_idx, lane)

        for piece in cutlass.range(npieces, unroll=1):
            pe, pmt, pnt, wa, wb, pa = self.work_piece(cnt, piece, e, mt, u0, u1, num_experts, lane, skt)
            prow = offs[pe]
            pcount = cnt[pe]
            acc0.fill(0.0)
            acc1.fill(0.0)
            col_base = pnt * n_tile
            sxv, rwt = self.load_piece_scales(sxT, ep_a, tidx, w_lo, prow, col_base, pcount)
            # the piece's tile's row scales (each piece its own tile's), divided by the piece's t below
            rsp = self.load_row_scale(ws, pe * self.m_tiles + pmt, half_at, tidx)
            self.warp_reduce_bits(rsp, True, sunit, warp_idx, lane)
            tb = self.piece_unit_bits(sxv, sunit, warp_idx, lane)
            if tidx < self.rows:
                rs = bits_to_f32(rsp)
                srs[tidx] = rs * bits_to_f32(F32_INV_POW2 - tb)
            self.stage_piece_scales(ssx, srw, sxv, rwt, tb, tidx)
            issued, prev, prod, cons = self.mainloop(
                stream, compute, wa, wb, prod, cons, prev, issued, total, warp_idx, lane
            )
            # (read once the window accumulators are dead: read before the last promote, ptxas spilled at N 80)
            self.scale_rows(acc0, srs, trow0 - half_at * self.rows)
            if cutlass.const_expr(self.subs == 2):
                self.scale_rows(acc1, srs, trow0 - half_at * self.rows + 64)
            finish = Int32(0)
            if ks == 0:
                finish = Int32(1)
            if wb - wa < nw:  # a part of the tile's windows: the tile's last piece to arrive finishes it
                finish = self.reduce_pieces(acc0, acc1, accw0, accw1, sig, sflag, pa, mt, u0, units, tidx)
            if finish != 0:
                self.epilogue_w1(
                    acc0,
                    acc1,
                    sred,
                    srw,
                    xchg,
                    piece % 2,
                    ep_b,
                    ep_c,
                    pmt,
                    wg,
                    sb,
                    wwarp,
                    g,
                    t0,
                    prow + col_base,
                    pcount - col_base,
                    pe,
                    sig,
                )
                if cutlass.const_expr(self.expert_sync):
                    # every (N tile, M tile) of the expert counts once in W1_DONE
                    if tidx == 0:
                        sflag[2] = pe
                        sflag[3] = pcount
                        sflag[6] = (pcount + n_tile - 1) // n_tile * self.m_tiles
                    self.release_expert(sig, sflag, tidx)
        return Int32(0)

    @cute.jit
    def load_coords(self, cnt: cute.Tensor, offs: cute.Tensor, lc: tuple, it: Int32, lane: Int32):
        """Load `it` of this CTA: (tile = expert x M tiles + M tile, first activation row, window), continuing the
        global window order from the CTA's first unit (tile-major: locate_tile). lc = (u0, experts, tile table)."""
        u0, num_experts, skt = lc
        nw = self.nwk
        tile = Int32(0)
        row0 = Int32(0)
        v = u0 * self.prefetch + it
        a = v // nw
        w = v - a * nw
        p = a - u0 // (nw // self.prefetch)  # the CTA's piece of this load
        if p < SK_TABLE:
            tile = skt[0, p]
            row0 = skt[1, p]
        else:
            pe, pnt, pmt, _ = self.locate_tile(cnt, a, num_experts, lane)
            tile = pe * self.m_tiles + pmt
            row0 = offs[pe] + pnt * self.n
        return tile, row0, w

    @cute.jit
    def work_piece(
        self,
        cnt: cute.Tensor,
        piece: Int32,
        e: Int32,
        mt: Int32,
        u0: Int32,
        u1: Int32,
        num_experts: Int32,
        lane: Int32,
        skt: cute.Tensor,
    ):
        """Piece `piece` of this CTA's work: (expert, M tile, N tile, first window, end window, tile index): the CTA's
        windows of tile u0 // units-per-tile + piece (its units [u0, u1) of `prefetch` windows each)."""
        pe, pmt, pnt = e, mt, piece
        nwu = self.windows // self.prefetch
        a = u0 // nwu + piece
        if piece < SK_TABLE:
            pe, pnt, pmt = skt[2, piece], skt[3, piece], skt[4, piece]
        else:
            pe, pnt, pmt, _ = self.locate_tile(cnt, a, num_experts, lane)
        wa = (cutlass.max(u0, a * nwu) - a * nwu) * self.prefetch
        wb = (cutlass.min(u1, (a + 1) * nwu) - a * nwu) * self.prefetch
        return pe, pmt, pnt, wa, wb, a

    @cute.jit
    def locate_tile(self, cnt: cute.Tensor, a: Int32, num_experts: Int32, lane: Int32):
        """stream_k's tile order: experts ascending, each expert's N tiles (ceil(count / N)) ascending, each N tile's
        M tiles ascending. Returns (expert, N tile, M tile) of tile a (expert -1 past the end) and the number of
        tiles. Every warp computes it on its own: a prefix sum over the counts of 32 experts per step."""
        found = Int32(-1)
        nt = Int32(0)
        mt = Int32(0)
        before = Int32(0)  # tiles of the experts before this step's 32
        for base in cutlass.range(0, num_experts, 32, unroll=1):
            c = Int32(0)
            if base + lane < num_experts:
                c = cnt[base + lane]
            t = (c + self.n - 1) // self.n * self.m_tiles
            incl = t
            for d in cutlass.range_constexpr(5):
                up = cute.arch.shuffle_sync_up(incl, 1 << d)
                if lane >= (1 << d):
                    incl = incl + up
            start = before + incl - t
            hit = cute.arch.vote_ballot_sync((t > 0) & (start <= a) & (a < start + t))
            if hit != 0:
                src = 31 - Int32(cute.arch.clz(hit))
                off = a - cute.arch.shuffle_sync(start, src)
                found = base + src
                nt = off // self.m_tiles
                mt = off - nt * self.m_tiles
            before = before + cute.arch.shuffle_sync(incl, 31)
        return found, nt, mt, before

    @cute.jit
    def reduce_pieces(
        self,
        acc0: cute.Tensor,
        acc1: cute.Tensor,
        res0: cute.Tensor,
        res1: cute.Tensor,
        sig: tuple,
        sflag: cute.Tensor,
        a: Int32,
        c: Int32,
        u0: Int32,
        units: Int32,
        tidx: Int32,
    ) -> Int32:
        """stream_k: this CTA computed some of tile a's windows. Store the partial accumulators into the CTA's slot
        (2 c, or 2 c + 1 for a tile that started before the CTA's range) of the partials buffer (sig[6]), count the
        arrival on the counter of the tile's last CTA (sig[7], acq_rel); the last to arrive resets the counter, adds
        every piece's partials in CTA order (deterministic: the same sum whichever arrives last) into acc and
        returns 1 (it finishes the tile); the others return 0."""
        nwu = self.windows // self.prefetch
        ctas = cute.arch.grid_dim()[0]
        first = ((a * nwu + 1) * ctas - 1) // units  # the CTA owning the tile's first unit
        last = ((a + 1) * nwu * ctas - 1) // units  # ... and its last (CTAs between may own no unit: fewer units
        # than CTAs)
        accs = (acc0, acc1)[: self.subs]
        ress = (res0, res1)[: self.subs]
        nacc = cute.size(acc0)
        stride = self.subs * nacc * self.threads  # floats per slot
        slot = 2 * c
        if u0 < a * nwu:
            slot = slot + 1
        for s, acc in enumerate(accs):
            for i in cutlass.range_constexpr(nacc):
                at = sig[6] + cutlass.Int64(slot * stride + (s * nacc + i) * self.threads + tidx) * 4
                st_u32(at, f32_to_bits(acc[i]))
        cute.arch.barrier()
        if tidx == 0:
            fence_gpu()  # the CTA's partials (ordered by the barrier) before the arrival
            counter = sig[7] + cutlass.Int64(last) * 4
            done = Int32(0)
            pieces = Int32(0)
            for c2 in cutlass.range(first, last + 1, unroll=1):
                if (c2 + 1) * units // ctas > c2 * units // ctas:
                    pieces = pieces + 1
            if atom_add_u32(counter, 1, "acq_rel", "gpu") == pieces - 1:
                st_u32(counter, 0)  # the next launch counts from 0 again
                done = Int32(1)
            sflag[7] = done
        cute.arch.barrier()
        done = sflag[7]
        if done != 0:
            for res in ress:
                res.fill(0.0)
            for c2 in cutlass.range(first, last + 1, unroll=1):
                start = c2 * units // ctas
                if (c2 + 1) * units // ctas > start:  # a CTA with units: one piece of the tile
                    slot2 = 2 * c2
                    if start < a * nwu:
                        slot2 = slot2 + 1
                    for s, acc in enumerate(accs):
                        for i in cutlass.range_constexpr(nacc):
                            v = acc[i]
                            if c2 != c:
                                at = sig[6] + cutlass.Int64(slot2 * stride + (s * nacc + i) * self.threads + tidx) * 4
                                v = bits_to_f32(ld_relaxed_u32(at, "gpu"))
                            ress[s][i] = ress[s][i] + v
            for s, acc in enumerate(accs):
                for i in cutlass.range_constexpr(nacc):
                    acc[i] = ress[s][i]
        return done
