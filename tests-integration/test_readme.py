"""The README's two commands are what CI and users run."""

import re
from pathlib import Path

ROOT = Path(__file__).parents[1]


def _commands() -> list[str]:
    block = re.search(r"## The two commands\n\n```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    return [line.split("  #")[0].strip() for line in block.strip().splitlines()]


def test_ci_runs_the_readme_test_command():
    main_job, tests = _commands()
    assert "gcmoe demo" in main_job and "nox" in tests
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert tests in [line.strip() for line in ci], f"{tests!r} not in .ci/run"
