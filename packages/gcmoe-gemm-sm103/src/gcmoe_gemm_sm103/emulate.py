"""The sm_103a kernels' tile schedule, indexing and math (kernel_grouped's docstring) replayed in plain torch on the
*prepacked* tensors — proof, on a CPU, that the K128 layout, the scale-factor atoms and the epilogues are what the
reference computes (the tcgen05 instructions themselves cannot run here).

Token scale factors: each token's per-128 power-of-two activation scale is 4 identical UE8M0 bytes (one per 32), laid
out in the same 512-byte atoms as the weights' (`token_scale_atoms`).
"""

from __future__ import annotations

import torch

from gcmoe_core.formats import MXFP4Tensor, e2m1_decode, quantize_fp8_e4m3_1x128, unpack_nibbles
from gcmoe_core.grouping import Activations, RowLayout

from .config import K_TILE, MMA_M, TILE_M
from .prepack import GATE_UP_GROUP, PackedK128, _pack_sf, prepack_mxfp4_k128, sf_atom_offsets


def token_scale_atoms(sxT: torch.Tensor) -> torch.Tensor:
    """fp32 power-of-two scales [K/128, R] (R a multiple of 128) -> UE8M0 atoms [R/128, K/128, 512]."""
    r = sxT.shape[1]
    if r % MMA_M:
        raise ValueError(f"token_scale_atoms: rows R = {r} must be a multiple of {MMA_M}")
    _, ex = torch.frexp(sxT.t())  # scale = 0.5 * 2^ex
    byte = (ex - 1 + 127).clamp(0, 254).to(torch.uint8)
    return _pack_sf(byte.repeat_interleave(4, dim=1).unsqueeze(0))[0]


def _sf_values(atom: torch.Tensor) -> torch.Tensor:
    """One 512-byte atom -> [128 rows, 4 groups] fp32 factors 2^(b - 127)."""
    b = atom[sf_atom_offsets(atom.device)].to(torch.int32)
    return torch.ldexp(torch.ones_like(b, dtype=torch.float32), b - 127)


def _tile_a(p: PackedK128, e: int, nt: int, kt: int) -> torch.Tensor:
    """A tile [128 rows, 128 K] fp32 from the prepacked bytes and scale atom."""
    v = e2m1_decode(unpack_nibbles(p.data[e, nt, kt]))  # [128, 128]
    return v * _sf_values(p.sf[e, nt, kt]).repeat_interleave(32, dim=1)


def _tile_b(x_rows: torch.Tensor, sfb: torch.Tensor, row0: int, n: int, kt: int) -> torch.Tensor:
    """B tile [n tokens, 128 K] fp32: FP8 rows times their UE8M0 factors (from the 128-row atom holding them)."""
    x = x_rows[row0 : row0 + n, kt * K_TILE : (kt + 1) * K_TILE].view(torch.float8_e4m3fn).float()
    f = _sf_values(sfb[row0 // MMA_M, kt])[row0 % MMA_M : row0 % MMA_M + n]
    return x * f.repeat_interleave(32, dim=1)


def _accumulate(p: PackedK128, e: int, mt: int, x_rows, sfb, row0: int, n: int) -> torch.Tensor:
    """[256, n] fp32 accumulator of one CTA tile: the k-tile loop of both 128-row MMAs."""
    acc = torch.zeros(TILE_M, n, dtype=torch.float32, device=x_rows.device)
    for kt in range(p.k // K_TILE):
        b = _tile_b(x_rows, sfb, row0, n, kt)
        for s in range(2):
            acc[s * MMA_M : (s + 1) * MMA_M] += _tile_a(p, e, 2 * mt + s, kt) @ b.T
    return acc


def _swiglu_tile(acc: torch.Tensor, route_w: torch.Tensor) -> torch.Tensor:
    """[256 rows, n] -> h [n, 128 columns]: in each 32-row block, rows 0-15 are gate and 16-31 up of 16 columns."""
    blocks = acc.view(TILE_M // (2 * GATE_UP_GROUP), 2, GATE_UP_GROUP, -1)  # [8 blocks, gate/up, 16, n]
    gate, up = blocks[:, 0].reshape(-1, acc.shape[1]), blocks[:, 1].reshape(-1, acc.shape[1])
    return (torch.nn.functional.silu(gate) * up * route_w.unsqueeze(0)).T


def emulate_w1(p: PackedK128, acts: Activations, sfb: torch.Tensor, layout: RowLayout):
    """-> (hq uint8 [R, I], hsT fp32 [I/128, R]) for the valid rows, as the W1 kernel writes them."""
    inter = p.n // 2
    hq = torch.zeros(layout.rows, inter, dtype=torch.uint8, device=acts.x_rows.device)
    hsT = torch.zeros(inter // K_TILE, layout.rows, dtype=torch.float32, device=acts.x_rows.device)
    for e, (off, cnt) in enumerate(zip(layout.offsets.tolist(), layout.counts.tolist())):
        for row0 in range(off, off + cnt, layout.n_tile):
            n = min(layout.n_tile, off + cnt - row0)
            for mt in range(p.n // TILE_M):
                acc = _accumulate(p, e, mt, acts.x_rows, sfb, row0, n)
                q, s = quantize_fp8_e4m3_1x128(_swiglu_tile(acc, acts.route_w[row0 : row0 + n]))
                hq[row0 : row0 + n, mt * K_TILE : (mt + 1) * K_TILE] = q.view(torch.uint8)
                hsT[mt, row0 : row0 + n] = s[:, 0]
    return hq, hsT


def emulate_w2(p: PackedK128, hq: torch.Tensor, sfb_h: torch.Tensor, layout: RowLayout, out: torch.Tensor):
    """out[src_slot[row]] = bf16 rows of W2 for the valid rows."""
    for e, (off, cnt) in enumerate(zip(layout.offsets.tolist(), layout.counts.tolist())):
        for row0 in range(off, off + cnt, layout.n_tile):
            n = min(layout.n_tile, off + cnt - row0)
            dst = layout.src_slot[row0 : row0 + n].long()
            for mt in range(p.n // TILE_M):
                acc = _accumulate(p, e, mt, hq, sfb_h, row0, n)
                out[dst, mt * TILE_M : (mt + 1) * TILE_M] = acc.T.to(torch.bfloat16)
    return out


def prepack_layer(w13: MXFP4Tensor, w2: MXFP4Tensor) -> tuple[PackedK128, PackedK128]:
    return prepack_mxfp4_k128(w13, gate_up=True), prepack_mxfp4_k128(w2, gate_up=False)
