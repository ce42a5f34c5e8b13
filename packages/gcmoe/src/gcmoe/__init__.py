"""gcmoe: MoE decode operator — FP8 x MXFP4 grouped expert GEMMs between a token-ring dispatch and combine (on
green-context SM partitions where the tuned policy says so).

import gcmoe
layer = gcmoe.MoELayer(gcmoe.MoEConfig.from_model("deepseek-v4-flash"), device="cuda")
layer.load_weights(w13, w2, shared_w13, shared_w2)
y = layer(x, topk_ids, topk_weights)
"""

from gcmoe_comm.workspace import CommError
from gcmoe_core.config import MODEL_SHAPES, MoEConfig
from gcmoe_core.formats import MXFP4Tensor, quantize_mxfp4
from gcmoe_core.reference import MoEWeights

from .backends import BackendUnavailable, choose
from .checkpoints import MoECheckpointInfo, load_moe_layer, load_moe_layer_weights
from .engine import fused_experts
from .layer import MoELayer, PackedMoE, moe, prepack
from .pool import LayerPool, default_pool, micro_batch

__version__ = "0.1.0"

__all__ = [
    "MODEL_SHAPES",
    "BackendUnavailable",
    "CommError",
    "LayerPool",
    "MXFP4Tensor",
    "MoECheckpointInfo",
    "MoEConfig",
    "MoELayer",
    "MoEWeights",
    "PackedMoE",
    "choose",
    "default_pool",
    "fused_experts",
    "load_moe_layer",
    "load_moe_layer_weights",
    "micro_batch",
    "moe",
    "prepack",
    "quantize_mxfp4",
]
