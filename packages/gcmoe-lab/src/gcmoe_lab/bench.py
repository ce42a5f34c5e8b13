"""`gcmoe-lab bench` (also `gcmoe bench`): what users call, side by side in one run, next to the weight-streaming
floor.

    gcmoe-lab bench [--models deepseek-v3 deepseek-v4-flash] [--tokens 1 8 32 128 256] [--variants ...] [--iters 30]
                    [--json PATH] [--markdown PATH] [--plot PATH]

On the GPU machine, with the peers: tools/gpu/bench.sh (it builds DeepGEMM's module and puts triton_kernels on
PYTHONPATH first).

Per model: the EP=8 slice one rank holds (MoEConfig.ep_slice: E/8 routed experts + the shared expert, max tokens per
rank max(256, max T)); weights from gcmoe_core.testing.make_weights, the SAME MoEWeights loaded into every variant.
Per token count T: tokens from make_tokens, then every variant run once and checked (calc_diff against
gcmoe_core.reference.moe_reference, of the whole layer or of the routed experts, whichever the variant computes),
then timed side by side — A B C A B C ..., a cold L2 before every run (gcmoe_lab.timing.time_interleaved), medians.

Variants (GPU):
    partitioned     gcmoe.MoELayer(cfg, "cuda", comm_sms=16): the design's split, 16 comm / 116 compute SMs on an
                    H200 (layer.describe() is recorded); called through the public API inside a torch.cuda.graph the
                    bench captures (the caller's own capture), timed as graph replays
    sequential      MoELayer(..., comm_sms=0): the same kernels with no partition, captured the same way
    eager           MoELayer(cfg, "cuda") as it chooses (the tuned partition policy) called eagerly, no graph: what a
                    caller without graphs gets
    torch_fp8       gcmoe_lab.baselines.TorchFp8MoE: the whole layer with torch._scaled_grouped_mm FP8 (eager:
                    torch's grouped GEMMs under graph replay hit an illegal address on torch 2.11)
    triton_kernels  gcmoe_lab.peers.TritonKernelsMoE (when importable), graph replays, ROUTED EXPERTS ONLY
    deepgemm        gcmoe_lab.peers.DeepGemmMegaMoE (when built), graph replays, ROUTED EXPERTS ONLY
A variant that cannot load or run gets its error string in its records; the others go on.

Peers at their best: each peer is timed in several forms (gcmoe_lab.peers.Form; by default only the forms validated
on a GPU, `--peer-forms all` for every form: gcmoe_lab.peers), all in the same interleaved run:
triton_kernels with num_warps 8 and 4, DeepGEMM as its own harness sizes its buffer; each with the per-call
preparation inside the timed call (column `call`: median_us, what the gcmoe layer's timed call also does) and
before it (column `prepared`: prepared_us, the peer's own harness's timed region: triton_kernels' routing metadata,
DeepGEMM's FP8 cast of x and copies into its buffer). Per column the record carries the best form's time (best,
best_prepared) and every form's time under `forms`.

Per point also:
    floor_us        FP4 weight + scale bytes of the active routed experts plus the shared expert(s) / the copy
                    bandwidth measured in this run (gcmoe_lab.timing.copy_bandwidth, fp4_floor_us);
                    floor_routed_us the same without the shared expert(s), the floor of the routed-only peers
    x_floor         per variant: its median / the floor of the work it does
    speedup_vs_<v>  on the partitioned record: median(v) / median(partitioned); for a peer also
                    speedup_vs_<v>_prepared: prepared_us(v) / median(partitioned)
    host            on the partitioned record: 200 eager calls back to back, one sync at the end, per-call µs with
                    GCMOE_CHECK_VALUES=1 and =0 (gcmoe.moe reads it per call), next to 200 back-to-back replays of
                    the bench's graph; their difference is Python and launch cost per call; and the host time
                    alone (host_us_check1 / _check0): 50 eager calls queued behind a 50 ms sleep kernel, so none
                    waits for the device (host_device_busy_* says the device was still busy after the last one:
                    with checks on each call waits for the previous call's publish, so it is not), and the median
                    of 50 single calls each made on an idle device (host_idle_us_*)

CPU (no GPU): the reference backend on a small grid (deepseek-v4-flash, T 1 and 4) — the layer called eagerly and
the torch_fp8 baseline on its per-expert loop — wall-clock medians of interleaved runs, no floor; the same JSON,
markdown and plot. Output: a tqdm bar on stderr, the markdown table on stdout, and the files asked for.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from gcmoe import MoELayer
from gcmoe_core.config import MoEConfig
from gcmoe_core.reference import MoEWeights, moe_reference
from gcmoe_core.testing import calc_diff, capture_graph, make_tokens, make_weights

from . import peers
from .baselines import TorchFp8MoE
from .timing import L2_FLUSHES, copy_bandwidth, fp4_floor_us, run_meta, time_interleaved

MODELS = ("deepseek-v3", "deepseek-v4-flash")
TOKENS = (1, 8, 32, 128, 256)
CPU_MODELS = ("deepseek-v4-flash",)
CPU_TOKENS = (1, 4)
GPU_ITERS, CPU_ITERS = 30, 3
HOST_CALLS = 200
HOST_ONLY_CALLS, HOST_SLEEP_MS = 50, 50.0  # host time alone: 50 eager calls queued behind a 50 ms sleep kernel
FIRST_CALL_TIMEOUT_S = 120.0  # a first launch still running after this is a hang: the run stops there
L2_FLUSH = "write"
LAYER_WORK = "layer (routed + shared experts)"
CUSTOM = "custom:"  # --models custom:H,I,E,top_k,shared: a world-size-1 layer of that shape


class VariantAbsent(Exception):
    """The variant cannot exist here (a peer not installed, no GPU); the message says what is missing."""


class DeviceHang(RuntimeError):
    """A first launch did not finish: the device is stuck behind it, so the run cannot go on."""


@dataclass
class Loaded:
    """A variant ready to run one model: call(x, ids, w) -> y bf16 [T, H]; forms: the ways to time it (a peer's,
    gcmoe_lab.peers.Form; None: the call itself, one form)."""

    call: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    graph: bool  # time CUDA-graph replays of call (else eager calls)
    work: str  # LAYER_WORK or peers.WORK
    backend: str
    info: dict
    close: Callable[[], None] | None = None
    forms: dict[str, peers.Form] | None = None


@dataclass
class Model:
    """What the variants of one model share: config, weights, device and the gcmoe layers (one per comm_sms)."""

    name: str
    cfg: MoEConfig
    weights: MoEWeights
    device: torch.device
    backend: str | None
    max_tokens: int
    ep: int | None  # the EP the slice is of (None: a custom world-size-1 layer)
    layers: dict = field(default_factory=dict)
    # every capture warms up and records on this one stream: a gcmoe layer keeps per-stream resources (a lane per
    # caller stream), so a fresh stream per capture would leave one more lane behind each time
    capture_stream: torch.cuda.Stream | None = None

    def layer(self, comm_sms: int | None) -> MoELayer:
        if comm_sms not in self.layers:
            layer = MoELayer(self.cfg, self.device, self.backend, comm_sms=comm_sms)
            self.layers[comm_sms] = layer.load(self.weights)
        return self.layers[comm_sms]


@dataclass(frozen=True)
class LayerVariant:
    name: str
    comm_sms: int | None
    graph: bool

    def load(self, m: Model) -> Loaded:
        layer = m.layer(self.comm_sms)
        # the reference backend's capturable path runs every expert over every row: time it eagerly
        graph = self.graph and m.device.type == "cuda" and layer.backend != "reference"
        info = {"comm_sms": self.comm_sms, "describe": layer.describe()}
        return Loaded(layer, graph, LAYER_WORK, layer.backend, info)


@dataclass(frozen=True)
class TorchFp8Variant:
    name: str = "torch_fp8"

    def load(self, m: Model) -> Loaded:
        if not _plain_swiglu(m.cfg):
            raise VariantAbsent("computes plain SwiGLU without biases, not this layer's experts")
        base = TorchFp8MoE(m.cfg, m.weights, m.device)
        info = {"quantisation": "FP8 E4M3 rowwise (x per token, h per row, weights per channel)"}
        return Loaded(base, False, LAYER_WORK, base.backend, info)


def _plain_swiglu(cfg: MoEConfig) -> bool:
    """The layer's experts are SwiGLU without biases (what the torch FP8 baseline and DeepGEMM compute)."""
    return cfg.activation == "swiglu" and not cfg.has_bias


