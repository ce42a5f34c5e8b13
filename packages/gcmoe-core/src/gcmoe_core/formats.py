"""Numeric formats of gcmoe — the one home of every encode and decode (plain torch, any device).

MXFP4 weights (bit-compatible with OCP Microscaling v1.0, "MXFP4")
    element  FP4 E2M1, 4 bits [s e1 e0 m]; magnitude codes 0..7 = {0, 0.5, 1, 1.5, 2, 3, 4, 6}; no Inf/NaN
    packing  two elements per byte along K: element 2j in the LOW nibble, element 2j+1 in the HIGH nibble
    scale    one UE8M0 per 32 consecutive K elements; byte b means 2^(b-127); b = 0xFF means NaN (whole group NaN)
    tensor   logical w [..., N, K]  ->  packed uint8 [..., N, K/2]  +  scale uint8 [..., N, K/32]

    Quantisation (ours; any MXFP4 producer's tensors load as they are): per group of 32, the smallest power of two
    2^e with amax <= 6 * 2^e (no element saturates), then round-to-nearest-even onto the E2M1 grid. A zero group
    gets b = 0. OCP's own recipe (e = floor(log2 amax) - 2, saturating) differs only in the scale choice.

FP8 activations (and the W1 -> W2 intermediate)
    element  FP8 E4M3 (torch.float8_e4m3fn), max 448, round-to-nearest-even, saturating at +-448
    scale    one fp32 per token per 128 consecutive K, always a power of two (so it is also a UE8M0 byte:
             Hopper multiplies the fp32; Blackwell's block-scaled MMA reads it as 4 identical UE8M0 per-32 scales)
             chosen as the smallest 2^e with amax <= 448 * 2^e; a zero block gets 1.0
    tensor   x [T, K] -> q float8_e4m3fn [T, K] + scale float32 [T, K/128]
    non-finite input propagates: a block holding NaN or Inf gets a NaN scale, so its values dequantise to NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
MXFP4_GROUP = 32
FP8_E4M3_MAX = 448.0
FP8_GROUP = 128
UE8M0_BIAS = 127
UE8M0_NAN = 0xFF

# Rounding thresholds between neighbouring E2M1 magnitudes, with the tie going to the even code (m bit 0):
# (threshold, inclusive) -> the code increments when |v| > t (or >= t when inclusive).
_E2M1_STEPS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


# ----------------------------------------------------------------------------------------------------------- E2M1
def e2m1_encode(v: torch.Tensor) -> torch.Tensor:
    """fp32 values (already divided by their scale) -> 4-bit E2M1 codes in uint8 (round to nearest even,
    saturate at +-6; a value that rounds to zero is +0). NaN is not representable: it raises."""
    if not v.is_floating_point():
        raise ValueError(f"e2m1_encode: expected a floating tensor, got {v.dtype}")
    if v.numel() and bool(torch.isnan(v).any()):
        raise ValueError("e2m1_encode: NaN has no E2M1 encoding (FP4 E2M1 has no NaN); the input holds NaN")
    a = v.abs().float()
    code = torch.zeros_like(a, dtype=torch.uint8)
    for t, inclusive in _E2M1_STEPS:
        code += (a >= t if inclusive else a > t).to(torch.uint8)
    sign = ((v < 0) & (code > 0)).to(torch.uint8) << 3
    return code | sign


def e2m1_decode(code: torch.Tensor) -> torch.Tensor:
    """4-bit E2M1 codes (uint8, values 0..15) -> fp32."""
    lut = torch.tensor(E2M1_VALUES + tuple(-x for x in E2M1_VALUES), dtype=torch.float32, device=code.device)
    return lut[code.long() & 0xF]


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] uint8 codes (0..15) -> [..., K/2] bytes, element 2j in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_nibbles: last dimension must be even, got {codes.shape[-1]}")
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] bytes -> [..., K] uint8 codes; inverse of pack_nibbles."""
    lo = packed & 0xF
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2)


# ---------------------------------------------------------------------------------------------------------- UE8M0
def ue8m0_decode(b: torch.Tensor) -> torch.Tensor:
    """UE8M0 bytes -> fp32 powers of two (2^(b-127)); 0xFF -> NaN. b = 0 (2^-127) is an fp32 subnormal, exact."""
    e = b.to(torch.int32) - UE8M0_BIAS
    out = torch.ldexp(torch.ones_like(e, dtype=torch.float32), e)
    return torch.where(b.to(torch.int32) == UE8M0_NAN, torch.full_like(out, float("nan")), out)


