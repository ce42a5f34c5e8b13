"""Side by side at T = 1 (write / read flush): the shared experts' W1 L2 prefetch by 4 / 8 (default) / 16 / 32 CTAs,
its first half, none."""

from contextlib import contextmanager

from side_by_side import run, set_prefetch_ranges

import gcmoe_gemm_sm90.ops as ops

ORIG = ops.prefetch_l2
VARIANTS = {"w1_8": (8, 1.0), "w1_4": (4, 1.0), "w1_16": (16, 1.0), "w1_32": (32, 1.0), "half_8": (8, 0.5), "off": None}


def prepare(name, layer):
    v = VARIANTS[name]
    if v is None:
        layer.packed.plan.l2_prefetch = False
    else:
        base = layer.packed.plan.moe.shared_w1_ranges()
        set_prefetch_ranges(layer, [(a, (int(n * v[1]) // 16) * 16) for a, n in base])


@contextmanager
def ctas(name):
    """The prefetch kernel's CTA count of this variant, baked into the graph at capture."""
    if VARIANTS[name] is not None:
        ops.prefetch_l2 = lambda r, ctas=8, k=VARIANTS[name][0]: ORIG(r, k)
    try:
        yield
    finally:
        ops.prefetch_l2 = ORIG


run(("deepseek-v3", "glm-5", "deepseek-v4-flash"), (1,), tuple(VARIANTS), prepare, ctas)
