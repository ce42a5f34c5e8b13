"""One rank's routed(+shared)-expert layer on the comm path: the four comm kernels around the sm90 W1/W2 kernels,
no torch glue in between.

    layer = CommSm90Layer(moe, max_tokens=256, bm=8)       # moe: gcmoe_gemm_sm90.MoESm90 (prepacked weights)
    y = layer(x, topk_ids, topk_weights)                   # bf16 [T, H]; fixed shapes: captures into a CUDA graph

    publish    x -> FP8 1x128 + routing into the workspace; READY          (gcmoe_comm, one kernel)
    dispatch   routed rows -> the expert-sorted, BM-padded ring            (gcmoe_comm, one kernel)
    W1         ring rows -> FP8 intermediate (SwiGLU, routing weight)      (gcmoe_gemm_sm90)
    W2         -> bf16 rows scattered to combine row token * k + slot       (gcmoe_gemm_sm90, dst = the ring's dst)
    combined   + finalize: slot-order fp32 sum per token -> y               (gcmoe_comm, two kernels)

World size 1 (P = 1): the shared experts ride as always-routed experts E..E+S-1 exactly as MoESm90.forward does, so
the result is bit-identical to it, with 6 launches instead of ~15 torch ops of glue. For P > 1 the same kernels run
across ranks (gcmoe_comm is tested with virtual ranks); the layer does not take ep_size > 1 yet because W1 does not
acquire the ring's L1_FULL tags and W2 scatters to this rank's combine buffer only.
"""

from __future__ import annotations

import torch

from gcmoe_comm.comm import CommRank
from gcmoe_comm.ring import RingSpec
from gcmoe_comm.workspace import Workspace
from gcmoe_core.grouping import Activations, RowLayout
from gcmoe_gemm_sm90.config import Sm90Config
from gcmoe_gemm_sm90.ops import MoESm90, w1, w2


class CommSm90Layer:
    def __init__(self, moe: MoESm90, top_k: int, max_tokens: int, cfg: Sm90Config, timeout_ms: float | None = None):
        self.moe, self.cfg, self.top_k = moe, cfg, top_k
        experts = moe.num_routed + moe.num_shared
        self.slots = top_k + moe.num_shared
        self.spec = RingSpec(1, experts, moe.hidden, self.slots, max_tokens, cfg.n_tile)
        dev = moe.w13.data.device
        self.ws = Workspace.virtual(self.spec, dev)[0]  # P = 1: this process's own buffer
        self.rank = CommRank(self.ws, timeout_ms=timeout_ms)
        v = self.ws.views
        self.acts = Activations(v.ring_x, v.ring_sxT, v.ring_w)
        self.layout = RowLayout(cfg.n_tile, self.spec.capacity, v.ring_offsets, v.ring_counts, v.ring_dst)
        self._shared_ids = torch.arange(moe.num_routed, experts, device=dev, dtype=torch.int32)

    def __call__(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        if topk_ids.shape != (t, self.top_k):
            raise ValueError(f"CommSm90Layer: topk_ids must be [{t}, {self.top_k}], got {tuple(topk_ids.shape)}")
        ids, wts = topk_ids.to(torch.int32), topk_weights.float()
        if self.moe.num_shared:
            s = self.moe.num_shared
            ids = torch.cat((ids, self._shared_ids.expand(t, s)), dim=1)
            wts = torch.cat((wts, torch.ones(t, s, device=x.device)), dim=1)
        self.rank.publish(x, ids, wts)
        self.rank.dispatch()
        hq, hsT = w1(self.moe.w13, self.acts, self.layout, self.cfg)
        w2(self.moe.w2, hq, hsT, self.layout, self.ws.views.combine, self.cfg)
        self.rank.combined()
        return self.rank.finalize(torch.empty(t, self.moe.hidden, dtype=torch.bfloat16, device=x.device))
