"""The sm90 grouped W1/W2 kernels on an H200 against their torch models and the quantisation-emulating reference:
fresh random data, poisoned outputs, uniform / one-expert / half-empty routing, the layer on prepared rows
(gcmoe_core.grouping.grouped_forward around ops.w1 / w2), bitwise-stable graph replays; ring mode (Sm90Config.ring) on
hand-made signal words: the same bits as the launch on prepared rows, nothing stored once ERR is set, bounded waits
recorded in ERR."""

import time
from dataclasses import replace
from itertools import accumulate

import pytest
import torch

from gcmoe_core.config import MoEConfig
from gcmoe_core.formats import quantize_fp8_e4m3_1x128
from gcmoe_core.grouping import Activations, RowLayout, group_rows, grouped_forward, prepare_activations
from gcmoe_core.reference import MoEWeights, moe_reference
from gcmoe_core.signals import ERR_FAILED, KIND_BLOCK, KIND_OFFS, KIND_RECV, KIND_W1
from gcmoe_core.testing import (
    Case,
    calc_diff,
    capture_graph,
    cosine,
    first_mismatch,
    make_problem,
    make_tokens,
    make_weights,
    poison_,
)
from gcmoe_gemm_sm90.config import Sm90Config
from gcmoe_gemm_sm90.ops import (
    MoESm90,
    RingSync,
    StreamKScratch,
    emulate_w1,
    emulate_w2,
    launch_w1,
    launch_w2,
    w1,
    w2,
)
from gcmoe_gemm_sm90.prepack import unpack_sm90

pytestmark = [pytest.mark.gpu, pytest.mark.sm90]

SMALL = MoEConfig(
    hidden_size=512, intermediate_size=256, num_experts=8, top_k=2, num_shared_experts=1, max_tokens_per_rank=512
)


def _dequant_rows(hq, hsT):
    k = hq.shape[1] // 128
    return (hq.view(torch.float8_e4m3fn).float().view(-1, k, 128) * hsT.t().unsqueeze(-1)).view(hq.shape[0], -1)


def _assert_w1_matches_model(hq, hsT, eq, es, valid):
    """W1's outputs on the valid rows against its torch model. Power-of-two scales: equal, except that one whose amax
    lies at a 448 * 2^e boundary (within FP32 rounding of the two summation orders) may sit one binade off; the
    dequantised values must match either way."""
    ratio = hsT[:, valid] / es[:, valid]
    assert ((ratio == 1) | (ratio == 2) | (ratio == 0.5)).all(), "activation scales off by more than a binade"
    assert int((ratio != 1).sum()) <= 2, f"{int((ratio != 1).sum())} activation scales one binade off"
    d = calc_diff(_dequant_rows(hq, hsT)[valid], _dequant_rows(eq, es)[valid])
    assert d < 1e-3, d


def sm90_layer(moe: MoESm90, x, ids, w):
    """The whole layer on the sm90 kernels on prepared rows (gcmoe_core.grouping.grouped_forward around w1 / w2):
    routing metadata, FP8 quantisation, W1, W2, slot combine; -> y bf16 [T, H]."""
    c = moe.config_for(*ids.shape)
    run_w1 = lambda acts, lay: w1(moe.w13, acts, lay, c)
    run_w2 = lambda hq, hs, lay, out: w2(moe.w2, hq, hs, lay, out, c)
    return grouped_forward(x, ids, w, moe.num_routed, moe.num_shared, c.n_tile, moe.hidden, run_w1, run_w2)


