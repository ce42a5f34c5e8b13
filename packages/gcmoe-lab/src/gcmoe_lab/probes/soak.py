"""Soak: the public sm90 layer replayed as CUDA graphs 100,000 times, every replay checked bit-exact on the device,
with no host synchronisation per replay (issue #16 item 1).

    gcmoe-lab probe soak [--replays 100000] [--sync-every 1000] [--pool 8] [--hang-timeout 60] [--out DIR]
                              [--units 'A-*' ...] [--list]

What replays (UNITS): three layers of different shapes and weights, each graph one caller's capture of the layer on
fixed token counts, on two outer streams:

    A   H 1024, I 512, 16 experts, top-4 + 1 shared, P = 1, the tuned partition policy   T = 1, 7, 32   stream 0
    B   H 2048, I 1024, 32 experts, top-8 + 1 shared, P = 1, comm_sms = 16              T = 3, 16      stream 1
    C   H 1024, I 512, 64 experts, top-4 + 1 shared, P = 4 virtual ranks on this GPU     T per rank     stream 1
        (gcmoe.backends.sm90.virtual_ranks, comm_sms = 16: rank q's plan holds experts 16q .. 16q + 15, every rank
        forked onto its own stream inside the one capture; the ranks' kernels wait for each other as across GPUs)

A layer's units share its capture stream, hence one lane (workspace) per layer: replays of one layer stay on one
outer stream (two replays of one lane at once are refused by design, see gcmoe/backends/sm90.py).

Before the soak, per unit:
    pool    --pool input sets (x, ids, weights for every rank), the routings of SOAK_ROUTINGS in turn, fresh draws,
            copied to the device once
    want    each set's output from the same layer called eagerly (P = 1: layer(x, ids, w); P = 4: every rank's plan
            on its stream), then checked once against gcmoe_core.reference.moe_reference (calc_diff <= 1e-3)
    graph   gcmoe_core.testing.capture_graph of the layer on the unit's static inputs (inside a caller's capture the
            layer enqueues its kernels with arguments by value)
Per replay (unit u, set j = u's replay count mod pool: consecutive replays of a unit never see the same set; units in
a seeded random order each round, so the two streams interleave irregularly), on u's outer stream:
    static inputs <- pool[j] (device copies); outputs <- NaN; graph.replay();
    flags[i mod N, r] = any(bits(out_r) != bits(want[j]_r))          (torch.any(..., out=): no host sync)
Every N = --sync-every replays an event per outer stream is polled for at most --hang-timeout s; then the window's
flags come to the host, each mismatching replay is charged to its unit (count, first index) and the flags are
zeroed. A hang (the bound expired) writes the report with hangs = 1 and leaves with exit code 3 at once (os._exit: a
stuck kernel would block the interpreter's teardown). A watchdog thread backs this up for a host blocked inside a
launch (a launch queue full behind a hung kernel): no progress for the bound + WATCHDOG_SLACK_S -> the same report
and exit; while the layers load and the units arm (kernel compiles), the bound is --setup-timeout between steps.
Budget: sized for about three minutes of device time with the default 100,000 replays (~70 % at P = 1, ~30 % at
P = 4), compiles on a cold cache included; the replays are host-bound (~20-30 launches each, ~50-150 µs of host time).
Not measured yet: run it once and record setup_s and replays_per_s from soak.json.

Output under --out: soak.json (meta, per-unit replays / mismatches / first mismatch, reference checks, layer errors,
totals) and soak.md (the summary). Exit 0 only when every replay was exact, no reference check failed, no layer
recorded an error and nothing hung.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import json
import os
import random
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from gcmoe_core.config import MoEConfig
from gcmoe_core.testing import make_routing

SOAK_ROUTINGS = ("uniform", "skewed", "one_expert", "duplicate")  # every unit
MULTI_RANK_ROUTINGS = ("empty_ranks",)  # P > 1 units also
SKEW = 1.5  # expert i (of a per-set random order) drawn with weight (i + 1) ** -SKEW
REF_TOL = 1e-3  # calc_diff against moe_reference: the quantisation-emulation bound of the sm90 tests
WATCHDOG_SLACK_S = 30.0
EXIT_MISMATCH, EXIT_HANG = 1, 3


@dataclass(frozen=True)
class LayerSpec:
    hidden: int
    inter: int
    experts: int
    top_k: int
    shared: int
    ranks: int
    max_tokens: int
    comm_sms: int | None
    seed: int

    def config(self) -> MoEConfig:
        """The layer's config (ep_size = ranks: the global view the virtual ranks split)."""
        return MoEConfig(
            self.hidden,
            self.inter,
            self.experts,
            self.top_k,
            self.shared,
            ep_size=self.ranks,
            max_tokens_per_rank=self.max_tokens,
        )


