"""Adapters for the public MoE implementations `gcmoe-lab bench` compares against, each run at its best. Each is a
callable `peer(x, topk_ids, topk_weights) -> y bf16 [T, H]` over the same MoEWeights a gcmoe layer loads, computing
the ROUTED experts only (no shared expert: neither peer has one), and each factory returns None when its peer is
absent here:

    peer = triton_kernels_moe(cfg, weights, device)          # None unless `import triton_kernels` works on an SM90
    peer = deepgemm_mega_moe(cfg, weights, device)           # None unless DeepGEMM's SM90 module was built
    why = triton_kernels_missing(device) / deepgemm_missing(device)   # what is absent (None when present)
    forms = peer.forms()                                     # the ways the bench times it (Form, below)

Both are called through their public APIs only; no code of theirs is copied here.

Forms. A peer is timed in several forms, side by side with everything else in the bench's interleaved run; a form
binds one point's inputs (untimed work: the peer's set-up for those inputs) and returns the timed call. Its column:
    call      everything from (x bf16, top-k ids, weights) to y inside the timed call: what a caller holding the
              layer's inputs pays, the work the gcmoe layer's own timed call does
    prepared  the peer's own harness's timed region: the per-call preparation its harness does before timing
              (triton_kernels: the routing metadata; DeepGEMM: the FP8 cast of x and the copies into its buffer)
              done in `bind`, outside the timed call
The bench reports, per point and column, the best form (best_forms), and keeps every form's time in the JSON.

triton_kernels  OpenAI's triton_kernels (triton-lang/triton python/triton_kernels, v3.6.0 for triton 3.6): the MoE path
    vLLM runs for MXFP4 experts on Hopper. Importable when PYTHONPATH holds a copy of
    shared/peers/triton-kernels-v3.6.0. Per call (CUDA-graph capturable):
        routing   top-k padded to a power of two with id -1 (its metadata kernels need it), a bitmatrix of the ids
                  (one Triton launch of ours where triton compiles it and it agrees with the torch build, else a few
                  torch ops: bitmatrix_words), SparseMatrix -> ragged metadata -> RoutingData / GatherIndx /
                  ScatterIndx (vLLM's make_routing_data for triton_kernels >= 3.6)
        W1        matmul_ogs(x bf16, W13 MXFP4, gather) with SwiGLU fused
        W2        matmul_ogs(h, W2 MXFP4, scatter, gammas = routing weights) with the top-k sum fused
    Forms: both Hopper layouts vLLM uses, num_warps 8 (its default on H100 / H200) and 4 (its batched-MoE path; the
    scale swizzle is made for a warp count and the kernel runs with it), each with the routing inside the call and
    prepared (the ids' routing metadata built in bind, outside the timed call; the standalone probe
    shared/peers/bench_triton_kernels.py times both). The two layouts share the weight values (the value swizzle
    does not depend on the warp count); each has its own scale tensors.
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
    (its source unchanged). Run as its own benchmark harness runs it (sgl_deep_gemm/tests/
    test_mega_moe_fp4_hopper.py --bench): the symmetric buffer sized for the call's tokens (its
    num_max_tokens_per_rank = num_tokens, aligned as the kernel asks), so one buffer per point; recipe (1, 1, 32),
    SwiGLU, fast math, a per-expert receive-count tensor; x cast to FP8 per token per 128 with fp32 scales (its
    deep_gemm.utils.math.per_token_cast_to_fp8). Its harness casts x once before timing and times the copies of
    x, scales, ids and weights into the buffer plus the launch (its CUDA-event mode) or the launch alone (its
    default, the profiler's kernel time). Forms: `call` = cast + copies + launch; `prepared` = the launch alone, the
    cast and the copies done in bind. No activation clamp: the layer's SwiGLU is unclamped (its harness's 10.0 for
    DeepSeek-V4 only changes a template constant, not the work). Weights: our MXFP4 bytes as they are, scales as fp32
    powers of two (what its transform takes). torch.distributed (NCCL, world size 1, file rendezvous) is
    initialised for the symmetric buffer when nothing else has; plain device memory is the fallback (what DeepGEMM
    itself uses at world size 1).

Validated forms and the rest (PEER_FORMS, `gcmoe-lab bench --peer-forms`): by default only the forms that ran
clean on the H200 are timed: triton_kernels at num_warps 8 with its routing inside the call, built by torch ops, and
DeepGEMM's `call` form. The other forms (num_warps 4, routing prepared, the Triton bitmatrix, DeepGEMM's `prepared`)
are built and tested on the CPU, but their first GPU run (2026-12-03) hit an illegal memory access in the
triton_kernels peer and in the DeepGEMM one, not yet traced to a form; `--peer-forms all` times them.

History: up to the lab's first version the bench timed triton_kernels with num_warps 8 only and its routing inside
the call (built by ~9 torch launches), and DeepGEMM with x's cast and the copies inside the call and one buffer of
max(256, T) tokens; standalone probes of the same peers then ran 1.1-1.3x faster (issue #47).
"""

