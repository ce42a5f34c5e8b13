"""Host side of the sm_103a grouped GEMMs: the layer (routing metadata, FP8 activations and their UE8M0 atoms, W1,
W2, combine) around either the kernels (on a B300) or their torch tile-loop model (anywhere).

    moe = MoESm103.from_weights(weights)
    y = moe.forward(x, ids, w, emulate=True)     # on a CPU: the kernels' schedule, indexing and math in torch
"""

from __future__ import annotations

import torch

from gcmoe_core.grouping import grouped_forward
from gcmoe_core.reference import MoEWeights

from .config import Sm103Config, layer_missing
from .emulate import emulate_w1, emulate_w2, token_scale_atoms
from .prepack import PackedK128, prepack_mxfp4_k128


class MoESm103:
    """The routed (+ shared, appended) experts of one rank, K128-prepacked for tcgen05 block-scaled MMA."""

    def __init__(self, w13: PackedK128, w2: PackedK128, num_routed: int, cfg: Sm103Config | None = None):
        if not w13.gate_up or w2.gate_up or w13.n != 2 * w2.k or w13.k != w2.n:
            raise ValueError("MoESm103: w13 (gate/up interleaved) and w2 prepacks do not belong to one layer")
        self.w13, self.w2 = w13, w2
        self.num_routed = num_routed
        self.num_shared = w13.data.shape[0] - num_routed
        self.hidden, self.inter = w2.n, w2.k
        self.cfg = cfg or Sm103Config()

    @classmethod
    def from_weights(cls, weights: MoEWeights, cfg: Sm103Config | None = None) -> MoESm103:
        if weights.quant != "fp8_mxfp4":
            raise ValueError("MoESm103: the sm103 kernels take MXFP4 weights (quant='fp8_mxfp4')")
        w13, w2_ = weights.shared_as_experts()
        e, two_i, h = w13.shape
        why = layer_missing(h, two_i // 2, e)
        if why:
            raise ValueError(f"MoESm103: {why}")
        return cls(prepack_mxfp4_k128(w13, gate_up=True), prepack_mxfp4_k128(w2_), weights.num_experts, cfg)

    def forward(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, emulate: bool = False
    ) -> torch.Tensor:
        if not emulate:
            from .kernel_grouped import run_w1, run_w2

            w1 = lambda acts, lay: run_w1(self.w13, acts, lay, self.cfg)
            w2 = lambda hq, hs, lay, out: run_w2(self.w2, hq, hs, lay, out, self.cfg)
        else:
            w1 = lambda acts, lay: emulate_w1(self.w13, acts, token_scale_atoms(acts.sxT), lay)
            w2 = lambda hq, hs, lay, out: emulate_w2(self.w2, hq, token_scale_atoms(hs), lay, out)
        return grouped_forward(
            x, topk_ids, topk_weights, self.num_routed, self.num_shared, self.cfg.n_tile, self.hidden, w1, w2
        )
