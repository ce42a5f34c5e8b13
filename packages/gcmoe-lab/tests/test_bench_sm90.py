"""The sm90 kernel bench (gcmoe_lab.bench_sm90) on a CPU: it launches the grid rows the operator launches (the sm90
backend's own rule, gcmoe.backends.sm90.grid_rows, at the call's bucket: no copy of it), and its variants are
configurations the kernels accept."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from gcmoe.backends.sm90 import Sm90Plan, ring_spec, token_bucket
from gcmoe_core.config import MoEConfig
from gcmoe_core.testing import make_tokens
from gcmoe_gemm_sm90.config import can_implement, choose_config
from gcmoe_gemm_sm90.ops import layer_config
from gcmoe_lab import bench_sm90


@pytest.mark.parametrize("model", ["deepseek-v3", "deepseek-v4-flash", "glm-4.5"])
def test_kernel_bench_launches_the_layers_grid_rows(model):
    """The kernels on prepared rows launch the grid rows the layer's plan launches for the same call at world size 1
    without shared experts — not one row per expert, whose empty CTAs held back W2's launch to W1's end (1.12-1.16x
    at one token, H200, 2026-12-03): with active-first rows the experts a call of the bucket can reach, else one row
    per expert (None)."""
    cfg = MoEConfig.ep_slice(model, 8, max_tokens_per_rank=256, num_shared_experts=0)
    plan = SimpleNamespace(spec=ring_spec(cfg), cfg=cfg, sm_count=132)
    h, i, e = cfg.hidden_size, cfg.intermediate_size, cfg.num_experts
    seen = set()
    for t in (1, 2, 3, 4, 8, 32, 128):
        kcfg = layer_config(t, cfg.top_k, e, h, i, 0)
        seen.add(kcfg.active_first)
        for kc in (kcfg, replace(kcfg, active_first=not kcfg.active_first)):
            rows = bench_sm90.layer_grid_rows(cfg, t, kc, 132)
            assert rows == Sm90Plan.grid_rows(plan, token_bucket(t), kc), (t, kc.active_first)
            assert rows == (min(e, token_bucket(t) * cfg.top_k) if kc.active_first else None)
    assert seen == {True, False}  # both kinds of grid chosen over these T


def test_kernel_launches_pass_the_grid_rows_to_both_gemms(monkeypatch):
    """kernel_launches hands W1 and W2 the operator's grid rows (and W1 alone with w1_only)."""
    cfg = MoEConfig(512, 256, 16, 4, 0, max_tokens_per_rank=16)
    x, ids, w = make_tokens(cfg, 3, seed=1)
    launched = []
    monkeypatch.setattr(bench_sm90, "launch_w1", lambda *a, **kw: launched.append(("w1", kw["grid_rows"])))
    monkeypatch.setattr(bench_sm90, "launch_w2", lambda *a, **kw: launched.append(("w2", kw["grid_rows"])))
    moe = SimpleNamespace(w13=None, w2=None, inter=cfg.intermediate_size)
    out = torch.empty(ids.numel(), cfg.hidden_size, dtype=torch.bfloat16)
    for active_first, rows in ((True, min(16, 4 * 4)), (False, None)):  # T = 3: bucket 4
        kc = replace(choose_config(3, 4, 16, 512, 256), active_first=active_first)
        run, layout = bench_sm90.kernel_launches(moe, x, w, ids, cfg, kc, out, 132)
        assert layout.n_tile == kc.n_tile
        launched.clear()
        run()
        run(w1_only=True)
        assert launched == [("w1", rows), ("w2", rows), ("w1", rows)]


def test_bench_variants_are_valid_configs():
    """Every benchmark variant is a configuration the kernels accept for both GEMMs of a model shape (or does not
    apply), and differs from the chosen one."""
    from gcmoe_lab.bench_sm90 import VARIANTS, variant_config

    for tokens in (1, 8, 32, 128, 256):
        chosen = choose_config(tokens, 8, 32, 7168, 2048)
        for name in VARIANTS:
            cfg = variant_config(name, chosen, 7168, 2048)
            if cfg is None:
                continue
            assert cfg != chosen, name
            for (m, k), sp in zip(((4096, 7168), (7168, 2048)), cfg.splits, strict=True):
                assert can_implement(m, k, 32, cfg, splits=sp) is None, (name, tokens, cfg)
    with pytest.raises(ValueError, match="unknown variant"):
        variant_config("n12", choose_config(8, 8, 32), 7168, 2048)
    # half tiles follow choose_config's rule (an SM held alone: occupancy 1) and half_tiles_ok (W2's bias epilogue
    # stays whole above N 64); wg2 is whole 2-warpgroup tiles
    n64 = choose_config(256, 6, 32, 4096, 2048)
    assert n64.w1_half and n64.w2_half
    n80 = variant_config("n80", n64, 4096, 2048)
    assert n80.w1_half and n80.w2_half
    for name in ("wg2", "n16"):
        c = variant_config(name, n64, 4096, 2048)
        assert not (c.w1_half or c.w2_half), name
    oss = layer_config(128, 4, 16, 3072, 2944, 0, epilogue={"activation": "swiglu_clamped", "bias": True})
    v = variant_config("n80", oss, 3072, 2944)
    assert oss.w2_half and v.w1_half and not v.w2_half
