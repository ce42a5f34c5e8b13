"""gcmoe-gemm-sm103: FP8 x MXFP4 grouped expert GEMMs for Blackwell B300 (sm_103a, tcgen05 block-scaled MMA) and
their K128 prepacker. Compiled and checked offline: no Blackwell GPU is available to this project (see README).

    prepack.prepack_mxfp4_k128   MXFP4 (or MXFP8) experts -> K128 tiles + tcgen05 scale-factor atoms (exact inverse)
    kernel_grouped               W1 / W2 grouped kernels (kind::mxf8f6f4, block scale 32), compiled for sm_103a/sm_100a
    emulate                      the kernels' tile schedule, indexing and math in torch on the prepacked tensors

Kernels and their models only: the layer around them (routing, activations, W1, W2, combine) is gcmoe's sm103 backend
(gcmoe.backends.sm103), which runs either the kernels or, emulated, the models in `emulate`.
"""

__version__ = "0.1.0"

VERIFIED_ON_HARDWARE = False  # never run on a Blackwell GPU: gcmoe's `auto` does not pick it; ask for it explicitly


def kernels_missing() -> str | None:
    """None when the kernels can be built here (CuTe DSL importable), else what is missing."""
    from gcmoe_core.cutedsl import dsl_available

    return dsl_available()


def layer_missing(hidden: int, inter: int, experts: int) -> str | None:
    from .config import layer_missing as _missing

    return _missing(hidden, inter, experts)
