"""The whole-tile schedule of the sm90 grouped GEMMs (what the schedules share: kernel_grouped_common): a CTA computes
all 256 rows of an M tile, for every N tile of one expert, optionally with its K windows split over a cluster.

    grid [M tiles, rows R, K splits S], cluster [1, 1, S]; CTA (mt, y, ks):
        for the expert e of grid row y (then y + R, y + 2 R, ... while experts with rows remain):
            for each N tile nt of e's rows:
                acc = windows [ks nw / S, (ks + 1) nw / S) of tile (e, mt, nt)      (kernel_grouped_common: mainloop)
                K splits: CTAs ks > 0 push acc into the leader's shared memory (st.shared::cluster), one cluster
                          barrier, the leader adds them in split order (deterministic) and runs the epilogue

Grid: with cfg.active_first, grid row y runs the y-th expert that has rows (a ballot over cnt in every warp), so the
CTAs of empty experts launch after every CTA with work (config.ACTIVE_FIRST_BELOW); else row y runs expert y. Rows R
(the `ctas` argument): E, or with active_first any number: a CTA of grid row y runs rows y, y + R, ... below the count
of experts with rows (the stages' mbarriers re-armed between rows), so every expert with rows runs whatever R is. The
layer passes its expected bound (gcmoe's sm90 backend, grid_rows), so the CTAs of empty experts never launch:
otherwise, where K-split W1 clusters fill the SM slots, they queue to the end of W1 and hold back W2's programmatic
launch. first (rotation): grid row y runs expert first + y (mod E), active-first rows counting in that order, so the
experts the caller expects to take longest launch first: the layer's shared experts (more N tiles than any routed
expert from T = 16 on), whose extra passes would otherwise run after every other CTA has finished.
"""

# No `from __future__ import annotations` in kernel files: the DSL reads the annotations as live objects.
from gcmoe_core.device_ops import ld_u32
from gcmoe_core.kernel_helpers import F32_ONE, bits_to_f32, st_cluster_f32

from .kernel_grouped_common import F32_INV_POW2, GroupedGemmSm90Base, Int32, cpasync, cute, cutlass, pipeline


