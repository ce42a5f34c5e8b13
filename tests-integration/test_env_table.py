"""The README's GCMOE_* table lists exactly the variables gcmoe reads."""

import re
from pathlib import Path

from gcmoe_core.env import ENV_VARS


def test_readme_env_table_matches_code():
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    documented = set(re.findall(r"^\| `(GCMOE_[A-Z_]+)` \|", readme, flags=re.M))
    assert documented == {v.name for v in ENV_VARS}
    code = set()
    for p in (Path(__file__).parents[1] / "packages").rglob("*.py"):
        code |= set(re.findall(r"\"(GCMOE_[A-Z_]+)\"", p.read_text()))
    assert code <= documented, code - documented
