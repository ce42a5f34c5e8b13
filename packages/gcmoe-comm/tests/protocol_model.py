"""Executable model of the cross-rank protocol (ring, generation tags, double-buffered receive counters), and an
explorer of its interleavings. CPU only; the kernels implement exactly these steps.

Per rank r and replay generation g = 1, 2, ... (one captured graph replay per generation; a rank's replay g+1 starts
only after its replay g finished — graph launches on one stream are serialised — but ranks are not synchronised
with each other: there is no trailing cross-rank barrier):

  dispatch (comm partition; kernels.py k_publish, k_dispatch)
    publish      take INUSE (CAS 0 -> ticket; held by another ticket: ERR = BUSY, the call does nothing) ;
                 g = ++GEN ; payload_gen[r] = g ; ready[r] = g            (own FP8 tokens + routing, release)
    route q      wait ready[q] >= g ; read q's routing (check payload_gen[q] == g)          for each rank q
    offsets      write the ring offsets and counts of g ; OFFS[r] = g (release)           (two steps, this order;
                 the kernel's CTAs each read the routing: the last past its reads releases OFFS, RANKED counter)
    block b      wait ready[src(b)] >= g ; pull rows (check payload_gen[src] == g) ;
                 ring_gen[r][b] = g ; full[r][b] = g                    (generation tag, release)
    done         dispatch_done[r] = g      (in the kernels: no flag, but OFFS (released once every dispatch CTA read the
                 routing) and every block's L1_FULL, all acquired by W1 before its W1_DONE tags that W2 acquires)
  compute (compute partition, concurrent with publish and dispatch; kernel_grouped.py acquire_ring)
    acquire      wait INUSE == ticket ; g = CGEN + 1 (the generation compute's waits use)
    offsets      wait OFFS == g ; read the offsets and counts (check they are of the call's generation)
    block b      wait full[r][b] == g (acquire; a stale tag g-1 is never accepted) ; consume (check ring_gen == g)
    experts      W1 tiles and W2 of every expert e, all concurrent (W2 does not wait for the whole W1 grid):
      W1 e, m    store rows (w1_rows[r][e][m] = g) ; old = atomic_add(count[e], 1) (acq_rel)  for each M tile m
                 if old == M - 1 (last of M tiles): count[e] = 0 ; tag[e] = g (release)  (count, tag: W1_DONE[e])
      W2 e       wait tag[e] == g (acquire; the last call's tag g-1 is never accepted) ; read e's W1 rows
                 (check w1_rows[r][e][m] == g for every m)
    scatter q    wait dispatch_done[r] == g ; combine_gen[q][r] = g (W2 rows into q's combine buffer)  for each q
  finalize (compute partition, after W2 on the stream; kernels.py k_finalize)
    start        INUSE != ticket or ERR set: NaN rows, nothing else (INUSE stays held) ; g = GEN (checked)
    signal q     recv[q][g % 2] += 1 (release: the combined signal, my rows for q landed)  for each rank q
    wait         recv[r][g % 2] == P (acquire) ; read combine (check combine_gen[r][q] == g for all q)
    tail         recv[r][g % 2] = 0 (for generation g + 2) ; CGEN = g ; INUSE = 0 (release)  (three steps)

World size 1 with small calls runs publish and dispatch as one kernel (kernels.py k_dispatch_local): the same steps
for its one rank, with g = the GEN read after taking INUSE, plus one, and GEN = READY = g written by the last CTA past
the ranking under the same release as OFFS = g (no rank waits on READY at P = 1; W1 acquires OFFS).

Calls: one lane (Config.lanes = 1) issues its calls in order on one stream, ticket fixed; lanes = 2 (ranks = 1):
two streams' calls race for one workspace: one takes it, the other is refused (BUSY) or takes it once freed.
On one lane INUSE and CGEN are redundant (the stream orders the calls); with two lanes compute's INUSE wait and
finalize's order (CGEN = g, then INUSE = 0) keep a call from deriving another call's g and reading its offsets.
Signals folded into finalize: a rank's signal to q and its own wait touch different words (q != r), so running
the signals before the wait loses no interleaving.

Why it is safe without a trailing barrier: rank q signals r for generation g only after q's dispatch finished
pulling r's payload of g, and r overwrites that payload (g + 1) only after its finalize(g) saw every peer's signal.
A fast peer's signal for g + 1 lands in the other parity slot, so r's reset of slot g % 2 cannot erase it; its
signal for g + 2 needs r's signal for g + 1, sent after r's reset.

The model runs the blocks before the experts step (the W1 tiles' ring-block acquires touch no W1_DONE word).
W1_DONE needs no reset between calls: the tile that saw count M - 1 resets it before it releases the tag, and W2
acquires the tag, so the reset precedes the next call's adds even if that call could start while this call's W1
tiles retire (Config.w1_tail_overlap). W2 accepts only tag == g, so the last call's tag never passes.

`explore(...)` runs every interleaving (memoised DFS over states) and reports deadlocks and violations of: payload
read of the wrong generation, a ring block consumed twice / never / with the wrong generation, a combine row of the
wrong generation, a lost receive-counter increment, a W2 read of W1 rows of another generation or before every M
tile of the expert stored them, a W1_DONE count not back to 0 after a call (or already at M before a tile's add),
compute reading ring offsets of another generation (OFFS, CGEN, INUSE), publish or finalize seeing another GEN.
A rank whose ERR is set fails loudly (its waits end): its stuck lanes are no deadlock, its counters not checked.
`Variant` flags seed known bugs so tests prove the explorer catches them.

Faults (`Config.fault`, one `Fault` per exploration; one lane per rank): a peer that dies, whose generation
counter goes stale (rolled back, as after a recover() on that rank alone) or is corrupted, whose READY tag is forged
to the very generation its peers wait for before it published (a corrupted tag that looks valid), that publishes
twice, that restarts (its workspace recreated: every word zeroed), or whose finalize stalls past the bound. The
model then has bounded waits: once nothing can move, a blocked wait expires and records ERR (kind, who, generation,
value seen) as the kernels' waits do (a rank's dispatch first: its bound is half the compute role's), and the
rank stops. What a fault must give, in every interleaving: no violation (no silently wrong read) and no deadlock,
ERR on some rank, or every call complete and correct (a fault that happened to do no harm). Every waiting kernel
reads its ERR word, so ERR is the CommError the host raises. `recovered_state` is the state recover() leaves on
every rank (every signal zero, every buffer holding stale data): explore(..., start=recovered_state(cfg)) checks
the calls after it.
Dispatch acquires each peer's READY == g, then checks the peer's GEN == g (a READY = g beside another GEN is a
forged or corrupted tag: ERR kind READY, value seen = the peer's GEN). Only a forger that writes GEN, READY and
the payload exactly as a publish would is indistinguishable from one; any other value fails the equality waits.

Two lanes per rank (`TwoLaneConfig`, `explore_two_lanes`, `random_walks_two_lanes`): at P > 1 each rank runs two
micro-batches' calls in flight, each lane an independent instance of the one-lane protocol above (its own workspace:
one sub-state per lane, the same steps), issued on two streams (a stream per lane) or on one stream in a per-rank
order (`orders`). Resources: a rank has `slots` resident CTA slots (SMs x CTAs per SM, one unit per CTA of any
kernel); each call's five kernels (publish, dispatch, W1, W2, finalize) have `grids` CTAs. A CTA becomes resident
when its kernel is launchable and a slot is free (any pending kernel may win the slot); a kernel's step runs only
with one of its CTAs resident, a last-CTA step (READY, OFFS, finalize's tail) once all its CTAs were placed; a CTA
frees its slot once its kernel is past its waits (the last one once its steps are done), so a spinning CTA holds its
slot. Launch order, as the code does it: the next call on a stream after every kernel of the last finished; dispatch
once every publish CTA started (publish triggers launch_dependents first thing) and its steps after publish finished
(griddepcontrol.wait: a dispatch CTA may be resident and spinning before); W1 once every dispatch CTA passed its
READY waits (partitioned, `comm_slots`: with the call, on the compute pool); W2 once every W1 CTA passed INUSE / OFFS;
finalize once every W2 CTA passed its W1_DONE wait, its steps after W2 finished. Not modelled: per-SM packing
(registers, shared memory: a W1 / W2 CTA needs an SM that no small CTA occupies, so a unit slot is optimistic for
them), the block scheduler's order, CTAs of one kernel waiting on different things (all wait at the kernel's step),
faults. Retiring is immediate (it only frees slots); a PRIVATE step runs alone as in _expand.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from functools import cache
from typing import NamedTuple


@dataclass(frozen=True)
class Variant:
    """Protocol switches; the default is the shipped protocol. Each True flag is a deliberate bug."""

    signal_first: bool = False  # W2 scatters its rows before its blocks arrived (without waiting for dispatch)
    accept_stale_tags: bool = False  # wait full[b] >= 1 instead of == g (a tag from an old generation passes)
    skip_ready_wait: bool = False  # pull a peer's rows without waiting for its ready flag of this generation
    # Not a bug under this protocol: one receive counter per rank instead of two. Every rank reads every peer's
    # routing each generation (it must, to know what it receives), which already keeps ranks within one
    # generation of each other; the explorer proves the single counter safe. We keep the parity slots so the
    # protocol stays correct if that handshake is ever narrowed (e.g. senders pushing counts).
    single_recv_counter: bool = False
    # Not a bug under the stream rule (a rank's call g + 1 starts only after every W1 tile of call g retired): the
    # expert's last W1 tile releases W1_DONE[e].tag before it stores count = 0. Nothing reads or adds to the count
    # between the two stores in the same call, and the next call's tiles come after both; the explorer proves it
    # safe. It is a bug once the next call may start while a W1 tile's steps after its tag are pending
    # (Config.w1_tail_overlap): a tile of call g + 1 then adds to the unreset count, or the late reset erases its
    # add. The shipped order (reset, then tag) is safe either way: W2 acquires the tag, so the reset is done first.
    w1_tag_before_reset: bool = False
    w2_accept_stale_w1_tag: bool = False  # W2 waits W1_DONE[e].tag >= 1 instead of == g (last call's tag passes)
    w1_tag_every_tile: bool = False  # every W1 tile of e releases W1_DONE[e].tag, not only the last one
    compute_skips_offs_wait: bool = False  # W1 / W2 read the ring offsets and counts without waiting OFFS == g
    offs_before_offsets: bool = False  # dispatch releases OFFS = g before it writes the ring offsets and counts
    # Not bugs on one lane (the stream rule: the lane's next call starts after this finalize ended, and CGEN changes
    # only in finalize): compute skips the INUSE == ticket wait (CGEN + 1 and OFFS == g alone pick the right call);
    # finalize frees INUSE before it stores CGEN = g; finalize stores CGEN before it resets RECV. The explorer proves
    # all three safe there. The first two break once a second lane shares the workspace (Config.lanes = 2): a
    # call of the other lane reads the holder's CGEN + 1 and OFFS (its offsets of the holder's generation), or
    # takes the freed workspace and reads CGEN before the holder stored it (g = the holder's, whose OFFS passes).
    # cgen_before_reset stays safe there too: CGEN is read only by a call that holds INUSE, freed after both.
    compute_skips_inuse_wait: bool = False
    inuse_freed_early: bool = False
    cgen_before_reset: bool = False
    ready_ignores_gen: bool = False  # dispatch trusts a READY = g without checking the peer's GEN == g


FAULT_KINDS = ("dead", "stale_gen", "corrupt_gen", "forged_ready", "double_publish", "restart", "finalize_stall")


@dataclass(frozen=True)
class Fault:
    """One fault on rank `rank`'s call `call` (1-based):
    dead            the rank does nothing from this call on
    stale_gen       its GEN is back at 0 before the call's publish (a recover() on that rank alone)
    corrupt_gen     its GEN holds a value no call has (+ 1000) before the call's publish
    forged_ready    its READY is set to the call's generation while its publish of the call is still to come
    double_publish  the call publishes twice (same ticket: a publish node replayed)
    restart         its workspace is recreated before the call (every signal zero, every buffer stale)
    finalize_stall  the call's finalize runs only once every other rank stopped (stalled past the bound)"""

    kind: str
    rank: int = 1
    call: int = 2

    def __post_init__(self):
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"Fault: kind {self.kind!r} not in {FAULT_KINDS}")


