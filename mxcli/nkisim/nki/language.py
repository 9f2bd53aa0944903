"""``nki.language`` as provided by mxcli's interpreter (api spec §2, §3.4, §4)."""

from __future__ import annotations

import builtins
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from mxcli.nkisim import machine
from mxcli.nkisim.dtypes import as_dtype, dtype_of_numpy, from_fp32, uint8
from mxcli.nkisim.errors import NkiValidationError
from mxcli.nkisim.nki import dtype as _dtype
from mxcli.nkisim.nki.dtype import *  # noqa: F403 - nki.language re-exports every nki.dtype name
from mxcli.nkisim.nki.highlevel import load, store
from mxcli.nkisim.ops import (
    abs,  # noqa: A004 - NKI's name
    abs_max,
    abs_min,
    add,
    arctan,
    bitwise_and,
    bitwise_or,
    bitwise_xor,
    bypass,
    divide,
    equal,
    erf,
    erf_dx,
    exp,
    gelu,
    gelu_apprx_sigmoid,
    gelu_apprx_sigmoid_dx,
    gelu_apprx_tanh,
    gelu_dx,
    greater,
    greater_equal,
    invert,
    left_shift,
    less,
    less_equal,
    log,
    logical_and,
    logical_or,
    logical_xor,
    maximum,
    minimum,
    mish,
    multiply,
    not_equal,
    power,
    prelu,
    reciprocal,
    relu,
    right_shift,
    rsqrt,
    sigmoid,
    sign,
    silu,
    silu_dx,
    sin,
    softplus,
    sqrt,
    square,
    subtract,
    tanh,
)
from mxcli.nkisim.ops import copy as _copy_token
from mxcli.nkisim.target import resolve_target
from mxcli.nkisim.tensor import (
    MemoryRegion,
    NkiTensor,
    VirtualRegister,
    allocate,
    ds,
    register_or_int,
    wrap_array,
)

sbuf = MemoryRegion.sbuf
psum = MemoryRegion.psum
private_hbm = MemoryRegion.private_hbm
shared_hbm = MemoryRegion.shared_hbm
hbm = MemoryRegion.private_hbm  # alias (api spec §2.2)


def is_hbm(buffer: MemoryRegion) -> bool:
    return buffer in (private_hbm, shared_hbm)


def is_on_chip(buffer: MemoryRegion) -> bool:
    return buffer in (sbuf, psum)


def is_psum(buffer: MemoryRegion) -> bool:
    return buffer is psum


def is_sbuf(buffer: MemoryRegion) -> bool:
    return buffer is sbuf


# -- creation (api spec §4.1) -----------------------------------------------------------------


def ndarray(
    shape: Any, dtype: Any, buffer: MemoryRegion = sbuf, name: str = "", address: Any = None
) -> NkiTensor:
    """A new uninitialized tensor (NaN / 4 sentinel fill)."""
    return allocate(shape, dtype, buffer, name, address)


def zeros(shape: Any, dtype: Any, buffer: MemoryRegion = sbuf, name: str = "") -> NkiTensor:
    return allocate(shape, dtype, buffer, name, fill=_fill_value(dtype, 0))


def ones(shape: Any, dtype: Any, buffer: MemoryRegion = sbuf, name: str = "") -> NkiTensor:
    return allocate(shape, dtype, buffer, name, fill=_fill_value(dtype, 1))


def full(
    shape: Any, fill_value: Any, dtype: Any, buffer: MemoryRegion = sbuf, name: str = ""
) -> NkiTensor:
    return allocate(shape, dtype, buffer, name, fill=_fill_value(dtype, fill_value))


def _fill_value(dtype: Any, value: Any) -> Any:
    dt = as_dtype(dtype)
    if dt.kind == "x4" and value != 0:
        raise NkiValidationError(f"nl.full: {dt} tensors can only be filled with 0")
    if dt.kind in ("int", "uint", "bool"):
        return np.array(int(value)).astype(np.int64).astype(dt.np_dtype)
    if dt.kind == "x4":
        return 0
    return from_fp32(np.array([float(value)], dtype=np.float32), dt)[0]


