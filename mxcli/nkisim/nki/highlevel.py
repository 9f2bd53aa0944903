"""Experimental high-level ``nl`` wrappers (api spec §4.8), built on the ISA instructions.

``nl.add(x, y)`` / ``nl.exp(x)`` allocate a new SBUF result; ``nl.load`` / ``nl.store`` /
``nl.copy`` move tiles. Kernels targeted by mxcli use the ISA ops directly; these exist so that
small kernels and tests written in the high-level style run too.
"""

from __future__ import annotations

from typing import Any

from mxcli.nkisim.dtypes import as_dtype
from mxcli.nkisim.errors import NkiValidationError
from mxcli.nkisim.ops import OpToken
from mxcli.nkisim.tensor import MemoryRegion, NkiTensor, allocate


def _new_like(x: NkiTensor, dtype: Any) -> NkiTensor:
    dt = as_dtype(dtype) if dtype is not None else x.dtype
    return allocate(x.shape, dt, MemoryRegion.sbuf)


def call_token(tok: Any, *args: Any, **kwargs: Any) -> NkiTensor:
    from mxcli.nkisim.nki import isa

    try:  # the stub's parameter names: nl.add(x, y, dtype=None), nl.exp(x, dtype=None)
        bound = tok.__signature__.bind(*args, **kwargs)
    except TypeError as exc:
        raise TypeError(f"nl.{tok.name}(): {exc}") from None
    bound.apply_defaults()
    dtype = bound.arguments.pop("dtype")
    args = tuple(bound.arguments.values())
    if not args or not isinstance(args[0], NkiTensor):
        raise TypeError(f"nl.{tok.name}(x, ...) needs an on-chip tile as its first argument")
    x = args[0]
    if tok.name == "copy" and len(args) == 1:
        return copy(x, dtype)
    out = _new_like(x, dtype)
    if len(args) == 1:
        if tok.act is None:
            raise TypeError(f"nl.{tok.name} needs two operands")
        isa.activation(dst=out, op=tok, data=x)
        return out
    if len(args) != 2:
        raise TypeError(f"nl.{tok.name} takes one or two operands")
    y = args[1]
    if isinstance(y, NkiTensor):
        if y.shape != x.shape:
            raise NkiValidationError(
                f"nl.{tok.name}: operands must have the same shape (got {x.shape} and {y.shape})"
            )
        isa.tensor_tensor(dst=out, data1=x, data2=y, op=tok)
    else:
        isa.tensor_scalar(dst=out, data=x, op0=tok, operand0=y)
    return out


def load(src: NkiTensor, dtype: Any = None) -> NkiTensor:
    """A new SBUF tile holding an HBM view (cast through fp32 when `dtype` differs)."""
    from mxcli.nkisim.nki import isa

    out = _new_like(src, dtype)
    isa.dma_copy(dst=out, src=src)
    return out


def store(dst: NkiTensor, value: NkiTensor) -> None:
    """HBM <- SBUF tile (PSUM values need a tensor_copy first)."""
    from mxcli.nkisim.nki import isa

    isa.dma_copy(dst=dst, src=value)


def copy(x: NkiTensor, dtype: Any = None) -> NkiTensor:
    """A new SBUF copy of an SBUF/PSUM tile (Vector tensor_copy; bit-exact for equal dtypes)."""
    from mxcli.nkisim.nki import isa

    out = _new_like(x, dtype)
    isa.tensor_copy(dst=out, src=x)
    return out


# the op tokens' high-level call (``nl.add(x, y)``) is this module's, handed down (ops.py)
OpToken.high_level_call = call_token