@dataclass(frozen=True)
class Config:
    ranks: int = 2
    blocks: int = 2  # ring blocks each rank receives per generation (block b pulled from rank b % P)
    generations: int = 2  # calls per lane
    experts: int = 1  # experts of each rank's W1 / W2 (all with rows: an empty expert's tiles and W2 skip W1_DONE)
    m_tiles: int = 2  # W1 M tiles per expert (the count W1_DONE[e] reaches per generation)
    # A weaker stream rule: a rank's next generation may start once this generation's W2 work finished, with W1
    # tiles' steps after their own tag still pending (they finish later, concurrently with the next generation).
    w1_tail_overlap: bool = False
    # Streams ("lanes") issuing calls on one workspace, not ordered with each other; lane l's calls hold ticket
    # l + 1. lanes > 1 needs ranks == 1 (the calls of one layer step are not paired across ranks there).
    lanes: int = 1
    variant: Variant = field(default_factory=Variant)
    fault: Fault | None = None
    ticket: int = 1  # lane l's calls hold ticket `ticket + l` (the two-lane model gives each lane its own)

    def __post_init__(self):
        if self.lanes > 1 and self.ranks != 1:
            raise ValueError("Config: lanes > 1 needs ranks == 1")
        f = self.fault
        if f is not None and (self.lanes != 1 or not 0 <= f.rank < self.ranks or not 1 <= f.call <= self.generations):
            raise ValueError(f"Config: {f} needs one lane, a rank < {self.ranks} and a call <= {self.generations}")


class _Rank(NamedTuple):
    """Program counters of one lane of one rank. gen = the lane's call number (1-based), gen > generations: the lane
    is finished."""

    gen: int
    g: int  # the generation this call's publish took (one lane: known ahead, = gen; else 0 until publish)
    cg: int  # the generation compute derived (CGEN + 1 once it held INUSE; 0 before)
    dpc: int  # dispatch
    cpc: int  # compute: acquire, offsets, blocks, the experts step, scatters (see _plans)
    fpc: int  # finalize
    w1: tuple  # [e][m]: None (not started) or the tile's steps still to run after its add ((): retired)
    w2: tuple  # [e]: W2 of expert e done
    late: tuple  # (e, gen, steps) of W1 tiles of earlier generations still running (Config.w1_tail_overlap)


