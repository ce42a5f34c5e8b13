"""P virtual ranks in one process on one GPU, the stand-in expert between dispatch and finalize, and the problems
and checks the comm GPU tests share: the cross-rank protocol exercised without several GPUs.

    vr = VirtualRanks(spec, "cuda", dispatch_ctas=8)    # P workspaces, P CommRanks, P streams
    vr.load()                                           # every rank's kernels loaded (before the first wait)
    xs, ids, ws = make_inputs(p, "one_rank", seed, ...) # every rank's inputs, deterministic in the seed
    vr.step(xs, ids, ws, outs)                          # every rank's call, ranks' kernels concurrent on their streams
    g, _ = capture_graph(lambda: vr.step(...))          # ... and as one CUDA graph (P forked branches)
    want = expected_outputs(spec, xs, ids, ws)          # finalize's output per rank (stand-in experts)
    check_ring(views, q, spec, xs, ids, ws, gen)        # rank q's ring vs the multi-rank reference

Each rank's buffers are separate allocations and each rank's peer table points at the others', so dispatch pulls
and the W2 scatter cross "rank" boundaries exactly as they would across GPUs (over HBM instead of NVLink). The
compute between dispatch and finalize is a stand-in for W1/W2 with the same data movement (`scatter_stand_in`):
every valid ring row becomes one bf16 row, a fixed elementwise function of its payload and expert, written to its
source rank's combine buffer at row token * (k + S) + slot. The spec's S shared experts ride the ring as the layer's
do (published slots k .. k + S - 1, ids E .. E + S - 1, weight 1). `stand_in_slot_rows` is the same function computed
straight from the source rank's tokens, so comparing the two checks dispatch, scatter and finalize bit for bit.

Routings: uniform / one_expert / half_empty (gcmoe_core.testing), one_rank (every token to rank 0's experts: the
other ranks receive nothing) and idle_rank (the last rank has no tokens).
"""

from __future__ import annotations

import torch

from gcmoe_comm.comm import CommRank
from gcmoe_comm.ring import RingSpec, published_routing
from gcmoe_comm.workspace import Workspace, WorkspaceViews
from gcmoe_core.formats import quantize_fp8_e4m3_1x128
from gcmoe_core.multirank import dispatch_reference, quantize_tokens
from gcmoe_core.reference import combine_slots
from gcmoe_core.testing import make_routing

ROUTINGS = ("uniform", "one_expert", "half_empty", "one_rank", "idle_rank")


