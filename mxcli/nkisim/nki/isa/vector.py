"""Vector / Scalar / GpSimd instructions (api spec §8).

Arithmetic is fp32: inputs converted to fp32, results rounded once (RNE) to dst's dtype.
Inputs are read completely before dst is written, so in-place use is safe (§5.3 rule 6).
Check-only mode skips the arithmetic of instructions with a float destination (writing zeros
and marking them written); integer destinations (indices, masks) are always computed.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mxcli.nkisim import machine
from mxcli.nkisim import ops as T
from mxcli.nkisim.dtypes import from_fp32
from mxcli.nkisim.errors import NkiValidationError
from mxcli.nkisim.nki.isa._common import (
    PSUM,
    SBUF,
    NkiInstruction,
    check_engine,
    check_parts,
    check_token,
    elementwise_operands,
    flat2,
    is_int_dtype,
    isa_op,
    no_psum,
    not_both_psum,
    operand,
    require_v4,
    scalar_operand,
    skip_arithmetic,
    store_f32,
    store_int,
)
from mxcli.nkisim.nki.isa.enums import as_enum, engine, reduce_cmd
from mxcli.nkisim.ops import OpToken
from mxcli.nkisim.rules import Rule, rule_error
from mxcli.nkisim.target import nc_version
from mxcli.nkisim.tensor import Access, NkiTensor, VirtualRegister, register_or_int

__all__ = [
    "tensor_copy",
    "memset",
    "iota",
    "tensor_tensor",
    "tensor_scalar",
    "tensor_scalar_reduce",
    "scalar_tensor_tensor",
    "tensor_reduce",
    "activation",
    "activation_reduce",
    "activate2",
    "reciprocal",
    "exponential",
    "max8",
    "nc_find_index8",
    "topk",
    "nc_stream_shuffle",
]

_E = engine
_RC = reduce_cmd
F32 = np.float32


def _alu_check(op: str, name: str, tok: OpToken, *, allow_unary: bool = True) -> None:
    if not (tok.is_alu or tok.is_bitvec) or tok is T.bypass:
        raise NkiValidationError(f"{op}: {name}={tok!r} is not an ALU operator")
    if not tok.isa_alu:
        # api spec §12.16 decision: nl.divide is not an ISA ALU op
        raise NkiValidationError(f"{op}: {name}=nl.divide is not supported by the ISA ALU")
    if not allow_unary and (tok.is_unary_alu or tok.bitvec_unary is not None):
        raise NkiValidationError(f"{op}: {name}={tok!r} is unary; a binary operator is required")


def _apply(tok: OpToken, a: Any, b: Any, reverse: bool) -> np.ndarray:
    """``tok(a, b)``, or ``tok(b, a)`` when reversed; unary operators ignore b."""
    if tok.is_unary_alu:
        return tok.apply(a, None)
    return tok.apply(b, a) if reverse else tok.apply(a, b)


# -- copies and fills ---------------------------------------------------------------------------


@isa_op()
def tensor_copy(
    dst: NkiTensor, src: NkiTensor, engine: engine = engine.unknown, name: str | None = None
) -> NkiInstruction:
    """``dst = src`` (api spec §8.1): bit-exact for equal dtypes, else via fp32."""
    op = "tensor_copy"
    e = check_engine(op, engine, (_E.unknown, _E.vector, _E.scalar, _E.gpsimd))
    prog = machine.current()
    if e is _E.scalar and prog.target.version < nc_version.gen3:
        raise NkiValidationError(
            f"{op}: the scalar engine cannot tensor_copy on {prog.target.name}"
        )
    eng = "vector" if e is _E.unknown else e.name
    prog.begin(op, eng)
    s, d = elementwise_operands(op, dst, ("src", src), engine_name=eng)
    if s.dtype is d.dtype:
        d.write(s.read().reshape(d.shape))
    else:
        store_f32(d, s.read_f32())
    return NkiInstruction(op)


@isa_op()
def memset(
    dst: NkiTensor, value: Any, engine: engine = engine.unknown, name: str | None = None
) -> NkiInstruction:
    """Fill dst with a compile-time constant (api spec §8.2)."""
    op = "memset"
    e = check_engine(op, engine, (_E.unknown, _E.vector, _E.gpsimd))
    prog = machine.current()
    eng = "vector" if e is _E.unknown else e.name
    prog.begin(op, eng)
    d = operand(op, "dst", dst)
    check_parts(op, d)
    if eng == "gpsimd":
        no_psum(op, eng, d)
    if isinstance(value, (NkiTensor, VirtualRegister)):
        raise NkiValidationError(
            f"{op}: value must be a compile-time constant, got {type(value).__name__}"
        )
    dt = d.dtype
    if dt.kind == "x4":
        if value != 0:
            raise rule_error(Rule.MEMSET_X4, f"{op}: {dt} dst accepts only value=0 (got {value!r})")
        d.write(np.zeros(d.shape, dtype=dt.np_dtype))
        return NkiInstruction(op)
    if is_int_dtype(dt):
        if isinstance(value, (float, np.floating)):
            raise NkiValidationError(
                f"{op}: a float value cannot fill an integer dst (got {value!r} for {dt})"
            )
        # out-of-range literals (0xFFFFFFFF into int32) store their low bits
        store_int(d, np.full(d.shape, int(value), dtype=np.int64))
        return NkiInstruction(op)
    d.write(from_fp32(np.full(d.shape, float(value), dtype=F32), dt))
    return NkiInstruction(op)


@isa_op()
def iota(
    dst: NkiTensor,
    pattern: Any,
    offset: Any = 0,
    channel_multiplier: Any = 0,
    name: str | None = None,
) -> NkiInstruction:
    """``dst[p, ...] = offset + p*channel_multiplier + sum(idx*step)`` in int32 (api spec §8.3)."""
    op = "iota"
    prog = machine.current()
    prog.begin(op, "gpsimd")
    d = operand(op, "dst", dst, (SBUF,))
    check_parts(op, d)
    pairs = [tuple(int(v) for v in p) for p in pattern]
    if not 1 <= len(pairs) <= 4 or any(len(p) != 2 for p in pairs):
        raise NkiValidationError(f"{op}: pattern must be 1..4 [step, num] pairs, got {pattern!r}")
    n = int(np.prod([p[1] for p in pairs]))
    if n != d.per_part:
        raise NkiValidationError(
            f"{op}: pattern covers {n} elements per partition, dst has {d.per_part}"
        )
    off = register_or_int(offset, f"{op}: offset")
    cm = register_or_int(channel_multiplier, f"{op}: channel_multiplier")
    v = np.zeros((), dtype=np.int64)
    for step, num in pairs:
        v = v[..., None] + np.arange(num, dtype=np.int64) * step
    vals = off + np.arange(d.parts, dtype=np.int64)[:, None] * cm + v.reshape(1, -1)
    vals = ((vals + (1 << 31)) % (1 << 32)) - (1 << 31)  # int32 arithmetic
    if is_int_dtype(d.dtype):
        info = np.iinfo(d.dtype.np_dtype) if d.dtype.kind != "bool" else np.iinfo(np.uint8)
        d.write(np.clip(vals, info.min, info.max).astype(d.dtype.np_dtype).reshape(d.shape))
    else:
        store_f32(d, vals.astype(F32))
    return NkiInstruction(op)


# -- element-wise ALU -----------------------------------------------------------------------------

_INT_EXACT = {
    "add": np.add,
    "subtract": np.subtract,
    "multiply": np.multiply,
    "maximum": np.maximum,
    "minimum": np.minimum,
    "equal": np.equal,
    "not_equal": np.not_equal,
    "greater": np.greater,
    "greater_equal": np.greater_equal,
    "less": np.less,
    "less_equal": np.less_equal,
}


@isa_op()
def tensor_tensor(
    dst: NkiTensor,
    data1: NkiTensor,
    data2: NkiTensor,
    op: Any,
    engine: engine = engine.unknown,
    name: str | None = None,
) -> NkiInstruction:
    """``dst = op(data1, data2)`` element-wise (api spec §8.4)."""
    opn = "tensor_tensor"
    tok = check_token(opn, "op", op)
    _alu_check(opn, "op", tok, allow_unary=False)
    e = check_engine(opn, engine, (_E.unknown, _E.vector, _E.gpsimd))
    prog = machine.current()
    a, b, d = elementwise_operands(opn, dst, ("data1", data1), ("data2", data2))
    not_both_psum(opn, a, b)
    any_psum = PSUM in (a.buffer, b.buffer, d.buffer)
    all_i32 = all(x.dtype.name in ("int32", "uint32") for x in (a, b, d))
    if tok is T.power:
        if e is _E.vector:
            raise NkiValidationError(f"{opn}: nl.power runs on the gpsimd engine, not vector")
        eng = "gpsimd"
    elif tok.is_bitvec:
        if e is _E.gpsimd:
            raise NkiValidationError(f"{opn}: bitvec operators run on the vector engine")
        eng = "vector"
    elif e is _E.unknown:
        eng = "gpsimd" if all_i32 and not any_psum else "vector"
    else:
        eng = e.name
    if eng == "gpsimd":
        no_psum(opn, eng, a, b, d)
    prog.begin(opn, eng)
    if tok.is_bitvec:
        for x in (a, b, d):
            if not is_int_dtype(x.dtype):
                raise NkiValidationError(
                    f"{opn}: bitvec op {tok!r} needs integer dtypes ({x.name} is {x.dtype})"
                )
        res = tok.bitvec(a.read().astype(np.int64), b.read().astype(np.int64))  # type: ignore[misc]
        store_int(d, res)
        return NkiInstruction(opn)
    if eng == "gpsimd" and all_i32 and tok.name in _INT_EXACT:
        # api spec §8.4: exact 32-bit integer arithmetic on GpSimd when all operands are int32/uint32
        res = _INT_EXACT[tok.name](a.read().astype(np.int64), b.read().astype(np.int64))
        store_int(d, res)
        return NkiInstruction(opn)
    if skip_arithmetic(prog, d, a, b):
        return NkiInstruction(opn)
    store_f32(d, tok.apply(a.read_f32(), b.read_f32().reshape(a.shape)))
    return NkiInstruction(opn)


def fp32_tile_operands(op: str, **operands: Any) -> None:
    """2.32 stub of ``tensor_scalar`` / ``tensor_scalar_reduce``: with arithmetic operators "the
    operand0 and operand1 (if used) must be float32" -- a tile operand of another dtype is not
    converted by value on hardware."""
    for nm, val in operands.items():
        if isinstance(val, NkiTensor) and val.dtype.name != "float32":
            raise rule_error(
                Rule.TENSOR_SCALAR_FP32,
                f"{op}: {nm} tile must be float32 (got {val.dtype}); convert it with "
                "tensor_copy first",
            )


_SCALAR_ENGINE_PAIRS = {("multiply", "add"), ("multiply", None), ("add", None)}


@isa_op()
def tensor_scalar(
    dst: NkiTensor,
    data: NkiTensor,
    op0: Any,
    operand0: Any,
    reverse0: bool = False,
    op1: Any = None,
    operand1: Any = None,
    reverse1: bool = False,
    engine: engine = engine.unknown,
    name: str | None = None,
) -> NkiInstruction:
    """``dst = op1(op0(data, operand0), operand1)`` with scalar / per-partition operands."""
    opn = "tensor_scalar"
    t0 = check_token(opn, "op0", op0)
    _alu_check(opn, "op0", t0)
    if (op1 is None) != (operand1 is None) and not (op1 is not None and _is_unary(op1)):
        raise NkiValidationError(f"{opn}: op1 and operand1 must both be given or both be None")
    t1 = check_token(opn, "op1", op1) if op1 is not None else None
    if t1 is not None:
        _alu_check(opn, "op1", t1)
        if t0.is_bitvec != t1.is_bitvec:
            raise NkiValidationError(f"{opn}: op0 and op1 must be both arithmetic or both bitvec")
    for tok, val, nm in ((t0, operand0, "operand0"), (t1, operand1, "operand1")):
        if tok is not None and (tok.is_unary_alu or tok.bitvec_unary) and val not in (None, 0, 0.0):
            raise NkiValidationError(f"{opn}: unary {tok!r} needs {nm} None or 0 (got {val!r})")
    e = check_engine(opn, engine, (_E.unknown, _E.vector, _E.scalar, _E.gpsimd))
    uses_rsqrt = t0 is T.rsqrt or t1 is T.rsqrt
    if t0.is_bitvec:
        if e not in (_E.unknown, _E.vector):
            raise NkiValidationError(f"{opn}: bitvec operators run on the vector engine only")
        eng = "vector"
    elif uses_rsqrt:
        if e not in (_E.unknown, _E.gpsimd):
            raise NkiValidationError(
                f"{opn}: rsqrt runs on the gpsimd engine only in tensor_scalar"
            )
        eng = "gpsimd"
    else:
        eng = "vector" if e is _E.unknown else e.name
    if eng == "scalar" and (t0.name, t1.name if t1 else None) not in _SCALAR_ENGINE_PAIRS:
        raise NkiValidationError(
            f"{opn}: the scalar engine supports (multiply, add), (multiply, None), (add, None); "
            f"got ({t0.name}, {t1.name if t1 else None})"
        )
    prog = machine.current()
    x, d = elementwise_operands(opn, dst, ("data", data), engine_name=eng)
    prog.begin(opn, eng)
    if not t0.is_bitvec:
        fp32_tile_operands(opn, operand0=operand0, operand1=operand1)
    s0 = scalar_operand(opn, "operand0", operand0, x.parts, allow_none=True)
    s1 = scalar_operand(opn, "operand1", operand1, x.parts, allow_none=True)
    if t0.is_bitvec:
        for a in (x, d):
            if not is_int_dtype(a.dtype):
                raise NkiValidationError(
                    f"{opn}: bitvec ops need integer dtypes ({a.name} is {a.dtype})"
                )
        v = flat2(x.read().astype(np.int64), x.parts)
        r = _bitvec(t0, v, s0, reverse0)
        if t1 is not None:
            r = _bitvec(t1, r, s1, reverse1)
        store_int(d, r)
        return NkiInstruction(opn)
    if skip_arithmetic(prog, d, x):
        return NkiInstruction(opn)
    v = flat2(x.read_f32(), x.parts)
    r = _apply(t0, v, s0, reverse0)
    if t1 is not None:
        r = _apply(t1, r, s1, reverse1)
    store_f32(d, r)
    return NkiInstruction(opn)


def _is_unary(tok: Any) -> bool:
    return isinstance(tok, OpToken) and (tok.is_unary_alu or tok.bitvec_unary is not None)


def _bitvec(tok: OpToken, v: np.ndarray, s: Any, reverse: bool) -> np.ndarray:
    if tok.bitvec_unary is not None:
        return tok.bitvec_unary(v)
    sv = np.asarray(s if s is not None else 0)
    if sv.dtype.kind == "f":
        if not np.all(np.mod(sv, 1) == 0):
            raise NkiValidationError(f"tensor_scalar: bitvec operand must be an integer, got {s!r}")
        sv = sv.astype(np.int64)
    a, b = (sv, v) if reverse else (v, sv)
    assert tok.bitvec is not None
    return tok.bitvec(a, b)


_REDUCERS = {"add": np.add, "multiply": np.multiply, "maximum": np.maximum, "minimum": np.minimum}


@isa_op()
def tensor_scalar_reduce(
    dst: NkiTensor,
    data: NkiTensor,
    op0: Any,
    operand0: Any,
    reduce_op: Any,
    reduce_res: Any = None,
    reverse0: bool = False,
    reduce_cmd: reduce_cmd = reduce_cmd.reset_reduce,
    reduce_init: Any = None,
    reduce_res_negate: bool = False,
    name: str | None = None,
) -> NkiInstruction:
    """``dst = data <op0> operand0`` on the Vector engine, reduced along the free dims into the
    VectorE accumulator (2.32 stub). reset_reduce starts from reduce_op's identity, reduce
    continues, load_reduce starts from `reduce_init`; `reduce_res` (P, 1) receives the result,
    negated when `reduce_res_negate`."""
    opn = "tensor_scalar_reduce"
    t0 = check_token(opn, "op0", op0)
    _alu_check(opn, "op0", t0)
    if t0.is_bitvec:
        raise NkiValidationError(f"{opn}: op0 must be arithmetic (bitvec operators unsupported)")
    red = check_token(opn, "reduce_op", reduce_op)
    if red.name not in _REDUCERS:
        raise NkiValidationError(
            f"{opn}: reduce_op must be nl.add, nl.multiply, nl.maximum or nl.minimum (got {red!r})"
        )
    if reverse0:
        raise NkiValidationError(f"{opn}: reverse0 is not supported yet (2.32 stub)")
    cmd = as_enum(reduce_cmd, _RC, opn, "reduce_cmd")
    if cmd not in (_RC.reset_reduce, _RC.reduce, _RC.load_reduce):
        raise NkiValidationError(
            f"{opn}: reduce_cmd must be reset_reduce, reduce or load_reduce (got {cmd.name})"
        )
    if (reduce_init is not None) != (cmd is _RC.load_reduce):
        raise NkiValidationError(f"{opn}: reduce_init is given exactly when reduce_cmd=load_reduce")
    prog = machine.current()
    x, d = elementwise_operands(opn, dst, ("data", data), engine_name="vector")
    prog.begin(opn, "vector")
    fp32_tile_operands(opn, operand0=operand0, reduce_init=reduce_init)
    P = x.parts
    s0 = scalar_operand(opn, "operand0", operand0, P, allow_none=t0.is_unary_alu)
    init = scalar_operand(opn, "reduce_init", reduce_init, P, allow_none=True)
    rr = _reduce_res_operand(opn, reduce_res, P)
    if skip_arithmetic(prog, d, x):
        _store_reduce_res(rr, None)
        return NkiInstruction(opn)
    r = _apply(t0, flat2(x.read_f32(), P), s0, False)
    store_f32(d, r)
    acc = prog.vector_acc
    if cmd is _RC.reset_reduce:
        acc[:P] = F32(red.identity)
    elif cmd is _RC.load_reduce:
        acc[:P] = np.broadcast_to(np.asarray(init, dtype=F32).reshape(-1), (P,))
    f = _REDUCERS[red.name]
    acc[:P] = f(acc[:P], f.reduce(np.asarray(r, dtype=F32), axis=-1, dtype=F32)).astype(F32)
    if rr is not None:
        store_f32(rr, (-acc[:P] if reduce_res_negate else acc[:P]).reshape(P, 1))
    return NkiInstruction(opn)


@isa_op()
def scalar_tensor_tensor(
    dst: NkiTensor,
    data: NkiTensor,
    op0: Any,
    operand0: Any,
    op1: Any,
    operand1: NkiTensor,
    reverse0: bool = False,
    reverse1: bool = False,
    name: str | None = None,
) -> NkiInstruction:
    """``dst = op1(op0(data, operand0), operand1)`` (Vector; api spec §8.6)."""
    opn = "scalar_tensor_tensor"
    t0 = check_token(opn, "op0", op0)
    t1 = check_token(opn, "op1", op1)
    for nm, tk in (("op0", t0), ("op1", t1)):
        _alu_check(opn, nm, tk)
        if tk.is_bitvec:
            raise NkiValidationError(f"{opn}: {nm} must be arithmetic (got bitvec {tk!r})")
    prog = machine.current()
    prog.begin(opn, "vector")
    x, o1, d = elementwise_operands(opn, dst, ("data", data), ("operand1", operand1))
    not_both_psum(opn, x, o1)
    s0 = scalar_operand(opn, "operand0", operand0, x.parts)
    if skip_arithmetic(prog, d, x, o1):
        return NkiInstruction(opn)
    t = _apply(t0, flat2(x.read_f32(), x.parts), s0, reverse0)
    r = _apply(t1, t, flat2(o1.read_f32(), x.parts), reverse1)
    store_f32(d, r)
    return NkiInstruction(opn)


@isa_op()
def tensor_reduce(
    dst: NkiTensor,
    op: Any,
    data: NkiTensor,
    axis: Any,
    negate: bool = False,
    keepdims: bool = False,
    name: str | None = None,
) -> NkiInstruction:
    """Reduce trailing free axes (api spec §8.7); fp32 for arithmetic ops, raw bits for bitvec."""
    opn = "tensor_reduce"
    tok = check_token(opn, "op", op)
    if not tok.reducible:
        raise NkiValidationError(f"{opn}: {tok!r} is not a legal reduction operator")
    prog = machine.current()
    prog.begin(opn, "vector")
    x = operand(opn, "data", data)
    d = operand(opn, "dst", dst)
    for a in (x, d):
        check_parts(opn, a)
    axes = (axis,) if isinstance(axis, int) else tuple(int(a) for a in axis)
    nd = len(x.shape)
    axes = tuple(sorted(a % nd if a < 0 else a for a in axes))
    if 0 in axes:
        raise NkiValidationError(f"{opn}: axis 0 (the partition dim) cannot be reduced")
    if not axes or axes != tuple(range(nd - len(axes), nd)):
        raise NkiValidationError(
            f"{opn}: axis must be the trailing free dims ending at dim {nd - 1} (got {axis!r})"
        )
    kept = int(np.prod(x.shape[1 : nd - len(axes)]))
    if d.parts != x.parts or d.per_part != kept:
        raise NkiValidationError(
            f"{opn}: dst must have {x.parts} partitions x {kept} elements (got {d.shape})"
        )
    if tok.is_bitvec:
        if negate:
            raise NkiValidationError(f"{opn}: negate is for arithmetic reductions only")
        v = x.read().astype(np.int64).reshape(x.parts, kept, -1) & 0xFFFFFFFF
        ufunc = {
            "bitwise_and": np.bitwise_and,
            "bitwise_or": np.bitwise_or,
            "bitwise_xor": np.bitwise_xor,
        }[tok.name]
        store_int(d, ufunc.reduce(v, axis=-1))
        return NkiInstruction(opn)
    if skip_arithmetic(prog, d, x):
        return NkiInstruction(opn)
    v = x.read_f32().reshape(x.parts, kept, -1)
    r = _reduce_f32(tok, v)
    if negate:
        r = -r
    store_f32(d, r)
    return NkiInstruction(opn)


def _reduce_f32(tok: OpToken, v: np.ndarray) -> np.ndarray:
    if tok is T.add:
        return v.sum(axis=-1, dtype=F32)
    if tok is T.multiply:
        return v.prod(axis=-1, dtype=F32)
    if tok is T.maximum:
        return v.max(axis=-1)
    if tok is T.minimum:
        return v.min(axis=-1)
    if tok is T.subtract:
        return (v[..., 0] - v[..., 1:].sum(axis=-1, dtype=F32)).astype(F32)
    nz = v != 0
    if tok is T.logical_and:
        return nz.all(axis=-1).astype(F32)
    if tok is T.logical_or:
        return nz.any(axis=-1).astype(F32)
    if tok is T.logical_xor:
        return (nz.sum(axis=-1) % 2).astype(F32)
    raise NkiValidationError(f"tensor_reduce: unsupported reduction {tok!r}")


# -- activations (Scalar engine) --------------------------------------------------------------


def _acc_update(
    acc: np.ndarray, parts: int, cmd: reduce_cmd, values: np.ndarray | None, init: float = 0.0
) -> None:
    """api spec §5.4 / §12.13: lane = partition index relative to the data operand's start."""
    if cmd in (_RC.reset, _RC.reset_reduce):
        acc[:parts] = 0.0
    elif cmd is _RC.load_reduce:
        acc[:parts] = F32(init)
    if cmd in (_RC.reduce, _RC.reset_reduce, _RC.load_reduce) and values is not None:
        acc[:parts] = (acc[:parts] + values.reshape(parts, -1).sum(axis=-1, dtype=F32)).astype(F32)


