"""Prepacker for the sm_90a grouped GEMMs: logical MXFP4 experts -> the per-thread register-fragment order the kernel
reads with 16-byte loads, plus scale records per window. Plain torch, any device; `unpack_sm90` is the exact inverse.

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

Row-referenced scales (per row r, over its K/32 groups; one UE8M0 exponent e per 32-group in the logical tensor):
    ref[r] = max e over the row's non-zero groups;  f[r] = max(ref - LUT_TOP, 1)  (the row's reference exponent)
    dd[r, g] = min(f + LUT_TOP - e, 15)  (0 for an all-zero group above ref: its values are zero anyway)
    scales     int32 [E, M/256, W * 128 + 256]: per CTA tile, W windows of 128 record words, then the tile's 256 row
               scales 2^(f - 127) (fp32 bits, CTA row order). CTA row = 128j + 64s + 16warp + 8u + g; the thread's
               two rows r0, r0 + 8 (u = 0, 1) share record word 64j + 32s + 8warp + g of the window, which holds
               pair b = 2u + h = pair(dd_2h, dd_2h+1) of that row's window groups 2h, 2h + 1 (pair(a, b) =
               a | b << 4) at bits [8b + 4, 8b + 12) mod 32 (pair 3 wraps: bits 28-31, 0-3): rotated right by 8b and
               masked with 0xFF0, a word gives 16 x pair b, the pair table's byte offset (an AND for pair 0, a shift
               or a funnel shift and an AND for the others). 16 bits per row and window (the logical scales' 32:
               the format's 4 bytes per 128 K become 2), one 32-bit shared load per thread and subtile; a half
               tile's records are its 64 contiguous words.
    the kernel decodes group q with LUT[dd_q] = E4M3(E2M1 magnitudes * 2^(LUT_TOP - dd)), 16 tables: values up to
    6 * 2^6 = 384 (< 448) at dd = 0, exact down to 0.5 * 2^-8 at dd = 14. A window's accumulator then needs no per-row
    scale: it is promoted with the tokens' activation scales alone (one FFMA per element), and the tile's
    accumulator is multiplied by its rows' 2^(f - 127) once, after its last window (exact: a power of two; before any
    K-split / stream_k reduction, so every partial is already in the row's units). In shared memory the kernel keeps
    the pair table (lut_pair_words: entry pair(a, b) = LUT[a], LUT[b], 16 bytes): two k32 steps' tables in one
    16-byte shared load at the offset a record word gives.

Effective weight = E4M3_RNE(v * 2^(LUT_TOP - dd)) * 2^(f - 127): exactly the MXFP4 value whenever dd <= 14, i.e. for
every group of a row whose non-zero groups' exponents span at most 14 binades; `lossy_groups` counts the non-zero
groups where it is not (the row's smallest, more than 2^14 below its largest). W13 rows are interleaved gate/up in
groups of 8 (gcmoe_core.layouts): thread rows r0/r1 are the gate and up rows of one intermediate column, so SwiGLU
runs in registers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gcmoe_core.formats import E2M1_VALUES, MXFP4Tensor, check_mxfp4, e2m1_decode, unpack_nibbles
from gcmoe_core.layouts import gate_up_permutation, inverse_permutation

from .decode_ptx import SIGN_BITS

TILE_M = 256
WINDOW_K = 128
GATE_UP_GROUP = 8
MAX_DD = 15
RECORD_WORDS = TILE_M // 2  # record words per (tile, window): 16 bits per row
LUT_TOP = 6  # LUT[dd] = E4M3(magnitudes * 2^(LUT_TOP - dd)): 6 * 2^6 = 384 fits E4M3 (448); dd <= 14 is exact
EXACT_DD = LUT_TOP + 8  # E4M3 subnormals reach 0.5 * 2^-8


@dataclass(frozen=True)
class PackedSm90:
    data: torch.Tensor  # uint8 [E, M/256, K/128, 2, 2, 2, 128, 16]
    scales: torch.Tensor  # int32 [E, M/256, K/128 * 128 + 256]: per tile its windows' record words, its row scales
    m: int
    k: int
    gate_up: bool
    lossy_groups: int
    # the decode tables the kernels read (lut_pair_words, int32 [1024]), made with the weights on their device
    lut: torch.Tensor | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.lut is None or self.lut.device != self.data.device:
            object.__setattr__(self, "lut", lut_pair_words().reshape(-1).to(self.data.device))

    @property
    def experts(self) -> int:
        return self.data.shape[0]


def lut_words() -> torch.Tensor:
    """int32 [16, 2]: LUT[dd] = E4M3 bytes of the E2M1 magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6 times 2^(LUT_TOP - dd)
    (RNE), packed little-endian into two words (magnitude codes 0-3, 4-7) for the decode's byte permute."""
    mags = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    rows = []
    for dd in range(MAX_DD + 1):
        b = (mags * 2.0 ** (LUT_TOP - dd)).to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int64)
        rows.append([int(b[0] | b[1] << 8 | b[2] << 16 | b[3] << 24), int(b[4] | b[5] << 8 | b[6] << 16 | b[7] << 24)])
    return torch.tensor(rows, dtype=torch.int64).to(torch.int32)


