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


@pytest.mark.slow
def test_bench_reference_table(tmp_path):
    out = tmp_path / "b.json"
    r = subprocess.run(
        [sys.executable, "-m", "gcmoe.cli", "bench", "--models", "glm-4.5", "--tokens", "1", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stderr
    rec = json.loads(out.read_text())["records"][0]
    assert rec["model"] == "glm-4.5" and rec["median_us"] > 0 and "| glm-4.5 |" in r.stdout
