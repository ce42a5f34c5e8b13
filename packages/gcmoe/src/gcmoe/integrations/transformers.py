"""Swap the MoE blocks of Hugging Face transformers models for gcmoe layers ("models, not only layers").

    from gcmoe.integrations.transformers import swap_moe_blocks

    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16, device_map="cuda")
    n = swap_moe_blocks(model)               # every MoE block -> a GcmoeMoEBlock; n blocks swapped
    model.generate(...)                      # same calls, same outputs' shapes

What is swapped: each MoE block of transformers' own DeepSeek-V3 (DeepseekV3MoE), Qwen3-MoE
(Qwen3MoeSparseMoeBlock), gpt-oss (GptOssMLP) and Mixtral (MixtralSparseMoeBlock) modules becomes a GcmoeMoEBlock:
the block's own router module (kept as it is, under its own attribute name) and a gcmoe.MoELayer holding the
block's experts. Dense MLPs (DeepSeek-V3's first_k_dense_replace layers, Qwen3-MoE's mlp_only_layers), attention
and everything else are left alone. The weights are converted once, at the swap; the block's expert tensors are
dropped with the block.

Routing is the model's own: GcmoeMoEBlock calls the router module transformers built, which returns (logits, top-k
weights, top-k ids) in these four families — Mixtral's softmax top-2 renormalised, Qwen3-MoE's softmax top-k
(renormalised when norm_topk_prob), DeepSeek-V3's grouped sigmoid routing with e_score_correction_bias,
norm_topk_prob and routed_scaling_factor, gpt-oss's biased router with softmax over its top-k logits. Nothing of it is
rewritten here; the ids and weights (as fp32) go to the layer.

Experts map onto MoEConfig / MoELayer.load_weights as:

    family        experts' tensors (transformers 5.x)            -> w13 [E, 2I, H] gate rows then up, w2 [E, H, I]
    Mixtral,      gate_up_proj [E, 2I, H] (gate then up),          as they are; activation "swiglu" (silu(gate) * up)
    Qwen3-MoE,    down_proj [E, H, I]
    DeepSeek-V3
    gpt-oss       gate_up_proj [E, H, 2I] gate / up interleaved,    transposed, deinterleave_gate_up (weights and
                  down_proj [E, I, H], + biases                    bias); "swiglu_clamped" with the experts' alpha /
                                                                   limit, has_bias
    DeepSeek-V3's shared_experts (one MLP of intermediate S * I) -> S shared experts of the layer (weight 1.0): its
                  gate / up rows and down columns cut into S slices of I channels (exact: the channels are
                  independent and down sums over them).

The block returns what transformers' block returns: y in the hidden states' dtype and shape (gpt-oss: (y, router
scores)).

Exact and quantised: the routing (router logits, top-k, weights) is transformers' own computation, bit for bit. The
layer takes x in bf16 and returns y in bf16 (cast back to the model's dtype). With quant="fp8_mxfp4" (the default,
the product path) the expert weights are quantised once to MXFP4 and activations to FP8 per call
(docs/numerics.md); with quant="bf16" the weights are held in bf16. Both differ from transformers' float
computation by their rounding only (tests, tiny random models of each family: logits cosine >= 0.999 with bf16
weights, >= 0.98 with fp8_mxfp4 — gpt-oss 0.986, whose random MoE output dominates its residual stream).

Inference only: no gradient flows through the layer (x and the routing weights are detached). Calls of more tokens
than max_tokens (the layer's max_tokens_per_rank) run in chunks of max_tokens rows.

Versions: the transformers 5.x module layout (fused 3-D expert parameters, router modules returning (logits,
weights, ids)); tested with 5.25.0. Older layouts (4.x: experts as a ModuleList of per-expert MLPs, routing inside
the block's forward) and blocks of other MoE models are reported as unknown MoE blocks: swap_moe_blocks raises
before it swaps anything.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch
from torch import nn

from gcmoe_core.config import MoEConfig
from gcmoe_core.layouts import deinterleave_gate_up

from ..layer import MoELayer


@dataclass(frozen=True)
class Family:
    """One transformers model family whose MoE blocks swap_moe_blocks knows."""

    name: str
    module: str  # the transformers modeling module
    block: str  # the MoE block's class there
    router: str  # the block's router attribute
    shared: str | None = None  # the block's shared-expert MLP attribute (folded into the layer)
    gpt_oss: bool = False  # gpt-oss experts (transposed, interleaved gate/up, biases, clamped SwiGLU), (y, scores) out


FAMILIES = (
    Family("deepseek_v3", "deepseek_v3.modeling_deepseek_v3", "DeepseekV3MoE", "gate", shared="shared_experts"),
    Family("qwen3_moe", "qwen3_moe.modeling_qwen3_moe", "Qwen3MoeSparseMoeBlock", "gate"),
    Family("gpt_oss", "gpt_oss.modeling_gpt_oss", "GptOssMLP", "router", gpt_oss=True),
    Family("mixtral", "mixtral.modeling_mixtral", "MixtralSparseMoeBlock", "gate"),
)


def _fail(msg: str):
    raise ValueError(f"gcmoe: swap_moe_blocks: {msg}")


def supported_blocks() -> dict[type, Family]:
    """The MoE block classes of the installed transformers that swap_moe_blocks swaps -> their family (a family
    whose module or class this transformers lacks is left out). ImportError without transformers."""
    importlib.import_module("transformers")
    blocks = {}
    for fam in FAMILIES:
        try:
            cls = getattr(importlib.import_module(f"transformers.models.{fam.module}"), fam.block)
        except (ImportError, AttributeError):
            continue
        blocks[cls] = fam
    return blocks


# ------------------------------------------------------------------------------------------------ weights
def _version() -> str:
    return importlib.import_module("transformers").__version__


def _check_silu(module: nn.Module, where: str) -> None:
    """Mixtral / Qwen3-MoE / DeepSeek-V3 experts are SwiGLU only with hidden_act "silu" (transformers' ACT2FN)."""
    act = getattr(module, "act_fn", None)
    if type(act).__name__ not in ("SiLU", "SiLUActivation"):
        _fail(f"{where}: activation {type(act).__name__} is not SiLU; gcmoe's experts are SwiGLU (hidden_act 'silu')")


def routed_weights(experts: nn.Module, fam: Family, where: str) -> dict[str, torch.Tensor]:
    """The experts' tensors as MoELayer.load_weights takes them: w13 [E, 2I, H] (gate rows, then up rows), w2
    [E, H, I] (+ fp32 w13_bias [E, 2I], w2_bias [E, H] for gpt-oss)."""
    if not isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor):
        _fail(
            f"{where}: experts {type(experts).__name__} hold no fused gate_up_proj tensor: transformers "
            f"{_version()} lays them out otherwise; gcmoe swaps the 5.x layout"
        )
    if fam.gpt_oss:
        return {
            "w13": deinterleave_gate_up(experts.gate_up_proj.transpose(1, 2)).contiguous(),
            "w2": experts.down_proj.transpose(1, 2).contiguous(),
            "w13_bias": deinterleave_gate_up(experts.gate_up_proj_bias).float().contiguous(),
            "w2_bias": experts.down_proj_bias.float().contiguous(),
        }
    _check_silu(experts, where)
    return {"w13": experts.gate_up_proj.contiguous(), "w2": experts.down_proj.contiguous()}


