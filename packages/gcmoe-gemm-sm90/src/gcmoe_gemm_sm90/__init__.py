"""gcmoe-gemm-sm90: FP8 x MXFP4 grouped expert GEMMs for Hopper (sm_90a, CuTe DSL) and their weight prepacker.
Component package: it exports kernels, configs, the prepacker and torch models, and runs no layer (the operator's
layer is gcmoe's sm90 backend; on prepared rows, ops.w1 / w2 run the kernels alone).

prepack.prepack_sm90      MXFP4 experts -> per-thread register-fragment order + row-referenced scale records
config                    Sm90Config, choose_config (per call size and layer shape), can_implement, schedule_of
kernel_grouped*           W1 (+ SwiGLU, routing weight, FP8 requant) and W2 (+ bf16 rows stored through a peer table):
                          kernel_grouped_common (what every schedule shares), kernel_grouped_epilogue, and one file
                          per schedule: whole tiles (kernel_grouped), half tiles (kernel_grouped_half), W1 stream_k
                          (kernel_grouped_stream_k)
kernel_prefetch           L2 prefetch of byte ranges (the layer's shared-expert W1 weights, beside its comm kernels)
ops                       launch_w1 / launch_w2 (any row source; RingSync for ring mode), w1 / w2 on prepared rows,
                          compiled, prefetch_l2, MoESm90 (a rank's prepacked weights + config_for, shared_w1_ranges),
                          emulate_w1 / emulate_w2 (torch models)
"""

__version__ = "0.1.0"
CLAMPED_SWIGLU_AND_BIAS = True  # the epilogues take Sm90Config.activation = "swiglu_clamped" and .bias (gpt-oss)


def kernels_missing() -> str | None:
    """None when the grouped W1/W2 kernels can be built here (CuTe DSL importable), else what is missing."""
    from gcmoe_core.cutedsl import dsl_available

    return dsl_available()


def layer_missing(hidden: int, inter: int, experts: int) -> str | None:
    """None when a layer of this shape runs on the kernels, else why not (pure Python)."""
    from .ops import layer_missing as _missing

    return _missing(hidden, inter, experts)
