"""The epilogues of the sm90 grouped GEMMs (a mixin of kernel_grouped_common.GroupedGemmSm90Base: every schedule
runs them on a finished tile's accumulators, in the thread layout of kernel_grouped_common).

    W1: h = silu(acc[gate rows]) * acc[up rows] * route_w -> FP8 E4M3 per token per 128 intermediate columns (+ its
        power-of-two scale, transposed for W2: hsT[M tile, row]); W13's rows are interleaved gate / up in groups of 8,
        so a thread holds the gate and up rows of its intermediate columns (r0, r0 + 8) and SwiGLU runs in registers
    W2: rank src[row, 0]'s output rows: (comb[src[row, 0]] as bf16 [*, M])[dst[row], 256 mt + m] = bf16(acc[m, token])
        — comb is the combine-buffer peer table (one entry: a local output)
    compile-time options (gpt-oss; off by default, and then not a single instruction of them is emitted):
      cfg.activation = "swiglu_clamped" (gcmoe_core.reference.Activation; alpha and limit compiled in)
      cfg.bias:  W1 adds b13[e, c] / b13[e, I + c] to gate / up before the activation (fp32); W2 stores
                 bf16(acc + route_w[row] * b2[e, m]), reading route_w from the array W1 read it from (in ring mode
                 written by dispatch before the L1_FULL tags W1 acquired before it released W1_DONE)
"""

# No `from __future__ import annotations` in kernel files: the DSL reads the annotations as live objects.
from gcmoe_core.cutedsl import cutlass_modules
from gcmoe_core.device_ops import ld_u32, st_bf16
from gcmoe_core.kernel_helpers import bits_to_f32, cvt_e4m3x2, fmax_nan, fmin_nan, fp8_pow2_exponent, st_cluster_f32

cutlass, cute = cutlass_modules()
Int32, Int64, Float32 = cutlass.Int32, cutlass.Int64, cutlass.Float32
EPI_COLS = 4  # W2: token columns whose output row addresses are loaded before their stores


