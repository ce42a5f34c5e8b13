"""Every registered backend (gcmoe.backends.BACKENDS) on a CPU, through the backend protocol (prepack -> plan ->
forward) and through the public API: kernel backends emulated (their own pipeline on torch models of their kernels),
the reference backend as it is, against moe_reference on fresh random problems. Every uninitialised allocation is
poisoned, so a row a backend forgets to write shows as NaN. And what each backend says it needs on a CPU.

(The old string-wired backends crashed at the sm103 prepack: 'MoESm103' object has no attribute 'tensors'.)
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import gcmoe
from gcmoe import backends
from gcmoe.backends import LayerOptions
from gcmoe_core.config import MoEConfig
from gcmoe_core.reference import moe_reference
from gcmoe_core.testing import Case, calc_diff, make_problem, make_tokens, poison_

# a layer every kernel backend takes (gcmoe_gemm_sm90.layer_missing and gcmoe_gemm_sm103.layer_missing accept it)
CFG = MoEConfig(
    hidden_size=512, intermediate_size=256, num_experts=8, top_k=2, num_shared_experts=1, max_tokens_per_rank=32
)
CALLS = [(1, "uniform"), (32, "one_expert"), (7, "half_empty")]  # (tokens, routing)
CPU = torch.device("cpu")
NEEDS = {"reference": None, "sm90": "compute capability 9.0", "sm103": "compute capability 10.3"}

_aten = torch.ops.aten
_EMPTY = {
    _aten.empty.memory_format,
    _aten.empty_like.default,
    _aten.empty_strided.default,
    _aten.new_empty.default,
    _aten.new_empty_strided.default,
}


class PoisonEmpty(TorchDispatchMode):
    """torch.empty & co. return poison (NaN floats, 0xA5 / -0x5A5A5A5A integers) instead of whatever memory held."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return poison_(out) if func in _EMPTY else out


def check_output(name: str, y: torch.Tensor, ref: torch.Tensor) -> None:
    assert y.dtype == torch.bfloat16 and y.shape == ref.shape and not y.isnan().any(), name
    if name == "reference":
        assert torch.equal(y, ref)
    else:
        assert calc_diff(y, ref) <= 1e-3, (name, calc_diff(y, ref))


@pytest.mark.parametrize("name", backends.NAMES)
def test_backend_matches_reference_emulated_on_cpu(name):
    impl = backends.get(name)
    options = LayerOptions(emulate=name != "reference")
    _, _, _, weights, floats = make_problem(Case(CFG, 1, seed=1))
    with PoisonEmpty():
        plan = impl.plan(CFG, impl.prepack(CFG, weights, CPU), CPU, options)
        layer = gcmoe.MoELayer(CFG, backend=name, emulate=True).load_weights(*floats)
    for seed, (tokens, routing) in enumerate(CALLS, start=2):  # one layer, fresh inputs per call
        x, ids, w = make_tokens(CFG, tokens, routing, seed=seed)
        with PoisonEmpty():
            y, y_layer = plan.forward(x, ids, w, True), layer(x, ids, w)
        check_output(name, y, moe_reference(x, ids, w, weights))
        assert torch.equal(y_layer, y)  # the public API runs the same plan on the same weights
    plan.check()
    bad = ids.clone()
    bad[0, 0] = CFG.num_experts
    with pytest.raises(ValueError, match="topk_ids"):
        plan.forward(x, bad, w, True)
        plan.check()
    assert plan.describe()["backend"] == name and layer.describe()["backend"] == name


@pytest.mark.parametrize("name", backends.NAMES)
def test_missing_on_cpu_names_what_the_backend_needs(name):
    assert name in NEEDS, f"say what backend {name!r} needs on a CPU"
    need = NEEDS[name]
    why = backends.get(name).missing(CPU, CFG)
    if need is None:
        assert why is None and backends.choose(CPU, name, CFG) == name
        return
    assert need in why
    with pytest.raises(gcmoe.BackendUnavailable, match=f"backend '{name}' cannot run on cpu: it needs .*{need}"):
        backends.choose(CPU, name, CFG)


def test_sm103_refuses_expert_parallel(monkeypatch):
    monkeypatch.setattr(backends.base, "cuda_missing", lambda device, capability: None)
    sm103, cfg = backends.get("sm103"), CFG.replace(ep_size=2)
    assert sm103.missing(torch.device("cuda"), cfg).startswith("ep_size = 1")
    with pytest.raises(ValueError, match="ep_size = 1"):
        sm103.prepack(cfg, make_problem(Case(CFG, 1))[3], CPU)


