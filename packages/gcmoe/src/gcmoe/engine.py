"""The serving engines' call shape: `gcmoe.fused_experts` takes what vLLM's `fused_experts` and SGLang's fused-MoE
functions take (vLLM's positional order) and runs gcmoe's layer (gcmoe.layer.prepack / moe) on it;
`gcmoe.fused_experts_masked` takes DeepEP low-latency's masked layout. docs/integration.md maps every argument and
describes the mechanisms below (the one description; this module implements it).

    y = gcmoe.fused_experts(hidden_states, w13, w2, topk_weights, topk_ids)          # raw weights: packed once
    y = gcmoe.fused_experts(hidden_states, w13, w2, topk_weights, topk_ids,          # EP: global ids, this rank's
                            expert_map=expert_map, global_num_experts=E)              # experts only
    y = gcmoe.fused_experts(hidden_states, w13_blocks, w2_blocks, topk_weights,      # quantised engine weights (MXFP4
                            topk_ids, w1_scale=s13, w2_scale=s2)                      # blocks, FP8 128x128 blocks)
    y = gcmoe.fused_experts(hidden_states, packed, None, topk_weights, topk_ids)     # a PackedMoE handle (preferred)
    y = gcmoe.fused_experts_masked(x_per_expert, w13, w2, masked_m)                  # [E_local, max_tokens, H]

- Expert parallelism the engine's way (map_expert_ids): a non-local expert becomes the masked id -1, and the output
  is this rank's partial sum for the engine to reduce.
- The pack cache (cached_pack): raw weights are packed once, keyed weakly on w1 and checked on every call against
  the tensors' (and their scales' and biases') identity, version counter and layout; a write that bypasses the
  version counter needs clear_cache(). Quantised weights are unpacked there, once (engine_weights).
- A PackedMoE handle (gcmoe.prepack) skips the lookup and makes the lifetime explicit: the recommended form.
- The layer computes in bf16; the output is cast to hidden_states' dtype (or out_dtype), scaled by
  routed_scaling_factor, and written into out= where given. No backward: a call autograd would differentiate is
  refused (gcmoe.ops.refuse_grad), eager and under torch.compile alike.
"""

from __future__ import annotations

import math
import threading
import warnings
import weakref
from dataclasses import dataclass

import torch
from torch.utils.weak import WeakIdKeyDictionary

from gcmoe_core.config import ACTIVATIONS, MASKED_ID, MoEConfig
from gcmoe_core.formats import MXFP4Tensor, check_mxfp4, dequantize_mxfp4
from gcmoe_core.layouts import deinterleave_gate_up
from gcmoe_core.reference import MoEWeights

from . import ops
from .checkpoints import FP8_BLOCK, dequantize_fp8_block128x128
from .layer import PackedMoE, moe, prepack

# engine activation name -> (MoEConfig.activation, w13 rows interleaved gate/up as the engine lays them out)
_ENGINE_ACTIVATIONS = {"silu": ("swiglu", False), "swigluoai": ("swiglu_clamped", True)}
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # unquantised weights (validate_weights'), activations
_MXFP4, _FP8 = torch.uint8, torch.float8_e4m3fn  # quantised engine weights: MXFP4 blocks, FP8 (128x128 block scales)
# vLLM's quantisation arguments (keywords, or attributes of quant_config: vLLM's FusedMoEQuantConfig or any object with
# these names, per_channel_quant being its per_act_token_quant) -> the value that means "not used". The first six are
# taken; the others only at that value (anything else: a ValueError naming it).
_QUANT_ARGS = {
    "w1_scale": None, "w2_scale": None, "block_shape": None, "use_fp8_w8a8": False, "w1_bias": None, "w2_bias": None,
    "use_int8_w8a8": False, "use_int8_w8a16": False, "use_int4_w4a16": False, "per_channel_quant": False,
    "w1_zp": None, "w2_zp": None, "a1_scale": None, "a2_scale": None,
}  # fmt: skip


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


