"""gcmoe-core: the numerics every gcmoe package shares — formats (MXFP4, FP8 1x128), the layer config and its limits,
the plain-torch reference operator (single- and multi-rank), grouped-row metadata and test helpers — plus the CuTe DSL
helpers the kernel packages share (cutedsl, device_ops, kernel_helpers), imported only when a kernel package builds a
kernel: importing this package imports torch, never the DSL."""

from .config import MODEL_SHAPES, ModelShape, MoEConfig, validate_call, validate_weights
from .formats import MXFP4Tensor, dequantize_fp8_1x128, dequantize_mxfp4, quantize_fp8_e4m3_1x128, quantize_mxfp4
from .reference import MoEWeights, moe_reference, moe_reference_loop_fp64

__version__ = "0.1.0"

__all__ = [
    "MODEL_SHAPES",
    "MXFP4Tensor",
    "MoEConfig",
    "MoEWeights",
    "ModelShape",
    "dequantize_fp8_1x128",
    "dequantize_mxfp4",
    "moe_reference",
    "moe_reference_loop_fp64",
    "quantize_fp8_e4m3_1x128",
    "quantize_mxfp4",
    "validate_call",
    "validate_weights",
]
