"""Side by side at T = 1, 2 (write / read flush): the shared experts' grid rows first (today) or last, with the
shared-W1 L2 prefetch at bucket 1 only (today) or at buckets 1-2."""

from contextlib import contextmanager

from side_by_side import run

import gcmoe.backends.sm90 as sm90

VARIANTS = {"today": (False, 1), "first_pf2": (False, 2), "last_pf2": (True, 2), "last_pf1": (True, 1)}


def prepare(name, layer):
    if VARIANTS[name][0]:
        layer.packed.plan.first_row_expert = lambda: 0  # ring experts 0 .. E/P - 1 first, the shared ones last


@contextmanager
def bucket(name):
    """The prefetch's largest bucket for this variant (read when the call is enqueued: at capture)."""
    sm90.L2_PREFETCH_MAX_BUCKET = VARIANTS[name][1]
    try:
        yield
    finally:
        sm90.L2_PREFETCH_MAX_BUCKET = 1


run(("deepseek-v3", "glm-5", "deepseek-v4-flash"), (1, 2), tuple(VARIANTS), prepare, bucket)
