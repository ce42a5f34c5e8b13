"""The fused W1 + W2 launch's block order (kernel_fused.tile_order, the model of the kernel's tile_of) and its lag:
every tile exactly once, each grid row's W1 tiles before its W2 tiles, W2 tiles `lag` rows behind (pure Python)."""

import random

import pytest

from gcmoe_gemm_sm90.config import Sm90Config
from gcmoe_gemm_sm90.kernel_fused import FusedW12Sm90, fused_lag, fused_missing, tile_order


@pytest.mark.parametrize("seed", range(200))
def test_tile_order_covers_every_tile_once_w1_first(seed):
    rng = random.Random(seed)
    rows, a, b = rng.randint(1, 40), rng.randint(1, 30), rng.randint(1, 30)
    lag = rng.randint(1, rows + 5)
    order = tile_order(rows, lag, a, b)
    assert len(order) == rows * (a + b) == len(set(order))
    assert set(order) == {(0, y, m) for y in range(rows) for m in range(a)} | {(1, y, m) for y in range(rows) for m in range(b)}
    pos = {t: i for i, t in enumerate(order)}
    for y in range(rows):
        last_w1 = max(pos[0, y, m] for m in range(a))
        first_w2 = min(pos[1, y, m] for m in range(b))
        assert last_w1 < first_w2
        # W2 of row y comes after the W1 tiles of row y + lag (or the last row's)
        assert first_w2 > max(pos[0, min(y + lag, rows - 1), m] for m in range(a))


def test_lag_is_one_turnover_of_the_slots():
    # DeepSeek-V4-Flash EP8 (W1 16 tiles x 32 windows, W2 16 x 16) and DeepSeek-V3 (16 x 56, 28 x 16) on 264 slots
    assert fused_lag(4096, 4096, 4096, 2048, 264, 33) == 11
    assert fused_lag(4096, 7168, 7168, 2048, 264, 33) == 11
    assert fused_lag(4096, 4096, 4096, 2048, 264, 5) == 5  # at most every row
    assert fused_lag(4096, 4096, 4096, 2048, 1, 33) == 1


def test_fused_needs_unsplit_ring_expert_sync():
    ok = Sm90Config(n_tile=16, ring=True, fused=True)
    assert fused_missing(ok) is None
    assert "ring" in fused_missing(Sm90Config(n_tile=16, fused=True))
    with pytest.raises(ValueError, match="expert_sync"):
        Sm90Config(n_tile=16, ring=True, expert_sync=False, fused=True)
    with pytest.raises(ValueError, match="unsplit"):
        Sm90Config(n_tile=16, splits=(2, 1), fused=True)
    with pytest.raises(ValueError, match="stream_k"):
        Sm90Config(n_tile=8, stream_k=True, fused=True)
    with pytest.raises(ValueError, match="ring"):
        FusedW12Sm90(4096, 7168, Sm90Config(n_tile=16, fused=True))