from __future__ import annotations
import __future__ as future_features

import ast
import os
import sys
import tempfile
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from gcmoe_core.config import MoEConfig
from gcmoe_core.formats import MXFP4Tensor, ue8m0_decode
from gcmoe_core.reference import MoEWeights

WORK = "routed experts only (no shared expert)"
COLUMNS = ("call", "prepared")  # Form.column: what the timed call holds (module docstring)


@dataclass(frozen=True)
class Form:
    """One way of timing a peer: bind(x, ids, w) does the untimed per-point set-up and returns the timed call
    (-> y bf16 [T, H]); column: "call" or "prepared" (module docstring); info: what distinguishes it (recorded)."""

    bind: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Callable[[], torch.Tensor]]
    column: str
    info: dict = field(default_factory=dict)


def best_forms(times_us: dict[str, float], forms: dict[str, Form]) -> dict:
    """Per column, the form with the lowest time among those that ran (times_us: form -> median µs):
    {column: (form name, µs)}; a column no form of which ran is absent."""
    best: dict[str, tuple[str, float]] = {}
    for name, us in times_us.items():
        col = forms[name].column
        if col not in best or us < best[col][1]:
            best[col] = (name, us)
    return best


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
TK_NUM_WARPS = (8, 4)  # the Hopper scale layouts vLLM builds (module docstring)


PEER_FORMS = "validated"  # or "all": `gcmoe-lab bench --peer-forms all` (module docstring)


def all_forms() -> bool:
    """Whether the forms not yet validated on a GPU are asked for (PEER_FORMS, module docstring)."""
    return PEER_FORMS == "all"


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


