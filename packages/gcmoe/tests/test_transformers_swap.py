"""gcmoe.integrations.transformers: transformers' own DeepSeek-V3, Qwen3-MoE, gpt-oss and Mixtral models with their MoE
blocks swapped for gcmoe layers (tiny random models, no hub download; the reference backend on the CPU).

- whole models: logits of the swapped model against transformers' float32 model on a fixed batch of token ids:
  cosine >= 0.999 on the bf16 path (seen: 0.99999+), >= 0.98 on the FP8 x MXFP4 path (seen: 0.986 gpt-oss, 0.994
  DeepSeek-V3, 0.9995+ Qwen3-MoE and Mixtral: random float weights are not MXFP4 values, unlike gpt-oss's
  checkpoints, and their rounding costs ~2% per block, most where the MoE dominates the residual stream as in
  gpt-oss); greedy next-token agreement printed and floored (near-ties abound in a random model's logits);
- one block on N(0, 1) hidden states (where the experts' share is not diluted by the residual stream): cosine
  >= 0.999 (bf16 weights), >= 0.97 (FP8 x MXFP4, docs/numerics.md's floor against the unquantised path);
- the swap keeps the block's router (same module, same state_dict keys), counts only MoE layers (DeepSeek-V3's
  dense first layer stays), returns 0 when run again, and chunks calls longer than max_tokens;
- a dense model and an MoE block of another family raise ValueError naming the problem; nothing is swapped.
The sm90 variants (cuda, sm90 backend) run only on an SM90 GPU.
"""

import copy

import pytest
import torch

tf = pytest.importorskip("transformers")
from gcmoe.integrations.transformers import GcmoeMoEBlock, supported_blocks, swap_moe_blocks  # noqa: E402

VOCAB, HIDDEN = 512, 256
COMMON = dict(
    vocab_size=VOCAB, hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128
)


def _config(family: str):
    """A tiny config of the family: H = 256, expert I = 128 (gpt-oss: 192, padded to 256 inside the layer)."""
    if family == "mixtral":
        return tf.MixtralConfig(
            **COMMON, intermediate_size=128, num_local_experts=8, num_experts_per_tok=2, num_hidden_layers=2
        )
    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(
            **COMMON, intermediate_size=512, moe_intermediate_size=128, num_experts=8, num_experts_per_tok=4,
            num_hidden_layers=2, head_dim=64, norm_topk_prob=True,
        )  # fmt: skip
    if family == "gpt_oss":
        return tf.GptOssConfig(
            **COMMON, intermediate_size=192, num_local_experts=8, num_experts_per_tok=4, num_hidden_layers=2,
            head_dim=64, sliding_window=16,
        )  # fmt: skip
    if family == "deepseek_v3":  # 16 experts in 4 groups, top-2 groups, one shared expert, the first layer dense
        return tf.DeepseekV3Config(
            **COMMON, intermediate_size=512, moe_intermediate_size=128, n_routed_experts=16, n_group=4, topk_group=2,
            num_experts_per_tok=4, n_shared_experts=1, num_hidden_layers=3, first_k_dense_replace=1, kv_lora_rank=64,
            q_lora_rank=96, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=64, routed_scaling_factor=2.5,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )  # fmt: skip
    raise AssertionError(family)


FAMILIES = ["deepseek_v3", "qwen3_moe", "gpt_oss", "mixtral"]


def _model(family: str, device="cpu"):
    """transformers' model of the family, random init (float32), with the init's zero biases made random so the
    paths they take matter: gpt-oss's expert biases, DeepSeek-V3's e_score_correction_bias (routing)."""
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(_config(family)).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("gate_up_proj_bias"):
                t.copy_(torch.randn(t.shape, generator=g) * 0.5)
            elif name.endswith(("down_proj_bias", "e_score_correction_bias")):
                t.copy_(torch.randn(t.shape, generator=g) * 0.02)
    return model.to(device)


def _ids(device="cpu"):
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(2)).to(device)


def _cos(a, b) -> float:
    return torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item()


def _moe_layers(model) -> list[torch.nn.Module]:
    return [layer.mlp for layer in model.model.layers if type(layer.mlp) in supported_blocks()]


