"""Partition tuner (the measuring driver of gcmoe.policy): how many SMs the communication partition gets, and above
which token count a layer runs unpartitioned — per schedule (one-batch calls; two micro-batches), measured per device
and layer shape, written to the cache file the product's runtime policy reads (gcmoe.policy: GCMOE_COMM_SMS, else
this cache, else the device defaults), published as an ablation table.

    res = tune(cfg, weights, "cuda")             # one-batch: measure, write the cache file, return the record
    res = tune_two_batch(cfg, weights, "cuda")   # two-batch: the same for the file's "two_batch" entry
    print(ablation_markdown(res))
    $ gcmoe-lab tune --out docs/benchmarks      # DeepSeek-V3 and V4-Flash EP8 slices -> JSON + markdown
    $ gcmoe-lab tune --two-batch [--layers 12]  # the two-batch schedule of V3, V4-Flash and Qwen3-235B slices
    $ gcmoe tune ...                            # the same (the product's CLI hands over to the lab)

The partition only pays where the layer is short and weight-bandwidth bound, and where that ends depends on the
device and on the shape, so one tuned answer per (device, shape): gcmoe.policy.cache_path.
Valid comm sizes (gcmoe.policy.check_comm_sms): 0, or a multiple of the split granularity (8 SMs on H100/H200,
measured) leaving at least one granule to compute. The one-batch sweep covers 8..48, the design's 16-24 with margin
on both sides: at 48 the compute partition keeps 84 of 132 SMs and a bf16 GEMM alone drops from 796 to 501 TFLOP/s,
while 16-24 SMs already copy 1.2-1.5 TB/s (the green-context record of 2026-11-29: docs/benchmarks/index.md).

How `tune` measures (one-batch):
- Every variant times the public call (layer(x, topk_ids, topk_weights)) captured in a CUDA graph, cold L2 by a read
  pass before each replay (clean lines: no write-back shares HBM with the timed run), median of `iters` replays; the
  same inputs for every variant at a given T.
- One layer (its own prepacked weights, ~0.8 GB for a DeepSeek-V3 slice, and workspaces) is live at a time, so the
  sizes alternate by rounds rather than replay by replay: each round builds every size in turn (0 = unpartitioned
  included, order rotated per round) and times all T on it; a (size, T) cell is the median over rounds. Slow drift
  (clocks, temperature) thus hits every size alike. The green-context splits stay (one per size, they coexist).

How `tune_two_batch` measures (two-batch): the same rounds, cold L2, medians and decision, over a step of `layers`
(default 12) layers of the shape, each behind its attention / router stand-in (gcmoe_lab.step), run as two
micro-batches of T tokens: micro-batch 0 on the capture stream, 1 on a side stream forked and joined inside the one
captured graph, every call under gcmoe.micro_batch(i). A size's layers are MoELayer(comm_sms=c) in a LayerPool of
their own. The sweep is short (0, 8, 16, 24: TWO_BATCH_COMM_SIZES): where two micro-batches gain from a partition
(a small T, some shapes) they gain a few %, and every (size, round) builds and times a whole step, not one layer.

How both decide (choose_policy):
- comm_sms = the size with the lowest total time over the T <= 32 points (the decode sizes the design is for; larger
  T would let the compute-bound end outvote them); ties go to the smaller size (more SMs for the GEMM).
- unpartitioned_above = the largest T such that, at it and at every smaller swept T, the chosen size beats
  unpartitioned by >= 1 % (t_unpartitioned >= 1.01 t_chosen): a smaller gain is within run-to-run noise (ratios
  move by a few % between runs in the green-context record above), and the unpartitioned path needs no partition.
  Between swept points the policy stays on the safe side: a T above the last winning point runs unpartitioned. If
  the chosen size does not win at the smallest T the policy is (0, 0): never partition.

The cache file (one per device and shape) is one-batch tune's record with the two-batch entry beside it:
{key, label, policy, tokens, comm_sizes, times_us, ..., two_batch: {comm_sms, unpartitioned_above}, two_batch_tune:
the two-batch record}. Each tuner replaces its own part and keeps the other's (a file of another key, or unreadable,
is replaced). Where tune_two_batch writes first, the file's one-batch policy is (0, 0) (never partition) with a
"note" saying the one-batch schedule was not tuned.
"""

from __future__ import annotations

import gc
import json
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from gcmoe.policy import cache_path, check_comm_sms, shape_key, slug
from gcmoe_core.config import MoEConfig
from gcmoe_core.reference import MoEWeights
from gcmoe_greenctx.partition import device_facts

from . import step

