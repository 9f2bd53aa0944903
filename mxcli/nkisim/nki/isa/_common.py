"""Helpers shared by the instruction implementations (api spec §5.3 rules)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from mxcli.nkisim import machine
from mxcli.nkisim.dtypes import DType, from_fp32
from mxcli.nkisim.errors import NkiValidationError
from mxcli.nkisim.nki.isa.enums import as_enum, engine
from mxcli.nkisim.ops import OpToken
from mxcli.nkisim.tensor import Access, MemoryRegion, NkiTensor, resolve

SBUF = MemoryRegion.sbuf
PSUM = MemoryRegion.psum
ON_CHIP = (SBUF, PSUM)
HBM = (MemoryRegion.private_hbm, MemoryRegion.shared_hbm)
SBUF_HBM = (SBUF, *HBM)

F = TypeVar("F", bound=Callable[..., Any])

# api spec §1: keywords removed by earlier NKI releases, with the replacement to name.
_REMOVED_ANY = {
    "mask": "removed in NKI 0.2 (slice the operands instead)",
    "dtype": "removed in NKI 0.2 (the dst tensor's dtype is the output dtype)",
}


class NkiInstruction:
    """Opaque handle returned by ISA ops (api spec §3.4); ``depends_on`` is a scheduling hint."""

    __slots__ = ("op",)

    def __init__(self, op: str) -> None:
        self.op = op

    def depends_on(self, *producers: Any) -> NkiInstruction:
        return self

    def __repr__(self) -> str:
        return f"NkiInstruction({self.op})"


def isa_op(removed: dict[str, str] | None = None) -> Callable[[F], F]:
    """Decorator: a clear TypeError for keywords that older NKI releases had (api spec §1)."""
    table = dict(_REMOVED_ANY)
    table.update(removed or {})

    def deco(fn: F) -> F:
        sig = inspect.signature(fn)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            for k in kwargs:
                if k not in sig.parameters:
                    why = table.get(k)
                    extra = f" ({why})" if why else ""
                    raise TypeError(
                        f"nki.isa.{fn.__name__}() got an unexpected keyword argument {k!r}{extra}"
                    )
            return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return deco


def begin(op: str, eng: str) -> machine.Program:
    prog = machine.current()
    prog.begin(op, eng)
    return prog


def operand(
    op: str, name: str, t: Any, buffers: tuple[MemoryRegion, ...] | None = ON_CHIP, **kw: Any
) -> Access:
    return resolve(t, op, name, buffers=buffers, **kw)


def check_parts(op: str, acc: Access, limit: int = 128) -> None:
    """api spec §5.3 rule 1: on-chip partition dim <= 128 (the simulator's message style)."""
    if acc.on_chip and acc.parts > limit:
        raise NkiValidationError(
            f"{op} {acc.name} partition dimension {acc.parts} exceeds maximum {limit}"
        )


def check_same_geometry(op: str, a: Access, b: Access) -> None:
    """api spec §5.3 rule 2: same partition count and elements per partition."""
    if a.parts != b.parts:
        raise NkiValidationError(
            f"{op}: {b.name} partition count differs from {a.name} (got {b.parts}, expected {a.parts})"
        )
    if a.per_part != b.per_part:
        raise NkiValidationError(
            f"{op}: {b.name} elements per partition differ from {a.name} "
            f"(got {b.per_part} {b.shape}, expected {a.per_part} {a.shape})"
        )


def not_both_psum(op: str, a: Access, b: Access) -> None:
    if a.buffer is PSUM and b.buffer is PSUM:
        raise NkiValidationError(f"{op}: {a.name} and {b.name} may not both be in PSUM")


def no_psum(op: str, eng: str, *accs: Access) -> None:
    for a in accs:
        if a.buffer is PSUM:
            raise NkiValidationError(
                f"{op}: {a.name} is in PSUM, which the {eng} engine cannot access"
            )


def elementwise_operands(
    op: str, dst: Any, *srcs: tuple[str, Any], engine_name: str | None = None
) -> tuple[Access, ...]:
    """Resolve the on-chip ``(name, tensor)`` sources and dst of an element-wise instruction and
    apply api spec §5.3 rules 1-2 (<= 128 partitions each; every operand has the first source's
    geometry). On the gpsimd engine no operand may be in PSUM. Returns ``(*srcs, dst)``."""
    accs = [operand(op, name, t) for name, t in srcs]
    accs.append(operand(op, "dst", dst))
    if engine_name == "gpsimd":
        no_psum(op, engine_name, *accs)
    for a in accs:
        check_parts(op, a)
    for other in accs[1:]:
        check_same_geometry(op, accs[0], other)
    return tuple(accs)


def skip_arithmetic(prog: machine.Program, dst: Access, *reads: Access) -> bool:
    """Check-only mode with a non-integer dst: init-check the reads, mark dst written (zeros) and
    return True so the caller skips the arithmetic. Integer results (indices, masks) are always
    computed."""
    if prog.compute or is_int_dtype(dst.dtype):
        return False
    for r in reads:
        r.check_init()
    dst.write_zero()
    return True


def store_f32(dst: Access, values: np.ndarray) -> None:
    """Round fp32 results once to dst's dtype (RNE) and write them (api spec §2.4)."""
    if dst.dtype.kind == "x4":
        raise dst.err(f"dtype {dst.dtype} cannot receive computed values (x4 data: MX ops only)")
    dst.write(from_fp32(np.asarray(values, dtype=np.float32).reshape(dst.shape), dst.dtype))


def store_int(dst: Access, values: Any) -> None:
    """Write exact integer results, wrapped (two's complement) to dst's integer width."""
    bits = dst.dtype.itemsize * 8
    u = np.asarray(values, dtype=np.int64) & ((1 << bits) - 1)
    wrapped = u.astype({8: np.uint8, 16: np.uint16, 32: np.uint32}[bits])
    dst.write(wrapped.view(dst.dtype.np_dtype).reshape(dst.shape))


def flat2(a: np.ndarray, parts: int) -> np.ndarray:
    """[P, free...] -> [P, F] (free dims flattened row-major in view order)."""
    return a.reshape(parts, -1)


def scalar_operand(
    op: str, name: str, x: Any, parts: int, *, allow_none: bool = False
) -> np.ndarray | float | None:
    """api spec §5.3 rule 4: a Python number (fp32) or an on-chip tensor with one element per
    partition and `parts` partitions; returns a float or a [P, 1] fp32 array."""
    if x is None:
        if allow_none:
            return None
        raise NkiValidationError(f"{op}: {name} must be a number or a (P, 1) tile, got None")
    if isinstance(x, NkiTensor):
        acc = operand(op, name, x)
        if acc.parts != parts or acc.per_part != 1:
            raise NkiValidationError(
                f"{op}: {name} must have one element per partition and {parts} partitions "
                f"(got shape {acc.shape})"
            )
        return acc.read_f32().reshape(parts, 1)
    if isinstance(x, (bool, int, float, np.number)):
        return float(np.float32(x))
    raise NkiValidationError(
        f"{op}: {name} must be a number or an on-chip (P, 1) tile, got {type(x).__name__}"
    )


def check_engine(op: str, eng: Any, allowed: tuple[engine, ...]) -> engine:
    e = as_enum(eng, engine, op, "engine")
    if e not in allowed:
        names = ", ".join(f"engine.{a.name}" for a in allowed)
        raise NkiValidationError(f"{op}: engine must be one of {names} (got engine.{e.name})")
    return e


def check_token(op: str, name: str, tok: Any) -> OpToken:
    if not isinstance(tok, OpToken):
        raise NkiValidationError(f"{op}: {name} must be an nl op token (nl.add, ...), got {tok!r}")
    return tok


def require_v4(op: str) -> None:
    t = machine.current().target
    if not t.supports_mx:
        raise NkiValidationError(
            f"{op}: requires NeuronCore-v4 (trn3); the target is {t.name} (gen{int(t.version)})"
        )


def is_int_dtype(dt: DType) -> bool:
    return dt.kind in ("int", "uint", "bool")
