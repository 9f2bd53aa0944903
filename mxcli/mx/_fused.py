"""Fused MX group kernels (numba): one pass per group computes the group's largest magnitude,
its E8M0 scale byte and the fp8 codes or fake-quantized values.

Optional (``pip install mxcli[fast]``): `mxcli.mx.quantize` uses these kernels when numba is
installed and falls back to its pure-torch path otherwise. Both give identical bytes
(tests/mx/test_fused.py checks every bf16 pattern, both schemes, both rules, both formats).
The element rounding copies torch's CPU casts bit for bit, as measured on torch 2.13:

- fp32 -> E4M3FN: round to nearest even, saturating (|v| >= 448 and ±Inf give ±448), NaN -> 0x7F
  with the sign bit;
- fp32 -> E5M2: round to nearest even, overflow to ±Inf (callers clamp first), NaN -> 0x7F.

Compiled lazily on the first call and cached on disk (``cache=True``).
"""

from __future__ import annotations

import os

import numpy as np
import torch
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic, overload

GROUP = 32
# Rows per parallel work item: about this many elements so each item amortizes its buffers.
_ITEM_ELEMS = 1 << 16


@intrinsic
def _f32_to_bits(typingctx, x):  # type: ignore[no-untyped-def]
    sig = types.uint32(types.float32)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.bitcast(args[0], ir.IntType(32))

    return sig, codegen


@intrinsic
def _bits_to_f32(typingctx, x):  # type: ignore[no-untyped-def]
    sig = types.float32(types.uint32)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen


def _load_bits(v):  # type: ignore[no-untyped-def]
    """fp32 bit pattern of one input element (bf16 arrives as its uint16 pattern)."""


@overload(_load_bits, inline="always")
def _load_bits_impl(v):  # type: ignore[no-untyped-def]
    if isinstance(v, types.Integer):
        return lambda v: np.uint32(v) << np.uint32(16)
    return lambda v: _f32_to_bits(v)


@njit(inline="always")
def _encode_e4m3fn(v):  # type: ignore[no-untyped-def]
    bits = _f32_to_bits(v)
    sign = np.uint8((bits >> np.uint32(24)) & np.uint32(0x80))
    a = bits & np.uint32(0x7FFFFFFF)
    # subnormal range |v| < 2^-6: the code is |v| / 2^-9 rounded to nearest even (8 = 2^-6)
    sub = np.uint32(np.rint(_bits_to_f32(a) * np.float32(512.0)))
    # normal range: round the 23-bit mantissa to 3 bits (nearest even), rebias 127 -> 7
    odd = (a >> np.uint32(20)) & np.uint32(1)
    nrm = (a + np.uint32(0x7FFFF) + odd - np.uint32(120 << 23)) >> np.uint32(20)
    code = sub if a < np.uint32(121 << 23) else nrm
    code = np.uint32(0x7E) if a >= np.uint32(0x43E00000) else code  # saturate at 448
    code = np.uint32(0x7F) if a > np.uint32(0x7F800000) else code  # NaN
    return np.uint8(code) | sign


@njit(inline="always")
def _round_e4m3fn(v, nan_pos, nan_neg):  # type: ignore[no-untyped-def]
    """The fp32 value of ``_encode_e4m3fn(v)`` without going through the code (same rounding,
    saturation and NaNs; `nan_pos`/`nan_neg` are the decoded NaN codes 0x7F/0xFF)."""
    bits = _f32_to_bits(v)
    sign = bits & np.uint32(0x80000000)
    a = bits & np.uint32(0x7FFFFFFF)
    odd = (a >> np.uint32(20)) & np.uint32(1)
    nrm = min((a + np.uint32(0x7FFFF) + odd) & np.uint32(0xFFF00000), np.uint32(0x43E00000))
    sub = _f32_to_bits(np.rint(_bits_to_f32(a) * np.float32(512.0)) * np.float32(1.0 / 512.0))
    r = _bits_to_f32((sub if a < np.uint32(121 << 23) else nrm) | sign)
    if a > np.uint32(0x7F800000):
        r = nan_neg if sign else nan_pos
    return r