@dataclass(frozen=True)
class PeerVariant:
    name: str
    missing: Callable[[torch.device], str | None]
    make: Callable[[Model], object]
    plain_swiglu_only: bool = False

    def load(self, m: Model) -> Loaded:
        why = self.missing(m.device)
        if why is not None:
            raise VariantAbsent(f"needs {why}")
        if self.plain_swiglu_only and not _plain_swiglu(m.cfg):
            raise VariantAbsent("computes plain SwiGLU without biases, not this layer's experts")
        peer = self.make(m)
        return Loaded(peer, True, peer.work, peer.name, peer.describe(), peer.close, peer.forms())


PARTITION_SMS = 16  # the design's split (16 comm SMs, 116 compute on an H200); the layer's own policy is `eager`'s
VARIANTS = {
    v.name: v
    for v in (
        LayerVariant("partitioned", PARTITION_SMS, True),
        LayerVariant("sequential", 0, True),
        LayerVariant("eager", None, False),
        TorchFp8Variant(),
        PeerVariant(
            "triton_kernels", peers.triton_kernels_missing, lambda m: peers.TritonKernelsMoE(m.cfg, m.weights, m.device)
        ),
        PeerVariant(
            "deepgemm",
            peers.deepgemm_missing,
            lambda m: peers.DeepGemmMegaMoE(m.cfg, m.weights, m.device),
            plain_swiglu_only=True,
        ),
    )
}
GPU_VARIANTS = tuple(VARIANTS)
CPU_VARIANTS = ("eager", "torch_fp8")
LEADS = ("partitioned", "eager")  # the record that carries the speedups: the first of these that ran


def _err(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:300] if lines else ''}"


@contextlib.contextmanager
def _env(name: str, value: str):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def _wait_device(timeout_s: float) -> None:
    """Wait for the current stream, polling, at most timeout_s; DeviceHang after that."""
    ev = torch.cuda.Event()
    ev.record()
    t0 = time.perf_counter()
    while not ev.query():
        if time.perf_counter() - t0 > timeout_s:
            raise DeviceHang(f"a first launch had not finished after {timeout_s:.0f} s")
        time.sleep(0.001)


