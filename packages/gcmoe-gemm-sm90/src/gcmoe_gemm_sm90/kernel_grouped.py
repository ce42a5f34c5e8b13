"""Grouped FP8-activation x MXFP4-weight GEMMs for sm_90a: W1 (+ SwiGLU, routing weight, FP8 requant) and W2 (+ row
scatter), one expert per grid column, register-A WGMMA with the FP4 -> E4M3 decode in registers.

    for each expert e, CTA tile mt (256 weight rows), N tile nt of the expert's tokens:
        acc[256, N] = 2^(f - 127) * sum_w  sx[:, w] * (decode(Wq[e, mt, w]) @ X[rows, 128 w : 128 w + 128]^T)
                      (f: each weight row's reference exponent; decode: E4M3 relative to it, prepack's row scales)
    W1 epilogue: h = silu(acc[gate rows]) * acc[up rows] * route_w -> FP8 E4M3 per token per 128 columns (+ scale)
    W2 epilogue: rank src[row, 0]'s output rows: (comb[src[row, 0]] as bf16 [*, M])[dst[row], 256 mt + m] =
                 bf16(acc[m, token]) — comb is the combine-buffer peer table (one entry: a local output)
    compile-time epilogue options (gpt-oss; off by default, and then not a single instruction of them is emitted):
      cfg.activation = "swiglu_clamped": gate = min(gate, limit), up = clamp(up, -limit, limit),
                 h = gate / (1 + exp(-alpha gate)) * (up + 1) * route_w   (alpha, limit compiled in)
      cfg.bias:  W1 adds b13[e, c] / b13[e, I + c] to gate / up before the activation (fp32); W2 stores
                 bf16(acc + route_w[row] * b2[e, m]): h carries the routing weight already, so the row is the
                 routing weight times the biased expert output. W2 reads route_w of its rows from the same array
                 W1 read it from (in ring mode the ring rows' weights, written by dispatch before its L1_FULL tags,
                 which W1 acquired before it released W1_DONE / finished, which W2 waited for)

Threads (cfg.warpgroups): 2 warpgroups, warpgroup j owns rows [128 j, 128 j + 128) of the tile as 2 WGMMA subtiles of
64 rows; or 4 warpgroups (N 32-64: half the accumulator registers per thread, 16 warps per SM at one CTA per SM),
warpgroup q owns subtile q % 2 of those rows of j = q // 2. The prepacked fragments and the epilogues' row / column
mapping are the same in both.
Half tiles (cfg.w1_half / cfg.w2_half): a CTA of 2 warpgroups takes 128 of the tile's rows (grid x: two CTAs per M tile,
j = x % 2; warpgroup q its subtile q: the 4-warpgroup mapping), so two CTAs share an SM where one whole-tile CTA held it
alone and one streams while another starts or stores; a stage holds that half's 8 KB of weights and 256 B of scale
records. W1's halves run as a cluster pair: a token's FP8 scale covers the tile's 128 intermediate columns, 64 in each
half, so each half sends its per-token maxima into the partner's shared memory and both scale by the larger (one cluster
barrier per N tile; the pair's leader decides the ring acquire for both).
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
2^(f - 127) multiplies the main accumulator once, after the tile's (piece's) last window. The accumulator's unit: the
staged activation scales are multiplied by a power of two t per piece and the row scales divided by it (tile_unit_bits:
t = the CTA's largest row scale, raised so that no staged scale underflows, at most 1) — the same bits wherever nothing
over- or underflows, and the range of the true values (a row held in units of its 2^(f - 127), -14 .. -8 for real
weights, overflowed up to 2^14 sooner than the reference).

Per window: one unconditional wait_group(0) for the previous window, release + refill, promote; decode subtile 0, its
WGMMAs; decode subtile 1 while those run (overlap), its WGMMAs. ptxas serialises every WGMMA (a wait after each) if a
wait is conditional, or an accumulator is read after a partial wait_group(1) (C7513 / C7515): the compile test checks.

K splits (cfg.splits, a cluster of S CTAs along z): CTA ks streams windows [ks nw/S, (ks + 1) nw/S); the others push
their fp32 partial accumulators into the leader's shared memory (st.shared::cluster), one cluster barrier, the leader
adds them in split order (deterministic) and runs the epilogue.
PDL (cfg.pdl): W1 waits for its producer (griddepcontrol.wait) before reading anything; W2 bulk-copies its first
stages' weights (which no earlier kernel writes) before waiting for W1, so its CTAs stream weights in W1's tail. Both
let their dependents launch right after their own wait (so a dependent may read what was written before its producer).
In ring mode W1 does not wait for its producer at all (gcmoe-comm's dispatch, which lets W1 launch once every CTA has
ranked the routing; the last of them then releases OFFS): what it reads from dispatch is behind the OFFS / L1_FULL
tags. W1 lets W2 launch once
every W1 CTA has read its row layout, so a W1 CTA without rows touches nothing of the call afterwards and every other
one is awaited by W2: a finished W2 grid leaves no W1 or dispatch CTA that can still read or write this call's
state (the launch after the layer's finalize, which waits for W2, never races them).

Ring mode (cfg.ring, the operator's path beside gcmoe-comm's dispatch on the other partition): each CTA first
acquires INUSE == ticket (its call holds the workspace), reads g = CGEN + 1 and acquires OFFS == g (dispatch wrote
the ring's offsets and counts of call g) — every wait bounded by timeout_ns and ended early by a non-zero ERR word,
a failed wait recorded there (gcmoe_core.signals kinds) and the CTA then doing nothing. W1 acquires L1_FULL[b] == g of
every ring block of its expert after issuing its first weight stages and before its first activation box; W2 reads
ERR again before its stores and stores nothing once it is set. With cfg.expert_sync, W2 does not wait for the whole
W1 grid: each W1 M tile of expert e, once stored, adds 1 to W1_DONE[e].count (acq_rel); the expert's last one resets
the count and releases W1_DONE[e].tag = g; a W2 CTA of expert e acquires that tag (bounded) before its first
activation box, so with PDL an expert's W2 runs beside the other experts' W1 tail. The words' addresses come by value
(sig: INUSE, CGEN, OFFS, ERR, L1_FULL, W1_DONE), so this package knows nothing of the workspace layout.

Inputs (see ops.py for how they are made):
    wq     int32 [E*MT*W*8, 128, 4]   prepacked weights (prepack.PackedSm90.data)
    ws     int32 [E*MT*(W*128 + 256)]  per tile: its windows' record words, its row scales (PackedSm90.scales)
    x      fp8   [R, K]                expert-sorted token rows, each expert's rows padded to a multiple of N
    sxT    fp32  [W, R]                activation scales, transposed (powers of two)
    offs   int32 [E + 1]               padded row offsets; count = cnt[e]
    cnt    int32 [E]                   valid rows of each expert
    lut    int32 [256, 4]              the decode tables by pairs of k32 steps (prepack.lut_pair_words)
    W1: rw fp32 [R] routing weight per row; hq uint8 [R, M/2] FP8 intermediate; hsT fp32 [M/256, R] its scales
    W2: dst int32 [R] output row per input row; src int32 [R, 3] its (rank, token, slot); comb int64 [P] the output
        buffer (bf16 [*, M]) of every rank
Grid [M tiles, rows, K splits]: with cfg.active_first, grid row y runs the y-th expert that has rows (a ballot over cnt
in every warp), so the CTAs of empty experts launch after all CTAs with work (1.04-1.12x at one token per rank, where
75-80 % of the experts are empty; 0.97-1.0x when nearly all have rows: sm90-grouped-v7); else row y runs expert y.
rows (the `ctas` argument) R: E, or with active_first any number: a CTA of grid row y runs the rows y, y + R,
y + 2 R, ... below the count of experts with rows (the stages' mbarriers re-armed between rows), so every expert with
rows is run whatever R is. The caller passes its expected bound on the experts that have rows (the layer: its own
call's bucket x top_k routed + the shared experts, at least one wave of CTAs: gcmoe's Sm90Plan.grid_rows), so the
CTAs of empty experts never launch and each CTA normally runs one row: at one token per rank they were 80 % of a
world-size-1 grid (97 % of a V4-Flash P = 2 rank's: 129 rows for 7 experts with rows), and where W1 runs K-split
clusters that fill the SM slots they queued behind the working CTAs to the end of W1, holding back W2's programmatic
launch (the layer 1.11x faster for DeepSeek-V4-Flash at T = 1, 1.04x for DeepSeek-V3 at T = 2; H200, 2026-12-01).
Routing that brings more experts with rows than the bound costs extra rows on the same CTAs, never a missed expert.
first (rotation): grid row y runs expert first + y (mod E), and active-first rows count the experts with rows in
that order, so the experts the caller expects to take longest launch first: the layer puts its shared experts
(every token of the rank: more N tiles than any routed expert from T = 16 on) at row 0, where they used to launch
last and run their N-tile passes after all others had finished (the layer 1.04-1.21x faster at T = 32-256; H200,
2026-12-01, docs/benchmarks/layer-h200-2026-12-01.md).
stream_k (W1): grid [ctas] (one per SM slot: occupancy x SMs); the tiles of every expert with rows (experts
ascending, N tiles, M tiles: locate_tile) times their windows in units of `prefetch` windows, split in equal ranges
over the CTAs; a CTA's pieces are the tiles its range touches (the first SK_TABLE kept in shared memory); a piece
with only part of a tile's windows stores its fp32 partials (scratch sig[6]) and counts on the counter of the tile's
last CTA (sig[7]); the last arriver adds the pieces in CTA order and runs the epilogue (reduce_pieces), and with
expert_sync each (N tile, M tile) counts once in W1_DONE.

Debug: CUTE_DSL_KEEP=sass,ptx and CUTE_DSL_DUMP_DIR keep the generated code.
"""

