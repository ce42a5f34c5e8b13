"""Host side of the sm90 grouped GEMMs: routing metadata on the GPU (no host sync), input preparation, the W1 and W2
launches, and the whole routed(+shared)-expert layer built from them.

    layout = group_rows(topk_ids, num_experts, n_tile)          # expert-sorted, padded rows; sync-free
    acts   = prepare_activations(x, topk_weights, layout)        # FP8 rows, transposed scales, routing weights
    hq, hsT = w1(packed_w13, acts, layout)                       # FP8 intermediate in W2's input layout
    w2(packed_w2, hq, hsT, layout, out)                          # bf16 rows scattered to out[slot]
    y = MoESm90.from_weights(weights).forward(x, ids, w)         # + shared experts as extra always-on experts

Shared experts ride the same kernels: expert ids E..E+S-1 are appended to every token's routing with weight 1, so
the combine (slot order: routed 0..k-1, then shared) matches gcmoe_core.reference exactly in structure.
Every step is a fixed-shape device computation: the layer captures into a CUDA graph and replays with new routing.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from gcmoe_core.cutedsl import as_cute
from gcmoe_core.formats import MXFP4Tensor, quantize_fp8_e4m3_1x128
from gcmoe_core.grouping import Activations, RowLayout, grouped_forward
from gcmoe_core.reference import MoEWeights

from .config import TILE_M, WINDOW_K, Sm90Config, can_implement, choose_config
from .prepack import PackedSm90, lut_words, prepack_sm90


def trace_shape(mode: str, packed: PackedSm90, cfg: Sm90Config) -> tuple[int, int]:
    """The trace buffer of a launch with cfg.trace: int64 [CTAs, 4] (see kernel_grouped)."""
    return packed.m // TILE_M * packed.experts * cfg.splits[0 if mode == "w1" else 1], 4


def _launch(
    mode: str,
    packed: PackedSm90,
    x_rows,
    sxT,
    layout: RowLayout,
    ep_a,
    ep_b,
    ep_c,
    cfg: Sm90Config,
    trace: torch.Tensor | None = None,
):
    import cuda.bindings.driver as cuda

    from gcmoe_core.cutedsl import cutlass_modules, target_arch

    from .kernel_grouped import compiled

    dev = x_rows.device
    e = packed.experts
    if layout.counts.numel() != e or layout.offsets.numel() != e + 1 or layout.n_tile != cfg.n_tile:
        raise ValueError(
            f"sm90 {mode}: row layout for {layout.counts.numel()} experts / n_tile {layout.n_tile} does "
            f"not match {e} prepacked experts / n_tile {cfg.n_tile}"
        )
    if x_rows.shape != (layout.rows, packed.k) or x_rows.dtype != torch.uint8:
        raise ValueError(
            f"sm90 {mode}: activation rows {tuple(x_rows.shape)} {x_rows.dtype} != "
            f"({layout.rows}, {packed.k}) uint8 (FP8 bits)"
        )
    if cfg.trace != (trace is not None):
        raise ValueError(f"sm90 {mode}: a trace buffer goes with cfg.trace and only with it")
    lut, no_trace, _ = _consts(dev)
    if trace is None:
        trace = no_trace
    elif trace.shape != trace_shape(mode, packed, cfg) or trace.dtype != torch.int64 or trace.device != dev:
        raise ValueError(f"sm90 {mode}: trace must be int64 {trace_shape(mode, packed, cfg)} on {dev}")
    kern = compiled(mode, packed.m, packed.k, cfg, target_arch(dev.index))
    wq = packed.data.view(torch.int32).view(-1, 128, 4)
    ws = packed.scales.view(-1, 256)
    kern(
        as_cute(wq, 0, 16),
        as_cute(ws, 0, 16),
        as_cute(x_rows, 0, 16, cutlass_modules()[0].Float8E4M3FN),
        as_cute(sxT, 1, 16),
        as_cute(layout.offsets, 0, 4),
        as_cute(layout.counts, 0, 4),
        as_cute(lut, None, 16),
        ep_a,
        ep_b,
        ep_c,
        as_cute(trace, 0, 16),
        e,
        cuda.CUstream(torch.cuda.current_stream(dev).cuda_stream),
    )


_CONSTS: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _consts(dev: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-device operands made once, not per launch: the decode LUT words, the trace buffer of an untraced launch
    (never written) and W2's unused third epilogue operand."""
    if dev not in _CONSTS:
        lut = lut_words().reshape(-1).contiguous().to(dev)
        _CONSTS[dev] = lut, torch.zeros(1, 4, dtype=torch.int64, device=dev), torch.zeros(1, device=dev)
    return _CONSTS[dev]