class GroupedEpilogueSm90:
    """epilogue_w1 / epilogue_w2 of a grouped GEMM kernel (the attributes they read are GroupedGemmSm90Base's)."""

    @cute.jit
    def epilogue_w1(
        self,
        acc0: cute.Tensor,
        acc1: cute.Tensor,
        sred: cute.Tensor,
        srw: cute.Tensor,
        xchg: cute.Tensor,
        slot: Int32,
        hq: cute.Tensor,
        hsT: cute.Tensor,
        mt: Int32,
        wg: Int32,
        sb: Int32,
        wwarp: Int32,
        g: Int32,
        t0: Int32,
        row0: Int32,
        valid: Int32,
        e: Int32,
        sig: tuple,
    ):
        """h = silu(gate) * up * rw per (token, intermediate column), the tile's routing weights rw staged in srw
        (0 past the expert's rows); FP8 per token per the tile's 128 columns.
        Subtile s of the warpgroup holds intermediate columns c_base + 32 (sb + s) (gate rows r, up rows r + 8).
        W1 half pairs (cfg.w1_half: this CTA holds 64 of the 128 columns, half wg of the tile): each token's maximum
        over the CTA's columns goes into the partner's xchg[slot] (slot: the piece's parity, so a partner still
        reading one piece's maxima is never overwritten by the next piece's), one cluster barrier (release /
        acquire), both scale by the larger of the two (the same value in both), half 0 writes the scales.
        cfg.bias / cfg.activation: gate and up get expert e's b13 entries, then the clamped activation."""
        ncol = self.n // 4
        hs = [cute.make_rmem_tensor(ncol, Float32) for _ in range(self.subs)]
        accs = (acc0, acc1)[: self.subs]
        warps = self.threads // 32
        warp = 4 * (wg * (self.wgs // 2) + sb) + wwarp
        if cutlass.const_expr(self.half):
            warp = 4 * sb + wwarp
        if cutlass.const_expr(self.bias):
            # the b13 entries of the thread's intermediate columns (one per subtile): gate at c, up at I + c
            bg = cute.make_rmem_tensor(self.subs, Float32)
            bu = cute.make_rmem_tensor(self.subs, Float32)
            for s in cutlass.range_constexpr(self.subs):
                at = sig[8] + (Int64(e) * self.m + 128 * mt + 64 * wg + 8 * wwarp + g + 32 * (sb + s)) * 4
                bg[s] = bits_to_f32(ld_u32(at))
                bu[s] = bits_to_f32(ld_u32(at + self.m // 2 * 4))
        for c in cutlass.range_constexpr(ncol):
            v0, q = c % 2, c // 2
            col = 2 * t0 + v0 + 8 * q
            i_gate, i_up = 4 * q + v0, 4 * q + 2 + v0
            w = srw[col]  # (staged with the tile's activation scales; 0 past the expert's rows)
            m = Float32(0.0)
            for s in cutlass.range_constexpr(self.subs):
                gate, up = accs[s][i_gate], accs[s][i_up]
                if cutlass.const_expr(self.bias):
                    gate = gate + bg[s]
                    up = up + bu[s]
                if cutlass.const_expr(self.clamped):
                    lim = Float32(self.cfg.swiglu_limit)
                    gate = fmin_nan(gate, lim)  # NaN-keeping: a non-finite token stays NaN (docs/numerics.md)
                    up = fmax_nan(fmin_nan(up, lim), -lim)
                    sig_a = Float32(1.0) + cute.math.exp(-(Float32(self.cfg.swiglu_alpha) * gate))
                    hs[s][c] = gate / sig_a * (up + Float32(1.0)) * w
                else:
                    hs[s][c] = gate / (Float32(1.0) + cute.math.exp(-gate)) * up * w
                m = cute.arch.fmax(m, cute.math.absf(hs[s][c]))
            for off in cutlass.range_constexpr(3):
                m = cute.arch.fmax(m, cute.arch.shuffle_sync_bfly(m, offset=4 << off))
            if g == 0:
                sred[col, warp] = m
        cute.arch.barrier(barrier_id=1, number_of_threads=self.threads)
        if cutlass.const_expr(self.pair):
            tidx, _, _ = cute.arch.thread_idx()
            if tidx < self.n:
                m = sred[tidx, 0]
                for k in cutlass.range_constexpr(1, warps):
                    m = cute.arch.fmax(m, sred[tidx, k])
                st_cluster_f32(xchg.iterator.toint() + 4 * (slot * self.n + tidx), 1 - wg, m)
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
        c_base = 128 * mt + 64 * wg + 8 * wwarp + g + 32 * sb  # intermediate column of the thread's first subtile
        lead = wg * int(self.pair)  # the CTA that stores a row's scale: W1's half pairs share it, the first stores it
        for c in cutlass.range_constexpr(ncol):
            col = 2 * t0 + (c % 2) + 8 * (c // 2)
            m = sred[col, 0]
            for k in cutlass.range_constexpr(1, warps):
                m = cute.arch.fmax(m, sred[col, k])
            if cutlass.const_expr(self.pair):
                m = cute.arch.fmax(m, xchg[slot, col])
            ex = fp8_pow2_exponent(m)
            inv = bits_to_f32((127 - ex) << 23)
            if col < valid:
                row = row0 + col
                q2 = cvt_e4m3x2(hs[self.subs - 1][c] * inv, hs[0][c] * inv)
                hq[row, c_base] = cutlass.Uint8(q2 & 0xFF)
                if cutlass.const_expr(self.subs == 2):
                    hq[row, c_base + 32] = cutlass.Uint8((q2 >> 8) & 0xFF)
                if warp == 0:
                    if g == 0:
                        if lead == 0:
                            hsT[mt, row] = bits_to_f32((127 + ex) << 23)
        cute.arch.barrier(barrier_id=1, number_of_threads=self.threads)

    @cute.jit
    def epilogue_w2(
        self,
        acc0: cute.Tensor,
        acc1: cute.Tensor,
        dst: cute.Tensor,
        src: cute.Tensor,
        comb: cute.Tensor,
        mt: Int32,
        wg: Int32,
        sb: Int32,
        wwarp: Int32,
        g: Int32,
        t0: Int32,
        row0: Int32,
        valid: Int32,
        e: Int32,
        sig: tuple,
    ):
        """Rank src[row, 0]'s output, bf16 [*, M] at comb[src[row, 0]]: row dst[row], columns m = bf16(acc) for the
        tile's 256 output columns (subtile s of the warpgroup: rows 64 (sb + s) of its 128); cfg.bias: bf16(acc +
        route_w[row] * b2[e, m])."""
        m_base = 256 * mt + 128 * wg + 64 * sb + 16 * wwarp + g
        if cutlass.const_expr(self.bias):
            # the routing weight of each of the thread's token columns, and expert e's b2 of its output columns
            rwc = cute.make_rmem_tensor(self.n // 4, Float32)
            for c in cutlass.range_constexpr(self.n // 4):
                col = 2 * t0 + (c % 2) + 8 * (c // 2)
                v = Float32(0.0)
                if col < valid:
                    v = bits_to_f32(ld_u32(sig[9] + Int64(row0 + col) * 4))
                rwc[c] = v
            b2 = cute.make_rmem_tensor(2 * self.subs, Float32)  # [row u + 2 subtile s]
            for j in cutlass.range_constexpr(2 * self.subs):
                b2[j] = bits_to_f32(ld_u32(sig[8] + (Int64(e) * self.m + m_base + 8 * (j % 2) + 64 * (j // 2)) * 4))
        # the output row addresses of EPI_COLS token columns at a time, then their stores: a store (st_bf16 clobbers
        # memory) orders the loads after it, so loading each column's between stores waits two round trips (src /
        # dst, then comb) per token column in series; more columns at a time spill at N >= 64
        ncol = self.n // 4
        for c0 in cutlass.range_constexpr(0, ncol, EPI_COLS):
            rowp = cute.make_rmem_tensor(EPI_COLS, Int64)
            for c in cutlass.range_constexpr(c0, min(c0 + EPI_COLS, ncol)):
                col = 2 * t0 + (c % 2) + 8 * (c // 2)
                rowp[c - c0] = Int64(0)
                if col < valid:
                    row = row0 + col
                    rowp[c - c0] = comb[src[row, 0]] + (Int64(dst[row]) * self.m + m_base) * 2
            for c in cutlass.range_constexpr(c0, min(c0 + EPI_COLS, ncol)):
                v0, q = c % 2, c // 2
                col = 2 * t0 + v0 + 8 * q
                if col < valid:
                    for v1 in cutlass.range_constexpr(2):
                        i = v0 + 2 * v1 + 4 * q
                        base = rowp[c - c0] + 16 * v1
                        if cutlass.const_expr(self.bias):
                            st_bf16(base, acc0[i] + rwc[c] * b2[v1])
                            if cutlass.const_expr(self.subs == 2):
                                st_bf16(base + 128, acc1[i] + rwc[c] * b2[v1 + 2])
                        else:
                            st_bf16(base, acc0[i])
                            if cutlass.const_expr(self.subs == 2):
                                st_bf16(base + 128, acc1[i])
