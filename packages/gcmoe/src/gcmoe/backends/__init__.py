"""Backends of the operator: one object per implementation behind a small protocol, and how one is chosen.

    backend = BACKENDS["sm90"]
    backend.missing(device, cfg)                         # None when it runs there, else what is missing (host checks)
    tensors = backend.prepack(cfg, weights, device)      # once, at load: MoEWeights -> the backend's device tensors
    plan = backend.plan(cfg, tensors, device, options)   # once per layer: workspaces, partition, graphs, fallback
    y = plan.forward(x, topk_ids, topk_weights, check_values)   # per call (arguments already validated)

    reference  plain torch (gcmoe-core), any device; the ground truth and the CPU path
    sm90       Hopper (sm_90a): gcmoe-comm's publish / dispatch and finalize kernels around gcmoe-gemm-sm90's W1 / W2,
               on two green-context partitions, replayed as captured role graphs (backends/sm90.py)
    sm103      Blackwell (sm_103a): gcmoe-gemm-sm103's tcgen05 block-scaled W1 / W2 (compiled and emulated only)

`choose(device, requested, cfg)`: an explicit request (argument, else GCMOE_BACKEND) must be runnable or it raises
BackendUnavailable naming what is missing; "auto" takes the first runnable backend whose `auto` flag is set, in
AUTO_ORDER. sm103 has never run on a Blackwell GPU: it is used only when asked for by name.

A plan is what a layer owns: every device resource its calls need (workspaces, partition streams, captured graphs)
lives in it, never in a module-global cache. `LayerOptions(emulate=True)` asks a kernel backend for a plan that runs
the same pipeline with torch models of its kernels on any device (what CPU CI drives end to end).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from gcmoe_core import env
from gcmoe_core.config import MoEConfig
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
    """

    comm_sms: int | None = None
    group: Any = None
    emulate: bool = False
    kernel_config: Any = None
    timeout_ms: float | None = None


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


def get(name: str) -> Backend:
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(f"gcmoe: backend: unknown backend {name!r}; known: {', '.join(NAMES)} or 'auto'") from None


def choose(device: torch.device, requested: str | None = None, cfg: MoEConfig | None = None) -> str:
    req = requested or env.get("GCMOE_BACKEND")
    if req == "auto":
        why = {n: BACKENDS[n].missing(device, cfg) for n in AUTO_ORDER if BACKENDS[n].auto}
        for name, missing in why.items():
            if missing is None:
                return name
        raise BackendUnavailable(
            f"gcmoe: no backend runs this layer on {device}: " + "; ".join(f"{n} needs {m}" for n, m in why.items())
        )
    why = get(req).missing(device, cfg)
    if why is not None:
        raise BackendUnavailable(f"gcmoe: backend {req!r} cannot run on {device}: it needs {why}")
    return req


def kernel_package_missing(module: str, cfg: MoEConfig | None) -> str | None:
    """What a kernel package (gcmoe_gemm_sm90 / gcmoe_gemm_sm103) lacks for this layer: CuTe DSL, the shape, the
    quantisation mode; None when it has everything."""
    try:
        mod = __import__(module)
    except ImportError as e:
        return f"the {module} package ({e})"
    missing = mod.kernels_missing()
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
    from gcmoe_core.formats import MXFP4Tensor

    out: list[torch.Tensor] = []
    for w in weights.all():
        if w is not None:
            out += [w.packed, w.scale] if isinstance(w, MXFP4Tensor) else [w]
    return tuple(out) + (weights.biases() or ())


def _registry() -> dict[str, Backend]:
    from .reference import ReferenceBackend
    from .sm90 import Sm90Backend
    from .sm103 import Sm103Backend

    return {b.name: b for b in (ReferenceBackend(), Sm90Backend(), Sm103Backend())}


BACKENDS: dict[str, Backend] = _registry()
NAMES = tuple(BACKENDS)
AUTO_ORDER = ("sm90", "reference")  # + "sm103" first once it has been verified on a B300