def _pow2_exponent_at_least(amax: torch.Tensor, limit: float, limit_mantissa: float, limit_exp: int) -> torch.Tensor:
    """Smallest integer e with amax <= limit * 2^e, computed exactly from frexp (no log2 rounding).

    limit = limit_mantissa * 2^limit_exp with limit_mantissa in [0.5, 1). amax = m * 2^q, m in [0.5, 1):
    limit * 2^e >= amax  <=>  e >= q - limit_exp when m <= limit_mantissa, else e >= q - limit_exp + 1.
    """
    assert limit == limit_mantissa * 2.0**limit_exp
    m, q = torch.frexp(amax.float())
    return torch.where(m <= limit_mantissa, q - limit_exp, q - limit_exp + 1).to(torch.int32)


def ue8m0_encode_for_amax(amax: torch.Tensor) -> torch.Tensor:
    """MXFP4 group scale byte for a group amax: smallest 2^e with amax <= 6 * 2^e, clamped to [2^-127, 2^127];
    amax == 0 -> 0 (the value is irrelevant: every element is zero)."""
    e = _pow2_exponent_at_least(amax, E2M1_MAX, 0.75, 3).clamp(-UE8M0_BIAS, UE8M0_BIAS)
    b = (e + UE8M0_BIAS).to(torch.uint8)
    return torch.where(amax > 0, b, torch.zeros_like(b))


# ---------------------------------------------------------------------------------------------------------- MXFP4
@dataclass(frozen=True)
class MXFP4Tensor:
    """Logical MXFP4 tensor [..., N, K]: packed uint8 [..., N, K/2] (low nibble first) + scale uint8 [..., N, K/32]."""

    packed: torch.Tensor
    scale: torch.Tensor

    def __post_init__(self) -> None:
        check_mxfp4(self.packed, self.scale, "MXFP4Tensor")

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.packed.shape[:-1], self.packed.shape[-1] * 2)

    @property
    def device(self) -> torch.device:
        return self.packed.device

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_mxfp4(self.packed, self.scale).to(dtype)

    def __getitem__(self, idx) -> MXFP4Tensor:
        """Index the leading (expert) dimensions: w13[e] is expert e's [N, K] MXFP4 weight."""
        return MXFP4Tensor(self.packed[idx], self.scale[idx])

    def to(self, device) -> MXFP4Tensor:
        return MXFP4Tensor(self.packed.to(device), self.scale.to(device))

    def nbytes(self) -> int:
        return self.packed.numel() + self.scale.numel()


