"""Helpers the tests of every package share: GEMM error metrics (calc_diff, the DeepGEMM metric: thresholds are
<= 1e-3 against a reference that emulates the same quantisation), poisoning, random MoE problems and graph capture.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .config import MoEConfig
from .formats import random_mxfp4
from .reference import MoEWeights


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """1 - 2<x,y>/(|x|^2+|y|^2) in float64; NaN anywhere gives NaN (never passes a <= test)."""
    x, y = x.double().flatten(), y.double().flatten()
    denom = (x * x).sum() + (y * y).sum()
    if float(denom) == 0.0:
        return 0.0 if torch.equal(x, y) else float("nan")
    return float(1.0 - 2.0 * (x * y).sum() / denom)


def cosine(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double().flatten(), y.double().flatten()
    return float((x @ y) / (x.norm() * y.norm()).clamp_min(1e-300))


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill with NaN (floats) or an out-of-range pattern (integers) so unwritten elements fail a comparison."""
    if t.is_floating_point():
        return t.fill_(float("nan"))
    return t.fill_(-0x5A5A5A5A if t.dtype in (torch.int32, torch.int64) else 0xA5)


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous().reshape(-1)
    return t.view(_INT_OF_SIZE[t.element_size()]) if t.is_floating_point() or t.dtype == torch.bool else t


def first_mismatch(a: torch.Tensor, b: torch.Tensor) -> str:
    """Bitwise comparison: '' when equal, else how many elements differ and the first one (index and values)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"{a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    ne = (_bits(a) != _bits(b).to(_bits(a).device)).nonzero()
    if ne.numel() == 0:
        return ""
    i = int(ne[0])
    idx = tuple(int(v) for v in torch.unravel_index(torch.tensor(i), a.shape))
    va, vb = a.reshape(-1)[i].float().item(), b.reshape(-1)[i].float().item()
    return f"{ne.numel()} element(s) differ; first at {idx}: {va} vs {vb}"


def capture_graph(
    fn: Callable[[], object],
    warmup: int = 1,
    device: torch.device | None = None,
    stream: torch.cuda.Stream | None = None,
):
    """(graph, what fn returned while captured). fn runs `warmup` times on a side stream first, so allocations,
    lazy initialisation and JIT compiles stay out of the graph; replaying the graph re-runs fn's device work.
    stream: warm up and capture on it (a green-context stream: the captured kernels keep its SM partition)."""
    s = stream or torch.cuda.Stream(device=device)
    s.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(s):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream(device).wait_stream(s)
    torch.cuda.synchronize(device)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream):
        out = fn()
    return g, out


ROUTINGS = ("uniform", "one_expert", "half_empty")


@dataclass(frozen=True)
class Case:
    """One MoE problem: a config, a token count and a routing pattern."""

    cfg: MoEConfig
    tokens: int
    routing: str = "uniform"
    seed: int = 0

    @property
    def id(self) -> str:
        c = self.cfg
        shape = f"H{c.hidden_size}-I{c.intermediate_size}-E{c.num_experts}-k{c.top_k}-s{c.num_shared_experts}"
        return f"{shape}-T{self.tokens}-{self.routing}"


def make_routing(t: int, k: int, e: int, routing: str, generator: torch.Generator, device="cpu"):
    """Random top-k ids (distinct per token) and softmax-like fp32 weights.

    uniform     ids uniform over all experts
    one_expert  every token's slot 0 on expert 0 (the rest uniform): one expert holds every token
    half_empty  ids only over the even experts: half the experts receive nothing
    """
    if routing == "half_empty" and e >= 2 * k:
        pool = torch.arange(0, e, 2)
    else:
        pool = torch.arange(e)
    scores = torch.rand(t, pool.numel(), generator=generator)
    if routing == "one_expert":
        scores[:, 0] = 2.0
    elif routing not in ROUTINGS:
        raise ValueError(f"unknown routing {routing!r}; known: {ROUTINGS}")
    top = torch.topk(scores, k, dim=1)
    ids = pool[top.indices].to(torch.int32)
    w = torch.softmax(torch.randn(t, k, generator=generator), dim=1).float()
    return ids.to(device), w.to(device)


def make_tokens(cfg: MoEConfig, tokens: int, routing: str = "uniform", seed: int = 0, device="cpu", generator=None):
    """A decode step's call arguments on `device`: x [T, H] bf16 ~ N(0, 1), top-k ids and weights (make_routing),
    deterministic in seed — or drawn from `generator`, continuing its stream."""
    g = generator if generator is not None else torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, cfg.hidden_size, generator=g).to(torch.bfloat16)
    ids, w = make_routing(tokens, cfg.top_k, cfg.num_experts, routing, g)
    return x.to(device), ids.to(device), w.to(device)


def make_problem(case: Case, device="cpu"):
    """Fresh random x [T, H] bf16, ids, weights and float weights (w13, w2, shared...) for `case`, deterministic
    in case.seed. Weights ~ N(0, 1/fan_in) so outputs have O(1) magnitude."""
    cfg = case.cfg
    g = torch.Generator().manual_seed(case.seed)
    h, i, el, s = cfg.hidden_size, cfg.intermediate_size, cfg.local_experts, cfg.num_shared_experts
    x, ids, w = make_tokens(cfg, case.tokens, case.routing, generator=g)
    w13 = torch.randn(el, 2 * i, h, generator=g) * h**-0.5
    w2 = torch.randn(el, h, i, generator=g) * i**-0.5
    sw13 = torch.randn(s, 2 * i, h, generator=g) * h**-0.5 if s else None
    sw2 = torch.randn(s, h, i, generator=g) * i**-0.5 if s else None
    weights = MoEWeights.from_float(w13, w2, sw13, sw2, quant=cfg.quant).to(device)
    return x.to(device), ids.to(device), w.to(device), weights, (w13, w2, sw13, sw2)


def make_weights(cfg: MoEConfig, seed: int = 0, device="cpu", quant: str | None = None) -> MoEWeights:
    """Random layer weights of full model size, fast, on `device`: MXFP4 drawn directly in the format
    (formats.random_mxfp4), bf16 from a normal distribution; element RMS 1/sqrt(fan_in) like make_problem; fp32
    biases where cfg.has_bias."""
    quant = quant or cfg.quant
    g = torch.Generator(device=device).manual_seed(seed)
    h, i = cfg.hidden_size, cfg.intermediate_size

    def stack(n: int, rows: int, k: int):
        if n == 0:
            return None
        if quant == "fp8_mxfp4":
            return random_mxfp4((n, rows, k), g, device, rms=k**-0.5)
        return (torch.randn(n, rows, k, generator=g, device=device) * k**-0.5).to(torch.bfloat16)

    s, el = cfg.num_shared_experts, cfg.local_experts
    bias = {}
    if cfg.has_bias:  # (gpt-oss) fp32 biases of the size a layer's pre-activations and outputs have
        bias = {
            "w13_bias": torch.randn(el, 2 * i, generator=g, device=device) * 0.5,
            "w2_bias": torch.randn(el, h, generator=g, device=device) * 0.1,
        }
    return MoEWeights(stack(el, 2 * i, h), stack(el, h, i), stack(s, 2 * i, h), stack(s, h, i), **bias)