def _rank(cfg: Config, gen: int) -> _Rank:
    g = gen if cfg.lanes == 1 else 0
    return _Rank(gen, g, 0, 0, 0, 0, ((None,) * cfg.m_tiles,) * cfg.experts, (False,) * cfg.experts, ())


def _finished(cfg: Config) -> _Rank:
    """A lane whose calls ended (or that stopped at a failed call: the workspace needs recover() first)."""
    return _rank(cfg, cfg.generations + 1)


def _initial(cfg: Config):
    p, b, ne = cfg.ranks, cfg.blocks, cfg.experts
    ng = cfg.generations * cfg.lanes + 2
    shared = {
        "gen": (0,) * p,  # GEN
        "inuse": (0,) * p,  # INUSE: the ticket holding the workspace (0: free)
        "cgen": (0,) * p,  # CGEN: the generation whose finalize last finished
        "offs": (0,) * p,  # OFFS: the generation whose ring offsets and counts are written
        "ring_offs": (0,) * p,  # generation of the ring offsets and counts themselves
        "err": (0,) * p,  # ERR set (a call found the workspace held: BUSY)
        "ready": (0,) * p,
        "payload_gen": (0,) * p,
        "dispatch_done": (0,) * p,
        "full": ((0,) * b,) * p,
        "ring_gen": ((0,) * b,) * p,
        "consumed": ((0,) * b,) * p,  # times block b was consumed in the current generation
        "recv": ((0, 0),) * p,
        "combine_gen": ((0,) * p,) * p,
        "signals": ((0,) * ng,) * p,  # increments ever sent to rank r per generation
        "seen": ((0,) * ng,) * p,  # increments rank r accounted for per generation
        "w1_count": ((0,) * ne,) * p,  # W1_DONE[e].count of rank r
        "w1_tag": ((0,) * ne,) * p,  # W1_DONE[e].tag of rank r
        "w1_rows": (((0,) * cfg.m_tiles,) * ne,) * p,  # generation of W1's output rows of M tile m of expert e
        "dead": (False,) * p,  # (Fault "dead")
        "fault_done": False,  # the fault has happened
    }
    pcs = tuple(_rank(cfg, 1) for _ in range(p * cfg.lanes))
    return pcs, tuple(sorted(shared.items()))


STALE = -1  # the generation of a buffer's data after recover() or a restart: no call's


def _stale_data(s: dict, ranks) -> None:
    """Every buffer of these ranks holds data of no call (what recover() or a new workspace leaves)."""
    for r in ranks:
        for key in ("payload_gen", "ring_offs"):
            s[key] = _set(s[key], r, STALE)
        s["ring_gen"] = _set(s["ring_gen"], r, (STALE,) * len(s["ring_gen"][r]))
        s["combine_gen"] = _set(s["combine_gen"], r, (STALE,) * len(s["combine_gen"][r]))
        s["w1_rows"] = _set(s["w1_rows"], r, tuple((STALE,) * len(m) for m in s["w1_rows"][r]))


def recovered_state(cfg: Config):
    """The state after recover() on every rank (every signal zeroed on every rank, the device quiet): the buffers
    keep the data of earlier calls, which no generation of the restarted count may be mistaken for."""
    pcs, shared = _initial(cfg)
    s = dict(shared)
    _stale_data(s, range(cfg.ranks))
    return pcs, tuple(sorted(s.items()))


def _restart(cfg: Config, s: dict, r: int) -> None:
    """Rank r's workspace recreated: every signal word zero (the increments counted in its receive counters gone
    with them: the model's accounting of them too), its buffers stale."""
    fresh = dict(_initial(cfg)[1])
    for key, v in fresh.items():
        if isinstance(v, tuple) and len(v) == cfg.ranks and key != "dead":
            s[key] = _set(s[key], r, v[r])
    _stale_data(s, [r])


def _fault_moves(cfg: Config, i: int, rk: _Rank, s: dict):
    """The fault's own step on lane i (before its publish of the faulty call), if it is due."""
    f = cfg.fault
    if f is None or s["fault_done"] or i != f.rank or rk.gen != f.call or rk.dpc != 0 or f.kind == "finalize_stall":
        return
    n = dict(s, fault_done=True)
    r, nrk = f.rank, rk
    if f.kind == "dead":
        n["dead"] = _set(s["dead"], r, True)
        nrk = _finished(cfg)
    elif f.kind == "stale_gen":
        n["gen"] = _set(s["gen"], r, 0)
    elif f.kind == "corrupt_gen":
        n["gen"] = _set(s["gen"], r, s["gen"][r] + 1000)
    elif f.kind == "forged_ready":
        n["ready"] = _set(s["ready"], r, s["gen"][r] + 1)
    elif f.kind == "double_publish":  # the first of the two publishes (the lane's own publish step is the second)
        ng = s["gen"][r] + 1
        for key in ("gen", "payload_gen", "ready"):
            n[key] = _set(s[key], r, ng)
        n["inuse"] = _set(s["inuse"], r, 1)
    else:
        _restart(cfg, n, r)
    yield f"r{r}c{rk.gen}:fault-{f.kind}", nrk, n


def _stalled(cfg: Config, i: int, rk: _Rank, pcs, s: dict) -> bool:
    """Fault finalize_stall: lane i's finalize of the faulty call waits until every other rank stopped."""
    f = cfg.fault
    if f is None or f.kind != "finalize_stall" or i != f.rank or rk.gen != f.call:
        return False
    return not all(s["err"][q] or s["dead"][q] or pcs[q].gen > cfg.generations for q in range(cfg.ranks) if q != i)


def _blocked_wait(cfg: Config, r: int, rk: _Rank, s: dict):
    """The bounded wait a stuck lane of rank r is in, as its ERR words would record it on expiry: (kind, who,
    generation, value seen); dispatch's wait first (its bound is half the compute role's), then compute's, then
    finalize's. None: not in a wait."""
    p, g, cg = cfg.ranks, rk.g, rk.cg
    if 0 < rk.dpc <= p or p + 2 < rk.dpc <= p + 2 + cfg.blocks:
        q = rk.dpc - 1 if rk.dpc <= p else (rk.dpc - 3 - p) % p
        return ("READY", q, g, s["ready"][q])
    compute, finalize = _plans(cfg)
    if rk.cpc < len(compute):
        kind, j = compute[rk.cpc]
        if kind == "acquire":
            return ("INUSE", r, 1, s["inuse"][r])
        if kind == "offsets":
            return ("OFFS", r, cg, s["offs"][r])
        if kind == "block":
            return ("BLOCK", j, cg, s["full"][r][j])
        if kind == "experts":
            e = rk.w2.index(False) if False in rk.w2 else 0
            return ("W1", e, cg, s["w1_tag"][r][e])
        return ("BLOCK", -1, g, s["dispatch_done"][r])  # (a scatter waits for the ring: the model's stand-in)
    if rk.fpc < len(finalize) and finalize[rk.fpc][0] == "wait":
        return ("RECV", r, g, s["recv"][r][_slot(cfg, g)])
    return None


