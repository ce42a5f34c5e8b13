"""The sm90 backend: one layer = gcmoe-comm's publish / dispatch and finalize kernels around gcmoe-gemm-sm90's W1 / W2,
in order on the caller's stream or, where the partition policy (gcmoe.policy) gives the bucket comm SMs, on two
green-context partitions; replayed as a captured role graph per token bucket. This module owns the layer's pipeline
(the component packages export kernels only).

    call on rank r, T tokens (T <= max_tokens_per_rank), bucket = the power of two >= T, partitioned:

      caller stream ──fork──┬─ comm partition:    publish (FP8 x, routing + shared slots, READY) ─► dispatch (ring)
                            └─ compute partition: W1 (waits OFFS, each block's L1_FULL) ─► W2 (scatter to the source
                                                  ranks' combine buffers) ─► finalize (combined, RECV, slot sum) ─► y
      ──join──► caller stream

    The shared experts ride the ring as local experts E/P .. E/P + S - 1 of every rank, fed from its own tokens (the
    design's fourth node, fused into W1 / W2 instead of a fifth and sixth launch).
    At T = 1 (bucket 1), beside publish and dispatch on a side branch forked from the caller's stream and joined
    back at the end: the shared experts' W1 weights prefetched into L2 (gcmoe_gemm_sm90.ops.prefetch_l2). Every call
    reads them, and HBM idles while the comm kernels' latency chains run; what counts is the second half of the
    ranges (the shared expert's last W1 tiles, which W1's last-launched CTAs read). Measured faster at one token and
    neutral from two on, so bucket 1 only (measured: docs/benchmarks/index.md, L2 prefetch and hint).
    comm_sms = 0 for the bucket (the tuned policy above its token threshold, or MoELayer(comm_sms=0)): the same five
    kernels on the caller's stream, in order.

Resources (owned by the plans and their lanes; nothing module-global):
    plan       per layer: the prepacked weights, the L2 prefetch ranges, one graph per (lane, token bucket) it served
               eagerly (captured on first use, no device sync), and the lanes it takes.
    lane       a call's transient state, shared by the layers of a shape class through their pool (gcmoe.pool: the
               rule and the checks): workspace, CommRank, W1 output, green-context splits per comm size, pinned
               argument slots, status and step check words, the device argument block, its own streams. P > 1 (or a
               process group): MICRO_BATCHES lanes made at load (Workspace.symmetric is collective) with every
               bucket's kernels loaded before the rendezvous. Every kernel is loaded into each CUDA context it
               launches in (the caller's, each green partition's: loads are lazy per context) before a capture could
               record its first launch there. Two captures replayed at once on one lane are refused on the device
               (ERR kind BUSY -> CommError), never silently mixed.
    teardown   a lane holds no plan, the pool holds lanes weakly: a dropped layer frees its graphs at once, the last
               one of a shape class its lanes. Dropped during someone's capture (the GC ran inside it), they release
               graphs, streams and partitions in relaxed capture mode (gcmoe_greenctx.relaxed_capture).
    streams    every stream the pool or a lane uses for itself is its own (gcmoe_greenctx.OwnedStream), never one of
               torch's pool, which past 32 objects can hand out the very stream a caller is capturing.
    eager call the call's pointers and T written to the next pinned staging slot, one async copy of it into the
               device argument block, the bucket's graph launched: two ctypes driver calls (gcmoe_greenctx.launch;
               host time: docs/benchmarks/index.md, Model step).
    captured   inside a caller's capture, the same kernels enqueued with arguments by value, on the lane's partition
               streams forked from the capture stream.
    checks     publish checks ids in [0, E) and finite weights on the device (a bad id is dropped, never
               dereferenced): ValueError at the lane's next eager call (which waits for the previous call's publish
               when values are checked); a failed cross-rank wait: CommError at the next call or layer.check(), and
               NaN from every later call on the lane until recover(). Captured calls: pool.check(). With
               MoEConfig.masked_ids an id of -1 is dropped the same way, unrecorded (its weight unchecked).

gpt-oss (MoEConfig.activation = "swiglu_clamped", has_bias): the same kernels compiled with their epilogue flags
(Sm90Config.activation / bias, from MoESm90.config_for): W1 adds b13 and clamps, W2 adds the ring row's routing
weight times b2 before its scatter. The layer sees H and I already padded (gcmoe.layer pads at load).

LayerOptions(emulate=True): the same pipeline in torch on any device (ring emulation, kernel models), for CPU CI.
"""

from __future__ import annotations

import contextlib
import math
import struct
import threading
import time
from dataclasses import replace

import torch
from cuda.bindings import driver as _driver

from gcmoe_comm.workspace import CommError, bad_input_message, error_message
from gcmoe_core.config import MoEConfig, check_call_values
from gcmoe_core.reference import MoEWeights, combine_slots
from gcmoe_greenctx import capturing, relaxed_capture
from gcmoe_greenctx.launch import copy_then_launch

from ..pool import MICRO_BATCHES, current_micro_batch, in_micro_batch
from .base import LayerOptions, cuda_missing, kernel_package_missing

L2_PREFETCH_MAX_BUCKET = 1  # the shared experts' W1 prefetched into L2 at these buckets (module docstring)
_SLOT = struct.Struct("<6q")  # a staging slot's words: x, ids, weights, out, T, ids are int64 (gcmoe_comm.kernels)
HOST_WAIT_S = 60.0  # the host never waits longer than this for the device to consume an argument slot


