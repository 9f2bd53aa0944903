"""Registers and version queries (api spec §3.3, §5.2)."""

from __future__ import annotations

from typing import Any

import numpy as np

from mxcli.nkisim import machine
from mxcli.nkisim.errors import NkiValidationError
from mxcli.nkisim.nki.isa._common import SBUF_HBM, NkiInstruction, isa_op, operand
from mxcli.nkisim.target import nc_version
from mxcli.nkisim.tensor import NkiTensor, VirtualRegister

__all__ = [
    "register_alloc",
    "register_move",
    "register_load",
    "register_store",
    "get_nc_version",
    "get_nc_sub_version",
]


def _load_scalar(op: str, src: NkiTensor) -> int:
    acc = operand(op, "src", src, SBUF_HBM)
    if acc.size != 1:
        raise NkiValidationError(f"{op}: src must hold exactly one element (got shape {acc.shape})")
    if acc.dtype.itemsize > 4 or acc.dtype.kind == "x4":
        raise NkiValidationError(
            f"{op}: src dtype must be a <= 32-bit scalar type (got {acc.dtype})"
        )
    raw = acc.read().reshape(-1)
    if acc.dtype.kind in ("int", "uint", "bool"):
        return int(raw[0])
    return int(np.float32(raw.astype(np.float32)[0]))


def register_alloc(x: Any = None) -> VirtualRegister:
    """A new register (api spec §12.21 decision: ``None`` initialises to 0, as the KLR tracer
    does; a 1-element tensor initialiser is loaded)."""
    prog = machine.current()
    prog.begin("register_alloc", "sync")
    if x is None:
        return VirtualRegister(0)
    if isinstance(x, NkiTensor):
        return VirtualRegister(_load_scalar("register_alloc", x))
    if isinstance(x, VirtualRegister):
        return VirtualRegister(x.value)
    if isinstance(x, (bool, float)) or not isinstance(x, (int, np.integer)):
        raise NkiValidationError(
            f"register_alloc: x must be an int, a 1-element tensor or None, got {x!r}"
        )
    return VirtualRegister(int(x))


@isa_op(removed={"imm": "renamed to src in NKI 0.3"})
def register_move(dst: VirtualRegister, src: Any) -> NkiInstruction:
    """``dst = src`` (an int immediate or another register)."""
    prog = machine.current()
    prog.begin("register_move", "sync")
    if not isinstance(dst, VirtualRegister):
        raise NkiValidationError(
            f"register_move: dst must be a VirtualRegister, got {type(dst).__name__}"
        )
    if isinstance(src, VirtualRegister):
        dst._set(src.value, "register_move")
    elif isinstance(src, (int, np.integer)) and not isinstance(src, bool):
        dst._set(int(src), "register_move")
    else:
        raise NkiValidationError(f"register_move: src must be an int or a register, got {src!r}")
    return NkiInstruction("register_move")


@isa_op()
def register_load(dst: VirtualRegister, src: NkiTensor) -> NkiInstruction:
    """Load a 1-element SBUF/HBM tensor into a register."""
    prog = machine.current()
    prog.begin("register_load", "sync")
    if not isinstance(dst, VirtualRegister):
        raise NkiValidationError(
            f"register_load: dst must be a VirtualRegister, got {type(dst).__name__}"
        )
    dst._set(_load_scalar("register_load", src), "register_load")
    return NkiInstruction("register_load")


@isa_op()
def register_store(dst: NkiTensor, src: VirtualRegister) -> NkiInstruction:
    """Write a register into a 1-element tensor (int32 bits, or a value cast for other dtypes)."""
    op = "register_store"
    prog = machine.current()
    prog.begin(op, "sync")
    if not isinstance(src, VirtualRegister):
        raise NkiValidationError(f"{op}: src must be a VirtualRegister, got {type(src).__name__}")
    acc = operand(op, "dst", dst, SBUF_HBM)
    if acc.size != 1:
        raise NkiValidationError(f"{op}: dst must hold exactly one element (got shape {acc.shape})")
    if acc.dtype.kind in ("int", "uint", "bool"):
        bits = acc.dtype.itemsize * 8
        u = np.array([src.value & ((1 << bits) - 1)], dtype=np.int64)
        raw = u.astype({8: np.uint8, 16: np.uint16, 32: np.uint32}[bits]).view(acc.dtype.np_dtype)
        acc.write(raw.reshape(acc.shape))
    else:
        from mxcli.nkisim.dtypes import from_fp32

        acc.write(from_fp32(np.array([src.value], dtype=np.float32), acc.dtype).reshape(acc.shape))
    return NkiInstruction(op)


def get_nc_version() -> nc_version:
    """The target's NeuronCore version (an orderable IntEnum, api spec §12.4)."""
    prog = machine.current_or_none()
    if prog is not None:
        return prog.target.version
    from mxcli.nkisim.target import resolve_target

    return resolve_target().version


def get_nc_sub_version() -> int:
    """0 (first silicon revision) — or 1 when ``NKI_NC_SUB_VERSION=1`` / the run sets it
    (kernels gate ``nisa.exponential`` on gen4 sub-version 1, "Trn3 B0+")."""
    prog = machine.current_or_none()
    if prog is not None:
        return prog.target.sub_version
    import os

    return int(os.environ.get("NKI_NC_SUB_VERSION", "0") or 0)
