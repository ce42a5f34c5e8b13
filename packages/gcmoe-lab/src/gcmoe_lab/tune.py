"""Partition tuner (the measuring driver of gcmoe.policy): how many SMs the communication partition gets, and above
which token count a layer runs unpartitioned — measured per device and layer shape, written to the cache file the
product's runtime policy reads (gcmoe.policy: GCMOE_COMM_SMS, else this cache, else the device defaults), published
as an ablation table.

    res = tune(cfg, weights, "cuda")             # measure, write the cache file, return the table + policy
    print(ablation_markdown(res))
    $ gcmoe-lab tune --out docs/benchmarks      # DeepSeek-V3 and V4-Flash EP8 slices -> JSON + markdown
    $ gcmoe tune ...                            # the same (the product's CLI hands over to the lab)

The partition only pays where the layer is short and weight-bandwidth bound, and where that ends depends on the
device and on the shape, so one tuned answer per (device, shape): gcmoe.policy.cache_path.
Valid comm sizes (gcmoe.policy.check_comm_sms): 0, or a multiple of the split granularity (8 SMs on H100/H200,
measured) leaving at least one granule to compute. The sweep covers 8..48, the design's 16-24 with margin on both
sides: at 48 the compute partition keeps 84 of 132 SMs and a bf16 GEMM alone drops from 796 to 501 TFLOP/s, while
16-24 SMs already copy 1.2-1.5 TB/s (the green-context record of 2026-11-29: docs/benchmarks/index.md).

How `tune` measures and decides:
- Every variant times the public call (layer(x, topk_ids, topk_weights)) captured in a CUDA graph, cold L2 by a read
  pass before each replay (clean lines: no write-back shares HBM with the timed run), median of `iters` replays; the
  same inputs for every variant at a given T.
- One layer (its own prepacked weights, ~0.8 GB for a DeepSeek-V3 slice, and workspaces) is live at a time, so the
  sizes alternate by rounds rather than replay by replay: each round builds every size in turn (0 = unpartitioned
  included, order rotated per round) and times all T on it; a (size, T) cell is the median over rounds. Slow drift
  (clocks, temperature) thus hits every size alike. The green-context splits stay (one per size, they coexist).
- comm_sms = the size with the lowest total time over the T <= 32 points (the decode sizes the design is for; larger
  T would let the compute-bound end outvote them); ties go to the smaller size (more SMs for the GEMM).
- unpartitioned_above = the largest T such that, at it and at every smaller swept T, the chosen size beats
  unpartitioned by >= 1 % (t_unpartitioned >= 1.01 t_chosen): a smaller gain is within run-to-run noise (ratios
  move by a few % between runs in the green-context record above), and the unpartitioned path needs no partition.
  Between swept points the policy stays on the safe side: a T above the last winning point runs unpartitioned. If
  the chosen size does not win at the smallest T the policy is (0, 0): never partition.
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

TOKENS = (1, 8, 32, 128, 256)
COMM_SIZES = (8, 16, 24, 32, 40, 48)
CHOOSE_UP_TO = 32  # comm_sms is chosen on the T <= 32 points
MIN_GAIN = 1.01  # the partition must be >= 1 % faster to be used at a T
MODELS = ("deepseek-v3", "deepseek-v4-flash")


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


def gpu_timer(device: torch.device, iters: int) -> Callable[[object, int], float]:
    """time_fn(layer, T) -> µs: the layer's public call captured in a CUDA graph, median of `iters` replays, each
    after a cold-L2 read pass; inputs depend on T only (the same for every comm size)."""
    from gcmoe_core.testing import capture_graph, make_tokens

    from .timing import ColdL2, time_once

    flush = ColdL2(device, "read")
    stream = torch.cuda.Stream(device)  # warm-up and capture on one stream: the layer keeps one lane for it

    def time_fn(layer, tokens: int) -> float:
        x, ids, w = make_tokens(layer.cfg, tokens, seed=tokens, device=device)
        graph, _ = capture_graph(lambda: layer(x, ids, w), warmup=2, device=device, stream=stream)
        graph.replay()
        torch.cuda.synchronize(device)
        return statistics.median(time_once(graph.replay, flush) for _ in range(iters))

    return time_fn


def _free(device: torch.device) -> None:
    """After the last reference to a layer is dropped: collect it and return its memory before the next is built."""
    if device.type != "cuda":
        return
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()


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
    """Measure the layer at every comm size (and unpartitioned) and token count, choose the policy, write it to
    the cache file and return the record (what the file holds). time_fn(layer, T) -> µs and make_layer(comm_sms)
    -> layer default to the GPU timer and gcmoe.MoELayer(cfg, device, comm_sms=c).load(weights); label names the
    model in the record and the reproduce line; device_name (default: the device's) keys the cache file."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    name = device_name or gpu_name(device)
    sm_count = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else None
    tokens = sorted(set(tokens))
    if not tokens or tokens[0] < 1:
        raise ValueError(f"tune: tokens must be positive token counts, got {tokens}")
    sizes = [0, *sorted({check_comm_sms(c, sm_count, "tune: comm_sizes") for c in comm_sizes} - {0})]
    if len(sizes) < 2:
        raise ValueError("tune: comm_sizes needs at least one partition size (> 0) to compare with unpartitioned")
    if rounds < 1 or iters < 1:
        raise ValueError(f"tune: rounds and iters must be >= 1, got {rounds} and {iters}")
    if time_fn is None and device.type != "cuda":
        raise ValueError(f"tune: timing needs a CUDA device, got {device} (or pass time_fn)")
    if make_layer is None:
        from gcmoe import MoELayer

        make_layer = lambda c: MoELayer(cfg, device, comm_sms=c).load(weights)
    time_fn = time_fn or gpu_timer(device, iters)

    samples: dict[int, list[list[float]]] = {c: [[] for _ in tokens] for c in sizes}
    backend = None
    for r in range(rounds):
        for c in sizes[r % len(sizes) :] + sizes[: r % len(sizes)]:
            layer = make_layer(c)
            backend = getattr(layer, "backend", backend)
            for j, t in enumerate(tokens):
                samples[c][j].append(float(time_fn(layer, t)))
            del layer
            _free(device)
    times = {c: [statistics.median(s) for s in samples[c]] for c in sizes}
    comm, above = choose_policy(tokens, times)

    from .timing import run_meta

    result = {
        "key": shape_key(cfg, name),
        "label": label,
        "policy": {"comm_sms": comm, "unpartitioned_above": above},
        "tokens": tokens,
        "comm_sizes": sizes,
        "times_us": {str(c): times[c] for c in sizes},
        "method": (
            f"public call captured in a CUDA graph, cold L2 (read pass), median of {iters} replays per round, "
            f"median of {rounds} rounds (comm sizes rebuilt in rotated order each round)"
        ),
        "backend": backend,
        "iters": iters,
        "rounds": rounds,
        "meta": run_meta(device=name, driver_cuda=device_facts(device.index).driver_version if sm_count else None),
    }
    path = cache_path(cfg, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    return json.loads(json.dumps(result))  # exactly what the file holds (string keys)


def reproduce_command(result: dict) -> str:
    model = result.get("label") or "<model>"
    return (
        f"gcmoe-lab tune --models {model} --tokens {' '.join(map(str, result['tokens']))} "
        f"--comm-sizes {' '.join(str(c) for c in result['comm_sizes'] if c)} --iters {result['iters']} "
        f"--out docs/benchmarks"
    )


def ablation_markdown(result: dict) -> str:
    """The published table of one tune record: rows = comm SMs (0 = unpartitioned), per T the median µs and the
    ratio to unpartitioned; then the chosen policy and the command that reproduces it."""
    k, meta, pol = result["key"], result["meta"], result["policy"]
    tokens, times = result["tokens"], result["times_us"]
    base = times["0"]
    title = result.get("label") or "layer"
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
            f"## {title} — {shape}",
            "",
            f"{meta['date']} · {k['device']} · driver CUDA {meta.get('driver_cuda')} · torch {meta['torch']} · "
            f"cutlass-dsl {meta['cutlass_dsl']} · backend {result.get('backend')}",
            "",
            *lines,
            "",
            "ratio = time / unpartitioned time at the same T (< 1: the partition is faster). "
            f"Method: {result['method']}.",
            "",
            f"Policy: {chosen}.",
            "",
            f"Reproduce (on one {k['device']}): `{reproduce_command(result)}`",
            "",
        ]
    )


