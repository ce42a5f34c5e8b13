"""Offline (CPU) compile of the grouped W1/W2 kernels for sm_90a: register-A QGMMA present, no local memory, the
weights streamed by bulk copy into shared memory + 16-byte shared loads, the WGMMAs pipelined; in ring mode the
bounded acquires of the comm signals (ld.acquire + %globaltimer) and W2's bf16 stores through the peer table."""

import re
from dataclasses import replace

import pytest

from gcmoe_core.cutedsl import sass_opcodes
from gcmoe_gemm_sm90.config import Sm90Config, choose_config, with_splits

pytestmark = pytest.mark.compile

W1_W2 = (("w1", 4096, 7168), ("w2", 7168, 2048))
VARIANTS = [
    ("w1", 4096, 4096, Sm90Config(8, 4, 4)),
    ("w2", 4096, 2048, Sm90Config(8, 4, 1)),
    ("w1", 4096, 4096, Sm90Config(32, 4, 2)),
    ("w1", 4096, 7168, Sm90Config(8, 4, 2, 2, smem_scales=False)),  # activation scales from global memory (v2)
    ("w1", 4096, 7168, with_splits(Sm90Config(16, 2, 2, 2), (4, 4), 7168, 2048)),  # K splits over a 4-CTA cluster
    # the chosen configurations (T = 1, 32, 64, 128, 256 on a DeepSeek-V3 EP8 rank: N 8, 16, 24, 48 with 4
    # warpgroups, 80 with 2), as the operator runs them (ring mode) and on prepared rows
    *[(mode, m, k, choose_config(t, 8, 32)) for t in (1, 32, 64, 128, 256) for mode, m, k in W1_W2],
    *[(mode, m, k, replace(choose_config(t, 8, 32), ring=True)) for t in (1, 8, 32, 128, 256) for mode, m, k in W1_W2],
    # 2 warpgroups at N = 48 (the ablation of the 4-warpgroup choice), 4 warpgroups with K splits
    *[
        (mode, m, k, with_splits(replace(choose_config(128, 8, 32), warpgroups=2), (1, 1), 7168, 2048))
        for mode, m, k in W1_W2
    ],
    ("w1", 4096, 7168, with_splits(Sm90Config(16, 2, 2, warpgroups=4), (2, 2), 7168, 2048)),
    # stream_k W1 (equal window ranges per CTA slot) at N 8 / 16, ring mode and prepared rows
    *[
        ("w1", 4096, 7168, replace(choose_config(t, 8, 32), splits=(1, 1), stream_k=True, ring=r))
        for t in (1, 32)
        for r in (False, True)
    ],
]


@pytest.mark.parametrize(
    ("mode", "m", "k", "cfg"),
    VARIANTS,
    ids=lambda v: (
        str(v)
        if not hasattr(v, "n_tile")
        else f"n{v.n_tile}s{v.stages}p{v.prefetch}o{v.occupancy}ss{v.smem_scales:d}sp{v.splits[0]}{v.splits[1]}"
        f"{'' if v.warpgroups == 2 else 'wg4'}{'ring' if v.ring else ''}{'sk' if v.stream_k else ''}"
    ),
)
def test_grouped_kernel_sass(mode, m, k, cfg):
    from gcmoe_gemm_sm90.kernel_grouped import compiled

    kern = compiled(mode, m, k, cfg, "sm_90a")
    sass = kern.sass()
    n = cfg.n_tile
    # register-A WGMMA: the A operand is a register (R..), B a shared-memory descriptor
    assert re.search(rf"QGMMA\.64x{n}x32\.F32\.E4M3\.E4M3 R\d+, R\d+, gdesc", sass), "no register-A QGMMA"
    ops = sass_opcodes(sass)
    assert "PRMT" in ops and "UTMALDG.2D" in ops
    # weights: one bulk copy per window into the stage, 16-byte shared loads, no global loads
    assert "UBLKCP.S.G" in ops and "LDS.128" in ops and "LDG.E.128" not in ops
    if cfg.ring:  # bounded acquires of the comm signals: acquire loads polled against %globaltimer, a nanosleep
        assert any(o.startswith("LDG.E.STRONG.GPU") for o in ops) and "NANOSLEEP" in ops
        assert any(o.startswith("CS2R") for o in ops) or "S2UR" in ops
        if cfg.pdl and mode == "w1":  # the ring's tags, not the grid dependency, order W1's reads
            assert "griddepcontrol.wait" not in kern.ptx and "griddepcontrol.launch_dependents" in kern.ptx
    if mode == "w2":  # bf16 stores at addresses from the combine peer table, not through a tensor of the output
        assert any(o.startswith("STG.E.U16") for o in ops)
    # the WGMMAs are pipelined: one wait per window (8 QGMMAs, 4 with 4 warpgroups) and the drain, not one after each
    # (ptxas C7513/C7515 serialisation)
    qgmma, waits = len(re.findall(r"\bQGMMA\.", sass)), len(re.findall(r"WARPGROUP\.DEPBAR", sass))
    assert waits * (4 if cfg.warpgroups == 2 else 2) <= qgmma, f"WGMMAs serialised: {waits} waits for {qgmma} QGMMAs"
    if cfg.splits[0 if mode == "w1" else 1] > 1:  # K splits: cluster barriers, partials pushed to the leader
        assert "UCGABAR_ARV" in ops and "UCGABAR_WAIT" in ops
    assert not {o.split(".")[0] for o in ops} & {"LDL", "STL"}, "local-memory spills"
    assert kern.resources()["LOCAL"] == 0 and kern.resources()["STACK"] == 0
    assert kern.resources()["REG"] <= (128 if cfg.occupancy == 2 or cfg.warpgroups == 4 else 255)
