"""Fused MX group kernels (numba): one pass per group computes the group's largest magnitude,
its E8M0 scale byte and the fp8 codes or fake-quantized values.

Optional (``pip install mxcli[fast]``): `mxcli.mx.quantize` uses these kernels when numba is
installed and falls back to its pure-torch path otherwise. Both give identical bytes
(tests/mx/test_fused.py checks every bf16 pattern, both schemes, both rules, both formats).
Each group is one explicit SIMD step written in LLVM IR (`mxcli.mx._simd`, which also states
the rounding rules copied from torch's casts).

Compiled lazily on the first call and cached on disk (`mxcli.jit.njit_cached`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from mxcli.jit import njit_cached
from mxcli.mx import _simd as simd

GROUP = simd.GROUP
# Rows per parallel work item: about this many elements so each item amortizes its dispatch.
_ITEM_ELEMS = 1 << 16


def _group_intrinsic(lanes: int, e5m2: bool) -> Callable[..., Any]:
    """Intrinsic ``byte = f(x, start, stride, out, offset, maxval, nan_pos, nan_neg)``: quantize
    one group of 32 elements of the row `x` (bf16 as uint16, or fp32; contiguous) and return
    its scale byte.

    The group is `lanes` runs of ``32 // lanes`` contiguous elements starting at ``start``,
    ``start + stride``, ... (1x32: one run; wrapX, bwd spec §5.3: 4 lanes of 8 physical rows).
    `out` (same length as `x`) receives at the same positions either the fp8 codes (uint8) or
    the fake-quantized fp32 values ``decode(code) * X``.
    """
    n = GROUP // lanes

    def typer(typingctx, x, start, stride, out, offset, maxval, nan_pos, nan_neg):  # type: ignore[no-untyped-def]
        if x.layout != "C" or out.layout != "C":
            return None
        sig = types.uint8(x, start, stride, out, offset, maxval, nan_pos, nan_neg)

        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            xty, _, _, outty = signature.args[:4]
            x_arr = context.make_array(xty)(context, builder, args[0])
            o_arr = context.make_array(outty)(context, builder, args[3])
            start_v, stride_v = args[1], args[2]
            offset_v, maxval_v, nan_pos_v, nan_neg_v = args[4:]
            bf16 = xty.dtype == types.uint16
            idx = [
                builder.add(start_v, builder.mul(stride_v, ir.Constant(start_v.type, lane)))
                for lane in range(lanes)
            ]
            values = [
                simd.load_fp32(builder, cgutils.gep(builder, x_arr.data, i), n, bf16) for i in idx
            ]
            gs = simd.GroupScale(builder, values, offset_v)
            for i, value in zip(idx, values, strict=True):
                v = simd.scale_to_fp8_range(builder, value, gs, e5m2, maxval_v)
                out_ptr = cgutils.gep(builder, o_arr.data, i)
                if outty.dtype == types.float32:
                    r = simd.round_fp8(builder, v, n, e5m2, nan_pos_v, nan_neg_v)
                    simd.store(
                        builder, builder.fmul(r, simd.broadcast(builder, gs.scale, n)), out_ptr
                    )
                else:
                    simd.store(builder, simd.encode_fp8(builder, v, n, e5m2), out_ptr)
            return builder.trunc(gs.byte, simd.I8)

        return sig, codegen

    return intrinsic(typer)


_q_1x32_e4m3 = _group_intrinsic(1, e5m2=False)
_q_1x32_e5m2 = _group_intrinsic(1, e5m2=True)
_q_wrap_e4m3 = _group_intrinsic(4, e5m2=False)
_q_wrap_e5m2 = _group_intrinsic(4, e5m2=True)


@njit(inline="always")
def _row(xr, out, sr, seg_k0, seg_c, seg_wrapped, offset, e5m2, maxval, nan_pos, nan_neg):  # type: ignore[no-untyped-def]
    """Quantize one row: every segment's groups in order, scale bytes into `sr`."""
    g0 = 0
    for s in range(seg_k0.shape[0]):
        k0 = seg_k0[s]
        c = seg_c[s]
        ng = c // GROUP
        if seg_wrapped[s]:
            # bwd spec §5.3: chunk = [lane j, physical row p], v = c/4 rows; group g holds
            # rows 8g..8g+7 of the 4 lanes
            v = c // 4
            for g in range(ng):
                if e5m2:
                    b = _q_wrap_e5m2(xr, k0 + 8 * g, v, out, offset, maxval, nan_pos, nan_neg)
                else:
                    b = _q_wrap_e4m3(xr, k0 + 8 * g, v, out, offset, maxval, nan_pos, nan_neg)
                sr[g0 + g] = b
        else:
            for g in range(ng):
                if e5m2:
                    b = _q_1x32_e5m2(xr, k0 + GROUP * g, 0, out, offset, maxval, nan_pos, nan_neg)
                else:
                    b = _q_1x32_e4m3(xr, k0 + GROUP * g, 0, out, offset, maxval, nan_pos, nan_neg)
                sr[g0 + g] = b
        g0 += ng