def _reduce_res_operand(op: str, reduce_res: Any, parts: int) -> Access | None:
    if reduce_res is None:
        return None
    r = operand(op, "reduce_res", reduce_res)
    if r.parts != parts or r.per_part != 1:
        raise NkiValidationError(
            f"{op}: reduce_res must have {parts} partitions and one element each (got {r.shape})"
        )
    return r


def _store_reduce_res(rr: Access | None, acc: np.ndarray | None) -> None:
    """Copy the accumulator lanes of reduce_res's partitions into it (zeros when acc is None:
    check-only mode)."""
    if rr is None:
        return
    if acc is None:
        rr.write_zero()
    else:
        store_f32(rr, acc[: rr.parts].reshape(rr.parts, 1))


def _activation(
    opn: str,
    dst: NkiTensor,
    op: Any,
    data: NkiTensor,
    bias: Any,
    scale: Any,
    reduce_op: Any,
    reduce_res: Any,
    cmd: reduce_cmd,
) -> NkiInstruction:
    tok = check_token(opn, "op", op)
    if tok.act is None:
        raise NkiValidationError(f"{opn}: op={tok!r} is not an activation function")
    if reduce_op is not None and reduce_op is not T.add:
        raise NkiValidationError(f"{opn}: reduce_op must be nl.add (got {reduce_op!r})")
    prog = machine.current()
    prog.begin(opn, "scalar")
    x, d = elementwise_operands(opn, dst, ("data", data))
    P = x.parts
    sc = scalar_operand(opn, "scale", scale, P)
    if isinstance(bias, NkiTensor):
        if bias.dtype.name == "tfloat32":
            raise NkiValidationError(f"{opn}: bias cannot be tfloat32")
        b = scalar_operand(opn, "bias", bias, P)
    elif bias is None:
        b = 0.0
    else:
        if prog.target.version < nc_version.gen3:
            raise NkiValidationError(
                f"{opn}: a scalar bias needs NeuronCore-v3+ (use a (P, 1) tile)"
            )
        b = scalar_operand(opn, "bias", bias, P)
    rr = _reduce_res_operand(opn, reduce_res, P)
    if skip_arithmetic(prog, d, x):
        _acc_update(prog.scalar_acc, P, cmd, None)
        _store_reduce_res(rr, None)
        return NkiInstruction(opn)
    v = flat2(x.read_f32(), P)
    pre = ((v * sc) + b).astype(F32)  # type: ignore[operator]
    y = tok.act(pre)
    store_f32(d, y)
    _acc_update(prog.scalar_acc, P, cmd, y)
    _store_reduce_res(rr, prog.scalar_acc)
    return NkiInstruction(opn)