def shared_weights(mlp: nn.Module, inter: int, where: str) -> dict[str, torch.Tensor]:
    """A shared-expert MLP of intermediate S * I (gate_proj, up_proj [S*I, H], down_proj [H, S*I]) as S shared experts
    of intermediate I: shared_w13 [S, 2I, H], shared_w2 [S, H, I]."""
    _check_silu(mlp, where)
    gate, up, down = (getattr(mlp, p).weight for p in ("gate_proj", "up_proj", "down_proj"))
    (si, h), (s, rest) = gate.shape, divmod(gate.shape[0], inter)
    if rest or any(getattr(mlp, p).bias is not None for p in ("gate_proj", "up_proj", "down_proj")):
        _fail(f"{where}: shared expert of intermediate {si} with biases or not a multiple of the routed I = {inter}")
    return {
        "shared_w13": torch.cat((gate.view(s, inter, h), up.view(s, inter, h)), dim=1).contiguous(),
        "shared_w2": down.view(h, s, inter).transpose(0, 1).contiguous(),
    }


def layer_config(block: nn.Module, fam: Family, weights: dict, quant: str, max_tokens: int) -> MoEConfig:
    """The block's MoEConfig from its converted weights (E, I, H), router (top_k) and experts (activation)."""
    e, two_i, h = weights["w13"].shape
    act = {}
    if fam.gpt_oss:
        act = dict(activation="swiglu_clamped", swiglu_alpha=block.experts.alpha, swiglu_limit=block.experts.limit)
    return MoEConfig(
        h,
        two_i // 2,
        e,
        getattr(block, fam.router).top_k,
        num_shared_experts=weights["shared_w13"].shape[0] if "shared_w13" in weights else 0,
        max_tokens_per_rank=max_tokens,
        quant=quant,
        has_bias="w13_bias" in weights,
        **act,
    )


