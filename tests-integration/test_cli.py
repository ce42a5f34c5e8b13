"""The command line end to end on the current machine (the reference backend on a CPU)."""

import json
import subprocess
import sys

import pytest


def _gcmoe(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gcmoe.cli", *args], capture_output=True, text=True, timeout=900)


def test_info_json():
    r = _gcmoe("info", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["packages"]["gcmoe"] == "0.1.0" and d["backends"]["reference"] == "runnable"
    assert set(d["backends"]) == {"reference", "sm90", "sm103"}


def test_demo_small_layer_is_checked():
    r = _gcmoe("demo", "--shape", "512,256,16,4,1", "--tokens", "3", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["ok"] and d["calc_diff"] <= 1e-3 and d["backend"] in ("reference", "sm90", "sm103")
    assert d["output_norm"] > 0


def test_demo_fails_loudly_on_bad_backend():
    r = _gcmoe("demo", "--shape", "512,256,16,4,1", "--backend", "tpu")
    assert r.returncode != 0 and "unknown backend 'tpu'" in r.stderr


def test_bench_cli_writes_json_markdown_plot(tmp_path):
    """`gcmoe bench` (gcmoe-lab's bench, handed over) on this machine with every output; on a CPU: the reference
    backend, no floor."""
    paths = {k: tmp_path / f"b.{k}" for k in ("json", "md", "png")}
    shape = "custom:512,256,16,4,1"
    r = _gcmoe(
        "bench", "--models", shape, "--tokens", "2", "--iters", "2", "--variants", "eager", "torch_fp8",
        "--json", str(paths["json"]), "--markdown", str(paths["md"]), "--plot", str(paths["png"]),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    d = json.loads(paths["json"].read_text())
    eager, fp8 = d["records"]
    assert (eager["variant"], fp8["variant"]) == ("eager", "torch_fp8") and eager["tokens"] == fp8["tokens"] == 2
    assert eager["median_us"] > 0 and fp8["median_us"] > 0 and 0 < fp8["calc_diff"] <= 1e-2
    assert (
        d["meta"]["reproduce"].startswith("gcmoe-lab bench ") and "--variants eager torch_fp8" in d["meta"]["reproduce"]
    )
    if d["meta"]["device"] == "CPU":
        assert eager["backend"] == "reference" and "floor_us" not in eager
        assert f"layer backend {shape}: reference" in r.stdout
    assert paths["md"].read_text() in r.stdout + "\n" and f"| {shape} | 2 |" in r.stdout
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_rejects_bad_arguments_before_measuring():
    r = _gcmoe("bench", "--variants", "fastest")
    assert r.returncode == 2 and "invalid choice: 'fastest'" in r.stderr
    r = _gcmoe("bench", "--models", "llama")
    assert r.returncode == 2 and "unknown model 'llama'" in r.stderr and "Traceback" not in r.stderr
    r = _gcmoe("bench", "--models", "custom:512,256")
    assert r.returncode == 2 and "expected custom:H,I,E,top_k,shared" in r.stderr


def test_tune_is_wired():
    r = _gcmoe("--help")
    assert r.returncode == 0 and "tune" in r.stdout and "bench" in r.stdout
    r = _gcmoe("tune", "--help")
    assert r.returncode == 0 and "--comm-sizes" in r.stdout and "usage: gcmoe tune" in r.stdout


BLOCK_LAB = "import sys; sys.modules['gcmoe_lab'] = None; from gcmoe.cli import main; sys.exit(main(sys.argv[1:]))"


@pytest.mark.parametrize("command", ["bench", "tune"])
def test_bench_and_tune_without_the_lab_say_how_to_install_it(command):
    """`gcmoe bench` / `gcmoe tune` hand over to gcmoe-lab; where it is not installed (an import of it fails here)
    they exit 2 with one line saying how to get it, and the product's own commands still work."""
    r = subprocess.run(
        [sys.executable, "-c", BLOCK_LAB, command, "--help"], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip() == f"gcmoe {command} needs gcmoe-lab: pip install gcmoe-lab / uv sync --package gcmoe-lab"
    r = subprocess.run([sys.executable, "-c", BLOCK_LAB, "--help"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "demo" in r.stdout


@pytest.mark.slow
def test_bench_default_grid_on_a_cpu(tmp_path):
    """With no arguments on a CPU: the reference backend on deepseek-v4-flash's EP8 slice at T = 1 and 4."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("the default GPU grid is the GPU run's job")
    out = tmp_path / "b.json"
    r = _gcmoe("bench", "--json", str(out))
    assert r.returncode == 0, r.stderr
    recs = json.loads(out.read_text())["records"]
    assert [(x["model"], x["tokens"], x["variant"]) for x in recs] == [
        ("deepseek-v4-flash", t, v) for t in (1, 4) for v in ("eager", "torch_fp8")
    ]
    assert all(x["median_us"] > 0 for x in recs) and {x["backend"] for x in recs[::2]} == {"reference"}
    assert "| deepseek-v4-flash | 4 |" in r.stdout
