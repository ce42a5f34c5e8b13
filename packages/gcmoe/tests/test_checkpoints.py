"""Checkpoint loaders (gcmoe.checkpoints) against fixtures written here in each published layout.

Each fixture starts from logical experts drawn at random (gate rows, up rows, down; fp64 values the test knows),
is written in exactly the published names, dtypes and shapes with safetensors (the gpt-oss layout packed and
interleaved by an encoder written here from the public description, the FP8 one with non-power-of-two 128×128
block scales), next to distractors (attention weights, layer 11's experts) and split into shard files. The loaded
MoEWeights are compared bit-exactly with the values expected from the logical experts, and the loaded layer's
output with the reference evaluated on those values.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import gcmoe
from gcmoe.checkpoints import MoECheckpointInfo, dequantize_fp8_block128x128, load_moe_layer, load_moe_layer_weights
from gcmoe_core.formats import MXFP4Tensor, quantize_mxfp4
from gcmoe_core.reference import Activation, MoEWeights, moe_reference, moe_reference_loop_fp64
from gcmoe_core.testing import calc_diff, first_mismatch, make_tokens

LAYER = 1
H, I = 256, 128  # noqa: E741
FP4_TABLE = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


@dataclass
class Published:
    """A checkpoint's tensors by name, and the logical fp64 weights it must load as (gate rows then up rows)."""

    tensors: dict[str, torch.Tensor]
    w13: torch.Tensor  # fp64 [E, 2I, H]
    w2: torch.Tensor  # fp64 [E, H, I]
    shared_w13: torch.Tensor | None = None
    shared_w2: torch.Tensor | None = None
    w13_bias: torch.Tensor | None = None
    w2_bias: torch.Tensor | None = None
    mxfp4: tuple | None = None  # gpt-oss: the logical (w13, w2) MXFP4Tensors the bytes must carry over to
    extra: dict[str, torch.Tensor] = field(default_factory=dict)


def _name(layer: int, rest: str) -> str:
    return f"model.layers.{layer}.mlp.{rest}"