# No `from __future__ import annotations` in kernel files: the DSL reads the annotations as live objects.
from functools import cache

from gcmoe_core.cutedsl import compile_kernel, cutlass_modules
from gcmoe_core.device_ops import (
    atom_add_u32,
    fence_gpu,
    ld_acquire_u32,
    ld_relaxed_u32,
    ld_u32,
    record_error,
    st_bf16,
    st_release_u32,
    st_u32,
    wait_until_eq,
)
from gcmoe_core.kernel_helpers import (
    F32_ONE,
    bits_to_f32,
    bulk_copy_g2s,
    cvt_e4m3x2,
    f32_to_bits,
    fake_epilogue_args,
    fmax_nan,
    fmin_nan,
    fp8_pow2_exponent,
    ld_cluster_u32,
    ld_shared_v4,
    rotl32,
    st_cluster_f32,
)
from gcmoe_core.signals import KIND_BLOCK, KIND_BUSY, KIND_OFFS, KIND_W1

from .config import LUT_PAIR_BYTES, WINDOW_SCALE_BYTES, WINDOW_WEIGHT_BYTES, Sm90Config, can_implement, half_stages
from .decode_ptx import DECODE8_SPLIT_SIGN_PTX
from .kernel_decode import decode8
from .prepack import RECORD_WORDS, tile_scale_words

