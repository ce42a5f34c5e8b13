"""In-register FP4 E2M1 -> FP8 E4M3 decode for sm_90a (WGMMA cannot take FP4; CuTe DSL's E2M1 .to() does not lower
on sm_90a). Eight E2M1 codes in one 32-bit word become eight E4M3 bytes in two 32-bit words:

    pos = prmt(LUT_LO, LUT_HI, code & 0x7777)        # magnitude codes 0..7 select bytes of an 8-byte table
    neg = pos | 0x80808080                           # the same values, negative
    out = prmt(pos, neg, 0x3210 | ((code & 0x8888) >> 1))   # sign bit 3 of each nibble -> selector bit 2: pick neg

    LUT bytes (E4M3 of the E2M1 magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6): 00 30 38 3C | 40 44 48 4C
    (done twice per word: nibbles 0-3, then nibbles 4-7 after a 16-bit shift)

A relative group exponent d <= 0 (windowed scales, see prepack) scales the table: every non-zero entry minus 8*|d|
in the exponent field, exact for d >= -5 (normals) and precomputed in the prepacker for the rest.
"""

from __future__ import annotations

E4M3_OF_E2M1 = (0x00, 0x30, 0x38, 0x3C, 0x40, 0x44, 0x48, 0x4C)
LUT_LO = E4M3_OF_E2M1[0] | E4M3_OF_E2M1[1] << 8 | E4M3_OF_E2M1[2] << 16 | E4M3_OF_E2M1[3] << 24
LUT_HI = E4M3_OF_E2M1[4] | E4M3_OF_E2M1[5] << 8 | E4M3_OF_E2M1[6] << 16 | E4M3_OF_E2M1[7] << 24

# One PTX block: $0, $1 = out words; $2 = 8 codes; $3, $4 = LUT words (per-group tables pass registers here).
DECODE8_PTX = """{
.reg .b32 idx, sgn, pos, neg, sel, hi;
and.b32 idx, $2, 0x77777777;
and.b32 sgn, $2, 0x88888888;
shr.u32 sgn, sgn, 1;
prmt.b32 pos, $3, $4, idx;
or.b32 neg, pos, 0x80808080;
or.b32 sel, sgn, 0x3210;
prmt.b32 $0, pos, neg, sel;
shr.u32 idx, idx, 16;
shr.u32 sgn, sgn, 16;
prmt.b32 pos, $3, $4, idx;
or.b32 neg, pos, 0x80808080;
or.b32 sel, sgn, 0x3210;
prmt.b32 $1, pos, neg, sel;
}"""


def decode8_reference(word: int, lut_lo: int = LUT_LO, lut_hi: int = LUT_HI) -> tuple[int, int]:
    """Bit-exact Python model of DECODE8_PTX (prmt semantics included), for CPU tests."""

    def prmt(a: int, b: int, sel: int) -> int:
        pool = (a | b << 32).to_bytes(8, "little")
        out = 0
        for i in range(4):
            s = (sel >> (4 * i)) & 0xF
            byte = pool[s & 7]
            if s & 8:  # sign-replicate mode
                byte = 0xFF if byte & 0x80 else 0x00
            out |= byte << (8 * i)
        return out

    idx, sgn = word & 0x77777777, (word & 0x88888888) >> 1
    outs = []
    for _ in range(2):
        pos = prmt(lut_lo, lut_hi, idx)
        outs.append(prmt(pos, pos | 0x80808080, (sgn & 0xFFFF) | 0x3210))
        idx, sgn = idx >> 16, sgn >> 16
    return outs[0], outs[1]
