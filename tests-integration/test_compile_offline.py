"""CuTe DSL kernels compile offline (no GPU) for every target arch, and their SASS is what we expect."""

import pytest

from gcmoe_core.cutedsl import ARCHS, sass_opcodes

pytestmark = pytest.mark.compile


@pytest.mark.parametrize("arch", ARCHS)
def test_smid_probe_compiles_for_every_arch(arch):
    from gcmoe_lab.kernel_smid import compiled

    k = compiled(arch)
    assert k.cubin and k.cubin[:4] == b"\x7fELF"
    sass = k.sass()
    assert "SR_VIRTUALSMID" in sass or "SR_SMID" in sass or "S2R" in sass or "S2UR" in sass
    assert k.resources()["LOCAL"] == 0
    ops = {o.split(".")[0] for o in sass_opcodes(sass)}
    assert not ops & {"LDL", "STL"}
