"""The peers' adapters on a CPU, their libraries stood in for: which forms each peer is timed in and what each form's
timed call holds (triton_kernels: both Hopper layouts, routing metadata inside / before the call; DeepGEMM: its
harness's buffer per point, the FP8 cast and copies inside / before the launch), the best form per column, and the
routing bitmatrix."""

from __future__ import annotations

import types

import pytest
import torch

from gcmoe_core.config import MoEConfig
from gcmoe_core.testing import make_routing, make_tokens, make_weights
from gcmoe_lab import peers


# ----------------------------------------------------------------------------------------------- best per column
def _form(column: str) -> peers.Form:
    return peers.Form(lambda x, ids, w: lambda: x, column)


def test_best_forms_picks_the_fastest_per_column_among_those_that_ran():
    forms = {"nw8": _form("call"), "nw4": _form("call"), "nw8_p": _form("prepared"), "nw4_p": _form("prepared")}
    assert peers.best_forms({"nw8": 120.0, "nw4": 110.0, "nw8_p": 90.0, "nw4_p": 95.0}, forms) == {
        "call": ("nw4", 110.0),
        "prepared": ("nw8_p", 90.0),
    }
    assert peers.best_forms({"nw8": 120.0}, forms) == {"call": ("nw8", 120.0)}  # the others failed
    assert peers.best_forms({}, forms) == {}


