"""Fuzzing the public API with hypothesis: every input either yields what the reference yields, row by row, or
raises ValueError before anything launches — never a crash, a hang or a silently wrong row.

    MoEConfig(...)                        any field values: a config inside every documented limit, or ValueError
    MoELayer.load_weights / .load_mxfp4   any weights: the layer of exactly those values, or ValueError
    MoELayer(...)(x, ids, w), gcmoe.moe   any call: y equal to the oracle row by row, or ValueError

Targets (TARGETS): the reference backend and the sm90 pipeline emulated on torch models of its kernels, on the CPU (CI);
the real sm90 backend on a Hopper GPU (marked sm90: `pytest packages/gcmoe/tests/test_fuzz.py -m sm90`).
Oracles, each on materialised copies of the call's inputs:
    reference       bit for bit moe_reference; and calc_diff <= 1e-5 against the independent fp64 loop where the
                    values stay in range (docs/numerics.md)
    sm90-emulated   bit for bit moe_reference on the kernels' effective weights (effective_weights_sm90: the MXFP4
                    values, except a non-zero 32-group more than 2^14 below its row's largest, which rounds)
    sm90 (GPU)      the same oracle row by row: the same non-finite rows, calc_diff <= 1e-3 on every finite row
Value errors the kernels find on the device (ids out of range, non-finite routing weights) raise at the next call
or at layer.check() on the GPU (README); on the CPU targets before the layer computes anything.

Bad inputs come from catalogues of mutation families (CALL_FAMILIES, WEIGHT_FAMILIES, config field values): each
family turns a valid call or weight set into a bad one with hypothesis-drawn parameters. Every test counts the
distinct bad inputs it saw rejected and asserts that every family was reached, so a fuzzer that silently tests
nothing fails; after each rejection the layer must still give the clean call's output bit for bit.

The NaN contract (docs/numerics.md "Non-finite values"): a NaN or Inf in x[t] makes y[t] NaN and leaves every other
row bit-identical to the call without it; so does a finite x[t] or routing weight large enough to overflow inside
the layer (y[t] then holds whatever the overflow gives).

Runtime: derandomize=True (the same examples every run), deadline None, max_examples sized for < 60 s on a CPU.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gcmoe
from gcmoe_core.config import MAX_EP, MAX_EXPERTS, MAX_INTERMEDIATE, MAX_SLOTS, MAX_TOKENS_PER_RANK, MoEConfig
from gcmoe_core.formats import MXFP4Tensor
from gcmoe_core.reference import MoEWeights, moe_reference, moe_reference_loop_fp64
from gcmoe_core.testing import calc_diff, first_mismatch


def fuzz(max_examples: int):
    return settings(
        max_examples=max_examples,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


# ------------------------------------------------------------------------------------------------------- targets
@dataclass(frozen=True)
class Target:
    name: str
    device: str
    backend: str
    emulate: bool


TARGETS = [
    Target("reference", "cpu", "reference", False),
    Target("sm90-emulated", "cpu", "sm90", True),
    pytest.param(Target("sm90", "cuda", "sm90", False), marks=pytest.mark.sm90, id="sm90"),
]
TARGET_IDS = ["reference", "sm90-emulated", "sm90"]

# the call fuzzers' layers (GPU: two shapes, so the kernels compile for few shapes)
POOL = [
    MoEConfig(256, 128, 8, 2, 1, max_tokens_per_rank=16),
    MoEConfig(512, 256, 16, 4, 0, max_tokens_per_rank=8),
    MoEConfig(256, 128, 1, 1, 2, max_tokens_per_rank=4),  # one routed expert, two shared
    MoEConfig(256, 256, 6, 6, 0, max_tokens_per_rank=24, masked_ids=True),  # top_k = E; id -1 masks a slot
]


def pool_for(target: Target) -> list[MoEConfig]:
    return POOL[:2] if target.device == "cuda" else POOL


WEIGHT_MODES = ("plain", "signs_scales", "lossy_windows")


def float_weights(cfg: MoEConfig, mode: str, seed: int) -> tuple:
    """(w13, w2, shared_w13, shared_w2) fp32 ~ N(0, 1/fan_in), then by mode: every row's sign flipped at random and
    each expert scaled by 2^s, s in [-24, 24] ("signs_scales"); or the 32-groups of every row scaled by 2^0 .. 2^12
    (a row's groups spread over 12+ binades: the sm90 decode's tables cover 14 below the row's largest)."""
    g = torch.Generator().manual_seed(seed)
    h, i, el, s = cfg.hidden_size, cfg.intermediate_size, cfg.local_experts, cfg.num_shared_experts

    def make(n, rows, k):
        if n == 0:
            return None
        w = torch.randn(n, rows, k, generator=g) * k**-0.5
        if mode == "signs_scales":
            sign = torch.randint(0, 2, (n, rows, 1), generator=g) * 2 - 1
            w = w * sign * torch.ldexp(torch.ones(n, 1, 1), torch.randint(-24, 25, (n, 1, 1), generator=g))
        elif mode == "lossy_windows":
            e = torch.randint(0, 13, (n, rows, k // 32, 1), generator=g)
            w = (w.view(n, rows, k // 32, 32) * torch.exp2(e.float())).view(n, rows, k)
        return w

    return make(el, 2 * i, h), make(el, h, i), make(s, 2 * i, h), make(s, h, i)


class ForwardSpy:
    """Stands in for a plan and counts its forward calls (so a test sees whether a call reached the backend)."""

    def __init__(self, plan):
        self.plan, self.calls = plan, 0

    def forward(self, *args):
        self.calls += 1
        return self.plan.forward(*args)

    def __getattr__(self, name):
        return getattr(self.plan, name)


@dataclass
class Built:
    cfg: MoEConfig
    layer: gcmoe.MoELayer
    spy: ForwardSpy
    weights: MoEWeights  # as loaded (MXFP4 or bf16), on the CPU
    oracle_weights: MoEWeights  # what the target's kernels multiply


def _oracle_weights(target: Target, weights: MoEWeights) -> MoEWeights:
    if target.backend == "reference" or weights.quant != "fp8_mxfp4":
        return weights
    from gcmoe_gemm_sm90.prepack import effective_weights_sm90

    return MoEWeights(*(None if w is None else effective_weights_sm90(w) for w in weights.all()))


@functools.cache
def built(target: Target, cfg: MoEConfig, mode: str = "plain", seed: int = 0) -> Built:
    floats = float_weights(cfg, mode, seed)
    layer = gcmoe.MoELayer(cfg, target.device, target.backend, emulate=target.emulate).load_weights(*floats)
    spy = ForwardSpy(layer.packed.plan)
    object.__setattr__(layer.packed, "plan", spy)
    weights = MoEWeights.from_float(*floats, quant=cfg.quant)
    return Built(cfg, layer, spy, weights, _oracle_weights(target, weights))


# --------------------------------------------------------------------------------------------------- valid calls
@dataclass
class Call:
    x: torch.Tensor
    ids: torch.Tensor
    w: torch.Tensor
    in_range: bool  # values the fp64 loop and the fp32 pipeline agree on (no overflow, no fp32 subnormal h)
    desc: str


X_ROWS = ("normal", "scaled", "subnormal", "zero", "constant")
ID_PATTERNS = ("distinct", "duplicates", "one_expert", "masked")
W_PATTERNS = ("softmax", "any_sign", "zeros", "scaled")


@st.composite
def calls(draw, cfg: MoEConfig, device: str, tokens=None) -> Call:
    """A valid call of cfg: T in [0, max] (or `tokens`), x rows of every kind (N(0,1), scaled by 2^[-60, 60], bf16
    subnormals, zeros, constants), ids distinct / with duplicates within a token / all on one expert (/ masked -1
    where the config allows), int32 or int64, routing weights of every sign and scale, x and the routing as views
    into larger buffers (a storage offset) or not."""
    t = draw(st.integers(1 if tokens is None else tokens, cfg.max_tokens_per_rank if tokens is None else tokens))
    h, k, e = cfg.hidden_size, cfg.top_k, cfg.num_experts
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    rows = draw(st.lists(st.sampled_from(X_ROWS), min_size=t, max_size=t))
    exps = draw(st.lists(st.integers(-60, 60), min_size=t, max_size=t))
    x = torch.randn(t, h, generator=g)
    for r, (kind, s) in enumerate(zip(rows, exps)):
        if kind == "scaled":
            x[r] *= 2.0**s
        elif kind == "subnormal":
            x[r] = x[r].sign() * 2.0**-130  # bf16 subnormal
        elif kind == "zero":
            x[r] = 0
        elif kind == "constant":
            x[r] = 2.0 ** (s // 4)
    ids_pat = draw(st.sampled_from(ID_PATTERNS if cfg.masked_ids else ID_PATTERNS[:3]))
    if ids_pat == "distinct" or (ids_pat == "duplicates" and e == 1):
        ids = torch.argsort(torch.rand(t, e, generator=g), dim=1)[:, :k].contiguous()
    elif ids_pat == "one_expert":
        ids = torch.full((t, k), draw(st.integers(0, e - 1)))
    else:
        ids = torch.randint(0, e, (t, k), generator=g)
        if ids_pat == "masked":
            ids[torch.rand(t, k, generator=g) < 0.4] = -1
    ids = ids.to(draw(st.sampled_from([torch.int32, torch.int64])))
    w_pat = draw(st.sampled_from(W_PATTERNS))
    w = torch.softmax(torch.randn(t, k, generator=g), dim=1)
    if w_pat == "any_sign":
        w = torch.randn(t, k, generator=g) * 3
    elif w_pat == "zeros":
        w = torch.where(torch.rand(t, k, generator=g) < 0.5, 0.0, w)
    elif w_pat == "scaled":
        w = w * 2.0 ** draw(st.integers(-40, 40))
    offset = draw(st.booleans())

    def place(a: torch.Tensor) -> torch.Tensor:  # a contiguous view at a storage offset, or a fresh tensor
        return _at_offset(a.to(device), 8 if a.dtype == torch.bfloat16 else 7) if offset else a.to(device)

    big = max((abs(s) for kind, s in zip(rows, exps) if kind == "scaled"), default=0)
    in_range = big <= 20 and "subnormal" not in rows and w_pat != "scaled"
    desc = f"T{t} {ids_pat} {ids.dtype} w:{w_pat} offset:{offset} rows:{','.join(sorted(set(rows)))}"
    return Call(place(x.to(torch.bfloat16)), place(ids), place(w.float()), in_range, desc)


def _at_offset(a: torch.Tensor, off: int) -> torch.Tensor:
    """a's values in a contiguous view `off` elements into a larger buffer."""
    buf = torch.empty(a.numel() + off, dtype=a.dtype, device=a.device)
    buf[off:] = a.flatten()
    return buf[off:].view(a.shape)


def oracle(b: Built, c: Call) -> torch.Tensor:
    cpu = [a.cpu().clone() for a in (c.x, c.ids, c.w)]
    return moe_reference(*cpu, b.oracle_weights, quant=b.cfg.quant)


def check_rows(target: Target, y: torch.Tensor, want: torch.Tensor, desc: str) -> None:
    """y against its oracle: bit for bit (CPU targets); on the GPU the same non-finite rows and calc_diff <= 1e-3 on
    every finite row."""
    y = y.cpu()
    assert y.dtype == torch.bfloat16 and y.shape == want.shape, (desc, y.dtype, tuple(y.shape))
    if target.device == "cpu":
        assert first_mismatch(y, want) == "", (desc, first_mismatch(y, want))
        return
    bad_y, bad_w = ~torch.isfinite(y).all(1), ~torch.isfinite(want).all(1)
    assert torch.equal(bad_y, bad_w), (desc, bad_y.nonzero().flatten().tolist(), bad_w.nonzero().flatten().tolist())
    for r in (~bad_w).nonzero().flatten().tolist():
        assert calc_diff(y[r], want[r]) <= 1e-3, (desc, r, calc_diff(y[r], want[r]))


def call_layer(b: Built, c: Call, functional: bool = False) -> torch.Tensor:
    if functional:
        return gcmoe.moe(c.x, c.ids, c.w, b.layer.packed)
    return b.layer(c.x, c.ids, c.w)


@pytest.mark.parametrize("target", TARGETS, ids=TARGET_IDS)
def test_valid_calls_match_the_oracle_row_by_row(target):
    seen = set()

    @fuzz(40)
    @given(data=st.data())
    def prop(data):
        cfg = data.draw(st.sampled_from(pool_for(target)))
        mode = data.draw(st.sampled_from(WEIGHT_MODES))
        b = built(target, cfg, mode, 0)
        c = data.draw(calls(cfg, target.device))
        functional = data.draw(st.booleans())
        y = call_layer(b, c, functional)
        check_rows(target, y, oracle(b, c), c.desc)
        if target.backend == "reference" and c.in_range and mode != "lossy_windows":
            ref64 = moe_reference_loop_fp64(*(a.cpu() for a in (c.x, c.ids, c.w)), b.weights)
            assert calc_diff(y.cpu(), ref64) <= 1e-5, (c.desc, calc_diff(y.cpu(), ref64))
        seen.add((cfg, mode, c.desc))

    prop()
    assert len(seen) >= 20, f"only {len(seen)} distinct valid calls exercised"


def test_zero_tokens_give_an_empty_output():
    for target in (TARGETS[0], TARGETS[1]):
        for cfg in POOL:
            b = built(target, cfg)
            x = torch.empty(0, cfg.hidden_size, dtype=torch.bfloat16)
            ids, w = torch.empty(0, cfg.top_k, dtype=torch.int32), torch.empty(0, cfg.top_k)
            y = b.layer(x, ids, w)
            assert y.dtype == torch.bfloat16 and tuple(y.shape) == (0, cfg.hidden_size)


@st.composite
def shapes(draw) -> MoEConfig:
    e = draw(st.integers(1, 12))
    k = draw(st.integers(1, min(e, 6)))
    return MoEConfig(
        draw(st.sampled_from([256, 512])),
        draw(st.sampled_from([128, 256])),
        e,
        k,
        draw(st.integers(0, min(2, MAX_SLOTS - k))),
        max_tokens_per_rank=draw(st.integers(1, 12)),
    )


@pytest.mark.parametrize("target", TARGETS[:2], ids=TARGET_IDS[:2])
def test_any_small_shape_matches_the_oracle(target):
    """H, I, E, k, S and T_max drawn: a fresh layer per shape, one call at T = max and one at T = 1."""
    seen = set()

    @fuzz(14)
    @given(cfg=shapes(), data=st.data())
    def prop(cfg, data):
        b = built(target, cfg)
        for t in (cfg.max_tokens_per_rank, 1):
            c = data.draw(calls(cfg, target.device, tokens=t))
            check_rows(target, call_layer(b, c), oracle(b, c), f"{cfg} {c.desc}")
        seen.add(cfg)

    prop()
    assert len(seen) >= 10


# ------------------------------------------------------------------------------------------------ the NaN contract
POISONS = ("nan", "+inf", "-inf", "huge_x", "huge_weight")


@pytest.mark.parametrize("target", TARGETS, ids=TARGET_IDS)
def test_a_non_finite_token_affects_its_own_row_only(target):
    """docs/numerics.md: every other row bit-identical to the call without the poison; y[t] NaN for NaN / Inf."""
    seen = set()

    @fuzz(8)
    @given(data=st.data())
    def prop(kind, data):
        cfg = data.draw(st.sampled_from(pool_for(target)))
        b = built(target, cfg)
        c = data.draw(calls(cfg, target.device))
        t = data.draw(st.integers(0, c.x.shape[0] - 1))
        cols = data.draw(st.lists(st.integers(0, cfg.hidden_size - 1), min_size=1, max_size=3, unique=True))
        x, w = c.x.clone(), c.w.clone()
        if kind == "huge_weight":
            w[t, data.draw(st.integers(0, cfg.top_k - 1))] = 3.0e38
        elif kind == "huge_x":
            x[t, cols] = torch.tensor(3.0e38, dtype=torch.bfloat16).to(x.device)
        else:
            x[t, cols] = {"nan": float("nan"), "+inf": float("inf"), "-inf": float("-inf")}[kind]
        clean, poisoned = b.layer(c.x, c.ids, c.w), b.layer(x, c.ids, w)
        others = torch.arange(c.x.shape[0], device=x.device) != t
        assert first_mismatch(poisoned[others], clean[others]) == "", (kind, c.desc)
        if kind in ("nan", "+inf", "-inf"):
            assert bool(poisoned[t].isnan().all()), (kind, c.desc, poisoned[t, :4])
        seen.add((kind, c.desc, t))

    for kind in POISONS:  # (each kind its own run: every one is reached)
        prop(kind)
    assert {k for k, *_ in seen} == set(POISONS) and len(seen) >= 30


# --------------------------------------------------------------------------------------------------- bad calls
@dataclass(frozen=True)
class Family:
    """One kind of bad call argument. make(data, cfg, x, ids, w) -> (x, ids, w, detail); value: only the device's
    value checks can see it (the GPU raises it at the next call or at check())."""

    name: str
    make: Callable
    value: bool = False
    min_tokens: int = 1


def _not_tensor(a: torch.Tensor, how: str):
    return {"list": a.tolist, "numpy": lambda: a.cpu().float().numpy(), "none": lambda: None, "float": lambda: 1.0}[
        how
    ]()


def _noncontiguous(a: torch.Tensor, how: str) -> torch.Tensor:
    """A view with a's shape and values that is not contiguous: transposed, strided, or broadcast from one row."""
    out = {"transposed": lambda: a.t().contiguous().t(), "broadcast": lambda: a[:1].expand_as(a)}.get(how, lambda: a)()
    # (a transposed [T, 1] is contiguous: strided then; T >= 2 makes the broadcast and the strided view non-contiguous)
    return out if not out.is_contiguous() else torch.stack((a, a), dim=-1)[..., 0]


def _reshaped(a: torch.Tensor, how: str) -> torch.Tensor:
    _t, n = a.shape
    return {
        "1d": a.reshape(-1),
        "3d": a[None],
        "rows+1": torch.cat((a, a[:1])),
        "cols+1": torch.cat((a, a[:, :1]), 1),
        "cols-1": a[:, : n - 1].contiguous(),
        "cols*2": torch.cat((a, a), 1),
    }[how]


def _on_meta(a: torch.Tensor, _how) -> torch.Tensor:
    return a.to("meta")


def _misaligned(a: torch.Tensor, off: int) -> torch.Tensor:
    return _at_offset(a, off)  # (bf16 x at an odd element offset: not 4-byte aligned)


def _neg_view(a: torch.Tensor, _how) -> torch.Tensor:
    return torch._neg_view(-a)  # the same values, lazily negated


def _arg_family(arg: int, name: str, fn: Callable, params, min_tokens: int = 1) -> Family:
    def make(data, cfg, *args):
        how = data.draw(st.sampled_from(params), label=name)
        out = list(args)
        out[arg] = fn(args[arg], how)
        return (*out, str(how))

    return Family(name, make, min_tokens=min_tokens)


def _dtype(a: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return a.to(torch.complex64) if dtype.is_complex else a.to(dtype)


def _bad_id_values(cfg: MoEConfig, int64: bool) -> list[int]:
    e = cfg.num_experts
    vals = [e, e + 1, e + 1000, 2**31 - 1, -2, -e - 1, -(2**31)] + ([] if cfg.masked_ids else [-1])
    return vals + ([2**31, 2**32 + 1, 2**40, -(2**63), 2**32 - 1] if int64 else [])


def _bad_id(data, cfg, x, ids, w):
    int64 = data.draw(st.booleans())
    v = data.draw(st.sampled_from(_bad_id_values(cfg, int64)))
    ids = ids.to(torch.int64 if int64 else torch.int32).clone()
    t, j = data.draw(st.integers(0, ids.shape[0] - 1)), data.draw(st.integers(0, cfg.top_k - 1))
    ids[t, j] = v
    return x, ids, w, f"{ids.dtype}:{v}@{t},{j}"


def _bad_weight(data, cfg, x, ids, w):
    v = data.draw(st.sampled_from([float("nan"), float("inf"), float("-inf")]))
    w = w.clone()
    t, j = data.draw(st.integers(0, w.shape[0] - 1)), data.draw(st.integers(0, cfg.top_k - 1))
    w[t, j] = v
    return x, ids, w, f"{v}@{t},{j}"


def _too_many_tokens(data, cfg, x, ids, w):
    t = data.draw(st.sampled_from([1, 2, cfg.max_tokens_per_rank, MAX_TOKENS_PER_RANK])) + cfg.max_tokens_per_rank
    rep = -(-t // x.shape[0])
    return x.repeat(rep, 1)[:t], ids.repeat(rep, 1)[:t], w.repeat(rep, 1)[:t], str(t)


X, IDS, W = 0, 1, 2
FLOATS = [torch.float32, torch.float16, torch.float64, torch.float8_e4m3fn, torch.complex64]
INTS = [torch.int8, torch.int16, torch.uint8, torch.bool]
NOT_TENSORS = ["list", "numpy", "none", "float"]
LAYOUTS = ["transposed", "strided", "broadcast"]
CALL_FAMILIES = [
    _arg_family(X, "x.dtype", _dtype, FLOATS[:4] + INTS + [torch.complex64, torch.int32]),
    _arg_family(X, "x.type", _not_tensor, NOT_TENSORS),
    _arg_family(X, "x.shape", _reshaped, ["1d", "3d", "cols+1", "cols-1", "cols*2"]),
    Family("x.tokens", _too_many_tokens),
    _arg_family(X, "x.layout", _noncontiguous, LAYOUTS, min_tokens=2),
    _arg_family(X, "x.device", _on_meta, ["meta"]),
    _arg_family(X, "x.neg_view", _neg_view, ["neg"]),
    _arg_family(X, "x.misaligned", _misaligned, [1, 3, 5, 7]),
    _arg_family(IDS, "ids.dtype", _dtype, [*INTS, torch.float32, torch.float64, torch.float16]),
    _arg_family(IDS, "ids.type", _not_tensor, NOT_TENSORS),
    _arg_family(IDS, "ids.shape", _reshaped, ["1d", "3d", "rows+1", "cols+1", "cols*2"]),
    _arg_family(IDS, "ids.layout", _noncontiguous, LAYOUTS, min_tokens=2),
    _arg_family(IDS, "ids.device", _on_meta, ["meta"]),
    Family("ids.value", _bad_id, value=True),
    _arg_family(W, "w.dtype", _dtype, [torch.bfloat16, torch.float16, torch.float64, torch.int32, torch.int64]),
    _arg_family(W, "w.type", _not_tensor, NOT_TENSORS),
    _arg_family(W, "w.shape", _reshaped, ["1d", "3d", "rows+1", "cols+1", "cols*2"]),
    _arg_family(W, "w.layout", _noncontiguous, LAYOUTS, min_tokens=2),
    _arg_family(W, "w.device", _on_meta, ["meta"]),
    _arg_family(W, "w.neg_view", _neg_view, ["neg"]),
    Family("w.value", _bad_weight, value=True),
]


@pytest.mark.parametrize("target", TARGETS, ids=TARGET_IDS)
def test_bad_calls_raise_value_error_before_launch(target):
    distinct, families = set(), set()

    @fuzz(9)
    @given(data=st.data())
    def prop(fam, data):
        cfg = data.draw(st.sampled_from(pool_for(target)))
        if fam.min_tokens > cfg.max_tokens_per_rank:
            return
        b = built(target, cfg)
        c = data.draw(calls(cfg, target.device))
        if c.x.shape[0] < fam.min_tokens:
            return
        x, ids, w, detail = fam.make(data, cfg, c.x, c.ids, c.w)
        functional = data.draw(st.booleans())
        before = b.spy.calls
        with pytest.raises(ValueError, match="gcmoe: "):
            call_layer(b, Call(x, ids, w, False, ""), functional)
            b.layer.check()  # (the GPU reports device-found values here)
        if not (fam.value and target.device == "cuda"):
            assert b.spy.calls == before + fam.value, f"{fam.name}: the backend ran on a bad call"
        check_rows(target, b.layer(c.x, c.ids, c.w), oracle(b, c), f"after {fam.name} {detail}")
        families.add(fam.name)
        distinct.add((fam.name, detail, cfg, functional))

    for fam in CALL_FAMILIES:  # (each family its own run: every one is reached)
        prop(fam)
    assert families == {f.name for f in CALL_FAMILIES}, {f.name for f in CALL_FAMILIES} - families
    assert len(distinct) >= 100, f"only {len(distinct)} distinct bad calls exercised"


def test_functional_call_needs_a_packed_layer():
    b = built(TARGETS[0], POOL[0])
    x = torch.randn(2, POOL[0].hidden_size).to(torch.bfloat16)
    ids, w = torch.zeros(2, POOL[0].top_k, dtype=torch.int32), torch.ones(2, POOL[0].top_k)
    for packed in (None, b.layer, b.weights, POOL[0], "layer"):
        with pytest.raises(ValueError, match="gcmoe: packed: must be a PackedMoE"):
            gcmoe.moe(x, ids, w, packed)


# ------------------------------------------------------------------------------------------------- bad weights
WEIGHT_CFG = POOL[0]  # (shared experts: every weight tensor present)
NAMES = ("w13", "w2", "shared_w13", "shared_w2")


def _weight_family(name: str, fn: Callable, params) -> Family:
    """fn(weights tuple, index of the tensor, param, data) -> (new weights tuple, cfg) for load_weights."""

    def make(data, cfg, floats):
        idx = data.draw(st.integers(0, 3))
        how = data.draw(st.sampled_from(params), label=name)
        out, cfg = fn(list(floats), idx, how, data, cfg)
        return out, cfg, f"{NAMES[idx]}:{how}"

    return Family(name, make)


def _w_dtype(ws, i, dtype, data, cfg):
    ws[i] = _dtype(ws[i], dtype)
    return ws, cfg


def _w_type(ws, i, how, data, cfg):
    ws[i] = _not_tensor(ws[i], how)
    return ws, cfg


def _w_shape(ws, i, how, data, cfg):
    w = ws[i]
    ws[i] = {"experts-1": w[1:], "rows+1": torch.cat((w, w[:, :1]), 1), "cols+32": torch.cat((w, w[..., :32]), 2)}.get(
        how, w[0]
    )
    return ws, cfg


def _w_value(ws, i, v, data, cfg):
    w = ws[i].clone()
    w.view(-1)[data.draw(st.integers(0, w.numel() - 1))] = v
    ws[i] = w
    return ws, cfg


def _w_layout(ws, i, how, data, cfg):
    ws[i] = ws[i].transpose(1, 2).contiguous().transpose(1, 2) if how == "transposed" else ws[i][:, ::2].repeat(1, 2, 1)
    if ws[i].is_contiguous():
        ws[i] = torch.stack((ws[i], ws[i]), -1)[..., 0]
    return ws, cfg


def _w_meta(ws, i, how, data, cfg):
    ws[i] = ws[i].to("meta")
    return ws, cfg


def _w_shared(ws, i, how, data, cfg):
    if how == "pair":  # one of the two shared tensors alone
        ws[2 + i % 2] = None
    elif how == "missing":
        ws[2] = ws[3] = None
    else:  # given to a layer without shared experts
        cfg = cfg.replace(num_shared_experts=0)
    return ws, cfg


WEIGHT_FAMILIES = [
    _weight_family("weights.dtype", _w_dtype, [torch.float64, torch.int32, torch.uint8, torch.bool, torch.complex64]),
    _weight_family("weights.type", _w_type, NOT_TENSORS),
    _weight_family("weights.shape", _w_shape, ["experts-1", "rows+1", "cols+32", "2d"]),
    _weight_family("weights.value", _w_value, [float("nan"), float("inf"), float("-inf")]),
    _weight_family("weights.layout", _w_layout, ["transposed", "strided"]),
    _weight_family("weights.device", _w_meta, ["meta"]),
    _weight_family("weights.shared", _w_shared, ["pair", "missing", "extra"]),
]


def _mx_family(name: str, fn: Callable, params) -> Family:
    """fn(MoEWeights, index, param, data) -> the four arguments of load_mxfp4 (their construction may raise too)."""

    def make(data, cfg, weights):
        idx = data.draw(st.integers(0, 3))
        how = data.draw(st.sampled_from(params), label=name)
        return (lambda: fn(list(weights.all()), idx, how, data)), f"{NAMES[idx]}:{how}"

    return Family(name, make)


def _mx_scale_nan(ws, i, how, data):
    scale = ws[i].scale.clone()
    scale.view(-1)[data.draw(st.integers(0, scale.numel() - 1))] = 0xFF
    ws[i] = MXFP4Tensor(ws[i].packed, scale)
    return ws


def _mx_plain(ws, i, how, data):
    ws[i] = {"dequantized": ws[i].dequantize(), "none": None, "packed": ws[i].packed}[how]
    return ws


def _mx_bytes(ws, i, how, data):
    packed, scale = ws[i].packed, ws[i].scale
    if how == "packed-int8":
        packed = packed.view(torch.int8)
    elif how == "scale-int32":
        scale = scale.int()
    else:  # the scale of another K
        scale = scale[..., :-1]
    ws[i] = MXFP4Tensor(packed, scale)
    return ws


def _mx_shape(ws, i, how, data):
    ws[i] = ws[i][1:] if how == "experts-1" else MXFP4Tensor(ws[i].packed[:, 1:], ws[i].scale[:, 1:])
    return ws


def _mx_meta(ws, i, how, data):
    ws[i] = ws[i].to("meta")
    return ws


MXFP4_FAMILIES = [
    _mx_family("mxfp4.scale_nan", _mx_scale_nan, ["0xFF"]),
    _mx_family("mxfp4.type", _mx_plain, ["dequantized", "none", "packed"]),
    _mx_family("mxfp4.bytes", _mx_bytes, ["packed-int8", "scale-int32", "scale-k"]),
    _mx_family("mxfp4.shape", _mx_shape, ["experts-1", "rows-1"]),
    _mx_family("mxfp4.device", _mx_meta, ["meta"]),
]


@pytest.mark.parametrize("target", TARGETS, ids=TARGET_IDS)
def test_bad_weights_raise_value_error_at_load(target):
    distinct = set()
    floats = float_weights(WEIGHT_CFG, "plain", 1)
    weights = MoEWeights.from_float(*floats)
    b = built(target, WEIGHT_CFG)

    @fuzz(6)
    @given(data=st.data())
    def bad_floats(fam, data):
        ws, cfg, detail = fam.make(data, WEIGHT_CFG, floats)
        layer = gcmoe.MoELayer(cfg, target.device, target.backend, emulate=target.emulate)
        with pytest.raises(ValueError, match="gcmoe: "):
            layer.load_weights(*ws)
        assert layer.packed is None
        distinct.add((fam.name, detail))

    @fuzz(6)
    @given(data=st.data())
    def bad_mxfp4(fam, data):
        args, detail = fam.make(data, WEIGHT_CFG, weights)
        layer = gcmoe.MoELayer(WEIGHT_CFG, target.device, target.backend, emulate=target.emulate)
        with pytest.raises(ValueError):
            layer.load_mxfp4(*args())
        assert layer.packed is None
        distinct.add((fam.name, detail))

    for fam in WEIGHT_FAMILIES:
        bad_floats(fam)
    for fam in MXFP4_FAMILIES:
        bad_mxfp4(fam)
    with pytest.raises(ValueError, match="MXFP4 weights need quant='fp8_mxfp4'"):
        bf16 = WEIGHT_CFG.replace(quant="bf16")
        gcmoe.MoELayer(bf16, "cpu", "reference").load_mxfp4(*weights.all())  # (a host check, the same everywhere)
    with pytest.raises(ValueError, match="gcmoe: device: a layer on the meta device"):
        gcmoe.MoELayer(WEIGHT_CFG, "meta", "reference").load_weights(*floats)
    assert {n for n, _ in distinct} == {f.name for f in WEIGHT_FAMILIES + MXFP4_FAMILIES}
    assert len(distinct) >= 40, f"only {len(distinct)} distinct bad weight sets exercised"
    assert b.layer.packed is not None  # (the cached layer is untouched)


@pytest.mark.parametrize("target", TARGETS, ids=TARGET_IDS)
def test_any_mxfp4_weights_load_as_they_are(target):
    """Random MXFP4 tensors (every code, scale bytes over [lo, hi], packed given as a non-contiguous view or not):
    load_mxfp4 gives the layer of exactly those values (the oracle on them; the sm90 one on its effective ones)."""
    from gcmoe_core.formats import random_mxfp4

    cfg = WEIGHT_CFG

    @fuzz(6)
    @given(seed=st.integers(0, 2**32 - 1), lo=st.integers(0, 127), span=st.integers(0, 40), strided=st.booleans())
    def prop(seed, lo, span, strided):
        g = torch.Generator().manual_seed(seed)
        h, i, e, s = cfg.hidden_size, cfg.intermediate_size, cfg.local_experts, cfg.num_shared_experts

        def mx(n, rows, k):
            w = random_mxfp4((n, rows, k), g)
            scale = torch.randint(lo, min(lo + span, 254) + 1, w.scale.shape, generator=g, dtype=torch.uint8)
            packed = torch.stack((w.packed, w.packed), -1)[..., 0] if strided else w.packed
            return MXFP4Tensor(packed, scale)

        ws = (mx(e, 2 * i, h), mx(e, h, i), mx(s, 2 * i, h), mx(s, h, i))
        layer = gcmoe.MoELayer(cfg, target.device, target.backend, emulate=target.emulate).load_mxfp4(*ws)
        b = Built(cfg, layer, ForwardSpy(layer.packed.plan), MoEWeights(*ws), _oracle_weights(target, MoEWeights(*ws)))
        x = (torch.randn(5, h, generator=g) * 2.0 ** ((127 - lo) // 4)).to(torch.bfloat16)
        ids = torch.randint(0, cfg.num_experts, (5, cfg.top_k), generator=g, dtype=torch.int32)
        w = torch.rand(5, cfg.top_k, generator=g)
        call = Call(x.to(target.device), ids.to(target.device), w.to(target.device), False, f"lo{lo} span{span}")
        check_rows(target, call_layer(b, call), oracle(b, call), call.desc)

    prop()


# ------------------------------------------------------------------------------------------------------ configs
FIELDS = ("hidden_size", "intermediate_size", "num_experts", "top_k", "num_shared_experts", "ep_size")
JUNK = [None, "256", 256.0, True, np.int64(4), -1, 0, [1]]


def within_limits(c: MoEConfig) -> bool:
    """The README's limits, restated (I counts padded to the kernels' multiple of 128)."""
    ints = all(isinstance(getattr(c, f), int) and not isinstance(getattr(c, f), bool) for f in FIELDS)
    pos = ints and min(getattr(c, f) for f in FIELDS if f != "num_shared_experts") >= 1 and c.num_shared_experts >= 0
    return (
        pos
        and -(-c.intermediate_size // 128) * 128 <= MAX_INTERMEDIATE
        and c.top_k + c.num_shared_experts <= MAX_SLOTS
        and c.top_k <= c.num_experts <= MAX_EXPERTS
        and c.ep_size <= MAX_EP
        and c.num_experts % c.ep_size == 0
        and 1 <= c.max_tokens_per_rank <= MAX_TOKENS_PER_RANK
        and c.quant in ("fp8_mxfp4", "bf16")
    )


def test_any_config_is_within_the_limits_or_rejected():
    outcomes = set()

    def field(lo, hi, top):  # mostly in the plausible range [lo, hi], else anywhere up to top, else junk
        return st.one_of(st.integers(lo, hi), st.integers(-2, top), st.sampled_from(JUNK))

    @fuzz(400)
    @given(
        h=field(256, 8192, 9000),
        i=field(128, 4096, 5000),
        e=field(8, 64, 2100),
        k=field(1, 8, 40),
        s=field(0, 2, 33),
        p=field(1, 2, 80),
        t=field(1, 512, 4200),
        quant=st.sampled_from(["fp8_mxfp4", "bf16", "fp4", None]),
    )
    def prop(h, i, e, k, s, p, t, quant):
        try:
            cfg = MoEConfig(h, i, e, k, s, p, max_tokens_per_rank=t, quant=quant)
        except ValueError as err:
            assert str(err).startswith("gcmoe: "), err
            outcomes.add("rejected")
            return
        assert within_limits(cfg), cfg
        outcomes.add("accepted")

    prop()

    @fuzz(200)
    @given(
        h=st.integers(1, 40).map(lambda n: 256 * n),
        i=st.integers(1, 32).map(lambda n: 128 * n),
        e=st.integers(1, MAX_EXPERTS),
        k=st.integers(1, MAX_SLOTS),
        s=st.integers(0, MAX_SLOTS),
        p=st.integers(1, MAX_EP),
        t=st.integers(1, MAX_TOKENS_PER_RANK),
    )
    def no_spurious_rejection(h, i, e, k, s, p, t):
        cfg = MoEConfig.__new__(MoEConfig)
        for name, v in zip((*FIELDS, "max_tokens_per_rank", "quant"), (h, i, e, k, s, p, t, "fp8_mxfp4")):
            object.__setattr__(cfg, name, v)
        if within_limits(cfg):
            MoEConfig(h, i, e, k, s, p, max_tokens_per_rank=t)  # must not raise
            outcomes.add("limits-accepted")

    no_spurious_rejection()
    assert outcomes == {"rejected", "accepted", "limits-accepted"}, outcomes
