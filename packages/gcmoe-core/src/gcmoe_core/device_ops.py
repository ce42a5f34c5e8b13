"""Memory operations on raw 64-bit addresses (a peer's workspace base + a layout offset, a signal word) for the comm
kernels and the grouped GEMMs that synchronise with them, as inline PTX so the memory-model semantics are explicit:
acquire / release / relaxed with a scope ("gpu" or "sys"), weak accesses (after an acquire, before a release), and
the bounded spin-wait every cross-rank and cross-partition wait goes through. Imports CuTe DSL: kernel modules only.
"""

# No `from __future__ import annotations`: the DSL reads the annotations as live objects.
from .cutedsl import cutlass_modules
from .kernel_helpers import inline_ptx as _asm

cutlass, cute = cutlass_modules()
from cutlass._mlir.dialects import llvm  # noqa: E402
from cutlass.cutlass_dsl import T, dsl_user_op  # noqa: E402

Int32, Int64, Float32 = cutlass.Int32, cutlass.Int64, cutlass.Float32


@dsl_user_op
def ld_acquire_u32(addr, scope: str = "sys", *, loc=None, ip=None):
    return Int32(_asm(T.i32(), [Int64(addr)], f"ld.acquire.{scope}.global.u32 $0, [$1];", "=r,l,~{memory}", loc, ip))


@dsl_user_op
def ld_relaxed_u32(addr, scope: str = "sys", *, loc=None, ip=None):
    return Int32(_asm(T.i32(), [Int64(addr)], f"ld.relaxed.{scope}.global.u32 $0, [$1];", "=r,l,~{memory}", loc, ip))


@dsl_user_op
def st_release_u32(addr, val, scope: str = "sys", *, loc=None, ip=None):
    _asm(None, [Int64(addr), Int32(val)], f"st.release.{scope}.global.u32 [$0], $1;", "l,r,~{memory}", loc, ip)


@dsl_user_op
def atom_add_u32(addr, val, sem: str = "release", scope: str = "sys", *, loc=None, ip=None):
    text = f"atom.{sem}.{scope}.global.add.u32 $0, [$1], $2;"
    return Int32(_asm(T.i32(), [Int64(addr), Int32(val)], text, "=r,l,r,~{memory}", loc, ip))


@dsl_user_op
def atom_cas_u32(addr, cmp, val, scope: str = "sys", sem: str = "relaxed", *, loc=None, ip=None):
    text = f"atom.{sem}.{scope}.global.cas.b32 $0, [$1], $2, $3;"
    return Int32(_asm(T.i32(), [Int64(addr), Int32(cmp), Int32(val)], text, "=r,l,r,r,~{memory}", loc, ip))


@dsl_user_op
def fence_sys(*, loc=None, ip=None):
    _asm(None, [], "fence.acq_rel.sys;", "~{memory}", loc, ip)


@dsl_user_op
def fence_gpu(*, loc=None, ip=None):
    _asm(None, [], "fence.acq_rel.gpu;", "~{memory}", loc, ip)


@dsl_user_op
def fence_scope(scope: str, *, loc=None, ip=None):
    _asm(None, [], f"fence.acq_rel.{scope};", "~{memory}", loc, ip)


@dsl_user_op
def nanosleep(ns, *, loc=None, ip=None):
    _asm(None, [Int32(ns)], "nanosleep.u32 $0;", "r", loc, ip)


@dsl_user_op
def ld_u32(addr, *, loc=None, ip=None):
    return Int32(_asm(T.i32(), [Int64(addr)], "ld.global.u32 $0, [$1];", "=r,l,~{memory}", loc, ip))


@dsl_user_op
def st_u32(addr, val, *, loc=None, ip=None):
    _asm(None, [Int64(addr), Int32(val)], "st.global.u32 [$0], $1;", "l,r,~{memory}", loc, ip)


@dsl_user_op
def ld_u64(addr, *, loc=None, ip=None):
    return Int64(_asm(T.i64(), [Int64(addr)], "ld.global.u64 $0, [$1];", "=l,l,~{memory}", loc, ip))


@dsl_user_op
def st_bf16(addr, val, *, loc=None, ip=None):
    """bf16(val) (round to nearest even) stored at a 2-byte aligned global address."""
    text = "{\n.reg .b16 h;\ncvt.rn.bf16.f32 h, $1;\nst.global.b16 [$0], h;\n}"
    _asm(None, [Int64(addr), Float32(val)], text, "l,f,~{memory}", loc, ip)


@dsl_user_op
def ld_v4(addr, *, loc=None, ip=None):
    """16 bytes from a 16-byte aligned global address, as four Int32."""
    i32 = T.i32()
    res = _asm(
        llvm.StructType.get_literal([i32, i32, i32, i32]),
        [Int64(addr)],
        "ld.global.v4.u32 {$0, $1, $2, $3}, [$4];",
        "=r,=r,=r,=r,l,~{memory}",
        loc,
        ip,
    )
    return tuple(Int32(llvm.extractvalue(i32, res, [i], loc=loc, ip=ip)) for i in range(4))


@dsl_user_op
def st_v4(addr, a, b, c, d, *, loc=None, ip=None):
    _asm(
        None,
        [Int64(addr), Int32(a), Int32(b), Int32(c), Int32(d)],
        "st.global.v4.u32 [$0], {$1, $2, $3, $4};",
        "l,r,r,r,r,~{memory}",
        loc,
        ip,
    )


@cute.jit
def wait_until_eq(addr: Int64, want: Int32, timeout_ns: Int64, scope: cutlass.Constexpr[str], err_addr: Int64) -> Int32:
    """Spin (with a short backoff) until the word at addr equals want, timeout_ns passed, or the error word at
    err_addr became non-zero (another wait of this call failed: stop at once); the last value seen."""
    seen = ld_acquire_u32(addr, scope)
    deadline = cute.arch.globaltimer() + timeout_ns
    spinning = seen != want
    while spinning:
        nanosleep(32)
        seen = ld_acquire_u32(addr, scope)
        spinning = seen != want and cute.arch.globaltimer() <= deadline and ld_relaxed_u32(err_addr, "gpu") == 0
    return seen


@cute.jit
def record_error(err_addr: Int64, kind: Int32, rank: Int32, gen: Int32, seen: Int32):
    """The first failed wait on this rank writes code/kind/rank/gen/seen; later ones only find the code set."""
    if atom_cas_u32(err_addr, 0, 1) == 0:
        st_u32(err_addr + 4, kind)
        st_u32(err_addr + 8, rank)
        st_u32(err_addr + 12, gen)
        st_u32(err_addr + 16, seen)
        fence_sys()
