"""Faults beyond the dead peer, in the executable protocol model (protocol_model.Fault): a stale or
corrupted generation counter, a READY tag forged to the very generation its peers wait for, a rank that publishes
twice, a peer that restarts (its workspace recreated), a finalize that stalls past the bound, and the dead peer.

For each, every interleaving is explored with bounded waits: no silently wrong read, no hang, and the ERR words the
kernels would record (rank, counter, generation, value seen) — which the host turns into the CommError message
checked here — then the calls after recover() on every rank are explored from the state it leaves. The forged tag
is caught only by dispatch's check of the peer's GEN beside its READY: without it (Variant.ready_ignores_gen, the
kernels before that check) the explorer finds the silently wrong read. The same faults on virtual ranks on a GPU:
test_faults_gpu.py.
"""

from dataclasses import dataclass, replace

import pytest
from protocol_model import (
    FAULT_KINDS,
    Config,
    Fault,
    Variant,
    explore,
    random_walks,
    recovered_state,
)

from gcmoe_comm.workspace import error_message
from gcmoe_core.signals import KIND_BLOCK, KIND_OFFS, KIND_READY, KIND_RECV, KIND_W1

KINDS = {"READY": KIND_READY, "RECV": KIND_RECV, "OFFS": KIND_OFFS, "BLOCK": KIND_BLOCK, "W1": KIND_W1}


@dataclass(frozen=True)
class FaultCase:
    fault: Fault
    ranks: int
    expect: frozenset  # ERR records some terminal state holds: (rank, kind, who, generation, value seen)

    @property
    def id(self) -> str:
        return f"{self.fault.kind}-P{self.ranks}"


# rank 1's call 2 (rank 0's on one rank) is the faulty one; two ring blocks, two calls
CASES = [
    FaultCase(Fault("dead"), 2, frozenset({(0, "READY", 1, 2, 1)})),
    FaultCase(Fault("stale_gen"), 2, frozenset({(0, "READY", 1, 2, 1), (1, "READY", 0, 1, 2)})),
    FaultCase(Fault("stale_gen", rank=0), 1, frozenset({(0, "OFFS", 0, 2, 1)})),
    FaultCase(Fault("corrupt_gen"), 2, frozenset({(0, "READY", 1, 2, 1002), (1, "READY", 0, 1002, 2)})),
    FaultCase(Fault("forged_ready"), 2, frozenset({(0, "READY", 1, 2, 1), (1, "RECV", 1, 2, 1)})),
    FaultCase(Fault("double_publish"), 2, frozenset({(0, "READY", 1, 2, 3), (1, "READY", 0, 3, 2)})),
    FaultCase(Fault("double_publish", rank=0), 1, frozenset({(0, "OFFS", 0, 2, 3)})),
    FaultCase(Fault("restart"), 2, frozenset({(0, "READY", 1, 2, 1), (1, "READY", 0, 1, 2)})),
    FaultCase(Fault("finalize_stall"), 2, frozenset({(0, "RECV", 0, 2, 1)})),
]


def _config(case: FaultCase, **kw) -> Config:
    return Config(ranks=case.ranks, blocks=2, generations=2, fault=case.fault, **kw)


def test_every_fault_kind_has_a_case():
    assert {c.fault.kind for c in CASES} == set(FAULT_KINDS)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_fault_ends_in_a_named_error_never_a_wrong_read_or_a_hang(case):
    rep = explore(_config(case))
    assert not rep.violations, rep.violations
    assert not rep.deadlocks, rep.deadlocks
    assert case.expect <= rep.errors, (case.expect - rep.errors, rep.errors)
    for rank, kind, who, gen, seen in rep.errors:  # each as the host says it: rank, counter, generation
        msg = error_message([1, KINDS[kind], who, gen, seen], rank, case.ranks)
        assert msg.startswith(f"gcmoe-comm rank {rank}: timed out waiting on ") and f"generation {gen}" in msg, msg


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_calls_after_recover_are_exact(case):
    cfg = replace(_config(case), fault=None)
    rep = explore(cfg, start=recovered_state(cfg))
    assert rep.ok and not rep.errors, (rep.deadlocks, rep.violations, rep.errors)
    assert rep.states > 10


def test_a_forged_ready_tag_is_a_silent_wrong_read_without_the_gen_check():
    """The corrupted tag that looks valid: READY = g before the peer published g. Dispatch's READY wait alone passes
    it and reads the peer's previous routing; the GEN check beside it is what turns it into an error."""
    rep = explore(_config(CASES[4], variant=Variant(ready_ignores_gen=True)))
    assert rep.violations and "read rank 1's routing of generation 1" in rep.violations[0], rep


@pytest.mark.parametrize(
    ("fault", "ranks"),
    [(Fault("forged_ready", rank=0), 1), (Fault("restart", rank=0), 1), (Fault("stale_gen", call=1), 2)],
    ids=["own-forged-ready", "lone-restart", "stale-gen-at-0"],
)
def test_faults_that_do_no_harm_leave_every_call_correct(fault, ranks):
    """A rank's own forged READY lands before its own dispatch reads it; a lone rank that restarts starts over
    consistently; a GEN already at 0 rolled back to 0 changes nothing: no error, every call checked correct."""
    rep = explore(Config(ranks=ranks, blocks=2, generations=2, fault=fault))
    assert rep.ok and not rep.errors, (rep.violations, rep.errors)


@pytest.mark.parametrize("kind", FAULT_KINDS)
def test_faults_on_more_ranks_random_walks(kind):
    cfg = Config(ranks=4, blocks=3, generations=3, fault=Fault(kind, rank=2, call=2))
    rep = random_walks(cfg, walks=60, seed=7)
    assert not rep.violations and not rep.deadlocks, (rep.violations, rep.deadlocks)
    assert any(rank != 2 for rank, *_ in rep.errors), rep.errors  # the faulty rank's peers notice


def test_faults_need_one_lane_and_a_real_rank_and_call():
    for bad in (
        dict(ranks=1, lanes=2, fault=Fault("dead", rank=0)),
        dict(ranks=2, fault=Fault("dead", rank=2)),
        dict(ranks=2, generations=2, fault=Fault("dead", call=3)),
    ):
        with pytest.raises(ValueError, match="Config: Fault"):
            Config(**bad)
    with pytest.raises(ValueError, match="kind 'flaky'"):
        Fault("flaky")