def check_mxfp4(packed: torch.Tensor, scale: torch.Tensor, name: str) -> None:
    """Shape/dtype agreement of an MXFP4 pair; raises ValueError naming `name`."""
    if not isinstance(packed, torch.Tensor) or not isinstance(scale, torch.Tensor):
        raise ValueError(f"{name}: packed and scale must be torch.Tensors")
    if packed.dtype != torch.uint8:
        raise ValueError(f"{name}: packed weights must be uint8 (two E2M1 per byte), got {packed.dtype}")
    if scale.dtype != torch.uint8:
        raise ValueError(f"{name}: scales must be uint8 UE8M0, got {scale.dtype}")
    if packed.dim() < 2 or scale.dim() != packed.dim():
        raise ValueError(
            f"{name}: packed {tuple(packed.shape)} and scale {tuple(scale.shape)} must have the same rank >= 2"
        )
    k = packed.shape[-1] * 2
    if k % MXFP4_GROUP:
        raise ValueError(f"{name}: K = {k} must be a multiple of {MXFP4_GROUP}")
    want = (*packed.shape[:-1], k // MXFP4_GROUP)
    if tuple(scale.shape) != want:
        raise ValueError(f"{name}: scale shape {tuple(scale.shape)} != {want} for packed {tuple(packed.shape)}")
    if packed.device != scale.device:
        raise ValueError(f"{name}: packed on {packed.device} but scale on {scale.device}")


def quantize_mxfp4(w: torch.Tensor) -> MXFP4Tensor:
    """[..., N, K] float -> MXFP4 along the last dimension. Rejects non-finite weights (ValueError)."""
    if not w.is_floating_point():
        raise ValueError(f"quantize_mxfp4: expected a floating tensor, got {w.dtype}")
    k = w.shape[-1]
    if k % MXFP4_GROUP:
        raise ValueError(f"quantize_mxfp4: K = {k} must be a multiple of {MXFP4_GROUP}")
    bad = ~torch.isfinite(w)
    if bool(bad.any()):
        first = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(f"quantize_mxfp4: {int(bad.sum())} non-finite weight(s), first at index {first}")
    g = w.float().reshape(*w.shape[:-1], k // MXFP4_GROUP, MXFP4_GROUP)
    b = ue8m0_encode_for_amax(g.abs().amax(dim=-1))
    inv = torch.ldexp(torch.ones_like(g[..., :1]), -(b.to(torch.int32) - UE8M0_BIAS).unsqueeze(-1))
    codes = e2m1_encode(g * inv).reshape(w.shape)
    return MXFP4Tensor(pack_nibbles(codes), b)


def _byte_lut(device) -> torch.Tensor:
    """[256, 2] fp32: the two E2M1 values of every packed byte (low nibble first)."""
    codes = torch.arange(256, dtype=torch.uint8, device=device)
    return e2m1_decode(unpack_nibbles(codes.unsqueeze(-1))).view(256, 2)


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """MXFP4 pair -> fp32 [..., N, K] (exact)."""
    check_mxfp4(packed, scale, "dequantize_mxfp4")
    v = _byte_lut(packed.device)[packed.int()].reshape(*packed.shape[:-1], -1, MXFP4_GROUP)
    return (v * ue8m0_decode(scale).unsqueeze(-1)).flatten(-2)


def random_mxfp4(shape: tuple[int, ...], generator: torch.Generator, device="cpu", rms: float = 1.0) -> MXFP4Tensor:
    """A random MXFP4 tensor drawn directly in the format (uniform codes, per-group exponents jittered by +-1 around
    the one that gives element RMS ~ `rms`): a fast stand-in for quantised weights of full model size."""
    *lead, k = shape
    packed = torch.randint(0, 256, (*lead, k // 2), generator=generator, device=device, dtype=torch.uint8)
    code_rms = (sum(v * v for v in E2M1_VALUES) / len(E2M1_VALUES)) ** 0.5
    base = UE8M0_BIAS + round(torch.log2(torch.tensor(rms / code_rms)).item())
    jitter = torch.randint(-1, 2, (*lead, k // MXFP4_GROUP), generator=generator, device=device)
    return MXFP4Tensor(packed, (base + jitter).to(torch.uint8))


# ------------------------------------------------------------------------------------------------------------ FP8
def fp8_scale_for_amax(amax: torch.Tensor) -> torch.Tensor:
    """Power-of-two fp32 scale: smallest 2^e with amax <= 448 * 2^e (e in [-126, 127]); 1.0 for a zero block;
    NaN for a non-finite amax."""
    e = _pow2_exponent_at_least(amax, FP8_E4M3_MAX, 0.875, 9).clamp(-126, 127)
    s = torch.ldexp(torch.ones_like(amax, dtype=torch.float32), e)
    s = torch.where(amax > 0, s, torch.ones_like(s))
    return torch.where(torch.isfinite(amax), s, torch.full_like(s, float("nan")))


def quantize_fp8_e4m3_1x128(x: torch.Tensor, group: int = FP8_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, K] float -> (float8_e4m3fn [T, K], fp32 power-of-two scales [T, K/group]). Graph-capturable (no sync)."""
    if x.dim() != 2:
        raise ValueError(f"quantize_fp8_e4m3_1x128: expected [T, K], got shape {tuple(x.shape)}")
    t, k = x.shape
    if k % group:
        raise ValueError(f"quantize_fp8_e4m3_1x128: K = {k} must be a multiple of {group}")
    g = x.float().reshape(t, k // group, group)
    amax = g.abs().amax(dim=-1)
    amax = torch.where(torch.isnan(g).any(dim=-1), torch.full_like(amax, float("nan")), amax)
    s = fp8_scale_for_amax(amax)
    q = (g / s.unsqueeze(-1)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q.reshape(t, k), s


def dequantize_fp8_1x128(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """(float8_e4m3fn [T, K], fp32 [T, K/g]) -> fp32 [T, K] (exact)."""
    t, k = q.shape
    group = k // s.shape[-1]
    return (q.float().reshape(t, s.shape[-1], group) * s.unsqueeze(-1)).reshape(t, k)


def fp8_roundtrip(x: torch.Tensor) -> torch.Tensor:
    """The value the kernels see for an activation: quantise per token per 128, then dequantise (fp32)."""
    return dequantize_fp8_1x128(*quantize_fp8_e4m3_1x128(x))


def fp4_layer_bytes(hidden: int, inter: int, active_experts: int) -> int:
    """Weight + scale bytes a decode layer must stream: W13 and W2 of each active expert, MXFP4."""
    elems = active_experts * 3 * hidden * inter
    return elems // 2 + elems // 32