def w1(packed: PackedSm90, acts: Activations, layout: RowLayout, cfg: Sm90Config, trace: torch.Tensor | None = None):
    """-> (hq uint8 [R, I] FP8 bits, hsT fp32 [I/128, R]). trace: with cfg.trace, int64 trace_shape(...)."""
    rows, inter = layout.rows, packed.m // 2
    dev = acts.x_rows.device
    hq = torch.empty(rows, inter, dtype=torch.uint8, device=dev)
    hsT = torch.empty(packed.m // TILE_M, rows, dtype=torch.float32, device=dev)
    _launch(
        "w1",
        packed,
        acts.x_rows,
        acts.sxT,
        layout,
        as_cute(acts.route_w, 0, 4),
        as_cute(hq, 0, 16),
        as_cute(hsT, 1, 4),
        cfg,
        trace,
    )
    return hq, hsT


def w2(
    packed: PackedSm90,
    hq: torch.Tensor,
    hsT: torch.Tensor,
    layout: RowLayout,
    out: torch.Tensor,
    cfg: Sm90Config,
    trace: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[slot, :] = W2_e h[row] for every valid row (slot = the row's (token, slot) index); bf16 [T*k, H]."""
    ep = (as_cute(layout.src_slot, 0, 4), as_cute(out, 0, 16), as_cute(_consts(hq.device)[2], None, 4))
    _launch("w2", packed, hq, hsT, layout, *ep, cfg, trace)
    return out


def layer_missing(hidden: int, inter: int, experts: int) -> str | None:
    """None when the kernels take a layer of this shape (with any chosen config), else why not."""
    for name, (m, k) in (("W13", (2 * inter, hidden)), ("W2", (hidden, inter))):
        why = can_implement(m, k, experts, Sm90Config(prefetch=1))  # config_for falls back to one window per step
        if why:
            return f"{name}: {why}"
    return None


class MoESm90:
    """The routed (+ shared) experts of one rank on the sm90 kernels, from prepacked weights."""

    def __init__(self, w13: PackedSm90, w2: PackedSm90, num_routed: int, cfg: Sm90Config | None = None):
        if not w13.gate_up or w2.gate_up or w13.experts != w2.experts or w13.m != 2 * w2.k or w13.k != w2.m:
            raise ValueError("MoESm90: w13 (gate/up interleaved) and w2 prepacks do not belong to one layer")
        self.w13, self.w2 = w13, w2
        self.num_routed = num_routed
        self.num_shared = w13.experts - num_routed
        self.hidden, self.inter = w2.m, w2.k
        self.cfg = cfg

    @classmethod
    def from_weights(cls, weights: MoEWeights, cfg: Sm90Config | None = None) -> MoESm90:
        """Prepack MXFP4 weights (shared experts appended after the routed ones)."""
        if weights.quant != "fp8_mxfp4":
            raise ValueError("MoESm90: the sm90 kernels take MXFP4 weights (quant='fp8_mxfp4')")
        w13, w2_ = weights.shared_as_experts()
        e, two_i, h = w13.shape
        why = layer_missing(h, two_i // 2, e)
        if why:
            raise ValueError(f"MoESm90: {why}")
        return cls(prepack_sm90(w13, gate_up=True), prepack_sm90(w2_, gate_up=False), weights.num_experts, cfg)

    def tensors(self) -> list[torch.Tensor]:
        """The device tensors that carry this layer (what the torch.library op receives)."""
        return [self.w13.data, self.w13.scales, self.w2.data, self.w2.scales]

    @classmethod
    def from_tensors(cls, tensors: list[torch.Tensor], num_routed: int) -> MoESm90:
        d13, s13, d2, s2 = tensors
        w13 = PackedSm90(d13, s13, d13.shape[1] * TILE_M, d13.shape[2] * WINDOW_K, True, 0)
        w2_ = PackedSm90(d2, s2, d2.shape[1] * TILE_M, d2.shape[2] * WINDOW_K, False, 0)
        return cls(w13, w2_, num_routed)

    def config_for(self, tokens: int, top_k: int) -> Sm90Config:
        cfg = self.cfg or choose_config(tokens, top_k, self.num_routed, self.hidden, self.inter)
        if min(self.hidden, self.inter) // WINDOW_K % cfg.prefetch:
            cfg = replace(cfg, prefetch=1 if cfg.tma_weights else 2)
        return cfg

    def forward(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, emulate: bool = False
    ) -> torch.Tensor:
        """y [T, H] bf16. emulate=True runs the same pipeline with torch models of the two kernels (any device)."""
        cfg = self.config_for(*topk_ids.shape)
        if emulate:
            from .prepack import unpack_sm90

            run_w1 = lambda acts, lay: emulate_w1(unpack_sm90(self.w13), acts, lay)
            run_w2 = lambda hq, hs, lay, out: emulate_w2(unpack_sm90(self.w2), hq, hs, lay, out)
        else:
            run_w1 = lambda acts, lay: w1(self.w13, acts, lay, cfg)
            run_w2 = lambda hq, hs, lay, out: w2(self.w2, hq, hs, lay, out, cfg)
        return grouped_forward(
            x, topk_ids, topk_weights, self.num_routed, self.num_shared, cfg.n_tile, self.hidden, run_w1, run_w2
        )


def emulate_w1(w13: MXFP4Tensor, acts: Activations, layout: RowLayout):
    """Torch model of the W1 kernel's outputs (effective sm90 weights, FP32 math): (hq, hsT) for valid rows."""
    from .prepack import effective_weights_sm90

    eff = effective_weights_sm90(w13)
    i = eff.shape[1] // 2
    x = acts.x_rows.view(torch.float8_e4m3fn).float()
    w_k = x.shape[1] // WINDOW_K
    x = (x.view(-1, w_k, WINDOW_K) * acts.sxT.t().unsqueeze(-1)).view(x.shape[0], -1)
    hq = torch.zeros(layout.rows, i, dtype=torch.uint8, device=x.device)
    hsT = torch.zeros(i // 128, layout.rows, dtype=torch.float32, device=x.device)
    offs, cnt = layout.offsets.tolist(), layout.counts.tolist()
    for e in range(eff.shape[0]):
        if cnt[e] == 0:
            continue
        r = slice(offs[e], offs[e] + cnt[e])
        gu = x[r] @ eff[e].T
        h = torch.nn.functional.silu(gu[:, :i]) * gu[:, i:] * acts.route_w[r].unsqueeze(1)
        q, s = quantize_fp8_e4m3_1x128(h)
        hq[r], hsT[:, r] = q.view(torch.uint8), s.t()
    return hq, hsT


def emulate_w2(w2_: MXFP4Tensor, hq: torch.Tensor, hsT: torch.Tensor, layout: RowLayout, out: torch.Tensor):
    from .prepack import effective_weights_sm90

    eff = effective_weights_sm90(w2_)
    hk = hq.shape[1] // WINDOW_K
    h = (hq.view(torch.float8_e4m3fn).float().view(-1, hk, WINDOW_K) * hsT.t().unsqueeze(-1)).view(hq.shape[0], -1)
    offs, cnt = layout.offsets.tolist(), layout.counts.tolist()
    for e in range(eff.shape[0]):
        if cnt[e] == 0:
            continue
        r = slice(offs[e], offs[e] + cnt[e])
        out[layout.src_slot[r].long()] = (h[r] @ eff[e].T).to(torch.bfloat16)
    return out