def _release(obj) -> None:
    """A plan's or lane's resources (graphs, streams, partitions, buffers) dropped in relaxed capture mode: the GC may
    run inside a caller's capture (the module docstring: teardown)."""
    try:
        with relaxed_capture():
            obj.__dict__.clear()
    except Exception:  # (interpreter shutdown)
        pass


def token_bucket(tokens: int) -> int:
    """The power of two >= tokens: calls of 5..8 tokens replay the graph captured for 8."""
    return 1 << (max(1, tokens) - 1).bit_length()


def ring_spec(cfg: MoEConfig):
    from gcmoe_comm.ring import RingSpec

    return RingSpec.from_config(cfg, bm=8)


class Sm90Backend:
    name = "sm90"
    auto = True

    def missing(self, device: torch.device, cfg: MoEConfig | None = None) -> str | None:
        why = cuda_missing(device, (9, 0)) or kernel_package_missing("gcmoe_gemm_sm90", cfg)
        if why is None and cfg is not None:
            from gcmoe_comm.comm import CommRank

            try:
                CommRank.validate_spec(ring_spec(cfg))
            except ValueError as e:
                return f"a routing table that fits the dispatch kernel's shared memory ({e})"
        return why

    def prepack(self, cfg: MoEConfig, weights: MoEWeights, device: torch.device) -> tuple[torch.Tensor, ...]:
        from gcmoe_gemm_sm90.ops import MoESm90

        return tuple(MoESm90.from_weights(weights).tensors())

    def plan(self, cfg: MoEConfig, tensors, device: torch.device, options: LayerOptions):
        if options.emulate:
            return Sm90EmulatedPlan(cfg, tensors, device, options)
        return Sm90Plan(cfg, tensors, device, options, pool=options.pool, name=options.name)


def _weights(cfg: MoEConfig, tensors, options: LayerOptions):
    from gcmoe_core.reference import Activation
    from gcmoe_gemm_sm90.ops import MoESm90

    moe = MoESm90.from_tensors(list(tensors), cfg.local_experts, Activation.of(cfg))  # (+ biases: cfg.has_bias)
    moe.cfg = options.kernel_config
    return moe


