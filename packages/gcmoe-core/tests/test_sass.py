"""SASS listing helpers (pure text, no GPU): the opcodes of a listing, and the innermost loop holding a marker
instruction with its opcode counts."""

import re

import pytest

from gcmoe_core.cutedsl import SASS_OP, sass_opcodes


def sass_loop_opcodes(sass: str, marker: str) -> tuple[dict[str, int], int]:
    """(opcode -> count, count of `marker`) over the innermost loop of a SASS listing that contains `marker` (e.g.
    QGMMA): the shortest span from a label to a later branch back to it. Opcodes without modifiers."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, ln in enumerate(lines) if (m := re.match(r"^\s*(\.L_x_\d+):", ln))}
    best = None
    for i, ln in enumerate(lines):
        m = re.search(r"BRA\s+`\((\.L_x_\d+)\)", ln)
        if m and labels.get(m.group(1), i) < i:
            j = labels[m.group(1)]
            if any(marker in x for x in lines[j:i]) and (best is None or i - j < best[1] - best[0]):
                best = (j, i)
    if best is None:
        raise ValueError(f"no loop containing {marker} in the listing")
    counts: dict[str, int] = {}
    for ln in lines[best[0] : best[1] + 1]:
        if m := re.match(SASS_OP + r"([A-Z][A-Z0-9_]*)", ln):
            counts[m.group(1)] = counts.get(m.group(1), 0) + 1
    return counts, counts.get(marker, 0)


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
