"""Host side of one rank's comm kernels: argument checks, the launches, and the workspace they share.

    rank = CommRank(ws, dispatch_ctas=16)           # ws: Workspace.virtual(...)[r] or Workspace.symmetric(...)
    rank.publish(x, topk_ids, topk_weights)         # one kernel: quantise + publish this rank's tokens, READY tag
    rank.dispatch()                                 # role1: pull routed tokens into this rank's ring
    ... W1 / W2 on ws.views.ring_* (W2 scatters into the source ranks' ws.views.combine) ...
    rank.combined()                                 # tell every rank my rows for it landed
    rank.finalize(out, shared_rows)                 # role3: wait for every rank, y = slot-order sum
    rank.ws.check()                                 # raises CommError if any bounded wait expired (host sync)

Every step enqueues on the current stream (capturable: no host sync, no allocation in dispatch/combined/finalize).
The bound on each wait is timeout_ms (GCMOE_COMM_TIMEOUT_MS by default).
"""

from __future__ import annotations

import torch

from gcmoe_core import env

from .workspace import Workspace

MAX_DISPATCH_SMEM = 200 * 1024


class CommRank:
    """One rank's launches of the comm kernels on its workspace (kernels compiled on first use, per shape)."""

    def __init__(
        self,
        ws: Workspace,
        dispatch_ctas: int = 16,
        finalize_ctas: int = 16,
        shared_rows: int = 0,
        timeout_ms: float | None = None,
    ):
        spec = ws.spec
        for name, v in (("dispatch_ctas", dispatch_ctas), ("finalize_ctas", finalize_ctas)):
            if not 1 <= v <= 1024:
                raise ValueError(f"CommRank: {name} = {v} must be in [1, 1024]")
        if shared_rows < 0:
            raise ValueError(f"CommRank: shared_rows = {shared_rows} must be >= 0")
        self.validate_spec(spec)
        self.ws = ws
        self.dispatch_ctas, self.finalize_ctas, self.shared_rows = dispatch_ctas, finalize_ctas, shared_rows
        ms = env.get_int("GCMOE_COMM_TIMEOUT_MS") if timeout_ms is None else timeout_ms
        if ms <= 0:
            raise ValueError(f"CommRank: timeout {ms} ms must be > 0")
        self.timeout_ns = int(ms * 1e6)
        self._kernels = None
        self._ntok = 0
        self._keep: tuple = ()  # the last publish's (possibly converted) inputs, alive while its launch reads them

    @staticmethod
    def validate_spec(spec) -> None:
        ids_bytes = spec.ranks * spec.max_tokens * spec.top_k * 2 + spec.ranks * spec.local_experts * 4
        if ids_bytes > MAX_DISPATCH_SMEM:
            raise ValueError(
                f"CommRank: dispatch keeps every rank's routing in shared memory: P * T_max * k * 2 + E * 4 = "
                f"{ids_bytes} bytes > {MAX_DISPATCH_SMEM}; lower max_tokens_per_rank"
            )

    @property
    def kernels(self) -> dict:
        if self._kernels is None:
            from gcmoe_core.cutedsl import cutlass_modules, target_arch

            from .kernels import CommShape, compiled

            shape = CommShape(self.ws.spec, self.dispatch_ctas, self.finalize_ctas, self.shared_rows)
            self._kernels = compiled(shape, target_arch(self.ws.buf.device.index))
            i64 = cutlass_modules()[0].Int64  # a plain Python int would be passed as a 32-bit parameter
            self._i64 = i64
            self._peer_args = tuple(i64(p) for p in self.ws.peers)
            self._base_arg = i64(self.ws.base)
            self._timeout_arg = i64(self.timeout_ns)
            self._sms = torch.cuda.get_device_properties(self.ws.buf.device).multi_processor_count
        return self._kernels

    def _stream(self):
        import cuda.bindings.driver as cuda

        return cuda.CUstream(torch.cuda.current_stream(self.ws.buf.device).cuda_stream)

    def publish(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        """One kernel: quantise x (FP8 1x128, bit-exact with gcmoe_core.formats) into this rank's published
        buffers, copy the routing, and tag READY = g once every CTA is done. topk_ids are global expert ids in
        [0, E) (the layer checks them): an id outside every rank's range is dropped by every dispatch, and that
        slot's combine row is then never written."""
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
        x = x.contiguous()
        ids = topk_ids.to(torch.int32).contiguous()  # no copy when already int32 and contiguous
        wts = topk_weights.to(torch.float32).contiguous()
        k, i64 = self.kernels["publish"], self._i64
        ctas = max(1, min(-(-t * (s.hidden // 128) // 8), 8 * self._sms))  # a warp per 128-value group, grid-stride
        k(self._base_arg, i64(x.data_ptr()), i64(ids.data_ptr()), i64(wts.data_ptr()), t, ctas, self._stream())
        self._ntok = t
        self._keep = (x, ids, wts)  # the launch reads them asynchronously

    def ready(self, ntok: int) -> None:
        """The READY kernel alone (generation + 1, NTOK = ntok): for callers that wrote the published buffers
        themselves (ws.views.pub_*), or a benchmark of dispatch alone."""
        if not 0 <= ntok <= self.ws.spec.max_tokens:
            raise ValueError(f"ready: ntok = {ntok} outside [0, {self.ws.spec.max_tokens}]")
        self._ntok = ntok
        self.kernels["ready"](self._base_arg, ntok, self._stream())

    def dispatch(self) -> None:
        k = self.kernels["dispatch"]
        k(self._peer_args, self.ws.rank, self._timeout_arg, self._stream())

    def combined(self) -> None:
        k = self.kernels["combined"]
        k(self._peer_args, self.ws.rank, self._stream())

    def finalize(self, out: torch.Tensor, shared_rows: torch.Tensor | None = None) -> torch.Tensor:
        """out[t] = bf16(fp32 sum of combine rows t*k .. t*k+k-1, then shared_rows[t, 0..S-1]) for this call's T."""
        s = self.ws.spec
        t = self._ntok
        if out.shape != (t, s.hidden) or out.dtype != torch.bfloat16 or not out.is_contiguous():
            raise ValueError(
                f"finalize: out must be contiguous bf16 [{t}, {s.hidden}], got {out.dtype} {tuple(out.shape)}"
            )
        if out.device != self.ws.buf.device:
            raise ValueError(f"finalize: out is on {out.device}, the workspace on {self.ws.buf.device}")
        if self.shared_rows:
            want = (t, self.shared_rows, s.hidden)
            if shared_rows is None or shared_rows.shape != want or shared_rows.dtype != torch.bfloat16:
                got = None if shared_rows is None else (shared_rows.dtype, tuple(shared_rows.shape))
                raise ValueError(f"finalize: shared_rows must be bf16 {want}, got {got}")
            if not shared_rows.is_contiguous():
                raise ValueError("finalize: shared_rows must be contiguous")
            shared_ptr = shared_rows.data_ptr()
        else:
            if shared_rows is not None:
                raise ValueError("finalize: shared_rows given, but this CommRank was built with shared_rows=0")
            shared_ptr = 0
        k, i64 = self.kernels["finalize"], self._i64
        k(self._base_arg, self.ws.rank, i64(out.data_ptr()), i64(shared_ptr), self._timeout_arg, self._stream())
        return out
