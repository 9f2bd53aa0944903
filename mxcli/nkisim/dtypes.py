"""NKI dtype objects and the fp32 conversion helpers every instruction uses (api spec §2.4).

Each NKI dtype maps to a NumPy *storage* dtype (the raw element as it sits in memory):
x4 packed types are raw unsigned words, bf16/fp8/e8m0 are ml_dtypes types. Arithmetic always
goes through float32 (`to_fp32` / `from_fp32`); equal-dtype copies never do (bit-exact).
"""

from __future__ import annotations

import enum
from typing import Any

import ml_dtypes
import numpy as np

__all__ = [
    "DType",
    "FloatToIntRule",
    "ALL_DTYPES",
    "as_dtype",
    "from_fp32",
    "to_fp32",
    "dtype_of_numpy",
    "sentinel_fill",
]


class DType:
    """One NKI dtype. ``str(dt)`` is the canonical name (nki-library's ``sizeinbytes`` relies on it).

    api spec §12.3 decision: a dtype equals itself and its canonical name string (the stub
    declares ``DType = str``), nothing else; it hashes like its name.
    """

    __slots__ = ("name", "itemsize", "np_dtype", "kind", "fp8_elem")

    def __init__(
        self, name: str, itemsize: int, np_dtype: Any, kind: str, fp8_elem: str | None = None
    ) -> None:
        self.name = name
        self.itemsize = itemsize
        self.np_dtype = np.dtype(np_dtype)
        # kind: "float" | "int" | "uint" | "bool" | "x4" | "e8m0"
        self.kind = kind
        # element format of the packed values of an x4 dtype ("e4m3fn", "e5m2", "e2m1fn")
        self.fp8_elem = fp8_elem

    def __repr__(self) -> str:
        return f"nl.{self.name}"

    def __str__(self) -> str:
        return self.name

    def __eq__(self, other: object) -> bool:
        if isinstance(other, DType):
            return other is self
        if isinstance(other, str):
            return other == self.name
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.name)

    @property
    def is_float(self) -> bool:
        return self.kind in ("float", "e8m0")

    @property
    def is_int(self) -> bool:
        return self.kind in ("int", "uint", "bool")

    @property
    def is_x4(self) -> bool:
        return self.kind == "x4"

    @property
    def is_fp8(self) -> bool:
        return self.name.startswith("float8_") and self.kind == "float"


bool_ = DType("bool_", 1, np.uint8, "bool")
int8 = DType("int8", 1, np.int8, "int")
int16 = DType("int16", 2, np.int16, "int")
int32 = DType("int32", 4, np.int32, "int")
uint8 = DType("uint8", 1, np.uint8, "uint")
uint16 = DType("uint16", 2, np.uint16, "uint")
uint32 = DType("uint32", 4, np.uint32, "uint")
float16 = DType("float16", 2, np.float16, "float")
float32 = DType("float32", 4, np.float32, "float")
bfloat16 = DType("bfloat16", 2, ml_dtypes.bfloat16, "float")
# tf32 lives in a 32-bit container; values are fp32 with the mantissa rounded to 10 bits.
tfloat32 = DType("tfloat32", 4, np.float32, "float")
# api spec §12.24 decision: legacy float8_e4m3 is the IEEE-style ml_dtypes.float8_e4m3 (max 240).
float8_e4m3 = DType("float8_e4m3", 1, ml_dtypes.float8_e4m3, "float")
float8_e4m3fn = DType("float8_e4m3fn", 1, ml_dtypes.float8_e4m3fn, "float")
float8_e5m2 = DType("float8_e5m2", 1, ml_dtypes.float8_e5m2, "float")
float8_e8m0fnu = DType("float8_e8m0fnu", 1, ml_dtypes.float8_e8m0fnu, "e8m0")
float8_e4m3fn_x4 = DType("float8_e4m3fn_x4", 4, np.uint32, "x4", "e4m3fn")
float8_e5m2_x4 = DType("float8_e5m2_x4", 4, np.uint32, "x4", "e5m2")
float4_e2m1fn_x4 = DType("float4_e2m1fn_x4", 2, np.uint16, "x4", "e2m1fn")

ALL_DTYPES: dict[str, DType] = {
    d.name: d
    for d in (
        bool_,
        int8,
        int16,
        int32,
        uint8,
        uint16,
        uint32,
        float16,
        float32,
        bfloat16,
        tfloat32,
        float8_e4m3,
        float8_e4m3fn,
        float8_e5m2,
        float8_e8m0fnu,
        float8_e4m3fn_x4,
        float8_e5m2_x4,
        float4_e2m1fn_x4,
    )
}

