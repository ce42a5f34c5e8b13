"""gcmoe-gemm-sm103: FP8 x MXFP4 grouped expert GEMMs for Blackwell B300 (sm_103a, tcgen05 block-scaled MMA), their
K128 prepacker and the kernels' torch models (emulate). Compiled and checked offline: no Blackwell GPU is available
to this project (see README). The layer around them is gcmoe's sm103 backend.
"""

from .config import layer_missing as layer_missing

__version__ = "0.1.0"

VERIFIED_ON_HARDWARE = False  # never run on a Blackwell GPU: gcmoe's `auto` does not pick it; ask for it explicitly
