"""Offline (CPU) compile of the grouped W1/W2 kernels for sm_90a: register-A QGMMA present, no local memory, the
weights streamed by bulk copy into shared memory + 16-byte shared loads, the WGMMAs pipelined, programmatic dependent
launch; in ring mode the bounded acquires of the comm signals (ld.acquire + %globaltimer) and W2's bf16 stores through
the peer table; the gpt-oss epilogue variants (clamped SwiGLU, biases) on its padded shapes, and their flags off
unless asked for."""

import itertools
import re
from dataclasses import replace

import pytest

from gcmoe_core.cutedsl import sass_opcodes
from gcmoe_gemm_sm90.config import Sm90Config, choose_config, with_splits
from gcmoe_gemm_sm90.ops import layer_config

pytestmark = pytest.mark.compile

W1_W2 = (("w1", 4096, 7168), ("w2", 7168, 2048))
VARIANTS = [
    ("w1", 4096, 4096, Sm90Config(8, 4, 4)),
    ("w2", 4096, 2048, Sm90Config(8, 4, 1)),
    ("w1", 4096, 4096, Sm90Config(32, 4, 2)),
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
    # CTAs of half an M tile at N 40 / 48 / 64 (two per SM: <= 128 registers), ring mode and prepared rows; W1's in
    # cluster pairs
    *[
        (mode, m, k, replace(choose_config(128, 8, 32), w1_half=True, w2_half=True, ring=r))
        for r in (False, True)
        for mode, m, k in W1_W2
    ],
    *[
        (mode, m, k, replace(choose_config(t, 6, 32, 4096, 2048), w1_half=True, w2_half=True, ring=True))
        for t in (128, 256)
        for mode, m, k in (("w1", 4096, 4096), ("w2", 4096, 2048))
    ],
    # half tiles at N 80 (DeepSeek-V3 T = 256): one subtile of N 80 per warpgroup in 128 registers
    *[(mode, m, k, replace(choose_config(256, 8, 32), w1_half=True, w2_half=True, ring=True)) for mode, m, k in W1_W2],
    # stream_k W1 (equal window ranges per CTA slot) at N 8 / 16, ring mode and prepared rows
    *[
        ("w1", 4096, 7168, replace(choose_config(t, 8, 32), splits=(1, 1), stream_k=True, ring=r))
        for t in (1, 32)
        for r in (False, True)
    ],
]
# gpt-oss (H = I = 2880, padded to 3072 / 2944 at load): clamped SwiGLU + biases, as the operator runs them (ring
# mode; EP8 slices of the 120b: 16 experts, N 8 K-split / 16 / 80 with 2 warpgroups, W1 in half tiles at N 80; the
# 20b: N 48, both in half tiles),
# on prepared rows, stream_k, and each flag alone
GPT_OSS = (("w1", 2 * 2944, 3072), ("w2", 3072, 2944))
EPILOGUE = {"activation": "swiglu_clamped", "bias": True}
GPT_OSS_VARIANTS = [
    *[
        (mode, m, k, replace(layer_config(t, 4, e, 3072, 2944, 0, epilogue=EPILOGUE), ring=True))
        for t, e in ((1, 16), (32, 16), (256, 16), (256, 32))
        for mode, m, k in GPT_OSS
    ],
    *[(mode, m, k, replace(choose_config(8, 4, 16, 3072, 2944), **EPILOGUE)) for mode, m, k in GPT_OSS],
    ("w1", *GPT_OSS[0][1:], replace(choose_config(1, 4, 16, 3072, 2944), splits=(1, 1), stream_k=True, **EPILOGUE)),
    ("w1", *GPT_OSS[0][1:], replace(choose_config(8, 4, 16, 3072, 2944), ring=True, activation="swiglu_clamped")),
    ("w1", *GPT_OSS[0][1:], replace(choose_config(8, 4, 16, 3072, 2944), ring=True, bias=True)),
]
VARIANTS += GPT_OSS_VARIANTS


