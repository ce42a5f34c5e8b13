"""MoEConfig(masked_ids=True) on a CPU: topk_ids == -1 is a slot that contributes nothing, on the reference backend
(sparse and dense paths), the emulated sm90 pipeline and the multi-rank reference; compared with independent
formulations of "the slot removed":

- zeroed    the masked slots keep a valid id with routing weight 0 (their rows are exact zeros): the dense path is
            the same arithmetic, so exactly equal;
- fp64      the float64 loop skipping the slot (moe_reference_loop_fp64): within the reference's tolerance.

The masked slots' weights are NaN throughout (a masked weight is neither used nor checked), and token 0 has every
slot masked (its output: the shared experts' alone, exact; zeros without shared experts). Any other id outside [0, E)
still raises, and without masked_ids a -1 does too. The GPU path is in test_masked_ids_gpu.py.
"""

from dataclasses import dataclass

import pytest
import torch

import gcmoe
from gcmoe_core.config import MoEConfig
from gcmoe_core.multirank import multirank_reference
from gcmoe_core.reference import activation_input, combine_slots, moe_reference, moe_reference_loop_fp64
from gcmoe_core.reference import shared_slot_rows as shared_rows_of
from gcmoe_core.testing import Case, calc_diff, make_problem

BASE = MoEConfig(
    hidden_size=512, intermediate_size=256, num_experts=8, top_k=3, num_shared_experts=1, max_tokens_per_rank=32
).replace(masked_ids=True)


@dataclass(frozen=True)
class MaskCase:
    cfg: MoEConfig
    tokens: int
    routing: str = "uniform"
    fraction: float = 0.3  # of the slots masked, beside token 0's (all masked)
    seed: int = 0

    @property
    def id(self) -> str:
        c = self.cfg
        return f"{c.quant}-s{c.num_shared_experts}-T{self.tokens}-{self.routing}-{self.fraction}"


CASES = [
    MaskCase(BASE, 9, "uniform", 0.3, 1),
    MaskCase(BASE.replace(num_shared_experts=0), 7, "one_expert", 0.5, 2),
    MaskCase(BASE.replace(quant="bf16"), 12, "half_empty", 0.3, 3),
    MaskCase(BASE.replace(quant="bf16", num_shared_experts=2), 5, "uniform", 0.8, 4),
    MaskCase(BASE, 16, "one_expert", 0.0, 5),  # only token 0 masked
]


def masked_problem(case: MaskCase):
    """x, ids with -1 in masked slots, weights NaN there; the zeroed formulation (original ids, weight 0); the mask."""
    x, ids, w, weights, _ = make_problem(Case(case.cfg, case.tokens, case.routing, case.seed))
    g = torch.Generator().manual_seed(1000 + case.seed)
    mask = torch.rand(ids.shape, generator=g) < case.fraction
    mask[0] = True
    ids_m = ids.masked_fill(mask, -1)
    w_m = w.masked_fill(mask, float("nan"))
    w_zero = w.masked_fill(mask, 0.0)
    return x, ids_m, w_m, ids, w_zero, mask, weights


def shared_only(x: torch.Tensor, weights, quant: str) -> torch.Tensor:
    """Each token's output from its shared experts alone (zeros without shared experts)."""
    rows = shared_rows_of(activation_input(x, quant), weights, quant)
    if rows.shape[1] == 0:
        return torch.zeros(x.shape, dtype=torch.bfloat16)
    return combine_slots(rows)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_reference_backend_drops_masked_slots(case):
    x, ids_m, w_m, ids, w_zero, mask, weights = masked_problem(case)
    quant = case.cfg.quant
    layer = gcmoe.MoELayer(case.cfg, backend="reference").load(weights)
    y = layer(x, ids_m, w_m)  # the eager (sparse) path
    assert y.dtype == torch.bfloat16 and not y.isnan().any()
    tol = 1e-5 if quant == "fp8_mxfp4" else 1e-6
    assert calc_diff(y, moe_reference_loop_fp64(x, ids_m, w_m, weights)) < tol
    assert calc_diff(y, moe_reference(x, ids, w_zero, weights)) < tol
    # the dense (capturable) path: every expert over every row, so the zeroed formulation is the same arithmetic
    dense = moe_reference(x, ids_m, w_m, weights, capturable=True)
    assert torch.equal(dense, moe_reference(x, ids, w_zero, weights, capturable=True))
    # token 0, every slot masked: its shared experts' output alone, bit for bit (zeros without shared experts)
    want0 = shared_only(x, weights, quant)[0]
    assert torch.equal(y[0], want0) and torch.equal(dense[0], want0)
    if case.cfg.num_shared_experts == 0:
        assert not y[0].any()
    # a masked slot matters only by being masked: unmasking one changes its token
    if case.fraction:
        t, j = (mask[1:].nonzero()[0] + torch.tensor([1, 0])).tolist()
        unmasked_ids, unmasked_w = ids_m.clone(), w_m.clone()
        unmasked_ids[t, j], unmasked_w[t, j] = ids[t, j], 1.0
        assert not torch.equal(layer(x, unmasked_ids, unmasked_w)[t], y[t])