@dataclass(frozen=True)
class Unit:
    """One captured graph: a layer at fixed token counts (one per rank), replayed on outer stream `stream`."""

    name: str
    layer: str
    tokens: tuple[int, ...]
    stream: int


LAYERS = {
    "A": LayerSpec(1024, 512, 16, 4, 1, 1, 32, None, seed=1),
    "B": LayerSpec(2048, 1024, 32, 8, 1, 1, 16, 16, seed=2),
    "C": LayerSpec(1024, 512, 64, 4, 1, 4, 8, 16, seed=3),
}
UNITS = (
    Unit("A-T1", "A", (1,), 0),
    Unit("A-T7", "A", (7,), 0),
    Unit("A-T32", "A", (32,), 0),
    Unit("B-T3", "B", (3,), 1),
    Unit("B-T16", "B", (16,), 1),
    Unit("C-P4-T5.1.8.3", "C", (5, 1, 8, 3), 1),
    Unit("C-P4-T2.8.4.7", "C", (2, 8, 4, 7), 1),
)


def check_units(units: Sequence[Unit], layers: dict[str, LayerSpec]) -> None:
    """ValueError for a unit whose layer, rank count, token counts or streams do not fit (host-side, before the GPU)."""
    stream_of: dict[str, int] = {}
    for u in units:
        spec = layers.get(u.layer)
        if spec is None:
            raise ValueError(f"soak: unit {u.name}: unknown layer {u.layer!r}")
        spec.config()  # the layer's own limits
        if len(u.tokens) != spec.ranks:
            raise ValueError(f"soak: unit {u.name}: {len(u.tokens)} token counts for P = {spec.ranks}")
        if not all(1 <= t <= spec.max_tokens for t in u.tokens):
            raise ValueError(f"soak: unit {u.name}: token counts {u.tokens} outside [1, {spec.max_tokens}]")
        if stream_of.setdefault(u.layer, u.stream) != u.stream:
            raise ValueError(f"soak: layer {u.layer}'s units must share one outer stream (one lane per layer)")


def routings_for(spec: LayerSpec) -> tuple[str, ...]:
    return SOAK_ROUTINGS + (MULTI_RANK_ROUTINGS if spec.ranks > 1 else ())


# --------------------------------------------------------------------------------------------- inputs (CPU side)
def soak_routing(t: int, k: int, e: int, routing: str, g: torch.Generator, ranks: int = 1):
    """(ids int32 [t, k], weights fp32 [t, k]) for a soak routing:

    uniform, one_expert   gcmoe_core.testing.make_routing (distinct ids; one_expert: every token's slot 0 on expert 0)
    skewed                distinct ids drawn by popularity (i + 1) ** -SKEW over a random expert order: a few hot
                          experts hold most rows, many hold none
    duplicate             uniform, then slot 1 repeats slot 0's expert in every other token: one token twice in one
                          expert (two rows, two weights)
    empty_ranks           ids only among the experts of the even ranks: the odd ranks receive no row (P > 1)
    """
    if routing in ("uniform", "one_expert"):
        return make_routing(t, k, e, routing, g)
    if routing == "skewed":
        order = torch.randperm(e, generator=g)
        popularity = (torch.arange(e, dtype=torch.float64) + 1.0) ** -SKEW
        ids = order[torch.multinomial(popularity.repeat(t, 1), k, replacement=False, generator=g)]
    elif routing == "duplicate":
        if k < 2:
            raise ValueError("soak: routing 'duplicate' needs top_k >= 2")
        ids, _ = make_routing(t, k, e, "uniform", g)
        ids[::2, 1] = ids[::2, 0]
    elif routing == "empty_ranks":
        if ranks < 2 or e % ranks:
            raise ValueError(f"soak: routing 'empty_ranks' needs P >= 2 ranks dividing E = {e}, got P = {ranks}")
        local = e // ranks
        pool = torch.cat([torch.arange(r * local, (r + 1) * local) for r in range(0, ranks, 2)])
        if k > pool.numel():
            raise ValueError(f"soak: routing 'empty_ranks': top_k = {k} > {pool.numel()} experts on the even ranks")
        ids = pool[torch.topk(torch.rand(t, pool.numel(), generator=g), k, dim=1).indices]
    else:
        known = SOAK_ROUTINGS + MULTI_RANK_ROUTINGS
        raise ValueError(f"soak: unknown routing {routing!r}; known: {known}")
    w = torch.softmax(torch.randn(t, k, generator=g), dim=1).float()
    return ids.to(torch.int32), w


