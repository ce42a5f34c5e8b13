"""Kernel configurations of the sm90 grouped GEMMs and the choice among them.

n_tile     tokens per WGMMA N tile (8, 16, 32 or 64): an expert with more tokens runs several N tiles, each
           re-reading its weights; the activation rows of every expert are padded to a multiple of n_tile
stages     shared-memory stages of the activation (B) TMA pipeline, one 128-K window each
prefetch   128-K windows of weights each thread keeps in flight in registers (2 or 4; divides K/128)
occupancy  CTAs per SM the register budget is sized for (1: up to 255 registers, 2: up to 128)
smem_scales  stage each N tile's activation scales (all windows) in shared memory once, instead of a global load per
           window inside the mainloop (False: the v2 kernel, kept for the ablation)
"""

from __future__ import annotations

from dataclasses import dataclass

N_TILES = (8, 16, 32, 64)
WINDOW_K = 128
TILE_M = 256


@dataclass(frozen=True)
class Sm90Config:
    n_tile: int = 8
    stages: int = 4
    prefetch: int = 4
    occupancy: int = 1
    smem_scales: bool = True

    def __post_init__(self) -> None:
        if self.n_tile not in N_TILES:
            raise ValueError(f"Sm90Config: n_tile must be one of {N_TILES}, got {self.n_tile}")
        if self.stages < 2 or self.stages > 8:
            raise ValueError(f"Sm90Config: stages must be in 2..8, got {self.stages}")
        if self.prefetch not in (2, 4):
            raise ValueError(f"Sm90Config: prefetch must be 2 or 4, got {self.prefetch}")
        if self.occupancy not in (1, 2):
            raise ValueError(f"Sm90Config: occupancy must be 1 or 2, got {self.occupancy}")


def choose_config(tokens_per_rank: int, top_k: int, num_experts: int) -> Sm90Config:
    """Smallest N tile that holds an expert's expected token count with room for imbalance (x2), capped at 64."""
    expected = max(1, tokens_per_rank * top_k // max(1, num_experts))
    want = 2 * expected
    n_tile = next((n for n in N_TILES if n >= want), N_TILES[-1])
    if n_tile == 64 and expected < 32:
        # N = 64 costs twice the MMA and promotion of N = 32 per pass: it pays only once most experts would need
        # two N = 32 passes (H200, 2026-11-29, sm90-grouped-v4: 1.28-1.49x faster at 32-64 expected rows per expert,
        # 1.23x slower at 24)
        n_tile = 32
    # n_tile <= 16 with 2 windows of prefetch fits 128 registers: two CTAs per SM (16 warps to hide latency);
    # n_tile 32 / 64 need ~250 registers: one CTA per SM, 4 windows in flight (measured on the H200, 2026-11-29)
    # shared-memory activation scales: 4-5 % faster at n_tile 16, 1-3 % at 32, 2-4 % slower at 8 (two more barriers per
    # N tile for a loop that is short at n_tile 8), side by side on the H200, 2026-11-29 (sm90-grouped-v3)
    if n_tile <= 16:
        return Sm90Config(n_tile=n_tile, stages=4, prefetch=2, occupancy=2, smem_scales=n_tile >= 16)
    return Sm90Config(n_tile=n_tile, stages=4, prefetch=4, occupancy=1)


def can_implement(m: int, k: int, num_experts: int, cfg: Sm90Config, k_min: int = WINDOW_K) -> str | None:
    """None if the kernel handles an [E, M, K] weight tensor with this config, else why not (pure Python)."""
    if m % TILE_M:
        return f"M = {m} must be a multiple of the {TILE_M}-row CTA tile"
    if k % WINDOW_K or k < k_min:
        return f"K = {k} must be a positive multiple of the {WINDOW_K}-wide scale window"
    if (k // WINDOW_K) % cfg.prefetch:
        return f"K / {WINDOW_K} = {k // WINDOW_K} windows must be a multiple of prefetch = {cfg.prefetch}"
    if num_experts < 1 or num_experts > 2048:
        return f"experts = {num_experts} must be in 1..2048"
    return None