def _prepare(fn: Callable[[], torch.Tensor], graph: bool, rec: dict, capture_stream: torch.cuda.Stream | None):
    """Run a timed call once (eagerly; on a GPU then captured on capture_stream when graph is set). Returns (what
    to time, output)."""
    y = fn()
    if capture_stream is None:
        rec["mode"] = "eager (CPU wall clock)"
        return fn, y
    _wait_device(FIRST_CALL_TIMEOUT_S)
    torch.cuda.synchronize()
    if graph:
        try:
            g, out = capture_graph(fn, stream=capture_stream)
            g.replay()
            torch.cuda.synchronize()
            rec["mode"] = "graph replay"
            return g, out
        except Exception as e:
            rec["capture_error"] = _err(e)
            torch.cuda.synchronize()
    rec["mode"] = "eager"
    return fn, y


def _forms(v: Loaded) -> dict[str, peers.Form]:
    """The forms to time of a loaded variant; a variant without forms is one: its call, in the `call` column."""
    if v.forms:
        return v.forms
    return {"": peers.Form(lambda x, ids, w: lambda: v.call(x, ids, w), "call")}


def _form_key(variant: str, form: str) -> str:
    """The name a form is timed under in the interleaved run: the variant's own where it has one form."""
    return f"{variant}/{form}" if form else variant


def summarise_forms(rec: dict, form_recs: dict[str, dict], times: dict[str, float], forms: dict[str, peers.Form]):
    """Fill a multi-form variant's record from its forms' (form_recs: per form mode / calc_diff / error; times:
    per form median µs): the best form per column (median_us / best from `call`, prepared_us / best_prepared from
    `prepared`), that form's mode and calc_diff, every form under rec["forms"]; an error when no form ran."""
    rec["forms"] = {}
    for name, form in forms.items():
        fr = {"column": form.column, **form.info, **form_recs.get(name, {})}
        if name in times:
            fr["median_us"] = times[name]
        rec["forms"][name] = fr
    best = peers.best_forms(times, forms)
    if "call" in best:
        name, us = best["call"]
        rec.update(median_us=us, best=name, mode=rec["forms"][name].get("mode"))
        if "calc_diff" in rec["forms"][name]:
            rec["calc_diff"] = rec["forms"][name]["calc_diff"]
    if "prepared" in best:
        rec["best_prepared"], rec["prepared_us"] = best["prepared"]
        rec.setdefault("mode", rec["forms"][rec["best_prepared"]].get("mode"))
        rec.setdefault("calc_diff", rec["forms"][rec["best_prepared"]].get("calc_diff"))
    if not best:
        errors = [fr["error"] for fr in rec["forms"].values() if "error" in fr]
        rec["error"] = errors[0] if errors else "no form ran"


def _time_cpu(runs: dict, iters: int) -> dict:
    """time_interleaved's CPU counterpart: wall-clock medians of A B C A B C ... (no graphs, no cache flush)."""
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(iters):
        for name, fn in runs.items():
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) * 1e6)
    return {k: statistics.median(v) for k, v in times.items()}


def _loop_us(fn: Callable[[], object], calls: int, sync: Callable[[], object]) -> float:
    """Per-call µs of `calls` calls back to back with one synchronisation at the end (after two warm-up calls)."""
    fn()
    fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - t0) / calls * 1e6


def _gpu_sleep(ms: float = HOST_SLEEP_MS) -> Callable[[], bool]:
    """Queue a kernel that spins for at least `ms` ms on the current stream (torch.cuda._sleep, cycles at the
    highest clock); returns a check: is it still running?"""
    ev = torch.cuda.Event()
    torch.cuda._sleep(int(ms * 1e-3 * 2.0e9))
    ev.record()
    return lambda: not ev.query()


def _host_us(fn: Callable[[], object], calls: int, sync: Callable[[], object], busy: Callable[[], Callable]) -> tuple:
    """Host µs per call, the device kept busy: `busy` queues device work ahead of the calls (a sleep kernel) so no
    call can wait for the device to drain; (µs per call, whether the device was still busy when the last call
    returned: if not, a call waited for it and the time is an upper bound)."""
    fn()
    fn()
    sync()
    running = busy()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    us = (time.perf_counter() - t0) / calls * 1e6
    still = bool(running())
    sync()
    return us, still


def _host_idle_us(fn: Callable[[], object], calls: int, sync: Callable[[], object]) -> float:
    """Median host µs of one call made with the device idle (synchronised before each): nothing of an earlier call
    is still pending, so a call that would wait for one (the value check waits for the previous call's publish)
    does not."""
    times = []
    for _ in range(calls):
        sync()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    sync()
    return statistics.median(times)


