"""First look at the sm90 layer on a GPU, step by step with the outcome of each printed (a hang is cut by --timeout
and its stack dumped): eager calls at several T, partitioned vs not, a caller's capture, P = 2 virtual ranks.

    gcmoe-lab probe layer_smoke [--timeout 240]
"""

from __future__ import annotations

import argparse
import faulthandler
import time
import traceback

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="gcmoe-lab probe layer_smoke", description=__doc__.split("\n\n")[0])
    ap.add_argument("--timeout", type=float, default=240)
    args = ap.parse_args(argv)
    faulthandler.dump_traceback_later(args.timeout, exit=True)

    import gcmoe
    from gcmoe.backends import LayerOptions
    from gcmoe.backends.sm90 import virtual_ranks
    from gcmoe_core.config import MoEConfig
    from gcmoe_core.reference import moe_reference
    from gcmoe_core.testing import calc_diff, first_mismatch, make_tokens, make_weights
    from gcmoe_gemm_sm90.config import Sm90Config

    cfg = MoEConfig(512, 256, 16, 4, 1, max_tokens_per_rank=32)
    failed = 0
    weights = make_weights(cfg, 1, "cuda")
    layers = {}

    def step(name, fn):
        nonlocal failed
        t0 = time.perf_counter()
        try:
            msg = fn()
            print(f"[ok]   {name} ({time.perf_counter() - t0:.1f} s) {msg or ''}", flush=True)
        except Exception:
            failed += 1
            print(f"[FAIL] {name} ({time.perf_counter() - t0:.1f} s)\n{traceback.format_exc()}", flush=True)

    def build(c):
        layers[c] = gcmoe.MoELayer(cfg, "cuda", "sm90", comm_sms=c, timeout_ms=2000).load(weights)
        return str(layers[c].describe())

    def eager(c, t):
        x, ids, w = make_tokens(cfg, t, "uniform", t, device="cuda")
        y = layers[c](x, ids, w)
        torch.cuda.synchronize()
        layers[c].check()
        d = calc_diff(y, moe_reference(x, ids, w, weights))
        assert d < 1e-3 and not y.isnan().any(), f"calc_diff {d}"
        return f"calc_diff {d:.2e}"

    def same(t):
        x, ids, w = make_tokens(cfg, t, "uniform", 50 + t, device="cuda")
        ys = [layers[c](x, ids, w) for c in layers]
        for y in ys[1:]:
            assert first_mismatch(y, ys[0]) == ""

    def captured():
        layer = layers[16]
        x, ids, w = make_tokens(cfg, 7, "uniform", 3, device="cuda")
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=torch.cuda.Stream()):
            y = layer(x, ids, w)
        g.replay()
        torch.cuda.synchronize()
        layer.check()
        assert first_mismatch(y, layer(x, ids, w)) == ""

    def virtual2():
        kcfg = Sm90Config(n_tile=8, stages=3, prefetch=2)
        options = LayerOptions(comm_sms=16, kernel_config=kcfg, timeout_ms=2000)
        ranks = virtual_ranks(cfg.replace(ep_size=2), weights, torch.device("cuda"), options)
        ref = gcmoe.MoELayer(cfg, "cuda", "sm90", kernel_config=kcfg, comm_sms=16).load(weights)
        inputs = [make_tokens(cfg, 5 + r, "uniform", 9 + r, device="cuda") for r in range(2)]
        streams = [torch.cuda.Stream() for _ in range(2)]
        ys = []
        for r in range(2):
            streams[r].wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(streams[r]):
                ys.append(ranks[r].forward(*inputs[r], True))
        torch.cuda.synchronize()
        for r in range(2):
            ranks[r].check()
            assert first_mismatch(ys[r], ref(*inputs[r])) == "", f"rank {r}"

    print(torch.cuda.get_device_name(0), torch.__version__, flush=True)
    for c in (0, 16):
        step(f"build comm_sms={c}", lambda c=c: build(c))
    for c in list(layers):
        for t in (1, 5, 8, 32):
            step(f"eager comm_sms={c} T={t}", lambda c=c, t=t: eager(c, t))
    step("comm_sms 0 == 16 bitwise", lambda: same(13))
    step("caller capture", captured)
    step("P=2 virtual ranks", virtual2)
    print(f"smoke: {failed} failed", flush=True)
    return 1 if failed else 0
