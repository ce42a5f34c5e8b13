"""Problem generators and checks shared by the comm GPU tests and the multi-process runner (gcmoe_comm.multiproc).

    xs, ids, ws, shared = make_inputs(p, "one_rank", seed)      # every rank's inputs, deterministic in the seed
    want = expected_outputs(xs, ids, ws, shared)                # finalize's output per rank (stand-in experts)
    check_ring(views, q, spec, xs, ids, ws, gen)                # rank q's ring vs the multi-rank reference

Routings: uniform / one_expert / half_empty (gcmoe_core.testing), one_rank (every token to rank 0's experts: the
other ranks receive nothing) and idle_rank (the last rank has no tokens).
"""

from __future__ import annotations

import torch

from gcmoe_core.multirank import dispatch_reference, quantize_tokens
from gcmoe_core.reference import combine_slots
from gcmoe_core.testing import make_routing

from .ring import RingSpec
from .virtual import stand_in_slot_rows
from .workspace import WorkspaceViews

ROUTINGS = ("uniform", "one_expert", "half_empty", "one_rank", "idle_rank")


def make_inputs(
    p: int,
    routing: str,
    seed: int,
    hidden: int,
    experts: int,
    k: int,
    tmax: int,
    shared: int,
    tokens: list[int] | None = None,
):
    """(xs, ids, weights, shared rows) per rank on the current CUDA device; T_r = tokens[r] if given, else
    min(tmax, 3 + 5 r + seed % 4) (0 for the idle rank of "idle_rank")."""
    g = torch.Generator().manual_seed(seed)
    xs, ids, ws, sh = [], [], [], []
    for r in range(p):
        if tokens is not None:
            t = tokens[r]
        else:
            t = 0 if routing == "idle_rank" and r == p - 1 else min(tmax, 3 + 5 * r + seed % 4)
        xs.append(torch.randn(t, hidden, generator=g).to(torch.bfloat16))
        if routing == "one_rank":
            i, w = make_routing(t, k, experts // p, "uniform", g)
        else:
            i, w = make_routing(t, k, experts, "uniform" if routing == "idle_rank" else routing, g)
        ids.append(i), ws.append(w)
        sh.append(torch.randn(t, shared, hidden, generator=g).to(torch.bfloat16))
    cuda = lambda ts: [t.cuda() for t in ts]
    return cuda(xs), cuda(ids), cuda(ws), cuda(sh)


def expected_outputs(xs, ids, ws, shared) -> list[torch.Tensor]:
    rows = [stand_in_slot_rows(x, i, w) for x, i, w in zip(xs, ids, ws)]
    return [combine_slots(torch.cat((r, s), dim=1)) for r, s in zip(rows, shared)]


def check_ring(v: WorkspaceViews, q: int, spec: RingSpec, xs, ids, weights, gen: int) -> None:
    """Rank q's ring after dispatch of generation gen, exactly (AssertionError naming what differs)."""
    bm = spec.bm
    payloads = [quantize_tokens(x, "fp8_mxfp4") for x in xs]
    ref = dispatch_reference(ids, payloads, spec.local_experts * spec.ranks, q)
    assert torch.equal(v.ring_counts, ref.expert_counts), f"rank {q}: counts"
    padded = (ref.expert_counts + bm - 1) // bm * bm
    assert torch.equal(v.ring_offsets[1:] - v.ring_offsets[:-1], padded) and int(v.ring_offsets[0]) == 0
    used = int(v.ring_offsets[-1])
    src = v.ring_src[:used]
    valid = src[:, 0] >= 0
    assert torch.equal(src[valid], ref.src), f"rank {q}: row order / sources"
    assert bool((src[~valid] == -1).all()), f"rank {q}: padding rows must say -1"
    dst = v.ring_dst[:used]
    assert torch.equal(dst[valid], ref.src[:, 1] * spec.slots + ref.src[:, 2]), f"rank {q}: combine rows"
    assert bool((dst[~valid] == v.sink_row).all()), f"rank {q}: padding rows must aim at the sink row"
    assert torch.equal(v.ring_x[:used][valid], ref.x_payload.view(torch.uint8)), f"rank {q}: FP8 payload"
    assert torch.equal(v.ring_sxT[:, :used][:, valid].t(), ref.x_scale), f"rank {q}: scales"
    if ref.src.numel():
        wref = torch.stack([weights[r][t, j] for r, t, j in ref.src.tolist()])
        assert torch.equal(v.ring_w[:used][valid], wref.float()), f"rank {q}: routing weights"
    tags = v.l1_full[: used // bm]
    assert bool((tags == gen).all()), f"rank {q}: L1_FULL tags {tags.tolist()} != generation {gen}"
