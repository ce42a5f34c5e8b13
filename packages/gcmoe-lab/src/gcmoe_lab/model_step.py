"""`gcmoe-lab bench --model-step` (also `gcmoe bench --model-step`): a model's whole decode step — N MoE layers, each
behind a stand-in for attention and the router — captured as one CUDA graph per batch size, as serving engines
capture it (issue #48, item 3).

    gcmoe-lab bench --model-step [--models deepseek-v3 deepseek-v4-flash qwen3-235b] [--layers N]
        [--tokens 1 8 32 128 256] [--iters 20] [--two-batch-layers N] [--[no-]tune-two-batch] [--peer-layers N]
        [--json PATH] [--markdown PATH]

The step, its stand-ins and its two micro-batches: gcmoe_lab.step (the model's EP8 slice, max_tokens_per_rank 256;
make_weights: random MXFP4 drawn on the device). Layer counts: MOE_LAYERS.

Per model on a GPU, in this order:
  load     per layer the prepack (layer.load) and the warm-up: the first eager step at every T, synchronised per layer
  memory   memory_allocated and device use (mem_get_info after empty_cache: driver allocations too — symmetric
           memory, green contexts, graphs) before loading, after loading, after the eager warm-up (one stream) and
           after capturing the step at the largest T (eager + one capture stream); beyond packed = growth - bytes of
           the layers' packed tensors (layer.packed.tensors); gcmoe.default_pool(device).memory_bytes() where it exists
  capture  layers_captured: N when that capture (torch.cuda.graph on torch's default capture stream, after the eager
           warm-up on the current stream, as engines do) worked, else its error
  host     at the smallest T, HOST_STEPS eager steps each queued behind a sleep kernel: the host µs of every layer
           call (time.perf_counter around it), median / p90, with the value checks on (the default) and off;
           device_busy: the sleep outlasted every step (else some call waited for the device: a checked call waits
           for the previous call's publish on its lane, any call for a free argument slot, 64 per lane)
  per T    step        the step captured as one graph, replayed; exact (torch.equal) against the eager step
           eager_step  the same step called eagerly (µs between events)
           parts       PART_SAMPLES layers (first, middle, last) and their stand-ins, each captured alone;
                       sum_us = N x (mean layer + mean stand-in): every layer has one shape, so a few stand for all
           two_batch   the batch as two micro-batches of T tokens, 0 on the current (capture) stream, 1 on a side
                       stream forked inside the one capture, issued layer by layer, each call under
                       gcmoe.micro_batch(i) where it exists; exact against the eager two-batch step
           timed side by side (gcmoe_lab.timing.time_interleaved: cold L2 before every run, medians)
  tune     with the model's layers dropped, unless --no-tune-two-batch (default: on for GPU runs):
           gcmoe_lab.tune.tune_two_batch for this shape, the run's tokens and the pair's layer count; it writes the
           two-batch policy to the tuner's cache file, which the pair's tuned layers then read (models.tune_two_batch)
  pair     --two-batch-layers (default N; 0: none) layers of each of three policies, each two-batch step captured
           and timed side by side:
             tuned_two_batch          comm_sms=None: the layer's own policy (the tuned two-batch schedule);
                                      tuned_comm_sms = the comm SMs it gives a two-batch call at T (0: unpartitioned)
             partitioned_two_batch    comm_sms=bench.PARTITION_SMS (16) forced at every T
             unpartitioned_two_batch  comm_sms=0
           tuned_over_unpartitioned = t(unpartitioned) / t(tuned); where tuned_comm_sms is 0 the tuned step is the
           unpartitioned step's graph: not timed, tuned_two_batch_us = unpartitioned_two_batch_us, the ratio 1.0 and
           tuned_same_as_unpartitioned true. forced_partitioned_over_unpartitioned = t(unpartitioned) /
           t(partitioned). Both >= 1 when the partition helps.
  peer     where triton_kernels runs (gcmoe_lab.peers): --peer-layers (default N; 0: none) TritonKernelsMoE layers
           (routed experts only) against as many gcmoe layers without the shared expert, the one-batch step of each;
           triton_kernels_over_gcmoe = t(triton_kernels step) / t(gcmoe routed step)
Record: JSON {meta (run_meta, reproduce, api: which of gcmoe.micro_batch / default_pool / MoELayer(name=) existed),
models (per model: load, memory, host, layers_captured, tune_two_batch, pair), records (per model and T), targets
({name: {value, limit, holds, note}}: TARGETS says what each value is) and the markdown beside it. The target
partitioned_over_unpartitioned_two_batch_p1_min is the min of tuned_over_unpartitioned: what the layer's policy
gives two micro-batches against never partitioning them; the forced partition's min is in the markdown's notes. A
phase that fails records its error; the others go on. Memory at P = 8 is computed (p8_memory_gb), not measured.

CPU (no CUDA): the same code on the reference backend with a small model-shaped config (CPU_MODELS, CPU_LAYERS
layers, T 1 and 4): the "graphs" are the eager callables, times wall clock, no memory, no tuning (the reference
backend never partitions: tuned = unpartitioned at every T); every target is null.
"""

