"""Plain-torch reference of the MoE layer (any device) — the ground truth every kernel and backend is tested against.

    y[t] = bf16( sum_{j < k} row(t, ids[t, j], w[t, j])  +  sum_{s < S} row_shared(t, s) )    (fp32 sum, slot order)
    row(t, e, w) = bf16( W2_e · act( W13_e · x[t] ) · w )
    act(gu) = silu(gate) * up     (W13 rows: gate rows [0, I), then up rows [I, 2I))

Two modes, both fp32 arithmetic on the values each mode's kernels see:
  "fp8_mxfp4"  x -> FP8 E4M3 1x128 (power-of-two scales) -> dequantised; W13/W2 dequantised exactly from MXFP4;
               h = silu(g) * u * w in fp32, re-quantised to FP8 1x128 (the W1 epilogue), then W2; per-slot row -> bf16.
  "bf16"       x, W13, W2 in bf16, products in fp32; h rounded to bf16; per-slot row -> bf16.
The routing weight multiplies h (it is fused into the W1 epilogue); shared experts use weight 1.0. Rows are summed
in slot order (routed j = 0..k-1, then shared) in fp32, as the finalize kernel sums the combine buffer.

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
    shared_w13 [S, 2I, H], shared_w2 [S, H, I]. Either all bf16 tensors, or all MXFP4Tensor (quantised along K)."""

    w13: Weight
    w2: Weight
    shared_w13: Weight | None = None
    shared_w2: Weight | None = None

    def __post_init__(self) -> None:
        kinds = {type(w) for w in self.all() if w is not None}
        if len(kinds) != 1:
            raise ValueError("MoEWeights: mix of MXFP4 and unquantised weights")
        e, two_i, h = self.w13.shape
        if tuple(self.w2.shape) != (e, h, two_i // 2):
            raise ValueError(f"MoEWeights: w2 shape {tuple(self.w2.shape)} does not match w13 {tuple(self.w13.shape)}")
        if (self.shared_w13 is None) != (self.shared_w2 is None):
            raise ValueError("MoEWeights: shared_w13 and shared_w2 must be given together")

    def all(self) -> tuple[Weight | None, ...]:
        return (self.w13, self.w2, self.shared_w13, self.shared_w2)

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
    def from_float(cls, w13, w2, shared_w13=None, shared_w2=None, quant: str = "fp8_mxfp4") -> MoEWeights:
        """Quantise (fp8_mxfp4) or cast (bf16) unquantised weights."""
        conv = quantize_mxfp4 if quant == "fp8_mxfp4" else (lambda w: w.to(torch.bfloat16).contiguous())
        return cls(*(None if w is None else conv(w) for w in (w13, w2, shared_w13, shared_w2)))

    def to(self, device) -> MoEWeights:
        return MoEWeights(*(None if w is None else w.to(device) for w in self.all()))

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
        return MoEWeights(*(None if w is None else _f32(w).to(torch.bfloat16) for w in self.all()))

    def nbytes(self) -> int:
        return sum(
            w.nbytes() if isinstance(w, MXFP4Tensor) else w.numel() * w.element_size()
            for w in self.all()
            if w is not None
        )


def _f32(w: Weight) -> torch.Tensor:
    return w.dequantize() if isinstance(w, MXFP4Tensor) else w.float()


def activation_input(x: torch.Tensor, quant: str) -> torch.Tensor:
    """What W1 multiplies: the FP8 round trip of x (fp8_mxfp4) or x itself (bf16), as fp32 [T, H]."""
    return fp8_roundtrip(x) if quant == "fp8_mxfp4" else x.float()


def w1_reference(x_rows: torch.Tensor, w13_e: Weight, route_w: torch.Tensor, quant: str):
    """W1 of one expert with its fused epilogue. x_rows fp32 [R, H] (activation_input), route_w fp32 [R].
    fp8_mxfp4 -> (h_fp8 float8_e4m3fn [R, I], h_scale fp32 [R, I/128]);  bf16 -> h bf16 [R, I]."""
    gu = x_rows @ _f32(w13_e).T
    i = gu.shape[1] // 2
    h = F.silu(gu[:, :i]) * gu[:, i:] * route_w.unsqueeze(1)
    return quantize_fp8_e4m3_1x128(h) if quant == "fp8_mxfp4" else h.to(torch.bfloat16)


def w2_reference(h, w2_e: Weight) -> torch.Tensor:
    """W2 of one expert: h (FP8 pair or bf16 [R, I]) -> bf16 rows [R, H]."""
    h32 = dequantize_fp8_1x128(*h) if isinstance(h, tuple) else h.float()
    return (h32 @ _f32(w2_e).T).to(torch.bfloat16)


def expert_rows(x_rows: torch.Tensor, route_w: torch.Tensor, w13_e: Weight, w2_e: Weight, quant: str) -> torch.Tensor:
    """One expert applied to R rows: bf16 [R, H]."""
    return w2_reference(w1_reference(x_rows, w13_e, route_w, quant), w2_e)


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
            out = expert_rows(x_all, flat_w, weights.w13[e], weights.w2[e], quant)
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
                rows[sel] = expert_rows(x_in[sel // k], flat_w[sel], weights.w13[e], weights.w2[e], quant)
    return rows.view(t, k, h), local.view(t, k)


def shared_slot_rows(x_in: torch.Tensor, weights: MoEWeights, quant: str | None = None) -> torch.Tensor:
    """[T, S, H] bf16 rows of the shared experts (weight 1.0), or [T, 0, H]."""
    t, h = x_in.shape
    quant = quant or weights.quant
    ones = torch.ones(t, dtype=torch.float32, device=x_in.device)
    rows = [
        expert_rows(x_in, ones, weights.shared_w13[s], weights.shared_w2[s], quant) for s in range(weights.num_shared)
    ]
    return torch.stack(rows, dim=1) if rows else x_in.new_zeros(t, 0, h, dtype=torch.bfloat16)


def moe_reference(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    weights: MoEWeights,
    capturable: bool | None = None,
    quant: str | None = None,
) -> torch.Tensor:
    """The whole layer on one rank holding every expert in `weights`: bf16 [T, H].

    capturable=None picks the dense (sync-free) path while a CUDA graph is being captured, else the sparse one.
    quant defaults to the weights' format (set it for exact_bf16() weights of an fp8_mxfp4 layer)."""
    if capturable is None:
        capturable = x.is_cuda and torch.cuda.is_current_stream_capturing()
    quant = quant or weights.quant
    x_in = activation_input(x, quant)
    routed, _ = routed_slot_rows(x_in, topk_ids, topk_weights, weights, capturable=capturable, quant=quant)
    return combine_slots(torch.cat((routed, shared_slot_rows(x_in, weights, quant)), dim=1))


def moe_reference_loop_fp64(x, topk_ids, topk_weights, weights: MoEWeights) -> torch.Tensor:
    """Independent token-by-token, slot-by-slot float64 loop on the CPU with the same rounding points (FP8 of x and
    of h, bf16 per slot row, bf16 output). Each used expert is dequantised once. For validation on small problems."""
    quant = weights.quant
    cpu = torch.device("cpu")
    x, ids, tw = x.to(cpu), topk_ids.to(cpu), topk_weights.to(cpu)
    (t_count, h), k = x.shape, ids.shape[1]
    xin = activation_input(x, quant).double()
    rows = torch.zeros(t_count, k + weights.num_shared, h, dtype=torch.float64)

    def apply(w13, w2, t: int, w: float) -> torch.Tensor:
        gu = w13 @ xin[t]
        i_size = gu.shape[0] // 2
        g, u = gu[:i_size], gu[i_size:]
        hv = g / (1.0 + torch.exp(-g)) * u * w
        hv = (
            fp8_roundtrip(hv.float().unsqueeze(0))[0].double()
            if quant == "fp8_mxfp4"
            else hv.to(torch.bfloat16).double()
        )
        return (w2 @ hv).to(torch.bfloat16).double()

    for e in sorted(set(ids.flatten().tolist())):
        a13, a2 = _f32(weights.w13[e].to(cpu)).double(), _f32(weights.w2[e].to(cpu)).double()
        for t, j in (ids == e).nonzero().tolist():
            rows[t, j] = apply(a13, a2, t, float(tw[t, j]))
    for s_idx in range(weights.num_shared):
        a13, a2 = _f32(weights.shared_w13[s_idx].to(cpu)).double(), _f32(weights.shared_w2[s_idx].to(cpu)).double()
        for t in range(t_count):
            rows[t, k + s_idx] = apply(a13, a2, t, 1.0)
    acc = torch.zeros(t_count, h, dtype=torch.float64)
    for j in range(rows.shape[1]):
        acc += rows[:, j]
    return acc.to(torch.bfloat16).to(topk_ids.device)