def make_pool(spec: LayerSpec, tokens: Sequence[int], size: int, seed: int) -> list[list[tuple]]:
    """`size` input sets on the CPU, set j of routing routings_for(spec)[j mod n]: [set][rank] = (x bf16 [T_r, H],
    ids int32 [T_r, k], weights fp32 [T_r, k]), deterministic in seed."""
    if size < 2:
        raise ValueError(f"soak: the pool needs >= 2 input sets (consecutive replays must differ), got {size}")
    routings = routings_for(spec)
    g = torch.Generator().manual_seed(seed)
    pool = []
    for j in range(size):
        routing = routings[j % len(routings)]
        sets = []
        for t in tokens:
            x = torch.randn(t, spec.hidden, generator=g).to(torch.bfloat16)
            sets.append((x, *soak_routing(t, spec.top_k, spec.experts, routing, g, spec.ranks)))
        pool.append(sets)
    return pool


def pool_routing(spec: LayerSpec, j: int) -> str:
    routings = routings_for(spec)
    return routings[j % len(routings)]


# ---------------------------------------------------------------------------------- schedule and bookkeeping
def schedule(n_units: int, replays: int, seed: int) -> list[int]:
    """The unit of every replay: rounds of every unit once, in a seeded random order per round."""
    rng = random.Random(seed)
    out: list[int] = []
    while len(out) < replays:
        order = list(range(n_units))
        rng.shuffle(order)
        out += order
    return out[:replays]


@dataclass
class Tally:
    """Per unit: replays enqueued, replays checked (their window synchronised), mismatching replays, the first one."""

    names: list[str]
    enqueued: list[int] = field(default_factory=list)
    checked: list[int] = field(default_factory=list)
    mismatches: list[int] = field(default_factory=list)
    first_mismatch: list[int | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.names)
        self.enqueued, self.checked = [0] * n, [0] * n
        self.mismatches, self.first_mismatch = [0] * n, [None] * n

    def window(self, start: int, units: Sequence[int], bad: Sequence[int]) -> None:
        """A synchronised window: replays start .. start + len(units) - 1 ran units[k]; offsets `bad` mismatched."""
        for u in units:
            self.checked[u] += 1
        for k in sorted(bad):
            u = units[k]
            self.mismatches[u] += 1
            if self.first_mismatch[u] is None:
                self.first_mismatch[u] = start + k

    def records(self) -> list[dict]:
        return [
            {"unit": n, "replays": c, "enqueued": e, "mismatches": m, "first_mismatch": f}
            for n, c, e, m, f in zip(
                self.names, self.checked, self.enqueued, self.mismatches, self.first_mismatch, strict=True
            )
        ]


class Hang(RuntimeError):
    """The device did not finish a window within the bound."""


def wait_events(events, bound_s: float, clock: Callable[[], float] = time.monotonic, sleep=time.sleep) -> float:
    """Poll events (objects with .query()) until all are done; Hang after bound_s. Returns the seconds waited."""
    t0 = clock()
    pending = list(events)
    while pending:
        pending = [e for e in pending if not e.query()]
        if not pending:
            break
        waited = clock() - t0
        if waited > bound_s:
            raise Hang(f"{len(pending)} stream(s) had not finished after {bound_s:.0f} s")
        sleep(1e-4 if waited < 1e-2 else 1e-3)
    return clock() - t0