TOKENS = (1, 8, 32, 128, 256)
COMM_SIZES = (8, 16, 24, 32, 40, 48)
TWO_BATCH_COMM_SIZES = (8, 16, 24)  # (with 0) the two-batch sweep
TWO_BATCH_LAYERS = 12  # layers of the two-batch step
CHOOSE_UP_TO = 32  # comm_sms is chosen on the T <= 32 points
MIN_GAIN = 1.01  # the partition must be >= 1 % faster to be used at a T
MODELS = ("deepseek-v3", "deepseek-v4-flash")
TWO_BATCH_MODELS = step.MODELS  # the model-step bench's (qwen3-235b: a lab shape, gcmoe_lab.step.LAB_SHAPES)
TWO_BATCH_KEYS = ("two_batch", "two_batch_tune")  # the two-batch part of a cache file
NOT_TUNED = "one-batch schedule not tuned on this device and shape (gcmoe-lab tune): its policy here never partitions"


def choose_policy(tokens: Sequence[int], times_us: dict[int, Sequence[float]]) -> tuple[int, int]:
    """(comm_sms, unpartitioned_above) from median times per comm size (0 = unpartitioned) per T (the rules in the
    module docstring). tokens ascending; times_us[c][j] belongs to tokens[j]."""
    small = [j for j, t in enumerate(tokens) if t <= CHOOSE_UP_TO] or [0]
    sizes = sorted(c for c in times_us if c)
    best = min(sizes, key=lambda c: (sum(times_us[c][j] for j in small), c))
    above = 0
    for j, t in enumerate(tokens):
        if times_us[0][j] < MIN_GAIN * times_us[best][j]:
            break
        above = t
    return (best, above) if above else (0, 0)


def gpu_name(device: torch.device) -> str:
    """The CUDA device's name ('NVIDIA H200'), 'CPU' for a CPU device."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"


def graph_timer(device: torch.device, iters: int) -> Callable[[Callable[[], object]], float]:
    """time_graph(fn) -> µs: fn captured in a CUDA graph (after two warm-up calls on the capture stream), median of
    `iters` replays, each after a cold-L2 read pass. Warm-up and capture share one stream: a layer keeps one lane
    for it (two, with the side stream of two micro-batches)."""
    from gcmoe_core.testing import capture_graph

    from .timing import ColdL2, time_once

    flush = ColdL2(device, "read")
    stream = torch.cuda.Stream(device)

    def time_graph(fn: Callable[[], object]) -> float:
        graph, _ = capture_graph(fn, warmup=2, device=device, stream=stream)
        graph.replay()
        torch.cuda.synchronize(device)
        return statistics.median(time_once(graph.replay, flush) for _ in range(iters))

    return time_graph


def gpu_timer(device: torch.device, iters: int) -> Callable[[object, int], float]:
    """time_fn(layer, T) -> µs: the layer's public call (graph_timer); inputs depend on T only (the same for every
    comm size)."""
    from gcmoe_core.testing import make_tokens

    time_graph = graph_timer(device, iters)

    def time_fn(layer, tokens: int) -> float:
        x, ids, w = make_tokens(layer.cfg, tokens, seed=tokens, device=device)
        return time_graph(lambda: layer(x, ids, w))

    return time_fn


def two_batch_timer(cfg: MoEConfig, device: torch.device, iters: int, layers: int, seed: int = 0):
    """time_fn(moes, T) -> µs: the two-batch step of `moes` (gcmoe_lab.step.run_two_batch: micro-batch 0 on the
    capture stream, 1 on a side stream, one graph; graph_timer); stand-ins and inputs depend on T only."""
    time_graph = graph_timer(device, iters)
    standins = step.make_standins(cfg, layers, device, seed)
    side = torch.cuda.Stream(device)

    def time_fn(moes, tokens: int) -> float:
        xa, xb = step.step_inputs(cfg, tokens, seed, device)
        return time_graph(lambda: step.run_two_batch(standins, moes, xa, xb, side))

    return time_fn


def _free(device: torch.device) -> None:
    """After the last reference to a layer is dropped: collect it and return its memory before the next is built."""
    if device.type != "cuda":
        return
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()


def _setup(device, device_name, tokens, comm_sizes, rounds, iters, time_fn, what: str):
    """(device, its name, SM count or None, tokens sorted, sizes with 0 first) or ValueError naming `what`."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    name = device_name or gpu_name(device)
    sm_count = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else None
    tokens = sorted(set(tokens))
    if not tokens or tokens[0] < 1:
        raise ValueError(f"{what}: tokens must be positive token counts, got {tokens}")
    sizes = [0, *sorted({check_comm_sms(c, sm_count, f"{what}: comm_sizes") for c in comm_sizes} - {0})]
    if len(sizes) < 2:
        raise ValueError(f"{what}: comm_sizes needs at least one partition size (> 0) to compare with unpartitioned")
    if rounds < 1 or iters < 1:
        raise ValueError(f"{what}: rounds and iters must be >= 1, got {rounds} and {iters}")
    if time_fn is None and device.type != "cuda":
        raise ValueError(f"{what}: timing needs a CUDA device, got {device} (or pass time_fn)")
    return device, name, sm_count, tokens, sizes


