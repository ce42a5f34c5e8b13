"""One MoE layer as role nodes on the two partitions: the same enqueue runs eagerly and under a CUDA-graph capture
(the layer's owner, e.g. gcmoe's sm90 backend, captures it once per token bucket and replays it).

    roles = RoleNodes(dispatch=..., compute=..., finalize=...)   # callables that enqueue work
    enqueue_roles(partition, roles, overlap=True)   # eagerly, or inside torch.cuda.graph(...) to record the nodes

Shape of the enqueued (or captured) work (fork/join events between the partitions):

    caller stream ──► fork ──┬──► [comm stream]    dispatch ───────────────────────────┐
                             └──► [compute stream] (wait dispatch if not overlap)       │
                                                   compute ─► finalize ──────────► join ◄┘ ──► caller stream

- A kernel node takes its SM partition from the stream it was captured on (green-context streams), so the graph
  replays with dispatch on the comm SMs and compute/finalize on the compute SMs.
- overlap=True: compute starts at once and synchronises with dispatch through device-side signals (the token ring);
  overlap=False: compute waits on dispatch with a graph edge (for roles that have no device-side signalling).
- Kernel parameters (pointers, tensor maps, peer tables) are baked into the nodes at capture: replays patch nothing
  on the host. Inputs must therefore live in static buffers that the roles read; callers copy new contents in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .partition import Partition


@dataclass(frozen=True)
class RoleNodes:
    dispatch: Callable[[], None]
    compute: Callable[[], None]
    finalize: Callable[[], None]


def enqueue_roles(part: Partition, roles: RoleNodes, overlap: bool) -> None:
    """Enqueue one layer's role nodes on the partition streams, forked from and joined back to the current stream.
    The same function runs eagerly and under capture, so eager and replayed layers are the same work."""
    comm_stream, compute_stream = part.comm_stream, part.compute_stream
    origin = torch.cuda.current_stream()
    fork = torch.cuda.Event()
    fork.record(origin)
    comm_stream.wait_event(fork)
    compute_stream.wait_event(fork)
    with torch.cuda.stream(comm_stream):
        roles.dispatch()
    dispatched = torch.cuda.Event()
    dispatched.record(comm_stream)
    with torch.cuda.stream(compute_stream):
        if not overlap:
            compute_stream.wait_event(dispatched)
        roles.compute()
        roles.finalize()
    computed = torch.cuda.Event()
    computed.record(compute_stream)
    origin.wait_event(dispatched)
    origin.wait_event(computed)
