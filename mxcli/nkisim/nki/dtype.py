"""``nki.dtype`` (undocumented in the 0.6 stubs, imported by kernels as
``from nki.dtype import float8_e4m3fn_x4``): the same dtype objects as ``nki.language``
(api spec §1, §12.1)."""

from __future__ import annotations

from mxcli.nkisim.dtypes import (
    DType,
    bfloat16,
    bool_,
    float4_e2m1fn_x4,
    float8_e4m3,
    float8_e4m3fn,
    float8_e4m3fn_x4,
    float8_e5m2,
    float8_e5m2_x4,
    float8_e8m0fnu,
    float16,
    float32,
    int8,
    int16,
    int32,
    tfloat32,
    uint8,
    uint16,
    uint32,
)

__all__ = [
    "DType",
    "bfloat16",
    "bool_",
    "float4_e2m1fn_x4",
    "float8_e4m3",
    "float8_e4m3fn",
    "float8_e4m3fn_x4",
    "float8_e5m2",
    "float8_e5m2_x4",
    "float8_e8m0fnu",
    "float16",
    "float32",
    "int8",
    "int16",
    "int32",
    "tfloat32",
    "uint8",
    "uint16",
    "uint32",
]