@isa_op()
def activation(
    dst: NkiTensor,
    op: Any,
    data: NkiTensor,
    bias: Any = None,
    scale: Any = 1.0,
    reduce_op: Any = None,
    reduce_res: Any = None,
    reduce_cmd: reduce_cmd = reduce_cmd.idle,
    name: str | None = None,
) -> NkiInstruction:
    """``dst = op(data*scale + bias)`` on the Scalar engine, optional sum into the ScalarE
    accumulator (api spec §8.8, §12.14: the reduction sums fp32 values before the cast)."""
    cmd = as_enum(reduce_cmd, _RC, "activation", "reduce_cmd")
    return _activation("activation", dst, op, data, bias, scale, reduce_op, reduce_res, cmd)


@isa_op()
def activation_reduce(
    dst: NkiTensor,
    op: Any,
    data: NkiTensor,
    reduce_op: Any,
    reduce_res: Any,
    bias: Any = None,
    scale: Any = 1.0,
    name: str | None = None,
) -> NkiInstruction:
    """``activation(..., reduce_cmd=reset_reduce)`` (api spec §8.9)."""
    if reduce_op is not T.add:
        raise NkiValidationError(f"activation_reduce: reduce_op must be nl.add (got {reduce_op!r})")
    return _activation(
        "activation_reduce", dst, op, data, bias, scale, reduce_op, reduce_res, _RC.reset_reduce
    )