# ------------------------------------------------------------------------------------------------- the GPU plan
class Sm90Plan:
    """One layer on the sm90 path: its weights, its bucket graphs, and its lanes (drawn from the pool, gcmoe.pool).
    rank: this plan's virtual rank (virtual_ranks: the P ranks' lanes share one Workspace.virtual set); None: a
    process of P ranks (symmetric memory for ep_size > 1)."""

    def __init__(
        self,
        cfg: MoEConfig,
        tensors,
        device: torch.device,
        options: LayerOptions,
        rank: int | None = None,
        pool=None,
        name: str | None = None,
    ):
        from .. import policy as tune_policy
        from ..pool import default_pool

        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.cfg, self.device, self.options = cfg, device, options
        self.moe = _weights(cfg, tensors, options)
        self.spec = ring_spec(cfg)
        props = torch.cuda.get_device_properties(device)
        self.sm_count = props.multi_processor_count
        if options.comm_sms is None:
            self.policy = tune_policy.policy(cfg, props.name, self.sm_count)
        else:
            c = tune_policy.check_comm_sms(options.comm_sms, self.sm_count, "gcmoe: MoELayer(comm_sms=...)")
            above = math.inf if c else 0
            self.policy = tune_policy.Policy(c, above, f"MoELayer(comm_sms={c})", c, above)
        self.group = options.group
        self.rank = rank
        if cfg.ep_size > 1 and self.group is None and rank is None:
            import torch.distributed as dist

            if not dist.is_initialized():
                raise ValueError(
                    f"gcmoe: ep_size: P = {cfg.ep_size} needs a torch.distributed process group of P ranks "
                    "(init_process_group, then MoELayer(..., group=...) or the world group)"
                )
            self.group = dist.group.WORLD
        self.pool = pool if pool is not None else default_pool(device)
        self.name = name or f"an sm90 layer (H {cfg.hidden_size}, I {cfg.intermediate_size}, E {cfg.num_experts})"
        # the shape class: layers with equal keys share lanes (their kernels, buffers and signals are alike)
        group_key = None if self.group is None else self.group.group_name
        self._shape = (cfg, options.timeout_ms, options.kernel_config, group_key, str(device))
        self.collective = cfg.ep_size > 1 or self.group is not None  # lanes by micro-batch, made at load
        from gcmoe_gemm_sm90.kernel_prefetch import MAX_RANGES

        self.prefetch_ranges = self.moe.shared_w1_ranges()[:MAX_RANGES]
        self._lanes: dict = {}  # lane key -> Lane (held here; the pool holds them weakly)
        self._graphs: dict = {}  # (lane key, bucket) -> the bucket's captured role graph (the slot path)
        self._execs: dict = {}  # (lane key, bucket) -> its executable's handle (call() launches it)
        self._lock = threading.Lock()
        if self.collective:
            for m in range(MICRO_BATCHES):  # every micro-batch's lane: collective, so at load
                self._lane(("micro_batch", m))
            if rank is None:
                import torch.distributed as dist

                dist.barrier(self.group)
        else:
            self.lane(torch.cuda.current_stream(device))  # the load stream's lane: its kernels loaded

    __del__ = _release

    @contextlib.contextmanager
    def outside_capture(self):
        """Allocate and initialise (a lane, a partition, a kernel load) also while the caller's stream is being
        captured: relaxed capture mode for this thread and the pool's set-up stream, drained before the block ends,
        so the memsets and kernel loads are not recorded into the caller's graph."""
        if not torch.cuda.is_current_stream_capturing():
            yield
            return
        with relaxed_capture():
            setup = self.pool.setup_stream(self.device)
            with torch.cuda.stream(setup.stream):
                yield
                setup.stream.synchronize()

    # -- lanes
    def lane(self, stream: torch.cuda.Stream | int) -> Lane:
        """The lane of a call on `stream` (or its raw handle): collective (P > 1 or a process group): the current
        micro-batch's (gcmoe.micro_batch); else the stream's. Made on first use, taken from the pool when another
        layer of this shape class made it."""
        if self.collective:
            return self._lanes[("micro_batch", current_micro_batch())]
        key = stream if isinstance(stream, int) else stream.cuda_stream
        lane = self._lanes.get(key)
        return lane if lane is not None else self._lane(key)

    def _lane(self, key) -> Lane:
        with self._lock:
            lane = self._lanes.get(key)
            if lane is None:
                lane = self._lanes[key] = self.pool.lane((self._shape, key, self.rank), lambda: Lane(self, key))
                self._load(lane)
        return lane

    def _load(self, lane: Lane) -> None:
        """This layer's kernels loaded on a lane it takes (a no-op for configurations the lane has loaded); at P > 1
        every bucket's, before the first cross-rank wait: a rank that compiles a new shape for seconds while its
        peers already wait would look dead to them."""
        buckets = _buckets(self.cfg.max_tokens_per_rank) if self.collective else ()
        for b in buckets:
            for comm_sms in {self.policy.mode_for(b), self.policy.mode_for(b, two_batch=True)}:
                self._load_gemms(lane, self.kernel_config(b), comm_sms)
        if self.prefetch_ranges and not lane.prefetch_loaded:
            from gcmoe_gemm_sm90.ops import prefetch_l2

            with self.outside_capture():
                with torch.cuda.stream(lane.prefetch.stream):
                    prefetch_l2(self.prefetch_ranges)
                lane.prefetch.stream.synchronize()
            lane.prefetch_loaded = True

    def kernel_config(self, bucket: int):
        return self.moe.config_for(bucket, self.cfg.top_k)

    def first_row_expert(self) -> int:
        return first_row_expert(self.spec)

    def grid_rows(self, bucket: int, kcfg, comm_sms: int = 0) -> int | None:
        return grid_rows(self.cfg, self.spec, bucket, kcfg, self.sm_count, comm_sms)

    # -- LayerPlan
    def forward(self, x, topk_ids, topk_weights, check_values: bool) -> torch.Tensor:
        stream = torch._C._cuda_getCurrentRawStream(self.device.index)  # (the handle: no Stream object per call)
        lane = self._lanes.get(stream) or self.lane(stream)
        two_batch = in_micro_batch()
        if torch._C._cuda_isCurrentStreamCapturing():
            return self.enqueue_captured(lane, x, topk_ids, topk_weights, two_batch)
        return self.call(lane, x, topk_ids, topk_weights, check_values, stream, two_batch)

    def check(self) -> None:
        for lane in list(self._lanes.values()):
            lane.check()

    def recover(self) -> None:
        """After a CommError: zero every lane's signals (collective for P > 1) so calls start over."""
        for lane in list(self._lanes.values()):
            lane.recover()

    def describe(self) -> dict:
        buckets = _buckets(self.cfg.max_tokens_per_rank)
        return {
            "backend": "sm90",
            "device": str(self.device),
            "ep_size": self.cfg.ep_size,
            "policy": {
                "comm_sms": self.policy.comm_sms,
                "unpartitioned_above": self.policy.unpartitioned_above,
                "source": self.policy.source,
                "two_batch_comm_sms": self.policy.two_batch_comm_sms,
                "two_batch_unpartitioned_above": self.policy.two_batch_unpartitioned_above,
            },
            "comm_sms_by_bucket": {b: self.policy.mode_for(b) for b in buckets},
            "two_batch_comm_sms_by_bucket": {b: self.policy.mode_for(b, two_batch=True) for b in buckets},
            "n_tile_by_bucket": {b: self.kernel_config(b).n_tile for b in buckets},
            "lanes": len(self._lanes),
            "pool": self.pool.describe(),
        }

    # -- kernels
    def _gemms(self, lane: Lane, kcfg, ticket: int, comm_sms: int = 0, signals: int | None = None, rows=None):
        """W1 then W2 on the lane's ring (ring mode), on the current stream; stream_k W1 over one CTA per SM slot of
        the compute partition (all SMs but comm_sms; the configuration's occupancy slots per SM). signals: their
        signal words (default: the lane's workspace's). rows: their grid rows (grid_rows; default: one per ring
        expert)."""
        from gcmoe_gemm_sm90.ops import launch_w1, launch_w2

        x, sxT, rw, offs, cnt, dst, src = lane.ring
        sync = lane.ring_sync(ticket, signals)
        moe = self.moe
        sk_ctas = kcfg.occupancy * (self.sm_count - comm_sms)
        b13, b2 = moe.w13_bias, moe.w2_bias  # (gpt-oss) W2 adds the ring rows' route_w times b2
        rw2 = rw if b2 is not None else None
        grid = dict(grid_rows=rows, first_expert=self.first_row_expert())
        hq, hsT = lane.hq, lane.hsT
        launch_w1(moe.w13, x, sxT, rw, offs, cnt, hq, hsT, kcfg, sync, lane.sk_scratch, sk_ctas, b13, **grid)
        launch_w2(moe.w2, hq, hsT, offs, cnt, dst, src, lane.comb, kcfg, sync, rw2, b2, **grid)

    def _load_gemms(self, lane: Lane, kcfg, comm_sms: int = 0) -> None:
        """Compile + load one bucket's W1 / W2 (once per lane, configuration and placement) by launching them on
        signal words of their own, a scratch copy whose ERR says WARMUP: they return at once and touch nothing a call
        in flight uses, so this is legal at any time, under a caller's capture too (where a first launch would load
        the module inside the capture, and the load's synchronisation would invalidate it). Module loads are lazy
        per CUDA context and a green context is a context of its own: with comm_sms, on the partition's compute
        stream too (made here if new)."""
        kcfg = ring_kernel_config(kcfg)
        if (kcfg, comm_sms) in lane.loaded:
            return
        warm = lane.warm_signals.data_ptr()
        with self.outside_capture():
            self._gemms(lane, kcfg, 1, signals=warm)
            if comm_sms:
                compute = lane.partition(comm_sms, self.outside_capture).compute_stream
                if not capturing(compute):  # (a stream of this lane already forked into the caller's capture)
                    with torch.cuda.stream(compute):
                        self._gemms(lane, kcfg, 1, comm_sms, signals=warm)
                    compute.synchronize()  # nothing uncaptured left on a stream a capture may fork next
        lane.loaded.add((kcfg, comm_sms))

    def spin_caps(self, comm_sms: int, two_batch: bool) -> tuple[int | None, int | None]:
        """spin_caps for this plan's calls: two_batch (inside gcmoe.micro_batch) counts MICRO_BATCHES calls in flight
        per rank, P virtual ranks on one GPU count P times as many; a plan of one rank per GPU at P = 1 none."""
        calls = (MICRO_BATCHES if two_batch else 1) * (self.cfg.ep_size if self.rank is not None else 1)
        return spin_caps(self.sm_count, comm_sms, calls if self.cfg.ep_size > 1 else 1)

    def _enqueue(self, lane: Lane, bucket: int, ticket: int, publish, out: torch.Tensor | None, two_batch: bool):
        """The kernels of one call as role nodes (gcmoe_greenctx.enqueue_roles): publish + dispatch on the lane's
        comm stream (one kernel at world size 1: CommRank.publish_dispatch), W1, W2, finalize on its compute stream,
        forked from and joined back to the current stream; comm_sms = 0 for the bucket: all in order on the current
        stream. publish(dispatch_ctas) enqueues publish + dispatch (arguments by value or from the argument block).
        out: given (a caller's capture): finalize writes it and mirrors a failed wait to the lane's step words;
        None: the slot path's output and status words."""
        from gcmoe_greenctx import RoleNodes, enqueue_roles

        kcfg = ring_kernel_config(self.kernel_config(bucket))
        status = lane.step_status.data_ptr() if out is not None else lane.status.data_ptr()
        comm_sms = self.policy.mode_for(bucket, two_batch)
        # grids for the bucket: dispatch a CTA per ring block it can fill (on a partition: 2 per comm SM at most),
        # finalize a thread per 16 output bytes; both within spin_caps when calls in flight could fill the device
        dispatch_cap, finalize_cap = self.spin_caps(comm_sms, two_batch)
        dispatch_ctas = min(lane.comm.dispatch_grid(bucket, 2 * comm_sms or None), dispatch_cap or math.inf)
        finalize_ctas = min(lane.comm.finalize_grid(bucket), finalize_cap or math.inf)

        rows = self.grid_rows(bucket, kcfg, comm_sms)
        roles = RoleNodes(
            lambda: publish(dispatch_ctas),
            lambda: self._gemms(lane, kcfg, ticket, comm_sms, rows=rows),
            lambda: lane.comm.finalize(out, status=status, ctas=finalize_ctas),
        )
        with self._prefetch_beside(lane, bucket):
            if comm_sms == 0:
                for role in (roles.dispatch, roles.compute, roles.finalize):
                    role()
                return
            enqueue_roles(lane.partition(comm_sms, self.outside_capture), roles, overlap=True)

    @contextlib.contextmanager
    def _prefetch_beside(self, lane: Lane, bucket: int):
        """At bucket <= L2_PREFETCH_MAX_BUCKET: the shared experts' W1 weights prefetched into L2 on the lane's side
        stream, forked from the current stream before the call's kernels and joined back after them (a graph branch
        under a capture). The prefetch only reads the weights, which no call writes: it changes when bytes reach L2,
        never a value."""
        if not self.prefetch_ranges or bucket > L2_PREFETCH_MAX_BUCKET:
            yield
            return
        from gcmoe_gemm_sm90.ops import prefetch_l2

        here, side = torch.cuda.current_stream(self.device), lane.prefetch.stream
        side.wait_stream(here)
        with torch.cuda.stream(side):
            prefetch_l2(self.prefetch_ranges)
        try:
            yield
        finally:
            here.wait_stream(side)

    # -- the captured path (inside a caller's capture): by-value arguments
    def enqueue_captured(self, lane: Lane, x, topk_ids, topk_weights, two_batch: bool = False) -> torch.Tensor:
        from gcmoe_comm.comm import new_ticket

        t = x.shape[0]
        bucket = token_bucket(t)
        self._load_gemms(lane, self.kernel_config(bucket), self.policy.mode_for(bucket, two_batch))  # (uncaptured)
        out = torch.empty(t, self.cfg.hidden_size, dtype=torch.bfloat16, device=x.device)
        ticket = new_ticket()
        self.pool.name_ticket(ticket, self.name)
        status = lane.step_status.data_ptr()
        publish = lambda ctas: lane.comm.publish_dispatch(x, topk_ids, topk_weights, ticket, ctas, bucket, status)
        self._enqueue(lane, bucket, ticket, publish, out, two_batch)
        return out

    # -- the eager path: the bucket's graph, arguments through the lane's host slots
    def graph(self, lane: Lane, bucket: int, two_batch: bool = False) -> torch.cuda.CUDAGraph:
        """The bucket's captured role graph on this lane (the slot path) for one- or two-batch calls, captured on its
        first eager use: on the lane's own capture stream, this thread alone in capture mode, no device or stream
        synchronisation (the graph records launches; nothing runs until a replay, which the caller's stream
        orders)."""
        key = (lane.key, bucket, two_batch)
        g = self._graphs.get(key)
        if g is None:
            from gcmoe_comm.comm import new_ticket

            ticket = new_ticket()
            self.pool.name_ticket(ticket, self.name)
            ctas = lane.comm.publish_ctas(bucket)
            args, status = lane.args.data_ptr(), lane.status.data_ptr()
            publish = lambda dispatch_ctas: lane.comm.publish_dispatch_slots(
                args, status, ticket, ctas, dispatch_ctas, bucket
            )
            self._load_gemms(lane, self.kernel_config(bucket), self.policy.mode_for(bucket, two_batch))  # (+ split)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.stream(lane.capture_stream.stream):
                g.capture_begin(capture_error_mode="thread_local")
                try:
                    self._enqueue(lane, bucket, ticket, publish, None, two_batch)
                finally:
                    g.capture_end()
            self._graphs[key] = g
            self._execs[key] = g.raw_cuda_graph_exec() if hasattr(g, "raw_cuda_graph_exec") else 0  # (torch < 2.9: 0)
        return g

    def call(
        self, lane: Lane, x, topk_ids, topk_weights, check_values: bool, stream: int, two_batch: bool = False
    ) -> torch.Tensor:
        """The eager path on `stream` (the current one's handle): a few Python steps, the call's pointers packed into
        a pinned staging slot, one async copy of it and one graph launch (two ctypes calls: gcmoe_greenctx.launch)."""
        t = x.shape[0]
        n = lane.seq
        st = lane.status_np
        if st[8]:
            lane.raise_comm_error()
        if check_values and n > 0:
            if st[0] < n:
                lane.wait_done(n)  # the previous call's publish ran: its BAD words are in the status
            if st[1]:
                lane.raise_bad()
        if n >= lane.nslots and st[0] < n - lane.nslots + 1:
            lane.wait_done(n - lane.nslots + 1)  # staging slot n mod NSLOTS: its copy has run
        out = torch.empty_like(x)  # [T, H] bf16 like x (validated contiguous)
        key = (lane.key, token_bucket(t), two_batch)
        graph_exec = self._execs.get(key)
        if graph_exec is None:
            self.graph(lane, key[1], two_batch)
            graph_exec = self._execs[key]
        off = (n % lane.nslots) * lane.slot_bytes
        ptrs = (x.data_ptr(), topk_ids.data_ptr(), topk_weights.data_ptr(), out.data_ptr())
        _SLOT.pack_into(lane.slots_np, off, *ptrs, t, topk_ids.dtype == torch.int64)
        src, size = lane.slot0 + off, lane.slot_bytes
        fast = graph_exec and torch._C._cuda_getDevice() == self.device.index
        if not fast or copy_then_launch(lane.args_addr, src, size, graph_exec, stream):
            self._launch_on_device(lane, key, src, stream)
        lane.seq = n + 1
        return out

    def _launch_on_device(self, lane: Lane, key, src: int, stream: int) -> None:
        """The slow path of call(): with the layer's device current (another device was, or this thread had no
        current CUDA context, or torch has no graph handle), through cuda-python and CUDAGraph.replay."""
        with torch.cuda.device(self.device):
            dst, s = _driver.CUdeviceptr(lane.args_addr), _driver.CUstream(stream)
            err = _driver.cuMemcpyHtoDAsync(dst, src, lane.slot_bytes, s)[0]
            if err != _driver.CUresult.CUDA_SUCCESS:
                raise RuntimeError(f"gcmoe: copying the call's arguments to the device failed: {err}")
            self._graphs[key].replay()


