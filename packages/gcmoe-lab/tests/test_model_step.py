"""`gcmoe-lab bench --model-step` on a CPU: the step it builds is the model's layers called one by one (checked
against gcmoe_core.reference, not through MoELayer), two micro-batches are two steps, the pair's tuned variant (timed
where its policy partitions, the unpartitioned step's twin where it does not), the targets' format and verdicts, the
model table (layer counts, qwen3-235b's lab shape), the computed P = 8 memory, and the CLI flags with a tiny run's
JSON and markdown. On a GPU: a small captured step is exact against its eager self, the pair tuned first."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from gcmoe.policy import Policy
from gcmoe_core.config import MoEConfig
from gcmoe_core.reference import moe_reference
from gcmoe_core.testing import make_weights
from gcmoe_lab import bench, cli, model_step

SMALL = "custom:256,128,8,2,1"  # H, I, E, top_k, shared
ISSUE_TARGETS = {  # issue #48's names and limits
    "memory_58_layers_p1_gb": 1.0,
    "memory_58_layers_p8_gb": 1.0,
    "load_s_per_layer": 1.0,
    "step_over_sum_max": 1.03,
    "two_batch_over_two_steps_max": 1.0,
    "partitioned_over_unpartitioned_two_batch_p1_min": 1.0,
    "eager_host_us_per_layer": 15.0,
    "layers_captured": 94,
}


def _model(n: int = 3, seed: int = 0):
    cfg = model_step.model_config(SMALL)
    weights = make_weights(cfg, seed=seed)
    layers, secs = model_step.build_layers(cfg, weights, n, "cpu")
    assert len(secs) == n and all(s > 0 for s in secs)
    return cfg, weights, layers, model_step.make_standins(cfg, n, "cpu", seed)


def test_step_is_the_layers_one_by_one():
    """x -> x + layer(rms_norm(x) @ W_attn, top-k of softmax(h @ W_router), renormalised), layer after layer, each
    layer being the reference of the one MoEWeights; the layers hold distinct copies of the packed weights."""
    cfg, weights, layers, standins = _model()
    x = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    y = model_step.run_step(standins, layers, x)
    ref = x
    for s in standins:
        h = torch.nn.functional.rms_norm(ref, (cfg.hidden_size,)) @ s.w_attn
        p = torch.softmax((h @ s.w_router).float(), dim=-1)
        w, ids = torch.topk(p, cfg.top_k, dim=-1)
        assert (ids < cfg.num_experts).all() and torch.unique(ids).numel() > 1
        ref = ref + moe_reference(h, ids, w / w.sum(dim=-1, keepdim=True), weights)
    assert torch.isfinite(y.float()).all() and y.float().norm() > x.float().norm()  # the layers added something
    assert torch.equal(y, ref)
    assert model_step.packed_bytes(layers) == 3 * model_step.packed_bytes(layers[:1]) > 0  # three copies, not one
    host: list[float] = []
    assert torch.equal(model_step.run_step(standins, layers, x, host), y) and len(host) == 3


def test_two_micro_batches_are_two_steps():
    _, _, layers, standins = _model()
    g = torch.Generator().manual_seed(2)
    xa, xb = (torch.randn(n, 256, generator=g).to(torch.bfloat16) for n in (3, 4))
    ya, yb = model_step.run_two_batch(standins, layers, xa, xb, None)
    assert torch.equal(ya, model_step.run_step(standins, layers, xa))
    assert torch.equal(yb, model_step.run_step(standins, layers, xb))


def test_captured_reports_a_mismatch_and_an_error():
    """The bit-for-bit check names what differs; a variant that fails is recorded, the others go on."""
    clock = model_step.Clock(torch.device("cpu"), iters=1)
    calls = iter([torch.zeros(2), torch.ones(2)])
    runs, rec = model_step.captured(
        clock, {"flaky": lambda: next(calls), "broken": lambda: 1 / 0, "fine": lambda: torch.ones(2)}
    )
    assert set(runs) == {"flaky", "fine"} and rec["exact_fine"] and not rec["exact_flaky"]
    assert rec["mismatch_flaky"].startswith("2 element(s) differ")
    assert rec["broken_error"].startswith("ZeroDivisionError")


def test_model_table():
    assert model_step.MOE_LAYERS == {"deepseek-v3": 58, "deepseek-v4-flash": 43, "qwen3-235b": 94}
    assert model_step.model_config("deepseek-v3") == MoEConfig.ep_slice("deepseek-v3", 8, max_tokens_per_rank=256)
    q = model_step.model_config("qwen3-235b")
    assert (q.hidden_size, q.intermediate_size, q.num_experts, q.top_k, q.num_shared_experts) == (4096, 1536, 16, 8, 0)
    opts = model_step.Options()
    model_step.validate(["deepseek-v3", "qwen3-235b", SMALL], [1, 256], opts)
    for models, tokens, o, what in (
        (["glm-4.5"], None, opts, "no layer count"),
        (["nope"], None, model_step.Options(layers=2), "unknown model"),
        (None, [512], opts, "token counts"),
        (None, None, model_step.Options(layers=0), "--layers must be >= 1"),
        (None, None, model_step.Options(peer_layers=-1), "--peer-layers must be >= 0"),
    ):
        with pytest.raises(ValueError, match=what):
            model_step.validate(models, tokens, o)


def test_p8_memory_per_pool():
    """At P = 8 each lane holds at least the ring's rows (P T k routed + T S shared, H FP8 bytes each, plus I bytes of
    W1 output each) and the combine buffer (T (k + S) rows of H bf16): 186 MB for DeepSeek-V3; two lanes per pool."""
    p8 = model_step.p8_memory_gb()
    rows = 8 * 256 * 8 + 256
    least = rows * (7168 + 2048) + 256 * 9 * 7168 * 2
    assert 2 * least / 1e9 <= p8 <= 1.2 * 2 * least / 1e9
    assert model_step.p8_memory_gb(lanes=1) == pytest.approx(p8 / 2)
    assert model_step.p8_memory_gb("qwen3-235b") < p8  # smaller H, no shared expert


def _gpu_like_result() -> dict:
    models = {
        "deepseek-v3": {
            "layers": 58,
            "memory": {"beyond_packed_gb": {"captured": {"device": 0.8, "allocated": 0.5}}},
            "load": {"warmup_s_per_layer": 0.2},
            "host": {"check1": {"median_us": 20.0}, "check0": {"median_us": 9.0}},
            "layers_captured": 58,
        },
        "qwen3-235b": {
            "layers": 94,
            "load": {"warmup_s_per_layer": 1.5},
            "host": {"check1": {"median_us": 12.0}},
            "layers_captured": 94,
        },
        "deepseek-v4-flash": {"layers": 43, "layers_captured": "43 layers at T = 256: RuntimeError: capture"},
    }
    pair = lambda tuned, forced: {"tuned_over_unpartitioned": tuned, "forced_partitioned_over_unpartitioned": forced}
    records = [
        {"step_over_sum": 1.01, "two_batch_over_two_steps": 0.9, **pair(1.02, 0.95)},
        {"step_over_sum": 1.05, "two_batch_over_two_steps": 0.8, **pair(0.99, 1.04)},
        {"step_over_sum": 1.0, "two_batch_over_two_steps": 0.8, **pair(1.0, 0.89), "tuned_same_as_unpartitioned": True},
        {"error": "RuntimeError: boom"},
    ]
    return {"meta": {"device_kind": "cuda:0"}, "models": models, "records": records}


def test_targets_of_a_gpu_run():
    t = model_step.targets(_gpu_like_result())
    assert {k: v["limit"] for k, v in t.items()} == ISSUE_TARGETS
    assert all(set(v) == {"value", "limit", "holds", "note"} and isinstance(v["holds"], bool) for v in t.values())
    got = {k: (v["value"], v["holds"]) for k, v in t.items()}
    assert got == {
        "memory_58_layers_p1_gb": (0.5, True),  # tensors the allocator holds (the device figure in the note)
        "memory_58_layers_p8_gb": (model_step.p8_memory_gb(), True),
        "load_s_per_layer": (1.5, False),  # the worst model
        "step_over_sum_max": (1.05, False),
        "two_batch_over_two_steps_max": (0.9, True),
        "partitioned_over_unpartitioned_two_batch_p1_min": (0.99, False),  # the tuned policy's; holds when >= 1
        "eager_host_us_per_layer": (9.0, True),  # the host's own work: checks off
        "layers_captured": (94, True),  # the failed capture's message is not a count
    }
    assert "device level 0.80 GB" in t["memory_58_layers_p1_gb"]["note"]
    assert "tuned policy" in t["partitioned_over_unpartitioned_two_batch_p1_min"]["note"]
    res = _gpu_like_result()
    res["models"]["deepseek-v3"]["layers"] = 30  # not the 58-layer step the target names
    t = model_step.targets(res)["memory_58_layers_p1_gb"]
    assert t["value"] is None and not t["holds"] and "not measured" in t["note"]


def test_cli_flag_parses():
    args = bench.parser().parse_args(["--model-step", "--layers", "2", "--two-batch-layers", "1", "--peer-layers", "0"])
    assert args.model_step and (args.layers, args.two_batch_layers, args.peer_layers) == (2, 1, 0)
    assert not bench.parser().parse_args([]).model_step
    p = bench.parser()  # --[no-]tune-two-batch among its flags
    assert p.parse_args(["--model-step", "--layers", "2"]).tune_two_batch is None  # default: on for GPU runs
    assert p.parse_args(["--model-step", "--tune-two-batch"]).tune_two_batch is True
    assert p.parse_args(["--model-step", "--no-tune-two-batch", "--two-batch-layers", "3"]).tune_two_batch is False


class FakeMoE:
    """A layer whose policy gives a two-batch call `policy`'s comm SMs; it adds `scale` x its input."""

    def __init__(self, policy: Policy | None, scale: float):
        self.packed = SimpleNamespace(plan=SimpleNamespace(policy=policy) if policy else SimpleNamespace())
        self.scale, self.policy = scale, policy

    def __call__(self, h, ids, w):
        return h * self.scale

    def describe(self) -> dict:
        return {"policy": self.policy.source if self.policy else None}


