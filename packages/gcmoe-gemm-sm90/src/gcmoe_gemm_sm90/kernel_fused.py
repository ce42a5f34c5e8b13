"""W1 and W2 in one persistent launch (Sm90Config.fused, ring mode): #15's "one persistent W1 -> W2 launch".

    CTA c of C (every CTA slot of the partition, all resident at once):
        phase 1: W1's stream_k range c of the active tiles' windows (kernel_grouped: stream_k), each finished
                 (N tile, M tile) counted in W1_DONE[e]; the expert's last releases its tag = g
        phase 2: W2's stream_k range c of its tiles' windows: the first weight stages issued at once (they depend
                 on nothing), then W1_DONE[e] == g acquired for every expert its pieces read, then the activation
                 boxes (the FP8 rows phase 1 wrote), the pieces, W2's scatter (split tiles: the last arriver adds the
                 pieces' fp32 partials in CTA order and stores)

Why: as two launches, W2's CTAs reach the SMs only as W1's leave them (W1 holds every slot), and each kernel ends in a
wave tail; the schedule probe (tools/gpu/schedule_probe.py, H200, 2026-12-01) streamed the layer's weights in one
persistent launch 5-6 us faster than as two (V4-Flash T = 1 / 8, DeepSeek-V3 T = 1). Here every CTA moves from its
W1 range straight to its W2 range, whose weights stream while the last W1 tiles finish.

The two phases are kernel_grouped's body with a stream_k range each (GroupedGemmSm90(..., fused=True)), on one
shared-memory struct sized for the longer K; between them one CTA barrier (the W1 pipeline drained, its mbarriers
re-armed for W2). Phase 2 takes the ring acquire (ok, g) phase 1 left in shared memory. A W2 wait can only end once
the CTAs holding that expert's W1 tiles have run, so the grid must be resident at once: C <= the CTA slots
(occupancy x SMs of the partition); the waits are bounded (a failure is recorded in ERR, as every ring wait).
Partials and arrival counters: one StreamKScratch per phase (a W1 tile's last arriver may still read a CTA's W1
partials while that CTA writes its W2 ones).

By-value words (sig): INUSE, CGEN, OFFS, ERR, L1_FULL, W1_DONE, W1 partials, W1 counters, W2 partials, W2 counters,
then with cfg.bias b13, b2, route_w.
"""

# No `from __future__ import annotations` in kernel files: the DSL reads the annotations as live objects.
from functools import cache

from gcmoe_core.cutedsl import compile_kernel, cutlass_modules

from .config import WINDOW_K, Sm90Config, can_implement
from .kernel_grouped import GroupedGemmSm90, fake_operands

cutlass, cute = cutlass_modules()
import cuda.bindings.driver as cuda  # noqa: E402
import cutlass.utils as utils  # noqa: E402
from cutlass import runtime as crt  # noqa: E402

Int32, Int64 = cutlass.Int32, cutlass.Int64
FUSED_SIG_WORDS = 10


def fused_sig_words(cfg: Sm90Config) -> int:
    return FUSED_SIG_WORDS + (3 if cfg.bias else 0)