VARIANTS = {  # weights by bulk copy into the pipeline's stages (the only weight stream)
    "smem-scales": dict(prefetch=2),
    # K splits over a cluster (SMALL: W1 has 4 windows, W2 2): partial sums pushed to the leader
    "split2": dict(prefetch=1, splits=(2, 2)),
    "split4": dict(prefetch=1, splits=(4, 2)),
    # 4 warpgroups of one 64-row subtile each (512 threads), also with K splits
    "4wg": dict(prefetch=2, warpgroups=4),
    "4wg-split2": dict(prefetch=1, splits=(2, 2), warpgroups=4),
    # W1 over equal window ranges of every CTA slot: tiles split between CTAs, reduced by the last to arrive (SMALL:
    # a few dozen units over 2 x SMs CTAs, so every tile is split; prefetch 1: pieces of single windows)
    "stream-k": dict(prefetch=2, stream_k=True),
    "stream-k-p1": dict(prefetch=1, stream_k=True),
    # CTAs of half an M tile (128 rows, one subtile per warpgroup, two CTAs per SM): W2 alone, and W1 too (its halves
    # a cluster pair exchanging each token's maximum for the FP8 scale)
    "w2-half": dict(prefetch=2, warpgroups=4, w2_half=True),
    "half": dict(prefetch=2, warpgroups=4, w1_half=True, w2_half=True),
    # grid row y runs expert y (no active-first rows: the layer's grids from about 4 tokens per rank on), the CTAs of
    # empty experts (one_expert, half_empty) among them
    "in-order": dict(prefetch=2, active_first=False),
    "split2-in-order": dict(prefetch=1, splits=(2, 2), active_first=False),
    "half-in-order": dict(prefetch=2, warpgroups=4, w1_half=True, w2_half=True, active_first=False),
}


GROUPED_N_TILES = (8, 16, 24, 32, 48, 64, 80)


def grouped_config(n_tile: int, variant: str) -> Sm90Config | str:
    """The config test_w1_then_w2_match_models runs for (n_tile, variant), or why it skips that pair
    (tools/gpu/precompile.py --test-variants compiles the same configs)."""
    if "split" in variant and n_tile >= 48:
        return "K splits are for small token counts (N <= 32): the leader's partial buffers exceed shared memory"
    if "4wg" in variant and n_tile > 64:
        return "4 warpgroups hold N <= 64 in 128 registers"
    if "stream-k" in variant and n_tile > 24:
        return "stream_k is for small token counts (N <= 24)"
    params = VARIANTS[variant]
    if "half" in variant and n_tile > 64:  # "w2-half"'s whole-tile W1 in 2 warpgroups, as choose_config runs N 80
        params = {**params, "warpgroups": 2}
    return Sm90Config(n_tile=n_tile, stages=3, **params)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("n_tile", GROUPED_N_TILES)
@pytest.mark.parametrize("routing", ["uniform", "one_expert", "half_empty"])
def test_w1_then_w2_match_models(n_tile, routing, variant):
    cfg = grouped_config(n_tile, variant)
    if isinstance(cfg, str):
        pytest.skip(cfg)
    routed = SMALL.replace(num_shared_experts=0)  # the kernels alone: routed experts only
    x, ids, w, weights, _ = make_problem(Case(routed, 37, routing, seed=n_tile), device="cuda")
    moe = MoESm90.from_weights(weights, cfg)
    layout = group_rows(ids, SMALL.num_experts, n_tile)
    acts = prepare_activations(x, w, layout, SMALL.top_k)
    hq, hsT = w1(moe.w13, acts, layout, cfg)
    _assert_w1_matches_model(hq, hsT, *emulate_w1(unpack_sm90(moe.w13), acts, layout), layout.src_slot >= 0)
    out = torch.full((ids.numel(), SMALL.hidden_size), float("nan"), dtype=torch.bfloat16, device="cuda")
    w2(moe.w2, hq, hsT, layout, out, cfg)
    ref = emulate_w2(unpack_sm90(moe.w2), hq, hsT, layout, torch.full_like(out, float("nan")))
    assert not out.isnan().any(), "unwritten output rows"
    assert calc_diff(out, ref) < 1e-3