class Lane:
    """The transient state of one call at a time, shared by the layers of a shape class (the module docstring's
    resources; gcmoe.pool). `plan` only configures it: a lane holds no layer."""

    def __init__(self, plan: Sm90Plan, key):
        from gcmoe_comm.comm import CommRank
        from gcmoe_comm.kernels import NSLOTS, SLOT_WORDS, STATUS_WORDS
        from gcmoe_comm.workspace import SIG_ERR, Workspace
        from gcmoe_core.signals import ERR_WARMUP
        from gcmoe_greenctx import OwnedStream

        cfg, spec, dev = plan.cfg, plan.spec, plan.device
        self.key, self.device, self.spec = key, dev, spec
        self.pool = plan.pool
        self.nslots = NSLOTS
        # normal tensors even when the lane is made under torch.inference_mode (an engine's warm-up): its buffers are
        # written in place by later calls and by recover(), which may run outside it
        with plan.outside_capture(), torch.inference_mode(False):
            if plan.rank is not None:  # a virtual rank: the P ranks' workspaces made together, held by each lane
                self.siblings = plan.pool.shared(
                    (plan._shape, key, "virtual"), lambda: _Workspaces(Workspace.virtual(spec, dev))
                )
                self.ws = self.siblings[plan.rank]
            elif plan.collective:
                self.ws = Workspace.symmetric(spec, plan.group)  # collective (a world-size-1 group: P = 1)
            else:
                self.ws = Workspace.virtual(spec, dev)[0]
            self.comm = CommRank(self.ws, timeout_ms=plan.options.timeout_ms, masked_ids=cfg.masked_ids)
            v = self.ws.views
            rows, inter = spec.capacity, cfg.intermediate_size
            self.hq = torch.zeros(rows, inter, dtype=torch.uint8, device=dev)
            self.hsT = torch.zeros(2 * inter // 256, rows, dtype=torch.float32, device=dev)
            self.comb = torch.empty(len(self.ws.combine_ptrs), dtype=torch.int64, device=dev)
            for q, ptr in enumerate(self.ws.combine_ptrs):  # (no host-to-device copy: legal under a capture too)
                self.comb[q].fill_(ptr)
            self.ring = (v.ring_x, v.ring_sxT, v.ring_w, v.ring_offsets, v.ring_counts, v.ring_dst, v.ring_src)
            # W1's stream_k scratch (partials + arrival counters) where a bucket's kernel configuration uses it
            sk_tiles = [c.n_tile for c in map(plan.kernel_config, _buckets(cfg.max_tokens_per_rank)) if c.stream_k]
            self.sk_scratch = None
            if sk_tiles:
                from gcmoe_gemm_sm90.ops import StreamKScratch

                self.sk_scratch = StreamKScratch.make(dev, max(sk_tiles))
            # each eager call's (x, ids, weights, out, T, ids-are-int64): written to a pinned staging slot, copied
            # (async, on the call's stream) into the device argument block the bucket graphs' publish reads
            self.slots = torch.zeros(NSLOTS, SLOT_WORDS, dtype=torch.int64, pin_memory=True)
            self.args = torch.zeros(SLOT_WORDS, dtype=torch.int64, device=dev)
            self.args_addr = self.args.data_ptr()
            self.slot0, self.slot_bytes = self.slots.data_ptr(), 8 * SLOT_WORDS
            self.status = torch.zeros(STATUS_WORDS, dtype=torch.int32, pin_memory=True)  # the slot path's
            self.step_status = torch.zeros(STATUS_WORDS, dtype=torch.int32, pin_memory=True)  # captured calls'
            self.slots_np, self.status_np = self.slots.numpy(), self.status.numpy()
            self.step_np = self.step_status.numpy()
            self.seq = 0  # slot calls issued
            self.partitions: dict = {}  # comm SMs -> this lane's green-context split (gcmoe_greenctx.Partition)
            self.capture_stream = OwnedStream(dev)  # where the bucket graphs are captured
            self.prefetch = OwnedStream(dev)  # the L2 prefetch branch
            self.prefetch_loaded = False
            self.comm.load()  # every comm kernel loaded before the first cross-rank wait
            # warm-up signal words (Sm90Plan._load_gemms, partition): zeros with ERR = WARMUP, never written by a kernel
            self.warm_signals = torch.zeros_like(self.ws.views.signals)
            self.warm_signals[SIG_ERR] = ERR_WARMUP
            torch.cuda.current_stream(dev).synchronize()  # set before a warm-up on another stream may read it
            self.loaded: set = set()  # (kernel configuration, comm SMs) whose W1 / W2 are loaded
        sk = () if self.sk_scratch is None else (self.sk_scratch.partials, self.sk_scratch.counters)
        self.nbytes = sum(b.numel() * b.element_size() for b in (self.ws.buf, self.hq, self.hsT, *sk))

    __del__ = _release

    def ring_sync(self, ticket: int, base: int | None = None):
        """The GEMMs' RingSync on the signal words at `base` (default: this lane's workspace)."""
        from gcmoe_comm.workspace import SIG_CGEN, SIG_ERR, SIG_INUSE, SIG_L1_FULL, SIG_OFFS, sig_w1_done
        from gcmoe_gemm_sm90.ops import RingSync

        base = self.ws.base if base is None else base
        # the compute role's waits end when this rank's dispatch has run, which itself waits up to the bound for its
        # peers: twice the bound, so a dead peer is reported as the root cause (its ready tag), not as this rank's ring
        return RingSync(
            base + 4 * SIG_INUSE,
            base + 4 * SIG_CGEN,
            base + 4 * SIG_OFFS,
            base + 4 * SIG_ERR,
            base + 4 * SIG_L1_FULL,
            base + 4 * sig_w1_done(self.ws.spec),
            ticket,
            2 * self.comm.timeout_ns,
        )

    def partition(self, comm_sms: int, outside_capture):
        """This lane's split of comm_sms SMs (its own green contexts), made outside any capture, with every comm kernel
        loaded into both partitions' contexts (see Sm90Plan._load_gemms)."""
        part = self.partitions.get(comm_sms)
        if part is None:
            from gcmoe_greenctx import split_device

            with outside_capture():
                part = split_device(comm_sms, self.device.index, mode="auto")
                for s in (part.comm_stream, part.compute_stream):
                    with torch.cuda.stream(s):
                        self.comm.load(self.warm_signals.data_ptr())
                    s.synchronize()
                self.partitions[comm_sms] = part
        return part

    # -- errors
    def wait_done(self, n: int) -> None:
        """Spin (sleeping) until the device's publish has consumed n slot calls."""
        st = self.status_np
        if int(st[0]) >= n:
            return
        start = time.monotonic()
        while int(st[0]) < n:  # spin first (the wait is usually µs; a sleep costs ~60 µs or more), then sleep
            waited = time.monotonic() - start
            if waited > 1e-3:
                self.raise_comm_error()
                if waited > HOST_WAIT_S:
                    raise RuntimeError(
                        f"gcmoe: the device consumed {int(st[0])} of {n} calls within {HOST_WAIT_S:.0f} s; is it hung?"
                    )
                time.sleep(1e-4)

    def raise_bad(self, words=None) -> None:
        """The BAD entry in the status words (the slot path's, or `words`) as ValueError naming the layer; cleared."""
        from gcmoe_comm.kernels import STATUS_BAD_TICKET

        st = self.status_np if words is None else words
        msg = bad_input_message([int(v) for v in st[1:5]], self.spec.num_experts)
        if msg is not None:
            layer = self.pool.layer_of(int(st[STATUS_BAD_TICKET]))
            st[1 : STATUS_BAD_TICKET + 1] = 0
            raise ValueError(f"{msg} [{layer}]")

    def raise_comm_error(self, words=None) -> None:
        from gcmoe_comm.kernels import STATUS_ERR_TICKET

        st = self.status_np if words is None else words
        if st[8] != 0:
            msg = error_message([int(v) for v in st[8:13]], self.ws.rank, self.spec.ranks)
            raise CommError(f"{msg} [first seen by {self.pool.layer_of(int(st[STATUS_ERR_TICKET]))}]")

    def check_step(self) -> None:
        """The captured calls' and the slot path's words (pinned; no sync): a failed wait, then a bad entry."""
        for words in (self.step_np, self.status_np):
            self.raise_comm_error(words)
        self.raise_bad(self.step_np)

    def check(self) -> None:
        torch.cuda.synchronize(self.device)
        self.check_step()
        self.ws.check()
        msg = self.ws.bad_input()
        if msg is not None:
            raise ValueError(msg)
        self.raise_bad()

    def recover(self) -> None:
        self.ws.recover()
        self.seq = 0
        self.status.zero_()
        self.step_status.zero_()


class _Workspaces(list):
    """A set of virtual ranks' workspaces (a list a pool can hold weakly)."""


def virtual_ranks(
    cfg: MoEConfig, weights: MoEWeights, device: torch.device, options: LayerOptions, pool=None
) -> list[Sm90Plan]:
    """cfg.ep_size = P ranks in this process on one GPU (tests, benchmarks): rank q's plan holds its experts of
    `weights` (every expert: MoEWeights.rank_slice, prepacked) and its lanes' workspaces of one Workspace.virtual set
    per lane, so dispatch pulls and the W2 scatter cross rank boundaries through the peer table exactly as across
    GPUs. Call each rank on its own stream (the ranks' kernels wait for each other); its micro-batch lanes as at
    P > 1 across processes (gcmoe.micro_batch). pool: the ranks' pool (default: the device's)."""
    p = cfg.ep_size
    tensors = [Sm90Backend().prepack(cfg, weights.rank_slice(q, p).to(device), device) for q in range(p)]
    return [
        Sm90Plan(cfg, t, device, options, rank=q, pool=pool or options.pool, name=options.name)
        for q, t in enumerate(tensors)
    ]


def ring_kernel_config(kcfg):
    """A bucket's kernel configuration as the layer launches it: ring mode beside gcmoe-comm's dispatch, whose ring
    blocks are 8 rows (the lab's precompile step compiles these ahead of a layer)."""
    return replace(kcfg, ring=True, ring_bm=8)


def first_row_expert(spec) -> int:
    """The ring expert of the W1 / W2 grids' first row: the shared experts (ring experts E/P .. E/P + S - 1) when
    there are any. Each has every token of the rank, so from T = 16 on it has the most rows (N-tile passes) of any
    expert; launched last, its extra passes would run after every other CTA had finished."""
    return spec.local_experts if spec.shared else 0


def experts_reached(spec, bucket: int, calls: int = 1) -> int:
    """The ring experts `calls` calls of up to `bucket` tokens can bring rows to: their routed ids (at most the local
    experts) + the shared experts."""
    return min(spec.ring_experts, min(spec.local_experts, calls * bucket * spec.top_k) + spec.shared)


def grid_rows(cfg: MoEConfig, spec, bucket: int, kcfg, sm_count: int, comm_sms: int = 0) -> int | None:
    """The W1 / W2 grid rows of a bucket with active-first rows (None, one row per ring expert, without): the ring
    experts a call of this rank can bring rows to (its own bucket x top_k routed ids, at most the local experts, + the
    shared experts) or, at P > 1, as many as one wave of CTAs fills (the SM slots of the compute SMs over the CTAs per
    row of the larger of W1 / W2), at most the bound of every rank calling with this bucket (P x bucket x top_k). A
    call whose experts with rows outnumber the grid rows still runs whole: the kernels' CTAs go on to rows y + R while
    they find experts with rows (gcmoe_gemm_sm90.kernel_grouped: Grid).

    Why not the P-rank bound itself: under even routing a rank receives about its own call's rows from all ranks
    together, so most of the P-rank bound's rows stay idle, and where W1 runs more CTAs than SM slots the idle ones
    wait for a slot and hold back W2's launch (measured: docs/benchmarks/index.md, Grid policy). At P = 1
    the two bounds are equal."""
    from gcmoe_gemm_sm90.config import TILE_M

    if not kcfg.active_first:
        return None
    own, every = experts_reached(spec, bucket), experts_reached(spec, bucket, spec.ranks)
    ctas_per_row = max(2 * cfg.intermediate_size // TILE_M * kcfg.splits[0], cfg.hidden_size // TILE_M * kcfg.splits[1])
    one_wave = kcfg.occupancy * (sm_count - comm_sms) // ctas_per_row
    return min(every, max(own, one_wave))


def spin_caps(sm_count: int, comm_sms: int, calls: int) -> tuple[int | None, int | None]:
    """The most CTAs dispatch and finalize may have (None: no cap) when `calls` calls that wait on peers can be in
    flight at once on one GPU of sm_count SMs (comm_sms: the comm partition's SMs, 0 = unpartitioned).

    Dispatch and finalize spin on other ranks (dispatch on their READY, finalize on their W2 rows); W1 and W2 wait
    only on this rank's earlier kernels of the same call, which are whole by the time they launch, so they always
    finish. With two micro-batches in flight at P > 1 (or P virtual ranks on one GPU), rank r's SMs could all hold
    micro-batch A's finalize waiting on a peer whose SMs all hold B's dispatch waiting on r's B publish: each waits
    for the other until the bound ends it (the two-lane protocol model, packages/gcmoe-comm/tests/protocol_model.py,
    finds it). A W1 / W2 CTA needs an SM that no small CTA occupies (registers), so the rule is by SMs: the calls in
    flight together spread their spinning CTAs over at most all but one SM of the pool the kernel runs on (the comm
    partition for dispatch when partitioned, else the device), one CTA per SM at worst. A call's dispatch and its
    finalize never spin at the same time (finalize launches after W2, which waits for every ring block), so each
    kernel gets the pool's share. One call in flight: no cap."""
    if calls <= 1:
        return None, None
    comm_pool = comm_sms or sm_count
    return max(1, (comm_pool - 1) // calls), max(1, (sm_count - comm_sms - 1) // calls)


def _buckets(max_tokens: int) -> list[int]:
    return [1 << i for i in range(token_bucket(max_tokens).bit_length())]


# ------------------------------------------------------------------------------------------- the emulated plan
class Sm90EmulatedPlan:
    """The same pipeline in torch on any device: publish (FP8, routing + shared slots) -> dispatch into the BM-padded
    ring (gcmoe_comm.ring) -> the W1 / W2 kernel models on the ring (gcmoe_gemm_sm90.ops) -> the W2 scatter to the
    combine rows -> finalize's slot-order sum. World size 1."""

    def __init__(self, cfg: MoEConfig, tensors, device: torch.device, options: LayerOptions):
        if cfg.ep_size > 1:
            raise ValueError("gcmoe: the emulated sm90 plan runs world size 1 (use gcmoe_core.multirank for P > 1)")
        from gcmoe_gemm_sm90.prepack import unpack_sm90

        self.cfg, self.device = cfg, device
        self.moe = _weights(cfg, tensors, options)
        self.spec = ring_spec(cfg)
        self.w13, self.w2 = unpack_sm90(self.moe.w13), unpack_sm90(self.moe.w2)

    def forward(self, x, topk_ids, topk_weights, check_values: bool) -> torch.Tensor:
        from gcmoe_comm.ring import dispatch_emulated, scatter_emulated
        from gcmoe_core.grouping import Activations, RowLayout
        from gcmoe_gemm_sm90.ops import emulate_w1, emulate_w2

        if check_values:
            check_call_values(self.cfg.num_experts, topk_ids, topk_weights, self.cfg.masked_ids)
        spec, t, h = self.spec, x.shape[0], self.cfg.hidden_size
        # publish drops an id outside [0, E) (a masked -1 too): no dispatch takes it, its combine row is zeroed
        dropped = (topk_ids < 0) | (topk_ids >= spec.num_experts)
        ring = dispatch_emulated(spec, 0, [topk_ids.masked_fill(dropped, -1)], [topk_weights], [x])
        combine = torch.full((t, spec.slots, h), float("nan"), dtype=torch.bfloat16, device=x.device)
        combine[:, : spec.top_k][dropped] = 0
        rows = torch.arange(spec.capacity, dtype=torch.int32, device=x.device)  # W2's output row i = ring row i
        layout = RowLayout(spec.bm, spec.capacity, ring.offsets, ring.counts, rows)
        moe = self.moe
        hq, hsT = emulate_w1(self.w13, Activations(ring.x_rows, ring.sxT, ring.route_w), layout, moe.act, moe.w13_bias)
        out = torch.empty(spec.capacity, h, dtype=torch.bfloat16, device=x.device)
        out = emulate_w2(self.w2, hq, hsT, layout, out, ring.route_w, moe.w2_bias)
        scatter_emulated(ring, out, [combine.view(t * spec.slots, h)], spec.slots)  # W2's scatter to the combine rows
        return combine_slots(combine)

    def check(self) -> None:
        return None

    def recover(self) -> None:
        return None

    def describe(self) -> dict:
        return {"backend": "sm90", "emulate": True, "device": str(self.device)}
