"""Host side of one rank's comm kernels: argument checks, the launches, and the workspace they share.

    rank = CommRank(ws)                             # ws: Workspace.virtual(...)[r] or Workspace.symmetric(...)
    rank.load()                                     # compile + load every kernel now (before any cross-rank wait)
    rank.publish(x, topk_ids, topk_weights)         # one kernel: take the workspace, quantise + publish, READY
    rank.dispatch()                                 # role1: pull routed tokens into this rank's ring
    (or both at once: rank.publish_dispatch(x, topk_ids, topk_weights), one kernel at world size 1)
    ... W1 / W2 on ws.views.ring_* (W2 scatters into the source ranks' ws.views.combine) ...
    rank.finalize(out)                              # role3: tell every rank my rows landed, wait for every rank,
                                                    # y = slot-order sum; frees the workspace
    rank.ws.check()                                 # raises CommError if any bounded wait expired (host sync)

Every step enqueues on the current stream (capturable: no host sync, no allocation in dispatch/finalize).
The bound on each wait is timeout_ms (GCMOE_COMM_TIMEOUT_MS by default).
Grids: publish a warp per 128-value group; dispatch a CTA per ring block the call can fill (dispatch_grid), finalize
a thread per 16 output bytes (finalize_grid), at most one dispatch CTA and FINALIZE_CTAS_PER_SM finalize CTAs per SM
unless given (dispatch_ctas / finalize_ctas fix them). Dispatch and finalize are programmatic dependent launches:
dispatch launches while publish runs and waits for it (griddepcontrol.wait) before reading anything, then lets the
next kernel launch (the layer's W1, which acquires the ring by its tags); finalize launches in W2's tail and waits
for W2 the same way.

Tickets: every call takes the workspace under a ticket (a process-wide unique int the publish and finalize of one
call share; a captured call keeps its ticket in every replay — CUDA never runs two launches of one graph at once).
A call that finds the workspace held by another ticket fails loudly (CommError, kind BUSY) instead of corrupting it.

World size 1: `publish_dispatch` runs both as one kernel (kernels.py k_dispatch_local): the ring rows are quantised
straight from x, so the call loses a kernel boundary, the published copy and its round trips (bit-identical rings).

The slot path (`publish_slots`, `publish_dispatch_slots`): publish reads its arguments from a device argument block
int64 [8] (x, ids, weights, out pointers, T, ids-are-int64) and finalize reads the output pointer and T from the
workspace, so one captured graph serves every eager call with new tensors (gcmoe's sm90 backend copies each call's
block in from a pinned staging slot just before replaying, and waits on the mirrored SEQ before it reuses a staging
slot).
"""

from __future__ import annotations

import contextlib
import itertools

import torch

from gcmoe_core import env

from .launch import MAX_DISPATCH_SMEM, THREADS, WARPS
from .workspace import Workspace

# finalize's grid: a thread per 16 output bytes, at most this many CTAs per SM (the cap binds from T = 38 / 66 tokens
# on for DeepSeek-V3 / V4-Flash). Four per SM keep more output pieces' loads in flight than one: measured on the
# public layer, faster at T = 128-256 and the same at T <= 32 (docs/benchmarks/index.md: comm ranking)
FINALIZE_CTAS_PER_SM = 4
# world size 1: publish + dispatch as one kernel (publish_dispatch) while the call's ring rows, T (k + S) rows of H
# FP8 bytes, are at most this many bytes; above, the two kernels: the fused one quantises each token once per ring row
# it lands in (k + S times), and that work outgrows the kernel boundary and round trips it saves (measured side by
# side on the public layer across V4-Flash, DeepSeek-V3 and GLM-5, docs/benchmarks/index.md: local dispatch)
LOCAL_DISPATCH_MAX_BYTES = 3 << 19
_TICKETS = itertools.count(1)


def new_ticket() -> int:
    """A process-wide unique, non-zero 31-bit ticket."""
    return next(_TICKETS) % (2**31 - 1) + 1


