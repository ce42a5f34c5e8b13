"""vLLM adapter: gcmoe computes the routed experts of vLLM's fused-MoE layers (tested with vLLM 0.33.0).

    import gcmoe.integrations.vllm                   # registers the quantization method "gcmoe" (every process:
    llm = vllm.LLM(model, quantization="gcmoe")      # the vllm.general_plugins entry point does it in workers)

or, on a layer vLLM built (a RoutedExperts, before its weights are loaded): install(layer).

Design. vLLM 0.33 splits its MoE into a router, a RoutedExperts module (the weights; its quant_method computes) and
a MoERunner (routing, shared experts, the EP / TP reduction). GcmoeFusedMoEMethod is a FusedMoEMethodBase, the
class vLLM's quant methods derive from:
- create_weights is vLLM's own unquantised one (UnquantizedFusedMoEMethod.create_weights): the same parameters,
  w13_weight [E_local, 2I, H] (gate rows then up rows; gate/up interleaved for "swigluoai"), w2_weight
  [E_local, H, I], biases when the model has them, with vLLM's weight loaders; checkpoints load unchanged.
- process_weights_after_loading packs them ONCE (gcmoe.engine.engine_weights -> MoEConfig -> gcmoe.prepack: MXFP4
  weights for the sm90 backend by default, or bf16) into a PackedMoE handle, and then empties the raw parameters
  (free_raw_weights=True: their storage becomes [0]-shaped, so the layer holds only the pack; a later weight reload
  needs a fresh layer).
- apply(layer, x, topk_weights, topk_ids, ...) gets the routing vLLM's router already computed (the runner calls
  router.select_experts, then RoutedExperts.forward_modular -> apply) and calls gcmoe.fused_experts with the handle
  and layer.expert_map: EP the vLLM way (global ids; another rank's expert becomes a masked slot; the output is this
  rank's partial sum, which the runner all-reduces as for its own kernels). Calls of more tokens than the pack's
  max_tokens_per_rank run in chunks. Shared experts stay vLLM's (the runner runs them: moe_kernel is None, so no
  overlap inside the kernel); routed_scaling_factor stays the router's / runner's.
Not covered (a ValueError at load): activations other than silu / swigluoai / swigluoai_uninterleave, swiglu_beta,
checkpoints quantised for another method (use quantization="gcmoe" with unquantised expert weights).
"""

from __future__ import annotations

import torch

try:
    from vllm.model_executor.layers.fused_moe import FusedMoEConfig, FusedMoEMethodBase, RoutedExperts
    from vllm.model_executor.layers.fused_moe.config import FusedMoEQuantConfig
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
    from vllm.model_executor.layers.quantization import register_quantization_config
    from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
except ImportError as e:  # (gcmoe itself never imports this module)
    raise ImportError(
        "gcmoe.integrations.vllm needs vLLM's fused-MoE layer (vllm.model_executor.layers.fused_moe.RoutedExperts, "
        f"vLLM >= 0.33; tested with 0.33.0): pip install vllm ({e})"
    ) from e

from gcmoe_core.config import MAX_TOKENS_PER_RANK, MoEConfig

from ..engine import _QUANT_ARGS, engine_weights, fused_experts
from ..layer import PackedMoE, prepack

# vLLM's MoEActivation value -> (MoEConfig.activation, w13 rows interleaved gate/up)
ACTIVATIONS = {
    "silu": ("swiglu", False),
    "swigluoai": ("swiglu_clamped", True),
    "swigluoai_uninterleave": ("swiglu_clamped", False),
}


