"""The `gcmoe` command forgives: a bad value for any option exits 2 with one line naming it (never a traceback);
`--version`; `--help` imports no torch; the demo runs gpt-oss (H = I = 2880, padded by the layer) and reports both
the kernel's agreement with its reference and the quantisation error against the bf16 layer."""

import json
import subprocess
import sys

import pytest
import torch

from gcmoe.cli import main

SMALL = ["--shape", "512,256,16,4,1", "--tokens", "2"]
NO_CUDA = f"cuda:{torch.cuda.device_count()}"  # a CUDA device this machine lacks (plain "cuda" on a CPU box)
BAD = {  # (argv, what the one line says)
    "no command": ([], "required: cmd"),
    "unknown command": (["serve"], "invalid choice: 'serve'"),
    "unknown option": (["demo", "--fast"], "unrecognized arguments: --fast"),
    "info --json value": (["info", "--json=yes"], "ignored explicit argument 'yes'"),
    "shape arity": (["demo", "--shape", "256,128,8,2"], "expected 5 integers H,I,E,top_k,shared, got 4"),
    "shape not int": (["demo", "--shape", "256,128,8,2,x"], "argument --shape: 'x' is not an integer"),
    "shape limit": (["demo", "--shape", "256,8192,8,2,0"], "argument --shape: intermediate_size: I = 8192"),
    "shape top_k > E": (["demo", "--shape", "256,128,2,4,0"], "top_k = 4 exceeds the number of experts"),
    "shape with model": (["demo", "--shape", "256,128,8,2,0", "--model", "glm-5"], "not allowed with argument"),
    "model": (["demo", "--model", "foo"], "unknown model 'foo'; known: deepseek-v4-flash"),
    "ep not int": (["demo", "--ep", "two"], "argument --ep: 'two' is not an integer"),
    "ep zero": (["demo", "--ep", "0"], "argument --ep: '0' is not an integer in [1,"),
    "ep divides E": (["demo", "--ep", "3"], "argument --model/--ep: ep_size: E = 256 must be divisible by P = 3"),
    "ep limit": (["demo", "--model", "deepseek-v4-pro", "--ep", "96"], "P = 96 exceeds the limit"),
    "tokens beyond max": (["demo", "--tokens", "5000"], "argument --tokens: 5000 exceeds the limit of 4096"),
    "tokens zero": (["demo", "--tokens", "0"], "argument --tokens: '0' is not an integer in [1,"),
    "tokens float": (["demo", "--tokens", "2.5"], "argument --tokens: '2.5' is not an integer"),
    "backend": (["demo", *SMALL, "--backend", "cuda"], "argument --backend: backend: unknown backend 'cuda'"),
    "device name": (["demo", *SMALL, "--device", "gpu"], "argument --device: 'gpu' is not cpu, cuda or cuda:N"),
    "device missing": (["demo", *SMALL, "--device", NO_CUDA], f"argument --device: {NO_CUDA}: no CUDA device"),
    "seed negative": (["demo", "--seed", "-1"], "argument --seed: '-1' is not an integer in [0,"),
    "seed too big": (["demo", "--seed", str(2**40)], "argument --seed:"),
    "demo --json value": (["demo", "--json=1"], "ignored explicit argument '1'"),
}
if not torch.cuda.is_available():
    BAD["backend unavailable"] = (["demo", *SMALL, "--backend", "sm90"], "backend 'sm90' cannot run on cpu")


@pytest.mark.parametrize("argv, says", BAD.values(), ids=BAD.keys())
def test_a_bad_value_exits_2_with_one_line(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    out, err = capsys.readouterr()
    assert e.value.code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("gcmoe") and ": error: " in err and says in err, err


def test_the_installed_command_says_one_line_not_a_traceback():
    r = subprocess.run(
        [sys.executable, "-m", "gcmoe.cli", "demo", "--shape", "256,128,8,2"], capture_output=True, text=True
    )
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr
    assert r.stderr.splitlines() == [
        "gcmoe demo: error: argument --shape: '256,128,8,2': expected 5 integers H,I,E,top_k,shared, got 4 "
        "(see gcmoe demo --help)"
    ]


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out == "gcmoe 0.1.0\n"


@pytest.mark.parametrize("argv", [["--help"], ["demo", "--help"], ["info", "--help"], ["--version"]])
def test_help_imports_no_torch(argv):
    code = f"import sys\nfrom gcmoe.cli import main\ntry:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
    code += "assert 'torch' not in sys.modules, 'torch imported'"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0 and ("usage: gcmoe" in r.stdout or r.stdout == "gcmoe 0.1.0\n"), r.stderr


def _demo(capsys, *argv: str) -> tuple[int, str]:
    rc = main(["demo", "--backend", "reference", "--device", "cpu", *argv])
    return rc, capsys.readouterr().out


def test_demo_reports_the_kernel_check_and_the_quantisation_error(capsys):
    rc, out = _demo(capsys, *SMALL)
    lines = out.splitlines()
    assert rc == 0 and len(lines) == 4 and "backend reference" in lines[0]
    assert lines[2].startswith("  kernel check:  calc_diff ") and "float64 loop" in lines[2] and "-> OK" in lines[2]
    assert lines[3].startswith("  quantisation:  calc_diff ") and "vs the unquantised bf16 layer" in lines[3]
    rc, out = _demo(capsys, *SMALL, "--json")
    d = json.loads(out)
    assert rc == 0 and d["ok"] and d["calc_diff"] <= 1e-3
    q = d["quantisation"]  # FP8 x MXFP4 against bf16: a real, bounded error (the kernel check shares it: ~0)
    assert 1e-3 < q["calc_diff"] < 0.1 and 0.9 < q["cosine"] < 0.9999 and q["vs"] == "the unquantised bf16 layer"


@pytest.mark.slow
def test_demo_runs_gpt_oss(capsys):
    """gpt-oss (H = I = 2880, not multiples of 128): the layer pads; the check pads as the layer does and applies the
    clamped SwiGLU with biases."""
    rc, out = _demo(capsys, "--model", "gpt-oss-20b", "--tokens", "2", "--json")
    d = json.loads(out)
    assert rc == 0 and d["ok"] and d["calc_diff"] <= 1e-3 and d["config"]["hidden_size"] == 2880
    assert 0.9 < d["quantisation"]["cosine"] < 0.9999


def test_lazy_names_and_their_type_checking_imports_agree():
    """gcmoe/__init__.py names each public name twice: in _HOMES (what __getattr__ imports) and in its TYPE_CHECKING
    block (what type checkers and the API docs read); both lists, and the modules, must agree."""
    import ast
    from pathlib import Path

    import gcmoe

    tree = ast.parse(Path(gcmoe.__file__).read_text())
    guarded = next(n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", "") == "TYPE_CHECKING")
    seen = {}
    for node in guarded.body:
        home = node.module if node.level == 0 else f"gcmoe.{node.module}"
        seen.update({a.name: home for a in node.names})
    assert seen == gcmoe._HOMES
    assert all(getattr(gcmoe, name) is not None for name in gcmoe.__all__)
