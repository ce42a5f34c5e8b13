"""SASS listing helpers (pure text, no GPU): the innermost loop holding a marker instruction and its opcode counts."""

import pytest

from gcmoe_core.cutedsl import sass_loop_opcodes, sass_opcodes

LISTING = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   LOP3.LUT R2, R3, 0x7777, RZ, 0xc0, !PT ;
.L_x_2:
        /*0020*/                   PRMT R4, R5, R2, R6 ;
        /*0030*/                   QGMMA.64x8x32.F32.E4M3.E4M3 R8, R4, gdesc[UR4], R8 ;
        /*0040*/               @P0 PRMT R4, R5, R2, R6 ;
        /*0050*/               @P1 BRA `(.L_x_2) ;
        /*0060*/                   SHF.R.U32.HI R3, RZ, 0x10, R3 ;
        /*0070*/              @!P2 BRA `(.L_x_1) ;
        /*0080*/                   BRA `(.L_x_3) ;
.L_x_3:
        /*0090*/                   EXIT ;
"""


def test_innermost_loop_with_the_marker():
    counts, marked = sass_loop_opcodes(LISTING, "QGMMA")
    assert counts == {"PRMT": 2, "QGMMA": 1, "BRA": 1} and marked == 1  # .L_x_2 .. its branch, not the outer loop
    assert {"LOP3.LUT", "SHF.R.U32.HI", "EXIT"} <= sass_opcodes(LISTING)
    with pytest.raises(ValueError, match="no loop containing HMMA"):
        sass_loop_opcodes(LISTING, "HMMA")