# ------------------------------------------------------------------------------------------------- the bitmatrix
@pytest.mark.parametrize(("t", "k", "e"), [(1, 6, 32), (9, 8, 256), (5, 4, 64), (3, 1, 33)])
def test_padded_routing_and_its_bitmatrix(t, k, e):
    """Unused slots say -1 (id and weight); bit e % 32 of word e // 32 is set exactly for the token's ids, the high
    bit of a word included (uint32 words)."""
    ids, w = make_routing(t, k, e, "uniform", torch.Generator().manual_seed(t))
    slots = 1 << (k - 1).bit_length()
    pids, pw = peers.pad_routing(ids, w, slots)
    assert pids.dtype == torch.int16 and pw.dtype == torch.bfloat16 and pids.shape == pw.shape == (t, slots)
    assert torch.equal(pids[:, :k].long(), ids.long()) and bool((pids[:, k:] == -1).all())
    assert bool((pw[:, k:] == -1).all()) and torch.equal(pw[:, :k], w.to(torch.bfloat16))
    words = peers.bitmatrix_words(pids, e)
    assert words.dtype == torch.uint32 and words.shape == (t, (e + 31) // 32)
    bits = words.view(torch.int32).long() & 0xFFFFFFFF
    for r in range(t):
        want = [0] * ((e + 31) // 32)
        for i in ids[r].tolist():
            want[i // 32] |= 1 << (i % 32)
        assert bits[r].tolist() == want
    top = torch.tensor([[31, 63, -1, -1]], dtype=torch.int16)
    assert (peers.bitmatrix_words(top, 64).view(torch.int32).long() & 0xFFFFFFFF).tolist() == [[2**31, 2**31]]


# ------------------------------------------------------------------------------------------------ triton_kernels
class FakeTK(types.SimpleNamespace):
    """triton_kernels' API as the adapter uses it, computing nothing: records which routing metadata and which
    precision config (num_warps) each matmul_ogs call got."""

    def __init__(self):
        calls: list = []
        layout = types.SimpleNamespace(
            make_default_matmul_mxfp4_w_layout=lambda mx_axis: ("values", {}),
            make_default_matmul_mxfp4_w_scale_layout=lambda mx_axis, num_warps: (("scales", num_warps), {}),
        )

        def convert_layout(t, lay, **kw):
            return types.SimpleNamespace(data=t, layout=lay)

        def sparse(indx, vals, mask):
            n = indx.numel()
            meta = types.SimpleNamespace(
                row_sorted_indx=torch.arange(n), col_sorted_indx=torch.arange(n), col_sum=torch.zeros(4)
            )
            calls.append(("routing", indx.shape[0]))
            return types.SimpleNamespace(mask_metadata=meta, vals=vals)

        def matmul_ogs(x, w, bias, rd, precision_config=None, **kw):
            calls.append(("gemm", precision_config.weight_scale.layout[1]))
            return torch.zeros(x.shape[0], 8)

        super().__init__(
            calls=calls,
            layout=layout,
            convert_layout=convert_layout,
            wrap_torch_tensor=lambda t, dtype=None: t,
            FP4="fp4",
            BIT="bit",
            FlexCtx=lambda rhs_data: None,
            InFlexData=lambda: None,
            PrecisionConfig=lambda flex_ctx, weight_scale, out_dtype: types.SimpleNamespace(weight_scale=weight_scale),
            FnSpecs=lambda *a, **kw: None,
            swiglu_fn=None,
            FusedActivation=lambda spec, args: args,
            Bitmatrix=lambda words, dtype, shape, shape_max: words,
            SparseMatrix=sparse,
            make_ragged_tensor_metadata=lambda col_sum, n: types.SimpleNamespace(slice_sizes=col_sum),
            RoutingData=lambda gate, sizes, e, slots, ragged: types.SimpleNamespace(gate_scal=gate),
            GatherIndx=lambda a, b: (a, b),
            ScatterIndx=lambda a, b: (a, b),
            matmul_ogs=matmul_ogs,
        )


def test_triton_kernels_forms_cover_both_layouts_with_routing_inside_and_before(monkeypatch):
    monkeypatch.setattr(peers, "PEER_FORMS", "all")  # every form, not only the GPU-validated ones
    tk = FakeTK()
    monkeypatch.setattr(peers, "_import_triton_kernels", lambda: tk)
    cfg = MoEConfig(256, 128, 8, 6, 0)
    peer = peers.TritonKernelsMoE(cfg, make_weights(cfg, seed=1), "cpu")
    assert peer.slots == 8 and peer.bitmatrix == "torch" and set(peer.precision) == {8, 4}
    assert peer.act == (1.0, peers._TK_SWIGLU_LIMIT)  # plain SwiGLU: no clamp...
    assert bool((peer.bias1[:, 1::2] == -1).all()) and bool((peer.bias1[:, 0::2] == 0).all())  # ...and u - 1 + 1
    forms = peer.forms()
    assert {n: (f.column, f.info["num_warps"]) for n, f in forms.items()} == {
        "nw8": ("call", 8),
        "nw8_prepared": ("prepared", 8),
        "nw4": ("call", 4),
        "nw4_prepared": ("prepared", 4),
    }
    x, ids, w = make_tokens(cfg, 5, seed=2)
    for name, form in forms.items():
        tk.calls.clear()
        run = form.bind(x, ids, w)
        bound = list(tk.calls)
        run()
        run()
        timed = tk.calls[len(bound) :]
        nw = form.info["num_warps"]
        if form.column == "prepared":  # the metadata once, at bind; each timed call: the two GEMMs
            assert bound == [("routing", 5)] and timed == [("gemm", nw), ("gemm", nw)] * 2, name
        else:  # nothing at bind; each timed call: metadata, then the two GEMMs
            assert bound == [] and timed == [("routing", 5), ("gemm", nw), ("gemm", nw)] * 2, name
    tk.calls.clear()
    assert peer(x, ids, w).shape[0] == 5 and tk.calls == [("routing", 5), ("gemm", 8), ("gemm", 8)]


# ------------------------------------------------------------------------------------------------------ DeepGEMM
class FakeDG:
    """DeepGEMM's extension as the adapter uses it: buffer sizes / views and the launch, recorded; the launch writes
    y from the staged inputs so a test sees what the buffer held."""

    ALIGN = 4

    def __init__(self, hidden: int, top_k: int):
        self.launches: list[dict] = []
        self.casts = 0
        dg = self

        class C:
            @staticmethod
            def get_token_alignment_for_mega_moe():
                return FakeDG.ALIGN

            @staticmethod
            def get_symm_buffer_size_for_sm90_mega_moe(ranks, experts, tokens, k, h, i, fp4, act):
                sizes = (tokens * h, tokens * h // 128 * 4, tokens * k * 8, tokens * k * 4)

                def slicer(buf):
                    views, at = [], 0
                    for n, (dtype, shape) in zip(
                        sizes,
                        (
                            (torch.float8_e4m3fn, (tokens, h)),
                            (torch.float32, (tokens, h // 128)),
                            (torch.int64, (tokens, k)),
                            (torch.float32, (tokens, k)),
                        ),
                        strict=True,
                    ):
                        views.append(buf[at : at + n].view(dtype).view(shape))
                        at += n
                    return views

                return sum(sizes), slicer

            @staticmethod
            def fp8_fp4_mega_moe_sm90(y, l1, l2, stats, buf, ptrs, rank, tokens, e, k, recipe, act, clamp, fast):
                dg.launches.append(dict(tokens=tokens, rows=y.shape[0], recipe=recipe, clamp=clamp, fast=fast))
                y.copy_(buf[: y.numel()].view(torch.float8_e4m3fn).float().view(y.shape))

        def cast_fp8(x, use_ue8m0, gran_k, use_packed_ue8m0):
            assert (use_ue8m0, gran_k, use_packed_ue8m0) == (False, 128, False)
            dg.casts += 1
            return x.to(torch.float8_e4m3fn), torch.ones(x.shape[0], x.shape[1] // 128)

        self.C = C
        self.cast_fp8 = cast_fp8
        self.align = lambda n, a: (n + a - 1) // a * a
        self.transform = lambda l1, l2: (l1, l2)
        self.src = "fake"


def test_deepgemm_forms_size_the_buffer_per_point_and_stage_inside_or_before(monkeypatch):
    monkeypatch.setattr(peers, "PEER_FORMS", "all")  # every form, not only the GPU-validated ones
    cfg = MoEConfig(256, 128, 8, 4, 0)
    fake = FakeDG(cfg.hidden_size, cfg.top_k)
    monkeypatch.setattr(peers, "_import_deepgemm", lambda: fake)
    monkeypatch.setattr(
        peers, "_symmetric_buffer", lambda n, dev: (torch.zeros(n, dtype=torch.int8), [0], "torch.empty (test)")
    )
    peer = peers.DeepGemmMegaMoE(cfg, make_weights(cfg, seed=3), "cpu")
    forms = peer.forms()
    assert {n: f.column for n, f in forms.items()} == {"call": "call", "prepared": "prepared"}
    for t in (1, 5, 8):
        x, ids, w = make_tokens(cfg, t, seed=t)
        for name, form in forms.items():
            fake.launches.clear()
            fake.casts = 0
            run = form.bind(x, ids, w)
            bound_casts = fake.casts
            y = run()
            run()
            rows = max(peers.MIN_BUFFER_TOKENS, t)
            buffer_rows = (rows + FakeDG.ALIGN - 1) // FakeDG.ALIGN * FakeDG.ALIGN  # at least MIN_BUFFER_TOKENS
            assert [launch["tokens"] for launch in fake.launches] == [buffer_rows] * 2, (name, t)
            assert all(lnch["rows"] == t and lnch["recipe"] == (1, 1, 32) for lnch in fake.launches)
            assert all(lnch["clamp"] is None and lnch["fast"] for lnch in fake.launches)
            # prepared: cast + copies once at bind, never timed; call: every timed call casts and copies
            assert (bound_casts, fake.casts) == ((1, 1) if name == "prepared" else (0, 2)), (name, t)
            assert torch.equal(y, x.to(torch.float8_e4m3fn).float())  # the launch read the staged tokens
    with pytest.raises(ValueError, match="exceeds its buffer"):
        b = peer.buffer(4)
        peer.stage(b, *make_tokens(cfg, b.tokens + 1, seed=0))
    assert peer.describe()["buffer"].startswith("torch.empty (test), per point")


def test_deepgemm_refuses_other_activations():
    cfg = MoEConfig(256, 128, 8, 4, 0, activation="swiglu_clamped")
    with pytest.raises(ValueError, match="plain SwiGLU"):
        peers.DeepGemmMegaMoE(cfg, None, "cpu")


def test_by_default_only_the_forms_validated_on_a_gpu_are_timed(monkeypatch):
    """Without --peer-forms all: triton_kernels at num_warps 8 with its routing inside the call (torch-built
    bitmatrix) and DeepGEMM's call form, the forms that ran clean on the H200."""
    monkeypatch.setattr(peers, "PEER_FORMS", "validated")
    tk = FakeTK()
    monkeypatch.setattr(peers, "_import_triton_kernels", lambda: tk)
    cfg = MoEConfig(256, 128, 8, 4, 0)
    peer = peers.TritonKernelsMoE(cfg, make_weights(cfg, seed=1), "cpu")
    assert set(peer.precision) == {8} and peer.bitmatrix == "torch"
    assert {n: (f.column, f.info["num_warps"]) for n, f in peer.forms().items()} == {"nw8": ("call", 8)}
    monkeypatch.setattr(peers, "_import_deepgemm", lambda: FakeDG(cfg.hidden_size, cfg.top_k))
    monkeypatch.setattr(
        peers, "_symmetric_buffer", lambda n, dev: (torch.zeros(n, dtype=torch.int8), [0], "torch.empty (test)")
    )
    dg = peers.DeepGemmMegaMoE(cfg, make_weights(cfg, seed=3), "cpu")
    assert {n: f.column for n, f in dg.forms().items()} == {"call": "call"}
