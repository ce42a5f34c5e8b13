"""gcmoe: MoE decode operator — FP8 x MXFP4 grouped expert GEMMs between a token-ring dispatch and combine (on
green-context SM partitions where the tuned policy says so).

import gcmoe
layer = gcmoe.MoELayer(gcmoe.MoEConfig.from_model("deepseek-v4-flash"), device="cuda")
layer.load_weights(w13, w2, shared_w13, shared_w2)
y = layer(x, topk_ids, topk_weights)

Names load on first use (PEP 562), so `import gcmoe` and `gcmoe --help` do not import torch.
"""

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

if TYPE_CHECKING:  # the names as type checkers and the API docs see them (the test suite keeps this equal to _HOMES)
    from gcmoe_comm.workspace import CommError  # noqa: F401
    from gcmoe_core.config import MODEL_SHAPES, MoEConfig  # noqa: F401
    from gcmoe_core.formats import MXFP4Tensor, quantize_mxfp4  # noqa: F401
    from gcmoe_core.reference import MoEWeights  # noqa: F401

    from .backends import BackendUnavailable, choose  # noqa: F401
    from .checkpoints import MoECheckpointInfo, load_moe_layer, load_moe_layer_weights  # noqa: F401
    from .engine import fused_experts, fused_experts_masked  # noqa: F401
    from .layer import MoELayer, PackedMoE, moe, prepack  # noqa: F401
    from .pool import LayerPool, default_pool, micro_batch  # noqa: F401

_HOMES = {
    "CommError": "gcmoe_comm.workspace",
    "MODEL_SHAPES": "gcmoe_core.config",
    "MoEConfig": "gcmoe_core.config",
    "MXFP4Tensor": "gcmoe_core.formats",
    "quantize_mxfp4": "gcmoe_core.formats",
    "MoEWeights": "gcmoe_core.reference",
    "BackendUnavailable": "gcmoe.backends",
    "choose": "gcmoe.backends",
    "MoECheckpointInfo": "gcmoe.checkpoints",
    "load_moe_layer": "gcmoe.checkpoints",
    "load_moe_layer_weights": "gcmoe.checkpoints",
    "fused_experts": "gcmoe.engine",
    "fused_experts_masked": "gcmoe.engine",
    "MoELayer": "gcmoe.layer",
    "PackedMoE": "gcmoe.layer",
    "moe": "gcmoe.layer",
    "prepack": "gcmoe.layer",
    "LayerPool": "gcmoe.pool",
    "default_pool": "gcmoe.pool",
    "micro_batch": "gcmoe.pool",
}
__all__ = sorted(_HOMES)
_SUBMODULES = ("backends", "checkpoints", "cli", "engine", "integrations", "layer", "ops", "policy", "pool")


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"gcmoe.{name}")
    if name not in _HOMES:
        raise AttributeError(f"module 'gcmoe' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_HOMES))