def _timeouts(cfg: Config, pcs, shared):
    """Nothing can move: each blocked wait of a live rank may expire first (its ERR words; the rank stops)."""
    s = dict(shared)
    for i, rk in enumerate(pcs):
        if s["err"][i] or s["dead"][i] or rk.gen > cfg.generations:
            continue
        rec = _blocked_wait(cfg, i, rk, s)
        if rec is not None:
            yield f"r{i}:timeout-{rec[0]}", pcs, tuple(sorted(dict(s, err=_set(s["err"], i, rec)).items()))


def _set(t: tuple, i: int, v) -> tuple:
    return (*t[:i], v, *t[i + 1 :])


def _set2(t: tuple, i: int, j: int, v) -> tuple:
    return _set(t, i, _set(t[i], j, v))


def _set3(t: tuple, i: int, j: int, k: int, v) -> tuple:
    return _set(t, i, _set2(t[i], j, k, v))


class Violation(Exception):
    pass


PRIVATE = -2  # the mark of a step _expand may run alone (see there)


def _dispatch_steps(cfg: Config) -> int:
    return 1 + cfg.ranks + 2 + cfg.blocks + 1  # publish, route per rank, offsets + OFFS, blocks, done


@cache
def _plans(cfg: Config) -> tuple[tuple, tuple]:
    """The steps (kind, index) of compute and of finalize. signal_first: the combined signal goes out from compute,
    before W2's scatters (not after them, from finalize)."""
    v, p = cfg.variant, cfg.ranks
    signals = tuple(("signal", q) for q in range(p))
    compute = (("acquire", 0), ("offsets", 0), *(("block", b) for b in range(cfg.blocks)), ("experts", 0))
    compute += (signals if v.signal_first else ()) + tuple(("scatter", q) for q in range(p))
    if v.inuse_freed_early:
        tail = ("reset", "free", "cgen")
    elif v.cgen_before_reset:
        tail = ("cgen", "reset", "free")
    else:
        tail = ("reset", "cgen", "free")
    finalize = (() if v.signal_first else signals) + (("wait", 0),) + tuple((t, 0) for t in tail)
    return compute, finalize


def _slot(cfg: Config, g: int) -> int:
    return 0 if cfg.variant.single_recv_counter else g % 2


def _signal(cfg: Config, n: dict, q: int, g: int) -> None:
    """The combined signal of generation g to rank q: recv[q][g % 2] += 1 (release)."""
    slot = _slot(cfg, g)
    n["recv"] = _set2(n["recv"], q, slot, n["recv"][q][slot] + 1)
    n["signals"] = _set2(n["signals"], q, g, n["signals"][q][g] + 1)


def _w1_step(n: dict, r: int, e: int, g: int, step: str) -> None:
    """One step a W1 tile runs after its add: store count = 0, or release the tag of generation g."""
    if step == "reset":
        n["w1_count"] = _set2(n["w1_count"], r, e, 0)
    else:
        n["w1_tag"] = _set2(n["w1_tag"], r, e, g)


def _expert_moves(cfg: Config, r: int, rk: _Rank, s: dict):
    """W1 tiles and W2 of rank r's experts step (concurrent), and the step that ends it. Tags carry compute's g (cg),
    rows the call's own generation (rk.g): a W2 that passes a tag of another call reads rows of another generation."""
    g, cg, v, mt = rk.g, rk.cg, cfg.variant, cfg.m_tiles
    for e in range(cfg.experts):
        for m in range(mt):
            tile = rk.w1[e][m]
            n = dict(s)
            if tile is None:  # store the rows, then the acq_rel add (one step: W2 reads the rows after a tag)
                old = s["w1_count"][r][e]
                if old >= mt:
                    raise Violation(f"rank {r} gen {g}: W1_DONE[{e}].count holds {old} before M tile {m} adds")
                n["w1_rows"] = _set3(s["w1_rows"], r, e, m, g)
                n["w1_count"] = _set2(s["w1_count"], r, e, old + 1)
                if old == mt - 1:
                    tile = ("tag", "reset") if v.w1_tag_before_reset else ("reset", "tag")
                else:
                    tile = ("tag",) if v.w1_tag_every_tile else ()
                desc = f"w1e{e}m{m}:add"
            elif tile:
                _w1_step(n, r, e, cg, tile[0])
                desc, tile = f"w1e{e}m{m}:{tile[0]}", tile[1:]
            else:
                continue
            w1 = _set2(rk.w1, e, m, tile)
            yield f"r{r}g{g}:{desc}", rk._replace(w1=w1), n
        if not rk.w2[e]:
            tag = s["w1_tag"][r][e]
            if tag >= 1 if v.w2_accept_stale_w1_tag else tag == cg:
                # acquire, then read the rows (one step: the next generation's W1 comes after this W2 on the stream)
                for m in range(mt):
                    if s["w1_rows"][r][e][m] != g:
                        raise Violation(
                            f"rank {r} gen {g}: W2 of expert {e} read W1 rows of M tile {m} holding generation "
                            f"{s['w1_rows'][r][e][m]}"
                        )
                yield f"r{r}g{g}:w2e{e}", rk._replace(w2=_set(rk.w2, e, True)), dict(s)
    # the step ends once every W2 ran and every W1 tile retired (w1_tail_overlap: added; the rest runs late)
    tiles = [t for row in rk.w1 for t in row]
    if all(rk.w2) and all(t is not None and (cfg.w1_tail_overlap or not t) for t in tiles):
        late = rk.late
        for e in range(cfg.experts):
            late += tuple((e, cg, t) for t in rk.w1[e] if t)
        for e in range(cfg.experts):
            if s["w1_count"][r][e] != 0 and not any(x[0] == e for x in late):
                raise Violation(f"rank {r} gen {g}: W1_DONE[{e}].count holds {s['w1_count'][r][e]} after the call")
        fresh = _rank(cfg, rk.gen)
        nrk = rk._replace(cpc=rk.cpc + 1, w1=fresh.w1, w2=fresh.w2, late=tuple(sorted(late)))
        yield f"r{r}g{g}:experts-done", nrk, dict(s)


def _at_experts(cfg: Config, rk: _Rank) -> bool:
    compute = _plans(cfg)[0]
    return rk.gen <= cfg.generations and rk.cpc < len(compute) and compute[rk.cpc][0] == "experts"


