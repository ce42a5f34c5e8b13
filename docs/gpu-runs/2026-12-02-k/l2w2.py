"""Side by side at T = 1, 2 (write / read flush): the shared experts' L2 prefetch of W1 (the default) vs W1 + W2 vs
off (at T = 2 none prefetches: the run's noise). Two repetitions."""

from side_by_side import run, set_prefetch_ranges


def prepare(name, layer):
    moe = layer.packed.plan.moe
    if name == "w1w2":
        extra = []
        for e in range(moe.num_routed, moe.w2.experts):
            for t in (moe.w2.data[e], moe.w2.scales[e]):
                extra.append((t.data_ptr(), t.numel() * t.element_size()))
        set_prefetch_ranges(layer, moe.shared_w1_ranges() + extra)
    if name == "off":
        layer.packed.plan.l2_prefetch = False


run(("deepseek-v3", "glm-5", "deepseek-v4-flash"), (1, 2), ("w1", "w1w2", "off"), prepare, reps=2)
