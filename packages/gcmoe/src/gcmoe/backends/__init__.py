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

import torch

from gcmoe_core import env
from gcmoe_core.config import MoEConfig

from .base import (
    Backend,
    BackendUnavailable,
    LayerOptions,
    LayerPlan,
    cuda_missing,
    flatten_weights,
    kernel_package_missing,
)

__all__ = [
    "AUTO_ORDER",
    "BACKENDS",
    "NAMES",
    "Backend",
    "BackendUnavailable",
    "LayerOptions",
    "LayerPlan",
    "choose",
    "cuda_missing",
    "flatten_weights",
    "get",
    "kernel_package_missing",
]


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


def _registry() -> dict[str, Backend]:
    from .reference import ReferenceBackend
    from .sm90 import Sm90Backend
    from .sm103 import Sm103Backend

    return {b.name: b for b in (ReferenceBackend(), Sm90Backend(), Sm103Backend())}


BACKENDS: dict[str, Backend] = _registry()
NAMES = tuple(BACKENDS)
AUTO_ORDER = ("sm90", "reference")  # + "sm103" first once it has been verified on a B300