def zeros_like(x: NkiTensor, dtype: Any = None, buffer: Any = None, name: str = "") -> NkiTensor:
    """api spec §12.23 decision: ``buffer=None`` means x's buffer (the signature's default)."""
    return zeros(x.shape, dtype or x.dtype, buffer or x.buffer, name)


def empty_like(x: NkiTensor, dtype: Any = None, buffer: Any = None, name: str = "") -> NkiTensor:
    return ndarray(x.shape, dtype or x.dtype, buffer or x.buffer, name)


def shared_identity_matrix(n: int, dtype: Any = uint8, dst: Any = None) -> NkiTensor:
    """An (n, n) SBUF identity matrix of `dtype`."""
    t = dst if dst is not None else ndarray((n, n), dtype, sbuf, name=f"identity{n}")
    from mxcli.nkisim.tensor import resolve

    acc = resolve(t, "shared_identity_matrix", "dst")
    acc.write(from_fp32(np.eye(n, dtype=np.float32), acc.dtype).reshape(acc.shape))
    return t


def shared_constant(constant: Any) -> NkiTensor:
    """A shared_hbm tensor holding a NumPy array (or the contents of a .npy path)."""
    arr = np.load(constant) if isinstance(constant, str) else np.asarray(constant)
    dt = dtype_of_numpy(arr.dtype)
    if dt is None:
        raise NkiValidationError(f"nl.shared_constant: unsupported dtype {arr.dtype}")
    machine.current()
    return wrap_array(np.ascontiguousarray(arr).copy(), shared_hbm, "shared_constant", dt)


