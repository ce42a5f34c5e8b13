"""The comm-partition policy a layer runs with: how many SMs the communication partition gets, and above which
token count per rank a call runs unpartitioned. The tuner (gcmoe-lab: `gcmoe tune`) writes it; the sm90 backend
reads it; this module imports neither.

Where a layer's policy comes from (first that exists):
1. GCMOE_COMM_SMS: forces the comm size at every token count (0 = never partition); a bad value raises ValueError.
2. The cache file the tuner wrote on this device for this shape (cache_path): where the partition pays depends on
   both. A bad cache file warns and falls through to the defaults (it must not stop a layer from being built).
3. DEFAULTS by device name, else GENERIC_DEFAULT: no partition on the H200 and on untuned devices. At world size 1
   dispatch moves no bytes across GPUs, so the partition has nothing to hide while the GEMMs lose SMs (measured:
   docs/benchmarks/index.md, Partition ablation).
Valid comm sizes: 0, or a multiple of the split granularity (8 SMs on H100 / H200) leaving one granule to compute.
"""

from __future__ import annotations

import json
import math
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

from gcmoe_core import env
from gcmoe_core.config import MoEConfig
from gcmoe_greenctx.partition import valid_comm_sizes

GRANULARITY = 8  # SMs per green-context split step on H100/H200 (minSmPartitionSize = smCoscheduledAlignment = 8)
DEFAULTS: dict[str, tuple[int, int]] = {"NVIDIA H200": (0, 0)}
GENERIC_DEFAULT = (0, 0)  # untuned devices: no partition until the tuner measures one that pays


@dataclass(frozen=True)
class Policy:
    """comm_sms: SMs of the comm partition (0 = never partition). unpartitioned_above: token count per rank above
    which a call runs unpartitioned (math.inf = never). source: where the numbers came from."""

    comm_sms: int
    unpartitioned_above: float
    source: str

    def mode_for(self, tokens: int) -> int:
        """Comm SMs for a call of `tokens` tokens per rank; 0 = unpartitioned."""
        return 0 if tokens > self.unpartitioned_above else self.comm_sms


def slug(text: str) -> str:
    """'NVIDIA H200' -> 'h200' (for file names)."""
    text = re.sub(r"^nvidia\s+", "", text.strip().lower())
    return re.sub(r"[^a-z0-9]+", "-", text).strip("-")


def shape_key(cfg: MoEConfig, device_name: str) -> dict:
    """What a tuned policy depends on: the device and the layer shape one rank sees."""
    return {
        "device": device_name,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "local_experts": cfg.local_experts,
        "top_k": cfg.top_k,
        "num_shared_experts": cfg.num_shared_experts,
        "ep_size": cfg.ep_size,
    }


def cache_path(cfg: MoEConfig, device_name: str) -> Path:
    k = shape_key(cfg, device_name)
    name = (
        f"{slug(device_name)}-h{k['hidden_size']}-i{k['intermediate_size']}-e{k['local_experts']}-k{k['top_k']}"
        f"-s{k['num_shared_experts']}-ep{k['ep_size']}"
    )
    return env.cache_dir() / "tune" / f"{name}.json"


def _valid_sizes_text(sm_count: int | None) -> str:
    if sm_count is None:
        return f"0 (no partition) or a positive multiple of {GRANULARITY}"
    sizes = valid_comm_sizes(sm_count, GRANULARITY)
    if not sizes:
        return f"0 (no partition; {sm_count} SMs cannot be split)"
    return f"0 (no partition) or {sizes[0]}..{sizes[-1]} in steps of {GRANULARITY}"


def check_comm_sms(comm_sms: int, sm_count: int | None, what: str) -> int:
    """comm_sms if it is 0 or a valid comm partition size on a device of sm_count SMs (None: unknown), else
    ValueError naming `what` and the valid sizes."""
    if sm_count is None:
        valid = isinstance(comm_sms, int) and comm_sms > 0 and comm_sms % GRANULARITY == 0
    else:
        valid = comm_sms in valid_comm_sizes(sm_count, GRANULARITY)
    ok = type(comm_sms) is int and (comm_sms == 0 or valid)
    if not ok:
        device = f" on this device ({sm_count} SMs)" if sm_count is not None else ""
        raise ValueError(
            f"{what}: {comm_sms} SMs is not a valid comm partition size{device}; valid: {_valid_sizes_text(sm_count)}"
        )
    return comm_sms


def _from_env(sm_count: int) -> Policy | None:
    raw = env.get_optional("GCMOE_COMM_SMS")
    if raw is None:
        return None
    try:
        comm = int(raw)
    except ValueError:
        raise ValueError(f"GCMOE_COMM_SMS={raw!r} is not an integer; valid: {_valid_sizes_text(sm_count)}") from None
    check_comm_sms(comm, sm_count, f"GCMOE_COMM_SMS={raw!r}")
    return Policy(comm, math.inf if comm else 0, f"env GCMOE_COMM_SMS={comm}")


def _from_cache(cfg: MoEConfig, device_name: str, sm_count: int) -> Policy | None:
    path = cache_path(cfg, device_name)
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        if data["key"] != shape_key(cfg, device_name):
            raise ValueError(f"it was tuned for {data['key']}")
        pol = data["policy"]
        comm, above = check_comm_sms(pol["comm_sms"], sm_count, "comm_sms"), pol["unpartitioned_above"]
        if not isinstance(above, int) or above < 0:
            raise ValueError(f"unpartitioned_above must be an int >= 0, got {above!r}")
    except (OSError, ValueError, KeyError, TypeError) as e:
        warnings.warn(f"gcmoe: ignoring the tuned partition policy {path}: {e}", RuntimeWarning, stacklevel=3)
        return None
    return Policy(comm, above, f"tuned {path}")


def policy(cfg: MoEConfig, device_name: str, sm_count: int) -> Policy:
    """The partition policy for a layer of this shape on this device: GCMOE_COMM_SMS, else the tuned cache file,
    else the device's default, else the generic default (see the module docstring)."""
    found = _from_env(sm_count) or _from_cache(cfg, device_name, sm_count)
    if found is not None:
        return found
    comm, above = DEFAULTS.get(device_name, GENERIC_DEFAULT)
    source = f"default for {device_name}" if device_name in DEFAULTS else f"generic default ({device_name} not tuned)"
    if comm and comm not in valid_comm_sizes(sm_count, GRANULARITY):
        return Policy(0, 0, f"{source}: {sm_count} SMs cannot give it {comm} comm SMs")
    return Policy(comm, above, source)
