"""LNC race detector for shared HBM (issue 11 item 2; NKI 0.6 ``core_barrier`` stub).

Under LNC=2 the two cores run concurrently and share ``shared_hbm``. ``core_barrier(data, cores)``
synchronizes the cores *on its data tensor only*. So an access by one core and a conflicting
access by the other core to the same bytes of a shared tensor are ordered only when both cores
passed a ``core_barrier`` on that same tensor in between.

The detector keeps, per shared tensor (storage), one byte map of who touched which bytes since the
last barrier both cores made on that tensor (bit ``2p``: read by core p, bit ``2p + 1``: written by
core p), plus the access sites. A read of bytes the other core wrote in the same window, or a write
over bytes the other core read in that window, raises naming both sites. Barriers on other tensors
do not clear it. Write/write overlaps (both cores storing the same region) are not reported: the
rule covers hand-overs (a value produced by one core and consumed by the other).

Identical bytes are no hand-over (issue 29; AWS's MXFP8 backward has both cores gather the same
block into one shared buffer and each read it back, with no barrier). When a core reads bytes it
wrote itself in the window, and the other core's writes of them stored the very same bytes, every
order of the three accesses gives the reader the same value: the read is of its own product, not
a hand-over, and is not reported. The same holds for a write of the bytes a byte already holds
over bytes the other core read after writing them itself. core_barrier orders accesses; nothing
in the execution spec (nki_execution.md §3.3, api §6.5) orders or tears two DMA stores of one value,
so only a value that could differ between orders is a race. A read of bytes the other core wrote
before the reader wrote them itself, and any write that changes bytes the other core read, stay
races. Bits per byte: ``2p`` read by core p before writing it, ``2p + 1`` written by core p,
``4`` the two cores' writes agree, ``5 + p`` read by core p after writing it itself.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from mxcli.nkisim.rules import Rule, rule_error

if TYPE_CHECKING:
    from mxcli.nkisim.tensor import Access, Storage

__all__ = ["RaceTracker", "kernel_site"]

_PACKAGE_DIR = str(Path(__file__).resolve().parent)


def kernel_site() -> str:
    """``file:line`` of the innermost caller outside this package (the kernel source line)."""
    f = sys._getframe(1)
    while f is not None:
        path = f.f_code.co_filename
        if not path.startswith(_PACKAGE_DIR):
            return f"{path}:{f.f_lineno}"
        f = f.f_back  # type: ignore[assignment]
    return "<unknown>"


@dataclass
class _Record:
    """One access of a shared tensor: who, where, and its byte footprint (bounding range first)."""

    program: int
    write: bool
    site: str
    op: str
    operand: str
    lo: int
    hi: int
    footprint: Any  # callable () -> flat byte indices, computed only when a race is reported

    def describe(self) -> str:
        kind = "wrote" if self.write else "read"
        return f"core {self.program} {kind} it in {self.op} ({self.operand}) at {self.site}"


class _Window:
    """Accesses of one shared tensor since the last barrier both cores made on it."""

    def __init__(self, nbytes: int) -> None:
        self.bits = np.zeros(nbytes, dtype=np.uint8)
        self.records: list[_Record] = []


class RaceTracker:
    """Accesses to shared HBM per tensor and barrier window; see the module docstring."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.enabled = True
        self._windows: dict[int, _Window] = {}
        self._keep: dict[int, Storage] = {}

    def clear(self, st: Storage) -> None:
        """Both cores passed a barrier on `st`: its earlier accesses are ordered before later ones."""
        with self.lock:
            self._windows.pop(id(st), None)

    def record(
        self,
        acc: Access,
        program: int,
        write: bool,
        mask: np.ndarray | None,
        values: np.ndarray | None = None,
        commit: Any = None,
    ) -> None:
        """One access of a shared tensor by `program`; `values` (a write's raw elements, in the
        view's shape) tell a store of the bytes already there from one that changes them.
        `commit` (the store) runs under the lock right after the bytes are compared, so the
        other core's store cannot land between the comparison and this one."""
        if not self.enabled or acc.skip:
            if commit is not None:
                with self.lock:
                    commit()
            return
        st = acc.st
        s = acc.dtype.itemsize
        udt = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}.get(s)
        if acc.rows is None:
            base = acc.offset * s
            shape = tuple(acc.shape) + (s,)
            strides = tuple(x * s for x in acc.strides) + (1,)
            ext = sum((n - 1) * abs(x) for n, x in zip(shape, strides, strict=True))
            lo, hi = base, base + ext + 1
            sel = None if mask is None else np.asarray(mask, dtype=bool)

            def view(bits: np.ndarray) -> np.ndarray:
                return np.lib.stride_tricks.as_strided(
                    bits[base:], shape=shape, strides=strides, writeable=True
                )

            def footprint() -> np.ndarray:
                grid = np.arange(st.nbytes, dtype=np.int64)
                v = np.lib.stride_tricks.as_strided(
                    grid[base:], shape=shape, strides=tuple(x * grid.itemsize for x in strides)
                )
                return (v if sel is None else v[sel]).reshape(-1)

            def same_bytes() -> np.ndarray | None:
                if values is None or udt is None:
                    return None
                now = acc._strided(st.buf, udt)
                new = np.ascontiguousarray(values).view(udt).reshape(now.shape)
                eq = np.broadcast_to((now == new)[..., None], shape)
                return eq if sel is None else eq[sel]

        else:

            def elements() -> np.ndarray:
                assert acc.valid is not None
                m = np.broadcast_to(
                    acc.valid.reshape((-1,) + (1,) * (len(acc.shape) - 1)), tuple(acc.shape)
                )
                return m & np.asarray(mask, dtype=bool) if mask is not None else m

            def footprint() -> np.ndarray:
                return (acc._grid()[elements()].reshape(-1, 1) * s + np.arange(s)).reshape(-1)

            def same_bytes() -> np.ndarray | None:
                if values is None or udt is None:
                    return None
                sel_e = elements()
                now = acc._flat(st.buf, udt)[acc._grid()[sel_e]]
                new = np.ascontiguousarray(values).view(udt).reshape(tuple(acc.shape))[sel_e]
                return np.repeat((now == new).reshape(-1), s)

            idx = footprint()
            if idx.size == 0:
                if commit is not None:
                    with self.lock:
                        commit()
                return
            lo, hi = int(idx.min()), int(idx.max()) + 1

        with self.lock:
            win = self._windows.get(id(st))
            if win is None:
                win = self._windows[id(st)] = _Window(st.nbytes)
                self._keep[id(st)] = st
            same = same_bytes() if write else None
            if acc.rows is None:
                v = view(win.bits)
                touched = v if sel is None else v[sel]
                hit = np.flatnonzero(_conflicts(touched, program, write, same))
                if hit.size:
                    first = int(footprint()[hit[0]])
                    self._raise(acc, program, write, first, win, st)
                if sel is None:
                    v[...] = _after(touched, program, write, same)
                else:
                    v[sel] = _after(touched, program, write, same)
            else:
                cur = win.bits[idx]
                hits = idx[_conflicts(cur, program, write, same)]
                if hits.size:
                    self._raise(acc, program, write, int(hits[0]), win, st)
                # a byte twice in one access (duplicate rows): the last state wins, as the data
                win.bits[idx] = _after(cur, program, write, same)
            win.records.append(
                _Record(program, write, kernel_site(), acc.op, acc.name, lo, hi, footprint)
            )
            if commit is not None:
                commit()

    @staticmethod
    def _raise(
        acc: Access, program: int, write: bool, byte: int, win: _Window, st: Storage
    ) -> None:
        theirs = "<unknown site>"
        for rec in win.records:
            if rec.program != program and rec.write != write and rec.lo <= byte < rec.hi:
                if np.any(rec.footprint() == byte):
                    theirs = rec.describe()
                    break
        mine = _Record(program, write, kernel_site(), acc.op, acc.name, 0, 0, None).describe()
        what = (
            "overwrites bytes the other core read" if write else "reads bytes the other core wrote"
        )
        raise rule_error(
            Rule.LNC_RACE,
            f"LNC race on shared_hbm tensor {st.name or '<unnamed>'} (byte {byte}): core "
            f"{program} {what} with no core_barrier on this tensor by both cores in between; "
            f"{mine}; {theirs}",
        )