def lut_pair_words() -> torch.Tensor:
    """int32 [256, 4]: the kernel's shared-memory table, entry pair(a, b) = a | b << 4 -> LUT[a] (2 words), LUT[b]
    (2 words): two k32 steps' decode tables in one 16-byte load at byte offset 16 pair(a, b)."""
    lut = lut_words()
    idx = torch.arange(256)
    return torch.cat([lut[idx & 0xF], lut[idx >> 4]], dim=1).contiguous()


def _cta_rows() -> torch.Tensor:
    """[128 words, 2 u]: the CTA rows whose records share each record word (word 64j + 32s + 8warp + g holds rows
    128j + 64s + 16warp + g and that + 8)."""
    word = torch.arange(RECORD_WORDS)
    r0 = (word // 8) * 16 + word % 8
    return torch.stack([r0, r0 + 8], dim=1)


def make_records(dd: torch.Tensor) -> torch.Tensor:
    """dd [..., 256 CTA rows, 4 groups] (0..MAX_DD) -> int32 record words [..., 128] (the layout in the module
    docstring)."""
    d = dd.to(torch.int64)[..., _cta_rows().to(dd.device), :]  # [..., word, u, q]
    pairs = d[..., 0::2] | d[..., 1::2] << 4  # [..., word, u, h]
    word = sum(pairs[..., u, h] << (8 * (2 * u + h)) for u in range(2) for h in range(2))
    word = (word << 4 | word >> 28) & 0xFFFFFFFF  # pair b at bits 8b + 4 (rotated left by 4)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def record_pair(words: torch.Tensor, u: int, h: int) -> torch.Tensor:
    """pair(dd_2h, dd_2h+1) of rows u of each record word: the pair table's entry for k32 steps 2h, 2h + 1."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    return ((w >> 4 | w << 28) >> (8 * (2 * u + h))) & 0xFF


def record_dd(words: torch.Tensor) -> torch.Tensor:
    """record words [..., 128] -> dd [..., 256 CTA rows, 4]."""
    d = torch.stack(
        [torch.stack([(record_pair(words, u, q // 2) >> (4 * (q % 2))) & 0xF for q in range(4)], -1) for u in range(2)],
        dim=-2,
    )  # [..., word, u, q]
    out = torch.empty(*words.shape[:-1], TILE_M, 4, dtype=torch.int64, device=words.device)
    out[..., _cta_rows().to(words.device), :] = d
    return out


def tile_scale_words(windows: int) -> int:
    """int32 words of one tile's block of PackedSm90.scales: its windows' record words, then its row scales."""
    return windows * RECORD_WORDS + TILE_M


def split_scales(p: PackedSm90) -> tuple[torch.Tensor, torch.Tensor]:
    """p.scales -> (record words int32 [E, MT, W, 128], row scales fp32 [E, MT, 256 CTA rows])."""
    e, mt, nw = p.data.shape[:3]
    words = p.scales[..., : nw * RECORD_WORDS].view(e, mt, nw, RECORD_WORDS)
    return words, p.scales[..., nw * RECORD_WORDS :].view(torch.float32)


def row_exponents(scale: torch.Tensor, nonzero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """UE8M0 exponents [..., G] of a row's 32-groups and which groups hold a non-zero code -> (f [...], the row's
    reference exponent; dd [..., G], each group's table index; the count of lossy non-zero groups, dd > EXACT_DD)."""
    e = scale.to(torch.int32)
    ref = torch.where(nonzero, e, -1).amax(dim=-1)
    ref = torch.where(ref < 0, e.amax(dim=-1), ref)  # an all-zero row: any reference holds its (zero) values
    f = (ref - LUT_TOP).clamp(min=1)
    dd = f.unsqueeze(-1) + LUT_TOP - e
    lossy = int((nonzero & (dd > EXACT_DD)).sum())
    return f, dd.clamp(0, MAX_DD), lossy


def _pow2(exponent: torch.Tensor) -> torch.Tensor:
    """fp32 2^exponent, elementwise (exact)."""
    return torch.ldexp(torch.ones_like(exponent, dtype=torch.float32), exponent)


def _nonzero_groups(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] codes -> bool [..., K/32]: the 32-groups holding a non-zero magnitude (sign bits ignored)."""
    codes = unpack_nibbles(packed)
    return (codes & 7).ne(0).view(*codes.shape[:-1], -1, 32).any(-1)


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


def thread_rows_cols():
    """(r0, t) of each thread tw = 32 warp + 4 g + t of a warpgroup, in tw order: its first row r0 = 16 warp + g of
    a 64-row subtile, and its column group t."""
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
    r0, tt = thread_rows_cols()
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
    f, dd, lossy = row_exponents(scale, _nonzero_groups(packed))  # [E, M], [E, M, K/32]
    words = make_records(dd.view(e, mt, 256, nw, 4).transpose(2, 3))  # [E, MT, W, 128]
    rs = _pow2(f - 127).view(e, mt, 256)
    scales = torch.cat([words.reshape(e, mt, nw * RECORD_WORDS), rs.view(torch.int32)], dim=-1).contiguous()
    return PackedSm90(data, scales, m, k, gate_up, lossy)


def unpack_sm90(p: PackedSm90) -> MXFP4Tensor:
    """Exact inverse of prepack_sm90 when every group's dd fit 0..15 unclamped (an all-zero group above its row's
    reference, or one more than 2^15 below it, is rebuilt at the clamp: the same values in the kernel)."""
    e, mt, nw = p.data.shape[:3]
    dev = p.data.device
    d = sign_layout(p.data, to_split=False).view(e, mt, nw, 2, 2, 2, 128, 2, 2, 4).permute(0, 1, 2, 3, 4, 5, 7, 8, 6, 9)
    d = d.reshape(e, mt, nw, 2, 2, 4, 2, 128, 4)  # [.., step, A/B, tw, 4 B]
    r0, tt = thread_rows_cols()
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
    words, rs = split_scales(p)
    f = (rs.view(torch.int32).to(torch.int64) >> 23).view(e, mt, 256, 1, 1)
    dd = record_dd(words).transpose(2, 3)  # [E, MT, 256, W, 4]
    scale = (f + LUT_TOP - dd).clamp(0, 255).to(torch.uint8).reshape(e, p.m, p.k // 32)
    if p.gate_up:
        inv = inverse_permutation(gate_up_permutation(p.m // 2, GATE_UP_GROUP, dev))
        packed, scale = packed[:, inv], scale[:, inv]
    return MXFP4Tensor(packed.contiguous(), scale.contiguous())


def effective_weights_sm90(w: MXFP4Tensor) -> torch.Tensor:
    """fp32 [E, M, K]: the weights the sm90 kernel multiplies (logical row order):
    E4M3_RNE(v * 2^(LUT_TOP - dd)) * 2^(f - 127). Equal to w.dequantize() wherever dd <= EXACT_DD."""
    e, m, k = w.shape
    f, dd, _ = row_exponents(w.scale, _nonzero_groups(w.packed))
    v = e2m1_decode(unpack_nibbles(w.packed)).view(e, m, k // 32, 32)
    q = (v * _pow2(LUT_TOP - dd).unsqueeze(-1)).to(torch.float8_e4m3fn)
    return (q.float() * _pow2(f - 127).view(e, m, 1, 1)).view(e, m, k)
