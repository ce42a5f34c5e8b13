"""A model's decode step as the lab runs it: N MoE layers of one shape, each behind a stand-in for attention and the
router, called as one batch or as two micro-batches on two streams. The model-step bench (gcmoe_lab.model_step)
measures it; the two-batch tuner (gcmoe_lab.tune.tune_two_batch) times its two-batch form per comm size.

The step (x [T, H] bf16, the residual stream), for each layer l of N:
    h      = rms_norm(x) @ W_attn[l]          bf16 [H, H], one per layer: the attention stand-in (the norm keeps x
                                              finite over 94 layers: SwiGLU grows with the square of its input)
    ids, w = topk(softmax(h @ W_router[l]))   bf16 [H, E_local]: the router; w renormalised over the top-k
    x      = x + layer[l](h, ids, w)          gcmoe.MoELayer of the model's EP slice (max_tokens_per_rank 256)
Two micro-batches (run_two_batch): xa on the current stream, xb on a side stream forked from it and joined back,
issued layer by layer, each call under gcmoe.micro_batch(i) where it exists (the two-batch schedule of the layer's
partition policy); with no side stream (CPU) one after the other. Inside one torch.cuda.graph capture the fork and
join are captured too.
Layers are built through the public API only, all loaded from ONE MoEWeights (each prepacks its own copy, so the
packed weights are distinct tensors as in a real model). qwen3-235b's shape is the lab's own (LAB_SHAPES: not a
product model).
"""

from __future__ import annotations

import contextlib
import inspect
import time
from dataclasses import dataclass

import torch

import gcmoe
from gcmoe_core.config import MoEConfig

from . import bench

MODELS = ("deepseek-v3", "deepseek-v4-flash", "qwen3-235b")
LAB_SHAPES = {"qwen3-235b": (4096, 1536, 128, 8, 0)}  # H, I, E, top_k, shared (Qwen3-235B-A22B's config.json)
MAX_TOKENS = 256


def model_config(model: str, ep: int = 8, max_tokens: int = MAX_TOKENS) -> MoEConfig:
    """The world-size-1 layer of one rank's EP slice: a MODEL_SHAPES name, a LAB_SHAPES name or custom:H,I,E,k,S."""
    if model in LAB_SHAPES:
        h, i, e, k, s = LAB_SHAPES[model]
        if e % ep:
            raise ValueError(f"gcmoe bench: model {model!r}: E = {e} is not divisible by EP {ep}")
        model = f"{bench.CUSTOM}{h},{i},{e // ep},{k},{s}"
    return bench._model_config(model, ep, max_tokens)


@dataclass(frozen=True)
class StandIn:
    """Attention + router of one layer: x [T, H] bf16 -> (h bf16 [T, H], ids int64 [T, k], w fp32 [T, k])."""

    w_attn: torch.Tensor  # bf16 [H, H]
    w_router: torch.Tensor  # bf16 [H, E_local]
    top_k: int

    def __call__(self, x: torch.Tensor):
        h = torch.nn.functional.rms_norm(x, (x.shape[-1],)) @ self.w_attn
        w, ids = torch.topk(torch.softmax((h @ self.w_router).float(), dim=-1), self.top_k, dim=-1)
        return h, ids, w / w.sum(dim=-1, keepdim=True)


def make_standins(cfg: MoEConfig, n: int, device, seed: int = 0) -> list[StandIn]:
    g = torch.Generator(device=device).manual_seed(seed)
    h = cfg.hidden_size
    randn = lambda *shape: (torch.randn(*shape, generator=g, device=device) * h**-0.5).to(torch.bfloat16)
    return [StandIn(randn(h, h), randn(h, cfg.num_experts), cfg.top_k) for _ in range(n)]


def step_inputs(cfg: MoEConfig, tokens: int, seed: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The two micro-batches' residual streams at T = tokens (xa also the one-batch step's input): bf16 [T, H]."""
    g = torch.Generator().manual_seed(seed + 1000 + tokens)
    return tuple(torch.randn(tokens, cfg.hidden_size, generator=g).to(torch.bfloat16).to(device) for _ in range(2))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_layers(cfg, weights, n, device, backend=None, comm_sms=None, tag="", pool=None) -> tuple[list, list[float]]:
    """n gcmoe.MoELayer loaded from the one `weights` (each prepacks its own copy), in `pool` (None: the default
    pool); per layer the load's seconds."""
    named = "name" in inspect.signature(gcmoe.MoELayer).parameters
    kw_pool = {"pool": pool} if pool is not None else {}
    layers, secs = [], []
    for i in range(n):
        kw = {"name": f"{tag}layers.{i}.mlp"} if named else {}
        t0 = time.perf_counter()
        layers.append(gcmoe.MoELayer(cfg, device, backend, comm_sms=comm_sms, **kw_pool, **kw).load(weights))
        sync(torch.device(device))
        secs.append(time.perf_counter() - t0)
    return layers, secs


def two_batch_comm_sms(layer, tokens: int) -> int:
    """Comm SMs a two-batch call of `tokens` tokens gets from the layer's partition policy (that of its token
    bucket); 0 where the backend has no policy (the reference backend never partitions)."""
    policy = getattr(getattr(layer.packed, "plan", None), "policy", None)
    if policy is None:
        return 0
    from gcmoe.backends.sm90 import token_bucket

    return policy.mode_for(token_bucket(tokens), two_batch=True)


def micro_batch(i: int):
    """gcmoe.micro_batch(i) where the installed gcmoe has it."""
    mb = getattr(gcmoe, "micro_batch", None)
    return mb(i) if mb is not None else contextlib.nullcontext()


def block(standin, moe, x, host_us: list | None = None):
    """One layer of the step: x + moe(standin(x)); host_us gets the host µs of the moe call."""
    h, ids, w = standin(x)
    t0 = time.perf_counter()
    y = moe(h, ids, w)
    if host_us is not None:
        host_us.append((time.perf_counter() - t0) * 1e6)
    return x + y


def run_step(standins, moes, x, host_us: list | None = None):
    for s, m in zip(standins, moes, strict=True):
        x = block(s, m, x, host_us)
    return x


def run_two_batch(standins, moes, xa, xb, side: torch.cuda.Stream | None):
    """Two micro-batches through the step: xa on the current stream, xb on `side` (forked from it, joined back),
    issued layer by layer; with no side stream (CPU) one after the other."""
    if side is None:
        return run_step(standins, moes, xa), run_step(standins, moes, xb)
    main = torch.cuda.current_stream()
    side.wait_stream(main)
    for s, m in zip(standins, moes, strict=True):
        with micro_batch(0):
            xa = block(s, m, xa)
        with torch.cuda.stream(side), micro_batch(1):
            xb = block(s, m, xb)
    main.wait_stream(side)
    if not torch.cuda.is_current_stream_capturing():
        xb.record_stream(main)
    return xa, xb
