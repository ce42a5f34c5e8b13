"""Green-context partitions on a real GPU: facts, disjointness via %smid, streams, errors, and graphs."""

import pytest
import torch

from gcmoe_greenctx import (
    LayerGraph,
    LayerGraphCache,
    RoleNodes,
    device_facts,
    enqueue_roles,
    release,
    split_device,
)

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def part():
    p = split_device(16, mode="auto")
    yield p
    release(p.device)


def test_facts_are_read_from_the_driver():
    f = device_facts(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert f.green_contexts and f.sm_count == sms and f.granularity >= 1 and f.driver_version >= 12040


def test_partition_sizes(part):
    f = device_facts(0)
    assert part.mode == "green"
    assert part.comm_sms % f.coscheduled_alignment == 0 and part.comm_sms >= 16
    assert part.comm_sms + part.compute_sms == f.sm_count


def test_one_split_per_size_and_more_stream_pairs(part):
    """The same size returns the same split; another size coexists; new_streams gives streams confined to the same
    two partitions (%smid of CTAs launched on them)."""
    assert split_device(16) is part
    other = split_device(32)
    assert other is not part and other.comm_sms == 32 and split_device(32) is other
    comm, compute = part.new_streams()
    assert comm.cuda_stream not in (part.comm_stream.cuda_stream, part.compute_stream.cuda_stream)
    a, b = _smids(comm, 4 * part.comm_sms), _smids(compute, 4 * part.compute_sms)
    torch.cuda.synchronize()
    ref_b = _smids(part.compute_stream, 4 * part.compute_sms)
    torch.cuda.synchronize()
    sa, sb = set(a.tolist()), set(b.tolist())
    assert not sa & sb and not sa & set(ref_b.tolist()), "new stream pair: comm and compute SMs overlap"
    assert len(sa) <= part.comm_sms and len(sb) <= part.compute_sms


def test_too_many_sms_is_a_clear_error(part):
    f = device_facts(0)
    with pytest.raises(ValueError, match="Valid comm sizes"):
        split_device(f.sm_count)


def _smids(stream, n_ctas, spin_ns=200_000):
    from gcmoe_greenctx.kernel_smid import record_smids

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


def test_graph_capture_replays_with_new_contents(part):
    src = torch.randn(1 << 16, device="cuda")
    mid, dst = torch.empty_like(src), torch.empty_like(src)
    scale = torch.tensor(3.0, device="cuda")
    g = LayerGraph.capture(part, _roles(src, mid, dst, scale), overlap=False)
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
    LayerGraph.capture(part, roles, overlap=False).replay()
    torch.cuda.synchronize()
    assert torch.equal(dst, eager)


def test_graph_cache_buckets(part):
    bufs = {}

    def build(bucket):
        src = torch.randn(bucket, 64, device="cuda")
        mid, dst = torch.empty_like(src), torch.empty_like(src)
        bufs[bucket] = (src, dst)
        return _roles(src, mid, dst, torch.tensor(2.0, device="cuda"))

    cache = LayerGraphCache(part, build, buckets=(1, 2, 4, 8, 16), overlap=False)
    assert cache.replay(3) == 4 and cache.replay(4) == 4 and cache.replay(9) == 16
    torch.cuda.synchronize()
    assert sorted(cache.graphs) == [4, 16]
    src, dst = bufs[16]
    assert torch.equal(dst, src * 2 + 1)
    with pytest.raises(ValueError, match="outside the captured buckets"):
        cache.replay(17)
