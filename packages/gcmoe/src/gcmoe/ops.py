"""The operator as a torch.library custom op (`torch.ops.gcmoe.moe_forward`) with a fake implementation, so a layer
traces under torch.compile (fullgraph) and records inside a caller's CUDA-graph capture.

The op names the layer's plan by a handle (an int the plan registers under while its layer lives): the plan holds the
layer's workspaces, partition and graphs, which are not tensors the compiler should see. The prepacked weights ride
along as arguments so the compiler orders the call after whatever produced them. Eager calls from MoELayer skip the
op's dispatch and call the plan directly (same code below it).

The operator has no backward. A call autograd would differentiate (a trainable router outside torch.no_grad()) is
refused with one ValueError (refuse_grad): by gcmoe.fused_experts before anything runs, eager or traced, and by the
op's autograd registration for a layer's call traced by torch.compile (where the op has no formula to trace).
"""

from __future__ import annotations

import itertools
import weakref

import torch

_PLANS: dict[int, object] = {}
_HANDLES = itertools.count(1)


def register_plan(owner: object, plan: object) -> int:
    """A handle for `plan`, valid while `owner` (the layer or PackedMoE holding the plan) lives."""
    handle = next(_HANDLES)
    _PLANS[handle] = plan
    weakref.finalize(owner, _PLANS.pop, handle, None)
    return handle


def plan_of(handle: int):
    try:
        return _PLANS[handle]
    except KeyError:
        raise RuntimeError(f"gcmoe: layer handle {handle} is not live (its layer was deleted)") from None


def refuse_grad(grad_mode: bool | None = None, **tensors) -> None:
    """Raise the ValueError for a call with grad mode on (grad_mode; None: torch.is_grad_enabled()) and an argument
    that requires grad (named as given)."""
    if not (torch.is_grad_enabled() if grad_mode is None else grad_mode):
        return
    for arg, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.requires_grad:
            raise ValueError(
                f"gcmoe: {arg}: requires grad, but the MoE operator has no backward (a trainable router outside "
                f"torch.no_grad()?): call it under torch.no_grad() or torch.inference_mode(), or pass {arg}.detach()"
            )


@torch.library.custom_op("gcmoe::moe_forward", mutates_args=())
def moe_forward(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: list[torch.Tensor],
    layer: int,
    check_values: bool,
) -> torch.Tensor:
    """y [T, H] bf16 = MoE(x [T, H] bf16, topk_ids [T, k], topk_weights [T, k] fp32) of the layer behind `layer`."""
    return plan_of(layer).forward(x, topk_ids, topk_weights, check_values)


@moe_forward.register_fake
def _moe_forward_fake(x, topk_ids, topk_weights, weights, layer, check_values):
    return torch.empty_like(x)


def _refuse_backward(ctx, inputs, output) -> None:
    """setup_context of the op's autograd: called (grad mode off) only for a call autograd would differentiate."""
    x, _, topk_weights, weights, *_ = inputs
    refuse_grad(True, x=x, topk_weights=topk_weights, **{f"weights[{i}]": w for i, w in enumerate(weights)})


moe_forward.register_autograd(lambda ctx, grad: None, setup_context=_refuse_backward)  # (backward never reached)
