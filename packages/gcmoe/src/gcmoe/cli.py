"""The `gcmoe` command: info, demo (one decode step of a model-shaped layer, checked), and bench / tune, which live in
the gcmoe-lab package (benchmarks beside the product, never inside it): those two import it only when called and hand
it their arguments; without it they say how to install it (exit code 2).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from importlib import metadata

import torch

from gcmoe_core.cutedsl import dsl_version

PACKAGES = ("gcmoe", "gcmoe-core", "gcmoe-greenctx", "gcmoe-comm", "gcmoe-gemm-sm90", "gcmoe-gemm-sm103")
LAB_COMMANDS = {
    "bench": "the layer, torch FP8 and the peers side by side (gcmoe-lab bench; needs gcmoe-lab)",
    "tune": "measure and cache the comm partition size per model shape (gcmoe-lab tune; needs gcmoe-lab)",
}


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        mod = __import__(dist.replace("-", "_"))
        return getattr(mod, "__version__", None)
    except Exception:
        return None


def info() -> dict:
    from gcmoe_greenctx import device_facts

    from .backends import BACKENDS

    out: dict = {
        "packages": {p: _version(p) for p in PACKAGES},
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cutlass_dsl": dsl_version(),
        "devices": [],
    }
    facts0 = device_facts(0)
    out["driver_cuda_version"] = facts0.driver_version
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            facts = device_facts(i)
            out["devices"].append(
                {
                    "index": i,
                    "name": p.name,
                    "arch": f"sm_{p.major}{p.minor}",
                    "sm_count": p.multi_processor_count,
                    "memory_gib": round(p.total_memory / 2**30, 1),
                    "green_contexts": facts.as_dict(),
                }
            )
    dev = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    out["backends"] = {
        n: ("runnable" if why is None else f"unavailable: needs {why}")
        for n, b in BACKENDS.items()
        for why in [b.missing(dev)]
    }
    return out


def _print_info(d: dict) -> None:
    print("gcmoe " + " ".join(f"{k}={v}" for k, v in d["packages"].items()))
    print(
        f"python {d['python']} | torch {d['torch']} (CUDA {d['torch_cuda']}) | cutlass-dsl {d['cutlass_dsl']} | "
        f"driver CUDA {d['driver_cuda_version']}"
    )
    if not d["devices"]:
        print("devices: none (CPU only)")
    for dev in d["devices"]:
        g = dev["green_contexts"]
        gc = (
            f"green contexts: yes, split granularity {g['granularity']} SMs (minSmPartitionSize "
            f"{g['min_partition_size']}, smCoscheduledAlignment {g['coscheduled_alignment']}), split API "
            f"{g['split_api']}, workqueue isolation {'yes' if g['workqueue_config'] else 'no (driver < CUDA 13.1)'}"
            if g["green_contexts"]
            else f"green contexts: no ({g['reason']})"
        )
        print(
            f"device {dev['index']}: {dev['name']} {dev['arch']} {dev['sm_count']} SMs {dev['memory_gib']} GiB | {gc}"
        )
    for name, st in d["backends"].items():
        print(f"backend {name}: {st}")


def _median_us(fn, iters: int, device: torch.device, warmup: int) -> float:
    """Median µs of `iters` eager calls after `warmup` ones: CUDA events on a GPU, wall clock on a CPU."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def demo(
    model: str, ep: int, tokens: int, backend: str | None, seed: int, device: str | None, shape: str | None = None
) -> dict:
    from tqdm import tqdm

    from gcmoe_core.config import MoEConfig
    from gcmoe_core.reference import moe_reference_loop_fp64
    from gcmoe_core.testing import calc_diff, make_tokens, make_weights

    from .layer import MoELayer

    if shape:
        h, i, e, k, s = (int(v) for v in shape.split(","))
        cfg = MoEConfig(h, i, e, k, s, max_tokens_per_rank=max(256, tokens))
        label = f"custom H={h} I={i} E={e} top-{k} shared={s}"
    else:
        cfg = MoEConfig.ep_slice(model, ep, max_tokens_per_rank=max(256, tokens))
        label = f"{model}, one rank under EP={ep} ({cfg.num_experts} local experts)"
    dev = torch.device(device) if device else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    steps = tqdm(total=4, desc="gcmoe demo", file=sys.stderr, disable=not sys.stderr.isatty())
    steps.set_postfix_str("weights")
    weights = make_weights(cfg, seed=seed, device=dev)
    steps.update()
    layer = MoELayer(cfg, device=dev, backend=backend).load(weights)
    steps.set_postfix_str(f"prepack ({layer.backend})")
    steps.update()
    x, ids, w = make_tokens(cfg, tokens, seed=seed + 1, device=dev)
    steps.set_postfix_str("run")
    y = layer(x, ids, w)
    gpu = dev.type == "cuda"
    secs = _median_us(lambda: layer(x, ids, w), 20 if gpu else 2, dev, warmup=4 if gpu else 1) * 1e-6
    steps.update()
    steps.set_postfix_str("check")
    ref = moe_reference_loop_fp64(x, ids, w, weights)
    err = calc_diff(y.cpu(), ref.cpu())
    steps.update()
    steps.close()
    return {
        "layer": label,
        "config": cfg.__dict__,
        "tokens": tokens,
        "backend": layer.backend,
        "device": str(dev),
        "time_us": round(secs * 1e6, 1),
        "check": "independent float64 loop (gcmoe_core.reference)",
        "calc_diff": err,
        "ok": bool(err <= 1e-3),
        "output_norm": float(y.float().norm()),
    }


