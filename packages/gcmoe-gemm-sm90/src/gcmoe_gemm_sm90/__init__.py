"""gcmoe-gemm-sm90: FP8 x MXFP4 grouped expert GEMMs for Hopper (sm_90a, CuTe DSL), their weight prepacker, kernel
configurations and torch models. A component: it runs no layer (gcmoe's sm90 backend does; on prepared rows, ops.w1 /
w2 run the kernels alone). The package README lists what each module exports.
"""

from .config import layer_missing as layer_missing

__version__ = "0.1.0"
CLAMPED_SWIGLU_AND_BIAS = True  # the epilogues take Sm90Config.activation = "swiglu_clamped" and .bias (gpt-oss)
