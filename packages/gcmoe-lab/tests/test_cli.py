"""The `gcmoe-lab` command on a CPU: its commands, the probe registry (every probe imports, has main and answers
--help), and the errors it gives before measuring anything."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from gcmoe_lab import cli, probes


def _lab(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gcmoe_lab", *args], capture_output=True, text=True, timeout=300)


def test_help_lists_the_commands():
    r = _lab("--help")
    assert r.returncode == 0
    for name in ("bench", "tune", "multigpu", "probe"):
        assert name in r.stdout
    r = _lab()
    assert r.returncode == 2 and "COMMAND" in r.stderr
    r = _lab("measure")
    assert r.returncode == 2 and "invalid choice: 'measure'" in r.stderr


def test_probe_lists_the_probes_and_rejects_an_unknown_one(capsys):
    assert cli.main(["probe"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in probes.PROBES)
    assert cli.main(["probe", "split_sweep"]) == 2
    assert "unknown probe 'split_sweep'" in capsys.readouterr().err


@pytest.mark.parametrize("name", list(probes.PROBES))
def test_every_probe_imports_and_answers_help(name, capsys):
    module = probes.load(name)
    assert module.__name__ == probes.PROBES[name][0] and module.__doc__
    with pytest.raises(SystemExit) as e:
        cli.main(["probe", name, "--help"])
    assert e.value.code == 0
    assert f"gcmoe-lab probe {name}" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["bench", "tune", "multigpu"])
def test_commands_answer_help(command):
    r = _lab(command, "--help")
    assert r.returncode == 0, r.stderr
    assert f"gcmoe-lab {command}" in r.stdout


def test_nothing_in_the_product_imports_the_lab():
    """The lab sits beside the product: importing every product package pulls in no gcmoe_lab module (the product's
    `gcmoe bench` / `gcmoe tune` import it only when called)."""
    code = (
        "import sys\n"
        "for m in ('gcmoe', 'gcmoe.cli', 'gcmoe.backends.sm90', 'gcmoe_core', 'gcmoe_comm', 'gcmoe_greenctx', "
        "'gcmoe_gemm_sm90', 'gcmoe_gemm_sm103'):\n"
        "    __import__(m)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'gcmoe_lab'))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
    assert importlib.util.find_spec("gcmoe_lab") is not None
