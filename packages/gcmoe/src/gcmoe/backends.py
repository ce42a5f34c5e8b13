"""Backends of the operator and how one is chosen.

    reference  plain torch (gcmoe-core), any device; the ground truth and the CPU path
    sm90       Hopper (sm_90a): FP8 x MXFP4 grouped GEMMs from gcmoe-gemm-sm90 between gcmoe-comm's publish /
               dispatch and finalize kernels (gcmoe.rank_layer; CuTe DSL)
    sm103      Blackwell (sm_103a): tcgen05 block-scaled GEMMs from gcmoe-gemm-sm103 (CuTe DSL)

`choose(device, requested)`: an explicit request (argument, else GCMOE_BACKEND) must be runnable on the device or it
raises BackendUnavailable naming what is missing; "auto" takes the first runnable of sm90, reference. sm103 is
compiled and emulated but has never run on a Blackwell GPU: it is used only when asked for by name.

A backend turns MoEWeights into a flat list of device tensors once (`prepack`), and runs a call on that list
(`forward`): the list is what the torch.library op receives, so the op works under torch.compile and in capture.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gcmoe_core import env
from gcmoe_core.formats import MXFP4Tensor
from gcmoe_core.reference import MoEWeights, moe_reference

NAMES = ("reference", "sm90", "sm103")
AUTO_ORDER = ("sm90", "reference")  # + "sm103" first once it has been verified on a B300


class BackendUnavailable(RuntimeError):
    """The requested backend cannot run here; the message names what is missing."""


@dataclass(frozen=True)
class BackendStatus:
    name: str
    missing: str | None  # None: runnable

    @property
    def runnable(self) -> bool:
        return self.missing is None


def _kernel_backend_missing(
    name: str, device: torch.device, capability: tuple[int, int], module: str, cfg=None
) -> str | None:
    if device.type != "cuda":
        return f"a CUDA device of compute capability {capability[0]}.{capability[1]} (got {device})"
    if not torch.cuda.is_available():
        return "a CUDA device (torch.cuda.is_available() is False)"
    have = torch.cuda.get_device_capability(device)
    if have != capability:
        return f"compute capability {capability[0]}.{capability[1]} (device {device} is {have[0]}.{have[1]})"
    try:
        mod = __import__(module)
    except ImportError as e:
        return f"the {module} package ({e})"
    missing = mod.kernels_missing()
    if missing is None and cfg is not None:
        why = mod.layer_missing(cfg.hidden_size, cfg.intermediate_size, cfg.local_experts + cfg.num_shared_experts)
        if why:
            return f"a layer shape its kernels take ({why})"
    if missing is None and cfg is not None and cfg.quant != "fp8_mxfp4":
        return "quant='fp8_mxfp4' (its kernels are FP8 x MXFP4)"
    return missing


def status(name: str, device: torch.device, cfg=None) -> BackendStatus:
    """Whether backend `name` runs on `device` (and, given a MoEConfig, on that layer's shapes)."""
    if name == "reference":
        return BackendStatus(name, None)
    if name == "sm90":
        return BackendStatus(name, _kernel_backend_missing(name, device, (9, 0), "gcmoe_gemm_sm90", cfg))
    if name == "sm103":
        return BackendStatus(name, _kernel_backend_missing(name, device, (10, 3), "gcmoe_gemm_sm103", cfg))
    raise ValueError(f"gcmoe: backend: unknown backend {name!r}; known: {', '.join(NAMES)} or 'auto'")


def choose(device: torch.device, requested: str | None = None, cfg=None) -> str:
    req = requested or env.get("GCMOE_BACKEND")
    if req == "auto":
        return next(n for n in AUTO_ORDER if status(n, device, cfg).runnable)
    st = status(req, device, cfg)
    if not st.runnable:
        raise BackendUnavailable(f"gcmoe: backend {req!r} cannot run on {device}: it needs {st.missing}")
    return req


# ------------------------------------------------------------------------------------------------ implementations
def _flatten(weights: MoEWeights) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for w in weights.all():
        if w is not None:
            out += [w.packed, w.scale] if isinstance(w, MXFP4Tensor) else [w]
    return out


class ReferenceBackend:
    """Prepack = the weights dequantised once into bf16 (exact for MXFP4); forward = gcmoe_core's moe_reference
    with the layer's quantisation mode (FP8 activations and intermediate for fp8_mxfp4)."""

    name = "reference"

    @staticmethod
    def prepack(weights: MoEWeights) -> list[torch.Tensor]:
        return _flatten(weights.exact_bf16() if weights.quant == "fp8_mxfp4" else weights)

    @staticmethod
    def forward(x, topk_ids, topk_weights, tensors: list[torch.Tensor], quant: str, num_experts: int):
        return moe_reference(x, topk_ids, topk_weights, MoEWeights(*tensors), quant=quant)


class KernelBackend:
    """A kernel package's layer class (`from_weights(...).tensors()` to prepack, `from_tensors(...).forward` to
    run): the sm90 and sm103 backends differ only in the class — and in `run`, the function that runs a call on
    the layer object ("module:function"; default: its own forward)."""

    def __init__(self, name: str, module: str, cls: str, run: str | None = None):
        self.name, self._module, self._cls, self._run = name, module, cls, run

    def _layer_cls(self):
        import importlib

        return getattr(importlib.import_module(self._module), self._cls)

    def prepack(self, weights: MoEWeights) -> list[torch.Tensor]:
        return self._layer_cls().from_weights(weights).tensors()

    def forward(self, x, topk_ids, topk_weights, tensors: list[torch.Tensor], quant: str, num_experts: int):
        layer = self._layer_cls().from_tensors(tensors, num_experts)
        if self._run is None:
            return layer.forward(x, topk_ids, topk_weights)
        import importlib

        module, fn = self._run.split(":")
        return getattr(importlib.import_module(module), fn)(layer, x, topk_ids, topk_weights)


IMPLS = {
    "reference": ReferenceBackend,
    # register-A WGMMA, in-register FP4 decode; the comm kernels around it (gcmoe.rank_layer)
    "sm90": KernelBackend("sm90", "gcmoe_gemm_sm90.ops", "MoESm90", run="gcmoe.rank_layer:sm90_forward"),
    "sm103": KernelBackend("sm103", "gcmoe_gemm_sm103.ops", "MoESm103"),  # tcgen05 block-scaled MMA
}