@pytest.mark.parametrize(
    ("mode", "m", "k", "cfg"),
    VARIANTS,
    ids=lambda v: (
        str(v)
        if not hasattr(v, "n_tile")
        else f"n{v.n_tile}s{v.stages}p{v.prefetch}o{v.occupancy}sp{v.splits[0]}{v.splits[1]}"
        f"{'' if v.warpgroups == 2 else 'wg4'}{'ring' if v.ring else ''}{'sk' if v.stream_k else ''}"
        f"{'clamp' if v.activation == 'swiglu_clamped' else ''}{'bias' if v.bias else ''}"
        f"{'ef' if v.evict_first else ''}{'h1' if v.w1_half else ''}{'h2' if v.w2_half else ''}"
    ),
)
def test_grouped_kernel_sass(mode, m, k, cfg):
    from gcmoe_gemm_sm90.ops import compiled

    kern = compiled(mode, m, k, cfg, "sm_90a")
    sass = kern.sass()
    n = cfg.n_tile
    # register-A WGMMA: the A operand is a register (R..), B a shared-memory descriptor
    assert re.search(rf"QGMMA\.64x{n}x32\.F32\.E4M3\.E4M3 R\d+, R\d+, gdesc", sass), "no register-A QGMMA"
    ops = sass_opcodes(sass)
    assert "PRMT" in ops and "UTMALDG.2D" in ops
    # weights: one bulk copy per window into the stage, 16-byte shared loads, no global loads
    assert "UBLKCP.S.G" in ops and "LDS.128" in ops and "LDG.E.128" not in ops
    # the L2 evict_first hint (a cache-policy operand on every weight / scale bulk copy) exactly where configured
    copies = [ln for ln in sass.splitlines() if "UBLKCP.S.G" in ln]
    assert copies and all(("desc[" in ln) == cfg.evict_first for ln in copies)
    if cfg.ring:  # bounded acquires of the comm signals: acquire loads polled against %globaltimer, a nanosleep
        assert any(o.startswith("LDG.E.STRONG.GPU") for o in ops) and "NANOSLEEP" in ops
        assert any(o.startswith("CS2R") for o in ops) or "S2UR" in ops
        if mode == "w1":  # the ring's tags, not the grid dependency, order W1's reads
            assert "griddepcontrol.wait" not in kern.ptx and "griddepcontrol.launch_dependents" in kern.ptx
    # programmatic dependent launch, always on: every kernel lets its dependents launch; W1 on prepared rows and W2
    # without per-expert W1_DONE tags wait for their producer grid
    assert "griddepcontrol.launch_dependents" in kern.ptx
    waits = not cfg.ring if mode == "w1" else not (cfg.ring and cfg.expert_sync)
    assert ("griddepcontrol.wait" in kern.ptx) == waits
    if mode == "w2":  # bf16 stores at addresses from the combine peer table, not through a tensor of the output
        assert any(o.startswith("STG.E.U16") for o in ops)
    # the WGMMAs are pipelined: one wait per window (8 QGMMAs, 4 with 4 warpgroups) and the drain, not one after each
    # (ptxas C7513/C7515 serialisation)
    half = cfg.w1_half if mode == "w1" else cfg.w2_half  # (one subtile per warpgroup, two CTAs per SM)
    qgmma, waits = len(re.findall(r"\bQGMMA\.", sass)), len(re.findall(r"WARPGROUP\.DEPBAR", sass))
    subs = 2 if cfg.warpgroups == 2 and not half else 1
    assert waits * 2 * subs <= qgmma, f"WGMMAs serialised: {waits} waits for {qgmma} QGMMAs"
    if cfg.splits[0 if mode == "w1" else 1] > 1 or (half and mode == "w1"):  # clusters: K splits, W1's half pairs
        assert "UCGABAR_ARV" in ops and "UCGABAR_WAIT" in ops
    assert not {o.split(".")[0] for o in ops} & {"LDL", "STL"}, "local-memory spills"
    assert kern.resources()["LOCAL"] == 0 and kern.resources()["STACK"] == 0
    assert kern.resources()["REG"] <= (128 if cfg.occupancy == 2 or cfg.warpgroups == 4 or half else 255)


_PLAIN_LOAD = re.compile(r"\bLDG\.E(?:\.64)?\s")  # a plain global load (not the ring's strong acquires)


def _store_load_turns(lines: list[str], store: str) -> int:
    """How often a plain global load follows a store (`store`: a regex of the store opcodes) in these SASS lines."""
    seq = [bool(_PLAIN_LOAD.search(ln)) for ln in lines if _PLAIN_LOAD.search(ln) or re.search(store, ln)]
    return sum(1 for a, b in itertools.pairwise(seq) if not a and b)