def pad_routing(topk_ids: torch.Tensor, topk_weights: torch.Tensor, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids int16 [T, slots] and weights bf16 [T, slots]: the top-k, then unused slots (id -1, weight -1: what
    triton_kernels' metadata skips)."""
    t, k = topk_ids.shape
    ids = torch.full((t, slots), -1, dtype=torch.int16, device=topk_ids.device)
    ids[:, :k] = topk_ids
    vals = torch.full((t, slots), -1.0, dtype=torch.bfloat16, device=topk_ids.device)
    vals[:, :k] = topk_weights
    return ids, vals


def bitmatrix_words(ids: torch.Tensor, experts: int) -> torch.Tensor:
    """The routing bitmatrix [T, ceil(E / 32)] uint32 of padded ids [T, slots] (bit e % 32 of word e // 32 set for
    every id e >= 0), in torch: a token's ids are distinct, so the sum of their bits is their OR."""
    t = ids.shape[0]
    i64 = ids.long()
    valid = i64 >= 0
    e = i64.clamp(min=0)
    bits = torch.where(valid, torch.ones_like(e) << (e % 32), torch.zeros_like(e))
    words = torch.zeros(t, (experts + 31) // 32, dtype=torch.int64, device=ids.device)
    words.scatter_add_(1, e // 32, bits)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).view(torch.uint32)


def _triton_packer():
    """The one-launch bitmatrix packer (gcmoe_lab.bitmatrix_triton.pack), or None where triton is absent."""
    try:
        from .bitmatrix_triton import pack
    except ImportError:
        return None
    return pack


class TritonKernelsMoE:
    """Routed experts of one layer with triton_kernels' matmul_ogs (see the module docstring)."""

    name = "triton_kernels"
    work = WORK

    def __init__(self, cfg: MoEConfig, weights: MoEWeights, device, num_warps=None):
        tk = self.tk = _import_triton_kernels()
        self.all_forms = all_forms()
        num_warps = num_warps or (TK_NUM_WARPS if self.all_forms else TK_NUM_WARPS[:1])
        self.device = torch.device(device)
        w13, w2 = _mxfp4(weights)
        e, i = w13.shape[0], cfg.intermediate_size
        self.num_experts, self.top_k = e, cfg.top_k
        self.slots = 1 << (cfg.top_k - 1).bit_length()  # its bitmatrix metadata wants a power of two
        self.num_warps = tuple(num_warps)

        def interleave(t: torch.Tensor) -> torch.Tensor:  # rows [gate 0..I, up 0..I] -> [g0, u0, g1, u1, ...]
            return t.view(e, 2, i, t.shape[-1]).transpose(1, 2).reshape(e, 2 * i, t.shape[-1]).contiguous()

        def kn(t: torch.Tensor) -> torch.Tensor:  # [E, N, K'] -> matmul_ogs's [E, K', N] operand (K contiguous)
            return t.to(self.device).transpose(1, 2)

        # [E, N, K/2] / [E, N, K/32] -> swizzled for Hopper: the values once, the scales per warp count
        packed13, scale13 = kn(interleave(w13.packed.to(self.device))), kn(interleave(w13.scale.to(self.device)))
        packed2, scale2 = kn(w2.packed), kn(w2.scale)
        vl, vo = tk.layout.make_default_matmul_mxfp4_w_layout(mx_axis=1)
        self.w1 = tk.convert_layout(tk.wrap_torch_tensor(packed13, dtype=tk.FP4), vl, **vo)
        self.w2 = tk.convert_layout(tk.wrap_torch_tensor(packed2, dtype=tk.FP4), vl, **vo)

        clamped = cfg.activation == "swiglu_clamped"  # gpt-oss: its own SwiGLU, as it is
        b13 = weights.w13_bias
        self.bias1 = torch.zeros(e, 2 * i, dtype=torch.float32, device=self.device)
        if b13 is not None:
            self.bias1 += interleave(b13.to(self.device, torch.float32).unsqueeze(-1)).squeeze(-1)
        if not clamped:
            self.bias1[:, 1::2] -= 1.0  # (u - 1) + 1 = u in its SwiGLU
        self.bias2 = None if weights.w2_bias is None else weights.w2_bias.to(self.device, torch.float32).contiguous()
        flex = tk.FlexCtx(rhs_data=tk.InFlexData())
        self.precision = {}
        for nw in self.num_warps:
            sl, so = tk.layout.make_default_matmul_mxfp4_w_scale_layout(mx_axis=1, num_warps=nw)
            s1 = tk.convert_layout(tk.wrap_torch_tensor(scale13), sl, **so)
            s2 = tk.convert_layout(tk.wrap_torch_tensor(scale2), sl, **so)
            self.precision[nw] = (
                tk.PrecisionConfig(flex_ctx=flex, weight_scale=s1, out_dtype=torch.bfloat16),
                tk.PrecisionConfig(flex_ctx=flex, weight_scale=s2, out_dtype=torch.bfloat16),
            )
        spec = tk.FnSpecs("swiglu", tk.swiglu_fn, ("alpha", "limit"), reduction_n=2)
        alpha_limit = (cfg.swiglu_alpha, cfg.swiglu_limit) if clamped else (1.0, _TK_SWIGLU_LIMIT)
        self.act = tk.FusedActivation(spec, alpha_limit)
        self._pack = _triton_packer() if self.device.type == "cuda" else None
        self.bitmatrix = self._choose_bitmatrix() if self.all_forms else "torch"

    def _choose_bitmatrix(self) -> str:
        """ "triton" when our one-launch packer compiles here and builds the same words as bitmatrix_words on a probe
        covering several words, unused slots and the high bit; else "torch"."""
        if self._pack is None:
            return "torch"
        probe = torch.tensor([[0, 5, 31, -1], [33, 2, 63, 32], [-1, -1, 7, 40]], dtype=torch.int16, device=self.device)
        try:
            same = torch.equal(self._pack(probe, 64).view(torch.int32), bitmatrix_words(probe, 64).view(torch.int32))
        except Exception:
            return "torch"
        return "triton" if same else "torch"

    def describe(self) -> dict:
        return {
            "peer": self.name,
            "work": self.work,
            "activations": "bf16",
            "weights": "MXFP4, Hopper swizzled layouts",
            "num_warps": list(self.num_warps),
            "topk_slots": self.slots,
            "bitmatrix": "one Triton launch" if self.bitmatrix == "triton" else "torch ops",
            "forms": "per num_warps: routing metadata inside the call (call) / built before it (prepared)",
        }

    def routing(self, topk_ids: torch.Tensor, topk_weights: torch.Tensor):
        """(RoutingData, GatherIndx, ScatterIndx) of one call's routing (vLLM's recipe, module docstring)."""
        tk, t, e = self.tk, topk_ids.shape[0], self.num_experts
        ids, vals = pad_routing(topk_ids, topk_weights, self.slots)
        words = self._pack(ids, e) if self.bitmatrix == "triton" else bitmatrix_words(ids, e)
        mask = tk.Bitmatrix(words, dtype=tk.BIT, shape=[t, e], shape_max=[t, None])
        sm = tk.SparseMatrix(indx=ids, vals=vals, mask=mask)
        dispatch, combine = sm.mask_metadata.row_sorted_indx, sm.mask_metadata.col_sorted_indx
        ragged = tk.make_ragged_tensor_metadata(sm.mask_metadata.col_sum, dispatch.shape[0])
        rd = tk.RoutingData(sm.vals.flatten()[combine], ragged.slice_sizes, e, self.slots, ragged)
        return rd, tk.GatherIndx(combine, dispatch), tk.ScatterIndx(dispatch, combine)

    def gemms(self, x: torch.Tensor, routing, num_warps: int) -> torch.Tensor:
        """W1 (+ gather, SwiGLU) -> W2 (+ scatter, gammas, top-k sum) on a routing built by `routing`."""
        tk, (rd, gi, si) = self.tk, routing
        pc1, pc2 = self.precision[num_warps]
        h = tk.matmul_ogs(x, self.w1, self.bias1, rd, gather_indx=gi, precision_config=pc1, fused_activation=self.act)
        return tk.matmul_ogs(h, self.w2, self.bias2, rd, scatter_indx=si, precision_config=pc2, gammas=rd.gate_scal)

    def __call__(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        return self.gemms(x, self.routing(topk_ids, topk_weights), self.num_warps[0])

    def forms(self) -> dict[str, Form]:
        """Per num_warps: the routing inside the timed call, and prepared before it (module docstring)."""
        out = {}
        for nw in self.num_warps:

            def inside(x, ids, w, nw=nw):
                return lambda: self.gemms(x, self.routing(ids, w), nw)

            def prepared(x, ids, w, nw=nw):
                routing = self.routing(ids, w)  # untimed: the metadata lives as long as the timed call
                return lambda: self.gemms(x, routing, nw)

            out[f"nw{nw}"] = Form(inside, "call", {"num_warps": nw, "routing": "inside the call"})
            if self.all_forms:
                out[f"nw{nw}_prepared"] = Form(prepared, "prepared", {"num_warps": nw, "routing": "built before"})
        return out

    def close(self) -> None:
        self.w1 = self.w2 = self.bias1 = self.bias2 = self.precision = None


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


@dataclass
class MegaMoeBuffer:
    """One point's symmetric buffer (sized for `tokens` rows) and the views the kernel reads its inputs from."""

    tokens: int  # num_max_tokens_per_rank: the point's T aligned as the kernel asks
    buf: torch.Tensor
    ptrs: list[int]
    kind: str
    x: torch.Tensor
    x_sf: torch.Tensor
    ids: torch.Tensor
    w: torch.Tensor


MIN_BUFFER_TOKENS = 256


class DeepGemmMegaMoE:
    """Routed experts of one layer with DeepGEMM's SM90 FP8 x MXFP4 Mega MoE at world size 1 (module docstring)."""

    name = "deepgemm"
    work = WORK

    def __init__(self, cfg: MoEConfig, weights: MoEWeights, device):
        if cfg.activation != "swiglu" or cfg.has_bias:
            raise ValueError("DeepGEMM's Mega MoE computes plain SwiGLU without biases: not this layer's experts")
        dg = self.dg = _import_deepgemm()
        self.device = torch.device(device)
        w13, w2 = _mxfp4(weights)
        self.num_experts, self.top_k = w13.shape[0], cfg.top_k
        self.hidden, self.inter = cfg.hidden_size, cfg.intermediate_size

        def pair(w: MXFP4Tensor):
            return w.packed.to(self.device).contiguous(), ue8m0_decode(w.scale.to(self.device)).contiguous()

        self.l1, self.l2 = dg.transform(pair(w13), pair(w2))
        self.recv_stats = torch.zeros(self.num_experts, dtype=torch.int32, device=self.device)
        self.buffer_kind = self.buffer(1).kind  # (sets up the process group at load, as a caller would)

    def buffer_tokens(self, tokens: int) -> int:
        """The buffer rows for a call of `tokens` tokens: at least MIN_BUFFER_TOKENS, aligned as the kernel asks (a
        buffer of the call's own T, as its harness sizes it, faulted on the H200 at T = 1 in our runs)."""
        return self.dg.align(max(MIN_BUFFER_TOKENS, tokens), self.dg.C.get_token_alignment_for_mega_moe())

    def buffer(self, tokens: int) -> MegaMoeBuffer:
        n = self.buffer_tokens(tokens)
        nbytes, slicer = self.dg.C.get_symm_buffer_size_for_sm90_mega_moe(
            1, self.num_experts, n, self.top_k, self.hidden, self.inter, True, "swiglu"
        )
        buf, ptrs, kind = _symmetric_buffer(nbytes, self.device)
        buf.zero_()
        return MegaMoeBuffer(n, buf, ptrs, kind, *slicer(buf)[:4])

    def stage(self, b: MegaMoeBuffer, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        """x cast to FP8 per token per 128, then x, its scales, the ids and the weights copied into the buffer."""
        t = x.shape[0]
        if t > b.tokens:
            raise ValueError(f"deepgemm peer: T = {t} exceeds its buffer's {b.tokens} tokens")
        xq, sx = self.dg.cast_fp8(x, use_ue8m0=False, gran_k=128, use_packed_ue8m0=False)
        b.x[:t].copy_(xq)
        b.x_sf[:t].copy_(sx)
        b.ids[:t].copy_(topk_ids)
        b.w[:t].copy_(topk_weights)

    def launch(self, b: MegaMoeBuffer, tokens: int) -> torch.Tensor:
        """The one fp8_fp4_mega_moe_sm90 launch over the staged inputs of `tokens` tokens."""
        y = torch.empty(tokens, self.hidden, dtype=torch.bfloat16, device=self.device)
        self.dg.C.fp8_fp4_mega_moe_sm90(
            y, self.l1, self.l2, self.recv_stats, b.buf, b.ptrs, 0, b.tokens,
            self.num_experts, self.top_k, (1, 1, 32), "swiglu", None, True,
        )  # fmt: skip
        return y

    def __call__(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        b = self.buffer(x.shape[0])
        self.stage(b, x, topk_ids, topk_weights)
        return self.launch(b, x.shape[0])

    def forms(self) -> dict[str, Form]:
        """`call`: cast + copies + launch timed; `prepared`: the launch alone (module docstring). Each binds its own
        buffer for the point's T."""

        def call(x, ids, w):
            b = self.buffer(x.shape[0])

            def run():
                self.stage(b, x, ids, w)
                return self.launch(b, x.shape[0])

            return run

        def prepared(x, ids, w):
            b = self.buffer(x.shape[0])
            self.stage(b, x, ids, w)  # untimed, once: every replay reads the same staged inputs
            return lambda: self.launch(b, x.shape[0])

        out = {"call": Form(call, "call", {"timed": "FP8 cast of x + copies into the buffer + the launch"})}
        if all_forms():
            out["prepared"] = Form(prepared, "prepared", {"timed": "the launch (inputs staged before)"})
        return out

    def describe(self) -> dict:
        return {
            "peer": self.name,
            "work": self.work,
            "kernel": "fp8_fp4_mega_moe_sm90 (one persistent launch), recipe (1, 1, 32), fast math, no clamp",
            "activations": "FP8 E4M3 per token per 128 (fp32 scales)",
            "weights": "MXFP4 (UE8M0 per 32)",
            "buffer": f"{self.buffer_kind}, per point: num_max_tokens_per_rank = T aligned (its harness)",
            "source": str(self.dg.src),
            "forms": "call: cast + copies + launch; prepared: the launch alone",
        }

    def close(self) -> None:
        self.l1 = self.l2 = self.recv_stats = None


def deepgemm_mega_moe(cfg: MoEConfig, weights: MoEWeights, device) -> DeepGemmMegaMoE | None:
    if deepgemm_missing(device) is not None:
        return None
    return DeepGemmMegaMoE(cfg, weights, device)


def shutdown() -> None:
    """Tear down what the peers set up process-wide (the world-size-1 process group, if this module made it)."""
    global _DIST_OURS
    if _DIST_OURS:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        _DIST_OURS = False
