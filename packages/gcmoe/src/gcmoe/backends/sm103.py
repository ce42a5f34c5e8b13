"""The sm103 backend: gcmoe-gemm-sm103's tcgen05 block-scaled W1 / W2 (Blackwell B300, sm_103a) inside the layer
pipeline, or, with LayerOptions(emulate=True), the same pipeline on the torch models of those kernels (any device).

prepack: the MXFP4 experts, shared ones appended as experts E..E+S-1, as K128 tiles and scale atoms
(gcmoe_gemm_sm103.prepack); forward: gcmoe_core.grouping.grouped_forward around W1 and W2.

One rank only (ep_size = 1): no dispatch kernels around the GEMMs. The kernels have never run on a Blackwell GPU
(gcmoe_gemm_sm103.VERIFIED_ON_HARDWARE), so `auto` never picks this backend. Value checks read the ids on the host
(one sync per eager call); a call being captured into a CUDA graph skips them, as the reference backend does.
"""

from __future__ import annotations

import torch

from gcmoe_core.config import MASKED_ID, MoEConfig, check_call_values
from gcmoe_core.grouping import Activations, RowLayout, grouped_forward
from gcmoe_core.reference import MoEWeights
from gcmoe_gemm_sm103 import VERIFIED_ON_HARDWARE, layer_missing
from gcmoe_gemm_sm103.config import K_TILE, Sm103Config
from gcmoe_gemm_sm103.emulate import emulate_w1, emulate_w2, prepack_layer, token_scale_atoms
from gcmoe_gemm_sm103.prepack import BM, PackedK128

from . import base
from .base import LayerOptions

CAPABILITY = (10, 3)
ONE_RANK = "ep_size = 1 (the sm103 backend runs every expert on one rank: it has no dispatch)"


def _packed_k128(data: torch.Tensor, sf: torch.Tensor, gate_up: bool) -> PackedK128:
    """The prepacker's MXFP4 result back from its two tensors: data [E, N/128, K/128, 128, 64] uint8, sf [..., 512]."""
    _e, n_tiles, k_tiles, _rows, row_bytes = data.shape
    if row_bytes != K_TILE // 2:
        raise ValueError(f"gcmoe: sm103: expected MXFP4 K128 tiles of {K_TILE // 2} bytes per row, got {row_bytes}")
    return PackedK128(data, sf, n_tiles * BM, k_tiles * K_TILE, gate_up)


class Sm103Plan:
    """One layer on the sm103 kernels (or their torch models): the prepacked experts and the kernel config."""

    def __init__(self, cfg: MoEConfig, tensors: tuple[torch.Tensor, ...], device: torch.device, options: LayerOptions):
        w13_data, w13_sf, w2_data, w2_sf = tensors
        self.cfg, self.device, self.emulate = cfg, device, options.emulate
        self.kernel_config = options.kernel_config or Sm103Config()
        if not isinstance(self.kernel_config, Sm103Config):
            raise TypeError(f"gcmoe: sm103: kernel_config must be an Sm103Config, got {self.kernel_config!r}")
        self.w13 = _packed_k128(w13_data, w13_sf, gate_up=True)
        self.w2 = _packed_k128(w2_data, w2_sf, gate_up=False)
        self.num_routed, self.num_shared = cfg.local_experts, cfg.num_shared_experts
        self.kernels = None
        if not self.emulate:  # CuTe DSL is imported (and the kernels compiled) only for the real thing
            from gcmoe_gemm_sm103 import kernel_grouped

            self.kernels = kernel_grouped

    def _w1(self, acts: Activations, layout: RowLayout) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (h uint8 FP8 bits [R, I], its scales fp32 [I/128, R])."""
        if self.emulate:
            return emulate_w1(self.w13, acts, token_scale_atoms(acts.sxT), layout)
        return self.kernels.run_w1(self.w13, acts, layout, self.kernel_config)

    def _w2(self, hq: torch.Tensor, hsT: torch.Tensor, layout: RowLayout, out: torch.Tensor) -> None:
        """out[slot] = bf16 W2 rows, for every valid row's slot."""
        if self.emulate:
            emulate_w2(self.w2, hq, token_scale_atoms(hsT), layout, out)
        else:
            self.kernels.run_w2(self.w2, hq, hsT, layout, out, self.kernel_config)

    def forward(self, x, topk_ids, topk_weights, check_values: bool) -> torch.Tensor:
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        if check_values and not capturing:
            check_call_values(self.cfg.num_experts, topk_ids, topk_weights, self.cfg.masked_ids)
        if self.cfg.masked_ids:  # a masked slot rides expert 0 with weight 0: its rows are exact zeros
            masked = topk_ids == MASKED_ID
            topk_ids = torch.where(masked, torch.zeros_like(topk_ids), topk_ids)
            topk_weights = torch.where(masked, torch.zeros_like(topk_weights), topk_weights)
        n_tile, hidden = self.kernel_config.n_tile, x.shape[1]
        return grouped_forward(
            x, topk_ids, topk_weights, self.num_routed, self.num_shared, n_tile, hidden, self._w1, self._w2
        )

    def check(self) -> None:
        return None

    def recover(self) -> None:
        return None

    def describe(self) -> dict:
        return {
            "backend": "sm103",
            "device": str(self.device),
            "emulate": self.emulate,
            "experts": self.num_routed + self.num_shared,
            "n_tile": self.kernel_config.n_tile,
            "stages": self.kernel_config.stages,
            "verified_on_hardware": VERIFIED_ON_HARDWARE,
        }


class Sm103Backend:
    name = "sm103"
    auto = False  # never run on a Blackwell GPU: used only when asked for by name

    def missing(self, device: torch.device, cfg: MoEConfig | None = None) -> str | None:
        why = base.cuda_missing(device, CAPABILITY)
        if why is None and cfg is not None and cfg.ep_size > 1:
            why = ONE_RANK
        return why or base.kernel_package_missing("gcmoe_gemm_sm103", cfg)

    def prepack(self, cfg: MoEConfig, weights: MoEWeights, device: torch.device) -> tuple[torch.Tensor, ...]:
        if cfg.ep_size > 1:
            raise ValueError(f"gcmoe: sm103: needs {ONE_RANK}; got ep_size = {cfg.ep_size}")
        if weights.quant != "fp8_mxfp4":
            raise ValueError(f"gcmoe: sm103: the kernels take MXFP4 weights (quant='fp8_mxfp4'), got {weights.quant}")
        if cfg.activation != "swiglu" or cfg.has_bias:  # also when emulated: never a silently different expert
            raise ValueError(
                f"gcmoe: activation: the sm103 kernels' epilogue is plain SwiGLU without biases; got "
                f"activation={cfg.activation!r}, has_bias={cfg.has_bias} (use backend='sm90' or 'reference')"
            )
        w13, w2 = weights.to(device).shared_as_experts()
        experts, two_inter, hidden = w13.shape
        why = layer_missing(hidden, two_inter // 2, experts)
        if why:
            raise ValueError(f"gcmoe: sm103: a layer shape its kernels take ({why})")
        p13, p2 = prepack_layer(w13, w2)
        return (p13.data, p13.sf, p2.data, p2.sf)

    def plan(self, cfg: MoEConfig, tensors, device: torch.device, options: LayerOptions) -> Sm103Plan:
        return Sm103Plan(cfg, tensors, device, options)
