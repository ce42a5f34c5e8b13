"""gcmoe.integrations.vllm against vLLM's real classes (skipped where vLLM is not installed; `nox -s engines`).

On a CPU (vLLM's CUDA build, no GPU): the real FusedMoEFactory builds the MoERunner / RoutedExperts with
quantization "gcmoe", the expert weights are loaded per expert through vLLM's own weight_loader (gate w1 / up w3 /
down w2 shards, EP's non-local experts skipped by it), process_weights_after_loading packs them, and
RoutedExperts.forward_modular (the runner's call after routing) runs apply. vLLM's router (topk_softmax) and the
runner's forward are CUDA custom ops: on the CPU the routing is torch's softmax top-k renormalised (vLLM's
formula), and the end-to-end runner test is @pytest.mark.gpu. Values are compared with gcmoe_core.reference on
the same routing: exact where the path is the same (the reference backend), calc_diff for the quantisation.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

pytest.importorskip("vllm")

from gcmoe_core.reference import Activation, MoEWeights, moe_reference
from gcmoe_core.testing import calc_diff

H, INTER, E, K = 128, 128, 8, 2


def _vllm_config():
    from vllm.config import DeviceConfig, VllmConfig

    dev = "cuda" if torch.cuda.is_available() else "cpu"  # (device inference fails on a GPU-less CUDA build)
    return VllmConfig(device_config=DeviceConfig(device=dev))


def _runner(monkeypatch=None, ep: tuple[int, int] | None = None, activation="silu", **options):
    """vLLM's MoE pipeline for quantization "gcmoe" (ep = (rank, size): vLLM's EP with its own expert map)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.fused_moe import FusedMoEFactory, FusedMoEParallelConfig
    from vllm.model_executor.layers.fused_moe import layer as moe_layer

    from gcmoe.integrations.vllm import GcmoeConfig

    if ep is not None:  # what make_parallel_config gives rank r of an EP group (no process group needed here)
        par = dataclasses.replace(FusedMoEParallelConfig.make_no_parallel(), ep_rank=ep[0], ep_size=ep[1], use_ep=True)
        monkeypatch.setattr(moe_layer, "make_parallel_config", lambda **kw: par)
    with set_current_vllm_config(_vllm_config()):
        return FusedMoEFactory(
            num_experts=E, top_k=K, hidden_size=H, intermediate_size=INTER, params_dtype=torch.bfloat16,
            tp_size=1, dp_size=1, pcp_size=1, prefix="model.layers.0.mlp.experts", activation=activation,
            quant_config=GcmoeConfig(**options),
        )  # fmt: skip


def _checkpoint(seed: int):
    """Per-expert checkpoint tensors (bf16): gate [E, I, H], up [E, I, H], down [E, H, I]."""
    g = torch.Generator().manual_seed(seed)
    gate, up = (torch.randn(E, INTER, H, generator=g) * H**-0.5 for _ in range(2))
    down = torch.randn(E, H, INTER, generator=g) * INTER**-0.5
    return gate.bfloat16(), up.bfloat16(), down.bfloat16()


def weights_bf16(ckpt):
    """The checkpoint as gcmoe's w13 [E, 2I, H] (gate rows then up rows) and w2 [E, H, I]."""
    gate, up, down = ckpt
    return torch.cat((gate, up), 1), down


def _load(experts, ckpt) -> None:
    """vLLM's loading: one weight_loader call per expert and shard (global expert ids), then post-processing."""
    gate, up, down = ckpt
    for e in range(E):
        for param, shard, w in (("w13_weight", "w1", gate), ("w13_weight", "w3", up), ("w2_weight", "w2", down)):
            p = getattr(experts, param)
            p.weight_loader(p, w[e], f"experts.{e}.{shard}.weight", shard_id=shard, expert_id=e)
    experts.quant_method.process_weights_after_loading(experts)