class GroupedGemmSm90(GroupedGemmSm90Base):
    """Whole 256-row tiles, one grid row per expert with rows, K splits over a cluster of cfg.splits CTAs."""

    schedule = "whole"

    def launch_grid(self, ctas: Int32) -> list:
        return [self.m_tiles * self.ctas_per_tile, ctas, self.splits]

    def launch_cluster(self) -> list | None:
        return [1, 1, self.splits] if self.splits > 1 else None

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
        """One grid row's work of a CTA: M tile mt of grid row ey of the grid's R = rows, K split ks, on the shared
        memory struct st; args: the kernel's operands wq .. num_experts. Returns 1 where the kernel's loop goes on to
        row ey + R (active-first rows, and more experts with rows than ey + R), else 0."""
        wq, ws, tma_atom, tma_x, sxT, offs, cnt, lut, ep_a, ep_b, ep_c, sig, ticket, timeout_ns, num_experts = args
        n_tile = self.n
        nw = self.nwk  # windows of this CTA: [w_lo, w_lo + nw) of the tile's K (all of them without K splits)
        tidx, _, _ = cute.arch.thread_idx()
        w_lo = ks * nw
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        mt, wg, sb, wg_stage, half_at, crank = self.cta_rows(tidx, mt, ks)
        tw = tidx % 128
        lane = tidx % 32
        g = lane // 4
        t0 = lane % 4
        wwarp = tw // 32  # warp within the warpgroup
        slut, lut_at, srs, sunit, t_at, sflag, sred, ssx, srw, xchg, sB, _ = self.shared_views(st, b_smem_staged)

        if cutlass.const_expr(self.is_w1 and not self.cfg.ring):
            # W1's rows, scales and counts may come from the kernel just before it (ring mode acquires them by their
            # tags instead)
            cute.arch.griddepcontrol_wait()
        # ring mode: this call holds the workspace and dispatch published the ring's layout (sflag[0]: ok, [1]: g)
        ok, gen = self.acquire_ring(sig, ticket, timeout_ns, sflag, tidx, crank)
        # grid row ey runs the ey-th expert with rows: the CTAs of empty experts come last in launch order, after
        # every CTA with work (W2: the counts were written before W1, which let W2 launch only after its acquire)
        count = Int32(0)
        row_base = Int32(0)
        more = Int32(0)  # (see the docstring)
        e_found = (ey + first) % num_experts  # (cfg.active_first off: grid row y runs expert first + y)
        if ok == 0:
            e_found = Int32(-1)
        elif cutlass.const_expr(self.cfg.active_first):
            # (its rows and first row come with it: no second round trip)
            e_found, with_rows, count, row_base = self.active_expert(cnt, offs, ey, num_experts, first, lane)
            if ey + rows < with_rows:  # an expert with rows beyond the grid's rows
                more = Int32(1)
        e = cutlass.max(e_found, 0)
        if cutlass.const_expr(not self.cfg.active_first):
            if e_found >= 0:
                count = cnt[e]
                row_base = offs[e]
        npieces = (count + n_tile - 1) // n_tile  # the N tiles of the expert
        total = npieces * nw  # the CTA's pipeline loads (one window each)
        if cutlass.const_expr(self.is_w1):
            # W2 may launch once every W1 CTA has read the row layout: a CTA without rows reads and writes nothing
            # of the call after this, one with rows is awaited by W2 (W1_DONE or the grid dependency)
            cute.arch.griddepcontrol_launch_dependents()
        if cutlass.const_expr(self.expert_sync and self.is_w1):
            self.keep_release_words(sflag, sig, e, count, ks, tidx)

        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_atom)
        # the rows' scales 2^(f - 127) of the CTA's one tile, divided by each piece's t after its first barrier (held
        # in registers over the loop, or their address, ptxas spilled at N 80 half tiles); loaded before the table's
        # stores (after them, a round trip of its own)
        rsv = self.load_row_scale(ws, e * self.m_tiles + mt, half_at, tidx)
        self.copy_lut(slut, lut, tidx)
        if tidx < self.rows:
            srs[tidx] = bits_to_f32(rsv)
        self.warp_reduce_bits(rsv, True, sunit, warp_idx, lane)
        if tidx == 0:
            sunit[t_at + 1] = Int32(F32_ONE)  # srs holds the scales in units of t = 1 before the first piece
        pipe = self.start_pipeline(st, b_smem_staged)

        sW, sS, tCrB, frag0, frag1, fw0, fw1, accw0, accw1, acc0, acc1, abuf, sbuf = self.mma_operands(
            st, tiled_mma, sB, tw
        )
        nacc = self.subs * cute.size(acc0)  # accumulators per thread
        part_layout = cute.make_layout(
            (max(1, self.splits - 1), nacc, self.threads), stride=(nacc * self.threads, self.threads, 1)
        )
        swrd0 = 64 * wg_stage + 8 * wwarp + g  # the stage's record word of r0, r0 + 8 in subtile 0 (subtile s: + 32)
        trow0 = 128 * wg + 64 * sb + 16 * wwarp + g  # the tile's row r0 in subtile 0 (subtile s adds 64, row u 8)
        w_base, s_base, w_dst, s_dst = self.stage_addresses(wq, ws, st, half_at)
        lc = (mt, e, row_base, w_lo)  # what load_coords needs
        stream = (pipe, cnt, offs, lc, w_base, s_base, w_dst, s_dst, tma_atom, tma_x, sB)
        compute = (tiled_mma, tCrB, sW, sS, abuf, sbuf, lut_at, frag0, frag1, fw0, fw1, accw0, accw1, acc0, acc1, ssx)
        compute += (wg_stage, sb, tw, swrd0, t0)

        prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        cons = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        prev = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        issued = Int32(0)
        # the prologue, stages - 1 loads: the weights first (they depend on no earlier kernel), then W2 waits for W1
        # (its CTAs start in W1's tail and stream weights meanwhile) and W1 for its ring blocks, then the activations
        self.load_first_weights(stream, prod, total, warp_idx, lane)
        if cutlass.const_expr(not self.is_w1):
            self.wait_for_w1(sig, gen, timeout_ns, e, count, tidx)
        if cutlass.const_expr(self.cfg.ring and self.is_w1):
            self.acquire_blocks(sig, gen, timeout_ns, row_base, count, tidx)
        issued, prod = self.load_first_acts(stream, prod, issued, total, warp_idx, lane)

        for piece in cutlass.range(npieces, unroll=1):  # N tile `piece` of the expert, all of the CTA's windows
            acc0.fill(0.0)
            acc1.fill(0.0)
            col_base = piece * n_tile
            # the tile's activation scales of every window and W1's routing weights into shared memory once (no
            # global-load latency inside the window loop or the epilogue), times the piece's unit t
            sxv, rwt = self.load_piece_scales(sxT, ep_a, tidx, w_lo, row_base, col_base, count)
            tb = self.piece_unit_bits(sxv, sunit, warp_idx, lane)
            if tidx < self.rows:
                # the CTA's one tile's row scales, from units of the previous piece's t to this one's (rs / t_prev x
                # t_prev / t: every factor a normal power of two, so exact)
                rs = srs[tidx] * bits_to_f32(sunit[t_at + (piece + 1) % 2])
                srs[tidx] = rs * bits_to_f32(F32_INV_POW2 - tb)
            if tidx == 0:  # (the slot of the piece before the last: read before its second barrier)
                sunit[t_at + piece % 2] = tb
            self.stage_piece_scales(ssx, srw, sxv, rwt, tb, tidx)
            issued, prev, prod, cons = self.mainloop(
                stream, compute, Int32(0), Int32(nw), prod, cons, prev, issued, total, warp_idx, lane
            )
            # (read once the window accumulators are dead: read before the last promote, ptxas spilled at N 80)
            self.scale_rows(acc0, srs, trow0 - half_at * self.rows)
            if cutlass.const_expr(self.subs == 2):
                self.scale_rows(acc1, srs, trow0 - half_at * self.rows + 64)
            if cutlass.const_expr(self.splits > 1):
                self.reduce_splits(acc0, acc1, st.part.data_ptr().toint(), st.part.get_tensor(part_layout), ks, tidx)
            finish = Int32(0)
            if ks == 0:  # the cluster's leader (every CTA without K splits) finishes the tile
                finish = Int32(1)
            if finish != 0:
                if cutlass.const_expr(self.is_w1):
                    self.epilogue_w1(
                        acc0,
                        acc1,
                        sred,
                        srw,
                        xchg,
                        piece % 2,
                        ep_b,
                        ep_c,
                        mt,
                        wg,
                        sb,
                        wwarp,
                        g,
                        t0,
                        row_base + col_base,
                        count - col_base,
                        e,
                        sig,
                    )
                else:
                    valid = count - col_base
                    if cutlass.const_expr(self.cfg.ring):
                        if ld_u32(sig[3]) != 0:  # a wait of this call failed: store nothing
                            valid = Int32(0)
                    self.epilogue_w2(
                        acc0, acc1, ep_a, ep_b, ep_c, mt, wg, sb, wwarp, g, t0, row_base + col_base, valid, e, sig
                    )
            if cutlass.const_expr(self.splits > 1):
                if piece + 1 < npieces:  # the leader has read this tile's partials before they are pushed again
                    cute.arch.cluster_arrive()
                    cute.arch.cluster_wait()
        if cutlass.const_expr(self.expert_sync and self.is_w1):
            self.release_expert(sig, sflag, tidx)
        return more

    @cute.jit
    def load_coords(self, cnt: cute.Tensor, offs: cute.Tensor, lc: tuple, it: Int32, lane: Int32):
        """Load `it` of this CTA: (tile = expert x M tiles + M tile, first activation row, window): N tile it // nw of
        its (expert, M tile), window w_lo + it % nw. lc = (M tile, expert, its first row, w_lo)."""
        mt, e, row_base, w_lo = lc
        nw = self.nwk
        it_t = it // nw
        it_w = it - it_t * nw
        w = w_lo + it_w
        tile = e * self.m_tiles + mt
        row0 = row_base + it_t * self.n
        return tile, row0, w

    @cute.jit
    def active_expert(
        self, cnt: cute.Tensor, offs: cute.Tensor, j: Int32, num_experts: Int32, first: Int32, lane: Int32
    ):
        """(the j-th (from 0) expert with rows in the order first, first + 1, ..., E - 1, 0, ..., first - 1, or -1
        where fewer than j + 1 have rows; how many have rows; that expert's rows and first row, 0 / 0 for -1). Every
        warp computes it on its own: a ballot over the counts of 32 experts per step (their first rows loaded
        beside them)."""
        found = Int32(-1)
        seen = Int32(0)
        count = Int32(0)
        row_base = Int32(0)
        for base in cutlass.range(0, num_experts, 32, unroll=1):
            c = Int32(0)
            o = Int32(0)
            if base + lane < num_experts:
                x = (base + lane + first) % num_experts
                c = cnt[x]
                o = offs[x]
            active = cute.arch.vote_ballot_sync(c > 0)
            below = Int32(cute.arch.popc(active & cute.arch.lanemask_lt()))
            hit = cute.arch.vote_ballot_sync((c > 0) & (seen + below == j))
            if hit != 0:
                src = 31 - Int32(cute.arch.clz(hit))
                found = (base + src + first) % num_experts
                count = cute.arch.shuffle_sync(c, src)
                row_base = cute.arch.shuffle_sync(o, src)
            seen = seen + Int32(cute.arch.popc(active))
        return found, seen, count, row_base

    @cute.jit
    def reduce_splits(
        self, acc0: cute.Tensor, acc1: cute.Tensor, part_addr: Int32, part: cute.Tensor, ks: Int32, tidx: Int32
    ):
        """K splits: CTA ks > 0 pushes its partial accumulators into slot ks - 1 of the leader's (rank 0) shared memory,
        one cluster barrier, the leader adds them in split order (deterministic: acc_0 + acc_1 + ... )."""
        accs = (acc0, acc1)[: self.subs]
        nacc = cute.size(acc0)
        if ks > 0:
            slot = (ks - 1) * self.subs * nacc * self.threads
            for s, acc in enumerate(accs):
                for i in cutlass.range_constexpr(nacc):
                    st_cluster_f32(part_addr + 4 * (slot + (s * nacc + i) * self.threads + tidx), 0, acc[i])
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()
        if ks == 0:
            for r in cutlass.range_constexpr(self.splits - 1):
                for s, acc in enumerate(accs):
                    for i in cutlass.range_constexpr(nacc):
                        acc[i] = acc[i] + part[r, s * nacc + i, tidx]
