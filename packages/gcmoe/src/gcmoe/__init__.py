"""gcmoe: MoE decode operator — FP8 x MXFP4 grouped expert GEMMs between a token-ring dispatch and combine (on
green-context SM partitions where the tuned policy says so).

import gcmoe
layer = gcmoe.MoELayer(gcmoe.MoEConfig.from_model("deepseek-v4-flash"), device="cuda")
layer.load_weights(w13, w2, shared_w13, shared_w2)
y = layer(x, topk_ids, topk_weights)

Names load on first use (PEP 562), so `import gcmoe` and `gcmoe --help` do not import torch.
"""

import importlib

__version__ = "0.1.0"

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
