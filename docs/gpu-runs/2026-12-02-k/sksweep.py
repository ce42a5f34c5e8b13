"""Side by side at T = 1 (write / read flush): W1's stream_k grid over 2 x (132 - d) CTAs, d = 0 (default) .. 24: the
CTAs that cannot be resident at launch (SM slots held by dispatch's and the L2 prefetch's CTAs) start late."""

from side_by_side import run


def prepare(name, layer):
    layer.packed.plan.sm_count = int(name[2:]) // 2  # (sets stream_k's CTAs: occupancy x SMs)


names = tuple(f"sk{2 * (132 - d)}" for d in (0, 4, 8, 12, 16, 24))
run(("deepseek-v3", "glm-5"), (1,), names, prepare, compare="calc_diff")
