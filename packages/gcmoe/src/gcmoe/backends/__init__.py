"""Backends of the operator: one object per implementation behind a small protocol (base.Backend, base.LayerPlan),
and how one is chosen.

    reference  plain torch (gcmoe-core), any device; the ground truth and the CPU path
    sm90       Hopper (sm_90a): gcmoe-comm's dispatch and finalize around gcmoe-gemm-sm90's W1 / W2 (backends/sm90.py)
    sm103      Blackwell (sm_103a): gcmoe-gemm-sm103's W1 / W2 (compiled and emulated only, never run on the hardware)

`choose(device, requested, cfg)`: an explicit request (argument, else GCMOE_BACKEND) must be runnable or it raises
BackendUnavailable naming what is missing; "auto" takes the first runnable backend in AUTO_ORDER whose `auto` flag is
set. A plan owns every device resource its layer's calls need, never a module-global cache;
`LayerOptions(emulate=True)` runs a kernel backend's pipeline on torch models of its kernels (what CPU CI drives).
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