@njit(inline="always")
def _encode_e5m2(v):  # type: ignore[no-untyped-def]
    bits = _f32_to_bits(v)
    sign = np.uint8((bits >> np.uint32(24)) & np.uint32(0x80))
    a = bits & np.uint32(0x7FFFFFFF)
    # subnormal range |v| < 2^-14: the code is |v| / 2^-16 rounded to nearest even
    sub = np.uint32(np.rint(_bits_to_f32(a) * np.float32(65536.0)))
    odd = (a >> np.uint32(21)) & np.uint32(1)
    nrm = (a + np.uint32(0xFFFFF) + odd - np.uint32(112 << 23)) >> np.uint32(21)
    code = sub if a < np.uint32(113 << 23) else nrm
    code = np.uint32(0x7C) if a >= np.uint32(143 << 23) else code  # >= 2^16: Inf
    code = np.uint32(0x7F) if a > np.uint32(0x7F800000) else code  # NaN
    return np.uint8(code) | sign


@njit(inline="always")
def _codes_run(xr, base, n, inv_el, e5m2, maxval, cr):  # type: ignore[no-untyped-def]
    """``cr[base + i] = code(xr[base + i] * inv_el[i])`` for i < n; the format is chosen once
    per run so the element loop is branch-free and vectorizes."""
    # slices indexed by a range variable: numba's negative-index wraparound would otherwise turn
    # every load into a gather
    xs = xr[base : base + n]
    cs = cr[base : base + n]
    if e5m2:
        for i in range(n):
            v = _bits_to_f32(_load_bits(xs[i])) * inv_el[i]
            v = maxval if v > maxval else v  # the torch path clamps to ±max first
            v = -maxval if v < -maxval else v
            cs[i] = _encode_e5m2(v)
    else:
        for i in range(n):
            cs[i] = _encode_e4m3fn(_bits_to_f32(_load_bits(xs[i])) * inv_el[i])


@njit(inline="always")
def _deq_run(xr, base, n, inv_el, sc_el, e5m2, maxval, lut, dr):  # type: ignore[no-untyped-def]
    """``dr[base + i] = lut[code(xr[base + i] * inv_el[i])] * sc_el[i]`` for i < n."""
    xs = xr[base : base + n]
    ds = dr[base : base + n]
    if e5m2:
        for i in range(n):
            v = _bits_to_f32(_load_bits(xs[i])) * inv_el[i]
            v = maxval if v > maxval else v
            v = -maxval if v < -maxval else v
            ds[i] = lut[_encode_e5m2(v)] * sc_el[i]
    else:
        nan_pos, nan_neg = lut[0x7F], lut[0xFF]
        for i in range(n):
            v = _bits_to_f32(_load_bits(xs[i])) * inv_el[i]
            ds[i] = _round_e4m3fn(v, nan_pos, nan_neg) * sc_el[i]


