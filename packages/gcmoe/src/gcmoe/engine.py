"""The serving engines' call shape: `gcmoe.fused_experts` takes what vLLM's `fused_experts` and SGLang's fused-MoE
functions take and runs gcmoe's layer (gcmoe.layer.prepack / moe) on it. docs/integration.md maps every argument and
describes the three mechanisms below (the one description; this module implements it).

    y = gcmoe.fused_experts(hidden_states, w13, w2, topk_weights, topk_ids)          # raw weights: packed once
    y = gcmoe.fused_experts(hidden_states, w13, w2, topk_weights, topk_ids,          # EP: global ids, this rank's
                            expert_map=expert_map, global_num_experts=E)              # experts only
    y = gcmoe.fused_experts(hidden_states, packed, None, topk_weights, topk_ids)     # a PackedMoE handle (preferred)

- Expert parallelism the engine's way (map_expert_ids): a non-local expert becomes the masked id -1, and the output
  is this rank's partial sum for the engine to reduce.
- The pack cache (cached_pack): raw weights are packed once, keyed weakly on w1 and checked on every call against
  the tensors' identity, version counter and layout; a write that bypasses the version counter needs clear_cache().
- A PackedMoE handle (gcmoe.prepack) skips the lookup and makes the lifetime explicit: the recommended form.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from dataclasses import dataclass

import torch
from torch.utils.weak import WeakIdKeyDictionary

from gcmoe_core.config import ACTIVATIONS, MASKED_ID, MoEConfig
from gcmoe_core.layouts import deinterleave_gate_up
from gcmoe_core.reference import MoEWeights

from .layer import PackedMoE, moe, prepack

# engine activation name -> (MoEConfig.activation, w13 rows interleaved gate/up as the engine lays them out)
_ENGINE_ACTIVATIONS = {"silu": ("swiglu", False), "swigluoai": ("swiglu_clamped", True)}
_RAW_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # MoELayer.load_weights' (validate_weights)


def _fail(arg: str, msg: str):
    raise ValueError(f"gcmoe: fused_experts: {arg}: {msg}")


def supported_activations() -> dict[str, tuple[str, bool]]:
    """Activation names fused_experts takes -> (MoEConfig.activation, w13 rows interleaved): the engines' names, and
    MoEConfig's own names (gate rows then up rows)."""
    return {**_ENGINE_ACTIVATIONS, **{a: (a, False) for a in ACTIVATIONS}}


def _activation(name: str) -> tuple[str, bool]:
    table = supported_activations()
    if name not in table:
        _fail("activation", f"{name!r} is not supported; supported: {', '.join(map(repr, table))}")
    return table[name]


# ------------------------------------------------------------------------------------------------ the pack cache
def _signature(t: torch.Tensor) -> tuple:
    """What identifies a tensor's contents for the cache, short of reading them."""
    try:
        version = t._version
    except RuntimeError:  # an inference tensor: no version counter
        version = None
    return (t.data_ptr(), version, tuple(t.shape), t.stride(), t.dtype, t.device)


@dataclass
class _Entry:
    options: tuple
    w1: tuple
    w2: tuple
    w2_ref: weakref.ref
    packed: PackedMoE


_PACKS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # w1 tensor -> [_Entry]; entries die with their w1
_LOCK = threading.Lock()
_WARNED = False  # the first raw-weight pack of the process warns what the cache cannot see


def clear_cache() -> None:
    """Drop every cached pack (raw-weight calls pack again on their next call)."""
    with _LOCK:
        _PACKS.clear()


def cached_pack(w1: torch.Tensor, w2: torch.Tensor, options: tuple, build, biases: tuple = ()) -> PackedMoE:
    """The cached pack of (w1, w2, biases) for `options`, or build() it (and drop the entry it replaces). The biases'
    identities and signatures are checked with w2's."""
    sig1 = _signature(w1)
    sig2 = (_signature(w2), *((id(b), _signature(b)) if b is not None else None for b in biases))
    with _LOCK:
        entries = _PACKS.get(w1, [])
        for entry in entries:
            if entry.options == options and entry.w2_ref() is w2 and (entry.w1, entry.w2) == (sig1, sig2):
                return entry.packed
        # dropped before packing again: a pack of the same tensors and options with older contents (stale), and
        # any whose w2 has died
        keep = [e for e in entries if e.w2_ref() is not None and not (e.options == options and e.w2_ref() is w2)]
        _PACKS[w1] = keep
    global _WARNED
    if not _WARNED:
        _WARNED = True
        warnings.warn(
            "gcmoe.fused_experts: raw weights are packed once and cached by tensor identity and version counter; "
            "a reload that bypasses the version counter (param.data.copy_, a collective or DLPack write into the "
            "tensor) is not seen: call gcmoe.engine.clear_cache() after it, or pass a PackedMoE handle "
            "(docs/integration.md)",
            stacklevel=3,
        )
    packed = build()
    with _LOCK:
        _PACKS.setdefault(w1, []).append(_Entry(options, sig1, sig2, weakref.ref(w2), packed))
    return packed


