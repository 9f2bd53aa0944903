"""Instruction recording for the cost model: what each issued instruction touched.

While `recording()` is active, every simulated program (LNC core) gets a `Recorder`. The
interpreter calls `Recorder.begin` when an instruction issues (``Program.begin``) and
`Recorder.operand` for each tensor operand it resolves (``tensor.resolve``); nothing else in the
interpreter knows about tracing. Each instruction becomes an `Instr`: its op, engine, the kernel
source line that issued it, a few ISA arguments that decide its cost (``dge_mode``, ``engine``,
``perf_mode``, read from the ISA function's own frame, whose parameter names are pinned by the
NKI API spec) and one `Operand` per tensor with the geometry the cost model needs (elements per
partition, contiguous run length, byte region for the dependency tracking of `schedule`).

Works in check-only mode (the intended use: production shapes in seconds), since operand
resolution and issue happen there exactly as in a full run.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from mxcli.nkisim import machine

__all__ = ["Operand", "Instr", "Recorder", "recording", "WRITE_OPERANDS"]

# operand names an ISA op writes (api spec §6-§8); every other resolved operand is read
WRITE_OPERANDS = frozenset({"dst", "dst_scale", "reduce_res", "idx_dst", "val_dst"})
# ISA parameters whose value changes an instruction's cost or queue (api spec §6.1, §7.1)
_COST_ARGS = ("dge_mode", "engine", "perf_mode", "is_transpose")
_PKG_DIR = os.path.dirname(os.path.abspath(__file__))


@dataclass(frozen=True, slots=True)
class Operand:
    """One tensor operand as an instruction accessed it.

    ``region``: partitions ``[p0, p1)`` x bytes ``[lo, hi)`` inside each partition row (on-chip),
    or ``[0, 1)`` x flat bytes (HBM): a bounding box, used for data dependencies; for a tensor
    placed at an ``address``, in the buffer's own coordinates (``key`` is then the buffer's).
    ``run``: elements per contiguous run (the DMA packet size in elements).
    ``rows``: partitions/rows actually moved (indirect rows skipped out of bounds excluded).
    """

    name: str
    write: bool
    buffer: str  # "sbuf" | "psum" | "hbm"
    key: int  # identity of the storage (allocation)
    tensor: str  # the allocation's name, for reports
    dtype: str
    itemsize: int
    shape: tuple[int, ...]
    parts: int  # dim 0 of the view (the partition dim on chip)
    per_part: int  # elements per partition (row)
    region: tuple[int, int, int, int]
    run: int
    rows: int
    contiguous_free: bool  # innermost free dim has unit stride (Vector performance mode rule)

    @property
    def size(self) -> int:
        return self.rows * self.per_part

    @property
    def nbytes(self) -> int:
        return self.size * self.itemsize


@dataclass(slots=True)
class Instr:
    """One issued instruction."""

    index: int  # issue order within its program
    op: str
    engine: str  # "tensor" | "vector" | "scalar" | "gpsimd" | "dma" | "sync"
    source: str  # "path/to/nki_kernel.py:123" (the kernel line that issued it)
    args: dict[str, str] = field(default_factory=dict)
    operands: list[Operand] = field(default_factory=list)

    def reads(self) -> list[Operand]:
        return [o for o in self.operands if not o.write]

    def writes(self) -> list[Operand]:
        return [o for o in self.operands if o.write]

    def get(self, *names: str) -> Operand | None:
        for n in names:
            for o in self.operands:
                if o.name == n:
                    return o
        return None


def _run_length(shape: tuple[int, ...], strides: tuple[int, ...], first: int) -> int:
    """Elements per contiguous run of a strided view over dims ``first..``."""
    run, expect = 1, 1
    for n, st in zip(reversed(shape[first:]), reversed(strides[first:]), strict=True):
        if n == 1:
            continue
        if st != expect:
            break
        run *= n
        expect *= n
    return run


# the dependency key of every kernel-placed tensor of a buffer (ids of live objects are positive)
_PLACED_KEY = {"sbuf": -1, "psum": -2}


def _storage_key(st: Any, on_chip: bool) -> int:
    """Operands with one key are checked for overlapping regions (`schedule`): one allocation,
    or, for tensors the kernel placed at an ``address``, the whole buffer (their regions are
    then absolute: two placed tensors that share bytes depend on each other)."""
    if on_chip and st.address is not None:
        return _PLACED_KEY[st.buffer.value]
    return id(st.record) if st.record is not None else id(st)


def _operand(acc: Any) -> Operand:
    st = acc.st
    s = acc.dtype.itemsize
    shape, strides = tuple(acc.shape), tuple(acc.strides)
    on_chip = st.buffer.on_chip
    first = 1 if (on_chip or acc.rows is not None) else 0
    lo_f = sum(min(0, (n - 1) * k) for n, k in zip(shape[first:], strides[first:], strict=True))
    hi_f = sum(max(0, (n - 1) * k) for n, k in zip(shape[first:], strides[first:], strict=True))
    parts = shape[0] if shape else 1
    per_part = 1
    for n in shape[1:]:
        per_part *= n
    rows = parts
    if acc.rows is not None:  # vector-indirect (DMA gather/scatter) on HBM
        valid = acc.rows[acc.valid]
        rows = int(valid.size)
        if rows:
            region = (0, 1, int(valid.min() + lo_f) * s, int(valid.max() + hi_f + 1) * s)
        else:
            region = (0, 1, 0, 0)
    elif on_chip:
        b = acc.offset * s
        p0, in_row = divmod(b, st.row_bytes)
        if st.address is not None:  # placed by the kernel: its bytes in the buffer itself
            p0, in_row = p0 + st.address[0], in_row + st.address[1]
        region = (p0, p0 + max(parts, 1), in_row + lo_f * s, in_row + (hi_f + 1) * s)
    else:
        if not shape:
            per_part = 1
        lo_all = sum(min(0, (n - 1) * k) for n, k in zip(shape, strides, strict=True))
        hi_all = sum(max(0, (n - 1) * k) for n, k in zip(shape, strides, strict=True))
        region = (0, 1, (acc.offset + lo_all) * s, (acc.offset + hi_all + 1) * s)
    inner = [k for n, k in zip(shape[1:], strides[1:], strict=True) if n > 1]
    return Operand(
        name=acc.name,
        write=acc.name in WRITE_OPERANDS,
        buffer="hbm" if not on_chip else st.buffer.value,
        key=_storage_key(st, on_chip),
        tensor=st.name or "<unnamed>",
        dtype=str(acc.dtype),
        itemsize=s,
        shape=shape,
        parts=parts,
        per_part=per_part,
        region=region,
        run=_run_length(shape, strides, first),
        rows=rows,
        contiguous_free=not inner or inner[-1] == 1,
    )


_inside_cache: dict[str, bool] = {}


def _inside(frame: FrameType) -> bool:
    fn = frame.f_code.co_filename
    r = _inside_cache.get(fn)
    if r is None:
        r = _inside_cache[fn] = os.path.abspath(fn).startswith(_PKG_DIR)
    return r


def _outer(frame: FrameType | None) -> tuple[FrameType | None, FrameType | None]:
    """(outermost interpreter frame = the ISA call, the kernel frame that made it)."""
    last = None
    while frame is not None and _inside(frame):
        last, frame = frame, frame.f_back
    return last, frame


def _call_site(frame: FrameType | None) -> tuple[FrameType | None, str, dict[str, str]]:
    """(the ISA call's frame, its kernel call site "file:line", cost-relevant ISA
    arguments read from the ISA function's own frame)."""
    args: dict[str, str] = {}
    f = frame
    while f is not None and _inside(f):
        code = f.f_code
        if not args and code.co_name != "begin" and any(a in code.co_varnames for a in _COST_ARGS):
            loc = f.f_locals
            args = {a: _enum_name(loc[a]) for a in _COST_ARGS if a in loc}
        f = f.f_back
    outer, site = _outer(frame)
    where = f"{_short(site.f_code.co_filename)}:{site.f_lineno}" if site else "<unknown>"
    return outer, where, args


def _enum_name(v: Any) -> str:
    name = getattr(v, "name", None)
    return str(name) if name is not None else str(v)


def _short(path: str) -> str:
    """A path relative to the mxcli package root when inside it, else the file name."""
    root = os.path.dirname(os.path.dirname(_PKG_DIR))
    ap = os.path.abspath(path)
    return os.path.relpath(ap, root) if ap.startswith(root) else os.path.basename(ap)


class Recorder:
    """The instructions one program issued, in order (`Instr` list).

    An operand belongs to the instruction whose ISA call resolved it: some ops resolve their
    operands before they issue, so operands wait in `_pending` until the issue of the
    instruction made from the same ISA call frame.
    """

    def __init__(self, program_id: int) -> None:
        self.program_id = program_id
        self.instrs: list[Instr] = []
        # the current instruction's ISA call frame (held, so that a later call's frame cannot
        # reuse its identity)
        self._frame: FrameType | None = None
        self._pending: list[tuple[FrameType | None, Operand]] = []
        self._keep: dict[int, Any] = {}  # HBM storages kept alive so their ids stay unique

    def begin(self, op: str, engine: str) -> None:
        frame, source, args = _call_site(sys._getframe(2))
        ins = Instr(len(self.instrs), op, engine, source, args)
        ins.operands.extend(o for f, o in self._pending if f is frame)
        self._pending.clear()
        self._frame = frame
        self.instrs.append(ins)

    def operand(self, acc: Any) -> None:
        if acc.st.record is None:
            self._keep[id(acc.st)] = acc.st
        outer, _ = _outer(sys._getframe(1))
        o = _operand(acc)
        if self.instrs and outer is self._frame:
            self.instrs[-1].operands.append(o)
        else:
            self._pending.append((outer, o))


@contextmanager
def recording() -> Iterator[list[Recorder]]:
    """Record every program started inside the block; yields the recorders (one per program,
    appended as programs start). Not re-entrant across threads: one recording at a time."""
    recorders: list[Recorder] = []

    def factory(program_id: int) -> Recorder:
        r = Recorder(program_id)
        recorders.append(r)
        return r

    prev = machine.set_trace_factory(factory)
    try:
        yield recorders
    finally:
        machine.set_trace_factory(prev)
