"""MoE layer configuration, the design's limits, and call-argument validation (pure Python + cheap tensor checks).

Every limit the GC-MoE design states is checked here, once, before anything launches:

    I <= 4096      the W1-completion bitmap that lets W2 start on a block is 64 bits of 64-wide I tiles
    I % 128 == 0   K128 tiles of W2 (and FP8 1x128 scale blocks of the intermediate)
    H % 256 == 0   W1 K128 tiles and the W2 output tiling
    k + shared <= 32, E <= 2048, P <= 72, E % P == 0

The two multiples bind the kernels, not the caller: a layer whose H or I is not a multiple (gpt-oss: H = I = 2880) is
padded internally — `padded()` is the kernel-facing config (I <= 4096 is checked on the padded I), the weights get
zero rows / columns / bias entries once at load and x zero columns per call, and the caller sees x [T, H] in, y [T,
H] out. The padding is exact (gcmoe_core.reference.MoEWeights.padded says why).

The expert's activation ("swiglu", or gpt-oss' "swiglu_clamped" with swiglu_alpha / swiglu_limit) is written out in
gcmoe_core.reference.Activation, the biases (has_bias; not with shared experts) in gcmoe_core.reference.

Call arguments (x, topk_ids, topk_weights) are checked for type, dtype, shape, device and contiguity on every call
(host-side metadata only, graph-capture safe). Value checks (ids in range — or -1 where MoEConfig.masked_ids says a
slot may be masked — finite routing weights) need a device read; they run when `check_values` is true, which the
operator sets unless a CUDA graph is being captured.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal

import torch

MAX_INTERMEDIATE = 4096
INTERMEDIATE_MULTIPLE = 128
HIDDEN_MULTIPLE = 256
MAX_SLOTS = 32  # top_k + shared experts
MAX_EXPERTS = 2048
MAX_EP = 72
MAX_TOKENS_PER_RANK = 4096  # workspace sizing bound; decode is <= 512 in practice

QuantMode = Literal["fp8_mxfp4", "bf16"]
ActivationKind = Literal["swiglu", "swiglu_clamped"]
ACTIVATIONS = ("swiglu", "swiglu_clamped")


@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden_size: int
    intermediate_size: int
    num_experts: int
    top_k: int
    num_shared_experts: int
    activation: ActivationKind = "swiglu"
    has_bias: bool = False


# The shapes the design benchmarks: (H, I, E, top-k, shared); gpt-oss (public config.json of openai/gpt-oss-120b and
# -20b: hidden 2880, intermediate 2880, 128 / 32 local experts, 4 per token, clamped SwiGLU, biased projections).
MODEL_SHAPES: dict[str, ModelShape] = {
    s.name: s
    for s in (
        ModelShape("deepseek-v4-flash", 4096, 2048, 256, 6, 1),
        ModelShape("deepseek-v4-pro", 7168, 3072, 384, 6, 1),
        ModelShape("deepseek-v3", 7168, 2048, 256, 8, 1),
        ModelShape("glm-5", 6144, 2048, 256, 8, 1),
        ModelShape("glm-4.5", 5120, 1536, 160, 8, 1),
        ModelShape("gpt-oss-120b", 2880, 2880, 128, 4, 0, "swiglu_clamped", True),
        ModelShape("gpt-oss-20b", 2880, 2880, 32, 4, 0, "swiglu_clamped", True),
    )
}


def _fail(arg: str, msg: str) -> None:
    raise ValueError(f"gcmoe: {arg}: {msg}")


@dataclass(frozen=True)
class MoEConfig:
    """One MoE layer as one rank sees it.

    num_experts is the global routed-expert count E; each of the ep_size ranks holds E / ep_size of them.
    quant: "fp8_mxfp4" (FP8 E4M3 activations x MXFP4 weights, the product path) or "bf16" (unquantised).
    masked_ids: topk_ids == -1 marks a slot that contributes nothing (a serving engine's padded CUDA-graph rows,
    vLLM's expert_map for non-local experts, DeepEP's masked layout): it is dropped on every backend, its routing
    weight is neither used nor checked, and a token whose every slot is -1 yields its shared-expert output only
    (zeros without shared experts). Any other id outside [0, E) is still an error.
    activation / swiglu_alpha / swiglu_limit / has_bias: the expert's activation and biases (module docstring).
    H and I need not be multiples of the kernels' tiles (`padded()`).
    """

    hidden_size: int
    intermediate_size: int
    num_experts: int
    top_k: int
    num_shared_experts: int = 0
    ep_size: int = 1
    max_tokens_per_rank: int = 256
    quant: QuantMode = "fp8_mxfp4"
    masked_ids: bool = False
    activation: ActivationKind = "swiglu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    has_bias: bool = False

    def __post_init__(self) -> None:
        for f in ("hidden_size", "intermediate_size", "num_experts", "top_k", "ep_size", "max_tokens_per_rank"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                _fail(f, f"must be a positive int, got {v!r}")
        s = self.num_shared_experts
        if not isinstance(s, int) or isinstance(s, bool) or s < 0:
            _fail("num_shared_experts", f"must be an int >= 0, got {s!r}")
        e, k, p = self.num_experts, self.top_k, self.ep_size
        i = self.padded_intermediate  # (H and I themselves are padded to the kernels' multiples internally)
        if i > MAX_INTERMEDIATE:
            _fail(
                "intermediate_size",
                f"I = {self.intermediate_size} (padded to {i}) exceeds the limit I <= {MAX_INTERMEDIATE} "
                "(64-bit W1 completion bitmap)",
            )
        if k + s > MAX_SLOTS:
            _fail("top_k", f"top_k + num_shared_experts = {k} + {s} exceeds the limit {MAX_SLOTS}")
        if e > MAX_EXPERTS:
            _fail("num_experts", f"E = {e} exceeds the limit E <= {MAX_EXPERTS}")
        if k > e:
            _fail("top_k", f"top_k = {k} exceeds the number of experts E = {e}")
        if p > MAX_EP:
            _fail("ep_size", f"P = {p} exceeds the limit P <= {MAX_EP}")
        if e % p:
            _fail("ep_size", f"E = {e} must be divisible by P = {p} (experts are sharded E/P per rank)")
        if self.max_tokens_per_rank > MAX_TOKENS_PER_RANK:
            _fail("max_tokens_per_rank", f"{self.max_tokens_per_rank} exceeds the limit {MAX_TOKENS_PER_RANK}")
        if self.quant not in ("fp8_mxfp4", "bf16"):
            _fail("quant", f"must be 'fp8_mxfp4' or 'bf16', got {self.quant!r}")
        if not isinstance(self.masked_ids, bool):
            _fail("masked_ids", f"must be a bool, got {self.masked_ids!r}")
        if self.activation not in ACTIVATIONS:
            _fail("activation", f"must be one of {', '.join(map(repr, ACTIVATIONS))}, got {self.activation!r}")
        for f in ("swiglu_alpha", "swiglu_limit"):
            v = getattr(self, f)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
                _fail(f, f"must be a finite number > 0, got {v!r}")
        if not isinstance(self.has_bias, bool):
            _fail("has_bias", f"must be a bool, got {self.has_bias!r}")
        if self.has_bias and s:
            _fail("has_bias", f"biased experts with {s} shared expert(s) are not supported (no bias for shared ones)")

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.ep_size

    @property
    def slots(self) -> int:
        """Expert applications per token: routed top-k plus shared experts."""
        return self.top_k + self.num_shared_experts

    @property
    def padded_hidden(self) -> int:
        """H rounded up to the kernels' multiple (HIDDEN_MULTIPLE)."""
        return -(-self.hidden_size // HIDDEN_MULTIPLE) * HIDDEN_MULTIPLE

    @property
    def padded_intermediate(self) -> int:
        """I rounded up to the kernels' multiple (INTERMEDIATE_MULTIPLE)."""
        return -(-self.intermediate_size // INTERMEDIATE_MULTIPLE) * INTERMEDIATE_MULTIPLE

    @property
    def needs_padding(self) -> bool:
        return (self.padded_hidden, self.padded_intermediate) != (self.hidden_size, self.intermediate_size)

    def padded(self) -> MoEConfig:
        """The kernel-facing config: H and I padded to the kernels' multiples (itself when they already are)."""
        if not self.needs_padding:
            return self
        return self.replace(hidden_size=self.padded_hidden, intermediate_size=self.padded_intermediate)

    def replace(self, **changes) -> MoEConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_model(cls, name: str, ep_size: int = 1, **overrides) -> MoEConfig:
        """A named model's layer under EP = ep_size (see MODEL_SHAPES)."""
        try:
            s = MODEL_SHAPES[name]
        except KeyError:
            raise ValueError(f"gcmoe: model: unknown model {name!r}; known: {', '.join(MODEL_SHAPES)}") from None
        expert = {"activation": s.activation, "has_bias": s.has_bias}
        return cls(
            s.hidden_size,
            s.intermediate_size,
            s.num_experts,
            s.top_k,
            s.num_shared_experts,
            ep_size,
            **{**expert, **overrides},
        )

    @classmethod
    def ep_slice(cls, name: str, ep: int, **overrides) -> MoEConfig:
        """The routed experts one rank holds under EP = ep, as a world-size-1 layer (E/ep experts, every token routed
        among them): the per-rank compute of the GEMM benchmarks."""
        full = cls.from_model(name, ep_size=ep)
        return full.replace(**{"num_experts": full.local_experts, "ep_size": 1, **overrides})


def _check_tensor(arg: str, t, dtypes: tuple[torch.dtype, ...], shape: tuple[int | None, ...]) -> None:
    if not isinstance(t, torch.Tensor):
        _fail(arg, f"must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        _fail(arg, f"dtype must be {' or '.join(str(d) for d in dtypes)}, got {t.dtype}")
    if t.dim() != len(shape):
        _fail(arg, f"must be {len(shape)}-D, got shape {tuple(t.shape)}")
    for axis, (have, want) in enumerate(zip(t.shape, shape)):
        if want is not None and have != want:
            _fail(arg, f"shape {tuple(t.shape)}: dim {axis} must be {want}")
    if not t.is_contiguous():
        _fail(arg, f"must be contiguous (strides {t.stride()})")
    # a lazy view: the kernel backends read the memory, which holds other values (real tensors only: not traced)
    if not torch.compiler.is_compiling() and (t.is_neg() or t.is_conj()):
        _fail(arg, "is a lazily negated / conjugated view; pass a materialised tensor (.resolve_neg())")


def validate_call(
    cfg: MoEConfig,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    device: torch.device | None = None,
    check_values: bool = True,
) -> None:
    """Raise ValueError naming the argument and the limit for any bad call argument; nothing launches before."""
    if (
        not check_values
        and not torch.compiler.is_compiling()
        and plain_cuda_call(cfg, x, topk_ids, topk_weights, device)
    ):
        return
    _check_tensor("x", x, (torch.bfloat16,), (None, cfg.hidden_size))
    if not torch.compiler.is_compiling() and x.data_ptr() % 4:  # (the kernels load x two bf16 at a time)
        _fail("x", f"data must be 4-byte aligned, got address {x.data_ptr():#x} (an odd storage offset)")
    t = x.shape[0]
    if t > cfg.max_tokens_per_rank:
        _fail("x", f"T = {t} tokens exceeds max_tokens_per_rank = {cfg.max_tokens_per_rank}")
    _check_tensor("topk_ids", topk_ids, (torch.int32, torch.int64), (t, cfg.top_k))
    _check_tensor("topk_weights", topk_weights, (torch.float32,), (t, cfg.top_k))
    if device is not None and x.device != device:
        _fail("x", f"is on {x.device} but the layer's weights are on {device}")
    for arg, ten in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if ten.device != x.device:
            _fail(arg, f"is on {ten.device} but x is on {x.device}")
    if check_values:
        check_call_values(cfg.num_experts, topk_ids, topk_weights, cfg.masked_ids)


def plain_cuda_call(cfg: MoEConfig, x, topk_ids, topk_weights, device: torch.device | None) -> bool:
    """The common case of validate_call's argument checks in a few attribute reads (an eager call costs host time per
    layer): plain contiguous CUDA tensors of the right dtypes and shapes on the layer's device. True only where the
    full checks pass; anything else (False) takes them, which name the problem. Not for traced calls (dynamo)."""
    if device is None or device.type != "cuda":
        return False
    if not type(x) is type(topk_ids) is type(topk_weights) is torch.Tensor:
        return False
    xs = x.shape
    if len(xs) != 2 or xs[1] != cfg.hidden_size or xs[0] > cfg.max_tokens_per_rank:
        return False
    slots = (xs[0], cfg.top_k)
    dev = device.index
    return (
        topk_ids.shape == slots
        and topk_weights.shape == slots
        and x.dtype == torch.bfloat16
        and topk_ids.dtype in _IDS
        and topk_weights.dtype == torch.float32
        and x.get_device() == dev
        and topk_ids.get_device() == dev
        and topk_weights.get_device() == dev
        and x.is_contiguous()
        and topk_ids.is_contiguous()
        and topk_weights.is_contiguous()
        and not (x.is_neg() or topk_ids.is_neg() or topk_weights.is_neg())
        and x.data_ptr() % 4 == 0
    )


_IDS = (torch.int32, torch.int64)
MASKED_ID = -1  # with MoEConfig.masked_ids: the id of a slot that contributes nothing


def check_call_values(
    num_experts: int, topk_ids: torch.Tensor, topk_weights: torch.Tensor, masked_ids: bool = False
) -> None:
    """The checks that read device memory — one host sync: ids in [0, E) (or -1 with masked_ids, whose weights are
    not checked), finite routing weights. No tokens (T = 0): nothing to check."""
    if topk_ids.numel() == 0:
        return
    ids = topk_ids.long()
    bad_w = ~torch.isfinite(topk_weights)
    if masked_ids:
        masked = ids == MASKED_ID
        bad_w = bad_w & ~masked
        ids = torch.where(masked, 0, ids)  # the range check below sees only the unmasked ids
    lo, hi, bad_w = torch.stack((ids.min(), ids.max(), bad_w.any().long())).tolist()
    if lo < 0:
        allowed = f"[0, {num_experts}) or {MASKED_ID} (masked_ids)" if masked_ids else f"[0, {num_experts})"
        _fail("topk_ids", f"holds a negative expert id ({lo}); ids must be in {allowed}")
    if hi >= num_experts:
        _fail("topk_ids", f"holds expert id {hi}, out of range [0, {num_experts})")
    if bad_w:
        _fail("topk_weights", "holds a non-finite routing weight (NaN or Inf)")


def validate_weights(
    cfg: MoEConfig,
    w13: torch.Tensor,
    w2: torch.Tensor,
    shared_w13: torch.Tensor | None = None,
    shared_w2: torch.Tensor | None = None,
) -> None:
    """Unquantised weights as loaded: w13 [E_local, 2I, H] (gate rows, then up rows), w2 [E_local, H, I]."""
    h, i, el, s = cfg.hidden_size, cfg.intermediate_size, cfg.local_experts, cfg.num_shared_experts
    floats = (torch.bfloat16, torch.float16, torch.float32)
    _check_tensor("w13", w13, floats, (el, 2 * i, h))
    _check_tensor("w2", w2, floats, (el, h, i))
    if (shared_w13 is None) != (shared_w2 is None):
        _fail("shared_w13", "shared_w13 and shared_w2 must be given together")
    if s and shared_w13 is None:
        _fail("shared_w13", f"config has num_shared_experts = {s} but no shared expert weights were given")
    if shared_w13 is not None:
        if not s:
            _fail("shared_w13", "shared expert weights given but config.num_shared_experts = 0")
        _check_tensor("shared_w13", shared_w13, floats, (s, 2 * i, h))
        _check_tensor("shared_w2", shared_w2, floats, (s, h, i))
    for name, w in (("w13", w13), ("w2", w2), ("shared_w13", shared_w13), ("shared_w2", shared_w2)):
        if w is not None and w.device != w13.device:
            _fail(name, f"is on {w.device} but w13 is on {w13.device}")
        if w is not None and w.is_meta:
            _fail(name, "is a meta tensor: it holds no values to load")
        if w is not None and not bool(torch.isfinite(w).all()):
            _fail(name, "holds non-finite values (NaN or Inf); MXFP4 cannot encode them")
