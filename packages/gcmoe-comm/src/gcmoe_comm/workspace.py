"""One rank's communication workspace: a single byte buffer carved into the published tokens, the token ring, the
signals and the combine buffer, and the peer address table the kernels get by value.

    spec = RingSpec.from_config(cfg)
    wss = Workspace.virtual(spec, device)          # P virtual ranks on one GPU: P separate buffers (tests, benches)
    ws = Workspace.symmetric(spec, group)          # one rank of P processes: PyTorch symmetric memory (P may be 1)
    ws.views                                       # torch views of this rank's buffers (WorkspaceViews)
    ws.peer_views(q)                               # rank q's buffers as this process addresses them
    ws.peers                                       # base address of every rank's workspace, rank order
    ws.check()                                     # raises CommError when a kernel's bounded wait expired
    with ws.warmup(): ...                          # launches in the block load kernels and do nothing (ERR = WARMUP)
    ws.recover()                                   # zero the signals (every rank, between a fault and the next call)

Every rank's workspace has the same layout (WorkspaceLayout, byte offsets from the base), so one base address per
rank is the whole peer table. Signal words (uint32, start of the buffer; each group in its own 128-byte line):

    GEN      this rank's call generation g (publish advances it; never reset between replays)
    READY    g once this rank's tokens, ids and weights for call g are published (peers acquire it before pulling)
    NTOK     this rank's token count in call g, OUT (2 words) its output pointer (published with READY)
    DONE     finalize CTAs that finished call g (the last one resets the receive counter it consumed)
    PUB_DONE publish CTAs that finished (the last one advances GEN and releases READY)
    ERR      code, kind, rank, generation, value seen — written once by the first wait that timed out (code 1), or
             set by the host to WARMUP while kernels are loaded (every kernel then returns at once)
    RECV     two receive counters, parity g & 1: each peer adds 1 after its W2 rows for call g landed here
    CGEN     the generation whose finalize last finished on this rank: the compute role (W1, W2) runs call CGEN + 1
    OFFS     g once dispatch wrote the ring offsets and counts of call g (W1 and W2 acquire it)
    INUSE    the ticket of the call that holds this workspace (0: free); publish takes it, finalize frees it. A
             second call arriving while it is held records ERR kind BUSY: concurrent use never corrupts silently
    SEQ      calls of the slot path consumed (the host's argument slot ring, see comm.CommRank.publish)
    BAD      code, token, slot, value of the first invalid routing entry of a call (id outside [0, E): dropped, never
             dereferenced; non-finite weight: kept) — mirrored to the host or read by Workspace.bad_input()
    L1_FULL  per ring block: the generation whose dispatch filled it (W1 acquires it; no reset pass)
    W1_DONE  after the blocks, two words per ring expert: W1 tiles of the expert finished in the current call (the
             last one resets it) and the generation whose W1 finished the expert (W2 acquires it, so an expert's W2
             starts while other experts' W1 still runs; the grouped GEMMs own the protocol, see gcmoe-gemm-sm90)
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from gcmoe_core.signals import ERR_WARMUP, KIND_BLOCK, KIND_BUSY, KIND_OFFS, KIND_READY, KIND_RECV, KIND_W1

from .ring import RingSpec

SIG_GEN, SIG_READY, SIG_NTOK, SIG_OUT = 0, 32, 33, 34  # OUT: 2 words
SIG_DONE = 64  # finalize's CTAs done (the last resets it)
SIG_PUB_DONE = 65  # publish's CTAs done
SIG_RANKED = 66  # dispatch's CTAs past their reads of the routing (the last releases OFFS)
SIG_ERR = 96  # 5 words
SIG_RECV = 128  # 2 words
SIG_CGEN = 160
SIG_OFFS = 192
SIG_INUSE = 224
SIG_SEQ = 256
SIG_BAD = 288  # 4 words
SIG_L1_FULL = 320


def sig_w1_done(spec: RingSpec) -> int:
    """Word index of the W1_DONE pairs (after the L1_FULL tags of every ring block)."""
    return SIG_L1_FULL + spec.blocks


ERR_WORDS = 5
ERR_KINDS = {
    KIND_READY: "ready tag (its tokens for this call were never published, or the tag disagrees with its GEN)",
    KIND_RECV: "receive counter",
    KIND_OFFS: "ring offsets tag (this rank's dispatch never published the call's ring)",
    KIND_BLOCK: "ring block tag (this rank's dispatch never filled the block)",
    KIND_BUSY: "workspace, held by another call (one layer's workspace used by two calls at once: give each "
    "concurrent stream its own layer call lane, see gcmoe.MoELayer)",
    KIND_W1: "W1 completion tag (this rank's W1 never finished the expert)",
}
BAD_ID, BAD_WEIGHT = 1, 2


class CommError(RuntimeError):
    """A bounded wait in a gcmoe-comm kernel expired: names the rank, counter and generation it waited on."""


def error_message(err: list[int], rank: int, ranks: int) -> str | None:
    """ERR words (code, kind, rank or block, generation, value seen) in words; None when no wait failed."""
    code, kind, who, gen, seen = err
    if code == 0:
        return None
    what = ERR_KINDS.get(kind, f"counter kind {kind}")
    tail = "The call's outputs are invalid (NaN); every rank must call recover() before the next call"
    if kind == KIND_BUSY:
        return f"gcmoe-comm rank {rank}: a call (ticket {gen}) found its {what}, ticket {seen}. {tail}"
    if kind == KIND_RECV:
        want = f"{ranks} arrivals for generation {gen}"
    else:
        want = f"generation {gen}"
    own = {KIND_BLOCK: f"block {who} of its own ring", KIND_W1: f"ring expert {who}"}  # waits on this rank's words
    if kind in own:
        return f"gcmoe-comm rank {rank}: timed out waiting on {own[kind]} ({what}): wanted {want}, saw {seen}. {tail}"
    return f"gcmoe-comm rank {rank}: timed out waiting on rank {who}'s {what}: wanted {want}, saw {seen}. {tail}"


def bad_input_message(bad: list[int], num_experts: int) -> str | None:
    """BAD words (code, token, slot, value) in words, as gcmoe_core.config's argument errors say them; None: none."""
    code, token, slot, value = bad
    if code == 0:
        return None
    if code == BAD_ID:
        return (
            f"gcmoe: topk_ids: holds expert id {value} at token {token}, slot {slot}, out of range [0, {num_experts})"
            " (that slot was dropped)"
        )
    return f"gcmoe: topk_weights: holds a non-finite routing weight (NaN or Inf) at token {token}, slot {slot}"


