"""Workspace layout, views, the host-side checks of CommRank, and the error words (CPU)."""

import itertools

import pytest
import torch

from gcmoe_comm.comm import CommRank
from gcmoe_comm.ring import RingSpec
from gcmoe_comm.workspace import SIG_BAD, SIG_ERR, SIG_L1_FULL, CommError, Workspace, WorkspaceLayout, sig_w1_done
from gcmoe_core.config import MoEConfig

SPEC = RingSpec(ranks=2, local_experts=4, hidden=256, top_k=2, max_tokens=16, bm=8)


def test_layout_aligned_disjoint_and_sized():
    cfg = MoEConfig.from_model("deepseek-v3", ep_size=8, max_tokens_per_rank=256)
    spec = RingSpec.from_config(cfg, bm=16)
    lay = WorkspaceLayout(spec)
    spans = sorted((lay[n], lay[n] + lay.sizes[n], n) for n in lay.offsets)
    for (_a0, a1, an), (b0, _, bn) in itertools.pairwise(spans):
        assert a1 <= b0, f"{an} overlaps {bn}"
    assert all(off % 128 == 0 for off in lay.offsets.values())
    assert spans[-1][1] <= lay.nbytes
    assert lay.sizes["ring_x"] == spec.capacity * 7168
    assert lay.sizes["combine"] == (256 * (8 + 1) + 1) * 7168 * 2  # k + S slots per token, then the sink row
    assert lay.sizes["signals"] == (SIG_L1_FULL + spec.blocks + 2 * spec.ring_experts) * 4  # + the W1_DONE pairs


def test_views_cover_their_buffers_exactly():
    wss = Workspace.virtual(SPEC, "cpu")
    assert len(wss) == 2 and wss[0].peers == wss[1].peers and wss[1].base == wss[1].buf.data_ptr()
    v = wss[0].views
    lay = wss[0].layout
    for name in lay.offsets:
        t = getattr(v, name)
        assert t.data_ptr() - wss[0].buf.data_ptr() == lay[name]
        assert t.numel() * t.element_size() == lay.sizes[name]
    assert v.ring_sxT.shape == (2, SPEC.capacity) and v.combine.shape == (16 * 2 + 1, 256)
    assert v.sink_row == 32 and v.l1_full.numel() == SPEC.blocks
    assert v.w1_done.shape == (SPEC.ring_experts, 2)
    assert v.w1_done.data_ptr() == v.signals.data_ptr() + 4 * sig_w1_done(SPEC)
    assert int(v.signals.abs().sum()) == 0


def test_dropped_workspaces_are_freed_without_the_cyclic_gc():
    """A workspace holds no reference to itself or its siblings (only their buffers): dropping it frees it at once, not
    whenever the cyclic GC runs (possibly inside a CUDA-graph capture); virtual siblings' buffers stay alive while any
    sibling that addresses them does, and each sibling still sees the others' (peer_views, recover)."""
    import gc
    import weakref

    gc.disable()
    try:
        wss = Workspace.virtual(SPEC, "cpu")
        refs = [weakref.ref(ws) for ws in wss]
        buf1 = weakref.ref(wss[1].buf)
        wss[1].views.signals.fill_(3)
        assert wss[0].peer_views(1).signals.data_ptr() == wss[1].views.signals.data_ptr()
        keep = wss[0]
        del wss
        assert refs[1]() is None and refs[0]() is keep
        assert buf1() is not None, "a sibling's buffer must live while a workspace addressing it does"
        assert int(keep.peer_views(1).signals.sum()) == 3 * keep.views.signals.numel()
        keep.recover()  # resets every sibling's signals, the dropped one's buffer included
        assert int(keep.peer_views(1).signals.abs().sum()) == 0
        del keep
        assert refs[0]() is None and buf1() is None
    finally:
        gc.enable()


ERROR_CASES = [  # (rank whose ERR words are set, the words: code, kind, who, generation, seen; the message)
    (0, [1, 1, 1, 7, 6], r"rank 0: timed out waiting on rank 1's ready tag.*generation 7, saw 6"),
    (1, [1, 2, 1, 3, 1], r"rank 1's receive counter: wanted 2 arrivals for generation 3, saw 1"),
    (1, [1, 4, 12, 3, 2], r"rank 1: timed out waiting on block 12 of its own ring .*generation 3, saw 2"),
    (1, [1, 6, 5, 3, 2], r"rank 1: timed out waiting on ring expert 5 \(W1 completion tag.*generation 3, saw 2"),
    (0, [1, 5, 0, 9, 4], r"a call \(ticket 9\) found its workspace, held by another call .*ticket 4"),
]


def test_error_words_become_a_clear_error_and_recover_clears_them():
    wss = Workspace.virtual(SPEC, "cpu")
    wss[0].check()  # no error recorded
    for rank, words, message in ERROR_CASES:
        wss[rank].views.signals[SIG_ERR : SIG_ERR + 5] = torch.tensor(words, dtype=torch.int32)
        with pytest.raises(CommError, match=message):
            wss[rank].check()
    wss[1].recover()  # virtual ranks: resets every sibling
    wss[0].check(), wss[1].check()


