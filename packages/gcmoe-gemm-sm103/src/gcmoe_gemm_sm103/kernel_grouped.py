"""Grouped FP8-activation x MXFP4-weight GEMMs for Blackwell (sm_103a / sm_100a): W1 (+ SwiGLU, routing weight, FP8
requant) and W2 (+ row scatter), operand-swapped tcgen05 block-scaled MMA (kind::mxf8f6f4, scale vector 32).

    grid = (M / 256, experts); CTA (mt, e) loops over its expert's 128-token tiles:
        for k-tile kt:   acc_s += (A_s * SFA_s) @ (B * SFB)^T     s = 0, 1: the two 128-row halves of the 256-row tile
    W1 epilogue: rows (l, l + 16) of each 32-lane block are the gate and up rows of one intermediate column:
                 h = silu(gate) * up * route_w  -> FP8 E4M3 per token over the tile's 128 columns (+ its scale)
    W2 epilogue: out[dst[row], 256 mt + m] = bf16(acc[m, token])

Warp roles (192 threads): warps 0-3 epilogue (TMEM -> registers, one accumulator row per thread), warp 4 MMA
(scale factors smem -> TMEM with tcgen05.cp, then tcgen05.mma), warp 5 TMA producer. Per pipeline stage (one K128
tile): both A halves (the prepacked K128 tiles: one contiguous 8 KiB burst each, unpacked to bytes by TMA as the
f8f6f4 kind requires), their 512-byte scale atoms, the token tile (128 rows x 128 FP8) and its scale atom.

Global operands (the prepacker's layouts, gcmoe_gemm_sm103.prepack):
    A    logical [M, K, E] FP4 over data [E, M/128, K/128, 128, 64 B]: ((128, M/128), (128, K/128), E)
    SFA  sf [E, M/128, K/128, 512]: exactly the tcgen05 scale-factor atom tiling (tile_atom_to_shape_SF)
    B    token rows [R, K] FP8 (expert-sorted, padded to 128 per expert); SFB [R/128, K/128, 512] UE8M0 atoms
Never run (no Blackwell GPU): CI compiles it and checks its SASS; emulate.py replays the schedule and math.
"""

# No `from __future__ import annotations` in kernel files: the DSL reads the annotations as live objects.
from functools import cache

from gcmoe_core.cutedsl import compile_kernel, cutlass_modules
from gcmoe_core.kernel_helpers import bits_to_f32, cvt_e4m3x2, fake_epilogue_args, fp8_pow2_exponent

from .config import K_TILE, MMA_M, TILE_M, Sm103Config

cutlass, cute = cutlass_modules()
import cuda.bindings.driver as cuda  # noqa: E402
import cutlass.pipeline as pipeline  # noqa: E402
import cutlass.utils as utils  # noqa: E402
import cutlass.utils.blackwell_helpers as sm100_utils  # noqa: E402
import cutlass.utils.blockscaled_layout as blockscaled_utils  # noqa: E402
from cutlass import runtime as crt  # noqa: E402
from cutlass.cute.nvgpu import OperandMajorMode, tcgen05  # noqa: E402
from cutlass.cute.runtime import make_fake_compact_tensor  # noqa: E402

Int32, Float32 = cutlass.Int32, cutlass.Float32
SF_VEC = 32
EPI_N = 32  # tokens per epilogue chunk (one tcgen05.ld of 32 columns per thread)
THREADS = 192
EPI_WARPS = (0, 1, 2, 3)
MMA_WARP = 4
TMA_WARP = 5
DEFAULT_CONFIG = Sm103Config()


