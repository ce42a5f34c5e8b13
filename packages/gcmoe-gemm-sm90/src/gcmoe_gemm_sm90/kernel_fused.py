"""W1 and W2 in one launch (ring mode, Sm90Config.fused): the two kernels' CTAs in one 1-D grid, W2's tiles of each
expert placed `lag` grid rows after W1's, so the block scheduler starts an expert's W2 tiles while later experts' W1
tiles still run, instead of after the last W1 CTA has been dispatched.

    grid rows y = 0 .. Y - 1 (the experts as kernel_grouped's Grid rows them), A = W1's M tiles, B = W2's, L = lag:
    block order   [W1 of rows 0 .. L - 1]  [W1 of row L + j, then W2 of row j  for j = 0 .. Y - L - 1]
                  [W2 of rows Y - L .. Y - 1]                                         (Y (A + B) CTAs in all)

Each CTA runs one tile of one kernel: kernel_grouped.GroupedGemmSm90.body of the W1 or the W2 variant, with that
variant's operands, TMA descriptor, shared-memory struct (the launch reserves the larger) and epilogue, exactly as its
own launch would (so the outputs are bit-identical). What orders W2 after W1 is what already does with expert_sync:
a W2 CTA of expert e acquires W1_DONE[e] == g (bounded) before its first activation box, after streaming its first
weight stages. Why this cannot wait forever on a W1 tile that never starts: every W1 tile of a row comes before the
row's W2 tiles in block order, W1 tiles wait for nothing of W2, and a W2 CTA that waits holds one slot only.

Before this, W2's CTAs could launch (PDL) only once every W1 CTA had started, and took SM slots only as W1 CTAs
finished: its tiles of the last experts ran as a tail after W1 (V4-Flash T = 8: W2 ended 25 µs after W1,
DeepSeek-V3 T = 8: 38 µs; layer-h200-2026-12-01 / l2-hint-h200-2026-12-01 timelines).

Only the configurations W1 / W2 run as one unsplit tile per CTA (no K splits, no stream_k) with expert_sync.
"""

# No `from __future__ import annotations` in kernel files: the DSL reads the annotations as live objects.
from functools import cache
from math import ceil

from gcmoe_core.cutedsl import compile_kernel, cutlass_modules

from .config import Sm90Config
from .kernel_grouped import GroupedGemmSm90, fake_operands, sig_words

cutlass, cute = cutlass_modules()
import cuda.bindings.driver as cuda  # noqa: E402
import cutlass.utils as utils  # noqa: E402
from cutlass import runtime as crt  # noqa: E402

Int32, Int64 = cutlass.Int32, cutlass.Int64


def fused_missing(cfg: Sm90Config) -> str | None:
    """None when W1 and W2 of this config can run as one launch (kernel_fused), else why not."""
    if cfg.splits != (1, 1):
        return f"K splits {cfg.splits}: a fused launch runs one unsplit tile per CTA"
    if cfg.stream_k:
        return "stream_k W1 runs over the SM slots, not one tile per CTA"
    if not (cfg.ring and cfg.expert_sync):
        return "a fused launch orders W2 after W1 by the ring's W1_DONE tags (ring mode with expert_sync)"
    return None


def fused_lag(m1: int, k1: int, m2: int, k2: int, slots: int, rows: int) -> int:
    """Grid rows between an expert's W1 tiles and its W2 tiles: about one turnover of the SM slots measured in W1
    tile lifetimes, ceil(slots x K1 / (A K1 + B K2)) with A, B the M tiles of W1 and W2 (a tile's time ~ its K
    windows), so an expert's W2 tiles are dispatched about when its W1 tiles finish; at most `rows`."""
    a, b = m1 // 256, m2 // 256
    return max(1, min(rows, ceil(slots * k1 / (a * k1 + b * k2))))


