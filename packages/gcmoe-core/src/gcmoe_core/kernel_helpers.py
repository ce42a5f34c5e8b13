"""Small device helpers (inline PTX) the CuTe DSL kernels of several packages share; imports CuTe DSL: kernel
modules only.
"""

# No `from __future__ import annotations`: the DSL reads the annotations as live objects.
from .cutedsl import cutlass_modules

cutlass, cute = cutlass_modules()
from cutlass._mlir.dialects import llvm  # noqa: E402
from cutlass.cute.runtime import make_fake_compact_tensor  # noqa: E402
from cutlass.cutlass_dsl import T, dsl_user_op  # noqa: E402

Int32, Float32 = cutlass.Int32, cutlass.Float32
F32_ONE = 0x3F800000  # the fp32 bits of 1.0


@dsl_user_op
def bits_to_f32(x, *, loc=None, ip=None):
    return Float32(llvm.bitcast(T.f32(), Int32(x).ir_value(loc=loc, ip=ip), loc=loc, ip=ip))


@dsl_user_op
def f32_to_bits(x, *, loc=None, ip=None):
    return Int32(llvm.bitcast(T.i32(), Float32(x).ir_value(loc=loc, ip=ip), loc=loc, ip=ip))


def inline_ptx(ret, args, text: str, constraints: str, loc, ip, side_effects: bool = True):
    """One inline PTX block: `args` are DSL numbers (already of the operand's type), `ret` the LLVM result type (None:
    no result). The one place the kernels of every package build inline assembly."""
    return llvm.inline_asm(
        ret,
        [a.ir_value(loc=loc, ip=ip) for a in args],
        text,
        constraints,
        has_side_effects=side_effects,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc,
        ip=ip,
    )


def _cvt_pair(ptx: str, hi, lo, loc, ip):
    """One PTX conversion of two fp32 operands ($1 = hi, $2 = lo) into a 32-bit result ($0)."""
    return Int32(inline_ptx(T.i32(), [Float32(hi), Float32(lo)], ptx, "=r,f,f", loc, ip, side_effects=False))


@dsl_user_op
def cvt_e4m3x2(hi, lo, *, loc=None, ip=None):
    """Two fp32 -> two E4M3 bytes (RNE, saturating) in the low 16 bits: byte 0 from lo, byte 1 from hi."""
    return _cvt_pair("{\n.reg .b16 h;\ncvt.rn.satfinite.e4m3x2.f32 h, $1, $2;\ncvt.u32.u16 $0, h;\n}", hi, lo, loc, ip)


@dsl_user_op
def cvt_bf16x2(hi, lo, *, loc=None, ip=None):
    """Two fp32 -> two bf16 (round to nearest even, as torch's .to(bfloat16)): lo in bits 0-15, hi in 16-31."""
    return _cvt_pair("cvt.rn.bf16x2.f32 $0, $1, $2;", hi, lo, loc, ip)


@dsl_user_op
def fmin_nan(a, b, *, loc=None, ip=None):
    """min that returns NaN when either operand is NaN (min.NaN; cute.arch.fmin returns the other: a clamp would
    hide a NaN). fmax_nan likewise."""
    return Float32(
        inline_ptx(T.f32(), [Float32(a), Float32(b)], "min.NaN.f32 $0, $1, $2;", "=f,f,f", loc, ip, side_effects=False)
    )


@dsl_user_op
def fmax_nan(a, b, *, loc=None, ip=None):
    return Float32(
        inline_ptx(T.f32(), [Float32(a), Float32(b)], "max.NaN.f32 $0, $1, $2;", "=f,f,f", loc, ip, side_effects=False)
    )


@dsl_user_op
def bulk_copy_g2s(smem_dst, gmem_src, nbytes, mbar, evict_first=False, *, loc=None, ip=None):
    """cp.async.bulk of nbytes (a multiple of 16; both addresses 16-byte aligned) from global address gmem_src to the
    shared address smem_dst of this CTA, signalling complete_tx on the mbarrier at shared address mbar. One thread
    issues it; the mbarrier must expect the bytes (arrive.expect_tx) in the same phase.
    evict_first (compile-time): an L2 cache hint (createpolicy evict_first, fraction 1): L2 replaces these lines
    before any other, so a stream read once does not push out what L2 held (dirty lines that would cost a write to
    HBM each, or data a later kernel reads)."""
    text = "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$0], [$1], $2, [$3];"
    if evict_first:
        text = (
            "{\n.reg .b64 pol;\ncreatepolicy.fractional.L2::evict_first.b64 pol, 1.0;\n"
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
            " [$0], [$1], $2, [$3], pol;\n}"
        )
    args = [Int32(smem_dst), cutlass.Int64(gmem_src), Int32(nbytes), Int32(mbar)]
    inline_ptx(None, args, text, "r,l,r,r,~{memory}", loc, ip)