class FusedGemmSm90:
    """W1 (gate/up rows 2I, K = H) then W2 (rows H, K = I) of one layer in one launch."""

    def __init__(self, hidden: int, inter: int, cfg: Sm90Config):
        if not (cfg.fused and cfg.ring):
            raise ValueError("FusedGemmSm90: needs cfg.fused and ring mode")
        self.cfg = cfg
        self.g1 = GroupedGemmSm90("w1", 2 * inter, hidden, cfg, fused=True)
        self.g2 = GroupedGemmSm90("w2", hidden, inter, cfg, fused=True)

    @cute.jit
    def __call__(
        self,
        wq1: cute.Tensor,
        ws1: cute.Tensor,
        x: cute.Tensor,
        sxT: cute.Tensor,
        wq2: cute.Tensor,
        ws2: cute.Tensor,
        h: cute.Tensor,
        hsT: cute.Tensor,
        offs: cute.Tensor,
        cnt: cute.Tensor,
        lut: cute.Tensor,
        rw: cute.Tensor,
        hq: cute.Tensor,
        hs_out: cute.Tensor,
        dst: cute.Tensor,
        src: cute.Tensor,
        comb: cute.Tensor,
        sig: tuple,
        ticket: Int32,
        timeout_ns: Int64,
        num_experts: Int32,
        ctas: Int32,
        stream: cuda.CUstream,
    ):
        # (each phase its own tiled MMA: the body sets its ACCUMULATE field inside its loops)
        mma1, b_smem_staged, tma_atom1, tma_x = self.g1.operands(x)
        mma2, _, tma_atom2, tma_h = self.g2.operands(h)
        shared = self.g1.shared_struct(b_smem_staged, max(self.g1.windows, self.g2.windows))
        self.g1.shared = self.g2.shared = shared
        self.kernel(
            wq1,
            ws1,
            tma_atom1,
            tma_x,
            sxT,
            wq2,
            ws2,
            tma_atom2,
            tma_h,
            hsT,
            offs,
            cnt,
            lut,
            rw,
            hq,
            hs_out,
            dst,
            src,
            comb,
            sig,
            ticket,
            timeout_ns,
            num_experts,
            mma1,
            mma2,
            b_smem_staged,
        ).launch(
            grid=[ctas, 1, 1],
            block=[self.g1.threads, 1, 1],
            use_pdl=self.cfg.pdl,
            smem=shared.size_in_bytes(),
            stream=stream,
            min_blocks_per_mp=self.cfg.occupancy,
            preferred_smem_carveout=100,
        )

    @cute.kernel
    def kernel(
        self,
        wq1: cute.Tensor,
        ws1: cute.Tensor,
        tma_atom1: cute.CopyAtom,
        tma_x: cute.Tensor,
        sxT: cute.Tensor,
        wq2: cute.Tensor,
        ws2: cute.Tensor,
        tma_atom2: cute.CopyAtom,
        tma_h: cute.Tensor,
        hsT: cute.Tensor,
        offs: cute.Tensor,
        cnt: cute.Tensor,
        lut: cute.Tensor,
        rw: cute.Tensor,
        hq: cute.Tensor,
        hs_out: cute.Tensor,
        dst: cute.Tensor,
        src: cute.Tensor,
        comb: cute.Tensor,
        sig: tuple,
        ticket: Int32,
        timeout_ns: Int64,
        num_experts: Int32,
        mma1: cute.TiledMma,
        mma2: cute.TiledMma,
        b_smem_staged: cute.ComposedLayout,
    ):
        c, _, _ = cute.arch.block_idx()
        st = utils.SmemAllocator().allocate(self.g1.shared)
        bias = self.cfg.bias
        sig1 = tuple(sig[:8]) + ((sig[10],) if bias else ())
        sig2 = tuple(sig[:6]) + (sig[8], sig[9]) + ((sig[11], sig[12]) if bias else ())
        args1 = (wq1, ws1, tma_atom1, tma_x, sxT, offs, cnt, lut, rw, hq, hs_out, sig1, ticket, timeout_ns, num_experts)
        args2 = (wq2, ws2, tma_atom2, tma_h, hsT, offs, cnt, lut, dst, src, comb, sig2, ticket, timeout_ns, num_experts)
        self.g1.body(args1, Int32(0), mma1, b_smem_staged, c, Int32(0), Int32(1), Int32(0), st)
        cute.arch.barrier()  # W1's pipeline is drained and its readers done before W2 re-arms the mbarriers
        self.g2.body(args2, Int32(0), mma2, b_smem_staged, c, Int32(0), Int32(1), Int32(0), st)


def fake_fused_operands(hidden: int, inter: int):
    """The fused kernel's tensor operands as fakes (see FusedGemmSm90.__call__'s order)."""
    f1 = fake_operands("w1", 2 * inter, hidden)
    f2 = fake_operands("w2", hidden, inter)
    return f1[:4] + f2[:4] + f1[4:7] + f1[7:10] + f2[7:10]


@cache
def compiled_fused(hidden: int, inter: int, cfg: Sm90Config, arch: str = "sm_90a"):
    """Compile the fused launch against fake tensors (dynamic expert and row counts); refuses a shape either GEMM
    cannot run with this config."""
    for m, k in ((2 * inter, hidden), (hidden, inter)):
        why = can_implement(m, k, 1, cfg)
        if why:
            raise ValueError(f"sm90 fused: {why}")
    if hidden % WINDOW_K or inter % WINDOW_K:
        raise ValueError(f"sm90 fused: H = {hidden} and I = {inter} must be multiples of {WINDOW_K}")
    kern = FusedGemmSm90(hidden, inter, cfg)
    sig = tuple(Int64(0) for _ in range(fused_sig_words(cfg)))
    return compile_kernel(
        kern,
        *fake_fused_operands(hidden, inter),
        sig,
        Int32(1),
        Int64(0),
        Int32(1),
        Int32(1),
        crt.make_fake_stream(),
        arch=arch,
        name=f"fused_h{hidden}_i{inter}_n{cfg.n_tile}{'_clamp' if cfg.activation == 'swiglu_clamped' else ''}"
        f"{'_bias' if cfg.bias else ''}{'_ef' if cfg.evict_first else ''}",
    )
