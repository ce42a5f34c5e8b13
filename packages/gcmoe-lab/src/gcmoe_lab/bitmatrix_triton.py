"""The triton_kernels peer's routing bitmatrix in one Triton launch (imported only where triton is installed: the
peer's own dependency). One program per token: for every 32-bit word, the sum of the bits of the token's ids that
fall in it (a token's ids are distinct, so the sum is their OR); ids < 0 (unused slots) set nothing. The same words
as gcmoe_lab.peers.bitmatrix_words, which the peer checks on the device before using this."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _pack(ids_ptr, out_ptr, n_words, SLOTS: tl.constexpr, WORDS: tl.constexpr):
    row = tl.program_id(0)
    ids = tl.load(ids_ptr + row * SLOTS + tl.arange(0, SLOTS)).to(tl.int32)
    valid = ids >= 0
    safe = tl.where(valid, ids, 0)
    word = tl.arange(0, WORDS)
    bit = tl.full([SLOTS], 1, tl.uint32) << (safe % 32).to(tl.uint32)
    hit = valid[None, :] & ((safe // 32)[None, :] == word[:, None])
    bits = tl.where(hit, bit[None, :], 0).to(tl.uint32)
    tl.store(out_ptr + row * n_words + word, tl.sum(bits, axis=1), mask=word < n_words)


def pack(ids: torch.Tensor, experts: int) -> torch.Tensor:
    """Padded ids int16 [T, slots] (slots a power of two, contiguous) -> words uint32 [T, ceil(E / 32)]."""
    t, slots = ids.shape
    n_words = (experts + 31) // 32
    words = torch.empty(t, n_words, dtype=torch.uint32, device=ids.device)
    _pack[(t,)](ids, words, n_words, SLOTS=slots, WORDS=1 << (n_words - 1).bit_length())
    return words
