"""Side by side at T = 1 (write / read flush): the shared experts' W1 L2 prefetch whole (the default), its first
half, its second half (of each range: the weights' first / last M tiles, the records' likewise), none."""

from side_by_side import run, set_prefetch_ranges


def part(ranges, which):
    """The first / second half of each (address, bytes) range, 16-byte aligned."""
    res = []
    for a, n in ranges:
        h = (n // 2) // 16 * 16
        res.append((a, h) if which == "first" else (a + h, n - h))
    return res


def prepare(name, layer):
    if name == "none":
        layer.packed.plan.l2_prefetch = False
    elif name != "all":
        set_prefetch_ranges(layer, part(layer.packed.plan.moe.shared_w1_ranges(), name))


run(("deepseek-v3", "glm-5"), (1,), ("all", "first", "second", "none"), prepare)