def host_overhead(
    layer: Callable,
    x,
    ids,
    w,
    graph=None,
    calls: int = HOST_CALLS,
    sync: Callable[[], object] | None = None,
    busy: Callable[[], Callable] | None = None,
) -> dict:
    """Eager-call cost of the layer, with GCMOE_CHECK_VALUES=1 and =0, next to back-to-back replays of a graph of
    the same call (graph: a CUDAGraph or None). sync: the synchronisation at the end (default: the CUDA device's).
    Also the host time alone: HOST_ONLY_CALLS calls queued behind `busy` (default: a sleep kernel), per call, and
    the median of as many single calls on an idle device."""
    sync = sync or torch.cuda.synchronize
    busy = busy or _gpu_sleep
    out: dict = {"calls": calls, "host_only_calls": HOST_ONLY_CALLS}
    for flag in ("1", "0"):
        with _env("GCMOE_CHECK_VALUES", flag):
            out[f"eager_loop_us_check{flag}"] = _loop_us(lambda: layer(x, ids, w), calls, sync)
            us, still = _host_us(lambda: layer(x, ids, w), HOST_ONLY_CALLS, sync, busy)
            out[f"host_us_check{flag}"] = us
            out[f"host_device_busy_check{flag}"] = still
            out[f"host_idle_us_check{flag}"] = _host_idle_us(lambda: layer(x, ids, w), HOST_ONLY_CALLS, sync)
    if graph is not None:
        out["graph_loop_us"] = _loop_us(graph.replay, calls, sync)
        out["host_overhead_us"] = out["eager_loop_us_check1"] - out["graph_loop_us"]
    return out


def _driver() -> dict:
    d: dict = {}
    try:
        from gcmoe_greenctx import device_facts

        d["driver_cuda_version"] = device_facts(0).driver_version
    except Exception as e:
        d["driver_cuda_version"] = f"unknown ({_err(e)})"
    if torch.cuda.is_available():
        try:
            r = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
            )
            d["driver"] = r.stdout.strip().splitlines()[0] if r.returncode == 0 and r.stdout.strip() else None
        except Exception:
            d["driver"] = None
    return d


def _model_config(model: str, ep: int, max_tokens: int) -> MoEConfig:
    if model.startswith(CUSTOM):
        try:
            h, i, e, k, s = (int(v) for v in model[len(CUSTOM) :].split(","))
        except ValueError:
            raise ValueError(f"gcmoe bench: model {model!r}: expected custom:H,I,E,top_k,shared (five ints)") from None
        return MoEConfig(h, i, e, k, s, max_tokens_per_rank=max_tokens)
    return MoEConfig.ep_slice(model, ep, max_tokens_per_rank=max_tokens)


def validate(models, tokens, variants, ep: int = 8) -> None:
    """ValueError naming what is wrong with the arguments of a run (checked before anything is measured)."""
    unknown = [v for v in variants or () if v not in VARIANTS]
    if unknown:
        raise ValueError(f"gcmoe bench: unknown variant(s) {unknown}; known: {', '.join(VARIANTS)}")
    if tokens is not None and (not tokens or min(tokens) < 1):
        raise ValueError(f"gcmoe bench: token counts must be >= 1, got {tokens}")
    max_tokens = max(256, max(tokens or TOKENS))
    for model in models or ():
        _model_config(model, ep, max_tokens)


def run(
    models: list[str] | None = None,
    tokens: list[int] | None = None,
    *,
    ep: int = 8,
    variants: list[str] | None = None,
    iters: int | None = None,
    backend: str | None = None,
    device=None,
    seed: int = 0,
    reproduce: str = "",
    l2_flush: str = L2_FLUSH,
) -> dict:
    """Measure the grid; returns {"meta": ..., "records": [...]} (one record per model, T and variant).
    models: names of gcmoe_core.config.MODEL_SHAPES, or "custom:H,I,E,top_k,shared" (a world-size-1 layer).
    l2_flush: how L2 is made cold before every run (gcmoe_lab.timing.L2_FLUSHES): "write" leaves up to L2's size of
    dirty lines that the run's own reads then evict (what triton's and DeepGEMM's benchmarks do); "read" leaves
    clean lines (as a decode step's attention, which reads the KV cache, leaves L2)."""
    from tqdm import tqdm

    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    gpu = dev.type == "cuda"
    models = list(models or (MODELS if gpu else CPU_MODELS))
    tokens = list(tokens or (TOKENS if gpu else CPU_TOKENS))
    variants = list(variants or (GPU_VARIANTS if gpu else CPU_VARIANTS))
    validate(models, tokens, variants, ep)
    if l2_flush not in L2_FLUSHES:
        raise ValueError(f"gcmoe bench: l2_flush must be one of {L2_FLUSHES}, got {l2_flush!r}")
    iters = iters or (GPU_ITERS if gpu else CPU_ITERS)
    max_tokens = max(256, max(tokens))
    bw = copy_bandwidth(dev) if gpu else None
    meta = run_meta(
        **_driver(),
        device_kind=str(dev),
        method=(
            f"variants interleaved, cold L2 ({l2_flush} flush of 4x L2) before every run, median of {iters}; "
            "graph-able variants as CUDA-graph replays"
            if gpu
            else f"CPU wall clock, variants interleaved, median of {iters} (no floor: no GPU)"
        ),
        iters=iters,
        l2_flush=l2_flush if gpu else None,
        ep=ep,
        models=models,
        tokens=tokens,
        variants=variants,
        copy_tb_s=bw / 1e12 if bw else None,
        reproduce=reproduce,
        notes=[
            *(
                []
                if gpu
                else [
                    "**a CPU run**: the layer ran on the plain-torch reference backend, not the GPU kernels; "
                    "these are CPU wall-clock times of that reference (no floor, no peers)"
                ]
            ),
            *(
                [
                    "triton_kernels and deepgemm compute the routed experts only (neither has a shared expert); "
                    "their x_floor is against floor_routed_us, and the speedups against them compare unequal work",
                    "a peer's median is its best form with everything inside the timed call (triton_kernels: best "
                    "of num_warps 8 / 4, routing metadata inside); its prepared µs is its best form with its own "
                    "harness's per-call preparation done before the timed call (triton_kernels: the routing "
                    "metadata; deepgemm: x's FP8 cast and the copies into its buffer); every form's time is in the "
                    "JSON",
                ]
                if {"triton_kernels", "deepgemm"} & set(variants)
                else []
            ),
            *(
                [
                    "torch_fp8 is timed eagerly (torch's grouped GEMMs under graph replay hit an illegal address on "
                    "torch 2.11)"
                ]
                if gpu and "torch_fp8" in variants
                else []
            ),
        ],
        layer_backends={},
        model_setup={},
    )
    records: list[dict] = []
    bar = tqdm(total=len(models) * len(tokens), desc="gcmoe bench", file=sys.stderr, dynamic_ncols=True)
    try:
        for model in models:
            _run_model(
                model, tokens, variants, ep, max_tokens, iters, backend, dev, seed, bw, meta, records, bar, l2_flush
            )
    except DeviceHang as e:  # nothing more can run on the device (nor be torn down): report what was measured
        meta["aborted"] = f"{e}; the records before it are complete"
    finally:
        bar.close()
    if not meta.get("aborted"):
        peers.shutdown()
    return {"meta": meta, "records": records}


