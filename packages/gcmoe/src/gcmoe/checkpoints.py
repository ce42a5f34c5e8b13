"""Checkpoint loaders: one MoE layer's experts, read from safetensors files as published, into `MoEWeights`.

    weights, info = gcmoe.load_moe_layer_weights("/ckpt/dir", layer=3, ep_rank=r, ep_size=P)
    layer = gcmoe.MoELayer(info.moe_config(top_k=8), "cuda").load(weights)      # or gcmoe.load_moe_layer(...)

The formats, each tensor's name, dtype and shape, and what is done to it are tabled in docs/checkpoints.md (the one
description; this module implements it). In short:
- gpt_oss_mxfp4 (fused experts, MXFP4 along K, gate / up rows interleaved): the bytes carry over as they are (same
  nibble order and scale bias as gcmoe_core.formats); rows and biases are de-interleaved into gate-then-up order, no
  value is re-quantised; quant="bf16" dequantises exactly.
- deepseek_fp8 (per-expert FP8 E4M3, 128 x 128 blocks; Qwen3 FP8 too): fp8 times its block's scale_inv in fp32 (one
  correctly rounded product), then quantize_mxfp4 along K or bf16.
- hf_bf16 (per-expert bf16 / fp16 / fp32): quantize_mxfp4 or bf16.
- auto: the layout from the names present at the layer.
Every name, dtype and shape is checked from the headers before any data is read, an EP rank reads only its E/P routed
experts and every shared expert, and every rejection is a ValueError naming the tensor or argument.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from gcmoe_core.config import MoEConfig
from gcmoe_core.formats import MXFP4_GROUP, MXFP4Tensor, quantize_mxfp4
from gcmoe_core.layouts import deinterleave_gate_up
from gcmoe_core.reference import MoEWeights

from .layer import MoELayer

FORMATS = ("gpt_oss_mxfp4", "deepseek_fp8", "hf_bf16")
INDEX_FILE = "model.safetensors.index.json"
FP8_BLOCK = 128  # DeepSeek's weight_block_size [128, 128]
_MXFP4_BLOCK_BYTES = MXFP4_GROUP // 2  # 16 bytes hold one 32-element group

# safetensors header dtype names
_U8, _BF16, _F16, _F32, _F8 = "U8", "BF16", "F16", "F32", "F8_E4M3"
_FLOATS = (_BF16, _F16, _F32)
_QUANTS = ("fp8_mxfp4", "bf16")


def _fail(msg: str) -> None:
    raise ValueError(f"gcmoe.checkpoints: {msg}")


@dataclass(frozen=True)
class MoECheckpointInfo:
    """What a checkpoint says about one MoE layer, and how it was loaded. num_experts is the global E."""

    format: str
    layer: int
    hidden_size: int
    intermediate_size: int
    num_experts: int
    num_shared_experts: int
    has_bias: bool
    activation: str  # MoEConfig.activation: "swiglu" (silu(gate) * up) or "swiglu_clamped" (gpt-oss)
    quant: str
    ep_rank: int
    ep_size: int
    top_k: int | None = None  # num_experts_per_tok of a config.json beside the files
    swiglu_limit: float | None = None  # swiglu_limit of that config.json (gpt-oss)

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.ep_size

    def moe_config(self, top_k: int | None = None, **overrides) -> MoEConfig:
        """The layer's MoEConfig (shapes, activation, biases, ep_size and quant as loaded); top_k (and the clamp
        limit) default to the config.json's."""
        top_k = top_k if top_k is not None else self.top_k
        if top_k is None:
            _fail("top_k: not given and no config.json with num_experts_per_tok beside the checkpoint")
        fields = {
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_experts": self.num_experts,
            "top_k": top_k,
            "num_shared_experts": self.num_shared_experts,
            "ep_size": self.ep_size,
            "quant": self.quant,
            "activation": self.activation,
            "has_bias": self.has_bias,
        }
        if self.swiglu_limit is not None:
            fields["swiglu_limit"] = self.swiglu_limit
        return MoEConfig(**{**fields, **overrides})