def test_pair_times_the_tuned_step_only_where_it_partitions():
    """The tuned variant at T: its layers' two-batch comm SMs (its token bucket's); where 0 its step is the
    unpartitioned step's graph: not captured nor timed, its µs the unpartitioned one's, the ratio 1.0; elsewhere
    timed and compared like the others."""
    cfg = model_step.model_config(SMALL)
    n, clock = 2, model_step.Clock(torch.device("cpu"), iters=1)
    standins = model_step.make_standins(cfg, n, "cpu")
    inputs = {t: model_step.step_inputs(cfg, t, 0, "cpu") for t in (1, 2, 3)}
    tuned = Policy(0, 0, "tuned here", 16, 2)  # two-batch: 16 comm SMs up to T = 2 (buckets 1, 2), then none
    assert [model_step.two_batch_comm_sms(FakeMoE(tuned, 0.0), t) for t in (1, 2, 3, 4)] == [16, 16, 0, 0]
    assert model_step.two_batch_comm_sms(FakeMoE(None, 0.0), 1) == 0  # no policy: never partitions
    builds = {
        model_step.TUNED: lambda k: [FakeMoE(tuned, 0.5)] * k,
        model_step.PARTITIONED: lambda k: [FakeMoE(Policy(16, math.inf, "forced", 16, math.inf), 0.25)] * k,
        model_step.UNPARTITIONED: lambda k: [FakeMoE(Policy(0, 0, "none"), 0.125)] * k,
    }
    by_t = {t: {"tokens": t} for t in inputs}
    rec = model_step.compare(clock, builds, standins, inputs, model_step.PAIR_RATIOS, None, by_t, n, True)
    assert rec == {
        "layers": n,
        "describe": {k: {"policy": s} for k, s in zip(builds, ("tuned here", "forced", "none"))},
    }
    for t, r in by_t.items():
        partitions = t <= 2
        assert (r["tuned_comm_sms"], r["tuned_same_as_unpartitioned"]) == ((16, False) if partitions else (0, True))
        assert r["two_batch_layers"] == n and r["exact_partitioned_two_batch"] and r["exact_unpartitioned_two_batch"]
        assert (
            r["forced_partitioned_over_unpartitioned"]
            == r["unpartitioned_two_batch_us"] / r["partitioned_two_batch_us"]
        )
        assert r["tuned_over_unpartitioned"] == r["unpartitioned_two_batch_us"] / r["tuned_two_batch_us"]
        if partitions:
            assert r["exact_tuned_two_batch"] is True and r["tuned_two_batch_us"] > 0
        else:
            assert "exact_tuned_two_batch" not in r  # not run
            assert r["tuned_two_batch_us"] == r["unpartitioned_two_batch_us"] and r["tuned_over_unpartitioned"] == 1.0


