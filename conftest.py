"""The ONE place where test markers are applied: each hardware marker auto-skips, with the reason, where the
hardware or toolchain is absent. Markers are registered in pyproject.toml ([tool.pytest.ini_options])."""

from __future__ import annotations

import functools

import pytest


@functools.cache
def _hardware() -> dict[str, str | None]:
    """marker -> None when its tests can run here, else the skip reason."""
    import torch

    reasons: dict[str, str | None] = {}
    if not torch.cuda.is_available():
        none = "no CUDA GPU on this machine"
        reasons.update(gpu=none, sm90=none, sm103=none, multigpu=none)
    else:
        cap = torch.cuda.get_device_capability(0)
        name = torch.cuda.get_device_name(0)
        reasons["gpu"] = None
        reasons["sm90"] = None if cap == (9, 0) else f"needs an SM90 GPU; this is {name} (sm_{cap[0]}{cap[1]})"
        reasons["sm103"] = (
            None if cap == (10, 3) else f"needs an SM103 (B300) GPU; this is {name} (sm_{cap[0]}{cap[1]})"
        )
        n = torch.cuda.device_count()
        reasons["multigpu"] = None if n >= 2 else f"needs 2+ GPUs; this machine has {n}"
    try:
        from gcmoe_core.cutedsl import cuda_tool, dsl_available

        why = dsl_available()
        if why is None:
            cuda_tool("nvdisasm")
            cuda_tool("cuobjdump")
        reasons["compile"] = why
    except Exception as e:  # gcmoe-core absent in this environment, or no nvdisasm/cuobjdump
        reasons["compile"] = f"offline compile toolchain unavailable: {e}"
    return reasons


def pytest_collection_modifyitems(config, items):
    reasons = _hardware()
    for item in items:
        for marker, why in reasons.items():
            if why is not None and item.get_closest_marker(marker) is not None:
                item.add_marker(pytest.mark.skip(reason=f"[{marker}] {why}"))
                break
