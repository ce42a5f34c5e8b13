"""sm90 prepack: exact inverse, the kernel's decode replayed from the prepacked bytes, windowed-scale accounting,
the pipeline on prepared rows with torch models of the kernels against the reference, configuration checks and the
launches' argument checks (CPU)."""

from dataclasses import replace

import pytest
import torch

from gcmoe_core.config import MoEConfig
from gcmoe_core.formats import quantize_mxfp4, random_mxfp4
from gcmoe_core.grouping import group_rows, grouped_forward
from gcmoe_core.layouts import gate_up_permutation, inverse_permutation
from gcmoe_core.reference import moe_reference
from gcmoe_core.testing import Case, make_problem
from gcmoe_gemm_sm90.config import LUT_PAIR_BYTES, Sm90Config, can_implement, choose_config
from gcmoe_gemm_sm90.ops import MoESm90, emulate_w1, emulate_w2, layer_config
from gcmoe_gemm_sm90.prepack import (
    GATE_UP_GROUP,
    MAX_DD,
    PackedSm90,
    effective_weights_sm90,
    lut_pair_words,
    lut_words,
    make_records,
    prepack_sm90,
    record_dd,
    record_pair,
    sign_layout,
    split_scales,
    thread_rows_cols,
    unpack_sm90,
)