def lab(command: str, args: list[str]) -> int:
    """`gcmoe bench` / `gcmoe tune`: gcmoe-lab's command with these arguments; 2 with one line when the lab is not
    installed."""
    try:
        from gcmoe_lab.cli import run
    except ModuleNotFoundError as e:
        if e.name != "gcmoe_lab" and not (e.name or "").startswith("gcmoe_lab."):
            raise
        print(f"gcmoe {command} needs gcmoe-lab: pip install gcmoe-lab / uv sync --package gcmoe-lab", file=sys.stderr)
        return 2
    return run(command, args, prog=f"gcmoe {command}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gcmoe", description="gcmoe: MoE decode operator (green-context partitioned)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p_info = sub.add_parser("info", help="versions, device, green-context facts, runnable backends")
    p_info.add_argument("--json", action="store_true")
    p_demo = sub.add_parser("demo", help="one decode step of a model-shaped layer, checked against the reference")
    p_demo.add_argument("--model", default="deepseek-v4-flash")
    p_demo.add_argument("--ep", type=int, default=8, help="expert parallelism the rank is a slice of")
    p_demo.add_argument("--tokens", type=int, default=4)
    p_demo.add_argument("--shape", help="custom layer 'H,I,E,top_k,shared' instead of --model/--ep")
    p_demo.add_argument("--backend", default=None, help="auto (default), reference, sm90, sm103")
    p_demo.add_argument("--device", default=None)
    p_demo.add_argument("--seed", type=int, default=0)
    p_demo.add_argument("--json", action="store_true")
    for name, what in LAB_COMMANDS.items():
        sub.add_parser(name, help=what, add_help=False)  # (gcmoe-lab parses their arguments: lab)
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in LAB_COMMANDS:
        return lab(argv[0], argv[1:])
    args = ap.parse_args(argv)

    if args.cmd == "info":
        d = info()
        print(json.dumps(d, indent=2)) if args.json else _print_info(d)
        return 0
    if args.cmd == "demo":
        r = demo(args.model, args.ep, args.tokens, args.backend, args.seed, args.device, args.shape)
        if args.json:
            print(json.dumps(r, indent=2))
        else:
            print(f"gcmoe demo: {r['layer']}, T={r['tokens']} tokens on {r['device']}")
            print(f"  backend: {r['backend']}")
            print(f"  time:    {r['time_us']:.1f} us (median)")
            print(f"  check:   calc_diff = {r['calc_diff']:.3e} vs the {r['check']} -> {'OK' if r['ok'] else 'FAIL'}")
        return 0 if r["ok"] else 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
