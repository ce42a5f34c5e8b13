"""pytest-benchmark around our own GPU timer: the public layer's CUDA-graph replays with a cold L2, next to the FP4
floor (issue #17 item 4).

    pytest packages/gcmoe-lab/tests/test_bench_layer.py -m gpu --benchmark-json out.json   [-k deepseek-v3]

Per model (DeepSeek-V3, DeepSeek-V4-Flash, and gpt-oss-120b where gcmoe_core.config.MODEL_SHAPES has it) the EP8 slice
one rank holds (MoEConfig.ep_slice, T_max 256), weights from make_weights; per T in 1, 8, 32, 128 and per
graph-replayed layer variant of `gcmoe-lab bench` (partitioned: comm_sms = 16; sequential: comm_sms = 0;
gcmoe_lab.bench's Model holds the layers and the one capture stream, as in the bench): the layer called once and
checked against gcmoe_core.reference (calc_diff <= 1e-3), captured in a caller's graph
(gcmoe_core.testing.capture_graph), its replay checked bit-exact against that call, then ROUNDS replays timed one by
one by gcmoe_lab.timing.time_once (CUDA events around the replay, a cold-L2 flush before each, untimed).

How pytest-benchmark reports our numbers: the fixture times each round with its timer; gpu_rounds hands it a GpuClock
that reads 0 when a round starts and that round's event time when it ends, so the fixture's per-round durations ARE
our measurements and its min / median / stddev (and --benchmark-json) are ours, in seconds.
extra_info (layer_record): median_us (= the fixture's median), min_us, floor_us (FP4 bytes of the active + shared
experts / the copy bandwidth measured once per session), x_floor, calc_diff, model, tokens, variant, mode.
test_gpu_rounds_reports_our_samples runs the wrapper on a CPU with a fake measurement.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import pytest
import torch

import gcmoe
from gcmoe_core.config import MODEL_SHAPES, MoEConfig
from gcmoe_core.reference import moe_reference
from gcmoe_core.testing import calc_diff, capture_graph, first_mismatch, make_tokens, make_weights
from gcmoe_lab import bench
from gcmoe_lab.timing import ColdL2, copy_bandwidth, fp4_floor_us, time_once

MODELS = tuple(m for m in ("deepseek-v3", "deepseek-v4-flash", "gpt-oss-120b") if m in MODEL_SHAPES)
TOKENS = (1, 8, 32, 128)
VARIANTS = tuple(n for n, v in bench.VARIANTS.items() if isinstance(v, bench.LayerVariant) and v.graph)
EP = 8
ROUNDS = bench.GPU_ITERS
WARMUP_ROUNDS = 2
TOL = 1e-3


# ------------------------------------------------------------------------------------------ the wrapper (any device)
class GpuClock:
    """A pytest-benchmark timer reading what gpu_rounds sets: 0 at a round's start, its measurement at its end."""

    __name__ = "gpu_event_clock"  # what pytest-benchmark records as the timer

    def __init__(self) -> None:
        self.seconds = 0.0

    def __call__(self) -> float:
        return self.seconds


def gpu_rounds(benchmark, measure: Callable[[], float], rounds: int, warmup_rounds: int = WARMUP_ROUNDS) -> list[float]:
    """Run `measure` (-> µs of one run, measured by its own timer) for warmup_rounds + rounds rounds under the
    benchmark fixture, which sees each round last exactly the µs measure returned; returns the timed rounds' µs (with
    --benchmark-disable the fixture runs one round: its sample)."""
    clock = GpuClock()
    samples: list[float] = []

    def one_round() -> None:
        us = measure()
        samples.append(us)
        clock.seconds += us * 1e-6

    def reset() -> None:  # after each round: the next round's start reads 0, so its duration is exactly its µs
        clock.seconds = 0.0

    benchmark._timer = clock  # the fixture's timer, read when each round's runner is made (pytest-benchmark 5.x)
    benchmark.pedantic(one_round, teardown=reset, rounds=rounds, warmup_rounds=warmup_rounds, iterations=1)
    return samples[warmup_rounds:] if benchmark.enabled else samples


def layer_record(samples: list[float], floor_us: float | None, **fields) -> dict:
    """extra_info of one point: our median / min of the samples (µs), the floor and the ratio, plus `fields`."""
    median = statistics.median(samples)
    rec = {"median_us": median, "min_us": min(samples), "rounds": len(samples), "floor_us": floor_us}
    rec["x_floor"] = median / floor_us if floor_us else None
    return {**rec, **fields}


