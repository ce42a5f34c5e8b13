"""The operator on a GPU (reference backend until the kernels land): same values as on the CPU, CUDA-graph capture
and replay with new inputs, bitwise-stable replays."""

import pytest
import torch

import gcmoe
from gcmoe_core.config import MoEConfig
from gcmoe_core.reference import moe_reference
from gcmoe_core.testing import Case, calc_diff, first_mismatch, make_problem

pytestmark = pytest.mark.gpu

CFG = MoEConfig(
    hidden_size=512, intermediate_size=256, num_experts=16, top_k=4, num_shared_experts=1, max_tokens_per_rank=64
)


@pytest.mark.parametrize("routing", ["uniform", "one_expert", "half_empty"])
def test_gpu_matches_cpu(routing):
    x, ids, w, weights, floats = make_problem(Case(CFG, 13, routing, seed=21))
    y_gpu = gcmoe.MoELayer(CFG, device="cuda").load_weights(*floats)(x.cuda(), ids.cuda(), w.cuda())
    y_cpu = moe_reference(x, ids, w, weights)
    assert calc_diff(y_gpu.cpu(), y_cpu) < 1e-5


def test_cuda_graph_capture_and_replay():
    x, ids, w, _, floats = make_problem(Case(CFG, 8, "uniform", seed=22))
    layer = gcmoe.MoELayer(CFG, device="cuda").load_weights(*floats)
    sx, sids, sw = x.cuda(), ids.cuda(), w.cuda()
    layer(sx, sids, sw)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        layer(sx, sids, sw)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = layer(sx, sids, sw)
    first = None
    for i in range(5):
        nx, nids, nw, _, _ = make_problem(Case(CFG, 8, ("uniform", "one_expert")[i % 2], seed=100 + i))
        sx.copy_(nx), sids.copy_(nids), sw.copy_(nw)
        g.replay()
        torch.cuda.synchronize()
        eager = layer(sx, sids, sw)
        assert calc_diff(out, eager) < 1e-6, f"replay {i}"
    for _ in range(20):
        g.replay()
        torch.cuda.synchronize()
        first = out.clone() if first is None else first
        assert first_mismatch(out, first) == ""
