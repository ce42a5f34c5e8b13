"""On a B300 (sm_103): the kernels against the quantisation-emulating reference. Skipped everywhere else (this
project has no Blackwell GPU: these tests have never run)."""

import pytest

from gcmoe_core.config import MoEConfig
from gcmoe_core.reference import moe_reference
from gcmoe_core.testing import Case, calc_diff, make_problem, make_tokens, make_weights
from gcmoe_gemm_sm103.ops import MoESm103

pytestmark = pytest.mark.sm103


@pytest.mark.parametrize("routing", ["uniform", "one_expert", "half_empty"])
def test_small_layer(routing):
    cfg = MoEConfig(
        hidden_size=512, intermediate_size=256, num_experts=8, top_k=2, num_shared_experts=1, max_tokens_per_rank=512
    )
    x, ids, w, weights, _ = make_problem(Case(cfg, 150, routing, seed=1), device="cuda")
    y = MoESm103.from_weights(weights).forward(x, ids, w)
    assert calc_diff(y, moe_reference(x, ids, w, weights)) < 1e-3


@pytest.mark.parametrize(("model", "tokens"), [("deepseek-v4-flash", 8), ("deepseek-v3", 128)])
def test_model_shapes(model, tokens):
    cfg = MoEConfig.ep_slice(model, 8, max_tokens_per_rank=512)
    weights = make_weights(cfg, seed=tokens, device="cuda")
    x, ids, w = make_tokens(cfg, tokens, seed=tokens, device="cuda")
    y = MoESm103.from_weights(weights).forward(x, ids, w)
    ref = moe_reference(x, ids, w, weights.exact_bf16(), quant="fp8_mxfp4")
    assert calc_diff(y, ref) < 1e-3
