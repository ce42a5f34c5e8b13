"""What every schedule of the sm90 grouped GEMMs shares: FP8-activation x MXFP4-weight W1 (+ SwiGLU, routing weight,
FP8 requant) and W2 (+ bf16 rows stored through a peer table), register-A WGMMA with the FP4 -> E4M3 decode in
registers. A schedule decides which CTA computes which tiles and how a tile's partial sums meet; each is a subclass of
GroupedGemmSm90Base in a file of its own, and ops.kernel_class picks one from the config (config.schedule_of):

    kernel_grouped           whole 256-row tiles, one grid row per expert with rows, optionally K-split clusters
    kernel_grouped_half      half tiles: two CTAs per M tile and per SM (W2 halves, W1 halves as cluster pairs)
    kernel_grouped_stream_k  W1 over equal ranges of all active tiles' K windows, one CTA per SM slot

    for each expert e, M tile mt (256 weight rows), N tile nt of the expert's tokens:
        acc[256, N] = 2^(f - 127) * sum_w  sx[:, w] * (decode(Wq[e, mt, w]) @ X[rows, 128 w : 128 w + 128]^T)
                      (f: each weight row's reference exponent; decode: E4M3 relative to it, prepack's row scales)
        then the W1 / W2 epilogue (kernel_grouped_epilogue)

Threads (cfg.warpgroups): 2 warpgroups, warpgroup j owns rows [128 j, 128 j + 128) of the tile as 2 WGMMA subtiles of
64 rows; or 4 warpgroups (half the accumulator registers per thread, 16 warps per SM at one CTA per SM), warpgroup q
owns subtile q % 2 of those rows of j = q // 2. The prepacked fragments and the epilogues' row / column mapping are
the same in both (and in half tiles, whose CTAs map their warpgroups as 4 warpgroups do).
Pipeline (PipelineTmaAsync, `stages` deep, one 128-K window per stage): warp 0 (the whole warp: the arrive and the TMA
issue elect one lane with elect.sync, which hangs if only one lane runs it) fills a stage with the window's activation
box by TMA and the window's 16 KB of prepacked weights and 512 B of scale records by one bulk copy each, all on the
stage's mbarrier. The activation boxes start at the expert's first row (any multiple of 8: a TMA box reaches into
the next expert's rows or past the end, which reads zeros; those token columns are computed and never stored).
Every thread reads its own weight fragments from the stage with 16-byte shared loads (conflict-free), decodes them
in registers (decode_ptx: split-sign layout, per-group LUT from shared memory: one 16-byte entry of prepack's pair
table holds two k32 steps' tables, at the offset a mask of the rows' record word gives) and issues m64nNk32 WGMMAs
with A from registers and B (tokens) from the stage. Each window's WGMMAs accumulate into a window accumulator that
is then promoted into the main accumulator with the tokens' activation scales (two-level FP32 accumulation, one FFMA
per element; the N tile's scales of every window are staged in shared memory once, before its window loop); the rows'
2^(f - 127) multiplies the main accumulator once, after the tile's (piece's) last window. The accumulators' unit: the
staged activation scales are multiplied by a power of two t per piece and the row scales divided by it
(tile_unit_bits), so a row's values stay in the range of its true values (in units of its own 2^(f - 127) they would
overflow up to 2^14 sooner than the reference). One window's steps, and why its wait is unconditional: mainloop.

Programmatic dependent launch: W1 waits for its producer (griddepcontrol.wait) before reading anything; W2 bulk-copies
its first stages' weights (which no earlier kernel writes) before waiting for W1, so its CTAs stream weights in W1's
tail. Both let their dependents launch right after their own wait (so a dependent may read what was written before its
producer). In ring mode W1 does not wait for its producer at all (gcmoe-comm's dispatch, which lets W1 launch once
every CTA has ranked the routing; the last of them then releases OFFS): what it reads from dispatch is behind the OFFS /
L1_FULL tags. W1 lets W2 launch once every W1 CTA has read its row layout, so a W1 CTA without rows touches nothing of
the call afterwards and every other one is awaited by W2: a finished W2 grid leaves no W1 or dispatch CTA that can
still read or write this call's state (the launch after the layer's finalize, which waits for W2, never races them).

Ring mode (cfg.ring, the operator's path beside gcmoe-comm's dispatch on the other partition): each CTA first
acquires INUSE == ticket (its call holds the workspace), reads g = CGEN + 1 and acquires OFFS == g (dispatch wrote
the ring's offsets and counts of call g) — every wait bounded by timeout_ns and ended early by a non-zero ERR word,
a failed wait recorded there (gcmoe_core.signals kinds) and the CTA then doing nothing. W1 acquires L1_FULL[b] == g of
every ring block of its expert after issuing its first weight stages and before its first activation box; W2 reads
ERR again before its stores and stores nothing once it is set. With cfg.expert_sync, W2 waits per expert, not for
the whole W1 grid: the expert's last W1 M tile releases W1_DONE[e] = g (release_expert), which its W2 CTAs acquire
before their first activation box (acquire_expert). The words' addresses come by value (sig:
INUSE, CGEN, OFFS, ERR, L1_FULL, W1_DONE), so this package knows nothing of the workspace layout. Without ring mode
(prepared rows: the component used on its own, and its tests) the kernels read rows laid out beforehand.

Inputs (see ops.py for how they are made):
    wq     int32 [E*MT*W*8, 128, 4]   prepacked weights (prepack.PackedSm90.data)
    ws     int32 [E*MT*(W*128 + 256)]  per tile: its windows' record words, its row scales (PackedSm90.scales)
    x      fp8   [R, K]                expert-sorted token rows, each expert's first row a multiple of 8
    sxT    fp32  [W, R]                activation scales, transposed (powers of two)
    offs   int32 [E + 1]               row offsets; count = cnt[e]
    cnt    int32 [E]                   valid rows of each expert
    lut    int32 [256, 4]              the decode tables by pairs of k32 steps (prepack.lut_pair_words)
    W1: rw fp32 [R] routing weight per row; hq uint8 [R, M/2] FP8 intermediate; hsT fp32 [M/256, R] its scales
    W2: dst int32 [R] output row per input row; src int32 [R, 3] its (rank, token, slot); comb int64 [P] the output
        buffer (bf16 [*, M]) of every rank
    ctas   the grid rows (kernel_grouped: Grid) or stream_k's CTAs; first: the expert of grid row 0

Debug: CUTE_DSL_KEEP=sass,ptx and CUTE_DSL_DUMP_DIR keep the generated code.
"""

# No `from __future__ import annotations` in kernel files: the DSL reads the annotations as live objects.
from gcmoe_core.cutedsl import compile_kernel, cutlass_modules
from gcmoe_core.device_ops import (
    atom_add_u32,
    fence_gpu,
    ld_acquire_u32,
    ld_relaxed_u32,
    record_error,
    st_release_u32,
    st_u32,
    wait_until_eq,
)
from gcmoe_core.kernel_helpers import (
    F32_ONE,
    bits_to_f32,
    bulk_copy_g2s,
    f32_to_bits,
    fake_epilogue_args,
    inline_ptx,
    ld_cluster_u32,
    ld_shared_v4,
    rotl32,
)
from gcmoe_core.signals import KIND_BLOCK, KIND_BUSY, KIND_OFFS, KIND_W1