class FusedW12Sm90:
    """W1 (M1 = 2I rows, K1 = H) and W2 (M2 = H, K2 = I) of one config in one launch."""

    def __init__(self, m1: int, k1: int, cfg: Sm90Config):
        why = fused_missing(cfg)
        if why:
            raise ValueError(f"sm90 fused W1 + W2: {why}")
        self.w1 = GroupedGemmSm90("w1", m1, k1, cfg)
        self.w2 = GroupedGemmSm90("w2", k1, m1 // 2, cfg)
        self.cfg = cfg
        self.a, self.b = self.w1.m_tiles, self.w2.m_tiles

    @cute.jit
    def __call__(
        self,
        wq1: cute.Tensor,
        ws1: cute.Tensor,
        x1: cute.Tensor,
        sxT1: cute.Tensor,
        ep1_a: cute.Tensor,
        ep1_b: cute.Tensor,
        ep1_c: cute.Tensor,
        sig1: tuple,
        wq2: cute.Tensor,
        ws2: cute.Tensor,
        x2: cute.Tensor,
        sxT2: cute.Tensor,
        ep2_a: cute.Tensor,
        ep2_b: cute.Tensor,
        ep2_c: cute.Tensor,
        sig2: tuple,
        offs: cute.Tensor,
        cnt: cute.Tensor,
        lut: cute.Tensor,
        ticket: Int32,
        timeout_ns: Int64,
        num_experts: Int32,
        rows: Int32,
        first: Int32,
        lag: Int32,
        stream: cuda.CUstream,
    ):
        mma1, bst1, tma1, tx1 = self.w1.prepare(x1)
        mma2, bst2, tma2, tx2 = self.w2.prepare(x2)
        smem = max(self.w1.shared.size_in_bytes(), self.w2.shared.size_in_bytes())
        self.kernel(
            wq1, ws1, tma1, tx1, sxT1, ep1_a, ep1_b, ep1_c, sig1, mma1, bst1,
            wq2, ws2, tma2, tx2, sxT2, ep2_a, ep2_b, ep2_c, sig2, mma2, bst2,
            offs, cnt, lut, ticket, timeout_ns, num_experts, rows, first, lag,
        ).launch(  # fmt: skip
            grid=[rows * (self.a + self.b), 1, 1],
            block=[self.w1.threads, 1, 1],
            use_pdl=self.cfg.pdl,
            smem=smem,
            stream=stream,
            min_blocks_per_mp=self.cfg.occupancy,
            preferred_smem_carveout=100,
        )

    @cute.kernel
    def kernel(
        self,
        wq1: cute.Tensor,
        ws1: cute.Tensor,
        tma1: cute.CopyAtom,
        tx1: cute.Tensor,
        sxT1: cute.Tensor,
        ep1_a: cute.Tensor,
        ep1_b: cute.Tensor,
        ep1_c: cute.Tensor,
        sig1: tuple,
        mma1: cute.TiledMma,
        bst1: cute.ComposedLayout,
        wq2: cute.Tensor,
        ws2: cute.Tensor,
        tma2: cute.CopyAtom,
        tx2: cute.Tensor,
        sxT2: cute.Tensor,
        ep2_a: cute.Tensor,
        ep2_b: cute.Tensor,
        ep2_c: cute.Tensor,
        sig2: tuple,
        mma2: cute.TiledMma,
        bst2: cute.ComposedLayout,
        offs: cute.Tensor,
        cnt: cute.Tensor,
        lut: cute.Tensor,
        ticket: Int32,
        timeout_ns: Int64,
        num_experts: Int32,
        rows: Int32,
        first: Int32,
        lag: Int32,
    ):
        bid, _, _ = cute.arch.block_idx()
        is_w2, y, mt = self.tile_of(bid, rows, lag)
        # one allocation for either kernel's shared-memory struct (the allocator would place a second one after it)
        size = max(self.w1.shared.__sizeof__(), self.w2.shared.__sizeof__())
        align = max(self.w1.shared.__alignof__(), self.w2.shared.__alignof__())
        base = utils.SmemAllocator().allocate(size, align)
        if is_w2 == 0:
            self.w1.body(
                wq1, ws1, tma1, tx1, sxT1, offs, cnt, lut, ep1_a, ep1_b, ep1_c, sig1,
                ticket, timeout_ns, num_experts, first, mma1, bst1, mt, y, Int32(0), base,
            )  # fmt: skip
        else:
            self.w2.body(
                wq2, ws2, tma2, tx2, sxT2, offs, cnt, lut, ep2_a, ep2_b, ep2_c, sig2,
                ticket, timeout_ns, num_experts, first, mma2, bst2, mt, y, Int32(0), base,
            )  # fmt: skip

    @cute.jit
    def tile_of(self, bid: Int32, rows: Int32, lag: Int32):
        """Block bid -> (0: W1 / 1: W2, grid row, M tile) in the order of the module docstring (model: tile_order)."""
        a, b = self.a, self.b
        lag = cutlass.min(lag, rows)
        head = lag * a
        is_w2 = Int32(0)
        y = bid // a
        mt = bid - y * a
        if bid >= head:
            r = bid - head
            mid = (rows - lag) * (a + b)
            if r < mid:
                j = r // (a + b)
                q = r - j * (a + b)
                if q < a:
                    y = lag + j
                    mt = q
                else:
                    is_w2 = Int32(1)
                    y = j
                    mt = q - a
            else:
                r = r - mid
                is_w2 = Int32(1)
                y = rows - lag + r // b
                mt = r - (r // b) * b
        return is_w2, y, mt


def tile_order(rows: int, lag: int, a: int, b: int) -> list[tuple[int, int, int]]:
    """Pure-Python model of FusedW12Sm90.tile_of: (0 / 1, grid row, M tile) of every block in order (CPU tests)."""
    lag = min(lag, rows)
    order = [(0, y, mt) for y in range(lag) for mt in range(a)]
    for j in range(rows - lag):
        order += [(0, lag + j, mt) for mt in range(a)] + [(1, j, mt) for mt in range(b)]
    order += [(1, y, mt) for y in range(rows - lag, rows) for mt in range(b)]
    return order


@cache
def compiled(m1: int, k1: int, cfg: Sm90Config, arch: str = "sm_90a"):
    """Compile the fused launch of W1 [E, m1, k1] and W2 [E, k1, m1 / 2] against fake tensors."""
    kern = FusedW12Sm90(m1, k1, cfg)
    ops1 = fake_operands("w1", m1, k1)
    ops2 = fake_operands("w2", k1, m1 // 2)
    sig1 = tuple(Int64(0) for _ in range(sig_words("w1", cfg)))
    sig2 = tuple(Int64(0) for _ in range(sig_words("w2", cfg)))
    # fake_operands: wq, ws, x, sxT, offs, cnt, lut, then the epilogue's three
    return compile_kernel(
        kern,
        *ops1[:4],
        *ops1[7:],
        sig1,
        *ops2[:4],
        *ops2[7:],
        sig2,
        *ops1[4:7],
        Int32(1),
        Int64(0),
        Int32(1),
        Int32(1),
        Int32(0),
        Int32(1),
        crt.make_fake_stream(),
        arch=arch,
        name=f"fused_w12_m{m1}_k{k1}_n{cfg.n_tile}{'_clamp' if cfg.activation == 'swiglu_clamped' else ''}"
        f"{'_bias' if cfg.bias else ''}{'_ef' if cfg.evict_first else ''}",
    )
