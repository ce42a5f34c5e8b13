"""The backend protocol (what a backend and its plans provide) and the host checks backends share. Backends import
this module, never the package: gcmoe.backends imports every backend to build its registry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from gcmoe_core.config import MoEConfig
from gcmoe_core.cutedsl import dsl_available
from gcmoe_core.formats import MXFP4Tensor
from gcmoe_core.reference import MoEWeights


class BackendUnavailable(RuntimeError):
    """The requested backend cannot run here; the message names what is missing."""


@dataclass(frozen=True)
class LayerOptions:
    """How a layer runs, beyond its config (all optional).

    comm_sms     SMs of the communication partition: None = tuned for this device and shape (GCMOE_COMM_SMS forces
                 one), 0 = no partition (every role on the caller's stream, in order), else 8..48 in steps of 8
    group        torch.distributed process group of the ep_size ranks (ep_size > 1; default: the world group)
    emulate      run the kernel backend's pipeline with torch models of its kernels (any device; tests, CPU CI)
    kernel_config  backend-specific kernel configuration forcing every call's choice (tests, ablations)
    timeout_ms   bound on every cross-rank / cross-partition wait (default GCMOE_COMM_TIMEOUT_MS)
    pool         the gcmoe.LayerPool whose lanes the layer shares (default: gcmoe.default_pool of its device)
    name         the layer's name in error messages (e.g. "model.layers.3.mlp")
    """

    comm_sms: int | None = None
    group: Any = None
    emulate: bool = False
    kernel_config: Any = None
    timeout_ms: float | None = None
    pool: Any = None
    name: str | None = None


class LayerPlan(Protocol):
    """One layer's resources and its forward, built once by Backend.plan."""

    def forward(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, check_values: bool
    ) -> torch.Tensor:
        """y [T, H] bf16 (arguments already validated for dtype, shape and device). check_values: raise ValueError
        for out-of-range ids / non-finite weights no later than the next call (kernel backends check on the device,
        and never dereference a bad id)."""

    def check(self) -> None:
        """Raise any error a call recorded on the device (CommError, ValueError); synchronises."""

    def recover(self) -> None:
        """Reset cross-rank state after a CommError (collective for P > 1); a no-op where there is none."""

    def describe(self) -> dict:
        """What runs: backend, partition, modes per token bucket (for logs and benchmark records)."""


class Backend(Protocol):
    """missing: None when it runs there, else what is missing (host checks); prepack: once, at load, MoEWeights ->
    the backend's device tensors; plan: once per layer."""

    name: str
    auto: bool  # `auto` may choose it

    def missing(self, device: torch.device, cfg: MoEConfig | None = None) -> str | None: ...

    def prepack(self, cfg: MoEConfig, weights: MoEWeights, device: torch.device) -> tuple[torch.Tensor, ...]: ...

    def plan(
        self, cfg: MoEConfig, tensors: tuple[torch.Tensor, ...], device: torch.device, options: LayerOptions
    ) -> LayerPlan: ...


def cuda_missing(device: torch.device, capability: tuple[int, int]) -> str | None:
    """None when `device` is a CUDA device of this compute capability, else what is missing."""
    if device.type != "cuda":
        return f"a CUDA device of compute capability {capability[0]}.{capability[1]} (got {device})"
    if not torch.cuda.is_available():
        return "a CUDA device (torch.cuda.is_available() is False)"
    have = torch.cuda.get_device_capability(device)
    if have != capability:
        return f"compute capability {capability[0]}.{capability[1]} (device {device} is {have[0]}.{have[1]})"
    return None


def kernel_package_missing(module: str, cfg: MoEConfig | None) -> str | None:
    """What a kernel package (gcmoe_gemm_sm90 / gcmoe_gemm_sm103) lacks for this layer: CuTe DSL, the shape, the
    quantisation mode; None when it has everything."""
    try:
        mod = __import__(module)
    except ImportError as e:
        return f"the {module} package ({e})"
    missing = dsl_available()
    if missing is None and cfg is not None:
        why = mod.layer_missing(cfg.hidden_size, cfg.intermediate_size, cfg.local_experts + cfg.num_shared_experts)
        if why:
            return f"a layer shape its kernels take ({why})"
        if cfg.quant != "fp8_mxfp4":
            return "quant='fp8_mxfp4' (its kernels are FP8 x MXFP4)"
        if (cfg.activation != "swiglu" or cfg.has_bias) and not getattr(mod, "CLAMPED_SWIGLU_AND_BIAS", False):
            return "activation='swiglu' without biases (its kernels' epilogues have no other)"
    return missing


def flatten_weights(weights: MoEWeights) -> tuple[torch.Tensor, ...]:
    """MoEWeights -> its tensors in order (MXFP4 as packed, scale), then the biases; None entries dropped."""
    out: list[torch.Tensor] = []
    for w in weights.all():
        if w is not None:
            out += [w.packed, w.scale] if isinstance(w, MXFP4Tensor) else [w]
    return tuple(out) + (weights.biases() or ())
