"""LLVM IR building blocks for the fused numba kernels: one MX group as explicit SIMD.

numba types arithmetic on integers narrower than ``intp`` as 64-bit, so the bit manipulations of
fp8 and bf16 rounding written in numba's Python run on 64-bit lanes (half the SIMD width), and a
reduction over a group's 32 elements stays scalar. These helpers emit the same arithmetic as
32-bit vector IR inside numba intrinsics (`mxcli.mx._fused`,
`mxcli.kernels.rmsnorm_mx_prefill._fused`). Every rounding copies torch's CPU casts bit for bit
(tests/mx/test_fused.py and tests/kernels/prefill/test_fused_chain.py compare against torch):

- fp32 -> E4M3FN: round to nearest even, saturating (|v| >= 448 and ±Inf give ±448), NaN -> 0x7F
  with the sign bit;
- fp32 -> E5M2: round to nearest even, overflow to ±Inf (callers clamp first), NaN -> 0x7F with
  the sign bit;
- fp32 -> bf16: round to nearest even; NaN -> one fixed pattern that depends on torch's CPU
  kernel (0xFFFF on the AVX2/AVX-512 paths, 0x7FC0 on the scalar one), passed in by the caller.

numba's on-disk cache is keyed on the source file of each cached function, not on the modules it
calls: after editing this file, touch the kernel modules that use it (or delete their
``__pycache__/*.nb*``) so that they recompile. A fresh install has fresh files.
"""

from __future__ import annotations

from typing import Any

from llvmlite import ir

I8 = ir.IntType(8)
I16 = ir.IntType(16)
I32 = ir.IntType(32)
F32 = ir.FloatType()
GROUP = 32
# Software prefetch distance of `load_fp32`. Measured on this project's 2-core AVX-512 VM: with
# the input 64-byte aligned (every torch allocation) the hardware prefetcher fell behind and the
# 1x32 kernel ran at a third of its speed; prefetching 1 KiB ahead or more removes the
# dependence on alignment (4 KiB: 0.29 ns per element per core).
PREFETCH_BYTES = 4096


def splat(value: int | float, n: int) -> ir.Constant:
    """Constant vector of `n` copies (fp32 for a float, i32 for an int)."""
    ty = F32 if isinstance(value, float) else I32
    return ir.Constant(ir.VectorType(ty, n), [ir.Constant(ty, value)] * n)


def broadcast(builder: ir.IRBuilder, scalar: Any, n: int) -> Any:
    """Vector of `n` copies of a run-time scalar."""
    vec = ir.VectorType(scalar.type, n)
    one = builder.insert_element(ir.Constant(vec, ir.Undefined), scalar, ir.Constant(I32, 0))
    zeros = ir.Constant(ir.VectorType(I32, n), [ir.Constant(I32, 0)] * n)
    return builder.shuffle_vector(one, ir.Constant(vec, ir.Undefined), zeros)


def call_intrinsic(builder: ir.IRBuilder, name: str, ret: ir.Type, args: list[Any]) -> Any:
    """Call an LLVM intrinsic (``llvm.rint.v32f32``, ``llvm.vector.reduce.umax.v32i32``...)."""
    fn = builder.module.globals.get(name)
    if fn is None:
        fn = ir.Function(builder.module, ir.FunctionType(ret, [a.type for a in args]), name=name)
    return builder.call(fn, args)


def _fp8_geometry(e5m2: bool) -> tuple[int, float, int, int, int, int]:
    """(mantissa shift, subnormal step 1/2^-m, smallest normal bits, rebias bits, top bits,
    top code) of E5M2 or E4M3FN, all in fp32 bit terms."""
    if e5m2:  # subnormal below 2^-14 in steps of 2^-16; 2 mantissa bits; >= 2^16 is Inf
        return 21, 65536.0, 113 << 23, 112 << 23, 143 << 23, 0x7C
    # E4M3FN: subnormal below 2^-6 in steps of 2^-9; 3 mantissa bits; saturate at 448
    return 20, 512.0, 121 << 23, 120 << 23, 0x43E00000, 0x7E