class Watchdog:
    """Calls on_hang(reason) once when beat() has not been called for bound_s (a daemon thread)."""

    def __init__(self, bound_s: float, on_hang: Callable[[str], None], poll_s: float | None = None):
        self.bound_s, self.on_hang = bound_s, on_hang
        self.poll_s = poll_s if poll_s is not None else min(1.0, bound_s / 4)
        self.last, self.what = time.monotonic(), "start"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-watchdog", daemon=True)
        self.fired = False

    def start(self) -> Watchdog:
        self.last = time.monotonic()
        self._thread.start()
        return self

    def beat(self, what: str = "") -> None:
        self.last, self.what = time.monotonic(), what

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            idle = time.monotonic() - self.last
            if idle > self.bound_s:
                self.fired = True
                self.on_hang(f"no progress for {idle:.0f} s (bound {self.bound_s:.0f} s) after: {self.what}")
                return


def result_record(
    meta: dict,
    args: dict,
    tally: Tally,
    wall_s: float,
    hang: str | None,
    checks: list[dict],
    errors: list[str],
    units: Sequence[Unit],
    layers: dict[str, LayerSpec],
) -> dict:
    recs = tally.records()
    for rec, u in zip(recs, units, strict=True):
        spec = layers[u.layer]
        rec.update(layer=u.layer, ranks=spec.ranks, tokens=list(u.tokens), stream=u.stream)
    replays = sum(tally.checked)
    mismatches = sum(tally.mismatches)
    bad_checks = [c for c in checks if not c["ok"]]
    by_p: dict[int, int] = {}
    for r in recs:
        by_p[r["ranks"]] = by_p.get(r["ranks"], 0) + r["replays"]
    return {
        "meta": meta,
        "args": args,
        "layers": {k: v.__dict__ for k, v in layers.items() if any(u.layer == k for u in units)},
        "units": recs,
        "reference_checks": checks,
        "errors": errors,
        "totals": {
            "replays": replays,
            "replays_by_ranks": {f"P{p}": n for p, n in sorted(by_p.items())},
            "mismatches": mismatches,
            "hangs": int(hang is not None),
            "hang": hang,
            "reference_failures": len(bad_checks),
            "wall_s": wall_s,
            "replays_per_s": replays / wall_s if wall_s > 0 else None,
        },
        "ok": mismatches == 0 and hang is None and not bad_checks and not errors and 0 < replays == sum(tally.enqueued),
    }