@pytest.mark.parametrize("variant", ["smem-scales", "split2", "4wg", "w2-half", "in-order"])
def test_w2_rows_at_both_ends_of_the_range_match_the_model(variant):
    """W2 rows of one expert's tiles whose outputs lie near 2^120 and near 2^-120 beside ordinary rows: each row as
    the model's (all finite, calc_diff <= 1e-3; the kernels once held a row in units of its weights' 2^(f - 127) and
    overflowed from about 2^120 on), and the ordinary rows bit for bit what they are without the extreme rows in
    their tiles (the accumulators' unit depends on the tile's rows and tokens only by powers of two: docs/numerics.md).
    """
    cfg = grouped_config(16, variant)
    routed = SMALL.replace(num_shared_experts=0)
    x, ids, w, weights, _ = make_problem(Case(routed, 37, "one_expert", seed=11), device="cuda")
    moe = MoESm90.from_weights(weights, cfg)
    layout = group_rows(ids, SMALL.num_experts, 16)
    acts = prepare_activations(x, w, layout, SMALL.top_k)
    hq, hsT = emulate_w1(unpack_sm90(moe.w13), acts, layout)
    model = unpack_sm90(moe.w2)
    valid = layout.src_slot >= 0
    base = emulate_w2(model, hq, hsT, layout, torch.zeros(ids.numel(), SMALL.hidden_size, device="cuda").bfloat16())
    amax = base.float().abs().amax(1)[layout.src_slot.clamp(min=0).long()]  # each row's largest output
    rows = valid.nonzero().flatten()
    big, tiny = rows[0::3], rows[1::3]
    scaled = hsT.clone()
    scaled[:, big] *= torch.exp2(120 - torch.log2(amax[big]).floor())
    scaled[:, tiny] *= torch.exp2(-120 - torch.log2(amax[tiny]).floor())

    def run(h_scales):
        out = torch.full((ids.numel(), SMALL.hidden_size), float("nan"), dtype=torch.bfloat16, device="cuda")
        return w2(moe.w2, hq, h_scales, layout, out, cfg)

    out = run(scaled)
    ref = emulate_w2(model, hq, scaled, layout, torch.full_like(out, float("nan")))
    slots = layout.src_slot[valid].long()
    assert torch.isfinite(out[slots]).all(), "a row the model keeps finite overflowed"
    for r in slots.tolist():
        assert calc_diff(out[r], ref[r]) <= 1e-3, (r, calc_diff(out[r], ref[r]))
    assert out[slots].float().abs().amax() >= 2.0**119, "no row reached the top of the range"
    plain = run(hsT)
    rest = layout.src_slot[rows[2::3]].long()
    assert first_mismatch(out[rest], plain[rest]) == ""


@pytest.mark.parametrize(
    ("model", "tokens"), [("deepseek-v4-flash", 1), ("deepseek-v4-flash", 32), ("glm-4.5", 8), ("deepseek-v3", 128)]
)
def test_layer_vs_reference_on_model_shapes(model, tokens):
    cfg = MoEConfig.ep_slice(model, 8, max_tokens_per_rank=512)
    weights = make_weights(cfg, seed=tokens, device="cuda")
    x, ids, w = make_tokens(cfg, tokens, seed=tokens, device="cuda")
    y = sm90_layer(MoESm90.from_weights(weights), x, ids, w)
    ref = moe_reference(x, ids, w, weights.exact_bf16(), quant="fp8_mxfp4")
    assert calc_diff(y, ref) < 1e-3


def test_cosine_vs_bf16_path():
    x, ids, w, weights, floats = make_problem(Case(SMALL, 64, "uniform", seed=5), device="cuda")
    y = sm90_layer(MoESm90.from_weights(weights), x, ids, w)
    yb = moe_reference(x, ids, w, MoEWeights.from_float(*floats, quant="bf16").to("cuda"))
    assert cosine(y, yb) >= 0.97


@pytest.mark.parametrize(
    ("splits", "stream_k"),
    [((1, 1), False), ((2, 2), False), ((1, 1), True)],
    ids=["no-splits", "k-splits", "stream-k"],
)
def test_graph_replays_bitwise_identical_with_new_routing(splits, stream_k):
    x, ids, w, weights, _ = make_problem(Case(SMALL, 16, "uniform", seed=9), device="cuda")
    prefetch = 2 if splits == (1, 1) else 1  # SMALL's W2 has 2 windows: 2 splits x 1
    cfg = Sm90Config(n_tile=16, stages=3, prefetch=prefetch, splits=splits, stream_k=stream_k)
    moe = MoESm90.from_weights(weights, cfg)
    g, y = capture_graph(lambda: sm90_layer(moe, x, ids, w), warmup=2)
    for seed in range(3):
        nx, nids, nw, _, _ = make_problem(Case(SMALL, 16, ("uniform", "one_expert", "half_empty")[seed], 50 + seed))
        x.copy_(nx), ids.copy_(nids), w.copy_(nw)
        g.replay()
        torch.cuda.synchronize()
        assert calc_diff(y, moe_reference(x, ids, w, weights)) < 1e-3
    first = None
    for _ in range(100):
        g.replay()
        torch.cuda.synchronize()
        first = y.clone() if first is None else first
        assert first_mismatch(y, first) == ""