def _moves(cfg: Config, pcs, shared):
    """Yield (description, new_pcs, new_shared, local) for every enabled step; raise Violation on a bad read. local is
    r for the steps of rank r's W1 tiles, W2 and late W1 tiles while its compute is at the experts step (see _expand),
    else -1."""
    s = dict(shared)
    p, nb, nl = cfg.ranks, cfg.blocks, cfg.lanes
    v = cfg.variant
    for i, rk in enumerate(pcs):
        r, lane = divmod(i, nl)
        ticket = cfg.ticket + lane
        g, dpc, cpc, fpc = rk.g, rk.dpc, rk.cpc, rk.fpc
        who = f"r{r}g{g}" if nl == 1 else f"r{r}l{lane}c{rk.gen}g{g}"
        local = i if _at_experts(cfg, rk) else -1
        # ---- W1 tiles of earlier generations still running (w1_tail_overlap)
        for j, (e, lg, steps) in enumerate(rk.late):
            n = dict(s)
            _w1_step(n, r, e, lg, steps[0])
            late = rk.late[:j] + rk.late[j + 1 :] if len(steps) == 1 else _set(rk.late, j, (e, lg, steps[1:]))
            nrk = rk._replace(late=tuple(sorted(late)))
            yield f"r{r}g{lg}:w1e{e}:late-{steps[0]}", _set(pcs, i, nrk), tuple(sorted(n.items())), local
        if rk.gen > cfg.generations:
            continue
        if cfg.fault is not None:
            if s["err"][r] or s["dead"][r]:  # every wait of the rank ended: it stops (its output rows are NaN)
                continue
            faulty = list(_fault_moves(cfg, i, rk, s))
            for desc, nrk, n in faulty:
                yield desc, _set(pcs, i, nrk), tuple(sorted(n.items())), -1
            if faulty and cfg.fault.kind != "forged_ready":
                continue  # (the fault comes first; a forged tag may land before or after the publish)
        # ---- dispatch (publish and dispatch on the lane's comm stream)
        if dpc < _dispatch_steps(cfg):
            n = dict(s)
            nrk = rk._replace(dpc=dpc + 1)
            ok = True
            if dpc == 0:  # take the workspace (CAS 0 -> ticket), publish; the last CTA: g = ++GEN, READY = g
                held = s["inuse"][r]
                if s["err"][r] or held not in (0, ticket):
                    # BUSY: ERR recorded, the call does nothing (its compute waits end on ERR, finalize writes NaN)
                    n["err"] = _set(s["err"], r, s["err"][r] or ("BUSY", 0, ticket, held))
                    nrk = _finished(cfg)._replace(late=rk.late)
                else:
                    ng = s["gen"][r] + 1
                    if nl == 1 and ng != rk.g and cfg.fault is None:
                        raise Violation(f"rank {r} call {rk.gen}: publish took generation {ng}")
                    n["inuse"] = _set(s["inuse"], r, ticket)
                    n["gen"] = _set(s["gen"], r, ng)
                    n["payload_gen"] = _set(s["payload_gen"], r, ng)
                    n["ready"] = _set(s["ready"], r, ng)
                    nrk = nrk._replace(g=ng)
            elif dpc <= p:
                q = dpc - 1
                ok = v.skip_ready_wait or s["ready"][q] == g
                if ok and not (v.skip_ready_wait or v.ready_ignores_gen) and s["gen"][q] != g:
                    if cfg.fault is None:
                        raise Violation(f"rank {r} gen {g}: rank {q}'s READY = {g} beside GEN = {s['gen'][q]}")
                    n["err"] = _set(s["err"], r, ("READY", q, g, s["gen"][q]))  # a forged / corrupted tag
                elif ok and s["payload_gen"][q] != g:
                    raise Violation(f"rank {r} gen {g}: read rank {q}'s routing of generation {s['payload_gen'][q]}")
            elif dpc <= p + 2:  # CTA 0 writes the ring offsets and counts, then releases OFFS = g
                first = (dpc == p + 1) != v.offs_before_offsets
                word = "ring_offs" if first else "offs"
                n[word] = _set(s[word], r, g)
            elif dpc <= p + 2 + nb:
                b = dpc - 3 - p
                src = b % p
                ok = v.skip_ready_wait or s["ready"][src] == g
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
                yield f"{who}:dispatch{dpc}", _set(pcs, i, nrk), tuple(sorted(n.items())), -1
        # ---- compute (W1, W2 on the lane's compute stream, concurrent with publish and dispatch)
        compute, finalize = _plans(cfg)
        if cpc < len(compute):
            kind, j = compute[cpc]
            if kind == "experts":
                for desc, nrk, n in _expert_moves(cfg, r, rk, s):
                    yield desc.replace(f"r{r}g{g}", who), _set(pcs, i, nrk), tuple(sorted(n.items())), local
                continue
            n = dict(s)
            nrk = rk._replace(cpc=cpc + 1)
            cg = rk.cg
            mark = PRIVATE if kind in ("acquire", "offsets", "block") else -1
            ok = True
            if kind == "acquire":  # wait INUSE == ticket, then g = CGEN + 1
                ok = v.compute_skips_inuse_wait or s["inuse"][r] == ticket
                nrk = nrk._replace(cg=s["cgen"][r] + 1)
            elif kind == "offsets":  # wait OFFS == g, then read the ring offsets and counts
                ok = v.compute_skips_offs_wait or s["offs"][r] == cg
                if ok and s["ring_offs"][r] != g:
                    raise Violation(
                        f"rank {r} call {rk.gen} (generation {g}): compute read ring offsets of generation "
                        f"{s['ring_offs'][r]} (its g = {cg})"
                    )
            elif kind == "block":
                tag = s["full"][r][j]
                ok = tag >= 1 if v.accept_stale_tags else tag == cg
                if ok:
                    if s["ring_gen"][r][j] != g:
                        raise Violation(
                            f"rank {r} gen {g}: consumed ring block {j} holding generation {s['ring_gen'][r][j]}"
                        )
                    n["consumed"] = _set2(s["consumed"], r, j, s["consumed"][r][j] + 1)
            elif kind == "signal":
                _signal(cfg, n, j, g)
            else:  # W2 scatters its rows into rank j's combine buffer
                ok = s["dispatch_done"][r] == g
                if ok:
                    n["combine_gen"] = _set2(s["combine_gen"], j, r, g)
            if ok:
                yield f"{who}:compute{cpc}", _set(pcs, i, nrk), tuple(sorted(n.items())), mark
        # ---- finalize (after compute on the same stream)
        elif fpc < len(finalize) and not _stalled(cfg, i, rk, pcs, s):
            kind, j = finalize[fpc]
            n = dict(s)
            nrk = rk._replace(fpc=fpc + 1)
            slot = _slot(cfg, g)
            ok = True
            mark = PRIVATE if kind in ("cgen", "free") else -1
            if fpc == 0 and (s["inuse"][r] != ticket or s["err"][r]):
                # not this call's workspace, or ERR set: NaN rows, no signal, INUSE stays held (recover() needed)
                nrk = _finished(cfg)._replace(late=rk.late)
                mark = -1
            elif fpc == 0 and s["gen"][r] != g:
                raise Violation(f"rank {r} call {rk.gen}: finalize read GEN = {s['gen'][r]}, its call is {g}")
            elif kind == "signal":  # the combined signal: my W2 rows for rank j landed (W2 finished: stream order)
                _signal(cfg, n, j, g)
            elif kind == "wait":
                # (the kernel waits for == P; more is reported as a violation, or with a fault: the wait expires)
                ok = s["recv"][r][slot] == p if cfg.fault is not None else s["recv"][r][slot] >= p
                if ok:
                    if s["recv"][r][slot] > p:
                        raise Violation(
                            f"rank {r} gen {g}: counter holds {s['recv'][r][slot]} > {p} signals (mixed generations)"
                        )
                    for q in range(p):
                        if s["combine_gen"][r][q] != g:
                            raise Violation(
                                f"rank {r} gen {g}: combine rows from rank {q} are of generation "
                                f"{s['combine_gen'][r][q]}"
                            )
                    n["seen"] = _set2(s["seen"], r, g, p)
                    for b in range(nb):
                        if s["consumed"][r][b] != 1:
                            raise Violation(f"rank {r} gen {g}: ring block {b} consumed {s['consumed'][r][b]} times")
                    n["consumed"] = _set(s["consumed"], r, (0,) * nb)
            elif kind == "reset":  # the receive counter of this parity, for generation g + 2
                n["recv"] = _set2(s["recv"], r, slot, 0)
            elif kind == "cgen":
                n["cgen"] = _set(s["cgen"], r, g)
            else:
                n["inuse"] = _set(s["inuse"], r, 0)
            if ok and fpc + 1 == len(finalize):  # the call ends; the lane's next call starts from the top
                nrk = _rank(cfg, rk.gen + 1)._replace(late=rk.late)
            if ok:
                yield f"{who}:finalize{fpc}", _set(pcs, i, nrk), tuple(sorted(n.items())), mark


