"""The reference backend: plain torch (gcmoe_core.reference), any device.

prepack = the weights dequantised once into bf16 (exact for MXFP4); forward = moe_reference with the layer's
quantisation mode (FP8 activations and intermediate for fp8_mxfp4): the sparse path (gather rows per expert, one host
sync) in eager calls, the dense path (every expert over every row, no sync) while a CUDA graph is being captured.
A masked slot (id -1, MoEConfig.masked_ids) is no expert's: the reference adds a zero row for it.
"""

from __future__ import annotations

import torch

from gcmoe_core.config import MoEConfig, check_call_values
from gcmoe_core.reference import Activation, MoEWeights, moe_reference

from .base import LayerOptions, flatten_weights


class ReferencePlan:
    def __init__(self, cfg: MoEConfig, tensors: tuple[torch.Tensor, ...], device: torch.device):
        self.cfg, self.device = cfg, device
        self.weights = MoEWeights.from_flat(tensors, cfg.has_bias)
        self.act = Activation.of(cfg)

    def forward(self, x, topk_ids, topk_weights, check_values: bool) -> torch.Tensor:
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        if check_values and not capturing:  # plain torch reads the ids anyway: one host sync
            check_call_values(self.cfg.num_experts, topk_ids, topk_weights, self.cfg.masked_ids)
        return moe_reference(x, topk_ids, topk_weights, self.weights, quant=self.cfg.quant, act=self.act)

    def check(self) -> None:
        return None

    def recover(self) -> None:
        return None

    def describe(self) -> dict:
        return {"backend": "reference", "device": str(self.device), "quant": self.cfg.quant}


class ReferenceBackend:
    name = "reference"
    auto = True

    def missing(self, device: torch.device, cfg: MoEConfig | None = None) -> str | None:
        if cfg is not None and cfg.ep_size > 1:
            return "ep_size = 1 (the reference backend holds every expert of one rank; see gcmoe_core.multirank)"
        return None

    def prepack(self, cfg: MoEConfig, weights: MoEWeights, device: torch.device) -> tuple[torch.Tensor, ...]:
        return flatten_weights(weights.exact_bf16() if weights.quant == "fp8_mxfp4" else weights)

    def plan(self, cfg: MoEConfig, tensors, device: torch.device, options: LayerOptions) -> ReferencePlan:
        return ReferencePlan(cfg, tensors, device)
