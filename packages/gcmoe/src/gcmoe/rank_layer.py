"""One rank's routed(+shared)-expert layer on the comm path: the comm kernels around the sm90 W1/W2 kernels, no
torch glue in between. This is the sm90 backend's forward.

    y = sm90_forward(moe, x, topk_ids, topk_weights)     # moe: gcmoe_gemm_sm90.MoESm90 (prepacked weights)

    publish    x -> FP8 1x128 + routing into the workspace; READY          (gcmoe_comm, one kernel)
    dispatch   routed rows -> the expert-sorted, BM-padded ring            (gcmoe_comm, one kernel)
    W1         ring rows -> FP8 intermediate (SwiGLU, routing weight)      (gcmoe_gemm_sm90)
    W2         -> bf16 rows scattered to combine row token * k + slot       (gcmoe_gemm_sm90, dst = the ring's dst)
    combined   + finalize: slot-order fp32 sum per token -> y               (gcmoe_comm, two kernels)

World size 1 (P = 1): the shared experts ride as always-routed experts E..E+S-1 exactly as MoESm90.forward does, so
the result is bit-identical to it (tested), with 6 launches instead of ~15 torch ops of glue.

Workspaces: one per (device, layer shape, kernel N tile, token bucket), created on first use and shared by every
layer of that shape — calls that share one are serialised by stream order (the design's one-workspace limit); use one
stream per workspace. Token buckets are powers of two from 8, so a graph captured at T tokens keeps its workspace.
Shapes the dispatch cannot hold (routing of P * T * k entries beyond its shared memory) fall back to MoESm90.forward.
For P > 1 the same kernels run across ranks (gcmoe_comm is tested with virtual ranks); the layer does not take
ep_size > 1 yet: W1 does not acquire the ring's L1_FULL tags and W2 scatters to this rank's combine buffer only.
"""

from __future__ import annotations

import torch

from gcmoe_comm.comm import CommRank
from gcmoe_comm.ring import RingSpec
from gcmoe_comm.workspace import Workspace
from gcmoe_core.grouping import Activations, RowLayout, append_shared
from gcmoe_gemm_sm90.config import Sm90Config
from gcmoe_gemm_sm90.ops import MoESm90, w1, w2


class CommSm90Path:
    """The workspace and comm kernels for one layer shape on one device (P = 1)."""

    def __init__(self, moe: MoESm90, top_k: int, max_tokens: int, n_tile: int, timeout_ms: float | None = None):
        self.top_k, self.num_routed, self.num_shared = top_k, moe.num_routed, moe.num_shared
        self.hidden = moe.hidden
        self.spec = self.spec_for(moe, top_k, max_tokens, n_tile)
        CommRank.validate_spec(self.spec)  # before allocating the workspace
        dev = moe.w13.data.device
        self.ws = Workspace.virtual(self.spec, dev)[0]  # P = 1: this process's own buffer
        self.rank = CommRank(self.ws, timeout_ms=timeout_ms)
        v = self.ws.views
        self.acts = Activations(v.ring_x, v.ring_sxT, v.ring_w)
        self.layout = RowLayout(n_tile, self.spec.capacity, v.ring_offsets, v.ring_counts, v.ring_dst)

    @staticmethod
    def spec_for(moe: MoESm90, top_k: int, max_tokens: int, n_tile: int) -> RingSpec:
        """P = 1; the shared experts are local experts E..E+S-1 routed from every token (slots k..k+S-1)."""
        return RingSpec(1, moe.num_routed + moe.num_shared, moe.hidden, top_k + moe.num_shared, max_tokens, n_tile)

    def __call__(
        self, moe: MoESm90, cfg: Sm90Config, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        t = x.shape[0]
        if topk_ids.shape != (t, self.top_k) or cfg.n_tile != self.spec.bm:
            raise ValueError(
                f"CommSm90Path: topk_ids {tuple(topk_ids.shape)} / n_tile {cfg.n_tile} do not match this path's "
                f"[{t}, {self.top_k}] / {self.spec.bm}"
            )
        ids, wts = append_shared(topk_ids.to(torch.int32), topk_weights.float(), self.num_routed, self.num_shared)
        self.rank.publish(x, ids, wts)
        self.rank.dispatch()
        hq, hsT = w1(moe.w13, self.acts, self.layout, cfg)
        w2(moe.w2, hq, hsT, self.layout, self.ws.views.combine, cfg)
        self.rank.combined()
        return self.rank.finalize(torch.empty(t, self.hidden, dtype=torch.bfloat16, device=x.device))


_PATHS: dict[tuple, CommSm90Path | None] = {}


def token_bucket(tokens: int) -> int:
    return max(8, 1 << (max(1, tokens) - 1).bit_length())


def comm_path(moe: MoESm90, top_k: int, tokens: int, n_tile: int) -> CommSm90Path | None:
    """The shared path for this shape, or None when the dispatch cannot hold it (then use MoESm90.forward)."""
    bucket = token_bucket(tokens)
    key = (moe.w13.data.device, moe.hidden, moe.inter, moe.num_routed, moe.num_shared, top_k, n_tile, bucket)
    if key not in _PATHS:
        try:
            CommRank.validate_spec(CommSm90Path.spec_for(moe, top_k, bucket, n_tile))
        except ValueError:  # the dispatch cannot hold this much routing in shared memory
            _PATHS[key] = None
        else:
            _PATHS[key] = CommSm90Path(moe, top_k, bucket, n_tile)
    return _PATHS[key]


def sm90_forward(moe: MoESm90, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """The sm90 backend's layer: the comm path when it holds the shape, else the torch-glue MoESm90.forward."""
    t, k = topk_ids.shape
    cfg = moe.config_for(t, k)
    path = comm_path(moe, k, t, cfg.n_tile) if x.is_cuda and t > 0 else None
    if path is None:
        return moe.forward(x, topk_ids, topk_weights)
    return path(moe, cfg, x, topk_ids, topk_weights)
