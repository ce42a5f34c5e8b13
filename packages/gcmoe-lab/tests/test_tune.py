"""The partition tuner (gcmoe_lab.tune) on a CPU: the choice rules on constructed timings (fake layers and timer),
one-batch and two-batch; the cache file they write (each keeping the other's part) and gcmoe.policy reads; the
ablation tables; the CLI without a GPU. On a GPU: a small two-batch tune, end to end. The policy's own rules
(precedence, validation) are tested beside it: packages/gcmoe/tests/test_policy.py."""

import json
import math
from dataclasses import dataclass

import pytest
import torch

from gcmoe import policy as policy_mod
from gcmoe_core.config import MoEConfig
from gcmoe_core.testing import make_tokens, make_weights
from gcmoe_lab import step, tune

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
    """Unset --models / --comm-sizes take the schedule's defaults in main (MODELS, COMM_SIZES; with --two-batch
    TWO_BATCH_MODELS, TWO_BATCH_COMM_SIZES)."""
    ap = tune.parser()
    args = ap.parse_args([])
    assert (args.two_batch, args.models, args.comm_sizes, args.layers) == (False, None, None, 12)
    assert (args.tokens, args.iters, args.out) == ([1, 8, 32, 128, 256], 20, None)
    assert tune.MODELS == ("deepseek-v3", "deepseek-v4-flash") and tune.COMM_SIZES == (8, 16, 24, 32, 40, 48)
    assert tune.TWO_BATCH_MODELS == step.MODELS == ("deepseek-v3", "deepseek-v4-flash", "qwen3-235b")
    assert tune.TWO_BATCH_COMM_SIZES == (8, 16, 24) and tune.TWO_BATCH_LAYERS == 12
    argv = ["--models", "glm-5", "--tokens", "4", "--comm-sizes", "16", "--out", "d"]
    args = ap.parse_args(argv)
    assert (args.models, args.tokens, args.comm_sizes, args.out) == (["glm-5"], [4], [16], "d")
    args = ap.parse_args(["--two-batch", "--layers", "6", "--models", "qwen3-235b"])
    assert (args.two_batch, args.layers, args.models) == (True, 6, ["qwen3-235b"])

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert tune.main(argv) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert tune.main(["--two-batch"]) == 2
    assert "nothing was measured" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------------------- two-batch
LAYERS = 4


def fake_tune_two_batch(case: Case, rounds: int = 3, **kw):
    """tune_two_batch() over fake steps (LAYERS copies of the comm size) and a timer reading case.times, with some
    noise in one round that the median over rounds removes; returns (result, the order steps were built in)."""
    built: list[int] = []

    def make_layers(c):
        built.append(c)
        return [c] * LAYERS

    def time_fn(moes, t):
        assert moes == [moes[0]] * LAYERS
        noise = 50.0 if len(built) <= len(case.times) and moes[0] == 0 else 0.0
        return case.times[moes[0]][TOKENS.index(t)] + noise

    sizes = [c for c in case.times if c]
    fake = dict(time_fn=time_fn, make_layers=make_layers, rounds=rounds, layers=LAYERS)
    return tune.tune_two_batch(CFG, None, "cpu", TOKENS, sizes, iters=5, **fake, **kw), built


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_tune_two_batch_decides_by_the_same_rules(case):
    """The two-batch sweep: the same rounds (rotated order, medians) and choose_policy's decision."""
    res, built = fake_tune_two_batch(case)
    sizes = sorted(case.times)
    assert res["policy"] == {"comm_sms": case.comm_sms, "unpartitioned_above": case.unpartitioned_above}
    assert (res["policy"]["comm_sms"], res["policy"]["unpartitioned_above"]) == tune.choose_policy(TOKENS, case.times)
    assert res["times_us"] == {str(c): list(case.times[c]) for c in sizes}
    assert res["comm_sizes"] == sizes and res["tokens"] == list(TOKENS) and res["layers"] == LAYERS
    n = len(sizes)
    assert built == [c for r in range(3) for c in sizes[r % n :] + sizes[: r % n]]
    assert "two micro-batches" in res["method"] and f"{LAYERS}-layer step" in res["method"]