_ACT2_PAIRS = {
    ("multiply", "add"),
    ("multiply", "subtract"),
    ("multiply", "bypass"),
    ("add", "bypass"),
    ("subtract", "bypass"),
    ("bypass", "bypass"),
}


@isa_op()
def activate2(
    dst: NkiTensor,
    op: Any,
    data: NkiTensor,
    imm0: Any,
    imm1: Any,
    op0: Any,
    op1: Any,
    relu_param: float = 0.0,
    reverse0: bool = False,
    reverse1: bool = False,
    reduce_op: Any = None,
    reduce_res: Any = None,
    reduce_cmd: reduce_cmd = reduce_cmd.idle,
    name: str | None = None,
) -> NkiInstruction:
    """Two ALU stages then an activation, v4 only (api spec §8.10)."""
    opn = "activate2"
    cmd = as_enum(reduce_cmd, _RC, opn, "reduce_cmd")
    tok = check_token(opn, "op", op)
    t0 = check_token(opn, "op0", op0)
    t1 = check_token(opn, "op1", op1)
    if tok.act is None:
        raise NkiValidationError(f"{opn}: op={tok!r} is not an activation function")
    if (t0.name, t1.name) not in _ACT2_PAIRS:
        raise NkiValidationError(
            f"{opn}: (op0, op1) = ({t0.name}, {t1.name}) is not an allowed pair"
        )
    red = {T.add, T.maximum, T.minimum, T.abs_max, T.abs_min}
    if reduce_op is not None and reduce_op not in red:
        raise NkiValidationError(f"{opn}: reduce_op must be add/maximum/minimum/abs_max/abs_min")
    prog = machine.current()
    prog.begin(opn, "scalar")
    require_v4(opn)
    x, d = elementwise_operands(opn, dst, ("data", data))
    P = x.parts
    i0 = scalar_operand(opn, "imm0", imm0, P)
    i1 = scalar_operand(opn, "imm1", imm1, P)
    rr = _reduce_res_operand(opn, reduce_res, P)
    if skip_arithmetic(prog, d, x):
        _store_reduce_res(rr, None)
        return NkiInstruction(opn)
    v = flat2(x.read_f32(), P)
    if t0 is not T.bypass:
        v = _apply(t0, v, i0, reverse0)
    if t1 is not T.bypass:
        v = _apply(t1, v, i1, reverse1)
    if tok is T.prelu:
        y = np.where(v > 0, v, F32(relu_param) * v).astype(F32)
    else:
        y = tok.act(v)
    store_f32(d, y)
    rop = reduce_op or T.add
    acc = prog.scalar_acc
    if cmd in (_RC.reset, _RC.reset_reduce):
        acc[:P] = F32(rop.identity if rop.identity is not None else 0.0)
    if cmd in (_RC.reduce, _RC.reset_reduce):
        if rop is T.add:
            acc[:P] = acc[:P] + y.sum(axis=-1, dtype=F32)
        else:
            r = y[:, 0]
            for j in range(1, y.shape[1]):
                r = rop.apply(r, y[:, j])
            acc[:P] = rop.apply(acc[:P], r)
    _store_reduce_res(rr, acc)
    return NkiInstruction(opn)


