"""Weight-row orders: the gate/up interleave both GEMM packages prepack W13 with, and the one checkpoints and engines
publish it in.

W13 holds gate rows [0, I) then up rows [I, 2I). The fused SwiGLU epilogue needs gate row i and up row i in the same
CTA tile, so the prepackers interleave them in groups of `g` rows (g = half the tile's M):

    logical rows   gate[0:g] gate[g:2g] ... | up[0:g] up[g:2g] ...
    prepacked      gate[0:g] up[0:g] | gate[g:2g] up[g:2g] | ...        (tile t = intermediate columns [t*g, t*g+g))
"""

from __future__ import annotations

import torch


def gate_up_permutation(intermediate: int, g: int, device=None) -> torch.Tensor:
    """perm [2I] with prepacked_row[j] = logical_row[perm[j]]."""
    if intermediate % g:
        raise ValueError(f"gate_up_permutation: I = {intermediate} must be a multiple of the group {g}")
    t = torch.arange(intermediate // g, device=device).view(-1, 1, 1)
    r = torch.arange(g, device=device).view(1, 1, -1)
    half = torch.tensor([0, intermediate], device=device).view(1, 2, 1)
    return (t * g + half + r).reshape(-1)


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


def deinterleave_gate_up(t: torch.Tensor) -> torch.Tensor:
    """[E, 2I, ...] with gate row j at 2j and up row j at 2j + 1 (gpt-oss, vLLM's "swigluoai") -> gate rows, then up
    rows."""
    return torch.cat((t[:, 0::2], t[:, 1::2]), dim=1)
