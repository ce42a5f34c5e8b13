"""The token ring's layout and sizing, and a plain-torch model of role1 (dispatch) and role3 (combine) over P ranks —
the interface the dispatch/finalize kernels implement and the sm90 W1/W2 kernels read (gcmoe_core.grouping.RowLayout).

Receiving rank q's ring (rows = the (src rank, token, slot) pairs routed to q's experts):
    experts    q's E/P routed experts, then its S shared experts (ring experts E/P .. E/P + S - 1): every rank
               publishes its tokens with S more slots k .. k + S - 1 naming global ids E .. E + S - 1 (weight 1),
               and only the publishing rank's own dispatch takes them, so a shared expert sees its own rank's tokens
    order      by (ring expert, src rank, token, slot)  — gcmoe_core.multirank.dispatch_reference's order
    blocks     each expert's rows padded to a multiple of BM: block b = rows [b BM, b BM + BM) of ONE expert;
               l1_full_count[b] = the generation that filled it (tag; no reset between replays). Padding rows
               carry src = -1 and the sink row as dst; their payload is left as it was (the GEMMs compute every
               token column on its own and never store a padding column)
    payload    x_rows   uint8 (FP8 E4M3 bits) [capacity, H]      bit copies of the source rank's quantised tokens
               sxT      fp32 [H/128, capacity]                   their activation scales, transposed (W1's layout)
               route_w  fp32 [capacity]                          routing weight of the (token, slot)
               src      int32 [capacity, 3]                      (src rank, token, slot); -1 for padding rows
Source rank r's combine buffer: bf16 [T_max * (k + S), H], row t * (k + S) + j = slot j's output (W2 scatters ring
row i to rank src[i, 0]'s row src[i, 1] * (k + S) + src[i, 2]); role3 sums the k + S rows in slot order in fp32
(gcmoe_core.reference.combine_slots: routed slots, then shared).

Capacity per rank: every token of every rank could route all k slots to one rank, so P * T_max * k rows, plus
T_max * S shared rows, plus (E/P + S) * (BM - 1) rows of padding, rounded up to BM.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gcmoe_core.config import MoEConfig
from gcmoe_core.grouping import append_shared, row_capacity
from gcmoe_core.multirank import quantize_tokens


@dataclass(frozen=True)
class RingSpec:
    """ranks P, routed experts per rank E/P, hidden H, routed top_k, tokens per rank T_max, block rows BM, and the
    shared experts S every rank applies to its own tokens through the ring (0: none)."""

    ranks: int
    local_experts: int
    hidden: int
    top_k: int
    max_tokens: int
    bm: int
    shared: int = 0

    def __post_init__(self) -> None:
        if self.bm < 8 or self.bm % 8:
            raise ValueError(f"RingSpec: BM must be a positive multiple of 8 (a WGMMA N tile), got {self.bm}")
        if self.shared < 0:
            raise ValueError(f"RingSpec: shared experts {self.shared} must be >= 0")

    @classmethod
    def from_config(cls, cfg: MoEConfig, bm: int = 8) -> RingSpec:
        return cls(
            cfg.ep_size,
            cfg.local_experts,
            cfg.hidden_size,
            cfg.top_k,
            cfg.max_tokens_per_rank,
            bm,
            cfg.num_shared_experts,
        )

    @property
    def slots(self) -> int:
        """Published slots per token: the routed top_k, then the shared experts."""
        return self.top_k + self.shared

    @property
    def ring_experts(self) -> int:
        """Experts of one rank's ring: its routed experts, then the shared ones."""
        return self.local_experts + self.shared

    @property
    def num_experts(self) -> int:
        """Routed experts over all ranks (E): valid routed ids are [0, E); shared slots carry E .. E + S - 1."""
        return self.ranks * self.local_experts

    @property
    def capacity(self) -> int:
        rows = self.ranks * self.max_tokens * self.top_k + self.max_tokens * self.shared
        return row_capacity(rows, self.ring_experts, self.bm)

    @property
    def blocks(self) -> int:
        return self.capacity // self.bm