def _routing(t: int, seed: int):
    """x [T, H] bf16, and vLLM's default routing of random logits: softmax, top-k, renormalised (fp32, int32 ids)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, H, generator=g).bfloat16()
    w, ids = torch.softmax(torch.randn(t, E, generator=g), -1).topk(K, dim=-1)
    return x, (w / w.sum(-1, keepdim=True)).float(), ids.int()


def _forward(runner, x, w, ids):
    return runner.routed_experts.forward_modular(x=x, topk_weights=w, topk_ids=ids)  # the runner's call -> apply


def test_importing_gcmoe_does_not_import_vllm_and_its_absence_is_a_clear_error():
    code = "import sys, gcmoe, gcmoe.engine, gcmoe.integrations; gcmoe.fused_experts; assert 'vllm' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
    code = "import sys\nsys.modules['vllm'] = None  # vLLM absent\n"
    code += "try:\n    import gcmoe.integrations.vllm\nexcept ImportError as e:\n    print(e)"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert "pip install vllm" in out


def test_parameters_are_vllms_and_are_packed_once_then_freed():
    from gcmoe.integrations.vllm import GcmoeFusedMoEMethod

    runner = _runner(quant="bf16")
    experts = runner.routed_experts
    assert isinstance(experts.quant_method, GcmoeFusedMoEMethod)
    shapes = {n: (tuple(p.shape), p.dtype) for n, p in experts.named_parameters()}
    assert shapes == {"w13_weight": ((E, 2 * INTER, H), torch.bfloat16), "w2_weight": ((E, H, INTER), torch.bfloat16)}
    assert experts.w13_weight.weight_loader == experts.weight_loader  # vLLM's loader, set by its create_weights
    _load(experts, _checkpoint(0))
    packed = experts.quant_method.packed
    assert packed.cfg.local_experts == E and packed.cfg.masked_ids and packed.backend == "reference"
    assert experts.w13_weight.numel() == 0 and experts.w2_weight.numel() == 0  # the raw weights are freed


@pytest.mark.parametrize("quant", ["bf16", "fp8_mxfp4"])
def test_apply_equals_the_reference_on_the_same_routing(quant):
    ckpt = _checkpoint(1)
    runner = _runner(quant=quant)
    _load(runner.routed_experts, ckpt)
    x, w, ids = _routing(9, seed=2)
    y = _forward(runner, x, w, ids)
    gate, up, down = ckpt
    weights = MoEWeights.from_float(torch.cat((gate, up), 1).float(), down.float(), quant=quant)  # gate then up
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    assert torch.equal(y, moe_reference(x, ids, w, weights))
    if quant == "fp8_mxfp4":  # against the unquantised experts: the quantisation only
        assert calc_diff(y, moe_reference(x, ids, w, MoEWeights.from_float(*weights_bf16(ckpt), quant="bf16"))) < 0.03


def test_calls_beyond_max_tokens_run_in_chunks():
    ckpt = _checkpoint(3)
    small, big = _runner(quant="bf16", max_tokens_per_rank=4), _runner(quant="bf16")
    _load(small.routed_experts, ckpt)
    _load(big.routed_experts, ckpt)
    x, w, ids = _routing(11, seed=4)
    assert small.routed_experts.quant_method.packed.cfg.max_tokens_per_rank == 4
    assert torch.equal(_forward(small, x, w, ids), _forward(big, x, w, ids))


def test_expert_parallel_through_vllms_expert_map(monkeypatch):
    ckpt = _checkpoint(5)
    x, w, ids = _routing(13, seed=6)
    gate, up, down = ckpt
    full = moe_reference(x, ids, w, MoEWeights.from_float(*weights_bf16(ckpt), quant="bf16"))
    ys = []
    for rank in range(2):
        runner = _runner(monkeypatch, ep=(rank, 2), quant="bf16")
        experts = runner.routed_experts
        emap = experts.expert_map  # vLLM's: global id -> local id, -1 elsewhere
        assert emap is not None and int((emap >= 0).sum()) == E // 2 and experts.local_num_experts == E // 2
        _load(experts, ckpt)  # vLLM's loader keeps only this rank's experts
        y = _forward(runner, x, w, ids)
        mine = [g for g in range(E) if emap[g] >= 0]
        local = {g: int(emap[g]) for g in mine}
        ids_q = torch.tensor([[local.get(int(g), -1) for g in row] for row in ids], dtype=torch.int32)
        w13_q, w2_q = torch.cat((gate, up), 1)[mine], down[mine]
        assert torch.equal(y, moe_reference(x, ids_q, w, MoEWeights.from_float(w13_q, w2_q, quant="bf16")))
        ys.append(y)
    summed = (ys[0].float() + ys[1].float()).bfloat16()  # the runner's all-reduce of the partial sums
    assert calc_diff(summed, full) < 1e-5 and calc_diff(ys[0], full) > 1e-2


def test_gpt_oss_swigluoai_interleaved_rows():
    ckpt = _checkpoint(7)
    runner = _runner(activation="swigluoai", quant="bf16")
    _load(runner.routed_experts, ckpt)  # vLLM's loader puts w1 / w3 as halves: a swigluoai model interleaves them
    x, w, ids = _routing(7, seed=8)
    gate, up, down = ckpt
    from gcmoe_core.layouts import deinterleave_gate_up

    w13 = deinterleave_gate_up(torch.cat((gate, up), 1))  # how gcmoe reads those rows for "swigluoai"
    y = _forward(runner, x, w, ids)
    ref = moe_reference(x, ids, w, MoEWeights.from_float(w13, down, quant="bf16"), act=Activation("swiglu_clamped"))
    assert torch.equal(y, ref)


@pytest.mark.gpu
def test_the_runner_end_to_end_on_cuda():
    """vLLM's router (CUDA topk_softmax) and the runner's routing + apply, on the device's gcmoe backend."""
    from vllm.config import set_current_vllm_config

    runner = _runner(quant="fp8_mxfp4")
    ckpt = _checkpoint(9)
    experts = runner.routed_experts.cuda()
    _load(experts, tuple(t.cuda() for t in ckpt))
    x, _, _ = _routing(16, seed=10)
    logits = torch.randn(16, E, generator=torch.Generator().manual_seed(11)).cuda()
    with set_current_vllm_config(_vllm_config()):
        shared, y = runner._apply_quant_method(x.cuda(), logits, None)
    w, ids = torch.softmax(logits.float(), -1).topk(K, dim=-1)
    weights = MoEWeights.from_float(*(t.cuda() for t in weights_bf16(ckpt)), quant="fp8_mxfp4")
    ref = moe_reference(x.cuda(), ids.int(), w / w.sum(-1, keepdim=True), weights)
    assert shared is None and calc_diff(y, ref) < 1e-3
