"""K128 prepacker for the sm_103a grouped GEMMs: MXFP4 expert weights -> TMA-friendly K128 tiles and the scale
factors in the layout tcgen05 block-scaled MMA reads (plain torch, any device).

Weights (operand swap: weight rows are the MMA's M side, BM = 128 rows per CTA tile):

    logical  w [E, N, K]            MXFP4: packed [E, N, K/2] bytes (low nibble first) + UE8M0 [E, N, K/32]
    data     [E, N/128, K/128, 128, 64]     64 bytes (128 FP4) per row per K128 tile
             one (128-row x K128) tile = 8 KiB contiguous: a single TMA box of one long burst

Scale factors (one UE8M0 per 32 K per row; 4 per row per K128 tile), in 512-byte atoms per (128 rows x K128):

    sf       [E, N/128, K/128, 512]
             byte (r, j) of the atom, r = row in the tile (0..127), j = 32-group in the K128 tile (0..3):
                 offset = (r % 32) * 16 + (r // 32) * 4 + j
             i.e. the "128x4" block-scale layout: 32 lanes x (4 row-quarters x 4 groups) — each 16-byte line holds
             rows r, r+32, r+64, r+96 for all four 32-groups.

W13 rows are first interleaved gate/up in groups of 16 (gcmoe_core.layouts): each 32-row block (the TMEM lanes one
epilogue warp reads) holds the gate rows then the up rows of the same 16 intermediate columns, so the fused SwiGLU
pairs lane l with lane l + 16 by one shuffle; a 256-row CTA tile covers 128 intermediate columns (one FP8 scale
group of the intermediate).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gcmoe_core.formats import MXFP4Tensor, check_mxfp4
from gcmoe_core.layouts import gate_up_permutation

BM = 128
K_TILE = 128
SF_ATOM = 512
GATE_UP_GROUP = 16  # gate rows 0-15 and up rows 16-31 of each 32-row TMEM lane block (one warp): SwiGLU by shuffle


@dataclass(frozen=True)
class PackedK128:
    """Prepacked MXFP4 weights of E experts: data [E, N/128, K/128, 128, 64] uint8, sf [E, N/128, K/128, 512]."""

    data: torch.Tensor
    sf: torch.Tensor
    n: int
    k: int
    gate_up: bool  # rows interleaved gate/up (W13)


def sf_atom_offsets(device=None) -> torch.Tensor:
    """[128, 4] int64: the byte offset of (row, 32-group) inside a 512-byte scale atom."""
    r = torch.arange(BM, device=device).view(-1, 1)
    j = torch.arange(4, device=device).view(1, -1)
    return (r % 32) * 16 + (r // 32) * 4 + j


def _check_nk(n: int, k: int, what: str) -> None:
    if n % BM:
        raise ValueError(f"{what}: N = {n} rows must be a multiple of {BM}")
    if k % K_TILE:
        raise ValueError(f"{what}: K = {k} must be a multiple of {K_TILE}")


def _tile_rows(t: torch.Tensor, bytes_per_tile_row: int) -> torch.Tensor:
    """[E, N, K_bytes] -> [E, N/128, K_bytes/B, 128, B]."""
    e, n, kb = t.shape
    return t.view(e, n // BM, BM, kb // bytes_per_tile_row, bytes_per_tile_row).permute(0, 1, 3, 2, 4).contiguous()


def _pack_sf(scale: torch.Tensor) -> torch.Tensor:
    """[E, N, K/32] -> [E, N/128, K/128, 512]."""
    e, n, g = scale.shape
    tiles = scale.view(e, n // BM, BM, g // 4, 4).permute(0, 1, 3, 2, 4)  # [E, nt, kt, 128, 4]
    out = torch.empty(e, n // BM, g // 4, SF_ATOM, dtype=torch.uint8, device=scale.device)
    out[..., sf_atom_offsets(scale.device).reshape(-1)] = tiles.reshape(e, n // BM, g // 4, -1)
    return out


def prepack_mxfp4_k128(w: MXFP4Tensor, gate_up: bool = False) -> PackedK128:
    """MXFP4 [E, N, K] -> PackedK128. gate_up=True: W13 (gate rows then up rows) interleaved for SwiGLU tiles."""
    check_mxfp4(w.packed, w.scale, "prepack_mxfp4_k128")
    if w.packed.dim() != 3:
        raise ValueError(f"prepack_mxfp4_k128: expected [E, N, K/2] experts, got {tuple(w.packed.shape)}")
    _e, n, k = w.shape
    _check_nk(n, k, "prepack_mxfp4_k128")
    packed, scale = w.packed, w.scale
    if gate_up:
        perm = gate_up_permutation(n // 2, GATE_UP_GROUP, packed.device)
        packed, scale = packed[:, perm], scale[:, perm]
    return PackedK128(_tile_rows(packed, K_TILE // 2), _pack_sf(scale), n, k, gate_up)