def _check_raw(w1, w2) -> None:
    for arg, w in (("w1", w1), ("w2", w2)):
        if not isinstance(w, torch.Tensor) or w.dim() != 3 or not w.is_floating_point():
            _fail(arg, f"must be a floating 3-D tensor (or w1 a PackedMoE handle), got {_describe(w)}")
        if w.dtype not in _RAW_DTYPES:  # an FP8 engine weight is codes without its block scales (not taken here)
            _fail(arg, f"dtype must be bf16, fp16 or fp32 (unquantised weights), got {w.dtype}")
    e, two_i, h = w1.shape
    if two_i % 2 or tuple(w2.shape) != (e, h, two_i // 2):
        want = f"[E, H, I] = ({e}, {h}, {two_i // 2})"
        _fail("w2", f"shape {tuple(w2.shape)} does not match w1 {tuple(w1.shape)} [E, 2I, H]: want {want}")
    if w1.device != w2.device:
        _fail("w2", f"is on {w2.device} but w1 is on {w1.device}")


def _pack_raw(
    w1, w2, top_k: int, max_tokens: int, quant: str, act: str, interleaved: bool, backend, w1_bias=None, w2_bias=None
) -> PackedMoE:
    """MoEConfig + quantised weights (+ fp32 biases) from the engine's raw tensors, prepacked (the cache's miss
    path)."""
    e, two_i, h = w1.shape
    has_bias = w1_bias is not None
    cfg = MoEConfig(
        h, two_i // 2, e, top_k, max_tokens_per_rank=max_tokens, quant=quant, masked_ids=True, activation=act,
        has_bias=has_bias,
    )  # fmt: skip
    w13, b13 = w1.detach(), None if w1_bias is None else w1_bias.detach()
    if interleaved:  # gate rows 0, 2, 4, ..., up rows 1, 3, 5, ... -> gate rows, then up rows (biases alike)
        w13 = deinterleave_gate_up(w13)
        b13 = None if b13 is None else deinterleave_gate_up(b13)
    w2d = w2.detach()
    if quant == "bf16":  # a bf16 pack must not alias the caller's tensors (the cache holds it weakly by w1)
        w13, w2d = w13.to(torch.bfloat16, copy=True), w2d.to(torch.bfloat16, copy=True)
    b2 = None if w2_bias is None else w2_bias.detach().to(torch.float32, copy=True)
    b13 = None if b13 is None else b13.to(torch.float32, copy=True)
    weights = MoEWeights.from_float(w13.contiguous(), w2d.contiguous(), quant=quant, w13_bias=b13, w2_bias=b2)
    return prepack(cfg, weights, w1.device, backend)


def _check_biases(w1, w2, w1_bias, w2_bias) -> None:
    if (w1_bias is None) != (w2_bias is None):
        _fail("w1_bias" if w1_bias is None else "w2_bias", "w1_bias and w2_bias go together (both or neither)")
    if w1_bias is None:
        return
    e, two_i, h = w1.shape
    for arg, b, shape in (("w1_bias", w1_bias, (e, two_i)), ("w2_bias", w2_bias, (e, h))):
        if not isinstance(b, torch.Tensor) or tuple(b.shape) != shape or not b.is_floating_point():
            _fail(arg, f"must be a floating tensor of shape {shape}, got {_describe(b)}")
        if b.device != w1.device:
            _fail(arg, f"is on {b.device} but w1 is on {w1.device}")


# ------------------------------------------------------------------------------------------------ the entry
def _describe(v) -> str:
    return f"{v.dtype} {tuple(v.shape)}" if isinstance(v, torch.Tensor) else type(v).__name__


def map_expert_ids(topk_ids: torch.Tensor, expert_map: torch.Tensor, num_local: int) -> torch.Tensor:
    """Global ids -> local ids through expert_map (int [G]), on the device (no host sync): a non-local expert gives
    -1 (masked), a masked global id stays -1, and any other id outside [0, G) gives num_local (reported out of
    range by the layer). Same dtype as topk_ids."""
    g = expert_map.shape[0]
    ids = topk_ids.long()
    inside = (ids >= 0) & (ids < g)
    local = expert_map.long()[ids.clamp(0, g - 1)]
    outside = torch.where(ids == MASKED_ID, MASKED_ID, num_local)
    return torch.where(inside, local, outside).to(topk_ids.dtype)


def fused_experts(
    hidden_states: torch.Tensor,
    w1: torch.Tensor | PackedMoE,
    w2: torch.Tensor | None,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    inplace: bool = False,
    activation: str = "silu",
    apply_router_weight_on_input: bool = False,
    global_num_experts: int = -1,
    expert_map: torch.Tensor | None = None,
    w1_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    max_tokens_per_rank: int = 256,
    quant: str = "fp8_mxfp4",
    backend: str | None = None,
) -> torch.Tensor:
    """y = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(hidden_states[t]) over this rank's experts, bf16 [T, H]
    (the module docstring says what each argument is). inplace: written into hidden_states, which is returned.
    w1_bias [E, 2I] / w2_bias [E, H] (vLLM's names; gpt-oss): per-expert biases of raw weights, laid out like w1's
    rows (interleaved for "swigluoai"); a handle carries its own. max_tokens_per_rank / quant / backend configure the
    pack of raw weights (ignored with a handle)."""
    if apply_router_weight_on_input:
        _fail(
            "apply_router_weight_on_input",
            "True is not supported: gcmoe applies the routing weight in W1's epilogue, to act(W13 x) before W2 "
            "(as apply_router_weight_on_input=False does), never to the input x",
        )
    act, interleaved = _activation(activation)
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dtype != torch.bfloat16 or hidden_states.dim() != 2:
        _fail("hidden_states", f"must be a bf16 [T, H] tensor, got {_describe(hidden_states)}")
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != 2:
        _fail("topk_ids", f"must be an int [T, k] tensor, got {_describe(topk_ids)}")
    if isinstance(w1, PackedMoE):
        if w2 is not None:
            _fail("w2", "must be None when w1 is a PackedMoE handle (the handle holds both projections)")
        if w1_bias is not None or w2_bias is not None:
            _fail("w1_bias", "must be None with a PackedMoE handle (the handle's layer holds its biases)")
        packed = w1
        have = packed.cfg.activation
        if have != act:
            _fail("activation", f"{activation!r} (MoEConfig activation {act!r}) but the handle's layer has {have!r}")
    else:
        _check_raw(w1, w2)
        _check_biases(w1, w2, w1_bias, w2_bias)
        options = (topk_ids.shape[1], max_tokens_per_rank, quant, act, interleaved, backend)
        build = lambda: _pack_raw(w1, w2, *options, w1_bias, w2_bias)
        packed = cached_pack(w1, w2, options, build, (w1_bias, w2_bias))
    cfg = packed.cfg
    if hidden_states.device != packed.device:
        _fail("hidden_states", f"is on {hidden_states.device} but the experts are on {packed.device}")
    ids = topk_ids
    if expert_map is not None:
        if not isinstance(expert_map, torch.Tensor) or expert_map.dim() != 1 or expert_map.shape[0] == 0:
            _fail("expert_map", f"must be a 1-D int tensor [global E], got {_describe(expert_map)}")
        if expert_map.dtype not in (torch.int32, torch.int64):
            _fail("expert_map", f"dtype must be torch.int32 or torch.int64, got {expert_map.dtype}")
        if expert_map.device != topk_ids.device:
            _fail("expert_map", f"is on {expert_map.device} but topk_ids is on {topk_ids.device}")
        if global_num_experts not in (-1, expert_map.shape[0]):
            _fail("global_num_experts", f"{global_num_experts} but expert_map has {expert_map.shape[0]} entries")
        if cfg.ep_size > 1:
            _fail("expert_map", "not with an ep_size > 1 handle: its layer dispatches global ids itself")
        if not cfg.masked_ids:
            _fail(
                "expert_map", "needs a handle built with MoEConfig(..., masked_ids=True): non-local experts map to -1"
            )
        ids = map_expert_ids(topk_ids, expert_map, cfg.local_experts)
    elif global_num_experts not in (-1, cfg.num_experts):
        _fail(
            "global_num_experts",
            f"{global_num_experts} but the layer has E = {cfg.num_experts} experts and no expert_map was given "
            "(without one the ids index w1 directly)",
        )
    weights = topk_weights
    if isinstance(weights, torch.Tensor) and weights.is_floating_point() and weights.dtype != torch.float32:
        weights = weights.float()
    try:
        y = moe(hidden_states, ids, weights, packed)
    except ValueError as e:
        if expert_map is None or "topk_ids" not in str(e):
            raise
        raise ValueError(
            f"{e} (fused_experts mapped the global topk_ids through expert_map: local id {cfg.local_experts} "
            f"stands for a global id outside [-1, {expert_map.shape[0]}); any other bad local id is an expert_map "
            "entry outside [-1, E_local))"
        ) from e
    if inplace:
        return hidden_states.copy_(y)
    return y