def _align(n: int, a: int = 128) -> int:
    return -(-n // a) * a


@dataclass(frozen=True)
class WorkspaceLayout:
    """Byte offsets of every buffer inside one rank's workspace (identical on every rank)."""

    spec: RingSpec

    def __post_init__(self):
        s = self.spec
        if s.hidden % 128:
            raise ValueError(f"WorkspaceLayout: hidden {s.hidden} must be a multiple of 128 (FP8 1x128 scales)")
        sizes = {
            "signals": (SIG_L1_FULL + s.blocks + 2 * s.ring_experts) * 4,
            "pub_x": s.max_tokens * s.hidden,
            "pub_sx": s.max_tokens * (s.hidden // 128) * 4,
            "pub_ids": s.max_tokens * s.slots * 4,
            "pub_w": s.max_tokens * s.slots * 4,
            "ring_x": s.capacity * s.hidden,
            "ring_sxT": (s.hidden // 128) * s.capacity * 4,
            "ring_w": s.capacity * 4,
            "ring_src": s.capacity * 3 * 4,
            "ring_dst": s.capacity * 4,
            "ring_offsets": (s.ring_experts + 1) * 4,
            "ring_counts": s.ring_experts * 4,
            "combine": (s.max_tokens * s.slots + 1) * s.hidden * 2,  # + 1 sink row for masked scatters
        }
        offsets, at = {}, 0
        for name, n in sizes.items():
            offsets[name] = at
            at += _align(n)
        object.__setattr__(self, "offsets", offsets)
        object.__setattr__(self, "sizes", sizes)
        object.__setattr__(self, "nbytes", at)

    def __getitem__(self, name: str) -> int:
        return self.offsets[name]


@dataclass
class WorkspaceViews:
    """Torch views of one rank's workspace."""

    signals: torch.Tensor  # int32 [SIG_L1_FULL + blocks + 2 * ring experts]
    pub_x: torch.Tensor  # uint8 [T_max, H]  (FP8 E4M3 bits)
    pub_sx: torch.Tensor  # fp32 [T_max, H/128]
    pub_ids: torch.Tensor  # int32 [T_max, k + S]  (routed slots, then the shared experts' ids E .. E + S - 1)
    pub_w: torch.Tensor  # fp32 [T_max, k + S]
    ring_x: torch.Tensor  # uint8 [capacity, H]
    ring_sxT: torch.Tensor  # fp32 [H/128, capacity]
    ring_w: torch.Tensor  # fp32 [capacity]
    ring_src: torch.Tensor  # int32 [capacity, 3]  (src rank, token, slot), -1 for padding
    ring_dst: torch.Tensor  # int32 [capacity]  row of the source rank's combine buffer (token * (k + S) + slot),
    # or the sink row for padding: what W2's scatter reads
    ring_offsets: torch.Tensor  # int32 [E/P + S + 1]
    ring_counts: torch.Tensor  # int32 [E/P + S]
    combine: torch.Tensor  # bf16 [T_max * (k + S) + 1, H]: row t * (k + S) + j, then one sink row that a
    # scatter may aim its padding rows at instead of branching; finalize never reads it

    @property
    def l1_full(self) -> torch.Tensor:
        return self.signals[SIG_L1_FULL : SIG_L1_FULL + self._blocks]

    @property
    def w1_done(self) -> torch.Tensor:
        """int32 [ring experts, 2]: (W1 tiles finished in the current call, generation whose W1 finished)."""
        return self.signals[SIG_L1_FULL + self._blocks :].view(-1, 2)

    @property
    def _blocks(self) -> int:
        return self.signals.numel() - SIG_L1_FULL - 2 * self.ring_counts.numel()

    @property
    def sink_row(self) -> int:
        return self.combine.shape[0] - 1


def _views(buf: torch.Tensor, lay: WorkspaceLayout) -> WorkspaceViews:
    s = lay.spec
    h, hs, cap, t, k = s.hidden, s.hidden // 128, s.capacity, s.max_tokens, s.slots

    def part(name, dtype, shape):
        n = lay.sizes[name]
        return buf[lay[name] : lay[name] + n].view(dtype).view(shape)

    return WorkspaceViews(
        signals=part("signals", torch.int32, (-1,)),
        pub_x=part("pub_x", torch.uint8, (t, h)),
        pub_sx=part("pub_sx", torch.float32, (t, hs)),
        pub_ids=part("pub_ids", torch.int32, (t, k)),
        pub_w=part("pub_w", torch.float32, (t, k)),
        ring_x=part("ring_x", torch.uint8, (cap, h)),
        ring_sxT=part("ring_sxT", torch.float32, (hs, cap)),
        ring_w=part("ring_w", torch.float32, (cap,)),
        ring_src=part("ring_src", torch.int32, (cap, 3)),
        ring_dst=part("ring_dst", torch.int32, (cap,)),
        ring_offsets=part("ring_offsets", torch.int32, (s.ring_experts + 1,)),
        ring_counts=part("ring_counts", torch.int32, (s.ring_experts,)),
        combine=part("combine", torch.bfloat16, (t * k + 1, h)),
    )


class Workspace:
    """One rank's workspace and the peer table. Build with Workspace.virtual or Workspace.symmetric."""

    def __init__(self, spec: RingSpec, rank: int, buf: torch.Tensor, peers: tuple[int, ...], group=None):
        if len(peers) != spec.ranks:
            raise ValueError(f"Workspace: {len(peers)} peer addresses for P = {spec.ranks} ranks")
        if not 0 <= rank < spec.ranks:
            raise ValueError(f"Workspace: rank {rank} outside [0, {spec.ranks})")
        self.layout = WorkspaceLayout(spec)
        if buf.dtype != torch.uint8 or buf.numel() < self.layout.nbytes:
            raise ValueError(
                f"Workspace: buffer must be uint8 with >= {self.layout.nbytes} bytes, got {buf.dtype} {buf.numel()}"
            )
        self.spec, self.rank, self.buf, self.peers, self.group = spec, rank, buf, peers, group
        self.views = _views(buf, self.layout)
        # the buffers of every rank in this process (virtual ranks: all P, each kept alive by every sibling since
        # their kernels address each other; tensors, not workspaces: no reference cycle, a dropped workspace is
        # freed at once rather than by the cyclic GC, which may run inside someone's CUDA-graph capture)
        self._local_bufs: tuple[torch.Tensor, ...] = (buf,)

    @property
    def base(self) -> int:
        return self.peers[self.rank]

    @property
    def combine_ptrs(self) -> tuple[int, ...]:
        """Address of every rank's combine buffer as this process addresses it (the W2 scatter's peer table)."""
        return tuple(p + self.layout["combine"] for p in self.peers)

    @classmethod
    def virtual(cls, spec: RingSpec, device: torch.device | str) -> list[Workspace]:
        """P ranks in this process on one device: separate buffers, each rank's peer table pointing at the others'.
        Every buffer starts zeroed (signals at generation 0; ring rows, offsets and counts in range)."""
        lay = WorkspaceLayout(spec)
        bufs = [torch.zeros(lay.nbytes, dtype=torch.uint8, device=device) for _ in range(spec.ranks)]
        peers = tuple(b.data_ptr() for b in bufs)
        wss = [cls(spec, r, b, peers) for r, b in enumerate(bufs)]
        for ws in wss:
            ws._local_bufs = tuple(bufs)
        return wss

    @classmethod
    def symmetric(cls, spec: RingSpec, group=None) -> Workspace:
        """This process's rank of a torch.distributed group (world size P = spec.ranks, one GPU per process), its
        buffer from PyTorch symmetric memory. Collective: every rank of the group calls it."""
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        group = group or dist.group.WORLD
        world = dist.get_world_size(group)
        if world != spec.ranks:
            raise ValueError(f"Workspace.symmetric: group has {world} ranks, the ring spec says P = {spec.ranks}")
        lay = WorkspaceLayout(spec)
        buf = symm_mem.empty(lay.nbytes, dtype=torch.uint8, device=torch.device("cuda", torch.cuda.current_device()))
        handle = symm_mem.rendezvous(buf, group.group_name)
        ws = cls(spec, handle.rank, buf, tuple(int(p) for p in handle.buffer_ptrs), group)
        ws._handle = handle  # keeps the peers' mappings alive
        buf.zero_()
        torch.cuda.synchronize()
        dist.barrier(group)
        return ws

    def peer_views(self, q: int) -> WorkspaceViews:
        """Torch views of rank q's workspace as this process addresses it (a sibling's buffer for virtual ranks,
        the symmetric-memory mapping of the peer's buffer otherwise): what a W2 scatter writes into."""
        if not 0 <= q < self.spec.ranks:
            raise ValueError(f"peer_views: rank {q} outside [0, {self.spec.ranks})")
        if self.group is None:
            return _views(self._local_bufs[q], self.layout)
        buf = self._handle.get_buffer(q, (self.layout.nbytes,), torch.uint8)
        return _views(buf, self.layout)

    def error(self) -> str | None:
        """The recorded wait failure of this rank, in words, or None (reads the device: one sync)."""
        return error_message(self.views.signals[SIG_ERR : SIG_ERR + ERR_WORDS].tolist(), self.rank, self.spec.ranks)

    def check(self) -> None:
        msg = self.error()
        if msg is not None:
            raise CommError(msg)

    @contextlib.contextmanager
    def warmup(self):
        """Launch kernels inside this block to load their modules without effect: ERR says WARMUP meanwhile (every
        kernel of the layer then returns at once). The device is quiet before and after (only the current stream
        while another stream is being captured: a device-wide synchronisation is refused then, and a workspace
        made under capture has nothing in flight elsewhere)."""
        err = self.views.signals[SIG_ERR : SIG_ERR + 1]
        stream = torch.cuda.current_stream(self.buf.device) if self.buf.is_cuda else None
        if stream is not None:
            stream.synchronize()
        err.fill_(ERR_WARMUP)
        try:
            yield
        finally:
            err.zero_()
            if stream is not None:
                stream.synchronize()

    def bad_input(self, clear: bool = True) -> str | None:
        """The first invalid routing entry a publish recorded (since the last clear), in words, or None (one sync)."""
        words = self.views.signals[SIG_BAD : SIG_BAD + 4]
        msg = bad_input_message(words.tolist(), self.spec.num_experts)
        if msg is not None and clear:
            words.zero_()
        return msg

    def recover(self) -> None:
        """Zero the signals so the ranks restart from generation 0. Collective: with virtual ranks it resets every
        sibling; with symmetric memory every process calls it (it synchronises the device and the group)."""
        if self.buf.is_cuda:
            torch.cuda.synchronize(self.buf.device)
        if self.group is not None:
            import torch.distributed as dist

            dist.barrier(self.group)
            self.views.signals.zero_()
            torch.cuda.synchronize(self.buf.device)
            dist.barrier(self.group)
        else:
            for buf in self._local_bufs:
                _views(buf, self.layout).signals.zero_()
            if self.buf.is_cuda:
                torch.cuda.synchronize(self.buf.device)
