"""Green-context partitions on a real GPU: facts, disjointness via %smid, streams, errors, and graphs."""

import pytest
import torch

from gcmoe_greenctx import OwnedStream, RoleNodes, capturing, device_facts, enqueue_roles, relaxed_capture, split_device

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def part():
    p = split_device(16, mode="auto")
    yield p
    p.close()


def test_facts_are_read_from_the_driver():
    f = device_facts(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert f.green_contexts and f.sm_count == sms and f.granularity >= 1 and f.driver_version >= 12040


def test_partition_sizes(part):
    f = device_facts(0)
    assert part.mode == "green"
    assert part.comm_sms % f.coscheduled_alignment == 0 and part.comm_sms >= 16
    assert part.comm_sms + part.compute_sms == f.sm_count


def test_each_split_is_its_callers_and_splits_coexist(part):
    """Every split_device call makes a partition of its own (another size coexists), confined to its SMs (%smid of
    CTAs launched on it); closing one leaves the others working."""
    other, same = split_device(32), split_device(16)
    assert other is not part and same is not part and other.comm_sms == 32 and same.comm_sms == part.comm_sms
    assert same.comm_stream.cuda_stream not in (part.comm_stream.cuda_stream, part.compute_stream.cuda_stream)
    a, b = _smids(same.comm_stream, 4 * part.comm_sms), _smids(same.compute_stream, 4 * part.compute_sms)
    torch.cuda.synchronize()
    sa, sb = set(a.tolist()), set(b.tolist())
    assert -1 not in sa and -1 not in sb and not sa & sb, "comm and compute SMs overlap"
    assert len(sa) <= part.comm_sms and len(sb) <= part.compute_sms
    other.close()
    same.close()
    c = _smids(part.comm_stream, 4 * part.comm_sms)
    torch.cuda.synchronize()
    assert -1 not in set(c.tolist())


def test_owned_streams_and_teardown_inside_a_capture_leave_it_valid(part):
    """A stream of our own is never the captured one, and a partition or stream destroyed while another stream
    captures (the garbage collector dropping a layer inside an engine's capture) leaves that capture valid."""
    x = torch.randn(4096, device="cuda")
    y = torch.empty_like(x)
    g = torch.cuda.CUDAGraph()
    cap = OwnedStream(0)
    with torch.cuda.graph(g, stream=cap.stream):
        assert capturing(cap.stream)
        with relaxed_capture():  # set-up during a capture (as a layer first called inside one does it)
            doomed, s = split_device(16), OwnedStream(0)
            s.stream.synchronize()  # legal for this thread in relaxed mode, on a stream outside the capture
        assert not capturing(s.stream)
        doomed.close()
        s.close()
        torch.mul(x, 3.0, out=y)
    y.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, x * 3.0)


def test_too_many_sms_is_a_clear_error(part):
    f = device_facts(0)
    with pytest.raises(ValueError, match="Valid comm sizes"):
        split_device(f.sm_count)


def _smids(stream, n_ctas, spin_ns=200_000):
    from gcmoe_lab.kernel_smid import record_smids

    out = torch.full((n_ctas,), -1, dtype=torch.int32, device="cuda")
    record_smids(out, spin_ns, stream)
    return out


def test_partitions_are_disjoint_and_confined(part):
    """Each stream's CTAs land only on its partition's SMs, the SM sets never intersect, and together they fill
    the GPU (launched concurrently, 4 CTAs per SM of the whole GPU on each side)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    torch.cuda.synchronize()
    a = _smids(part.comm_stream, 4 * sms)
    b = _smids(part.compute_stream, 4 * sms)
    torch.cuda.synchronize()
    sa, sb = set(a.tolist()), set(b.tolist())
    assert -1 not in sa and -1 not in sb
    assert sa.isdisjoint(sb), f"overlap {sorted(sa & sb)}"
    assert len(sa) == part.comm_sms and len(sb) == part.compute_sms
    # repeat: the same sets again (the split is stable)
    a2, b2 = _smids(part.comm_stream, 4 * sms), _smids(part.compute_stream, 4 * sms)
    torch.cuda.synchronize()
    assert set(a2.tolist()) <= sa and set(b2.tolist()) <= sb


def test_unpartitioned_mode_same_interface():
    p = split_device(16, mode="unpartitioned")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert p.mode == "unpartitioned" and p.comm_sms == p.compute_sms == sms
    x = torch.randn(1000, device="cuda")
    with torch.cuda.stream(p.comm_stream):
        y = x * 2
    torch.cuda.synchronize()
    assert torch.equal(y, x * 2)


def _roles(src, mid, dst, scale):
    """dispatch copies src -> mid on the comm SMs; compute scales mid; finalize adds a bias."""
    return RoleNodes(
        dispatch=lambda: mid.copy_(src),
        compute=lambda: torch.mul(mid, scale, out=dst),
        finalize=lambda: dst.add_(1.0),
    )


def _capture(part, roles):
    side = OwnedStream(part.device)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=side.stream):
        enqueue_roles(part, roles, overlap=False)
    return g, side


def test_graph_capture_replays_with_new_contents(part):
    src = torch.randn(1 << 16, device="cuda")
    mid, dst = torch.empty_like(src), torch.empty_like(src)
    scale = torch.tensor(3.0, device="cuda")
    g, _side = _capture(part, _roles(src, mid, dst, scale))
    for i in range(200):
        src.copy_(torch.randn_like(src))
        scale.fill_(float(i % 7))
        dst.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(dst, src * float(i % 7) + 1.0), f"replay {i}"


def test_graph_equals_eager(part):
    src = torch.randn(1 << 12, device="cuda")
    mid, dst = torch.empty_like(src), torch.empty_like(src)
    scale = torch.tensor(0.5, device="cuda")
    roles = _roles(src, mid, dst, scale)
    enqueue_roles(part, roles, overlap=False)
    torch.cuda.synchronize()
    eager = dst.clone()
    dst.fill_(float("nan"))
    g, _side = _capture(part, roles)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(dst, eager)
