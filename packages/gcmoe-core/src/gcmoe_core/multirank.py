"""Multi-rank reference: what each rank's dispatch and combine must produce, for the comm tests to check bit-exactly.

P ranks; rank q holds global experts [q*E/P, (q+1)*E/P) and its own tokens x_q [T_q, H] with global top-k ids.

Dispatch (role1) on receiving rank q produces, for its local experts, every (src_rank, token, slot) routed to them,
ordered by (local expert, src_rank, token, slot) — a deterministic order the ring layout refines into BM blocks:
    expert_counts [E/P] int32, expert_offsets [E/P + 1] int32 (exclusive prefix sum),
    src [N_q, 3] int32 (src_rank, token, slot), x_fp8 [N_q, H] float8_e4m3fn, x_scale [N_q, H/128] fp32
(bf16 mode carries x_bf16 [N_q, H] instead of the FP8 pair). The payload rows are bit copies of the source rank's
quantised tokens: dispatch moves bytes, it never re-quantises.

Combine (role3) on source rank r: slot_rows [T_r, k, H] bf16, row (t, j) written by the rank owning expert ids[t, j]
(its W2 scatter), then y_r = combine_slots(slot_rows ++ shared rows) (shared experts are replicated on every rank).
A masked slot (id -1, MoEConfig.masked_ids) is no rank's: no dispatch receives it and its slot row stays zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .formats import quantize_fp8_e4m3_1x128
from .reference import (
    SWIGLU,
    Activation,
    MoEWeights,
    activation_input,
    combine_slots,
    routed_slot_rows,
    shared_slot_rows,
)


@dataclass
class RankDispatch:
    expert_counts: torch.Tensor
    expert_offsets: torch.Tensor
    src: torch.Tensor
    x_payload: torch.Tensor  # float8_e4m3fn [N, H] (fp8_mxfp4) or bf16 [N, H]
    x_scale: torch.Tensor | None  # fp32 [N, H/128] or None (bf16)


@dataclass
class RankCombine:
    slot_rows: torch.Tensor  # bf16 [T, k, H]
    y: torch.Tensor  # bf16 [T, H]


def quantize_tokens(x: torch.Tensor, quant: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The payload a source rank publishes for dispatch."""
    return quantize_fp8_e4m3_1x128(x) if quant == "fp8_mxfp4" else (x.contiguous(), None)


def dispatch_reference(
    topk_ids: list[torch.Tensor],
    payloads: list[tuple[torch.Tensor, torch.Tensor | None]],
    num_experts: int,
    rank: int,
    shared: int = 0,
) -> RankDispatch:
    """What rank `rank` must receive, given every rank's routed ids [T, k] and published payloads. shared = S > 0:
    the shared experts ride the ring as this rank's experts E/P .. E/P + S - 1, fed from its own tokens only
    (slots k .. k + S - 1 of each of its tokens, as its publish appends them)."""
    p = len(topk_ids)
    el = num_experts // p
    lo = rank * el
    keys, srcs, rows, scales = [], [], [], []
    for r in range(p):
        ids = topk_ids[r].long()
        t, k = ids.shape
        if shared and r == rank:
            extra = torch.arange(num_experts, num_experts + shared, device=ids.device).expand(t, shared)
            ids = torch.cat((ids, extra), dim=1)
            k += shared
        tok = torch.arange(t, device=ids.device).unsqueeze(1).expand(t, k)
        slot = torch.arange(k, device=ids.device).unsqueeze(0).expand(t, k)
        mine = (ids >= lo) & (ids < lo + el)
        e_of = ids - lo
        if shared and r == rank:
            own_shared = ids >= num_experts
            mine = mine | own_shared
            e_of = torch.where(own_shared, ids - num_experts + el, e_of)
        e_loc, tt, jj = e_of[mine], tok[mine], slot[mine]
        keys.append(e_loc * (p * 2**40) + r * 2**40 + tt * 64 + jj)
        srcs.append(torch.stack((torch.full_like(tt, r), tt, jj), dim=1))
        rows.append(payloads[r][0][tt])
        if payloads[r][1] is not None:
            scales.append(payloads[r][1][tt])
    key = torch.cat(keys)
    order = torch.argsort(key)
    src = torch.cat(srcs)[order].to(torch.int32)
    e_of = (key[order] // (p * 2**40)).long()
    counts = torch.bincount(e_of, minlength=el + shared).to(torch.int32)
    offsets = torch.zeros(el + shared + 1, dtype=torch.int32, device=counts.device)
    offsets[1:] = torch.cumsum(counts, 0)
    return RankDispatch(counts, offsets, src, torch.cat(rows)[order], torch.cat(scales)[order] if scales else None)


def multirank_reference(
    xs: list[torch.Tensor],
    topk_ids: list[torch.Tensor],
    topk_weights: list[torch.Tensor],
    weights_global: MoEWeights,
    shared_in_ring: bool = False,
    act: Activation = SWIGLU,
) -> tuple[list[RankDispatch], list[RankCombine]]:
    """Every rank's expected dispatch result and combine result. weights_global holds all E experts (rank q uses its
    E/P slice, biases included); per-slot rows use the same per-expert functions and activation `act` as
    moe_reference. shared_in_ring: the shared experts ride each rank's ring (its dispatch result includes them, see
    dispatch_reference)."""
    p = len(xs)
    e = weights_global.num_experts
    if e % p:
        raise ValueError(f"multirank_reference: E = {e} not divisible by P = {p}")
    quant = weights_global.quant
    payloads = [quantize_tokens(x, quant) for x in xs]
    shared = weights_global.num_shared if shared_in_ring else 0
    dispatch = [dispatch_reference(topk_ids, payloads, e, q, shared) for q in range(p)]
    x_in = [activation_input(x, quant) for x in xs]
    slot_rows = [
        torch.zeros(*ids.shape, x.shape[1], dtype=torch.bfloat16, device=x.device) for ids, x in zip(topk_ids, xs)
    ]
    el = e // p
    for q in range(p):
        local = weights_global.rank_slice(q, p)  # (its shared experts: added per source rank below)
        for r in range(p):
            rows, written = routed_slot_rows(x_in[r], topk_ids[r], topk_weights[r], local, expert_base=q * el, act=act)
            slot_rows[r] = torch.where(written.unsqueeze(-1), rows, slot_rows[r])
    combine = []
    for r in range(p):
        shared = shared_slot_rows(x_in[r], weights_global, act=act)
        combine.append(RankCombine(slot_rows[r], combine_slots(torch.cat((slot_rows[r], shared), dim=1))))
    return dispatch, combine