def _rint_subnormal(builder: ir.IRBuilder, a: Any, n: int, step: float) -> Any:
    fvec = ir.VectorType(F32, n)
    scaled = builder.fmul(builder.bitcast(a, fvec), splat(step, n))
    return call_intrinsic(builder, f"llvm.rint.v{n}f32", fvec, [scaled])


def encode_fp8(builder: ir.IRBuilder, v: Any, n: int, e5m2: bool) -> Any:
    """fp8 codes (``<n x i8>``) of the fp32 vector `v`, as torch's CPU cast."""
    shift, step, min_normal, rebias, top, top_code = _fp8_geometry(e5m2)
    bits = builder.bitcast(v, ir.VectorType(I32, n))
    sign = builder.and_(builder.lshr(bits, splat(24, n)), splat(0x80, n))
    a = builder.and_(bits, splat(0x7FFFFFFF, n))
    sub = builder.fptosi(_rint_subnormal(builder, a, n, step), ir.VectorType(I32, n))
    odd = builder.and_(builder.lshr(a, splat(shift, n)), splat(1, n))
    rounded = builder.add(builder.add(a, splat((1 << (shift - 1)) - 1, n)), odd)
    nrm = builder.lshr(builder.sub(rounded, splat(rebias, n)), splat(shift, n))
    code = builder.select(builder.icmp_unsigned("<", a, splat(min_normal, n)), sub, nrm)
    code = builder.select(builder.icmp_unsigned(">=", a, splat(top, n)), splat(top_code, n), code)
    is_nan = builder.icmp_unsigned(">", a, splat(0x7F800000, n))
    code = builder.select(is_nan, splat(0x7F, n), code)
    return builder.trunc(builder.or_(code, sign), ir.VectorType(I8, n))


def round_fp8(builder: ir.IRBuilder, v: Any, n: int, e5m2: bool, nan_pos: Any, nan_neg: Any) -> Any:
    """fp32 value of the code `encode_fp8` gives, without going through the code (same
    rounding, saturation and NaNs); `nan_pos`/`nan_neg` are the decoded NaN codes 0x7F/0xFF."""
    shift, step, min_normal, _, top, _ = _fp8_geometry(e5m2)
    ivec = ir.VectorType(I32, n)
    fvec = ir.VectorType(F32, n)
    bits = builder.bitcast(v, ivec)
    sign = builder.and_(bits, splat(-0x80000000, n))
    a = builder.and_(bits, splat(0x7FFFFFFF, n))
    odd = builder.and_(builder.lshr(a, splat(shift, n)), splat(1, n))
    rounded = builder.add(builder.add(a, splat((1 << (shift - 1)) - 1, n)), odd)
    nrm = builder.and_(rounded, splat(-(1 << shift), n))
    over = builder.icmp_unsigned(">=" if e5m2 else ">", nrm, splat(top, n))
    nrm = builder.select(over, splat(0x7F800000 if e5m2 else top, n), nrm)
    sub_value = builder.fmul(_rint_subnormal(builder, a, n, step), splat(1.0 / step, n))
    sub = builder.bitcast(sub_value, ivec)
    mag = builder.select(builder.icmp_unsigned("<", a, splat(min_normal, n)), sub, nrm)
    r = builder.bitcast(builder.or_(mag, sign), fvec)
    negative = builder.icmp_unsigned("!=", sign, splat(0, n))
    nan = builder.select(negative, broadcast(builder, nan_neg, n), broadcast(builder, nan_pos, n))
    is_nan = builder.icmp_unsigned(">", a, splat(0x7F800000, n))
    return builder.select(is_nan, nan, r)


def round_bf16(builder: ir.IRBuilder, v: Any, n: int, nan_bits: Any) -> Any:
    """fp32 vector `v` rounded to bf16 (nearest even) and widened back to fp32; NaN becomes
    the bf16 pattern `nan_bits` (i32 holding the 16-bit pattern)."""
    ivec = ir.VectorType(I32, n)
    bits = builder.bitcast(v, ivec)
    lsb = builder.and_(builder.lshr(bits, splat(16, n)), splat(1, n))
    rounded = builder.and_(builder.add(builder.add(bits, splat(0x7FFF, n)), lsb), splat(-65536, n))
    is_nan = builder.icmp_unsigned(
        ">", builder.and_(bits, splat(0x7FFFFFFF, n)), splat(0x7F800000, n)
    )
    nan = broadcast(builder, builder.shl(nan_bits, ir.Constant(I32, 16)), n)
    return builder.bitcast(builder.select(is_nan, nan, rounded), ir.VectorType(F32, n))