def test_gpu_rounds_reports_our_samples(benchmark):
    """The wiring, on any machine: the fixture's statistics are the fake measurements, warm-up rounds excluded."""
    fake = iter([500.0, 400.0, 50.0, 70.0, 60.0, 90.0, 40.0])  # two warm-up rounds, then five timed
    benchmark.group = "wiring check (fake measurements, not a benchmark)"
    samples = gpu_rounds(benchmark, lambda: next(fake), rounds=5, warmup_rounds=2)
    rec = layer_record(samples, 25.0, model="fake", tokens=1)
    benchmark.extra_info.update(rec)
    if benchmark.enabled:
        assert samples == [50.0, 70.0, 60.0, 90.0, 40.0]
        st = benchmark.stats.stats
        assert st.rounds == 5
        assert st.median == pytest.approx(60e-6, rel=1e-12) and st.min == pytest.approx(40e-6, rel=1e-12)
        assert st.max == pytest.approx(90e-6, rel=1e-12) and st.mean == pytest.approx(62e-6, rel=1e-12)
        assert rec["median_us"] == 60.0 == pytest.approx(st.median * 1e6, rel=1e-12)
        assert rec == {
            "median_us": 60.0,
            "min_us": 40.0,
            "rounds": 5,
            "floor_us": 25.0,
            "x_floor": 2.4,
            "model": "fake",
            "tokens": 1,
        }
        assert benchmark.stats.options["timer"] is not None and isinstance(benchmark._timer, GpuClock)
    else:
        assert samples == [500.0]


def test_layer_record_without_a_floor():
    assert layer_record([3.0, 1.0, 2.0], None) == {
        "median_us": 2.0,
        "min_us": 1.0,
        "rounds": 3,
        "floor_us": None,
        "x_floor": None,
    }


# ------------------------------------------------------------------------------------------------- on the GPU
@pytest.fixture(scope="session")
def copy_bw() -> float:
    return copy_bandwidth(torch.device("cuda", torch.cuda.current_device()))


@pytest.fixture(scope="module", params=MODELS)
def model(request):
    from gcmoe.backends.sm90 import Sm90Backend

    dev = torch.device("cuda", torch.cuda.current_device())
    max_tokens = max(256, max(TOKENS))
    cfg = MoEConfig.ep_slice(request.param, EP, max_tokens_per_rank=max_tokens)
    why = Sm90Backend().missing(dev, cfg)
    if why is not None:
        pytest.skip(f"{request.param}: the sm90 backend needs {why}")
    weights = make_weights(cfg, seed=0, device=dev)  # (with fp32 biases where cfg.has_bias: gpt-oss)
    m = bench.Model(request.param, cfg, weights, dev, "sm90", max_tokens, EP)
    m.capture_stream = torch.cuda.Stream(dev)
    # gpt-oss (H padded, clamped SwiGLU + biases): moe_reference takes neither an unpadded H of 2880 nor (by default)
    # the clamped activation; the reference backend pads and activates as the layer does
    plain = cfg.padded() == cfg and not cfg.has_bias and cfg.activation == "swiglu"
    m.ref_layer = None if plain else gcmoe.MoELayer(cfg, dev, "reference").load(weights)
    yield m
    m.layers.clear()
    m.ref_layer = None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("tokens", TOKENS)
def test_layer_graph_replay(benchmark, model, tokens, variant, copy_bw):
    cfg = model.cfg
    loaded = bench.VARIANTS[variant].load(model)
    x, ids, w = make_tokens(cfg, tokens, seed=1000 + tokens, device=model.device)
    y = loaded.call(x, ids, w)
    if model.ref_layer is not None:
        want = model.ref_layer(x, ids, w)
    else:
        want = moe_reference(x, ids, w, model.weights, capturable=False)
    d = calc_diff(y, want)
    assert d <= TOL, f"{model.name} T={tokens} {variant}: calc_diff {d:.3e}"
    graph, out = capture_graph(lambda: loaded.call(x, ids, w), stream=model.capture_stream)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert first_mismatch(out, y) == "", "the replayed graph differs from the call it captured"
    flush = ColdL2(model.device, bench.L2_FLUSH)
    benchmark.group = f"{model.name} EP{EP} T={tokens}"
    samples = gpu_rounds(benchmark, lambda: time_once(graph.replay, flush), ROUNDS)
    active = int(torch.unique(ids).numel())
    floor = fp4_floor_us(cfg.hidden_size, cfg.intermediate_size, active + cfg.num_shared_experts, copy_bw)
    benchmark.extra_info.update(
        layer_record(
            samples,
            floor,
            model=model.name,
            ep=EP,
            tokens=tokens,
            variant=variant,
            active_experts=active,
            calc_diff=d,
            mode=f"graph replay, cold L2 ({bench.L2_FLUSH} flush), CUDA events",
            copy_tb_s=copy_bw / 1e12,
        )
    )
