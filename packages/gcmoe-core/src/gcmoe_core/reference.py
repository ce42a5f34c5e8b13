"""Plain-torch reference of the MoE layer (any device) — the ground truth every kernel and backend is tested against.

    y[t] = bf16( sum_{j < k} row(t, ids[t, j], w[t, j])  +  sum_{s < S} row_shared(t, s) )    (fp32 sum, slot order)
    row(t, e, w) = bf16( (W2_e · act( W13_e · x[t] + b13_e ) + b2_e) · w )      (biases: MoEConfig.has_bias)
    act(gate, up) = silu(gate) * up, or the clamped gpt-oss form (Activation)   (W13 rows: gate [0, I), up [I, 2I))

Two modes, both fp32 arithmetic on the values each mode's kernels see:
  "fp8_mxfp4"  x -> FP8 E4M3 1x128 (power-of-two scales) -> dequantised; W13/W2 dequantised exactly from MXFP4;
               h = act(g, u) * w in fp32, re-quantised to FP8 1x128 (the W1 epilogue), then W2; per-slot row -> bf16.
  "bf16"       x, W13, W2 in bf16, products in fp32; h rounded to bf16; per-slot row -> bf16.
The routing weight multiplies h (fused into the W1 epilogue) and b2 (added in fp32 before the row's bf16 rounding,
as the W2 epilogue does); shared experts use weight 1.0. Rows are summed in slot order in fp32, as the finalize kernel
sums the combine buffer. A slot whose id is not one of the weights' experts (-1: MoEConfig.masked_ids) adds zero.

Two evaluation paths of the same per-expert functions (`w1_reference`, `w2_reference`):
  sparse   gathers each expert's rows (host sync per call; the default outside CUDA-graph capture)
  dense    runs every expert over every row and selects (no host sync: capturable in a CUDA graph)
`moe_reference_loop_fp64` is an independent token-by-token float64 loop that validates both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .formats import MXFP4Tensor, dequantize_fp8_1x128, fp8_roundtrip, quantize_fp8_e4m3_1x128, quantize_mxfp4

Weight = torch.Tensor | MXFP4Tensor


@dataclass(frozen=True)
class MoEWeights:
    """Expert weights of one rank: w13 [E, 2I, H] (gate rows then up rows), w2 [E, H, I]; optional shared experts
    shared_w13 [S, 2I, H], shared_w2 [S, H, I]. Either all bf16 tensors, or all MXFP4Tensor (quantised along K).
    Optional biases of the routed experts (MoEConfig.has_bias; not with shared experts), fp32 whatever the weights:
    w13_bias [E, 2I] (gate entries then up entries, as w13's rows), w2_bias [E, H]."""

    w13: Weight
    w2: Weight
    shared_w13: Weight | None = None
    shared_w2: Weight | None = None
    w13_bias: torch.Tensor | None = None
    w2_bias: torch.Tensor | None = None

    def __post_init__(self) -> None:
        kinds = {type(w) for w in self.all() if w is not None}
        if len(kinds) != 1:
            raise ValueError("MoEWeights: mix of MXFP4 and unquantised weights")
        e, two_i, h = self.w13.shape
        if tuple(self.w2.shape) != (e, h, two_i // 2):
            raise ValueError(f"MoEWeights: w2 shape {tuple(self.w2.shape)} does not match w13 {tuple(self.w13.shape)}")
        if (self.shared_w13 is None) != (self.shared_w2 is None):
            raise ValueError("MoEWeights: shared_w13 and shared_w2 must be given together")
        if (self.w13_bias is None) != (self.w2_bias is None):
            raise ValueError("MoEWeights: w13_bias and w2_bias must be given together")
        if self.w13_bias is not None:
            if self.num_shared:
                raise ValueError("MoEWeights: biases with shared experts are not supported")
            for name, b, want in (("w13_bias", self.w13_bias, (e, two_i)), ("w2_bias", self.w2_bias, (e, h))):
                if not isinstance(b, torch.Tensor) or b.dtype != torch.float32 or tuple(b.shape) != want:
                    got = f"{b.dtype} {tuple(b.shape)}" if isinstance(b, torch.Tensor) else type(b).__name__
                    raise ValueError(f"MoEWeights: {name} must be fp32 {want}, got {got}")
                if b.device != self.device:
                    raise ValueError(f"MoEWeights: {name} is on {b.device}, the weights on {self.device}")

    def all(self) -> tuple[Weight | None, ...]:
        """The weights (not the biases)."""
        return (self.w13, self.w2, self.shared_w13, self.shared_w2)

    def biases(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(w13_bias, w2_bias), or None without biases."""
        return None if self.w13_bias is None else (self.w13_bias, self.w2_bias)

    def bias_of(self, e: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Expert e's (b13 [2I], b2 [H]), or None."""
        return None if self.w13_bias is None else (self.w13_bias[e], self.w2_bias[e])

    def rank_slice(self, rank: int, ranks: int) -> MoEWeights:
        """The experts EP rank `rank` of `ranks` holds: routed experts [rank E/P, (rank + 1) E/P) with their biases,
        and every shared expert (replicated on every rank)."""
        e = self.num_experts
        if e % ranks or not 0 <= rank < ranks:
            raise ValueError(f"MoEWeights.rank_slice: rank {rank} of {ranks} over E = {e} experts")
        mine = slice(rank * (e // ranks), (rank + 1) * (e // ranks))
        bias = (None, None) if self.w13_bias is None else (self.w13_bias[mine], self.w2_bias[mine])
        return MoEWeights(self.w13[mine], self.w2[mine], self.shared_w13, self.shared_w2, *bias)

    def _with(self, conv, bias_conv=lambda b: b) -> MoEWeights:
        """conv applied to every weight and bias_conv to every bias (None stays None)."""
        ws = (None if w is None else conv(w) for w in self.all())
        bs = (None if b is None else bias_conv(b) for b in (self.w13_bias, self.w2_bias))
        return MoEWeights(*ws, *bs)

    @classmethod
    def from_flat(cls, tensors, has_bias: bool) -> MoEWeights:
        """Unquantised weights from (w13, w2[, shared_w13, shared_w2][, w13_bias, w2_bias]) (flatten order, None
        entries dropped)."""
        w13, w2, *rest = tensors
        bias = rest[len(rest) - 2 :] if has_bias else []
        shared = rest[: len(rest) - len(bias)] or [None, None]
        return cls(w13, w2, *shared, *(bias or [None, None]))

    def padded(self, hidden: int, inter: int) -> MoEWeights:
        """Zero-padded to H = hidden, I = inter (MoEConfig.padded()): W13's K columns, gate rows [I, inter) and up rows
        [inter + I, 2 inter); W2's rows [H, hidden) and K columns [I, inter); bias entries likewise (MXFP4: zero
        codes, scale byte 0). Exact, with x's columns [H, hidden) zero too: padded K columns add 0 * 0 products;
        a padded I channel has gate = up = 0 (zero rows, zero bias), so act = 0 for both activations (silu(0) * 0;
        min(0, limit) = 0 as limit > 0, then 0 * sigmoid(0) * (0 + 1)): it leaves the FP8 1x128 block maxima of
        the intermediate unchanged (a padded block is the unpadded layer's partial last block) and meets zero W2
        columns; padded output columns are zero and sliced off by the caller."""
        _, two_i, h = self.w13.shape
        i = two_i // 2
        if (hidden, inter) == (h, i):
            return self
        if hidden < h or inter < i:
            raise ValueError(f"MoEWeights.padded: ({hidden}, {inter}) is smaller than (H, I) = ({h}, {i})")

        def pad(w, rows, cols, split):  # [.., N, K] -> [.., rows, cols]; with split, each half of N on its own
            if isinstance(w, MXFP4Tensor):  # (cols: a multiple of 32, as the padded H and I are)
                return MXFP4Tensor(pad(w.packed, rows, cols // 2, split), pad(w.scale, rows, cols // 32, split))
            n = w.shape[-2]
            halves = (w[..., : n // 2, :], w[..., n // 2 :, :]) if split else (w,)
            per = rows // len(halves)
            out = w.new_zeros(*w.shape[:-2], rows, cols)
            for j, part in enumerate(halves):
                out[..., j * per : j * per + part.shape[-2], : part.shape[-1]] = part
            return out

        def pad_bias(b, n, split):
            return pad(b.unsqueeze(-1), n, 1, split).squeeze(-1)

        def w13_of(w):
            return None if w is None else pad(w, 2 * inter, hidden, True)

        def w2_of(w):
            return None if w is None else pad(w, hidden, inter, False)

        biases = (None, None)
        if self.w13_bias is not None:
            biases = (pad_bias(self.w13_bias, 2 * inter, True), pad_bias(self.w2_bias, hidden, False))
        return MoEWeights(w13_of(self.w13), w2_of(self.w2), w13_of(self.shared_w13), w2_of(self.shared_w2), *biases)

    @property
    def quant(self) -> str:
        return "fp8_mxfp4" if isinstance(self.w13, MXFP4Tensor) else "bf16"

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def num_shared(self) -> int:
        return 0 if self.shared_w13 is None else self.shared_w13.shape[0]

    @property
    def device(self) -> torch.device:
        return self.w13.device

    @classmethod
    def from_float(
        cls, w13, w2, shared_w13=None, shared_w2=None, quant: str = "fp8_mxfp4", w13_bias=None, w2_bias=None
    ) -> MoEWeights:
        """Quantise (fp8_mxfp4) or cast (bf16) unquantised weights; biases as fp32."""
        conv = quantize_mxfp4 if quant == "fp8_mxfp4" else (lambda w: w.to(torch.bfloat16).contiguous())
        ws = (None if w is None else conv(w) for w in (w13, w2, shared_w13, shared_w2))
        bs = (None if b is None else b.to(torch.float32).contiguous() for b in (w13_bias, w2_bias))
        return cls(*ws, *bs)

    def to(self, device) -> MoEWeights:
        return self._with(lambda w: w.to(device), lambda b: b.to(device))

    def shared_as_experts(self) -> tuple[Weight, Weight]:
        """(w13, w2) with the shared experts appended after the routed ones (the kernels run them as experts
        E..E+S-1 that every token is routed to with weight 1)."""
        if not self.num_shared:
            return self.w13, self.w2

        def cat(a, b):
            if isinstance(a, MXFP4Tensor):
                return MXFP4Tensor(torch.cat((a.packed, b.packed)), torch.cat((a.scale, b.scale)))
            return torch.cat((a, b))

        return cat(self.w13, self.shared_w13), cat(self.w2, self.shared_w2)

    def exact_bf16(self) -> MoEWeights:
        """MXFP4 weights dequantised into bf16 — exact (an E2M1 value times a power of two has <= 2 significant
        bits) — for fast reference evaluation; pass quant="fp8_mxfp4" alongside to keep the FP8 activations."""
        return self._with(lambda w: _f32(w).to(torch.bfloat16))

    def nbytes(self) -> int:
        return sum(
            w.nbytes() if isinstance(w, MXFP4Tensor) else w.numel() * w.element_size()
            for w in (*self.all(), self.w13_bias, self.w2_bias)
            if w is not None
        )


def _f32(w: Weight) -> torch.Tensor:
    return w.dequantize() if isinstance(w, MXFP4Tensor) else w.float()


def activation_input(x: torch.Tensor, quant: str) -> torch.Tensor:
    """What W1 multiplies: the FP8 round trip of x (fp8_mxfp4) or x itself (bf16), as fp32 [T, H]."""
    return fp8_roundtrip(x) if quant == "fp8_mxfp4" else x.float()


@dataclass(frozen=True)
class Activation:
    """The expert's activation of W13's gate and up halves (MoEConfig.activation; the one home of its formula, used
    by the references and the kernels' torch models):
        swiglu          silu(gate) * up
        swiglu_clamped  gate = min(gate, limit), up = clamp(up, -limit, limit): gate * sigmoid(alpha gate) * (up + 1)
    """

    kind: str = "swiglu"
    alpha: float = 1.702
    limit: float = 7.0

    @classmethod
    def of(cls, cfg) -> Activation:
        """The activation of a MoEConfig."""
        return cls(cfg.activation, float(cfg.swiglu_alpha), float(cfg.swiglu_limit))

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.kind == "swiglu":
            return F.silu(gate) * up
        if self.kind != "swiglu_clamped":
            raise ValueError(f"Activation: unknown kind {self.kind!r}")
        gate = gate.clamp(max=self.limit)
        up = up.clamp(-self.limit, self.limit)
        return gate * torch.sigmoid(self.alpha * gate) * (up + 1.0)


SWIGLU = Activation()


def w1_reference(
    x_rows: torch.Tensor,
    w13_e: Weight,
    route_w: torch.Tensor,
    quant: str,
    act: Activation = SWIGLU,
    b13_e: torch.Tensor | None = None,
):
    """W1 of one expert with its fused epilogue: h = act(gate, up) * route_w with gu = x W13^T (+ b13). x_rows fp32
    [R, H] (activation_input), route_w fp32 [R], b13_e fp32 [2I] or None.
    fp8_mxfp4 -> (h_fp8 float8_e4m3fn [R, I], h_scale fp32 [R, I/128]);  bf16 -> h bf16 [R, I]."""
    gu = x_rows @ _f32(w13_e).T
    if b13_e is not None:
        gu = gu + b13_e
    i = gu.shape[1] // 2
    h = act(gu[:, :i], gu[:, i:]) * route_w.unsqueeze(1)
    return quantize_fp8_e4m3_1x128(h) if quant == "fp8_mxfp4" else h.to(torch.bfloat16)


def w2_reference(h, w2_e: Weight, route_w: torch.Tensor | None = None, b2_e: torch.Tensor | None = None):
    """W2 of one expert: h (FP8 pair or bf16 [R, I]) -> bf16 rows [R, H] = bf16(h W2^T (+ route_w b2)): h already
    carries the routing weight, so the bias gets it here, in fp32 before the rounding."""
    h32 = dequantize_fp8_1x128(*h) if isinstance(h, tuple) else h.float()
    out = h32 @ _f32(w2_e).T
    if b2_e is not None:
        out = out + route_w.unsqueeze(1) * b2_e
    return out.to(torch.bfloat16)


def expert_rows(
    x_rows: torch.Tensor,
    route_w: torch.Tensor,
    w13_e: Weight,
    w2_e: Weight,
    quant: str,
    act: Activation = SWIGLU,
    bias: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """One expert applied to R rows: bf16 [R, H]; bias = (b13 [2I], b2 [H]) or None (MoEWeights.bias_of)."""
    b13, b2 = bias or (None, None)
    return w2_reference(w1_reference(x_rows, w13_e, route_w, quant, act, b13), w2_e, route_w, b2)


def combine_slots(slot_rows: torch.Tensor) -> torch.Tensor:
    """[T, S, H] bf16 rows -> [T, H] bf16: fp32 sum in slot order (the finalize kernel's order)."""
    acc = slot_rows[:, 0].float()
    for j in range(1, slot_rows.shape[1]):
        acc = acc + slot_rows[:, j].float()
    return acc.to(torch.bfloat16)


def routed_slot_rows(
    x_in: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: MoEWeights,
    expert_base: int = 0,
    capturable: bool = False,
    quant: str | None = None,
    act: Activation = SWIGLU,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-slot routed rows for slots whose expert lives in [expert_base, expert_base + E_local).

    x_in: fp32 [T, H] (activation_input); quant defaults to the weights' format. Returns (rows bf16 [T, k, H],
    written bool [T, k]); rows of slots owned by
    other ranks are left zero and written=False.
    """
    t, k = topk_ids.shape
    h = x_in.shape[1]
    quant = quant or weights.quant
    flat_ids = topk_ids.reshape(-1).long() - expert_base
    flat_w = topk_weights.reshape(-1).float()
    rows = torch.zeros(t * k, h, dtype=torch.bfloat16, device=x_in.device)
    local = (flat_ids >= 0) & (flat_ids < weights.num_experts)
    if capturable:
        x_all = x_in.repeat_interleave(k, dim=0)
        for e in range(weights.num_experts):
            out = expert_rows(x_all, flat_w, weights.w13[e], weights.w2[e], quant, act, weights.bias_of(e))
            rows = torch.where((flat_ids == e).unsqueeze(1), out, rows)
    else:
        key = torch.where(local, flat_ids, torch.full_like(flat_ids, weights.num_experts))
        order = torch.argsort(key, stable=True)
        counts = torch.bincount(key, minlength=weights.num_experts + 1).tolist()
        start = 0
        for e in range(weights.num_experts):
            sel = order[start : start + counts[e]]
            start += counts[e]
            if sel.numel():
                rows[sel] = expert_rows(
                    x_in[sel // k], flat_w[sel], weights.w13[e], weights.w2[e], quant, act, weights.bias_of(e)
                )
    return rows.view(t, k, h), local.view(t, k)


def shared_slot_rows(
    x_in: torch.Tensor, weights: MoEWeights, quant: str | None = None, act: Activation = SWIGLU
) -> torch.Tensor:
    """[T, S, H] bf16 rows of the shared experts (weight 1.0, no biases), or [T, 0, H]."""
    t, h = x_in.shape
    quant = quant or weights.quant
    ones = torch.ones(t, dtype=torch.float32, device=x_in.device)
    rows = [
        expert_rows(x_in, ones, weights.shared_w13[s], weights.shared_w2[s], quant, act)
        for s in range(weights.num_shared)
    ]
    return torch.stack(rows, dim=1) if rows else x_in.new_zeros(t, 0, h, dtype=torch.bfloat16)


def moe_reference(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: MoEWeights,
    capturable: bool | None = None,
    quant: str | None = None,
    act: Activation = SWIGLU,
) -> torch.Tensor:
    """The whole layer on one rank holding every expert in `weights`: bf16 [T, H].

    capturable=None picks the dense (sync-free) path while a CUDA graph is being captured, else the sparse one.
    quant defaults to the weights' format (set it for exact_bf16() weights of an fp8_mxfp4 layer). act: the
    expert's activation (Activation.of(cfg)); the weights' biases apply when they have them."""
    if capturable is None:
        capturable = x.is_cuda and torch.cuda.is_current_stream_capturing()
    quant = quant or weights.quant
    x_in = activation_input(x, quant)
    routed, _ = routed_slot_rows(x_in, topk_ids, topk_weights, weights, capturable=capturable, quant=quant, act=act)
    return combine_slots(torch.cat((routed, shared_slot_rows(x_in, weights, quant, act)), dim=1))


def moe_reference_loop_fp64(x, topk_ids, topk_weights, weights: MoEWeights, act: Activation = SWIGLU) -> torch.Tensor:
    """Independent token-by-token, slot-by-slot float64 loop on the CPU with the same rounding points (FP8 of x and
    of h, bf16 per slot row, bf16 output). Each used expert is dequantised once. For validation on small problems."""
    quant = weights.quant
    cpu = torch.device("cpu")
    x, ids, tw = x.to(cpu), topk_ids.to(cpu), topk_weights.to(cpu)
    (t_count, h), k = x.shape, ids.shape[1]
    xin = activation_input(x, quant).double()
    rows = torch.zeros(t_count, k + weights.num_shared, h, dtype=torch.float64)

    def apply(w13, w2, t: int, w: float, bias=None) -> torch.Tensor:
        gu = w13 @ xin[t]
        if bias is not None:
            gu = gu + bias[0]
        i_size = gu.shape[0] // 2
        hv = act(gu[:i_size], gu[i_size:]) * w
        hv = (
            fp8_roundtrip(hv.float().unsqueeze(0))[0].double()
            if quant == "fp8_mxfp4"
            else hv.to(torch.bfloat16).double()
        )
        out = w2 @ hv
        if bias is not None:
            out = out + w * bias[1]
        return out.to(torch.bfloat16).double()

    for e in sorted(set(ids.flatten().tolist())):
        if e < 0:  # a masked slot (MoEConfig.masked_ids): its row stays zero
            continue
        a13, a2 = _f32(weights.w13[e].to(cpu)).double(), _f32(weights.w2[e].to(cpu)).double()
        bias = weights.bias_of(e)
        bias = None if bias is None else tuple(b.to(cpu).double() for b in bias)
        for t, j in (ids == e).nonzero().tolist():
            rows[t, j] = apply(a13, a2, t, float(tw[t, j]), bias)
    for s_idx in range(weights.num_shared):
        a13, a2 = _f32(weights.shared_w13[s_idx].to(cpu)).double(), _f32(weights.shared_w2[s_idx].to(cpu)).double()
        for t in range(t_count):
            rows[t, k + s_idx] = apply(a13, a2, t, 1.0)
    acc = torch.zeros(t_count, h, dtype=torch.float64)
    for j in range(rows.shape[1]):
        acc += rows[:, j]
    return acc.to(torch.bfloat16).to(topk_ids.device)