def test_bad_input_words_read_as_argument_errors_and_clear():
    ws = Workspace.virtual(SPEC, "cpu")[0]
    assert ws.bad_input() is None
    ws.views.signals[SIG_BAD : SIG_BAD + 4] = torch.tensor([1, 3, 1, 99], dtype=torch.int32)
    assert ws.bad_input() == (
        "gcmoe: topk_ids: holds expert id 99 at token 3, slot 1, out of range [0, 8) (that slot was dropped)"
    )
    assert ws.bad_input() is None  # read once, then cleared
    ws.views.signals[SIG_BAD : SIG_BAD + 4] = torch.tensor([2, 0, 1, 0x7FC00000], dtype=torch.int32)
    assert "non-finite routing weight" in ws.bad_input()


def test_workspace_argument_errors():
    buf = torch.empty(WorkspaceLayout(SPEC).nbytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match="1 peer addresses for P = 2"):
        Workspace(SPEC, 0, buf, (0,))
    with pytest.raises(ValueError, match="rank 2 outside"):
        Workspace(SPEC, 2, buf, (0, 0))
    with pytest.raises(ValueError, match="buffer must be uint8"):
        Workspace(SPEC, 0, buf[:100], (0, 0))
    with pytest.raises(ValueError, match="multiple of 128"):
        WorkspaceLayout(RingSpec(1, 4, 200, 2, 16, 8))


@pytest.fixture
def rank():
    return CommRank(Workspace.virtual(SPEC, "cpu")[0], timeout_ms=10)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"dispatch_ctas": 0}, "dispatch_ctas = 0"),
        ({"finalize_ctas": 2000}, "finalize_ctas = 2000"),
        ({"timeout_ms": 0}, "timeout 0 ms"),
    ],
)
def test_comm_rank_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CommRank(Workspace.virtual(SPEC, "cpu")[0], **kwargs)


def test_comm_rank_refuses_routing_that_does_not_fit_shared_memory():
    big = RingSpec(ranks=8, local_experts=32, hidden=7168, top_k=8, max_tokens=2048, bm=16)
    with pytest.raises(ValueError, match="lower max_tokens_per_rank"):
        CommRank.validate_spec(big)
    CommRank.validate_spec(RingSpec(ranks=8, local_experts=32, hidden=7168, top_k=8, max_tokens=256, bm=16))


def test_timeout_from_environment(monkeypatch):
    monkeypatch.setenv("GCMOE_COMM_TIMEOUT_MS", "250")
    assert CommRank(Workspace.virtual(SPEC, "cpu")[0]).timeout_ns == 250_000_000
    monkeypatch.setenv("GCMOE_COMM_TIMEOUT_MS", "soon")
    with pytest.raises(ValueError, match="not an integer"):
        CommRank(Workspace.virtual(SPEC, "cpu")[0])


def _args(t=4, h=256, k=2):
    return torch.randn(t, h).to(torch.bfloat16), torch.zeros(t, k, dtype=torch.int32), torch.ones(t, k)


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda a: (a[0].float(), a[1], a[2]), "x must be bf16"),
        (lambda a: (a[0][:, :128], a[1], a[2]), "x must be bf16"),
        (lambda a: _args(t=17), "exceeds the workspace's max_tokens_per_rank = 16"),
        (lambda a: (a[0], a[1][:, :1], a[2]), "topk_ids must be int32/int64"),
        (lambda a: (a[0], a[1].float(), a[2]), "topk_ids must be int32/int64"),
        (lambda a: (a[0], a[1], a[2].int()), "topk_weights must be floating"),
        (lambda a: (a[0], a[1], a[2][:3]), "topk_weights must be floating"),
    ],
)
def test_publish_argument_errors(rank, change, match):
    with pytest.raises(ValueError, match=match):
        rank.publish(*change(_args()))


def test_finalize_argument_errors(rank):
    rank._ntok = 4
    with pytest.raises(ValueError, match=r"out must be contiguous bf16 \[4, 256\]"):
        rank.finalize(torch.empty(4, 256))
    with pytest.raises(ValueError, match=r"out must be contiguous bf16"):
        rank.finalize(torch.empty(256, 4, dtype=torch.bfloat16).t())
    with pytest.raises(ValueError, match=r"out is on meta, the workspace on cpu"):
        rank.finalize(torch.empty(4, 256, dtype=torch.bfloat16, device="meta"))


@pytest.mark.parametrize(
    "model, one_kernel_up_to",
    [("deepseek-v4-flash", 32), ("deepseek-v3", 16), ("glm-5", 16)],
)
def test_one_kernel_publish_dispatch_only_at_world_size_one_and_small_rings(model, one_kernel_up_to):
    """publish_dispatch's choice (LOCAL_DISPATCH_MAX_BYTES of ring rows, T (k + S) H): one kernel exactly where the
    H200 side-by-side run measured it faster (V4-Flash T <= 32, DeepSeek-V3 / GLM-5 T <= 16), never at P > 1."""
    for p in (1, 2):
        cfg = MoEConfig.ep_slice(model, 8, max_tokens_per_rank=256).replace(ep_size=p)
        rank = CommRank(Workspace.virtual(RingSpec.from_config(cfg, 8), "cpu")[0], timeout_ms=10)
        chosen = [t for t in (1, 2, 4, 8, 16, 32, 64, 128, 256) if rank.local_dispatch(t)]
        assert chosen == ([t for t in (1, 2, 4, 8, 16, 32) if t <= one_kernel_up_to] if p == 1 else []), (p, chosen)
