"""The GCMOE_* environment variables — one table, read in one place (README's table is checked against it)."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str
    meaning: str


ENV_VARS: tuple[EnvVar, ...] = (
    EnvVar("GCMOE_BACKEND", "auto", "force a backend: auto, reference, sm90, sm103"),
    EnvVar(
        "GCMOE_CACHE_DIR",
        "~/.cache/gcmoe",
        "on-disk cache of compiled kernels (keyed on source, config, arch) and of tuned partition policies (tune/)",
    ),
    EnvVar("GCMOE_ARCH", "(from the device)", "compile target when no GPU is present: sm_90a, sm_100a or sm_103a"),
    EnvVar(
        "GCMOE_CHECK_VALUES", "1", "0: skip the device-read value checks (ids range, finite weights) in eager calls"
    ),
    EnvVar(
        "GCMOE_COMM_TIMEOUT_MS",
        "5000",
        "bound on every cross-rank wait in the comm kernels; on expiry the kernel records rank, counter and "
        "generation and the host raises CommError",
    ),
    EnvVar(
        "GCMOE_COMM_SMS",
        "(tuned)",
        "force the comm partition size in SMs; 0 = no partition. Unset: the policy `gcmoe tune` cached for the "
        "device and shape, else the device's default (gcmoe.policy)",
    ),
)
_BY_NAME = {v.name: v for v in ENV_VARS}
# GCMOE_CHECK_VALUES is read on every eager call: os.environ.get of an unset name raises and catches KeyError inside
# (~4 µs), so get() looks in the bytes dict behind os.environ (POSIX; os.environ writes it through) where it has one
_RAW = getattr(os.environ, "_data", None) if os.name == "posix" else None
_RAW_KEYS = {v.name: os.fsencode(v.name) for v in ENV_VARS}


def get(name: str) -> str:
    """The variable's value, or its default; unknown names are a programming error."""
    v = _BY_NAME[name]
    if _RAW is None:
        return os.environ.get(name, v.default)
    raw = _RAW.get(_RAW_KEYS[name])
    return v.default if raw is None else os.fsdecode(raw)


def get_optional(name: str) -> str | None:
    """The variable's value, or None when it is unset or blank (for variables whose default is derived)."""
    _BY_NAME[name]  # unknown names are a programming error, as in get()
    return os.environ.get(name, "").strip() or None


def get_int(name: str) -> int:
    raw = get(name)
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None


def get_bool(name: str) -> bool:
    return _truthy(get(name))


@functools.lru_cache(maxsize=64)
def _truthy(raw: str) -> bool:
    return raw.strip().lower() not in ("0", "false", "no", "off", "")


def cache_dir() -> Path:
    return Path(os.path.expanduser(get("GCMOE_CACHE_DIR")))