_AGREE = np.uint8(1 << 4)


def _bit(n: int) -> np.uint8:
    return np.uint8(1 << n)


def _conflicts(bits: np.ndarray, program: int, write: bool, same: np.ndarray | None) -> np.ndarray:
    """Per byte: this access races with the other core's accesses in the window."""
    other = 1 - program
    if write:
        read_first = (bits & _bit(2 * other)) != 0
        read_own = (bits & _bit(5 + other)) != 0
        unchanged = np.zeros(bits.shape, dtype=bool) if same is None else same
        return read_first | (read_own & ~unchanged)
    theirs = (bits & _bit(2 * other + 1)) != 0
    agreed = ((bits & _bit(2 * program + 1)) != 0) & ((bits & _AGREE) != 0)
    return theirs & ~agreed


def _after(bits: np.ndarray, program: int, write: bool, same: np.ndarray | None) -> np.ndarray:
    """The bytes' state after this access."""
    other = 1 - program
    if write:
        theirs = (bits & _bit(2 * other + 1)) != 0
        agree = theirs & (np.zeros(bits.shape, dtype=bool) if same is None else same)
        out = (bits & ~_AGREE) | _bit(2 * program + 1)
        return np.where(agree, out | _AGREE, out).astype(np.uint8)
    own = (bits & _bit(2 * program + 1)) != 0
    return np.where(own, bits | _bit(5 + program), bits | _bit(2 * program)).astype(np.uint8)
