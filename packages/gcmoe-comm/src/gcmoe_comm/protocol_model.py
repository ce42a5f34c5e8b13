"""Executable model of the cross-rank protocol (ring, generation tags, double-buffered receive counters), and an
explorer of its interleavings. CPU only; the kernels implement exactly these steps.

Per rank r and replay generation g = 1, 2, ... (one captured graph replay per generation; a rank's replay g+1 starts
only after its replay g finished — graph launches on one stream are serialised — but ranks are not synchronised
with each other: there is no trailing cross-rank barrier):

  dispatch (comm partition)
    publish      payload_gen[r] = g ; ready[r] = g                      (own FP8 tokens + routing, release)
    route q      wait ready[q] >= g ; read q's routing (check payload_gen[q] == g)          for each rank q
    block b      wait ready[src(b)] >= g ; pull rows (check payload_gen[src] == g) ;
                 ring_gen[r][b] = g ; full[r][b] = g                    (generation tag, release)
    done         dispatch_done[r] = g
  compute (compute partition, concurrent with dispatch)
    block b      wait full[r][b] == g (acquire; a stale tag g-1 is never accepted) ; consume (check ring_gen == g)
    scatter q    wait dispatch_done[r] == g ; combine_gen[q][r] = g (W2 rows into q's combine buffer) ;
                 recv[q][g % 2] += 1 (release)                          for each rank q
  finalize (compute partition, after compute)
    wait recv[r][g % 2] == P (acquire) ; read combine (check combine_gen[r][q] == g for all q) ;
    recv[r][g % 2] = 0 (reset for generation g + 2)

Why it is safe without a trailing barrier: rank q signals r for generation g only after q's dispatch finished
pulling r's payload of g, and r overwrites that payload (g + 1) only after its finalize(g) saw every peer's signal.
A fast peer's signal for g + 1 lands in the other parity slot, so r's reset of slot g % 2 cannot erase it; its
signal for g + 2 needs r's signal for g + 1, sent after r's reset.

`explore(...)` runs every interleaving (memoised DFS over states) and reports deadlocks and violations of: payload
read of the wrong generation, a ring block consumed twice / never / with the wrong generation, a combine row of the
wrong generation, a lost receive-counter increment. `Variant` flags seed known bugs so tests prove the explorer
catches them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Variant:
    """Protocol switches; the default is the shipped protocol. Each True flag is a deliberate bug."""

    signal_first: bool = False  # compute signals peers before its blocks arrived (pulls may still be in flight)
    accept_stale_tags: bool = False  # wait full[b] >= 1 instead of == g (a tag from an old generation passes)
    skip_ready_wait: bool = False  # pull a peer's rows without waiting for its ready flag of this generation
    # Not a bug under this protocol: one receive counter per rank instead of two. Every rank reads every peer's
    # routing each generation (it must, to know what it receives), which already keeps ranks within one
    # generation of each other; the explorer proves the single counter safe. We keep the parity slots so the
    # protocol stays correct if that handshake is ever narrowed (e.g. senders pushing counts).
    single_recv_counter: bool = False


@dataclass(frozen=True)
class Config:
    ranks: int = 2
    blocks: int = 2  # ring blocks each rank receives per generation (block b pulled from rank b % P)
    generations: int = 2
    variant: Variant = field(default_factory=Variant)


# Program counters per rank: (gen, dispatch_pc, compute_pc, finalize_pc). gen = current generation (1-based),
# gen > generations means the rank is finished.
def _initial(cfg: Config):
    p, b = cfg.ranks, cfg.blocks
    shared = {
        "ready": (0,) * p,
        "payload_gen": (0,) * p,
        "dispatch_done": (0,) * p,
        "full": ((0,) * b,) * p,
        "ring_gen": ((0,) * b,) * p,
        "consumed": ((0,) * b,) * p,  # times block b was consumed in the current generation
        "recv": ((0, 0),) * p,
        "combine_gen": ((0,) * p,) * p,
        "signals": ((0,) * (cfg.generations + 2),) * p,  # increments ever sent to rank r per generation
        "seen": ((0,) * (cfg.generations + 2),) * p,  # increments rank r accounted for per generation
    }
    pcs = tuple((1, 0, 0, 0) for _ in range(p))
    return pcs, tuple(sorted(shared.items()))


def _set(t: tuple, i: int, v) -> tuple:
    return (*t[:i], v, *t[i + 1 :])


def _set2(t: tuple, i: int, j: int, v) -> tuple:
    return _set(t, i, _set(t[i], j, v))


class Violation(Exception):
    pass


def _dispatch_steps(cfg: Config) -> int:
    return 1 + cfg.ranks + cfg.blocks + 1  # publish, route per rank, blocks, done


def _compute_steps(cfg: Config) -> int:
    return cfg.blocks + cfg.ranks


def _slot(cfg: Config, g: int) -> int:
    return 0 if cfg.variant.single_recv_counter else g % 2


def _moves(cfg: Config, pcs, shared):
    """Yield (description, new_pcs, new_shared) for every enabled step; raise Violation on a bad read."""
    s = dict(shared)
    p, nb = cfg.ranks, cfg.blocks
    v = cfg.variant
    for r in range(p):
        g, dpc, cpc, fpc = pcs[r]
        if g > cfg.generations:
            continue
        # ---- dispatch
        if dpc < _dispatch_steps(cfg):
            n = dict(s)
            ok = True
            if dpc == 0:
                n["payload_gen"] = _set(s["payload_gen"], r, g)
                n["ready"] = _set(s["ready"], r, g)
            elif dpc <= p:
                q = dpc - 1
                ok = v.skip_ready_wait or s["ready"][q] >= g
                if ok and s["payload_gen"][q] != g:
                    raise Violation(f"rank {r} gen {g}: read rank {q}'s routing of generation {s['payload_gen'][q]}")
            elif dpc <= p + nb:
                b = dpc - 1 - p
                src = b % p
                ok = v.skip_ready_wait or s["ready"][src] >= g
                if ok:
                    if s["payload_gen"][src] != g:
                        raise Violation(
                            f"rank {r} gen {g}: pulled block {b} from rank {src}'s payload of "
                            f"generation {s['payload_gen'][src]}"
                        )
                    n["ring_gen"] = _set2(s["ring_gen"], r, b, g)
                    n["full"] = _set2(s["full"], r, b, g)
            else:
                n["dispatch_done"] = _set(s["dispatch_done"], r, g)
            if ok:
                yield f"r{r}g{g}:dispatch{dpc}", _set(pcs, r, (g, dpc + 1, cpc, fpc)), tuple(sorted(n.items()))
        # ---- compute
        if cpc < _compute_steps(cfg):
            n = dict(s)
            ok = True
            step = (cpc + p) % (nb + p) if v.signal_first else cpc  # signal_first: scatter steps come first
            if step < nb:
                b = step
                tag = s["full"][r][b]
                ok = tag >= 1 if v.accept_stale_tags else tag == g
                if ok:
                    if s["ring_gen"][r][b] != g:
                        raise Violation(
                            f"rank {r} gen {g}: consumed ring block {b} holding generation {s['ring_gen'][r][b]}"
                        )
                    n["consumed"] = _set2(s["consumed"], r, b, s["consumed"][r][b] + 1)
            else:
                q = step - nb
                ok = v.signal_first or s["dispatch_done"][r] == g
                if ok:
                    n["combine_gen"] = _set2(s["combine_gen"], q, r, g)
                    slot = _slot(cfg, g)
                    n["recv"] = _set2(s["recv"], q, slot, s["recv"][q][slot] + 1)
                    n["signals"] = _set2(s["signals"], q, g, s["signals"][q][g] + 1)
            if ok:
                yield f"r{r}g{g}:compute{cpc}", _set(pcs, r, (g, dpc, cpc + 1, fpc)), tuple(sorted(n.items()))
        # ---- finalize (after compute on the same stream)
        elif fpc == 0:
            slot = _slot(cfg, g)
            if s["recv"][r][slot] >= p:
                n = dict(s)
                if s["recv"][r][slot] > p:
                    raise Violation(
                        f"rank {r} gen {g}: counter holds {s['recv'][r][slot]} > {p} signals (mixed generations)"
                    )
                for q in range(p):
                    if s["combine_gen"][r][q] != g:
                        raise Violation(
                            f"rank {r} gen {g}: combine rows from rank {q} are of generation {s['combine_gen'][r][q]}"
                        )
                n["recv"] = _set2(s["recv"], r, slot, 0)
                n["seen"] = _set2(s["seen"], r, g, p)
                for b in range(nb):
                    if s["consumed"][r][b] != 1:
                        raise Violation(f"rank {r} gen {g}: ring block {b} consumed {s['consumed'][r][b]} times")
                n["consumed"] = _set(s["consumed"], r, (0,) * nb)
                # the generation ends; the next replay's roles start from the top
                yield f"r{r}g{g}:finalize", _set(pcs, r, (g + 1, 0, 0, 0)), tuple(sorted(n.items()))


def _done(cfg: Config, pcs) -> bool:
    return all(pc[0] > cfg.generations for pc in pcs)


def _check_final(cfg: Config, shared) -> None:
    s = dict(shared)
    for r in range(cfg.ranks):
        for g in range(1, cfg.generations + 1):
            if s["signals"][r][g] != s["seen"][r][g]:
                raise Violation(f"rank {r} gen {g}: {s['signals'][r][g]} signals sent, {s['seen'][r][g]} accounted")


def _expand(cfg: Config, pcs, shared, trace, deadlocks: list[str], violations: list[str]) -> list:
    """The enabled moves from a state; [] for a terminal state, whose deadlock or violation is recorded."""
    tail = " ".join(trace[-12:])
    try:
        moves = list(_moves(cfg, pcs, shared))
    except Violation as e:
        violations.append(f"{e} after {tail}")
        return []
    if not moves:
        if not _done(cfg, pcs):
            deadlocks.append(f"stuck at {pcs} after {tail}")
        else:
            try:
                _check_final(cfg, shared)
            except Violation as e:
                violations.append(str(e))
    return moves


@dataclass
class Report:
    states: int
    deadlocks: list[str]
    violations: list[str]

    @property
    def ok(self) -> bool:
        return not self.deadlocks and not self.violations


def explore(cfg: Config, max_states: int = 5_000_000) -> Report:
    """Every interleaving (memoised on the global state)."""
    start = _initial(cfg)
    seen = {start}
    stack = [(start, ())]
    deadlocks: list[str] = []
    violations: list[str] = []
    while stack and len(seen) <= max_states:
        (pcs, shared), trace = stack.pop()
        moves = _expand(cfg, pcs, shared, trace, deadlocks, violations)
        for desc, npcs, nshared in moves:
            st = (npcs, nshared)
            if st not in seen:
                seen.add(st)
                stack.append((st, (*trace[-11:], desc)))
    if stack:
        raise RuntimeError(f"explore: state space exceeds {max_states} states; shrink the configuration")
    return Report(len(seen), deadlocks[:5], violations[:5])


def random_walks(cfg: Config, walks: int, seed: int = 0) -> Report:
    """Random interleavings for configurations too large to enumerate."""
    rng = random.Random(seed)
    deadlocks: list[str] = []
    violations: list[str] = []
    steps = 0
    for _ in range(walks):
        pcs, shared = _initial(cfg)
        trace: list[str] = []
        while True:
            moves = _expand(cfg, pcs, shared, trace, deadlocks, violations)
            if not moves:
                break
            desc, pcs, shared = rng.choice(moves)
            trace.append(desc)
            steps += 1
    return Report(steps, deadlocks[:5], violations[:5])