def test_bad_arguments_exit_2_before_measuring(capsys):
    assert cli.main(["bench", "--model-step", "--models", "qwen3-235b", "--tokens", "300"]) == 2
    assert "token counts" in capsys.readouterr().err


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    if torch.cuda.is_available():
        pytest.skip("checks the CPU run (reference backend, wall clock); a GPU machine runs test_gpu_model_step")
    d = tmp_path_factory.mktemp("model_step")
    paths = {k: d / f"step.{k}" for k in ("json", "md")}
    argv = ["bench", "--model-step", "--models", SMALL, "--layers", "3", "--tokens", "4", "1", "--iters", "2"]
    argv.append("--tune-two-batch")  # asked for on a CPU: the tuner's error is recorded, the run goes on
    assert cli.main([*argv, "--json", str(paths["json"]), "--markdown", str(paths["md"])]) == 0
    return json.loads(paths["json"].read_text()), paths["md"].read_text()


def test_cpu_run_records(cpu_run):
    result, _ = cpu_run
    meta, rows, m = result["meta"], result["records"], result["models"][SMALL]
    want = f"gcmoe-lab bench --model-step --models {SMALL} --layers 3 --tokens 4 1 --iters 2 --tune-two-batch"
    assert meta["reproduce"] == want and meta["options"]["tune_two_batch"] is True
    assert meta["device"] == "CPU" and meta["tokens"] == [1, 4] and meta["api"] == model_step.api()
    assert [(r["model"], r["tokens"], r["layers"]) for r in rows] == [(SMALL, 1, 3), (SMALL, 4, 3)]
    for r in rows:
        for name in ("step", "two_batch", "partitioned_two_batch", "unpartitioned_two_batch"):
            assert r[f"exact_{name}"] is True, (name, r)
        assert r["check"] == "ok" and r["parts_sampled"] == [0, 1, 2] and r["two_batch_layers"] == 3
        assert r["sum_us"] == pytest.approx(3 * (r["layer_us"] + r["standin_us"]))
        assert r["step_over_sum"] == pytest.approx(r["step_us"] / r["sum_us"])
        assert r["two_batch_over_two_steps"] == pytest.approx(r["two_batch_us"] / (2 * r["step_us"]))
        assert r["forced_partitioned_over_unpartitioned"] == pytest.approx(
            r["unpartitioned_two_batch_us"] / r["partitioned_two_batch_us"]
        )
        # the reference backend never partitions: the tuned step is the unpartitioned one's twin at every T
        assert (r["tuned_comm_sms"], r["tuned_same_as_unpartitioned"], r["tuned_over_unpartitioned"]) == (0, True, 1.0)
        assert r["tuned_two_batch_us"] == r["unpartitioned_two_batch_us"] and "exact_tuned_two_batch" not in r
        assert "partitioned_over_unpartitioned" not in r and "triton_kernels_step_us" not in r
    assert m["layers"] == 3 and m["describe"]["backend"] == "reference" and m["memory"] is None
    assert m["load"]["prepack_s_per_layer"] > 0 and set(m["load"]["warmup_s_by_tokens"]) == {"1", "4"}
    for host in (m["host"]["check1"], m["host"]["check0"]):
        assert host["calls"] == 3 * model_step.HOST_STEPS and host["p90_us"] >= host["median_us"] > 0
    assert m["peer"]["error"].startswith("absent: needs a CUDA device")
    assert m["tune_two_batch"] == {
        "error": "ValueError: tune_two_batch: timing needs a CUDA device, got cpu (or pass time_fn)"
    }
    assert set(m["pair"]["describe"]) == {"tuned_two_batch", "partitioned_two_batch", "unpartitioned_two_batch"}
    assert {k: v["limit"] for k, v in result["targets"].items()} == ISSUE_TARGETS
    assert all(v["value"] is None and v["holds"] is False and "CPU" in v["note"] for v in result["targets"].values())


