"""Configuration and static checks of the sm_103a grouped GEMMs (pure Python, CPU-tested).

CTA tile    256 weight rows (two 128-row tcgen05 MMAs sharing the token tile) x N tokens x K128 per stage
n_tile      tokens per tile: 128 (the block-scale factors of the token operand come in 128-row atoms)
mma         tcgen05.mma kind::mxf8f6f4, block scale vector 32: A = weights E2M1, B = tokens E4M3, UE8M0 scales
"""

from __future__ import annotations

from dataclasses import dataclass

TILE_M = 256
MMA_M = 128
K_TILE = 128
N_TILES = (128,)


@dataclass(frozen=True)
class Sm103Config:
    n_tile: int = 128
    stages: int = 4

    def __post_init__(self) -> None:
        if self.n_tile not in N_TILES:
            raise ValueError(f"Sm103Config: n_tile must be one of {N_TILES}, got {self.n_tile}")
        if not 2 <= self.stages <= 8:
            raise ValueError(f"Sm103Config: stages must be in 2..8, got {self.stages}")


def can_implement(mode: str, m: int, k: int, num_experts: int) -> str | None:
    """None if the kernel takes an MXFP4 [E, M, K] weight tensor in this mode, else the reason."""
    if mode not in ("w1", "w2"):
        return f"mode must be 'w1' or 'w2', got {mode!r}"
    if m % TILE_M:  # for W1 this also makes each CTA own 128 intermediate columns: one FP8 scale group
        return f"M = {m} rows must be a multiple of the {TILE_M}-row CTA tile"
    if k % K_TILE or k <= 0:
        return f"K = {k} must be a positive multiple of {K_TILE}"
    if not 1 <= num_experts <= 2048:
        return f"experts = {num_experts} must be in 1..2048"
    return None


def layer_missing(hidden: int, inter: int, experts: int) -> str | None:
    for mode, (m, k) in (("w1", (2 * inter, hidden)), ("w2", (hidden, inter))):
        why = can_implement(mode, m, k, experts)
        if why:
            return f"{mode.upper()}: {why}"
    return None
