"""Public API: a layer object and a functional form over the same prepacked weights and plan.

    cfg = gcmoe.MoEConfig.from_model("deepseek-v4-flash")            # or MoEConfig(H, I, E, top_k, ...)
    layer = gcmoe.MoELayer(cfg, device="cuda")                       # backend chosen from the device (or backend=)
    layer.load_weights(w13, w2, shared_w13, shared_w2)               # BF16 -> MXFP4 -> prepacked for the backend
    layer.load_mxfp4(w13_mxfp4, w2_mxfp4)                            # or standard MXFP4 expert tensors as they are
    y = layer(x, topk_ids, topk_weights)                             # [T, H] bf16

    packed = gcmoe.prepack(cfg, weights, device="cuda")              # functional: MoEWeights -> PackedMoE
    y = gcmoe.moe(x, topk_ids, topk_weights, packed)

Every call validates its arguments (ValueError naming the argument and the limit) before anything launches. Eager
calls go straight to the layer's plan; under torch.compile the call is the custom op torch.ops.gcmoe.moe_forward.
A layer owns its plan (weights, graphs); its transient call state (workspace, partitions) lives in lanes it shares
with the layers of its shape class that run one after another (gcmoe.pool: one lane per stream or micro-batch).

Padding (H or I not a multiple of the kernels' tiles, e.g. gpt-oss's 2880): prepack pads the weights once to
cfg.padded() (MoEWeights.padded: zero rows, columns and bias entries, exact) and every backend sees only the padded
shapes; per call x is copied into the caller stream's zero-padded buffer (InputPadding) and y is a copy of the first
H columns of the padded output. The caller's config and tensors keep H.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gcmoe_core import env
from gcmoe_core.config import MoEConfig, plain_cuda_call, validate_call, validate_weights
from gcmoe_core.formats import UE8M0_NAN, MXFP4Tensor
from gcmoe_core.reference import MoEWeights

from . import ops
from .backends import LayerOptions, choose, get


@dataclass(frozen=True, eq=False)
class PackedMoE:
    """Weights prepacked for one backend on one device, and the plan (resources) that runs them."""

    cfg: MoEConfig
    backend: str
    device: torch.device
    tensors: tuple[torch.Tensor, ...]
    plan: object
    handle: int = 0
    pad: InputPadding | None = None  # H padded for the kernels (cfg.padded())

    def check(self) -> None:
        """Raise any error a call recorded on the device (synchronises)."""
        self.plan.check()


def _device(device) -> torch.device:
    """A concrete device ('cuda' -> 'cuda:<current>') so argument checks compare like with like."""
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return d


class InputPadding:
    """x [T, H] -> [T, H_pad] with zero columns [H, H_pad) for a layer whose H is padded (cfg.padded()).

    Eager: one copy of x into the caller stream's buffer [max_tokens, H_pad], whose pad columns were zeroed when it
    was made and are never written again (a buffer per stream: calls on one stream are ordered, calls on two never
    share one). Under a CUDA-graph capture or torch.compile: a functional pad (its output belongs to the graph)."""

    def __init__(self, hidden: int, padded: int, max_tokens: int):
        self.hidden, self.padded, self.max_tokens = hidden, padded, max_tokens
        self._buffers: dict[int, torch.Tensor] = {}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # (is_compiling first: dynamo cannot trace is_current_stream_capturing, a fullgraph compile would break there)
        if torch.compiler.is_compiling() or (x.is_cuda and torch.cuda.is_current_stream_capturing()):
            return torch.nn.functional.pad(x, (0, self.padded - self.hidden))
        key = torch.cuda.current_stream(x.device).cuda_stream if x.is_cuda else 0
        buf = self._buffers.get(key)
        if buf is None:  # a normal tensor even when made under inference_mode (later calls may run outside it)
            with torch.inference_mode(False):
                buf = torch.zeros(self.max_tokens, self.padded, dtype=x.dtype, device=x.device)
            self._buffers[key] = buf
        t = x.shape[0]
        buf[:t, : self.hidden].copy_(x)
        return buf[:t]


def _check_weights_match(cfg: MoEConfig, weights: MoEWeights) -> None:
    h, i, el, s = cfg.hidden_size, cfg.intermediate_size, cfg.local_experts, cfg.num_shared_experts
    if weights.quant != cfg.quant:
        raise ValueError(f"gcmoe: weights: weights are {weights.quant} but the config says quant={cfg.quant!r}")
    if tuple(weights.w13.shape) != (el, 2 * i, h):
        raise ValueError(f"gcmoe: w13: shape {tuple(weights.w13.shape)} != ({el}, {2 * i}, {h})")
    if tuple(weights.w2.shape) != (el, h, i):
        raise ValueError(f"gcmoe: w2: shape {tuple(weights.w2.shape)} != ({el}, {h}, {i})")
    if weights.num_shared != s:
        raise ValueError(f"gcmoe: shared_w13: {weights.num_shared} shared expert(s) given, config has {s}")
    if s and (tuple(weights.shared_w13.shape) != (s, 2 * i, h) or tuple(weights.shared_w2.shape) != (s, h, i)):
        raise ValueError(
            f"gcmoe: shared_w13: shapes {tuple(weights.shared_w13.shape)}, "
            f"{tuple(weights.shared_w2.shape)} != ({s}, {2 * i}, {h}), ({s}, {h}, {i})"
        )
    if (weights.biases() is not None) != cfg.has_bias:
        have = "biases were given" if weights.biases() is not None else "no biases were given"
        raise ValueError(f"gcmoe: w13_bias: {have} but the config says has_bias={cfg.has_bias}")


def _check_real_device(device: torch.device) -> None:
    if device.type == "meta":
        raise ValueError("gcmoe: device: a layer on the meta device holds no weights; use a real device")


def _check_weights_hold_values(weights: MoEWeights, device: torch.device) -> None:
    """Weights that can be loaded: with data (not meta, nor a meta target device) and finite (an MXFP4 scale byte
    0xFF is NaN) — docs/numerics.md: non-finite weights are rejected at load, whichever way they come in."""
    _check_real_device(device)
    names = ("w13", "w2", "shared_w13", "shared_w2", "w13_bias", "w2_bias")
    for name, w in zip(names, (*weights.all(), *(weights.biases() or ()))):
        parts = (w.packed, w.scale) if isinstance(w, MXFP4Tensor) else (w,) if w is not None else ()
        if any(t.is_meta for t in parts):
            raise ValueError(f"gcmoe: {name}: is a meta tensor: it holds no values to load")
        if isinstance(w, MXFP4Tensor) and bool((w.scale == UE8M0_NAN).any()):
            raise ValueError(f"gcmoe: {name}: holds NaN scales (UE8M0 byte 0x{UE8M0_NAN:X}); weights must be finite")
        if isinstance(w, torch.Tensor) and not bool(torch.isfinite(w).all()):
            raise ValueError(f"gcmoe: {name}: holds non-finite values (NaN or Inf)")


def prepack(
    cfg: MoEConfig,
    weights: MoEWeights,
    device=None,
    backend: str | None = None,
    options: LayerOptions | None = None,
) -> PackedMoE:
    """Place and convert weights once for the chosen backend and build the plan that runs them (the caller reuses
    the result across calls). With ep_size > 1 this is collective over the options' process group."""
    if not isinstance(cfg, MoEConfig) or not isinstance(weights, MoEWeights):
        raise ValueError(
            f"gcmoe: prepack: needs a MoEConfig and MoEWeights, got {type(cfg).__name__}, {type(weights).__name__}"
        )
    _check_weights_match(cfg, weights)
    device = _device(device if device is not None else weights.device)
    _check_weights_hold_values(weights, device)
    options = options or LayerOptions()
    kcfg = cfg.padded()  # what the backends see: H and I padded to the kernels' multiples (once, here)
    name = choose(device, backend, kcfg) if not options.emulate else (backend or "reference")
    impl = get(name)
    tensors = impl.prepack(kcfg, weights.to(device).padded(kcfg.hidden_size, kcfg.intermediate_size), device)
    plan = impl.plan(kcfg, tensors, device, options)
    pad = None
    if kcfg.hidden_size != cfg.hidden_size:
        pad = InputPadding(cfg.hidden_size, kcfg.hidden_size, cfg.max_tokens_per_rank)
    packed = PackedMoE(cfg, name, device, tuple(tensors), plan, pad=pad)
    object.__setattr__(packed, "handle", ops.register_plan(packed, plan))
    return packed


def moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    packed: PackedMoE,
    check_values: bool | None = None,
) -> torch.Tensor:
    """y [T, H] bf16. check_values=None follows GCMOE_CHECK_VALUES (default on): out-of-range ids and non-finite
    weights raise ValueError, at the latest on the next call (kernel backends check on the device). With H padded
    internally (cfg.padded()), y is the first H columns of the layer's [T, H_pad] output, copied (contiguous)."""
    if not isinstance(packed, PackedMoE):
        raise ValueError(f"gcmoe: packed: must be a PackedMoE (gcmoe.prepack), got {type(packed).__name__}")
    cfg = packed.cfg
    compiling = torch.compiler.is_compiling()
    if compiling or not plain_cuda_call(cfg, x, topk_ids, topk_weights, packed.device):  # (the common case first)
        validate_call(cfg, x, topk_ids, topk_weights, device=packed.device, check_values=False)
    if (x.requires_grad or topk_weights.requires_grad) and torch.is_grad_enabled():
        ops.refuse_grad(x=x, topk_weights=topk_weights)  # no backward: refused, never a silently missing gradient
    if check_values is None:
        check_values = env.get_bool("GCMOE_CHECK_VALUES")
    if x.shape[0] == 0 and cfg.ep_size == 1:
        return x.new_empty(0, cfg.hidden_size)  # nothing to do; with P > 1 an idle rank still takes part
    if packed.pad is not None:
        y = _forward(packed.pad(x), topk_ids, topk_weights, packed, check_values, compiling)
        return y[:, : cfg.hidden_size].contiguous()  # a plain [T, H] tensor (one small copy), not a view
    return _forward(x, topk_ids, topk_weights, packed, check_values, compiling)


