"""``nki.isa`` enums with the exact member values of the 0.6 stub (api spec §5.1)."""

from __future__ import annotations

import enum
import warnings
from typing import Any, TypeVar

from mxcli.nkisim.target import nc_version

__all__ = [
    "engine",
    "reduce_cmd",
    "dge_mode",
    "oob_mode",
    "matmul_perf_mode",
    "dma_engine",
    "nc_version",
    "as_enum",
]


class engine(enum.Enum):  # noqa: N801 - NKI's spelling
    unknown = 0
    tensor = 1
    scalar = 2
    gpsimd = 3
    dma = 4
    vector = 5
    sync = 6


class reduce_cmd(enum.Enum):  # noqa: N801
    idle = 0
    reset = 1
    reduce = 2
    reset_reduce = 3
    load_reduce = 4


class dge_mode(enum.Enum):  # noqa: N801
    unknown = 0
    swdge = 1
    hwdge = 2
    none = 3


class oob_mode(enum.Enum):  # noqa: N801
    error = 0
    skip = 1


class matmul_perf_mode(enum.Enum):  # noqa: N801
    none = "none"
    double_row = "double_row"


class dma_engine(enum.Enum):  # noqa: N801
    dma = 1
    gpsimd_dma = 2


E = TypeVar("E", bound=enum.Enum)


def as_enum(value: Any, cls: type[E], op: str, name: str) -> E:
    """Accept a member of `cls`; a raw int is accepted with a warning (api spec §5.1: rejected
    since 0.3, but one 2.32 nki-library file still passes ``dge_mode=0``)."""
    if isinstance(value, cls):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        try:
            member = cls(value)
        except ValueError:
            pass
        else:
            warnings.warn(
                f"{op}: {name}={value!r} is a raw int; pass {cls.__name__}.{member.name} "
                "(raw ints are rejected by NKI >= 0.3)",
                stacklevel=3,
            )
            return member
    raise TypeError(f"{op}: {name} must be a nki.isa.{cls.__name__} member, got {value!r}")