def markdown(result: dict) -> str:
    t, meta = result["totals"], result["meta"]
    verdict = "PASS" if result["ok"] else "FAIL"
    by_p = ", ".join(f"{k}: {v}" for k, v in t["replays_by_ranks"].items())
    rate = f"{t['replays_per_s']:.0f}/s" if t.get("replays_per_s") else "–"
    lines = [
        f"# gcmoe soak — {verdict}",
        "",
        f"{meta.get('date', '')} · {meta.get('device', '')} · torch {meta.get('torch', '')} · "
        f"CuTe DSL {meta.get('cutlass_dsl', '')}",
        "",
        f"{t['replays']} graph replays ({by_p}), {t['mismatches']} mismatching, {t['hangs']} hang(s), "
        f"{t['reference_failures']} reference-check failure(s), {len(result['errors'])} layer error(s); "
        f"wall {t['wall_s']:.1f} s ({rate}).",
    ]
    if t.get("hang"):
        lines += ["", f"**Hang**: {t['hang']}"]
    lines += [
        "",
        "| unit | layer | P | T per rank | stream | replays | mismatches | first mismatch |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["units"]:
        first = "–" if r["first_mismatch"] is None else r["first_mismatch"]
        cells = (r["unit"], r["layer"], r["ranks"], "/".join(map(str, r["tokens"])), r["stream"], r["replays"])
        lines.append("| " + " | ".join(str(c) for c in (*cells, r["mismatches"], first)) + " |")
    bad = [c for c in result["reference_checks"] if not c["ok"]]
    worst = max((c["calc_diff"] for c in result["reference_checks"]), default=None)
    lines += [
        "",
        f"Reference checks (eager output vs moe_reference, calc_diff <= {REF_TOL:g}): "
        f"{len(result['reference_checks'])} sets, worst {'–' if worst is None else format(worst, '.2e')}, "
        f"{len(bad)} failed.",
    ]
    lines += [f"- FAILED {c['unit']} set {c['set']} ({c['routing']}) rank {c['rank']}: {c['calc_diff']}" for c in bad]
    lines += [f"- layer error: {e}" for e in result["errors"]]
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="gcmoe-lab probe soak",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawTextHelpFormatter,
    )
    ap.add_argument("--replays", type=int, default=100_000, help="graph replays in all (default 100000)")
    ap.add_argument("--sync-every", type=int, default=1000, help="replays between host synchronisations")
    ap.add_argument("--pool", type=int, default=8, help="input sets per unit (>= 2)")
    ap.add_argument("--hang-timeout", type=float, default=60.0, help="seconds a window may take before it is a hang")
    ap.add_argument(
        "--setup-timeout", type=float, default=240.0, help="seconds loading + arming may go without progress"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--units", nargs="+", default=["*"], help="unit names or patterns (default: all; see --list)")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/gcmoe-gpu-out") + "/soak", help="output folder")
    ap.add_argument("--list", action="store_true", help="print the units and exit")
    a = ap.parse_args(argv)
    for name in ("replays", "sync_every"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.pool < 2:
        ap.error("--pool must be >= 2 (consecutive replays of a unit must use different input sets)")
    if a.hang_timeout <= 0 or a.setup_timeout <= 0:
        ap.error("--hang-timeout and --setup-timeout must be > 0")
    return a


def select_units(patterns: Sequence[str], units: Sequence[Unit] = UNITS) -> list[Unit]:
    chosen = [u for u in units if any(fnmatch.fnmatchcase(u.name, p) for p in patterns)]
    if not chosen:
        raise ValueError(f"soak: no unit matches {list(patterns)}; units: {', '.join(u.name for u in units)}")
    return chosen


def describe_units(units: Sequence[Unit], layers: dict[str, LayerSpec] = LAYERS) -> str:
    lines = []
    for u in units:
        s = layers[u.layer]
        shape = f"H {s.hidden}, I {s.inter}, E {s.experts}, top-{s.top_k} + {s.shared} shared"
        part = "tuned" if s.comm_sms is None else s.comm_sms
        lines.append(
            f"{u.name:16s} layer {u.layer} ({shape}), P = {s.ranks}, T per rank {'/'.join(map(str, u.tokens))}, "
            f"comm_sms {part}, stream {u.stream}; routings {', '.join(routings_for(s))}"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- the GPU side
@dataclass
class Armed:
    """A unit ready to replay: its graph, static inputs and outputs, its pool on the device and the expected outputs."""

    unit: Unit
    graph: object
    static: list[tuple]
    outs: list[torch.Tensor]
    pool: list[list[tuple]]
    want: list[list[torch.Tensor]]
    stream: torch.cuda.Stream | None  # the outer stream its replays go on (None: the current one)

    def replay(self, j: int, flags_row: torch.Tensor) -> None:
        """Enqueue one checked replay of set j on the current stream: copies in, poison, replay, compare into flags."""
        for dst, src in zip(self.static, self.pool[j], strict=True):
            for a, b in zip(dst, src, strict=True):
                a.copy_(b)
        for o in self.outs:
            o.fill_(float("nan"))
        self.graph.replay()
        for r, (o, w) in enumerate(zip(self.outs, self.want[j], strict=True)):
            torch.any(torch.ne(o.view(torch.int16), w.view(torch.int16)), out=flags_row[r])


def step(plans: Sequence, streams: Sequence[torch.cuda.Stream], inputs: Sequence[tuple]) -> list[torch.Tensor]:
    """One call of every virtual rank, each on its own stream forked from and joined back to the current one (also
    inside a capture: the ranks become parallel branches of the graph)."""
    main = torch.cuda.current_stream()
    ys = []
    for plan, s, args in zip(plans, streams, inputs, strict=True):
        s.wait_stream(main)
        with torch.cuda.stream(s):
            ys.append(plan.forward(*args, True))
    for s in streams:
        main.wait_stream(s)
    return ys


class LoadedLayer:
    """A layer of LAYERS on the GPU: forward(inputs per rank) -> outputs per rank on the current stream."""

    def __init__(self, spec: LayerSpec, device: torch.device):
        import gcmoe
        from gcmoe.backends import LayerOptions
        from gcmoe_core.testing import make_weights

        self.spec, self.device = spec, device
        cfg = spec.config()
        self.weights = make_weights(cfg.replace(ep_size=1), spec.seed, device)  # every expert (the reference's view)
        self.capture_stream = torch.cuda.Stream(device)
        self.layer = self.plans = None
        if spec.ranks == 1:
            self.layer = gcmoe.MoELayer(cfg, device, "sm90", comm_sms=spec.comm_sms).load(self.weights)
        else:
            from gcmoe.backends.sm90 import virtual_ranks

            self.plans = virtual_ranks(cfg, self.weights, device, LayerOptions(comm_sms=spec.comm_sms))
            self.rank_streams = [torch.cuda.Stream(device) for _ in range(spec.ranks)]

    def forward(self, inputs: list[tuple]) -> list[torch.Tensor]:
        if self.plans is None:
            return [self.layer(*inputs[0])]
        return step(self.plans, self.rank_streams, inputs)

    def check(self) -> None:
        for layer in self.plans or [self.layer]:
            layer.check()


def arm(unit: Unit, loaded: LoadedLayer, pool_size: int, seed: int, stream, checks: list[dict]) -> Armed:
    from gcmoe_core.reference import moe_reference
    from gcmoe_core.testing import calc_diff, capture_graph

    spec, dev = loaded.spec, loaded.device
    pool = [[tuple(t.to(dev) for t in rank) for rank in s] for s in make_pool(spec, unit.tokens, pool_size, seed)]
    want = []
    for j, sets in enumerate(pool):
        ys = [y.clone() for y in loaded.forward(sets)]
        torch.cuda.synchronize()
        want.append(ys)
        for r, (y, (x, ids, w)) in enumerate(zip(ys, sets, strict=True)):
            d = calc_diff(y, moe_reference(x, ids, w, loaded.weights))
            ok = d <= REF_TOL and not bool(y.isnan().any())
            checks.append(
                {"unit": unit.name, "set": j, "routing": pool_routing(spec, j), "rank": r, "calc_diff": d, "ok": ok}
            )
    static = [tuple(t.clone() for t in rank) for rank in pool[0]]
    graph, outs = capture_graph(lambda: loaded.forward(static), stream=loaded.capture_stream)
    torch.cuda.synchronize()
    return Armed(unit, graph, static, list(outs), pool, want, stream)


class Report:
    """Writes the result once (from the main thread, or from the watchdog's thread on a hang, then exits 3)."""

    def __init__(self, out: Path, meta: dict, args: dict, units: Sequence[Unit], tally: Tally):
        self.out, self.meta, self.args, self.units, self.tally = out, meta, args, units, tally
        self.checks: list[dict] = []
        self.errors: list[str] = []
        self.t0: float = time.perf_counter()
        self.wall_s: float | None = None
        self._lock = threading.Lock()
        self._done = False

    def finish(self, hang: str | None = None) -> int:
        with self._lock:
            if self._done:
                return EXIT_HANG if hang else 0
            self._done = True
            wall = self.wall_s if self.wall_s is not None else time.perf_counter() - self.t0
            res = result_record(
                self.meta, self.args, self.tally, wall, hang, self.checks, self.errors, self.units, LAYERS
            )
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "soak.json").write_text(json.dumps(res, indent=2, default=str))
            md = markdown(res)
            (self.out / "soak.md").write_text(md)
            print(md, flush=True)
            if hang:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(EXIT_HANG)  # a hung kernel would block the interpreter's teardown
            return 0 if res["ok"] else EXIT_MISMATCH


def soak(
    armed: Sequence[Armed], order: Sequence[int], sync_every: int, hang_timeout: float, rep: Report, watchdog: Watchdog
) -> None:
    """Replay in `order` (unit indices), checking on the device; synchronise every sync_every replays (Hang after
    hang_timeout s); mismatches land in rep.tally."""
    dev = armed[0].outs[0].device
    streams = [s for s in {id(a.stream): a.stream for a in armed}.values() if s is not None]  # none on a CPU (tests)
    max_ranks = max(len(a.outs) for a in armed)
    flags = torch.zeros(sync_every, max_ranks, dtype=torch.bool, device=dev)
    tally = rep.tally
    cur = torch.cuda.current_stream(dev) if streams else None
    watchdog.bound_s = hang_timeout + WATCHDOG_SLACK_S
    rep.t0 = time.perf_counter()
    try:
        for start in range(0, len(order), sync_every):
            window = order[start : start + sync_every]
            for s in streams:
                s.wait_stream(cur)  # after the flags' zeroing
            for k, u in enumerate(window):
                a = armed[u]
                with torch.cuda.stream(a.stream) if a.stream is not None else contextlib.nullcontext():
                    a.replay(tally.enqueued[u] % len(a.pool), flags[k])
                tally.enqueued[u] += 1
                watchdog.beat(f"replay {start + k} enqueued ({a.unit.name})")
            events = [torch.cuda.Event() for _ in streams]
            for ev, s in zip(events, streams, strict=True):
                ev.record(s)
            try:
                wait_events(events, hang_timeout)
            except Hang as e:
                raise Hang(f"window of replays {start}..{start + len(window) - 1}: {e}") from None
            bad = flags[: len(window)].any(dim=1).nonzero().flatten().tolist()
            flags.zero_()
            tally.window(start, window, bad)
            watchdog.beat(f"window at replay {start} synchronised")
            if (start // sync_every) % 20 == 0:
                done = start + len(window)
                print(f"soak: {done}/{len(order)} replays, {sum(tally.mismatches)} mismatching", flush=True)
    finally:
        rep.wall_s = time.perf_counter() - rep.t0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    units = select_units(args.units)
    check_units(units, LAYERS)
    if args.list:
        print(describe_units(units))
        return 0
    if not torch.cuda.is_available():
        print("soak: needs a CUDA GPU (sm90)", file=sys.stderr)
        return 2
    from ..timing import run_meta

    dev = torch.device("cuda", torch.cuda.current_device())
    reproduce = "gcmoe-lab probe soak " + " ".join(sys.argv[1:] if argv is None else argv)
    meta = run_meta(device_kind=str(dev), reproduce=reproduce)
    rep = Report(Path(args.out), meta, vars(args), units, Tally([u.name for u in units]))
    # loading compiles kernels (tens of seconds per shape on a cold cache): a looser bound until the soak starts
    watchdog = Watchdog(args.setup_timeout, lambda why: rep.finish(f"watchdog: {why}")).start()
    try:
        t0 = time.perf_counter()
        outer = [torch.cuda.Stream(dev), torch.cuda.Stream(dev)]
        names = list(dict.fromkeys(u.layer for u in units))
        print(f"soak: loading layers {names}, arming {len(units)} units", flush=True)
        layers = {}
        for name in names:
            layers[name] = LoadedLayer(LAYERS[name], dev)
            watchdog.beat(f"layer {name} loaded")
        armed = []
        for i, u in enumerate(units):
            armed.append(arm(u, layers[u.layer], args.pool, 1000 * args.seed + i, outer[u.stream], rep.checks))
            watchdog.beat(f"unit {u.name} armed")
        meta["setup_s"] = time.perf_counter() - t0
        failed = sum(not c["ok"] for c in rep.checks)
        print(
            f"soak: armed in {meta['setup_s']:.1f} s; {len(rep.checks)} reference checks, {failed} failed", flush=True
        )
        order = schedule(len(armed), args.replays, args.seed)
        soak(armed, order, args.sync_every, args.hang_timeout, rep, watchdog)
        for name, loaded in layers.items():
            try:
                loaded.check()
            except Exception as e:  # CommError / ValueError recorded on the device
                rep.errors.append(f"layer {name}: {type(e).__name__}: {e}")
    except Hang as e:
        watchdog.stop()
        return rep.finish(str(e))
    except Exception as e:  # a launch or setup failure: reported, not a traceback alone
        traceback.print_exc()
        rep.errors.append(f"{type(e).__name__}: {e}")
    watchdog.stop()
    return rep.finish()
