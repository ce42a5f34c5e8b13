"""Every design limit and every bad call argument is a ValueError naming the argument and the limit."""

import pytest
import torch

from gcmoe_core.config import MODEL_SHAPES, MoEConfig, validate_call, validate_weights

OK = dict(
    hidden_size=512,
    intermediate_size=256,
    num_experts=16,
    top_k=4,
    num_shared_experts=1,
    ep_size=2,
    max_tokens_per_rank=32,
)

BAD_CONFIGS = [
    (dict(intermediate_size=4224), "intermediate_size.*I <= 4096"),
    (dict(intermediate_size=4097), "intermediate_size.*padded to 4224.*I <= 4096"),  # H, I: padded internally
    (dict(top_k=31, num_shared_experts=2), "top_k.*exceeds the limit 32"),
    (dict(num_experts=2304, ep_size=1), "num_experts.*E <= 2048"),
    (dict(ep_size=73, num_experts=73 * 16), "ep_size"),
    (dict(ep_size=3), "ep_size.*divisible"),
    (dict(top_k=0), "top_k.*positive"),
    (dict(hidden_size=-256), "hidden_size.*positive"),
    (dict(num_shared_experts=-1), "num_shared_experts"),
    (dict(max_tokens_per_rank=0), "max_tokens_per_rank"),
    (dict(max_tokens_per_rank=10**6), "max_tokens_per_rank.*limit"),
    (dict(quant="int4"), "quant"),
    (dict(top_k=2.0), "top_k.*positive int"),
    (dict(num_experts=2, ep_size=1), "top_k.*exceeds the number of experts"),
]


@pytest.mark.parametrize(("change", "match"), BAD_CONFIGS, ids=[m for _, m in BAD_CONFIGS])
def test_bad_config(change, match):
    with pytest.raises(ValueError, match=match):
        MoEConfig(**{**OK, **change})


def test_model_shapes_are_valid_under_ep8_and_ep1():
    for name in MODEL_SHAPES:
        assert MoEConfig.from_model(name, ep_size=8).local_experts == MODEL_SHAPES[name].num_experts // 8
        MoEConfig.from_model(name)
    s = MoEConfig.ep_slice("deepseek-v3", 8)
    assert (s.num_experts, s.ep_size, s.top_k) == (32, 1, 8)
    with pytest.raises(ValueError, match="unknown model"):
        MoEConfig.from_model("llama")


def _good(cfg, t=4):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(t, cfg.hidden_size, generator=g).bfloat16()
    ids = torch.randint(0, cfg.num_experts, (t, cfg.top_k), generator=g, dtype=torch.int32)
    w = torch.rand(t, cfg.top_k, generator=g)
    return x, ids, w


CFG = MoEConfig(**OK)


def _mut(what):
    x, ids, w = _good(CFG)
    return {"x": x, "ids": ids, "w": w, **what(x, ids, w)}


def _with(t, idx, v):
    t = t.clone()
    t[idx] = v
    return t


