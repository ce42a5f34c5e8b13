"""Prepacker for the sm_90a grouped GEMMs: logical MXFP4 experts -> the per-thread register-fragment order the kernel
reads with 16-byte loads, plus windowed scales. Plain torch, any device; `unpack` is the exact inverse.

Tiling (operand swap: weight rows are WGMMA's M, tokens are N; K = reduction):
    CTA tile   256 rows = 2 warpgroups (j) x 2 subtiles (s) x 64 rows; K in windows of 128 (4 k32 WGMMA steps)
    thread     tw = 32*warp + 4*g + t   (g = lane // 4, t = lane % 4) of warpgroup j holds, per subtile and k32
               step, rows r0 = 16*warp + g and r1 = r0 + 8, K values 4t..4t+3 and 16+4t..16+4t+3 (the WGMMA
               register-A fragment for 8-bit types: a0 a1 a2 a3)
    words      word_A = row r0's 8 codes (nibbles 0-3: k = 4t.., nibbles 4-7: k = 16+4t..) -> decodes to a0, a2
               word_B = row r1's 8 codes                                            -> decodes to a1, a3
               with the sign bits moved (decode_ptx.SIGN_BITS): code n keeps its magnitude in nibble n, its sign
               goes to bit 8n + 3 (n < 4) or 8(n - 4) + 7, where the decode finds it without a byte permute
    data       uint8 [E, M/256, K/128, j(2), s(2), half(2), 128 tw, 16 B]; half h holds k32 steps 2h, 2h+1 as
               [A(2h), B(2h), A(2h+1), B(2h+1)]: one 16-byte load per (subtile, half) per thread, 128 threads read
               2 KiB contiguous, and one window of a CTA tile is 16 KiB contiguous (one bulk copy into a stage).

Windowed scales (per row, per 128-K window w; one UE8M0 per 32-group q = 0..3 in the logical tensor):
    base[r, w] = max_q e[r, 4w+q];  dd[r, w, q] = min(base - e, 15)
    record     int32 per (E, M/256, K/128, CTA row); CTA row = 128j + 64s + 16warp + 8u + g:
               bits [4, 12) pair(dd_0, dd_1), [12, 20) pair(dd_2, dd_3), [23, 31) base (pair(a, b) = a | b << 4)
    the kernel decodes group q with LUT[dd_q] (E4M3 of the E2M1 magnitudes times 2^-dd, 16 tables) and promotes each
    window's accumulator with 2^(base - 127) (and the activation's per-128 scale). In shared memory it keeps the
    pair table (lut_pair_words: entry pair(a, b) = LUT[a], LUT[b], 16 bytes), so one AND gives the byte offset of
    steps 0-1's two tables (rec & 0xFF0), a shift and an AND those of steps 2-3, one AND the base as an fp32 power of
    two (rec & 0x7F800000), and one 16-byte shared load fetches two steps' tables: 4 ALU instructions and 2 loads
    per record, where fields at 16 + 4q took 9 and 4 (sass_sm90_mix).

Effective weight = E4M3_RNE(v * 2^-dd) * 2^(base-127): exactly the MXFP4 value whenever dd <= 8 (E4M3 subnormals
reach 2^-9 = 0.5 * 2^-8); `lossy_groups` counts the non-zero groups where it is not. W13 rows are interleaved
gate/up in groups of 8 (gcmoe_core.layouts): thread rows r0/r1 are the gate and up rows of one intermediate column,
so SwiGLU runs in registers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gcmoe_core.formats import E2M1_VALUES, MXFP4Tensor, check_mxfp4, e2m1_decode, unpack_nibbles
from gcmoe_core.layouts import gate_up_permutation, inverse_permutation

from .decode_ptx import SIGN_BITS

TILE_M = 256
WINDOW_K = 128
GATE_UP_GROUP = 8
MAX_DD = 15
PAIR_SHIFTS = (4, 12)  # record bits of pair(dd_0, dd_1) and pair(dd_2, dd_3): rec & 0xFF0 is 16 x pair(dd_0, dd_1)
BASE_SHIFT = 23  # the base's record bits: rec & 0x7F800000 is 2^(base - 127) as fp32 bits


@dataclass(frozen=True)
class PackedSm90:
    data: torch.Tensor  # uint8 [E, M/256, K/128, 2, 2, 2, 128, 16]
    scales: torch.Tensor  # int32 [E, M/256, K/128, 256]
    m: int
    k: int
    gate_up: bool
    lossy_groups: int

    @property
    def experts(self) -> int:
        return self.data.shape[0]


def lut_words() -> torch.Tensor:
    """int32 [16, 2]: LUT[dd] = E4M3 bytes of the E2M1 magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6 times 2^-dd (RNE),
    packed little-endian into two words (magnitude codes 0-3, 4-7) for the decode's byte permute."""
    mags = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    rows = []
    for dd in range(MAX_DD + 1):
        b = (mags * 2.0**-dd).to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int64)
        rows.append([int(b[0] | b[1] << 8 | b[2] << 16 | b[3] << 24), int(b[4] | b[5] << 8 | b[6] << 16 | b[7] << 24)])
    return torch.tensor(rows, dtype=torch.int64).to(torch.int32)


