"""Optional adapters for the public MoE implementations `gcmoe bench` compares against. Each is a callable
`peer(x, topk_ids, topk_weights) -> y bf16 [T, H]` over the same MoEWeights a gcmoe layer loads, computing the ROUTED
experts only (no shared expert: neither peer has one), and each factory returns None when its peer is absent here:

    peer = triton_kernels_moe(cfg, weights, device)          # None unless `import triton_kernels` works on an SM90
    peer = deepgemm_mega_moe(cfg, weights, device, max_tokens)   # None unless DeepGEMM's SM90 module was built
    why = triton_kernels_missing(device) / deepgemm_missing(device)   # what is absent (None when present)

Both are called through their public APIs only; no code of theirs is copied here.

triton_kernels  OpenAI's triton_kernels (triton-lang/triton python/triton_kernels, v3.6.0 for triton 3.6): the MoE
    path vLLM runs for MXFP4 experts on Hopper. Importable when PYTHONPATH holds a copy of
    shared/peers/triton-kernels-v3.6.0. Per call (all inside the timed call, CUDA-graph capturable):
        routing   top-k padded to a power of two with id -1 (its metadata kernels need it), a bitmatrix of the
                  ids, SparseMatrix -> ragged metadata -> RoutingData / GatherIndx / ScatterIndx (vLLM's recipe)
        W1        matmul_ogs(x bf16, W13 MXFP4, gather) with SwiGLU fused
        W2        matmul_ogs(h, W2 MXFP4, scatter, gammas = routing weights) with the top-k sum fused
    Activations are bf16 (FP8 x MXFP4 is not supported on sm_90 in v3.6.0). Weights: our MXFP4 bytes and scales as
    they are (same E2M1 codes, low nibble first, UE8M0 per 32 along K), W13's gate/up rows interleaved, in the
    Hopper swizzled layouts (HopperMXValueLayout / HopperMXScaleLayout). Its fused SwiGLU is gpt-oss's
    s = g * sigmoid(alpha g), y = s * (u + 1) with clamps at `limit`: alpha = 1, a W1 bias of -1 on the up columns
    and a limit far above any value make it silu(g) * u, the layer's activation; a gpt-oss layer (clamped SwiGLU,
    biases) runs it as it is, with the layer's alpha, limit and biases (the W2 bias added before gammas apply).

deepgemm  DeepGEMM's SM90 FP8 x MXFP4 "Mega MoE" (deepseek-ai/DeepGEMM refs/pull/323/head): one persistent kernel
    doing dispatch -> W1 -> SwiGLU -> FP8 requant -> W2 -> combine through a symmetric buffer, at world size 1.
    Importable after shared/peers/deepgemm-sm90-megamoe/build_and_run.sh has built its module (`build`, then
    `selftest`, whose iostream fix may ask for LD_PRELOAD: source $PEER_DG_WORK/iostream_fix.env before the run).
    The tree is found at $PEER_DG_SRC, else $PEER_DG_WORK/DeepGEMM (PEER_DG_WORK default /tmp/peer_dg), the
    script's own locations. Its Python front end needs packages the GPU image lacks, so the built extension is
    imported as deep_gemm._C under a bare `deep_gemm` package, and the one weight-layout function of its public
    Python API (sgl_deep_gemm.transform_weights_for_mega_moe_sm90_fp4) is loaded from its file by name with `ast`
    (its source unchanged). Per call (inside the timed call): x -> FP8 per token per 128 (its
    deep_gemm.utils.math.per_token_cast_to_fp8), x / scales / ids / weights copied into the symmetric buffer, one
    fp8_fp4_mega_moe_sm90 launch. Weights: our MXFP4 bytes as they are, scales as fp32 powers of two (what its
    transform takes). torch.distributed (NCCL, world size 1, file rendezvous) is initialised for the symmetric
    buffer when nothing else has; plain device memory is the fallback (what DeepGEMM itself uses at world size 1).
"""

from __future__ import annotations
import __future__ as future_features

import ast
import os
import sys
import tempfile
import types
from pathlib import Path

import torch

from gcmoe_core.config import MoEConfig
from gcmoe_core.formats import MXFP4Tensor, ue8m0_decode
from gcmoe_core.reference import MoEWeights

WORK = "routed experts only (no shared expert)"


