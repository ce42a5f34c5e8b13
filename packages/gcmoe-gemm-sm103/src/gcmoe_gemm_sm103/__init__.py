"""gcmoe-gemm-sm103: FP8 x MXFP4 grouped expert GEMMs for Blackwell B300 (sm_103a, tcgen05 block-scaled MMA) and
their K128 prepacker. Compiled and checked offline: no Blackwell GPU is available to this project (see README)."""

__version__ = "0.1.0"


def kernels_missing() -> str | None:
    """None when the grouped W1/W2 kernels are available, else what is missing (used by gcmoe's backend choice)."""
    return "the tcgen05 block-scaled grouped W1/W2 kernels, which gcmoe-gemm-sm103 0.1.0 does not ship yet"
