"""The workload compute-sanitizer runs (tools/gpu/sanitize.sh): every kernel of the layer, small, as named cases.

    gcmoe-lab probe sanitize_case --list                        # the cases and the kernels each one launches
    gcmoe-lab probe sanitize_case [--cases 'ring-*' comm-p2]    # all cases by default (fnmatch patterns)
    compute-sanitizer --tool initcheck --report-api-errors no python3 -m gcmoe_lab probe sanitize_case

Cases (CASES), every one on the shape CFG (H 1024, I 512, 16 experts, top-4 + 1 shared, 12 tokens, T_max 16):

    comm-ready        publish (arguments by value) -> READY alone (`ready`, generation 2) -> dispatch; P = 1
    comm-p2           publish, dispatch, finalize with the combined signal across 2 virtual ranks, the W1/W2 stand-in
                      of gcmoe-comm's tests (tests/virtual_ranks.py) between them (uniform, then one_rank: rank 1
                      receives nothing); the comm cases read those helpers from the checkout
    layer             the public layer as the H200 policy runs it: eager (slot-path publish + dispatch as one kernel,
                      W1, W2, finalize), then inside a caller's capture (arguments by value), replayed with new tokens
    layer-partitioned the same on two green-context partitions (comm_sms = 16)
    ring-<variant>    W1 / W2 in ring mode through the public layer with kernel_config forcing RING_CONFIGS[variant]:
                      plain (unsplit, W2 after the whole W1 grid), splitk (K split 2 / 2 in clusters), expert-sync (W2
                      per expert on W1_DONE), stream-k (W1 over K ranges with fp32 partials), wg4 (4 warpgroups, N 32);
                      wg4-half / n80-half (half M tiles, W1's halves cluster pairs; N 32 / 80);
                      uniform and one_expert routing (one expert over two N tiles)
    layer-p2          2 virtual ranks of the layer with the real kernels (W2 scatters into the peer's combine buffer)
    rows-<variant>    W1 / W2 on prepared rows (not ring mode: the kernels' tests and benchmark path; the pipeline on
                      prepared rows, gcmoe_core.grouping.grouped_forward, around ops.w1 / w2), ROW_CONFIGS

Every case checks its values — exact where bytes only move (rings, stand-in combine, replays against the eager
call), calc_diff <= 1e-3 against gcmoe_core.reference where the GEMMs compute — so a sanitizer run is also a
correctness run; the script exits non-zero when a case fails (each case runs even after another failed). Waits are
bounded by TIMEOUT_MS, generous because the tools slow every kernel down. The P = 2 cases need the two ranks'
kernels resident at once (each waits for the other): a tool that serialised kernels would turn that into a
CommError after TIMEOUT_MS, named in the case's output.

initcheck: the layer's buffers start zeroed (workspace, ring, W1 output), so its cases read nothing unwritten. The
rows-* cases may: W1 never stores a padding column (rows past an expert's count), gcmoe_gemm_sm90.ops.w1 allocates
its output with torch.empty, and W2's activation box (the whole N tile) covers those rows; their values reach only
padding columns of W2's accumulators, which are never stored. If initcheck reports that read (at W2's activation load
in the sm90 kernel), the line needs an `initcheck-uninit:` comment saying so before the verdict passes.
"""

from __future__ import annotations

import argparse
import fnmatch
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from gcmoe_core.config import MoEConfig
from gcmoe_gemm_sm90.config import Sm90Config

CFG = MoEConfig(
    hidden_size=1024, intermediate_size=512, num_experts=16, top_k=4, num_shared_experts=1, max_tokens_per_rank=16
)
TOKENS = 12
TOL = 1e-3
TIMEOUT_MS = 60_000  # every cross-rank / cross-partition wait (the sanitizers slow the kernels down)

