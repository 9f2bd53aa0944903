"""Storage + view data model (api spec §2.2-§2.5, §4.1-§4.5).

An `NkiTensor` is a *view* (shape, strides and offset in elements of the view's dtype) over a
`Storage` (one allocation: a flat byte buffer). Element ``(i0, ..., in-1)`` of a view lives at
flat element ``offset + sum(strides[k] * ik)`` of the storage read as an array of the view's
dtype. On-chip (SBUF/PSUM) storages are ``[P, row_bytes]``: partition = byte // row_bytes.

Views may carry *dynamic* parts resolved when an instruction uses them: scalar offsets
(``nl.ds(register, n)``, ``.ap(scalar_offset=...)``) and a per-row vector offset
(``.ap(vector_offset=idx)``, DMA gather/scatter). `resolve` turns a view into an `Access`,
checking bounds at use time (api spec §4.5: not when the view is built).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from mxcli.nkisim import machine
from mxcli.nkisim.dtypes import DType, as_dtype, sentinel_fill
from mxcli.nkisim.errors import NkiOutOfBoundsError, NkiValidationError
from mxcli.nkisim.rules import Rule, rule_error

__all__ = [
    "MemoryRegion",
    "VirtualRegister",
    "Storage",
    "NkiTensor",
    "ds",
    "DynSlice",
    "Access",
    "resolve",
    "allocate",
    "wrap_array",
]


class MemoryRegion(enum.Enum):
    """Buffers (api spec §2.2). ``nl.hbm`` is an alias of ``private_hbm``."""

    sbuf = "sbuf"
    psum = "psum"
    private_hbm = "private_hbm"
    shared_hbm = "shared_hbm"

    def __repr__(self) -> str:
        return f"nl.{self.value}"

    @property
    def on_chip(self) -> bool:
        return self in (MemoryRegion.sbuf, MemoryRegion.psum)


class VirtualRegister:
    """A 32-bit engine register (api spec §5.2): a Python int with int32 wrap-around.

    Frozen registers are loop induction variables (writing them is an ``AssertionError``).
    """

    __slots__ = ("_value", "frozen", "name")

    def __init__(self, value: int = 0, frozen: bool = False, name: str = "") -> None:
        self._value = _wrap_i32(value)
        self.frozen = frozen
        self.name = name

    @property
    def value(self) -> int:
        return self._value

    def _set(self, value: int, op: str) -> None:
        if self.frozen:
            raise NkiValidationError(f"{op}: dst is a frozen loop induction register")
        self._value = _wrap_i32(value)

    def __repr__(self) -> str:
        return f"VirtualRegister({self._value})"

    def __bool__(self) -> bool:
        # api spec §4.7: legacy ``while reg:`` is deprecated but still accepted; warn.
        import warnings

        warnings.warn(
            "using a VirtualRegister as a Python condition is deprecated in NKI 0.6 "
            "(use nl.while_loop)",
            DeprecationWarning,
            stacklevel=2,
        )
        return self._value != 0

    def __index__(self) -> int:
        raise TypeError(
            "a VirtualRegister cannot be used as a Python int (NKI tracer rule): "
            "use nl.ds(reg, n), nl.fori_loop or .ap(scalar_offset=reg)"
        )

    __int__ = __index__


def register_or_int(x: Any, what: str) -> int:
    """The value of an int or a VirtualRegister (its current value); `what` names it in errors."""
    if isinstance(x, VirtualRegister):
        return x.value
    if isinstance(x, (bool, float)) or not isinstance(x, (int, np.integer)):
        raise NkiValidationError(f"{what} must be an int or a VirtualRegister, got {x!r}")
    return int(x)


def _wrap_i32(v: int) -> int:
    v = int(v) & 0xFFFFFFFF
    return v - (1 << 32) if v >= (1 << 31) else v


class DynSlice:
    """``nl.ds(start, size)``: the slice ``start : start + size``; `start` may be a register."""

    __slots__ = ("start", "size")

    def __init__(self, start: int | VirtualRegister, size: int) -> None:
        if isinstance(size, VirtualRegister) or int(size) <= 0:
            raise NkiValidationError(
                f"nl.ds: size must be a positive compile-time int, got {size!r}"
            )
        self.start = start
        self.size = int(size)

    def __repr__(self) -> str:
        return f"ds({self.start!r}, {self.size})"


def ds(start: int | VirtualRegister, size: int) -> DynSlice:
    """The dynamic slice ``start : start + size`` (api spec §4.3)."""
    return DynSlice(start, size)


# -- storage ------------------------------------------------------------------------------------


class Storage:
    """One allocation: a flat byte buffer plus a per-byte "written" mask.

    ``init`` is None when every byte is known to be written (kernel inputs, filled tensors);
    else a uint8 mask (0xFF = written since allocation), used for the uninitialized-read check
    and for ``nc_matmul``'s ``accumulate=None`` rule (api spec §7.1: per PSUM element).
    """

    __slots__ = (
        "buf",
        "init",
        "buffer",
        "shape",
        "dtype",
        "nbytes",
        "row_bytes",
        "name",
        "record",
        "address",
        "owner",
    )

    def __init__(
        self,
        buf: np.ndarray,
        init: np.ndarray | None,
        buffer: MemoryRegion,
        shape: tuple[int, ...],
        dtype: DType,
        name: str,
        owner: int | None,
    ) -> None:
        self.buf = buf
        self.init = init
        self.buffer = buffer
        self.shape = shape
        self.dtype = dtype
        self.nbytes = int(buf.size)
        self.row_bytes = (
            self.nbytes // shape[0] if buffer.on_chip and shape and shape[0] else self.nbytes
        )
        self.name = name
        self.record: machine.AllocRecord | None = None
        self.address: tuple[int, int] | None = None
        self.owner = owner  # program id for private memory, None for shared

    @property
    def partitions(self) -> int:
        return self.shape[0] if self.buffer.on_chip else 1

    def touch(self, clock: int) -> None:
        """An instruction at `clock` uses this storage: it is live from its first use to its
        last (the capacity sweep, `machine.Program.finish_capacity`)."""
        rec = self.record
        if rec is not None:
            if rec.first_t is None:
                rec.first_t = clock
            rec.last_t = clock


def _prod(xs: Sequence[int]) -> int:
    return int(math.prod(xs))


def allocate(
    shape: Sequence[int],
    dtype: Any,
    buffer: MemoryRegion,
    name: str = "",
    address: tuple[int, int] | None = None,
    fill: Any = None,
) -> NkiTensor:
    """A fresh tensor (api spec §4.1), sentinel-filled unless `fill` is given."""
    prog = machine.current()
    if isinstance(buffer, str) or not isinstance(buffer, MemoryRegion):
        raise TypeError(
            f"buffer: expected nl.sbuf / nl.psum / nl.hbm / nl.private_hbm / nl.shared_hbm, got {buffer!r}"
            " (string buffer names were removed in NKI 0.3)"
        )
    dt = as_dtype(dtype)
    shp = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list)) else (shape,)))
    if not shp or any(s <= 0 for s in shp):
        raise NkiValidationError(f"nl.ndarray: shape must be positive ints, got {tuple(shape)}")
    if buffer is MemoryRegion.shared_hbm and prog.config.lnc > 1:
        # LNC: the k-th shared_hbm allocation of every program is the same tensor. The lock is
        # held through creation so that two programs allocating at once agree on the tensor.
        run = prog.run
        with run.lock:
            k = prog.shared_index
            prog.shared_index += 1
            if k < len(run.shared_allocs):
                t = run.shared_allocs[k]
                if t.shape != shp or t.dtype is not dt:
                    raise NkiValidationError(
                        f"nl.ndarray: shared_hbm allocation #{k} differs between LNC programs "
                        f"(got {shp} {dt}, expected {t.shape} {t.dtype})"
                    )
                return t
            t_shared = _new_tensor(prog, shp, dt, buffer, name, address, fill)
            run.shared_allocs.append(t_shared)
            return t_shared
    return _new_tensor(prog, shp, dt, buffer, name, address, fill)


def _new_tensor(
    prog: machine.Program,
    shp: tuple[int, ...],
    dt: Any,
    buffer: MemoryRegion,
    name: str,
    address: tuple[int, int] | None,
    fill: Any,
) -> NkiTensor:
    nbytes = _prod(shp) * dt.itemsize
    buf = np.empty(nbytes, dtype=np.uint8)
    init: np.ndarray | None
    if fill is None:
        kind, val = sentinel_fill(dt)
        if kind == "byte":
            buf.fill(val)
        else:
            buf.view(dt.np_dtype)[...] = val
        init = np.zeros(nbytes, dtype=np.uint8)
    else:
        buf.view(dt.np_dtype)[...] = fill
        init = None
    owner = None if buffer is MemoryRegion.shared_hbm else prog.program_id
    st = Storage(buf, init, buffer, shp, dt, name or "", owner)
    if buffer.on_chip:
        t = prog.target
        if shp[0] > t.pmax:  # dim 0 of an on-chip tensor is the partition dim (API stubs)
            raise rule_error(
                Rule.PARTITION_DIM,
                f"nl.ndarray: {name or 'tensor'} in {buffer.value} has {shp[0]} partitions "
                f"(shape {shp}; expected dim 0 <= nl.tile_size.pmax = {t.pmax})",
            )
        bpp = st.row_bytes
        if buffer is MemoryRegion.psum:
            bank = t.psum_bank_fmax_bytes
            bpp = -(-bpp // bank) * bank  # PSUM is allocated in whole 2 KiB banks
        if address is not None:
            _check_address(prog, st, address)
            st.address = (int(address[0]), int(address[1]))
        st.record = prog.new_record(name or "", buffer.value, bpp, written=fill is not None)
    return NkiTensor(st, shp, _row_major(shp), 0, dt, name=name or "")


def _check_address(prog: machine.Program, st: Storage, address: tuple[int, int]) -> None:
    p0, b0 = int(address[0]), int(address[1])
    t = prog.target
    limit = t.sbuf_fmax_bytes if st.buffer is MemoryRegion.sbuf else t.psum_budget_bytes
    if p0 < 0 or p0 + st.shape[0] > t.pmax:
        raise NkiValidationError(
            f"nl.ndarray: {st.name or 'tensor'} address partition range [{p0}, {p0 + st.shape[0]}) "
            f"outside 0..{t.pmax}"
        )
    if b0 < 0 or b0 + st.row_bytes > limit:
        raise NkiValidationError(
            f"nl.ndarray: {st.name or 'tensor'} address bytes [{b0}, {b0 + st.row_bytes}) per "
            f"partition exceed the {t.name} {st.buffer.value.upper()} budget (expected <= {limit})"
        )


def wrap_array(arr: np.ndarray, buffer: MemoryRegion, name: str, dt: DType) -> NkiTensor:
    """An HBM tensor sharing memory with a C-contiguous NumPy array (kernel inputs: writes by
    the kernel update the caller's array in place, api spec §3.2)."""
    flat = arr.reshape(-1).view(np.uint8)
    st = Storage(flat, None, buffer, tuple(arr.shape) or (1,), dt, name, None)
    shp = tuple(arr.shape) or (1,)
    return NkiTensor(st, shp, _row_major(shp), 0, dt, name=name)


def _row_major(shape: Sequence[int]) -> tuple[int, ...]:
    strides = []
    acc = 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= int(s)
    return tuple(reversed(strides))


# -- views --------------------------------------------------------------------------------------


class _Vec:
    """Per-row vector indirection of a view's dim 0 (api spec §4.5)."""

    __slots__ = ("index", "mult", "limit", "grid")

    def __init__(self, index: NkiTensor, mult: int, limit: int, grid: bool = False) -> None:
        self.index = index
        self.mult = mult  # elements (view dtype) per index step
        self.limit = limit  # base.shape[0]: indices must be < limit
        # a [128, n] index grid read column-major (gather-transpose only, api spec §6.3)
        self.grid = grid


class NkiTensor:
    """A view over a storage (api spec §4.2)."""

    __slots__ = ("_st", "shape", "strides", "offset", "dtype", "name", "_dyn", "_vec")

    def __init__(
        self,
        storage: Storage,
        shape: tuple[int, ...],
        strides: tuple[int, ...],
        offset: int,
        dtype: DType,
        name: str = "",
        dyn: tuple[tuple[Any, int, int | None], ...] = (),
        vec: _Vec | None = None,
    ) -> None:
        self._st = storage
        self.shape = tuple(int(s) for s in shape)
        self.strides = tuple(int(s) for s in strides)
        self.offset = int(offset)
        self.dtype = dtype
        self.name = name
        # dynamic scalar terms: (register or 1-element tensor, multiplier, limit or None)
        self._dyn = dyn
        self._vec = vec

    # -- attributes --
    @property
    def buffer(self) -> MemoryRegion:
        return self._st.buffer

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return _prod(self.shape)

    @property
    def _on_chip(self) -> bool:
        return self._st.buffer.on_chip

    def __repr__(self) -> str:
        return (
            f"NkiTensor(name={self.name or self._st.name!r}, shape={self.shape}, "
            f"dtype={self.dtype}, buffer={self.buffer.value}, strides={self.strides}, "
            f"offset={self.offset})"
        )

    def __len__(self) -> int:
        return self.shape[0]

    def _new(
        self,
        shape: Sequence[int],
        strides: Sequence[int],
        offset: int | None = None,
        dtype: DType | None = None,
        dyn: Any = None,
        vec: Any = "keep",
    ) -> NkiTensor:
        return NkiTensor(
            self._st,
            tuple(shape),
            tuple(strides),
            self.offset if offset is None else offset,
            dtype or self.dtype,
            self.name,
            self._dyn if dyn is None else dyn,
            self._vec if vec == "keep" else vec,
        )

    def _err(self, method: str, msg: str) -> NkiValidationError:
        return NkiValidationError(f"{method}: {self.name or self._st.name or 'tensor'} {msg}")

    # -- indexing (api spec §4.3) --
    def __getitem__(self, key: Any) -> NkiTensor:
        if not isinstance(key, tuple):
            key = (key,)
        if any(k is None for k in key):
            raise TypeError("NkiTensor indexing: None / np.newaxis is not supported")
        n_ell = sum(1 for k in key if k is Ellipsis)
        if n_ell > 1:
            raise IndexError("NkiTensor indexing: at most one '...'")
        if n_ell:
            i = key.index(Ellipsis)
            fill = self.ndim - (len(key) - 1)
            key = key[:i] + (slice(None),) * fill + key[i + 1 :]
        if len(key) > self.ndim:
            raise IndexError(f"NkiTensor indexing: {len(key)} indices for a {self.ndim}-D tensor")
        key = key + (slice(None),) * (self.ndim - len(key))
        shape: list[int] = []
        strides: list[int] = []
        removed: list[tuple[int, int, int]] = []  # (position, stride, dim) of int-indexed free dims
        offset = self.offset
        dyn = list(self._dyn)
        for d, k in enumerate(key):
            size, stride = self.shape[d], self.strides[d]
            if d == 0 and self._vec is not None and not _full(k, size):
                raise self._err("index", "cannot slice/select the vector-indirect dim 0")
            if isinstance(k, DynSlice):
                if isinstance(k.start, VirtualRegister):
                    if k.size > size:
                        raise self._err("index", f"nl.ds size {k.size} exceeds dim {d} size {size}")
                    dyn.append((k.start, stride, size - k.size + 1))
                    shape.append(k.size)
                    strides.append(stride)
                    continue
                k = slice(int(k.start), int(k.start) + k.size)
            if isinstance(k, slice):
                start, stop, step = k.start, k.stop, k.step
                step = 1 if step is None else int(step)
                if step < 1:
                    raise self._err("index", f"slice step must be >= 1, got {step}")
                start = 0 if start is None else int(start)
                stop = size if stop is None else int(stop)
                if start < 0:
                    start += size
                if stop < 0:
                    stop += size
                if not (0 <= start <= size) or not (0 <= stop <= size) or stop < start:
                    raise self._err(
                        "index", f"slice {k.start}:{k.stop} out of range for dim {d} of size {size}"
                    )
                n = len(range(start, stop, step))
                offset += start * stride
                shape.append(n)
                strides.append(stride * step)
            else:
                try:
                    i = int(k)
                except TypeError:
                    raise TypeError(f"NkiTensor indexing: unsupported index {k!r}") from None
                if i < 0:
                    i += size
                if not 0 <= i < size:
                    raise self._err("index", f"index {k} out of range for dim {d} of size {size}")
                offset += i * stride
                if self._on_chip and d == 0:
                    shape.append(1)  # on-chip: the partition dim is kept with size 1
                    strides.append(stride)
                else:
                    removed.append((len(shape), stride, d))
        if self._on_chip and len(shape) < 2 and removed:
            # on-chip views stay >= 2-D: keep the last int-indexed free dim with size 1
            pos, stride, _ = removed[-1]
            shape.insert(pos, 1)
            strides.insert(pos, stride)
        if not shape:  # HBM scalar pick: keep 1-D
            shape, strides = [1], [1]
        return self._new(shape, strides, offset, dyn=tuple(dyn))

    # -- explicit view methods (api spec §4.4) --
    def slice(self, dim: int, start: int, end: int, step: int = 1) -> NkiTensor:
        if not (0 <= start < end <= self.shape[dim]) or step < 1:
            raise self._err("slice", f"needs 0 <= start < end <= {self.shape[dim]}, step >= 1")
        key = [slice(None)] * self.ndim
        key[dim] = slice(start, end, step)
        return self[tuple(key)]

    def select(self, dim: int, index: Any) -> NkiTensor:
        if isinstance(index, NkiTensor):
            if self._on_chip and dim == 0:
                raise self._err("select", "dynamic select on the partition dim is not allowed")
            shape = list(self.shape)
            strides = list(self.strides)
            mult = strides.pop(dim)
            limit = shape.pop(dim)
            dyn = self._dyn + ((index, mult, limit),)
            return self._new(shape, strides, dyn=dyn)
        key: list[Any] = [slice(None)] * self.ndim
        key[dim] = int(index)
        return self[tuple(key)]

    def vector_select(self, dim: int, vector_offset: NkiTensor) -> NkiTensor:
        if dim != 0:
            raise self._err("vector_select", f"dim must be 0, got {dim}")
        pattern = [[self.strides[0], vector_offset.shape[0]]] + [
            [st, sz] for st, sz in zip(self.strides[1:], self.shape[1:], strict=True)
        ]
        return self.ap(pattern, vector_offset=vector_offset, indirect_dim=0)

    def permute(self, dims: Sequence[int]) -> NkiTensor:
        dims = [int(d) for d in dims]
        if sorted(dims) != list(range(self.ndim)):
            raise self._err("permute", f"dims {dims} is not a permutation of range({self.ndim})")
        if self._on_chip and dims[0] != 0:
            raise self._err("permute", "on-chip tensors must keep the partition dim first")
        return self._new([self.shape[d] for d in dims], [self.strides[d] for d in dims])

    def broadcast(self, dim: int, size: int) -> NkiTensor:
        if self.shape[dim] != 1:
            raise self._err("broadcast", f"dim {dim} must have size 1, got {self.shape[dim]}")
        if self._on_chip and dim == 0:
            raise self._err("broadcast", "cannot broadcast the partition dim")
        shape, strides = list(self.shape), list(self.strides)
        shape[dim], strides[dim] = int(size), 0
        return self._new(shape, strides)

    def expand_dim(self, dim: int) -> NkiTensor:
        if self._on_chip and dim == 0:
            raise self._err("expand_dim", "cannot insert before the partition dim")
        shape, strides = list(self.shape), list(self.strides)
        shape.insert(dim, 1)
        strides.insert(dim, 1)
        return self._new(shape, strides)

    def squeeze_dim(self, dim: int) -> NkiTensor:
        if self.shape[dim] != 1:
            raise self._err("squeeze_dim", f"dim {dim} has size {self.shape[dim]}, expected 1")
        if self._on_chip and dim == 0:
            raise self._err("squeeze_dim", "cannot remove the partition dim")
        shape, strides = list(self.shape), list(self.strides)
        del shape[dim], strides[dim]
        return self._new(shape, strides)

    def reshape_dim(self, dim: int, shape: Sequence[int]) -> NkiTensor:
        new = list(self.shape[:dim]) + list(shape) + list(self.shape[dim + 1 :])
        if -1 in shape:
            known = _prod([s for s in shape if s != -1])
            new[dim + list(shape).index(-1)] = self.shape[dim] // known
        if self._on_chip and dim == 0 and len(shape) > 1:
            raise self._err("reshape_dim", "cannot split the partition dim")
        return self.reshape(new)

    def flatten_dims(self, start_dim: int, end_dim: int) -> NkiTensor:
        if self._on_chip and start_dim == 0:
            raise self._err("flatten_dims", "cannot merge the partition dim")
        new = (
            list(self.shape[:start_dim])
            + [_prod(self.shape[start_dim : end_dim + 1])]
            + list(self.shape[end_dim + 1 :])
        )
        return self.reshape(new)

    def reshape(self, shape: Sequence[int] | int, *more: int) -> NkiTensor:
        """No-copy reshape (api spec §4.4): same element count, compatible layout."""
        shp = (
            [int(shape)] + [int(m) for m in more]
            if isinstance(shape, int)
            else [int(s) for s in shape]
        )
        if shp.count(-1) > 1:
            raise self._err("reshape", "at most one -1")
        if -1 in shp:
            known = _prod([s for s in shp if s != -1])
            shp[shp.index(-1)] = self.size // known if known else 0
        if _prod(shp) != self.size:
            raise self._err(
                "reshape", f"element count differs (got {tuple(shp)}, from {self.shape})"
            )
        if self._on_chip and shp[0] != self.shape[0]:
            raise self._err(
                "reshape",
                f"on-chip reshape must keep the partition dim (got {shp[0]}, expected {self.shape[0]})",
            )
        if self._vec is not None or self._dyn:
            raise self._err("reshape", "cannot reshape an indirect view")
        strides = _nocopy_strides(self.shape, self.strides, shp)
        if strides is None:
            raise self._err(
                "reshape",
                f"layout of strides {self.strides} is incompatible with shape {tuple(shp)}",
            )
        return self._new(shp, strides)

    def rearrange(
        self, src_pattern: str, dst_pattern: str, fixed_sizes: dict | None = None
    ) -> NkiTensor:
        raise NotImplementedError("NkiTensor.rearrange is not implemented by mxcli's interpreter")

    def view(self, dtype: Any) -> NkiTensor:
        """Bit reinterpretation (api spec §2.5)."""
        dt = as_dtype(dtype)
        if self._vec is not None or self._dyn:
            raise self._err("view", "cannot reinterpret an indirect (dynamic) view")
        old, new = self.dtype.itemsize, dt.itemsize
        if old == new:
            return self._new(self.shape, self.strides, dtype=dt)
        if self.shape[-1] != 1 and self.strides[-1] != 1:
            raise self._err(
                "view", f"last dim must be contiguous (stride 1), got {self.strides[-1]}"
            )
        shape, strides = list(self.shape), list(self.strides)
        if old > new:
            r = old // new
            shape[-1] *= r
            strides = [s * r for s in strides[:-1]] + [1]
            return self._new(shape, strides, self.offset * r, dtype=dt)
        q = new // old
        if shape[-1] % q or any(s % q for s in strides[:-1]) or self.offset % q:
            raise self._err(
                "view",
                f"cannot view {self.dtype} shape {self.shape} (strides {self.strides}, offset "
                f"{self.offset}) as {dt}: last dim, strides and offset must be divisible by {q}",
            )
        shape[-1] //= q
        strides = [s // q for s in strides[:-1]] + [1]
        return self._new(shape, strides, self.offset // q, dtype=dt)

    reinterpret_cast = view

    def ap(
        self,
        pattern: Sequence[Sequence[int]],
        offset: int | None = None,
        scalar_offset: Any = None,
        vector_offset: NkiTensor | None = None,
        indirect_dim: int = 0,
        dtype: Any = None,
    ) -> NkiTensor:
        """Raw access pattern over the underlying storage (api spec §4.5)."""
        pairs = []
        for p in pattern:
            if len(p) != 2:
                raise self._err("ap", f"pattern entries must be [step, count] pairs, got {p!r}")
            step, count = p
            if isinstance(step, VirtualRegister) or isinstance(count, VirtualRegister):
                raise self._err("ap", "pattern steps and counts must be compile-time ints")
            if int(count) <= 0 or int(step) < 0:
                raise self._err("ap", f"pattern pair {list(p)}: count must be > 0 and step >= 0")
            pairs.append((int(step), int(count)))
        if not pairs:
            raise self._err("ap", "empty pattern")
        dt = as_dtype(dtype) if dtype is not None else self.dtype
        if scalar_offset is not None and vector_offset is not None:
            raise self._err("ap", "scalar_offset and vector_offset are mutually exclusive")
        if (scalar_offset is not None or vector_offset is not None) and (self._vec or self._dyn):
            raise self._err("ap", "an indirect view cannot be re-indirected")
        if offset is None:
            # api spec §12.12 decision: the inherited offset is rescaled to the new dtype (bytes kept)
            nbyte = self.offset * self.dtype.itemsize
            if nbyte % dt.itemsize:
                raise self._err("ap", f"inherited offset is not a whole number of {dt} elements")
            off = nbyte // dt.itemsize
            dyn = self._dyn
        else:
            off = int(offset)
            dyn = ()
        ratio_num, ratio_den = self.dtype.itemsize, dt.itemsize
        shape = tuple(c for _, c in pairs)
        strides = tuple(s for s, _ in pairs)
        vec = None
        if scalar_offset is not None:
            if not 0 <= indirect_dim < self.ndim:
                raise self._err(
                    "ap", f"indirect_dim {indirect_dim} out of range for {self.ndim}-D base"
                )
            mult_bytes = _prod(self.shape[indirect_dim + 1 :]) * ratio_num
            if mult_bytes % ratio_den:
                raise self._err("ap", "indirect stride is not a whole number of elements")
            _check_offset_operand("ap", "scalar_offset", scalar_offset)
            dyn = dyn + ((scalar_offset, mult_bytes // ratio_den, self.shape[indirect_dim]),)
        if vector_offset is not None:
            if indirect_dim != 0:
                raise self._err("ap", f"vector_offset needs indirect_dim=0, got {indirect_dim}")
            if self._on_chip:
                raise self._err(
                    "ap", "vector_offset indexes HBM tensors only (got an on-chip tensor)"
                )
            if not isinstance(vector_offset, NkiTensor):
                raise self._err(
                    "ap",
                    f"vector_offset must be an SBUF tensor, got {type(vector_offset).__name__}",
                )
            if vector_offset.buffer is not MemoryRegion.sbuf:
                raise self._err(
                    "ap", f"vector_offset must be in SBUF, got {vector_offset.buffer.value}"
                )
            if vector_offset.dtype.name not in ("int32", "uint32"):
                raise self._err(
                    "ap", f"vector_offset dtype must be int32/uint32, got {vector_offset.dtype}"
                )
            # (P, 1): one index per row (api spec §4.5). A [128, n] grid (n > 1) whose
            # column-major elements cover the rows is the gather-transpose form (api spec §6.3:
            # "indices.shape[1] > 1 requires indices.shape[0] == 128", "shape[0]*shape[1] >=
            # src.shape[0]", flat = indices.T.flatten()[:src.shape[0]]; AWS's DGT loader,
            # load_apis.py load_tile_dgt); dma_transpose alone takes it (isa/dma.py).
            vshape = tuple(vector_offset.shape)
            grid = len(vshape) == 2 and vshape[1] > 1
            if grid:
                if vshape[0] != 128 or vector_offset.size < shape[0]:
                    raise self._err(
                        "ap",
                        f"vector_offset index grid must be [128, n] covering the pattern's "
                        f"{shape[0]} rows (got {vshape})",
                    )
            elif vshape[0] != shape[0] or vector_offset.size != vshape[0]:
                raise self._err(
                    "ap",
                    f"vector_offset must have one element per row of the pattern "
                    f"(got {vshape}, expected ({shape[0]}, 1)) or be a [128, n] index grid",
                )
            mult_bytes = _prod(self.shape[1:]) * ratio_num
            if mult_bytes % ratio_den:
                raise self._err("ap", "indirect row stride is not a whole number of elements")
            vec = _Vec(vector_offset, mult_bytes // ratio_den, self.shape[0], grid)
        return NkiTensor(self._st, shape, strides, off, dt, self.name, tuple(dyn), vec)

    def indirect(self, index: NkiTensor, num_elem: int | None = None) -> NkiTensor:
        raise NotImplementedError(
            "NkiTensor.indirect (v4 tensor indirection) is not implemented by mxcli's interpreter"
        )

    def get_pattern(self) -> list[list[int]]:
        return [[st, sz] for st, sz in zip(self.strides, self.shape, strict=True)]

    def is_contiguous(self) -> bool:
        first = 1 if self._on_chip else 0
        expect = 1
        for d in range(self.ndim - 1, first - 1, -1):
            if self.shape[d] != 1 and self.strides[d] != expect:
                return False
            expect *= self.shape[d]
        return True

    def is_indirect(self) -> bool:
        return bool(self._vec is not None or self._dyn)


def _full(k: Any, size: int) -> bool:
    if isinstance(k, slice):
        return slice(k.start, k.stop, k.step).indices(size) == (0, size, 1)
    return False


def _check_offset_operand(op: str, name: str, x: Any) -> None:
    if isinstance(x, VirtualRegister):
        return
    if isinstance(x, NkiTensor):
        if x.size != 1:
            raise NkiValidationError(
                f"{op}: {name} must be a 1-element tensor (got shape {x.shape})"
            )
        if x.dtype.name not in ("int32", "uint32"):
            raise NkiValidationError(f"{op}: {name} dtype must be int32/uint32 (got {x.dtype})")
        return
    raise NkiValidationError(
        f"{op}: {name} must be a VirtualRegister or a 1x1 SBUF tensor, got {type(x).__name__}"
    )


def _nocopy_strides(
    shape: Sequence[int], strides: Sequence[int], new: Sequence[int]
) -> list[int] | None:
    """Strides of `new` over the same memory as (shape, strides), or None if not expressible."""
    old = [(s, st) for s, st in zip(shape, strides, strict=True) if s != 1]
    out: list[int] = []
    i = 0
    j = 0
    newshape = list(new)
    res = [0] * len(newshape)
    nz = [k for k, s in enumerate(newshape) if s != 1]
    # group old and new non-unit dims into chunks with equal element counts
    while i < len(old) and j < len(nz):
        np_old = old[i][0]
        np_new = newshape[nz[j]]
        oi, nj = [i], [nz[j]]
        while np_old != np_new:
            if np_old < np_new:
                i += 1
                if i >= len(old):
                    return None
                np_old *= old[i][0]
                oi.append(i)
            else:
                j += 1
                if j >= len(nz):
                    return None
                np_new *= newshape[nz[j]]
                nj.append(nz[j])
        # the old chunk must be contiguous in itself
        for a in range(len(oi) - 1):
            if old[oi[a]][1] != old[oi[a + 1]][1] * old[oi[a + 1]][0]:
                return None
        st = old[oi[-1]][1]
        for k in reversed(nj):
            res[k] = st
            st *= newshape[k]
        i += 1
        j += 1
    if i != len(old) or j != len(nz):
        return None
    for k, s in enumerate(newshape):
        if s == 1:
            res[k] = 1
    out = res
    return out


# -- resolving a view for an instruction ------------------------------------------------------


def _dyn_value(x: Any) -> int:
    """Value of a dynamic offset source: a register, or a 1-element int tensor (read now)."""
    if isinstance(x, VirtualRegister):
        return x.value
    acc = resolve(x, "dynamic offset", "offset tensor")
    raw = acc.read()
    return int(raw.reshape(-1)[0])


class Access:
    """A view resolved for one instruction: bounds checked, dynamic offsets applied.

    Static accesses are a NumPy strided view over the storage; vector-indirect ones (DMA
    gather/scatter) are a per-row element index grid with a per-row validity mask.
    """

    __slots__ = (
        "t",
        "st",
        "dtype",
        "shape",
        "offset",
        "strides",
        "rows",
        "valid",
        "op",
        "name",
        "skip",
    )

    def __init__(self, t: NkiTensor, op: str, name: str) -> None:
        self.t = t
        self.st = t._st
        self.dtype = t.dtype
        self.shape = t.shape
        self.offset = t.offset
        self.strides = t.strides
        self.rows: np.ndarray | None = None  # vector: flat element index of each row start
        self.valid: np.ndarray | None = None
        self.op = op
        self.name = name
        self.skip = False  # whole access skipped (scalar-offset OOB under oob_mode.skip)

    # geometry
    @property
    def buffer(self) -> MemoryRegion:
        return self.st.buffer

    @property
    def on_chip(self) -> bool:
        return self.st.buffer.on_chip

    @property
    def parts(self) -> int:
        return self.shape[0]

    @property
    def per_part(self) -> int:
        return _prod(self.shape[1:])

    @property
    def size(self) -> int:
        return _prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def start_partition(self) -> int:
        return (self.offset * self.dtype.itemsize) // self.st.row_bytes

    def err(self, msg: str) -> NkiValidationError:
        return NkiValidationError(f"{self.op}: {self.name} {msg}")

    # raw element views
    def _strided(self, base: np.ndarray, np_dtype: Any) -> np.ndarray:
        s = self.dtype.itemsize
        return np.ndarray(
            self.shape,
            dtype=np_dtype,
            buffer=base,
            offset=self.offset * s,
            strides=tuple(x * s for x in self.strides),
        )

    def _grid(self) -> np.ndarray:
        """Flat element indices [P, rest...] of a vector access."""
        assert self.rows is not None
        rest = np.zeros((), dtype=np.int64)
        for sz, stv in zip(self.shape[1:], self.strides[1:], strict=True):
            rest = rest[..., None] + np.arange(sz, dtype=np.int64) * stv
        return self.rows.reshape((-1,) + (1,) * (len(self.shape) - 1)) + rest

    def _flat(self, base: np.ndarray, np_dtype: Any) -> np.ndarray:
        s = self.dtype.itemsize
        n = (base.size // s) * s
        return base[:n].view(np_dtype)

    def _mask_dtype(self) -> Any:
        return {1: np.uint8, 2: np.uint16, 4: np.uint32}[self.dtype.itemsize]

    def _track(
        self,
        write: bool,
        mask: np.ndarray | None = None,
        values: np.ndarray | None = None,
        commit: Any = None,
    ) -> None:
        """LNC=2: report this access of a shared_hbm tensor to the race detector (a write with
        its raw values: a store of the bytes already there is told apart, races.py); `commit`
        (the store itself) runs after it, under the detector's lock for a tracked write."""
        prog = machine.current_or_none()
        race = None if prog is None else prog.run.race
        if self.st.buffer is not MemoryRegion.shared_hbm or race is None:
            if commit is not None:
                commit()
            return
        assert prog is not None
        race.record(self, prog.program_id, write, mask, values, commit)

    def read(self, check_init: bool = True) -> np.ndarray:
        """Raw elements (a copy) in the storage dtype; vector rows that are skipped read as 0."""
        if check_init:
            self.check_init()
        self._track(write=False)
        np_dt = self.dtype.np_dtype
        if self.rows is None:
            return self._strided(self.st.buf, np_dt).copy()
        out = np.zeros(self.shape, dtype=np_dt)
        assert self.valid is not None
        g = self._grid()[self.valid]
        out[self.valid] = self._flat(self.st.buf, np_dt)[g]
        return out

    def read_f32(self) -> np.ndarray:
        from mxcli.nkisim.dtypes import to_fp32

        if self.dtype.kind == "x4":
            raise self.err(f"dtype {self.dtype} cannot be used by this op (x4 data: MX ops only)")
        return to_fp32(self.read(), self.dtype)

    def written_mask(self) -> np.ndarray:
        """Per element: True where every byte was written since allocation."""
        if self.st.init is None:
            return np.ones(self.shape, dtype=bool)
        mdt = self._mask_dtype()
        full = np.iinfo(mdt).max
        if self.rows is None:
            return self._strided(self.st.init, mdt) == full
        out = np.ones(self.shape, dtype=bool)
        assert self.valid is not None
        g = self._grid()[self.valid]
        out[self.valid] = self._flat(self.st.init, mdt)[g] == full
        return out

    def check_init(self) -> None:
        prog = machine.current()
        if self.st.init is None or not prog.checks_init:
            return
        m = self.written_mask()
        if m.all():
            return
        bad = np.argwhere(~m)[0].tolist()
        msg = (
            f"{self.op}: {self.name} reads memory never written since allocation "
            f"(tensor {self.st.name or '<unnamed>'} in {self.st.buffer.value}, first at view index "
            f"{tuple(bad)}; {int((~m).sum())} of {m.size} elements)"
        )
        prog.uninit_read(
            f"uninit:{self.op}:{self.name}",
            msg,
            operand=self.name,
            tensor=f"{self.st.name or '<unnamed>'} ({self.st.buffer.value})",
            elements=int((~m).sum()),
        )

    def write(self, values: np.ndarray, mask: np.ndarray | None = None) -> None:
        """Store raw elements (already in the storage dtype) and mark them written.

        `mask` (shape of the view) restricts the write to selected elements (skipped OOB rows).
        """
        np_dt = self.dtype.np_dtype
        vals = np.asarray(values)
        if vals.dtype != np_dt:
            vals = vals.astype(np_dt)
        vals = vals.reshape(self.shape) if vals.shape != self.shape else vals
        # the race detector compares the stored bytes with these under its lock, and the store
        # happens under the same lock: the other core's write cannot land in between (races.py)
        self._track(write=True, mask=mask, values=vals, commit=lambda: self._store(vals, mask))

    def _store(self, vals: np.ndarray, mask: np.ndarray | None) -> None:
        np_dt = self.dtype.np_dtype
        mdt = self._mask_dtype()
        full = np.iinfo(mdt).max
        if self.rows is None:
            view = self._strided(self.st.buf, np_dt)
            if mask is None:
                view[...] = vals
            else:
                view[mask] = vals[mask]
            if self.st.init is not None:
                iv = self._strided(self.st.init, mdt)
                if mask is None:
                    iv[...] = full
                else:
                    iv[mask] = full
            return
        assert self.valid is not None
        em = np.broadcast_to(self.valid.reshape((-1,) + (1,) * (len(self.shape) - 1)), self.shape)
        if mask is not None:
            em = em & mask
        g = self._grid()[em].reshape(-1)
        v = vals[em].reshape(-1)
        if g.size:
            # api spec §6.1: duplicate rows in one scatter: the last write (partition order) wins
            _, first = np.unique(g[::-1], return_index=True)
            keep = g.size - 1 - first
            self._flat(self.st.buf, np_dt)[g[keep]] = v[keep]
            if self.st.init is not None:
                self._flat(self.st.init, mdt)[g[keep]] = full

    def write_zero(self) -> None:
        """Check-only mode: store zeros (skipped arithmetic) and mark written."""
        self.write(np.zeros(self.shape, dtype=self.dtype.np_dtype))


def resolve(
    t: Any,
    op: str,
    name: str,
    *,
    buffers: tuple[MemoryRegion, ...] | None = None,
    oob_skip: bool = False,
) -> Access:
    """Resolve `t` as operand `name` of instruction `op`: buffer, bounds and dynamic offsets."""
    if not isinstance(t, NkiTensor):
        raise NkiValidationError(f"{op}: {name} must be an NkiTensor, got {type(t).__name__}")
    prog = machine.current()
    st = t._st
    if st.owner is not None and st.owner != prog.program_id:
        raise NkiValidationError(
            f"{op}: {name} belongs to LNC program {st.owner} (private memory of another core)"
        )
    if buffers is not None and st.buffer not in buffers:
        allowed = "/".join(b.value for b in buffers)
        raise NkiValidationError(f"{op}: {name} must be in {allowed} (got {st.buffer.value})")
    st.touch(prog.clock)
    acc = Access(t, op, name)
    s = t.dtype.itemsize
    if st.nbytes % 1:
        raise acc.err("bad storage")
    offset = t.offset
    for src, mult, limit in t._dyn:
        v = _dyn_value(src)
        if limit is not None and not 0 <= v < limit:
            if oob_skip:
                acc.skip = True
                return acc
            raise NkiOutOfBoundsError(
                f"{op}: {name} dynamic offset {v} out of bounds (expected 0 <= offset < {limit})"
            )
        offset += v * mult
    acc.offset = offset
    ext = sum((sz - 1) * stv for sz, stv in zip(t.shape, t.strides, strict=True))
    if t._vec is None:
        if offset < 0 or (offset + ext + 1) * s > st.nbytes:
            if t._dyn and oob_skip:
                acc.skip = True
                return acc
            err_cls = NkiOutOfBoundsError if t._dyn else NkiValidationError
            raise err_cls(
                f"{op}: {name} access out of bounds of tensor {st.name or '<unnamed>'} "
                f"(elements [{offset}, {offset + ext}] of {st.nbytes // s} {t.dtype})"
            )
        if st.buffer.on_chip:
            _check_on_chip(acc, ext)
        if prog.trace is not None:
            prog.trace.operand(acc)
        return acc
    # vector indirection (api spec §4.5): row p starts at offset + idx[p] * mult
    vec = t._vec
    idx_acc = resolve(vec.index, op, f"{name}.vector_offset", buffers=(MemoryRegion.sbuf,))
    raw = idx_acc.read()
    if vec.grid:  # column-major over the [128, n] grid (api spec §6.3)
        raw = raw.reshape(raw.shape[0], -1).T.reshape(-1)[: t.shape[0]]
    raw = raw.reshape(-1).astype(np.int64)  # int32 signed, uint32 unsigned
    rest_ext = ext - (t.shape[0] - 1) * t.strides[0]
    rows = offset + raw * vec.mult
    if oob_skip:
        # upstream (nki-library MoE kernels) marks a row to skip with index -1 (int32; uint32_max
        # as uint32), clamping other negative offsets with max(idx, -1) first: the DGE scales the
        # index by the row stride, so only -1 is a reliable skip marker
        neg = (raw < 0) & (raw != -1)
        if neg.any():
            p = int(np.argmax(neg))
            raise rule_error(
                Rule.DMA_NEGATIVE_INDEX,
                f"{op}: {name} indirect row {p} index {int(raw[p])} is negative; under "
                "oob_mode.skip only -1 marks a skipped row (clamp with max(index, -1))",
            )
    valid = (raw >= 0) & (raw < vec.limit) & (rows >= 0) & ((rows + rest_ext + 1) * s <= st.nbytes)
    if not valid.all() and not oob_skip:
        p = int(np.argmin(valid))
        raise NkiOutOfBoundsError(
            f"{op}: {name} indirect row {p} index {int(raw[p])} out of bounds "
            f"(expected 0 <= index < {vec.limit}) under oob_mode.error"
        )
    acc.rows = np.where(valid, rows, 0)
    acc.valid = valid
    if prog.trace is not None:
        prog.trace.operand(acc)
    return acc


def _check_on_chip(acc: Access, ext: int) -> None:
    """On-chip geometry (api spec §2.3): partition stride = row length; free accesses stay in
    one partition row; partitions exist in the storage."""
    st = acc.st
    s = acc.dtype.itemsize
    row = st.row_bytes
    if row % s:
        raise acc.err(f"dtype {acc.dtype} does not tile the {row}-byte partition rows")
    if acc.shape and acc.shape[0] > 1 and acc.strides[0] * s != row:
        raise acc.err(
            f"partition step must equal the storage row length (got {acc.strides[0]}, expected "
            f"{row // s} {acc.dtype} elements): partitions cannot be strided"
        )
    in_row = (acc.offset * s) % row
    free_ext = sum((sz - 1) * stv for sz, stv in zip(acc.shape[1:], acc.strides[1:], strict=True))
    if in_row + (free_ext + 1) * s > row:
        raise acc.err(
            f"free-dim access spills out of its partition row (bytes {in_row}..."
            f"{in_row + (free_ext + 1) * s} of a {row}-byte row)"
        )
