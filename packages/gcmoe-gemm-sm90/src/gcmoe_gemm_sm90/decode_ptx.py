"""In-register FP4 E2M1 -> FP8 E4M3 decode for sm_90a (WGMMA cannot take FP4; CuTe DSL's E2M1 .to() does not lower
on sm_90a). Eight E2M1 codes in one 32-bit word become eight E4M3 bytes in two 32-bit words:

    mag  = prmt(LUT_LO, LUT_HI, code & 0x7777)              # magnitude codes 0..7 select bytes of an 8-byte table
    sign = prmt(code << 4, code, 0xD9C8)                     # sign-replicate mode: 0xFF where the code's bit 3 is set
    out  = mag | (sign & 0x80808080)                         # (then the same for codes 4-7 with idx >> 16, 0xFBEA)

    LUT bytes (E4M3 of the E2M1 magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6): 00 30 38 3C | 40 44 48 4C
    (done twice per word: nibbles 0-3, then nibbles 4-7 after a 16-bit shift)

The LUT is an operand: with row-referenced scales (see prepack) each 32-group uses the table of its exponent relative
to its row's reference, LUT[dd] = E4M3(magnitudes * 2^(6 - dd)), one of 16 tables kept in shared memory.
"""

from __future__ import annotations

E4M3_OF_E2M1 = (0x00, 0x30, 0x38, 0x3C, 0x40, 0x44, 0x48, 0x4C)
LUT_LO = E4M3_OF_E2M1[0] | E4M3_OF_E2M1[1] << 8 | E4M3_OF_E2M1[2] << 16 | E4M3_OF_E2M1[3] << 24
LUT_HI = E4M3_OF_E2M1[4] | E4M3_OF_E2M1[5] << 8 | E4M3_OF_E2M1[6] << 16 | E4M3_OF_E2M1[7] << 24

# One PTX block: $0, $1 = out words (codes 0-3, codes 4-7); $2 = 8 codes; $3, $4 = the LUT (register operands, so a
# per-group table — the group's exponent relative to its row — costs nothing extra). 9 instructions per 8 values:
#   magnitude: prmt over the 8-byte LUT with the code's low 3 bits;
#   sign:      prmt in sign-replicate mode over (word << 4, word) gives 0xFF/0x00 per byte from each code's bit 3;
#   merge:     lop3  out = mag | (sign & 0x80808080)
DECODE8_PTX = """{
.reg .b32 idx, idxh, w4, pos, msk;
and.b32 idx, $2, 0x77777777;
shl.b32 w4, $2, 4;
prmt.b32 pos, $3, $4, idx;
prmt.b32 msk, w4, $2, 0xD9C8;
lop3.b32 $0, pos, msk, 0x80808080, 0xF8;
shr.u32 idxh, idx, 16;
prmt.b32 pos, $3, $4, idxh;
prmt.b32 msk, w4, $2, 0xFBEA;
lop3.b32 $1, pos, msk, 0x80808080, 0xF8;
}"""


# The prepacked weights (prepack.py) move each code's sign bit so that no byte permute is needed for it: value j of the
# low word (j = 0..3) keeps its magnitude in nibble j and has its sign at bit 8j + 3, value j of the high word keeps
# its magnitude in nibble 4 + j and has its sign at bit 8j + 7 (the bit-3 slots of the nibbles, permuted):
#   SIGN_BITS[n] = bit of value n's sign.  7 instructions per 8 values:
#   magnitude: prmt over the LUT with the low 3 bits of each nibble (low word: nibbles 0-3, high: 4-7 after >> 16);
#   sign:      low word: (word << 4) & 0x80808080, high word: word & 0x80808080, merged by the same lop3.
#   ptxas puts shl on the FMA pipe (IMAD.SHL); moving idx >> 16 there too (mul.hi.u32) measured slower (sm90-grouped-v6
#   run F).
SIGN_BITS = (3, 11, 19, 27, 7, 15, 23, 31)
DECODE8_SPLIT_SIGN_PTX = """{
.reg .b32 idx, idxh, w4, pos;
and.b32 idx, $2, 0x77777777;
shl.b32 w4, $2, 4;
prmt.b32 pos, $3, $4, idx;
lop3.b32 $0, pos, w4, 0x80808080, 0xF8;
shr.u32 idxh, idx, 16;
prmt.b32 pos, $3, $4, idxh;
lop3.b32 $1, pos, $2, 0x80808080, 0xF8;
}"""


def _prmt(a: int, b: int, sel: int) -> int:
    pool = (a | b << 32).to_bytes(8, "little")
    out = 0
    for i in range(4):
        s = (sel >> (4 * i)) & 0xF
        byte = pool[s & 7]
        if s & 8:  # sign-replicate mode
            byte = 0xFF if byte & 0x80 else 0x00
        out |= byte << (8 * i)
    return out


def decode8_reference(word: int, lut_lo: int = LUT_LO, lut_hi: int = LUT_HI) -> tuple[int, int]:
    """Bit-exact Python model of DECODE8_PTX (prmt semantics included), for CPU tests."""
    idx = word & 0x77777777
    w4 = (word << 4) & 0xFFFFFFFF
    lo = _prmt(lut_lo, lut_hi, idx) | (_prmt(w4, word, 0xD9C8) & 0x80808080)
    hi = _prmt(lut_lo, lut_hi, idx >> 16) | (_prmt(w4, word, 0xFBEA) & 0x80808080)
    return lo, hi


def decode8_split_sign_reference(word: int, lut_lo: int = LUT_LO, lut_hi: int = LUT_HI) -> tuple[int, int]:
    """Bit-exact Python model of DECODE8_SPLIT_SIGN_PTX."""
    idx = word & 0x77777777
    lo = _prmt(lut_lo, lut_hi, idx) | ((word << 4) & 0x80808080)
    hi = _prmt(lut_lo, lut_hi, idx >> 16) | (word & 0x80808080)
    return lo, hi