def _check_model(family, quant, backend, device, min_cos, min_agree):
    model = _model(family, device)
    ids = _ids(device)
    blocks = _moe_layers(model)
    routers = [getattr(b, supported_blocks()[type(b)].router) for b in blocks]
    orig = copy.deepcopy(blocks[-1])
    with torch.no_grad():
        ref = model(ids).logits.float()
        assert swap_moe_blocks(model, backend, quant=quant) == len(blocks) == 2
        got = model(ids).logits.float()
        # one block on unit-scale hidden states
        x = torch.randn(2, 24, HIDDEN, generator=torch.Generator().manual_seed(3)).to(device)
        want, have = orig(x), model.model.layers[-1].mlp(x)
    if family == "gpt_oss":  # (y, router scores) like transformers' block
        assert isinstance(have, tuple) and torch.equal(have[1], want[1])
        want, have = want[0], have[0]
    cos, agree = _cos(ref, got), (ref.argmax(-1) == got.argmax(-1)).double().mean().item()
    block_cos = _cos(want, have)
    print(
        f"{family} {quant} {backend}: logits cosine {cos:.6f}, greedy agreement {agree:.3f}, block cos {block_cos:.5f}"
    )
    assert cos >= min_cos and agree >= min_agree
    assert block_cos >= (0.999 if quant == "bf16" else 0.97)
    swapped = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, GcmoeMoEBlock)]
    assert all(getattr(b, b.family.router) is r for b, r in zip(swapped, routers, strict=True))  # the same routers
    assert swapped[0].layer.backend == backend


@pytest.mark.parametrize(("quant", "min_cos", "min_agree"), [("bf16", 0.999, 0.9), ("fp8_mxfp4", 0.98, 0.5)])
@pytest.mark.parametrize("family", FAMILIES)
def test_swapped_model_matches_transformers(family, quant, min_cos, min_agree):
    _check_model(family, quant, "reference", "cpu", min_cos, min_agree)


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("family", FAMILIES)
def test_swapped_model_matches_transformers_sm90(family):
    _check_model(family, "fp8_mxfp4", "sm90", "cuda", 0.98, 0.5)


def test_swap_keeps_router_keys_skips_dense_layers_and_is_idempotent():
    model = _model("deepseek_v3")
    keys = {k for k in model.state_dict() if ".gate." in k}
    assert swap_moe_blocks(model, quant="bf16") == 2
    assert type(model.model.layers[0].mlp).__name__ == "DeepseekV3MLP"  # first_k_dense_replace = 1
    assert {k for k in model.state_dict() if ".gate." in k} == keys  # weight, e_score_correction_bias
    assert not any("experts" in k for k in model.state_dict())  # the expert tensors went with the blocks
    layer = model.model.layers[1].mlp.layer
    assert (layer.cfg.num_shared_experts, layer.cfg.top_k, layer.cfg.num_experts) == (1, 4, 16)
    assert swap_moe_blocks(model) == 0  # every block swapped already


def test_long_calls_run_in_chunks_of_max_tokens():
    ids = _ids()
    outs, calls = [], []
    for max_tokens in (256, 5):
        model = _model("qwen3_moe")
        swap_moe_blocks(model, quant="bf16", max_tokens=max_tokens)
        layer = model.model.layers[0].mlp.layer
        assert layer.cfg.max_tokens_per_rank == max_tokens
        layer.register_forward_pre_hook(lambda _, args: calls.append(args[0].shape[0]))
        with torch.no_grad():
            outs.append(model(ids).logits)
    assert calls == [24, 5, 5, 5, 5, 4]  # 24 tokens in one call, or in chunks of 5 rows
    # (the same values up to fp32 sums of another blocking: a bf16 rounding of y may differ)
    torch.testing.assert_close(outs[1], outs[0], atol=2e-3, rtol=0)


def test_dense_model_raises():
    cfg = tf.LlamaConfig(**COMMON, intermediate_size=256, num_hidden_layers=1)
    with pytest.raises(ValueError, match=r"no MoE block in LlamaForCausalLM.*known blocks: .*MixtralSparseMoeBlock"):
        swap_moe_blocks(tf.AutoModelForCausalLM.from_config(cfg))


def test_unknown_moe_block_raises_and_swaps_nothing():
    cfg = tf.Qwen2MoeConfig(
        **COMMON, intermediate_size=256, moe_intermediate_size=128, shared_expert_intermediate_size=128,
        num_experts=4, num_experts_per_tok=2, num_hidden_layers=1,
    )  # fmt: skip
    model = tf.AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(ValueError, match=r"does not know: model\.layers\.0\.mlp \(Qwen2MoeSparseMoeBlock\).*nothing"):
        swap_moe_blocks(model)
    assert not any(isinstance(m, GcmoeMoEBlock) for m in model.modules())


def _old_layout(model):
    """transformers 4.x's Mixtral experts: a ModuleList of per-expert MLPs."""
    model.model.layers[0].mlp.experts = torch.nn.ModuleList([torch.nn.Linear(HIDDEN, HIDDEN)])
    return model


@pytest.mark.parametrize(
    ("change", "hidden_act", "match"),
    [
        (_old_layout, "silu", r"layers\.0\.mlp: experts ModuleList hold no fused gate_up_proj.*5\.x"),
        (None, "gelu", "not SiLU"),
    ],
    ids=["old-layout", "gelu"],
)
def test_block_that_cannot_be_converted_raises_naming_it(change, hidden_act, match):
    cfg = _config("mixtral")
    cfg.hidden_act = hidden_act
    model = tf.AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(ValueError, match=match):
        swap_moe_blocks(change(model) if change else model)