class NKIObject:
    """Base class for kernel-side configuration objects (dataclasses allowed).

    A subclass without ``@dataclass`` is compiled the same way as one with it (python subset
    spec, "Classes": "`@dataclass` is optional and compiled the same way"): its annotated class
    attributes are its fields, in order, and it is built with them as positional or keyword
    arguments, a class-level value being the field's default (AWS's
    ``DimensionSizes(NKIObject)`` is built as ``DimensionSizes(B=..., H=..., ...)``, some fields
    left for a method to set). A class with its own ``__init__`` (or a dataclass's) keeps it.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        cls = type(self)
        names: list[str] = []
        for klass in reversed(cls.__mro__):
            if klass is object or klass is NKIObject:
                continue
            for name in klass.__dict__.get("__annotations__", {}):
                if name not in names:
                    names.append(name)
        if len(args) > len(names):
            raise TypeError(
                f"{cls.__qualname__}() takes {len(names)} positional arguments but "
                f"{len(args)} were given"
            )
        values = dict(zip(names, args, strict=False))
        for name, value in kwargs.items():
            if name not in names:
                raise TypeError(f"{cls.__qualname__}() got an unexpected keyword argument {name!r}")
            if name in values:
                raise TypeError(f"{cls.__qualname__}() got multiple values for argument {name!r}")
            values[name] = value
        # a field given no value and no class-level default stays unset: AWS builds
        # DimensionSizes(T=.., H=.., B=.., E=.., N=.., I_TP=..) and its derive_all_dims() sets
        # I_TP_sharded / GUP_N_TILES afterwards (bwmm_bwd_dropless_mxfp8.py, compiled by the
        # NKI front end); reading one before it is set is an AttributeError naming it
        for name in names:
            if name in values:
                setattr(self, name, values[name])
            elif hasattr(cls, name):
                setattr(self, name, getattr(cls, name))


# -- loops (api spec §4.7) ----------------------------------------------------------------------

range = builtins.range  # noqa: A001 - undocumented alias used by the 2.32 prefill kernel


def affine_range(start: int, stop: int | None = None, step: int = 1) -> builtins.range:
    return builtins.range(start, stop, step) if stop is not None else builtins.range(start)


def sequential_range(start: int, stop: int | None = None, step: int = 1) -> builtins.range:
    return affine_range(start, stop, step)


def static_range(start: int, stop: int | None = None, step: int = 1) -> builtins.range:
    return affine_range(start, stop, step)


def _check_dynamic(what: str) -> None:
    if machine.current().no_reorder_depth:
        raise NkiValidationError(f"{what}: dynamic loops are not allowed inside nl.no_reorder()")


def dynamic_range(start: Any, stop: Any = None, step: int = 1) -> Iterator[VirtualRegister]:
    """Runtime loop with register bounds; the induction variable is a frozen register
    (deprecated in 0.6 in favour of ``fori_loop``)."""
    warnings.warn(
        "nl.dynamic_range is deprecated in NKI 0.6: use nl.fori_loop",
        DeprecationWarning,
        stacklevel=2,
    )
    if isinstance(step, VirtualRegister):
        raise NkiValidationError(
            "nl.dynamic_range: step must be a compile-time int, got a register"
        )
    if int(step) <= 0:
        raise NkiValidationError(f"nl.dynamic_range: step must be positive, got {step}")
    _check_dynamic("nl.dynamic_range")
    lo, hi = (
        (0, register_or_int(start, "start"))
        if stop is None
        else (register_or_int(start, "start"), register_or_int(stop, "stop"))
    )
    for i in builtins.range(lo, hi, int(step)):
        yield VirtualRegister(i, frozen=True)


def fori_loop(
    lower: Any, upper: Any, body_fun: Callable[[VirtualRegister], Any], step: int = 1
) -> None:
    """Run ``body_fun(i)`` for i in range(lower, upper, step); i is a frozen register."""
    if isinstance(step, VirtualRegister) or int(step) <= 0:
        raise NkiValidationError(
            f"nl.fori_loop: step must be a positive compile-time int, got {step!r}"
        )
    _check_dynamic("nl.fori_loop")
    for i in builtins.range(
        register_or_int(lower, "lower"), register_or_int(upper, "upper"), int(step)
    ):
        body_fun(VirtualRegister(i, frozen=True))


def while_loop(
    init: VirtualRegister, body_fun: Callable[[VirtualRegister], VirtualRegister]
) -> None:
    """``r = init; while r != 0: r = body_fun(r)`` (pre-test)."""
    _check_dynamic("nl.while_loop")
    r = init
    while register_or_int(r, "while_loop condition") != 0:
        r = body_fun(r)
        if not isinstance(r, (VirtualRegister, int)):
            raise NkiValidationError(
                "nl.while_loop: body_fun must return the next condition register"
            )


# -- per-kernel state (api spec §3.4) ----------------------------------------------------------


def program_id(axis: int = 0) -> int:
    prog = machine.current()
    if axis != 0:
        raise NkiValidationError(f"nl.program_id: axis must be 0 (got {axis})")
    return prog.program_id


def num_programs(axes: int = 0) -> int:
    prog = machine.current()
    if axes != 0:
        raise NkiValidationError(f"nl.num_programs: axes must be 0 (got {axes})")
    return prog.config.lnc


def program_ndim() -> int:
    return 1 if machine.current().config.lnc > 1 else 0


def device_print(print_prefix: str, tensor: NkiTensor) -> None:
    """Print a tensor immediately (SBUF or HBM)."""
    from mxcli.nkisim.tensor import resolve

    acc = resolve(tensor, "device_print", "tensor")
    raw = acc.read(check_init=False)
    vals = raw if acc.dtype.kind == "x4" else raw.astype(np.float32)
    print(print_prefix, vals)


@contextmanager
def no_reorder() -> Iterator[None]:
    """Scheduling hint: a no-op, except that dynamic loops inside it are an error."""
    prog = machine.current()
    prog.no_reorder_depth += 1
    try:
        yield
    finally:
        prog.no_reorder_depth -= 1


# ``nl.copy`` is both the activation token (``op=nl.copy``) and, called, the high-level
# bit-exact copy (api spec §4.8): the token's __call__ routes to highlevel.copy.
copy = _copy_token


class _TileSize:
    """``nl.tile_size``: hardware constants of the active target (api spec §2.1)."""

    @property
    def _t(self) -> Any:
        prog = machine.current_or_none()
        return prog.target if prog is not None else resolve_target()

    pmax = property(lambda self: self._t.pmax)
    psum_fmax = property(lambda self: self._t.psum_bank_fmax)
    psum_bank_fmax = property(lambda self: self._t.psum_bank_fmax)
    psum_bank_fmax_bytes = property(lambda self: self._t.psum_bank_fmax_bytes)
    psum_num_banks = property(lambda self: self._t.psum_num_banks)
    gemm_stationary_fmax = property(lambda self: self._t.gemm_stationary_fmax)
    gemm_moving_fmax = property(lambda self: self._t.gemm_moving_fmax)
    bn_stats_fmax = property(lambda self: self._t.bn_stats_fmax)
    psum_min_align = property(lambda self: self._t.psum_min_align)
    sbuf_min_align = property(lambda self: self._t.sbuf_min_align)
    sbuf_size_bytes = property(lambda self: self._t.sbuf_partition_bytes * 128)
    sbuf_fmax_bytes = property(lambda self: self._t.sbuf_fmax_bytes)
    total_available_sbuf_size = property(lambda self: self._t.sbuf_fmax_bytes)
    sbuf_fmax = property(lambda self: self._t.sbuf_fmax_bytes // 4)

    def __repr__(self) -> str:
        return f"nl.tile_size(target={self._t.name})"


tile_size = _TileSize()

_REMOVED = {
    "arange": "removed in NKI 0.3 (use nl.ds / slices / .ap)",
    "mgrid": "removed in NKI 0.3 (use nl.ds / slices / .ap)",
    "par_dim": "removed in NKI 0.3 (dim 0 of an on-chip tensor is the partition dim)",
}


def __getattr__(name: str) -> Any:
    if name in _REMOVED:
        raise AttributeError(f"nki.language.{name} was {_REMOVED[name]}")
    raise AttributeError(f"module 'nki.language' has no attribute {name!r}")


__all__ = [
    "MemoryRegion",
    "NKIObject",
    "NkiTensor",
    "abs",
    "abs_max",
    "abs_min",
    "add",
    "affine_range",
    "arctan",
    "bitwise_and",
    "bitwise_or",
    "bitwise_xor",
    "bypass",
    "copy",
    "device_print",
    "divide",
    "ds",
    "dynamic_range",
    "empty_like",
    "equal",
    "erf",
    "erf_dx",
    "exp",
    "fori_loop",
    "full",
    "gelu",
    "gelu_apprx_sigmoid",
    "gelu_apprx_sigmoid_dx",
    "gelu_apprx_tanh",
    "gelu_dx",
    "greater",
    "greater_equal",
    "hbm",
    "invert",
    "is_hbm",
    "is_on_chip",
    "is_psum",
    "is_sbuf",
    "left_shift",
    "less",
    "less_equal",
    "load",
    "log",
    "logical_and",
    "logical_or",
    "logical_xor",
    "maximum",
    "minimum",
    "mish",
    "multiply",
    "ndarray",
    "no_reorder",
    "not_equal",
    "num_programs",
    "ones",
    "power",
    "prelu",
    "private_hbm",
    "program_id",
    "program_ndim",
    "psum",
    "range",
    "reciprocal",
    "relu",
    "right_shift",
    "rsqrt",
    "sbuf",
    "sequential_range",
    "shared_constant",
    "shared_hbm",
    "shared_identity_matrix",
    "sigmoid",
    "sign",
    "silu",
    "silu_dx",
    "sin",
    "softplus",
    "sqrt",
    "square",
    "static_range",
    "store",
    "subtract",
    "tanh",
    "tile_size",
    "while_loop",
    "zeros",
    "zeros_like",
]
__all__ += _dtype.__all__