# NumPy dtype -> NKI dtype for arrays handed to `simulate` (and lenient dtype arguments).
_FROM_NUMPY: dict[np.dtype, DType] = {
    np.dtype(np.bool_): bool_,
    np.dtype(np.int8): int8,
    np.dtype(np.int16): int16,
    np.dtype(np.int32): int32,
    np.dtype(np.uint8): uint8,
    np.dtype(np.uint16): uint16,
    np.dtype(np.uint32): uint32,
    np.dtype(np.float16): float16,
    np.dtype(np.float32): float32,
    np.dtype(ml_dtypes.bfloat16): bfloat16,
    np.dtype(ml_dtypes.float8_e4m3): float8_e4m3,
    np.dtype(ml_dtypes.float8_e4m3fn): float8_e4m3fn,
    np.dtype(ml_dtypes.float8_e5m2): float8_e5m2,
    np.dtype(ml_dtypes.float8_e8m0fnu): float8_e8m0fnu,
}


def dtype_of_numpy(dt: Any) -> DType | None:
    """The NKI dtype of a NumPy dtype, or None when NKI has no such type (64-bit types)."""
    try:
        return _FROM_NUMPY.get(np.dtype(dt))
    except TypeError:
        return None


def as_dtype(dt: Any, what: str = "dtype") -> DType:
    """Accept an NKI dtype, its canonical name, or an equivalent NumPy dtype."""
    if isinstance(dt, DType):
        return dt
    if isinstance(dt, str) and dt in ALL_DTYPES:
        return ALL_DTYPES[dt]
    found = dtype_of_numpy(dt) if not isinstance(dt, str) else None
    if found is None:
        raise TypeError(f"{what}: expected an nki dtype (nl.float32, ...), got {dt!r}")
    return found


class FloatToIntRule(enum.Enum):
    """How fp32 values are written to an integer dtype (api spec §2.4, §12.9).

    RNE_SATURATE: ``clip(rint(x), min, max)`` (round half to even, saturate: the 0.6 simulator
    rule for finite values); NaN -> 0, +inf -> max, -inf -> min (our choice for the undocumented
    non-finite cases).
    """

    RNE_SATURATE = "rne_saturate"


def _round_tf32(x: np.ndarray) -> np.ndarray:
    """fp32 -> tf32 (10 mantissa bits), round to nearest even, kept in an fp32 container."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    finite = np.isfinite(x)
    lsb = (bits >> 13) & 1
    rounded = ((bits.astype(np.uint64) + 0xFFF + lsb) & 0xFFFFE000).astype(np.uint32)
    out = np.where(finite, rounded, bits).view(np.float32)
    return out


def to_fp32(raw: np.ndarray, dt: DType) -> np.ndarray:
    """Values of raw storage elements as float32 (compute engines and DMA convert through fp32)."""
    if dt.kind == "x4":
        raise TypeError(f"{dt.name} values cannot be converted through fp32 (MX ops only)")
    return raw.astype(np.float32)


def from_fp32(x: np.ndarray, dt: DType) -> np.ndarray:
    """Round float32 values once to `dt` (RNE), returning raw storage elements.

    Overflow follows ml_dtypes (what the real simulator's precise mode inherits, api spec §2.4,
    §12.8): float8_e4m3fn -> NaN above 464, float8_e5m2 / bf16 / fp16 -> ±inf.
    Integers: round half to even, then saturate (`FloatToIntRule.RNE_SATURATE`).
    """
    x = np.asarray(x, dtype=np.float32)
    if dt.kind == "x4":
        raise TypeError(f"{dt.name} values cannot be produced through fp32 (MX ops only)")
    if dt is tfloat32:
        return _round_tf32(x)
    if dt.kind in ("int", "uint", "bool"):
        info = np.iinfo(dt.np_dtype) if dt.kind != "bool" else np.iinfo(np.uint8)
        r = np.rint(x.astype(np.float64))
        r = np.nan_to_num(r, nan=0.0, posinf=info.max, neginf=info.min)
        return np.clip(r, info.min, info.max).astype(dt.np_dtype)
    return x.astype(dt.np_dtype)


def sentinel_fill(dt: DType) -> tuple[str, Any]:
    """How a fresh allocation is filled (api spec §2.4; §12.22 for packed types).

    Floats: NaN; integers: 4 (as the real simulator); x4 packed and e8m0: all-ones bytes
    (each packed fp8 is then NaN, e8m0 255 is NaN).
    """
    if dt.kind in ("int", "uint", "bool"):
        return ("value", 4)
    if dt.kind in ("x4", "e8m0"):
        return ("byte", 0xFF)
    return ("value", np.nan)
