"""Layer pools: the call state of a model's layers, shared by the layers that never run at the same time.

    pool = gcmoe.LayerPool()                                   # or gcmoe.default_pool() (what layers use unless told)
    layers = [gcmoe.MoELayer(cfg, "cuda", pool=pool, name=f"layers.{i}.mlp") for i in range(58)]
    pool.check()                                               # once per step: no device sync
    pool.recover()                                             # after a CommError: once per rank, for every layer

A backend keeps a call's transient state (token ring, W1 output, signal words, argument slots, green contexts) in a
lane. Calls of one lane run one after another, so the layers of one shape class (equal MoEConfig and options: a
model's MoE layers) take one lane per stream (world size 1) or per micro-batch (P > 1, see micro_batch): N layers hold
one lane per concurrent call, not N. Two calls at once (two streams, two micro-batches) get two lanes; one lane used
by two calls at once fails loudly on the device (CommError, kind BUSY). The pool holds lanes weakly (the layers hold
them). Each lane keeps the first bad routing entry and the first failed wait of its captured calls in pinned words
with the call's ticket, which names the layer: check() reads them without a sync (what completed so far).
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import weakref

import torch

MICRO_BATCHES = 2  # lanes per shape class at world size P > 1 (made at load: they are collective)

_MICRO_BATCH: contextvars.ContextVar[int | None] = contextvars.ContextVar("gcmoe_micro_batch", default=None)


@contextlib.contextmanager
def micro_batch(index: int):
    """Calls inside belong to a two-micro-batch schedule and take micro-batch `index`'s lane (0 or 1). At P > 1 every
    rank calls a micro-batch's layers under the same index (the ranks' lanes pair up by it); at world size 1 the
    caller's stream separates calls. Inside, a layer takes its policy's two-batch partition choice
    (gcmoe.policy.Policy.mode_for) and, at P > 1, keeps each kernel that waits on peers to a grid that leaves the
    other micro-batch SMs to progress on (gcmoe.backends.sm90.Sm90Plan.spin_caps): two calls in flight never fill the
    device with spinning CTAs. Outside any block: one call in flight per rank (micro-batch 0's lane)."""
    if index not in range(MICRO_BATCHES):
        raise ValueError(f"gcmoe: micro_batch: index {index} outside [0, {MICRO_BATCHES})")
    token = _MICRO_BATCH.set(index)
    try:
        yield
    finally:
        _MICRO_BATCH.reset(token)


def current_micro_batch() -> int:
    """The micro-batch index of calls made here (0 outside any micro_batch block)."""
    return _MICRO_BATCH.get() or 0


def in_micro_batch() -> bool:
    """Whether calls made here belong to a two-micro-batch schedule (inside a micro_batch block)."""
    return _MICRO_BATCH.get() is not None


class LayerPool:
    """Lanes shared by layers of one shape class (see the module docstring)."""

    def __init__(self):
        self._lanes: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._shared: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._names: dict[int, str] = {}  # call ticket -> layer name (for errors)
        self._setup: dict = {}  # device -> OwnedStream for set-up work under a caller's capture
        self._lock = threading.RLock()

    def setup_stream(self, device: torch.device):
        """The pool's own stream on `device` for set-up work that must stay out of a caller's capture."""
        s = self._setup.get(device)
        if s is None:
            from gcmoe_greenctx import OwnedStream

            s = self._setup.setdefault(device, OwnedStream(device))
        return s

    def lane(self, key, make):
        """The lane under `key` (made by make() if none is alive)."""
        return self._lanes.get(key) or self._made(self._lanes, key, make)

    def shared(self, key, make):
        """Any other object layers of a shape class share (e.g. a set of virtual ranks' workspaces), held weakly."""
        return self._made(self._shared, key, make)

    def _made(self, table, key, make):
        with self._lock:
            obj = table.get(key)
            if obj is None:
                obj = table[key] = make()
            return obj

    def lanes(self) -> list:
        return list(self._lanes.values())

    def name_ticket(self, ticket: int, name: str) -> None:
        self._names[ticket] = name

    def layer_of(self, ticket: int) -> str:
        return self._names.get(ticket, f"the call with ticket {ticket}")

    def check(self) -> None:
        """Raise the first error a call of this pool's layers recorded (ValueError: a bad routing entry, dropped;
        CommError: a failed cross-rank wait, the step's outputs from that layer on are NaN until recover()), naming
        the layer. No device sync: it reads pinned words the kernels wrote, so it covers the calls that completed."""
        for lane in self.lanes():
            lane.check_step()

    def recover(self) -> None:
        """After a CommError: reset every lane's cross-rank state (collective at P > 1: every rank calls it once)."""
        for lane in self.lanes():
            lane.recover()

    def memory_bytes(self) -> int:
        """Device bytes the pool's live lanes hold (workspaces, W1 outputs, scratch)."""
        return sum(lane.nbytes for lane in self.lanes())

    def describe(self) -> dict:
        return {"lanes": len(self._lanes), "memory_bytes": self.memory_bytes()}


_DEFAULT: dict[torch.device, LayerPool] = {}


def default_pool(device=None) -> LayerPool:
    """The pool every layer on `device` (default: the current CUDA device) uses unless given one."""
    d = torch.device(device if device is not None else "cuda")
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    pool = _DEFAULT.get(d)
    if pool is None:
        pool = _DEFAULT.setdefault(d, LayerPool())
    return pool
