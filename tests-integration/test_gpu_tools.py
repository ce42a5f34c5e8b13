"""The CPU side of the GPU tools (the lab's probes, gcmoe_lab.probes, and the shell runners in tools/gpu): soak's
inputs, schedule, on-device check loop (run here on CPU tensors with fake graphs, planted faults included), watchdog
and report; sanitize_case's case list and kernel configs (compiled offline for sm_90a); racecheck_filter's verdicts
on racecheck and initcheck logs; ncu_source's summary of a source page; precompile's job lists; the sanitize.sh and
run.sh wiring with stand-in tools."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from gcmoe_gemm_sm90.config import can_implement
from gcmoe_lab.probes import ncu_source, precompile, racecheck_filter, sanitize_case, soak

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ROOT / "tools" / "gpu"
PROBE = [sys.executable, "-m", "gcmoe_lab", "probe"]


def _env(**extra) -> dict:
    """This interpreter's bin folder first on PATH (python3 = the one with torch), plus `extra`."""
    env = dict(os.environ, **extra)
    env["PATH"] = os.pathsep.join((str(Path(sys.executable).parent), env.get("PATH", "")))
    return env


# ------------------------------------------------------------------------------------------------ soak: inputs
def _g(seed=0):
    return torch.Generator().manual_seed(seed)


def _check_weights(w, t, k):
    assert w.dtype == torch.float32 and w.shape == (t, k) and bool((w > 0).all())
    assert torch.allclose(w.sum(1), torch.ones(t))


@pytest.mark.parametrize("routing", ["uniform", "skewed", "one_expert"])
def test_soak_routings_with_distinct_ids(routing):
    ids, w = soak.soak_routing(64, 4, 32, routing, _g(1))
    assert ids.dtype == torch.int32 and ids.shape == (64, 4)
    assert int(ids.min()) >= 0 and int(ids.max()) < 32
    assert all(len(set(row)) == 4 for row in ids.tolist())
    _check_weights(w, 64, 4)
    if routing == "one_expert":
        assert bool((ids[:, 0] == 0).all())


def test_skewed_routing_has_hot_and_empty_experts():
    ids, _ = soak.soak_routing(2000, 4, 32, "skewed", _g(0))
    counts = torch.bincount(ids.flatten().long(), minlength=32)
    assert int(counts.max()) > 4 * (2000 * 4 / 32)  # the hottest expert: over 4x its uniform share
    few, _ = soak.soak_routing(8, 4, 32, "skewed", _g(1))
    assert int((torch.bincount(few.flatten().long(), minlength=32) == 0).sum()) >= 10  # at T = 8 many get nothing


def test_duplicate_routing_repeats_an_expert_in_every_other_token():
    ids, w = soak.soak_routing(9, 4, 16, "duplicate", _g(2))
    for t, row in enumerate(ids.tolist()):
        assert (row[1] == row[0]) == (t % 2 == 0)
        assert len(set(row)) == (3 if t % 2 == 0 else 4)
    _check_weights(w, 9, 4)


def test_empty_ranks_routing_leaves_the_odd_ranks_without_rows():
    ids, _ = soak.soak_routing(200, 4, 64, "empty_ranks", _g(3), ranks=4)
    rank = (ids // 16).flatten()
    assert set(rank.tolist()) == {0, 2}
    assert all(len(set(row)) == 4 for row in ids.tolist())


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((4, 1, 16, "duplicate"), "top_k >= 2"),
        ((4, 2, 16, "empty_ranks"), "P >= 2"),
        ((4, 2, 16, "zipf"), "unknown routing"),
    ],
)
def test_soak_routing_rejects(args, match):
    with pytest.raises(ValueError, match=match):
        soak.soak_routing(*args, _g())


