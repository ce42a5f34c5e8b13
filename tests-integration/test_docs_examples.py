"""Every ```python block of README.md and docs/*.md runs as written, on a CPU (the reference backend).

A block runs in a fresh namespace with a fresh temporary working directory. An HTML comment on the line right
above a block's opening fence says what else it needs (words combine: `<!-- docs-test: continue gpu -->`):

    <!-- docs-test: continue -->      a fragment: runs in the namespace the previous block of the same page left
    <!-- docs-test: gpu -->           needs a CUDA GPU: compiled (syntax) but not run here
    <!-- docs-test: multiprocess -->  needs several processes (torch.distributed): compiled but not run here

A chain is a block and the `continue` blocks after it, run in order in one namespace; its gpu / multiprocess blocks
are compiled and passed over (a later block that needs their names must be marked too), and a chain with nothing
to run here is reported as skipped. Nothing else skips a block, and the pages must hold at least MIN_RUNNABLE
blocks that run, so the test cannot pass by running nothing. docs/benchmarks holds records, not examples: not
read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
WORDS = {"continue", "gpu", "multiprocess"}
NOT_HERE = {"gpu": "needs a CUDA GPU", "multiprocess": "needs several processes (torch.distributed)"}
MIN_RUNNABLE = 14  # blocks that run on a CPU across the pages today: fewer means examples were lost or marked away

MARKER = re.compile(r"^\s*<!--\s*docs-test:(?P<words>[^>]*?)\s*-->\s*$")
FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>[\w+-]*)\s*$")


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository root
    line: int  # 1-based line of the block's first code line
    code: str
    words: frozenset[str]

    @property
    def not_here(self) -> str | None:
        """Why this block does not run on this CPU test, or None."""
        reasons = [NOT_HERE[w] for w in sorted(self.words & NOT_HERE.keys())]
        return "; ".join(reasons) or None


def _blocks(path: Path) -> list[Block]:
    """The ```python blocks of one page with their markers; a marker anywhere else, or an unknown word, fails."""
    page = str(path.relative_to(ROOT))
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = MARKER.match(lines[i])
        if m:
            words = set(m["words"].split())
            assert words and words <= WORDS, f"{page}:{i + 1}: docs-test words must be among {sorted(WORDS)}"
            nxt = FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
            assert nxt and nxt["lang"] == "python", f"{page}:{i + 1}: a docs-test marker must sit right above ```python"
        fence = FENCE.match(lines[i])  # outside a block every fence opens one (```python, ```bash, ```)
        if not fence:
            i += 1
            continue
        indent, start = len(fence["indent"]), i + 1
        end = start
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        assert end < len(lines), f"{page}:{i + 1}: unclosed code fence"
        if fence["lang"] == "python":
            above = MARKER.match(lines[i - 1]) if i else None
            words = frozenset(above["words"].split()) if above else frozenset()
            code = "\n".join(line[indent:] for line in lines[start:end])
            blocks.append(Block(page, start + 1, code, words))
        i = end + 1
    return blocks


def _chains() -> list[list[Block]]:
    chains: list[list[Block]] = []
    for path in PAGES:
        for n, block in enumerate(_blocks(path)):
            if "continue" in block.words:
                assert n, f"{block.page}:{block.line}: `continue` on a page's first block (nothing to continue)"
                chains[-1].append(block)
            else:
                chains.append([block])
    return chains


CHAINS = _chains()


def test_enough_blocks_run_on_a_cpu():
    runnable = [b for chain in CHAINS for b in chain if not b.not_here]
    assert len(runnable) >= MIN_RUNNABLE, f"only {len(runnable)} docs blocks run on a CPU (want >= {MIN_RUNNABLE})"
    pages = {b.page for b in runnable}
    assert {"docs/index.md", "docs/usage.md"} <= pages, f"the quick start and the usage page must run: {pages}"


@pytest.mark.parametrize("chain", CHAINS, ids=[f"{c[0].page}:{c[0].line}" for c in CHAINS])
def test_block_runs_as_written(chain: list[Block], tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    compiled = [
        # padded so a traceback's line numbers are the page's
        (b, compile("\n" * (b.line - 1) + b.code, b.page, "exec"))
        for b in chain
    ]
    namespace: dict = {"__name__": "__docs__"}
    for block, code in compiled:
        if not block.not_here:
            exec(code, namespace)
    passed = [f"{b.page}:{b.line} ({b.not_here})" for b in chain if b.not_here]
    if len(passed) == len(chain):
        pytest.skip(f"compiled, not run: {', '.join(passed)}")