# ------------------------------------------------------------------------------------------------ the block
class GcmoeMoEBlock(nn.Module):
    """A transformers MoE block on a gcmoe layer: the block's own router (under its own attribute name, so its
    parameters keep their state_dict keys) routes in torch; the layer runs the routed (+ shared) experts."""

    def __init__(self, family: Family, router: nn.Module, layer: MoELayer):
        super().__init__()
        self.family = family
        self.add_module(family.router, router)
        self.layer = layer

    def forward(self, hidden_states: torch.Tensor):
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        _, weights, ids = getattr(self, self.family.router)(x)
        y = self.run_experts(x, ids, weights).to(hidden_states.dtype).view(shape)
        return (y, weights) if self.family.gpt_oss else y

    @torch.no_grad()
    def run_experts(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The layer on x [T, H] (any float dtype and device; bf16 on the layer's device for the call), in chunks of
        max_tokens_per_rank rows; y [T, H] bf16 on x's device."""
        dev, n = self.layer.device, self.layer.cfg.max_tokens_per_rank
        xb = x.detach().to(dev, torch.bfloat16).contiguous()
        ids, weights = ids.to(dev).contiguous(), weights.detach().to(dev, torch.float32).contiguous()
        ys = [self.layer(xb[i : i + n], ids[i : i + n], weights[i : i + n]) for i in range(0, max(len(xb), 1), n)]
        return (ys[0] if len(ys) == 1 else torch.cat(ys)).to(x.device)


@torch.no_grad()
def swap_block(
    block: nn.Module, fam: Family, backend=None, device=None, quant="fp8_mxfp4", max_tokens=256, name=None
) -> GcmoeMoEBlock:
    """One transformers MoE block -> a GcmoeMoEBlock (its weights converted and loaded once; device None: the
    experts' device)."""
    where = name or type(block).__name__
    weights = routed_weights(block.experts, fam, where)
    if fam.shared:
        weights |= shared_weights(getattr(block, fam.shared), weights["w2"].shape[2], where)
    cfg = layer_config(block, fam, weights, quant, max_tokens)
    layer = MoELayer(cfg, device if device is not None else weights["w13"].device, backend, name=name)
    order = ("w13", "w2", "shared_w13", "shared_w2")
    layer.load_weights(
        *(weights.get(k) for k in order), w13_bias=weights.get("w13_bias"), w2_bias=weights.get("w2_bias")
    )
    return GcmoeMoEBlock(fam, getattr(block, fam.router), layer)


def _looks_like_moe(module: nn.Module) -> bool:
    """A module holding experts (an `experts` child) that swap_moe_blocks does not know."""
    return "experts" in dict(module.named_children())


def swap_moe_blocks(
    model: nn.Module, backend: str | None = None, device=None, *, quant: str = "fp8_mxfp4", max_tokens: int = 256
) -> int:
    """Swap every MoE block of a transformers model (DeepSeek-V3, Qwen3-MoE, gpt-oss, Mixtral) for a GcmoeMoEBlock,
    in place; returns how many were swapped (0 when every block is swapped already).

    backend / device: the layers' (None: chosen from the device / the experts' device). quant: "fp8_mxfp4" (MXFP4
    weights, FP8 activations) or "bf16". max_tokens: the layers' max_tokens_per_rank (longer calls run in chunks).
    Raises ValueError, before swapping anything, where the model holds an MoE block of another family or none at
    all; a block that cannot be converted (an older transformers layout, an activation other than SiLU) raises
    naming it, the blocks before it swapped already (each block is converted and swapped in turn, so the model never
    holds two copies of every expert)."""
    blocks = supported_blocks()
    found, unknown, done = [], [], 0  # (found: names only, so each replaced block is freed as the loop goes)
    for name, module in model.named_modules():
        if type(module) in blocks:
            found.append((name, blocks[type(module)]))
        elif isinstance(module, GcmoeMoEBlock):
            done += 1
        elif _looks_like_moe(module):
            unknown.append(f"{name} ({type(module).__name__})")
    known = ", ".join(f.block for f in blocks.values())
    if unknown:
        _fail(
            f"{type(model).__name__} holds MoE blocks gcmoe does not know: {', '.join(unknown[:3])}"
            f"{', ...' if len(unknown) > 3 else ''}; known blocks: {known}; nothing was swapped"
        )
    if not found and not done:
        _fail(f"no MoE block in {type(model).__name__} (a dense model?); known blocks: {known}")
    for name, fam in found:
        model.set_submodule(name, swap_block(model.get_submodule(name), fam, backend, device, quant, max_tokens, name))
    return len(found)