from __future__ import annotations

import gc
import inspect
import json
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

import gcmoe
from gcmoe.policy import cache_path
from gcmoe_core.config import MoEConfig
from gcmoe_core.reference import MoEWeights
from gcmoe_core.testing import capture_graph, first_mismatch, make_weights

from . import bench, peers, tune
from .step import (
    LAB_SHAPES,
    MAX_TOKENS,
    MODELS,
    block,
    build_layers,
    make_standins,
    model_config,
    run_step,
    run_two_batch,
    step_inputs,
    sync,
    two_batch_comm_sms,
)
from .timing import run_meta, time_interleaved

MOE_LAYERS = {"deepseek-v3": 58, "deepseek-v4-flash": 43, "qwen3-235b": 94}  # MoE layers (dense ones left out)
TOKENS, CPU_MODELS, CPU_LAYERS, CPU_TOKENS = bench.TOKENS, ("custom:256,128,8,2,1",), 3, (1, 4)
GPU_ITERS, CPU_ITERS = 20, 3
PART_SAMPLES = 3
HOST_STEPS = 5
MICRO_BATCH_LANES = 2
GB = 1e9
TUNED, PARTITIONED, UNPARTITIONED = "tuned_two_batch", "partitioned_two_batch", "unpartitioned_two_batch"
PAIR_RATIOS = (  # (key, a, b): rec[key] = t(a) / t(b)
    ("tuned_over_unpartitioned", UNPARTITIONED, TUNED),
    ("forced_partitioned_over_unpartitioned", UNPARTITIONED, PARTITIONED),
)


# --------------------------------------------------------------------------------------------------------- measuring
class Clock:
    """GPU: graphs captured on torch's default capture stream (after the caller's eager warm-up), timed by
    time_interleaved (cold L2 before every run); CPU: the eager callables, wall clock (bench._time_cpu)."""

    def __init__(self, device: torch.device, iters: int, l2_flush: str = bench.L2_FLUSH):
        self.device, self.iters, self.l2_flush, self.gpu = device, iters, l2_flush, device.type == "cuda"

    def capture(self, fn):
        """(what to time, its output); on a GPU the output holds values after replay()."""
        return capture_graph(fn, warmup=0, device=self.device) if self.gpu else (fn, fn())

    def replay(self, g) -> None:
        if self.gpu:
            g.replay()
            sync(self.device)

    def time(self, runs: dict) -> dict:
        if not runs:
            return {}
        if self.gpu:
            return time_interleaved(runs, self.iters, self.device, self.l2_flush)
        return bench._time_cpu(runs, self.iters)


def captured(clock: Clock, fns: dict) -> tuple[dict, dict]:
    """Each fn called eagerly (its output: the reference), captured, replayed and compared bit for bit: (what to time
    per name, {exact_<name>, mismatch_<name> or <name>_error})."""
    runs, rec = {}, {}
    for name, fn in fns.items():
        try:
            ref = fn()
            runs[name], out = clock.capture(fn)
            clock.replay(runs[name])
        except Exception as e:
            runs.pop(name, None)
            rec[f"{name}_error"] = bench._err(e)
            sync(clock.device)
            continue
        outs, refs = (out, ref) if isinstance(out, tuple) else ((out,), (ref,))
        mismatch = "; ".join(m for m in map(first_mismatch, outs, refs) if m)
        rec[f"exact_{name}"] = not mismatch
        if mismatch:
            rec[f"mismatch_{name}"] = mismatch
    return runs, rec


def _check(layers) -> str:
    """'' or the error the calls recorded: the pool's one check where it exists, then every layer's."""
    try:
        pool = getattr(gcmoe, "default_pool", None)
        if pool is not None and layers[0].device.type == "cuda":
            pool(layers[0].device).check()
        for layer in layers:
            layer.check()
    except Exception as e:
        return bench._err(e)
    return ""


def _mem(device: torch.device) -> dict | None:
    if device.type != "cuda":
        return None
    sync(device)
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    pool = getattr(gcmoe, "default_pool", None)
    return {
        "allocated": torch.cuda.memory_allocated(device),
        "device": total - free,
        "pool": pool(device).memory_bytes() if pool is not None else None,
    }