def _done(cfg: Config, pcs, shared) -> bool:
    """Every lane finished, or stopped on a rank whose ERR is set (every wait there ends on ERR: a loud failure)
    or that died (Fault "dead")."""
    s = dict(shared)
    err, dead = s["err"], s["dead"]
    return all(
        err[i // cfg.lanes] or dead[i // cfg.lanes] or (rk.gen > cfg.generations and not rk.late)
        for i, rk in enumerate(pcs)
    )


def _check_final(cfg: Config, shared) -> None:
    s = dict(shared)
    for r in range(cfg.ranks):
        if s["err"][r] or s["dead"][r]:
            continue
        for g in range(1, cfg.generations + 1):
            if s["signals"][r][g] != s["seen"][r][g]:
                raise Violation(f"rank {r} gen {g}: {s['signals'][r][g]} signals sent, {s['seen'][r][g]} accounted")
        for e in range(cfg.experts):
            if s["w1_count"][r][e] != 0:
                raise Violation(f"rank {r}: W1_DONE[{e}].count holds {s['w1_count'][r][e]} after the last call")


def _expand(
    cfg: Config, pcs, shared, trace, deadlocks: list[str], violations: list[str], reduce: bool, errors: set
) -> list:
    """The enabled moves (description, pcs, shared) from a state; [] for a terminal state, whose deadlock or violation
    is recorded.

    reduce (a partial-order reduction): while rank r's compute is at the experts step, its W1 tiles, W2 and late W1
    steps read and write only rank r's W1_DONE words and W1 rows, which no other step touches, and no other step
    enables, disables or changes them. Every other step commutes with them and stays enabled, with the same reads
    (every enabled step's reads are checked here, in every state), so exploring only those steps of one such rank,
    in every order among themselves, reaches the same violations, deadlocks and final states. The state graph has
    no cycles (every step advances a counter).
    Stronger, for PRIVATE steps (compute's acquire, offsets and block steps; finalize's CGEN and INUSE stores): on
    one lane they write nothing another lane or rank reads (compute: its own counters and consumed; CGEN, INUSE:
    read by the rank's next call only), and the words they read change during the call only towards this call's
    values (its own publish, dispatch), so once enabled they stay enabled and a read that is good stays good (a bad
    one is reported in the state where the step is enabled). One such step is explored alone. Both reductions are
    off for lanes > 1 (the lanes share these words), and with a fault (it writes a rank's words from outside).
    With a fault, a state where nothing moves lets a blocked wait expire (_timeouts); every terminal state's ERR
    records go to `errors` as (rank, kind, who, generation, value seen)."""
    tail = " ".join(trace[-12:])
    try:
        moves = list(_moves(cfg, pcs, shared))
    except Violation as e:
        violations.append(f"{e} after {tail}")
        return []
    if reduce and cfg.lanes == 1 and cfg.fault is None:
        private = [m for m in moves if m[3] == PRIVATE]
        local = [m for m in moves if m[3] >= 0]
        if private:
            moves = private[:1]
        elif local:
            moves = [m for m in local if m[3] == local[0][3]]
    moves = [m[:3] for m in moves]
    if not moves and cfg.fault is not None and not _done(cfg, pcs, shared):
        moves = list(_timeouts(cfg, pcs, shared))
    if not moves:
        errors.update((r, *e) for r, e in enumerate(dict(shared)["err"]) if e)
        if not _done(cfg, pcs, shared):
            deadlocks.append(f"stuck at {[tuple(rk[:6]) for rk in pcs]} after {tail}")
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
    errors: set = field(default_factory=set)  # ERR records of terminal states: (rank, kind, who, gen, seen)

    @property
    def ok(self) -> bool:
        return not self.deadlocks and not self.violations


def _search(name: str, start, expand, max_states: int, keep: int) -> Report:
    """Every state reachable from `start` (memoised DFS). expand(state, trace, deadlocks, violations, errors) ->
    [(desc, next state)]; a trace keeps its last `keep` steps."""
    seen = {start}
    stack = [(start, ())]
    deadlocks: list[str] = []
    violations: list[str] = []
    errors: set = set()
    while stack and len(seen) <= max_states:
        state, trace = stack.pop()
        for desc, nstate in expand(state, trace, deadlocks, violations, errors):
            if nstate not in seen:
                seen.add(nstate)
                stack.append((nstate, (*trace[-keep:], desc)))
    if stack:
        raise RuntimeError(f"{name}: state space exceeds {max_states} states; shrink the configuration")
    return Report(len(seen), deadlocks[:5], violations[:5], errors)


def _walks(start, expand, walks: int, seed: int) -> Report:
    """`walks` random interleavings from `start` (expand as _search's); states: the steps taken."""
    rng = random.Random(seed)
    deadlocks: list[str] = []
    violations: list[str] = []
    errors: set = set()
    steps = 0
    for _ in range(walks):
        state, trace = start, []
        while moves := expand(state, trace, deadlocks, violations, errors):
            desc, state = rng.choice(moves)
            trace.append(desc)
            steps += 1
    return Report(steps, deadlocks[:5], violations[:5], errors)


def _one_lane(cfg: Config, reduce: bool):
    """_expand on (pcs, shared) states, as _search / _walks call it."""

    def expand(state, trace, deadlocks, violations, errors):
        moves = _expand(cfg, *state, trace, deadlocks, violations, reduce, errors)
        return [(desc, (pcs, shared)) for desc, pcs, shared in moves]

    return expand


def explore(cfg: Config, max_states: int = 5_000_000, reduce: bool = True, start=None) -> Report:
    """Every interleaving (memoised on the global state; reduce: see _expand) from `start` (default: the first
    call; recovered_state(cfg): the calls after a recover())."""
    return _search("explore", start or _initial(cfg), _one_lane(cfg, reduce), max_states, 11)


def random_walks(cfg: Config, walks: int, seed: int = 0) -> Report:
    """Random interleavings for configurations too large to enumerate."""
    return _walks(_initial(cfg), _one_lane(cfg, False), walks, seed)


# ---------------------------------------------------------------------------------------------- two lanes per rank
KERNELS = ("publish", "dispatch", "w1", "w2", "finalize")
PUB, DSP, W1, W2, FIN = range(5)


@dataclass(frozen=True)
class Grids:
    """CTAs of each kernel of a call (in slots: see TwoLaneConfig.slots)."""

    publish: int = 1
    dispatch: int = 1
    w1: int = 1
    w2: int = 1
    finalize: int = 1

    def of(self, k: int) -> int:
        return (self.publish, self.dispatch, self.w1, self.w2, self.finalize)[k]


@dataclass(frozen=True)
class TwoLaneConfig:
    """P ranks, two lanes (micro-batches) each with its own workspace, `calls` calls per lane; see _TWO_LANES_DOC."""

    ranks: int = 2
    blocks: int = 1
    calls: int = 1  # calls per lane
    experts: int = 1
    m_tiles: int = 1
    slots: int = 64  # resident CTA slots per rank (SMs x CTAs per SM, in the unit of the grids)
    grids: Grids = field(default_factory=Grids)
    # None: a stream per lane (two streams per rank). Else, per rank, its one stream's calls as the lane of each
    # call in order (each lane's calls in its own order), e.g. ((0, 1, 0, 1), (1, 0, 1, 0)).
    orders: tuple | None = None
    # > 0: green-context partition: publish and dispatch of both lanes on comm_slots slots, W1, W2 and finalize on the
    # other slots - comm_slots (the lanes' partitions cover the same SMs); W1 launches with the call, beside publish
    comm_slots: int = 0
    variant: Variant = field(default_factory=Variant)
    # Seeded bugs: both lanes on one workspace (every word shared, tickets 1 and 2); lane 1's READY and L1_FULL
    # words are lane 0's (a call waiting on, and releasing, the other lane's generation tags)
    shared_workspace: bool = False
    cross_tags: bool = False

    def __post_init__(self):
        if self.orders is not None and (
            len(self.orders) != self.ranks or any(sorted(o) != [0] * self.calls + [1] * self.calls for o in self.orders)
        ):
            raise ValueError(f"TwoLaneConfig: orders {self.orders} must list each lane {self.calls} times per rank")
        if not 0 <= self.comm_slots < self.slots:
            raise ValueError("TwoLaneConfig: comm_slots must be in [0, slots)")

    def lane(self, lane: int) -> Config:
        return Config(
            self.ranks, self.blocks, self.calls, self.experts, self.m_tiles, variant=self.variant, ticket=1 + lane
        )

    def aliased(self) -> tuple:
        if self.shared_workspace:
            return tuple(k for k in dict(_initial(self.lane(0))[1]) if k not in ("signals", "seen"))
        return ("ready", "full") if self.cross_tags else ()

    def streams(self, r: int) -> tuple:
        """Rank r's streams, each its (lane, call) items in order."""
        if self.orders is None:
            return tuple(tuple((lane, c) for c in range(1, self.calls + 1)) for lane in (0, 1))
        seen = [0, 0]
        items = []
        for lane in self.orders[r]:
            seen[lane] += 1
            items.append((lane, seen[lane]))
        return (tuple(items),)

    def pool(self, k: int) -> int:
        """The slot pool of kernel k: 0 (the whole device, or the compute partition), 1 (the comm partition)."""
        return int(self.comm_slots > 0 and k in (PUB, DSP))

    def capacity(self, pool: int) -> int:
        return self.comm_slots if pool else self.slots - self.comm_slots


def _kernel_of(cfg: Config, old: _Rank, new: _Rank) -> tuple[int, bool]:
    """The kernel a sub-model step of one rank belongs to, and whether its last CTA runs it (every CTA placed)."""
    p = cfg.ranks
    if new.gen != old.gen:  # refused (BUSY): the publish's INUSE CAS; or finalize's last step (INUSE = 0)
        return (PUB, True) if old.dpc == 0 else (FIN, True)
    if new.dpc != old.dpc:
        if old.dpc == 0:
            return PUB, True  # READY: the last CTA
        return DSP, old.dpc in (p + 1, p + 2)  # the ring offsets and OFFS: the last CTA past the ranking
    if new.cpc != old.cpc or new.w1 != old.w1 or new.w2 != old.w2:
        kind = _plans(cfg)[0][old.cpc][0]
        if kind in ("acquire", "offsets", "block") or (new.cpc == old.cpc and new.w1 != old.w1):
            return W1, False
        return W2, False
    kind = _plans(cfg)[1][old.fpc][0]
    return FIN, kind in ("reset", "cgen", "free") or new.gen != old.gen


def _progress(cfg: Config, rk: _Rank, call: int, stopped: bool) -> tuple[tuple, tuple, bool]:
    """Per kernel of lane call `call` on a rank whose pcs are rk: (past its waits, its steps all done), and whether
    W1 lets its dependents launch (every CTA read its row layout: past INUSE and OFFS). A stopped rank (ERR): every
    wait ended."""
    p, nb = cfg.ranks, cfg.blocks
    if stopped or rk.gen > call:
        return (True,) * 5, (True,) * 5, True
    x = 2 + nb  # the experts step of compute's plan
    tiles = all(t == () for row in rk.w1 for t in row)
    w1_done = rk.cpc > x or (rk.cpc == x and tiles)
    w2_waited = rk.cpc > x or (rk.cpc == x and all(rk.w2))
    waits = (True, rk.dpc > p, rk.cpc >= x, w2_waited, rk.fpc > cfg.ranks)
    done = (rk.dpc >= 1, rk.dpc == _dispatch_steps(cfg), w1_done, rk.cpc == len(_plans(cfg)[0]), False)
    return waits, done, rk.cpc >= 2


class _Call(NamedTuple):
    """The call in flight on one stream of a rank and its kernels' CTAs: placed and retired per kernel."""

    lane: int
    call: int
    placed: tuple
    retired: tuple


def _two_initial(cfg: TwoLaneConfig):
    lanes = tuple(_initial(cfg.lane(lane)) for lane in (0, 1))
    pos = tuple((0,) * len(cfg.streams(r)) for r in range(cfg.ranks))
    return lanes, pos, tuple(tuple(() for _ in cfg.streams(r)) for r in range(cfg.ranks))


def _in_flight(cfg: TwoLaneConfig, r: int, k: int, pos: int, ctas: tuple) -> _Call | None:
    items = cfg.streams(r)[k]
    if pos >= len(items):
        return None
    lane, call = items[pos]
    return _Call(lane, call, *(ctas or ((0,) * 5, (0,) * 5)))


def _launchable(cfg: TwoLaneConfig, c: _Call, waits: tuple, w1_launched: bool) -> tuple:
    """Per kernel: may its CTAs become resident? Stream order with programmatic dependent launches: dispatch once
    every publish CTA started (publish triggers at its start), W1 once every dispatch CTA ranked the routing (past
    its READY waits; partitioned: W1 is on the compute stream, launched with the call), W2 once every W1 CTA read its
    row layout, finalize once every W2 CTA passed its W1_DONE wait."""
    g, pl = cfg.grids, c.placed
    full = [pl[k] == g.of(k) for k in range(5)]
    w1 = cfg.comm_slots > 0 or (full[DSP] and waits[DSP])
    return (True, full[PUB], w1, full[W1] and w1_launched, full[W2] and waits[W2])


def _two_moves(cfg: TwoLaneConfig, state):
    """(description, state, private) of every enabled step: sub-model steps of an in-flight call whose kernel has a
    resident CTA (and its own rules), and CTA placements; raises Violation."""
    lanes, pos, ctas = state
    alias = cfg.aliased()
    used = [[0, 0] for _ in range(cfg.ranks)]  # resident CTAs per rank and pool
    flights = []  # (r, k, call, stopped, waits, done, w1_launched)
    for r in range(cfg.ranks):
        for k in range(len(pos[r])):
            c = _in_flight(cfg, r, k, pos[r][k], ctas[r][k])
            if c is None:
                continue
            sub = cfg.lane(c.lane)
            pcs, shared = lanes[c.lane]
            stopped = bool(dict(shared)["err"][r])
            flights.append((r, k, c, stopped, *_progress(sub, pcs[r], c.call, stopped)))
            for kern in range(5):
                used[r][cfg.pool(kern)] += c.placed[kern] - c.retired[kern]
    for r, k, c, _stopped, waits, _done, w1_launched in flights:
        for kern, ok in enumerate(_launchable(cfg, c, waits, w1_launched)):
            if ok and c.placed[kern] < cfg.grids.of(kern) and used[r][cfg.pool(kern)] < cfg.capacity(cfg.pool(kern)):
                nc = c._replace(placed=_set(c.placed, kern, c.placed[kern] + 1))
                yield f"r{r}l{c.lane}c{c.call}:{KERNELS[kern]}+cta", _with_call(cfg, state, r, k, nc), False
    for lane in (0, 1):
        sub = cfg.lane(lane)
        pcs, shared = lanes[lane]
        for desc, npcs, nshared, mark in _moves(sub, pcs, shared):
            r = next(i for i in range(cfg.ranks) if npcs[i] != pcs[i])
            f = next((f for f in flights if f[0] == r and f[2].lane == lane and f[2].call == pcs[r].gen), None)
            if f is None:
                continue  # the call is not issued yet (its stream's earlier call still runs)
            kern, last = _kernel_of(sub, pcs[r], npcs[r])
            c = f[2]
            resident = c.placed[kern] - c.retired[kern]
            before = {DSP: PUB, FIN: W2}.get(kern)  # griddepcontrol.wait: that kernel finished first
            if resident < 1 or (last and c.placed[kern] < cfg.grids.of(kern)):
                continue
            if before is not None and c.retired[before] < cfg.grids.of(before):
                continue
            nlanes = _set(lanes, lane, (npcs, nshared))
            if alias:
                nd = dict(nshared)
                other = dict(lanes[1 - lane][1])
                other.update((key, nd[key]) for key in alias)
                nlanes = _set(nlanes, 1 - lane, (lanes[1 - lane][0], tuple(sorted(other.items()))))
            nstate = _settle(cfg, (nlanes, pos, ctas))
            yield f"l{lane}:{desc}", nstate, mark == PRIVATE


def _with_call(cfg: TwoLaneConfig, state, r: int, k: int, c: _Call):
    lanes, pos, ctas = state
    return _settle(cfg, (lanes, pos, _set2(ctas, r, k, (c.placed, c.retired))))


def _settle(cfg: TwoLaneConfig, state):
    """Retire every CTA that may retire (past its kernel's waits; a kernel's last CTA once its steps are done), and
    move each stream whose call's kernels all retired (or whose rank stopped on ERR) to its next call. Retiring only
    frees slots and nothing waits for it, so doing it at once loses no interleaving."""
    lanes, pos, ctas = state
    g = cfg.grids
    for r in range(cfg.ranks):
        for k in range(len(pos[r])):
            while (c := _in_flight(cfg, r, k, pos[r][k], ctas[r][k])) is not None:
                pcs, shared = lanes[c.lane]
                stopped = bool(dict(shared)["err"][r])
                waits, done, _ = _progress(cfg.lane(c.lane), pcs[r], c.call, stopped)
                retired = list(c.retired)
                for kern in range(5):
                    resident = c.placed[kern] - retired[kern]
                    if waits[kern] and resident:
                        keep = 0 if done[kern] or c.placed[kern] < g.of(kern) else 1
                        retired[kern] += max(0, resident - keep)
                if stopped or all(retired[kern] == g.of(kern) for kern in range(5)):
                    pos = _set(pos, r, _set(pos[r], k, pos[r][k] + 1))
                    ctas = _set2(ctas, r, k, ())
                    continue
                ctas = _set2(ctas, r, k, (c.placed, tuple(retired)))
                break
    return lanes, pos, ctas


def _two_done(cfg: TwoLaneConfig, state) -> bool:
    _, pos, _ = state
    return all(p == len(items) for r in range(cfg.ranks) for p, items in zip(pos[r], cfg.streams(r), strict=True))


def explore_two_lanes(cfg: TwoLaneConfig, max_states: int = 5_000_000, reduce: bool = True) -> Report:
    """Every interleaving of both lanes' calls on every rank, CTA placements included (memoised DFS). reduce: a PRIVATE
    step (see _expand) of an in-flight call runs alone (its kernel's CTAs stay resident while it is enabled)."""
    return _search("explore_two_lanes", _two_initial(cfg), _two_lanes(cfg, reduce), max_states, 23)


def _two_lanes(cfg: TwoLaneConfig, reduce: bool):
    """_two_expand as _search / _walks call it."""
    return lambda state, trace, d, v, e: _two_expand(cfg, state, trace, d, v, e, reduce)


def _two_expand(cfg: TwoLaneConfig, state, trace, deadlocks, violations, errors, reduce: bool) -> list:
    tail = " ".join(trace[-24:])
    try:
        moves = list(_two_moves(cfg, state))
    except Violation as e:
        violations.append(f"{e} after {tail}")
        return []
    private = [m for m in moves if m[2]]
    if reduce and private:
        moves = private[:1]
    if not moves:
        for lane, (_, shared) in enumerate(state[0]):
            errors.update((r, lane, *e) for r, e in enumerate(dict(shared)["err"]) if e)
        if not _two_done(cfg, state):
            deadlocks.append(f"stuck at {_two_summary(cfg, state)} after {tail}")
        else:
            for lane in (0, 1):
                try:
                    _check_final(cfg.lane(lane), state[0][lane][1])
                except Violation as e:
                    violations.append(f"lane {lane}: {e}")
    return [m[:2] for m in moves]


def _two_summary(cfg: TwoLaneConfig, state) -> str:
    """Each rank's calls in flight: lane, call, and the kernels' resident CTAs."""
    _, pos, ctas = state
    out = []
    for r in range(cfg.ranks):
        for k in range(len(pos[r])):
            c = _in_flight(cfg, r, k, pos[r][k], ctas[r][k])
            if c is not None:
                res = {KERNELS[i]: c.placed[i] - c.retired[i] for i in range(5) if c.placed[i] - c.retired[i]}
                out.append(f"r{r} lane {c.lane} call {c.call} resident {res}")
    return "; ".join(out)


def random_walks_two_lanes(cfg: TwoLaneConfig, walks: int, seed: int = 0) -> Report:
    """Random interleavings of configurations too large to enumerate."""
    return _walks(_two_initial(cfg), _two_lanes(cfg, False), walks, seed)