def _run_model(
    model, tokens, variants, ep, max_tokens, iters, backend, dev, seed, bw, meta, records, bar, flush
) -> None:
    gpu = dev.type == "cuda"
    bar.set_postfix_str(f"{model}: weights")
    cfg = _model_config(model, ep, max_tokens)
    weights = make_weights(cfg, seed=seed, device=dev)
    routed_weights = MoEWeights(weights.w13, weights.w2, w13_bias=weights.w13_bias, w2_bias=weights.w2_bias)
    m = Model(model, cfg, weights, dev, backend, max_tokens, None if model.startswith(CUSTOM) else ep)
    if gpu:
        m.capture_stream = torch.cuda.Stream(dev)
    loaded: dict[str, Loaded] = {}
    load_error: dict[str, str] = {}
    setup: dict = {"config": dict(cfg.__dict__), "variants": {}}
    for name in variants:
        bar.set_postfix_str(f"{model}: load {name}")
        try:
            v = loaded[name] = VARIANTS[name].load(m)
            setup["variants"][name] = {"backend": v.backend, "work": v.work, "graph": v.graph, **v.info}
        except VariantAbsent as e:
            load_error[name] = f"absent: {e}"
        except Exception as e:
            load_error[name] = f"load: {_err(e)}"
            setup["variants"][name] = {"traceback": traceback.format_exc()[-1500:]}
        if name in load_error:
            setup["variants"].setdefault(name, {})["error"] = load_error[name]
    meta["model_setup"][model] = setup
    layer_backends = {v.backend for n, v in loaded.items() if isinstance(VARIANTS[n], LayerVariant)}
    meta["layer_backends"][model] = sorted(layer_backends)
    hung = False
    try:
        for t in tokens:
            bar.set_postfix_str(f"{model} T={t}")
            records += _run_point(m, routed_weights, t, variants, loaded, load_error, iters, seed, bw, gpu, flush)
            bar.update()
    except DeviceHang:
        hung = True  # a hung device can neither free nor synchronise: leave everything as it is
        raise
    finally:
        if not hung:
            for v in loaded.values():
                if v.close is not None:
                    v.close()
            m.layers.clear()
            loaded.clear()
            if gpu:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()


