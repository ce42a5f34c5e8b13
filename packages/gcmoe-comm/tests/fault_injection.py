"""Fault injection on virtual ranks (one GPU): the faults of the protocol model (protocol_model.Fault) enacted on
real workspaces through virtual_ranks.VirtualRanks.step's inject hook, each on the faulty rank's own stream just
before the phase it hits:

    dead            every phase of the rank skipped
    stale_gen       its GEN = 0 before its publish (its counter rolled back, as after a recover() on it alone)
    corrupt_gen     its GEN += 1000 before its publish
    forged_ready    its READY = GEN + 1 (the generation its peers wait for), then its stream sleeps `stall_ms` before
                    its real publish: the peers find the forged tag first (a corrupted tag that looks valid)
    double_publish  its publish launched twice under one ticket (a replayed publish node)
    restart         its whole workspace zeroed before its publish (a new workspace at the same address: the
                    peers' tables stay valid, as a re-rendezvous would give)
    finalize_stall  its stream sleeps `stall_ms` before its finalize (alive, but late past the bound)

    inject = FaultInjector(Fault("forged_ready", rank=1), (xs, ids, ws), stall_ms=3 * bound_ms)
    vr.step(xs, ids, ws, outs, inject=inject)              # the faulty call; then vr.check() raises CommError

A sleep lasts at least stall_ms on a GPU clocked at 2 GHz or less (torch.cuda._sleep counts cycles).
"""

from __future__ import annotations

import torch
from protocol_model import Fault

from gcmoe_comm.comm import CommRank, new_ticket
from gcmoe_comm.workspace import SIG_GEN, SIG_READY

CYCLES_PER_MS = 2_000_000  # (an upper bound on the clock: the sleeps last at least as long as asked)


class FaultInjector:
    """VirtualRanks.step's inject hook for one Fault (its `call` is the caller's business: pass the injector to the
    faulty call's step only). inputs: (xs, topk_ids, topk_weights) of that step, for double_publish."""

    def __init__(self, fault: Fault, inputs: tuple | None = None, stall_ms: float = 0.0):
        if fault.kind == "double_publish" and inputs is None:
            raise ValueError("FaultInjector: double_publish needs the step's inputs")
        if fault.kind in ("forged_ready", "finalize_stall") and stall_ms <= 0:
            raise ValueError(f"FaultInjector: {fault.kind} needs stall_ms > 0")
        self.fault, self.inputs, self.stall_ms = fault, inputs, stall_ms

    def _sleep(self) -> None:
        torch.cuda._sleep(int(self.stall_ms * CYCLES_PER_MS))

    def __call__(self, phase: str, r: int, rank: CommRank) -> bool:
        kind = self.fault.kind
        if r != self.fault.rank:
            return False
        if kind == "dead":
            return True
        sig = rank.ws.views.signals
        if phase == "publish":
            if kind == "stale_gen":
                sig[SIG_GEN].zero_()
            elif kind == "corrupt_gen":
                sig[SIG_GEN].add_(1000)
            elif kind == "forged_ready":
                sig[SIG_READY].copy_(sig[SIG_GEN] + 1)
                self._sleep()
            elif kind == "restart":
                rank.ws.buf.zero_()
            elif kind == "double_publish":
                xs, ids, ws = self.inputs
                ticket = new_ticket()
                for _ in range(2):
                    rank.publish(xs[r], ids[r], ws[r], ticket)
                return True
        elif phase == "finalize" and kind == "finalize_stall":
            self._sleep()
        return False