def test_sm103_refuses_the_clamped_activation_and_biases_also_emulated():
    """Its epilogue is plain SwiGLU: a gpt-oss-style layer must be refused, never computed as another expert."""
    import dataclasses

    for cfg in (CFG.replace(activation="swiglu_clamped"), CFG.replace(num_shared_experts=0, has_bias=True)):
        weights = make_problem(Case(cfg, 1))[3]
        if cfg.has_bias:
            e, i, h = cfg.local_experts, cfg.intermediate_size, cfg.hidden_size
            weights = dataclasses.replace(weights, w13_bias=torch.randn(e, 2 * i), w2_bias=torch.randn(e, h))
        with pytest.raises(ValueError, match="sm103 kernels' epilogue is plain SwiGLU"):
            gcmoe.MoELayer(cfg, "cpu", "sm103", emulate=True).load(weights)


@pytest.mark.parametrize("model", ["deepseek-v3", "deepseek-v4-flash", "tiny"])
def test_sm90_grid_rows_bound_every_ring_layout_and_lead_with_the_shared_experts(model):
    """The sm90 plan's W1 / W2 grid (pure Python, no GPU: the methods on a stand-in plan): at world size 1 with
    active-first rows the routed experts with rows of any call of up to `bucket` tokens — random, skewed and
    all-distinct routings through the ring's own dispatch model — never exceed grid_rows (a smaller grid would leave
    CTAs running more rows each); with P ranks the rows are those of one rank's call, or one wave of CTAs if more,
    never more than P calls of `bucket` tokens can bring (a peer's larger call is run by the kernels' row loop:
    test_grouped_gpu); rows in expert order have no bound; the first row runs the first shared ring expert (the one
    with the most N tiles), expert 0 without shared experts."""
    from dataclasses import replace
    from types import SimpleNamespace

    from gcmoe.backends.sm90 import Sm90Plan, ring_spec
    from gcmoe_comm.ring import dispatch_emulated
    from gcmoe_gemm_sm90.config import TILE_M, Sm90Config

    if model == "tiny":
        cfg = MoEConfig(256, 128, 16, 4, num_shared_experts=0, max_tokens_per_rank=16)
    else:
        cfg = MoEConfig.ep_slice(model, 8, max_tokens_per_rank=16)
    spec = ring_spec(cfg)
    plan = SimpleNamespace(spec=spec, cfg=cfg, sm_count=132)
    first = Sm90Plan.first_row_expert(plan)
    assert first == (spec.local_experts if spec.shared else 0)
    assert spec.shared == 0 or first == spec.ring_experts - spec.shared  # the shared experts are the last ring experts
    kcfg = Sm90Config(n_tile=8, active_first=True)
    assert Sm90Plan.grid_rows(plan, 4, replace(kcfg, active_first=False)) is None
    for ranks in (2, 8):
        for bucket in (1, 2, 4, 16):
            for kc in (kcfg, replace(kcfg, occupancy=1, splits=(2, 2)), replace(kcfg, occupancy=2, splits=(1, 1))):
                rank = SimpleNamespace(spec=replace(spec, ranks=ranks), cfg=cfg, sm_count=132)
                rows, own = Sm90Plan.grid_rows(rank, bucket, kc), Sm90Plan.grid_rows(plan, bucket, kc)
                every = min(spec.ring_experts, min(spec.local_experts, ranks * bucket * cfg.top_k) + spec.shared)
                w1_tiles, w2_tiles = 2 * cfg.intermediate_size // TILE_M, cfg.hidden_size // TILE_M
                per_row = max(w1_tiles * kc.splits[0], w2_tiles * kc.splits[1])
                assert rows == min(every, max(own, kc.occupancy * 132 // per_row)), (ranks, bucket, kc)
                assert own <= rows <= every
                assert Sm90Plan.grid_rows(rank, bucket, kc, comm_sms=16) <= rows  # fewer compute SMs, no more rows
    g = torch.Generator().manual_seed(7)
    for bucket in (1, 2, 4, 8, 16):
        rows = Sm90Plan.grid_rows(plan, bucket, kcfg)
        assert spec.shared < rows <= spec.ring_experts
        for t in {1, bucket // 2 + 1, bucket}:
            e = cfg.num_experts
            picks = [
                torch.stack([torch.randperm(e, generator=g)[: cfg.top_k] for _ in range(t)]),  # random, distinct
                torch.arange(t * cfg.top_k).remainder(e).view(t, cfg.top_k),  # as many distinct experts as can be
                torch.arange(cfg.top_k).expand(t, cfg.top_k),  # every token on the same experts
            ]
            for ids in picks:
                ids = ids.to(torch.int32)
                ring = dispatch_emulated(
                    spec,
                    0,
                    [ids],
                    [torch.rand(t, cfg.top_k, generator=g)],
                    [torch.randn(t, cfg.hidden_size, generator=g).bfloat16()],
                )
                with_rows = int((ring.counts > 0).sum())
                assert with_rows <= rows, (bucket, t, with_rows, rows)