BAD_CALLS = [
    (lambda x, i, w: {"x": x.float()}, "x: dtype must be torch.bfloat16"),
    (lambda x, i, w: {"x": x.half()}, "x: dtype"),
    (lambda x, i, w: {"x": x[:, :256].contiguous()}, r"x: shape .*dim 1 must be 512"),
    (lambda x, i, w: {"x": x.unsqueeze(0)}, "x: must be 2-D"),
    (lambda x, i, w: {"x": x.t().contiguous().t()}, "x: must be contiguous"),
    (lambda x, i, w: {"x": x.repeat(9, 1), "ids": i.repeat(9, 1), "w": w.repeat(9, 1)}, "T = 36 .*max_tokens_per_rank"),
    (lambda x, i, w: {"x": x.float().numpy()}, "x: must be a torch.Tensor"),
    (lambda x, i, w: {"ids": i.float()}, "topk_ids: dtype"),
    (lambda x, i, w: {"ids": i.to(torch.int16)}, "topk_ids: dtype"),
    (lambda x, i, w: {"ids": i[:, :2].contiguous()}, r"topk_ids: shape .*dim 1 must be 4"),
    (lambda x, i, w: {"ids": i[:3]}, r"topk_ids: shape .*dim 0 must be 4"),
    (lambda x, i, w: {"ids": i.reshape(-1)}, "topk_ids: must be 2-D"),
    (lambda x, i, w: {"ids": i.t().contiguous().t()}, "topk_ids: must be contiguous"),
    (lambda x, i, w: {"ids": _with(i, (1, 2), -1)}, "topk_ids: holds a negative expert id"),
    (lambda x, i, w: {"ids": _with(i, (3, 0), 16)}, r"topk_ids: holds expert id 16, out of range \[0, 16\)"),
    (lambda x, i, w: {"ids": _with(i, (0, 0), 10**6).long()}, "topk_ids: holds expert id 1000000"),
    (lambda x, i, w: {"w": w.double()}, "topk_weights: dtype must be torch.float32"),
    (lambda x, i, w: {"w": w.bfloat16()}, "topk_weights: dtype"),
    (lambda x, i, w: {"w": w[:, :1].contiguous()}, "topk_weights: shape"),
    (lambda x, i, w: {"w": _with(w, (2, 1), float("nan"))}, "topk_weights: holds a non-finite"),
    (lambda x, i, w: {"w": _with(w, (0, 3), float("inf"))}, "topk_weights: holds a non-finite"),
    (lambda x, i, w: {"w": w.t().contiguous().t()}, "topk_weights: must be contiguous"),
    (lambda x, i, w: {"w": w.tolist()}, "topk_weights: must be a torch.Tensor"),
]


@pytest.mark.parametrize(("mutate", "match"), BAD_CALLS, ids=[f"{n}-{m[:30]}" for n, (_, m) in enumerate(BAD_CALLS)])
def test_bad_call(mutate, match):
    a = _mut(mutate)
    with pytest.raises(ValueError, match=match):
        validate_call(CFG, a["x"], a["ids"], a["w"])


def test_good_call_passes_and_value_checks_can_be_skipped():
    x, ids, w = _good(CFG)
    validate_call(CFG, x, ids, w)
    validate_call(CFG, x, _with(ids, (0, 0), -5), w, check_values=False)  # capture path: metadata checks only
    validate_call(CFG, x[:0], ids[:0], w[:0])  # T = 0 (an idle rank's call): valid, values included


def test_wrong_device_is_named():
    x, ids, w = _good(CFG)
    with pytest.raises(ValueError, match="x: is on cpu but the layer's weights are on meta"):
        validate_call(CFG, x, ids, w, device=torch.device("meta"))
    with pytest.raises(ValueError, match="topk_ids: is on meta but x is on cpu"):
        validate_call(CFG, x, ids.to("meta"), w, check_values=False)


BAD_WEIGHTS = [
    (lambda w13, w2: (w13[:, :100], w2), "w13: shape"),
    (lambda w13, w2: (w13, w2.transpose(1, 2)), "w2: "),
    (lambda w13, w2: (w13.int(), w2), "w13: dtype"),
    (lambda w13, w2: (w13, _with(w2, (0, 0, 0), float("nan"))), "w2: holds non-finite"),
    (lambda w13, w2: (w13[:1], w2[:1]), "w13: shape .*dim 0 must be 8"),
]


@pytest.mark.parametrize(("mutate", "match"), BAD_WEIGHTS, ids=[m for _, m in BAD_WEIGHTS])
def test_bad_weights(mutate, match):
    cfg = CFG.replace(num_shared_experts=0)
    w13 = torch.randn(8, 512, 512)
    w2 = torch.randn(8, 512, 256)
    with pytest.raises(ValueError, match=match):
        validate_weights(cfg, *mutate(w13, w2))


def test_shared_expert_weights_must_match_config():
    w13, w2 = torch.randn(8, 512, 512), torch.randn(8, 512, 256)
    with pytest.raises(ValueError, match="num_shared_experts = 1 but no shared"):
        validate_weights(CFG, w13, w2)
    with pytest.raises(ValueError, match="shared_w13: shared expert weights given but"):
        validate_weights(CFG.replace(num_shared_experts=0), w13, w2, w13[:1], w2[:1])
    with pytest.raises(ValueError, match="given together"):
        validate_weights(CFG, w13, w2, w13[:1], None)
    validate_weights(CFG, w13, w2, w13[:1].contiguous(), w2[:1].contiguous())
