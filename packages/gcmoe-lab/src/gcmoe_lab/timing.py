"""GPU timing the lab's benchmarks share: CUDA-graph replay (gcmoe_core.testing.capture_graph), cold L2, medians,
kernel timelines (the profiler); the copy-bandwidth ceiling and the FP4 weight-streaming floor of a decode MoE layer.

    floor(T) = active_experts * 3 * H * I * (0.5 + 1/32) B / copy_bandwidth      (weights + UE8M0 scales)

Cold L2: before every timed replay a buffer of 4x the L2 size passes through L2 (not timed), so weights come from
HBM. ColdL2's mode says how: "write" overwrites it (L2 is left full of dirty lines, whose write-back then shares HBM
with the timed run: about one L2 of extra traffic, 3.5-10.5 µs per replay on the H200), "read" only reads it (L2 is
left with clean lines; ~57 µs of GPU time, short enough that a host-bound eager run may show its launch time).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

try:
    from gcmoe_core.formats import fp4_layer_bytes
    from gcmoe_core.testing import capture_graph
except ImportError:  # the packages of a checkout older than the lab (`gcmoe-lab probe layer_ab` A/B runs against one)
    from gcmoe_core.timing import capture_graph, fp4_layer_bytes


def _l2_bytes(device: torch.device) -> int:
    return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 64 * 2**20))


L2_FLUSHES = ("write", "read")


class ColdL2:
    """kernel_names: substrings of the names of the kernels a flush launches (what profile readers split runs by)."""

    def __init__(self, device: torch.device, mode: str = "write"):
        if mode not in L2_FLUSHES:
            raise ValueError(f"ColdL2: mode must be one of {L2_FLUSHES}, got {mode!r}")
        self.mode = mode
        self.kernel_names = ("elementwise_kernel", "Memset") if mode == "write" else ("reduce_kernel", "Memset")
        self.buf = torch.zeros(4 * _l2_bytes(device) // 4, dtype=torch.int32, device=device)
        self.out = torch.zeros((), dtype=torch.int32, device=device)

    def __call__(self) -> None:
        if self.mode == "write":
            self.buf.add_(1)
        else:
            torch.amax(self.buf, dim=0, out=self.out)


def time_once(run: Callable[[], object], flush: Callable[[], object]) -> float:
    """Microseconds of one run on the current stream between two events, after an untimed flush (e.g. a ColdL2)."""
    flush()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    run()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e3


def kernel_runs(
    run: Callable[[], object], flush: ColdL2, reps: int = 3, skip: tuple[str, ...] = ()
) -> list[list[tuple[float, float, str]]]:
    """The GPU kernels of `reps` runs, each after `flush`, from the profiler: per run [(start µs, end µs, kernel
    name)] in start order, the runs told apart by the flush's own kernels (flush.kernel_names); kernels whose
    lowercased name contains one of `skip` are left out."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            flush()
            torch.cuda.synchronize()
            run()
            torch.cuda.synchronize()
    ks = sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and not any(k in e.name.lower() for k in skip)
    )
    runs, cur = [], []
    for a, b, name in ks:
        if any(k in name for k in flush.kernel_names):
            if cur:
                runs.append(cur)
            cur = []
            continue
        cur.append((a, b, name))
    runs.append(cur)
    return runs


def time_gpu(
    fn: Callable[[], object],
    iters: int = 50,
    warmup: int = 3,
    graph: bool = True,
    cold_l2: bool = True,
    device: torch.device | None = None,
) -> dict:
    """Median/min/p90 microseconds of fn on the current stream. graph=True captures fn once and times replays."""
    device = device or torch.device("cuda", torch.cuda.current_device())
    if graph:
        run = capture_graph(fn, warmup, device)[0].replay
    else:
        for _ in range(warmup):
            fn()
        run = fn
    run()
    torch.cuda.synchronize(device)
    flush = ColdL2(device) if cold_l2 else (lambda: None)
    times = sorted(time_once(run, flush) for _ in range(iters))
    return {
        "median_us": statistics.median(times),
        "min_us": times[0],
        "p90_us": times[int(0.9 * (len(times) - 1))],
        "iters": iters,
        "graph": graph,
        "cold_l2": cold_l2,
    }


def time_interleaved(runs: dict, iters: int, device: torch.device | None = None, l2_flush: str = "write") -> dict:
    """Median microseconds of several variants measured side by side (A B C A B C ..., cold L2 before each, by a
    ColdL2 of mode l2_flush). runs: name -> CUDAGraph (replayed) or a plain callable (launched eagerly)."""
    flush = ColdL2(device or torch.device("cuda", torch.cuda.current_device()), l2_flush)
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(iters):
        for name, g in runs.items():
            times[name].append(time_once(g.replay if isinstance(g, torch.cuda.CUDAGraph) else g, flush))
    return {k: statistics.median(v) for k, v in times.items()}


def time_cpu(fn: Callable[[], object], iters: int = 5) -> dict:
    fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return {
        "median_us": statistics.median(times),
        "min_us": min(times),
        "iters": iters,
        "graph": False,
        "cold_l2": False,
    }


def copy_bandwidth(device: torch.device, nbytes: int = 2 * 2**30, iters: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written. Timed eagerly: a
    captured memcpy becomes a graph memcpy node, which measured ~2.8 TB/s here against ~4.2 TB/s for the SM copy."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    t = time_gpu(lambda: dst.copy_(src), iters=iters, graph=False, cold_l2=False, device=device)
    return 2 * src.numel() / (t["median_us"] * 1e-6)


def run_meta(**extra) -> dict:
    """What every benchmark record starts with: UTC date, device, torch and CuTe DSL versions (+ extra fields)."""
    import datetime

    from gcmoe_core.cutedsl import dsl_version

    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU",
        "torch": torch.__version__,
        "cutlass_dsl": dsl_version(),
        **extra,
    }


def fp4_floor_us(hidden: int, inter: int, active_experts: int, bandwidth: float) -> float:
    return fp4_layer_bytes(hidden, inter, active_experts) / bandwidth * 1e6