@isa_op()
def reciprocal(dst: NkiTensor, data: NkiTensor, name: str | None = None) -> NkiInstruction:
    """``dst = 1/data`` in fp32 on the Vector engine (api spec §8.11)."""
    opn = "reciprocal"
    prog = machine.current()
    prog.begin(opn, "vector")
    x, d = elementwise_operands(opn, dst, ("data", data))
    if skip_arithmetic(prog, d, x):
        return NkiInstruction(opn)
    with np.errstate(divide="ignore"):
        store_f32(d, F32(1.0) / flat2(x.read_f32(), x.parts))
    return NkiInstruction(opn)


@isa_op()
def exponential(
    dst: NkiTensor,
    src: NkiTensor,
    max_value: Any = 0.0,
    reduce_res: Any = None,
    reduce_cmd: reduce_cmd = reduce_cmd.idle,
    reduce_init: float = 0.0,
    name: str | None = None,
) -> NkiInstruction:
    """``dst = exp(src - max_value)`` with an optional sum into the VectorE accumulator
    (api spec §8.12; §12.13: ``idle`` leaves the accumulator unchanged)."""
    opn = "exponential"
    cmd = as_enum(reduce_cmd, _RC, opn, "reduce_cmd")
    prog = machine.current()
    prog.begin(opn, "vector")
    require_v4(opn)
    x, d = elementwise_operands(opn, dst, ("src", src))
    if reduce_init not in (None, 0, 0.0) and cmd is not _RC.load_reduce:
        raise NkiValidationError(
            f"{opn}: reduce_init needs reduce_cmd=load_reduce (got {cmd.name})"
        )
    P = x.parts
    mv = scalar_operand(opn, "max_value", max_value, P)
    rr = _reduce_res_operand(opn, reduce_res, P)
    if skip_arithmetic(prog, d, x):
        _store_reduce_res(rr, None)
        return NkiInstruction(opn)
    v = (flat2(x.read_f32(), P) - mv).astype(F32)
    y = T.exp.act(v)  # type: ignore[misc]
    store_f32(d, y)
    _acc_update(prog.vector_acc, P, cmd, y, float(reduce_init or 0.0))
    _store_reduce_res(rr, prog.vector_acc)
    return NkiInstruction(opn)


