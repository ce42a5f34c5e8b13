"""Kernel configurations of the sm90 grouped GEMMs and the choice among them (choose_config: each rule with its
reason; the measurements behind them are listed in docs/benchmarks/index.md). Sm90Config's fields:

n_tile     tokens per WGMMA N tile (a multiple of 8 up to N_MAX = 80): an expert with more tokens runs several N tiles,
           each re-reading its weights
stages     shared-memory stages of the TMA pipeline, one 128-K window each (activation box, 16 KB of weights, 512 B of
           scale records)
prefetch   windows decoded per loop iteration (1, 2 or 4); divides K/128
occupancy  CTAs per SM the register budget is sized for (1: up to 255 registers, 2: up to 128)
splits     (W1, W2) K splits: S CTAs of one thread-block cluster each stream 1/S of a tile's K windows; the leader adds
           the others' partial sums in split order and runs the epilogue (more CTAs when tiles are fewer than SM slots)
warpgroups 2: 256 threads, each warpgroup two 64-row subtiles of its 128 rows (decode of one overlaps the other's
           WGMMAs); 4: 512 threads, one subtile each (half the accumulator registers per thread: tile_shape)
active_first  grid row y runs the y-th expert that has rows, so the CTAs of empty experts launch after every CTA with
           work; False: row y runs expert y
ring       True: the operator's path, rows from gcmoe-comm's dispatch on the token ring (kernel_grouped_common, Ring
           mode); False: rows prepared beforehand (gcmoe_core.grouping): the component on its own, and its tests
expert_sync  ring mode: W2's CTAs of an expert start once W1 finished that expert (its W1_DONE tag), not the W1 grid
stream_k   W1 only, unsplit: one CTA per SM slot over the active tiles' K windows in equal ranges; a tile split between
           CTAs is finished, deterministically, by the last to arrive (kernel_grouped_stream_k)
ring_bm    rows per ring block (gcmoe-comm's BM): the grain of the L1_FULL tags; expert row offsets are multiples of it
activation the W1 epilogue's activation, compiled in with alpha and limit: "swiglu" or "swiglu_clamped" (gpt-oss;
           gcmoe_core.reference.Activation is the formula)
w2_half    W2's CTAs take half an M tile (128 rows, 256 threads, <= 128 registers: two CTAs per SM), so one CTA streams
           while the other starts or stores (kernel_grouped_half); W2 unsplit, N <= 64 with bias (half_tiles_ok)
w1_half    the same for W1, whose two halves of an M tile run as a cluster pair exchanging their per-token maxima
bias       W1 adds b13 (fp32 [E, 2I]) before the activation; W2 adds route_w[row] * b2 (fp32 [E, M]) before its bf16
           store. Off (the default), the kernels compile to the code without them
evict_first  the weight / scale bulk copies carry an L2 evict_first policy (the weights are read once per call)

Each (GEMM, config) runs one schedule, one kernel file each (schedule_of).
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
# active-first grid rows where fewer than half the experts are expected to have rows: the CTAs of the many empty experts
# then launch after every CTA with work instead of among them; where nearly every expert has rows there is little to
# reorder and the ballot over the counts costs more than it saves
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
    evict_first: bool = False
    w2_half: bool = False
    w1_half: bool = False

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


def schedule_of(mode: str, cfg: Sm90Config) -> str:
    """The kernel schedule W1 (mode 'w1') / W2 of cfg runs: 'stream_k' (W1 with cfg.stream_k), 'half'
    (cfg.w1_half / w2_half), else 'whole' (whole tiles, K splits as cfg.splits): one kernel file each."""
    if mode == "w1" and cfg.stream_k:
        return "stream_k"
    return "half" if (cfg.w1_half if mode == "w1" else cfg.w2_half) else "whole"


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
    ACTIVE_FIRST_BELOW of the experts are expected to have rows; K splits, stream_k, the L2 hint and half tiles by the
    rules below, counting the `shared` always-active experts that ride the same launch (at one token per rank the
    shared expert is one of 9 active experts of a DeepSeek-V3 rank: 16 more W1 tiles); as many pipeline stages (<= 8)
    as the shared memory of the occupancy holds (with_splits)."""
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
    # K splits in two: W1 where its active tiles fit the SM slots and either leave SMs without a tile or, at one token,
    # stream at most 32 K windows each (a cluster of two streams one tile's windows on two SMs, so the idle SMs work);
    # otherwise W1 unsplit, which also lets W2 start per expert (with_splits: expert_sync) and was faster where the
    # tiles already cover the SMs. W2 where its tiles leave SMs without one; where they cover the SMs the split only
    # adds the reduction, and measured slower.
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
    # stream_k W1 where one token's unsplit W1 has more tiles than SMs but at most one per slot (whole tiles would
    # leave most SMs one tile and some two: the second is the kernel's tail); at two tokens and more the partial sums'
    # round trip through global memory cost more than the balance gained
    stream_k = tokens_per_rank == 1 and splits[0] == 1 and sms < w1_tiles <= slots
    # the weight streams' L2 evict_first hint at up to EVICT_FIRST_MAX_T tokens per rank where the layer streams at
    # most EVICT_FIRST_MAX_BYTES of weights (the expected active experts): a short stream then leaves L2's earlier
    # lines in place instead of writing dirty ones back while it runs; longer streams (more tokens, larger layers)
    # gained nothing or lost a little
    from gcmoe_core.formats import fp4_layer_bytes

    weight_bytes = fp4_layer_bytes(hidden, inter, active + shared)
    # W1 and W2 in half M tiles, two CTAs per SM, wherever a whole tile holds an SM alone (occupancy 1: N 32-80): one
    # CTA streams while the other starts or stores (outputs bit-identical). Not where two CTAs share an SM already
    # (N <= 24: four half-tile CTAs per SM lose or tie), nor in place of K splits / stream_k at one token (fewer
    # CTAs than SM slots there: the halves leave SMs idle)
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
    weights and, at one to two waves of CTAs, becomes the kernel's tail; a larger tile than needed computes empty token
    columns in every pass. Above N_MAX: N_MAX while a typical expert (expected + 1 sd) fits in one pass, else the rows
    spread evenly over the fewest passes."""
    target = expected + 2.0 * sqrt(expected)
    if target > N_MAX:
        passes = 1 if expected + sqrt(expected) <= N_MAX else ceil(target / N_MAX)
        target = min(N_MAX, target / passes)
    return next(n for n in N_TILES if n >= target)


def tile_shape(n_tile: int) -> tuple[int, int]:
    """(occupancy, warpgroups) of an N tile, by registers (ptxas, no spills): up to N = 24 two 256-thread CTAs per SM
    (<= 128 registers); up to 64 one CTA of 4 warpgroups, one 64-row subtile each (<= 128 registers: 16 warps per SM
    hide more latency than 8 warps of two subtiles); above, one CTA of 2 warpgroups (<= 255 registers)."""
    if n_tile <= 24:
        return 2, 2
    return (1, 4) if n_tile <= 64 else (1, 2)


def with_splits(cfg: Sm90Config, splits: tuple[int, int], hidden: int, inter: int) -> Sm90Config:
    """cfg with these K splits, expert_sync where W1 runs unsplit, and as many pipeline stages (<= 8) as the shared
    memory of its occupancy holds — with stream_k at most STREAM_K_STAGES: every CTA of its one wave asks for its
    first stages at once, and the smaller burst reaches each CTA's first window sooner (elsewhere fewer stages than
    fit did not help).

    expert_sync (ring mode): W2 per expert after its W1 tiles instead of after the whole W1 grid wherever W1 runs
    unsplit, so W2 runs beside W1's tail; where W1 runs in K-split clusters the per-expert handshake cost more than
    it overlapped."""
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


def can_implement(m: int, k: int, num_experts: int, cfg: Sm90Config, splits: int = 1, half: bool = False) -> str | None:
    """None if the kernel handles an [E, M, K] weight tensor with this config, else why not (pure Python); half: as
    the kernel runs in half tiles (cfg.w1_half / w2_half: half an M tile per CTA, two CTAs per SM, half_stages)."""
    if m % TILE_M:
        return f"M = {m} must be a multiple of the {TILE_M}-row CTA tile"
    if k % WINDOW_K or k < WINDOW_K:
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


def layer_missing(hidden: int, inter: int, experts: int) -> str | None:
    """None when the kernels take a layer of this shape (with any chosen config), else why not."""
    for name, (m, k) in (("W13", (2 * inter, hidden)), ("W2", (hidden, inter))):
        why = can_implement(m, k, experts, Sm90Config(prefetch=1))  # config_for falls back to one window per step
        if why:
            return f"{name}: {why}"
    return None