class GroupedGemmSm103:
    """One compiled variant: mode 'w1' or 'w2', weight rows M, reduction K, config."""

    def __init__(self, mode: str, m: int, k: int, cfg: Sm103Config):
        self.is_w1 = mode == "w1"
        self.m, self.k, self.cfg = m, k, cfg
        self.n = cfg.n_tile
        self.stages = cfg.stages
        self.k_tiles = k // K_TILE
        self.m_tiles = m // TILE_M
        self.mma_tiler = (MMA_M, self.n, K_TILE)
        self.epi_sync = pipeline.NamedBarrier(barrier_id=1, num_threads=32 * len(EPI_WARPS))
        self.tmem_alloc_sync = pipeline.NamedBarrier(barrier_id=2, num_threads=32 * (len(EPI_WARPS) + 1))

    def _tiled_mma(self):
        return sm100_utils.make_blockscaled_trivial_tiled_mma(
            cutlass.Float4E2M1FN,
            cutlass.Float8E4M3FN,
            OperandMajorMode.K,
            OperandMajorMode.K,
            cutlass.Float8E8M0FNU,
            SF_VEC,
            tcgen05.CtaGroup.ONE,
            (MMA_M, self.n),
        )

    @cute.jit
    def __call__(
        self,
        a_data: cute.Tensor,
        a_sf: cute.Tensor,
        x: cute.Tensor,
        x_sf: cute.Tensor,
        offs: cute.Tensor,
        cnt: cute.Tensor,
        ep_a: cute.Tensor,
        ep_b: cute.Tensor,
        ep_c: cute.Tensor,
        num_experts: Int32,
        stream: cuda.CUstream,
    ):
        f4, f8, sf_t = cutlass.Float4E2M1FN, cutlass.Float8E4M3FN, cutlass.Float8E8M0FNU
        m, k, n_tile = self.m, self.k, self.n
        tiled_mma = self._tiled_mma()
        cluster_vmnk = cute.tiled_divide(cute.make_layout((1, 1, 1)), (tiled_mma.thr_id.shape,))

        # A: the logical [M, K, E] FP4 view of the K128-prepacked bytes (element strides)
        kt, mtl = k // K_TILE, m // MMA_M
        a_layout = cute.make_layout(
            ((MMA_M, mtl), (K_TILE, kt), num_experts),
            stride=((K_TILE, kt * MMA_M * K_TILE), (1, MMA_M * K_TILE), mtl * kt * MMA_M * K_TILE),
        )
        mA = cute.make_tensor(cute.recast_ptr(a_data.iterator, dtype=f4), a_layout)
        mSFA = cute.make_tensor(
            cute.recast_ptr(a_sf.iterator, dtype=sf_t),
            blockscaled_utils.tile_atom_to_shape_SF((m, k, num_experts), SF_VEC),
        )
        rows = cute.size(x, mode=[0])
        mB = cute.make_tensor(
            cute.recast_ptr(x.iterator, dtype=f8), cute.make_layout((rows, k, 1), stride=(k, 1, rows * k))
        )
        mSFB = cute.make_tensor(
            cute.recast_ptr(x_sf.iterator, dtype=sf_t), blockscaled_utils.tile_atom_to_shape_SF((rows, k, 1), SF_VEC)
        )

        a_smem = sm100_utils.make_smem_layout_a(tiled_mma, self.mma_tiler, cutlass.Int8, self.stages)
        b_smem = sm100_utils.make_smem_layout_b(tiled_mma, self.mma_tiler, f8, self.stages)
        sfa_smem = blockscaled_utils.make_smem_layout_sfa(tiled_mma, self.mma_tiler, SF_VEC, self.stages)
        sfb_smem = blockscaled_utils.make_smem_layout_sfb(tiled_mma, self.mma_tiler, SF_VEC, self.stages)
        a_one = cute.slice_(a_smem, (None, None, None, 0))
        b_one = cute.slice_(b_smem, (None, None, None, 0))
        sfa_one = cute.slice_(sfa_smem, (None, None, None, 0))
        sfb_one = cute.slice_(sfb_smem, (None, None, None, 0))
        op_g2s = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.ONE)
        tma_a, tma_mA = cute.nvgpu.make_tiled_tma_atom_A(
            op_g2s, mA, a_one, self.mma_tiler, tiled_mma, cluster_vmnk.shape, internal_type=cutlass.Int8
        )
        tma_b, tma_mB = cute.nvgpu.make_tiled_tma_atom_B(
            op_g2s, mB, b_one, self.mma_tiler, tiled_mma, cluster_vmnk.shape
        )
        tma_sfa, tma_mSFA = cute.nvgpu.make_tiled_tma_atom_A(
            op_g2s, mSFA, sfa_one, self.mma_tiler, tiled_mma, cluster_vmnk.shape, internal_type=cutlass.Int16
        )
        tma_sfb, tma_mSFB = cute.nvgpu.make_tiled_tma_atom_B(
            op_g2s, mSFB, sfb_one, self.mma_tiler, tiled_mma, cluster_vmnk.shape, internal_type=cutlass.Int16
        )
        # one stage = both A halves, their scale atoms, the token tile and its scale atom
        self.tx_bytes = (
            2 * cute.size_in_bytes(f4, a_one)
            + cute.size_in_bytes(f8, b_one)
            + 2 * cute.size_in_bytes(sf_t, sfa_one)
            + cute.size_in_bytes(sf_t, sfb_one)
        )

        @cute.struct
        class Shared:
            ab_full: cute.struct.MemRange[cutlass.Int64, self.stages]
            ab_empty: cute.struct.MemRange[cutlass.Int64, self.stages]
            acc_full: cute.struct.MemRange[cutlass.Int64, 1]
            acc_empty: cute.struct.MemRange[cutlass.Int64, 1]
            tmem_holding: Int32
            red: cute.struct.MemRange[Float32, 8 * EPI_N]
            sA0: cute.struct.Align[cute.struct.MemRange[cutlass.Int8, cute.cosize(a_smem.outer)], 1024]
            sA1: cute.struct.Align[cute.struct.MemRange[cutlass.Int8, cute.cosize(a_smem.outer)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[f8, cute.cosize(b_smem.outer)], 1024]
            sSFA0: cute.struct.Align[cute.struct.MemRange[sf_t, cute.cosize(sfa_smem)], 128]
            sSFA1: cute.struct.Align[cute.struct.MemRange[sf_t, cute.cosize(sfa_smem)], 128]
            sSFB: cute.struct.Align[cute.struct.MemRange[sf_t, cute.cosize(sfb_smem)], 128]

        self.shared = Shared
        self.kernel(
            tiled_mma,
            tma_a,
            tma_mA,
            tma_b,
            tma_mB,
            tma_sfa,
            tma_mSFA,
            tma_sfb,
            tma_mSFB,
            offs,
            cnt,
            ep_a,
            ep_b,
            ep_c,
            a_smem,
            b_smem,
            sfa_smem,
            sfb_smem,
        ).launch(grid=[self.m_tiles, num_experts, 1], block=[THREADS, 1, 1], stream=stream, min_blocks_per_mp=1)

    @cute.kernel
    def kernel(
        self,
        tiled_mma: cute.TiledMma,
        tma_a: cute.CopyAtom,
        mA: cute.Tensor,
        tma_b: cute.CopyAtom,
        mB: cute.Tensor,
        tma_sfa: cute.CopyAtom,
        mSFA: cute.Tensor,
        tma_sfb: cute.CopyAtom,
        mSFB: cute.Tensor,
        offs: cute.Tensor,
        cnt: cute.Tensor,
        ep_a: cute.Tensor,
        ep_b: cute.Tensor,
        ep_c: cute.Tensor,
        a_smem: cute.ComposedLayout,
        b_smem: cute.ComposedLayout,
        sfa_smem: cute.Layout,
        sfb_smem: cute.Layout,
    ):
        n_tile, k_tiles = self.n, self.k_tiles
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        mt, e, _ = cute.arch.block_idx()
        count = cnt[e]
        row_base = offs[e]
        n_tiles = (count + n_tile - 1) // n_tile

        if warp_idx == TMA_WARP:
            for atom in (tma_a, tma_b, tma_sfa, tma_sfb):
                cute.nvgpu.cpasync.prefetch_descriptor(atom)

        smem = utils.SmemAllocator()
        st = smem.allocate(self.shared)
        ab_pipe = pipeline.PipelineTmaUmma.create(
            barrier_storage=st.ab_full.data_ptr(),
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            tx_count=self.tx_bytes,
            cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
            defer_sync=True,
        )
        acc_pipe = pipeline.PipelineUmmaAsync.create(
            barrier_storage=st.acc_full.data_ptr(),
            num_stages=1,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32 * len(EPI_WARPS)),
            cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
            defer_sync=True,
        )
        tmem = utils.TmemAllocator(
            st.tmem_holding.ptr, barrier_for_retrieve=self.tmem_alloc_sync, allocator_warp_id=EPI_WARPS[0]
        )
        pipeline.pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)

        sA0 = st.sA0.get_tensor(a_smem.outer, swizzle=a_smem.inner)
        sA1 = st.sA1.get_tensor(a_smem.outer, swizzle=a_smem.inner)
        sB = st.sB.get_tensor(b_smem.outer, swizzle=b_smem.inner)
        sSFA0 = st.sSFA0.get_tensor(sfa_smem)
        sSFA1 = st.sSFA1.get_tensor(sfa_smem)
        sSFB = st.sSFB.get_tensor(sfb_smem)
        sred = st.red.get_tensor(cute.make_layout((EPI_N, 8)))

        # global tiles: (tile, tile, rest_m, rest_k, rest_l)
        gA = cute.local_tile(mA, cute.slice_(self.mma_tiler, (None, 0, None)), (None, None, None))
        gB = cute.local_tile(mB, cute.slice_(self.mma_tiler, (0, None, None)), (None, None, None))
        gSFA = cute.local_tile(mSFA, cute.slice_(self.mma_tiler, (None, 0, None)), (None, None, None))
        gSFB = cute.local_tile(mSFB, cute.slice_(self.mma_tiler, (0, None, None)), (None, None, None))
        thr_mma = tiled_mma.get_slice(0)
        tCgA, tCgB = thr_mma.partition_A(gA), thr_mma.partition_B(gB)
        tCgSFA, tCgSFB = thr_mma.partition_A(gSFA), thr_mma.partition_B(gSFB)
        one = cute.make_layout(1)
        tAsA0, tAgA = cute.nvgpu.cpasync.tma_partition(
            tma_a, 0, one, cute.group_modes(sA0, 0, 3), cute.group_modes(tCgA, 0, 3)
        )
        tAsA1, _ = cute.nvgpu.cpasync.tma_partition(
            tma_a, 0, one, cute.group_modes(sA1, 0, 3), cute.group_modes(tCgA, 0, 3)
        )
        tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(
            tma_b, 0, one, cute.group_modes(sB, 0, 3), cute.group_modes(tCgB, 0, 3)
        )
        tAsSFA0, tAgSFA = cute.nvgpu.cpasync.tma_partition(
            tma_sfa, 0, one, cute.group_modes(sSFA0, 0, 3), cute.group_modes(tCgSFA, 0, 3)
        )
        tAsSFA1, _ = cute.nvgpu.cpasync.tma_partition(
            tma_sfa, 0, one, cute.group_modes(sSFA1, 0, 3), cute.group_modes(tCgSFA, 0, 3)
        )
        tBsSFB, tBgSFB = cute.nvgpu.cpasync.tma_partition(
            tma_sfb, 0, one, cute.group_modes(sSFB, 0, 3), cute.group_modes(tCgSFB, 0, 3)
        )
        tAsSFA0, tAsSFA1, tAgSFA = cute.filter_zeros(tAsSFA0), cute.filter_zeros(tAsSFA1), cute.filter_zeros(tAgSFA)
        tBsSFB, tBgSFB = cute.filter_zeros(tBsSFB), cute.filter_zeros(tBgSFB)

        tCrA0, tCrA1 = tiled_mma.make_fragment_A(sA0), tiled_mma.make_fragment_A(sA1)
        tCrB = tiled_mma.make_fragment_B(sB)
        acc_shape = tiled_mma.partition_shape_C(self.mma_tiler[:2])
        tCtAcc_fake = tiled_mma.make_fragment_C(cute.append(acc_shape, 2))  # the two 128-row halves
        pipeline.pipeline_init_wait(cluster_shape_mn=(1, 1))

        tile_m0 = 2 * mt
        tile_n0 = row_base // n_tile

        # ------------------------------------------------------------------------------------------- TMA producer
        if warp_idx == TMA_WARP:
            prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
            for nt in cutlass.range(n_tiles, unroll=1):
                for kt in cutlass.range(k_tiles, unroll=1):
                    ab_pipe.producer_acquire(prod)
                    bar = ab_pipe.producer_get_barrier(prod)
                    cute.copy(tma_a, tAgA[(None, tile_m0, kt, e)], tAsA0[(None, prod.index)], tma_bar_ptr=bar)
                    cute.copy(tma_a, tAgA[(None, tile_m0 + 1, kt, e)], tAsA1[(None, prod.index)], tma_bar_ptr=bar)
                    cute.copy(tma_sfa, tAgSFA[(None, tile_m0, kt, e)], tAsSFA0[(None, prod.index)], tma_bar_ptr=bar)
                    cute.copy(tma_sfa, tAgSFA[(None, tile_m0 + 1, kt, e)], tAsSFA1[(None, prod.index)], tma_bar_ptr=bar)
                    cute.copy(tma_b, tBgB[(None, tile_n0 + nt, kt, 0)], tBsB[(None, prod.index)], tma_bar_ptr=bar)
                    cute.copy(tma_sfb, tBgSFB[(None, tile_n0 + nt, kt, 0)], tBsSFB[(None, prod.index)], tma_bar_ptr=bar)
                    prod.advance()
            ab_pipe.producer_tail(prod)

        # ---------------------------------------------------------------------------------------------- MMA warp
        if warp_idx == MMA_WARP:
            tmem.wait_for_alloc()
            acc_ptr = tmem.retrieve_ptr(Float32)
            tCtAcc = cute.make_tensor(acc_ptr, tCtAcc_fake.layout)
            acc_cols = 2 * n_tile
            sfa_cols = (MMA_M // 32) * 4
            tCtSFA0 = cute.make_tensor(
                cute.recast_ptr(acc_ptr + acc_cols, dtype=cutlass.Float8E8M0FNU),
                blockscaled_utils.make_tmem_layout_sfa(
                    tiled_mma, self.mma_tiler, SF_VEC, cute.slice_(sfa_smem, (None, None, None, 0))
                ),
            )
            tCtSFA1 = cute.make_tensor(
                cute.recast_ptr(acc_ptr + acc_cols + sfa_cols, dtype=cutlass.Float8E8M0FNU),
                blockscaled_utils.make_tmem_layout_sfa(
                    tiled_mma, self.mma_tiler, SF_VEC, cute.slice_(sfa_smem, (None, None, None, 0))
                ),
            )
            tCtSFB = cute.make_tensor(
                cute.recast_ptr(acc_ptr + acc_cols + 2 * sfa_cols, dtype=cutlass.Float8E8M0FNU),
                blockscaled_utils.make_tmem_layout_sfb(
                    tiled_mma, self.mma_tiler, SF_VEC, cute.slice_(sfb_smem, (None, None, None, 0))
                ),
            )
            cp_sfa0, s2t_sSFA0, s2t_tSFA0 = self.s2t(sSFA0, tCtSFA0)
            cp_sfa1, s2t_sSFA1, s2t_tSFA1 = self.s2t(sSFA1, tCtSFA1)
            cp_sfb, s2t_sSFB, s2t_tSFB = self.s2t(sSFB, tCtSFB)
            cons = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            acc_prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
            for nt in cutlass.range(n_tiles, unroll=1):
                acc_pipe.producer_acquire(acc_prod)
                for kt in cutlass.range(k_tiles, unroll=1):
                    ab_pipe.consumer_wait(cons)
                    stage = (None, None, None, None, cons.index)
                    cute.copy(cp_sfa0, s2t_sSFA0[stage], s2t_tSFA0)
                    cute.copy(cp_sfa1, s2t_sSFA1[stage], s2t_tSFA1)
                    cute.copy(cp_sfb, s2t_sSFB[stage], s2t_tSFB)
                    tile = (None, None, None, cons.index)
                    # one call per half covers the tile's K32 blocks (the first one overwrites when kt == 0)
                    tiled_mma.set(tcgen05.Field.ACCUMULATE, kt != 0)
                    cute.gemm(
                        tiled_mma,
                        tCtAcc[(None, None, None, 0)],
                        [tCrA0[tile], tCtSFA0],
                        [tCrB[tile], tCtSFB],
                        tCtAcc[(None, None, None, 0)],
                    )
                    tiled_mma.set(tcgen05.Field.ACCUMULATE, kt != 0)
                    cute.gemm(
                        tiled_mma,
                        tCtAcc[(None, None, None, 1)],
                        [tCrA1[tile], tCtSFA1],
                        [tCrB[tile], tCtSFB],
                        tCtAcc[(None, None, None, 1)],
                    )
                    ab_pipe.consumer_release(cons)
                    cons.advance()
                acc_pipe.producer_commit(acc_prod)
                acc_prod.advance()
            acc_pipe.producer_tail(acc_prod)

        # ------------------------------------------------------------------------------------------ epilogue warps
        if warp_idx < MMA_WARP:
            tmem.allocate(cute.arch.get_max_tmem_alloc_cols("sm_100"))
            tmem.wait_for_alloc()
            acc_ptr = tmem.retrieve_ptr(Float32)
            tCtAcc = cute.make_tensor(acc_ptr, tCtAcc_fake.layout)
            epi_tile = (MMA_M, EPI_N)
            ld_atom = sm100_utils.get_tmem_load_op(
                (MMA_M, n_tile, K_TILE), utils.LayoutEnum.ROW_MAJOR, Float32, Float32, epi_tile, False
            )
            acc_cons = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
            for nt in cutlass.range(n_tiles, unroll=1):
                acc_pipe.consumer_wait(acc_cons)
                row0 = row_base + nt * n_tile
                valid = count - nt * n_tile
                for chunk in cutlass.range_constexpr(n_tile // EPI_N):
                    vals0, coord = self.load_chunk(ld_atom, tCtAcc, 0, chunk, epi_tile, tidx)
                    vals1, _ = self.load_chunk(ld_atom, tCtAcc, 1, chunk, epi_tile, tidx)
                    if cutlass.const_expr(self.is_w1):
                        self.epilogue_w1(
                            vals0,
                            vals1,
                            coord,
                            sred,
                            ep_a,
                            ep_b,
                            ep_c,
                            mt,
                            warp_idx,
                            tidx,
                            row0 + chunk * EPI_N,
                            valid - chunk * EPI_N,
                        )
                    else:
                        self.epilogue_w2(
                            vals0, vals1, coord, ep_a, ep_b, mt, row0 + chunk * EPI_N, valid - chunk * EPI_N
                        )
                cute.arch.fence_view_async_tmem_load()
                acc_pipe.consumer_release(acc_cons)
                acc_cons.advance()
            tmem.relinquish_alloc_permit()
            self.epi_sync.arrive_and_wait()
            tmem.free(acc_ptr)

    @cute.jit
    def s2t(self, sSF: cute.Tensor, tSF: cute.Tensor):
        """Scale factors smem -> TMEM (tcgen05.cp 4x32x128b), partitioned for the MMA warp."""
        s_compact, t_compact = cute.filter_zeros(sSF), cute.filter_zeros(tSF)
        atom = cute.make_copy_atom(tcgen05.Cp4x32x128bOp(tcgen05.CtaGroup.ONE), cutlass.Float8E8M0FNU)
        tiled = tcgen05.make_s2t_copy(atom, t_compact)
        thr = tiled.get_slice(0)
        src = tcgen05.get_s2t_smem_desc_tensor(tiled, thr.partition_S(s_compact))
        return tiled, src, thr.partition_D(t_compact)

    @cute.jit
    def load_chunk(
        self,
        ld_atom: cute.CopyAtom,
        tCtAcc: cute.Tensor,
        half: cutlass.Constexpr,
        chunk: cutlass.Constexpr,
        epi_tile: cutlass.Constexpr,
        tidx: Int32,
    ):
        """TMEM -> registers for accumulator `half`, token columns [32 chunk, 32 chunk + 32): this thread's row."""
        t_acc = cute.flat_divide(tCtAcc[((None, None), 0, 0, half)], epi_tile)
        tiled = tcgen05.make_tmem_copy(ld_atom, t_acc[(None, None, 0, 0)])
        thr = tiled.get_slice(tidx)
        src = thr.partition_S(t_acc)[(None, None, None, 0, chunk)]
        ident = cute.flat_divide(cute.make_identity_tensor((MMA_M, self.n)), epi_tile)
        coord = thr.partition_D(ident)[(None, None, None, 0, chunk)]
        vals = cute.make_rmem_tensor(coord.shape, Float32)
        cute.copy(tiled, src, vals)
        return vals, coord

    @cute.jit
    def epilogue_w1(
        self,
        vals0: cute.Tensor,
        vals1: cute.Tensor,
        coord: cute.Tensor,
        sred: cute.Tensor,
        rw: cute.Tensor,
        hq: cute.Tensor,
        hsT: cute.Tensor,
        mt: Int32,
        warp_idx: Int32,
        tidx: Int32,
        row0: Int32,
        valid: Int32,
    ):
        """Each thread owns one accumulator row m of both halves; lanes l < 16 hold gate rows, l + 16 the matching up
        rows of intermediate column 16 * (m // 32) + l (+ 64 for the second half)."""
        lane = tidx % 32
        is_gate = lane < 16
        hv0 = cute.make_rmem_tensor(cute.size(vals0), Float32)
        hv1 = cute.make_rmem_tensor(cute.size(vals0), Float32)
        for i in cutlass.range_constexpr(cute.size(vals0)):
            tok = coord[i][1] % EPI_N
            w = Float32(0.0)
            if tok < valid:
                w = rw[row0 + tok]
            up0 = cute.arch.shuffle_sync_bfly(vals0[i], offset=16)
            up1 = cute.arch.shuffle_sync_bfly(vals1[i], offset=16)
            g0, g1 = vals0[i], vals1[i]
            hv0[i] = g0 / (Float32(1.0) + cute.math.exp(-g0)) * up0 * w
            hv1[i] = g1 / (Float32(1.0) + cute.math.exp(-g1)) * up1 * w
            amax = cute.arch.fmax(cute.math.absf(hv0[i]), cute.math.absf(hv1[i]))
            if not is_gate:
                amax = Float32(0.0)
            for off in cutlass.range_constexpr(4):
                amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset=1 << off))
            if lane == 0:
                sred[tok, warp_idx] = amax
        self.epi_sync.arrive_and_wait()
        for i in cutlass.range_constexpr(cute.size(vals0)):
            tok = coord[i][1] % EPI_N
            amax = sred[tok, 0]
            for wi in cutlass.range_constexpr(1, 4):
                amax = cute.arch.fmax(amax, sred[tok, wi])
            ex = fp8_pow2_exponent(amax)
            inv = bits_to_f32((127 - ex) << 23)
            if is_gate:
                if tok < valid:
                    col = 128 * mt + 16 * (coord[i][0] // 32) + lane
                    q = cvt_e4m3x2(hv1[i] * inv, hv0[i] * inv)
                    hq[row0 + tok, col] = cutlass.Uint8(q & 0xFF)
                    hq[row0 + tok, col + 64] = cutlass.Uint8((q >> 8) & 0xFF)
                    if warp_idx == 0:
                        if lane == 0:
                            hsT[mt, row0 + tok] = bits_to_f32((127 + ex) << 23)
        self.epi_sync.arrive_and_wait()

    @cute.jit
    def epilogue_w2(
        self,
        vals0: cute.Tensor,
        vals1: cute.Tensor,
        coord: cute.Tensor,
        dst: cute.Tensor,
        out: cute.Tensor,
        mt: Int32,
        row0: Int32,
        valid: Int32,
    ):
        for i in cutlass.range_constexpr(cute.size(vals0)):
            tok = coord[i][1] % EPI_N
            if tok < valid:
                orow = dst[row0 + tok]
                m = TILE_M * mt + coord[i][0]
                out[orow, m] = vals0[i].to(cutlass.BFloat16)
                out[orow, m + MMA_M] = vals1[i].to(cutlass.BFloat16)


@cache
def compiled(mode: str, m: int, k: int, cfg: Sm103Config = DEFAULT_CONFIG, arch: str = "sm_103a"):
    """Compile one variant against fake tensors (no GPU needed)."""
    dyn = cute.sym_int
    a_data = make_fake_compact_tensor(cutlass.Uint8, (dyn(),), assumed_align=128)
    a_sf = make_fake_compact_tensor(cutlass.Uint8, (dyn(),), assumed_align=128)
    x = make_fake_compact_tensor(cutlass.Uint8, (dyn(), k), stride_order=(1, 0), assumed_align=128)
    x_sf = make_fake_compact_tensor(cutlass.Uint8, (dyn(),), assumed_align=128)
    offs = make_fake_compact_tensor(Int32, (dyn(),), assumed_align=4)
    cnt = make_fake_compact_tensor(Int32, (dyn(),), assumed_align=4)
    ep_a, ep_b, ep_c = fake_epilogue_args(mode, m)
    kern = GroupedGemmSm103(mode, m, k, cfg)
    return compile_kernel(
        kern,
        a_data,
        a_sf,
        x,
        x_sf,
        offs,
        cnt,
        ep_a,
        ep_b,
        ep_c,
        Int32(1),
        crt.make_fake_stream(),
        arch=arch,
        name=f"sm103_{mode}_m{m}_k{k}_n{cfg.n_tile}",
    )


def _launch(mode: str, packed, x_rows, x_sf, layout, ep_a, ep_b, ep_c, cfg: Sm103Config):
    import torch

    from gcmoe_core.cutedsl import as_cute, target_arch

    e = packed.data.shape[0]
    if layout.counts.numel() != e or layout.n_tile != cfg.n_tile:
        raise ValueError(
            f"sm103 {mode}: row layout ({layout.counts.numel()} experts, n_tile {layout.n_tile}) does "
            f"not match {e} prepacked experts / n_tile {cfg.n_tile}"
        )
    kern = compiled(mode, packed.n, packed.k, cfg, target_arch(x_rows.device.index))
    kern(
        as_cute(packed.data.view(-1), 0, 128),
        as_cute(packed.sf.view(-1), 0, 128),
        as_cute(x_rows, 0, 128),
        as_cute(x_sf.view(-1), 0, 128),
        as_cute(layout.offsets, 0, 4),
        as_cute(layout.counts, 0, 4),
        ep_a,
        ep_b,
        ep_c,
        e,
        cuda.CUstream(torch.cuda.current_stream(x_rows.device).cuda_stream),
    )


def run_w1(packed, acts, layout, cfg: Sm103Config):
    """W1 on a Blackwell GPU: -> (hq uint8 [R, I] FP8 bits, hsT fp32 [I/128, R])."""
    import torch

    from gcmoe_core.cutedsl import as_cute

    from .emulate import token_scale_atoms

    dev = acts.x_rows.device
    hq = torch.empty(layout.rows, packed.n // 2, dtype=torch.uint8, device=dev)
    hsT = torch.empty(packed.n // TILE_M, layout.rows, dtype=torch.float32, device=dev)
    _launch(
        "w1",
        packed,
        acts.x_rows,
        token_scale_atoms(acts.sxT),
        layout,
        as_cute(acts.route_w, 0, 4),
        as_cute(hq, 0, 16),
        as_cute(hsT, 1, 4),
        cfg,
    )
    return hq, hsT


def run_w2(packed, hq, hsT, layout, out, cfg: Sm103Config):
    """W2 on a Blackwell GPU: out[src_slot[row]] = bf16 rows."""
    import torch

    from gcmoe_core.cutedsl import as_cute

    from .emulate import token_scale_atoms

    dummy = torch.empty(1, dtype=torch.float32, device=hq.device)
    _launch(
        "w2",
        packed,
        hq,
        token_scale_atoms(hsT),
        layout,
        as_cute(layout.src_slot, 0, 4),
        as_cute(out, 0, 16),
        as_cute(dummy, None),
        cfg,
    )
    return out