def _forward(x, topk_ids, topk_weights, packed: PackedMoE, check_values: bool, compiling: bool) -> torch.Tensor:
    if compiling:
        return torch.ops.gcmoe.moe_forward(x, topk_ids, topk_weights, list(packed.tensors), packed.handle, check_values)
    return packed.plan.forward(x, topk_ids, topk_weights, check_values)


class MoELayer(torch.nn.Module):
    """The routed (+ shared) experts of one MoE layer on one rank.

    comm_sms: SMs of the communication partition (None: tuned per device and shape, GCMOE_COMM_SMS forces it; 0: no
    partition). group: the process group of the ep_size ranks (ep_size > 1). emulate: the backend's pipeline with
    torch models of its kernels (any device). pool: the gcmoe.LayerPool it shares lanes in (default: the device's,
    gcmoe.default_pool); name: the layer's name in errors. kernel_config / timeout_ms: see
    gcmoe.backends.LayerOptions."""

    def __init__(
        self,
        cfg: MoEConfig,
        device=None,
        backend: str | None = None,
        *,
        comm_sms: int | None = None,
        group=None,
        emulate: bool = False,
        kernel_config=None,
        timeout_ms: float | None = None,
        pool=None,
        name: str | None = None,
    ):
        super().__init__()
        self.cfg = cfg
        self.device = _device(device if device is not None else "cpu")
        self.options = LayerOptions(comm_sms, group, emulate, kernel_config, timeout_ms, pool, name)
        self.backend = backend or "reference" if emulate else choose(self.device, backend, cfg.padded())
        self.packed: PackedMoE | None = None

    def load_weights(self, w13, w2, shared_w13=None, shared_w2=None, *, w13_bias=None, w2_bias=None) -> MoELayer:
        """Unquantised weights w13 [E, 2I, H] (gate rows then up rows), w2 [E, H, I] (+ shared [S, ...]; + biases
        w13_bias [E, 2I], w2_bias [E, H] where cfg.has_bias): quantised to the config's format on the layer's
        device, then prepacked."""
        validate_weights(self.cfg, w13, w2, shared_w13, shared_w2)
        _check_real_device(self.device)  # (before the weights are quantised there)
        dev = [None if w is None else w.to(self.device) for w in (w13, w2, shared_w13, shared_w2, w13_bias, w2_bias)]
        return self.load(MoEWeights.from_float(*dev[:4], quant=self.cfg.quant, w13_bias=dev[4], w2_bias=dev[5]))

    def load_mxfp4(
        self,
        w13: MXFP4Tensor,
        w2: MXFP4Tensor,
        shared_w13: MXFP4Tensor | None = None,
        shared_w2: MXFP4Tensor | None = None,
        *,
        w13_bias: torch.Tensor | None = None,
        w2_bias: torch.Tensor | None = None,
    ) -> MoELayer:
        """Standard MXFP4 expert tensors (E2M1 low nibble first + UE8M0 per 32 along K), used as they are (+ fp32
        biases where cfg.has_bias)."""
        if self.cfg.quant != "fp8_mxfp4":
            raise ValueError(f"gcmoe: weights: MXFP4 weights need quant='fp8_mxfp4', config has {self.cfg.quant!r}")
        for name, w in (("w13", w13), ("w2", w2), ("shared_w13", shared_w13), ("shared_w2", shared_w2)):
            if not isinstance(w, MXFP4Tensor) and (w is not None or not name.startswith("shared")):
                raise ValueError(f"gcmoe: {name}: must be an MXFP4Tensor, got {type(w).__name__}")
        return self.load(MoEWeights(w13, w2, shared_w13, shared_w2, w13_bias, w2_bias))

    def load(self, weights: MoEWeights) -> MoELayer:
        self.packed = prepack(self.cfg, weights, self.device, self.backend, self.options)
        return self

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            raise RuntimeError("gcmoe: MoELayer: no weights loaded (call load_weights, load_mxfp4 or load first)")
        return moe(x, topk_ids, topk_weights, self.packed)

    def check(self) -> None:
        """Raise any error a call recorded on the device (CommError after a failed cross-rank wait, ValueError for
        bad ids / weights in a call made with value checks off or captured in a graph); synchronises."""
        if self.packed is not None:
            self.packed.check()

    def recover(self) -> None:
        """After a CommError: reset the layer's cross-rank state so calls start over (collective for ep_size > 1:
        every rank calls it)."""
        if self.packed is not None:
            self.packed.plan.recover()

    def describe(self) -> dict:
        """What runs: backend, partition sizes, the path per token bucket."""
        if self.packed is None:
            return {"backend": self.backend, "loaded": False}
        return self.packed.plan.describe()

    def extra_repr(self) -> str:
        c = self.cfg
        return (
            f"H={c.hidden_size}, I={c.intermediate_size}, E={c.num_experts}, top_k={c.top_k}, "
            f"shared={c.num_shared_experts}, ep_size={c.ep_size}, quant={c.quant}, backend={self.backend}, "
            f"device={self.device}"
        )