def parser(prog: str = "gcmoe-lab tune"):
    """The tuner's command line (`gcmoe-lab tune`, `gcmoe tune`)."""
    import argparse

    p = argparse.ArgumentParser(
        prog=prog, description="measure the comm partition size per model shape on this GPU; cache the policy"
    )
    p.add_argument("--models", nargs="+", default=list(MODELS), help="models, each as its EP8 slice")
    p.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS), help="token counts per rank")
    p.add_argument("--comm-sizes", nargs="+", type=int, default=list(COMM_SIZES), help="comm partition sizes (SMs)")
    p.add_argument("--iters", type=int, default=20, help="timed replays per comm size, T and round")
    p.add_argument(
        "--out", metavar="DIR", default=None, help="also write partition-ablation-<device>-<date>.{json,md} here"
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
    results = []
    for model in args.models:
        cfg = MoEConfig.ep_slice(model, 8, max_tokens_per_rank=max(256, *args.tokens))
        print(f"gcmoe tune: {model} (EP8 slice) on {gpu_name(device)} ...", file=sys.stderr)
        res = tune(cfg, make_weights(cfg, 0, device), device, args.tokens, args.comm_sizes, args.iters, label=model)
        pol = res["policy"]
        print(
            f"{model}: comm_sms={pol['comm_sms']} unpartitioned_above={pol['unpartitioned_above']} "
            f"-> {cache_path(cfg, res['key']['device'])}"
        )
        results.append(res)
        gc.collect()
        torch.cuda.empty_cache()
    name = results[0]["key"]["device"]
    markdown = f"# Partition-size ablation — {name}\n\n" + "\n".join(ablation_markdown(r) for r in results)
    print(markdown)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        stem = f"partition-ablation-{slug(name)}-{results[0]['meta']['date'][:10]}"
        (out / f"{stem}.json").write_text(json.dumps({"results": results}, indent=2))
        (out / f"{stem}.md").write_text(markdown)
        print(f"wrote {out / stem}.json and .md", file=sys.stderr)
    return 0