def _sm90_missing(device: torch.device) -> str | None:
    if device.type != "cuda" or not torch.cuda.is_available():
        return f"a CUDA device (got {device})"
    cap = torch.cuda.get_device_capability(device)
    if cap != (9, 0):
        return f"an SM90 (Hopper) GPU (device {device} is sm_{cap[0]}{cap[1]})"
    return None


def _mxfp4(weights: MoEWeights) -> tuple[MXFP4Tensor, MXFP4Tensor]:
    if not isinstance(weights.w13, MXFP4Tensor):
        raise ValueError("peers: the peers run MXFP4 expert weights (quant='fp8_mxfp4'); these are bf16")
    return weights.w13, weights.w2


# ------------------------------------------------------------------------------------------------- triton_kernels
# gpt-oss's clamp is a runtime argument of the fused SwiGLU; one far above any value leaves silu(g) * u unclamped
# (None would specialise the kernel differently from what vLLM runs).
_TK_SWIGLU_LIMIT = 1.0e30


def _import_triton_kernels() -> types.SimpleNamespace:
    """The names of triton_kernels' public API (v3.6.0) the adapter uses."""
    import importlib

    mo = importlib.import_module("triton_kernels.matmul_ogs")
    tensor = importlib.import_module("triton_kernels.tensor")
    return types.SimpleNamespace(
        matmul_ogs=mo.matmul_ogs,
        FlexCtx=mo.FlexCtx,
        FnSpecs=mo.FnSpecs,
        FusedActivation=mo.FusedActivation,
        GatherIndx=mo.GatherIndx,
        PrecisionConfig=mo.PrecisionConfig,
        RoutingData=mo.RoutingData,
        ScatterIndx=mo.ScatterIndx,
        InFlexData=importlib.import_module("triton_kernels.numerics").InFlexData,
        swiglu_fn=importlib.import_module("triton_kernels.swiglu").swiglu_fn,
        BIT=tensor.BIT,
        FP4=tensor.FP4,
        Bitmatrix=tensor.Bitmatrix,
        SparseMatrix=tensor.SparseMatrix,
        convert_layout=tensor.convert_layout,
        make_ragged_tensor_metadata=tensor.make_ragged_tensor_metadata,
        wrap_torch_tensor=tensor.wrap_torch_tensor,
        layout=importlib.import_module("triton_kernels.tensor_details.layout"),
    )


def triton_kernels_missing(device=None) -> str | None:
    """None when the triton_kernels peer can run on `device` (default: the current CUDA device), else what is
    missing."""
    device = torch.device(device if device is not None else "cuda")
    why = _sm90_missing(device)
    if why:
        return why
    try:
        _import_triton_kernels()
    except Exception as e:
        return (
            f"the triton_kernels package ({type(e).__name__}: {e}; put a copy of "
            "shared/peers/triton-kernels-v3.6.0 on PYTHONPATH)"
        )
    return None