class CommRank:
    """One rank's launches of the comm kernels on its workspace (kernels compiled on first use, per shape)."""

    def __init__(
        self,
        ws: Workspace,
        dispatch_ctas: int | None = None,
        finalize_ctas: int | None = None,
        timeout_ms: float | None = None,
        masked_ids: bool = False,
    ):
        spec = ws.spec
        for name, v in (("dispatch_ctas", dispatch_ctas), ("finalize_ctas", finalize_ctas)):
            if v is not None and not 1 <= v <= 1024:
                raise ValueError(f"CommRank: {name} = {v} must be in [1, 1024]")
        self.validate_spec(spec)
        self.ws = ws
        self.dispatch_ctas, self.finalize_ctas = dispatch_ctas, finalize_ctas
        self.masked_ids = masked_ids  # publish drops an id of -1 without recording it (MoEConfig.masked_ids)
        ms = env.get_int("GCMOE_COMM_TIMEOUT_MS") if timeout_ms is None else timeout_ms
        if ms <= 0:
            raise ValueError(f"CommRank: timeout {ms} ms must be > 0")
        self.timeout_ns = int(ms * 1e6)
        self._kernels = None
        self._ntok = 0
        self._ticket = 0
        self._keep: tuple = ()  # the last publish's (possibly converted) inputs, alive while its launch reads them

    @staticmethod
    def validate_spec(spec) -> None:
        ids_bytes = spec.ranks * spec.max_tokens * spec.slots * 2 + WARPS * spec.ranks * spec.ring_experts * 4
        if ids_bytes > MAX_DISPATCH_SMEM:
            raise ValueError(
                f"CommRank: dispatch keeps every rank's routing in shared memory: P * T_max * (k + S) * 2 + "
                f"{WARPS} * P * (E/P + S) * 4 = {ids_bytes} bytes > {MAX_DISPATCH_SMEM}; lower max_tokens_per_rank"
            )

    @property
    def kernels(self) -> dict:
        if self._kernels is None:
            from gcmoe_core.cutedsl import cutlass_modules, target_arch

            from .kernels import CommShape, compiled

            shape = CommShape(self.ws.spec, self.masked_ids)
            self._kernels = compiled(shape, target_arch(self.ws.buf.device.index))
            i64 = cutlass_modules()[0].Int64  # a plain Python int would be passed as a 32-bit parameter
            self._i64 = i64
            self._peer_args = tuple(i64(p) for p in self.ws.peers)
            self._base_arg = i64(self.ws.base)
            self._timeout_arg = i64(self.timeout_ns)
            self._zero = i64(0)
            self._sms = torch.cuda.get_device_properties(self.ws.buf.device).multi_processor_count
        return self._kernels

    def _stream(self):
        import cuda.bindings.driver as cuda

        return cuda.CUstream(torch.cuda.current_stream(self.ws.buf.device).cuda_stream)

    def load(self, signals: int | None = None) -> None:
        """Compile every kernel and load its module into the current stream's CUDA context now, by launching each
        once with ERR set to WARMUP (each kernel then returns at once; nothing crosses ranks). Call it before the
        first cross-rank wait (the layer does, before its rendezvous): a rank still loading kernels when its peers
        already wait would look dead to them. Default: the workspace's own ERR word says WARMUP meanwhile (the
        device quiet before and after). signals: the address of a scratch copy of the signal words whose ERR says
        WARMUP, taken as every rank's workspace: nothing of the real workspace is read or written, so this is
        legal while calls are in flight (e.g. loading into another green context, whose module loads are lazy)."""
        k, z = self.kernels, self._zero
        warm = self.ws.warmup() if signals is None else contextlib.nullcontext()
        base = self._base_arg if signals is None else self._i64(signals)
        peers = self._peer_args if signals is None else (base,) * len(self._peer_args)
        with warm:
            k["ready"](base, 0, self._stream())
            k["publish"](base, z, z, z, z, z, z, 0, 0, 1, 1, self._stream())
            if "dispatch_local" in k:
                k["dispatch_local"](base, z, z, z, z, z, z, 0, 0, 1, 1, self._stream())
            k["dispatch"](peers, self.ws.rank, self._timeout_arg, -1, 1, self._stream())
            k["finalize"](peers, self.ws.rank, z, 0, self._timeout_arg, 1, z, 1, self._stream())

    def publish_ctas(self, tokens: int) -> int:
        """Publish CTAs for T tokens: a warp per 128-value group, grid-stride, at most 8 per SM."""
        s = self.ws.spec
        self.kernels  # noqa: B018  (reads the SM count)
        return max(1, min(-(-tokens * (s.hidden // 128) // 8), 8 * self._sms))

    def dispatch_grid(self, tokens: int, cap: int | None = None) -> int:
        """Dispatch CTAs for calls of up to `tokens` tokens on every rank: one per ring block the call can fill (CTA c
        pulls blocks c, c + C, ...; each CTA also ranks all the routing, which is cheap), at most `cap` (default: the
        SM count); dispatch_ctas given: that."""
        if self.dispatch_ctas is not None:
            return self.dispatch_ctas
        s = self.ws.spec
        self.kernels  # noqa: B018  (reads the SM count)
        rows = s.ranks * tokens * s.slots  # at most: every routed slot of every rank lands here
        blocks = min(s.ring_experts, rows) + -(-rows // s.bm)  # each expert's rows padded to BM
        return max(1, min(blocks, cap or self._sms))

    def finalize_grid(self, tokens: int) -> int:
        """Finalize CTAs for `tokens` output rows: a thread per 16 output bytes, at most FINALIZE_CTAS_PER_SM per SM
        (each thread's k + S loads of one output piece in flight together); finalize_ctas given: that."""
        if self.finalize_ctas is not None:
            return self.finalize_ctas
        self.kernels  # noqa: B018  (reads the SM count)
        return max(1, min(-(-tokens * (self.ws.spec.hidden // 8) // THREADS), FINALIZE_CTAS_PER_SM * self._sms))

    def publish(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        ticket: int | None = None,
        status: int = 0,
    ) -> None:
        """One kernel: take the workspace under `ticket` (default: a new one), quantise x (FP8 1x128, bit-exact
        with gcmoe_core.formats) into this rank's published buffers, check and copy the routing (plus the shared
        slots), and tag READY = g once every CTA is done. An id outside [0, E) is recorded (Workspace.bad_input)
        and dropped: no rank computes that slot, and its combine row is zeroed (masked_ids: an id of -1 is dropped
        the same way, unrecorded). status: pinned int32 words [STATUS_WORDS] that keep the first BAD entry and its
        ticket until the host clears them (a captured step's check; 0: none)."""
        args = self._publish_args(x, topk_ids, topk_weights, ticket)
        self._launch_call("publish", 0, status, args, self.publish_ctas(self._ntok))

    def publish_dispatch(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        ticket: int | None = None,
        ctas: int | None = None,
        tokens: int | None = None,
        status: int = 0,
    ) -> None:
        """publish + dispatch (`ctas` dispatch CTAs, default dispatch_grid of T): where local_dispatch(`tokens`, the
        bound the call was sized for, default T) one kernel that quantises x straight into the ring (the same rows,
        bits and checks; no published copy), else the two. status: as publish."""
        if not self.local_dispatch(x.shape[0] if tokens is None else tokens):
            self.publish(x, topk_ids, topk_weights, ticket, status)
            self.dispatch(ctas)
            return
        args = self._publish_args(x, topk_ids, topk_weights, ticket)
        self._launch_call("dispatch_local", 0, status, args, ctas or self.dispatch_grid(self._ntok))

    def local_dispatch(self, tokens: int) -> bool:
        """Whether publish_dispatch runs as one kernel for calls of up to `tokens` tokens: world size 1, ring rows of
        at most LOCAL_DISPATCH_MAX_BYTES."""
        s = self.ws.spec
        return s.ranks == 1 and tokens * s.slots * s.hidden <= LOCAL_DISPATCH_MAX_BYTES

    def _publish_args(self, x, topk_ids, topk_weights, ticket) -> tuple:
        """Checked inputs of a publish as its kernel arguments (x, ids, weights, out = 0, T, ids-are-int64, ticket);
        records T and the ticket for the call's later launches and keeps the inputs alive."""
        s = self.ws.spec
        dev = self.ws.buf.device
        if x.dim() != 2 or x.shape[1] != s.hidden or x.dtype != torch.bfloat16:
            raise ValueError(f"publish: x must be bf16 [T, {s.hidden}], got {x.dtype} {tuple(x.shape)}")
        t = x.shape[0]
        if t > s.max_tokens:
            raise ValueError(f"publish: T = {t} exceeds the workspace's max_tokens_per_rank = {s.max_tokens}")
        if topk_ids.shape != (t, s.top_k) or topk_ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"publish: topk_ids must be int32/int64 [{t}, {s.top_k}], got {topk_ids.dtype} {tuple(topk_ids.shape)}"
            )
        if topk_weights.shape != (t, s.top_k) or not topk_weights.is_floating_point():
            raise ValueError(
                f"publish: topk_weights must be floating [{t}, {s.top_k}], got {topk_weights.dtype} "
                f"{tuple(topk_weights.shape)}"
            )
        for name, ten in (("x", x), ("topk_ids", topk_ids), ("topk_weights", topk_weights)):
            if ten.device != dev:
                raise ValueError(f"publish: {name} is on {ten.device}, the workspace on {dev}")
        x, ids = x.contiguous(), topk_ids.contiguous()
        wts = topk_weights.to(torch.float32).contiguous()
        self.kernels  # noqa: B018  (compiles on first use; sets the argument wrappers)
        i64 = self._i64
        self._ticket = ticket or new_ticket()
        self._ntok = t
        self._keep = (x, ids, wts)  # the launch reads them asynchronously
        ptrs = (i64(x.data_ptr()), i64(ids.data_ptr()), i64(wts.data_ptr()))
        return (*ptrs, self._zero, t, int(ids.dtype == torch.int64), self._ticket)

    def publish_slots(self, args: int, status: int, ticket: int, ctas: int) -> None:
        """The slot path's publish (see the module docstring): arguments from the device argument block at `args`,
        the call's SEQ and BAD mirrored to the pinned int32 status words at `status` (0: none)."""
        self._launch_call("publish", args, status, self._slot_args(ticket), ctas)

    def publish_dispatch_slots(
        self, args: int, status: int, ticket: int, publish_ctas: int, ctas: int, tokens: int
    ) -> None:
        """The slot path's publish + dispatch (`ctas` dispatch CTAs) for calls of up to `tokens` tokens: one kernel
        where local_dispatch(tokens), as publish_dispatch."""
        if not self.local_dispatch(tokens):
            self.publish_slots(args, status, ticket, publish_ctas)
            self.dispatch(ctas)
            return
        self._launch_call("dispatch_local", args, status, self._slot_args(ticket), ctas)

    def _slot_args(self, ticket: int) -> tuple:
        """The slot path's kernel arguments in place of _publish_args' (the kernel reads them from the argument
        block); records the ticket, T unknown on the host (-1)."""
        self._ticket, self._ntok = ticket, -1
        z = self._zero
        return (z, z, z, z, 0, 0, ticket)

    def _launch_call(self, name: str, args: int, status: int, call_args: tuple, ctas: int) -> None:
        """Launch publish or dispatch_local (kernels.CallLaunch): argument block `args` and status words `status`
        (device addresses; 0 by value), the call's arguments (_publish_args or _slot_args), `ctas` CTAs."""
        i64 = self._i64
        self.kernels[name](self._base_arg, i64(args), i64(status), *call_args, ctas, self._stream())

    def ready(self, ntok: int) -> None:
        """The READY kernel alone (generation + 1, NTOK = ntok): for callers that wrote the published buffers
        themselves (ws.views.pub_*), or a benchmark of dispatch alone."""
        if not 0 <= ntok <= self.ws.spec.max_tokens:
            raise ValueError(f"ready: ntok = {ntok} outside [0, {self.ws.spec.max_tokens}]")
        self._ntok = ntok
        self.kernels["ready"](self._base_arg, ntok, self._stream())

    def dispatch(self, ctas: int | None = None) -> None:
        """Role 1 on the current stream: `ctas` CTAs (default: dispatch_grid of the last publish's T)."""
        k = self.kernels["dispatch"]
        t = self._ntok if self._ntok >= 0 else self.ws.spec.max_tokens
        n = ctas or self.dispatch_grid(t)
        k(self._peer_args, self.ws.rank, self._timeout_arg, self._ntok, n, self._stream())

    def finalize(
        self,
        out: torch.Tensor | None = None,
        status: int = 0,
        ctas: int | None = None,
    ) -> torch.Tensor | None:
        """Tell every rank my W2 rows for it landed (the W2 launch must precede this on the stream), wait for every
        rank's, then out[t] = bf16(fp32 sum of combine rows t*(k+S) .. t*(k+S)+k+S-1) for
        this call's T, and free the workspace. out=None (slot path): the output pointer and T published with READY.
        ctas: the grid (default: finalize_grid of T; the slot path's default sizes it for max_tokens)."""
        s = self.ws.spec
        t = self._ntok
        if out is not None:
            if t < 0 or out.shape != (t, s.hidden) or out.dtype != torch.bfloat16 or not out.is_contiguous():
                raise ValueError(
                    f"finalize: out must be contiguous bf16 [{t}, {s.hidden}], got {out.dtype} {tuple(out.shape)}"
                )
            if out.device != self.ws.buf.device:
                raise ValueError(f"finalize: out is on {out.device}, the workspace on {self.ws.buf.device}")
        k, i64, z = self.kernels["finalize"], self._i64, self._zero
        out_ptr = z if out is None else i64(out.data_ptr())
        ntok = -1 if out is None else t
        k(
            self._peer_args,
            self.ws.rank,
            out_ptr,
            ntok,
            self._timeout_arg,
            self._ticket,
            i64(status),
            ctas or self.finalize_grid(t if t >= 0 else s.max_tokens),
            self._stream(),
        )
        return out
