"""The faults of test_faults.py on virtual ranks on one GPU (fault_injection.FaultInjector through
VirtualRanks.step): each faulty call ends, within a few bounds and without hanging the process, in a CommError
naming the rank, the counter and the generation — the same ERR record the protocol model predicts for rank 0 —
with NaN rows where a call failed; then recover() on every rank and the next call is bit-exact (ring and outputs).
A stalled finalize leaves the late rank's own call correct (its peers had signalled it); only its peers fail."""

import time
from dataclasses import dataclass

import pytest
import torch
from fault_injection import FaultInjector
from protocol_model import FAULT_KINDS, Fault
from virtual_ranks import VirtualRanks, check_ring, expected_outputs, make_inputs

from gcmoe_comm.ring import RingSpec
from gcmoe_comm.workspace import CommError

pytestmark = pytest.mark.gpu

H, E, K, S, TMAX, BM = 1024, 16, 4, 1, 32, 8
BOUND_MS = 100


@dataclass(frozen=True)
class GpuFault:
    kind: str
    rank0: str  # what rank 0's CommError must say (regex): rank 1 is faulty, in call 2 (generation 2)
    faulty_rank_fails: bool  # the faulty rank raises too (else its own call is exact)


CASES = [
    GpuFault("dead", r"rank 0: timed out waiting on rank 1's ready tag .*wanted generation 2, saw 1\.", False),
    GpuFault("stale_gen", r"rank 0: timed out waiting on rank 1's ready tag .*wanted generation 2, saw 1\.", True),
    GpuFault("corrupt_gen", r"rank 0: timed out waiting on rank 1's ready tag .*wanted generation 2, saw 1002\.", True),
    GpuFault("forged_ready", r"rank 0: timed out waiting on rank 1's ready tag .*wanted generation 2, saw 1\.", True),
    GpuFault(  # (rank 0 may pass READY = 2 between the two publishes: then its receive counter expires)
        "double_publish",
        r"rank 0: timed out waiting on (rank 1's ready tag .*wanted generation 2, saw 3|rank 0's receive counter: "
        r"wanted 2 arrivals for generation 2, saw 1)\.",
        True,
    ),
    GpuFault("restart", r"rank 0: timed out waiting on rank 1's ready tag .*wanted generation 2, saw 1\.", True),
    GpuFault(
        "finalize_stall",
        r"rank 0: timed out waiting on rank 0's receive counter: wanted 2 arrivals for generation 2, saw 1\.",
        False,
    ),
]


def test_cases_cover_every_fault_kind():
    assert {c.kind for c in CASES} == set(FAULT_KINDS)


def _step(vr, inputs, inject=None):
    xs, ids, ws = inputs
    outs = [torch.full_like(x, float("nan")) for x in xs]
    silent = frozenset({1}) if inject is not None and inject.fault.kind == "dead" else frozenset()
    vr.step(xs, ids, ws, outs, silent=silent, inject=inject)
    torch.cuda.synchronize()
    return outs


def _virtual_ranks(p: int):
    """P virtual ranks of the fault tests' ring, their kernels loaded, every wait bounded by BOUND_MS."""
    spec = RingSpec(p, E // p, H, K, TMAX, BM, S)
    vr = VirtualRanks(spec, "cuda", dispatch_ctas=4, finalize_ctas=4, timeout_ms=BOUND_MS)
    vr.load()
    return vr


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.kind)
def test_fault_is_reported_within_the_bound_and_recovery_is_exact(case):
    p = 2
    vr = _virtual_ranks(p)
    inputs = make_inputs(p, "uniform", 5, H, E, K, TMAX)
    want = expected_outputs(vr.spec, *inputs)
    outs = _step(vr, inputs)  # call 1 (generation 1) is exact
    vr.check()
    assert all(torch.equal(y, w) for y, w in zip(outs, want))
    inject = FaultInjector(Fault(case.kind, rank=1, call=2), inputs, stall_ms=3 * BOUND_MS)
    t0 = time.perf_counter()
    outs = _step(vr, inputs, inject)
    elapsed = time.perf_counter() - t0
    assert elapsed < 10 * BOUND_MS / 1e3, f"{case.kind}: the faulty call took {elapsed:.3f} s, bound {BOUND_MS} ms"
    with pytest.raises(CommError, match=case.rank0):
        vr.ws[0].check()
    assert bool(outs[0].isnan().all()), f"{case.kind}: rank 0's failed call must write NaN rows"
    if case.faulty_rank_fails:
        with pytest.raises(CommError, match=r"rank 1: .*generation \d+"):
            vr.ws[1].check()
    elif case.kind == "finalize_stall":
        vr.ws[1].check()  # late, not dead: its peers' signals were there, its own call is exact
        assert torch.equal(outs[1], want[1])
    vr.recover()
    outs = _step(vr, inputs)
    vr.check()
    for q, w in enumerate(vr.ws):
        check_ring(w.views, q, vr.spec, *inputs, gen=1)
    for r, (y, w) in enumerate(zip(outs, want)):
        assert torch.equal(y, w), f"{case.kind}: rank {r} after recover()"


@pytest.mark.parametrize("kind", ["forged_ready", "double_publish", "finalize_stall"])
def test_faults_on_four_ranks(kind):
    p = 4
    vr = _virtual_ranks(p)
    inputs = make_inputs(p, "uniform", 6, H, E, K, TMAX)
    _step(vr, inputs)
    vr.check()
    _step(vr, inputs, FaultInjector(Fault(kind, rank=2, call=2), inputs, stall_ms=3 * BOUND_MS))
    for r in (0, 1, 3):  # every peer of the faulty rank names a counter and generation 2
        with pytest.raises(CommError, match=rf"rank {r}: timed out waiting on .*generation 2"):
            vr.ws[r].check()
    vr.recover()
    outs = _step(vr, inputs)
    vr.check()
    assert all(torch.equal(y, w) for y, w in zip(outs, expected_outputs(vr.spec, *inputs)))
