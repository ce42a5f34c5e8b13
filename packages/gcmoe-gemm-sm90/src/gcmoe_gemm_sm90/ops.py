"""Host side of the sm90 grouped GEMMs: the W1 and W2 launches (launch_w1 / launch_w2 from any row source, w1 / w2 on
prepared rows), the prepacked weights of one layer (MoESm90), the L2 prefetch, and the torch models of the two kernels
(emulate_w1 / emulate_w2). The operator's layer runs in gcmoe (its sm90 backend); this package never runs a layer.

ring: a RingSync (the comm workspace's signal addresses, the call's ticket, the wait bound) for the kernels' ring mode
(Sm90Config.ring); None on prepared rows. scratch: W1's StreamKScratch where cfg.stream_k (owned by the caller: the
layer's lane; w1() on prepared rows makes one per call). The epilogue's biases (cfg.bias) ride the kernels' by-value
words after the signal addresses.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cache

import torch

from gcmoe_core.cutedsl import as_cute
from gcmoe_core.formats import MXFP4Tensor
from gcmoe_core.grouping import Activations, RowLayout
from gcmoe_core.reference import SWIGLU, Activation, MoEWeights, w1_reference, w2_reference

from .config import TILE_M, WINDOW_K, Sm90Config, choose_config, layer_missing, schedule_of, with_halves
from .prepack import PackedSm90, prepack_sm90


@dataclass(frozen=True)
class RingSync:
    """What the kernels' ring mode waits on (addresses of the workspace's INUSE, CGEN, OFFS, ERR words, L1_FULL
    array and W1_DONE pairs: int32 [ring experts, 2], zeroed with the signals), the call's ticket and the bound on
    each wait in ns."""

    inuse: int
    cgen: int
    offs: int
    err: int
    l1_full: int
    w1_done: int
    ticket: int
    timeout_ns: int


@dataclass(frozen=True)
class StreamKScratch:
    """W1 with cfg.stream_k: fp32 partial accumulators of the tiles split between CTAs (two slots per CTA, 256 x N
    each) and one arrival counter per CTA (int32, zero between launches: each tile's last arriver resets its own).
    One launch at a time may use it (the stream orders a lane's launches)."""

    partials: torch.Tensor
    counters: torch.Tensor
    ctas: int

    @classmethod
    def make(cls, device: torch.device, n_tile_max: int = 24) -> StreamKScratch:
        """For every stream_k config up to N tile n_tile_max, one CTA per SM slot (two per SM) of the device."""
        ctas = 2 * torch.cuda.get_device_properties(device).multi_processor_count
        partials = torch.empty(2 * ctas * TILE_M * n_tile_max, dtype=torch.float32, device=device)
        return cls(partials, torch.zeros(ctas, dtype=torch.int32, device=device), ctas)

    def check(self, cfg: Sm90Config) -> None:
        need = 2 * self.ctas * TILE_M * cfg.n_tile
        if self.partials.numel() < need or self.counters.numel() < self.ctas:
            raise ValueError(f"sm90 w1: stream_k scratch has {self.partials.numel()} partials, N {cfg.n_tile}: {need}")


def kernel_class(mode: str, cfg: Sm90Config):
    """The kernel class of the schedule W1 (mode 'w1') / W2 of cfg runs (config.schedule_of): whole tiles
    (kernel_grouped), half tiles (kernel_grouped_half) or stream_k (kernel_grouped_stream_k)."""
    schedule = schedule_of(mode, cfg)
    if schedule == "stream_k":
        from .kernel_grouped_stream_k import GroupedGemmStreamKSm90

        return GroupedGemmStreamKSm90
    if schedule == "half":
        from .kernel_grouped_half import GroupedGemmHalfSm90

        return GroupedGemmHalfSm90
    from .kernel_grouped import GroupedGemmSm90

    return GroupedGemmSm90


@cache
def compiled(mode: str, m: int, k: int, cfg: Sm90Config, arch: str = "sm_90a"):
    """W1 (mode 'w1') / W2 of an [E, M, K] weight tensor with cfg, compiled for arch against fake tensors (dynamic
    expert and row counts; no GPU needed), once per process. Refuses a variant the kernel would run wrong
    (can_implement)."""
    from .kernel_grouped_common import compile_grouped

    return compile_grouped(kernel_class(mode, cfg)(mode, m, k, cfg), arch)


def _launch(
    mode,
    packed: PackedSm90,
    x_rows,
    sxT,
    offsets,
    counts,
    ep,
    cfg: Sm90Config,
    ring: RingSync | None,
    scratch: StreamKScratch | None = None,
    sk_ctas: int | None = None,
    extra: tuple[torch.Tensor, ...] = (),
    grid_rows: int | None = None,
    first_expert: int = 0,
):
    """extra: the epilogue's fp32 operands whose addresses follow the signal words (cfg.bias: W1 b13; W2 b2,
    route_w), checked by the caller. grid_rows: the grid's rows, below E only with cfg.active_first (default: every
    expert; fewer rows than experts with rows only make CTAs run more rows); first_expert: the expert of the first
    grid row (the rows rotate), see kernel_grouped (Grid)."""
    import cuda.bindings.driver as cuda

    from gcmoe_core.cutedsl import cutlass_modules, target_arch

    from .kernel_grouped_common import sig_words

    dev = x_rows.device
    e = packed.experts
    if counts.numel() != e or offsets.numel() != e + 1:
        raise ValueError(f"sm90 {mode}: row layout for {counts.numel()} experts does not match {e} prepacked experts")
    if x_rows.dim() != 2 or x_rows.shape[1] != packed.k or x_rows.dtype != torch.uint8:
        raise ValueError(f"sm90 {mode}: activation rows {tuple(x_rows.shape)} {x_rows.dtype} != (R, {packed.k}) uint8")
    if cfg.ring != (ring is not None):
        raise ValueError(f"sm90 {mode}: a RingSync goes with cfg.ring and only with it")
    cutlass = cutlass_modules()[0]
    i64 = cutlass.Int64
    stream_k = cfg.stream_k and mode == "w1"
    if cfg.stream_k and not stream_k:
        cfg = replace(cfg, stream_k=False)  # (a W1 option: W2 compiles as without it)
    if stream_k:
        if scratch is None:
            raise ValueError("sm90 w1: cfg.stream_k needs a StreamKScratch")
        scratch.check(cfg)
        sk_ctas = sk_ctas or scratch.ctas
        if not 1 <= sk_ctas <= scratch.ctas:
            raise ValueError(f"sm90 w1: stream_k over {sk_ctas} CTAs, the scratch holds 1..{scratch.ctas}")
    if grid_rows is None:
        grid_rows = e
    elif not 1 <= grid_rows <= e or (grid_rows < e and not cfg.active_first):
        raise ValueError(f"sm90 {mode}: grid_rows = {grid_rows} must be in 1..{e} (below {e} only with active_first)")
    if not 0 <= first_expert < e:
        raise ValueError(f"sm90 {mode}: first_expert = {first_expert} must be in 0..{e - 1}")
    sk = (scratch.partials.data_ptr(), scratch.counters.data_ptr()) if stream_k else (0, 0)
    if ring is None:
        sig, ticket, timeout = tuple(i64(a) for a in (0, 0, 0, 0, 0, 0, *sk)), 0, 0
    else:
        sig = tuple(i64(a) for a in (ring.inuse, ring.cgen, ring.offs, ring.err, ring.l1_full, ring.w1_done, *sk))
        ticket, timeout = ring.ticket, ring.timeout_ns
    sig += tuple(i64(t.data_ptr()) for t in extra)
    assert len(sig) == sig_words(mode, cfg)
    kern = compiled(mode, packed.m, packed.k, cfg, target_arch(dev.index))
    wq = packed.data.view(torch.int32).view(-1, 128, 4)
    ws = packed.scales.view(-1)
    kern(
        as_cute(wq, 0, 16),
        as_cute(ws, 0, 16),
        as_cute(x_rows, 0, 16, cutlass.Float8E4M3FN),
        as_cute(sxT, 1, 16),
        as_cute(offsets, 0, 4),
        as_cute(counts, 0, 4),
        as_cute(packed.lut, None, 16),
        *ep,
        sig,
        ticket,
        i64(timeout),
        e,
        sk_ctas if stream_k else grid_rows,
        first_expert,
        cuda.CUstream(torch.cuda.current_stream(dev).cuda_stream),
    )


def launch_w1(
    packed: PackedSm90,
    x_rows: torch.Tensor,
    sxT: torch.Tensor,
    route_w: torch.Tensor,
    offsets: torch.Tensor,
    counts: torch.Tensor,
    hq: torch.Tensor,
    hsT: torch.Tensor,
    cfg: Sm90Config,
    ring: RingSync | None = None,
    scratch: StreamKScratch | None = None,
    sk_ctas: int | None = None,
    bias: torch.Tensor | None = None,
    grid_rows: int | None = None,
    first_expert: int = 0,
) -> None:
    """W1 on expert-sorted rows: x_rows uint8 [R, H] (FP8 bits), sxT fp32 [H/128, R], route_w fp32 [R], offsets
    int32 [E + 1] (multiples of 8), counts int32 [E] -> hq uint8 [R, I] (FP8 bits), hsT fp32 [I/128, R].
    cfg.stream_k: scratch (StreamKScratch) is required; sk_ctas CTAs (default: the scratch's, two per SM) share the
    windows (the layer passes one per SM slot of the partition it runs on: cfg.occupancy per SM). cfg.bias: bias =
    b13 fp32 [E, 2I] (gate then up entries).
    grid_rows, first_expert: the grid's rows (see _launch)."""
    rows, inter = x_rows.shape[0], packed.m // 2
    if hq.shape != (rows, inter) or hq.dtype != torch.uint8 or hsT.shape != (packed.m // TILE_M, rows):
        raise ValueError(f"sm90 w1: hq / hsT must be uint8 [{rows}, {inter}] / fp32 [{packed.m // TILE_M}, {rows}]")
    extra = _epilogue_operands("w1", cfg, ((bias, "bias", (packed.experts, packed.m)),), x_rows.device)
    ep = (as_cute(route_w, 0, 4), as_cute(hq, 0, 16), as_cute(hsT, 1, 4))
    _launch("w1", packed, x_rows, sxT, offsets, counts, ep, cfg, ring, scratch, sk_ctas, extra, grid_rows, first_expert)


def launch_w2(
    packed: PackedSm90,
    hq: torch.Tensor,
    hsT: torch.Tensor,
    offsets: torch.Tensor,
    counts: torch.Tensor,
    dst: torch.Tensor,
    src: torch.Tensor,
    comb: torch.Tensor,
    cfg: Sm90Config,
    ring: RingSync | None = None,
    route_w: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    grid_rows: int | None = None,
    first_expert: int = 0,
) -> None:
    """W2: row i's bf16 output [H] goes to row dst[i] of rank src[i, 0]'s output buffer, whose address is comb[rank]
    (int64 [P]: the combine buffers of every rank, or one local output). cfg.bias: + route_w[i] * bias[e] before
    the store (route_w fp32 [R]: W1's routing weights of the same rows; bias = b2 fp32 [E, H]). grid_rows,
    first_expert: the grid's rows (see _launch)."""
    if src.dim() != 2 or src.shape[1] != 3 or comb.dtype != torch.int64 or dst.dtype != torch.int32:
        raise ValueError("sm90 w2: dst int32 [R], src int32 [R, 3], comb int64 [P]")
    operands = ((bias, "bias", (packed.experts, packed.m)), (route_w, "route_w", (hq.shape[0],)))
    extra = _epilogue_operands("w2", cfg, operands, hq.device)
    ep = (as_cute(dst, 0, 4), as_cute(src, 0, 4), as_cute(comb, 0, 8))
    _launch("w2", packed, hq, hsT, offsets, counts, ep, cfg, ring, None, None, extra, grid_rows, first_expert)


def _epilogue_operands(mode: str, cfg: Sm90Config, operands, device) -> tuple[torch.Tensor, ...]:
    """The fp32 operands cfg.bias needs (name, tensor, shape), checked; none without it."""
    given = [t is not None for t, _, _ in operands]
    if any(given) != cfg.bias or (cfg.bias and not all(given)):
        names = " and ".join(n for _, n, _ in operands)
        raise ValueError(f"sm90 {mode}: {names} go with cfg.bias and only with it")
    for t, name, shape in operands if cfg.bias else ():
        if t.dtype != torch.float32 or tuple(t.shape) != shape or not t.is_contiguous() or t.device != device:
            raise ValueError(f"sm90 {mode}: {name} must be contiguous fp32 {shape} on {device}")
    return tuple(t for t, _, _ in operands) if cfg.bias else ()


def w1(packed: PackedSm90, acts: Activations, layout: RowLayout, cfg: Sm90Config, bias: torch.Tensor | None = None):
    """W1 on prepared rows -> (hq uint8 [R, I] FP8 bits, hsT fp32 [I/128, R]); bias: b13 where cfg.bias."""
    rows, dev = layout.rows, acts.x_rows.device
    hq = torch.empty(rows, packed.m // 2, dtype=torch.uint8, device=dev)
    hsT = torch.empty(packed.m // TILE_M, rows, dtype=torch.float32, device=dev)
    scratch = StreamKScratch.make(dev, cfg.n_tile) if cfg.stream_k else None
    args = (acts.x_rows, acts.sxT, acts.route_w, layout.offsets, layout.counts, hq, hsT, cfg, None, scratch)
    launch_w1(packed, *args, bias=bias)
    return hq, hsT


def w2(
    packed: PackedSm90,
    hq: torch.Tensor,
    hsT: torch.Tensor,
    layout: RowLayout,
    out: torch.Tensor,
    cfg: Sm90Config,
    route_w: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[slot, :] = W2_e h[row] (+ route_w[row] b2_e where cfg.bias) for every valid row (slot = the row's (token,
    slot) index); bf16 [T*k, H]."""
    if out.dtype != torch.bfloat16 or out.dim() != 2 or out.shape[1] != packed.m or not out.is_contiguous():
        raise ValueError(f"sm90 w2: out must be contiguous bf16 [*, {packed.m}]")
    src = torch.zeros(layout.rows, 3, dtype=torch.int32, device=hq.device)  # every row to "rank 0": out
    comb = torch.full((1,), out.data_ptr(), dtype=torch.int64, device=hq.device)  # (capturable: no host copy)
    launch_w2(packed, hq, hsT, layout.offsets, layout.counts, layout.src_slot, src, comb, cfg, None, route_w, bias)
    return out


def prefetch_l2(ranges: list[tuple[int, int]], ctas: int = 8) -> None:
    """L2 prefetch of (device address, bytes) ranges on the current stream (kernel_prefetch): `ctas` CTAs of 128
    threads issue one 16 KB prefetch each per turn. Each address 16-byte aligned, each size a multiple of 16."""
    import cuda.bindings.driver as cuda

    from gcmoe_core.cutedsl import cutlass_modules, target_arch

    from .kernel_prefetch import MAX_RANGES, compiled

    if not 1 <= len(ranges) <= MAX_RANGES:
        raise ValueError(f"sm90 prefetch_l2: 1..{MAX_RANGES} ranges, got {len(ranges)}")
    if any(a % 16 or n % 16 or not 0 < n < 2**31 for a, n in ranges):
        raise ValueError(f"sm90 prefetch_l2: ranges must be 16-byte aligned, 16 .. 2^31 - 16 bytes: {ranges}")
    cutlass = cutlass_modules()[0]
    kern = compiled(len(ranges), target_arch(torch.cuda.current_device()))
    kern(
        tuple(cutlass.Int64(a) for a, _ in ranges),
        tuple(cutlass.Int32(n) for _, n in ranges),
        cutlass.Int32(ctas),
        cuda.CUstream(torch.cuda.current_stream().cuda_stream),
    )


class MoESm90:
    """The prepacked weights of one rank's routed (+ shared, appended) experts for the sm90 kernels, their epilogue
    (activation; biases b13 fp32 [E, 2I], b2 fp32 [E, H] or None) and the kernel configuration per call size. Runs
    nothing: the layer is gcmoe's sm90 backend."""

    def __init__(
        self,
        w13: PackedSm90,
        w2: PackedSm90,
        num_routed: int,
        cfg: Sm90Config | None = None,
        act: Activation = SWIGLU,
        bias: tuple[torch.Tensor, torch.Tensor] | None = None,
    ):
        if not w13.gate_up or w2.gate_up or w13.experts != w2.experts or w13.m != 2 * w2.k or w13.k != w2.m:
            raise ValueError("MoESm90: w13 (gate/up interleaved) and w2 prepacks do not belong to one layer")
        if bias is not None and (w13.experts != num_routed or bias[0].shape != (num_routed, w13.m)):
            raise ValueError("MoESm90: biases need [E, 2I] / [E, H] fp32 for the routed experts only (no shared)")
        self.w13, self.w2 = w13, w2
        self.num_routed = num_routed
        self.num_shared = w13.experts - num_routed
        self.hidden, self.inter = w2.m, w2.k
        self.cfg = cfg
        self.act = act
        self.w13_bias, self.w2_bias = bias or (None, None)

    @classmethod
    def from_weights(cls, weights: MoEWeights, cfg: Sm90Config | None = None, act: Activation = SWIGLU) -> MoESm90:
        """Prepack MXFP4 weights (shared experts appended after the routed ones); biases kept as they are."""
        if weights.quant != "fp8_mxfp4":
            raise ValueError("MoESm90: the sm90 kernels take MXFP4 weights (quant='fp8_mxfp4')")
        w13, w2_ = weights.shared_as_experts()
        e, two_i, h = w13.shape
        why = layer_missing(h, two_i // 2, e)
        if why:
            raise ValueError(f"MoESm90: {why}")
        p13, p2 = prepack_sm90(w13, gate_up=True), prepack_sm90(w2_, gate_up=False)
        return cls(p13, p2, weights.num_experts, cfg, act, weights.biases())

    def shared_w1_ranges(self) -> list[tuple[int, int]]:
        """(address, bytes) of each shared expert's W1 weights and scale records (contiguous per expert in the
        prepacked tensors): what every call of the layer reads first, for prefetch_l2. Empty without shared experts."""
        ranges = []
        for e in range(self.num_routed, self.w13.experts):
            for t in (self.w13.data[e], self.w13.scales[e]):
                ranges.append((t.data_ptr(), t.numel() * t.element_size()))
        return ranges

    def tensors(self) -> list[torch.Tensor]:
        """The device tensors that carry this layer (what the torch.library op receives): weights, then biases."""
        bias = [] if self.w13_bias is None else [self.w13_bias, self.w2_bias]
        return [self.w13.data, self.w13.scales, self.w2.data, self.w2.scales, *bias]

    @classmethod
    def from_tensors(cls, tensors: list[torch.Tensor], num_routed: int, act: Activation = SWIGLU) -> MoESm90:
        d13, s13, d2, s2, *bias = tensors
        w13 = PackedSm90(d13, s13, d13.shape[1] * TILE_M, d13.shape[2] * WINDOW_K, True, 0)
        w2_ = PackedSm90(d2, s2, d2.shape[1] * TILE_M, d2.shape[2] * WINDOW_K, False, 0)
        return cls(w13, w2_, num_routed, None, act, tuple(bias) or None)

    @property
    def epilogue(self) -> dict:
        """The Sm90Config fields of this layer's epilogue (empty for SwiGLU without biases: the default kernels)."""
        return epilogue_flags(self.act, self.w13_bias is not None)

    def config_for(self, tokens: int, top_k: int, sms: int = 132) -> Sm90Config:
        """The kernel configuration for a call of `tokens` tokens per rank on `sms` SMs (self.cfg forces one; the
        layer's epilogue flags apply to either)."""
        shape = (self.num_routed, self.hidden, self.inter, self.num_shared)
        return layer_config(tokens, top_k, *shape, sms=sms, forced=self.cfg, epilogue=self.epilogue)


def epilogue_flags(act: Activation, bias: bool) -> dict:
    """The Sm90Config fields of an epilogue: activation `act`, biases or not (empty for SwiGLU without biases)."""
    flags: dict = {}
    if act.kind != "swiglu":
        flags.update(activation=act.kind, swiglu_alpha=act.alpha, swiglu_limit=act.limit)
    if bias:
        flags["bias"] = True
    return flags


def layer_config(
    tokens: int,
    top_k: int,
    num_routed: int,
    hidden: int,
    inter: int,
    num_shared: int,
    sms: int = 132,
    forced: Sm90Config | None = None,
    epilogue: dict | None = None,
) -> Sm90Config:
    """The kernel configuration of a layer (its prepacked, padded H and I; shared experts riding the routed experts'
    launch) for `tokens` tokens per rank on `sms` SMs: choose_config's (or `forced`), one window per loop step where
    K / 128 is odd, and the layer's epilogue flags (epilogue_flags), its half tiles kept where half_tiles_ok allows
    them with the flags. Without the weights: what MoESm90.config_for returns, for tools that compile a layer's
    kernels ahead of it."""
    cfg = forced or choose_config(tokens, top_k, num_routed, hidden, inter, sms, num_shared)
    if min(hidden, inter) // WINDOW_K % cfg.prefetch:
        cfg = replace(cfg, prefetch=1)
    if not epilogue:
        return cfg
    return with_halves(replace(cfg, w1_half=False, w2_half=False, **epilogue), cfg.w1_half, cfg.w2_half)


def emulate_w1(
    w13: MXFP4Tensor, acts: Activations, layout: RowLayout, act: Activation = SWIGLU, bias: torch.Tensor | None = None
):
    """Torch model of the W1 kernel's outputs (effective sm90 weights, FP32 math: the reference's W1 on them):
    (hq, hsT) for valid rows; bias: b13 fp32 [E, 2I] or None."""
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
        q, s = w1_reference(x[r], eff[e], acts.route_w[r], "fp8_mxfp4", act, None if bias is None else bias[e])
        hq[r], hsT[:, r] = q.view(torch.uint8), s.t()
    return hq, hsT


def emulate_w2(
    w2_: MXFP4Tensor,
    hq: torch.Tensor,
    hsT: torch.Tensor,
    layout: RowLayout,
    out: torch.Tensor,
    route_w: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
):
    """Torch model of the W2 kernel's stores (the reference's W2 on the effective weights): out[src_slot[row]] for
    valid rows; with bias (b2 fp32 [E, H]) + route_w[row] b2."""
    from .prepack import effective_weights_sm90

    eff = effective_weights_sm90(w2_)
    hk = hq.shape[1] // WINDOW_K
    h = (hq.view(torch.float8_e4m3fn).float().view(-1, hk, WINDOW_K) * hsT.t().unsqueeze(-1)).view(hq.shape[0], -1)
    offs, cnt = layout.offsets.tolist(), layout.counts.tolist()
    for e in range(eff.shape[0]):
        if cnt[e] == 0:
            continue
        r = slice(offs[e], offs[e] + cnt[e])
        b2 = None if bias is None else bias[e]
        out[layout.src_slot[r].long()] = w2_reference(h[r], eff[e], None if route_w is None else route_w[r], b2)
    return out