def test_pool_is_deterministic_cycles_routings_and_differs_between_sets():
    spec = soak.LAYERS["C"]
    a = soak.make_pool(spec, (5, 1, 8, 3), 7, seed=11)
    b = soak.make_pool(spec, (5, 1, 8, 3), 7, seed=11)
    assert len(a) == 7 and all(len(s) == 4 for s in a)
    for sa, sb in zip(a, b, strict=True):
        for ra, rb in zip(sa, sb, strict=True):
            assert all(torch.equal(x, y) for x, y in zip(ra, rb, strict=True))
    for (x, ids, w), t in zip(a[0], (5, 1, 8, 3), strict=True):
        assert x.shape == (t, spec.hidden) and x.dtype == torch.bfloat16 and ids.shape == w.shape == (t, spec.top_k)
    assert [soak.pool_routing(spec, j) for j in range(7)] == [*soak.routings_for(spec), "uniform", "skewed"]
    empty = a[soak.routings_for(spec).index("empty_ranks")]
    assert {int(i) // 16 for _, ids, _ in empty for i in ids.flatten()} <= {0, 2}
    for j in range(7):  # consecutive sets (and the wrap-around) never share tokens
        assert not torch.equal(a[j][0][0], a[(j + 1) % 7][0][0])
    assert not torch.equal(soak.make_pool(spec, (5, 1, 8, 3), 2, seed=12)[0][0][0], a[0][0][0])
    with pytest.raises(ValueError, match=">= 2 input sets"):
        soak.make_pool(spec, (1,), 1, seed=0)


def test_units_are_consistent_and_cover_both_rank_counts():
    soak.check_units(soak.UNITS, soak.LAYERS)
    assert {soak.LAYERS[u.layer].ranks for u in soak.UNITS} == {1, 4}
    assert {u.stream for u in soak.UNITS} == {0, 1}
    assert len({soak.LAYERS[u.layer] for u in soak.UNITS}) >= 2  # several shapes / weights
    bad_stream = [soak.Unit("x", "A", (1,), 0), soak.Unit("y", "A", (2,), 1)]
    with pytest.raises(ValueError, match="share one outer stream"):
        soak.check_units(bad_stream, soak.LAYERS)
    with pytest.raises(ValueError, match="token counts"):
        soak.check_units([soak.Unit("x", "C", (1, 2), 0)], soak.LAYERS)
    with pytest.raises(ValueError, match=r"outside \[1, 8\]"):
        soak.check_units([soak.Unit("x", "C", (1, 2, 9, 1), 0)], soak.LAYERS)
    assert [u.name for u in soak.select_units(["C-*"])] == [u.name for u in soak.UNITS if u.layer == "C"]
    with pytest.raises(ValueError, match="no unit matches"):
        soak.select_units(["nope"])


def test_schedule_rounds_are_permutations():
    order = soak.schedule(5, 23, seed=3)
    assert len(order) == 23 and order == soak.schedule(5, 23, seed=3)
    for r in range(4):
        assert sorted(order[5 * r : 5 * r + 5]) == list(range(5))
    assert order[:5] != soak.schedule(5, 23, seed=4)[:5] or order[5:10] != soak.schedule(5, 23, seed=4)[5:10]


def test_tally_charges_mismatches_to_units():
    t = soak.Tally(["a", "b", "c"])
    t.window(0, [0, 1, 2, 0], [3])
    t.window(4, [2, 1, 0, 1], [1, 3, 0])
    assert t.checked == [3, 3, 2] and t.mismatches == [1, 2, 1] and t.first_mismatch == [3, 5, 4]


def test_parse_args():
    a = soak.parse_args([])
    assert (a.replays, a.sync_every, a.pool, a.hang_timeout, a.units) == (100_000, 1000, 8, 60.0, ["*"])
    assert soak.parse_args(["--replays", "7", "--units", "A-*", "B-T3"]).units == ["A-*", "B-T3"]
    for bad in (["--pool", "1"], ["--replays", "0"], ["--hang-timeout", "0"]):
        with pytest.raises(SystemExit):
            soak.parse_args(bad)


# ------------------------------------------------------------------------------------- soak: waits and watchdog
class _Event:
    def __init__(self, done_after: int | None):
        self.left = done_after

    def query(self) -> bool:
        if self.left is None:
            return False
        self.left -= 1
        return self.left < 0


def test_wait_events_returns_when_done_and_raises_on_a_hang():
    assert soak.wait_events([_Event(0), _Event(3)], 5.0, sleep=lambda s: None) >= 0
    clock = iter(float(i) for i in range(100))
    with pytest.raises(soak.Hang, match="1 stream"):
        soak.wait_events([_Event(0), _Event(None)], 10.0, clock=lambda: next(clock), sleep=lambda s: None)


def test_watchdog_fires_once_without_beats_and_not_while_beating():
    fired: list[str] = []
    wd = soak.Watchdog(0.05, fired.append, poll_s=0.01).start()
    wd.beat("replay 7 enqueued")
    time.sleep(0.3)
    wd.stop()
    assert len(fired) == 1 and "replay 7 enqueued" in fired[0] and wd.fired
    quiet: list[str] = []
    wd = soak.Watchdog(0.2, quiet.append, poll_s=0.01).start()
    for _ in range(20):
        wd.beat()
        time.sleep(0.01)
    wd.stop()
    assert quiet == [] and not wd._thread.is_alive()


# ---------------------------------------------------------------------------- soak: the check loop on a CPU
def _f(x, ids, w):
    """A stand-in layer: deterministic, different for every input set."""
    return (x.float() * w.sum(1, keepdim=True) + ids.sum(1, keepdim=True)).to(torch.bfloat16)


class FakeGraph:
    """Replays _f of the static inputs into the outputs; fault_at = n: its n-th replay writes nothing (a stale
    replay, left with the NaN poison); wrong_at = n: writes a value off by one ulp."""

    def __init__(self, static, outs, fault_at=None, wrong_at=None):
        self.static, self.outs, self.fault_at, self.wrong_at = static, outs, fault_at, wrong_at
        self.n = 0
        self.seen: list[float] = []

    def replay(self):
        self.n += 1
        self.seen.append(float(self.static[0][0][0, 0]))
        if self.n == self.fault_at:
            return
        for args, o in zip(self.static, self.outs, strict=True):
            o.copy_(_f(*args))
            if self.n == self.wrong_at:
                o.view(torch.int16)[0, 0] += 1


def _armed(unit: soak.Unit, pool_size=3, seed=0, **faults) -> soak.Armed:
    spec = replace(soak.LAYERS[unit.layer], hidden=256)
    pool = soak.make_pool(spec, unit.tokens, pool_size, seed)
    want = [[_f(*args) for args in sets] for sets in pool]
    static = [tuple(t.clone() for t in args) for args in pool[0]]
    outs = [torch.empty(t, spec.hidden, dtype=torch.bfloat16) for t in unit.tokens]
    return soak.Armed(unit, FakeGraph(static, outs, **faults), static, outs, pool, want, None)


UNITS = [soak.Unit("p1", "A", (3,), 0), soak.Unit("p4", "C", (2, 1, 3, 1), 1), soak.Unit("p1b", "A", (1,), 0)]


def _soak(armed, replays, sync_every, tmp_path):
    rep = soak.Report(
        tmp_path, {"date": "today"}, {}, [a.unit for a in armed], soak.Tally([a.unit.name for a in armed])
    )
    fired: list[str] = []
    wd = soak.Watchdog(30.0, fired.append).start()
    soak.soak(armed, soak.schedule(len(armed), replays, 0), sync_every, 30.0, rep, wd)
    wd.stop()
    assert not fired
    return rep


def test_soak_loop_passes_exact_replays_and_cycles_the_pool(tmp_path):
    armed = [_armed(u, seed=i) for i, u in enumerate(UNITS)]
    rep = _soak(armed, 61, 7, tmp_path)
    assert rep.tally.checked == rep.tally.enqueued and sum(rep.tally.checked) == 61
    assert rep.tally.mismatches == [0, 0, 0]
    for a in armed:  # consecutive replays of a unit ran different input sets
        s = a.graph.seen
        assert len(s) >= 20 and all(p != q for p, q in itertools.pairwise(s))
    assert rep.finish() == 0
    res = json.loads((tmp_path / "soak.json").read_text())
    p4 = soak.schedule(len(armed), 61, 0).count(1)
    assert (
        res["ok"] and res["totals"]["replays"] == 61 and res["totals"]["replays_by_ranks"] == {"P1": 61 - p4, "P4": p4}
    )
    assert "PASS" in (tmp_path / "soak.md").read_text()


@pytest.mark.parametrize("fault", ["fault_at", "wrong_at"])
def test_soak_loop_finds_a_planted_fault_at_its_replay(tmp_path, fault):
    armed = [_armed(u, seed=i) for i, u in enumerate(UNITS)]
    armed[1] = _armed(UNITS[1], seed=1, **{fault: 9})  # the P = 4 unit's 9th replay
    order = soak.schedule(len(armed), 50, 0)
    rep = _soak(armed, 50, 8, tmp_path)
    nth = [i for i, u in enumerate(order) if u == 1][8]  # global index of unit 1's 9th replay
    assert rep.tally.mismatches == [0, 1, 0] and rep.tally.first_mismatch == [None, nth, None]
    assert rep.finish() == soak.EXIT_MISMATCH
    res = json.loads((tmp_path / "soak.json").read_text())
    assert not res["ok"] and res["units"][1]["first_mismatch"] == nth
    assert f"| p4 | C | 4 | 2/1/3/1 | 1 | {rep.tally.checked[1]} | 1 | {nth} |" in (tmp_path / "soak.md").read_text()


def test_result_record_fails_on_a_hang_or_a_reference_failure():
    tally = soak.Tally(["A-T1"])
    tally.window(0, [0, 0], [])
    tally.enqueued = [2]
    units = [soak.UNITS[0]]
    check = {"unit": "A-T1", "set": 0, "routing": "uniform", "rank": 0, "calc_diff": 1e-6, "ok": True}
    ok = soak.result_record({}, {}, tally, 1.0, None, [check], [], units, soak.LAYERS)
    assert ok["ok"] and ok["totals"]["hangs"] == 0 and ok["totals"]["replays_per_s"] == 2.0
    hung = soak.result_record({}, {}, tally, 1.0, "window 0: 1 stream(s)", [check], [], units, soak.LAYERS)
    assert not hung["ok"] and hung["totals"]["hangs"] == 1 and "**Hang**" in soak.markdown(hung)
    bad = soak.result_record(
        {}, {}, tally, 1.0, None, [{**check, "calc_diff": 0.5, "ok": False}], [], units, soak.LAYERS
    )
    assert not bad["ok"] and "FAILED A-T1 set 0 (uniform)" in soak.markdown(bad)
    err = soak.result_record({}, {}, tally, 1.0, None, [check], ["layer A: CommError"], units, soak.LAYERS)
    assert not err["ok"] and "layer error: layer A: CommError" in soak.markdown(err)


def test_report_is_written_once_even_with_two_writers(tmp_path):
    rep = soak.Report(tmp_path, {}, {}, [soak.UNITS[0]], soak.Tally(["A-T1"]))
    codes = []
    threads = [threading.Thread(target=lambda: codes.append(rep.finish())) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert sorted(codes) == [0, 0, 0, soak.EXIT_MISMATCH]  # no replay ran: the one real verdict fails
    assert json.loads((tmp_path / "soak.json").read_text())["totals"]["replays"] == 0


def test_soak_cli_help_and_list_run_on_a_cpu():
    for args in (["--help"], ["--list"]):
        r = subprocess.run([*PROBE, "soak", *args], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
    assert all(u.name in r.stdout for u in soak.UNITS) and "empty_ranks" in r.stdout
    if not torch.cuda.is_available():
        assert soak.main(["--replays", "5"]) == 2


# ------------------------------------------------------------------------------------------- sanitize_case
def test_sanitize_cases_cover_every_kernel_and_w1_w2_variant():
    kernels = {k for c in sanitize_case.CASES for k in c.kernels}
    for k in ("publish", "publish (slot path)", "ready", "dispatch", "finalize (+ combined signal)", "W1", "W2"):
        assert k in kernels
    assert {sanitize_case.LOCAL, sanitize_case.LOCAL_SLOTS} <= kernels  # world size 1: publish + dispatch fused
    names = [c.name for c in sanitize_case.CASES]
    assert len(set(names)) == len(names)
    for v in ("plain", "splitk", "expert-sync", "stream-k"):
        assert f"ring-{v}" in names
    rc = sanitize_case.RING_CONFIGS
    assert rc["plain"].splits == (1, 1) and not rc["plain"].expert_sync and not rc["plain"].stream_k
    assert rc["splitk"].splits == (2, 2) and not rc["splitk"].expert_sync
    assert rc["expert-sync"].expert_sync and rc["expert-sync"].splits[0] == 1
    assert rc["stream-k"].stream_k and rc["stream-k"].splits[0] == 1
    assert {"comm-p2", "layer-p2"} <= set(names)  # the combined signal across ranks


@pytest.mark.parametrize(
    "kc", [*sanitize_case.RING_CONFIGS.values(), *sanitize_case.ROW_CONFIGS.values()], ids=lambda c: str(c.n_tile)
)
def test_sanitize_configs_fit_both_gemms_of_the_case_shape(kc):
    c = sanitize_case.CFG
    experts = c.local_experts + c.num_shared_experts
    h, i = c.hidden_size, c.intermediate_size
    assert can_implement(2 * i, h, experts, kc, splits=kc.splits[0], half=kc.w1_half) is None
    assert can_implement(h, i, experts, kc, splits=kc.splits[1], half=kc.w2_half) is None


@pytest.mark.compile
@pytest.mark.parametrize("name", [*(f"ring-{n}" for n in sanitize_case.RING_CONFIGS), *sanitize_case.ROW_CONFIGS])
def test_sanitize_configs_compile_for_sm90a(name):
    """Every forced configuration compiles as the case runs it (ring mode through the layer, or prepared rows)."""
    from gcmoe_gemm_sm90.ops import compiled

    ring = name.startswith("ring-")
    kc = sanitize_case.RING_CONFIGS[name[5:]] if ring else sanitize_case.ROW_CONFIGS[name]
    kc = replace(kc, ring=True, ring_bm=8) if ring else kc
    c = sanitize_case.CFG
    for mode, m, k in (("w1", 2 * c.intermediate_size, c.hidden_size), ("w2", c.hidden_size, c.intermediate_size)):
        assert "QGMMA" in compiled(mode, m, k, kc, "sm_90a").sass()


def test_sanitize_case_list_and_selection():
    r = subprocess.run([*PROBE, "sanitize_case", "--list"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert [ln.split()[0] for ln in r.stdout.splitlines()] == [c.name for c in sanitize_case.CASES]
    assert [c.name for c in sanitize_case.select(["ring-*", "comm-p2"])] == [
        "comm-p2",
        *(f"ring-{n}" for n in sanitize_case.RING_CONFIGS),
    ]
    with pytest.raises(SystemExit):
        sanitize_case.select(["nothing"])


# ------------------------------------------------------------------------------------------ racecheck_filter
def _tagged_line(path: Path) -> int:
    """A source line the comment block above which says racecheck-ordered."""
    lines = path.read_text().splitlines()
    i = next(n for n, ln in enumerate(lines) if racecheck_filter.TAGS["racecheck"] in ln)
    while lines[i].lstrip().startswith("#"):
        i += 1
    return i + 1


# the sm90 kernel source that carries racecheck-ordered tags (whichever module of the kernel holds its pipeline)
SM90_GROUPED = next(
    p
    for p in sorted((ROOT / "packages/gcmoe-gemm-sm90/src/gcmoe_gemm_sm90").glob("kernel_grouped*.py"))
    if racecheck_filter.TAGS["racecheck"] in p.read_text()
)
SYMBOL = f"kernel_cutlass_kernel_gcmoe_gemm_sm90{SM90_GROUPED.stem}GroupedGemmSm90_object_0"


def _race(line_a: int, line_b: int) -> list[str]:
    return [
        f"========= Error: Race reported between Write access at {SYMBOL}+0x1430 in {SM90_GROUPED.name}:{line_a}",
        f"=========     and Read access at {SYMBOL}+0x1810 in {SM90_GROUPED.name}:{line_b} [1015808 hazards]",
        "=========",
    ]


def _verdict(tmp_path, tool, lines):
    log = tmp_path / f"{tool}.log"
    log.write_text("\n".join(["========= COMPUTE-SANITIZER", *lines]) + "\n")
    return racecheck_filter.main(["--tool", tool, str(log)])


def test_racecheck_filter_explains_tagged_lines_only(tmp_path, capsys):
    n = _tagged_line(SM90_GROUPED)
    summary = "========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)"
    assert _verdict(tmp_path, "racecheck", [*_race(n, n), summary]) == 0
    assert "1 distinct race reports, 0 unexplained" in capsys.readouterr().out
    untagged = next(i for i, ln in enumerate(SM90_GROUPED.read_text().splitlines(), 1) if ln.strip() == "")
    assert _verdict(tmp_path, "racecheck", [*_race(n, untagged), summary]) == 1
    assert "UNEXPLAINED" in capsys.readouterr().out
    assert _verdict(tmp_path, "racecheck", _race(n, n)) == 1  # no summary: racecheck did not finish
    assert _verdict(tmp_path, "racecheck", [summary.replace("1 hazard", "0 hazards")]) == 0


def _uninit(where: str | None) -> list[str]:
    out = ["========= Uninitialized __global__ memory read of size 16 bytes"]
    if where:
        out.append(f"=========     at {SYMBOL}+0x2a90 in {where}")
    return [*out, "=========     by thread (0,0,0) in block (3,0,0)", "========="]


def test_initcheck_filter_is_strict(tmp_path, capsys, monkeypatch):
    zero = "========= ERROR SUMMARY: 0 errors"
    one = "========= ERROR SUMMARY: 1 error"
    assert _verdict(tmp_path, "initcheck", ["case layer: ok, uninitialized words: none", zero]) == 0  # program output
    assert _verdict(tmp_path, "initcheck", [*_uninit("kernel_grouped.py:724"), one]) == 1  # no initcheck-uninit tag
    assert _verdict(tmp_path, "initcheck", [*_uninit(None), one]) == 1  # no source line of ours
    host = "========= Host API uninitialized memory access: cuMemcpyDtoH_v2 reads 64 bytes"
    assert _verdict(tmp_path, "initcheck", [host, one]) == 1
    assert _verdict(tmp_path, "initcheck", _uninit("kernel_grouped.py:724")) == 1  # no summary
    capsys.readouterr()
    # an explained read: the line's comment block says initcheck-uninit
    fake = ["x = 1", "# initcheck-uninit: padding rows of the TMA box, never stored", "y = load(box)"]
    monkeypatch.setattr(racecheck_filter, "source", lambda name, symbol: fake)
    assert _verdict(tmp_path, "initcheck", [*_uninit("kernel_grouped.py:3"), one]) == 0
    assert "explained" in capsys.readouterr().out
    two = "========= ERROR SUMMARY: 2 errors"  # one report printed, two counted: the other cannot be explained
    assert _verdict(tmp_path, "initcheck", [*_uninit("kernel_grouped.py:3"), two]) == 1


# ------------------------------------------------------------------------------------ sanitize.sh and run.sh
def _stub_sanitizer(bin_dir: Path, initcheck_report: bool) -> None:
    """A compute-sanitizer stand-in: runs the program, then prints its tool's summary (and one report if asked)."""
    report = "\n".join(_uninit("kernel_grouped.py:724")) if initcheck_report else ""
    script = f"""#!/usr/bin/env bash
tool=memcheck
while [ $# -gt 0 ]; do case "$1" in --tool) tool=$2; shift 2;; --*) shift 2;; *) break;; esac; done
"$@"
echo "========= COMPUTE-SANITIZER"
if [ "$tool" = racecheck ]; then echo "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)"
elif [ "$tool" = initcheck ] && [ -n "{"1" if initcheck_report else ""}" ]; then
  cat <<'EOF'
{report}
========= ERROR SUMMARY: 1 error
EOF
else echo "========= ERROR SUMMARY: 0 errors"; fi
"""
    path = bin_dir / "compute-sanitizer"
    path.write_text(script)
    path.chmod(0o755)


@pytest.mark.slow
@pytest.mark.parametrize("bad_initcheck", [False, True])
def test_sanitize_sh_runs_every_tool_and_fails_on_an_unexplained_report(tmp_path, bad_initcheck):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _stub_sanitizer(bin_dir, bad_initcheck)
    tools = ("initcheck",) if bad_initcheck else ("racecheck", "memcheck", "synccheck", "initcheck")
    env = _env(OUT=str(tmp_path / "out"), SANITIZE_ARGS="--list --cases 'comm-*'")
    if bad_initcheck:
        env["SANITIZE_TOOLS"] = "initcheck"
    env["PATH"] = os.pathsep.join((str(bin_dir), env["PATH"]))
    r = subprocess.run(["bash", str(TOOLS / "sanitize.sh")], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == (1 if bad_initcheck else 0), r.stdout + r.stderr
    out = tmp_path / "out" / "sanitize"
    assert [ln.split()[0] for ln in (out / "cases.txt").read_text().splitlines()] == ["comm-ready", "comm-p2"]
    assert "plain: exit 0" in r.stdout
    for tool in tools:
        assert f"{tool}: exit 0" in r.stdout
        assert "comm-p2" in (out / f"{tool}.log").read_text()  # the case selection reached the program
    verdict = (out / "initcheck-verdict.txt").read_text()
    assert ("1 unexplained" in verdict) == bad_initcheck


@pytest.mark.slow
def test_run_sh_soak_step_reaches_the_soak_script(tmp_path):
    env = _env(OUT=str(tmp_path), SOAK_ARGS="--list --units C-P4-*")
    r = subprocess.run(["bash", str(TOOLS / "run.sh"), "soak"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "=== soak ===" in r.stdout and "C-P4-T5.1.8.3" in (tmp_path / "soak.log").read_text()
    text = (TOOLS / "run.sh").read_text()
    assert "    benchmark)" in text and "test_bench_layer.py" in text and "--benchmark-json" in text


# ------------------------------------------------------------------------------------------------ precompile
def test_precompile_lists_the_layers_kernels_and_the_ring_tests_variants(capsys):
    """precompile.py --list (CPU): per model and T, W1 and W2 in ring mode with the configuration the layer's bucket
    gets (layer_config of the slice's padded shape, epilogue flags included), then the ring tests' variants, each
    once."""
    from gcmoe.backends.sm90 import ring_kernel_config, token_bucket
    from gcmoe_core.config import MoEConfig
    from gcmoe_gemm_sm90.ops import layer_config

    jobs = precompile.layer_jobs("deepseek-v4-flash", 8, [1, 5, 32])
    cfg = MoEConfig.ep_slice("deepseek-v4-flash", 8, max_tokens_per_rank=256)
    h, i = cfg.padded_hidden, cfg.padded_intermediate
    for t, (w1, w2) in zip((1, 5, 32), zip(jobs[::2], jobs[1::2]), strict=True):
        shape = (cfg.local_experts, h, i, cfg.num_shared_experts)
        want = ring_kernel_config(layer_config(token_bucket(t), cfg.top_k, *shape))
        assert w1 == ("w1", 2 * i, h, want) and w2 == ("w2", h, i, want)
    gpt = precompile.layer_jobs("gpt-oss-120b", 8, [8])
    assert gpt[0][3].bias and gpt[0][3].activation == "swiglu_clamped" and gpt[0][2] % 256 == 0
    tests = precompile.test_jobs()
    assert {c.ring for *_, c in tests} == {False, True} and len(tests) == len(set(tests))
    assert precompile.main(["--models", "deepseek-v3", "--tokens", "1", "--tests", "--list"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 + len(tests) and out[0].startswith("w1 4096 7168 Sm90Config(")


def test_precompile_kernels_bench_jobs_are_the_bench_configs(capsys):
    """--kernels-bench: per T, W1 and W2 as the kernel bench (bench_sm90) launches them (prepared rows, not ring
    mode; the routed experts of the EP slice: MoESm90.config_for = layer_config of that shape)."""
    from gcmoe_core.config import MoEConfig
    from gcmoe_gemm_sm90.ops import layer_config

    jobs = precompile.kernels_bench_jobs("deepseek-v3", 8, [1, 32, 128])
    cfg = MoEConfig.ep_slice("deepseek-v3", 8, max_tokens_per_rank=256, num_shared_experts=0)
    h, i = cfg.hidden_size, cfg.intermediate_size
    for t, (w1, w2) in zip((1, 32, 128), zip(jobs[::2], jobs[1::2]), strict=True):
        want = layer_config(t, cfg.top_k, cfg.num_experts, h, i, 0)
        assert not want.ring and w1 == ("w1", 2 * i, h, want) and w2 == ("w2", h, i, want)
    assert precompile.main(["--models", "deepseek-v3", "--tokens", "1", "--kernels-bench", "--list"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 4 and sum("ring=False" in line for line in out) == 2


def test_precompile_grouped_tests_configs():
    """--test-variants: exactly the configurations test_grouped_gpu.py runs (grouped_config), skipped pairs left
    out."""
    mod = precompile._load(precompile.RING_TESTS)
    grouped = precompile.grouped_test_jobs(["*half"])
    want = [
        c
        for n in mod.GROUPED_N_TILES
        for name in ("w2-half", "half")
        if not isinstance(c := mod.grouped_config(n, name), str)
    ]
    assert sorted({c for *_, c in grouped}, key=repr) == sorted(set(want), key=repr)
    assert len(grouped) == 2 * len(want) and all(c.w2_half for *_, c in grouped)


# ------------------------------------------------------------------------------------------------ ncu_source
def _source_page() -> str:
    """Two kernels as ncu's source page prints them: W1 (a byte store) then W2 (the bf16 scatter)."""
    head = '"Address","Source","Instructions Executed","stall_barrier","stall_long_sb","stall_barrier (Not Issued)"'

    def table(rows):
        return "\n".join([head, *(f'"{a}","{src}","{n}","{b}","{ls}","{b}"' for a, src, n, b, ls in rows)])

    w1 = [
        ("0x10", "BAR.SYNC.DEFER_BLOCKING 0x0", 8, 0, 0),
        ("0x20", "FENCE.VIEW.ASYNC.G", 8, 30, 0),
        ("0x30", "@!P0 BRA 0x90", "1,024", 0, 10),
        ("0x40", "STG.E.U8 desc[UR4][R2.64], R3", 16, 0, 0),
    ]
    w2 = [
        ("0x10", "LDG.E R4, desc[UR4][R2.64]", 8, 0, 0),
        ("0x20", "IMAD.WIDE R6, R4, 0x8, R8", 8, 0, 3),
        ("0x30", "STG.E.U16 desc[UR4][R6.64], R5", 8, 1, 0),
    ]
    name = '"Kernel Name","kernel_cutlass_gcmoe_gemm_sm90_x",\n'
    return name + table(w1) + "\n" + name + table(w2) + "\n"


def test_ncu_source_summary_labels_the_kernels_and_shares_their_samples():
    w1, w2 = ncu_source.kernels(_source_page())
    assert [ncu_source.label(k) for k in (w1, w2)] == ["W1", "W2"]
    s = ncu_source.summary(w1)
    assert s["samples"] == 40
    assert s["reasons"] == [("barrier", 0.75), ("long_sb", 0.25)]  # the "(Not Issued)" columns are not counted twice
    assert s["opcodes"][0][:2] == ("FENCE", 0.75) and ("BRA", 0.25) in [o[:2] for o in s["opcodes"]]
    src, executed, share, why = s["hot"][0]
    assert (src, executed, share, why[0]) == ("FENCE.VIEW.ASYNC.G", 8.0, 0.75, ("barrier", 0.75))
    assert ncu_source.opcode("@!UP1 IMAD.WIDE R6, R4, 0x8, R8") == "IMAD"
    assert s["outside_loop"] == (0.75, 0.75, 0.0)  # executed < 1,024 / 4: all but the loop's branch
    assert ncu_source.summary(w2)["hot"][0][2] == 0.75


def test_ncu_source_main_prints_both_kernels(tmp_path, capsys):
    page = tmp_path / "source.csv"
    page.write_text(_source_page())
    assert ncu_source.main([str(page), "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert out.index("== W1: 40 samples, 4 instructions") < out.index("== W2: 4 samples, 3 instructions")