class TritonKernelsMoE:
    """Routed experts of one layer with triton_kernels' matmul_ogs (see the module docstring)."""

    name = "triton_kernels"
    work = WORK

    def __init__(self, cfg: MoEConfig, weights: MoEWeights, device, num_warps: int = 8):
        tk = self.tk = _import_triton_kernels()
        self.device = torch.device(device)
        w13, w2 = _mxfp4(weights)
        e, i = w13.shape[0], cfg.intermediate_size
        self.num_experts, self.top_k = e, cfg.top_k
        self.slots = 1 << (cfg.top_k - 1).bit_length()  # its bitmatrix metadata wants a power of two
        self.num_warps = num_warps

        def interleave(t: torch.Tensor) -> torch.Tensor:  # rows [gate 0..I, up 0..I] -> [g0, u0, g1, u1, ...]
            return t.view(e, 2, i, t.shape[-1]).transpose(1, 2).reshape(e, 2 * i, t.shape[-1]).contiguous()

        def mx(packed: torch.Tensor, scale: torch.Tensor):
            # [E, N, K/2] / [E, N, K/32] -> matmul_ogs's [E, K, N] operands (K contiguous), swizzled for Hopper
            vl, vo = tk.layout.make_default_matmul_mxfp4_w_layout(mx_axis=1)
            sl, so = tk.layout.make_default_matmul_mxfp4_w_scale_layout(mx_axis=1, num_warps=num_warps)
            packed, scale = packed.to(self.device).transpose(1, 2), scale.to(self.device).transpose(1, 2)
            wv = tk.convert_layout(tk.wrap_torch_tensor(packed, dtype=tk.FP4), vl, **vo)
            ws = tk.convert_layout(tk.wrap_torch_tensor(scale), sl, **so)
            return wv, ws

        self.w1, w1s = mx(interleave(w13.packed.to(self.device)), interleave(w13.scale.to(self.device)))
        self.w2, w2s = mx(w2.packed, w2.scale)
        clamped = cfg.activation == "swiglu_clamped"  # gpt-oss: its own SwiGLU, as it is
        b13 = weights.w13_bias
        self.bias1 = torch.zeros(e, 2 * i, dtype=torch.float32, device=self.device)
        if b13 is not None:
            self.bias1 += interleave(b13.to(self.device, torch.float32).unsqueeze(-1)).squeeze(-1)
        if not clamped:
            self.bias1[:, 1::2] -= 1.0  # (u - 1) + 1 = u in its SwiGLU
        self.bias2 = None if weights.w2_bias is None else weights.w2_bias.to(self.device, torch.float32).contiguous()
        flex = tk.FlexCtx(rhs_data=tk.InFlexData())
        self.pc1 = tk.PrecisionConfig(flex_ctx=flex, weight_scale=w1s, out_dtype=torch.bfloat16)
        self.pc2 = tk.PrecisionConfig(flex_ctx=flex, weight_scale=w2s, out_dtype=torch.bfloat16)
        spec = tk.FnSpecs("swiglu", tk.swiglu_fn, ("alpha", "limit"), reduction_n=2)
        alpha_limit = (cfg.swiglu_alpha, cfg.swiglu_limit) if clamped else (1.0, _TK_SWIGLU_LIMIT)
        self.act = tk.FusedActivation(spec, alpha_limit)

    def describe(self) -> dict:
        return {
            "peer": self.name,
            "work": self.work,
            "activations": "bf16",
            "weights": "MXFP4, Hopper swizzled layouts",
            "num_warps": self.num_warps,
            "topk_slots": self.slots,
            "routing": "in the timed call (bitmatrix + metadata)",
        }

    def _routing(self, topk_ids: torch.Tensor, topk_weights: torch.Tensor):
        tk, t, e = self.tk, topk_ids.shape[0], self.num_experts
        ids = torch.full((t, self.slots), -1, dtype=torch.int16, device=topk_ids.device)
        ids[:, : self.top_k] = topk_ids
        vals = torch.full((t, self.slots), -1.0, dtype=torch.bfloat16, device=topk_ids.device)  # -1: unused slot
        vals[:, : self.top_k] = topk_weights
        # bitmatrix [T, E] in 32-bit words: a token's experts are distinct, so a sum of bits is their OR
        n_words = (e + 31) // 32
        i64 = topk_ids.long()
        words = torch.zeros(t, n_words, dtype=torch.int64, device=topk_ids.device)
        words.scatter_add_(1, i64 // 32, torch.ones_like(i64) << (i64 % 32))
        words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).view(torch.uint32)
        mask = tk.Bitmatrix(words, dtype=tk.BIT, shape=[t, e], shape_max=[t, None])
        sm = tk.SparseMatrix(indx=ids, vals=vals, mask=mask)
        dispatch, combine = sm.mask_metadata.row_sorted_indx, sm.mask_metadata.col_sorted_indx
        ragged = tk.make_ragged_tensor_metadata(sm.mask_metadata.col_sum, dispatch.shape[0])
        rd = tk.RoutingData(sm.vals.flatten()[combine], ragged.slice_sizes, e, self.slots, ragged)
        return rd, tk.GatherIndx(combine, dispatch), tk.ScatterIndx(dispatch, combine)

    def __call__(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        tk = self.tk
        rd, gi, si = self._routing(topk_ids, topk_weights)
        h = tk.matmul_ogs(
            x, self.w1, self.bias1, rd, gather_indx=gi, precision_config=self.pc1, fused_activation=self.act
        )
        return tk.matmul_ogs(
            h, self.w2, self.bias2, rd, scatter_indx=si, precision_config=self.pc2, gammas=rd.gate_scal
        )

    def close(self) -> None:
        self.w1 = self.w2 = self.bias1 = self.bias2 = None


def triton_kernels_moe(cfg: MoEConfig, weights: MoEWeights, device, **kw) -> TritonKernelsMoE | None:
    if triton_kernels_missing(device) is not None:
        return None
    return TritonKernelsMoE(cfg, weights, device, **kw)


# ------------------------------------------------------------------------------------------------------- DeepGEMM
_DG: types.SimpleNamespace | None = None  # the imported extension: one per process (it is a native module)
_DIST_OURS = False  # whether this module initialised torch.distributed (then shutdown() tears it down)


def deepgemm_src() -> Path:
    """Where build_and_run.sh unpacked and built the tree: $PEER_DG_SRC, else $PEER_DG_WORK/DeepGEMM."""
    if os.environ.get("PEER_DG_SRC"):
        return Path(os.environ["PEER_DG_SRC"])
    return Path(os.environ.get("PEER_DG_WORK") or "/tmp/peer_dg") / "DeepGEMM"


def _built_module(src: Path) -> Path | None:
    hits = sorted((src / "deep_gemm").glob("_C*.so")) if (src / "deep_gemm").is_dir() else []
    return hits[0] if hits else None


def deepgemm_missing(device=None) -> str | None:
    """None when the DeepGEMM SM90 Mega MoE peer can run on `device`, else what is missing (host checks only)."""
    device = torch.device(device if device is not None else "cuda")
    why = _sm90_missing(device)
    if why:
        return why
    src = deepgemm_src()
    if _built_module(src) is None:
        return (
            f"DeepGEMM's built SM90 module under {src}/deep_gemm (run "
            "shared/peers/deepgemm-sm90-megamoe/build_and_run.sh build, then selftest)"
        )
    return None


def _load_function(path: Path, name: str, namespace: dict):
    """The top-level function `name` of the Python file `path`, defined from its unchanged source in `namespace`
    (for a library file whose module-level imports cannot run here)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    node = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name), None)
    if node is None:
        raise ImportError(f"{path}: no top-level function {name!r}")
    code = compile(
        ast.Module(body=[node], type_ignores=[]),
        str(path),
        "exec",
        flags=future_features.annotations.compiler_flag,  # its annotations stay unevaluated, as in its module
        dont_inherit=True,
    )
    exec(code, namespace)
    return namespace[name]


def _import_deepgemm() -> types.SimpleNamespace:
    global _DG
    if _DG is not None:
        return _DG
    src = deepgemm_src()
    work = Path(os.environ.get("PEER_DG_WORK") or "/tmp/peer_dg")
    os.environ.setdefault("CUDA_HOME", "/usr/local/cuda")
    os.environ.setdefault("DG_JIT_CACHE_DIR", str(work / "jit-cache"))
    if "deep_gemm" not in sys.modules:  # a bare package: its __init__ wants the tvm-ffi front end
        pkg = types.ModuleType("deep_gemm")
        pkg.__path__ = [str(src / "deep_gemm")]
        sys.modules["deep_gemm"] = pkg
    from deep_gemm import _C
    from deep_gemm.utils.math import align, per_token_cast_to_fp8

    _C.init(str(src / "deep_gemm"), os.environ["CUDA_HOME"])
    transform = _load_function(
        src / "sgl_deep_gemm" / "__init__.py", "transform_weights_for_mega_moe_sm90_fp4", {"torch": torch}
    )
    _DG = types.SimpleNamespace(C=_C, align=align, cast_fp8=per_token_cast_to_fp8, transform=transform, src=src)
    return _DG


def _symmetric_buffer(nbytes: int, device: torch.device) -> tuple[torch.Tensor, list[int], str]:
    """(buffer, its pointers per rank, kind): torch symmetric memory over a world-size-1 group, else plain memory."""
    global _DIST_OURS
    import torch.distributed as dist

    # never NVLS / multicast on the lent machines
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
    os.environ["NVSHMEM_DISABLE_NVLS"] = "1"
    try:
        if not dist.is_initialized():
            rendezvous = tempfile.mktemp(prefix="gcmoe_peer_dg_")
            dist.init_process_group("nccl", init_method=f"file://{rendezvous}", rank=0, world_size=1, device_id=device)
            _DIST_OURS = True
        if dist.get_world_size() != 1:
            raise RuntimeError("the peer runs at world size 1")
        import torch.distributed._symmetric_memory as symm_mem

        buf = symm_mem.empty(nbytes, dtype=torch.int8, device=device)
        handle = symm_mem.rendezvous(buf, group=dist.group.WORLD)
        return buf, [int(p) for p in handle.buffer_ptrs], "symm_mem"
    except Exception as e:
        buf = torch.empty(nbytes, dtype=torch.int8, device=device)
        return buf, [buf.data_ptr()], f"torch.empty (symmetric memory failed: {type(e).__name__}: {str(e)[:120]})"


class DeepGemmMegaMoE:
    """Routed experts of one layer with DeepGEMM's SM90 FP8 x MXFP4 Mega MoE at world size 1 (module docstring)."""

    name = "deepgemm"
    work = WORK

    def __init__(self, cfg: MoEConfig, weights: MoEWeights, device, max_tokens: int):
        if cfg.activation != "swiglu" or cfg.has_bias:
            raise ValueError("DeepGEMM's Mega MoE computes plain SwiGLU without biases: not this layer's experts")
        dg = self.dg = _import_deepgemm()
        self.device = torch.device(device)
        w13, w2 = _mxfp4(weights)
        self.num_experts, self.top_k, self.hidden = w13.shape[0], cfg.top_k, cfg.hidden_size

        def pair(w: MXFP4Tensor):
            return w.packed.to(self.device).contiguous(), ue8m0_decode(w.scale.to(self.device)).contiguous()

        self.l1, self.l2 = dg.transform(pair(w13), pair(w2))
        self.nmax = dg.align(max_tokens, dg.C.get_token_alignment_for_mega_moe())
        nbytes, slicer = dg.C.get_symm_buffer_size_for_sm90_mega_moe(
            1, self.num_experts, self.nmax, self.top_k, self.hidden, cfg.intermediate_size, True, "swiglu"
        )
        self.buf, self.ptrs, self.buffer_kind = _symmetric_buffer(nbytes, self.device)
        self.buf.zero_()
        self.x, self.x_sf, self.ids, self.w = slicer(self.buf)[:4]
        self.recv_stats = torch.zeros(self.num_experts, dtype=torch.int32, device=self.device)

    def describe(self) -> dict:
        return {
            "peer": self.name,
            "work": self.work,
            "kernel": "fp8_fp4_mega_moe_sm90 (one persistent launch)",
            "activations": "FP8 E4M3 per token per 128 (fp32 scales)",
            "weights": "MXFP4 (UE8M0 per 32)",
            "buffer": self.buffer_kind,
            "num_max_tokens_per_rank": self.nmax,
            "source": str(self.dg.src),
            "in_timed_call": "x FP8 cast + copies into the symmetric buffer + the launch",
        }

    def __call__(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        if t > self.nmax:
            raise ValueError(f"deepgemm peer: T = {t} exceeds its buffer's {self.nmax} tokens")
        xq, sx = self.dg.cast_fp8(x, use_ue8m0=False, gran_k=128, use_packed_ue8m0=False)
        self.x[:t].copy_(xq)
        self.x_sf[:t].copy_(sx)
        self.ids[:t].copy_(topk_ids)
        self.w[:t].copy_(topk_weights)
        y = torch.empty(t, self.hidden, dtype=torch.bfloat16, device=x.device)
        self.dg.C.fp8_fp4_mega_moe_sm90(
            y, self.l1, self.l2, self.recv_stats, self.buf, self.ptrs, 0, self.nmax,
            self.num_experts, self.top_k, (1, 1, 32), "swiglu", None, True,
        )  # fmt: skip
        return y

    def close(self) -> None:
        self.l1 = self.l2 = self.buf = self.x = self.x_sf = self.ids = self.w = None


def deepgemm_mega_moe(cfg: MoEConfig, weights: MoEWeights, device, max_tokens: int) -> DeepGemmMegaMoE | None:
    if deepgemm_missing(device) is not None:
        return None
    return DeepGemmMegaMoE(cfg, weights, device, max_tokens)


def shutdown() -> None:
    """Tear down what the peers set up process-wide (the world-size-1 process group, if this module made it)."""
    global _DIST_OURS
    if _DIST_OURS:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        _DIST_OURS = False