@pytest.mark.parametrize("case", [c for c in CASES if c.cfg.quant == "fp8_mxfp4"], ids=lambda c: c.id)
def test_emulated_sm90_drops_masked_slots(case):
    x, ids_m, w_m, ids, w_zero, _, weights = masked_problem(case)
    layer = gcmoe.MoELayer(case.cfg, backend="sm90", emulate=True).load(weights)
    y = layer(x, ids_m, w_m)  # the ring, the kernel models, the combine rows (NaN-filled until written or zeroed)
    assert not y.isnan().any()
    assert calc_diff(y, moe_reference(x, ids, w_zero, weights)) <= 1e-3
    if case.cfg.num_shared_experts == 0:
        assert not y[0].any()
    else:
        assert calc_diff(y[0], shared_only(x, weights, case.cfg.quant)[0]) <= 1e-3
    # the emulated publish drops a -1 the way it drops any out-of-range id (checks off): same rows, bit for bit
    dropped = ids_m.masked_fill(ids_m < 0, case.cfg.num_experts)
    plan = layer.packed.plan
    assert torch.equal(plan.forward(x, dropped, w_m, False), y)


@pytest.mark.parametrize("backend", ["reference", "sm90"])
def test_bad_ids_still_raise_and_masked_ids_needs_the_option(backend):
    cfg = BASE.replace(num_shared_experts=0)
    x, ids, w, weights, _ = make_problem(Case(cfg, 4, seed=6))
    masked = gcmoe.MoELayer(cfg, backend=backend, emulate=backend != "reference").load(weights)
    plain = gcmoe.MoELayer(cfg.replace(masked_ids=False), backend=backend, emulate=backend != "reference").load(weights)
    for bad, msg in (
        (-2, r"negative expert id \(-2\); ids must be in \[0, 8\) or -1 \(masked_ids\)"),
        (8, r"holds expert id 8, out of range \[0, 8\)"),
    ):
        b = ids.clone()
        b[1, 1] = bad
        with pytest.raises(ValueError, match=msg):
            masked(x, b, w)
    m = ids.clone()
    m[2, 0] = -1
    with pytest.raises(ValueError, match=r"negative expert id \(-1\); ids must be in \[0, 8\)$"):
        plain(x, m, w)
    w_nan = w.clone()
    w_nan[2, 1] = float("nan")  # a kept slot's weight is still checked
    with pytest.raises(ValueError, match="non-finite routing weight"):
        masked(x, m, w_nan)
    w_nan[2, 0] = float("nan")  # the masked slot's is not
    w_nan[2, 1] = w[2, 1]
    assert not masked(x, m, w_nan).isnan().any()
    with pytest.raises(ValueError, match="masked_ids: must be a bool"):
        cfg.replace(masked_ids=1)


@pytest.mark.parametrize("p", [2, 4])
def test_multirank_reference_drops_masked_slots(p):
    cfg = BASE.replace(num_experts=8)
    xs, idss, wss, zeroed = [], [], [], []
    weights = None
    for r in range(p):
        x, ids_m, w_m, ids, w_zero, _, wts = masked_problem(
            MaskCase(cfg, 3 + r, "uniform", 0.4, 0 if r == 0 else 50 + r)
        )
        weights = weights or wts  # same seed-0 weights for every rank
        xs.append(x), idss.append(ids_m), wss.append(w_m), zeroed.append((ids, w_zero))
    dispatch, combine = multirank_reference(xs, idss, wss, weights)
    assert sum(d.src.shape[0] for d in dispatch) == sum(int((i >= 0).sum()) for i in idss)  # no rank receives -1
    for r in range(p):
        assert not combine[r].slot_rows[idss[r] < 0].any()  # a masked slot's row stays zero
        assert calc_diff(combine[r].y, moe_reference(xs[r], *zeroed[r], weights)) < 1e-6
        assert torch.equal(combine[r].y[0], shared_only(xs[r], weights, cfg.quant)[0])


@pytest.mark.compile
def test_comm_kernels_compile_with_masked_ids():
    """The option reaches publish (a separate compiled variant) and costs no local memory."""
    from gcmoe_comm.kernels import CommShape, compiled
    from gcmoe_comm.ring import RingSpec

    spec = RingSpec.from_config(MoEConfig.from_model("deepseek-v3", ep_size=8), 16)
    plain, masked = (compiled(CommShape(spec, m), "sm_90a") for m in (False, True))
    assert masked["publish"].ptx != plain["publish"].ptx
    for name, k in masked.items():
        res = k.resources()
        assert res["LOCAL"] == 0 and res["STACK"] == 0, (name, res)