@njit(parallel=True, cache=True)
def quantize_rows(
    x, seg_k0, seg_c, seg_wrapped, offset, e5m2, maxval, lut, codes, scales, deq, want_deq
):  # type: ignore[no-untyped-def]
    """Quantize every row of ``x [R, K]`` (bf16 as uint16, or fp32) along its last axis.

    Segments ``(k0, c, wrapped)`` cover ``[0, K)`` in group order (`quantize._segments`).
    Writes ``scales [R, K/32]`` and either ``codes [R, K]`` (uint8) or, with `want_deq`,
    ``deq [R, K]`` (fp32, ``lut[code] * 2^(byte - 127)``).
    """
    R, K = x.shape
    rows_per_item = max(1, _ITEM_ELEMS // K)
    n_items = (R + rows_per_item - 1) // rows_per_item
    for item in prange(n_items):
        rowmax = np.empty(K // 4, dtype=np.uint32)
        inv_el = np.empty(K, dtype=np.float32)  # per-element 1/X of the current segment
        sc_el = np.empty(K, dtype=np.float32)  # per-element X (fake quantization)
        r_end = min(R, (item + 1) * rows_per_item)
        for r in range(item * rows_per_item, r_end):
            xr = x[r]
            g0 = 0
            for s in range(seg_k0.shape[0]):
                k0 = seg_k0[s]
                c = seg_c[s]
                ng = c // GROUP
                if seg_wrapped[s]:
                    # bwd spec §5.3: a chunk is [lane j, physical row p] with v = c/4 rows;
                    # a group is 8 consecutive rows x 4 lanes
                    v = c // 4
                    lanes = xr[k0 : k0 + c]
                    for p in range(v):
                        rowmax[p] = _load_bits(lanes[p]) & np.uint32(0x7FFFFFFF)
                    for j in range(1, 4):
                        lane = lanes[j * v : j * v + v]
                        for p in range(v):
                            b = _load_bits(lane[p]) & np.uint32(0x7FFFFFFF)
                            rowmax[p] = max(rowmax[p], b)
                    for g in range(ng):
                        m = rowmax[8 * g]
                        for i in range(1, 8):
                            m = max(m, rowmax[8 * g + i])
                        byte = min(255, max(0, np.int32(m >> np.uint32(23)) - offset))
                        scales[r, g0 + g] = np.uint8(byte)
                        inv = _bits_to_f32(np.uint32(254 - byte) << np.uint32(23))
                        sc = _bits_to_f32(
                            np.uint32(1 << 22) if byte == 0 else np.uint32(byte) << np.uint32(23)
                        )
                        inv_el[8 * g : 8 * g + 8] = inv
                        if want_deq:
                            sc_el[8 * g : 8 * g + 8] = sc
                    for j in range(4):
                        if want_deq:
                            _deq_run(xr, k0 + j * v, v, inv_el, sc_el, e5m2, maxval, lut, deq[r])
                        else:
                            _codes_run(xr, k0 + j * v, v, inv_el, e5m2, maxval, codes[r])
                else:
                    # amax and scale of every group first, then one flat (vectorizable) pass
                    xseg = xr[k0 : k0 + c]
                    for g in range(ng):
                        xg = xseg[GROUP * g : GROUP * g + GROUP]
                        m = np.uint32(0)
                        for i in range(GROUP):
                            m = max(m, _load_bits(xg[i]) & np.uint32(0x7FFFFFFF))
                        byte = min(255, max(0, np.int32(m >> np.uint32(23)) - offset))
                        scales[r, g0 + g] = np.uint8(byte)
                        inv = _bits_to_f32(np.uint32(254 - byte) << np.uint32(23))
                        sc = _bits_to_f32(
                            np.uint32(1 << 22) if byte == 0 else np.uint32(byte) << np.uint32(23)
                        )
                        inv_el[GROUP * g : GROUP * g + GROUP] = inv
                        if want_deq:
                            sc_el[GROUP * g : GROUP * g + GROUP] = sc
                    if want_deq:
                        _deq_run(xr, k0, c, inv_el, sc_el, e5m2, maxval, lut, deq[r])
                    else:
                        _codes_run(xr, k0, c, inv_el, e5m2, maxval, codes[r])
                g0 += ng


def enabled() -> bool:
    """Whether `mxcli.mx.quantize` should use these kernels (``MXCLI_FUSED=0`` turns them off)."""
    return os.environ.get("MXCLI_FUSED", "1") != "0"


_LUTS: dict[torch.dtype, np.ndarray] = {}


def _lut(fp8: torch.dtype) -> np.ndarray:
    if fp8 not in _LUTS:
        _LUTS[fp8] = torch.arange(256, dtype=torch.uint8).view(fp8).to(torch.float32).numpy()
    return _LUTS[fp8]


def quantize_2d(
    x: torch.Tensor,
    segments: list[tuple[int, int, bool]],
    offset: int,
    fp8: torch.dtype,
    maxval: float,
    codes: torch.Tensor | None,
    scales: torch.Tensor,
    deq: torch.Tensor | None,
) -> None:
    """Run `quantize_rows` on a contiguous CPU ``x [R, K]`` (bf16 or fp32) into the outputs."""
    import numba

    n = min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)  # type: ignore[attr-defined]
    if numba.get_num_threads() != n:
        numba.set_num_threads(n)
    xn = x.view(torch.int16).numpy().view(np.uint16) if x.dtype == torch.bfloat16 else x.numpy()
    seg = np.asarray(segments, dtype=np.int64).reshape(-1, 3)
    dummy_u8 = np.empty((1, 1), dtype=np.uint8)
    dummy_f32 = np.empty((1, 1), dtype=np.float32)
    quantize_rows(
        xn,
        np.ascontiguousarray(seg[:, 0]),
        np.ascontiguousarray(seg[:, 1]),
        np.ascontiguousarray(seg[:, 2]),
        np.int32(offset),
        fp8 == torch.float8_e5m2,
        np.float32(maxval),
        _lut(fp8),
        dummy_u8 if codes is None else codes.numpy(),
        scales.numpy(),
        dummy_f32 if deq is None else deq.numpy(),
        deq is not None,
    )
