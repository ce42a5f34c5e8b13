"""On a B300 (sm_103): the W1 / W2 kernels against their torch models (emulate.py, which CPU CI proves against the
reference) on the same prepacked weights and rows. Skipped everywhere else (this project has no Blackwell GPU: these
tests have never run). The layer around the kernels is gcmoe's sm103 backend."""

import pytest
import torch

from gcmoe_core.config import MoEConfig
from gcmoe_core.formats import dequantize_fp8_1x128
from gcmoe_core.grouping import group_rows, prepare_activations
from gcmoe_core.testing import calc_diff, make_tokens, make_weights, poison_
from gcmoe_gemm_sm103.config import Sm103Config
from gcmoe_gemm_sm103.emulate import emulate_w1, emulate_w2, prepack_layer, token_scale_atoms

pytestmark = pytest.mark.sm103

CONFIG = Sm103Config()
SMALL = MoEConfig(
    hidden_size=512, intermediate_size=256, num_experts=8, top_k=2, num_shared_experts=0, max_tokens_per_rank=512
)
CASES = [
    (SMALL, 150, "uniform"),
    (SMALL, 150, "one_expert"),  # one expert with two 128-token tiles
    (SMALL, 150, "half_empty"),
    (MoEConfig.ep_slice("deepseek-v4-flash", 8, num_shared_experts=0, max_tokens_per_rank=512), 8, "uniform"),
    (MoEConfig.ep_slice("deepseek-v3", 8, num_shared_experts=0, max_tokens_per_rank=512), 128, "uniform"),
]


@pytest.mark.parametrize(("cfg", "tokens", "routing"), CASES, ids=[f"H{c.hidden_size}-T{t}-{r}" for c, t, r in CASES])
def test_kernels_match_their_emulation(cfg, tokens, routing):
    from gcmoe_gemm_sm103.kernel_grouped import run_w1, run_w2

    weights = make_weights(cfg, seed=tokens, device="cuda")
    x, ids, w = make_tokens(cfg, tokens, routing, seed=tokens, device="cuda")
    p13, p2 = prepack_layer(weights.w13, weights.w2)
    layout = group_rows(ids, cfg.num_experts, CONFIG.n_tile)
    acts = prepare_activations(x, w, layout, cfg.top_k)
    valid = layout.src_slot >= 0

    def h_values(hq, hsT):  # fp32 h of the valid rows (the kernel leaves padding rows unwritten)
        return dequantize_fp8_1x128(hq[valid].view(torch.float8_e4m3fn), hsT[:, valid].t())

    hq, hsT = emulate_w1(p13, acts, token_scale_atoms(acts.sxT), layout)
    assert calc_diff(h_values(*run_w1(p13, acts, layout, CONFIG)), h_values(hq, hsT)) < 1e-3

    out = poison_(torch.empty(tokens * cfg.top_k, cfg.hidden_size, dtype=torch.bfloat16, device="cuda"))
    want = poison_(torch.empty_like(out))
    run_w2(p2, hq, hsT, layout, out, CONFIG)  # both W2s on the same h: W2 alone
    emulate_w2(p2, hq, token_scale_atoms(hsT), layout, want)
    assert not out.isnan().any() and calc_diff(out, want) < 1e-3
