"""The comm-partition policy a layer runs with: per schedule, how many SMs the communication partition gets and above
which token count per rank a call runs unpartitioned. The tuner (gcmoe-lab: `gcmoe tune`) writes it; the sm90
backend reads it; this module imports neither.

Two schedules, each with its own (comm_sms, unpartitioned_above):
- one-batch: a call on its own (Policy.comm_sms, Policy.unpartitioned_above; mode_for(tokens));
- two-batch: a call inside gcmoe.micro_batch(i), while the other micro-batch's layers run on another stream
  (Policy.two_batch_comm_sms, Policy.two_batch_unpartitioned_above; mode_for(tokens, two_batch=True)).
Where the partition pays differs between them: at world size 1 a one-batch call has nothing for the comm partition
to hide, while two micro-batches overlap one's dispatch with the other's GEMMs, and only at some small T for some
shapes (docs/benchmarks/index.md, Model step). So each is tuned and defaulted on its own.

Where a layer's policy comes from (first that exists):
1. GCMOE_COMM_SMS: forces the comm size of both schedules at every token count (0 = never partition); a bad value
   raises ValueError. MoELayer(comm_sms=c) forces both the same way (the backend builds that Policy).
2. The cache file the tuner wrote on this device for this shape (cache_path): where the partition pays depends on
   both. "policy" holds the one-batch entry, the optional "two_batch" the two-batch one (absent: never partition in
   two-batch calls); each is {"comm_sms": valid size, "unpartitioned_above": int >= 0}. A bad file or a bad "policy"
   entry warns and falls through to the defaults; a bad "two_batch" entry warns and is ignored (two-batch calls
   never partition, the one-batch entry stands). A cache file must not stop a layer from being built.
3. DEFAULTS by device name, else GENERIC_DEFAULT: no partition in either schedule, on the H200 and on untuned devices.
   At world size 1 dispatch moves no bytes across GPUs, so a one-batch partition has nothing to hide while the GEMMs
   lose SMs (docs/benchmarks/index.md, Partition ablation); the two-batch partition pays only where the tuner
   measured it.
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
# (comm_sms, unpartitioned_above, two_batch_comm_sms, two_batch_unpartitioned_above) per device name
DEFAULTS: dict[str, tuple[int, int, int, int]] = {"NVIDIA H200": (0, 0, 0, 0)}
GENERIC_DEFAULT = (0, 0, 0, 0)  # untuned devices: no partition until the tuner measures one that pays


@dataclass(frozen=True)
class Policy:
    """comm_sms: SMs of the comm partition of a one-batch call (0 = never partition). unpartitioned_above: token
    count per rank above which such a call runs unpartitioned (math.inf = never). source: where the numbers came
    from. two_batch_*: the same for a call inside gcmoe.micro_batch(i) (default: never partition)."""

    comm_sms: int
    unpartitioned_above: float
    source: str
    two_batch_comm_sms: int = 0
    two_batch_unpartitioned_above: float = 0

    def mode_for(self, tokens: int, two_batch: bool = False) -> int:
        """Comm SMs for a call of `tokens` tokens per rank, one of two micro-batches or not; 0 = unpartitioned."""
        if two_batch:
            return 0 if tokens > self.two_batch_unpartitioned_above else self.two_batch_comm_sms
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
    above = math.inf if comm else 0
    return Policy(comm, above, f"env GCMOE_COMM_SMS={comm}", comm, above)


def _entry(entry, sm_count: int, what: str) -> tuple[int, int]:
    """(comm_sms, unpartitioned_above) of one cache entry, else ValueError / KeyError / TypeError naming `what`."""
    comm = check_comm_sms(entry["comm_sms"], sm_count, f"{what}.comm_sms")
    above = entry["unpartitioned_above"]
    if type(above) is not int or above < 0:
        raise ValueError(f"{what}.unpartitioned_above must be an int >= 0, got {above!r}")
    return comm, above


def _warn(path: Path, what: str, error: Exception, then: str = "") -> None:
    warnings.warn(f"gcmoe: ignoring the tuned {what} {path}: {error}{then}", RuntimeWarning, stacklevel=4)


def _from_cache(cfg: MoEConfig, device_name: str, sm_count: int) -> Policy | None:
    path = cache_path(cfg, device_name)
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        if data["key"] != shape_key(cfg, device_name):
            raise ValueError(f"it was tuned for {data['key']}")
        comm, above = _entry(data["policy"], sm_count, "policy")
    except (OSError, ValueError, KeyError, TypeError) as e:
        _warn(path, "partition policy", e)
        return None
    two = (0, 0)
    if data.get("two_batch") is not None:
        try:
            two = _entry(data["two_batch"], sm_count, "two_batch")
        except (ValueError, KeyError, TypeError) as e:
            _warn(path, "two-batch partition policy", e, " (two-batch calls never partition)")
    return Policy(comm, above, f"tuned {path}", *two)


def policy(cfg: MoEConfig, device_name: str, sm_count: int) -> Policy:
    """The partition policy for a layer of this shape on this device: GCMOE_COMM_SMS, else the tuned cache file,
    else the device's default, else the generic default (see the module docstring)."""
    found = _from_env(sm_count) or _from_cache(cfg, device_name, sm_count)
    if found is not None:
        return found
    comm, above, two_comm, two_above = DEFAULTS.get(device_name, GENERIC_DEFAULT)
    source = f"default for {device_name}" if device_name in DEFAULTS else f"generic default ({device_name} not tuned)"
    valid = valid_comm_sizes(sm_count, GRANULARITY)
    if any(c and c not in valid for c in (comm, two_comm)):
        return Policy(0, 0, f"{source}: {sm_count} SMs cannot give it {comm or two_comm} comm SMs")
    return Policy(comm, above, source, two_comm, two_above)