def _sweep(device, tokens, sizes, rounds: int, make: Callable[[int], object], time_fn) -> tuple[dict, str | None]:
    """({size: median µs per T}, backend): per round every size built by make(size) in rotated order, all T timed on
    it by time_fn(built, T), then dropped; a cell is the median over rounds."""
    samples: dict[int, list[list[float]]] = {c: [[] for _ in tokens] for c in sizes}
    backend = None
    for r in range(rounds):
        for c in sizes[r % len(sizes) :] + sizes[: r % len(sizes)]:
            built = make(c)
            first = built[0] if isinstance(built, list) and built else built
            backend = getattr(first, "backend", backend)
            for j, t in enumerate(tokens):
                samples[c][j].append(float(time_fn(built, t)))
            del built, first
            _free(device)
    return {c: [statistics.median(s) for s in samples[c]] for c in sizes}, backend


def _record(cfg, name, sm_count, device, label, tokens, sizes, times, backend, iters, rounds, method) -> dict:
    """A tuner's record: the policy choose_policy takes from the times, what was swept, how, and the run's meta."""
    from .timing import run_meta

    comm, above = choose_policy(tokens, times)
    return {
        "key": shape_key(cfg, name),
        "label": label,
        "policy": {"comm_sms": comm, "unpartitioned_above": above},
        "tokens": tokens,
        "comm_sizes": sizes,
        "times_us": {str(c): times[c] for c in sizes},
        "method": method,
        "backend": backend,
        "iters": iters,
        "rounds": rounds,
        "meta": run_meta(device=name, driver_cuda=device_facts(device.index).driver_version if sm_count else None),
    }