def test_cpu_run_markdown(cpu_run):
    result, md = cpu_run
    assert md.startswith("# gcmoe model step\n") and f"Reproduce: `{result['meta']['reproduce']}`" in md
    assert f"torch {torch.__version__}" in md and "## Targets" in md and "## Steps" in md
    for name in ISSUE_TARGETS:
        assert f"| {name} | – | " in md
    steps = [line for line in md.split("## Steps")[1].splitlines() if line.startswith(f"| {SMALL} |")]
    assert len(steps) == 2
    cells = [c.strip() for c in steps[0].strip("|").split("|")]
    r = result["records"][0]
    assert cells[1:4] == ["1", "3", f"{r['step_us']:.1f}"] and "yes" in cells
    head = [c.strip() for c in md.split("## Steps")[1].strip().splitlines()[0].strip("|").split("|")]
    row = dict(zip(head, cells))
    assert (row["tuned comm SMs"], row["unpart. / tuned"], row["tuned is unpart."]) == ("0", "1.000", "yes")
    assert row["unpart. / forced part."] == f"{r['forced_partitioned_over_unpartitioned']:.3f}"
    notes = md.split("## Notes")[1].split("## Models")[0]
    assert "partitioned_over_unpartitioned_two_batch_p1_min measures the layer's own partition policy" in notes
    assert "t(unpartitioned two-batch step) / t(two-batch step of layers built with comm_sms=None" in notes
    assert "recorded as 1.0" in notes and "The forced 16-SM partition at every T" in notes
    forced = min(x["forced_partitioned_over_unpartitioned"] for x in result["records"])
    assert f"unpart. / forced part. min {forced:.3f}" in notes
    assert f"- {SMALL}: two-batch policy tuning failed (ValueError: tune_two_batch: timing needs a CUDA" in notes


