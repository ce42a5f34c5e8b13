"""In-register FP4 E2M1 -> FP8 E4M3 decode for sm_90a (WGMMA cannot take FP4; CuTe DSL's E2M1 .to() does not lower
on sm_90a). Eight E2M1 codes in one 32-bit word become eight E4M3 bytes in two 32-bit words, by a byte permute over
an 8-byte table of the magnitudes' E4M3 bytes:

    LUT bytes (E4M3 of the E2M1 magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6): 00 30 38 3C | 40 44 48 4C
    lo = prmt(LUT_LO, LUT_HI, word & 0x7777) | signs of values 0-3      (magnitude codes 0..7 select LUT bytes)
    hi = prmt(LUT_LO, LUT_HI, (word & 0x77777777) >> 16) | signs of values 4-7

The LUT is an operand: with row-referenced scales (see prepack) each 32-group uses the table of its exponent relative
to its row's reference, LUT[dd] = E4M3(magnitudes * 2^(6 - dd)), one of 16 tables kept in shared memory.

The prepacked weights (prepack.py) move each code's sign bit so that no byte permute is needed for it: value j of the
low word (j = 0..3) keeps its magnitude in nibble j and has its sign at bit 8j + 3, value j of the high word keeps its
magnitude in nibble 4 + j and has its sign at bit 8j + 7 (the bit-3 slots of the nibbles, permuted): SIGN_BITS[n] =
the bit of value n's sign. 7 instructions per 8 values (the standard layout needs 9: a second, sign-replicating
permute per word; tests/test_decode.py keeps it as a standalone kernel):
    magnitude: prmt over the LUT with the low 3 bits of each nibble (low word: nibbles 0-3, high: 4-7 after >> 16);
    sign:      low word: (word << 4) & 0x80808080, high word: word & 0x80808080, merged by one lop3 each.
ptxas puts the shl on the FMA pipe (IMAD.SHL); moving idx >> 16 there too (mul.hi.u32) measured slower.
"""

from __future__ import annotations

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