def test_two_batch_without_a_one_batch_tune():
    """No cache file yet: the two-batch tune writes one whose one-batch policy is (0, 0) with a note, and the policy
    reads the two-batch entry from it."""
    res, _ = fake_tune_two_batch(CASES[0], device_name=H200, label="deepseek-v3")
    path = policy_mod.cache_path(CFG, H200)
    data = json.loads(path.read_text())
    assert data["key"] == policy_mod.shape_key(CFG, H200) and data["label"] == "deepseek-v3"
    assert data["policy"] == {"comm_sms": 0, "unpartitioned_above": 0} and data["note"] == tune.NOT_TUNED
    assert data["two_batch"] == {"comm_sms": 16, "unpartitioned_above": 32} == res["policy"]
    assert data["two_batch_tune"] == res
    p = policy_mod.policy(CFG, H200, SMS)
    assert p == policy_mod.Policy(0, 0, f"tuned {path}", 16, 32)
    assert [(p.mode_for(t), p.mode_for(t, two_batch=True)) for t in (1, 32, 128)] == [(0, 16), (0, 16), (0, 0)]


def test_each_tuner_keeps_the_others_part():
    """one-batch then two-batch: both entries; one-batch again: the two-batch part stays, and the note is gone."""
    one, _ = fake_tune(CASES[1], device_name=H200)  # one-batch: 16 up to 256
    two, _ = fake_tune_two_batch(CASES[3], device_name=H200)  # two-batch: 16 up to 1
    path = policy_mod.cache_path(CFG, H200)
    data = json.loads(path.read_text())
    assert {k: data[k] for k in one} == one and "note" not in data
    assert data["two_batch"] == {"comm_sms": 16, "unpartitioned_above": 1} and data["two_batch_tune"] == two
    assert policy_mod.policy(CFG, H200, SMS) == policy_mod.Policy(16, 256, f"tuned {path}", 16, 1)

    fake_tune_two_batch(CASES[-1], device_name=H200)  # never partition two-batch calls
    assert policy_mod.policy(CFG, H200, SMS) == policy_mod.Policy(16, 256, f"tuned {path}", 0, 0)
    again, _ = fake_tune(CASES[0], device_name=H200)  # one-batch: 16 up to 32
    assert again == json.loads(path.read_text()) and again["two_batch"] == {"comm_sms": 0, "unpartitioned_above": 0}
    assert policy_mod.policy(CFG, H200, SMS) == policy_mod.Policy(16, 32, f"tuned {path}", 0, 0)


@pytest.mark.parametrize("old", ["{not json", json.dumps({"key": {"device": "other"}, "two_batch": {}})])
def test_a_file_of_another_key_or_unreadable_is_replaced(old):
    path = policy_mod.cache_path(CFG, H200)
    path.parent.mkdir(parents=True)
    path.write_text(old)
    fake_tune_two_batch(CASES[0], device_name=H200)
    data = json.loads(path.read_text())
    assert data["key"] == policy_mod.shape_key(CFG, H200) and data["note"] == tune.NOT_TUNED
    path.write_text(old)
    res, _ = fake_tune(CASES[0], device_name=H200)
    assert json.loads(path.read_text()) == res and "two_batch" not in res


