"""Kernel configurations of the sm90 grouped GEMMs and the choice among them.

n_tile     tokens per WGMMA N tile (a multiple of 8 up to N_MAX = 80): an expert with more tokens runs several N tiles,
           each re-reading its weights; the activation rows of every expert are padded to a multiple of n_tile
stages     shared-memory stages of the TMA pipeline, one 128-K window each: the window's activation box, 16 KB of
           weights and 512 B of scale records, all arriving by TMA / bulk copy on the stage's mbarrier
prefetch   windows decoded per loop iteration (1, 2 or 4); divides K/128
occupancy  CTAs per SM the register budget is sized for (1: up to 255 registers, 2: up to 128)
overlap    decode subtile 1 of a window while subtile 0's WGMMAs run (False: decode both, then issue all 8)
pdl        programmatic dependent launch: W2's CTAs start in W1's tail and stream their first weight stages before
           waiting for W1 (griddepcontrol); W1 waits for its producer before reading anything
splits     (W1, W2) K splits: S CTAs of one thread-block cluster each stream 1/S of a tile's K windows; the S - 1
           others push their partial sums into the leader's shared memory, which adds them in split order and runs
           the epilogue (more CTAs when there are fewer tiles than SM slots)
warpgroups 2: 256 threads, each warpgroup two 64-row subtiles of its 128 rows (decode of one overlaps the other's
           WGMMAs); 4: 512 threads, one subtile each (half the accumulator registers per thread, twice the warps per
           SM at one CTA per SM: for N >= 32, where two subtiles' accumulators allow only one 256-thread CTA per SM)
active_first  grid row y runs the y-th expert that has rows (a ballot over the counts in each warp), so the CTAs of
           empty experts launch after every CTA with work; False: row y runs expert y
ring       the kernels run beside gcmoe-comm's dispatch on the token ring (the operator's path): before reading the
           row layout each CTA acquires the workspace's INUSE == its call's ticket and OFFS == CGEN + 1 (the ring
           offsets and counts of this call), W1 acquires the L1_FULL tag of every ring block of its expert before
           loading activations, every wait bounded and failing into the workspace's ERR words; W2 skips its stores
           once ERR is set. False: rows prepared beforehand (benchmarks, kernel tests)
expert_sync  ring mode: W2's CTAs of an expert start once W1 finished that expert (W1's last M tile of the expert
           releases the workspace's W1_DONE tag of the call) instead of waiting for the whole W1 grid
           (griddepcontrol.wait): with PDL, W2 runs beside W1's tail
stream_k   W1 only, unsplit: a grid of `ctas` CTAs (the SM slots) over the active tiles' K windows in equal ranges
           (units of `prefetch` windows, tile-major): a CTA's range covers parts of one or more tiles; a tile split
           between CTAs is finished by the last to arrive (an acq_rel counter), which adds the others' fp32 partials
           (global scratch) in CTA order, deterministically. Every SM then streams the same bytes whatever the tile
           count (at one token per rank: 144 tiles of DeepSeek-V3 over 264 slots leave most SMs one tile; the K
           split clusters give 288 CTAs, a second wave)
ring_bm    rows per ring block (gcmoe-comm's BM): the grain of the L1_FULL tags; expert row offsets are multiples
           of it, not of the N tile (the TMA boxes start at any row)
activation the W1 epilogue's activation, a compile-time choice: "swiglu" (silu(gate) * up) or "swiglu_clamped"
           (gpt-oss: gate = min(gate, limit), up = clamp(up, +-limit), gate * sigmoid(alpha gate) * (up + 1); alpha
           and limit are compiled in as constants; gcmoe_core.reference.Activation is the formula)
w2_half    W2's CTAs take half an M tile (128 weight rows: one 64-row subtile per warpgroup, 256 threads, registers
           <= 128, so two CTAs share an SM) instead of 256 rows (one CTA per SM: 4 warpgroups, 2 above N 64): with one
           CTA per SM each CTA's start (ring words, W1_DONE, the tile's scales, the first stages) and its epilogue
           leave the SM idle, with two the other CTA streams meanwhile. W2 unsplit, and N <= 64 with the bias epilogue
           (half_tiles_ok); the stages are those that fit half the SM's shared memory (half_stages)
w1_half    the same for W1, whose two halves of an M tile run as a cluster of two CTAs: a token's FP8 scale covers the
           tile's 128 intermediate columns, 64 in each half, so the halves exchange their maxima (one cluster barrier
           per epilogue). W1 unsplit, not stream_k
bias       W1 adds b13 (fp32 [E, 2I], gate then up entries) to gate and up before the activation; W2 adds
           route_w[row] * b2 (fp32 [E, M]) to each row before its bf16 store (h already carries the routing weight, so
           this is the routing weight times the biased expert output). Off (the default, as choose_config leaves both
           epilogue flags): the kernels compile to the code without them

Measured and removed (git history and docs/benchmarks keep them): the v4 register weight stream, three CTAs per SM,
the decode's shifts on the FMA pipe, the stage ablations and per-CTA trace stamps (sm90-grouped-v5 .. v7 records);
the activation scales loaded from global memory per window (smem_scales=False): each N tile's scales of every window
are always staged in shared memory once, 4-5 % faster at n_tile 16, 1-3 % at 32 (sm90-grouped-v3); at n_tile 8
measured 2-4 % slower then, but on today's kernel the per-window global load of the scales was the promote's top
stall (ncu source counters) and staging them made the layer 1.01-1.09x faster at T = 1, 2, 8 (DeepSeek-V3 /
V4-Flash, H200, 2026-12-01, `tools/gpu/split_sweep.py --sweep scales` at commit 5561605, removed with the path).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cache
from math import ceil, sqrt

N_TILES = (8, 16, 24, 32, 40, 48, 56, 64, 72, 80)
N_MAX = N_TILES[-1]  # two 64-row subtiles' accumulators of N = 80 fill 255 registers (N = 96 spills)
WINDOW_K = 128
TILE_M = 256
WINDOW_WEIGHT_BYTES = TILE_M * WINDOW_K // 2  # one CTA tile's FP4 weights of one 128-K window (16 KB)
WINDOW_SCALE_BYTES = TILE_M * 2  # its scale records, 16 bits per weight row (prepack: record words)
LUT_PAIR_BYTES = 256 * 16  # the decode tables by pairs of k32 steps in shared memory (prepack.lut_pair_words)
# active-first grid rows where fewer than half the experts are expected to have rows: 1.04-1.12x faster at one token
# per rank (75-80 % of the experts empty), 0.97-1.0x at 8-32 tokens (13 % or fewer empty), side by side, H200,
# 2026-11-29 (sm90-grouped-v7 runs S and R)
ACTIVE_FIRST_BELOW = 0.5
STREAM_K_STAGES = 4  # the most pipeline stages of a stream_k configuration (with_splits)
EVICT_FIRST_MAX_BYTES, EVICT_FIRST_MAX_T = 280e6, 2  # where the weight streams carry the L2 evict_first hint
SMEM_PER_SM = 228 * 1024  # H100 / H200: 227 KB usable by one CTA, 1 KB reserved per resident CTA


@dataclass(frozen=True)
class Sm90Config:
    n_tile: int = 8
    stages: int = 4
    prefetch: int = 2
    occupancy: int = 1
    splits: tuple[int, int] = (1, 1)
    overlap: bool = True
    pdl: bool = True
    warpgroups: int = 2
    active_first: bool = True
    ring: bool = False
    expert_sync: bool = True
    ring_bm: int = 8
    stream_k: bool = False
    activation: str = "swiglu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    bias: bool = False
    evict_first: bool = False  # the weight / scale bulk copies carry an L2 evict_first hint (read once)
    w2_half: bool = False  # W2 CTAs of 128 weight rows, two per SM (see the module docstring)
    w1_half: bool = False  # W1 likewise, its halves in clusters of two

    def __post_init__(self) -> None:
        if self.n_tile not in N_TILES:
            raise ValueError(f"Sm90Config: n_tile must be one of {N_TILES}, got {self.n_tile}")
        if self.stages < 2 or self.stages > 8:
            raise ValueError(f"Sm90Config: stages must be in 2..8, got {self.stages}")
        if self.prefetch not in (1, 2, 4):
            raise ValueError(f"Sm90Config: prefetch must be 1, 2 or 4, got {self.prefetch}")
        if any(sp not in (1, 2, 4) for sp in self.splits) or len(self.splits) != 2:
            raise ValueError(f"Sm90Config: splits must be two of 1, 2, 4 (W1, W2), got {self.splits}")
        if self.warpgroups not in (2, 4):
            raise ValueError(f"Sm90Config: warpgroups must be 2 or 4, got {self.warpgroups}")
        if self.warpgroups == 4 and self.occupancy != 1:
            raise ValueError("Sm90Config: 4 warpgroups need occupancy 1 (512 threads, <= 128 registers)")
        if self.occupancy not in (1, 2):
            raise ValueError(f"Sm90Config: occupancy must be 1 or 2, got {self.occupancy}")
        if self.stream_k and self.splits[0] != 1:
            raise ValueError(f"Sm90Config: stream_k runs W1 unsplit (splits[0] = 1), got {self.splits}")
        if self.ring_bm < 8 or self.ring_bm % 8:
            raise ValueError(f"Sm90Config: ring_bm must be a positive multiple of 8, got {self.ring_bm}")
        if self.activation not in ("swiglu", "swiglu_clamped"):
            raise ValueError(f"Sm90Config: activation must be 'swiglu' or 'swiglu_clamped', got {self.activation!r}")
        for name, w1 in (("w1_half", True), ("w2_half", False)):
            if getattr(self, name) and not half_tiles_ok(self, w1):
                raise ValueError(
                    f"Sm90Config: {name} needs that GEMM unsplit (W1: not stream_k; W2 with bias: N <= 64), got "
                    f"splits {self.splits}, stream_k {self.stream_k}, N {self.n_tile}, bias {self.bias}"
                )
        for name in ("swiglu_alpha", "swiglu_limit"):
            v = getattr(self, name)
            if not isinstance(v, float) or not 0.0 < v < float("inf"):
                raise ValueError(f"Sm90Config: {name} must be a finite float > 0, got {v!r}")


def half_tiles_ok(cfg: Sm90Config, w1: bool) -> bool:
    """Whether W1 (w1) / W2 of cfg can run in half tiles: that GEMM unsplit, W1 not stream_k (its pieces are whole
    tiles). One 64-row subtile of N <= N_MAX = 80 per warpgroup compiles in <= 128 registers, except W2 with its bias
    epilogue (route_w * b2) above N 64, which spills (ptxas, gpt-oss at N 80)."""
    if w1:
        return cfg.splits[0] == 1 and not cfg.stream_k
    return cfg.splits[1] == 1 and (cfg.n_tile <= 64 or not cfg.bias)


def with_halves(cfg: Sm90Config, w1_half: bool, w2_half: bool) -> Sm90Config:
    """cfg with W1 / W2 in half tiles where asked and half_tiles_ok allows it."""
    return replace(cfg, w1_half=w1_half and half_tiles_ok(cfg, True), w2_half=w2_half and half_tiles_ok(cfg, False))


def smem_bytes(cfg: Sm90Config, k: int, splits: int = 1, half: bool = False) -> int:
    """Shared memory of one CTA of the kernel for reduction length k with `splits` K splits (the kernel's Shared
    struct, plus alignment); half: a CTA of half an M tile (cfg.w1_half / w2_half: 128 rows, 256 threads)."""
    n, nw = cfg.n_tile, k // WINDOW_K
    rows = TILE_M // 2 if half else TILE_M
    stage = n * WINDOW_K + rows * WINDOW_K // 2 + rows * 2  # activation box, weights, scale records
    warps = 8 if half else 4 * cfg.warpgroups
    red = 4 * n * warps  # the W1 epilogue's per-warp amax
    # mbarriers, the decode's pair table, flags, amax, the N tile's activation scales and routing weights, the rows'
    # scales, the accumulators' unit (per-warp extrema, two pieces' t: kernel_grouped.tile_unit_bits), alignment
    fixed = 16 * cfg.stages + LUT_PAIR_BYTES + 16 + red + 4 * nw * n + 4 * n + 4 * rows + 4 * (2 * warps + 2)
    fixed += 1024 + 128 + 16
    fixed += 4 * 5 * 8 if cfg.stream_k else 4  # stream_k's table of a CTA's first 8 tiles
    fixed += 8 * n if half else 4  # W1 half pairs: the partner's column maxima of two pieces
    return fixed + cfg.stages * stage + 4 * max(1, (splits - 1) * n * 256)


def half_stages(cfg: Sm90Config, k: int) -> int:
    """Pipeline stages of a half-tile CTA (cfg.w1_half / w2_half) for reduction length k: as many (<= 8) as fit half
    the SM's shared memory (two CTAs per SM)."""
    fits = [st for st in range(2, 9) if smem_bytes(replace(cfg, stages=st), k, 1, True) <= smem_limit(2)]
    return max(fits, default=2)


