"""The half-tile schedule of the sm90 grouped GEMMs (cfg.w1_half / cfg.w2_half): two CTAs per M tile, each of 2
warpgroups taking 128 of its 256 rows, so that two CTAs share an SM where one whole-tile CTA held it alone and one
streams while the other starts (ring words, W1_DONE, the tile's scales, the first stages) or stores its epilogue.

    grid [2 x M tiles, rows R, 1]; CTA (x, y): rows [128 (x % 2), 128 (x % 2) + 128) of M tile x // 2 for the expert
    of grid row y (then y + R, ...: the whole-tile schedule's grid rows, kernel_grouped), unsplit
    W1: cluster [2, 1, 1], the tile's two halves a pair: a token's FP8 scale covers the tile's 128 intermediate
        columns, 64 in each half, so each half sends its per-token maxima into the partner's shared memory and both
        scale by the larger (one cluster barrier per N tile: kernel_grouped_epilogue.epilogue_w1); the pair's leader
        decides the ring acquire for both, and each half counts itself in W1_DONE

Warpgroup q of a CTA takes subtile q of its half (the 4-warpgroup mapping of whole tiles: the prepacked fragments
and the epilogues' row / column mapping are the same); a stage holds that half's 8 KB of weights and 256 B of scale
records, and as many stages as fit half the SM's shared memory (config.half_stages); 256 threads of <= 128
registers (two CTAs per SM). The outputs are bit-identical to whole tiles.
"""

# No `from __future__ import annotations` in kernel files: the DSL reads the annotations as live objects.
from .config import TILE_M, WINDOW_SCALE_BYTES, WINDOW_WEIGHT_BYTES, Sm90Config, half_stages
from .kernel_grouped import GroupedGemmSm90
from .kernel_grouped_common import Int32, cute, cutlass


class GroupedGemmHalfSm90(GroupedGemmSm90):
    """Half M tiles, two CTAs per SM; W1's halves as cluster pairs. The whole-tile body on the CTA's half."""

    schedule = "half"

    def __init__(self, mode: str, m: int, k: int, cfg: Sm90Config):
        super().__init__(mode, m, k, cfg)
        self.half = True
        self.pair = self.clustered = self.is_w1
        self.ctas_per_tile = 2
        self.subs, self.threads, self.occupancy = 1, 256, 2
        self.stages = half_stages(cfg, k)
        self.w_bytes, self.s_bytes = WINDOW_WEIGHT_BYTES // 2, WINDOW_SCALE_BYTES // 2
        self.rows = TILE_M // 2

    def launch_cluster(self) -> list | None:
        return [2, 1, 1] if self.pair else None

    @cute.jit
    def cta_rows(self, tidx: Int32, mt: Int32, ks: Int32):
        """(M tile x // 2, the CTA's half wg = x % 2 (the tile's rows 128 wg ..), the warpgroup's subtile, the
        stage's row block (0: a stage holds only the CTA's half), the half again, the rank in the cluster: W1's
        pair along x, else the K split (0))."""
        sb = tidx // 128
        wg = mt % 2
        crank = ks
        if cutlass.const_expr(self.pair):
            crank = wg
        return mt // 2, wg, sb, Int32(0), wg, crank
