"""FP8 element codecs (E4M3FN, E5M2) and E8M0 scale bytes.

Codes are plain ``uint8`` tensors: the byte layout is the contract (prefill spec §3.4, bwd spec
§5.1), so every codec here maps values to bytes and bytes to float32 values, nothing else.
"""

from __future__ import annotations

import enum
from typing import Any

import numpy as np
import torch

from mxcli.io.kwargs import coerce_enum


class ElemFormat(str, enum.Enum):
    """FP8 element format of an MX block.

    - ``E4M3FN``: 1 sign, 4 exponent bits (bias 7), 3 mantissa bits, no infinities;
      max finite 448 (0x7E), NaN 0x7F/0xFF, smallest subnormal 2^-9. Emax = 8.
    - ``E5M2``: 1 sign, 5 exponent bits (bias 15), 2 mantissa bits, IEEE-like with
      infinities; max finite 57344 (0x7B), smallest subnormal 2^-16. Emax = 15.
    """

    E4M3FN = "e4m3fn"
    E5M2 = "e5m2"

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn if self is ElemFormat.E4M3FN else torch.float8_e5m2

    @property
    def max_finite(self) -> float:
        return 448.0 if self is ElemFormat.E4M3FN else 57344.0

    @property
    def emax(self) -> int:
        """Exponent of the largest power of two the format represents (8 or 15)."""
        return 8 if self is ElemFormat.E4M3FN else 15

    @property
    def nan_code(self) -> int:
        """Positive NaN code written for NaN input (the sign bit is kept)."""
        return 0x7F


# Other names of the two formats: the torch dtypes and the NKI x4 dtype names
# (``float8_e4m3fn_x4``, the prefill's ``qmx_output_dtype``).
FP8_ALIASES: dict[Any, ElemFormat] = {
    torch.float8_e4m3fn: ElemFormat.E4M3FN,
    torch.float8_e5m2: ElemFormat.E5M2,
    **{f"{p}e4m3fn{s}": ElemFormat.E4M3FN for p in ("", "float8_") for s in ("", "_x4")},
    **{f"{p}e5m2{s}": ElemFormat.E5M2 for p in ("", "float8_") for s in ("", "_x4")},
}


def as_elem_format(
    elem: Any,
    name: str = "elem",
    *,
    error: type[Exception] = ValueError,
    expected: str = "'e4m3fn' or 'e5m2'",
) -> ElemFormat:
    """The enum from itself, ``"e4m3fn"``/``"e5m2"`` (any case), the x4 dtype names or the torch
    fp8 dtypes (`coerce_enum` with `FP8_ALIASES`)."""
    return coerce_enum(ElemFormat, elem, name, aliases=FP8_ALIASES, expected=expected, error=error)


def as_tensor(x: Any) -> torch.Tensor:
    """Torch view of a tensor or numpy array (no copy where possible)."""
    if isinstance(x, torch.Tensor):
        return x
    arr = np.asarray(x)
    if arr.dtype.kind == "V" or arr.dtype.name == "bfloat16":  # ml_dtypes bfloat16
        return torch.from_numpy(arr.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(arr))


def fp8_encode(x: Any, elem: ElemFormat | str = ElemFormat.E4M3FN) -> torch.Tensor:
    """Encode values to FP8 codes (uint8, same shape).

    Rounding is round-to-nearest-even in one step from the exact input value (bf16, fp16 and
    fp32 inputs are exact in fp32; float64 is rounded to fp32 first).
    Out-of-range values and infinities saturate to ±max finite (0x7E/0xFE for E4M3FN,
    0x7B/0xFB for E5M2). NaN encodes to 0x7F with the input's sign bit (0xFF for -NaN).
    Negative values that round to zero give -0 (0x80).
    """
    fmt = as_elem_format(elem)
    t = as_tensor(x)
    if t.dtype == torch.float64:
        t = t.to(torch.float32)
    if not t.is_floating_point():
        raise TypeError(f"fp8_encode: expected a floating tensor, got {t.dtype}")
    m = fmt.max_finite
    codes = t.clamp(-m, m).to(fmt.torch_dtype).view(torch.uint8)
    nan = torch.isnan(t)
    if bool(nan.any()):
        sign = torch.signbit(t).to(torch.uint8) << 7
        codes = torch.where(nan, sign | fmt.nan_code, codes)
    return codes


def fp8_decode(codes: Any, elem: ElemFormat | str = ElemFormat.E4M3FN) -> torch.Tensor:
    """Decode FP8 codes (uint8) to float32 values (exact). E4M3FN 0x7F/0xFF decode to NaN."""
    fmt = as_elem_format(elem)
    c = as_tensor(codes)
    if c.dtype != torch.uint8:
        raise TypeError(f"fp8_decode: expected uint8 codes, got {c.dtype}")
    return c.view(fmt.torch_dtype).to(torch.float32)


def e8m0_decode(scales: Any) -> torch.Tensor:
    """Decode E8M0 scale bytes (bias 127) to float32: ``2 ** (byte - 127)``; 255 is NaN.

    Byte 0 decodes to 2^-127, a float32 subnormal, exactly.
    """
    s = as_tensor(scales)
    if s.dtype != torch.uint8:
        raise TypeError(f"e8m0_decode: expected uint8 scale bytes, got {s.dtype}")
    out = torch.pow(2.0, s.to(torch.float32) - 127.0)
    return torch.where(s == 255, torch.full_like(out, float("nan")), out)


def e8m0_encode_exponent(exponent: Any) -> torch.Tensor:
    """Scale byte of the power of two ``2 ** exponent``: ``clamp(exponent + 127, 0, 254)``."""
    e = as_tensor(exponent).to(torch.int32)
    return (e + 127).clamp(0, 254).to(torch.uint8)


def exponent_field(x: Any) -> torch.Tensor:
    """Biased fp32 exponent field ``(bits >> 23) & 0xFF`` of each value, as int32.

    bf16 shares fp32's exponent field; fp16 is widened to fp32 first (exact), so fp16
    subnormals get their true fp32 exponent (prefill spec §3.4).
    """
    t = as_tensor(x)
    if t.dtype == torch.bfloat16:
        return ((t.view(torch.int16) & 0x7FFF) >> 7).to(torch.int32)
    if t.dtype in (torch.float16, torch.float64):
        t = t.to(torch.float32)
    if t.dtype != torch.float32:
        raise TypeError(f"exponent_field: expected a floating tensor, got {t.dtype}")
    return (t.view(torch.int32) >> 23) & 0xFF
