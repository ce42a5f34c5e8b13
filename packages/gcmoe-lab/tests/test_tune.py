"""The partition tuner (gcmoe_lab.tune) on a CPU: the choice rules on constructed timings (fake layers and timer),
the cache file it writes and gcmoe.policy reads, the ablation table, the CLI without a GPU. The policy's own rules
(precedence, validation) are tested beside it: packages/gcmoe/tests/test_policy.py."""

import json
from dataclasses import dataclass

import pytest
import torch

from gcmoe import policy as policy_mod
from gcmoe_core.config import MoEConfig
from gcmoe_core.testing import make_tokens, make_weights
from gcmoe_lab import tune

CFG = MoEConfig.ep_slice("deepseek-v3", 8, max_tokens_per_rank=256)
H200, SMS = "NVIDIA H200", 132
TOKENS = (1, 8, 32, 128, 256)


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("GCMOE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("GCMOE_COMM_SMS", raising=False)


@dataclass
class Case:
    name: str
    times: dict[int, tuple[float, ...]]  # comm SMs (0 = unpartitioned) -> µs per T in TOKENS
    comm_sms: int
    unpartitioned_above: int


BASE = (300.0, 320.0, 360.0, 420.0, 520.0)
CASES = [
    Case(
        "unpartitioned wins from T=128",
        {
            0: BASE,
            8: (270.0, 290.0, 340.0, 430.0, 560.0),
            16: (250.0, 270.0, 320.0, 425.0, 540.0),
            24: (255.0, 272.0, 318.0, 422.0, 530.0),  # total over T <= 32: 845 vs 16's 840
        },
        16,
        32,
    ),
    Case(
        "partition never loses",
        {0: BASE, 8: (280.0, 300.0, 340.0, 400.0, 500.0), 16: (260.0, 280.0, 330.0, 410.0, 510.0)},
        16,
        256,
    ),
    Case(
        "tie goes to the smaller size",
        {0: BASE, 16: (250.0, 270.0, 320.0, 400.0, 600.0), 24: (260.0, 260.0, 320.0, 390.0, 500.0)},
        16,
        128,
    ),
    Case(
        "a gain under 1 % does not count, and the run must be contiguous from the smallest T",
        {0: BASE, 16: (280.0, 318.0, 330.0, 400.0, 500.0)},  # T=8: 320 / 318 = 1.006
        16,
        1,
    ),
    Case(
        "the partition loses at the smallest T: never partition",
        {0: BASE, 16: (299.0, 300.0, 330.0, 400.0, 500.0)},
        0,
        0,
    ),
]


def fake_tune(case: Case, rounds: int = 3, **kw):
    """tune() over fake layers (the comm size itself) and a timer reading case.times, with some noise in one round
    that the median over rounds removes; returns (result, the order layers were built in)."""
    built: list[int] = []

    def make_layer(c):
        built.append(c)
        return c

    def time_fn(layer, t):
        noise = 50.0 if len(built) <= len(case.times) and layer == 0 else 0.0  # round 0 only, unpartitioned only
        return case.times[layer][TOKENS.index(t)] + noise

    sizes = [c for c in case.times if c]
    res = tune.tune(
        CFG, None, "cpu", TOKENS, sizes, iters=5, time_fn=time_fn, make_layer=make_layer, rounds=rounds, **kw
    )
    return res, built


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_tune_picks_comm_size_and_threshold(case):
    res, built = fake_tune(case)
    assert res["policy"] == {"comm_sms": case.comm_sms, "unpartitioned_above": case.unpartitioned_above}
    sizes = sorted(case.times)
    assert res["comm_sizes"] == sizes and res["tokens"] == list(TOKENS)
    assert res["times_us"] == {str(c): list(case.times[c]) for c in sizes}  # medians over rounds: noise gone
    n = len(sizes)
    assert built == [c for r in range(3) for c in sizes[r % n :] + sizes[: r % n]]  # rounds, rotated order


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_choose_policy_matches_the_rules(case):
    """The rules restated directly: argmin of the T <= 32 total (ties -> smaller), then the contiguous >= 1 % run."""
    small = [j for j, t in enumerate(TOKENS) if t <= 32]
    sizes = sorted(c for c in case.times if c)
    totals = {c: sum(case.times[c][j] for j in small) for c in sizes}
    best = min(c for c in sizes if totals[c] == min(totals.values()))
    run = 0
    for j, t in enumerate(TOKENS):
        if not case.times[0][j] >= 1.01 * case.times[best][j]:
            break
        run = t
    want = (best, run) if run else (0, 0)
    assert tune.choose_policy(TOKENS, case.times) == want == (case.comm_sms, case.unpartitioned_above)


def test_the_policy_reads_what_the_tuner_writes(monkeypatch):
    """The tuner's cache file is the one gcmoe.policy reads for this device and shape (and only for them); the
    environment still overrides it."""
    assert policy_mod.policy(CFG, H200, SMS) == policy_mod.Policy(0, 0, "default for NVIDIA H200")
    fake_tune(CASES[0], device_name=H200)
    path = policy_mod.cache_path(CFG, H200)
    assert path.exists() and path.parent.name == "tune"
    assert policy_mod.policy(CFG, H200, SMS) == policy_mod.Policy(16, 32, f"tuned {path}")
    assert policy_mod.policy(MoEConfig.ep_slice("deepseek-v4-flash", 8), H200, SMS).source == "default for NVIDIA H200"
    assert policy_mod.policy(CFG, "NVIDIA H100 80GB HBM3", SMS).source.startswith("generic default")
    monkeypatch.setenv("GCMOE_COMM_SMS", "40")
    assert policy_mod.policy(CFG, H200, SMS).source == "env GCMOE_COMM_SMS=40"


def test_cache_round_trip_and_contents():
    res, _ = fake_tune(CASES[0], device_name=H200, label="deepseek-v3")
    path = policy_mod.cache_path(CFG, H200)
    assert path.name == "h200-h7168-i2048-e32-k8-s1-ep1.json"
    assert json.loads(path.read_text()) == res
    assert res["key"] == policy_mod.shape_key(CFG, H200)  # what the policy reads (its literal: test_policy)
    assert res["meta"]["device"] == H200 and res["meta"]["torch"] == torch.__version__ and res["meta"]["date"]
    assert res["label"] == "deepseek-v3" and (res["iters"], res["rounds"]) == (5, 3)


def test_default_factory_builds_a_gcmoe_layer_per_comm_size():
    """Without make_layer, tune builds gcmoe.MoELayer(cfg, device, comm_sms=c).load(weights): every size computes
    the same output (here on the reference backend, which has no partition)."""
    cfg = MoEConfig(256, 128, 8, 2, 1, max_tokens_per_rank=8)
    x, ids, w = make_tokens(cfg, 4, seed=5)
    outs = {}

    def time_fn(layer, t):
        outs.setdefault(layer.options.comm_sms, layer(x, ids, w))
        return 100.0 if layer.options.comm_sms == 0 else 90.0

    res = tune.tune(cfg, make_weights(cfg, seed=3), "cpu", (1, 4), (8, 16), time_fn=time_fn, rounds=1)
    assert sorted(outs) == [0, 8, 16] and all(torch.equal(y, outs[0]) for y in outs.values())
    assert not outs[0].isnan().any() and outs[0].abs().sum() > 0
    assert res["backend"] == "reference" and res["policy"] == {"comm_sms": 8, "unpartitioned_above": 4}


def test_tune_rejects_bad_arguments():
    with pytest.raises(ValueError, match=r"comm_sizes: 12 SMs is not a valid"):
        tune.tune(CFG, None, "cpu", comm_sizes=(8, 12), time_fn=lambda layer, t: 1.0, make_layer=lambda c: c)
    with pytest.raises(ValueError, match="at least one partition size"):
        tune.tune(CFG, None, "cpu", comm_sizes=(0,), time_fn=lambda layer, t: 1.0, make_layer=lambda c: c)
    with pytest.raises(ValueError, match="positive token counts"):
        tune.tune(CFG, None, "cpu", tokens=(0, 8), time_fn=lambda layer, t: 1.0, make_layer=lambda c: c)
    with pytest.raises(ValueError, match="rounds and iters must be >= 1"):
        tune.tune(CFG, None, "cpu", time_fn=lambda layer, t: 1.0, make_layer=lambda c: c, rounds=0)
    with pytest.raises(ValueError, match="timing needs a CUDA device, got cpu"):
        tune.tune(CFG, None, "cpu", make_layer=lambda c: c)


def test_ablation_markdown_has_the_numbers_policy_and_command():
    case = CASES[0]
    res, _ = fake_tune(case, device_name=H200, label="deepseek-v3")
    md = tune.ablation_markdown(res)
    assert "| comm SMs | T=1 µs | T=1 ratio | T=8 µs |" in md
    assert "| 0 (unpartitioned) | 300.0 | 1.000 | 320.0 | 1.000 | 360.0 | 1.000 | 420.0 | 1.000 | 520.0 | 1.000 |" in md
    assert "| **16 (chosen)** | 250.0 | 0.833 | 270.0 | 0.844 | 320.0 | 0.889 | 425.0 | 1.012 | 540.0 | 1.038 |" in md
    assert "| 8 | 270.0 | 0.900 |" in md and "| 24 | 255.0 | 0.850 |" in md
    assert md.index("| 0 (unpartitioned)") < md.index("| 8 |") < md.index("| **16") < md.index("| 24 |")
    assert "comm_sms = 16" in md and "unpartitioned above T = 32" in md
    assert "gcmoe-lab tune --models deepseek-v3 --tokens 1 8 32 128 256 --comm-sizes 8 16 24 --iters 5" in md
    assert "H=7168, I=2048, 32 local experts, top-8" in md and H200 in md

    never, _ = fake_tune(CASES[-1], device_name=H200)
    assert "never partition" in tune.ablation_markdown(never)


def test_cli_parser_defaults_and_no_gpu_exit(monkeypatch, capsys):
    ap = tune.parser()
    args = ap.parse_args([])
    assert args.models == ["deepseek-v3", "deepseek-v4-flash"]
    assert (args.tokens, args.comm_sizes, args.iters, args.out) == (
        [1, 8, 32, 128, 256],
        [8, 16, 24, 32, 40, 48],
        20,
        None,
    )
    argv = ["--models", "glm-5", "--tokens", "4", "--comm-sizes", "16", "--out", "d"]
    args = ap.parse_args(argv)
    assert (args.models, args.tokens, args.comm_sizes, args.out) == (["glm-5"], [4], [16], "d")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert tune.main(argv) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