@dataclass
class RingRows:
    """One receiving rank's ring after dispatch (padding rows: src = -1, payload unspecified)."""

    x_rows: torch.Tensor
    sxT: torch.Tensor
    route_w: torch.Tensor
    src: torch.Tensor
    offsets: torch.Tensor  # int32 [E/P + S + 1], multiples of BM
    counts: torch.Tensor  # int32 [E/P + S]


def published_routing(
    spec: RingSpec, topk_ids: torch.Tensor, topk_weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """What one rank's publish writes: its k routed slots, then S shared slots (ids E .. E + S - 1, weight 1)."""
    return append_shared(topk_ids.to(torch.int32), topk_weights.float(), spec.num_experts, spec.shared)


def dispatch_emulated(
    spec: RingSpec, rank: int, topk_ids: list[torch.Tensor], topk_weights: list[torch.Tensor], xs: list[torch.Tensor]
) -> RingRows:
    """Role1 on `rank`, in torch: aggregate routing counts from every rank's published ids (routed [T, k] per rank,
    the shared slots appended as publish does), then pull the tokens' FP8 payload into the ring in (ring expert, src
    rank, token, slot) order, BM-padded per expert."""
    el, bm, k, rel = spec.local_experts, spec.bm, spec.top_k, spec.ring_experts
    if k != topk_ids[0].shape[1]:
        raise ValueError(f"dispatch_emulated: top_k {k} != routing width {topk_ids[0].shape[1]}")
    dev = xs[0].device
    payloads = [quantize_tokens(x, "fp8_mxfp4") for x in xs]
    pub = [published_routing(spec, i, w) for i, w in zip(topk_ids, topk_weights)]

    def ring_id(e: int) -> int:  # the global id a ring expert answers to: routed ids of this rank, then shared
        return rank * el + e if e < el else spec.num_experts + e - el

    def sources(e: int):  # the ranks whose published ids can name ring expert e
        return range(len(pub)) if e < el else (rank,)

    counts = torch.zeros(rel, dtype=torch.int64, device=dev)
    for e in range(rel):
        for r in sources(e):
            counts[e] += int((pub[r][0].long() == ring_id(e)).sum())
    padded = (counts + bm - 1) // bm * bm
    offsets = torch.zeros(rel + 1, dtype=torch.int64, device=dev)
    offsets[1:] = torch.cumsum(padded, 0)
    cap = spec.capacity
    x_rows = torch.zeros(cap, spec.hidden, dtype=torch.uint8, device=dev)
    sxT = torch.zeros(spec.hidden // 128, cap, dtype=torch.float32, device=dev)
    route_w = torch.zeros(cap, dtype=torch.float32, device=dev)
    src = torch.full((cap, 3), -1, dtype=torch.int32, device=dev)
    cursor = offsets[:-1].clone()
    for e in range(rel):  # pull: expert-major, then source rank, token, slot
        for r in sources(e):
            ids, w = pub[r]
            tt, jj = (ids.long() == ring_id(e)).nonzero(as_tuple=True)
            n = tt.numel()
            if n == 0:
                continue
            rows = slice(int(cursor[e]), int(cursor[e]) + n)
            x_rows[rows] = payloads[r][0][tt].view(torch.uint8)
            sxT[:, rows] = payloads[r][1][tt].t()
            route_w[rows] = w[tt, jj].float()
            src[rows] = torch.stack((torch.full_like(tt, r), tt, jj), dim=1).to(torch.int32)
            cursor[e] += n
    return RingRows(x_rows, sxT, route_w, src, offsets.to(torch.int32), counts.to(torch.int32))


def scatter_emulated(ring: RingRows, rows_out: torch.Tensor, combine: list[torch.Tensor], slots: int) -> None:
    """W2's scatter in torch: ring row i's output goes to rank src[i,0]'s combine buffer row
    src[i,1] * slots + src[i,2] (slots = k + S, the published slots per token)."""
    valid = ring.src[:, 0] >= 0
    for r, buf in enumerate(combine):
        sel = valid & (ring.src[:, 0] == r)
        dst = ring.src[sel, 1].long() * slots + ring.src[sel, 2].long()
        buf[dst] = rows_out[sel]