def _run_point(m: Model, routed_weights, t, variants, loaded, load_error, iters, seed, bw, gpu, flush) -> list[dict]:
    cfg, dev = m.cfg, m.device
    x, ids, w = make_tokens(cfg, t, seed=seed + 1000 + t, device=dev)
    active = int(torch.unique(ids).numel())
    refs: dict[str, torch.Tensor] = {}

    def ref(work: str) -> torch.Tensor:
        if work not in refs:
            weights = m.weights if work == LAYER_WORK else routed_weights
            if _plain_swiglu(cfg) and cfg.padded() == cfg:
                refs[work] = moe_reference(x, ids, w, weights, capturable=False)
            else:  # padded H / I, clamped SwiGLU, biases: the reference backend's layer handles them
                shared = cfg.num_shared_experts if work == LAYER_WORK else 0
                layer = MoELayer(cfg.replace(num_shared_experts=shared), dev, "reference").load(weights)
                refs[work] = layer(x, ids, w)
        return refs[work]

    point = {
        "model": m.name,
        "ep": m.ep,
        "tokens": t,
        "active_experts": active,
        "shared_experts": cfg.num_shared_experts,
    }
    floors = {}
    if bw:
        h, i = cfg.hidden_size, cfg.intermediate_size
        floors = {
            LAYER_WORK: fp4_floor_us(h, i, active + cfg.num_shared_experts, bw),
            peers.WORK: fp4_floor_us(h, i, active, bw),
        }
        point.update(floor_us=floors[LAYER_WORK], floor_routed_us=floors[peers.WORK])
    recs: dict[str, dict] = {}
    runs: dict = {}
    form_recs: dict[str, dict[str, dict]] = {}  # variant -> form -> its mode, calc_diff, error
    for name in variants:
        rec = recs[name] = {**point, "variant": name}
        if name in load_error:
            rec["error"] = load_error[name]
            continue
        v = loaded[name]
        rec.update(backend=v.backend, work=v.work)
        for fname, form in _forms(v).items():
            frec = rec if not v.forms else form_recs.setdefault(name, {}).setdefault(fname, {})
            key = _form_key(name, fname)
            try:
                runs[key], y = _prepare(form.bind(x, ids, w), v.graph, frec, m.capture_stream)
                frec["calc_diff"] = calc_diff(y.float().cpu(), ref(v.work).float().cpu())
            except DeviceHang:
                raise
            except Exception as e:
                frec["error"] = f"run: {_err(e)}"
                runs.pop(key, None)
                if gpu:
                    with contextlib.suppress(Exception):
                        torch.cuda.synchronize()
    try:
        timed = time_interleaved(runs, iters, dev, flush) if gpu else _time_cpu(runs, iters)
    except Exception as e:
        timed = {}
        for key in runs:
            name, _, fname = key.partition("/")
            (form_recs[name][fname] if fname else recs[name])["error"] = f"timing: {_err(e)}"
    times: dict[str, float] = {}  # per variant: its median (the best `call` form of a multi-form variant)
    for name in variants:
        rec = recs[name]
        v = loaded.get(name)
        if v is not None and v.forms:
            ft = {f: timed[_form_key(name, f)] for f in v.forms if _form_key(name, f) in timed}
            summarise_forms(rec, form_recs.get(name, {}), ft, v.forms)
        elif name in timed:
            rec["median_us"] = timed[name]
        if "median_us" in rec:
            times[name] = rec["median_us"]
            if floors:
                rec["x_floor"] = rec["median_us"] / floors[rec["work"]]
        if "prepared_us" in rec and floors:
            rec["prepared_x_floor"] = rec["prepared_us"] / floors[rec["work"]]
    lead = next((n for n in LEADS if n in times), None)
    if lead:
        recs[lead].update({f"speedup_vs_{n}": us / times[lead] for n, us in times.items() if n != lead})
        recs[lead].update(
            {f"speedup_vs_{n}_prepared": r["prepared_us"] / times[lead] for n, r in recs.items() if "prepared_us" in r}
        )
    if gpu and "partitioned" in loaded and "partitioned" in times:
        graph = runs["partitioned"] if isinstance(runs["partitioned"], torch.cuda.CUDAGraph) else None
        try:
            recs["partitioned"]["host"] = host_overhead(loaded["partitioned"].call, x, ids, w, graph, HOST_CALLS)
        except Exception as e:
            recs["partitioned"]["host"] = {"error": _err(e)}
    return [recs[n] for n in variants]


# ---------------------------------------------------------------------------------------------------------- output
def _fmt(v, spec: str) -> str:
    return format(v, spec) if isinstance(v, (int, float)) else "–"