RING_CONFIGS = {
    "plain": Sm90Config(8, 3, 2, occupancy=2, expert_sync=False),
    "splitk": Sm90Config(16, 3, 2, occupancy=2, splits=(2, 2), expert_sync=False),
    "expert-sync": Sm90Config(8, 3, 2, occupancy=2, expert_sync=True),
    "stream-k": Sm90Config(8, 3, 2, occupancy=2, expert_sync=True, stream_k=True),
    "wg4": Sm90Config(32, 2, 2, occupancy=1, warpgroups=4, expert_sync=True),
    "wg4-half": Sm90Config(32, 2, 2, occupancy=1, warpgroups=4, expert_sync=True, w1_half=True, w2_half=True),
    "n80-half": Sm90Config(80, 3, 2, occupancy=1, expert_sync=True, w1_half=True, w2_half=True),
}
ROW_CONFIGS = {
    "n8": Sm90Config(8, 3, 2, occupancy=2),
    "n16-splitk": Sm90Config(16, 3, 2, occupancy=2, splits=(2, 1)),
    "n32-wg4": Sm90Config(32, 2, 2, occupancy=1, warpgroups=4),
    "n32-wg4-half": Sm90Config(32, 2, 2, occupancy=1, warpgroups=4, w1_half=True, w2_half=True),
}

PUBLISH, PUBLISH_SLOTS, READY = "publish", "publish (slot path)", "ready"
DISPATCH, FINALIZE = "dispatch", "finalize (+ combined signal)"
# world size 1 (the layer's small calls): publish + dispatch as one kernel (gcmoe_comm CommRank.publish_dispatch)
LOCAL, LOCAL_SLOTS = "publish + dispatch (one kernel)", "publish + dispatch (one kernel, slot path)"


@dataclass(frozen=True)
class SanCase:
    name: str
    kernels: tuple[str, ...]  # what it launches
    run: Callable[[], str]  # raises AssertionError (or a CommError) on a wrong value; returns a one-line result


# ------------------------------------------------------------------------------------------------------ helpers
def _weights(cfg: MoEConfig = CFG, seed: int = 0):
    from gcmoe_core.testing import make_weights

    return make_weights(cfg, seed, "cuda")


def _tokens(t: int, routing: str, seed: int, cfg: MoEConfig = CFG):
    from gcmoe_core.testing import make_tokens

    return make_tokens(cfg, t, routing, seed, device="cuda")


def _diff(y: torch.Tensor, x, ids, w, weights) -> float:
    from gcmoe_core.reference import moe_reference
    from gcmoe_core.testing import calc_diff

    d = calc_diff(y, moe_reference(x, ids, w, weights))
    assert d <= TOL, f"calc_diff {d:.3e} > {TOL:g} against the reference"
    return d


def _layer(weights, **kw):
    import gcmoe

    return gcmoe.MoELayer(CFG, "cuda", "sm90", timeout_ms=TIMEOUT_MS, **kw).load(weights)


# -------------------------------------------------------------------------------------------------------- cases
COMM_TESTS = Path(__file__).resolve().parents[5] / "packages" / "gcmoe-comm" / "tests"


def _comm_test_helpers():
    """gcmoe-comm's virtual ranks, inputs and ring checks: test code that lives beside the comm tests (so the comm
    cases run from a source checkout, as sanitize.sh does)."""
    if str(COMM_TESTS) not in sys.path:
        sys.path.insert(0, str(COMM_TESTS))
    import virtual_ranks

    return virtual_ranks


def comm_ready() -> str:
    from gcmoe_comm.comm import CommRank
    from gcmoe_comm.ring import RingSpec
    from gcmoe_comm.workspace import Workspace

    vr = _comm_test_helpers()
    spec = RingSpec(1, CFG.num_experts, CFG.hidden_size, CFG.top_k, CFG.max_tokens_per_rank, 8)
    ws = Workspace.virtual(spec, "cuda")[0]
    rank = CommRank(ws, timeout_ms=TIMEOUT_MS)
    rank.load()
    xs, ids, wts = vr.make_inputs(1, "uniform", 3, spec.hidden, spec.local_experts, spec.top_k, TOKENS)
    rank.publish(xs[0], ids[0], wts[0])  # generation 1: the published buffers hold these tokens from here on
    torch.cuda.synchronize()
    rank.ready(xs[0].shape[0])  # generation 2 over the same buffers
    rank.dispatch()
    torch.cuda.synchronize()
    ws.check()
    vr.check_ring(ws.views, 0, spec, xs, ids, wts, gen=2)
    return f"ring exact after publish + ready + dispatch ({xs[0].shape[0]} tokens)"


