"""Read a compute-sanitizer racecheck log and fail on any race report that is not explained in the source.

A report names two accesses as `<file>:<line>`. It is explained when both lines (or the comment block just above
each) carry a `racecheck-ordered:` comment naming the synchronisation that orders them, which racecheck cannot see
(e.g. a bulk copy into a pipeline stage against the thread reads of that stage: mbarrier arrive / try_wait). Prints
every distinct report with its verdict; exit 1 if any is unexplained or the log has no racecheck summary.

    python tools/gpu/racecheck_filter.py racecheck.log
"""

import re
import sys
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TAG = "racecheck-ordered:"
ACCESS = re.compile(r"\b(Read|Write) (?:access|Thread \([\d,]+\)) at (\S+) in (\S+?):(\d+)")
START = ("Race reported between", "hazard detected")  # analysis mode, hazard mode


@cache
def source(name: str, symbol: str) -> list[str] | None:
    """The file `name` of our packages; where several share the name, the one whose package + module name the
    kernel's symbol carries (CuTe DSL symbols embed them, e.g. gcmoe_gemm_sm90kernel_grouped)."""
    found = list(ROOT.glob(f"packages/*/src/**/{name}"))
    if len(found) > 1:
        found = [p for p in found if f"{p.parent.name}{p.stem}" in symbol]
    return found[0].read_text().splitlines() if len(found) == 1 else None


def explained(name: str, line: int, symbol: str) -> bool:
    lines = source(name, symbol)
    if lines is None or not 1 <= line <= len(lines):
        return False
    if TAG in lines[line - 1]:
        return True
    above = line - 2  # the comment block just above the line
    while above >= 0 and lines[above].lstrip().startswith("#"):
        if TAG in lines[above]:
            return True
        above -= 1
    return False


def main(path: str) -> int:
    text = Path(path).read_text(errors="replace").splitlines()
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
    summary = [ln for ln in text if "RACECHECK SUMMARY" in ln]
    bad = 0
    for (symbol, *accesses), times in sorted(reports.items()):
        ok = len(accesses) == 2 and all(explained(f, n, symbol) for _, f, n in accesses)
        bad += not ok
        where = " vs ".join(f"{kind} {f}:{n}" for kind, f, n in accesses)
        print(f"{'explained  ' if ok else 'UNEXPLAINED'} {where} (reported {times}x)")
    print(summary[-1].strip("= ") if summary else "no RACECHECK SUMMARY in the log (did racecheck finish?)")
    print(f"{len(reports)} distinct race reports, {bad} unexplained")
    return 1 if bad or not summary else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
