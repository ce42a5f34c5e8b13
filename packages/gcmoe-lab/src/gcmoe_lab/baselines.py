"""Layer-level baselines written with plain torch, for `gcmoe-lab bench` to time next to the gcmoe layer.

    base = TorchFp8MoE(cfg, weights, device)         # the same MoEWeights a gcmoe layer loads
    y = base(x, topk_ids, topk_weights)              # bf16 [T, H], the whole layer (routed + shared experts)

TorchFp8MoE does what a torch user would write with torch's FP8 grouped GEMM (torch._scaled_grouped_mm):

    ids, w  = routing with the shared experts appended as always-routed experts E..E+S-1 (weight 1)
    layout  = expert-sorted rows of the (token, slot) pairs, each expert padded to 16 rows (gcmoe_core.grouping)
    xq, sx  = FP8 E4M3 of x, one fp32 scale per token (amax / 448), gathered into the rows
    gu      = _scaled_grouped_mm(xq, W13q, sx, s13)                 bf16 [R, 2I]
    h       = silu(gate) * up * routing weight                      fp32
    hq, sh  = FP8 E4M3 of h, one fp32 scale per row (amax / 448)
    rows    = _scaled_grouped_mm(hq, W2q, sh, s2)                   bf16 [R, H]
    y       = fp32 sum of each token's slot rows in slot order -> bf16

Quantisation (not gcmoe's): FP8 E4M3 rowwise everywhere. Activations: one fp32 scale per row (per token for x, per
expert row for h), amax / 448. Weights: one fp32 scale per output channel (W13 row / W2 row), the power of two at or
above amax / 448: the layer's MXFP4 weights are dequantised exactly and re-quantised to FP8, which is then exact (an
E2M1 value times a power of two has 2 significant bits) unless a value falls below FP8's normal range.
gcmoe's own path (gcmoe_core.reference, quant="fp8_mxfp4") quantises activations FP8 per 1x128 block with
power-of-two scales instead, so the two differ by FP8 rounding of x and h: calc_diff ~2e-3 on random layers.

torch._scaled_grouped_mm runs on CUDA only (SM90+). Elsewhere (a CPU), or with grouped_mm=False, the same layer runs
with `scaled_grouped_mm_loop`: one fp32 matmul per expert over the same FP8 operands and scales, i.e. the math of
the grouped GEMM with the launch structure of a loop (a host sync per call) — for checking the baseline on a CPU,
never for timing. Not capturable in a CUDA graph either way: replaying torch's grouped GEMMs from a graph hit an
illegal address on torch 2.11 (H200, 2026-11-29), so the bench times this baseline eagerly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gcmoe_core.config import MoEConfig
from gcmoe_core.formats import FP8_E4M3_MAX, MXFP4Tensor
from gcmoe_core.grouping import append_shared, group_rows
from gcmoe_core.reference import MoEWeights, combine_slots

ROW_ALIGN = 16  # torch's grouped GEMMs want each group's row offset 16-aligned


def quantize_fp8_rowwise(a: torch.Tensor, pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., K] float -> (float8_e4m3fn [..., K], fp32 [...] scales): scale = amax / 448 over the last dim, or with
    pow2 the smallest power of two >= that (a zero row gets a tiny scale and quantises to zeros)."""
    a = a.float()
    s = a.abs().amax(dim=-1).clamp_min(1e-12) / FP8_E4M3_MAX
    if pow2:
        s = torch.exp2(torch.ceil(torch.log2(s)))
    q = (a / s.unsqueeze(-1)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q, s


def scaled_grouped_mm_loop(
    a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, offs: torch.Tensor
) -> torch.Tensor:
    """What torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs=offs, out_dtype=bf16) computes, as a loop:
    a FP8 [R, K], b FP8 [G, K, N], scale_a fp32 [R], scale_b fp32 [G, N], offs int32 [G] group end rows.
    Group g is rows [offs[g-1], offs[g]): out = bf16((a_rows @ b[g]) * scale_a_rows * scale_b[g]) with an fp32
    accumulator; rows after offs[-1] are zero. Reads offs on the host (one sync)."""
    out = torch.zeros(a.shape[0], b.shape[2], dtype=torch.bfloat16, device=a.device)
    start = 0
    for g, end in enumerate(offs.tolist()):
        if end > start:
            acc = a[start:end].float() @ b[g].float()
            out[start:end] = (acc * scale_a[start:end].unsqueeze(1) * scale_b[g].unsqueeze(0)).to(torch.bfloat16)
        start = end
    return out


def _has_scaled_grouped_mm(device: torch.device) -> bool:
    if device.type != "cuda" or not hasattr(torch, "_scaled_grouped_mm"):
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


class TorchFp8MoE:
    """The whole MoE layer (routed + shared experts) with torch._scaled_grouped_mm FP8 rowwise GEMMs; see the module
    docstring for the computation and its quantisation. grouped_mm: None = the grouped GEMM where torch has it for
    the device (CUDA, SM90+), else the per-expert loop; True / False force one."""

    def __init__(self, cfg: MoEConfig, weights: MoEWeights, device=None, grouped_mm: bool | None = None):
        self.device = torch.device(device) if device is not None else weights.device
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.cfg = cfg
        self.num_routed = weights.num_experts
        self.num_shared = weights.num_shared
        self.inter = cfg.intermediate_size
        self.grouped_mm = _has_scaled_grouped_mm(self.device) if grouped_mm is None else grouped_mm
        w13, w2 = weights.shared_as_experts()
        self.w13, self.s13 = self._prepare(w13)  # [E+S, H, 2I] (column-major view), [E+S, 2I]
        self.w2, self.s2 = self._prepare(w2)  # [E+S, I, H], [E+S, H]

    @property
    def backend(self) -> str:
        return "torch._scaled_grouped_mm" if self.grouped_mm else "torch per-expert loop (scaled_grouped_mm_loop)"

    def _prepare(self, w) -> tuple[torch.Tensor, torch.Tensor]:
        """[G, N, K] weights (MXFP4 or float) -> FP8 [G, K, N] as a transposed view of [G, N, K] (what the grouped
        GEMM wants for its second operand) and fp32 per-output-channel scales [G, N]. One expert at a time, so the
        fp32 copy of a full-size expert is the only temporary."""
        g, n, k = w.shape
        q = torch.empty(g, n, k, dtype=torch.float8_e4m3fn, device=self.device)
        s = torch.empty(g, n, dtype=torch.float32, device=self.device)
        for e in range(g):
            we = w[e].to(self.device)
            q[e], s[e] = quantize_fp8_rowwise(we.dequantize() if isinstance(we, MXFP4Tensor) else we.float(), pow2=True)
        return q.transpose(1, 2), s

    def _mm(self, a, b, sa, sb, offs) -> torch.Tensor:
        if self.grouped_mm:
            return torch._scaled_grouped_mm(a, b, sa, sb, offs=offs, out_dtype=torch.bfloat16)
        return scaled_grouped_mm_loop(a, b, sa, sb, offs)

    def __call__(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        t, hidden = x.shape
        ids, w = append_shared(topk_ids, topk_weights, self.num_routed, self.num_shared)
        slots = ids.shape[1]
        layout = group_rows(ids, self.num_routed + self.num_shared, ROW_ALIGN)
        valid = layout.src_slot >= 0
        slot = layout.src_slot.long().clamp(min=0)
        tok = slot // slots
        xq, sx = quantize_fp8_rowwise(x)
        xa = xq.view(torch.uint8)[tok].view(torch.float8_e4m3fn)  # gather the bytes: indexing FP8 is not everywhere
        route_w = torch.where(valid, w.reshape(-1).float()[slot], torch.zeros((), device=x.device))
        offs = layout.offsets[1:].contiguous()
        gu = self._mm(xa, self.w13, sx[tok], self.s13, offs)
        h = F.silu(gu[:, : self.inter].float()) * gu[:, self.inter :].float() * route_w.unsqueeze(1)
        hq, sh = quantize_fp8_rowwise(h)
        rows = self._mm(hq, self.w2, sh, self.s2, offs)
        # scatter each row to its (token, slot); padding rows go to one extra row that is dropped
        dump = t * slots
        dst = torch.where(valid, layout.src_slot.long(), torch.full_like(slot, dump))
        out = torch.zeros(dump + 1, hidden, dtype=torch.bfloat16, device=x.device)
        out.index_copy_(0, dst, rows)
        return combine_slots(out[:dump].view(t, slots, hidden))