def comm_p2() -> str:
    from gcmoe_comm.ring import RingSpec

    vr = _comm_test_helpers()
    p, e = 2, CFG.num_experts
    spec = RingSpec(p, e // p, CFG.hidden_size, CFG.top_k, CFG.max_tokens_per_rank, 8, shared=1)
    ranks = vr.VirtualRanks(spec, "cuda", dispatch_ctas=4, finalize_ctas=4, timeout_ms=TIMEOUT_MS)
    ranks.load()
    for gen, routing in enumerate(("uniform", "one_rank"), start=1):
        xs, ids, wts = vr.make_inputs(p, routing, 10 + gen, spec.hidden, e, spec.top_k, TOKENS)
        outs = [torch.full_like(x, float("nan")) for x in xs]
        ranks.step(xs, ids, wts, outs)
        torch.cuda.synchronize()
        ranks.check()
        for q, w in enumerate(ranks.ws):
            vr.check_ring(w.views, q, spec, xs, ids, wts, gen)
        for r, (y, want) in enumerate(zip(outs, vr.expected_outputs(spec, xs, ids, wts), strict=True)):
            assert torch.equal(y, want), f"{routing}: rank {r}'s combine differs in {(y != want).sum().item()} elements"
    return "rings and combine exact at P = 2 (uniform, one_rank)"


def layer_case(comm_sms: int | None) -> Callable[[], str]:
    def run() -> str:
        from gcmoe_core.testing import first_mismatch

        weights = _weights(seed=1)
        layer = _layer(weights, comm_sms=comm_sms)
        x, ids, w = _tokens(TOKENS, "uniform", 1)
        y = layer(x, ids, w)
        torch.cuda.synchronize()
        layer.check()
        d = _diff(y, x, ids, w, weights)
        static = (x.clone(), ids.clone(), w.clone())
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=torch.cuda.Stream()):
            out = layer(*static)
        for i, routing in enumerate(("one_expert", "half_empty")):
            for a, b in zip(static, _tokens(TOKENS, routing, 20 + i), strict=True):
                a.copy_(b)
            out.fill_(float("nan"))
            g.replay()
            torch.cuda.synchronize()
            diff = first_mismatch(out, layer(*static))
            assert diff == "", f"captured replay {i} ({routing}) vs the eager call: {diff}"
        layer.check()
        policy = layer.describe().get("comm_sms_by_bucket", {})
        return f"eager calc_diff {d:.2e}; 2 captured replays bit-exact (comm SMs by bucket {policy})"

    return run


def ring_case(kc: Sm90Config) -> Callable[[], str]:
    def run() -> str:
        weights = _weights(seed=2)
        layer = _layer(weights, comm_sms=0, kernel_config=kc)
        diffs = []
        for i, routing in enumerate(("uniform", "one_expert")):
            x, ids, w = _tokens(TOKENS, routing, 30 + i)
            y = layer(x, ids, w)
            torch.cuda.synchronize()
            layer.check()
            diffs.append(_diff(y, x, ids, w, weights))
        return "calc_diff " + ", ".join(f"{d:.2e}" for d in diffs) + " (uniform, one_expert)"

    return run


def layer_p2() -> str:
    from gcmoe.backends import LayerOptions
    from gcmoe.backends.sm90 import virtual_ranks

    from .soak import step

    p = 2
    cfg = CFG.replace(ep_size=p)
    weights = _weights(seed=3)
    plans = virtual_ranks(cfg, weights, torch.device("cuda"), LayerOptions(comm_sms=0, timeout_ms=TIMEOUT_MS))
    streams = [torch.cuda.Stream() for _ in range(p)]
    diffs = []
    for i, routing in enumerate(("uniform", "one_expert")):
        inputs = [_tokens(t, routing, 40 + 2 * i + r) for r, t in enumerate((TOKENS, 5))]
        ys = step(plans, streams, inputs)
        torch.cuda.synchronize()
        for plan in plans:
            plan.check()
        diffs += [_diff(y, *args, weights) for y, args in zip(ys, inputs, strict=True)]
    return "calc_diff per rank " + ", ".join(f"{d:.2e}" for d in diffs)