# ------------------------------------------------------------------------------------------------------ numerics
def dequantize_fp8_block128x128(q: torch.Tensor, scale_inv: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """float8_e4m3fn [..., N, K] with scale_inv [..., ceil(N/block), ceil(K/block)] -> fp32 [..., N, K]: each element
    times its block's scale (an E4M3 value has 4 significant bits, so the fp32 product is the correctly rounded exact
    one). Leading dims: experts stacked as engines hold them (gcmoe.engine)."""
    *lead, n, k = q.shape
    want = (*lead, math.ceil(n / block), math.ceil(k / block))
    if tuple(scale_inv.shape) != want:
        _fail(f"fp8 weight {tuple(q.shape)} needs scale_inv {want}, got {tuple(scale_inv.shape)}")
    s = scale_inv.float().repeat_interleave(block, -2)[..., :n, :].repeat_interleave(block, -1)[..., :k]
    return q.float() * s


def _stack(ws: list) -> torch.Tensor | MXFP4Tensor:
    if isinstance(ws[0], MXFP4Tensor):
        return MXFP4Tensor(torch.stack([w.packed for w in ws]), torch.stack([w.scale for w in ws]))
    return torch.stack(ws)


def _convert(w: torch.Tensor, quant: str) -> torch.Tensor | MXFP4Tensor:
    """One float [N, K] weight -> MXFP4 along K, or bf16."""
    return quantize_mxfp4(w) if quant == "fp8_mxfp4" else w.to(torch.bfloat16).contiguous()


# --------------------------------------------------------------------------------------------------------- files
def _resolve(files_or_dir) -> tuple[dict[str, Path], Path | None]:
    """(tensor name -> file, the folder holding the files when there is one). Only headers are read."""
    if isinstance(files_or_dir, (str, Path)):
        p = Path(files_or_dir)
        if p.is_dir():
            if (p / INDEX_FILE).is_file():
                return _from_index(p / INDEX_FILE), p
            files = sorted(p.glob("*.safetensors"))
            if not files:
                _fail(f"{p}: no {INDEX_FILE} and no *.safetensors files in the directory")
            return _from_files(files), p
        if p.suffix == ".json":
            return _from_index(p), p.parent
        return _from_files([p]), p.parent
    files = [Path(f) for f in files_or_dir]
    if not files:
        _fail("files_or_dir: an empty list of files")
    return _from_files(files), files[0].parent


def _from_index(index: Path) -> dict[str, Path]:
    if not index.is_file():
        _fail(f"{index}: no such index file")
    weight_map = json.loads(index.read_text()).get("weight_map")
    if not isinstance(weight_map, dict):
        _fail(f"{index}: no 'weight_map' object")
    return {name: index.parent / f for name, f in weight_map.items()}


def _from_files(files: list[Path]) -> dict[str, Path]:
    where: dict[str, Path] = {}
    for f in files:
        if not f.is_file():
            _fail(f"{f}: no such file")
        with safe_open(f, framework="pt") as h:
            for name in h.keys():  # noqa: SIM118 (a safe_open handle is not iterable)
                if name in where:
                    _fail(f"tensor '{name}' is in both {where[name]} and {f}")
                where[name] = f
    return where


def _config_json(folder: Path | None) -> dict:
    cfg = folder / "config.json" if folder is not None else None
    return json.loads(cfg.read_text()) if cfg is not None and cfg.is_file() else {}


class _Reader:
    """Checked lazy reads from the files of one checkpoint onto `device` (handles stay open for one load)."""

    def __init__(self, where: dict[str, Path], stack: contextlib.ExitStack, device: torch.device):
        self.where = where
        self.device = device
        self._stack = stack
        self._open: dict[Path, object] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def _slice(self, name: str):
        if name not in self.where:
            _fail(f"tensor '{name}' is missing from the checkpoint")
        f = self.where[name]
        if f not in self._open:
            if not f.is_file():
                _fail(f"tensor '{name}': its file {f} does not exist")
            self._open[f] = self._stack.enter_context(safe_open(f, framework="pt"))
        return self._open[f].get_slice(name)

    def meta(self, name: str, dtypes: tuple[str, ...], ndim: int) -> tuple[int, ...]:
        """The tensor's shape, after checking its dtype and rank from the header."""
        sl = self._slice(name)
        dtype, shape = sl.get_dtype(), tuple(sl.get_shape())
        if dtype not in dtypes:
            _fail(f"tensor '{name}' has dtype {dtype}; expected {' or '.join(dtypes)}")
        if len(shape) != ndim:
            _fail(f"tensor '{name}' has shape {shape}; expected {ndim} dimensions")
        return shape

    def read(self, name: str, dtypes: tuple[str, ...], shape: tuple[int, ...], rows: slice | None = None):
        """The tensor (or rows of its first dimension) after checking dtype and the full shape."""
        have = self.meta(name, dtypes, len(shape))
        if have != shape:
            _fail(f"tensor '{name}' has shape {have}; expected {shape}")
        sl = self._slice(name)
        return (sl[rows] if rows is not None else sl[:]).to(self.device)


# -------------------------------------------------------------------------------------------------------- layouts
def _detect(reader: _Reader, base: str) -> str:
    names = [n for n in reader.where if n.startswith(base)]
    if base + "experts.gate_up_proj_blocks" in reader:
        return "gpt_oss_mxfp4"
    if any(re.fullmatch(re.escape(base) + r"experts\.\d+\.gate_proj\.weight_scale_inv", n) for n in names):
        return "deepseek_fp8"
    if any(re.fullmatch(re.escape(base) + r"experts\.\d+\.gate_proj\.weight", n) for n in names):
        return "hf_bf16"
    seen = ", ".join(sorted(names)[:6]) or "none"
    _fail(f"no MoE experts in a known layout under '{base}' (tensors there: {seen}); known formats: {FORMATS}")


def _check_ep(num_experts: int, ep_rank: int, ep_size: int) -> slice:
    if num_experts % ep_size:
        _fail(f"ep_size = {ep_size} does not divide the checkpoint's E = {num_experts} experts")
    per = num_experts // ep_size
    return slice(ep_rank * per, (ep_rank + 1) * per)


def _facts(h: int, i: int, num_e: int, shared: int, has_bias: bool, activation: str) -> dict:
    """The MoECheckpointInfo fields a layout loader finds in the files."""
    return {
        "hidden_size": h,
        "intermediate_size": i,
        "num_experts": num_e,
        "num_shared_experts": shared,
        "has_bias": has_bias,
        "activation": activation,
    }


def _load_gpt_oss(rd: _Reader, base: str, ep_rank: int, ep_size: int, quant: str) -> tuple[MoEWeights, dict]:
    e = base + "experts."
    num_e, two_i, h_groups, nb = rd.meta(e + "gate_up_proj_blocks", (_U8,), 4)
    if nb != _MXFP4_BLOCK_BYTES or two_i % 2:
        _fail(f"tensor '{e}gate_up_proj_blocks' has shape {(num_e, two_i, h_groups, nb)}; expected [E, 2I, H/32, 16]")
    h, i = h_groups * MXFP4_GROUP, two_i // 2
    rows = _check_ep(num_e, ep_rank, ep_size)

    def mxfp4(name: str, n: int, k: int) -> MXFP4Tensor:
        blocks = rd.read(f"{e}{name}_blocks", (_U8,), (num_e, n, k // MXFP4_GROUP, _MXFP4_BLOCK_BYTES), rows)
        scales = rd.read(f"{e}{name}_scales", (_U8,), (num_e, n, k // MXFP4_GROUP), rows)
        return MXFP4Tensor(blocks.reshape(*blocks.shape[:2], k // 2), scales)

    w13_il, w2 = mxfp4("gate_up_proj", two_i, h), mxfp4("down_proj", h, i)
    w13 = MXFP4Tensor(deinterleave_gate_up(w13_il.packed), deinterleave_gate_up(w13_il.scale))
    if quant == "bf16":
        w13, w2 = w13.dequantize(torch.bfloat16), w2.dequantize(torch.bfloat16)
    b13 = b2 = None
    has_bias = f"{e}gate_up_proj_bias" in rd or f"{e}down_proj_bias" in rd
    if has_bias:
        b13 = deinterleave_gate_up(rd.read(f"{e}gate_up_proj_bias", (_BF16, _F32), (num_e, two_i), rows))
        b2 = rd.read(f"{e}down_proj_bias", (_BF16, _F32), (num_e, h), rows)
        b13, b2 = b13.float().contiguous(), b2.float().contiguous()
    weights = MoEWeights(w13, w2, w13_bias=b13, w2_bias=b2)
    return weights, _facts(h, i, num_e, 0, has_bias, "swiglu_clamped")


def _load_per_expert(
    rd: _Reader, base: str, fmt: str, ep_rank: int, ep_size: int, quant: str, shared: bool
) -> tuple[MoEWeights, dict]:
    fp8 = fmt == "deepseek_fp8"
    dtypes = (_F8,) if fp8 else _FLOATS
    pat = re.compile(re.escape(base) + r"experts\.(\d+)\.gate_proj\.weight")
    ids = [int(m.group(1)) for n in rd.where if (m := pat.fullmatch(n))]
    if not ids:
        _fail(f"tensor '{base}experts.0.gate_proj.weight' is missing from the checkpoint (no {fmt} experts)")
    num_e = max(ids) + 1
    local = _check_ep(num_e, ep_rank, ep_size)
    i, h = rd.meta(f"{base}experts.{local.start}.gate_proj.weight", dtypes, 2)
    if shared and f"{base}shared_expert.gate_proj.weight" in rd:
        _fail(
            f"'{base}shared_expert' is a gated shared expert (shared_expert_gate) the layer cannot apply; "
            "pass shared=False to load the routed experts only"
        )

    def weight(name: str, n: int, k: int) -> torch.Tensor:
        q = rd.read(name + ".weight", dtypes, (n, k))
        if not fp8:
            return q
        blocks = (math.ceil(n / FP8_BLOCK), math.ceil(k / FP8_BLOCK))
        return dequantize_fp8_block128x128(q, rd.read(name + ".weight_scale_inv", (_F32, _BF16), blocks))

    def expert(prefix: str, n_i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 [2·n_i, H] gate rows then up rows, w2 [H, n_i]) as read (float)."""
        gate, up = weight(prefix + "gate_proj", n_i, h), weight(prefix + "up_proj", n_i, h)
        return torch.cat((gate, up)), weight(prefix + "down_proj", h, n_i)

    w13s, w2s = [], []
    for idx in range(local.start, local.stop):
        w13_e, w2_e = expert(f"{base}experts.{idx}.", i)
        w13s.append(_convert(w13_e, quant))
        w2s.append(_convert(w2_e, quant))

    sw13 = sw2 = None
    s = 0
    if shared and f"{base}shared_experts.gate_proj.weight" in rd:
        s_i, _ = rd.meta(f"{base}shared_experts.gate_proj.weight", dtypes, 2)
        if s_i % i:
            _fail(
                f"tensor '{base}shared_experts.gate_proj.weight': shared intermediate {s_i} is not a multiple of I={i}"
            )
        s = s_i // i
        w13_all, w2_all = expert(f"{base}shared_experts.", s_i)
        gate, up = w13_all[:s_i], w13_all[s_i:]
        split = [(gate[j * i : (j + 1) * i], up[j * i : (j + 1) * i], w2_all[:, j * i : (j + 1) * i]) for j in range(s)]
        sw13 = _stack([_convert(torch.cat((g, u)), quant) for g, u, _ in split])
        sw2 = _stack([_convert(d.contiguous(), quant) for _, _, d in split])
    return MoEWeights(_stack(w13s), _stack(w2s), sw13, sw2), _facts(h, i, num_e, s, False, "swiglu")


# ------------------------------------------------------------------------------------------------------- public
def load_moe_layer_weights(
    files_or_dir,
    layer: int,
    fmt: str = "auto",
    ep_rank: int = 0,
    ep_size: int = 1,
    *,
    quant: str = "fp8_mxfp4",
    prefix: str = "model.layers",
    shared: bool = True,
    device="cpu",
) -> tuple[MoEWeights, MoECheckpointInfo]:
    """One MoE layer's experts held by EP rank `ep_rank` of `ep_size`, as MoEWeights on `device` (quant:
    "fp8_mxfp4" -> MXFP4Tensor weights, "bf16" -> bf16), and what the checkpoint says about the layer.

    fmt: "auto" or one of FORMATS (the module docstring lists each layout). shared=False skips shared experts."""
    if fmt != "auto" and fmt not in FORMATS:
        _fail(f"fmt: unknown format {fmt!r}; known: 'auto', {', '.join(repr(f) for f in FORMATS)}")
    if quant not in _QUANTS:
        _fail(f"quant: must be one of {_QUANTS}, got {quant!r}")
    for arg, v, lo in (("layer", layer, 0), ("ep_size", ep_size, 1), ("ep_rank", ep_rank, 0)):
        if not isinstance(v, int) or isinstance(v, bool) or v < lo:
            _fail(f"{arg}: must be an int >= {lo}, got {v!r}")
    if ep_rank >= ep_size:
        _fail(f"ep_rank: {ep_rank} is outside [0, ep_size = {ep_size})")
    where, folder = _resolve(files_or_dir)
    base = f"{prefix}.{layer}.mlp."
    with contextlib.ExitStack() as stack:
        rd = _Reader(where, stack, torch.device(device))
        fmt = _detect(rd, base) if fmt == "auto" else fmt
        if fmt == "gpt_oss_mxfp4":
            weights, facts = _load_gpt_oss(rd, base, ep_rank, ep_size, quant)
        else:
            weights, facts = _load_per_expert(rd, base, fmt, ep_rank, ep_size, quant, shared)
    model_cfg = _config_json(folder)
    limit = model_cfg.get("swiglu_limit") if facts["activation"] == "swiglu_clamped" else None
    info = MoECheckpointInfo(
        format=fmt,
        layer=layer,
        quant=quant,
        ep_rank=ep_rank,
        ep_size=ep_size,
        top_k=model_cfg.get("num_experts_per_tok"),
        swiglu_limit=limit,
        **facts,
    )
    return weights, info


def load_moe_layer(
    files_or_dir,
    layer: int,
    device=None,
    backend: str | None = None,
    *,
    top_k: int | None = None,
    fmt: str = "auto",
    ep_rank: int = 0,
    ep_size: int = 1,
    quant: str = "fp8_mxfp4",
    prefix: str = "model.layers",
    shared: bool = True,
    max_tokens_per_rank: int | None = None,
    **layer_options,
):
    """load_moe_layer_weights + info.moe_config + MoELayer(...).load(weights): a ready layer. layer_options go to
    MoELayer (comm_sms, group, ...); top_k defaults to the config.json's num_experts_per_tok. The weights are
    converted on the layer's device."""
    weights, info = load_moe_layer_weights(
        files_or_dir,
        layer,
        fmt,
        ep_rank,
        ep_size,
        quant=quant,
        prefix=prefix,
        shared=shared,
        device=device if device is not None else "cpu",
    )
    overrides = {} if max_tokens_per_rank is None else {"max_tokens_per_rank": max_tokens_per_rank}
    cfg = info.moe_config(top_k, **overrides)
    return MoELayer(cfg, device, backend, **layer_options).load(weights)
