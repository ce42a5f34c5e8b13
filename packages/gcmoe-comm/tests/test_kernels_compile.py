"""Offline (CPU) compile of the comm kernels for sm_90a: the memory-model instructions the protocol rests on are
in the PTX (acquire / release at the right scope, the generation tag, the parity counters), no local memory."""

import re
from collections import Counter

import pytest

from gcmoe_comm.kernels import ID_BATCH, CommShape, compiled
from gcmoe_comm.ring import RingSpec
from gcmoe_core.config import MoEConfig

pytestmark = pytest.mark.compile


def _ptx_ops(ptx: str) -> Counter:
    return Counter(re.findall(r"^\s+((?:ld|st|atom|match|fence|nanosleep)[\w.]*)", ptx, re.M))


def _first_global(ptx: str) -> int:
    """Where the first global-memory access of a kernel is."""
    return re.search(r"^\s+(?:ld|st|atom)\.(?!param|shared)", ptx, re.M).start()


@pytest.mark.parametrize("model, p, bm", [("deepseek-v3", 8, 16), ("glm-4.5", 4, 8)])
def test_comm_kernels_compile_with_the_protocol_instructions(model, p, bm):
    cfg = MoEConfig.from_model(model, ep_size=p, max_tokens_per_rank=256)
    ks = compiled(CommShape(RingSpec.from_config(cfg, bm)), "sm_90a")
    names = ("ready", "publish", "dispatch", "finalize")
    ready, publish, dispatch, finalize = (_ptx_ops(ks[n].ptx) for n in names)
    assert ready["st.release.sys.global.u32"] == 1 and ready["fence.acq_rel.sys"] == 1  # READY = g
    # publish: READY and the host status (slot path) released at system scope; the last CTA; the workspace's INUSE
    # taken by compare-and-swap
    assert publish["st.release.sys.global.u32"] == 2 and publish["atom.acq_rel.gpu.global.add.u32"] == 1
    assert publish["atom.acq_rel.gpu.global.cas.b32"] == 1
    assert "cvt.rn.satfinite.e4m3x2.f32" in ks["publish"].ptx and "vote.sync.any.pred" in ks["publish"].ptx
    assert dispatch["ld.acquire.sys.global.u32"] >= 1 and dispatch["nanosleep.u32"] >= 1  # bounded wait on READY
    assert dispatch["atom.relaxed.sys.global.cas.b32"] == 1  # the error word, first failure wins
    # the ranking's one match.any; the counts' smem atomics, one per routing id of a lane's batch of loads
    assert dispatch["match.any.sync.b32"] == 1 and dispatch["atom.shared.add.u32"] == ID_BATCH
    assert dispatch["st.release.gpu.global.u32"] == 2  # OFFS = g, then L1_FULL[b] = g: what W1 acquires
    assert dispatch["atom.acq_rel.gpu.global.add.u32"] == 1  # RANKED: the last CTA past the routing releases OFFS
    assert dispatch["ld.global.v4.u32"] >= 1 and dispatch["st.global.v4.u32"] >= 1  # 16-byte pulls
    assert finalize["atom.release.sys.global.add.u32"] == 1  # combined: RECV[g & 1] += 1 on every peer
    assert finalize["ld.acquire.sys.global.u32"] >= 1 and finalize["st.release.sys.global.u32"] == 1  # reset
    assert finalize["atom.acq_rel.gpu.global.add.u32"] == 1  # last-CTA detection
    # INUSE read (relaxed: this call's kernels before W2 wrote it, W2 has finished) and freed by a release
    assert finalize["ld.relaxed.gpu.global.u32"] >= 1 and finalize["st.release.gpu.global.u32"] == 1
    # PDL: dispatch launches while publish runs and waits for it before it reads anything, and lets W1 launch after
    # ranking the routing (before the row pulls: the L1_FULL releases follow); finalize waits for W2 before its reads
    assert "griddepcontrol.launch_dependents" in ks["publish"].ptx
    dptx, fptx = ks["dispatch"].ptx, ks["finalize"].ptx
    assert dptx.index("griddepcontrol.wait") < _first_global(dptx)
    assert dptx.index("match.any") < dptx.index("griddepcontrol.launch_dependents") < dptx.rindex("st.release.gpu")
    assert fptx.index("griddepcontrol.wait") < _first_global(fptx)
    for name, k in ks.items():
        res = k.resources()
        assert res["LOCAL"] == 0 and res["STACK"] == 0, (name, res)
    one = compiled(CommShape(RingSpec.from_config(cfg.replace(ep_size=1), bm)), "sm_90a")
    # P = 1: every signal is this GPU's own (gpu scope), and READY is read, not awaited (its only
    # publish finished before griddepcontrol.wait returned): no acquire loop at all, OFFS and L1_FULL still released
    one_dispatch = _ptx_ops(one["dispatch"].ptx)
    assert one_dispatch["ld.acquire.gpu.global.u32"] == 0 and one_dispatch["ld.acquire.sys.global.u32"] == 0
    assert one_dispatch["nanosleep.u32"] == 0 and one_dispatch["st.release.gpu.global.u32"] == 2
    # P = 1: publish + dispatch as one kernel (the layer's small calls): INUSE taken by compare-and-swap, the inputs
    # quantised in place of the pulls (no 16-byte row copies), RANKED's last CTA releases OFFS, each block L1_FULL;
    # the host status released at system scope; no wait on anything, and W1 may launch once INUSE is held
    assert "dispatch_local" not in ks
    local_ptx = one["dispatch_local"].ptx
    local = _ptx_ops(local_ptx)
    assert local["atom.acq_rel.gpu.global.cas.b32"] == 1 and local["atom.acq_rel.gpu.global.add.u32"] == 1
    assert local["st.release.gpu.global.u32"] == 2 and local["st.release.sys.global.u32"] == 1
    assert local["ld.acquire.gpu.global.u32"] == 0 and local["nanosleep.u32"] == 0 and local["ld.global.v4.u32"] == 0
    assert "cvt.rn.satfinite.e4m3x2.f32" in local_ptx and local["match.any.sync.b32"] == 1
    assert "griddepcontrol.launch_dependents" in local_ptx and "griddepcontrol.wait" not in local_ptx
    res = one["dispatch_local"].resources()
    assert res["LOCAL"] == 0 and res["STACK"] == 0, res
    # P = 1: finalize has no receive counters (its W2's rows are all its own): no atomics on them, no wait
    one_finalize = _ptx_ops(one["finalize"].ptx)
    assert one_finalize["atom.release.gpu.global.add.u32"] == 0 and one_finalize["nanosleep.u32"] == 0
    assert one_finalize["atom.acq_rel.gpu.global.add.u32"] == 1 and one_finalize["st.release.gpu.global.u32"] == 1
    sass = ks["dispatch"].sass()
    assert "MATCH.ANY" in sass and "LDG.E.128" in sass and "STG.E.128" in sass
