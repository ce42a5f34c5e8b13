"""The `gcmoe` command: info, demo (one decode step of a model-shaped layer, checked), and bench / tune, which live in
the gcmoe-lab package (benchmarks beside the product, never inside it): those two import it only when called and hand
it their arguments; without it they say how to install it (exit code 2).

Design: the parser imports no torch (`--help`, `--version` answer at once); a command imports what it runs. A value
is checked before any work, its form by its argparse `type`, its meaning (a layer limit, a backend or device this
machine lacks) by the library's checks (`_demo_setup`), whose error becomes the parser's: exit 2, one line. The demo
reports the kernel against an independent float64 loop of the same quantisation (is it right?) and against the bf16
layer it was quantised from (what FP8 x MXFP4 costs).
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import statistics
import sys
import time
from importlib import metadata

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
    import torch

    from gcmoe_core.cutedsl import dsl_version
    from gcmoe_greenctx import device_facts

    from .backends import BACKENDS

    out: dict = {
        "packages": {p: _version(p) for p in PACKAGES},
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cutlass_dsl": dsl_version(),
        "devices": [],
        "driver_cuda_version": device_facts(0).driver_version,
    }
    for i in range(torch.cuda.device_count()):
        p, facts = torch.cuda.get_device_properties(i), device_facts(i)
        arch, gib = f"sm_{p.major}{p.minor}", round(p.total_memory / 2**30, 1)
        out["devices"].append(
            {"index": i, "name": p.name, "arch": arch, "sm_count": p.multi_processor_count, "memory_gib": gib}
            | {"green_contexts": facts.as_dict()}
        )
    dev = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    out["backends"] = {
        n: "runnable" if (why := b.missing(dev)) is None else f"unavailable: needs {why}" for n, b in BACKENDS.items()
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


def _median_us(fn, iters: int, device, warmup: int) -> float:
    """Median µs of `iters` eager calls after `warmup` ones: CUDA events on a GPU, wall clock on a CPU."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(), fn(), b.record(), b.synchronize()
            times.append(a.elapsed_time(b) * 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def _int_in(lo: int, hi: int = 2**63 - 1):
    """argparse type: an int in [lo, hi]."""

    def parse(s: str) -> int:
        if not re.fullmatch(r"\s*[+-]?\d+\s*", s) or not lo <= int(s) <= hi:
            raise argparse.ArgumentTypeError(f"{s!r} is not an integer in [{lo}, {hi}]")
        return int(s)

    return parse


def _shape(s: str) -> tuple[int, ...]:
    if len(parts := s.split(",")) != 5:
        raise argparse.ArgumentTypeError(f"{s!r}: expected 5 integers H,I,E,top_k,shared, got {len(parts)}")
    return tuple(_int_in(0)(p) for p in parts)


def _device(s: str) -> str:
    if not re.fullmatch(r"cpu|cuda(:\d+)?", s):
        raise argparse.ArgumentTypeError(f"{s!r} is not cpu, cuda or cuda:N")
    return s


def _demo_setup(args, error) -> tuple:
    """(cfg, label, device, backend) of demo's options, their meaning checked by the library; error(one line) else."""
    import torch

    from gcmoe_core.config import MAX_TOKENS_PER_RANK, MoEConfig

    from .backends import BackendUnavailable, choose

    def checked(opt, fn, *a, **kw):
        try:
            return fn(*a, **kw)
        except (ValueError, BackendUnavailable) as e:
            error(f"argument {opt}: {str(e).removeprefix('gcmoe: ')}")

    if args.tokens > MAX_TOKENS_PER_RANK:
        error(f"argument --tokens: {args.tokens} exceeds the limit of {MAX_TOKENS_PER_RANK} tokens per rank")
    room = {"max_tokens_per_rank": max(256, args.tokens)}
    if args.shape:
        cfg = checked("--shape", MoEConfig, *args.shape, **room)
        label = "custom H={} I={} E={} top-{} shared={}".format(*args.shape)
    else:
        cfg = checked("--model/--ep", MoEConfig.ep_slice, args.model, args.ep, **room)
        label = f"{args.model}, one rank under EP={args.ep} ({cfg.num_experts} local experts)"
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda" and (dev.index or 0) >= torch.cuda.device_count():
        error(f"argument --device: {dev}: no CUDA device there (torch sees {torch.cuda.device_count()})")
    return cfg, label, dev, checked("--backend", choose, dev, args.backend, cfg.padded())


def demo(cfg, label: str, dev, backend: str, tokens: int, seed: int) -> dict:
    """The layer, its bf16 weights quantised at load as a checkpoint's are, on `tokens` tokens: its time, calc_diff
    against the independent float64 loop (same quantisation, H / I padded as the layer pads) and against the bf16
    layer (bf16 weights and activations)."""
    import torch
    from tqdm import tqdm

    from gcmoe_core.reference import Activation, MoEWeights, moe_reference, moe_reference_loop_fp64
    from gcmoe_core.testing import calc_diff, cosine, make_tokens, make_weights

    from .layer import MoELayer

    bar = tqdm(total=3, desc="gcmoe demo", postfix="weights", disable=not sys.stderr.isatty())
    bf16 = make_weights(cfg, seed=seed, device=dev, quant="bf16")
    weights = MoEWeights.from_float(*bf16.all(), quant=cfg.quant, w13_bias=bf16.w13_bias, w2_bias=bf16.w2_bias)
    layer = MoELayer(cfg, device=dev, backend=backend).load(weights)
    x, ids, w = make_tokens(cfg, tokens, seed=seed + 1, device=dev)
    bar.update(), bar.set_postfix_str(f"run ({backend})")
    y, gpu, act, kc = layer(x, ids, w).cpu(), dev.type == "cuda", Activation.of(cfg), cfg.padded()
    us = _median_us(lambda: layer(x, ids, w), 20 if gpu else 2, dev, warmup=4 if gpu else 1)
    bar.update(), bar.set_postfix_str("check")
    xp = torch.nn.functional.pad(x, (0, kc.hidden_size - cfg.hidden_size))  # (the loop's FP8 x needs H % 128 == 0)
    ref = moe_reference_loop_fp64(xp, ids, w, weights.padded(kc.hidden_size, kc.intermediate_size), act)
    y16 = moe_reference(x, ids, w, bf16, quant="bf16", act=act).cpu()
    err = calc_diff(y, ref[:, : cfg.hidden_size].cpu())
    bar.close()
    return {
        "layer": label,
        "config": cfg.__dict__,
        "tokens": tokens,
        "backend": layer.backend,
        "device": str(dev),
        "time_us": round(us, 1),
        "check": "the independent float64 loop, same FP8 x MXFP4 quantisation (gcmoe_core.reference)",
        "calc_diff": err,
        "ok": bool(err <= 1e-3),
        "quantisation": {"vs": "the unquantised bf16 layer", "calc_diff": calc_diff(y, y16), "cosine": cosine(y, y16)},
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


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line (not the usage block, which --help shows), exit 2
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The `gcmoe` parser and its demo sub-parser (for demo's errors); imports no torch."""
    ap = _Parser(prog="gcmoe", description="gcmoe: MoE decode operator (green-context partitioned)")
    ap.add_argument("--version", action="version", version=f"gcmoe {_version('gcmoe')}")
    sub = ap.add_subparsers(dest="cmd", required=True)
    info_ap = sub.add_parser("info", help="versions, device, green-context facts, runnable backends")
    info_ap.add_argument("--json", action="store_true")
    d = sub.add_parser("demo", help="one decode step of a model-shaped layer, checked against the reference")
    layer = d.add_mutually_exclusive_group()
    layer.add_argument("--model", default="deepseek-v4-flash", help="a model's layer (a wrong name lists them)")
    layer.add_argument("--shape", type=_shape, help="custom layer 'H,I,E,top_k,shared' instead of --model/--ep")
    d.add_argument("--ep", type=_int_in(1), default=8, help="expert parallelism the rank is a slice of")
    d.add_argument("--tokens", type=_int_in(1), default=4)
    d.add_argument("--backend", help="auto (default), reference, sm90, sm103")
    d.add_argument("--device", type=_device, help="cpu, cuda or cuda:N (default: cuda if there is one)")
    d.add_argument("--seed", type=_int_in(0, 2**32 - 1), default=0)
    d.add_argument("--json", action="store_true")
    for name, what in LAB_COMMANDS.items():
        sub.add_parser(name, help=what, add_help=False)  # (gcmoe-lab parses their arguments: lab)
    return ap, d


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in LAB_COMMANDS:
        return lab(argv[0], argv[1:])
    ap, demo_ap = parser()
    args = ap.parse_args(argv)
    if args.cmd == "info":
        d = info()
        print(json.dumps(d, indent=2)) if args.json else _print_info(d)
        return 0
    r = demo(*_demo_setup(args, demo_ap.error), args.tokens, args.seed)
    q = r["quantisation"]
    lines = (
        f"gcmoe demo: {r['layer']}, T={r['tokens']} tokens on {r['device']}, backend {r['backend']}",
        f"  time:          {r['time_us']:.1f} us (median)",
        f"  kernel check:  calc_diff {r['calc_diff']:.1e} vs {r['check']} -> {'OK' if r['ok'] else 'FAIL'}",
        f"  quantisation:  calc_diff {q['calc_diff']:.1e}, cosine {q['cosine']:.4f} vs {q['vs']} (FP8 x MXFP4 error)",
    )
    print(json.dumps(r, indent=2) if args.json else "\n".join(lines))
    return 0 if r["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