def test_two_batch_default_factory_builds_a_pool_per_comm_size():
    """Without make_layers, tune_two_batch builds `layers` gcmoe.MoELayer(cfg, device, comm_sms=c, pool=...) per
    size, one LayerPool per size kept over the rounds: here on the reference backend every size's two-batch step
    (the step's stand-ins, gcmoe_lab.step) computes the same outputs."""
    cfg = MoEConfig(256, 128, 8, 2, 1, max_tokens_per_rank=8)
    standins = step.make_standins(cfg, 2, "cpu", seed=1)
    outs, pools = {}, {}

    def time_fn(moes, t):
        c = moes[0].options.comm_sms
        assert len(moes) == 2 and {m.options.comm_sms for m in moes} == {c}
        assert len({id(m.options.pool) for m in moes}) == 1
        pools.setdefault(c, set()).add(id(moes[0].options.pool))
        xa, xb = step.step_inputs(cfg, t, 0, "cpu")
        outs.setdefault((c, t), step.run_two_batch(standins, moes, xa, xb, None))
        return 100.0 if c == 0 else 90.0

    res = tune.tune_two_batch(cfg, make_weights(cfg, seed=3), "cpu", (1, 4), (8, 16), time_fn=time_fn, layers=2)
    assert sorted(pools) == [0, 8, 16] and all(len(v) == 1 for v in pools.values())  # one pool per size
    assert len(set().union(*pools.values())) == 3  # and not shared between sizes
    for t in (1, 4):
        ya, yb = outs[(0, t)]
        assert not ya.isnan().any() and ya.abs().sum() > 0 and not torch.equal(ya, yb)
        assert all(torch.equal(outs[(c, t)][0], ya) and torch.equal(outs[(c, t)][1], yb) for c in (8, 16))
    assert res["backend"] == "reference" and res["policy"] == {"comm_sms": 8, "unpartitioned_above": 4}


def test_tune_two_batch_rejects_bad_arguments():
    ok = dict(time_fn=lambda moes, t: 1.0, make_layers=lambda c: [c])
    with pytest.raises(ValueError, match=r"tune_two_batch: comm_sizes: 12 SMs is not a valid"):
        tune.tune_two_batch(CFG, None, "cpu", comm_sizes=(8, 12), **ok)
    with pytest.raises(ValueError, match="tune_two_batch: layers must be >= 1"):
        tune.tune_two_batch(CFG, None, "cpu", layers=0, **ok)
    with pytest.raises(ValueError, match="tune_two_batch: timing needs a CUDA device, got cpu"):
        tune.tune_two_batch(CFG, None, "cpu", make_layers=lambda c: [c])


def test_two_batch_ablation_markdown():
    res, _ = fake_tune_two_batch(CASES[0], device_name=H200, label="deepseek-v3")
    md = tune.ablation_markdown(res)
    assert md.startswith(f"## deepseek-v3 — two micro-batches of a {LAYERS}-layer step — H=7168, I=2048")
    assert "| **16 (chosen)** | 250.0 | 0.833 |" in md and "| 0 (unpartitioned) | 300.0 | 1.000 |" in md
    assert "Two-batch policy: comm_sms = 16" in md and "unpartitioned above T = 32" in md
    want = f"gcmoe-lab tune --two-batch --layers {LAYERS} --models deepseek-v3 --tokens 1 8 32 128 256 --comm-sizes"
    assert want in md
    one = tune.ablation_markdown(fake_tune(CASES[0], device_name=H200, label="deepseek-v3")[0])
    assert "\nPolicy: comm_sms = 16" in one and "--two-batch" not in one


@pytest.mark.gpu
def test_gpu_tune_two_batch():
    """A small two-batch tune on the GPU: real captured two-batch steps per comm size, the record and the cache entry
    the layer's policy then reads."""
    cfg = MoEConfig(512, 256, 16, 4, 1, max_tokens_per_rank=256)
    dev = torch.device("cuda", torch.cuda.current_device())
    res = tune.tune_two_batch(cfg, make_weights(cfg, 0, dev), dev, (1, 8), (8,), iters=3, layers=2, rounds=1)
    assert res["comm_sizes"] == [0, 8] and res["backend"] == "sm90" and res["layers"] == 2
    assert all(us > 0 and math.isfinite(us) for row in res["times_us"].values() for us in row)
    name = torch.cuda.get_device_name(dev)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    p = policy_mod.policy(cfg, name, sms)
    assert (p.two_batch_comm_sms, p.two_batch_unpartitioned_above) == tuple(res["policy"].values())