def decode_prepacked_reference(p: PackedSm90) -> torch.Tensor:
    """What the kernel's decode computes, replayed in torch from the prepacked bytes alone (bit-exact model of the
    register path: nibble selection, the pair table's entry at the record's offset, sign, row scale), in logical row
    order: fp32 [E, M, K].
    (The sign bits are read back from their split-sign positions first: test_decode models the PTX itself.)"""
    e, mt, nw = p.data.shape[:3]
    table = lut_pair_words().to(p.data.device).to(torch.int64) & 0xFFFFFFFF  # [256, 4]
    words = sign_layout(p.data, to_split=False).view(e, mt, nw, 2, 2, 2, 128, 4, 4)  # [.., half, tw, word, 4 B]
    words = words.to(torch.int64)
    word = words[..., 0] | words[..., 1] << 8 | words[..., 2] << 16 | words[..., 3] << 24  # [.., half, tw, 4]
    rec, rsc = split_scales(p)  # [E, MT, W, 128 words], [E, MT, 256 rows]
    out = torch.empty(e, mt, nw, 2, 2, 64, 128, dtype=torch.float32, device=p.data.device)  # [.., j, s, row, k]
    r0, tt = thread_rows_cols()
    for half in range(2):
        for si in range(2):
            step = 2 * half + si
            for u in range(2):
                wv = word[:, :, :, :, :, half, :, 2 * si + u]  # [E, MT, W, j, s, tw]
                cta_row = (
                    torch.arange(2).view(2, 1, 1) * 128
                    + torch.arange(2).view(1, 2, 1) * 64
                    + (r0 + 8 * u).view(1, 1, 128)
                ).to(p.data.device)  # [j, s, tw]
                rword = (
                    torch.arange(2).view(2, 1, 1) * 64
                    + torch.arange(2).view(1, 2, 1) * 32
                    + (r0 // 16 * 8 + r0 % 8).view(1, 1, 128)
                ).to(p.data.device)  # [j, s, tw]: the thread's record word
                rs = rsc[:, :, cta_row].unsqueeze(2)  # [E, MT, 1, j, s, tw]
                entry = table[record_pair(rec[:, :, :, rword], u, half)]  # [.., tw, 4 words]: LUT[dd_2h], LUT[dd_2h+1]
                for nib in range(8):
                    code = (wv >> (4 * nib)) & 0xF
                    lut_word = entry.gather(-1, (2 * si + (code & 7) // 4).unsqueeze(-1)).squeeze(-1)
                    mag = (lut_word >> (8 * (code & 3))) & 0xFF
                    byte = mag | ((code & 8) << 4)
                    val = byte.to(torch.uint8).view(torch.float8_e4m3fn).float()
                    val = val * rs
                    kk = 32 * step + (4 * tt + nib if nib < 4 else 16 + 4 * tt + nib - 4).to(p.data.device)
                    rows = (r0 + 8 * u).to(p.data.device)
                    out[:, :, :, :, :, rows, kk] = val  # (row, k) pairs per thread
    # out: [E, MT, W, j, s, 64, 128] -> [E, M, K] in prepacked row order
    full = out.permute(0, 1, 3, 4, 5, 2, 6).reshape(e, p.m, p.k)
    if p.gate_up:
        inv = inverse_permutation(gate_up_permutation(p.m // 2, GATE_UP_GROUP, full.device))
        full = full[:, inv]
    return full


@pytest.mark.parametrize("gate_up", [False, True])
@pytest.mark.parametrize(("e", "m", "k"), [(1, 256, 128), (2, 512, 256), (3, 256, 512)])
def test_roundtrip_and_decode_model(e, m, k, gate_up):
    w = random_mxfp4((e, m, k), torch.Generator().manual_seed(m + k + e))
    p = prepack_sm90(w, gate_up=gate_up)
    assert p.data.shape == (e, m // 256, k // 128, 2, 2, 2, 128, 16)
    assert p.scales.shape == (e, m // 256, k // 128 * 128 + 256) and p.scales.dtype == torch.int32
    u = unpack_sm90(p)
    assert torch.equal(u.packed, w.packed) and torch.equal(u.scale, w.scale)
    assert torch.equal(decode_prepacked_reference(p), effective_weights_sm90(w))
    assert torch.equal(effective_weights_sm90(w), w.dequantize()) and p.lossy_groups == 0


def test_scale_records_give_the_kernels_offsets_by_bytes():
    """What decode_subtile computes from a thread's record word: rotated right by 8b and masked with 0xFF0 it is the
    pair table's byte offset of the entry holding LUT[dd] of steps 2h, 2h + 1 of row r0 + 8u (b = 2u + h); the
    tile's row scales follow its windows."""
    g = torch.Generator().manual_seed(7)
    dd = torch.randint(0, MAX_DD + 1, (5, 256, 4), generator=g)
    words = make_records(dd)
    assert words.shape == (5, 128) and torch.equal(record_dd(words), dd)
    table, lut = lut_pair_words(), lut_words()
    assert table.shape == (256, 4) and table.numel() * 4 == LUT_PAIR_BYTES  # (what the kernel's shared memory holds)
    wv = words.to(torch.int64) & 0xFFFFFFFF
    for u in range(2):
        rows = torch.tensor([16 * (i // 8) + i % 8 + 8 * u for i in range(128)])  # word i's row u
        for h in range(2):
            b = 2 * u + h
            rot = (wv >> (8 * b) | wv << (32 - 8 * b)) & 0xFFFFFFFF  # the kernel: AND, shift + AND, rotation + AND
            entry = table[(rot & 0xFF0) // 16]
            assert torch.equal(entry[..., :2], lut[dd[:, rows, 2 * h]])
            assert torch.equal(entry[..., 2:], lut[dd[:, rows, 2 * h + 1]])
            if b < 3:  # (a plain arithmetic shift is enough there: the mask takes bits below the wrap)
                assert torch.equal(rot & 0xFF0, (words.to(torch.int64) >> (8 * b)) & 0xFF0)
    w = random_mxfp4((2, 512, 384), g)
    w.scale[1, 300] = 140  # one row's reference
    p = prepack_sm90(w)
    rec, rs = split_scales(p)
    assert rec.shape == (2, 2, 3, 128) and rs.shape == (2, 2, 256)
    assert float(rs[1, 1, 300 - 256]) == 2.0 ** (140 - 6 - 127)
    assert torch.equal(rec, make_records(record_dd(rec)))


def test_lossy_groups_are_counted_and_emulated():
    """Row-referenced scales: a group 2^10 below its row's largest is exact (the per-window bases rounded it), one
    2^16 below rounds and is counted; effective_weights_sm90 models both, decode_prepacked_reference agrees."""
    w = torch.randn(1, 256, 256)
    w[..., 32:64] *= 2.0**-10
    w[..., 160:192] *= 2.0**-16
    q = quantize_mxfp4(w)
    p = prepack_sm90(q)
    assert p.lossy_groups == 256  # the 2^-16 group of every row
    eff = effective_weights_sm90(q)
    assert torch.equal(decode_prepacked_reference(p), eff)
    exact = q.dequantize()
    keep = torch.ones(256, dtype=torch.bool)
    keep[160:192] = False
    assert torch.equal(eff[..., keep], exact[..., keep]) and not torch.equal(eff, exact)


def test_row_reference_edges():
    """Rows of tiny exponents (the reference clamps at f = 1) and all-zero groups (left out of the reference, whatever
    their exponent) decode exactly and unpack to the same values."""
    g = torch.Generator().manual_seed(11)
    w = random_mxfp4((1, 256, 512), g)
    scale = w.scale.clone()
    scale[0, :8] = torch.randint(0, 4, (8, 16), generator=g, dtype=torch.uint8)  # 2^-127 .. 2^-124
    packed = w.packed.clone()
    packed[0, 8:16, :16] = 0  # group 0 of rows 8-15 all zero, with an exponent far above the rest of the row
    scale[0, 8:16, 0] = 250
    q = type(w)(packed, scale)
    p = prepack_sm90(q)
    assert p.lossy_groups == 0
    assert torch.equal(decode_prepacked_reference(p), effective_weights_sm90(q))
    assert torch.equal(effective_weights_sm90(q), q.dequantize())
    assert torch.equal(unpack_sm90(p).dequantize(), q.dequantize())


def test_group_rows_padding_and_order():
    ids = torch.tensor([[3, 1], [1, 0], [3, 1]])
    lay = group_rows(ids, 4, 8)
    assert lay.counts.tolist() == [1, 3, 0, 2] and lay.offsets.tolist() == [0, 8, 16, 16, 24]
    assert lay.rows == 40  # 6 slots + 4 experts * 7 padding rows, rounded up to a multiple of 8
    assert lay.src_slot[:2].tolist() == [3, -1] and lay.src_slot[8:12].tolist() == [1, 2, 5, -1]
    assert lay.src_slot[16:19].tolist() == [0, 4, -1] and int((lay.src_slot >= 0).sum()) == 6
    assert lay.src_slot[[16, 8, 9, 0, 17, 10]].tolist() == list(range(6))  # slot s sits at those rows


@pytest.mark.parametrize("routing", ["uniform", "one_expert", "half_empty"])
def test_layer_pipeline_with_kernel_models_equals_reference(routing):
    cfg = MoEConfig(
        hidden_size=512, intermediate_size=256, num_experts=8, top_k=2, num_shared_experts=1, max_tokens_per_rank=64
    )
    x, ids, w, weights, _ = make_problem(Case(cfg, 13, routing, seed=3))
    moe = MoESm90.from_weights(weights)
    w13, w2 = unpack_sm90(moe.w13), unpack_sm90(moe.w2)
    y = grouped_forward(
        x,
        ids,
        w,
        moe.num_routed,
        moe.num_shared,
        moe.config_for(*ids.shape).n_tile,
        moe.hidden,
        lambda acts, lay: emulate_w1(w13, acts, lay),
        lambda hq, hs, lay, out: emulate_w2(w2, hq, hs, lay, out),
    )
    assert torch.equal(y, moe_reference(x, ids, w, weights))


def test_can_implement_and_config_choice():
    assert can_implement(4096, 7168, 32, Sm90Config()) is None
    assert "multiple of the 256-row" in can_implement(4000, 7168, 32, Sm90Config())
    assert "scale window" in can_implement(4096, 100, 32, Sm90Config())
    assert "prefetch" in can_implement(4096, 640, 32, Sm90Config(prefetch=4))
    assert "experts" in can_implement(4096, 512, 0, Sm90Config())
    # N tiles by expected rows per expert (e): e + 2 sqrt(e) rounded up to a multiple of 8, N_MAX = 80 while a typical
    # expert fits, else the fewest passes; the tile shape by registers
    assert choose_config(1, 8, 32).n_tile == 8 and choose_config(32, 8, 32).n_tile == 16  # e = 2, 8
    # active-first grid rows only where most experts are empty (one token per rank: 7 of 32 active; 8 tokens: 28)
    assert choose_config(1, 8, 32).active_first and not choose_config(8, 8, 32).active_first
    assert choose_config(32, 8, 20, 5120, 1536).n_tile == 24  # GLM-4.5: e = 12.8 -> 12
    assert choose_config(64, 8, 32).n_tile == 24 and choose_config(128, 8, 32).n_tile == 48  # e = 16, 32
    assert choose_config(128, 6, 32).n_tile == 40 and choose_config(256, 8, 32).n_tile == 80  # e = 24, 64
    assert choose_config(256, 8, 20, 5120, 1536).n_tile == 64  # e = 102: two passes of <= 64
    assert [choose_config(t, 8, 32).warpgroups for t in (32, 64, 128, 256)] == [2, 2, 4, 2]
    assert [choose_config(t, 8, 32).occupancy for t in (32, 64, 128, 256)] == [2, 2, 1, 1]
    # W1 and W2 in half M tiles (two CTAs per SM) exactly where a whole tile holds an SM alone (N 32-80: occupancy 1)
    for t, half in ((1, False), (32, False), (64, False), (128, True), (256, True)):
        c = choose_config(t, 8, 32)
        assert c.w1_half == c.w2_half == half == (c.occupancy == 1), t
    assert all(choose_config(t, 6, 32, 4096, 2048).w1_half for t in (128, 256))  # V4-Flash: N 40, 64
    with pytest.raises(ValueError, match="w1_half"):  # a cluster pair per M tile: no K splits, no stream_k
        Sm90Config(n_tile=48, splits=(2, 1), w1_half=True)
    with pytest.raises(ValueError, match="w1_half"):
        Sm90Config(n_tile=16, stream_k=True, w1_half=True)
    with pytest.raises(ValueError, match="w2_half"):
        Sm90Config(n_tile=48, splits=(1, 2), w2_half=True)
    with pytest.raises(ValueError, match="w2_half"):  # W2's bias epilogue in a half tile spills above N 64
        Sm90Config(n_tile=80, bias=True, w2_half=True)
    # the layer's epilogue flags keep the halves half_tiles_ok allows with them (gpt-oss EP8 at T = 256: N 80)
    flags = {"activation": "swiglu_clamped", "bias": True}
    oss = layer_config(256, 4, 16, 3072, 2944, 0, epilogue=flags)
    assert (oss.n_tile, oss.w1_half, oss.w2_half, oss.bias) == (80, True, False, True)
    assert layer_config(128, 4, 16, 3072, 2944, 0, epilogue=flags).w2_half  # N 48: both halves
    with pytest.raises(ValueError, match="n_tile"):
        Sm90Config(n_tile=20)
    with pytest.raises(ValueError, match="warpgroups"):
        Sm90Config(n_tile=64, warpgroups=4, occupancy=2)
    with pytest.raises(ValueError, match="occupancy"):  # three CTAs per SM: measured slower, removed
        Sm90Config(occupancy=3)
    with pytest.raises(ValueError, match="prefetch"):
        Sm90Config(prefetch=3)
    with pytest.raises(ValueError, match="ring_bm"):  # ring blocks: the grain of the L1_FULL tags, rows of 8
        Sm90Config(ring=True, ring_bm=12)


def test_k_splits_stages_and_shared_memory():
    from gcmoe_gemm_sm90.config import smem_bytes, smem_limit, with_splits

    # T = 1 on a DeepSeek-V3 EP8 rank: ~7 active experts x 16 W1 tiles fill under half of 2 x 132 slots -> 2 splits;
    # W2's 28 tiles per expert do not need them; T = 8 fills the slots without
    one = choose_config(1, 8, 32, 7168, 2048)
    assert one.splits == (2, 1) and choose_config(8, 8, 32, 7168, 2048).splits == (1, 1)
    for t in (1, 8, 32, 128, 256):  # every chosen configuration fits its occupancy's shared memory
        c = choose_config(t, 8, 32, 7168, 2048)
        assert smem_bytes(c, 7168, max(c.splits)) <= smem_limit(c.occupancy) and 2 <= c.stages <= 8
        assert can_implement(7168, 2048, 32, c, splits=c.splits[1], half=c.w2_half) is None  # (W2 as it runs)
    # W2's half tiles: two CTAs in half the SM's shared memory each, so fewer stages than one CTA of 4 warpgroups
    from gcmoe_gemm_sm90.config import half_stages

    half = choose_config(128, 8, 32, 7168, 2048)
    assert half.w2_half and 2 <= half_stages(half, 2048) < half.stages
    assert smem_bytes(replace(half, stages=half_stages(half, 2048)), 2048, 1, True) <= smem_limit(2)
    # W2 per expert after its W1 tiles (ring mode) exactly where W1 runs unsplit (measured: K-split W1 loses with it)
    for t in (1, 2, 4, 8, 128):
        for h, k in ((7168, 8), (4096, 6)):
            c = choose_config(t, k, 32, h, 2048, 132, 1)
            assert c.expert_sync == (c.splits[0] == 1)
    assert not one.expert_sync and choose_config(8, 8, 32, 7168, 2048).expert_sync
    # with the shared expert at one token (layer-split-sweep-expert-sync record): V3 / GLM-5 unsplit (>= 132 tiles of
    # >= 48 windows), V4-Flash split (32 windows), GLM-4.5 split (108 tiles < 132 SMs); unsplit again at two tokens
    shapes = {"v3": (8, 7168, 2048), "v4": (6, 4096, 2048), "glm5": (8, 6144, 2048), "glm45": (8, 5120, 1536)}
    w1 = {n: choose_config(1, k, 20 if n == "glm45" else 32, h, i, 132, 1).splits[0] for n, (k, h, i) in shapes.items()}
    assert w1 == {"v3": 1, "v4": 2, "glm5": 1, "glm45": 2}
    # W2 split in two where its tiles leave SMs without one: V4-Flash at one token (7 experts x 16 tiles < 132 SMs)
    # stream_k (V3 / GLM-5 at one token): 4 stages, the others as many as fit
    from gcmoe_gemm_sm90.config import STREAM_K_STAGES

    for n, (k, h, i) in shapes.items():
        c = choose_config(1, k, 20 if n == "glm45" else 32, h, i, 132, 1)
        assert c.stream_k == (n in ("v3", "glm5")) and (c.stages == STREAM_K_STAGES) == c.stream_k, n
    for t, want in ((1, {"v3": 1, "v4": 2, "glm5": 1, "glm45": 1}), (2, dict.fromkeys(shapes, 1))):
        w2 = {
            n: choose_config(t, k, 20 if n == "glm45" else 32, h, i, 132, 1).splits[1]
            for n, (k, h, i) in shapes.items()
        }
        assert w2 == want, t
    assert all(choose_config(2, k, 32, h, i, 132, 1).splits[0] == 1 for k, h, i in shapes.values())
    # stream_k W1 exactly where one token's unsplit W1 has 132 < tiles <= 264 (V3 / GLM-5: 144; measured faster there,
    # slower at two tokens), never with K splits
    sk = {n: choose_config(1, k, 20 if n == "glm45" else 32, h, i, 132, 1).stream_k for n, (k, h, i) in shapes.items()}
    assert sk == {"v3": True, "v4": False, "glm5": True, "glm45": False}
    assert not any(choose_config(t, 8, 32, 7168, 2048, 132, 1).stream_k for t in (2, 8, 32, 256))
    assert not choose_config(1, 8, 32, 7168, 2048).stream_k  # no shared expert: 128 tiles <= 132 SMs
    # the L2 evict_first hint on the weight streams where the layer streams <= 280 MB at T <= 2 (measured faster
    # there in the write flush, slower from 301 MB at T = 2-64): T = 1 everywhere, V4-Flash / GLM-4.5 also T = 2
    ef = {
        n: [
            t
            for t in (1, 2, 4, 8, 32, 256)
            if choose_config(t, k, 20 if n == "glm45" else 32, h, i, 132, 1).evict_first
        ]
        for n, (k, h, i) in shapes.items()
    }
    assert ef == {"v3": [1], "v4": [1, 2], "glm5": [1], "glm45": [1, 2]}
    with pytest.raises(ValueError, match="stream_k"):
        Sm90Config(splits=(2, 1), stream_k=True)
    four = with_splits(one, (4, 4), 7168, 2048)  # more partial buffers in the leader: fewer stages
    assert four.stages < one.stages
    assert "K splits" in can_implement(7168, 1536, 20, Sm90Config(prefetch=2), splits=4)  # 12 windows, 2 x 4
    assert can_implement(7168, 1536, 20, Sm90Config(prefetch=2), splits=2) is None
    assert "shared memory" in can_implement(4096, 7168, 32, Sm90Config(n_tile=64, stages=8, occupancy=2))
    assert choose_config(9, 4, 16, 512, 384).prefetch == 1  # 3 windows of W2: one window per loop step
    with pytest.raises(ValueError, match="splits"):
        Sm90Config(splits=(3, 1))


SMALL = MoEConfig(
    hidden_size=512, intermediate_size=256, num_experts=8, top_k=2, num_shared_experts=0, max_tokens_per_rank=64
)


class Launched(Exception):
    """Raised in place of the compile + launch: the call got past every argument check."""


def test_launch_argument_checks_raise_before_any_launch(monkeypatch):
    """launch_w1 / launch_w2 / w2 refuse wrong operands in Python, before the kernel is compiled or launched (here:
    no GPU; the compile step is replaced by a sentinel that a well-formed call reaches); a K split that does not
    divide the windows is refused by can_implement when the variant is compiled, before any launch."""
    monkeypatch.setenv("GCMOE_ARCH", "sm_90a")  # (no GPU here: the arch the launch would compile for)
    import gcmoe_gemm_sm90.ops as ops
    from gcmoe_core.grouping import prepare_activations
    from gcmoe_gemm_sm90.ops import RingSync, launch_w1, launch_w2, w1, w2

    x, ids, w, weights, _ = make_problem(Case(SMALL, 5, "uniform", seed=1))
    moe = MoESm90.from_weights(weights)
    cfg = Sm90Config(n_tile=8, prefetch=2)
    lay = group_rows(ids, SMALL.num_experts, cfg.n_tile)
    acts = prepare_activations(x, w, lay, SMALL.top_k)
    r, i, h = lay.rows, SMALL.intermediate_size, SMALL.hidden_size
    hq = torch.zeros(r, i, dtype=torch.uint8)
    hsT = torch.zeros(2 * i // 256, r)
    dst, src = lay.src_slot, torch.zeros(r, 3, dtype=torch.int32)
    comb = torch.zeros(1, dtype=torch.int64)
    ring = RingSync(0, 4, 8, 12, 32, 64, ticket=1, timeout_ns=10**8)

    def run_w1(**kw):
        a = dict(x_rows=acts.x_rows, sxT=acts.sxT, route_w=acts.route_w, offsets=lay.offsets, counts=lay.counts)
        a.update(hq=hq, hsT=hsT, cfg=cfg, ring=None)
        a.update(kw)
        launch_w1(moe.w13, **a)

    def run_w2(**kw):
        a = dict(hq=hq, hsT=hsT, offsets=lay.offsets, counts=lay.counts, dst=dst, src=src, comb=comb, cfg=cfg)
        a.update(ring=None)
        a.update(kw)
        launch_w2(moe.w2, **a)

    # K = 512 is 4 windows of W1, not a multiple of 4 splits x prefetch 2: refused by the real compile step
    with pytest.raises(ValueError, match="K splits"):
        run_w1(cfg=Sm90Config(n_tile=8, prefetch=2, splits=(4, 1)))

    def not_compiled(*args, **kwargs):
        raise Launched(args[0])

    monkeypatch.setattr(ops, "compiled", not_compiled)
    w1_cases = {
        "hq / hsT must be": [
            dict(hq=hq[:, :128]),
            dict(hq=hq.view(torch.int8)),
            dict(hsT=hsT[:, :-8]),
        ],
        "row layout": [dict(counts=lay.counts[:-1]), dict(offsets=lay.offsets[:-1])],
        "activation rows": [dict(x_rows=acts.x_rows.view(torch.float8_e4m3fn)), dict(x_rows=acts.x_rows[:, :256])],
        "RingSync goes with cfg.ring": [dict(ring=ring), dict(cfg=replace(cfg, ring=True))],
        # grid rows: 1..E, below E only where row y runs the y-th expert with rows (active_first)
        "grid_rows": [
            dict(grid_rows=0),
            dict(grid_rows=SMALL.num_experts + 1),
            dict(grid_rows=2, cfg=replace(cfg, active_first=False)),
        ],
    }
    for match, cases in w1_cases.items():
        for kw in cases:
            with pytest.raises(ValueError, match=match):
                run_w1(**kw)
    w2_cases = {
        "src int32": [
            dict(src=torch.zeros(r, 2, dtype=torch.int32)),
            dict(comb=comb.to(torch.int32)),
            dict(dst=dst.long()),
        ],
        "row layout": [dict(counts=lay.counts[:-1])],
        "activation rows": [dict(hq=torch.zeros(r, 2 * i, dtype=torch.uint8))],  # W2's K is I, not 2 I
        "RingSync goes with cfg.ring": [dict(ring=ring), dict(cfg=replace(cfg, ring=True))],
        "grid_rows": [dict(grid_rows=-1), dict(grid_rows=3, cfg=replace(cfg, active_first=False))],
        "first_expert": [dict(first_expert=-1), dict(first_expert=SMALL.num_experts)],
    }
    for match, cases in w2_cases.items():
        for kw in cases:
            with pytest.raises(ValueError, match=match):
                run_w2(**kw)
    out = torch.zeros(ids.numel(), h, dtype=torch.bfloat16)
    for bad in (out.float(), torch.zeros(h, ids.numel(), dtype=torch.bfloat16).t()):
        with pytest.raises(ValueError, match="out must be contiguous bf16"):
            w2(moe.w2, hq, hsT, lay, bad, cfg)
    # well-formed calls get past every check (to the compile step), ring mode with its RingSync too
    for call in (
        lambda: run_w1(),
        lambda: run_w2(),
        lambda: run_w1(cfg=replace(cfg, ring=True), ring=ring),
        lambda: run_w1(grid_rows=2),
        lambda: run_w1(first_expert=SMALL.num_experts - 1),
        lambda: run_w2(grid_rows=SMALL.num_experts, cfg=replace(cfg, active_first=False)),
        lambda: run_w2(cfg=replace(cfg, ring=True), ring=ring),
        lambda: w1(moe.w13, acts, lay, cfg),
        lambda: w2(moe.w2, hq, hsT, lay, out, cfg),
    ):
        with pytest.raises(Launched):
            call()


def test_shared_w1_ranges_cover_each_shared_experts_w1_and_nothing_else():
    """The prefetch's ranges: per shared expert (appended after the routed ones) its W1 weights and scale records,
    each the contiguous bytes of that expert in the prepacked tensors; none for a layer without shared experts."""
    from gcmoe_gemm_sm90.ops import prefetch_l2

    cfg = MoEConfig(512, 256, 6, 2, num_shared_experts=2, max_tokens_per_rank=8)
    _, _, _, weights, _ = make_problem(Case(cfg, 3, "uniform", seed=1))
    moe = MoESm90.from_weights(weights)
    ranges = moe.shared_w1_ranges()
    data, scales = moe.w13.data, moe.w13.scales
    want = []
    for e in (6, 7):
        want += [(data[e].data_ptr(), data[e].numel()), (scales[e].data_ptr(), scales[e].numel() * 4)]
    assert ranges == want
    assert data[7].data_ptr() + data[7].numel() == data.data_ptr() + data.numel()  # the last one ends the tensor
    assert all(a % 16 == 0 and n % 16 == 0 for a, n in ranges)
    plain = MoESm90.from_weights(make_problem(Case(cfg.replace(num_shared_experts=0), 3, "uniform", seed=1))[3])
    assert plain.shared_w1_ranges() == []
    # the launcher refuses what the bulk prefetch cannot take, before anything is compiled or launched
    for bad in ([], [(16, 8)], [(8, 16)], [(16, 0)], [(16, 16)] * 9):
        with pytest.raises(ValueError, match="prefetch_l2"):
            prefetch_l2(bad)


def test_each_gemm_runs_the_schedule_its_config_names():
    """config.schedule_of names one schedule per (GEMM, config) and ops.kernel_class picks its kernel class (one file
    each); a class refuses a config of another schedule, so no config compiles into a schedule it did not ask for."""
    from gcmoe_gemm_sm90.config import schedule_of
    from gcmoe_gemm_sm90.kernel_grouped import GroupedGemmSm90
    from gcmoe_gemm_sm90.kernel_grouped_half import GroupedGemmHalfSm90
    from gcmoe_gemm_sm90.kernel_grouped_stream_k import GroupedGemmStreamKSm90
    from gcmoe_gemm_sm90.ops import kernel_class

    classes = {"whole": GroupedGemmSm90, "half": GroupedGemmHalfSm90, "stream_k": GroupedGemmStreamKSm90}
    whole = Sm90Config(n_tile=16, prefetch=2)
    cases = [
        (whole, "whole", "whole"),
        (replace(whole, stream_k=True), "stream_k", "whole"),  # stream_k is W1's: W2 runs whole tiles
        (replace(whole, n_tile=48, warpgroups=4, w1_half=True), "half", "whole"),
        (replace(whole, n_tile=48, warpgroups=4, w2_half=True), "whole", "half"),
        (replace(whole, stream_k=True, w2_half=True), "stream_k", "half"),
    ]
    for cfg, w1_schedule, w2_schedule in cases:
        for mode, m, k, want in (("w1", 4096, 7168, w1_schedule), ("w2", 7168, 2048, w2_schedule)):
            assert schedule_of(mode, cfg) == want, (mode, cfg)
            cls = kernel_class(mode, cfg)
            assert cls is classes[want] and cls.schedule == want
            assert cls(mode, m, k, cfg).stream_k == (want == "stream_k")
            for other in set(classes.values()) - {cls}:
                with pytest.raises(ValueError, match="schedule"):
                    other(mode, m, k, cfg)
    # a DeepSeek-V3 EP8 rank's W1 runs all three: stream_k at T = 1, whole tiles at T = 8, half tiles at T = 128
    assert [schedule_of("w1", choose_config(t, 8, 32, shared=1)) for t in (1, 8, 128)] == ["stream_k", "whole", "half"]


def test_packed_weights_own_their_decode_tables():
    """The decode tables the kernels read belong to the prepacked weights (made with them, on their device): no
    module-global device state in the package."""
    import gcmoe_gemm_sm90.ops as ops

    p = prepack_sm90(random_mxfp4((2, 256, 256), torch.Generator().manual_seed(3)))
    assert torch.equal(p.lut, lut_pair_words().reshape(-1)) and p.lut.device == p.data.device
    moved = replace(p, data=p.data.to("meta"), scales=p.scales.to("meta"))  # (a replace onto another device)
    assert moved.lut.device == moved.data.device
    assert not [n for n, v in vars(ops).items() if isinstance(v, dict) and n.isupper()], "a module-global table"