@njit_cached(parallel=True)
def quantize_rows(
    x,
    seg_k0,
    seg_c,
    seg_wrapped,
    offset,
    e5m2,
    maxval,
    nan_pos,
    nan_neg,
    codes,
    scales,
    deq,
    want_deq,
):  # type: ignore[no-untyped-def]
    """Quantize every row of ``x [R, K]`` (bf16 as uint16, or fp32) along its last axis.

    Segments ``(k0, c, wrapped)`` cover ``[0, K)`` in group order (`quantize._segments`).
    Writes ``scales [R, K/32]`` and either ``codes [R, K]`` (uint8) or, with `want_deq`,
    ``deq [R, K]`` (fp32, ``decode(code) * 2^(byte - 127)``).
    """
    R, K = x.shape
    rows_per_item = max(1, _ITEM_ELEMS // K)
    n_items = (R + rows_per_item - 1) // rows_per_item
    for item in prange(n_items):
        for r in range(item * rows_per_item, min(R, (item + 1) * rows_per_item)):
            if want_deq:
                _row(
                    x[r],
                    deq[r],
                    scales[r],
                    seg_k0,
                    seg_c,
                    seg_wrapped,
                    offset,
                    e5m2,
                    maxval,
                    nan_pos,
                    nan_neg,
                )
            else:
                _row(
                    x[r],
                    codes[r],
                    scales[r],
                    seg_k0,
                    seg_c,
                    seg_wrapped,
                    offset,
                    e5m2,
                    maxval,
                    nan_pos,
                    nan_neg,
                )


# The same loop compiled without `parallel`: with one thread it runs no OpenMP region, so no
# pool thread is left spinning after it (measured in prep-weights on 2 cores: the spinning
# thread took 2.7 s of CPU per 1.2 GB layer from the writer thread that shares the other core).
quantize_rows_serial = njit_cached()(quantize_rows.py_func)


def enabled() -> bool:
    """Whether `mxcli.mx.quantize` should use these kernels (``MXCLI_FUSED=0`` turns them off)."""
    return os.environ.get("MXCLI_FUSED", "1") != "0"


_LUTS: dict[torch.dtype, np.ndarray] = {}


def _lut(fp8: torch.dtype) -> np.ndarray:
    if fp8 not in _LUTS:
        _LUTS[fp8] = torch.arange(256, dtype=torch.uint8).view(fp8).to(torch.float32).numpy()
    return _LUTS[fp8]


def match_torch_threads() -> None:
    """Run numba's parallel loops on as many threads as torch's intra-op pool (capped by numba's
    pool size), so ``torch.set_num_threads`` governs both."""
    import numba

    n = min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)  # type: ignore[attr-defined]
    if numba.get_num_threads() != n:
        numba.set_num_threads(n)


_BF16_NAN: dict[str, int] = {}


