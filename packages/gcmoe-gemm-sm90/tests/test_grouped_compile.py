"""Offline (CPU) compile of the grouped W1/W2 kernels for sm_90a: register-A QGMMA present, no local memory."""

import re

import pytest

from gcmoe_core.cutedsl import sass_opcodes
from gcmoe_gemm_sm90.config import Sm90Config

pytestmark = pytest.mark.compile

VARIANTS = [
    ("w1", 4096, 4096, Sm90Config(8, 4, 4)),
    ("w2", 4096, 2048, Sm90Config(8, 4, 4)),
    ("w1", 4096, 7168, Sm90Config(16, 4, 4)),
    ("w1", 4096, 4096, Sm90Config(32, 4, 2)),
    ("w2", 7168, 2048, Sm90Config(32, 4, 2)),
    ("w1", 4096, 7168, Sm90Config(8, 4, 2, 2)),  # the chosen small-T configuration: 2 CTAs/SM, <= 128 registers
    ("w2", 7168, 2048, Sm90Config(16, 4, 2, 2)),
    ("w1", 4096, 7168, Sm90Config(8, 4, 2, 2, smem_scales=False)),  # the v2 ablation
    ("w1", 4096, 7168, Sm90Config(64, 4, 4, 1)),  # T >= 128: one pass over the weights for up to 64 rows
    ("w2", 7168, 2048, Sm90Config(64, 4, 4, 1)),
]


@pytest.mark.parametrize(
    ("mode", "m", "k", "cfg"),
    VARIANTS,
    ids=lambda v: str(v) if not hasattr(v, "n_tile") else f"n{v.n_tile}p{v.prefetch}o{v.occupancy}s{v.smem_scales:d}",
)
def test_grouped_kernel_sass(mode, m, k, cfg):
    from gcmoe_gemm_sm90.kernel_grouped import compiled

    kern = compiled(mode, m, k, cfg, "sm_90a")
    sass = kern.sass()
    n = cfg.n_tile
    # register-A WGMMA: the A operand is a register (R..), B a shared-memory descriptor
    assert re.search(rf"QGMMA\.64x{n}x32\.F32\.E4M3\.E4M3 R\d+, R\d+, gdesc", sass), "no register-A QGMMA"
    ops = sass_opcodes(sass)
    assert "LDG.E.128" in ops and "PRMT" in ops and "UTMALDG.2D" in ops
    assert not {o.split(".")[0] for o in ops} & {"LDL", "STL"}, "local-memory spills"
    assert kern.resources()["LOCAL"] == 0 and kern.resources()["STACK"] == 0
    assert kern.resources()["REG"] <= (128 if cfg.occupancy == 2 else 255)