def load_fp32(builder: ir.IRBuilder, ptr: Any, n: int, bf16: bool) -> Any:
    """`n` consecutive elements at `ptr` (bf16 as i16, or fp32) as an fp32 vector; prefetches
    the line `PREFETCH_BYTES` ahead (a hint: never faults past the end of the array)."""
    i8p = I8.as_pointer()
    ahead = builder.gep(builder.bitcast(ptr, i8p), [ir.Constant(ir.IntType(64), PREFETCH_BYTES)])
    hint = [
        ahead,
        ir.Constant(I32, 0),
        ir.Constant(I32, 3),
        ir.Constant(I32, 1),
    ]  # read, keep, data
    call_intrinsic(builder, "llvm.prefetch.p0", ir.VoidType(), hint)
    if bf16:
        vec_ptr = builder.bitcast(ptr, ir.VectorType(I16, n).as_pointer())
        raw = builder.load(vec_ptr, align=2)
        wide = builder.shl(builder.zext(raw, ir.VectorType(I32, n)), splat(16, n))
        return builder.bitcast(wide, ir.VectorType(F32, n))
    return builder.load(builder.bitcast(ptr, ir.VectorType(F32, n).as_pointer()), align=4)


def store(builder: ir.IRBuilder, value: Any, ptr: Any) -> None:
    """Store a vector at an element pointer (unaligned)."""
    elem = value.type.element
    align = 1 if elem == I8 else 4
    builder.store(value, builder.bitcast(ptr, value.type.as_pointer()), align=align)


class GroupScale:
    """The E8M0 scale of one group from its values (prefill spec §3.4, bwd spec §5.2).

    ``byte = clamp(E(amax) - offset, 0, 255)`` with ``E`` the fp32 exponent field of the
    largest magnitude (NaN and Inf have E = 255, so ``byte <= 255`` needs no upper clamp);
    ``inv = 1/X = 2^(127 - byte)`` (a normal power of two for every byte <= 253, so the multiply
    is exact); ``scale = X = 2^(byte - 127)``, the fp32 subnormal 2^-127 for byte 0.
    """

    def __init__(self, builder: ir.IRBuilder, values: list[Any], offset: Any) -> None:
        absmax = None
        for v in values:
            n = v.type.count
            mag = builder.and_(builder.bitcast(v, ir.VectorType(I32, n)), splat(0x7FFFFFFF, n))
            m = call_intrinsic(builder, f"llvm.vector.reduce.umax.v{n}i32", I32, [mag])
            absmax = (
                m
                if absmax is None
                else builder.select(builder.icmp_unsigned(">", m, absmax), m, absmax)
            )
        assert absmax is not None
        byte = builder.sub(builder.lshr(absmax, ir.Constant(I32, 23)), offset)
        byte = builder.select(
            builder.icmp_signed("<", byte, ir.Constant(I32, 0)), ir.Constant(I32, 0), byte
        )
        self.byte = byte
        self.inv = builder.bitcast(
            builder.shl(builder.sub(ir.Constant(I32, 254), byte), ir.Constant(I32, 23)), F32
        )
        x_bits = builder.select(
            builder.icmp_unsigned("==", byte, ir.Constant(I32, 0)),
            ir.Constant(I32, 1 << 22),
            builder.shl(byte, ir.Constant(I32, 23)),
        )
        self.scale = builder.bitcast(x_bits, F32)


def scale_to_fp8_range(
    builder: ir.IRBuilder, v: Any, gs: GroupScale, e5m2: bool, maxval: Any
) -> Any:
    """``v / X`` (exact), clamped to ±max for E5M2 as the torch path does (NaN passes)."""
    n = v.type.count
    v = builder.fmul(v, broadcast(builder, gs.inv, n))
    if e5m2:
        top = broadcast(builder, maxval, n)
        v = builder.select(builder.fcmp_ordered(">", v, top), top, v)
        bottom = builder.fneg(top)
        v = builder.select(builder.fcmp_ordered("<", v, bottom), bottom, v)
    return v