cutlass, cute = cutlass_modules()
import cuda.bindings.driver as cuda  # noqa: E402
import cutlass.pipeline as pipeline  # noqa: E402
import cutlass.utils as utils  # noqa: E402
import cutlass.utils.hopper_helpers as sm90_utils  # noqa: E402
from cutlass import runtime as crt  # noqa: E402
from cutlass.cute.nvgpu import cpasync, warpgroup  # noqa: E402
from cutlass.cute.runtime import make_fake_compact_tensor  # noqa: E402

Int32, Int64, Float32 = cutlass.Int32, cutlass.Int64, cutlass.Float32
WINDOW_K = 128
TILE_M = 256
LUT_PAIR_WORDS = LUT_PAIR_BYTES // 4  # the pair table (prepack.lut_pair_words): 256 entries of 16 bytes
EPI_COLS = 4  # W2 epilogue: token columns whose output row addresses are loaded before their stores
F32_MIN_NORMAL, F32_INF = 0x00800000, 0x7F800000  # fp32 bit patterns of 2^-126, +Inf (F32_ONE: 1)
F32_INV_POW2 = 254 << 23  # F32_INV_POW2 - bits(2^k) = bits(2^-k) for a normal power of two 2^k (|k| <= 126)
SK_TABLE = 8  # stream_k: tiles per CTA whose coordinates are kept in shared memory (more: located per load)
SIG_WORDS = 8  # by-value addresses: ring mode's INUSE, CGEN, OFFS, ERR, L1_FULL, W1_DONE; stream_k's partials, counters


def sig_words(mode: str, cfg: Sm90Config) -> int:
    """By-value address words of a variant: SIG_WORDS, then with cfg.bias the epilogue's fp32 operands (W1: b13
    [E, 2I]; W2: b2 [E, M], route_w [R]), so the default variants keep today's parameter list."""
    return SIG_WORDS + ((1 if mode == "w1" else 2) if cfg.bias else 0)