@pytest.mark.gpu
def test_gpu_model_step(tmp_path, monkeypatch):
    """A small captured step on the GPU: exact against its eager self, one- and two-batch, partitioned or not, the
    pair tuned first (into a cache dir of its own); the record carries memory, the capture and the host times."""
    monkeypatch.setenv("GCMOE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("GCMOE_COMM_SMS", raising=False)
    res = model_step.run(["custom:512,256,16,4,1"], [1, 8], model_step.Options(layers=4, peer_layers=0), iters=3)
    m = res["models"]["custom:512,256,16,4,1"]
    assert m["layers_captured"] == 4 and m["memory"]["packed_gb"] > 0 and m["host"]["check0"]["median_us"] > 0, m
    pol = m["tune_two_batch"]["policy"]
    assert m["tune_two_batch"]["layers"] == 4 and m["tune_two_batch"]["cache"].startswith(str(tmp_path))
    for r in res["records"]:
        assert "error" not in r and r["check"] == "ok", r
        for name in ("step", "two_batch", "partitioned_two_batch", "unpartitioned_two_batch"):
            assert r[f"exact_{name}"] is True, (name, r)
        assert r["step_us"] > 0 and r["two_batch_us"] > 0 and r["forced_partitioned_over_unpartitioned"] > 0
        want = pol["comm_sms"] if r["tokens"] <= pol["unpartitioned_above"] else 0
        assert r["tuned_comm_sms"] == want and r["tuned_same_as_unpartitioned"] == (want == 0), (pol, r)
        assert r["tuned_over_unpartitioned"] > 0 and (want == 0) == ("exact_tuned_two_batch" not in r)
    assert res["targets"]["layers_captured"]["value"] == 4 and res["targets"]["step_over_sum_max"]["value"] > 0