def _row(cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


OPTIONAL_COLUMNS = ("floor µs", "× floor", "prepared µs", "speedup, prepared")


def markdown(result: dict) -> str:
    meta, recs = result["meta"], result["records"]
    drv = meta.get("driver") or "–"
    if meta.get("driver_cuda_version"):
        drv += f" (CUDA {meta['driver_cuda_version']})"
    lines = [
        "# gcmoe bench",
        "",
        f"{meta['date']} · {meta['device']} · driver {drv} · "
        f"torch {meta['torch']} · CuTe DSL {meta['cutlass_dsl']}"
        + (f" · copy {meta['copy_tb_s']:.2f} TB/s" if meta.get("copy_tb_s") else ""),
        "",
        f"Method: {meta['method']}.",
        "Layer backends: "
        + ", ".join(f"{m}: {'/'.join(b) or '–'}" for m, b in meta["layer_backends"].items())
        + (
            ". × floor: median / (FP4 weight + scale bytes of the active experts / copy bandwidth)"
            if meta.get("copy_tb_s")
            else ""
        )
        + "; speedup: the variant's median / the partitioned layer's (eager layer on a CPU).",
    ]
    lines += [f"Note: {n}." for n in meta.get("notes", [])]
    if meta.get("aborted"):
        lines.append(f"**Run aborted**: {meta['aborted']}.")
    lines += ["", f"Reproduce: `{meta['reproduce']}`" if meta.get("reproduce") else "", ""]
    header = ["model", "T", "active", "floor µs", "variant", "backend", "mode", "median µs", "× floor", "speedup"]
    header += ["calc_diff", "prepared µs", "speedup, prepared"]
    rows = []
    lead_of = {}
    for r in recs:
        if any(k.startswith("speedup_vs_") for k in r):
            lead_of[(r["model"], r["tokens"])] = r
    for r in recs:
        lead = lead_of.get((r["model"], r["tokens"]))
        sp = lead.get(f"speedup_vs_{r['variant']}") if lead is not None else None
        sp_s = "1.00" if lead is r else _fmt(sp, ".2f")
        floor = r.get("floor_routed_us") if r.get("work") == peers.WORK else r.get("floor_us")
        cells = [r["model"], r["tokens"], r["active_experts"], _fmt(floor, ".1f"), r["variant"], r.get("backend", "–")]
        if "error" in r:
            cells += [f"error: {r['error'][:100]}", "–", "–", "–", "–", "–", "–"]
        else:
            mode = r.get("mode") or "–"
            if "forms" in r:  # which form each column's best is
                mode += " (" + ", ".join(r[k] for k in ("best", "best_prepared") if k in r) + ")"
            cells += [mode, _fmt(r.get("median_us"), ".1f"), _fmt(r.get("x_floor"), ".2f"), sp_s]
            cells.append(_fmt(r.get("calc_diff"), ".1e"))
            sp_p = lead.get(f"speedup_vs_{r['variant']}_prepared") if lead is not None else None
            cells += [_fmt(r.get("prepared_us"), ".1f"), _fmt(sp_p, ".2f")]
        rows.append(cells)
    # columns with nothing in any row (a CPU run: no floor; no peer: nothing prepared) are left out
    keep = [i for i, name in enumerate(header) if name not in OPTIONAL_COLUMNS or any(c[i] != "–" for c in rows)]
    lines += [_row([header[i] for i in keep]), _row(["---"] * len(keep))]
    lines += [_row([c[i] for i in keep]) for c in rows]
    host = [r for r in recs if isinstance(r.get("host"), dict)]
    if host:
        lines += [
            "",
            f"Host overhead of the partitioned layer ({host[0]['host'].get('calls', HOST_CALLS)} calls back to back, "
            "one sync at the end, per call; hot L2). Host alone: calls queued behind a sleep kernel (`waited`: the "
            "device drained first, as a call with checks on waits for the previous call's publish), and single calls "
            "on an idle device (median):",
            "",
            "| model | T | graph replay µs (cold L2) | graph replays µs/call | eager µs/call, checks on | "
            "eager µs/call, checks off | eager − graph µs | host µs/call, device busy: checks on | checks off | "
            "host µs, one call on an idle device: checks on | checks off |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in host:
            h = r["host"]
            cells = [r["model"], r["tokens"], _fmt(r.get("median_us"), ".1f")]
            if "error" in h:
                cells += [f"error: {h['error']}", *[""] * 7]
            else:
                keys = ("graph_loop_us", "eager_loop_us_check1", "eager_loop_us_check0", "host_overhead_us")
                cells += [_fmt(h.get(k), ".1f") for k in keys]
                for flag in "10":  # host time alone; marked where the device drained (a call waited: upper bound)
                    busy = h.get(f"host_device_busy_check{flag}", True)
                    cells.append(_fmt(h.get(f"host_us_check{flag}"), ".1f") + ("" if busy else " (waited)"))
                cells += [_fmt(h.get(f"host_idle_us_check{flag}"), ".1f") for flag in "10"]
            lines.append(_row(cells))
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str | Path) -> None:
    """PNG: median / floor against T (µs against T without a floor), one line per (variant, model)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    recs = [r for r in result["records"] if "median_us" in r]
    use_floor = bool(recs) and all("x_floor" in r for r in recs)
    key = "x_floor" if use_floor else "median_us"
    fig = Figure(figsize=(9, 5.5), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    lines: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for r in recs:
        lines.setdefault((r["variant"], r["model"]), []).append((r["tokens"], r[key]))
    styles = ("-", "--", ":", "-.")
    models = sorted({m for _, m in lines})
    for (variant, model), pts in sorted(lines.items()):
        pts.sort()
        ax.plot(
            [p[0] for p in pts],
            [p[1] for p in pts],
            marker="o",
            linestyle=styles[models.index(model) % len(styles)],
            label=f"{variant} · {model}",
        )
    ax.set_xscale("log", base=2)
    ticks = sorted({r["tokens"] for r in recs})
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.set_xlabel("tokens per rank (T)")
    if use_floor:
        ax.set_ylabel("time / FP4 floor")
        ax.axhline(1.0, color="grey", linewidth=0.8)
    else:
        ax.set_ylabel("median µs (no floor: CPU)")
        ax.set_yscale("log")
    meta = result["meta"]
    ax.set_title(f"gcmoe bench · {meta['device']} · {meta['date']}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    if lines:
        ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(str(path))


def reproduce_command(argv: list[str] | None) -> str:
    """The command line of this run (argv: the arguments after `gcmoe-lab` or `gcmoe`, "bench" first; output paths
    dropped). The peers' copies go on PYTHONPATH first: tools/gpu/bench.sh."""
    args, skip = [], False
    for a in argv or ["bench"]:
        if skip:
            skip = False
            continue
        if a in ("--json", "--markdown", "--plot"):
            skip = True
            continue
        args.append(a)
    return "gcmoe-lab " + " ".join(shlex.quote(a) for a in args)


def run_bench(
    models=None,
    tokens=None,
    *,
    ep: int = 8,
    backend: str | None = None,
    variants=None,
    iters: int | None = None,
    json_path: str | None = None,
    md_path: str | None = None,
    plot_path: str | None = None,
    argv: list[str] | None = None,
    l2_flush: str = L2_FLUSH,
) -> int:
    """The `gcmoe bench` command: measure, print the markdown table, write the files asked for. 0 unless the run had
    to stop (a hung launch: exit code 3, after writing what it has)."""
    import json

    result = run(
        models,
        tokens,
        ep=ep,
        variants=variants,
        iters=iters,
        backend=backend,
        reproduce=reproduce_command(argv),
        l2_flush=l2_flush,
    )
    meta = result["meta"]
    backends = "; ".join(f"{m}: {', '.join(b) or 'none'}" for m, b in meta["layer_backends"].items())
    print(f"gcmoe bench on {meta['device']} ({meta['device_kind']}): layer backend {backends or 'none'}")
    table = markdown(result)
    print(table)
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=2, default=str))
    if md_path:
        Path(md_path).write_text(table)
    if plot_path:
        try:
            plot(result, plot_path)
        except ImportError as e:
            print(f"gcmoe bench: no plot ({_err(e)}; install matplotlib)", file=sys.stderr)
    if meta.get("aborted"):
        print(f"gcmoe bench: aborted: {meta['aborted']}", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(3)  # a hung kernel would block interpreter teardown
    return 0


def parser(prog: str = "gcmoe-lab bench"):
    """The bench's command line (`gcmoe-lab bench`, `gcmoe bench`)."""
    import argparse

    p = argparse.ArgumentParser(
        prog=prog, description="the layer, torch FP8 and the peers side by side over model shapes and token counts"
    )
    p.add_argument(
        "--models",
        nargs="+",
        default=None,
        help=f"models, each as its EP slice, or custom:H,I,E,top_k,shared (default: {' '.join(MODELS)}; "
        f"CPU: {' '.join(CPU_MODELS)})",
    )
    p.add_argument(
        "--tokens",
        nargs="+",
        type=int,
        default=None,
        help=f"token counts per rank (default: {' '.join(map(str, TOKENS))}; CPU: {' '.join(map(str, CPU_TOKENS))})",
    )
    p.add_argument("--ep", type=int, default=8, help="expert parallelism the rank is a slice of")
    p.add_argument("--backend", default=None, help="the gcmoe layer's backend (default: auto)")
    p.add_argument(
        "--variants",
        nargs="+",
        default=None,
        choices=list(VARIANTS),
        metavar="VARIANT",
        help=f"what to time, of {' '.join(VARIANTS)} (default: all on a GPU, {' '.join(CPU_VARIANTS)} on a CPU)",
    )
    p.add_argument(
        "--iters",
        type=int,
        default=None,
        help=f"timed runs per variant and point (default {GPU_ITERS}; CPU {CPU_ITERS})",
    )
    p.add_argument(
        "--l2-flush",
        default=L2_FLUSH,
        choices=list(L2_FLUSHES),
        help="how L2 is made cold before each run: write (dirty lines left, as triton's and DeepGEMM's benchmarks) or "
        f"read (clean lines, as after a decode step's attention); default {L2_FLUSH}",
    )
    p.add_argument(
        "--peer-forms",
        choices=("validated", "all"),
        default="validated",
        help="the peers' forms: those validated on a GPU (default) or every form (gcmoe_lab.peers)",
    )
    p.add_argument(
        "--model-step",
        action="store_true",
        help="a model's whole decode step instead of one layer: N layers behind attention / router stand-ins, "
        "captured as one graph per T, one and two micro-batches (gcmoe_lab.model_step)",
    )
    p.add_argument("--layers", type=int, default=None, help="--model-step: MoE layers (default: the model's)")
    p.add_argument(
        "--two-batch-layers",
        type=int,
        default=None,
        help="--model-step: layers of the partitioned / unpartitioned two-batch pair (default: --layers; 0: none)",
    )
    p.add_argument(
        "--peer-layers",
        type=int,
        default=None,
        help="--model-step: layers of the triton_kernels step (default: --layers; 0: none)",
    )
    p.add_argument(
        "--tune-two-batch",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="--model-step: tune the two-batch partition policy per model (gcmoe-lab tune --two-batch) before the "
        "tuned / forced / unpartitioned pair (default: on for GPU runs)",
    )
    p.add_argument("--json", metavar="PATH", default=None, help="also write the records as JSON to PATH")
    p.add_argument("--markdown", metavar="PATH", default=None, help="also write a markdown table to PATH")
    p.add_argument("--plot", metavar="PATH", default=None, help="also write a PNG plot (time / floor vs T)")
    return p


def main(argv: list[str] | None = None, prog: str = "gcmoe-lab bench") -> int:
    """`gcmoe-lab bench ARGS` (argv: ARGS). Bad arguments: exit code 2 before anything is measured."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser(prog).parse_args(argv)
    if args.model_step:
        from . import model_step

        return model_step.main(args, ["bench", *argv])
    try:
        validate(args.models, args.tokens, args.variants, args.ep)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    peers.PEER_FORMS = args.peer_forms
    return run_bench(
        args.models,
        args.tokens,
        ep=args.ep,
        backend=args.backend,
        variants=args.variants,
        iters=args.iters,
        json_path=args.json,
        md_path=args.markdown,
        plot_path=args.plot,
        l2_flush=args.l2_flush,
        argv=["bench", *argv],
    )
