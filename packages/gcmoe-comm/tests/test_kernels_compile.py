"""Offline (CPU) compile of the comm kernels for sm_90a: the memory-model instructions the protocol rests on are
in the PTX (acquire / release at the right scope, the generation tag, the parity counters), no local memory."""

import re
from collections import Counter

import pytest

from gcmoe_comm.kernels import CommShape, compiled
from gcmoe_comm.ring import RingSpec
from gcmoe_core.config import MoEConfig

pytestmark = pytest.mark.compile


def _ptx_ops(ptx: str) -> Counter:
    return Counter(re.findall(r"^\s+((?:ld|st|atom|match|fence|nanosleep)[\w.]*)", ptx, re.M))


@pytest.mark.parametrize("model, p, bm, shared", [("deepseek-v3", 8, 16, 1), ("glm-4.5", 4, 8, 0)])
def test_comm_kernels_compile_with_the_protocol_instructions(model, p, bm, shared):
    cfg = MoEConfig.from_model(model, ep_size=p, max_tokens_per_rank=256)
    ks = compiled(CommShape(RingSpec.from_config(cfg, bm), 16, 16, shared), "sm_90a")
    names = ("ready", "publish", "dispatch", "combined", "finalize")
    ready, publish, dispatch, combined, finalize = (_ptx_ops(ks[n].ptx) for n in names)
    assert ready["st.release.sys.global.u32"] == 1 and ready["fence.acq_rel.sys"] == 1  # READY = g
    assert publish["st.release.sys.global.u32"] == 1 and publish["atom.acq_rel.gpu.global.add.u32"] == 1  # last CTA
    assert "cvt.rn.satfinite.e4m3x2.f32" in ks["publish"].ptx and "vote.sync.any.pred" in ks["publish"].ptx
    assert dispatch["ld.acquire.sys.global.u32"] >= 1 and dispatch["nanosleep.u32"] >= 1  # bounded wait on READY
    assert dispatch["atom.relaxed.sys.global.cas.b32"] == 1  # the error word, first failure wins
    assert dispatch["match.any.sync.b32"] == 1 and dispatch["atom.shared.add.u32"] == 1
    assert dispatch["st.release.gpu.global.u32"] == 1  # L1_FULL[b] = g for W1
    assert dispatch["ld.global.v4.u32"] >= 1 and dispatch["st.global.v4.u32"] >= 1  # 16-byte pulls
    assert combined["atom.release.sys.global.add.u32"] == 1  # RECV[g & 1] += 1 on every peer
    assert finalize["ld.acquire.sys.global.u32"] >= 1 and finalize["st.release.sys.global.u32"] == 1  # reset
    assert finalize["atom.acq_rel.gpu.global.add.u32"] == 1  # last-CTA detection
    for name, k in ks.items():
        res = k.resources()
        assert res["LOCAL"] == 0 and res["STACK"] == 0, (name, res)
    sass = ks["dispatch"].sass()
    assert "MATCH.ANY" in sass and "LDG.E.128" in sass and "STG.E.128" in sass
