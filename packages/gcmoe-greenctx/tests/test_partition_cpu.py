"""Rounding rules, error messages and the no-GPU paths of the partitioner (CPU)."""

import pytest
import torch

from gcmoe_greenctx import GreenContextError, device_facts, plan_split, split_device, valid_comm_sizes

H200 = dict(sm_count=132, min_partition_size=8, alignment=8)


@pytest.mark.parametrize(("req", "comm"), [(1, 8), (8, 8), (9, 16), (16, 16), (17, 24), (24, 24), (47, 48), (120, 120)])
def test_rounds_up_to_granularity(req, comm):
    p = plan_split(req, **H200)
    assert p.comm_sms == comm and p.compute_sms == 132 - comm and p.requested == req


def test_paper_partition_on_h200():
    p = plan_split(16, **H200)
    assert (p.comm_sms, p.compute_sms) == (16, 116)


def test_min_partition_size_dominates_alignment():
    p = plan_split(2, sm_count=64, min_partition_size=6, alignment=2)
    assert p.comm_sms == 6
    p = plan_split(7, sm_count=64, min_partition_size=6, alignment=2)
    assert p.comm_sms == 8


@pytest.mark.parametrize("req", [125, 128, 132, 200])
def test_too_many_sms_names_valid_sizes(req):
    with pytest.raises(
        ValueError,
        match=r"compute partition needs at least 8\. Valid comm sizes on this device: 8\.\.120 in steps of 8",
    ):
        plan_split(req, **H200)


@pytest.mark.parametrize("req", [0, -8, 3.5, "16"])
def test_bad_request(req):
    with pytest.raises(ValueError, match="comm_sms must be a positive int"):
        plan_split(req, **H200)


def test_valid_sizes():
    assert valid_comm_sizes(132, 8)[:3] == [8, 16, 24] and valid_comm_sizes(132, 8)[-1] == 120
    assert valid_comm_sizes(8, 8) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU behaviour")
def test_no_gpu_facts_and_errors():
    f = device_facts(0)
    assert not f.green_contexts and f.reason and f.granularity is None
    with pytest.raises(GreenContextError, match="no CUDA device"):
        split_device(16)
    with pytest.raises(ValueError, match="mode must be"):
        split_device(16, mode="halves")


class _FakeStream:
    def __init__(self, *a, **k):
        pass


class _FakeOwned:
    def __init__(self, device):
        self.stream = _FakeStream()

    def close(self):
        pass


def _fake_cuda(monkeypatch, facts):
    from types import SimpleNamespace

    import gcmoe_greenctx.partition as part

    monkeypatch.setattr(part.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(part.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr("gcmoe_greenctx.streams.OwnedStream", _FakeOwned)
    monkeypatch.setattr(part.torch.cuda, "device", lambda d: __import__("contextlib").nullcontext())
    monkeypatch.setattr(part.torch.cuda, "get_device_properties", lambda d: SimpleNamespace(multi_processor_count=132))
    monkeypatch.setattr(part, "device_facts", lambda d: facts)


def test_mode_selection_without_green_contexts(monkeypatch):
    """The mode logic on a (faked) GPU whose driver has no green contexts: 'auto' warns and runs unpartitioned with
    the same interface, 'green' refuses with the reason, 'unpartitioned' never asks."""
    from gcmoe_greenctx.partition import SmFacts

    facts = SmFacts(0, None, None, None, 12030, False, False, None, "driver too old for green contexts")
    _fake_cuda(monkeypatch, facts)
    with pytest.warns(RuntimeWarning, match="running unpartitioned"):
        p = split_device(16, mode="auto")
    assert p.mode == "unpartitioned" and p.comm_sms == p.compute_sms == 132
    assert isinstance(p.comm_stream, _FakeStream) and p.comm_stream is not p.compute_stream
    assert "unpartitioned: comm 132 SMs | compute 132 SMs" in p.describe()
    with pytest.raises(GreenContextError, match="driver too old for green contexts"):
        split_device(16, mode="green")
    assert split_device(16, mode="unpartitioned").mode == "unpartitioned"


def test_green_mode_checks_the_plan_before_touching_the_driver(monkeypatch):
    from gcmoe_greenctx.partition import SmFacts

    _fake_cuda(monkeypatch, SmFacts(0, 132, 8, 8, 13000, True, False, "cuDevSmResourceSplitByCount"))
    with pytest.raises(ValueError, match="Valid comm sizes on this device: 8..120 in steps of 8"):
        split_device(130, mode="green")