def storage_bytes(tensors) -> int:
    """Bytes of the storages under `tensors` (each storage once)."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def packed_bytes(layers) -> int:
    """Bytes of the layers' packed tensors (each storage once)."""
    return storage_bytes(t for ly in layers for t in ly.packed.tensors)


def memory_record(snaps: dict, packed: int) -> dict | None:
    """GB per stage, and beyond the packed weights (growth since before_load - packed bytes): allocated and device."""
    base = snaps["before_load"]
    if base is None:
        return None
    gb = lambda v: v / GB if v is not None else None
    return {
        "packed_gb": packed / GB,
        "stages_gb": {stage: {k: gb(v) for k, v in s.items()} for stage, s in snaps.items()},
        "beyond_packed_gb": {
            stage: {k: (s[k] - base[k] - packed) / GB for k in ("allocated", "device")}
            for stage, s in snaps.items()
            if stage != "before_load"
        },
    }


def _first_step(device, standins, layers, x) -> list[float]:
    """Seconds of every layer's block in one eager step, synchronised per layer."""
    secs = []
    for s, m in zip(standins, layers, strict=True):
        sync(device)
        t0 = time.perf_counter()
        x = block(s, m, x)
        sync(device)
        secs.append(time.perf_counter() - t0)
    return secs


def host_times(clock: Clock, standins, layers, x) -> dict:
    """Host µs per layer call over HOST_STEPS eager steps, each queued behind a sleep kernel on a GPU; with the value
    checks on (GCMOE_CHECK_VALUES=1, the default) and off."""
    out: dict = {"tokens": x.shape[0]}
    for flag in "10":
        per_call, busy = [], []
        with bench._env("GCMOE_CHECK_VALUES", flag):
            for _ in range(HOST_STEPS):
                sync(clock.device)
                running = bench._gpu_sleep(max(bench.HOST_SLEEP_MS, 1.0 * len(layers))) if clock.gpu else None
                run_step(standins, layers, x, per_call)
                busy.append(bool(running()) if running else None)
                sync(clock.device)
        per_call.sort()
        out[f"check{flag}"] = {
            "calls": len(per_call),
            "median_us": statistics.median(per_call),
            "p90_us": per_call[int(0.9 * (len(per_call) - 1))],
            "device_busy": all(busy) if clock.gpu else None,
        }
    return out