@pytest.mark.parametrize("routing", ["one_expert", "half_empty", "uniform"])
@pytest.mark.parametrize("splits", [(1, 1), (2, 2)], ids=["no-splits", "k-splits"])
def test_bounded_and_rotated_grid_rows_give_the_full_grids_bits(routing, splits):
    """W1 / W2 with active-first grid rows bounded by the experts that have rows (exactly those, and one more),
    fewer than those (1, 2, one less: each CTA runs rows y, y + R, ...) and rotated (the first row's expert not 0),
    and in-order rows rotated, store the same bits as the full grid in expert order, on poisoned outputs."""
    from gcmoe_gemm_sm90.ops import launch_w1, launch_w2

    cfg = Sm90Config(n_tile=8, stages=3, prefetch=1, splits=splits)  # (active_first is the default)
    routed = SMALL.replace(num_shared_experts=0)
    x, ids, w, weights, _ = make_problem(Case(routed, 3, routing, seed=11), device="cuda")
    moe = MoESm90.from_weights(weights, cfg)
    layout = group_rows(ids, SMALL.num_experts, cfg.n_tile)
    acts = prepare_activations(x, w, layout, SMALL.top_k)
    active = int((layout.counts > 0).sum())
    assert active < SMALL.num_experts
    src = torch.zeros(layout.rows, 3, dtype=torch.int32, device="cuda")
    e = SMALL.num_experts
    in_order = replace(cfg, active_first=False)
    grids = [(cfg, None, 0), (cfg, active, 0), (cfg, active + 1, 0), (cfg, active, e - 1), (cfg, None, 3)]
    grids += [(cfg, 1, 0), (cfg, 2, e - 1), (cfg, max(1, active - 1), 3)]  # fewer rows than experts with rows
    grids += [(in_order, None, 0), (in_order, None, e - 3)]
    results = []
    for c, rows, first in grids:
        hq = torch.full((layout.rows, SMALL.intermediate_size), 0xFF, dtype=torch.uint8, device="cuda")
        hsT = torch.full((2 * SMALL.intermediate_size // 256, layout.rows), float("nan"), device="cuda")
        grid = dict(grid_rows=rows, first_expert=first)
        launch_w1(moe.w13, acts.x_rows, acts.sxT, acts.route_w, layout.offsets, layout.counts, hq, hsT, c, **grid)
        out = torch.full((ids.numel(), SMALL.hidden_size), float("nan"), dtype=torch.bfloat16, device="cuda")
        comb = torch.full((1,), out.data_ptr(), dtype=torch.int64, device="cuda")
        launch_w2(moe.w2, hq, hsT, layout.offsets, layout.counts, layout.src_slot, src, comb, c, **grid)
        torch.cuda.synchronize()
        results.append(out)
    assert not results[0].isnan().any(), "unwritten output rows"
    for (c, rows, first), out in zip(grids[1:], results[1:]):
        assert first_mismatch(out, results[0]) == "", (c.active_first, rows, first)


# ------------------------------------------------------------------------------------------------ ring mode
# Hand-made rows as gcmoe-comm's dispatch leaves them on the ring: expert offsets padded to the ring block of 8 rows
# (Sm90Config.ring_bm), not to the N tile, so activation boxes start inside another expert's tile grid
RING = MoEConfig(
    hidden_size=512, intermediate_size=256, num_experts=4, top_k=2, num_shared_experts=0, max_tokens_per_rank=64
)
RING_COUNTS = (3, 9, 0, 20)
RING_BM = 8
# the signal words (each on its own 128-byte line, as in a workspace): INUSE, CGEN, OFFS, ERR (5 words), L1_FULL
# (one per ring block), then the W1_DONE pairs (count, tag) of every expert
SIG_INUSE, SIG_CGEN, SIG_OFFS, SIG_ERR, SIG_L1_FULL = 0, 32, 64, 96, 128
TICKET = 7
TIMEOUT_MS = 100
RING_VARIANTS = {
    "n16": Sm90Config(n_tile=16, stages=3, prefetch=2),
    "n16-split2": Sm90Config(n_tile=16, stages=3, prefetch=1, splits=(2, 2)),
    "n32-4wg": Sm90Config(n_tile=32, stages=3, prefetch=2, warpgroups=4),
    "n48-4wg-half": Sm90Config(n_tile=48, stages=3, prefetch=2, warpgroups=4, w1_half=True, w2_half=True),
    "n80-half": Sm90Config(n_tile=80, stages=3, prefetch=2, w1_half=True, w2_half=True),
    "n8-stream-k": Sm90Config(n_tile=8, stages=3, prefetch=2, stream_k=True),
    "n16-stream-k-p1": Sm90Config(n_tile=16, stages=3, prefetch=1, stream_k=True),
    # in-order grid rows (the layer's config from about 4 tokens per rank): expert 2's CTAs find no rows; N 16 also
    # with ERR set and under every failed wait (test_ring_mode_stores_nothing_once_err_is_set, _wait_is_bounded_...)
    "n16-in-order": Sm90Config(n_tile=16, stages=3, prefetch=2, active_first=False),
    "n48-half-in-order": Sm90Config(
        n_tile=48, stages=3, prefetch=2, warpgroups=4, w1_half=True, w2_half=True, active_first=False
    ),
}


def ring_rows(seed: int) -> tuple[RowLayout, Activations]:
    """Fresh random rows for RING_COUNTS with offsets padded to RING_BM; every valid row goes to a distinct output
    slot (a random permutation); padding rows hold random data too (never stored)."""
    g = torch.Generator().manual_seed(seed)
    offsets = [0, *accumulate(-(-c // RING_BM) * RING_BM for c in RING_COUNTS)]
    rows, slots = offsets[-1], sum(RING_COUNTS)
    valid = torch.zeros(rows, dtype=torch.bool)
    for e, c in enumerate(RING_COUNTS):
        valid[offsets[e] : offsets[e] + c] = True
    src_slot = torch.full((rows,), -1, dtype=torch.int32)
    src_slot[valid] = torch.randperm(slots, generator=g).to(torch.int32)
    q, s = quantize_fp8_e4m3_1x128(torch.randn(rows, RING.hidden_size, generator=g))
    route_w = torch.where(valid, torch.rand(rows, generator=g) + 0.1, torch.zeros(rows))
    layout = RowLayout(
        RING_BM,  # (no N tile: the rows are padded to ring blocks)
        rows,
        torch.tensor(offsets, dtype=torch.int32, device="cuda"),
        torch.tensor(RING_COUNTS, dtype=torch.int32, device="cuda"),
        src_slot.cuda(),
    )
    acts = Activations(q.view(torch.uint8).cuda(), s.t().contiguous().cuda(), route_w.cuda())
    return layout, acts


def sig_w1_done(sig: torch.Tensor) -> int:
    return sig.numel() - 2 * len(RING_COUNTS)


def ring_signals(layout: RowLayout) -> torch.Tensor:
    """The words as dispatch leaves them for call 1: INUSE = the call's ticket, CGEN = 0, OFFS = 1, L1_FULL = 1 for
    every ring block of the rows, ERR and W1_DONE clear."""
    blocks = layout.rows // RING_BM
    sig = torch.zeros(SIG_L1_FULL + blocks + 2 * len(RING_COUNTS), dtype=torch.int32, device="cuda")
    sig[SIG_INUSE], sig[SIG_CGEN], sig[SIG_OFFS] = TICKET, 0, 1
    sig[SIG_L1_FULL : SIG_L1_FULL + blocks] = 1
    return sig


def ring_sync(sig: torch.Tensor, timeout_ms: int = TIMEOUT_MS) -> RingSync:
    a = lambda i: sig.data_ptr() + 4 * i
    words = (SIG_INUSE, SIG_CGEN, SIG_OFFS, SIG_ERR, SIG_L1_FULL, sig_w1_done(sig))
    return RingSync(*(a(i) for i in words), TICKET, timeout_ms * 10**6)


class RingRun:
    """W1 + W2 on the ring rows into poisoned outputs; the operands made once (the timed launch builds nothing)."""

    def __init__(self, moe: MoESm90, layout: RowLayout, acts: Activations):
        self.moe, self.layout, self.acts = moe, layout, acts
        r = layout.rows
        self.hq = torch.empty(r, moe.inter, dtype=torch.uint8, device="cuda")
        self.hsT = torch.empty(2 * moe.inter // 256, r, device="cuda")
        self.out = torch.empty(sum(RING_COUNTS), moe.hidden, dtype=torch.bfloat16, device="cuda")
        self.src = torch.zeros(r, 3, dtype=torch.int32, device="cuda")  # every row to "rank 0": out
        self.comb = torch.tensor([self.out.data_ptr()], dtype=torch.int64, device="cuda")
        self.scratch = StreamKScratch.make(torch.device("cuda"))  # (used where cfg.stream_k)
        self.poison()

    def poison(self) -> None:
        for t in (self.hq, self.hsT, self.out):
            poison_(t)

    def outputs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.hq.clone(), self.hsT.clone(), self.out.clone()

    def launch(self, cfg: Sm90Config, ring: RingSync | None, grid_rows: int | None = None) -> None:
        m, a, lay = self.moe, self.acts, self.layout
        hq, hsT, sk, rows = self.hq, self.hsT, self.scratch, dict(grid_rows=grid_rows)
        launch_w1(m.w13, a.x_rows, a.sxT, a.route_w, lay.offsets, lay.counts, hq, hsT, cfg, ring, sk, **rows)
        launch_w2(m.w2, hq, hsT, lay.offsets, lay.counts, lay.src_slot, self.src, self.comb, cfg, ring, **rows)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """torch.equal on the bits (NaN poison compares equal to itself)."""
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.view(as_int), b.view(as_int))


def _ring_setup(seed: int, cfg: Sm90Config):
    weights = make_weights(RING, seed=seed, device="cuda")
    moe = MoESm90.from_weights(weights, cfg)
    layout, acts = ring_rows(seed)
    return moe, layout, acts, RingRun(moe, layout, acts)


@pytest.mark.parametrize("variant", list(RING_VARIANTS))
def test_ring_mode_equals_prepared_rows(variant):
    """Ring mode with every signal published gives bit for bit what the launch on prepared rows gives (both against
    the kernels' torch models), leaves the signal words as they were, and every valid row's output written."""
    cfg = RING_VARIANTS[variant]
    moe, layout, acts, run = _ring_setup(11, cfg)
    run.launch(cfg, None)
    plain = run.outputs()
    sig = ring_signals(layout)
    before = sig.clone()
    run.poison()
    run.launch(replace(cfg, ring=True), ring_sync(sig))
    torch.cuda.synchronize()
    ringed = run.outputs()
    for name, a, b in zip(("hq", "hsT", "out"), plain, ringed, strict=True):
        assert _bits_equal(a, b), f"{name}: {first_mismatch(a, b)}"
    # the W1_DONE pairs: every expert with rows counted its M tiles back to 0 and tagged generation 1 (W2 acquired
    # it); experts without rows untouched; nothing else written (ERR clear)
    w1d = sig_w1_done(sig)
    assert sig[w1d:].view(-1, 2).tolist() == [[0, int(c > 0)] for c in RING_COUNTS]
    assert torch.equal(sig[:w1d], before[:w1d]), "ring mode wrote a signal word (ERR?)"
    assert not run.scratch.counters.any(), "stream_k arrival counters not back to 0"
    hq, hsT, out = ringed
    valid = layout.src_slot >= 0
    _assert_w1_matches_model(hq, hsT, *emulate_w1(unpack_sm90(moe.w13), acts, layout), valid)
    ref = emulate_w2(unpack_sm90(moe.w2), hq, hsT, layout, torch.full_like(out, float("nan")))
    assert not out.isnan().any(), "unwritten output rows"
    assert calc_diff(out, ref) < 1e-3


@pytest.mark.parametrize("variant", ["n16", "n16-split2", "n32-4wg"])
def test_ring_mode_with_fewer_grid_rows_than_experts_with_rows(variant):
    """Ring mode with 1 or 2 active-first grid rows for the 3 experts with rows (a peer's call larger than the
    layer's bound): each CTA runs rows y, y + R, ... — W1 acquiring each expert's ring blocks and releasing its
    W1_DONE tag, W2 acquiring it, per row — and stores the bits of the full grid; the W1_DONE pairs end as there."""
    cfg = replace(RING_VARIANTS[variant], ring=True)
    _, layout, _, run = _ring_setup(15, cfg)
    run.launch(cfg, ring_sync(ring_signals(layout)))
    torch.cuda.synchronize()
    full = run.outputs()
    for rows in (1, 2):
        sig = ring_signals(layout)
        run.poison()
        run.launch(cfg, ring_sync(sig), grid_rows=rows)
        torch.cuda.synchronize()
        for name, a, b in zip(("hq", "hsT", "out"), full, run.outputs(), strict=True):
            assert _bits_equal(a, b), f"{rows} rows, {name}: {first_mismatch(a, b)}"
        w1d = sig_w1_done(sig)
        assert sig[w1d:].view(-1, 2).tolist() == [[0, int(c > 0)] for c in RING_COUNTS]
        assert sig[SIG_ERR] == 0


def _ring_warmed(seed: int, variant: str = "n16"):
    """A ring variant (N 16) in ring mode on hand-made rows, launched once (compiled and loaded outside any timed
    launch); returns (cfg, layout, run, fresh signal words)."""
    cfg = replace(RING_VARIANTS[variant], ring=True)
    _, layout, _, run = _ring_setup(seed, cfg)
    run.launch(cfg, ring_sync(ring_signals(layout)))
    torch.cuda.synchronize()
    return cfg, layout, run, ring_signals(layout)


@pytest.mark.parametrize("variant", ["n16", "n16-in-order"])
def test_ring_mode_stores_nothing_once_err_is_set(variant):
    """A call whose ERR word is already set (another kernel's wait failed) writes no output and no ERR word, and
    returns at once (no wait runs to its bound)."""
    cfg, _, run, sig = _ring_warmed(12, variant)
    sig[SIG_ERR : SIG_ERR + 5] = torch.tensor([ERR_FAILED, KIND_RECV, 1, 1, 0], dtype=torch.int32)
    before = sig.clone()
    run.poison()
    poisoned = run.outputs()
    t0 = time.perf_counter()
    run.launch(cfg, ring_sync(sig, timeout_ms=1000))
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    for name, a, b in zip(("hq", "hsT", "out"), poisoned, run.outputs(), strict=True):
        assert _bits_equal(a, b), f"{name} written with ERR set: {first_mismatch(a, b)}"
    assert torch.equal(sig, before), f"ERR words changed: {sig[SIG_ERR : SIG_ERR + 5].tolist()}"
    assert dt < 0.5, f"{dt:.3f} s with ERR set: a wait ran instead of returning at once"


@pytest.mark.parametrize("variant", ["n16", "n16-in-order"])
@pytest.mark.parametrize("missing", ["offs", "block", "w1"])
def test_ring_wait_is_bounded_and_recorded(missing, variant):
    """offs: OFFS never reaches CGEN + 1 = 1 -> every CTA gives up within the bound (RingSync.timeout_ns), the first
    records (1, KIND_OFFS, 0, generation 1, seen 0), nothing is written. block: the last ring block of expert 3 never
    gets its L1_FULL tag -> (1, KIND_BLOCK, block 5, 1, 0), and expert 3's W2 stores nothing (W1's scratch rows may
    be written; other experts' W2 may store, since it starts per expert). w1: expert 1's W1_DONE count starts off
    (as if a tile of it were lost) so its tag never comes -> its W2 waits out the bound: (1, KIND_W1, expert 1, 1, 0)
    and stores nothing. The whole call returns within 2x the bound."""
    cfg, layout, run, sig = _ring_warmed(13, variant)
    block = layout.rows // RING_BM - 1  # expert 3's rows 24..43 lie in blocks 3..5
    if missing == "offs":
        sig[SIG_OFFS] = 0
    elif missing == "block":
        sig[SIG_L1_FULL + block] = 0
    else:
        sig[sig_w1_done(sig) + 2 * 1] = 100
    run.poison()
    poisoned = run.outputs()
    t0 = time.perf_counter()
    run.launch(cfg, ring_sync(sig, TIMEOUT_MS))
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    bound = TIMEOUT_MS / 1e3
    assert 0.9 * bound <= dt < 2 * bound, f"{dt * 1e3:.1f} ms for a wait bounded by {TIMEOUT_MS} ms"
    kind, who, expert = {"offs": (KIND_OFFS, 0, None), "block": (KIND_BLOCK, block, 3), "w1": (KIND_W1, 1, 1)}[missing]
    assert sig[SIG_ERR : SIG_ERR + 5].tolist() == [ERR_FAILED, kind, who, 1, 0]
    hq, hsT, out = run.outputs()
    if expert is None:
        for name, a, b in zip(("hq", "hsT", "out"), poisoned, (hq, hsT, out), strict=True):
            assert _bits_equal(a, b), f"{name} written after a failed wait: {first_mismatch(a, b)}"
    else:  # the failed expert's output slots
        lo = int(layout.offsets[expert])
        slots = layout.src_slot[lo : lo + RING_COUNTS[expert]].long()
        assert _bits_equal(out[slots], poisoned[2][slots]), "the failed expert's rows were stored"