class GroupedGemmSm90:
    """One compiled variant: mode 'w1' or 'w2', weight rows M, reduction K, config."""

    def __init__(self, mode: str, m: int, k: int, cfg: Sm90Config):
        if mode not in ("w1", "w2"):
            raise ValueError(f"mode must be 'w1' or 'w2', got {mode!r}")
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
        # cfg.w2_half (W2) / cfg.w1_half (W1): a CTA takes half of an M tile (grid x: 2 per M tile, rows 128 (x % 2)
        # ..), warpgroup q its subtile q (as 4 warpgroups do), two CTAs per SM; its stages hold that half's weights and
        # scale records. W1's two halves form a cluster: each token's FP8 scale spans the tile's 128 intermediate
        # columns, 64 in each half, so the halves exchange their column maxima through shared memory (epilogue_w1)
        self.half = cfg.w1_half if self.is_w1 else cfg.w2_half
        self.pair = self.half and self.is_w1
        self.clustered = self.splits > 1 or self.pair  # K-split clusters along z, W1's half pairs along x
        self.occupancy = cfg.occupancy
        self.w_bytes, self.s_bytes = WINDOW_WEIGHT_BYTES, WINDOW_SCALE_BYTES  # per stage
        if self.half:
            self.subs, self.threads, self.occupancy = 1, 256, 2
            self.stages = half_stages(cfg, k)
            self.w_bytes, self.s_bytes = WINDOW_WEIGHT_BYTES // 2, WINDOW_SCALE_BYTES // 2
        self.rows = TILE_M // 2 if self.half else TILE_M  # the tile's rows this CTA computes
        self.expert_sync = cfg.ring and cfg.expert_sync  # W1_DONE tags per expert instead of W2's grid-wide wait
        self.stream_k = cfg.stream_k and self.is_w1  # W1: a grid of `ctas` CTAs over equal window ranges
        self.clamped = cfg.activation == "swiglu_clamped"  # (gpt-oss) W1's clamped SwiGLU
        self.bias = cfg.bias  # W1 + b13, W2 + route_w * b2 (addresses: sig[8], sig[9])

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
        self.kernel(
            wq,
            ws,
            tma_atom,
            tma_x,
            sxT,
            offs,
            cnt,
            lut,
            ep_a,
            ep_b,
            ep_c,
            sig,
            ticket,
            timeout_ns,
            num_experts,
            first,
            tiled_mma,
            b_smem_staged,
        ).launch(
            # ctas: stream_k's CTAs, else the grid rows (see the module docstring: Grid)
            grid=[ctas, 1, 1] if self.stream_k else [self.m_tiles * (2 if self.half else 1), ctas, self.splits],
            block=[self.threads, 1, 1],
            cluster=[2, 1, 1] if self.pair else ([1, 1, self.splits] if self.splits > 1 else None),
            use_pdl=self.cfg.pdl,
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
        # rows only: see the module docstring, Grid); every other config runs one row
        rows = cute.arch.grid_dim()[1]
        y = ey
        more = Int32(1)
        while more != 0:
            cute.arch.barrier()  # the previous row's readers of the stages' mbarriers are done before they re-arm
            more = self.body(args, first, tiled_mma, b_smem_staged, mt, y, rows, ks, st)
            y = y + rows

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
        """One row's work of a CTA: M tile mt (or stream_k's CTA index) of grid row ey of the grid's R = rows, K split
        ks, on the shared memory struct st; args: the kernel's operands wq .. num_experts. Returns 1 where the
        kernel's loop goes on to row ey + R (active-first rows, and more experts with rows than ey + R), else 0."""
        wq, ws, tma_atom, tma_x, sxT, offs, cnt, lut, ep_a, ep_b, ep_c, sig, ticket, timeout_ns, num_experts = args
        n_tile, depth = self.n, self.prefetch
        nw = self.nwk  # windows of this CTA: [w_lo, w_lo + nw) of the tile's K (all of them without K splits)
        tidx, _, _ = cute.arch.thread_idx()
        w_lo = ks * nw
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        # warpgroup q: rows [128 wg, 128 wg + 128) of the tile; with 4 warpgroups only its subtile sb of them
        wg = tidx // 128 if self.wgs == 2 else tidx // 256
        sb = 0 if self.wgs == 2 else (tidx // 128) % 2  # first subtile (of 2) of the warpgroup's rows
        wg_stage = wg  # the stage's 128-row block the thread reads (half tiles: 0, the stage holds only the CTA's)
        half_at = Int32(0)  # half tiles: the half of the M tile the CTA takes (0: rows 0-127, 1: rows 128-255)
        crank = ks  # rank in the cluster: the K split, or W1's half (pairs along x)
        if cutlass.const_expr(self.half):
            wg = mt % 2  # (the tile's rows 128 wg .., as with 4 warpgroups; the stage holds only those)
            sb = tidx // 128
            wg_stage = Int32(0)
            half_at = wg
            if cutlass.const_expr(self.pair):
                crank = wg
            mt = mt // 2
        tw = tidx % 128
        lane = tidx % 32
        g = lane // 4
        t0 = lane % 4
        wwarp = tw // 32  # warp within the warpgroup

        slut = st.lut.get_tensor(cute.make_layout(LUT_PAIR_WORDS))
        lut_at = slut.iterator.toint()  # (decode_subtile's vector loads)
        srs = st.srs.get_tensor(cute.make_layout(self.rows))  # the row scales 2^(f - 127) / t of the CTA's rows
        sunit = st.sunit.get_tensor(cute.make_layout(2 * (self.threads // 32) + 2))  # (tile_unit_bits)
        t_at = 2 * (self.threads // 32)  # sunit[t_at + piece % 2]: the piece's t (fp32 bits)
        sflag = st.flag.get_tensor(cute.make_layout(8))
        sred = st.red.get_tensor(cute.make_layout((n_tile, self.threads // 32)))  # [token column, warp]
        ssx_layout = cute.make_layout((nw, n_tile), stride=(n_tile, 1))
        ssx = st.ssx.get_tensor(ssx_layout)  # [window, token column] of the current N tile
        srw = st.srw.get_tensor(cute.make_layout(n_tile if self.is_w1 else 1))  # W1: [token column]
        xchg = st.xchg.get_tensor(
            cute.make_layout((2, n_tile) if self.pair else 1, stride=(n_tile, 1) if self.pair else 1)
        )
        sB = st.sB.get_tensor(b_smem_staged.outer, swizzle=b_smem_staged.inner)
        skt = st.skt.get_tensor(cute.make_layout((5, SK_TABLE if self.stream_k else 1)))

        if cutlass.const_expr(self.cfg.pdl and self.is_w1 and not self.cfg.ring):
            # programmatic dependent launch: W1's rows, scales and counts may come from the kernel just before it
            # (ring mode acquires them by their tags instead)
            cute.arch.griddepcontrol_wait()
        # ring mode: this call holds the workspace and dispatch published the ring's layout (sflag[0]: ok, [1]: g)
        ok, gen = self.acquire_ring(sig, ticket, timeout_ns, sflag, tidx, crank)
        # the CTA's work as pieces (see work_piece): the N tiles of one (expert, M tile), or with stream_k a range of
        # the windows of all tiles; the loads of the pieces in order (see load_coords)
        e = Int32(0)
        count = Int32(0)
        row_base = Int32(0)
        npieces = Int32(0)
        total = Int32(0)  # the CTA's pipeline loads (one window each)
        u0 = Int32(0)  # stream_k: the CTA's units (depth windows each) [u0, u1) of `units`
        u1 = Int32(0)
        units = Int32(0)
        more = Int32(0)  # (see the docstring)
        if cutlass.const_expr(self.stream_k):
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
            # the table of the CTA's first tiles (each warp locates them, thread 0 writes; read after the barrier
            # below): what the loads and pieces of those tiles read instead of locating them again
            for p in cutlass.range(cutlass.min(npieces, SK_TABLE), unroll=1):
                pe, pnt, pmt, _ = self.locate_tile(cnt, u0 // (nw // depth) + p, num_experts, lane)
                if tidx == 0:
                    skt[0, p] = pe * self.m_tiles + pmt
                    skt[1, p] = offs[pe] + pnt * n_tile
                    skt[2, p] = pe
                    skt[3, p] = pnt
                    skt[4, p] = pmt
        else:
            # grid row ey runs the ey-th expert with rows: the CTAs of empty experts come last in launch order, after
            # every CTA with work (W2: the counts were written before W1, which let W2 launch only after its acquire)
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
            npieces = (count + n_tile - 1) // n_tile
            total = npieces * nw
        if cutlass.const_expr(self.cfg.pdl and self.is_w1):
            # W2 may launch once every W1 CTA has read the row layout: a CTA without rows reads and writes nothing
            # of the call after this, one with rows is awaited by W2 (W1_DONE or the grid dependency)
            cute.arch.griddepcontrol_launch_dependents()
        if cutlass.const_expr(self.expert_sync and self.is_w1):
            if tidx == 0:  # for release_expert after the tiles (kept in shared memory, not in registers over the loop)
                sflag[2] = e
                sflag[3] = count
                if ks != 0:  # the cluster's leader counts the M tile (K splits)
                    sflag[3] = Int32(0)
                sflag[4] = Int32(sig[5] & 0xFFFFFFFF)
                sflag[5] = Int32(sig[5] >> 32)
                sflag[6] = Int32(self.m_tiles * (2 if self.half else 1))  # (W1's half tiles count each)

        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_atom)
        rsv = Int32(0)
        if cutlass.const_expr(not self.stream_k):
            # the rows' scales 2^(f - 127) of the CTA's one tile, divided by each piece's t after its first barrier
            # (held in registers over the loop, or their address, ptxas spilled at N 80 half tiles); loaded before the
            # table's stores (after them, a round trip of its own)
            rsv = self.load_row_scale(ws, e * self.m_tiles + mt, half_at, tidx)
        # the decode's pair table, by warp 0 (copied by every thread, or by the bulk-copy engine on an mbarrier, ptxas
        # spilled registers at N 80: gpt-oss' W2 with its bias)
        if tidx < 32:
            for i in cutlass.range_constexpr(LUT_PAIR_WORDS // 32):
                slut[tidx + 32 * i] = lut[tidx + 32 * i]
        if cutlass.const_expr(not self.stream_k):
            if tidx < self.rows:
                srs[tidx] = bits_to_f32(rsv)
            self.warp_reduce_bits(rsv, True, sunit, warp_idx, lane)
            if tidx == 0:
                sunit[t_at + 1] = Int32(F32_ONE)  # srs holds the scales in units of t = 1 before the first piece

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
            # every CTA of the cluster has started before any pushes into the leader's (partner's) shared memory
            cute.arch.cluster_arrive_relaxed()
            cute.arch.cluster_wait()

        # a stage's weights as [word, thread, fragment (wg, subtile, half), stage], its record words [word, stage]
        frags, swords = self.w_bytes // 2048, self.s_bytes // 4  # per stage: 16-byte fragments x 128 threads, records
        sW = st.sW.get_tensor(cute.make_layout((4, 128, frags, self.stages), stride=(1, 4, 512, self.w_bytes // 4)))
        sS = st.sS.get_tensor(cute.make_layout((swords, self.stages), stride=(1, swords)))
        thr_mma = tiled_mma.get_slice(tw)
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))  # (MMA, 1, 4 k32, stages)
        a_shape = thr_mma.partition_shape_A((64, WINDOW_K))
        c_shape = thr_mma.partition_shape_C((64, n_tile))
        # A fragments and window accumulators of subtiles 0 and 1
        frag0 = cute.make_rmem_tensor(a_shape, cutlass.Float8E4M3FN)
        frag1 = cute.make_rmem_tensor(a_shape, cutlass.Float8E4M3FN)
        fw0 = cute.recast_tensor(frag0, Int32)
        fw1 = cute.recast_tensor(frag1, Int32)
        accw0 = cute.make_rmem_tensor(c_shape, Float32)
        accw1 = cute.make_rmem_tensor(c_shape, Float32)
        acc0 = cute.make_rmem_tensor(c_shape, Float32)
        acc1 = cute.make_rmem_tensor(c_shape, Float32)
        nacc = self.subs * cute.size(c_shape)  # accumulators per thread
        part_layout = cute.make_layout(
            (max(1, self.splits - 1), nacc, self.threads), stride=(nacc * self.threads, self.threads, 1)
        )

        # the window being decoded, read from its stage: abuf[word 0..3, half, sub, slot], sbuf[sub, slot] (the
        # record word of rows r0, r0 + 8)
        abuf = cute.make_rmem_tensor((4, 2, 2, depth), Int32)
        sbuf = cute.make_rmem_tensor((2, depth), Int32)

        swrd0 = 64 * wg_stage + 8 * wwarp + g  # the stage's record word of r0, r0 + 8 in subtile 0 (subtile s: + 32)
        trow0 = 128 * wg + 64 * sb + 16 * wwarp + g  # the tile's row r0 in subtile 0 (subtile s adds 64, row u 8)
        # bulk-copy bases: the window records in global memory (half tiles: the CTA's half of each), the stages in
        # shared memory
        w_base = wq.iterator.toint() + Int64(half_at) * self.w_bytes
        s_base = ws.iterator.toint() + Int64(half_at) * self.s_bytes
        w_dst = st.sW.data_ptr().toint()
        s_dst = st.sS.data_ptr().toint()
        lc = (mt, e, row_base, w_lo, u0, num_experts, skt)  # what load_coords needs

        prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        cons = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        prev = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        issued = Int32(0)
        # prologue, S - 1 stages: the weights first (they depend on no earlier kernel), then W2 waits for W1 (PDL:
        # W2's CTAs start in W1's tail and stream weights meanwhile) and W1 for its ring blocks, then the
        # activation boxes
        if warp_idx == 0:  # the whole warp: the pipeline's arrive and the TMA issue elect one lane themselves
            pre = prod.clone()
            for i in cutlass.range_constexpr(self.stages - 1):
                if i < total:
                    tile, _, wx = self.load_coords(cnt, offs, lc, i, lane)
                    self.produce_weights(pipe, pre, tile, wx, w_base, s_base, w_dst, s_dst)
                    pre.advance()
        if cutlass.const_expr(self.expert_sync and not self.is_w1):
            self.acquire_expert(sig, gen, timeout_ns, e, count, tidx)
        elif cutlass.const_expr(self.cfg.pdl and not self.is_w1):
            cute.arch.griddepcontrol_wait()
        if cutlass.const_expr(self.cfg.pdl and not self.is_w1):
            cute.arch.griddepcontrol_launch_dependents()
        if cutlass.const_expr(self.cfg.ring and self.is_w1):
            if cutlass.const_expr(self.stream_k):
                for p in cutlass.range(npieces, unroll=1):  # every expert the CTA's pieces read
                    pe, _, _, _, _, _ = self.work_piece(cnt, p, e, mt, u0, u1, num_experts, lane, skt)
                    self.acquire_blocks(sig, gen, timeout_ns, offs[pe], cnt[pe], tidx)
            else:
                self.acquire_blocks(sig, gen, timeout_ns, row_base, count, tidx)
        if warp_idx == 0:
            for _ in cutlass.range_constexpr(self.stages - 1):
                if issued < total:
                    _, row0, wx = self.load_coords(cnt, offs, lc, issued, lane)
                    self.produce_acts(pipe, prod, tma_atom, tma_x, sB, row0, wx)
                    prod.advance()
                    issued += 1

        for piece in cutlass.range(npieces, unroll=1):
            pe, pmt, pnt, wa, wb, pa = self.work_piece(cnt, piece, e, mt, u0, u1, num_experts, lane, skt)
            prow = row_base
            pcount = count
            if cutlass.const_expr(self.stream_k):
                prow = offs[pe]
                pcount = cnt[pe]
            acc0.fill(0.0)
            acc1.fill(0.0)
            col_base = pnt * n_tile
            # the tile's activation scales, every window (and W1's routing weights), into shared memory once: no
            # global-load latency inside the window loop or the epilogue. Each thread loads all of its values into
            # registers, then stores them after the first barrier (the previous tile's readers are past it): loads
            # between the shared stores were waited for one by one, a round trip per value (up to 18 in series at
            # N 80), and the W1 epilogue waited for one routing weight per token column in series. Columns past the
            # expert's rows read nothing (they may lie past the end of the rows): scale and routing weight 0. The
            # same for the rows' scales 2^(f - 127) of a stream_k piece's tile.
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
                        rwt = ep_a[prow + col_base + tidx]
            rsp = Int32(0)
            if cutlass.const_expr(self.stream_k):  # (else every piece is of the CTA's tile: staged once, above)
                rsp = self.load_row_scale(ws, pe * self.m_tiles + pmt, half_at, tidx)
                self.warp_reduce_bits(rsp, True, sunit, warp_idx, lane)
            sxmin = Int32(F32_INF)  # the smallest non-zero activation scale (NaN's bits are above +Inf's)
            for r in cutlass.range_constexpr(nsx):
                b = f32_to_bits(sxv[r])
                if b != 0:
                    sxmin = cutlass.min(sxmin, b)
            self.warp_reduce_bits(sxmin, False, sunit, warp_idx, lane)
            cute.arch.barrier()
            # the accumulators' unit: the activation scales times t, the row scales divided by it after the last window
            tb = self.tile_unit_bits(sunit)
            if tidx < self.rows:
                # stream_k: the piece's tile's scales; else the CTA's one tile's, in units of the previous piece's t
                # (rs / t_prev x t_prev / t: every factor a normal power of two, so exact)
                rs = bits_to_f32(rsp)
                if cutlass.const_expr(not self.stream_k):
                    rs = srs[tidx] * bits_to_f32(sunit[t_at + (piece + 1) % 2])
                srs[tidx] = rs * bits_to_f32(F32_INV_POW2 - tb)
            if cutlass.const_expr(not self.stream_k):
                if tidx == 0:  # (the slot of the piece before the last: read before its second barrier)
                    sunit[t_at + piece % 2] = tb
            for r in cutlass.range_constexpr(nsx):
                i = tidx + self.threads * r
                if i < nw * n_tile:
                    wi = i // n_tile
                    ssx[wi, i - wi * n_tile] = sxv[r] * bits_to_f32(tb)
            if cutlass.const_expr(self.is_w1):
                if tidx < n_tile:
                    srw[tidx] = rwt
            cute.arch.barrier()
            # per window w: wait for window w - 1's WGMMAs, release its stage, refill, promote it; decode subtile 0 of
            # w, issue its WGMMAs; decode subtile 1 while they run (cfg.overlap; else before them), issue its WGMMAs
            # (two commit groups). The wait is unconditional and waits for all before any accumulator is read or
            # fragment 0 rewritten: otherwise ptxas serialises every WGMMA (C7513 / C7515, e.g. for a wait under
            # `if w > 0`, or a promote after wait_group(1); the compile test checks the waits per QGMMA). Decoding the
            # next window's subtile 0 into a second fragment slot before this wait compiles unserialised but measured
            # 0.99-1.01x on the layer (H200, 2026-12-02, docs/benchmarks/window-pipelining-h200-2026-12-02.md).
            for w0 in cutlass.range(wa, wb, depth, unroll=1):
                for j in cutlass.range_constexpr(depth):
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
                    if cutlass.const_expr(self.subs == 2 and not self.cfg.overlap):
                        self.decode_subtile(abuf, sbuf, lut_at, fw1, j, 1)
                    warpgroup.fence()
                    self.mma_window(tiled_mma, accw0, frag0, tCrB, cons.index)
                    if cutlass.const_expr(self.subs == 2):
                        if cutlass.const_expr(self.cfg.overlap):
                            warpgroup.commit_group()
                            self.decode_subtile(abuf, sbuf, lut_at, fw1, j, 1)
                            warpgroup.fence()
                        self.mma_window(tiled_mma, accw1, frag1, tCrB, cons.index)
                    warpgroup.commit_group()
                    prev = cons.clone()
                    cons.advance()
            # drain the piece: the last window's MMAs, release its stage, promote, scale the rows
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
            # (read once the window accumulators are dead: read before the last promote, ptxas spilled at N 80)
            self.scale_rows(acc0, srs, trow0 - half_at * self.rows)
            if cutlass.const_expr(self.subs == 2):
                self.scale_rows(acc1, srs, trow0 - half_at * self.rows + 64)
            if cutlass.const_expr(self.splits > 1):
                self.reduce_splits(acc0, acc1, st.part.data_ptr().toint(), st.part.get_tensor(part_layout), ks, tidx)
            finish = Int32(0)
            if ks == 0:  # the cluster's leader (every CTA without K splits) finishes the tile
                finish = Int32(1)
            if cutlass.const_expr(self.stream_k):
                if wb - wa < nw:  # a part of the tile's windows: the tile's last piece to arrive finishes it
                    finish = self.reduce_pieces(acc0, acc1, accw0, accw1, sig, sflag, pa, mt, u0, units, tidx)
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
                    if cutlass.const_expr(self.stream_k and self.expert_sync):
                        # every (N tile, M tile) of the expert counts once in W1_DONE
                        if tidx == 0:
                            sflag[2] = pe
                            sflag[3] = pcount
                            sflag[6] = (pcount + n_tile - 1) // n_tile * self.m_tiles
                        self.release_expert(sig, sflag, tidx)
                else:
                    valid = pcount - col_base
                    if cutlass.const_expr(self.cfg.ring):
                        if ld_u32(sig[3]) != 0:  # a wait of this call failed: store nothing
                            valid = Int32(0)
                    self.epilogue_w2(
                        acc0, acc1, ep_a, ep_b, ep_c, pmt, wg, sb, wwarp, g, t0, prow + col_base, valid, pe, sig
                    )
            if cutlass.const_expr(self.splits > 1):
                if piece + 1 < npieces:  # the leader has read this tile's partials before they are pushed again
                    cute.arch.cluster_arrive()
                    cute.arch.cluster_wait()
        if cutlass.const_expr(self.expert_sync and self.is_w1 and not self.stream_k):
            self.release_expert(sig, sflag, tidx)
        return more

    @cute.jit
    def acquire_ring(self, sig: tuple, ticket: Int32, timeout_ns: Int64, sflag: cute.Tensor, tidx: Int32, crank: Int32):
        """Ring mode: thread 0 waits for INUSE == ticket (this call holds the workspace), reads g = CGEN + 1 and waits
        for OFFS == g (the ring's offsets and counts of call g are written); every wait bounded, ended by a non-zero
        ERR, and recorded there on expiry. Where the words are already set, two round trips (ERR beside the INUSE
        acquire, CGEN beside OFFS under one fence): the layer 1.01x faster at T = 1 (H200, 2026-12-01,
        docs/benchmarks/cta-start-h200-2026-12-01.md). Returns (ok, g) to every thread. In a cluster (K splits, W1's
        half pairs; crank: the CTA's rank) the leader decides for every CTA of the cluster (read from its shared
        memory after a cluster barrier): CTAs of one cluster must agree on whether they work, or the split
        reduction's (the pair's exchange's) cluster barriers would not match.
        Without ring mode: (1, 0)."""
        ok = Int32(1)
        gen = Int32(0)
        if cutlass.const_expr(self.cfg.ring):
            inuse, cgen, offs_tag, err = sig[0], sig[1], sig[2], sig[3]
            if tidx == 0 and crank == 0:
                good = Int32(0)
                g = Int32(0)
                # two global round trips where the words are already set (a CTA launched after dispatch ranked the
                # routing: every W2 CTA and W1's later ones): ERR and the INUSE acquire together, then CGEN and OFFS
                # together, made an acquire by the fence; a word not yet set is waited for as before
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

    @cute.jit
    def load_coords(self, cnt: cute.Tensor, offs: cute.Tensor, lc: tuple, it: Int32, lane: Int32):
        """Load `it` of this CTA: (tile = expert x M tiles + M tile, first activation row, window). Without stream_k
        the CTA's loads are N tile it // nw of its (expert, M tile), window w_lo + it % nw; with stream_k they continue
        the global window order from the CTA's first unit (tile-major: locate_tile). lc = (M tile or CTA index,
        expert, its first row, w_lo, u0, experts)."""
        mt, e, row_base, w_lo, u0, num_experts, skt = lc
        nw = self.nwk
        tile = Int32(0)
        row0 = Int32(0)
        w = Int32(0)
        if cutlass.const_expr(self.stream_k):
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
        else:
            it_t = it // nw
            it_w = it - it_t * nw
            w = w_lo + it_w
            tile = e * self.m_tiles + mt
            row0 = row_base + it_t * self.n
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
        """Piece `piece` of this CTA's work: (expert, M tile, N tile, first window, end window, stream_k tile index).
        Without stream_k: N tile `piece` of the CTA's (expert, M tile), all its windows. With stream_k: the CTA's
        windows of tile u0 // units-per-tile + piece (its units [u0, u1) of depth windows each)."""
        pe, pmt, pnt = e, mt, piece
        wa = Int32(0)
        wb = Int32(self.nwk)
        a = Int32(0)
        if cutlass.const_expr(self.stream_k):
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
                    lo, hi = decode8(abuf[2 * sh + u, h, s, slot], tab[2 * sh], tab[2 * sh + 1], DECODE8_SPLIT_SIGN_PTX)
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
        # memory) orders the loads after it, so loading each column's between stores waited two round trips (src /
        # dst, then comb) per token column in series; more columns at a time spill at N >= 64 (the layer 1.03-1.04x
        # faster at T = 128 / 256: docs/benchmarks/epilogue-loads-h200-2026-12-01.md)
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


def fake_operands(mode: str, m: int, k: int, ranks_sym=None):
    """The kernel's tensor operands as fakes for an offline compile (every row extent its own run-time symbol):
    wq, ws, x, sxT, offs, cnt, lut, then the epilogue's three — W1: route_w fp32 [R], hq uint8 [R, M/2] (FP8 bits),
    hsT fp32 [M/256, R]; W2: dst int32 [R], src int32 [R, 3], comb int64 [P]."""
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
        ops += list(fake_epilogue_args("w1", m, TILE_M))
    else:
        ops += [
            make_fake_compact_tensor(Int32, (dyn(),), assumed_align=4),
            make_fake_compact_tensor(Int32, (dyn(), 3), stride_order=(1, 0), assumed_align=4),
            make_fake_compact_tensor(Int64, (dyn(),), assumed_align=8),
        ]
    return ops


@cache
def compiled(mode: str, m: int, k: int, cfg: Sm90Config, arch: str = "sm_90a"):
    """Compile one variant against fake tensors (dynamic expert count and row count). Refuses a variant the kernel
    would run wrong (e.g. a K split or unroll that does not divide the windows would silently skip some)."""
    half = cfg.w1_half if mode == "w1" else cfg.w2_half
    why = can_implement(m, k, 1, cfg, splits=cfg.splits[0 if mode == "w1" else 1], half=half)
    if why:
        raise ValueError(f"sm90 {mode}: {why}")
    kern = GroupedGemmSm90(mode, m, k, cfg)
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
        name=f"grouped_{mode}_m{m}_k{k}_n{cfg.n_tile}{'_ring' if cfg.ring else ''}{'_sk' if cfg.stream_k else ''}"
        f"{'_clamp' if cfg.activation == 'swiglu_clamped' else ''}{'_bias' if cfg.bias else ''}"
        f"{'_ef' if cfg.evict_first else ''}{'_half' if half else ''}",
    )