from .config import (
    LUT_PAIR_BYTES,
    TILE_M,
    WINDOW_K,
    WINDOW_SCALE_BYTES,
    WINDOW_WEIGHT_BYTES,
    Sm90Config,
    can_implement,
    schedule_of,
)
from .decode_ptx import DECODE8_SPLIT_SIGN_PTX
from .kernel_grouped_epilogue import GroupedEpilogueSm90
from .prepack import RECORD_WORDS, tile_scale_words

cutlass, cute = cutlass_modules()
import cuda.bindings.driver as cuda  # noqa: E402
import cutlass.pipeline as pipeline  # noqa: E402
import cutlass.utils as utils  # noqa: E402
import cutlass.utils.hopper_helpers as sm90_utils  # noqa: E402
from cutlass import runtime as crt  # noqa: E402
from cutlass._mlir.dialects import llvm  # noqa: E402
from cutlass.cute.nvgpu import cpasync, warpgroup  # noqa: E402
from cutlass.cute.runtime import make_fake_compact_tensor  # noqa: E402
from cutlass.cutlass_dsl import T, dsl_user_op  # noqa: E402

Int32, Int64, Float32 = cutlass.Int32, cutlass.Int64, cutlass.Float32
LUT_PAIR_WORDS = LUT_PAIR_BYTES // 4  # the pair table (prepack.lut_pair_words): 256 entries of 16 bytes
F32_MIN_NORMAL, F32_INF = 0x00800000, 0x7F800000  # fp32 bit patterns of 2^-126, +Inf (F32_ONE: 1)
F32_INV_POW2 = 254 << 23  # F32_INV_POW2 - bits(2^k) = bits(2^-k) for a normal power of two 2^k (|k| <= 126)
SK_TABLE = 8  # stream_k: tiles per CTA whose coordinates are kept in shared memory (more: located per load)
SIG_WORDS = 8  # by-value addresses: ring mode's INUSE, CGEN, OFFS, ERR, L1_FULL, W1_DONE; stream_k's partials, counters


@dsl_user_op
def decode8(word, lut_lo, lut_hi, *, loc=None, ip=None):
    """8 E2M1 codes of the split-sign layout (one word) -> 8 E4M3 bytes (two words) through the group's LUT
    (decode_ptx.DECODE8_SPLIT_SIGN_PTX)."""
    i32 = T.i32()
    args = [Int32(word), Int32(lut_lo), Int32(lut_hi)]
    ret = llvm.StructType.get_literal([i32, i32])
    res = inline_ptx(ret, args, DECODE8_SPLIT_SIGN_PTX, "=r,=r,r,r,r", loc, ip, side_effects=False)
    lo = llvm.extractvalue(i32, res, [0], loc=loc, ip=ip)
    hi = llvm.extractvalue(i32, res, [1], loc=loc, ip=ip)
    return Int32(lo), Int32(hi)


def sig_words(mode: str, cfg: Sm90Config) -> int:
    """By-value address words of a variant: SIG_WORDS, then with cfg.bias the epilogue's fp32 operands (W1: b13
    [E, 2I]; W2: b2 [E, M], route_w [R]), so the default variants keep the same parameter list."""
    return SIG_WORDS + ((1 if mode == "w1" else 2) if cfg.bias else 0)