def _stand_in(x_fp32: torch.Tensor, expert: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The stand-in expert: bf16((x * (expert + 1)) * weight), rows independent (fp32, fixed op order)."""
    return ((x_fp32 * (expert.float() + 1.0).unsqueeze(-1)) * weight.unsqueeze(-1)).to(torch.bfloat16)


def stand_in_slot_rows(x: torch.Tensor, slot_ids: torch.Tensor, slot_weights: torch.Tensor) -> torch.Tensor:
    """What the stand-in must deliver to a source rank: bf16 [T, k + S, H], from its own tokens and its published
    slots (ring.published_routing)."""
    q, s = quantize_fp8_e4m3_1x128(x)
    xf = q.float() * s.repeat_interleave(128, dim=1)
    t, k = slot_ids.shape
    return _stand_in(xf.unsqueeze(1).expand(t, k, -1), slot_ids, slot_weights.float())


def scatter_stand_in(ws: Workspace, combine_of: list[torch.Tensor]) -> None:
    """W1/W2 stand-in on rank ws.rank: ring rows -> rows of the source ranks' combine buffers, combine_of[q] = rank
    q's combine buffer as this process addresses it (ws.peer_views(q).combine); capturable."""
    v, s = ws.views, ws.spec
    cap = s.capacity
    rows = torch.arange(cap, device=v.ring_x.device, dtype=torch.int32)
    ring_e = torch.searchsorted(v.ring_offsets[1:], rows, right=True)  # ring expert: routed, then shared
    expert = torch.where(
        ring_e < s.local_experts, ring_e + ws.rank * s.local_experts, ring_e - s.local_experts + s.num_experts
    )
    xf = v.ring_x.view(torch.float8_e4m3fn).float() * v.ring_sxT.t().repeat_interleave(128, dim=1)
    y = _stand_in(xf, expert, v.ring_w)
    src = v.ring_src.long()
    valid = (src[:, 0] >= 0) & (rows < v.ring_offsets[-1])  # rows past the last block hold stale data
    sink = v.sink_row  # the same row index in every rank's combine buffer
    for q, combine in enumerate(combine_of):
        dst = torch.where(valid & (src[:, 0] == q), src[:, 1] * s.slots + src[:, 2], sink)
        combine.index_copy_(0, dst, y)


class VirtualRanks:
    """P ranks of one ring spec on one device, each with its own stream."""

    def __init__(
        self, spec: RingSpec, device, workspaces: list[Workspace] | None = None, fused: bool = True, **comm_kwargs
    ):
        """workspaces: the ranks' workspaces if already built (e.g. [Workspace.symmetric(spec)] for the one rank
        of a world-size-1 group); by default Workspace.virtual(spec, device). fused: at P = 1 publish + dispatch as
        the layer runs them, one kernel (CommRank.publish_dispatch); False: the two kernels."""
        self.spec = spec
        self.fused = fused and spec.ranks == 1
        self.ws = workspaces if workspaces is not None else Workspace.virtual(spec, device)
        if len(self.ws) != spec.ranks:
            raise ValueError(f"VirtualRanks: {len(self.ws)} workspaces for P = {spec.ranks}")
        self.ranks = [CommRank(w, **comm_kwargs) for w in self.ws]
        self.streams = [torch.cuda.Stream(device=device) for _ in self.ws]

    def step(
        self,
        xs: list[torch.Tensor],
        topk_ids: list[torch.Tensor],
        topk_weights: list[torch.Tensor],
        outs: list[torch.Tensor],
        silent: frozenset[int] = frozenset(),
        poison: bool = True,
        inject=None,
    ) -> None:
        """One layer call on every rank (ranks in `silent` do nothing: a dead peer). poison: NaN-fill each rank's
        combine buffer and ring first (on its own stream, before its READY), so a row nobody wrote shows.
        inject(phase, r, rank) -> skip: called before each phase ("publish", "dispatch", "compute", "finalize") of
        each live rank, on its stream; True skips that phase of that rank (fault_injection.FaultInjector)."""
        main = torch.cuda.current_stream(self.ws[0].buf.device)
        live = [r for r in range(len(self.ranks)) if r not in silent]
        for stream in self.streams:
            stream.wait_stream(main)

        def each(fn, phase):  # phase by phase over the live ranks, each on its own stream
            for r in live:
                with torch.cuda.stream(self.streams[r]):
                    if inject is None or not inject(phase, r, self.ranks[r]):
                        fn(r, self.ranks[r])

        def publish(r, rank):
            if poison:
                rank.ws.views.combine.fill_(float("nan"))
                rank.ws.views.ring_x.fill_(0x7F)  # E4M3 NaN
                rank.ws.views.ring_src.fill_(-7)
            if self.fused:
                rank.publish_dispatch(xs[r], topk_ids[r], topk_weights[r])
            else:
                rank.publish(xs[r], topk_ids[r], topk_weights[r])

        # Enqueued phase by phase, so every rank's READY is enqueued before any dispatch spins on it: in ONE process
        # a kernel's first launch may load its module, and CUDA's lazy loading can wait for running kernels — a
        # spinning dispatch whose peer's READY sits behind such a load would wait out its bound.
        each(publish, "publish")
        if not self.fused:
            each(lambda r, rank: rank.dispatch(), "dispatch")
        each(lambda r, rank: scatter_stand_in(rank.ws, [w.views.combine for w in self.ws]), "compute")
        each(lambda r, rank: rank.finalize(outs[r]), "finalize")
        for stream in self.streams:
            main.wait_stream(stream)

    def load(self) -> None:
        for r in self.ranks:
            r.load()

    def check(self) -> None:
        for w in self.ws:
            w.check()

    def recover(self) -> None:
        self.ws[0].recover()


def make_inputs(
    p: int,
    routing: str,
    seed: int,
    hidden: int,
    experts: int,
    k: int,
    tmax: int,
    tokens: list[int] | None = None,
):
    """(xs, ids, weights) per rank on the current CUDA device; T_r = tokens[r] if given, else
    min(tmax, 3 + 5 r + seed % 4) (0 for the idle rank of "idle_rank")."""
    g = torch.Generator().manual_seed(seed)
    xs, ids, ws = [], [], []
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
    return [x.cuda() for x in xs], [i.cuda() for i in ids], [w.cuda() for w in ws]


def expected_outputs(spec: RingSpec, xs, ids, ws) -> list[torch.Tensor]:
    """Every rank's finalize output: the slot-order sum of its stand-in rows, routed slots then shared."""
    return [combine_slots(stand_in_slot_rows(x, *published_routing(spec, i, w))) for x, i, w in zip(xs, ids, ws)]


def check_ring(v: WorkspaceViews, q: int, spec: RingSpec, xs, ids, weights, gen: int) -> None:
    """Rank q's ring after dispatch of generation gen, exactly (AssertionError naming what differs)."""
    bm = spec.bm
    payloads = [quantize_tokens(x, "fp8_mxfp4") for x in xs]
    ref = dispatch_reference(ids, payloads, spec.num_experts, q, spec.shared)
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
        slot_w = [published_routing(spec, i, w)[1] for i, w in zip(ids, weights)]
        wref = torch.stack([slot_w[r][t, j] for r, t, j in ref.src.tolist()])
        assert torch.equal(v.ring_w[:used][valid], wref), f"rank {q}: routing weights"
    tags = v.l1_full[: used // bm]
    assert bool((tags == gen).all()), f"rank {q}: L1_FULL tags {tags.tolist()} != generation {gen}"
