"""`gcmoe-lab bench` and what it times: the torch FP8 baseline against the reference, the bench's records, markdown
and plot on this machine (the reference backend on a CPU), its failure isolation, its host-overhead loop, and the
peers' forms (several timed per peer, the best per column reported, all kept)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import pytest
import torch

from gcmoe_core.config import MoEConfig
from gcmoe_core.reference import moe_reference, moe_reference_loop_fp64
from gcmoe_core.testing import Case, calc_diff, capture_graph, make_tokens, make_weights
from gcmoe_lab import bench, peers
from gcmoe_lab.baselines import TorchFp8MoE, quantize_fp8_rowwise, scaled_grouped_mm_loop

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SMALL = "custom:512,256,16,4,1"


CASES = [
    Case(MoEConfig(512, 256, 16, 4, 1), 7, seed=1),
    Case(MoEConfig(512, 256, 16, 4, 1), 1, seed=2),
    Case(MoEConfig(256, 128, 8, 2, 0), 5, "one_expert", seed=3),  # one expert takes every token, no shared expert
    Case(MoEConfig(256, 256, 16, 6, 2), 9, "half_empty", seed=4),  # half the experts empty, two shared experts
]


# ---------------------------------------------------------------------------------------------------- baseline
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_torch_fp8_baseline_matches_reference(case):
    """The baseline (its per-expert loop on a CPU: the same function, the grouped GEMM's math) is the layer: within
    FP8 rowwise-vs-1x128 rounding of the fp8_mxfp4 reference, and of the independent float64 loop."""
    cfg = case.cfg
    weights = make_weights(cfg, seed=case.seed)
    x, ids, w = make_tokens(cfg, case.tokens, case.routing, seed=case.seed + 100)
    base = TorchFp8MoE(cfg, weights, "cpu")
    assert not base.grouped_mm and "loop" in base.backend
    y = base(x, ids, w)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape and torch.isfinite(y).all()
    assert calc_diff(y, moe_reference(x, ids, w, weights)) <= 1e-2
    assert calc_diff(y, moe_reference_loop_fp64(x, ids, w, weights)) <= 1e-2
    assert y.float().norm() > 0.1 * moe_reference(x, ids, w, weights).float().norm()


def test_torch_fp8_baseline_includes_the_shared_expert():
    """Dropping the shared expert's contribution from the reference must make the baseline disagree."""
    cfg = MoEConfig(512, 256, 16, 4, 1)
    weights = make_weights(cfg, seed=7)
    x, ids, w = make_tokens(cfg, 6, seed=8)
    y = TorchFp8MoE(cfg, weights, "cpu")(x, ids, w)
    routed_only = moe_reference(x, ids, w, type(weights)(weights.w13, weights.w2))
    assert calc_diff(y, moe_reference(x, ids, w, weights)) <= 1e-2 < calc_diff(y, routed_only)


def test_weights_requantise_exactly_to_fp8():
    """MXFP4 weights -> FP8 per channel with power-of-two scales is exact (what the baseline's docstring claims)."""
    cfg = MoEConfig(512, 256, 16, 4, 1)
    weights = make_weights(cfg, seed=5)
    base = TorchFp8MoE(cfg, weights, "cpu")
    w13 = torch.cat((weights.w13.dequantize(), weights.shared_w13.dequantize()))
    w2 = torch.cat((weights.w2.dequantize(), weights.shared_w2.dequantize()))
    assert torch.equal(base.w13.transpose(1, 2).float() * base.s13.unsqueeze(2), w13)
    assert torch.equal(base.w2.transpose(1, 2).float() * base.s2.unsqueeze(2), w2)
    q, s = quantize_fp8_rowwise(torch.tensor([[3.0, -1.5, 0.0], [0.0, 0.0, 0.0]]), pow2=True)
    assert s[0] == 2.0**-7 and torch.equal(q.float() * s.unsqueeze(1), torch.tensor([[3.0, -1.5, 0], [0, 0, 0]]))


def test_scaled_grouped_mm_loop_follows_torch_grouped_mm():
    """The loop reads the operands as torch's grouped GEMMs do (torch._grouped_mm runs on a CPU; its FP8 sibling
    does not): B as [G, K, N] transposed views, offs = group end rows, an empty group, rows after the last group
    zero; the scales multiply rows and columns."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(64, 96, generator=g).to(torch.float8_e4m3fn)
    b = torch.randn(4, 48, 96, generator=g).to(torch.float8_e4m3fn).transpose(1, 2)
    offs = torch.tensor([16, 16, 32, 48], dtype=torch.int32)  # group 1 empty, rows 48..63 in no group
    ones_a, ones_b = torch.ones(64), torch.ones(4, 48)
    got = scaled_grouped_mm_loop(a, b, ones_a, ones_b, offs)
    want = torch._grouped_mm(a.to(torch.bfloat16), b.to(torch.bfloat16), offs=offs)
    assert torch.equal(got[:48], want[:48]) and not got[48:].any()
    sa, sb = torch.rand(64, generator=g) + 0.5, torch.rand(4, 48, generator=g) + 0.5
    scaled = scaled_grouped_mm_loop(a, b, sa, sb, offs)
    ref = torch.cat(
        [
            (a[lo:hi].float() @ b[e].float()) * sa[lo:hi, None] * sb[e]
            for e, lo, hi in ((0, 0, 16), (2, 16, 32), (3, 32, 48))
        ]
    )
    assert torch.equal(scaled[:48], ref.to(torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.sm90
def test_torch_fp8_grouped_gemm_equals_its_loop_on_the_gpu():
    cfg = MoEConfig.ep_slice("deepseek-v4-flash", 8)
    weights = make_weights(cfg, seed=3, device="cuda")
    x, ids, w = make_tokens(cfg, 32, seed=4, device="cuda")
    fast = TorchFp8MoE(cfg, weights, "cuda")
    assert fast.grouped_mm
    slow = TorchFp8MoE(cfg, weights, "cuda", grouped_mm=False)
    y = fast(x, ids, w)
    assert calc_diff(y, slow(x, ids, w)) <= 1e-4
    assert calc_diff(y, moe_reference(x, ids, w, weights)) <= 1e-2


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("peer", ["triton_kernels", "deepgemm"])
def test_peer_matches_the_routed_reference(peer):
    """Each peer adapter (where installed) computes the routed experts of the same weights, in every form the bench
    times: within its activation quantisation (bf16 for triton_kernels, FP8 per 128 for DeepGEMM) of the fp8_mxfp4
    reference without the shared expert; a graph replay of each form gives what its eager call gave."""
    from gcmoe_core.reference import MoEWeights

    missing = {"triton_kernels": peers.triton_kernels_missing, "deepgemm": peers.deepgemm_missing}[peer]("cuda")
    if missing:
        pytest.skip(f"{peer} peer absent: needs {missing}")
    cfg = MoEConfig.ep_slice("deepseek-v4-flash", 8)
    weights = make_weights(cfg, seed=5, device="cuda")
    x, ids, w = make_tokens(cfg, 16, seed=6, device="cuda")
    if peer == "triton_kernels":
        p = peers.triton_kernels_moe(cfg, weights, "cuda")
    else:
        p = peers.deepgemm_mega_moe(cfg, weights, "cuda")
    try:
        ref = moe_reference(x, ids, w, MoEWeights(weights.w13, weights.w2))
        forms = p.forms()
        assert {f.column for f in forms.values()} == set(peers.COLUMNS)
        for name, form in forms.items():
            fn = form.bind(x, ids, w)
            y = fn()
            assert y.shape == x.shape and torch.isfinite(y).all(), name
            assert calc_diff(y, ref) <= 1e-2, (name, calc_diff(y, ref))
            g, out = capture_graph(fn)
            g.replay()
            torch.cuda.synchronize()
            assert calc_diff(out, y) <= 1e-6, name  # (a peer's combine need not be bitwise deterministic)
    finally:
        p.close()
        peers.shutdown()


@pytest.mark.gpu
def test_gpu_run_records():
    """On a GPU: every variant has a time or an error; floors, x_floor and the host loop are there."""
    res = bench.run(["deepseek-v4-flash"], [1, 8], iters=3)
    recs = res["records"]
    assert len(recs) == 2 * len(bench.GPU_VARIANTS) and res["meta"]["copy_tb_s"] > 1.0
    for r in recs:
        assert r["floor_us"] > r["floor_routed_us"] > 0
        assert ("median_us" in r) != ("error" in r), r
        if r["variant"] in ("partitioned", "sequential", "eager", "torch_fp8"):
            assert "error" not in r, r
            assert r["calc_diff"] <= 1e-2 and r["x_floor"] > 0.8
    part = [r for r in recs if r["variant"] == "partitioned"]
    for r in part:
        assert r["mode"] == "graph replay" or r["backend"] == "reference"
        assert r["speedup_vs_sequential"] > 0 and r["host"]["eager_loop_us_check0"] > 0


# ------------------------------------------------------------------------------------------------------- bench
@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    if torch.cuda.is_available():
        pytest.skip("checks the CPU run (reference backend, no floor); a GPU machine runs the GPU variants")
    d = tmp_path_factory.mktemp("bench")
    paths = {k: d / f"b.{k}" for k in ("json", "md", "png")}
    argv = ["bench", "--models", SMALL, "--tokens", "1", "3", "--iters", "2"]
    variants = ["eager", "torch_fp8", "triton_kernels", "deepgemm"]
    rc = bench.run_bench(
        [SMALL],
        [1, 3],
        variants=variants,
        iters=2,
        json_path=str(paths["json"]),
        md_path=str(paths["md"]),
        plot_path=str(paths["png"]),
        argv=argv,
    )
    assert rc == 0
    return json.loads(paths["json"].read_text()), paths


def test_cpu_run_records(cpu_run):
    result, _ = cpu_run
    recs = result["records"]
    assert [(r["tokens"], r["variant"]) for r in recs] == [
        (t, v) for t in (1, 3) for v in ("eager", "torch_fp8", "triton_kernels", "deepgemm")
    ]
    by = {(r["tokens"], r["variant"]): r for r in recs}
    for t in (1, 3):
        layer, base = by[(t, "eager")], by[(t, "torch_fp8")]
        assert layer["backend"] == "reference" and layer["mode"].startswith("eager")
        assert layer["median_us"] > 0 and base["median_us"] > 0
        assert layer["calc_diff"] == 0.0  # the reference backend is the reference
        assert 0 < base["calc_diff"] <= 1e-2  # FP8 rowwise vs 1x128: close, never identical
        assert layer["speedup_vs_torch_fp8"] == pytest.approx(base["median_us"] / layer["median_us"])
        assert 1 <= layer["active_experts"] <= min(16, 4 * t) and layer["shared_experts"] == 1
        for r in (layer, base):
            assert not {"floor_us", "floor_routed_us", "x_floor", "host"} & set(r), r  # no floor on a CPU
        for peer in ("triton_kernels", "deepgemm"):  # absent here: recorded, the run went on
            assert by[(t, peer)]["error"].startswith("absent: needs a CUDA device"), by[(t, peer)]
            assert "median_us" not in by[(t, peer)]
    meta = result["meta"]
    assert meta["device"] == "CPU" and meta["layer_backends"] == {SMALL: ["reference"]}
    assert meta["torch"] == torch.__version__ and meta["iters"] == 2 and meta["tokens"] == [1, 3]
    assert meta["reproduce"].endswith(f"gcmoe-lab bench --models {SMALL} --tokens 1 3 --iters 2")
    setup = meta["model_setup"][SMALL]
    assert setup["config"]["hidden_size"] == 512 and setup["variants"]["eager"]["describe"]["backend"] == "reference"


def test_cpu_run_markdown(cpu_run):
    result, paths = cpu_run
    md = paths["md"].read_text()
    meta = result["meta"]
    assert md.startswith("# gcmoe bench\n")
    assert f"{meta['date']} · CPU · driver" in md and f"torch {torch.__version__}" in md
    assert f"CuTe DSL {meta['cutlass_dsl']}" in md and f"Reproduce: `{meta['reproduce']}`" in md
    rows = [line for line in md.splitlines() if line.startswith(f"| {SMALL} |")]
    assert len(rows) == len(result["records"])
    eager1 = next(r for r in result["records"] if r["tokens"] == 1 and r["variant"] == "eager")
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    # a CPU run says so and leaves out the columns it has nothing for (floor, × floor, prepared)
    assert "**a CPU run**: the layer ran on the plain-torch reference backend" in md
    assert "| model | T | active | variant | backend | mode | median µs | speedup | calc_diff |" in md
    assert cells[:5] == [SMALL, "1", str(eager1["active_experts"]), "eager", "reference"]
    assert cells[6] == f"{eager1['median_us']:.1f}" and cells[7] == "1.00" and cells[8] == "0.0e+00"
    assert len(cells) == 9
    assert "| absent: needs a CUDA device" not in md and "error: absent: needs a CUDA device" in md


def test_cpu_run_plot_is_a_png(cpu_run):
    pytest.importorskip("matplotlib")
    _, paths = cpu_run
    data = paths["png"].read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 10_000


def test_a_failing_variant_does_not_stop_the_run(monkeypatch):
    @dataclass(frozen=True)
    class Boom:
        name: str = "boom"

        def load(self, m):
            def call(x, ids, w):
                raise RuntimeError("boom\nsecond line")

            return bench.Loaded(call, False, bench.LAYER_WORK, "none", {})

    @dataclass(frozen=True)
    class CannotLoad:
        name: str = "cannot_load"

        def load(self, m):
            raise ValueError("no weights for me")

    monkeypatch.setitem(bench.VARIANTS, "boom", Boom())
    monkeypatch.setitem(bench.VARIANTS, "cannot_load", CannotLoad())
    res = bench.run([SMALL], [2], variants=["boom", "cannot_load", "eager"], iters=1, device="cpu")
    boom, cannot, eager = res["records"]
    assert boom["error"] == "run: RuntimeError: boom" and "median_us" not in boom
    assert cannot["error"] == "load: ValueError: no weights for me"
    assert "traceback" in res["meta"]["model_setup"][SMALL]["variants"]["cannot_load"]
    assert eager["median_us"] > 0 and eager["calc_diff"] == 0.0 and "error" not in eager


def test_gpu_branch_of_a_point_on_a_cpu(monkeypatch):
    """The GPU-only bookkeeping of one point, with the device pieces stood in for: graph-able variants are captured
    and their graph output checked, floors per work (layer vs routed-only), x_floor, speedups, the host loop."""
    from gcmoe import MoELayer
    from gcmoe_core.reference import MoEWeights
    from gcmoe_lab.timing import fp4_floor_us

    class FakeGraph:
        def __init__(self, fn):
            self.fn, self.replays = fn, 0

        def replay(self):
            self.replays += 1
            return self.fn()

    captured = {}

    def fake_capture(fn, stream=None):
        captured[stream] = captured.get(stream, 0) + 1
        return FakeGraph(fn), fn()

    medians = {"partitioned": 100.0, "sequential": 150.0, "routed_peer": 120.0, "torch_fp8": 400.0}
    # a peer timed in three forms: the best `call` form is b, the only `prepared` one p
    medians |= {"formed_peer/a": 130.0, "formed_peer/b": 125.0, "formed_peer/p": 90.0}
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(bench, "_wait_device", lambda timeout_s: None)
    monkeypatch.setattr(bench, "capture_graph", fake_capture)
    monkeypatch.setattr(bench, "_gpu_sleep", lambda: lambda: True)  # (no device to keep busy)
    flushes = []
    monkeypatch.setattr(
        bench,
        "time_interleaved",
        lambda runs, iters, dev, flush: flushes.append(flush) or {k: medians[k] for k in runs},
    )
    monkeypatch.setattr(bench, "HOST_CALLS", 3)
    cfg = MoEConfig(512, 256, 16, 4, 1, max_tokens_per_rank=8)
    weights = make_weights(cfg, seed=9)
    routed = MoEWeights(weights.w13, weights.w2)
    m = bench.Model("custom", cfg, weights, torch.device("cpu"), None, 8, None, capture_stream="stream")
    layer = MoELayer(cfg, "cpu").load(weights)
    routed_call = lambda x, i, w: moe_reference(x, i, w, routed)
    bound = []  # (form, inputs' T) per bind: a form binds the point's inputs once, before its capture

    def form(name, column):
        return peers.Form(lambda x, i, w: bound.append((name, x.shape[0])) or (lambda: routed_call(x, i, w)), column)

    forms = {"a": form("a", "call"), "b": form("b", "call"), "p": form("p", "prepared")}
    loaded = {
        "partitioned": bench.Loaded(layer, True, bench.LAYER_WORK, "reference", {}),
        "sequential": bench.Loaded(layer, True, bench.LAYER_WORK, "reference", {}),
        "routed_peer": bench.Loaded(routed_call, True, peers.WORK, "fake", {}),
        "torch_fp8": bench.Loaded(TorchFp8MoE(cfg, weights, "cpu"), False, bench.LAYER_WORK, "torch", {}),
        "formed_peer": bench.Loaded(routed_call, True, peers.WORK, "fake", {}, None, forms),
    }
    names = [*loaded, "absent_peer"]
    bw = 4.0e12
    recs = bench._run_point(m, routed, 3, names, loaded, {"absent_peer": "absent: needs x"}, 2, 0, bw, True, "read")
    assert flushes == ["read"]  # the run's L2 flush reaches the timing
    by = {r["variant"]: r for r in recs}
    assert captured == {"stream": 6}  # the graph-able variants' forms, all on the model's one capture stream
    assert bound == [("a", 3), ("b", 3), ("p", 3)]
    active = by["partitioned"]["active_experts"]
    floor, routed_floor = fp4_floor_us(512, 256, active + 1, bw), fp4_floor_us(512, 256, active, bw)
    for name, r in by.items():
        assert r["floor_us"] == floor and r["floor_routed_us"] == routed_floor
        if name == "absent_peer":
            assert r["error"] == "absent: needs x" and "median_us" not in r
            continue
        if name == "formed_peer":  # the best form per column, every form kept
            assert (r["best"], r["median_us"], r["best_prepared"], r["prepared_us"]) == ("b", 125.0, "p", 90.0)
            assert r["x_floor"] == 125.0 / routed_floor and r["prepared_x_floor"] == 90.0 / routed_floor
            assert {f: (fr["column"], fr["median_us"]) for f, fr in r["forms"].items()} == {
                "a": ("call", 130.0),
                "b": ("call", 125.0),
                "p": ("prepared", 90.0),
            }
            assert r["mode"] == "graph replay" and r["calc_diff"] == 0.0
            assert all(fr["mode"] == "graph replay" and fr["calc_diff"] == 0.0 for fr in r["forms"].values())
            continue
        assert r["median_us"] == medians[name]
        assert r["x_floor"] == medians[name] / (routed_floor if name == "routed_peer" else floor)
        assert r["mode"] == ("eager" if name == "torch_fp8" else "graph replay")
        assert r["calc_diff"] <= (1e-2 if name == "torch_fp8" else 0.0)
    lead = by["partitioned"]
    assert lead["speedup_vs_sequential"] == 1.5 and lead["speedup_vs_routed_peer"] == 1.2
    assert lead["speedup_vs_torch_fp8"] == 4.0 and "speedup_vs_absent_peer" not in lead
    assert lead["speedup_vs_formed_peer"] == 1.25 and lead["speedup_vs_formed_peer_prepared"] == 0.9
    assert not any(k.endswith("_prepared") and "formed" not in k for k in lead if k.startswith("speedup"))
    host = lead["host"]
    assert host["calls"] == 3 and host["graph_loop_us"] > 0 and host["host_us_check0"] > 0
    assert host["host_overhead_us"] == host["eager_loop_us_check1"] - host["graph_loop_us"]


def test_unknown_variant_is_rejected():
    with pytest.raises(ValueError, match="unknown variant"):
        bench.run([SMALL], [1], variants=["fastest"], device="cpu")


def test_host_overhead_sets_the_value_check_flag_per_loop(monkeypatch):
    monkeypatch.setenv("GCMOE_CHECK_VALUES", "1")
    seen = []
    syncs = []
    layer = lambda x, ids, w: seen.append(os.environ["GCMOE_CHECK_VALUES"])

    class Graph:
        replays = 0

        def replay(self):
            Graph.replays += 1

    monkeypatch.setattr(bench, "HOST_ONLY_CALLS", 3)
    queued = []  # the host-only loops: the device work queued ahead, and whether it still runs after the last call

    def busy():
        queued.append(len(seen))
        return lambda: len(seen) - queued[-1] == 3  # still busy once the loop's 3 calls are made (no call waited)

    out = bench.host_overhead(layer, None, None, None, Graph(), calls=5, sync=lambda: syncs.append(1), busy=busy)
    # per flag: two warm-up calls and 5 timed ones, two warm-up calls and 3 queued behind the busy work, 3 single
    assert seen == ["1"] * 15 + ["0"] * 15
    assert queued == [9, 24]  # the busy work is queued after the host loop's warm-up, before its timed calls
    # per loop one sync after its warm-up and one at its end; per flag one before each single call and one after
    assert Graph.replays == 7 and len(syncs) == 2 + 2 * (2 + 2 + 4)
    assert os.environ["GCMOE_CHECK_VALUES"] == "1"
    assert out["calls"] == 5 and all(out[k] > 0 for k in ("eager_loop_us_check1", "eager_loop_us_check0"))
    assert out["host_overhead_us"] == out["eager_loop_us_check1"] - out["graph_loop_us"]
    assert out["host_only_calls"] == 3 and all(out[f"host{m}_us_check{f}"] > 0 for f in "10" for m in ("", "_idle"))
    assert out["host_device_busy_check1"] is True and out["host_device_busy_check0"] is True


def _gpu_like_result() -> dict:
    """Records as a GPU run writes them (floors, x_floor, graph modes, host loop, a routed-only peer, an error)."""
    meta = {
        "date": "2026-12-01T00:00:00+00:00",
        "device": "NVIDIA H200",
        "driver": "580.82.07",
        "driver_cuda_version": "13.0",
        "torch": "2.11.0+cu130",
        "cutlass_dsl": "4.8.1",
        "method": "interleaved",
        "copy_tb_s": 4.1,
        "layer_backends": {"deepseek-v3": ["sm90"]},
        "reproduce": "gcmoe bench --tokens 8",
        "notes": [],
    }
    base = {"model": "deepseek-v3", "ep": 8, "tokens": 8, "active_experts": 30, "shared_experts": 1}
    floors = {"floor_us": 180.0, "floor_routed_us": 174.2}
    recs = [
        {
            **base,
            **floors,
            "variant": "partitioned",
            "backend": "sm90",
            "work": bench.LAYER_WORK,
            "mode": "graph replay",
            "median_us": 200.0,
            "x_floor": 200.0 / 180.0,
            "calc_diff": 1e-4,
            "speedup_vs_sequential": 1.25,
            "speedup_vs_triton_kernels": 1.5,
            "speedup_vs_deepgemm": 1.4,
            "speedup_vs_deepgemm_prepared": 1.25,
            "host": {
                "calls": 200,
                "eager_loop_us_check1": 260.0,
                "eager_loop_us_check0": 230.0,
                "graph_loop_us": 190.0,
                "host_overhead_us": 70.0,
            },
        },
        {**base, **floors, "variant": "sequential", "backend": "sm90", "work": bench.LAYER_WORK, "mode": "graph replay"}
        | {"median_us": 250.0, "x_floor": 250.0 / 180.0, "calc_diff": 1e-4},
        {**base, **floors, "variant": "triton_kernels", "backend": "triton_kernels", "work": peers.WORK}
        | {"mode": "graph replay", "median_us": 300.0, "x_floor": 300.0 / 174.2, "calc_diff": 2e-3},
        {**base, **floors, "variant": "deepgemm", "backend": "deepgemm", "work": peers.WORK, "mode": "graph replay"}
        | {"median_us": 280.0, "x_floor": 280.0 / 174.2, "calc_diff": 3e-4, "best": "call", "forms": {}}
        | {"prepared_us": 250.0, "best_prepared": "prepared", "prepared_x_floor": 250.0 / 174.2},
        {**base, **floors, "variant": "torch_fp8", "error": "absent: needs a CUDA device"},
    ]
    return {"meta": meta, "records": recs}


def test_markdown_of_a_gpu_run():
    md = bench.markdown(_gpu_like_result())
    assert "2026-12-01T00:00:00+00:00 · NVIDIA H200 · driver 580.82.07 (CUDA 13.0) · torch 2.11.0+cu130" in md
    assert "copy 4.10 TB/s" in md
    assert "| deepseek-v3 | 8 | 30 | 180.0 | partitioned | sm90 | graph replay | 200.0 | 1.11 | 1.00 | 1.0e-04 |" in md
    assert "| deepseek-v3 | 8 | 30 | 180.0 | sequential | sm90 | graph replay | 250.0 | 1.39 | 1.25 | 1.0e-04 |" in md
    # the routed-only peer is shown against the routed floor
    assert (
        "| deepseek-v3 | 8 | 30 | 174.2 | triton_kernels | triton_kernels | graph replay | 300.0 | 1.72 | 1.50 |" in md
    )
    # a peer's best form per column: its call median, and its prepared time with its own speedup
    assert (
        "| deepseek-v3 | 8 | 30 | 174.2 | deepgemm | deepgemm | graph replay (call, prepared) | 280.0 | 1.61 | 1.40 "
        "| 3.0e-04 | 250.0 | 1.25 |" in md
    )
    assert "| torch_fp8 | – | error: absent: needs a CUDA device | – | – | – | – | – | – |" in md
    assert "| deepseek-v3 | 8 | 200.0 | 190.0 | 260.0 | 230.0 | 70.0 |" in md


def test_plot_of_a_gpu_run(tmp_path):
    pytest.importorskip("matplotlib")
    res = _gpu_like_result()
    res["records"] += [r | {"tokens": 32, "median_us": r["median_us"] * 2} for r in res["records"] if "median_us" in r]
    for r in res["records"]:
        if "median_us" in r:
            r["x_floor"] = r["median_us"] / 180.0
    bench.plot(res, tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:8] == PNG_MAGIC


def test_peers_say_what_is_missing_on_a_cpu():
    assert "CUDA device" in peers.triton_kernels_missing("cpu")
    assert "CUDA device" in peers.deepgemm_missing("cpu")
    cfg = MoEConfig(512, 256, 16, 4, 1)
    w = make_weights(cfg, seed=0)
    assert peers.triton_kernels_moe(cfg, w, "cpu") is None
    assert peers.deepgemm_mega_moe(cfg, w, "cpu") is None


def test_deepgemm_function_loader(tmp_path):
    """The peer's one Python function is defined from its file's source by name, without running its imports."""
    src = tmp_path / "lib.py"
    src.write_text(
        "import module_that_does_not_exist\n\n"
        "def helper(t: Tuple[int, int]) -> Tuple[int, int]:\n    return (t[1], t[0])\n\n"
        "def other():\n    raise AssertionError\n"
    )
    f = peers._load_function(src, "helper", {})
    assert f((1, 2)) == (2, 1)
    with pytest.raises(ImportError, match="no top-level function 'missing'"):
        peers._load_function(src, "missing", {})
