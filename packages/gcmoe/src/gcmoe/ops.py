"""The operator as a torch.library custom op (`torch.ops.gcmoe.moe_forward`), with a fake implementation so it
traces under torch.compile, and a capture-safe eager implementation (value checks are skipped while a CUDA graph is
being captured; everything else is the same)."""

from __future__ import annotations

import torch

from gcmoe_core.config import check_call_values

from .backends import IMPLS


@torch.library.custom_op("gcmoe::moe_forward", mutates_args=())
def moe_forward(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: list[torch.Tensor],
    backend: str,
    quant: str,
    num_experts: int,
    check_values: bool,
) -> torch.Tensor:
    """y [T, H] bf16 = MoE(x [T, H] bf16, topk_ids [T, k], topk_weights [T, k] fp32) with prepacked `weights`."""
    capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
    if check_values and not capturing:
        check_call_values(num_experts, topk_ids, topk_weights)
    return IMPLS[backend].forward(x, topk_ids, topk_weights, weights, quant, num_experts)


@moe_forward.register_fake
def _moe_forward_fake(x, topk_ids, topk_weights, weights, backend, quant, num_experts, check_values):
    return torch.empty_like(x)