def cached_pack(w1: torch.Tensor, w2: torch.Tensor, options: tuple, build, watched: tuple = ()) -> PackedMoE:
    """The cached pack of (w1, w2, watched) for `options`, or build() it (and drop the entry it replaces). The
    identities and signatures of the watched tensors (scales, biases; None entries allowed) are checked with w2's."""
    sig1 = _signature(w1)
    sig2 = (_signature(w2), *((id(b), _signature(b)) if b is not None else None for b in watched))
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
            stacklevel=4,
        )
    packed = build()
    with _LOCK:
        _PACKS.setdefault(w1, []).append(_Entry(options, sig1, sig2, weakref.ref(w2), packed))
    return packed


def _logical_shape(w: torch.Tensor) -> tuple[int, int, int]:
    """[E, N, K] of an engine weight (MXFP4 blocks: two values a byte)."""
    e, n, k = w.shape
    return (e, n, 2 * k) if w.dtype == _MXFP4 else (e, n, k)


def _check_scale(arg: str, w: torch.Tensor, scale) -> None:
    """w's scale: none for unquantised weights; uint8 e8m0 [E, N, K/32] for MXFP4 blocks (formats.check_mxfp4);
    float32 scale_inv [E, ceil(N/128), ceil(K/128)] for FP8 weights (block_shape None or [128, 128])."""
    if w.dtype in _FLOAT_DTYPES:
        if scale is not None:
            _fail(f"{arg}_scale", f"given, but {arg} is {w.dtype} (unquantised)")
        return
    if scale is None:
        _fail(f"{arg}_scale", f"required with {w.dtype} {arg} (MXFP4 blocks, or FP8 with 128x128 block scales)")
    if w.dtype == _MXFP4:
        return check_mxfp4(w, scale, f"gcmoe: fused_experts: {arg}")
    e, n, k = w.shape
    want = (e, -(-n // FP8_BLOCK), -(-k // FP8_BLOCK))
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32 or tuple(scale.shape) != want:
        _fail(f"{arg}_scale", f"must be float32 {want} (a scale_inv per 128x128 block), got {_describe(scale)}")
    if scale.device != w.device:
        _fail(f"{arg}_scale", f"is on {scale.device} but {arg} is on {w.device}")


def _check_raw(w1, w2, q: dict) -> None:
    for arg, w in (("w1", w1), ("w2", w2)):
        if not isinstance(w, torch.Tensor) or w.dim() != 3:
            _fail(arg, f"must be a 3-D tensor (or w1 a PackedMoE handle), got {_describe(w)}")
        if w.dtype not in (*_FLOAT_DTYPES, _MXFP4, _FP8):
            _fail(arg, f"dtype must be bf16, fp16, fp32, uint8 (MXFP4 blocks) or float8_e4m3fn, got {w.dtype}")
        _check_scale(arg, w, q[f"{arg}_scale"])
    if w1.dtype != w2.dtype and not {w1.dtype, w2.dtype} <= set(_FLOAT_DTYPES):
        _fail("w2", f"is {w2.dtype} but w1 is {w1.dtype} (quantised weights come in pairs of one format)")
    if q["block_shape"] is not None and (w1.dtype != _FP8 or list(q["block_shape"]) != [FP8_BLOCK, FP8_BLOCK]):
        _fail("block_shape", f"{q['block_shape']} is not supported: only [128, 128], with float8_e4m3fn weights")
    if q["use_fp8_w8a8"] and w1.dtype != _FP8:
        _fail("use_fp8_w8a8", f"True, but w1 is {w1.dtype}, not float8_e4m3fn")
    (e, two_i, h), shape2 = _logical_shape(w1), _logical_shape(w2)
    if two_i % 2 or shape2 != (e, h, two_i // 2):
        want = f"[E, H, I] = ({e}, {h}, {two_i // 2})"
        _fail("w2", f"shape {shape2} does not match w1 {(e, two_i, h)} [E, 2I, H]: want {want} (MXFP4: K/2 bytes)")
    if w1.device != w2.device:
        _fail("w2", f"is on {w2.device} but w1 is on {w1.device}")
    _check_biases(w1, q["w1_bias"], q["w2_bias"])


def _float_values(w: torch.Tensor, scale) -> torch.Tensor:
    """An engine weight's values: unquantised as it is, MXFP4 blocks exactly (fp32), FP8 e4m3 [E, N, K] times its
    float32 scale_inv [E, ceil(N/128), ceil(K/128)] (DeepSeek-V3's 128x128 blocks; fp32 products)."""
    if w.dtype == _MXFP4:
        return dequantize_mxfp4(w, scale)
    return dequantize_fp8_block128x128(w, scale) if w.dtype == _FP8 else w


def engine_weights(w1, w2, quant: str, interleaved: bool, q: dict) -> MoEWeights:
    """MoEWeights in `quant` (gate rows then up rows, fp32 biases; copies, never the caller's storage) from the
    engine's tensors and their scales / biases in q (_QUANT_ARGS).

    MXFP4 blocks with quant="fp8_mxfp4" are taken as they are, bit for bit: vLLM's gpt-oss layout (uint8 [E, N, K/2],
    element 2j in the low nibble, one e8m0 byte per 32 along K, bias 127) is formats.MXFP4Tensor's, so the pack holds
    the checkpoint's codes and scales (a dequantise + quantize_mxfp4 round trip would give the same values but may
    choose other scale bytes). Any other quantised weight is dequantised (MXFP4 exactly; FP8 times its 128x128
    scale_inv in fp32) and quantised or cast like an unquantised one (MoEWeights.from_float)."""
    # w1's rows (and its bias' and MXFP4 scales' rows) in gate-then-up order: "swigluoai" interleaves them
    rows = deinterleave_gate_up if interleaved else (lambda t: t)
    own = lambda t: t.detach().clone(memory_format=torch.contiguous_format)
    b13 = None if q["w1_bias"] is None else rows(q["w1_bias"].detach()).to(torch.float32, copy=True)
    b2 = None if q["w2_bias"] is None else q["w2_bias"].detach().to(torch.float32, copy=True)
    s13, s2 = q["w1_scale"], q["w2_scale"]
    if w1.dtype == _MXFP4 and quant == "fp8_mxfp4":
        w13 = MXFP4Tensor(own(rows(w1)), own(rows(s13)))
        return MoEWeights(w13, MXFP4Tensor(own(w2), own(s2)), w13_bias=b13, w2_bias=b2)
    w13, w2d = rows(_float_values(w1.detach(), s13)), _float_values(w2.detach(), s2)  # (FP8: dequantised first)
    if quant == "bf16":  # a bf16 pack must not alias the caller's tensors (the cache holds it weakly by w1)
        w13, w2d = w13.to(torch.bfloat16, copy=True), w2d.to(torch.bfloat16, copy=True)
    return MoEWeights.from_float(w13.contiguous(), w2d.contiguous(), quant=quant, w13_bias=b13, w2_bias=b2)


def _pack_raw(w1, w2, top_k: int, max_tokens: int, quant: str, act: str, interleaved: bool, backend, q) -> PackedMoE:
    """MoEConfig + engine_weights, prepacked (the cache's miss path)."""
    e, two_i, h = _logical_shape(w1)
    cfg = MoEConfig(
        h, two_i // 2, e, top_k, max_tokens_per_rank=max_tokens, quant=quant, masked_ids=True, activation=act,
        has_bias=q["w1_bias"] is not None,
    )  # fmt: skip
    return prepack(cfg, engine_weights(w1, w2, quant, interleaved, q), w1.device, backend)


def _check_biases(w1, w1_bias, w2_bias) -> None:
    if (w1_bias is None) != (w2_bias is None):
        _fail("w1_bias" if w1_bias is None else "w2_bias", "w1_bias and w2_bias go together (both or neither)")
    if w1_bias is None:
        return
    e, two_i, h = _logical_shape(w1)
    for arg, b, shape in (("w1_bias", w1_bias, (e, two_i)), ("w2_bias", w2_bias, (e, h))):
        if not isinstance(b, torch.Tensor) or tuple(b.shape) != shape or not b.is_floating_point():
            _fail(arg, f"must be a floating tensor of shape {shape}, got {_describe(b)}")
        if b.device != w1.device:
            _fail(arg, f"is on {b.device} but w1 is on {w1.device}")


# ------------------------------------------------------------------------------------------------ the entry
def _describe(v) -> str:
    return f"{v.dtype} {tuple(v.shape)}" if isinstance(v, torch.Tensor) else type(v).__name__


def _is_tensor(v, dims: int, dtypes: tuple) -> bool:
    return isinstance(v, torch.Tensor) and v.dim() == dims and v.dtype in dtypes


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


def _quant_args(quant_config, given: dict) -> dict:
    """vLLM's quantisation arguments (_QUANT_ARGS) from the keywords or from quant_config (not both), with those gcmoe
    cannot honour refused unless at their "not used" value."""
    for name in given.keys() - _QUANT_ARGS.keys():
        raise TypeError(f"gcmoe.fused_experts() got an unexpected keyword argument {name!r}")
    if quant_config is not None:
        for name, v in given.items():
            if v is not _QUANT_ARGS[name]:
                _fail(name, "given both as a keyword and in quant_config: pass one")
        vllm_name = {"per_channel_quant": "per_act_token_quant"}
        given = {k: getattr(quant_config, vllm_name.get(k, k), d) for k, d in _QUANT_ARGS.items()}
    q = {**_QUANT_ARGS, **given}
    for name, unused in list(_QUANT_ARGS.items())[6:]:
        v = q[name]
        if (v is not None) if unused is None else bool(v):
            shown = _describe(v) if isinstance(v, torch.Tensor) else repr(v)
            _fail(
                name,
                f"{shown} is not supported: gcmoe quantises activations itself (FP8 1x128, dynamic scales) and "
                "takes unquantised, MXFP4-block or FP8 128x128-block weights without zero points",
            )
    return q


def _packed(w1, w2, q: dict, top_k: int, activation: str, max_tokens: int, quant: str, backend) -> PackedMoE:
    """The handle passed as w1 (checked against the call), or the cached pack of the engine's weights."""
    act, interleaved = _activation(activation)
    if not isinstance(w1, PackedMoE):
        _check_raw(w1, w2, q)
        options = (top_k, max_tokens, quant, act, interleaved, backend)
        build = lambda: _pack_raw(w1, w2, *options, q)
        return cached_pack(w1, w2, options, build, tuple(q[k] for k in ("w1_bias", "w2_bias", "w1_scale", "w2_scale")))
    if w2 is not None:
        _fail("w2", "must be None when w1 is a PackedMoE handle (the handle holds both projections)")
    for name, unused in list(_QUANT_ARGS.items())[:6]:
        if q[name] is not unused:
            _fail(name, f"must be {unused} with a PackedMoE handle (the handle's layer holds its weights and biases)")
    if w1.cfg.activation != act:
        _fail(
            "activation",
            f"{activation!r} (MoEConfig activation {act!r}) but the handle's layer has {w1.cfg.activation!r}",
        )
    return w1


def _local_ids(topk_ids, expert_map, global_num_experts: int, cfg: MoEConfig) -> torch.Tensor:
    """topk_ids as the layer takes them: mapped through expert_map (vLLM's EP) where given."""
    if expert_map is None:
        if global_num_experts not in (-1, cfg.num_experts):
            _fail(
                "global_num_experts",
                f"{global_num_experts} but the layer has E = {cfg.num_experts} experts and no expert_map was given "
                "(without one the ids index w1 directly)",
            )
        return topk_ids
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
        _fail("expert_map", "needs a handle built with MoEConfig(..., masked_ids=True): non-local experts map to -1")
    return map_expert_ids(topk_ids, expert_map, cfg.local_experts)


def _output_dtype(hidden_states, out, out_dtype, inplace: bool) -> torch.dtype:
    """The output's dtype (out_dtype, else hidden_states'), with out checked against it."""
    dtype = hidden_states.dtype if out_dtype is None else out_dtype
    if dtype not in _FLOAT_DTYPES:
        _fail("out_dtype", f"must be torch.bfloat16, torch.float16 or torch.float32, got {dtype}")
    if inplace and (out is not None or dtype != hidden_states.dtype):
        _fail("inplace", f"writes into hidden_states ({hidden_states.dtype}): not with out= or another out_dtype")
    want = (tuple(hidden_states.shape), dtype, hidden_states.device)
    if out is not None and not (isinstance(out, torch.Tensor) and (tuple(out.shape), out.dtype, out.device) == want):
        got = f"{_describe(out)} on {out.device}" if isinstance(out, torch.Tensor) else _describe(out)
        _fail("out", f"must be a {dtype} tensor of shape {want[0]} on {want[2]}, got {got}")
    return dtype


def fused_experts(
    hidden_states: torch.Tensor,
    w1: torch.Tensor | PackedMoE,
    w2: torch.Tensor | None,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    inplace: bool = False,
    activation: str = "silu",
    apply_router_weight_on_input: bool = False,
    global_num_experts: int = -1,
    expert_map: torch.Tensor | None = None,
    quant_config=None,
    allow_deep_gemm: bool = False,
    *,
    w1_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    block_shape: list[int] | None = None,
    use_fp8_w8a8: bool = False,
    w1_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    routed_scaling_factor: float | None = None,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    max_tokens_per_rank: int = 256,
    quant: str = "fp8_mxfp4",
    backend: str | None = None,
    **vllm_quant_args,
) -> torch.Tensor:
    """y [T, H] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(hidden_states[t]) over this rank's experts, in
    hidden_states' dtype (bf16, fp16 or fp32; the layer computes in bf16) or out_dtype, times routed_scaling_factor.
    The first twelve parameters are vLLM's fused_experts', in its order (allow_deep_gemm: a permission, unused);
    docs/integration.md maps each. inplace: written into hidden_states, which is returned; out: written into it
    (checked: shape, dtype, device), which is returned. apply_router_weight_on_input (top-1 only, as vLLM):
    hidden_states times the weight in fp32, rounded once to bf16, then routing weight 1.
    Raw weights [E, 2I, H] / [E, H, I]: bf16, fp16, fp32, or quantised with w1_scale / w2_scale (keywords or
    quant_config): MXFP4 blocks uint8 [E, N, K/2] + e8m0 uint8 [E, N, K/32] (gpt-oss), FP8 e4m3 [E, N, K] + float32
    scale_inv [E, ceil(N/128), ceil(K/128)] (DeepSeek-V3); unpacked once (engine_weights). w1_bias [E, 2I] /
    w2_bias [E, H] (gpt-oss): rows laid out like w1's (interleaved for "swigluoai"). max_tokens_per_rank / quant /
    backend configure the pack of raw weights (ignored with a handle, which carries its own weights and biases)."""
    ops.refuse_grad(hidden_states=hidden_states, topk_weights=topk_weights, w1=w1, w2=w2)
    given = dict(w1_scale=w1_scale, w2_scale=w2_scale, block_shape=block_shape, use_fp8_w8a8=use_fp8_w8a8)
    q = _quant_args(quant_config, {**given, "w1_bias": w1_bias, "w2_bias": w2_bias, **vllm_quant_args})
    if not _is_tensor(hidden_states, 2, _FLOAT_DTYPES):
        _fail("hidden_states", f"must be a bf16, fp16 or fp32 [T, H] tensor, got {_describe(hidden_states)}")
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != 2:
        _fail("topk_ids", f"must be an int [T, k] tensor, got {_describe(topk_ids)}")
    dtype = _output_dtype(hidden_states, out, out_dtype, inplace)
    factor = 1.0 if routed_scaling_factor is None else routed_scaling_factor
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not math.isfinite(factor):
        _fail("routed_scaling_factor", f"must be a finite number, got {factor!r}")
    packed = _packed(w1, w2, q, topk_ids.shape[1], activation, max_tokens_per_rank, quant, backend)
    cfg = packed.cfg
    if factor != 1 and cfg.num_shared_experts:
        _fail("routed_scaling_factor", "not with a handle's shared experts: it would scale their output too")
    if hidden_states.device != packed.device:
        _fail("hidden_states", f"is on {hidden_states.device} but the experts are on {packed.device}")
    ids = _local_ids(topk_ids, expert_map, global_num_experts, cfg)
    weights = topk_weights
    if isinstance(weights, torch.Tensor) and weights.is_floating_point() and weights.dtype != torch.float32:
        weights = weights.float()
    x = hidden_states.to(torch.bfloat16)
    if apply_router_weight_on_input:
        if topk_ids.shape[1] != 1:
            _fail("apply_router_weight_on_input", f"True needs top-1 routing (as vLLM), got k = {topk_ids.shape[1]}")
        x = (hidden_states.float() * weights).to(torch.bfloat16)
        weights = weights * 0 + 1  # 1 where finite: a non-finite routing weight is still refused by the layer
    try:
        y = moe(x, ids, weights, packed)
    except ValueError as e:
        if expert_map is None or "topk_ids" not in str(e):
            raise
        raise ValueError(
            f"{e} (fused_experts mapped the global topk_ids through expert_map: local id {cfg.local_experts} "
            f"stands for a global id outside [-1, {expert_map.shape[0]}); any other bad local id is an expert_map "
            "entry outside [-1, E_local))"
        ) from e
    y = (y.float() * factor).to(dtype) if factor != 1 else y.to(dtype)
    target = hidden_states if inplace else out
    return y if target is None else target.copy_(y)


def fused_experts_masked(
    hidden_states: torch.Tensor,
    w1: torch.Tensor | PackedMoE,
    w2: torch.Tensor | None,
    masked_m: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    max_tokens_per_rank: int | None = None,
    **options,
) -> torch.Tensor:
    """DeepEP low-latency's masked layout: hidden_states [E_local, max_tokens, H] with masked_m [E_local] (int32 /
    int64: the valid rows of each expert) -> y [E_local, max_tokens, H]: row r of expert e is expert e applied to it
    (weight 1) for r < masked_m[e], zero past it (whatever those input rows hold).

    One fused_experts call over the flattened rows, top-1, with the expert index as topk_ids and -1 (masked) past
    masked_m: no host sync, so it is captured in a CUDA graph like any call. max_tokens_per_rank defaults to
    E_local * max_tokens (the flattened rows; at most MoEConfig's 4096). options: fused_experts' keywords for the
    weights and the output (activation, quant_config, w1_scale, w2_scale, w1_bias, w2_bias, routed_scaling_factor,
    out_dtype, quant, backend). A PackedMoE handle needs MoEConfig(top_k=1, masked_ids=True)."""
    for name in ("inplace", "apply_router_weight_on_input", "global_num_experts", "expert_map"):
        if name in options:
            _fail(name, "does not apply to fused_experts_masked (a row's expert is its position)")
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 3:
        _fail("hidden_states", f"must be a [E_local, max_tokens, H] tensor, got {_describe(hidden_states)}")
    e, m, h = hidden_states.shape
    if isinstance(w1, PackedMoE) and (w1.cfg.top_k, w1.cfg.masked_ids, w1.cfg.local_experts) != (1, True, e):
        _fail("w1", f"a handle for the masked form needs MoEConfig(num_experts={e}, top_k=1, masked_ids=True)")
    if isinstance(w1, torch.Tensor) and w1.dim() == 3 and w1.shape[0] != e:
        _fail("hidden_states", f"holds rows of {e} experts but w1 has {w1.shape[0]}")
    dev = hidden_states.device
    if not _is_tensor(masked_m, 1, (torch.int32, torch.int64)) or (masked_m.shape[0], masked_m.device) != (e, dev):
        _fail("masked_m", f"must be an int32 / int64 tensor [{e}] on {dev}, got {_describe(masked_m)}")
    if out is not None and not (isinstance(out, torch.Tensor) and out.shape == (e, m, h) and out.is_contiguous()):
        _fail("out", f"must be a contiguous tensor of shape {(e, m, h)}, got {_describe(out)}")
    expert = torch.arange(e, dtype=torch.int32, device=dev).unsqueeze(1)
    valid = torch.arange(m, device=dev).unsqueeze(0) < masked_m.unsqueeze(1)
    ids = torch.where(valid, expert, MASKED_ID).to(torch.int32).reshape(e * m, 1)
    ones = torch.ones(e * m, 1, device=dev)
    flat_out = None if out is None else out.view(e * m, h)
    y = fused_experts(
        hidden_states.reshape(e * m, h), w1, w2, ones, ids, out=flat_out,
        max_tokens_per_rank=max_tokens_per_rank or e * m, **options,
    )  # fmt: skip
    return y.view(e, m, h) if out is None else out
