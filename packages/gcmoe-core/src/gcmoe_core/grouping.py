"""Routing metadata and activation rows for grouped expert GEMMs (plain torch, no host synchronisation, so the whole
thing captures into a CUDA graph and replays with new routing), and grouped_forward: the layer on prepared rows
around two grouped kernels, which the sm103 backend runs. The sm90 backend's rows come from gcmoe-comm's dispatch on
the token ring instead.

Shared experts ride the routed path: expert ids E..E+S-1 are appended to every token's routing with weight 1, so the
slot-order combine (routed 0..k-1, then shared) matches gcmoe_core.reference in structure.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .formats import quantize_fp8_e4m3_1x128
from .reference import combine_slots


@dataclass
class RowLayout:
    """Expert-sorted rows of the (token, slot) pairs, each expert's rows padded to a multiple of n_tile."""

    n_tile: int
    rows: int  # capacity R (static for a token count)
    offsets: torch.Tensor  # int32 [E + 1] padded row offsets
    counts: torch.Tensor  # int32 [E] valid rows per expert
    src_slot: torch.Tensor  # int32 [R] flat slot (t * k + j) of each row, -1 for padding


def row_capacity(slots: int, experts: int, n_tile: int) -> int:
    cap = slots + experts * (n_tile - 1)
    return -(-cap // n_tile) * n_tile


def group_rows(topk_ids: torch.Tensor, num_experts: int, n_tile: int) -> RowLayout:
    """Routing metadata with no host synchronisation (capturable)."""
    flat = topk_ids.reshape(-1).long()
    dev = flat.device
    nslots = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + n_tile - 1) // n_tile * n_tile
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=dev)
    offsets[1:] = torch.cumsum(padded, 0)
    starts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    starts[1:] = torch.cumsum(counts, 0)[:-1]
    order = torch.argsort(flat, stable=True)
    e_sorted = flat[order]
    pos = torch.arange(nslots, device=dev) - starts[e_sorted]
    slot_row = torch.empty(nslots, dtype=torch.int64, device=dev)
    slot_row[order] = offsets[e_sorted] + pos
    rows = row_capacity(nslots, num_experts, n_tile)
    src_slot = torch.full((rows,), -1, dtype=torch.int32, device=dev)
    src_slot[slot_row] = torch.arange(nslots, dtype=torch.int32, device=dev)
    return RowLayout(n_tile, rows, offsets.to(torch.int32), counts.to(torch.int32), src_slot)


@dataclass
class Activations:
    x_rows: torch.Tensor  # uint8 (FP8 E4M3 bits) [R, H]
    sxT: torch.Tensor  # fp32 [H/128, R]
    route_w: torch.Tensor  # fp32 [R]


def prepare_activations(x: torch.Tensor, topk_weights: torch.Tensor, layout: RowLayout, top_k: int) -> Activations:
    """Quantise tokens once (FP8 1x128) and gather them into expert-sorted rows; padding rows copy token 0."""
    q, s = quantize_fp8_e4m3_1x128(x)
    slot = layout.src_slot.long().clamp(min=0)
    tok = slot // top_k
    x_rows = q.view(torch.uint8)[tok]
    sxT = s[tok].t().contiguous()
    w = topk_weights.reshape(-1).float()[slot]
    route_w = torch.where(layout.src_slot >= 0, w, torch.zeros_like(w))
    return Activations(x_rows, sxT, route_w)


def append_shared(
    topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_routed: int, num_shared: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing with the shared experts E..E+S-1 appended to every token, weight 1 (slots k..k+S-1)."""
    if not num_shared:
        return topk_ids, topk_weights
    t, dev = topk_ids.shape[0], topk_ids.device
    shared = torch.arange(num_routed, num_routed + num_shared, device=dev, dtype=topk_ids.dtype).expand(t, num_shared)
    ones = torch.ones(t, num_shared, device=dev, dtype=topk_weights.dtype)
    return torch.cat((topk_ids, shared), dim=1), torch.cat((topk_weights, ones), dim=1)


def grouped_forward(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    num_routed: int,
    num_shared: int,
    n_tile: int,
    hidden: int,
    run_w1: Callable[[Activations, RowLayout], tuple[torch.Tensor, torch.Tensor]],
    run_w2: Callable[[torch.Tensor, torch.Tensor, RowLayout, torch.Tensor], object],
) -> torch.Tensor:
    """Prepared rows around two grouped kernels: append shared experts, group, quantise, W1, W2, combine (bf16
    [T, H])."""
    t = topk_ids.shape[0]
    topk_ids, topk_weights = append_shared(topk_ids, topk_weights, num_routed, num_shared)
    slots = topk_ids.shape[1]
    layout = group_rows(topk_ids, num_routed + num_shared, n_tile)
    acts = prepare_activations(x, topk_weights, layout, slots)
    hq, hsT = run_w1(acts, layout)
    out = torch.empty(t * slots, hidden, dtype=torch.bfloat16, device=x.device)
    run_w2(hq, hsT, layout, out)
    return combine_slots(out.view(t, slots, hidden))
