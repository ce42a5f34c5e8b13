"""Read a compute-sanitizer racecheck or initcheck log and fail on any report that is not explained in the source.

    gcmoe-lab probe racecheck_filter racecheck.log
    gcmoe-lab probe racecheck_filter --tool initcheck initcheck.log

racecheck: a report names two accesses as `<file>:<line>`. It is explained when both lines (or the comment block just
above each) carry a `racecheck-ordered:` comment naming the synchronisation that orders them, which racecheck cannot
see (e.g. a bulk copy into a pipeline stage against the thread reads of that stage: mbarrier arrive / try_wait).

initcheck: a report is one uninitialised access (`Uninitialized __global__ memory read ...`, then `at <symbol>+0x..
in <file>:<line>`). It is explained when that line (or the comment block above it) carries an `initcheck-uninit:`
comment saying why reading never-written bytes there is intended and harmless (e.g. a TMA box that also covers
padding rows whose values no output depends on). A report without a source line of ours (a torch kernel, a host API
copy of uninitialised memory) cannot be explained: it fails. Every error the summary counts must have been printed
(a report cut off by --print-limit cannot be explained either).

Prints every distinct report with its verdict; exit 1 if any is unexplained or the log has no summary.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
from functools import cache
from pathlib import Path

# the packages whose kernels a sanitizer report can name (their installed or checked-out source folders)
PACKAGES = ("gcmoe_core", "gcmoe_greenctx", "gcmoe_comm", "gcmoe_gemm_sm90", "gcmoe_gemm_sm103", "gcmoe")
TAGS = {"racecheck": "racecheck-ordered:", "initcheck": "initcheck-uninit:"}
ACCESS = re.compile(r"\b(Read|Write) (?:access|Thread \([\d,]+\)) at (\S+) in (\S+?):(\d+)")
START = ("Race reported between", "hazard detected")  # racecheck: analysis mode, hazard mode
PREFIX = "========="  # compute-sanitizer's own lines (the program's output never starts with it)
UNINIT = re.compile(r"uninitiali[sz]ed", re.IGNORECASE)
LOCATION = re.compile(r"\bat (\S+) in ([^\s:]+):(\d+)")
ERRORS = re.compile(r"ERROR SUMMARY: (\d+) error")


@cache
def package_dirs() -> tuple[Path, ...]:
    """The source folders of PACKAGES that import here."""
    dirs = []
    for pkg in PACKAGES:
        spec = importlib.util.find_spec(pkg)
        if spec is not None and spec.origin:
            dirs.append(Path(spec.origin).parent)
    return tuple(dirs)


@cache
def source(name: str, symbol: str) -> list[str] | None:
    """The file `name` of our packages; where several share the name, the one whose package + module name the
    kernel's symbol carries (CuTe DSL symbols embed them, e.g. gcmoe_gemm_sm90kernel_grouped). A report may name the
    file by its full path: only its base name is looked up."""
    found = [p for d in package_dirs() for p in d.glob(f"**/{Path(name).name}")]
    if len(found) > 1:
        found = [p for p in found if f"{p.parent.name}{p.stem}" in symbol]
    return found[0].read_text().splitlines() if len(found) == 1 else None


def explained(name: str, line: int, symbol: str, tag: str = TAGS["racecheck"]) -> bool:
    lines = source(name, symbol)
    if lines is None or not 1 <= line <= len(lines):
        return False
    if tag in lines[line - 1]:
        return True
    above = line - 2  # the comment block just above the line
    while above >= 0 and lines[above].lstrip().startswith("#"):
        if tag in lines[above]:
            return True
        above -= 1
    return False


def racecheck_reports(text: list[str]) -> dict[tuple, int]:
    """(kernel symbol, *sorted distinct (kind, file, line)) -> times reported."""
    reports: dict[tuple, int] = {}
    for i, ln in enumerate(text):
        if not any(s in ln for s in START):
            continue
        record = [ln]
        for nxt in text[i + 1 : i + 4]:  # the accesses follow on the next lines
            if any(s in nxt for s in START):
                break
            record.append(nxt)
        found = ACCESS.findall(" ".join(record))
        symbol = found[0][1] if found else ""
        key = (symbol.split("+")[0], *sorted({(kind, f, int(n)) for kind, _, f, n in found}))
        reports[key] = reports.get(key, 0) + 1
    return reports


def initcheck_reports(text: list[str]) -> dict[tuple, int]:
    """(what, kernel symbol, file, line) -> times reported; symbol/file/line empty where the report names no source."""
    reports: dict[tuple, int] = {}
    for i, ln in enumerate(text):
        if not ln.startswith(PREFIX) or not UNINIT.search(ln):
            continue
        what = ln[len(PREFIX) :].strip()
        what = re.sub(r"^(Error|ERROR):\s*", "", what)
        where = ("", "", 0)
        for nxt in text[i + 1 : i + 4]:
            if UNINIT.search(nxt):
                break
            m = LOCATION.search(nxt)
            if m:
                where = (m.group(1).split("+")[0], m.group(2), int(m.group(3)))
                break
        key = (what, *where)
        reports[key] = reports.get(key, 0) + 1
    return reports


def verdict_racecheck(text: list[str]) -> tuple[list[str], int]:
    lines, bad = [], 0
    reports = racecheck_reports(text)
    for (symbol, *accesses), times in sorted(reports.items()):
        ok = len(accesses) == 2 and all(explained(f, n, symbol, TAGS["racecheck"]) for _, f, n in accesses)
        bad += not ok
        where = " vs ".join(f"{kind} {f}:{n}" for kind, f, n in accesses)
        lines.append(f"{'explained  ' if ok else 'UNEXPLAINED'} {where} (reported {times}x)")
    summary = [ln for ln in text if "RACECHECK SUMMARY" in ln]
    lines.append(summary[-1].strip("= ") if summary else "no RACECHECK SUMMARY in the log (did racecheck finish?)")
    lines.append(f"{len(reports)} distinct race reports, {bad} unexplained")
    return lines, 1 if bad or not summary else 0


def verdict_initcheck(text: list[str]) -> tuple[list[str], int]:
    lines, bad = [], 0
    reports = initcheck_reports(text)
    for (what, symbol, f, n), times in sorted(reports.items()):
        ok = bool(f) and explained(f, n, symbol, TAGS["initcheck"])
        bad += not ok
        where = f"{f}:{n}" if f else "no source line of ours"
        lines.append(f"{'explained  ' if ok else 'UNEXPLAINED'} {what} at {where} (reported {times}x)")
    counts = [int(m.group(1)) for ln in text for m in [ERRORS.search(ln)] if m]
    printed = sum(reports.values())
    if not counts:
        lines.append("no ERROR SUMMARY in the log (did initcheck finish?)")
    else:
        lines.append(f"ERROR SUMMARY: {counts[-1]} error(s), {printed} uninitialised-access report(s) printed")
        if counts[-1] > printed:
            lines.append(f"{counts[-1] - printed} error(s) not printed or not uninitialised accesses: unexplained")
    lines.append(f"{len(reports)} distinct initcheck reports, {bad} unexplained")
    return lines, 1 if bad or not counts or counts[-1] > printed else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gcmoe-lab probe racecheck_filter", description=__doc__.split("\n\n")[0])
    ap.add_argument("log")
    ap.add_argument("--tool", choices=tuple(TAGS), default="racecheck")
    a = ap.parse_args(argv)
    text = Path(a.log).read_text(errors="replace").splitlines()
    lines, rc = (verdict_racecheck if a.tool == "racecheck" else verdict_initcheck)(text)
    print("\n".join(lines))
    return rc
