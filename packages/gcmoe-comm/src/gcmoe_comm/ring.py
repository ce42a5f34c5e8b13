"""The token ring's layout and sizing, and a plain-torch model of role1 (dispatch) and role3 (combine) over P ranks —
the interface the dispatch/finalize kernels implement and the sm90 W1/W2 kernels read (gcmoe_core.grouping.RowLayout).

Receiving rank q's ring (rows = the (src rank, token, slot) pairs routed to q's experts):
    order      by (local expert, src rank, token, slot)  — gcmoe_core.multirank.dispatch_reference's order
    blocks     each expert's rows padded to a multiple of BM: block b = rows [b BM, b BM + BM) of ONE expert;
               l1_full_count[b] = the generation that filled it (tag; no reset between replays)
    payload    x_rows   uint8 (FP8 E4M3 bits) [capacity, H]      bit copies of the source rank's quantised tokens
               sxT      fp32 [H/128, capacity]                   their activation scales, transposed (W1's layout)
               route_w  fp32 [capacity]                          routing weight of the (token, slot)
               src      int32 [capacity, 3]                      (src rank, token, slot); -1 for padding rows
    W2 scatters row i to rank src[i, 0]'s combine buffer row src[i, 1] * k + src[i, 2] (peer address table)
Source rank r's combine buffer: bf16 [T_max * k, H], row t * k + j = expert ids[t, j]'s output; role3 sums the k rows
(+ shared expert rows) in slot order in fp32 (gcmoe_core.reference.combine_slots).

Capacity per rank: every token of every rank could route all k slots to one rank, so P * T_max * k rows, plus
E/P * (BM - 1) rows of padding, rounded up to BM.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gcmoe_core.config import MoEConfig
from gcmoe_core.grouping import row_capacity
from gcmoe_core.multirank import quantize_tokens


@dataclass(frozen=True)
class RingSpec:
    ranks: int
    local_experts: int
    hidden: int
    top_k: int
    max_tokens: int
    bm: int

    def __post_init__(self) -> None:
        if self.bm < 8 or self.bm % 8:
            raise ValueError(f"RingSpec: BM must be a positive multiple of 8 (a WGMMA N tile), got {self.bm}")

    @classmethod
    def from_config(cls, cfg: MoEConfig, bm: int) -> RingSpec:
        return cls(cfg.ep_size, cfg.local_experts, cfg.hidden_size, cfg.top_k, cfg.max_tokens_per_rank, bm)

    @property
    def capacity(self) -> int:
        return row_capacity(self.ranks * self.max_tokens * self.top_k, self.local_experts, self.bm)

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
    offsets: torch.Tensor  # int32 [E/P + 1], multiples of BM
    counts: torch.Tensor  # int32 [E/P]


def dispatch_emulated(
    spec: RingSpec, rank: int, topk_ids: list[torch.Tensor], topk_weights: list[torch.Tensor], xs: list[torch.Tensor]
) -> RingRows:
    """Role1 on `rank`, in torch: aggregate routing counts from every rank's published ids, then pull the routed
    tokens' FP8 payload into the ring in (local expert, src rank, token, slot) order, BM-padded per expert."""
    el, bm, k = spec.local_experts, spec.bm, spec.top_k
    lo = rank * el
    dev = xs[0].device
    payloads = [quantize_tokens(x, "fp8_mxfp4") for x in xs]
    counts = torch.zeros(el, dtype=torch.int64, device=dev)
    for ids in topk_ids:  # aggregate counts per local expert over every source rank
        local = ids.long() - lo
        mine = (local >= 0) & (local < el)
        counts += torch.bincount(local[mine], minlength=el)
    padded = (counts + bm - 1) // bm * bm
    offsets = torch.zeros(el + 1, dtype=torch.int64, device=dev)
    offsets[1:] = torch.cumsum(padded, 0)
    cap = spec.capacity
    x_rows = torch.zeros(cap, spec.hidden, dtype=torch.uint8, device=dev)
    sxT = torch.zeros(spec.hidden // 128, cap, dtype=torch.float32, device=dev)
    route_w = torch.zeros(cap, dtype=torch.float32, device=dev)
    src = torch.full((cap, 3), -1, dtype=torch.int32, device=dev)
    cursor = offsets[:-1].clone()
    for e in range(el):  # pull: expert-major, then source rank, token, slot
        for r, (ids, w) in enumerate(zip(topk_ids, topk_weights)):
            tt, jj = (ids.long() == lo + e).nonzero(as_tuple=True)
            n = tt.numel()
            if n == 0:
                continue
            rows = slice(int(cursor[e]), int(cursor[e]) + n)
            x_rows[rows] = payloads[r][0][tt].view(torch.uint8)
            sxT[:, rows] = payloads[r][1][tt].t()
            route_w[rows] = w[tt, jj].float()
            src[rows] = torch.stack((torch.full_like(tt, r), tt, jj), dim=1).to(torch.int32)
            cursor[e] += n
    if k != topk_ids[0].shape[1]:
        raise ValueError(f"dispatch_emulated: top_k {k} != routing width {topk_ids[0].shape[1]}")
    return RingRows(x_rows, sxT, route_w, src, offsets.to(torch.int32), counts.to(torch.int32))


def scatter_emulated(ring: RingRows, rows_out: torch.Tensor, combine: list[torch.Tensor], top_k: int) -> None:
    """W2's scatter in torch: ring row i's output goes to rank src[i,0]'s combine buffer row src[i,1] * k + src[i,2]."""
    valid = ring.src[:, 0] >= 0
    for r, buf in enumerate(combine):
        sel = valid & (ring.src[:, 0] == r)
        dst = ring.src[sel, 1].long() * top_k + ring.src[sel, 2].long()
        buf[dst] = rows_out[sel]