def lut_pair_words() -> torch.Tensor:
    """int32 [256, 4]: the kernel's shared-memory table, entry pair(a, b) = a | b << 4 -> LUT[a] (2 words), LUT[b]
    (2 words): two k32 steps' decode tables in one 16-byte load at byte offset 16 pair(a, b)."""
    lut = lut_words()
    idx = torch.arange(256)
    return torch.cat([lut[idx & 0xF], lut[idx >> 4]], dim=1).contiguous()


def make_records(base: torch.Tensor, dd: torch.Tensor) -> torch.Tensor:
    """int32 records from base [...] (0..255) and dd [..., 4] (0..MAX_DD) (the layout in the module docstring)."""
    pairs = [dd[..., 2 * h] | dd[..., 2 * h + 1] << 4 for h in range(2)]
    rec = base.to(torch.int64) << BASE_SHIFT | pairs[0].to(torch.int64) << PAIR_SHIFTS[0]
    return (rec | pairs[1].to(torch.int64) << PAIR_SHIFTS[1]).to(torch.int32)


def record_base(rec: torch.Tensor) -> torch.Tensor:
    return (rec.to(torch.int64) >> BASE_SHIFT) & 0xFF


def record_pair(rec: torch.Tensor, half: int) -> torch.Tensor:
    """pair(dd_{2 half}, dd_{2 half + 1}) of each record: the pair table's entry for k32 steps 2 half, 2 half + 1."""
    return (rec.to(torch.int64) >> PAIR_SHIFTS[half]) & 0xFF