def rows_layer(moe, x, ids, w, kc: Sm90Config) -> torch.Tensor:
    """The kernels' layer on prepared rows: gcmoe_core.grouping.grouped_forward (routing metadata, FP8 quantisation,
    slot combine) around ops.w1 / w2 with configuration kc; -> y bf16 [T, H]."""
    from gcmoe_core.grouping import grouped_forward
    from gcmoe_gemm_sm90.ops import w1, w2

    return grouped_forward(
        x,
        ids,
        w,
        moe.num_routed,
        moe.num_shared,
        kc.n_tile,
        moe.hidden,
        lambda acts, lay: w1(moe.w13, acts, lay, kc),
        lambda hq, hs, lay, out: w2(moe.w2, hq, hs, lay, out, kc),
    )


def rows_case(kc: Sm90Config) -> Callable[[], str]:
    def run() -> str:
        from gcmoe_gemm_sm90.ops import MoESm90

        weights = _weights(seed=kc.n_tile)
        x, ids, w = _tokens(TOKENS, "uniform", kc.n_tile)
        y = rows_layer(MoESm90.from_weights(weights), x, ids, w, kc)
        torch.cuda.synchronize()
        return f"calc_diff {_diff(y, x, ids, w, weights):.2e}"

    return run


W1W2 = ("W1", "W2")
CASES = (
    SanCase("comm-ready", (PUBLISH, READY, DISPATCH), comm_ready),
    SanCase("comm-p2", (PUBLISH, DISPATCH, FINALIZE), comm_p2),
    SanCase("layer", (LOCAL_SLOTS, LOCAL, *W1W2, FINALIZE), layer_case(None)),
    SanCase("layer-partitioned", (LOCAL_SLOTS, LOCAL, *W1W2, FINALIZE), layer_case(16)),
    *(
        SanCase(f"ring-{name}", (LOCAL_SLOTS, f"W1/W2 ring {name}", FINALIZE), ring_case(kc))
        for name, kc in RING_CONFIGS.items()
    ),
    SanCase("layer-p2", (PUBLISH_SLOTS, DISPATCH, *W1W2, FINALIZE), layer_p2),
    *(SanCase(f"rows-{name}", (f"W1/W2 rows {name}",), rows_case(kc)) for name, kc in ROW_CONFIGS.items()),
)


def select(patterns: Sequence[str], cases: Sequence[SanCase] = CASES) -> list[SanCase]:
    chosen = [c for c in cases if any(fnmatch.fnmatchcase(c.name, p) for p in patterns)]
    if not chosen:
        raise SystemExit(f"sanitize_case: no case matches {list(patterns)}; cases: {', '.join(c.name for c in cases)}")
    return chosen


def describe(cases: Sequence[SanCase]) -> str:
    return "\n".join(f"{c.name:18s} {', '.join(c.kernels)}" for c in cases)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="gcmoe-lab probe sanitize_case", description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", nargs="+", default=["*"], help="case names or fnmatch patterns (default: all)")
    ap.add_argument("--list", action="store_true", help="print the cases and the kernels each launches, then exit")
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    cases = select(args.cases)
    if args.list:
        print(describe(cases))
        return 0
    failed = []
    for c in cases:
        t0 = time.perf_counter()
        try:
            result = c.run()
            print(f"case {c.name}: ok, {result} ({time.perf_counter() - t0:.1f} s)", flush=True)
        except Exception as e:
            failed.append(c.name)
            print(f"case {c.name}: FAILED {type(e).__name__}: {e} ({time.perf_counter() - t0:.1f} s)", flush=True)
            traceback.print_exc()
            sys.stdout.flush()
    print(f"sanitize_case: {len(cases)} case(s), {len(failed)} failed{': ' + ', '.join(failed) if failed else ''}")
    return 1 if failed else 0