def _read_cache(path: Path, key: dict) -> dict | None:
    """The cache file's contents where it is a readable record of this key, else None (it will be replaced)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("key") == key else None


def _write_cache(path: Path, data: dict) -> dict:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))
    return json.loads(json.dumps(data))  # exactly what the file holds (string keys)


def tune(
    cfg: MoEConfig,
    weights: MoEWeights | None,
    device,
    tokens: Sequence[int] = TOKENS,
    comm_sizes: Sequence[int] = COMM_SIZES,
    iters: int = 20,
    time_fn: Callable[[object, int], float] | None = None,
    *,
    make_layer: Callable[[int], object] | None = None,
    rounds: int = 3,
    label: str | None = None,
    device_name: str | None = None,
) -> dict:
    """Measure the layer at every comm size (and unpartitioned) and token count, choose the one-batch policy, write
    it to the cache file (keeping a two-batch entry already there) and return what the file holds. time_fn(layer, T)
    -> µs and make_layer(comm_sms) -> layer default to the GPU timer and gcmoe.MoELayer(cfg, device,
    comm_sms=c).load(weights); label names the model in the record and the reproduce line; device_name (default: the
    device's) keys the cache file."""
    device, name, sm_count, tokens, sizes = _setup(
        device, device_name, tokens, comm_sizes, rounds, iters, time_fn, "tune"
    )
    if make_layer is None:
        from gcmoe import MoELayer

        make_layer = lambda c: MoELayer(cfg, device, comm_sms=c).load(weights)
    times, backend = _sweep(device, tokens, sizes, rounds, make_layer, time_fn or gpu_timer(device, iters))
    method = (
        f"public call captured in a CUDA graph, cold L2 (read pass), median of {iters} replays per round, "
        f"median of {rounds} rounds (comm sizes rebuilt in rotated order each round)"
    )
    result = _record(cfg, name, sm_count, device, label, tokens, sizes, times, backend, iters, rounds, method)
    path = cache_path(cfg, name)
    old = _read_cache(path, result["key"]) or {}
    return _write_cache(path, {**result, **{k: old[k] for k in TWO_BATCH_KEYS if k in old}})


def tune_two_batch(
    cfg: MoEConfig,
    weights: MoEWeights | None,
    device,
    tokens: Sequence[int] = TOKENS,
    comm_sizes: Sequence[int] = TWO_BATCH_COMM_SIZES,
    iters: int = 20,
    time_fn: Callable[[list, int], float] | None = None,
    *,
    make_layers: Callable[[int], list] | None = None,
    layers: int = TWO_BATCH_LAYERS,
    rounds: int = 3,
    label: str | None = None,
    device_name: str | None = None,
) -> dict:
    """Measure a two-batch step of `layers` layers at every comm size (and unpartitioned) and token count, choose
    the two-batch policy, write it as the cache file's "two_batch" entry (its record as "two_batch_tune"; the
    one-batch part kept, or (0, 0) with a note where there is none) and return the record. time_fn(moes, T) -> µs
    and make_layers(comm_sms) -> moes default to two_batch_timer and `layers` gcmoe.MoELayer(cfg, device,
    comm_sms=c, pool=<the size's LayerPool>) loaded from weights."""
    if layers < 1:
        raise ValueError(f"tune_two_batch: layers must be >= 1, got {layers}")
    device, name, sm_count, tokens, sizes = _setup(
        device, device_name, tokens, comm_sizes, rounds, iters, time_fn, "tune_two_batch"
    )
    if make_layers is None:
        from gcmoe import LayerPool

        pools: dict[int, LayerPool] = {}
        make_layers = lambda c: step.build_layers(
            cfg, weights, layers, device, comm_sms=c, tag=f"tune{c}.", pool=pools.setdefault(c, LayerPool())
        )[0]
    time_fn = time_fn or two_batch_timer(cfg, device, iters, layers)
    times, backend = _sweep(device, tokens, sizes, rounds, make_layers, time_fn)
    method = (
        f"a {layers}-layer step (stand-ins + layers) as two micro-batches on two streams, captured in one CUDA graph, "
        f"cold L2 (read pass), median of {iters} replays per round, median of {rounds} rounds (comm sizes rebuilt "
        "in rotated order each round, each in its own LayerPool)"
    )
    result = _record(cfg, name, sm_count, device, label, tokens, sizes, times, backend, iters, rounds, method)
    result["layers"] = layers
    path = cache_path(cfg, name)
    base = _read_cache(path, result["key"]) or {
        "key": result["key"],
        "label": label,
        "policy": {"comm_sms": 0, "unpartitioned_above": 0},
        "note": NOT_TUNED,
    }
    return _write_cache(path, {**base, "two_batch": result["policy"], "two_batch_tune": result})["two_batch_tune"]


def reproduce_command(result: dict) -> str:
    model = result.get("label") or "<model>"
    two_batch = f"--two-batch --layers {result['layers']} " if "layers" in result else ""
    return (
        f"gcmoe-lab tune {two_batch}--models {model} --tokens {' '.join(map(str, result['tokens']))} "
        f"--comm-sizes {' '.join(str(c) for c in result['comm_sizes'] if c)} --iters {result['iters']} "
        f"--out docs/benchmarks"
    )


def ablation_markdown(result: dict) -> str:
    """The published table of one tune record (one-batch, or two-batch: it has "layers"): rows = comm SMs (0 =
    unpartitioned), per T the median µs and the ratio to unpartitioned; then the chosen policy and the command that
    reproduces it."""
    k, meta, pol = result["key"], result["meta"], result["policy"]
    tokens, times = result["tokens"], result["times_us"]
    base = times["0"]
    title = result.get("label") or "layer"
    schedule = f" — two micro-batches of a {result['layers']}-layer step" if "layers" in result else ""
    shape = (
        f"H={k['hidden_size']}, I={k['intermediate_size']}, {k['local_experts']} local experts, top-{k['top_k']}, "
        f"shared={k['num_shared_experts']}, ep_size={k['ep_size']}"
    )
    head = "| comm SMs | " + " | ".join(f"T={t} µs | T={t} ratio" for t in tokens) + " |"
    lines = [head, "|" + " --- |" * (1 + 2 * len(tokens))]
    for c in result["comm_sizes"]:
        row = times[str(c)]
        cells = " | ".join(f"{us:.1f} | {us / b:.3f}" for us, b in zip(row, base))
        label = "0 (unpartitioned)" if c == 0 else f"**{c} (chosen)**" if c == pol["comm_sms"] else str(c)
        lines.append(f"| {label} | {cells} |")
    if pol["comm_sms"]:
        chosen = (
            f"comm_sms = {pol['comm_sms']} (lowest total time over T ≤ {CHOOSE_UP_TO}), unpartitioned above "
            f"T = {pol['unpartitioned_above']} (up to there the partition is ≥ {MIN_GAIN - 1:.0%} faster at every "
            f"swept T)"
        )
    else:
        chosen = f"never partition (the best comm size is not ≥ {MIN_GAIN - 1:.0%} faster at T = {tokens[0]})"
    return "\n".join(
        [
            f"## {title}{schedule} — {shape}",
            "",
            f"{meta['date']} · {k['device']} · driver CUDA {meta.get('driver_cuda')} · torch {meta['torch']} · "
            f"cutlass-dsl {meta['cutlass_dsl']} · backend {result.get('backend')}",
            "",
            *lines,
            "",
            "ratio = time / unpartitioned time at the same T (< 1: the partition is faster). "
            f"Method: {result['method']}.",
            "",
            f"{'Two-batch policy' if schedule else 'Policy'}: {chosen}.",
            "",
            f"Reproduce (on one {k['device']}): `{reproduce_command(result)}`",
            "",
        ]
    )


def parser(prog: str = "gcmoe-lab tune"):
    """The tuner's command line (`gcmoe-lab tune`, `gcmoe tune`)."""
    import argparse

    p = argparse.ArgumentParser(
        prog=prog,
        description="measure the comm partition size per model shape on this GPU, for one-batch calls or (--two-batch) "
        "two micro-batches; cache the policy",
    )
    p.add_argument(
        "--two-batch",
        action="store_true",
        help="tune the two-batch schedule: two micro-batches of a --layers step (the cache file's two_batch entry)",
    )
    p.add_argument(
        "--models",
        nargs="+",
        default=None,
        help=f"models, each as its EP8 slice (default: {' '.join(MODELS)}; --two-batch: {' '.join(TWO_BATCH_MODELS)})",
    )
    p.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS), help="token counts per rank")
    p.add_argument(
        "--comm-sizes",
        nargs="+",
        type=int,
        default=None,
        help=f"comm partition sizes (SMs; default: {' '.join(map(str, COMM_SIZES))}; --two-batch: "
        f"{' '.join(map(str, TWO_BATCH_COMM_SIZES))})",
    )
    p.add_argument(
        "--layers", type=int, default=TWO_BATCH_LAYERS, help="--two-batch: layers of the step (default %(default)s)"
    )
    p.add_argument("--iters", type=int, default=20, help="timed replays per comm size, T and round")
    p.add_argument(
        "--out", metavar="DIR", default=None, help="also write partition-ablation[-two-batch]-<device>-<date>.{json,md}"
    )
    return p