class GroupedGemmSm90Base(GroupedEpilogueSm90):
    """One compiled variant: mode 'w1' or 'w2', weight rows M, reduction K, config. A subclass is a schedule: it names
    itself (`schedule`, as config.schedule_of names the config's), lays out the grid (launch_grid, launch_cluster)
    and writes `body`, one grid row's work of a CTA, from the steps below."""

    schedule = ""

    def __init__(self, mode: str, m: int, k: int, cfg: Sm90Config):
        if mode not in ("w1", "w2"):
            raise ValueError(f"mode must be 'w1' or 'w2', got {mode!r}")
        if schedule_of(mode, cfg) != self.schedule:
            raise ValueError(f"sm90 {mode}: the config runs the {schedule_of(mode, cfg)} schedule, not {self.schedule}")
        self.is_w1 = mode == "w1"
        self.m, self.k, self.cfg = m, k, cfg
        self.n = cfg.n_tile
        self.windows = k // WINDOW_K
        self.m_tiles = m // TILE_M
        self.stages = cfg.stages
        self.prefetch = cfg.prefetch
        self.splits = cfg.splits[0 if self.is_w1 else 1]  # K splits: CTAs of one cluster, one window range each
        self.nwk = self.windows // self.splits
        self.wgs = cfg.warpgroups  # 2: each warpgroup two 64-row subtiles; 4: one each (half the registers per thread)
        self.subs = 4 // self.wgs  # subtiles per warpgroup
        self.threads = 128 * self.wgs
        self.half = self.pair = False  # (kernel_grouped_half: CTAs of half an M tile, W1's as cluster pairs)
        self.ctas_per_tile = 1  # CTAs that share an M tile's rows (each counts itself in W1_DONE)
        self.clustered = self.splits > 1  # CTAs that exchange shared memory: K-split clusters, W1's half pairs
        self.occupancy = cfg.occupancy
        self.w_bytes, self.s_bytes = WINDOW_WEIGHT_BYTES, WINDOW_SCALE_BYTES  # per stage
        self.rows = TILE_M  # the tile's rows this CTA computes
        self.expert_sync = cfg.ring and cfg.expert_sync  # W1_DONE tags per expert instead of W2's grid-wide wait
        self.stream_k = cfg.stream_k and self.is_w1  # W1: a grid of `ctas` CTAs over equal window ranges
        self.clamped = cfg.activation == "swiglu_clamped"  # (gpt-oss) W1's clamped SwiGLU
        self.bias = cfg.bias  # W1 + b13, W2 + route_w * b2 (addresses: sig[8], sig[9])

    def launch_grid(self, ctas: Int32) -> list:
        """The grid [x, y, z] of a launch for `ctas` (the grid rows, or stream_k's CTAs): the schedule's."""
        raise NotImplementedError

    def launch_cluster(self) -> list | None:
        """The cluster shape of the schedule's CTAs (None: none)."""
        raise NotImplementedError

    @cute.jit
    def __call__(
        self,
        wq: cute.Tensor,
        ws: cute.Tensor,
        x: cute.Tensor,
        sxT: cute.Tensor,
        offs: cute.Tensor,
        cnt: cute.Tensor,
        lut: cute.Tensor,
        ep_a: cute.Tensor,
        ep_b: cute.Tensor,
        ep_c: cute.Tensor,
        sig: tuple,
        ticket: Int32,
        timeout_ns: Int64,
        num_experts: Int32,
        ctas: Int32,
        first: Int32,
        stream: cuda.CUstream,
    ):
        f8 = cutlass.Float8E4M3FN
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            f8,
            f8,
            warpgroup.OperandMajorMode.K,
            warpgroup.OperandMajorMode.K,
            Float32,
            (1, 1, 1),
            (64, self.n),
            warpgroup.OperandSource.RMEM,
        )
        b_layout = utils.LayoutEnum.from_tensor(x)
        b_smem_staged = sm90_utils.make_smem_layout_b(b_layout, (64, self.n, WINDOW_K), f8, self.stages)
        b_smem_one = cute.slice_(b_smem_staged, (None, None, 0))
        tma_atom, tma_x = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), x, b_smem_one, (self.n, WINDOW_K)
        )

        part_words = (self.splits - 1) * self.n * TILE_M if self.splits > 1 else 4  # the tile's 256 x N per split

        @cute.struct
        class Shared:
            mbar: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            lut: cute.struct.Align[cute.struct.MemRange[Int32, LUT_PAIR_WORDS], 16]
            flag: cute.struct.MemRange[Int32, 8]
            red: cute.struct.MemRange[Float32, self.threads // 32 * self.n]
            ssx: cute.struct.MemRange[Float32, self.windows * self.n]
            srw: cute.struct.MemRange[Float32, self.n if self.is_w1 else 1]  # W1: the tile's routing weights
            srs: cute.struct.MemRange[Float32, self.rows]  # the row scales of the CTA's rows, divided by the piece's t
            # fp32 bits: each warp's largest row scale, each warp's smallest non-zero activation scale of the piece,
            # t of the pieces by parity (a kilobyte more for the rows' own scales cost W1 at N 8 its 2 CTAs per SM)
            sunit: cute.struct.MemRange[Int32, 2 * (self.threads // 32) + 2]
            # W1 half pairs: the partner's column maxima, [piece parity][token column] (written by the partner)
            xchg: cute.struct.MemRange[Float32, 2 * self.n if self.pair else 1]
            # stream_k: the CTA's first SK_TABLE tiles (expert x M tiles + M tile, first row, expert, N tile, M tile)
            skt: cute.struct.MemRange[Int32, SK_TABLE * 5 if self.stream_k else 1]
            sB: cute.struct.Align[cute.struct.MemRange[f8, cute.cosize(b_smem_staged)], 1024]
            # each stage's window of weights [8 fragments][128 threads][16 B] and record words [128] (16 bits per row)
            sW: cute.struct.Align[cute.struct.MemRange[Int32, self.w_bytes // 4 * self.stages], 128]
            sS: cute.struct.Align[cute.struct.MemRange[Int32, self.s_bytes // 4 * self.stages], 16]
            # K splits: partial accumulators the cluster's other CTAs push to the leader, [split - 1][i][thread]
            part: cute.struct.Align[cute.struct.MemRange[Float32, part_words], 16]

        self.shared = Shared
        operands = (wq, ws, tma_atom, tma_x, sxT, offs, cnt, lut, ep_a, ep_b, ep_c, sig, ticket, timeout_ns)
        self.kernel(*operands, num_experts, first, tiled_mma, b_smem_staged).launch(
            grid=self.launch_grid(ctas),  # ctas: the grid rows, or stream_k's CTAs
            block=[self.threads, 1, 1],
            cluster=self.launch_cluster(),
            use_pdl=True,
            smem=Shared.size_in_bytes(),
            stream=stream,
            min_blocks_per_mp=self.occupancy,  # occupancy 2 caps the registers at 128 (65536 / (2 * 256))
            preferred_smem_carveout=100,  # (also keeps the DSL from querying a device at compile time)
        )

    @cute.kernel
    def kernel(
        self,
        wq: cute.Tensor,
        ws: cute.Tensor,
        tma_atom: cute.CopyAtom,
        tma_x: cute.Tensor,
        sxT: cute.Tensor,
        offs: cute.Tensor,
        cnt: cute.Tensor,
        lut: cute.Tensor,
        ep_a: cute.Tensor,
        ep_b: cute.Tensor,
        ep_c: cute.Tensor,
        sig: tuple,
        ticket: Int32,
        timeout_ns: Int64,
        num_experts: Int32,
        first: Int32,
        tiled_mma: cute.TiledMma,
        b_smem_staged: cute.ComposedLayout,
    ):
        mt, ey, ks = cute.arch.block_idx()  # ks: K split = rank in the cluster (clusters run along z)
        st = utils.SmemAllocator().allocate(self.shared)
        args = (wq, ws, tma_atom, tma_x, sxT, offs, cnt, lut, ep_a, ep_b, ep_c, sig, ticket, timeout_ns, num_experts)
        # grid rows ey, ey + R, ey + 2 R, ... (R = the grid's rows) while they find experts with rows (active-first
        # rows only: see kernel_grouped, Grid); every other config runs one row
        rows = cute.arch.grid_dim()[1]
        y = ey
        more = Int32(1)
        while more != 0:
            cute.arch.barrier()  # the previous row's readers of the stages' mbarriers are done before they re-arm
            more = self.body(args, first, tiled_mma, b_smem_staged, mt, y, rows, ks, st)
            y = y + rows

    # ---------------------------------------------------------------- a CTA's setup, in the order the bodies run it
    @cute.jit
    def cta_rows(self, tidx: Int32, mt: Int32, ks: Int32):
        """(M tile, the tile's 128-row block wg of the thread's warpgroup, its first subtile sb (of 2), the stage's
        128-row block it reads, the CTA's half of the tile (0), its rank in the cluster (the K split)) of a CTA that
        computes whole tiles; kernel_grouped_half overrides it."""
        wg = tidx // 128 if self.wgs == 2 else tidx // 256
        sb = 0 if self.wgs == 2 else (tidx // 128) % 2  # with 4 warpgroups: the warpgroup's one subtile
        return mt, wg, sb, wg, Int32(0), ks

    @cute.jit
    def shared_views(self, st, b_smem_staged: cute.ComposedLayout):
        """The shared struct's arrays as tensors: (decode table, its address, row scales, unit words, the index of the
        pieces' t in them, flags, per-warp column maxima, activation scales, routing weights, the pair's exchange,
        activation stages, stream_k's tile table)."""
        n_tile = self.n
        slut = st.lut.get_tensor(cute.make_layout(LUT_PAIR_WORDS))
        lut_at = slut.iterator.toint()  # (decode_subtile's vector loads)
        srs = st.srs.get_tensor(cute.make_layout(self.rows))  # the row scales 2^(f - 127) / t of the CTA's rows
        sunit = st.sunit.get_tensor(cute.make_layout(2 * (self.threads // 32) + 2))  # (tile_unit_bits)
        t_at = 2 * (self.threads // 32)  # sunit[t_at + piece % 2]: the piece's t (fp32 bits)
        sflag = st.flag.get_tensor(cute.make_layout(8))
        sred = st.red.get_tensor(cute.make_layout((n_tile, self.threads // 32)))  # [token column, warp]
        ssx_layout = cute.make_layout((self.nwk, n_tile), stride=(n_tile, 1))
        ssx = st.ssx.get_tensor(ssx_layout)  # [window, token column] of the current N tile
        srw = st.srw.get_tensor(cute.make_layout(n_tile if self.is_w1 else 1))  # W1: [token column]
        xchg = st.xchg.get_tensor(
            cute.make_layout((2, n_tile) if self.pair else 1, stride=(n_tile, 1) if self.pair else 1)
        )
        sB = st.sB.get_tensor(b_smem_staged.outer, swizzle=b_smem_staged.inner)
        skt = st.skt.get_tensor(cute.make_layout((5, SK_TABLE if self.stream_k else 1)))
        return slut, lut_at, srs, sunit, t_at, sflag, sred, ssx, srw, xchg, sB, skt

    @cute.jit
    def keep_release_words(self, sflag: cute.Tensor, sig: tuple, e: Int32, count: Int32, ks: Int32, tidx: Int32):
        """expert_sync, W1: what release_expert reads after the tiles, kept in shared memory (not in registers over
        the loop): the expert, its rows (0 on a K-split cluster's other CTAs: its leader counts the M tile), the
        W1_DONE address, the CTAs of the expert's M tiles (each counts itself)."""
        if tidx == 0:
            sflag[2] = e
            sflag[3] = count
            if ks != 0:
                sflag[3] = Int32(0)
            sflag[4] = Int32(sig[5] & 0xFFFFFFFF)
            sflag[5] = Int32(sig[5] >> 32)
            sflag[6] = Int32(self.m_tiles * self.ctas_per_tile)

    @cute.jit
    def copy_lut(self, slut: cute.Tensor, lut: cute.Tensor, tidx: Int32):
        """The decode's pair table into shared memory, by warp 0 (copied by every thread, or by the bulk-copy engine
        on an mbarrier, ptxas spilled registers at N 80: gpt-oss' W2 with its bias)."""
        if tidx < 32:
            for i in cutlass.range_constexpr(LUT_PAIR_WORDS // 32):
                slut[tidx + 32 * i] = lut[tidx + 32 * i]

    @cute.jit
    def start_pipeline(self, st, b_smem_staged: cute.ComposedLayout):
        """The stages' mbarriers (each armed for a window's activation box, weights and scale records), then every
        thread, and every CTA of a cluster (before any writes into another's shared memory), past a barrier."""
        b_bytes = cute.size_in_bytes(cutlass.Float8E4M3FN, cute.slice_(b_smem_staged, (None, None, 0)))
        pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=st.mbar.data_ptr(),
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.threads // 32),
            tx_count=b_bytes + self.w_bytes + self.s_bytes,
            cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
        )
        cute.arch.barrier()
        if cutlass.const_expr(self.clustered):
            cute.arch.cluster_arrive_relaxed()
            cute.arch.cluster_wait()
        return pipe

    @cute.jit
    def mma_operands(self, st, tiled_mma: cute.TiledMma, sB: cute.Tensor, tw: Int32):
        """A stage's weights as [word, thread, fragment (wg, subtile, half), stage] and its record words [word, stage],
        the token tiles as WGMMA B operands, and the thread's registers: A fragments of subtiles 0 and 1 (and as int32
        words), their window and main accumulators, the window being decoded (abuf[word 0..3, half, sub, slot],
        sbuf[sub, slot]: the record word of rows r0, r0 + 8)."""
        frags, swords = self.w_bytes // 2048, self.s_bytes // 4  # per stage: 16-byte fragments x 128 threads, records
        sW = st.sW.get_tensor(cute.make_layout((4, 128, frags, self.stages), stride=(1, 4, 512, self.w_bytes // 4)))
        sS = st.sS.get_tensor(cute.make_layout((swords, self.stages), stride=(1, swords)))
        thr_mma = tiled_mma.get_slice(tw)
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))  # (MMA, 1, 4 k32, stages)
        a_shape = thr_mma.partition_shape_A((64, WINDOW_K))
        c_shape = thr_mma.partition_shape_C((64, self.n))
        frag0 = cute.make_rmem_tensor(a_shape, cutlass.Float8E4M3FN)
        frag1 = cute.make_rmem_tensor(a_shape, cutlass.Float8E4M3FN)
        fw0 = cute.recast_tensor(frag0, Int32)
        fw1 = cute.recast_tensor(frag1, Int32)
        accw0 = cute.make_rmem_tensor(c_shape, Float32)
        accw1 = cute.make_rmem_tensor(c_shape, Float32)
        acc0 = cute.make_rmem_tensor(c_shape, Float32)
        acc1 = cute.make_rmem_tensor(c_shape, Float32)
        abuf = cute.make_rmem_tensor((4, 2, 2, self.prefetch), Int32)
        sbuf = cute.make_rmem_tensor((2, self.prefetch), Int32)
        return sW, sS, tCrB, frag0, frag1, fw0, fw1, accw0, accw1, acc0, acc1, abuf, sbuf

    @cute.jit
    def stage_addresses(self, wq: cute.Tensor, ws: cute.Tensor, st, half_at: Int32):
        """The bulk copies' bases: the window records in global memory (half tiles: the CTA's half of each), the
        stages in shared memory."""
        w_base = wq.iterator.toint() + Int64(half_at) * self.w_bytes
        s_base = ws.iterator.toint() + Int64(half_at) * self.s_bytes
        w_dst = st.sW.data_ptr().toint()
        s_dst = st.sS.data_ptr().toint()
        return w_base, s_base, w_dst, s_dst

    @cute.jit
    def load_first_weights(self, stream: tuple, prod: pipeline.PipelineState, total: Int32, warp_idx: Int32, lane):
        """The prologue's weights: the first stages - 1 loads' weights and scale records (no earlier kernel writes
        them, so they are asked for before any wait). stream: (pipeline, counts, offsets, load_coords' context, the
        bulk copies' bases, TMA atom, activations, stages)."""
        pipe, cnt, offs, lc, w_base, s_base, w_dst, s_dst, _, _, _ = stream
        if warp_idx == 0:  # the whole warp: the pipeline's arrive and the TMA issue elect one lane themselves
            pre = prod.clone()
            for i in cutlass.range_constexpr(self.stages - 1):
                if i < total:
                    tile, _, wx = self.load_coords(cnt, offs, lc, i, lane)
                    self.produce_weights(pipe, pre, tile, wx, w_base, s_base, w_dst, s_dst)
                    pre.advance()

    @cute.jit
    def wait_for_w1(self, sig: tuple, gen: Int32, timeout_ns: Int64, e: Int32, count: Int32, tidx: Int32):
        """W2, its first weights asked for: W1 finished expert e (expert_sync: the expert's W1_DONE tag) or the whole
        W1 grid (griddepcontrol.wait); then W2's dependents may launch."""
        if cutlass.const_expr(self.expert_sync):
            self.acquire_expert(sig, gen, timeout_ns, e, count, tidx)
        else:
            cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()

    @cute.jit
    def load_first_acts(
        self, stream: tuple, prod: pipeline.PipelineState, issued: Int32, total: Int32, warp_idx: Int32, lane: Int32
    ):
        """The prologue's activation boxes (after the waits for their producers), completing the first stages - 1
        loads. Returns (loads issued, producer state)."""
        pipe, cnt, offs, lc, _, _, _, _, tma_atom, tma_x, sB = stream
        if warp_idx == 0:
            for _ in cutlass.range_constexpr(self.stages - 1):
                if issued < total:
                    _, row0, wx = self.load_coords(cnt, offs, lc, issued, lane)
                    self.produce_acts(pipe, prod, tma_atom, tma_x, sB, row0, wx)
                    prod.advance()
                    issued += 1
        return issued, prod

    # ---------------------------------------------------------------- one piece: its scales, its windows
    @cute.jit
    def load_piece_scales(
        self, sxT: cute.Tensor, route_w: cute.Tensor, tidx: Int32, w_lo: Int32, prow: Int32, col_base: Int32, pcount
    ):
        """The piece's activation scales of every window (and W1's routing weights) into registers, stored into shared
        memory by stage_piece_scales after the piece's first barrier (the previous piece's readers are past it):
        loads between the shared stores were waited for one by one, a round trip per value, and the W1 epilogue
        waited for one routing weight per token column in series. Columns past the expert's rows read nothing (they
        may lie past the end of the rows): scale and routing weight 0."""
        nw, n_tile = self.nwk, self.n
        nsx = -(-nw * n_tile // self.threads)
        sxv = cute.make_rmem_tensor(nsx, Float32)
        for r in cutlass.range_constexpr(nsx):
            i = tidx + self.threads * r
            sxv[r] = Float32(0.0)
            if i < nw * n_tile:
                wi = i // n_tile
                c = i - wi * n_tile
                if col_base + c < pcount:
                    sxv[r] = sxT[w_lo + wi, prow + col_base + c]
        rwt = Float32(0.0)
        if cutlass.const_expr(self.is_w1):
            if tidx < n_tile:
                if col_base + tidx < pcount:
                    rwt = route_w[prow + col_base + tidx]
        return sxv, rwt

    @cute.jit
    def piece_unit_bits(self, sxv: cute.Tensor, sunit: cute.Tensor, warp_idx: Int32, lane: Int32) -> Int32:
        """The piece's unit t (tile_unit_bits), once every warp left its smallest non-zero activation scale beside its
        largest row scale in sunit; the barrier between is the piece's first."""
        sxmin = Int32(F32_INF)  # the smallest non-zero activation scale (NaN's bits are above +Inf's)
        for r in cutlass.range_constexpr(-(-self.nwk * self.n // self.threads)):
            b = f32_to_bits(sxv[r])
            if b != 0:
                sxmin = cutlass.min(sxmin, b)
        self.warp_reduce_bits(sxmin, False, sunit, warp_idx, lane)
        cute.arch.barrier()
        return self.tile_unit_bits(sunit)

    @cute.jit
    def stage_piece_scales(
        self, ssx: cute.Tensor, srw: cute.Tensor, sxv: cute.Tensor, rwt: Float32, tb: Int32, tidx: Int32
    ):
        """The piece's activation scales times its unit t, and W1's routing weights, into shared memory; the barrier
        after them is the piece's second (the window loop and the epilogue read them)."""
        nw, n_tile = self.nwk, self.n
        for r in cutlass.range_constexpr(-(-nw * n_tile // self.threads)):
            i = tidx + self.threads * r
            if i < nw * n_tile:
                wi = i // n_tile
                ssx[wi, i - wi * n_tile] = sxv[r] * bits_to_f32(tb)
        if cutlass.const_expr(self.is_w1):
            if tidx < n_tile:
                srw[tidx] = rwt
        cute.arch.barrier()

    @cute.jit
    def mainloop(
        self,
        stream: tuple,
        compute: tuple,
        wa: Int32,
        wb: Int32,
        prod: pipeline.PipelineState,
        cons: pipeline.PipelineState,
        prev: pipeline.PipelineState,
        issued: Int32,
        total: Int32,
        warp_idx: Int32,
        lane: Int32,
    ):
        """Windows [wa, wb) of the piece into the main accumulators (zeroed by the caller). Per window w: wait for
        window w - 1's WGMMAs, release its stage and refill it with the CTA's next load, promote w - 1; decode
        subtile 0 of w, issue its WGMMAs; decode subtile 1 while they run, issue its WGMMAs (two commit groups). The
        drain: the last window's WGMMAs, its stage released and refilled, its promotion. Returns (loads issued,
        previous, producer and consumer states). compute: (tiled MMA, B operands, the stages' weights and records,
        abuf, sbuf, the decode table's address, A fragments and their words, window and main accumulators, the
        staged activation scales, and the thread's stage block, subtile, thread in warpgroup, record word, column).
        The wait is unconditional and waits for all before any accumulator is read or fragment 0 rewritten: otherwise
        ptxas serialises every WGMMA (C7513 / C7515, e.g. for a wait under `if w > 0`, or a promote after
        wait_group(1); the compile test checks the waits per QGMMA). Decoding the next window's subtile 0 into a
        second fragment slot before this wait compiles unserialised, and measured no faster on the layer."""
        pipe, cnt, offs, lc, w_base, s_base, w_dst, s_dst, tma_atom, tma_x, sB = stream
        tiled_mma, tCrB, sW, sS, abuf, sbuf, lut_at, frag0, frag1, fw0, fw1, accw0, accw1, acc0, acc1, ssx = compute[
            :16
        ]
        wg_stage, sb, tw, swrd0, t0 = compute[16:]
        for w0 in cutlass.range(wa, wb, self.prefetch, unroll=1):
            for j in cutlass.range_constexpr(self.prefetch):
                w = w0 + j
                warpgroup.wait_group(0)
                if w > wa:
                    pipe.consumer_release(prev)
                    if warp_idx == 0:
                        if issued < total:
                            tile, row0, wx = self.load_coords(cnt, offs, lc, issued, lane)
                            self.produce_weights(pipe, prod, tile, wx, w_base, s_base, w_dst, s_dst)
                            self.produce_acts(pipe, prod, tma_atom, tma_x, sB, row0, wx)
                            prod.advance()
                            issued += 1
                    self.promote(acc0, accw0, ssx, w - 1, t0, 0)
                    if cutlass.const_expr(self.subs == 2):
                        self.promote(acc1, accw1, ssx, w - 1, t0, 1)
                pipe.consumer_wait(cons)
                self.load_window_smem(sW, sS, abuf, sbuf, cons.index, wg_stage, sb, tw, swrd0, j)
                self.decode_subtile(abuf, sbuf, lut_at, fw0, j, 0)
                warpgroup.fence()
                self.mma_window(tiled_mma, accw0, frag0, tCrB, cons.index)
                if cutlass.const_expr(self.subs == 2):
                    warpgroup.commit_group()
                    self.decode_subtile(abuf, sbuf, lut_at, fw1, j, 1)
                    warpgroup.fence()
                    self.mma_window(tiled_mma, accw1, frag1, tCrB, cons.index)
                warpgroup.commit_group()
                prev = cons.clone()
                cons.advance()
        warpgroup.wait_group(0)
        pipe.consumer_release(prev)
        if warp_idx == 0:
            if issued < total:
                tile, row0, wx = self.load_coords(cnt, offs, lc, issued, lane)
                self.produce_weights(pipe, prod, tile, wx, w_base, s_base, w_dst, s_dst)
                self.produce_acts(pipe, prod, tma_atom, tma_x, sB, row0, wx)
                prod.advance()
                issued += 1
        self.promote(acc0, accw0, ssx, wb - 1, t0, 0)
        if cutlass.const_expr(self.subs == 2):
            self.promote(acc1, accw1, ssx, wb - 1, t0, 1)
        return issued, prev, prod, cons

    # ---------------------------------------------------------------- ring mode: the bounded acquires and releases
    @cute.jit
    def acquire_ring(self, sig: tuple, ticket: Int32, timeout_ns: Int64, sflag: cute.Tensor, tidx: Int32, crank: Int32):
        """Ring mode: thread 0 waits for INUSE == ticket (this call holds the workspace), reads g = CGEN + 1 and waits
        for OFFS == g (the ring's offsets and counts of call g are written); every wait bounded, ended by a non-zero
        ERR, and recorded there on expiry. Where the words are already set, two round trips (ERR beside the INUSE
        acquire, CGEN beside OFFS under one fence): a CTA's start is on the critical path of a small call. Returns
        (ok, g) to every thread; without ring mode (1, 0). In a cluster (K splits, W1's half pairs; crank: the CTA's
        rank) the leader decides for every CTA of the cluster (read from its shared memory after a cluster barrier):
        CTAs of one cluster must agree on whether they work, or the split reduction's (the pair's exchange's) cluster
        barriers would not match."""
        ok = Int32(1)
        gen = Int32(0)
        if cutlass.const_expr(self.cfg.ring):
            inuse, cgen, offs_tag, err = sig[0], sig[1], sig[2], sig[3]
            if tidx == 0 and crank == 0:
                good = Int32(0)
                g = Int32(0)
                failed = ld_relaxed_u32(err, "gpu")
                held = ld_acquire_u32(inuse, "gpu")
                if failed == 0:
                    if held != ticket:
                        held = wait_until_eq(inuse, ticket, timeout_ns, "gpu", err)
                    if held == ticket:
                        # (after the INUSE acquire: CGEN is this call's; OFFS, if it equals g, is this call's too)
                        c = ld_relaxed_u32(cgen, "gpu")
                        seen = ld_relaxed_u32(offs_tag, "gpu")
                        fence_gpu()  # the acquire of both (a fence after strong loads)
                        g = c + 1
                        if seen != g:
                            seen = wait_until_eq(offs_tag, g, timeout_ns, "gpu", err)
                        if seen == g:
                            good = Int32(1)
                        else:
                            record_error(err, KIND_OFFS, 0, g, seen)
                    else:
                        record_error(err, KIND_BUSY, 0, ticket, held)
                sflag[0] = good
                sflag[1] = g
            if cutlass.const_expr(self.clustered):
                cute.arch.cluster_arrive()
                cute.arch.cluster_wait()
                if tidx == 0 and crank != 0:
                    at = sflag.iterator.toint()
                    sflag[0] = ld_cluster_u32(at, 0)
                    sflag[1] = ld_cluster_u32(at + 4, 0)
            cute.arch.barrier()
            ok = sflag[0]
            gen = sflag[1]
        return ok, gen

    @cute.jit
    def acquire_blocks(self, sig: tuple, gen: Int32, timeout_ns: Int64, row_base: Int32, count: Int32, tidx: Int32):
        """Ring mode, W1: every ring block holding this expert's rows carries L1_FULL == g (dispatch pulled its rows)
        before any activation box is loaded; one thread per block, bounded, recorded in ERR on expiry."""
        bm = self.cfg.ring_bm
        first = row_base // bm
        err = sig[3]
        for i in cutlass.range(tidx, (count + bm - 1) // bm, self.threads, unroll=1):
            tag = sig[4] + Int64(first + i) * 4
            seen = wait_until_eq(tag, gen, timeout_ns, "gpu", err)
            if seen != gen:
                record_error(err, KIND_BLOCK, first + i, gen, seen)
        cute.arch.barrier()

    @cute.jit
    def release_expert(self, sig: tuple, sflag: cute.Tensor, tidx: Int32):
        """Ring mode with expert_sync, W1: once this CTA's tiles of expert e are stored (every N tile), count the M tile
        as done in W1_DONE[e]; the expert's last M tile resets the count and releases the tag W1_DONE[e] = g that
        its W2 CTAs acquire. The epilogue's FP8 rows were written by the generic proxy and W2 reads them by TMA (the
        async proxy): every writer fences the proxies before the barrier that precedes the release. A CTA without
        rows (count 0, or a failed acquire) counts nothing: no W2 CTA of that expert waits. Thread 0 left g, e and the
        count (0 on the other CTAs of a K-split cluster) in sflag[1..3], the W1_DONE address in sflag[4..5], the
        expert's tiles (M tiles; with stream_k M x N tiles, each counted once) in sflag[6]."""
        cute.arch.fence_proxy("async.global")
        cute.arch.barrier()
        if tidx == 0 and sflag[3] > 0:
            gen = sflag[1]
            base = (Int64(sflag[5]) << 32) | (Int64(sflag[4]) & 0xFFFFFFFF)
            done = base + Int64(2 * sflag[2]) * 4
            fence_gpu()
            # acq_rel: the RMWs on one word form a release sequence, so the last one sees every earlier M tile's rows
            if atom_add_u32(done, 1, "acq_rel", "gpu") == sflag[6] - 1:
                st_u32(done, 0)  # ordered before the tag: the next call's W1 counts from 0 again
                st_release_u32(done + 4, gen, "gpu")

    @cute.jit
    def acquire_expert(self, sig: tuple, gen: Int32, timeout_ns: Int64, e: Int32, count: Int32, tidx: Int32):
        """Ring mode with expert_sync, W2: wait (bounded, failing into ERR) until W1 finished expert e in call g
        (W1_DONE[e] tag == g), then order this CTA's later TMA loads (async proxy) after that acquire. Replaces the
        grid-wide griddepcontrol.wait: an expert's W2 starts while other experts' W1 tiles still run."""
        if tidx == 0 and count > 0:
            seen = wait_until_eq(sig[5] + Int64(2 * e + 1) * 4, gen, timeout_ns, "gpu", sig[3])
            if seen != gen:
                record_error(sig[3], KIND_W1, e, gen, seen)
        cute.arch.barrier()
        cute.arch.fence_proxy("async.global")

    # ---------------------------------------------------------------- the loads: weights by bulk copy, tokens by TMA
    @cute.jit
    def produce_weights(
        self,
        pipe: pipeline.PipelineTmaAsync,
        prod: pipeline.PipelineState,
        tile: Int32,
        w: Int32,
        w_base: cutlass.Int64,
        s_base: cutlass.Int64,
        w_dst: Int32,
        s_dst: Int32,
    ):
        """A load, part 1: acquire the next stage (arming its mbarrier for all of its bytes) and bulk-copy window w of
        tile (expert x M tile) `tile` (its weights and scale records; load_coords) into it. Part 2 is produce_acts.
        Warp 0 runs both whole (the arrive and the TMA elect one lane themselves); the caller advances `prod` (a rebind
        the DSL must see in the caller's branch)."""
        pipe.producer_acquire(prod)
        bar = pipe.producer_get_barrier(prod).toint()
        with cute.arch.elect_one():
            stage = prod.index
            w_src = w_base + (cutlass.Int64(tile) * self.windows + w) * WINDOW_WEIGHT_BYTES
            # (each tile's windows of records are followed by its row scales)
            s_src = s_base + cutlass.Int64(tile) * (tile_scale_words(self.windows) * 4)
            s_src += cutlass.Int64(w) * WINDOW_SCALE_BYTES
            hint = self.cfg.evict_first
            # racecheck-ordered: racecheck reports these bulk copies (a write by this thread) against the consumers'
            # reads of the stage in load_window_smem (WAR, the stage's previous window). Ordered by the stage's empty
            # mbarrier: every consumer warp arrives (consumer_release, release semantics) only after its reads, and
            # producer_acquire waits on that barrier (try_wait, acquire) before this copy is issued; the RAW side by
            # the full mbarrier the copy completes (complete_tx) and consumer_wait waits on. racecheck does not model
            # mbarriers (memcheck / synccheck are clean, values exact in every test)
            bulk_copy_g2s(w_dst + stage * self.w_bytes, w_src, self.w_bytes, bar, hint)
            # racecheck-ordered: as above (the stage's empty / full mbarriers)
            bulk_copy_g2s(s_dst + stage * self.s_bytes, s_src, self.s_bytes, bar, hint)

    @cute.jit
    def produce_acts(
        self,
        pipe: pipeline.PipelineTmaAsync,
        prod: pipeline.PipelineState,
        tma_atom: cute.CopyAtom,
        tma_x: cute.Tensor,
        sB: cute.Tensor,
        row0: Int32,
        w: Int32,
    ):
        """A load, part 2: the (N, 128) activation box of rows [row0, row0 + N) at window w into the (acquired) stage
        by TMA (row0 is a multiple of 8, not of N: the domain offset moves the box's origin)."""
        gX = cute.local_tile(cute.domain_offset((row0, 0), tma_x), (self.n, WINDOW_K), (None, None))
        tXsX, tXgX = cpasync.tma_partition(
            tma_atom, 0, cute.make_layout(1), cute.group_modes(sB, 0, 2), cute.group_modes(gX, 0, 2)
        )
        bar = pipe.producer_get_barrier(prod)
        cute.copy(tma_atom, tXgX[(None, 0, w)], tXsX[(None, prod.index)], tma_bar_ptr=bar)
        pipe.producer_commit(prod)

    # ---------------------------------------------------------------- a window: decode, WGMMA, promotion
    @cute.jit
    def load_window_smem(
        self,
        sW: cute.Tensor,
        sS: cute.Tensor,
        abuf: cute.Tensor,
        sbuf: cute.Tensor,
        stage: Int32,
        wg: Int32,
        sb: Int32,
        tw: Int32,
        swrd0: Int32,
        slot: cutlass.Constexpr,
    ):
        """This thread's weights and scale words of the window in `stage` (16-byte shared loads, conflict-free): its
        subtiles sb, sb + 1 (2 warpgroups: sb = 0) or sb (4 warpgroups) of the warpgroup's rows."""
        for s in cutlass.range_constexpr(self.subs):
            for h in cutlass.range_constexpr(2):
                # racecheck-ordered: after consumer_wait (full mbarrier), before consumer_release (produce_weights)
                cute.autovec_copy(sW[None, tw, wg * 4 + (sb + s) * 2 + h, stage], abuf[None, h, s, slot])
            # racecheck-ordered: as the weights above
            sbuf[s, slot] = sS[swrd0 + 32 * (sb + s), stage]

    @cute.jit
    def decode_subtile(
        self,
        abuf: cute.Tensor,
        sbuf: cute.Tensor,
        lut_at: Int32,
        fw: cute.Tensor,
        slot: cutlass.Constexpr,
        s: cutlass.Constexpr,
    ):
        """Subtile s of the window in `slot`: FP4 -> E4M3 A fragment (per-group LUT of its exponent relative to the
        row's reference f). lut_at: the pair table's shared address. Per pair of k32 steps (2h, 2h + 1), row by row
        (r0, then r0 + 8: one table entry in registers at a time): the row's entry (LUT[dd] of both steps, at byte
        offset 16 x pair 2u + h of the record word: one AND, or a shift / rotation and an AND) in one 16-byte load,
        then the row's 16 codes of the two steps."""
        for h in cutlass.range_constexpr(2):
            for u in cutlass.range_constexpr(2):
                b = 2 * u + h  # the record word's pair b, 16 x it at bits 4-11 of the word rotated right by 8 b
                off = sbuf[s, slot] & 0xFF0
                if cutlass.const_expr(b == 3):
                    off = rotl32(sbuf[s, slot], 8) & 0xFF0
                elif cutlass.const_expr(b > 0):
                    off = (sbuf[s, slot] >> (8 * b)) & 0xFF0
                tab = ld_shared_v4(lut_at + off)
                for sh in cutlass.range_constexpr(2):
                    step = 2 * h + sh
                    lo, hi = decode8(abuf[2 * sh + u, h, s, slot], tab[2 * sh], tab[2 * sh + 1])
                    fw[4 * step + u] = lo  # a0 / a1 (row r0 / r0 + 8), codes 0-3
                    fw[4 * step + 2 + u] = hi  # a2 / a3, codes 4-7

    @cute.jit
    def mma_window(
        self,
        tiled_mma: cute.TiledMma,
        accw: cute.Tensor,
        frag: cute.Tensor,
        tCrB: cute.Tensor,
        stage: Int32,
    ):
        """accw = frag (64 x 128, registers) @ the stage's token tile (shared memory): 4 k32 WGMMAs (uncommitted)."""
        for kb in cutlass.range_constexpr(4):
            tiled_mma.set(warpgroup.Field.ACCUMULATE, kb != 0)
            cute.gemm(tiled_mma, accw, frag[(None, None, kb)], tCrB[(None, None, kb, stage)], accw)

    @cute.jit
    def promote(
        self,
        acc: cute.Tensor,
        accw: cute.Tensor,
        ssx: cute.Tensor,
        w: Int32,
        t0: Int32,
        s: cutlass.Constexpr,
    ):
        """acc += accw * sx[token] for window w, subtile s (token scales from shared memory: ssx)."""
        for i in cutlass.range_constexpr(cute.size(acc)):
            v0, q = i % 2, i // 4
            acc[i] = acc[i] + accw[i] * ssx[w, 2 * t0 + v0 + 8 * q]

    # ---------------------------------------------------------------- the accumulators' unit, the rows' scales
    @cute.jit
    def load_row_scale(self, ws: cute.Tensor, tile: Int32, half_at: Int32, tidx: Int32) -> Int32:
        """Thread tidx's row of the CTA's rows of `tile` (expert x M tiles + M tile): its 2^(f - 127) as fp32 bits
        (prepack: a tile's row scales follow its windows' records); 0 for threads past the CTA's rows."""
        v = Int32(0)
        if tidx < self.rows:
            at = tile * tile_scale_words(self.windows) + self.windows * RECORD_WORDS + half_at * self.rows
            v = ws[at + tidx]
        return v

    @cute.jit
    def warp_reduce_bits(self, v: Int32, largest: cutlass.Constexpr, sunit: cute.Tensor, warp_idx: Int32, lane: Int32):
        """The warp's largest (largest: sunit[warp]) or smallest (else: sunit[warps + warp]) of v, fp32 bits of
        non-negative values (which order as their bits). Every thread of the warp calls it."""
        at = warp_idx
        if cutlass.const_expr(not largest):
            at = self.threads // 32 + warp_idx
        v = cute.arch.warp_redux_sync(v, "max" if largest else "min")  # (one REDUX instruction: sm_80+)
        if lane == 0:
            sunit[at] = v

    @cute.jit
    def tile_unit_bits(self, sunit: cute.Tensor) -> Int32:
        """The bits of the piece's unit t (read after the barrier behind warp_reduce_bits): the CTA's largest row scale,
        raised to 2^-149 / the piece's smallest non-zero activation scale, at most 1 (powers of two: exact). The
        accumulators then hold a row in units of 2^(f - 127) / t, i.e. its true values times t / 2^(f - 127): at most
        the tile's spread of row exponents above them, unless t was raised (a token of the piece with sx below
        2^-149 / the largest row scale: activations at fp32's floor), no staged scale sx t underflows (sx t >= 2^-149)
        and none grows (t <= 1)."""
        warps = self.threads // 32
        rmax = Int32(F32_MIN_NORMAL)
        amin = Int32(F32_INF)
        for i in cutlass.range_constexpr(warps):
            rmax = cutlass.max(rmax, sunit[i])
            amin = cutlass.min(amin, sunit[warps + i])
        # amin = 2^e: its exponent field - 127, or for a subnormal (2^(j - 149)) j from the integer's own fp32 value
        e = (amin >> 23) - 127
        if amin < F32_MIN_NORMAL:
            e = (f32_to_bits(Float32(amin)) >> 23) - 127 - 149
        lo = Int32(0)  # the bits of 2^(-149 - e), where that is a normal number (else t's other bounds decide)
        if -22 - e > 0:
            lo = (-22 - e) << 23
        return cutlass.min(cutlass.max(rmax, lo), Int32(F32_ONE))

    @cute.jit
    def scale_rows(self, acc: cute.Tensor, srs: cute.Tensor, r0: Int32):
        """acc *= 2^(f - 127) / t of its rows (r0 and r0 + 8 of the CTA's rows, the piece's scales in shared memory:
        srs): exact, a power of two per row, once per piece after its last window."""
        for u in cutlass.range_constexpr(2):
            rs = srs[r0 + 8 * u]
            for i in cutlass.range_constexpr(cute.size(acc)):
                if cutlass.const_expr((i // 2) % 2 == u):
                    acc[i] = acc[i] * rs


def fake_operands(mode: str, m: int, k: int):
    """The kernel's tensor operands (the module docstring's Inputs) as fakes for an offline compile, every row extent
    its own run-time symbol."""
    f8 = cutlass.Float8E4M3FN
    nw = k // WINDOW_K
    dyn = cute.sym_int
    ops = [
        make_fake_compact_tensor(Int32, (dyn(), 128, 4), stride_order=(2, 1, 0), assumed_align=16),
        make_fake_compact_tensor(Int32, (dyn(),), assumed_align=16),
        make_fake_compact_tensor(f8, (dyn(), k), stride_order=(1, 0), assumed_align=16),
        make_fake_compact_tensor(Float32, (nw, dyn()), stride_order=(1, 0), assumed_align=16),
        make_fake_compact_tensor(Int32, (dyn(),), assumed_align=4),
        make_fake_compact_tensor(Int32, (dyn(),), assumed_align=4),
        make_fake_compact_tensor(Int32, (LUT_PAIR_WORDS,), assumed_align=16),
    ]
    if mode == "w1":  # the W1 epilogue's operands, as the sm103 kernels take them too
        ops += list(fake_epilogue_args("w1", m))
    else:
        ops += [
            make_fake_compact_tensor(Int32, (dyn(),), assumed_align=4),
            make_fake_compact_tensor(Int32, (dyn(), 3), stride_order=(1, 0), assumed_align=4),
            make_fake_compact_tensor(Int64, (dyn(),), assumed_align=8),
        ]
    return ops


def compile_grouped(kern: GroupedGemmSm90Base, arch: str = "sm_90a"):
    """Compile one variant against fake tensors (dynamic expert count and row count). Refuses a variant the kernel
    would run wrong (e.g. a K split or unroll that does not divide the windows would silently skip some)."""
    mode, m, k, cfg = ("w1" if kern.is_w1 else "w2"), kern.m, kern.k, kern.cfg
    why = can_implement(m, k, 1, cfg, splits=kern.splits, half=kern.half)
    if why:
        raise ValueError(f"sm90 {mode}: {why}")
    sig = tuple(Int64(0) for _ in range(sig_words(mode, cfg)))
    return compile_kernel(
        kern,
        *fake_operands(mode, m, k),
        sig,
        Int32(1),
        Int64(0),
        Int32(1),
        Int32(1),
        Int32(0),
        crt.make_fake_stream(),
        arch=arch,
        name=f"grouped_{mode}_m{m}_k{k}_n{cfg.n_tile}_{kern.schedule}{'_ring' if cfg.ring else ''}"
        f"{'_clamp' if cfg.activation == 'swiglu_clamped' else ''}{'_bias' if cfg.bias else ''}"
        f"{'_ef' if cfg.evict_first else ''}",
    )