def measure_point(clock: Clock, standins, layers, xa, xb, side) -> dict:
    """One T: the captured one- and two-batch steps (exact against eager), the eager step and the parts."""
    n = len(layers)
    step = lambda: run_step(standins, layers, xa)
    runs, rec = captured(clock, {"step": step, "two_batch": lambda: run_two_batch(standins, layers, xa, xb, side)})
    rec.update(layers=n, check=_check(layers) or "ok")
    h, ids, w = standins[0](xa)  # the parts' layer inputs: the first router's routing of xa
    sample = sorted({0, n // 2, n - 1})[:PART_SAMPLES]
    for i in sample:
        runs[f"layer{i}"] = clock.capture(lambda i=i: layers[i](h, ids, w))[0]
        runs[f"standin{i}"] = clock.capture(lambda i=i: standins[i](xa))[0]
    t = clock.time({**runs, "eager_step": step})
    rec.update(
        eager_step_us=t["eager_step"],
        parts_sampled=sample,
        layer_us=statistics.mean(t[f"layer{i}"] for i in sample),
        standin_us=statistics.mean(t[f"standin{i}"] for i in sample),
    )
    rec["sum_us"] = n * (rec["layer_us"] + rec["standin_us"])
    if "step" in t:
        rec.update(step_us=t["step"], step_us_per_layer=t["step"] / n, step_over_sum=t["step"] / rec["sum_us"])
        rec["eager_over_step"] = t["eager_step"] / t["step"]
    if "step" in t and "two_batch" in t:
        rec.update(two_batch_us=t["two_batch"], two_batch_over_two_steps=t["two_batch"] / (2 * t["step"]))
    return rec


def _step_fn(standins, moes, xa, xb, side):
    """The step as a call: of xa, or of two micro-batches xa, xb."""
    return (
        (lambda: run_step(standins, moes, xa)) if xb is None else (lambda: run_two_batch(standins, moes, xa, xb, side))
    )


def side_by_side(
    clock: Clock, variants: dict, inputs: dict, ratios: tuple, two_batch: bool, side, twins: dict | None = None
) -> dict[int, dict]:
    """Per T: each variant's step (name -> (standins, moes); two micro-batches or one) checked against its eager self
    and timed side by side; ratios ((key, a, b), ...): rec[key] = t(a) / t(b). twins {T: {a: b}}: at T variant a's
    step is b's graph (the same kernels on the same partitions), so it is neither captured nor timed: t(a) = t(b)."""
    out = {}
    for t, (xa, xb) in inputs.items():
        same = (twins or {}).get(t, {})
        fns = {
            name: _step_fn(s, m, xa, xb if two_batch else None, side)
            for name, (s, m) in variants.items()
            if name not in same
        }
        runs, rec = captured(clock, fns)
        times = clock.time(runs)
        times.update({a: times[b] for a, b in same.items() if b in times})
        rec.update({f"{k}_us": v for k, v in times.items()})
        for key, a, b in ratios:
            if a in times and b in times:
                rec[key] = times[a] / times[b]
        out[t] = rec
    return out


# --------------------------------------------------------------------------------------------------------- one model
@dataclass(frozen=True)
class Options:
    ep: int = 8
    backend: str | None = None
    seed: int = 0
    layers: int | None = None  # default: MOE_LAYERS (CPU_LAYERS for a custom model)
    two_batch_layers: int | None = None  # default: layers; 0: no tuned / partitioned / unpartitioned pair
    peer_layers: int | None = None  # default: layers; 0: no triton_kernels step
    tune_two_batch: bool | None = None  # tune the two-batch policy before the pair; default: on for GPU runs


def _drop(*lists) -> None:
    for lst in lists:
        lst.clear()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def run_model(model: str, tokens: list[int], opts: Options, clock: Clock, side) -> tuple[dict, list[dict]]:
    dev = clock.device
    n = opts.layers or MOE_LAYERS.get(model, CPU_LAYERS)
    cfg = model_config(model, opts.ep, max(MAX_TOKENS, *tokens))
    mrec: dict = {"layers": n, "config": dict(cfg.__dict__)}
    standins = make_standins(cfg, n, dev, opts.seed)
    weights = make_weights(cfg, seed=opts.seed, device=dev)
    inputs = {t: step_inputs(cfg, t, opts.seed, dev) for t in tokens}
    snaps = {"before_load": _mem(dev)}
    layers, prepack_s = build_layers(cfg, weights, n, dev, opts.backend)
    snaps["loaded"] = _mem(dev)
    warm = [_first_step(dev, standins, layers, inputs[t][0]) for t in tokens]  # the first eager step at every T
    snaps["eager"] = _mem(dev)
    per_layer = [sum(w[i] for w in warm) for i in range(n)]
    mrec["describe"] = layers[0].describe()
    mrec["load"] = {
        "prepack_s_per_layer": statistics.mean(prepack_s),
        "prepack_s_first_layer": prepack_s[0],
        "warmup_s_per_layer": statistics.mean(per_layer[1:] or per_layer),  # the first layer compiles, once a run
        "warmup_s_first_layer": per_layer[0],
        "warmup_s_by_tokens": {t: sum(w) for t, w in zip(tokens, warm)},
    }
    if clock.gpu:
        try:
            g, out = clock.capture(lambda: run_step(standins, layers, inputs[tokens[-1]][0]))
            mrec["layers_captured"] = n
            snaps["captured"] = _mem(dev)
            del g, out
        except Exception as e:
            mrec["layers_captured"] = f"{n} layers at T = {tokens[-1]}: {bench._err(e)}"
            sync(dev)
    mrec["memory"] = memory_record(snaps, packed_bytes(layers))
    mrec["host"] = host_times(clock, standins, layers, inputs[tokens[0]][0])
    rows = []
    for t in tokens:
        try:
            rec = measure_point(clock, standins, layers, *inputs[t], side)
        except Exception as e:
            rec = {"error": bench._err(e), "traceback": traceback.format_exc()[-1500:]}
            sync(dev)
        rows.append({"model": model, "tokens": t, **rec})
    _drop(layers)
    by_t = {r["tokens"]: r for r in rows}
    count = lambda k: n if k is None else min(k, n)
    build = lambda c, w, sms, tag: lambda k: build_layers(c, w, k, dev, opts.backend, sms, tag)[0]
    npair = count(opts.two_batch_layers)
    if npair and (clock.gpu if opts.tune_two_batch is None else opts.tune_two_batch):
        mrec["tune_two_batch"] = tuned_two_batch(cfg, weights, dev, tokens, npair, clock.iters, model)
    pair = {
        TUNED: build(cfg, weights, None, "tuned."),
        PARTITIONED: build(cfg, weights, bench.PARTITION_SMS, "partitioned."),
        UNPARTITIONED: build(cfg, weights, 0, "unpartitioned."),
    }
    mrec["pair"] = compare(clock, pair, standins, inputs, PAIR_RATIOS, side, by_t, npair, True)
    why = peers.triton_kernels_missing(dev)
    routed = MoEWeights(weights.w13, weights.w2, w13_bias=weights.w13_bias, w2_bias=weights.w2_bias)
    peer = {
        "gcmoe_routed_step": build(cfg.replace(num_shared_experts=0), routed, None, "routed."),
        "triton_kernels_step": lambda k: [peers.TritonKernelsMoE(cfg, weights, dev) for _ in range(k)],
    }
    ratios = (("triton_kernels_over_gcmoe", "triton_kernels_step", "gcmoe_routed_step"),)
    npeer = count(opts.peer_layers)
    mrec["peer"] = (
        {"error": f"absent: needs {why}"} if why else compare(clock, peer, standins, inputs, ratios, None, by_t, npeer)
    )
    return mrec, rows


def tuned_two_batch(cfg, weights, device, tokens, layers: int, iters: int, label: str) -> dict:
    """gcmoe_lab.tune.tune_two_batch for this shape (it writes the two-batch policy to the cache file the pair's
    tuned layers read): {policy, cache, the sweep's tokens, comm_sizes, times_us, layers, iters, rounds}, or its
    error."""
    try:
        res = tune.tune_two_batch(cfg, weights, device, tokens, iters=iters, layers=layers, label=label)
    except Exception as e:
        sync(device)
        return {"error": bench._err(e)}
    keep = ("policy", "tokens", "comm_sizes", "times_us", "layers", "iters", "rounds")
    return {"cache": str(cache_path(cfg, res["key"]["device"])), **{k: res[k] for k in keep}}


def compare(clock, builds: dict, standins, inputs, ratios, side, by_t, n: int, two_batch: bool = False) -> dict:
    """Each variant's n layers built (name -> build(n) -> moes), their steps measured side_by_side into the rows
    (by_t); the layers dropped after. Its record: {layers, describe (of each variant's first layer)} or an error.
    With a TUNED variant (the pair): per T tuned_comm_sms (its layers' two-batch comm SMs) and
    tuned_same_as_unpartitioned (they are 0: the TUNED step is the UNPARTITIONED step's graph, its twin)."""
    if n == 0:
        return {"layers": 0, "error": "skipped"}
    moes: dict[str, list] = {}
    try:
        for name, make in builds.items():
            moes[name] = make(n)
        comm = {t: two_batch_comm_sms(moes[TUNED][0], t) for t in inputs} if TUNED in moes else {}
        twins = {t: {TUNED: UNPARTITIONED} for t, c in comm.items() if c == 0}
        variants = {name: (standins[:n], m) for name, m in moes.items()}
        for t, r in side_by_side(clock, variants, inputs, ratios, two_batch, side, twins).items():
            by_t[t].update({"two_batch_layers" if two_batch else "peer_layers": n, **r})
            if t in comm:
                by_t[t].update(tuned_comm_sms=comm[t], tuned_same_as_unpartitioned=t in twins)
        return {"layers": n, "describe": {name: m[0].describe() for name, m in moes.items()}}
    except Exception as e:
        return {"layers": n, "error": bench._err(e)}
    finally:
        for m in moes.values():
            for p in m:
                getattr(p, "close", lambda: None)()
        _drop(*moes.values())


# ----------------------------------------------------------------------------------------------------------- targets
TARGETS = {  # name: (limit, holds when value <= or >= limit, what the value is)
    "memory_58_layers_p1_gb": (
        1.0,
        "<=",
        "GB the allocator holds beyond packed weights: 58 DeepSeek-V3 layers, eager + one capture",
    ),
    "memory_58_layers_p8_gb": (1.0, "<=", "GB beyond packed weights at P = 8, computed (p8_memory_gb)"),
    "load_s_per_layer": (1.0, "<=", "s per layer beyond the prepack: first eager steps, layers 2..N, max of models"),
    "step_over_sum_max": (1.03, "<=", "captured step / N x (layer + stand-in replays), max over models and T"),
    "two_batch_over_two_steps_max": (1.0, "<=", "two-batch step / two one-batch steps, max over models and T"),
    "partitioned_over_unpartitioned_two_batch_p1_min": (
        1.0,
        ">=",
        "t(unpartitioned) / t(the layer's tuned policy), two-batch steps, min over models and T (1.0 where the policy "
        "runs T unpartitioned: the same graph)",
    ),
    "eager_host_us_per_layer": (
        15.0,
        "<=",
        "median host µs per eager layer call (checks off: the host's own work), smallest T, max of models",
    ),
    "layers_captured": (94, ">=", "most layers of a step captured on the default capture stream after eager warm-up"),
}


def target(name: str, value, note: str | None = None) -> dict:
    limit, op, what = TARGETS[name]
    holds = value is not None and (value <= limit if op == "<=" else value >= limit)
    return {"value": value, "limit": limit, "holds": bool(holds), "note": note or what}


def lane_bytes(cfg: MoEConfig) -> int:
    """Device bytes of one lane of a layer of this config (gcmoe.backends.sm90.Lane, without W1's stream-K scratch):
        WorkspaceLayout(RingSpec.from_config(cfg)).nbytes   ring, published tokens, combine, signals
        + capacity * I                                       W1's FP8 output, uint8 [capacity, I]
        + (2 I / 256) * capacity * 4                         its scales, fp32 [2I/256, capacity]
    (virtual P = 2, 4 measured against it: gcmoe-lab probe pool_memory)."""
    from gcmoe_comm.ring import RingSpec
    from gcmoe_comm.workspace import WorkspaceLayout

    spec, inter = RingSpec.from_config(cfg.padded()), cfg.padded_intermediate
    return WorkspaceLayout(spec).nbytes + spec.capacity * inter + (2 * inter // 256) * spec.capacity * 4


def p8_memory_gb(model: str = "deepseek-v3", ep: int = 8, max_tokens: int = MAX_TOKENS, lanes: int = MICRO_BATCH_LANES):
    """GB beyond packed weights of a model's MoE layers at P = ep, computed per pool (not per layer): each lane (one
    per micro-batch in flight) is lane_bytes, total = lanes * lane."""
    if model in LAB_SHAPES:
        cfg = MoEConfig(*LAB_SHAPES[model], ep_size=ep, max_tokens_per_rank=max_tokens)
    else:
        cfg = MoEConfig.from_model(model, ep_size=ep, max_tokens_per_rank=max_tokens)
    return lanes * lane_bytes(cfg) / GB


def _get(d: dict, path: str):
    for k in path.split("."):
        d = d.get(k) if isinstance(d, dict) else None
    return d


def targets(result: dict) -> dict:
    if not result["meta"]["device_kind"].startswith("cuda"):
        return {n: target(n, None, "CPU run (reference backend, wall clock): measures no target") for n in TARGETS}
    models, rows = list(result["models"].values()), result["records"]

    def pick(recs, path, f):
        vals = [v for v in (_get(r, path) for r in recs) if isinstance(v, (int, float)) and not isinstance(v, bool)]
        return f(vals) if vals else None

    ds = result["models"].get("deepseek-v3") or {}
    # tensors held (allocated); the device-level figure also counts free blocks inside the allocator's segments
    # (the prepack's temporaries leave them at load: reusable by the process, not returned by empty_cache)
    mem = _get(ds, "memory.beyond_packed_gb.captured.allocated") if ds.get("layers") == 58 else None
    device = _get(ds, "memory.beyond_packed_gb.captured.device")
    values = {
        "memory_58_layers_p1_gb": mem,
        "memory_58_layers_p8_gb": p8_memory_gb(),
        "load_s_per_layer": pick(models, "load.warmup_s_per_layer", max),
        "step_over_sum_max": pick(rows, "step_over_sum", max),
        "two_batch_over_two_steps_max": pick(rows, "two_batch_over_two_steps", max),
        "partitioned_over_unpartitioned_two_batch_p1_min": pick(rows, "tuned_over_unpartitioned", min),
        # the host's own work per call: value checks off (with them on, each call waits for the previous layer's
        # publish, so behind a busy device its time is the device's; recorded as host.check1)
        "eager_host_us_per_layer": pick(models, "host.check0.median_us", max),
        "layers_captured": pick(models, "layers_captured", max),
    }
    out = {name: target(name, v) for name, v in values.items()}
    if mem is None:
        out["memory_58_layers_p1_gb"]["note"] = "not measured: this record has no captured 58-layer DeepSeek-V3 step"
    elif device is not None:
        loaded = _get(ds, "memory.beyond_packed_gb.loaded.device")
        at_load = f", of which {loaded:.2f} GB already at load before any call" if loaded is not None else ""
        out["memory_58_layers_p1_gb"]["note"] += (
            f"; device level {device:.2f} GB{at_load} (free blocks inside the allocator's segments: the prepack's"
            " temporaries leave them)"
        )
    return out


# ----------------------------------------------------------------------------------------------------------- the run
def api() -> dict:
    """Which of the pool API the installed gcmoe has (the record says what ran)."""
    named = "name" in inspect.signature(gcmoe.MoELayer).parameters
    return {"micro_batch": hasattr(gcmoe, "micro_batch"), "default_pool": hasattr(gcmoe, "default_pool"), "name": named}


def validate(models, tokens, opts: Options) -> None:
    """ValueError naming what is wrong with the arguments (before anything is measured)."""
    if tokens is not None and (not tokens or min(tokens) < 1 or max(tokens) > MAX_TOKENS):
        raise ValueError(f"gcmoe bench --model-step: token counts must be in [1, {MAX_TOKENS}], got {tokens}")
    for name, least in (("layers", 1), ("two_batch_layers", 0), ("peer_layers", 0)):
        if getattr(opts, name) is not None and getattr(opts, name) < least:
            raise ValueError(f"gcmoe bench --model-step: --{name.replace('_', '-')} must be >= {least}")
    for model in models or ():
        model_config(model, opts.ep)
        if model not in MOE_LAYERS and not model.startswith(bench.CUSTOM) and opts.layers is None:
            raise ValueError(f"gcmoe bench --model-step: no layer count for {model!r} here: pass --layers")


def run(models=None, tokens=None, opts: Options = Options(), *, iters=None, device=None, reproduce="", l2_flush=None):
    """Measure every model's step: {"meta", "models", "records", "targets"} (module docstring)."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    gpu = dev.type == "cuda"
    models, tokens = list(models or (MODELS if gpu else CPU_MODELS)), sorted(tokens or (TOKENS if gpu else CPU_TOKENS))
    validate(models, tokens, opts)
    clock = Clock(dev, iters or (GPU_ITERS if gpu else CPU_ITERS), l2_flush or bench.L2_FLUSH)
    method = (
        f"CUDA-graph replays interleaved, cold L2 ({clock.l2_flush} flush of 4x L2) before every run, median of "
        f"{clock.iters}; eager steps between events"
        if gpu
        else f"CPU wall clock of eager calls, interleaved, median of {clock.iters} (no graphs, no memory)"
    )
    meta = run_meta(
        **bench._driver(),
        device_kind=str(dev),
        method=method,
        iters=clock.iters,
        models=models,
        tokens=tokens,
        options=dict(opts.__dict__),
        api=api(),
        reproduce=reproduce,
    )
    result: dict = {"meta": meta, "models": {}, "records": []}
    side = torch.cuda.Stream(dev) if gpu else None
    for model in models:
        print(f"gcmoe bench --model-step: {model}", file=sys.stderr)
        try:
            result["models"][model], rows = run_model(model, tokens, opts, clock, side)
            result["records"] += rows
        except Exception as e:
            result["models"][model] = {"error": bench._err(e), "traceback": traceback.format_exc()[-1500:]}
        _drop()
    result["targets"] = targets(result)
    if gpu:
        peers.shutdown()
    return result


# ------------------------------------------------------------------------------------------------------------ output
# "header=path in the record" ("a.b": nested), "; "-separated; the format follows the path's ending (_fmt)
MODEL_COLUMNS = (
    "layers=layers; backend=describe.backend; prepack s/layer=load.prepack_s_per_layer; warm-up s/layer="
    "load.warmup_s_per_layer; first layer's warm-up s=load.warmup_s_first_layer; packed GB=memory.packed_gb; "
    "beyond packed GB: eager=memory.beyond_packed_gb.eager.device; + capture=memory.beyond_packed_gb.captured.device; "
    "pool GB=memory.stages_gb.captured.pool; layers captured=layers_captured; host µs/call=host.check1.median_us; "
    "p90=host.check1.p90_us; busy=host.check1.device_busy; checks off µs=host.check0.median_us; "
    "p90=host.check0.p90_us; busy=host.check0.device_busy"
)
STEP_COLUMNS = (
    "T=tokens; layers=layers; step µs=step_us; µs/layer=step_us_per_layer; eager µs=eager_step_us; sum µs=sum_us; "
    "step / sum=step_over_sum; two-batch µs=two_batch_us; two-batch / 2 steps=two_batch_over_two_steps; "
    "exact=exact_step; exact two-batch=exact_two_batch; pair layers=two_batch_layers; "
    "unpartitioned µs=unpartitioned_two_batch_us; tuned comm SMs=tuned_comm_sms; tuned µs=tuned_two_batch_us; "
    "unpart. / tuned=tuned_over_unpartitioned; tuned is unpart.=tuned_same_as_unpartitioned; "
    "forced part. µs=partitioned_two_batch_us; unpart. / forced part.=forced_partitioned_over_unpartitioned; "
    "peer layers=peer_layers; gcmoe routed µs=gcmoe_routed_step_us; triton_kernels µs=triton_kernels_step_us; "
    "triton / gcmoe=triton_kernels_over_gcmoe"
)


def _fmt(path: str) -> str:
    if "_over_" in path:
        return ".3f"
    return ".1f" if "_us" in path else ".2f" if path.endswith(("_gb", "_layer", ".pool")) else ""


def _cell(v, spec: str) -> str:
    if isinstance(v, bool) or v is None:
        return {True: "yes", False: "no", None: "–"}[v]
    return format(v, spec) if isinstance(v, (int, float)) and spec else str(v)


def _table(recs: list[tuple[str, dict]], columns: str) -> list[str]:
    """A markdown table, a row per (model, record); a last column with the record's errors and mismatches."""
    cols = [c.split("=") for c in columns.split("; ")]
    lines = [bench._row(["model", *(c[0] for c in cols), "errors"]), bench._row(["---"] * (len(cols) + 2))]
    for model, r in recs:
        notes = "; ".join(f"{k}: {v}" for k, v in r.items() if k.endswith("error") or k.startswith("mismatch_"))
        lines.append(bench._row([model, *(_cell(_get(r, path), _fmt(path)) for _, path in cols), notes]))
    return lines


def _policy_text(mrec: dict) -> str:
    """The two-batch policy the pair's tuned layers ran with, in words."""
    tuned = mrec.get("tune_two_batch")
    if tuned is None:
        desc = _get(mrec, f"pair.describe.{TUNED}.policy.source")
        return f"not tuned in this run (the layer's policy: {desc or 'see pair.describe'})"
    if "error" in tuned:
        return f"tuning failed ({tuned['error']}); the layer's cached or default policy ran"
    pol = tuned["policy"]
    if not pol["comm_sms"]:
        return f"never partition (tuned here over comm SMs {tuned['comm_sizes']})"
    return f"{pol['comm_sms']} comm SMs up to T = {pol['unpartitioned_above']} (tuned here over {tuned['comm_sizes']})"


def notes(result: dict) -> list[str]:
    """What the two-batch target measures, the forced partition's min beside it and each model's tuned policy."""
    rows = result["records"]
    forced = [r["forced_partitioned_over_unpartitioned"] for r in rows if "forced_partitioned_over_unpartitioned" in r]
    return [
        "- partitioned_over_unpartitioned_two_batch_p1_min measures the layer's own partition policy in the "
        "two-batch schedule at P = 1: t(unpartitioned two-batch step) / t(two-batch step of layers built with "
        "comm_sms=None, which read the two-batch policy tuned for this device and shape), min over models and T "
        "(column unpart. / tuned). Where that policy runs T unpartitioned (tuned comm SMs 0) the two steps are the "
        "same graph: the tuned one is not timed and its ratio is recorded as 1.0 (tuned is unpart.: yes). The "
        "target holds when no T at which the policy partitions runs slower than unpartitioned.",
        f"- The forced {bench.PARTITION_SMS}-SM partition at every T (comm_sms={bench.PARTITION_SMS}; not a target): "
        f"unpart. / forced part. min {_cell(min(forced) if forced else None, '.3f')}.",
        *(f"- {model}: two-batch policy {_policy_text(m)}." for model, m in result["models"].items() if "pair" in m),
    ]


def markdown(result: dict) -> str:
    meta, api = result["meta"], result["meta"]["api"]
    lines = [
        "# gcmoe model step",
        "",
        f"{meta['date']} · {meta['device']} · driver {meta.get('driver') or '–'} · torch {meta['torch']} · "
        f"CuTe DSL {meta['cutlass_dsl']}",
        "",
        f"Method: {meta['method']}. gcmoe API present: " + ", ".join(f"{k} {_cell(v, '')}" for k, v in api.items()),
        "",
        f"Reproduce: `{meta['reproduce']}`",
        "",
        "## Targets",
        "",
        "| target | value | limit | holds | what |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, t in result["targets"].items():
        lines.append(bench._row([name, _cell(t["value"], ".3g"), t["limit"], _cell(t["holds"], ""), t["note"]]))
    lines += ["", "## Notes", "", *notes(result)]
    lines += ["", "## Models", "", *_table(list(result["models"].items()), MODEL_COLUMNS)]
    lines += ["", "## Steps", "", *_table([(r["model"], r) for r in result["records"]], STEP_COLUMNS)]
    return "\n".join(lines) + "\n"


def main(args, argv: list[str]) -> int:
    """`gcmoe-lab bench --model-step ...` (args: bench.parser's namespace; argv: "bench" and its arguments)."""
    opts = Options(
        ep=args.ep,
        backend=args.backend,
        layers=args.layers,
        two_batch_layers=args.two_batch_layers,
        peer_layers=args.peer_layers,
        tune_two_batch=args.tune_two_batch,
    )
    try:
        validate(args.models, args.tokens, opts)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    if args.plot:
        print("gcmoe bench --model-step: no plot (the JSON and markdown hold the record)", file=sys.stderr)
    reproduce = bench.reproduce_command(argv)
    result = run(args.models, args.tokens, opts, iters=args.iters, reproduce=reproduce, l2_flush=args.l2_flush)
    table = markdown(result)
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    if args.markdown:
        Path(args.markdown).write_text(table)
    return 0
