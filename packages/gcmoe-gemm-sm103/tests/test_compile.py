"""Offline compile of the sm_103a grouped kernels (and sm_100a): block-scaled tcgen05 MMA in the PTX and UTCQMMA with
TMEM scale-factor operands in the SASS, scale factors copied to TMEM, TMA loads, TMEM loads, no local memory."""

import re

import pytest

from gcmoe_core.cutedsl import sass_opcodes

pytestmark = pytest.mark.compile

VARIANTS = [
    ("w1", 4096, 4096, "sm_103a"),
    ("w2", 4096, 2048, "sm_103a"),
    ("w1", 4096, 7168, "sm_103a"),
    ("w2", 7168, 2048, "sm_103a"),
    ("w1", 4096, 4096, "sm_100a"),
]


@pytest.mark.parametrize(("mode", "m", "k", "arch"), VARIANTS, ids=[f"{v[0]}-{v[1]}x{v[2]}-{v[3]}" for v in VARIANTS])
def test_kernel_compiles_with_block_scaled_mma(mode, m, k, arch):
    from gcmoe_gemm_sm103.config import Sm103Config
    from gcmoe_gemm_sm103.kernel_grouped import compiled

    kern = compiled(mode, m, k, Sm103Config(), arch)
    assert "tcgen05.mma.cta_group::1.kind::mxf8f6f4.block_scale.block32" in kern.ptx
    sass = kern.sass()
    # UTCQMMA A-desc, B-desc, acc, SFA, idesc, SFB: the block-scaled form (scale factors are TMEM operands)
    mmas = re.findall(r"UTCQMMA gdesc\[\w+\], gdesc\[\w+\], tmem\[\w+\], tmem\[\w+\], idesc\[\w+\], tmem\[\w+\]", sass)
    assert len(mmas) == 8, f"expected 2 halves x 4 K32 blocks of block-scaled UTCQMMA, found {len(mmas)}"
    ops = {o.split(".")[0] for o in sass_opcodes(sass)}
    assert {"UTCCP", "UTMALDG", "LDTM"} <= ops, sorted(ops)
    assert not ops & {"LDL", "STL"}
    assert kern.resources()["LOCAL"] == 0