def smem_limit(occupancy: int) -> int:
    return min(227 * 1024, SMEM_PER_SM // occupancy - 1024)


@cache
def choose_config(
    tokens_per_rank: int,
    top_k: int,
    num_experts: int,
    hidden: int = 7168,
    inter: int = 2048,
    sms: int = 132,
    shared: int = 0,
) -> Sm90Config:
    """The N tile of n_tile_for the expected rows per expert and its tile_shape; active-first grid rows when fewer than
    ACTIVE_FIRST_BELOW of the experts are expected to have rows; K splits and stream_k by the measured rules below,
    counting the `shared` always-active experts that ride the same launch (at one token per rank the shared expert is
    one of 9 active experts of a DeepSeek-V3 rank: 16 more W1 tiles); as many pipeline stages (<= 8) as the shared
    memory of the occupancy holds."""
    expected = max(1, tokens_per_rank * top_k // max(1, num_experts))
    n_tile = n_tile_for(expected)
    occupancy, warpgroups = tile_shape(n_tile)
    prefetch = 2 if (hidden // WINDOW_K) % 2 == 0 and (inter // WINDOW_K) % 2 == 0 else 1  # windows per loop step
    # experts with at least one row under uniform routing, and each kernel's tiles against the SM slots
    # (a token's top-k are k distinct experts: one token makes exactly k active)
    active = num_experts * (1.0 - (1.0 - min(top_k, num_experts) / num_experts) ** tokens_per_rank)
    cfg = Sm90Config(
        n_tile=n_tile,
        stages=2,
        prefetch=prefetch,
        occupancy=occupancy,
        warpgroups=warpgroups,
        active_first=active < ACTIVE_FIRST_BELOW * num_experts,
    )
    # K splits (measured on the whole layer, shared expert included, H200, 2026-11-30, tools/gpu/split_sweep.py,
    # docs/benchmarks/layer-split-sweep-expert-sync-h200-2026-11-30.md): W1 split in two where its active tiles fit the
    # SM slots and either leave SMs without a tile (GLM-4.5 T = 1: 108 tiles, 61.0 µs vs 67.7 unsplit) or, at one
    # token, stream at most 32 K windows each (V4-Flash T = 1: 67.0 vs 69.2); else unsplit, which also lets W2 start
    # per expert (with_splits: expert_sync), measured faster for DeepSeek-V3 T = 1 / 2 (94.1 vs 100.0 µs, 126.5 vs
    # 137.3) and GLM-5 T = 1 (86.0 vs 89.3); W2 split in two where its tiles leave SMs without one (DeepSeek-V4-Flash
    # at T = 1: 7 experts x 16 tiles = 112 of 132 SMs, one CTA streaming 16 windows each: 49.6 vs 52.4 µs with W1
    # split, 50.9 vs 53.8 unsplit; where the tiles cover the SMs split W2 measured slower: V4-Flash T = 2, 71.2 vs
    # 67.8; DeepSeek-V3 T = 1 / 2, 90.5 vs 85.4, 124.8 vs 111.6; GLM-4.5 T = 1 (144 tiles) 55.4 vs 53.2; H200,
    # 2026-12-01, docs/benchmarks/layer-bounds-h200-2026-12-01.md; and 4-8 % at every point of layer-h200-2026-11-30.md)
    slots = sms * occupancy
    w1_tiles = (active + shared) * 2 * inter / TILE_M
    w1_windows = hidden // WINDOW_K
    w2_tiles = (active + shared) * hidden / TILE_M
    want = (
        2 if w1_tiles <= slots and (w1_tiles < sms or (tokens_per_rank == 1 and w1_windows <= 32)) else 1,
        2 if w2_tiles < sms else 1,
    )
    splits = []
    for (m, k), sp in zip(((2 * inter, hidden), (hidden, inter)), want):
        ok = [s for s in (1, 2, 4) if can_implement(m, k, num_experts, cfg, splits=s) is None]
        splits.append(sp if sp in ok else ok[0])
    # stream_k W1 where one token's unsplit W1 has more tiles than SMs but fewer than slots (most SMs one tile, some
    # two): DeepSeek-V3 / GLM-5 at T = 1 (144 tiles), the public layer 1.03-1.09x faster (88.8 vs 97.0 µs, 82.5 vs
    # 86.0), 0.90-0.96x at T = 2 on three shapes (H200, 2026-11-30, tools/gpu/split_sweep.py --sweep stream_k,
    # docs/benchmarks/stream-k-h200-2026-11-30.md)
    stream_k = tokens_per_rank == 1 and splits[0] == 1 and sms < w1_tiles <= slots
    # the weight streams' L2 evict_first hint at up to EVICT_FIRST_MAX_T tokens per rank where the layer streams at
    # most EVICT_FIRST_MAX_BYTES of weights (the expected active experts): a short stream then leaves L2's earlier
    # lines in place instead of writing dirty ones back while it runs. The public layer with the hint vs without, side
    # by side (H200, 2026-12-01, tools/gpu/split_sweep.py --sweep evict_first, three runs, write / read flush;
    # docs/benchmarks/l2-hint-h200-2026-12-01.md): T = 1 1.00-1.09x faster in the write flush on every shape and run
    # (DeepSeek-V4-Flash 1.05-1.09x, GLM-5 1.03-1.06x, GLM-4.5 1.04x, DeepSeek-V3 1.00-1.04x), 0.98-1.03x in the read
    # flush; T = 2 at <= 280 MB (V4-Flash 159 MB, GLM-4.5) 1.03-1.05x / 0.98-1.01x; T = 2-64 above 300 MB (V3,
    # GLM-5) 0.97-1.00x in the write flush (0.99-1.02x read); T = 4 mixed (V4-Flash 1.03x / 1.00x write, 0.98x
    # read), so left off
    from gcmoe_core.formats import fp4_layer_bytes

    weight_bytes = fp4_layer_bytes(hidden, inter, active + shared)
    # W1 and W2 in half M tiles, two CTAs per SM, wherever a whole tile holds an SM alone (occupancy 1: N 32-80): one
    # CTA streams while the other starts or stores. The public layer, side by side, outputs bit-identical: at N 32-64
    # W2's half tiles 1.025-1.034x faster at T = 128 / 256 (V4-Flash T = 128 218.9 -> 211.6 µs, T = 256 271.3 ->
    # 264.7; DeepSeek-V3 T = 128 356.6 -> 346.3), then W1's 1.037-1.053x (V4-Flash 212.5 -> 203.5, 264.4 -> 251.1;
    # DeepSeek-V3 T = 128 346.0 -> 333.8); at N 80 (DeepSeek-V3 / GLM-5 T = 256) W2's 1.06 / 1.05x (485.7 -> 457.5,
    # 436.0 -> 414.0), both 1.06 / 1.07x (457.0, 407.0); gpt-oss-120b (biased epilogues; W2 whole at N 80) W1 / W2
    # 1.027 / 1.066x at N 48, W1 1.013x at N 80; where two CTAs share an SM already (N <= 24) half tiles lose or tie:
    # W1 0.95-0.97x at N 8 / 16 in 4 CTAs per SM, W2 0.99-1.01x, and 0.95-0.96x at two per SM; at one token in place
    # of K splits / stream_k 0.91-0.97x (H200, 2026-12-02, tools/gpu/split_sweep.py --sweep w2_half / w1_half,
    # docs/benchmarks/half-tiles-h200-2026-12-02.md, half-tiles-{n80,gpt-oss,t1}-h200-2026-12-02.md)
    split_cfg = replace(cfg, splits=(splits[0], splits[1]), stream_k=stream_k)
    halves = [
        occupancy == 1 and half_tiles_ok(split_cfg, w1) and can_implement(m, k, 1, cfg, half=True) is None
        for (m, k), w1 in zip(((2 * inter, hidden), (hidden, inter)), (True, False))
    ]
    cfg = replace(
        cfg,
        stream_k=stream_k,
        evict_first=tokens_per_rank <= EVICT_FIRST_MAX_T and weight_bytes <= EVICT_FIRST_MAX_BYTES,
        w1_half=halves[0],
        w2_half=halves[1],
    )
    return with_splits(cfg, (splits[0], splits[1]), hidden, inter)


def n_tile_for(expected: float) -> int:
    """Smallest N tile that holds the largest expert's rows under uniform routing, about expected + 2 sd (Poisson; the
    expected maximum of 20-32 experts' counts): an expert above its N tile runs a second pass, which re-reads its
    weights and, at one to two waves of CTAs, becomes the kernel's tail (H200, 2026-11-29, sm90-grouped-v6 run E: N 72
    vs 64 at 66 rows max 1.14x faster, N 64 vs 72 at 60 rows 1.11x). Above N_MAX: N_MAX while a typical expert
    (expected + 1 sd) fits in one pass, else the rows spread evenly over the fewest passes."""
    target = expected + 2.0 * sqrt(expected)
    if target > N_MAX:
        passes = 1 if expected + sqrt(expected) <= N_MAX else ceil(target / N_MAX)
        target = min(N_MAX, target / passes)
    return next(n for n in N_TILES if n >= target)


def tile_shape(n_tile: int) -> tuple[int, int]:
    """(occupancy, warpgroups) of an N tile, by registers (ptxas, no spills): up to N = 24 two 256-thread CTAs per SM
    (<= 128 registers); up to 64 one CTA of 4 warpgroups, one 64-row subtile each (<= 128 registers, 16 warps; 1-4 %
    faster than 2 warpgroups of two subtiles at N = 32 / 64, H200, 2026-11-29); above, one CTA of 2 warpgroups
    (<= 255 registers)."""
    if n_tile <= 24:
        return 2, 2
    return (1, 4) if n_tile <= 64 else (1, 2)


def with_splits(cfg: Sm90Config, splits: tuple[int, int], hidden: int, inter: int) -> Sm90Config:
    """cfg with these K splits, expert_sync where W1 runs unsplit, and as many pipeline stages (<= 8) as the shared
    memory of its occupancy holds — with stream_k at most STREAM_K_STAGES: every CTA of its one wave asks for its
    first stages at once, and the smaller burst reaches each CTA's first window sooner (DeepSeek-V3 T = 1 1.02-1.05x,
    GLM-5 1.03-1.06x than the 6 that fit; fewer stages 0.98-1.03x at T = 2 / 8 and for V4-Flash's K-split clusters;
    H200, 2026-12-01, split_sweep --sweep stages, docs/benchmarks/layer-bounds-h200-2026-12-01.md).

    expert_sync (ring mode): W2 per expert after its W1 tiles instead of after the whole W1 grid wherever W1 runs
    unsplit: the layer 1.07-1.15x faster at T = 4-128 on DeepSeek-V3, 1.01-1.14x on V4-Flash at T = 2-128;
    0.965-0.988x where W1 runs in K-split clusters (both models at T = 1, V3 at T = 2), side by side on the H200,
    2026-11-30 (tools/gpu/split_sweep.py --sweep expert_sync, docs/benchmarks/expert-sync-h200-2026-11-30.md)."""
    c = replace(
        cfg,
        splits=splits,
        expert_sync=splits[0] == 1,
        stream_k=cfg.stream_k and splits[0] == 1,
        w1_half=False,
        w2_half=False,
    )
    cfg = with_halves(c, cfg.w1_half, cfg.w2_half)
    k_max, s_max = max(hidden, inter), max(splits)
    fits = [st for st in range(2, 9) if smem_bytes(replace(cfg, stages=st), k_max, s_max) <= smem_limit(cfg.occupancy)]
    return replace(cfg, stages=min(max(fits), STREAM_K_STAGES) if cfg.stream_k else max(fits))


def can_implement(
    m: int, k: int, num_experts: int, cfg: Sm90Config, k_min: int = WINDOW_K, splits: int = 1, half: bool = False
) -> str | None:
    """None if the kernel handles an [E, M, K] weight tensor with this config, else why not (pure Python); half: as
    the kernel runs in half tiles (cfg.w1_half / w2_half: half an M tile per CTA, two CTAs per SM, half_stages)."""
    if m % TILE_M:
        return f"M = {m} must be a multiple of the {TILE_M}-row CTA tile"
    if k % WINDOW_K or k < k_min:
        return f"K = {k} must be a positive multiple of the {WINDOW_K}-wide scale window"
    if (k // WINDOW_K) % (cfg.prefetch * splits):
        return (
            f"K / {WINDOW_K} = {k // WINDOW_K} windows must be a multiple of prefetch x K splits = "
            f"{cfg.prefetch} x {splits}"
        )
    if num_experts < 1 or num_experts > 2048:
        return f"experts = {num_experts} must be in 1..2048"
    c, occupancy = (replace(cfg, stages=half_stages(cfg, k)), 2) if half else (cfg, cfg.occupancy)
    if smem_bytes(c, k, splits, half) > smem_limit(occupancy):
        return (
            f"{c.stages} stages at N tile {c.n_tile} and {splits} K splits need {smem_bytes(c, k, splits, half)} "
            f"bytes of shared memory for K = {k}, over the {smem_limit(occupancy)} of occupancy {occupancy}"
        )
    return None
