"""One MoE layer as a captured CUDA graph of role nodes on the two partitions, replayed with no re-capture.

    roles = RoleNodes(dispatch=..., compute=..., finalize=..., shared=None)   # callables that enqueue work
    graph = LayerGraph.capture(partition, roles, overlap=True)
    graph.replay()                       # only tensor *contents* changed since capture

    cache = LayerGraphCache(partition, build=lambda bucket: roles_for(bucket), buckets=(1, 2, 4, 8, ..., 256))
    cache.replay(tokens=13)              # captures the 16-token bucket once, then replays it

Shape of the captured graph (fork/join events between the partitions):

    caller stream ──► fork ──┬──► [comm stream]    dispatch ───────────────────────────┐
                             └──► [compute stream] (wait dispatch if not overlap)       │
                                                   compute ─► finalize ─► shared? ──► join ◄┘ ──► caller stream

- A kernel node takes its SM partition from the stream it was captured on (green-context streams), so the graph
  replays with dispatch on the comm SMs and compute/finalize on the compute SMs.
- overlap=True: compute starts at once and synchronises with dispatch through device-side signals (the token ring);
  overlap=False: compute waits on dispatch with a graph edge (for roles that have no device-side signalling).
- Kernel parameters (pointers, tensor maps, peer tables) are baked into the nodes at capture: replays patch nothing
  on the host. Inputs must therefore live in static buffers that the roles read; callers copy new contents in.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .partition import Partition


@dataclass(frozen=True)
class RoleNodes:
    dispatch: Callable[[], None]
    compute: Callable[[], None]
    finalize: Callable[[], None]
    shared: Callable[[], None] | None = None


def enqueue_roles(
    part: Partition,
    roles: RoleNodes,
    overlap: bool,
    streams: tuple[torch.cuda.Stream, torch.cuda.Stream] | None = None,
) -> None:
    """Enqueue one layer's role nodes on the partition streams, forked from and joined back to the current stream.
    The same function runs eagerly and under capture, so eager and replayed layers are the same work. streams:
    another (comm, compute) pair of this partition (Partition.new_streams) instead of its own pair."""
    comm_stream, compute_stream = streams or (part.comm_stream, part.compute_stream)
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
        if roles.shared is not None:
            roles.shared()
    computed = torch.cuda.Event()
    computed.record(compute_stream)
    origin.wait_event(dispatched)
    origin.wait_event(computed)


class LayerGraph:
    """A captured layer; replay() launches it on the caller's current stream."""

    def __init__(self, graph: torch.cuda.CUDAGraph, part: Partition, roles: RoleNodes):
        self.graph, self.partition, self.roles = graph, part, roles

    @classmethod
    def capture(cls, part: Partition, roles: RoleNodes, overlap: bool = True, warmup: int = 1, pool=None) -> LayerGraph:
        side = torch.cuda.Stream(device=part.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):  # first-call work (allocations, lazy init, JIT) stays out of the graph
                enqueue_roles(part, roles, overlap)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize(part.device)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool, stream=side):
            enqueue_roles(part, roles, overlap)
        return cls(g, part, roles)

    def replay(self) -> None:
        self.graph.replay()


class LayerGraphCache:
    """Captured layer graphs keyed by token-count bucket (the smallest bucket >= T); captured on first use."""

    def __init__(
        self, part: Partition, build: Callable[[int], RoleNodes], buckets: Sequence[int], overlap: bool = True
    ):
        if not buckets or sorted(set(buckets)) != list(buckets) or buckets[0] < 1:
            raise ValueError(f"buckets must be increasing positive ints, got {list(buckets)}")
        self.partition, self.build, self.buckets, self.overlap = part, build, list(buckets), overlap
        self.graphs: dict[int, LayerGraph] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def bucket(self, tokens: int) -> int:
        i = bisect.bisect_left(self.buckets, tokens)
        if tokens < 1 or i == len(self.buckets):
            raise ValueError(f"tokens = {tokens} outside the captured buckets 1..{self.buckets[-1]}")
        return self.buckets[i]

    def get(self, tokens: int) -> LayerGraph:
        b = self.bucket(tokens)
        if b not in self.graphs:
            self.graphs[b] = LayerGraph.capture(self.partition, self.build(b), self.overlap, pool=self.pool)
        return self.graphs[b]

    def replay(self, tokens: int) -> int:
        """Replay the graph of `tokens`' bucket; returns the bucket."""
        g = self.get(tokens)
        g.replay()
        return self.bucket(tokens)
