"""The probes: developer tools that run one measurement or check each (`gcmoe-lab probe NAME [args]`, `gcmoe-lab
probe` lists them). Each is a module with main(argv) -> exit code; GPU probes need the GPU only once they run, so
`--help` (and their --list options) work anywhere. The shell runners in tools/gpu (run.sh, bench.sh, sanitize.sh,
ncu_*.sh) call them as `python3 -m gcmoe_lab probe NAME`.
"""

from __future__ import annotations

import importlib

# name -> (module, what it is for)
PROBES: dict[str, tuple[str, str]] = {
    "bench_sm90": ("gcmoe_lab.bench_sm90", "the sm90 grouped GEMMs alone vs the floor, the layer and torch (GPU)"),
    "bench_comm": ("gcmoe_lab.bench_comm", "dispatch bandwidth on a green-context comm partition (GPU)"),
    "bench_greenctx": ("gcmoe_lab.bench_greenctx", "green-context partitions: isolation, disjointness, graphs (GPU)"),
    "layer_probe": ("gcmoe_lab.probes.layer_probe", "kernel timelines and host time of the layer's calls (GPU)"),
    "host_time": ("gcmoe_lab.probes.host_time", "where an eager layer call's host time goes, step by step (GPU)"),
    "layer_smoke": ("gcmoe_lab.probes.layer_smoke", "first look at the sm90 layer, step by step, hang-guarded (GPU)"),
    "layer_ab": ("gcmoe_lab.probes.layer_ab", "one process of a code A/B of the layer (tools/gpu/ab_commits.sh) (GPU)"),
    "pool_memory": ("gcmoe_lab.probes.pool_memory", "memory beyond packed weights, virtual P = 2, 4, vs formula (GPU)"),
    "soak": ("gcmoe_lab.probes.soak", "100,000 checked graph replays of the layer (GPU)"),
    "precompile": ("gcmoe_lab.probes.precompile", "compile a GPU run's sm90 kernels in parallel into the cache"),
    "sanitize_case": (
        "gcmoe_lab.probes.sanitize_case",
        "every kernel as small named cases for compute-sanitizer (GPU)",
    ),
    "racecheck_filter": ("gcmoe_lab.probes.racecheck_filter", "verdicts on racecheck / initcheck logs"),
    "ncu_layer": ("gcmoe_lab.probes.ncu_layer", "the layer's W1 / W2 for Nsight Compute (GPU)"),
    "ncu_sm90": ("gcmoe_lab.probes.ncu_sm90", "W1 / W2 on prepared rows for Nsight Compute (GPU)"),
    "ncu_source": ("gcmoe_lab.probes.ncu_source", "summary of Nsight Compute's source page"),
    "peer_probe": ("gcmoe_lab.probes.peer_probe", "which torch grouped-GEMM calls run on this build (GPU)"),
}


def load(name: str):
    """The probe's module (KeyError naming the known probes for an unknown name)."""
    if name not in PROBES:
        raise KeyError(f"unknown probe {name!r}; probes: {', '.join(PROBES)}")
    return importlib.import_module(PROBES[name][0])


def listing() -> str:
    return "\n".join(f"{name:18s} {what}" for name, (_, what) in PROBES.items())