# -- router ops -------------------------------------------------------------------------------


@isa_op()
def max8(dst: NkiTensor, src: NkiTensor, name: str | None = None) -> NkiInstruction:
    """The 8 largest values per partition in descending order (api spec §8.13; §12 decision:
    NaN sorts as the largest value)."""
    opn = "max8"
    prog = machine.current()
    prog.begin(opn, "vector")
    x = operand(opn, "src", src)
    d = operand(opn, "dst", dst)
    for a in (x, d):
        check_parts(opn, a)
    if not 8 <= x.per_part <= 16384:
        raise NkiValidationError(
            f"{opn}: src must have 8..16384 elements per partition (got {x.per_part})"
        )
    if d.parts != x.parts or d.per_part != 8:
        raise NkiValidationError(f"{opn}: dst must be ({x.parts}, 8) (got {d.shape})")
    if skip_arithmetic(prog, d, x):
        return NkiInstruction(opn)
    v = flat2(x.read_f32(), x.parts)
    top = np.sort(v, axis=-1)[:, ::-1][:, :8]
    store_f32(d, top)
    return NkiInstruction(opn)


@isa_op()
def nc_find_index8(
    dst: NkiTensor, data: NkiTensor, vals: NkiTensor, name: str | None = None
) -> NkiInstruction:
    """Index of the first element equal to each of 8 values (fp32 compare); duplicate values
    take successive occurrences; not found -> all ones (api spec §8.14)."""
    opn = "nc_find_index8"
    prog = machine.current()
    prog.begin(opn, "vector")
    x = operand(opn, "data", data)
    v = operand(opn, "vals", vals)
    d = operand(opn, "dst", dst)
    for a in (x, v, d):
        check_parts(opn, a)
    if not 8 <= x.per_part <= 16384:
        raise NkiValidationError(
            f"{opn}: data must have 8..16384 elements per partition (got {x.per_part})"
        )
    if v.parts != x.parts or v.per_part != 8:
        raise NkiValidationError(f"{opn}: vals must have 8 elements per partition (got {v.shape})")
    if d.parts != x.parts or d.per_part != 8:
        raise NkiValidationError(f"{opn}: dst must be ({x.parts}, 8) (got {d.shape})")
    if d.dtype.name not in ("uint32", "uint16"):
        raise NkiValidationError(f"{opn}: dst dtype must be uint32 or uint16 (got {d.dtype})")
    data2 = flat2(x.read_f32(), x.parts)  # [P, n]
    vv = flat2(v.read_f32(), x.parts)  # [P, 8]
    eq = data2[:, None, :] == vv[:, :, None]  # [P, 8, n]
    # rank of each value among equal earlier values -> which occurrence it takes
    same = vv[:, :, None] == vv[:, None, :]  # [P, 8, 8]
    rank = np.tril(same, k=-1).sum(axis=-1)  # [P, 8]
    occ = np.cumsum(eq, axis=-1)
    hit = eq & (occ == (rank + 1)[:, :, None])
    found = hit.any(axis=-1)
    idx = hit.argmax(axis=-1).astype(np.int64)
    allones = (1 << (8 * d.dtype.itemsize)) - 1
    res = np.where(found, idx, allones)
    d.write(res.astype(d.dtype.np_dtype).reshape(d.shape))
    return NkiInstruction(opn)