class GcmoeFusedMoEMethod(FusedMoEMethodBase):
    """vLLM's unquantised expert parameters, packed once for gcmoe after loading; apply runs gcmoe.fused_experts."""

    create_weights = UnquantizedFusedMoEMethod.create_weights  # vLLM's own parameters, loaders and shapes

    def __init__(self, moe: FusedMoEConfig, quant: str = "fp8_mxfp4", backend: str | None = None,
                 max_tokens_per_rank: int | None = None, free_raw_weights: bool = True):  # fmt: skip
        super().__init__(moe)
        self.quant, self.backend, self.free_raw_weights = quant, backend, free_raw_weights
        self.max_tokens = max_tokens_per_rank or max(1, min(moe.max_num_tokens, MAX_TOKENS_PER_RANK))
        self.packed: PackedMoE | None = None

    def get_fused_moe_quant_config(self, layer) -> FusedMoEQuantConfig | None:
        return None  # gcmoe quantises for itself; no vLLM modular kernel is built from this

    def process_weights_after_loading(self, layer: RoutedExperts) -> None:
        act = layer.activation.value
        if act not in ACTIVATIONS:
            raise ValueError(f"gcmoe (vLLM): activation {act!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
        if getattr(layer, "swiglu_beta", None) not in (None, 1.0):
            raise ValueError(f"gcmoe (vLLM): swiglu_beta={layer.swiglu_beta} is not supported")
        kind, interleaved = ACTIVATIONS[act]
        w13, w2 = layer.w13_weight, layer.w2_weight
        bias = self.moe.has_bias
        q = {**_QUANT_ARGS, "w1_bias": layer.w13_bias if bias else None, "w2_bias": layer.w2_bias if bias else None}
        e, two_i, h = w13.shape
        clamp = {}
        if kind == "swiglu_clamped":  # the layer's alpha / limit where the model sets them (else gpt-oss's)
            clamp = {
                k: float(v) for k in ("swiglu_alpha", "swiglu_limit") if (v := getattr(layer, k, None)) is not None
            }
        cfg = MoEConfig(
            h, two_i // 2, e, self.moe.experts_per_token, max_tokens_per_rank=self.max_tokens, quant=self.quant,
            masked_ids=True, activation=kind, has_bias=bias, **clamp,
        )  # fmt: skip
        with torch.no_grad():
            self.packed = prepack(cfg, engine_weights(w13, w2, self.quant, interleaved, q), w13.device, self.backend)
        if self.free_raw_weights:
            for name in ("w13_weight", "w2_weight", "w13_bias", "w2_bias"):
                p = getattr(layer, name, None)
                if isinstance(p, torch.Tensor):
                    p.data = p.data.new_empty(0)

    def apply(self, layer: RoutedExperts, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              shared_experts=None, shared_experts_input=None) -> torch.Tensor:  # fmt: skip
        if self.packed is None:
            raise RuntimeError("gcmoe (vLLM): apply before process_weights_after_loading (no packed weights)")
        kw = dict(
            activation=layer.activation.value, apply_router_weight_on_input=layer.apply_router_weight_on_input,
            global_num_experts=layer.global_num_experts, expert_map=layer.expert_map,
        )  # fmt: skip
        n = self.packed.cfg.max_tokens_per_rank
        if x.shape[0] <= n:
            return fused_experts(x, self.packed, None, topk_weights, topk_ids, **kw)
        out = torch.empty_like(x)
        for s in range(0, x.shape[0], n):
            fused_experts(x[s : s + n], self.packed, None, topk_weights[s : s + n], topk_ids[s : s + n],
                          out=out[s : s + n], **kw)  # fmt: skip
        return out


class GcmoeConfig(QuantizationConfig):
    """quantization="gcmoe": the routed experts on gcmoe (GcmoeFusedMoEMethod), linear layers unquantised. Options
    (hf_overrides={"quantization_config": {...}} or from_config): quant ("fp8_mxfp4" | "bf16"), backend,
    max_tokens_per_rank."""

    def __init__(self, quant: str = "fp8_mxfp4", backend: str | None = None, max_tokens_per_rank: int | None = None):
        super().__init__()
        self.options = dict(quant=quant, backend=backend, max_tokens_per_rank=max_tokens_per_rank)

    def get_name(self) -> str:
        return "gcmoe"

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 80  # sm90 runs gcmoe's kernels; other devices its reference backend

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []  # nothing to read from the checkpoint: GcmoeConfig() is used

    @classmethod
    def from_config(cls, config: dict) -> GcmoeConfig:
        return cls(**{k: config[k] for k in ("quant", "backend", "max_tokens_per_rank") if k in config})

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        if isinstance(layer, RoutedExperts):
            return GcmoeFusedMoEMethod(layer.moe_config, **self.options)
        if isinstance(layer, LinearBase):
            return UnquantizedLinearMethod()
        return None


def register() -> None:
    """Make quantization="gcmoe" known to vLLM (idempotent; a vllm.general_plugins entry point)."""
    register_quantization_config("gcmoe")(GcmoeConfig)


def install(layer: RoutedExperts, **options) -> GcmoeFusedMoEMethod:
    """Swap a built layer's quant method for gcmoe's (before its weights are loaded: the parameters are the same as
    vLLM's unquantised method's). options: GcmoeFusedMoEMethod's (quant, backend, max_tokens_per_rank)."""
    method = GcmoeFusedMoEMethod(layer.moe_config, **options)
    layer._replace_quant_method(method)
    return method


register()