@dsl_user_op
def bulk_prefetch_l2(gmem_src, nbytes, *, loc=None, ip=None):
    """cp.async.bulk.prefetch.L2 of nbytes (a multiple of 16, 16-byte aligned) at global address gmem_src: a hint,
    completed by the memory system on its own (no mbarrier, nothing to wait for; the issuing thread may exit)."""
    text = "cp.async.bulk.prefetch.L2.global [$0], $1;"
    inline_ptx(None, [cutlass.Int64(gmem_src), Int32(nbytes)], text, "l,r,~{memory}", loc, ip)


@dsl_user_op
def st_cluster_f32(smem_addr, rank, val, *, loc=None, ip=None):
    """st.shared::cluster of one fp32 to shared address smem_addr (an address of this kernel's shared layout) in the
    CTA of cluster rank `rank` (mapa). Weak: order it with barrier.cluster arrive (release) / wait (acquire)."""
    text = "{\n.reg .b32 ra;\nmapa.shared::cluster.u32 ra, $0, $1;\nst.shared::cluster.f32 [ra], $2;\n}"
    inline_ptx(None, [Int32(smem_addr), Int32(rank), Float32(val)], text, "r,r,f,~{memory}", loc, ip)


@dsl_user_op
def ld_cluster_u32(smem_addr, rank, *, loc=None, ip=None):
    """ld.shared::cluster of one 32-bit word at shared address smem_addr in the CTA of cluster rank `rank` (mapa).
    Weak: order it after the owner's store with barrier.cluster arrive (release) / wait (acquire)."""
    text = "{\n.reg .b32 ra;\nmapa.shared::cluster.u32 ra, $1, $2;\nld.shared::cluster.u32 $0, [ra];\n}"
    return Int32(inline_ptx(T.i32(), [Int32(smem_addr), Int32(rank)], text, "=r,r,r,~{memory}", loc, ip))


@dsl_user_op
def rotl32(x, n: int, *, loc=None, ip=None):
    """The 32-bit x rotated left by n (compile time): one funnel shift."""
    text = f"shf.l.wrap.b32 $0, $1, $1, {n};"
    return Int32(inline_ptx(T.i32(), [Int32(x)], text, "=r,r", loc, ip, side_effects=False))


@dsl_user_op
def ld_shared_v4(smem_addr, *, loc=None, ip=None):
    """ld.shared.v4.u32 at 16-byte aligned shared address smem_addr, as four Int32. Pure (no memory clobber): it may
    move, but not before what its address depends on; the caller orders it after the stores it reads."""
    i32 = T.i32()
    text = "ld.shared.v4.u32 {$0, $1, $2, $3}, [$4];"
    res = inline_ptx(llvm.StructType.get_literal([i32] * 4), [Int32(smem_addr)], text, "=r,=r,=r,=r,r", loc, ip, False)
    return tuple(Int32(llvm.extractvalue(i32, res, [i], loc=loc, ip=ip)) for i in range(4))


@cute.jit
def fp8_pow2_exponent(amax: Float32) -> Int32:
    """e of the power-of-two FP8 scale, the smallest 2^e with amax <= 448 * 2^e, in [-126, 126]: bit-exact with
    formats.fp8_scale_for_amax (amax = 0 gives e = 0)."""
    # amax = 1.f * 2^(E-127): the smallest e with amax <= 1.75 * 2^(8+e) is E - 135, plus 1 when 1.f > 1.75
    bits = f32_to_bits(amax)
    ex = ((bits >> 23) & 0xFF) - 135
    if (bits & 0x7FFFFF) > 0x600000:
        ex = ex + 1
    if amax == Float32(0.0):
        ex = Int32(0)
    return cutlass.max(cutlass.min(ex, 126), -126)


def fake_epilogue_args(mode: str, m: int):
    """Grouped-kernel epilogue operands as fakes for an offline compile: W1 (both kernel packages): route_w fp32 [R],
    hq uint8 [R, M/2] (FP8 bits), hsT fp32 [M/256, R];  W2 (sm103; sm90's W2 scatters through a peer table):
    dst int32 [R], out bf16 [R', M], and an unused fp32 [1]. Every row extent is its own run-time symbol."""
    dyn = cute.sym_int
    if mode == "w1":
        return (
            make_fake_compact_tensor(Float32, (dyn(),), assumed_align=4),
            make_fake_compact_tensor(cutlass.Uint8, (dyn(), m // 2), stride_order=(1, 0), assumed_align=16),
            make_fake_compact_tensor(Float32, (m // 256, dyn()), stride_order=(1, 0), assumed_align=4),
        )
    return (
        make_fake_compact_tensor(Int32, (dyn(),), assumed_align=4),
        make_fake_compact_tensor(cutlass.BFloat16, (dyn(), m), stride_order=(1, 0), assumed_align=16),
        make_fake_compact_tensor(Float32, (1,), assumed_align=4),
    )