def main(argv: list[str] | None = None, prog: str = "gcmoe-lab tune") -> int:
    """`gcmoe-lab tune ARGS` (argv: ARGS): 2 without a GPU (nothing measured)."""
    args = parser(prog).parse_args(list(sys.argv[1:] if argv is None else argv))
    if not torch.cuda.is_available():
        print(
            "gcmoe tune: needs a CUDA GPU (torch.cuda.is_available() is False); nothing was measured", file=sys.stderr
        )
        return 2
    from gcmoe_core.testing import make_weights

    device = torch.device("cuda", torch.cuda.current_device())
    models = args.models or (TWO_BATCH_MODELS if args.two_batch else MODELS)
    sizes = args.comm_sizes or (TWO_BATCH_COMM_SIZES if args.two_batch else COMM_SIZES)
    what = "two-batch " if args.two_batch else ""
    results = []
    for model in models:
        cfg = step.model_config(model, 8, max(256, *args.tokens))
        print(f"gcmoe tune: {what}{model} (EP8 slice) on {gpu_name(device)} ...", file=sys.stderr)
        weights = make_weights(cfg, 0, device)
        if args.two_batch:
            res = tune_two_batch(cfg, weights, device, args.tokens, sizes, args.iters, layers=args.layers, label=model)
        else:
            res = tune(cfg, weights, device, args.tokens, sizes, args.iters, label=model)
        pol = res["policy"]
        print(
            f"{model}: {what}comm_sms={pol['comm_sms']} unpartitioned_above={pol['unpartitioned_above']} "
            f"-> {cache_path(cfg, res['key']['device'])}"
        )
        results.append(res)
        del weights
        gc.collect()
        torch.cuda.empty_cache()
    name = results[0]["key"]["device"]
    title = "Two-batch partition-size ablation" if args.two_batch else "Partition-size ablation"
    markdown = f"# {title} — {name}\n\n" + "\n".join(ablation_markdown(r) for r in results)
    print(markdown)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        kind = "partition-ablation-two-batch" if args.two_batch else "partition-ablation"
        stem = f"{kind}-{slug(name)}-{results[0]['meta']['date'][:10]}"
        (out / f"{stem}.json").write_text(json.dumps({"results": results}, indent=2))
        (out / f"{stem}.md").write_text(markdown)
        print(f"wrote {out / stem}.json and .md", file=sys.stderr)
    return 0
