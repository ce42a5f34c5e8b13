"""The ring layout and the torch model of dispatch / scatter / combine over P virtual ranks (CPU), bit-exact against
gcmoe_core's multi-rank reference: uniform, skewed (everything to one expert / one rank), empty-rank routing, and a
rank with no tokens at all (T = 0: an idle rank still takes part in the step)."""

import pytest
import torch

from gcmoe_comm.ring import RingSpec, dispatch_emulated, scatter_emulated
from gcmoe_core.config import MoEConfig
from gcmoe_core.multirank import multirank_reference
from gcmoe_core.reference import MoEWeights, activation_input, combine_slots, shared_slot_rows
from gcmoe_core.testing import first_mismatch, make_routing

H, INTER, E, K = 256, 128, 8, 2


def _ranks(p: int, routing: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    xs, ids, ws = [], [], []
    for r in range(p):
        t = 0 if routing == "idle_rank" and r == p - 1 else 3 + 2 * r  # idle_rank: the last rank has no tokens
        xs.append(torch.randn(t, H, generator=g).to(torch.bfloat16))
        if routing == "one_rank":  # every token of every rank goes to rank 0's experts: other ranks receive nothing
            i, w = make_routing(t, K, E // p, "uniform", g)
        else:
            i, w = make_routing(t, K, E, "uniform" if routing == "idle_rank" else routing, g)
        ids.append(i), ws.append(w)
    return xs, ids, ws


def _weights(seed: int):
    g = torch.Generator().manual_seed(seed)
    return MoEWeights.from_float(
        torch.randn(E, 2 * INTER, H, generator=g) * H**-0.5,
        torch.randn(E, H, INTER, generator=g) * INTER**-0.5,
        torch.randn(1, 2 * INTER, H, generator=g) * H**-0.5,
        torch.randn(1, H, INTER, generator=g) * INTER**-0.5,
    )


@pytest.mark.parametrize("p", [1, 2, 4])
@pytest.mark.parametrize("routing", ["uniform", "one_expert", "half_empty", "one_rank", "idle_rank"])
def test_dispatch_and_combine_bit_exact(p, routing):
    """The shared expert rides the ring (ring expert E/P, fed from the rank's own tokens, slot k)."""
    xs, ids, ws = _ranks(p, routing, seed=p * 10 + len(routing))
    weights = _weights(seed=1)
    ref_dispatch, ref_combine = multirank_reference(xs, ids, ws, weights, shared_in_ring=True)
    cfg = MoEConfig(H, INTER, E, K, num_shared_experts=1, ep_size=p, max_tokens_per_rank=16)
    spec = RingSpec.from_config(cfg, bm=8)
    slots = spec.slots
    combine = [torch.full((x.shape[0] * slots, H), float("nan"), dtype=torch.bfloat16) for x in xs]  # poisoned
    shared = [shared_slot_rows(activation_input(x, "fp8_mxfp4"), weights) for x in xs]
    for q in range(p):
        ring = dispatch_emulated(spec, q, ids, ws, xs)
        ref = ref_dispatch[q]
        valid = ring.src[:, 0] >= 0
        assert torch.equal(ring.counts, ref.expert_counts)
        assert int(ring.counts[-1]) == xs[q].shape[0]  # the shared expert sees every token of this rank
        assert int(valid.sum()) == ref.src.shape[0]
        assert all(int(o) % spec.bm == 0 for o in ring.offsets)
        assert first_mismatch(ring.src[valid], ref.src) == ""
        assert first_mismatch(ring.x_rows[valid].view(torch.float8_e4m3fn), ref.x_payload) == ""
        assert first_mismatch(ring.sxT[:, valid].t(), ref.x_scale) == ""
        # every block holds rows of one expert only
        for e in range(spec.ring_experts):
            lo, hi = int(ring.offsets[e]), int(ring.offsets[e + 1])
            assert lo % spec.bm == 0 and hi % spec.bm == 0
        # W2 stand-in: each ring row's output is the reference's slot row for its (src rank, token, slot)
        out = torch.zeros(spec.capacity, H, dtype=torch.bfloat16)
        for i in valid.nonzero().squeeze(1).tolist():
            r, t, j = ring.src[i].tolist()
            out[i] = ref_combine[r].slot_rows[t, j] if j < K else shared[r][t, j - K]
        scatter_emulated(ring, out, combine, slots)
    for r in range(p):
        rows = combine[r].view(-1, slots, H)
        assert not rows.isnan().any(), "a combine row was never written"
        assert first_mismatch(rows, torch.cat((ref_combine[r].slot_rows, shared[r]), dim=1)) == ""
        assert first_mismatch(combine_slots(rows), ref_combine[r].y) == ""


def test_ring_sizing():
    cfg = MoEConfig.from_model("deepseek-v3", ep_size=8, max_tokens_per_rank=256)
    spec = RingSpec.from_config(cfg, bm=16)
    # P * T * k routed slots + T shared rows + (E/P + S) * (BM - 1) padding, already a multiple of 16
    assert spec.capacity == 8 * 256 * 8 + 256 + 33 * 15 + 1
    assert spec.blocks == spec.capacity // 16
    assert RingSpec.from_config(cfg, bm=24).capacity % 24 == 0  # any N tile the grouped GEMMs run (multiples of 8)
    for bad in (12, 0):
        with pytest.raises(ValueError, match="multiple of 8"):
            RingSpec.from_config(cfg, bm=bad)
