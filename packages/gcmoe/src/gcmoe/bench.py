"""`gcmoe bench`: a timing table of one backend over model shapes and token counts.

GPU: CUDA-graph replay, cold L2, medians, next to the FP4 floor (active-expert weight bytes / copy bandwidth
measured in the same run). CPU: wall-clock medians of the reference backend (small default grid).
Writes JSON records and a markdown table (with date, device, driver, torch, DSL versions) when asked.
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

import torch

from gcmoe_core.config import MoEConfig
from gcmoe_core.testing import make_tokens, make_weights
from gcmoe_core.timing import copy_bandwidth, fp4_floor_us, time_cpu, time_gpu

from .layer import MoELayer


def run_bench(models, tokens, ep: int, backend: str | None, json_path: str | None, md_path: str | None) -> int:
    from tqdm import tqdm

    from .cli import info

    gpu = torch.cuda.is_available()
    dev = torch.device("cuda" if gpu else "cpu")
    models = models or (["deepseek-v4-flash", "deepseek-v3", "glm-5", "glm-4.5"] if gpu else ["deepseek-v4-flash"])
    tokens = tokens or ([1, 8, 32, 128, 256] if gpu else [1, 4])
    bw = copy_bandwidth(dev) if gpu else None
    env = info()
    records = []
    grid = [(m, t) for m in models for t in tokens]
    bar = tqdm(grid, desc="gcmoe bench", file=sys.stderr, disable=not sys.stderr.isatty())
    layer_cache: dict[str, MoELayer] = {}
    for model, t in bar:
        bar.set_postfix_str(f"{model} T={t}")
        if model not in layer_cache:
            layer_cache.clear()  # one model's weights on the device at a time
            cfg = MoEConfig.ep_slice(model, ep, max_tokens_per_rank=max(256, max(tokens)))
            layer_cache[model] = MoELayer(cfg, device=dev, backend=backend).load(make_weights(cfg, 0, dev))
        layer = layer_cache[model]
        cfg = layer.cfg
        x, ids, w = make_tokens(cfg, t, seed=t, device=dev)
        fn = lambda layer=layer, x=x, ids=ids, w=w: layer(x, ids, w)
        # the reference backend's capturable path runs every expert over every row: time it eagerly
        timing = time_gpu(fn, graph=layer.backend != "reference") if gpu else time_cpu(fn, iters=3)
        active = int(torch.unique(ids).numel())
        rec = {"model": model, "ep": ep, "tokens": t, "backend": layer.backend, "active_experts": active, **timing}
        if bw:
            floor = fp4_floor_us(cfg.hidden_size, cfg.intermediate_size, active, bw)
            rec.update(floor_us=floor, x_floor=timing["median_us"] / floor, copy_tb_s=bw / 1e12)
        records.append(rec)
    bar.close()
    header = "| model | EP | T | backend | active experts | median µs | FP4 floor µs | × floor |"
    lines = [header, "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in records:
        fl = f"{r['floor_us']:.1f}" if "floor_us" in r else "–"
        xf = f"{r['x_floor']:.2f}" if "x_floor" in r else "–"
        lines.append(
            f"| {r['model']} | {r['ep']} | {r['tokens']} | {r['backend']} | {r['active_experts']} | "
            f"{r['median_us']:.1f} | {fl} | {xf} |"
        )
    table = "\n".join(lines)
    print(table)
    meta = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "env": env,
        "method": "CUDA-graph replay, cold L2, median" if gpu else "CPU wall clock, median",
    }
    if json_path:
        Path(json_path).write_text(json.dumps({"meta": meta, "records": records}, indent=2))
    if md_path:
        dev_name = env["devices"][0]["name"] if env["devices"] else "CPU"
        Path(md_path).write_text(
            f"# gcmoe bench\n\n{meta['date']} · {dev_name} · driver CUDA "
            f"{env['driver_cuda_version']} · torch {env['torch']} · cutlass-dsl {env['cutlass_dsl']}"
            f" · {meta['method']}\n\n{table}\n"
        )
    return 0