# ---------------------------------------------------------------------------------------- gpt-oss (fused MXFP4)
def _gpt_oss_pack(codes: torch.Tensor) -> torch.Tensor:
    """[..., N, K] E2M1 codes -> the published blocks [..., N, K/32, 16]: element 2j low nibble, 2j+1 high."""
    byte = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return byte.reshape(*codes.shape[:-1], codes.shape[-1] // 32, 16)


def _gpt_oss_decode(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Logical codes [..., K] + UE8M0 [..., K/32] -> fp64 values (table value × 2^(b − 127))."""
    v = torch.tensor(FP4_TABLE, dtype=torch.float64)[codes.long()]
    return v * torch.pow(2.0, scales.double() - 127).repeat_interleave(32, dim=-1)


def _interleave(gate_then_up: torch.Tensor, i: int) -> torch.Tensor:
    """[E, 2I, ...] gate rows then up rows -> the published order: row 2j = gate j, row 2j+1 = up j."""
    e = gate_then_up.shape[0]
    pairs = torch.stack((gate_then_up[:, :i], gate_then_up[:, i:]), dim=2)
    return pairs.reshape(e, 2 * i, *gate_then_up.shape[2:])


def gpt_oss_layer(g: torch.Generator, layer: int, e: int, bias: bool = True) -> Published:
    codes13 = torch.randint(0, 16, (e, 2 * I, H), generator=g, dtype=torch.uint8)
    codes2 = torch.randint(0, 16, (e, H, I), generator=g, dtype=torch.uint8)
    sc13 = torch.randint(117, 124, (e, 2 * I, H // 32), generator=g, dtype=torch.uint8)
    sc2 = torch.randint(117, 124, (e, H, I // 32), generator=g, dtype=torch.uint8)
    t = {
        _name(layer, "experts.gate_up_proj_blocks"): _gpt_oss_pack(_interleave(codes13, I)),
        _name(layer, "experts.gate_up_proj_scales"): _interleave(sc13, I),
        _name(layer, "experts.down_proj_blocks"): _gpt_oss_pack(codes2),
        _name(layer, "experts.down_proj_scales"): sc2,
    }
    pub = Published(t, _gpt_oss_decode(codes13, sc13), _gpt_oss_decode(codes2, sc2))
    ours = (codes13[..., 0::2] | (codes13[..., 1::2] << 4), sc13), (codes2[..., 0::2] | (codes2[..., 1::2] << 4), sc2)
    pub.mxfp4 = tuple(MXFP4Tensor(*p) for p in ours)
    if bias:
        b13 = (torch.randn(e, 2 * I, generator=g) * 0.1).to(torch.bfloat16)
        b2 = (torch.randn(e, H, generator=g) * 0.1).to(torch.bfloat16)
        t[_name(layer, "experts.gate_up_proj_bias")] = _interleave(b13, I)
        t[_name(layer, "experts.down_proj_bias")] = b2
        pub.w13_bias, pub.w2_bias = b13.double(), b2.double()
    return pub


# ------------------------------------------------------------------------------ per-expert (DeepSeek FP8, HF bf16)
def _fp8_block(g: torch.Generator, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn [n, k], fp32 scale_inv [ceil(n/128), ceil(k/128)] (not powers of two), fp64 value)."""
    q = (torch.randn(n, k, generator=g) * 8).to(torch.float8_e4m3fn)
    s = (torch.rand(math.ceil(n / 128), math.ceil(k / 128), generator=g) + 0.5) * 2.0**-8
    return q, s, _fp8_dequant_fp64(q, s)


def _fp8_dequant_fp64(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The published formula, block by block in fp64: (128×128 weight block) · its scale_inv."""
    out = q.double()
    for bi in range(s.shape[0]):
        for bj in range(s.shape[1]):
            out[bi * 128 : (bi + 1) * 128, bj * 128 : (bj + 1) * 128] *= float(s[bi, bj])
    return out


def _matrix(g, fmt: str, name: str, n: int, k: int, t: dict) -> torch.Tensor:
    """Write one [n, k] projection under `name` in the layout; return its fp64 value."""
    if fmt == "deepseek_fp8":
        q, s, v = _fp8_block(g, n, k)
        t[name + ".weight"], t[name + ".weight_scale_inv"] = q, s
        return v
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(torch.bfloat16)
    t[name + ".weight"] = w
    return w.double()


def per_expert_layer(g: torch.Generator, fmt: str, layer: int, e: int, shared: int) -> Published:
    t: dict[str, torch.Tensor] = {}

    def mlp(prefix: str, n_i: int) -> tuple[torch.Tensor, torch.Tensor]:
        gate = _matrix(g, fmt, prefix + "gate_proj", n_i, H, t)
        up = _matrix(g, fmt, prefix + "up_proj", n_i, H, t)
        return torch.cat((gate, up)), _matrix(g, fmt, prefix + "down_proj", H, n_i, t)

    experts = [mlp(_name(layer, f"experts.{j}."), I) for j in range(e)]
    pub = Published(t, torch.stack([a for a, _ in experts]), torch.stack([b for _, b in experts]))
    if shared:
        gu, down = mlp(_name(layer, "shared_experts."), shared * I)
        gate, up = gu[: shared * I], gu[shared * I :]
        pub.shared_w13 = torch.stack(
            [torch.cat((gate[s * I : (s + 1) * I], up[s * I : (s + 1) * I])) for s in range(shared)]
        )
        pub.shared_w2 = torch.stack([down[:, s * I : (s + 1) * I] for s in range(shared)])
    return pub


def make_layer(fmt: str, e: int, shared: int, seed: int, layer: int = LAYER) -> Published:
    g = torch.Generator().manual_seed(seed)
    if fmt == "gpt_oss_mxfp4":
        return gpt_oss_layer(g, layer, e)
    return per_expert_layer(g, fmt, layer, e, shared)


# ------------------------------------------------------------------------------------------------------- writing
def publish(tmp_path: Path, tensors: dict[str, torch.Tensor], storage: str, config: dict | None = None):
    """Write tensors as a checkpoint; return what the loader is given. storage: 'file' (one file, its path),
    'dir' (2 shards, the directory), 'files' (2 shards, their paths), 'index' (2 shards + index json, the dir)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    if storage == "file":
        save_file({n: tensors[n].contiguous() for n in names}, tmp_path / "model.safetensors")
        return tmp_path / "model.safetensors"
    files = [f"model-0000{s + 1}-of-00002.safetensors" for s in range(2)]
    shard_of = {n: files[j % 2] for j, n in enumerate(names)}
    for f in files:
        save_file({n: tensors[n].contiguous() for n in names if shard_of[n] == f}, tmp_path / f)
    if config is not None:
        (tmp_path / "config.json").write_text(json.dumps(config))
    if storage == "index":
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": shard_of}
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
        return tmp_path
    return tmp_path if storage == "dir" else [tmp_path / f for f in files]


def distractors(fmt: str, e: int, seed: int) -> dict[str, torch.Tensor]:
    """Tensors a real checkpoint has next to the layer: attention weights, and layer 11 (a name that starts like
    layer 1's) with more experts."""
    other = make_layer(fmt, e + 2, 1, seed + 1000, layer=11).tensors
    return {f"model.layers.{LAYER}.self_attn.q_proj.weight": torch.randn(H, H).to(torch.bfloat16), **other}


# ------------------------------------------------------------------------------------------------------ expected
def expected_weights(pub: Published, quant: str, rows: slice = slice(None)) -> MoEWeights:
    """What the loader must produce, built from the logical values by the operator's own conversions."""
    if pub.mxfp4 is not None:  # gpt-oss: the published bytes, moved, never re-quantised
        w13, w2 = (w[rows] for w in pub.mxfp4)
        if quant == "bf16":
            w13, w2 = pub.w13[rows].to(torch.bfloat16), pub.w2[rows].to(torch.bfloat16)
        biases = [None if b is None else b[rows].float() for b in (pub.w13_bias, pub.w2_bias)]
        return MoEWeights(w13, w2, None, None, *biases)
    parts = [pub.w13[rows], pub.w2[rows], pub.shared_w13, pub.shared_w2]
    conv = (lambda w: quantize_mxfp4(w.float())) if quant == "fp8_mxfp4" else (lambda w: w.float().bfloat16())

    def stacked(w):
        if w is None:
            return None
        ws = [conv(x) for x in w]
        if quant == "fp8_mxfp4":
            return MXFP4Tensor(torch.stack([x.packed for x in ws]), torch.stack([x.scale for x in ws]))
        return torch.stack(ws)

    return MoEWeights(*(stacked(w) for w in parts))


def assert_same_weights(got: MoEWeights, want: MoEWeights) -> None:
    for name in ("w13", "w2", "shared_w13", "shared_w2", "w13_bias", "w2_bias"):
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None) == (b is None), name
        if a is None:
            continue
        assert type(a) is type(b), name
        pairs = [(a.packed, b.packed), (a.scale, b.scale)] if isinstance(a, MXFP4Tensor) else [(a, b)]
        for x, y in pairs:
            assert not (msg := first_mismatch(x, y)), f"{name}: {msg}"


def reference_weights(pub: Published, quant: str) -> MoEWeights:
    """The values the checkpoint publishes, converted by the operator's own MoEWeights.from_float."""
    return MoEWeights.from_float(
        pub.w13, pub.w2, pub.shared_w13, pub.shared_w2, quant=quant, w13_bias=pub.w13_bias, w2_bias=pub.w2_bias
    )


ACTIVATION = {"gpt_oss_mxfp4": "swiglu_clamped", "deepseek_fp8": "swiglu", "hf_bf16": "swiglu"}


@dataclass(frozen=True)
class Case:
    fmt: str
    quant: str
    experts: int
    shared: int
    storage: str
    seed: int

    @property
    def id(self) -> str:
        return f"{self.fmt}-{self.quant}-E{self.experts}-S{self.shared}-{self.storage}"


CASES = [
    Case("gpt_oss_mxfp4", "fp8_mxfp4", 4, 0, "file", 0),
    Case("gpt_oss_mxfp4", "bf16", 4, 0, "index", 5),
    Case("deepseek_fp8", "fp8_mxfp4", 4, 2, "index", 1),
    Case("deepseek_fp8", "bf16", 4, 1, "index", 2),
    Case("hf_bf16", "fp8_mxfp4", 4, 1, "files", 3),
    Case("hf_bf16", "bf16", 6, 0, "dir", 4),
]


def checkpoint(tmp_path: Path, case: Case, config: dict | None = None):
    pub = make_layer(case.fmt, case.experts, case.shared, case.seed)
    src = publish(tmp_path, {**pub.tensors, **distractors(case.fmt, case.experts, case.seed)}, case.storage, config)
    return pub, src


# --------------------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("fmt_arg", ["auto", "explicit"])
def test_loaded_weights_equal_the_published_values(tmp_path, case, fmt_arg):
    pub, src = checkpoint(tmp_path, case)
    fmt = case.fmt if fmt_arg == "explicit" else "auto"
    weights, info = load_moe_layer_weights(src, LAYER, fmt, quant=case.quant)
    assert_same_weights(weights, expected_weights(pub, case.quant))
    assert (info.format, info.hidden_size, info.intermediate_size) == (case.fmt, H, I)
    gpt_oss = case.fmt == "gpt_oss_mxfp4"
    assert (info.num_experts, info.num_shared_experts, info.has_bias) == (case.experts, case.shared, gpt_oss)
    assert (info.activation, info.quant, info.ep_size) == (ACTIVATION[case.fmt], case.quant, 1)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_loaded_layer_matches_the_reference_on_the_dequantised_weights(tmp_path, case):
    pub, src = checkpoint(tmp_path, case)
    weights, info = load_moe_layer_weights(src, LAYER, quant=case.quant)
    cfg = info.moe_config(top_k=2, max_tokens_per_rank=16)
    assert (cfg.activation, cfg.has_bias) == (ACTIVATION[case.fmt], case.fmt == "gpt_oss_mxfp4")
    x, ids, w = make_tokens(cfg, 9, seed=case.seed)
    y = gcmoe.MoELayer(cfg, "cpu", backend="reference").load(weights)(x, ids, w)
    ref_weights, act = reference_weights(pub, case.quant), Activation.of(cfg)
    assert torch.equal(y, moe_reference(x, ids, w, ref_weights, act=act))  # the identical path: bit-exact
    assert calc_diff(y, moe_reference_loop_fp64(x, ids, w, ref_weights, act=act)) <= 1e-3
    assert y.abs().max() > 0


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_an_ep_rank_loads_exactly_its_experts(tmp_path, case):
    pub, src = checkpoint(tmp_path, case)
    full, _ = load_moe_layer_weights(src, LAYER, quant=case.quant)
    p = 2
    per = case.experts // p
    for rank in range(p):
        weights, info = load_moe_layer_weights(src, LAYER, ep_rank=rank, ep_size=p, quant=case.quant)
        rows = slice(rank * per, (rank + 1) * per)
        assert_same_weights(weights, expected_weights(pub, case.quant, rows))
        assert (info.num_experts, info.local_experts, info.ep_rank, info.ep_size) == (case.experts, per, rank, p)
        assert info.moe_config(top_k=2).local_experts == weights.num_experts
        biases = [None if b is None else b[rows] for b in (full.w13_bias, full.w2_bias)]
        full_slice = MoEWeights(full.w13[rows], full.w2[rows], full.shared_w13, full.shared_w2, *biases)
        assert_same_weights(weights, full_slice)  # the same bytes as the full load's slice


@pytest.mark.parametrize("fmt", ["deepseek_fp8", "hf_bf16"])
def test_a_rank_reads_only_its_own_experts(tmp_path, fmt):
    """Expert 0's tensors removed: rank 1 of 2 (experts 2, 3) still loads; rank 0 names the missing tensor."""
    pub = make_layer(fmt, 4, 1, 7)
    kept = {n: t for n, t in pub.tensors.items() if ".experts.0." not in n}
    src = publish(tmp_path, kept, "index")
    weights, _ = load_moe_layer_weights(src, LAYER, ep_rank=1, ep_size=2, quant="bf16")
    assert_same_weights(weights, expected_weights(pub, "bf16", slice(2, 4)))
    with pytest.raises(ValueError, match=re.escape(f"'{_name(LAYER, 'experts.0.gate_proj.weight')}' is missing")):
        load_moe_layer_weights(src, LAYER, ep_rank=0, ep_size=2)


def test_fp8_block_dequantisation_matches_the_fp64_formula_on_ragged_shapes():
    g = torch.Generator().manual_seed(5)
    for n, k in ((200, 300), (128, 256), (1, 129)):
        q, s, want = _fp8_block(g, n, k)
        got = dequantize_fp8_block128x128(q, s)
        assert got.dtype == torch.float32 and not (msg := first_mismatch(got, want.float())), msg


def test_config_json_supplies_top_k_and_load_moe_layer_builds_the_layer(tmp_path):
    case = CASES[2]  # DeepSeek FP8, two shared experts
    pub, src = checkpoint(tmp_path, case, config={"num_experts_per_tok": 3})
    layer = load_moe_layer(src, LAYER, "cpu", "reference", max_tokens_per_rank=8)
    assert (layer.cfg.top_k, layer.cfg.num_experts, layer.cfg.num_shared_experts) == (3, 4, 2)
    x, ids, w = make_tokens(layer.cfg, 5, seed=3)
    ref = reference_weights(pub, "fp8_mxfp4")
    assert torch.equal(layer(x, ids, w), moe_reference(x, ids, w, ref))


# ---------------------------------------------------------------------------------------------------- rejections
def _drop(name):
    return lambda t: {n: v for n, v in t.items() if n != name}


def _set(name, fn):
    return lambda t: {**t, name: fn(t[name])}


@dataclass(frozen=True)
class Bad:
    """A checkpoint edit (or bad arguments) and the ValueError message it must raise."""

    id: str
    fmt: str
    match: str
    edit: object = None
    kwargs: tuple = ()
    shared: int = 1


GATE1 = _name(LAYER, "experts.1.gate_proj.weight")
BAD = [
    Bad("unknown-format", "hf_bf16", "unknown format 'safetensors'", kwargs=(("fmt", "safetensors"),)),
    Bad("bad-quant", "hf_bf16", "quant: must be one of", kwargs=(("quant", "fp4"),)),
    Bad("ep-not-dividing", "hf_bf16", "ep_size = 3 does not divide the checkpoint's E = 4", kwargs=(("ep_size", 3),)),
    Bad(
        "ep-rank-outside",
        "hf_bf16",
        r"ep_rank: 2 is outside \[0, ep_size = 2\)",
        kwargs=(("ep_rank", 2), ("ep_size", 2)),
    ),
    Bad(
        "no-experts-at-layer",
        "hf_bf16",
        "no MoE experts in a known layout under 'model.layers.7.mlp.'",
        kwargs=(("layer", 7),),
    ),
    Bad(
        "missing-up",
        "hf_bf16",
        re.escape(f"'{_name(LAYER, 'experts.1.up_proj.weight')}' is missing"),
        _drop(_name(LAYER, "experts.1.up_proj.weight")),
    ),
    Bad("missing-scale-inv", "deepseek_fp8", re.escape(f"'{GATE1}_scale_inv' is missing"), _drop(GATE1 + "_scale_inv")),
    Bad(
        "fp8-stored-as-bf16",
        "deepseek_fp8",
        re.escape(f"'{GATE1}' has dtype BF16; expected F8_E4M3"),
        _set(GATE1, lambda w: w.float().bfloat16()),
        (("fmt", "deepseek_fp8"),),
    ),
    Bad("int-in-bf16-layout", "hf_bf16", re.escape(f"'{GATE1}' has dtype I32"), _set(GATE1, lambda w: w.int())),
    Bad(
        "down-transposed",
        "hf_bf16",
        re.escape(f"'{_name(LAYER, 'experts.1.down_proj.weight')}' has shape ({I}, {H}); expected ({H}, {I})"),
        _set(_name(LAYER, "experts.1.down_proj.weight"), lambda w: w.T),
    ),
    Bad(
        "scale-inv-wrong-blocks",
        "deepseek_fp8",
        re.escape(f"'{GATE1}_scale_inv' has shape (1, 1); expected (1, 2)"),
        _set(GATE1 + "_scale_inv", lambda s: s[:, :1]),
    ),
    Bad(
        "shared-not-multiple-of-I",
        "hf_bf16",
        "shared intermediate 192 is not a multiple of I=128",
        lambda t: {
            **t,
            **{
                _name(LAYER, f"shared_experts.{p}_proj.weight"): torch.ones(*s).bfloat16()
                for p, s in (("gate", (192, H)), ("up", (192, H)), ("down", (H, 192)))
            },
        },
        shared=0,
    ),
    Bad(
        "gated-shared-expert",
        "hf_bf16",
        "gated shared expert",
        lambda t: {**t, _name(LAYER, "shared_expert.gate_proj.weight"): torch.ones(I, H).bfloat16()},
        shared=0,
    ),
    Bad(
        "gpt-oss-scales-float",
        "gpt_oss_mxfp4",
        re.escape(f"'{_name(LAYER, 'experts.down_proj_scales')}' has dtype F32; expected U8"),
        _set(_name(LAYER, "experts.down_proj_scales"), lambda s: s.float()),
    ),
    Bad(
        "gpt-oss-block-bytes",
        "gpt_oss_mxfp4",
        r"expected \[E, 2I, H/32, 16\]",
        _set(_name(LAYER, "experts.gate_up_proj_blocks"), lambda b: b[..., :8]),
    ),
    Bad(
        "gpt-oss-down-rows",
        "gpt_oss_mxfp4",
        re.escape(
            f"'{_name(LAYER, 'experts.down_proj_blocks')}' has shape (4, {H // 2}, 4, 16); expected (4, {H}, 4, 16)"
        ),
        _set(_name(LAYER, "experts.down_proj_blocks"), lambda b: b[:, : H // 2]),
    ),
    Bad(
        "gpt-oss-missing-bias-half",
        "gpt_oss_mxfp4",
        re.escape(f"'{_name(LAYER, 'experts.down_proj_bias')}' is missing"),
        _drop(_name(LAYER, "experts.down_proj_bias")),
    ),
]


@pytest.mark.parametrize("bad", BAD, ids=lambda b: b.id)
def test_rejections_name_the_tensor_or_argument(tmp_path, bad):
    tensors = make_layer(bad.fmt, 4, bad.shared, 9).tensors
    if bad.edit is not None:
        tensors = bad.edit(tensors)
    src = publish(tmp_path, tensors, "index")
    kwargs = {"layer": LAYER, **dict(bad.kwargs)}
    with pytest.raises(ValueError, match=bad.match):
        load_moe_layer_weights(src, **kwargs)


def test_a_gated_shared_expert_loads_with_shared_false(tmp_path):
    pub = make_layer("hf_bf16", 4, 0, 10)
    gated = {**pub.tensors, _name(LAYER, "shared_expert.gate_proj.weight"): torch.ones(I, H).bfloat16()}
    weights, info = load_moe_layer_weights(publish(tmp_path, gated, "dir"), LAYER, quant="bf16", shared=False)
    assert info.num_shared_experts == 0
    assert_same_weights(weights, expected_weights(pub, "bf16"))


def test_rejections_of_the_paths_and_the_config(tmp_path):
    with pytest.raises(ValueError, match="no model.safetensors.index.json and no"):
        load_moe_layer_weights(tmp_path, LAYER)
    with pytest.raises(ValueError, match="no such file"):
        load_moe_layer_weights([tmp_path / "absent.safetensors"], LAYER)
    pub = make_layer("hf_bf16", 4, 0, 11)
    half = {n: t for n, t in pub.tensors.items() if ".experts.3." not in n}
    save_file(half, tmp_path / "a.safetensors")
    save_file(
        {_name(LAYER, "experts.3.gate_proj.weight"): pub.tensors[_name(LAYER, "experts.3.gate_proj.weight")]},
        tmp_path / "b.safetensors",
    )
    save_file({_name(LAYER, "experts.3.gate_proj.weight"): torch.zeros(1)}, tmp_path / "c.safetensors")
    with pytest.raises(ValueError, match="is in both"):
        load_moe_layer_weights([tmp_path / "b.safetensors", tmp_path / "c.safetensors"], LAYER)
    _, info = load_moe_layer_weights(
        [tmp_path / "a.safetensors", tmp_path / "b.safetensors"], LAYER, ep_rank=0, ep_size=2
    )
    with pytest.raises(ValueError, match="top_k: not given and no config.json"):
        info.moe_config()
    assert isinstance(info, MoECheckpointInfo)


# ------------------------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES[::2], ids=lambda c: c.id)
def test_load_onto_the_gpu_and_run_the_best_backend(tmp_path, case):
    """Conversion on the device gives the same bytes as on the CPU, and the auto-chosen backend's layer agrees with
    the reference built from the checkpoint's values."""
    pub, src = checkpoint(tmp_path, case)
    on_gpu, _ = load_moe_layer_weights(src, LAYER, quant=case.quant, device="cuda")
    assert on_gpu.device.type == "cuda"
    assert_same_weights(on_gpu.to("cpu"), expected_weights(pub, case.quant))
    layer = load_moe_layer(src, LAYER, "cuda", top_k=2, quant=case.quant, max_tokens_per_rank=16)
    x, ids, w = make_tokens(layer.cfg, 8, seed=case.seed, device="cuda")
    want = moe_reference(x.cpu(), ids.cpu(), w.cpu(), reference_weights(pub, case.quant), act=Activation.of(layer.cfg))
    assert calc_diff(layer(x, ids, w).cpu(), want) <= 1e-3