def test_tile_loads_are_issued_together_not_one_round_trip_each():
    """A global load placed after a store (st_bf16 clobbers memory; shared stores of loaded values) is waited for in
    turn: W2's epilogue loaded each token column's output row address (src, dst, then the peer table) between the
    previous column's stores — two round trips per column in series, 39 store -> load turns at N 80 — and the tile's
    prologue one activation scale at a time at N 48. Now: W2 loads the addresses of EPI_COLS columns at a time before
    their stores; W1's epilogue reads the routing weights staged in shared memory with the scales (no global load);
    the prologue's turns do not grow with N (the layer 1.03-1.04x faster at T = 128 / 256, bit-identical; H200,
    2026-12-01, docs/benchmarks/epilogue-loads-h200-2026-12-01.md)."""
    from gcmoe_gemm_sm90.kernel_grouped_epilogue import EPI_COLS
    from gcmoe_gemm_sm90.ops import compiled

    turns = {}
    for t in (8, 128, 256):  # N 8, 48 (4 warpgroups), 80
        cfg = replace(choose_config(t, 8, 32), ring=True)
        for mode, m, k in W1_W2:
            lines = compiled(mode, m, k, cfg, "sm_90a").sass().splitlines()
            q = [i for i, ln in enumerate(lines) if "QGMMA" in ln]
            epilogue = lines[q[-1] :]
            turns[mode, t] = _store_load_turns(lines[: q[0]], r"\bSTS\b")
            if mode == "w2":
                groups = -(-cfg.n_tile // 4 // EPI_COLS)
                assert _store_load_turns(epilogue, r"\bSTG\.E") <= groups - 1, (t, cfg.n_tile)
            else:
                assert not any(_PLAIN_LOAD.search(ln) for ln in epilogue), (t, cfg.n_tile)
    for mode, _, _ in W1_W2:
        assert turns[mode, 128] == turns[mode, 256] == turns[mode, 8], turns


def _count(sass: str, opcode: str) -> int:
    return len(re.findall(rf"\b{re.escape(opcode)}\b", sass))


def test_epilogue_flags_are_off_by_default_and_add_code_only_when_set():
    """choose_config never sets the gpt-oss epilogue flags (the layer does, MoESm90.config_for), so the default kernels
    are today's (their by-value words too: SIG_WORDS); set, W1 reads its b13 entries and clamps (more FMNMX, two
    more fp32 loads per subtile), W2 reads the rows' routing weights and b2 (more global loads), same registers
    budget and no spills (test_grouped_kernel_sass)."""
    from gcmoe_gemm_sm90.kernel_grouped_common import SIG_WORDS, sig_words
    from gcmoe_gemm_sm90.ops import compiled

    for t in (1, 2, 8, 32, 128, 256):
        for args in ((8, 32, 7168, 2048), (4, 16, 3072, 2944), (4, 32, 3072, 2944), (6, 32, 4096, 2048)):
            cfg = choose_config(t, *args)
            assert (cfg.activation, cfg.bias) == ("swiglu", False), (t, args)
            assert sig_words("w1", cfg) == sig_words("w2", cfg) == SIG_WORDS
    base = replace(choose_config(8, 4, 16, 3072, 2944), ring=True)
    for mode, m, k in GPT_OSS:
        plain = compiled(mode, m, k, base, "sm_90a").sass()
        both = compiled(mode, m, k, replace(base, **EPILOGUE), "sm_90a").sass()
        assert plain != both
        loads = [len(re.findall(r"\bLDG\.E(?:\.STRONG\.GPU)?\s", s)) for s in (plain, both)]
        if mode == "w1":
            clamped = compiled(mode, m, k, replace(base, activation="swiglu_clamped"), "sm_90a").sass()
            assert _count(clamped, "FMNMX") > _count(plain, "FMNMX")
            assert "FMNMX.NAN" in clamped and "FMNMX.NAN" not in plain  # the clamp keeps a NaN (NaN contract)
            assert loads[1] > loads[0]
        else:
            assert loads[1] >= loads[0] + 2  # route_w of its token columns and b2 of its output rows


@pytest.mark.parametrize("ranges", [1, 8])
def test_prefetch_kernel_sass(ranges):
    """The L2 prefetch (kernel_prefetch): bulk L2 prefetches only — no loads into registers or shared memory, no
    stores, no local memory."""
    from gcmoe_gemm_sm90.kernel_prefetch import compiled

    kern = compiled(ranges, "sm_90a")
    ops = sass_opcodes(kern.sass())
    assert "UBLKPF.L2" in ops
    assert not any(o.startswith(("LDG", "STG", "LDS", "STS", "UBLKCP", "UTMALDG", "ATOM", "RED")) for o in ops), ops
    assert kern.resources()["LOCAL"] == 0
