"""Split one GPU's SMs into a communication partition and a compute partition with CUDA Green Contexts.

    part = split_device(comm_sms=16)                 # comm = a structured group of 16 SMs, compute = the remainder
    with torch.cuda.stream(part.comm_stream): ...     # kernels launched (or captured) here run on the comm SMs only
    part.close()                                       # its green contexts and streams destroyed (or when dropped)

- Sizes are requested in SMs and rounded UP to the split granularity (max(minSmPartitionSize,
  smCoscheduledAlignment): 8 on H100/H200); the compute partition is the remainder, which keeps every SM busy.
  `plan_split` does the arithmetic in pure Python so the rules are tested on a CPU.
- A Partition belongs to whoever asked for it: each split_device call makes green contexts of its own (splits of
  different sizes may coexist; their SM sets then overlap), destroyed by close() or when the Partition is dropped.
- Isolation: on drivers with CUDA >= 13.1 each green context also gets a workqueue config (GREEN_CTX_BALANCED,
  concurrency 1) so the partitions do not share hardware work queues; older drivers reject it (a warning, once).
- The streams are the green contexts' own (cuGreenCtxStreamCreate) wrapped as torch streams.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Literal

import torch

Mode = Literal["green", "unpartitioned", "auto"]


class GreenContextError(RuntimeError):
    """A green-context operation failed; the message says what would work."""


@dataclass(frozen=True)
class SmFacts:
    """What the device and driver allow. Fields are None where they could not be read."""

    device: int
    sm_count: int | None
    min_partition_size: int | None
    coscheduled_alignment: int | None
    driver_version: int | None  # e.g. 13000 for CUDA 13.0
    green_contexts: bool
    workqueue_config: bool  # driver >= 13.1: per-partition workqueue isolation available
    split_api: str | None  # "cuDevSmResourceSplit" (driver >= 13.1) or "cuDevSmResourceSplitByCount"
    reason: str | None = None  # why green contexts are unavailable

    @property
    def granularity(self) -> int | None:
        if self.min_partition_size is None or self.coscheduled_alignment is None:
            return None
        return max(self.min_partition_size, self.coscheduled_alignment)

    def as_dict(self) -> dict:
        return {**self.__dict__, "granularity": self.granularity}


def _driver():
    from cuda.bindings import driver

    return driver


def _check(result, what: str):
    """Unwrap a cuda-bindings (err, *values) tuple or raise GreenContextError naming the call and the error."""
    drv = _driver()
    err, *vals = result if isinstance(result, tuple) else (result,)
    if err != drv.CUresult.CUDA_SUCCESS:
        _, name = drv.cuGetErrorName(err)
        code = int(err)
        raise GreenContextError(f"{what} failed: {name.decode() if isinstance(name, bytes) else name} ({code})")
    return vals[0] if len(vals) == 1 else tuple(vals)


def device_facts(device: int = 0) -> SmFacts:
    """Read the SM resource facts of `device` through the driver API (no context is created)."""
    try:
        drv = _driver()
        _check(drv.cuInit(0), "cuInit")
        version = _check(drv.cuDriverGetVersion(), "cuDriverGetVersion")
        dev = _check(drv.cuDeviceGet(device), "cuDeviceGet")
        res = _check(
            drv.cuDeviceGetDevResource(dev, drv.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM), "cuDeviceGetDevResource(SM)"
        )
    except ImportError as e:
        return SmFacts(device, None, None, None, None, False, False, None, f"cuda-bindings not importable: {e}")
    except (GreenContextError, RuntimeError, OSError) as e:
        return SmFacts(device, None, None, None, None, False, False, None, f"no CUDA driver/device: {e}")
    sm = res.sm
    wq = int(version) >= 13010
    split = "cuDevSmResourceSplit" if wq and hasattr(drv, "cuDevSmResourceSplit") else "cuDevSmResourceSplitByCount"
    return SmFacts(
        device,
        int(sm.smCount),
        int(sm.minSmPartitionSize),
        int(sm.smCoscheduledAlignment),
        int(version),
        True,
        wq,
        split,
    )


@dataclass(frozen=True)
class SplitPlan:
    comm_sms: int
    compute_sms: int
    requested: int


def valid_comm_sizes(sm_count: int, granularity: int) -> list[int]:
    """Comm partition sizes that leave at least one granule for compute."""
    return list(range(granularity, sm_count - granularity + 1, granularity))


def plan_split(requested_comm_sms: int, sm_count: int, min_partition_size: int, alignment: int) -> SplitPlan:
    """Round a requested comm size up to the granularity and check both partitions are legal (pure Python)."""
    if not isinstance(requested_comm_sms, int) or requested_comm_sms < 1:
        raise ValueError(f"comm_sms must be a positive int, got {requested_comm_sms!r}")
    gran = max(min_partition_size, alignment)
    comm = max(min_partition_size, -(-requested_comm_sms // alignment) * alignment)
    if comm > sm_count - gran:
        sizes = valid_comm_sizes(sm_count, gran)
        raise ValueError(
            f"comm_sms={requested_comm_sms} rounds to {comm} SMs, leaving {sm_count - comm} of {sm_count} for compute; "
            f"the compute partition needs at least {gran}. Valid comm sizes on this device: "
            f"{sizes[0]}..{sizes[-1]} in steps of {gran}"
            if sizes
            else f"this device ({sm_count} SMs) cannot be split"
        )
    return SplitPlan(comm, sm_count - comm, requested_comm_sms)


@dataclass
class Partition:
    """Two streams bound to disjoint SM sets (mode 'green') or to the whole GPU (mode 'unpartitioned')."""

    device: int
    mode: str
    comm_sms: int
    compute_sms: int
    comm_stream: torch.cuda.Stream
    compute_stream: torch.cuda.Stream
    facts: SmFacts
    workqueue_isolated: bool = False
    _handles: list = field(default_factory=list, repr=False)  # green contexts and streams to destroy
    _owned: list = field(default_factory=list, repr=False)  # unpartitioned mode: its OwnedStreams

    def close(self) -> None:
        """Destroy this split's streams and green contexts, once the work enqueued on its streams has finished (the
        driver does not promise that for a green context destroyed under running work). Graphs captured on its
        streams must not be replayed afterwards."""
        owned, self._owned = self._owned, []
        for s in owned:
            s.close()  # (a runtime stream: destroyed once its work completes)
        if self._handles:
            from .streams import capturing, relaxed_capture

            try:
                with relaxed_capture():  # (legal while another stream captures: these streams are not part of it)
                    for s in (self.comm_stream, self.compute_stream):
                        if not capturing(s):
                            s.synchronize()
                    _destroy(self._handles)
            except Exception:  # (interpreter shutdown: the driver may be gone already)
                pass

    def __del__(self):
        self.close()

    def describe(self) -> str:
        wq = "workqueue-isolated" if self.workqueue_isolated else "shared workqueues"
        return f"{self.mode}: comm {self.comm_sms} SMs | compute {self.compute_sms} SMs ({wq})"


_WARNED_WQ = False


def _warn_workqueue_once(why: str) -> None:
    global _WARNED_WQ
    if not _WARNED_WQ:
        _WARNED_WQ = True
        warnings.warn(
            f"gcmoe: green-context workqueue isolation unavailable ({why}); partitions share workqueues",
            RuntimeWarning,
            stacklevel=3,
        )


def _workqueue_resource(dev):
    """A WORKQUEUE_CONFIG resource with GREEN_CTX_BALANCED scope and concurrency 1, or None (older driver)."""
    drv = _driver()
    res = _check(
        drv.cuDeviceGetDevResource(dev, drv.CUdevResourceType.CU_DEV_RESOURCE_TYPE_WORKQUEUE_CONFIG),
        "cuDeviceGetDevResource(WORKQUEUE_CONFIG)",
    )
    res.wqConfig.sharingScope = drv.CUdevWorkqueueConfigScope.CU_WORKQUEUE_SCOPE_GREEN_CTX_BALANCED
    res.wqConfig.wqConcurrencyLimit = 1
    return res


def _green_stream(dev, resources: list, device: int, handles: list) -> torch.cuda.Stream:
    drv = _driver()
    desc = _check(drv.cuDevResourceGenerateDesc(resources, len(resources)), "cuDevResourceGenerateDesc")
    gctx = _check(
        drv.cuGreenCtxCreate(desc, dev, drv.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM), "cuGreenCtxCreate"
    )
    handles.append(("ctx", gctx))
    stream = _check(
        drv.cuGreenCtxStreamCreate(gctx, drv.CUstream_flags.CU_STREAM_NON_BLOCKING, 0), "cuGreenCtxStreamCreate"
    )
    handles.append(("stream", stream))
    return torch.cuda.get_stream_from_external(int(stream), device)


def _create_green(device: int, plan: SplitPlan, facts: SmFacts) -> Partition:
    drv = _driver()
    torch.cuda.init()
    torch.cuda.set_device(device)
    torch.empty(1, device=f"cuda:{device}")  # make sure the primary context is active before green contexts
    dev = _check(drv.cuDeviceGet(device), "cuDeviceGet")
    res = _check(
        drv.cuDeviceGetDevResource(dev, drv.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM), "cuDeviceGetDevResource(SM)"
    )
    try:
        groups, n, remaining = _check(
            drv.cuDevSmResourceSplitByCount(1, res, 0, plan.comm_sms),
            f"cuDevSmResourceSplitByCount(minCount={plan.comm_sms})",
        )
    except GreenContextError as e:
        sizes = valid_comm_sizes(facts.sm_count, facts.granularity)
        raise GreenContextError(f"{e}; valid comm sizes on this device: {sizes}") from None
    comm_res = groups[0]
    got_comm, got_compute = int(comm_res.sm.smCount), int(remaining.sm.smCount)
    if n != 1 or got_comm < plan.comm_sms or got_compute < 1:
        raise GreenContextError(
            f"driver split gave {n} group(s) of {got_comm} SMs + {got_compute} remaining for a "
            f"requested {plan.comm_sms}-SM comm partition"
        )
    handles: list = []
    wq = None
    if facts.workqueue_config:
        try:
            wq = _workqueue_resource(dev)
        except GreenContextError as e:
            _warn_workqueue_once(str(e))
    else:
        _warn_workqueue_once(f"driver CUDA {facts.driver_version} < 13.1")
    try:
        extra = [wq] if wq is not None else []
        try:
            comm_stream = _green_stream(dev, [comm_res, *extra], device, handles)
            compute_stream = _green_stream(dev, [remaining, *extra], device, handles)
        except GreenContextError as e:
            if not extra:
                raise
            _warn_workqueue_once(str(e))  # e.g. CUDA_ERROR_INVALID_RESOURCE_TYPE (914) on a CUDA 13.0 driver
            _destroy(handles)
            wq = None
            comm_stream = _green_stream(dev, [comm_res], device, handles)
            compute_stream = _green_stream(dev, [remaining], device, handles)
    except BaseException:
        _destroy(handles)
        raise
    return Partition(
        device,
        "green",
        got_comm,
        got_compute,
        comm_stream,
        compute_stream,
        facts,
        wq is not None,
        handles,
    )


def _destroy(handles: list) -> None:
    drv = _driver()
    for kind, h in reversed(handles):
        if kind == "stream":
            drv.cuStreamDestroy(h)
        else:
            drv.cuGreenCtxDestroy(h)
    handles.clear()


def split_device(comm_sms: int = 16, device: int | None = None, mode: Mode = "green") -> Partition:
    """A new partition pair of the device, owned by the caller (close() or drop it to destroy it).

    mode 'green' needs green-context support and raises GreenContextError otherwise; 'auto' falls back to
    'unpartitioned' (with a warning) where green contexts are unavailable; 'unpartitioned' gives two streams of its
    own on the whole GPU with the same interface (sizes then report the full SM count for both)."""
    from .streams import OwnedStream

    if mode not in ("green", "unpartitioned", "auto"):
        raise ValueError(f"mode must be 'green', 'unpartitioned' or 'auto', got {mode!r}")
    if not torch.cuda.is_available():
        raise GreenContextError("no CUDA device: partitions need a GPU (torch.cuda.is_available() is False)")
    device = torch.cuda.current_device() if device is None else device
    facts = device_facts(device)
    if mode == "unpartitioned" or (mode == "auto" and not facts.green_contexts):
        if mode == "auto":
            warnings.warn(
                f"gcmoe: green contexts unavailable ({facts.reason}); running unpartitioned",
                RuntimeWarning,
                stacklevel=2,
            )
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        owned = [OwnedStream(device), OwnedStream(device)]
        return Partition(device, "unpartitioned", sms, sms, owned[0].stream, owned[1].stream, facts, _owned=owned)
    if not facts.green_contexts:
        raise GreenContextError(f"green contexts unavailable on device {device}: {facts.reason}")
    plan = plan_split(comm_sms, facts.sm_count, facts.min_partition_size, facts.coscheduled_alignment)
    return _create_green(device, plan, facts)
