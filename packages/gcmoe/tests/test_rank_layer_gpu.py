"""The comm-path layer (publish -> dispatch -> W1 -> W2 -> combined -> finalize) on an H200: bit-identical to the
torch-glue sm90 layer (MoESm90.forward) on model-shaped EP8 slices with shared experts, eager and over CUDA-graph
replays with new routing, and the quantisation-emulating reference within 1e-3."""

import pytest
import torch

from gcmoe.rank_layer import CommSm90Path, comm_path, sm90_forward, token_bucket
from gcmoe_core.config import MoEConfig
from gcmoe_core.reference import moe_reference
from gcmoe_core.testing import calc_diff, first_mismatch, make_tokens, make_weights
from gcmoe_core.timing import capture_graph
from gcmoe_gemm_sm90.ops import MoESm90

pytestmark = [pytest.mark.gpu, pytest.mark.sm90]


def _problem(cfg, tokens, routing, seed):
    return make_tokens(cfg, tokens, routing, seed, device="cuda")


@pytest.mark.parametrize(
    ("model", "tokens"),
    [("deepseek-v3", 1), ("deepseek-v3", 8), ("glm-4.5", 32), ("deepseek-v4-flash", 128), ("glm-5", 256)],
)
def test_comm_path_is_bit_identical_to_the_glue_layer(model, tokens):
    cfg = MoEConfig.ep_slice(model, 8, max_tokens_per_rank=256)
    weights = make_weights(cfg, seed=tokens, device="cuda")
    moe = MoESm90.from_weights(weights)
    x, ids, w = _problem(cfg, tokens, "uniform", seed=tokens)
    y = sm90_forward(moe, x, ids, w)
    path = comm_path(moe, cfg.top_k, tokens, moe.config_for(tokens, cfg.top_k).n_tile)
    assert path is not None and path.spec.max_tokens == token_bucket(tokens)
    want = moe.forward(x, ids, w)
    path.ws.check()
    assert first_mismatch(y, want) == ""
    if tokens <= 8:
        assert calc_diff(y, moe_reference(x, ids, w, weights)) < 1e-3


def test_comm_path_graph_replays_with_new_routing():
    cfg = MoEConfig.ep_slice("deepseek-v3", 8, max_tokens_per_rank=64)
    moe = MoESm90.from_weights(make_weights(cfg, seed=3, device="cuda"))
    tokens = 16
    kcfg = moe.config_for(tokens, cfg.top_k)
    layer = CommSm90Path(moe, cfg.top_k, 64, kcfg.n_tile, timeout_ms=2000)
    sx, sids, sw = _problem(cfg, tokens, "uniform", seed=0)
    graph, out = capture_graph(lambda: layer(moe, kcfg, sx, sids, sw), warmup=2)
    for i in range(20):
        nx, nids, nw = _problem(cfg, tokens, ("uniform", "one_expert", "half_empty")[i % 3], seed=100 + i)
        sx.copy_(nx), sids.copy_(nids), sw.copy_(nw)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert first_mismatch(out, moe.forward(sx, sids, sw)) == "", f"replay {i}"
    layer.ws.check()
