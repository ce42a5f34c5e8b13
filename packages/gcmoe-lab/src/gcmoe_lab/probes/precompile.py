"""Compile the sm90 GEMM variants a GPU run needs, in parallel, into CuTe DSL's file cache (on the device machine).

A layer compiles each bucket's W1 / W2 the first time it runs it, one after another (~15-25 s each on the device's
CPUs), and so do the tests: a fresh device spends minutes of its time compiling serially. Run this first, in the same
call, with the same GCMOE_CACHE_DIR: every later process of the call loads the kernels from the cache. The cache only
fills where a GPU is present (on a CPU-only machine CuTe DSL compiles "compile only" and keeps nothing), so this is a
device step; `--list` prints the jobs anywhere.

    gcmoe-lab probe precompile --models deepseek-v4-flash deepseek-v3 --tokens 1 8 32 128 [--ep 8]
        [--tests] [--kernels-bench] [--test-variants '*half'] [--workers 16] [--list]

--models / --tokens: the public layer's kernels (MoEConfig.ep_slice(model, ep), the bucket of each T; ring mode,
exactly what gcmoe's sm90 backend launches: gcmoe_gemm_sm90.ops.layer_config + ring_kernel_config).
--tests: also the sm90 kernel tests' ring-mode variants (test_grouped_gpu.RING_VARIANTS, ring and prepared rows; read
from the checkout's packages/gcmoe-gemm-sm90/tests, so only from a source checkout).
--kernels-bench: also the kernels `gcmoe-lab probe bench_sm90` times at --tokens (prepared rows, the chosen
configuration; run it with --variants and --split-sweep 0 to need no others).
--test-variants PATTERN...: also the prepared-rows kernel tests' configs (test_grouped_gpu.VARIANTS whose names match
the fnmatch patterns, every N tile the test runs them at; e.g. '*half' before `pytest -m sm90 -k half`).
Prints one line per failed job and a summary; exits 1 if any job failed.
"""

from __future__ import annotations

import argparse
import fnmatch
import importlib.util
import multiprocessing as mp
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[5]  # the checkout (packages/gcmoe-lab/src/gcmoe_lab/probes/precompile.py)
RING_TESTS = ROOT / "packages" / "gcmoe-gemm-sm90" / "tests" / "test_grouped_gpu.py"


def layer_jobs(model: str, ep: int, tokens: list[int]) -> list[tuple]:
    """(mode, M, K, config) of W1 and W2 for each T's bucket of the model's EP slice, as the layer launches them."""
    from gcmoe.backends.sm90 import ring_kernel_config, token_bucket
    from gcmoe_core.config import MoEConfig
    from gcmoe_core.reference import Activation
    from gcmoe_gemm_sm90.ops import epilogue_flags, layer_config

    cfg = MoEConfig.ep_slice(model, ep, max_tokens_per_rank=max(256, *tokens))
    h, i = cfg.padded_hidden, cfg.padded_intermediate
    flags = epilogue_flags(Activation.of(cfg), cfg.has_bias)
    shape = (cfg.local_experts, h, i, cfg.num_shared_experts)
    jobs = []
    for t in tokens:
        kcfg = ring_kernel_config(layer_config(token_bucket(t), cfg.top_k, *shape, epilogue=flags))
        jobs += [("w1", 2 * i, h, kcfg), ("w2", h, i, kcfg)]
    return jobs


def kernels_bench_jobs(model: str, ep: int, tokens: list[int]) -> list[tuple]:
    """(mode, M, K, config) of W1 and W2 as `gcmoe-lab probe bench_sm90` launches them at each T (the routed
    experts of the EP slice on prepared rows, not ring mode, its chosen configuration; --variants / --split-sweep
    configurations not included)."""
    from gcmoe_core.config import MoEConfig
    from gcmoe_gemm_sm90.ops import layer_config

    cfg = MoEConfig.ep_slice(model, ep, max_tokens_per_rank=max(256, *tokens), num_shared_experts=0)
    h, i = cfg.hidden_size, cfg.intermediate_size
    jobs = []
    for t in tokens:
        kcfg = layer_config(t, cfg.top_k, cfg.num_experts, h, i, 0)
        jobs += [("w1", 2 * i, h, kcfg), ("w2", h, i, kcfg)]
    return jobs


def _load(path: Path):
    spec = importlib.util.spec_from_file_location("_sm90_gpu_tests", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_jobs() -> list[tuple]:
    """The sm90 ring-mode kernel tests' variants, on the tests' shape (RING), in ring mode and on prepared rows."""
    mod = _load(RING_TESTS)
    h, i = mod.RING.hidden_size, mod.RING.intermediate_size
    jobs = []
    for cfg in mod.RING_VARIANTS.values():
        for ring in (False, True):
            c = replace(cfg, ring=ring)
            jobs += [("w1", 2 * i, h, c), ("w2", h, i, c)]
    return jobs


def grouped_test_jobs(patterns: list[str]) -> list[tuple]:
    """The prepared-rows kernel tests' configs (test_grouped_gpu.grouped_config) of the VARIANTS matching patterns."""
    mod = _load(RING_TESTS)
    h, i = mod.SMALL.padded_hidden, mod.SMALL.padded_intermediate
    jobs = []
    for variant in mod.VARIANTS:
        if not any(fnmatch.fnmatchcase(variant, p) for p in patterns):
            continue
        for n_tile in mod.GROUPED_N_TILES:
            cfg = mod.grouped_config(n_tile, variant)
            if not isinstance(cfg, str):
                jobs += [("w1", 2 * i, h, cfg), ("w2", h, i, cfg)]
    return jobs


def compile_job(job: tuple) -> str:
    mode, m, k, cfg = job
    try:
        from gcmoe_gemm_sm90.ops import compiled

        compiled(mode, m, k, cfg)
        return ""
    except Exception as e:  # (reported per job, the others go on)
        return f"FAILED {mode} M={m} K={k} {cfg}: {e!r}"[:400]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="gcmoe-lab probe precompile", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="*", default=["deepseek-v4-flash", "deepseek-v3"])
    ap.add_argument("--tokens", nargs="*", type=int, default=[1, 8, 32, 128])
    ap.add_argument("--ep", type=int, default=8)
    ap.add_argument("--tests", action="store_true", help="also the sm90 ring-mode kernel tests' variants")
    ap.add_argument(
        "--test-variants", nargs="*", default=[], help="also test_grouped_gpu's VARIANTS matching these patterns"
    )
    ap.add_argument("--kernels-bench", action="store_true", help="also the kernel bench's chosen kernels (bench_sm90)")
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--list", action="store_true", help="print the jobs and compile nothing")
    args = ap.parse_args(argv)
    jobs = [j for model in args.models for j in layer_jobs(model, args.ep, args.tokens)]
    if args.kernels_bench:
        jobs += [j for model in args.models for j in kernels_bench_jobs(model, args.ep, args.tokens)]
    if args.tests:
        jobs += test_jobs()
    jobs += grouped_test_jobs(args.test_variants) if args.test_variants else []
    jobs = list(dict.fromkeys(jobs))  # (configs are frozen dataclasses: equal jobs compile once)
    if args.list:
        for mode, m, k, cfg in jobs:
            print(mode, m, k, cfg)
        return 0
    with ProcessPoolExecutor(args.workers, mp_context=mp.get_context("spawn")) as ex:
        failed = [r for r in ex.map(compile_job, jobs) if r]
    if failed:
        print(*failed, sep="\n")
    print(f"precompile: {len(jobs)} jobs, {len(jobs) - len(failed)} compiled", flush=True)
    return 1 if failed else 0