def record_dd(rec: torch.Tensor) -> torch.Tensor:
    """dd [..., 4] of each record."""
    return torch.stack([(record_pair(rec, q // 2) >> (4 * (q % 2))) & 0xF for q in range(4)], dim=-1)


def sign_layout(data: torch.Tensor, to_split: bool) -> torch.Tensor:
    """uint8 [..., 4n] as little-endian 32-bit code words: standard layout (code n's sign at bit 4n + 3) <-> the
    split-sign layout the kernel decodes (sign at SIGN_BITS[n]); magnitudes stay in place."""
    w = data.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    out = w & 0x77777777
    for n, bit in enumerate(SIGN_BITS):
        src, dst = (4 * n + 3, bit) if to_split else (bit, 4 * n + 3)
        out |= ((w >> src) & 1) << dst
    out = torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)
    return out.view(torch.uint8).view(data.shape)


def _thread_rows_cols():
    """Index helpers over (warp, g, t) of a warpgroup: rows r0 within the 64-row subtile, and tw."""
    warp = torch.arange(4).view(4, 1, 1)
    g = torch.arange(8).view(1, 8, 1)
    t = torch.arange(4).view(1, 1, 4)
    r0 = (16 * warp + g).expand(4, 8, 4).reshape(-1)  # [128] in tw order (tw = 32 warp + 4 g + t)
    tt = t.expand(4, 8, 4).reshape(-1)
    return r0, tt


def _word_byte_index() -> torch.Tensor:
    """[4 t, 4 bytes]: which byte of a row's 16-byte k32 group lands in each byte of the thread's word."""
    t = torch.arange(4).view(4, 1)
    return torch.cat([2 * t, 2 * t + 1, 8 + 2 * t, 9 + 2 * t], dim=1)


def prepack_sm90(w: MXFP4Tensor, gate_up: bool = False) -> PackedSm90:
    """MXFP4 [E, M, K] -> PackedSm90. gate_up=True for W13 ([gate rows; up rows]), interleaved for SwiGLU."""
    check_mxfp4(w.packed, w.scale, "prepack_sm90")
    if w.packed.dim() != 3:
        raise ValueError(f"prepack_sm90: expected [E, M, K/2] experts, got {tuple(w.packed.shape)}")
    e, m, k = w.shape
    if m % TILE_M:
        raise ValueError(f"prepack_sm90: M = {m} rows must be a multiple of {TILE_M}")
    if k % WINDOW_K:
        raise ValueError(f"prepack_sm90: K = {k} must be a multiple of {WINDOW_K}")
    dev = w.packed.device
    packed, scale = w.packed, w.scale
    if gate_up:
        perm = gate_up_permutation(m // 2, GATE_UP_GROUP, dev)
        packed, scale = packed[:, perm], scale[:, perm]
    mt, nw = m // TILE_M, k // WINDOW_K
    # ---- data: [E, MT, 2j, 2s, 64 rows, W, 4 steps, 16 B]
    rows = packed.view(e, mt, 2, 2, 64, nw, 4, 16)
    r0, tt = _thread_rows_cols()
    r0, tt = r0.to(dev), tt.to(dev)
    bidx = _word_byte_index().to(dev)[tt]  # [128, 4]
    out = torch.empty(e, mt, nw, 2, 2, 4, 2, 128, 4, dtype=torch.uint8, device=dev)  # [.., step, A/B, tw, 4 B]
    for u in range(2):  # u = 0: word_A (row r0), 1: word_B (row r1 = r0 + 8)
        sel = rows[:, :, :, :, r0 + 8 * u]  # [E, MT, 2, 2, 128, W, 4, 16]
        g = torch.gather(sel, -1, bidx.view(1, 1, 1, 1, 128, 1, 1, 4).expand(*sel.shape[:-1], 4))
        out[:, :, :, :, :, :, u] = g.permute(0, 1, 5, 2, 3, 6, 4, 7)  # [E, MT, W, 2, 2, 4 steps, 128, 4]
    # [E, MT, W, j, s, steps(4)=half(2)*2, A/B, tw, 4] -> [E, MT, W, j, s, half, tw, (step-in-half, A/B, 4 B)]
    data = out.view(e, mt, nw, 2, 2, 2, 2, 2, 128, 4).permute(0, 1, 2, 3, 4, 5, 8, 6, 7, 9)
    data = sign_layout(data.reshape(e, mt, nw, 2, 2, 2, 128, 16), to_split=True)
    # ---- scales
    sc = scale.view(e, mt, 256, nw, 4).to(torch.int32)
    base = sc.amax(dim=-1)
    dd = (base.unsqueeze(-1) - sc).clamp(max=MAX_DD)
    rec = make_records(base, dd)
    scales = rec.permute(0, 1, 3, 2).contiguous()  # [E, MT, W, 256]
    nonzero = unpack_nibbles(packed).view(e, m, k // 32, 32).ne(0).any(-1).view(e, mt, 256, nw, 4)
    lossy = int((nonzero & (dd > 8)).sum())
    return PackedSm90(data, scales, m, k, gate_up, lossy)


def unpack_sm90(p: PackedSm90) -> MXFP4Tensor:
    """Exact inverse of prepack_sm90 when no group needed dd > 15 (the scale of such a group is then rebuilt as
    base - 15, which holds the same values: every element of it decodes to zero in the kernel as well)."""
    e, mt, nw = p.data.shape[:3]
    dev = p.data.device
    d = sign_layout(p.data, to_split=False).view(e, mt, nw, 2, 2, 2, 128, 2, 2, 4).permute(0, 1, 2, 3, 4, 5, 7, 8, 6, 9)
    d = d.reshape(e, mt, nw, 2, 2, 4, 2, 128, 4)  # [.., step, A/B, tw, 4 B]
    r0, tt = _thread_rows_cols()
    r0, tt = r0.to(dev), tt.to(dev)
    bidx = _word_byte_index().to(dev)[tt]
    rows = torch.empty(e, mt, 2, 2, 64, nw, 4, 16, dtype=torch.uint8, device=dev)
    for u in range(2):
        src = d[:, :, :, :, :, :, u].permute(0, 1, 3, 4, 6, 2, 5, 7)  # [E, MT, 2, 2, 128 tw, W, 4, 4 B]
        for t in range(4):  # the 32 threads with this t cover each row once: no duplicate row indices
            tw = (tt == t).nonzero().squeeze(1).to(dev)
            for b in range(4):
                rows[:, :, :, :, r0[tw] + 8 * u, :, :, int(bidx[tw[0], b])] = src[:, :, :, :, tw, :, :, b]
    packed = rows.view(e, p.m, p.k // 2)
    rec = p.scales.permute(0, 1, 3, 2)  # [E, MT, 256, W]
    base, dd = record_base(rec), record_dd(rec)
    scale = (base.unsqueeze(-1) - dd).clamp(min=0).to(torch.uint8).reshape(e, p.m, p.k // 32)
    if p.gate_up:
        inv = inverse_permutation(gate_up_permutation(p.m // 2, GATE_UP_GROUP, dev))
        packed, scale = packed[:, inv], scale[:, inv]
    return MXFP4Tensor(packed.contiguous(), scale.contiguous())


def effective_weights_sm90(w: MXFP4Tensor) -> torch.Tensor:
    """fp32 [E, M, K]: the weights the sm90 kernel multiplies (logical row order): E4M3_RNE(v * 2^-dd) * 2^(base-127).
    Equal to w.dequantize() wherever dd <= 8."""
    e, m, k = w.shape
    sc = w.scale.view(e, m, k // WINDOW_K, 4).to(torch.int32)
    base = sc.amax(-1, keepdim=True)
    dd = (base - sc).clamp(max=MAX_DD)
    v = e2m1_decode(unpack_nibbles(w.packed)).view(e, m, k // WINDOW_K, 4, 32)
    q = (v * torch.ldexp(torch.ones_like(dd, dtype=torch.float32), -dd).unsqueeze(-1)).to(torch.float8_e4m3fn)
    return (q.float() * torch.ldexp(torch.ones_like(base, dtype=torch.float32), base - 127).unsqueeze(-1)).view(e, m, k)


def decode_prepacked_reference(p: PackedSm90) -> torch.Tensor:
    """What the kernel's decode computes, replayed in torch from the prepacked bytes alone (bit-exact model of the
    register path: nibble selection, the pair table's entry at the record's offset, sign, window base), in logical row
    order: fp32 [E, M, K].
    (The sign bits are read back from their split-sign positions first: decode_ptx models the PTX itself.)"""
    e, mt, nw = p.data.shape[:3]
    table = lut_pair_words().to(p.data.device).to(torch.int64) & 0xFFFFFFFF  # [256, 4]
    words = sign_layout(p.data, to_split=False).view(e, mt, nw, 2, 2, 2, 128, 4, 4)  # [.., half, tw, word, 4 B]
    words = words.to(torch.int64)
    word = words[..., 0] | words[..., 1] << 8 | words[..., 2] << 16 | words[..., 3] << 24  # [.., half, tw, 4]
    rec = p.scales.to(torch.int64) & 0xFFFFFFFF  # [E, MT, W, 256]
    out = torch.empty(e, mt, nw, 2, 2, 64, 128, dtype=torch.float32, device=p.data.device)  # [.., j, s, row, k]
    r0, tt = _thread_rows_cols()
    for half in range(2):
        for si in range(2):
            step = 2 * half + si
            for u in range(2):
                wv = word[:, :, :, :, :, half, :, 2 * si + u]  # [E, MT, W, j, s, tw]
                cta_row = (
                    torch.arange(2).view(2, 1, 1) * 128
                    + torch.arange(2).view(1, 2, 1) * 64
                    + (r0 + 8 * u).view(1, 1, 128)
                ).to(p.data.device)  # [j, s, tw]
                rr = rec[:, :, :, cta_row]  # [E, MT, W, j, s, tw]
                base = record_base(rr)
                entry = table[record_pair(rr, half)]  # [E, MT, W, j, s, tw, 4 words]: LUT[dd_2half], LUT[dd_2half+1]
                for nib in range(8):
                    code = (wv >> (4 * nib)) & 0xF
                    lut_word = entry.gather(-1, (2 * si + (code & 7) // 4).unsqueeze(-1)).squeeze(-1)
                    mag = (lut_word >> (8 * (code & 3))) & 0xFF
                    byte = mag | ((code & 8) << 4)
                    val = byte.to(torch.uint8).view(torch.float8_e4m3fn).float()
                    val = val * torch.ldexp(torch.ones_like(base, dtype=torch.float32), base - 127)
                    kk = 32 * step + (4 * tt + nib if nib < 4 else 16 + 4 * tt + nib - 4).to(p.data.device)
                    rows = (r0 + 8 * u).to(p.data.device)
                    out[:, :, :, :, :, rows, kk] = val  # (row, k) pairs per thread
    # out: [E, MT, W, j, s, 64, 128] -> [E, M, K] in prepacked row order
    full = out.permute(0, 1, 3, 4, 5, 2, 6).reshape(e, p.m, p.k)
    if p.gate_up:
        inv = inverse_permutation(gate_up_permutation(p.m // 2, GATE_UP_GROUP, full.device))
        full = full[:, inv]
    return full
