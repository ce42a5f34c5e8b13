"""gcmoe-gemm-sm90: FP8 x MXFP4 grouped expert GEMMs for Hopper (sm_90a, CuTe DSL) and their weight prepacker.

0.1.0 ships the in-register FP4 -> E4M3 decode (`kernel_decode`, the sm_90a compile smoke test); the grouped W1/W2
kernels come next (see the package README)."""

__version__ = "0.1.0"


def kernels_missing() -> str | None:
    """None when the grouped W1/W2 kernels are available, else what is missing (used by gcmoe's backend choice)."""
    return "the FP8 x MXFP4 grouped W1/W2 kernels, which gcmoe-gemm-sm90 0.1.0 does not ship yet"