@isa_op()
def topk(
    val_dst: NkiTensor, idx_dst: NkiTensor, src: NkiTensor, n: int, name: str | None = None
) -> NkiInstruction:
    """Top-K on GpSimd (api spec §8.15).

    api spec §12.26 decision: every 16-partition group holds one logical vector in the "snake"
    layout (element e at partition 16g + e % 16, column e // 16, e < n); its K largest values
    (ascending) and their logical positions are written to each partition of the group.
    """
    opn = "topk"
    prog = machine.current()
    prog.begin(opn, "gpsimd")
    x = operand(opn, "src", src, (SBUF,))
    vd = operand(opn, "val_dst", val_dst, (SBUF,))
    idd = operand(opn, "idx_dst", idx_dst, (SBUF,))
    for a in (x, vd, idd):
        check_parts(opn, a)
    if x.dtype.name != "bfloat16" or vd.dtype.name != "bfloat16" or idd.dtype.name != "uint32":
        raise NkiValidationError(
            f"{opn}: src/val_dst must be bfloat16 and idx_dst uint32 (got {x.dtype}, {vd.dtype}, {idd.dtype})"
        )
    P = x.parts
    K = vd.per_part
    if P % 16:
        raise NkiValidationError(f"{opn}: partition count must be a multiple of 16 (got {P})")
    if not 8 <= n < 65536 or not 1 <= K <= n or K >= 32768:
        raise NkiValidationError(f"{opn}: needs 8 <= n < 65536 and 1 <= K <= n (got n={n}, K={K})")
    if x.per_part < -(-n // 16):
        raise NkiValidationError(
            f"{opn}: src needs >= ceil(n/16) = {-(-n // 16)} columns (got {x.per_part})"
        )
    if idd.parts != P or idd.per_part != K or vd.parts != P:
        raise NkiValidationError(f"{opn}: val_dst and idx_dst must both be ({P}, {K})")
    v = flat2(x.read_f32(), P).reshape(P // 16, 16, -1)  # [G, 16, C]
    logical = v.transpose(0, 2, 1).reshape(P // 16, -1)[:, :n]  # e = 16*col + part
    order = np.argsort(-logical, axis=-1, kind="stable")[:, :K][:, ::-1]  # ascending values
    vals = np.take_along_axis(logical, order, axis=-1)
    store_f32(vd, np.repeat(vals, 16, axis=0))
    idd.write(np.repeat(order, 16, axis=0).astype(np.uint32).reshape(idd.shape))
    return NkiInstruction(opn)


@isa_op()
def nc_stream_shuffle(
    dst: NkiTensor, src: NkiTensor, shuffle_mask: Any, name: str | None = None
) -> NkiInstruction:
    """Per 32-partition group: dst partition i <- src partition ``shuffle_mask[i]`` (255 keeps
    dst), the same mask for every quadrant; partitions relative to each operand (api spec §8.16)."""
    opn = "nc_stream_shuffle"
    prog = machine.current()
    prog.begin(opn, "vector")
    s = operand(opn, "src", src)
    d = operand(opn, "dst", dst)
    for a in (s, d):
        check_parts(opn, a)
    mask = [int(m) for m in shuffle_mask]
    if len(mask) != 32 or any(not (0 <= m < 32 or m == 255) for m in mask):
        raise NkiValidationError(
            f"{opn}: shuffle_mask must be 32 ints in 0..31 or 255 (got {shuffle_mask!r})"
        )
    if s.dtype is not d.dtype:
        raise NkiValidationError(
            f"{opn}: dst dtype must equal src dtype (got {d.dtype}, {s.dtype})"
        )
    if s.per_part != d.per_part:
        raise NkiValidationError(
            f"{opn}: dst elements per partition differ from src (got {d.per_part}, expected {s.per_part})"
        )
    active = -(-max(s.parts, d.parts) // 32) * 32
    legal = {128: (0,), 96: (0,), 64: (0, 64), 32: (0, 32, 64, 96)}[active]
    for a in (s, d):
        if a.start_partition not in legal:
            raise NkiValidationError(
                f"{opn}: {a.name} starts at partition {a.start_partition}; with {active} active "
                f"partitions it must start at one of {legal}"
            )
    raw_s = flat2(s.read(), s.parts)
    cur = flat2(d.read(check_init=False), d.parts)
    out = cur.copy()
    keep = np.zeros(d.parts, dtype=bool)
    for q in range(active // 32):
        for i, m in enumerate(mask):
            p = 32 * q + i
            if p >= d.parts or m == 255:
                continue
            sp = 32 * q + m
            if sp >= s.parts:
                raise NkiValidationError(
                    f"{opn}: shuffle_mask[{i}]={m} selects src partition {sp} of {s.parts}"
                )
            out[p] = raw_s[sp]
            keep[p] = True
    d.write(
        out.reshape(d.shape),
        mask=np.broadcast_to(keep.reshape((-1,) + (1,) * (len(d.shape) - 1)), d.shape),
    )
    return NkiInstruction(opn)