def torch_bf16_nan_bits() -> int | None:
    """The bf16 pattern torch's CPU fp32 -> bf16 copy writes for every NaN (0xFFFF with ATen's
    AVX2/AVX-512 kernels, 0x7FC0 with ``ATEN_CPU_CAPABILITY=default``), probed once per CPU
    capability; None when it keeps information (a sign or payload, or differs with the length):
    then no fused kernel that rounds to bf16 applies."""
    cap = torch.backends.cpu.get_cpu_capability()
    if cap not in _BF16_NAN:
        nans = torch.tensor([0x7FC00000, -0x400000, 0x7F800001, -0x7FFFFF], dtype=torch.int32)
        patterns = set()
        for length in (1, 7, 64, 1000):
            src = nans.repeat(length).view(torch.float32)
            dst = torch.empty(src.shape, dtype=torch.bfloat16)
            dst.copy_(src)
            patterns.update((dst.view(torch.int16).to(torch.int32) & 0xFFFF).tolist())
        _BF16_NAN[cap] = patterns.pop() if len(patterns) == 1 else -1
    return None if _BF16_NAN[cap] < 0 else _BF16_NAN[cap]


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
    serial = torch.get_num_threads() == 1  # then numba's thread pool is never started
    if not serial:
        match_torch_threads()
    xn = x.view(torch.int16).numpy().view(np.uint16) if x.dtype == torch.bfloat16 else x.numpy()
    lut = _lut(fp8)
    seg = np.asarray(segments, dtype=np.int64).reshape(-1, 3)
    dummy_u8 = np.empty((1, 1), dtype=np.uint8)
    dummy_f32 = np.empty((1, 1), dtype=np.float32)
    kernel = quantize_rows_serial if serial else quantize_rows
    kernel(
        xn,
        np.ascontiguousarray(seg[:, 0]),
        np.ascontiguousarray(seg[:, 1]),
        np.ascontiguousarray(seg[:, 2]),
        np.int32(offset),
        fp8 == torch.float8_e5m2,
        np.float32(maxval),
        lut[0x7F],
        lut[0xFF],
        dummy_u8 if codes is None else codes.numpy(),
        scales.numpy(),
        dummy_f32 if deq is None else deq.numpy(),
        deq is not None,
    )


@njit_cached(nogil=True)
def _x4_rows(codes, order, out):  # type: ignore[no-untyped-def]
    """``out[e, w, f]`` = the x4 word of bytes ``codes[e, f, order[4w + j]]``, j = 0..3 (byte j
    of a little-endian word, bwd spec §5.1), in 64 x 64 tiles of (w, f)."""
    E, F, K = codes.shape
    W = K // 4
    for e in range(E):
        for f0 in range(0, F, 64):
            f1 = min(F, f0 + 64)
            for w0 in range(0, W, 64):
                for w in range(w0, min(W, w0 + 64)):
                    k0 = order[4 * w]
                    k1 = order[4 * w + 1]
                    k2 = order[4 * w + 2]
                    k3 = order[4 * w + 3]
                    for f in range(f0, f1):
                        out[e, w, f] = (
                            np.uint32(codes[e, f, k0])
                            | (np.uint32(codes[e, f, k1]) << 8)
                            | (np.uint32(codes[e, f, k2]) << 16)
                            | (np.uint32(codes[e, f, k3]) << 24)
                        )


@njit_cached(nogil=True)
def _scale_rows(compact, rows, out):  # type: ignore[no-untyped-def]
    """``out[e, rows[g], f] = compact[e, f, g]`` (rows not named stay as they are)."""
    E, F, G = compact.shape
    for e in range(E):
        for f0 in range(0, F, 256):
            f1 = min(F, f0 + 256)
            for g in range(G):
                r = rows[g]
                for f in range(f0, f1):
                    out[e, r, f] = compact[e, f, g]


def x4_transposed(
    codes: torch.Tensor, order: torch.Tensor, compact: torch.Tensor, rows: torch.Tensor, n_rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes ``[E, F, K]`` (natural K order) -> x4 words ``[E, K/4, F]`` in the physical order
    `order` (`group_order`), and compact scales ``[E, F, K/32]`` -> ``[E, n_rows, F]`` with group g
    at row ``rows[g]`` (zeros elsewhere): one pass each, where the torch path permutes, packs
    and transposes in three (`mxcli.kernels.blockwise_moe.prequant.quantize_weight_x4`)."""
    E, F, K = codes.shape
    x4 = torch.empty(E, K // 4, F, dtype=torch.uint32)
    _x4_rows(
        codes.contiguous().numpy(),
        order.to(torch.int64).numpy(),
        x4.view(torch.int32).numpy().view(np.uint32),
    )
    scales = torch.zeros(E, n_rows, F, dtype=torch.uint8)
    _scale_rows(compact.contiguous().numpy(), rows.to(torch.int64).numpy(), scales.numpy())
    return x4, scales
