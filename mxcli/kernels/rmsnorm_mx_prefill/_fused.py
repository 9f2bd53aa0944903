"""Fused CPU kernels (numba) for the prefill reference's elementwise chain (prefill spec §3.2-§3.4).

The torch reference rounds three times to bf16 (``a = R(x*gamma)``, ``y = R(a*r)``) and then
quantizes ``y``; done as torch ops that is six passes over ``[tokens, H]`` plus the quantizer's.
`rms_chain` does it in one pass per 32-element group, in registers, and writes the codes and
scale bytes straight into the packed rows (and the fp32 router input ``a``, when asked).
`squares` feeds the sum of squares, which stays a torch reduction: its fp32 summation order is
torch's, and the reference's bytes must not change.

Optional like `mxcli.mx._fused` (numba; ``MXCLI_FUSED=0`` turns it off). Bit-identical to the
torch chain (tests/kernels/prefill/test_fused_chain.py), including the NaN pattern torch's
fp32 -> bf16 cast writes, which depends on its CPU kernel and is probed once
(`mxcli.mx._fused.torch_bf16_nan_bits`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from mxcli.jit import njit_cached
from mxcli.mx import _simd as simd
from mxcli.mx._fused import match_torch_threads
from mxcli.mx._fused import torch_bf16_nan_bits as bf16_nan_bits

GROUP = simd.GROUP


@intrinsic
def _square_group(typingctx, x, start, out):  # type: ignore[no-untyped-def]
    """``out[start : start + 32] = fp32(x[...])**2`` for a bf16 (uint16) row `x`."""
    if x.layout != "C" or out.layout != "C":
        return None
    sig = types.void(x, start, out)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        x_arr = context.make_array(signature.args[0])(context, builder, args[0])
        o_arr = context.make_array(signature.args[2])(context, builder, args[2])
        v = simd.load_fp32(builder, cgutils.gep(builder, x_arr.data, args[1]), GROUP, True)
        simd.store(builder, builder.fmul(v, v), cgutils.gep(builder, o_arr.data, args[1]))
        return context.get_dummy_value()

    return sig, codegen


def _chain_intrinsic(e5m2: bool, want_a: bool) -> Callable[..., Any]:
    """Intrinsic ``byte = f(x, start, gamma, r, nan_bits, offset, maxval, row, a_out)`` for one
    group of 32 of a bf16 row: ``a = R(x*gamma)``, ``y = R(a*r)`` (§3.3), MX codes of ``y`` into
    ``row[start : start + 32]`` (§3.4), ``a`` into `a_out` when `want_a`; returns the scale byte."""

    def typer(typingctx, x, start, gamma, r, nan_bits, offset, maxval, row, a_out):  # type: ignore[no-untyped-def]
        if any(arr.layout != "C" for arr in (x, gamma, row, a_out)):
            return None
        sig = types.uint8(x, start, gamma, r, nan_bits, offset, maxval, row, a_out)

        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            arrays = [
                context.make_array(signature.args[i])(context, builder, args[i])
                for i in (0, 2, 7, 8)
            ]
            x_arr, g_arr, row_arr, a_arr = arrays
            start_v, r_v, nan_v, offset_v, maxval_v = args[1], args[3], args[4], args[5], args[6]
            n = GROUP
            xv = simd.load_fp32(builder, cgutils.gep(builder, x_arr.data, start_v), n, True)
            gv = simd.load_fp32(builder, cgutils.gep(builder, g_arr.data, start_v), n, False)
            a = simd.round_bf16(builder, builder.fmul(xv, gv), n, nan_v)
            if want_a:
                simd.store(builder, a, cgutils.gep(builder, a_arr.data, start_v))
            y = simd.round_bf16(builder, builder.fmul(a, simd.broadcast(builder, r_v, n)), n, nan_v)
            gs = simd.GroupScale(builder, [y], offset_v)
            v = simd.scale_to_fp8_range(builder, y, gs, e5m2, maxval_v)
            codes = simd.encode_fp8(builder, v, n, e5m2)
            simd.store(builder, codes, cgutils.gep(builder, row_arr.data, start_v))
            return builder.trunc(gs.byte, simd.I8)

        return sig, codegen

    return intrinsic(typer)


_chain_e4m3 = _chain_intrinsic(e5m2=False, want_a=False)
_chain_e4m3_a = _chain_intrinsic(e5m2=False, want_a=True)
_chain_e5m2 = _chain_intrinsic(e5m2=True, want_a=False)
_chain_e5m2_a = _chain_intrinsic(e5m2=True, want_a=True)


@njit_cached(parallel=True)
def _squares_rows(x, out):  # type: ignore[no-untyped-def]
    n, H = x.shape
    for t in prange(n):
        xr = x[t]
        orow = out[t]
        for g in range(H // GROUP):
            _square_group(xr, g * GROUP, orow)


@njit_cached(parallel=True)
def _chain_rows(x, gamma, r, nan_bits, offset, e5m2, maxval, scale_pos, tail, rows, a_out, want_a):  # type: ignore[no-untyped-def]
    n, H = x.shape
    for t in prange(n):
        xr = x[t]
        row = rows[t]
        row[H : H + tail.shape[0]] = tail
        ar = a_out[t] if want_a else a_out[0]
        rt = r[t]
        for g in range(H // GROUP):
            k = g * GROUP
            if e5m2:
                if want_a:
                    b = _chain_e5m2_a(xr, k, gamma, rt, nan_bits, offset, maxval, row, ar)
                else:
                    b = _chain_e5m2(xr, k, gamma, rt, nan_bits, offset, maxval, row, ar)
            elif want_a:
                b = _chain_e4m3_a(xr, k, gamma, rt, nan_bits, offset, maxval, row, ar)
            else:
                b = _chain_e4m3(xr, k, gamma, rt, nan_bits, offset, maxval, row, ar)
            row[scale_pos[g]] = b


def _u16(x: torch.Tensor) -> np.ndarray:
    return x.view(torch.int16).numpy().view(np.uint16)


def squares(x: torch.Tensor, out: torch.Tensor) -> None:
    """``out = x.float() ** 2`` for contiguous CPU ``x [n, H]`` bf16 into fp32 ``out [n, H]``."""
    match_torch_threads()
    _squares_rows(_u16(x), out.numpy())


def rms_chain(
    x: torch.Tensor,
    gamma: torch.Tensor,
    r: torch.Tensor,
    offset: int,
    fp8: torch.dtype,
    maxval: float,
    scale_pos: torch.Tensor,
    tail: torch.Tensor,
    rows: torch.Tensor,
    a_out: torch.Tensor | None,
) -> None:
    """One chunk of the prefill chain (§3.3, §3.4, §4.2) on contiguous CPU tensors.

    x ``[n, H]`` bf16 natural order; gamma ``[H]`` fp32; r ``[n]`` fp32 (the bf16-rounded
    inv_rms); scale_pos ``[H/32]`` int64 byte positions of the scales in a row; rows
    ``[n, row_bytes]`` uint8 (codes at ``[:H]``, scales at `scale_pos`; the rest untouched);
    a_out ``[n, H]`` fp32 receives ``R_bf16(x*gamma)`` (the router input) when given.
    """
    nan_bits = bf16_nan_bits()
    assert nan_bits is not None, "rms_chain needs a fixed bf16 NaN pattern (bf16_nan_bits)"
    match_torch_threads()
    a_np = a_out.numpy() if a_out is not None else np.empty((1, GROUP), dtype=np.float32)
    _chain_rows(
        _u16(x),
        gamma.numpy(),
        r.numpy(),
        np.int32(nan_bits),
        np.int32(offset),
        fp8 == torch.float8_e5m2,
        np.float32(maxval),
        scale_pos.numpy(),
        tail.numpy(),
        rows.numpy(),
        a_np,
        a_out is not None,
    )


# --------------------------------------------------------------------------- NOAUX_TC routing


@njit(inline="always")
def _top_k_hw(x, n, k, pad, pad_count, vals, idx):  # type: ignore[no-untyped-def]
    """``max8`` + ``nc_find_index8`` (§5.2, api spec §8.14) on ``x[:n]`` followed by `pad_count`
    pad columns of value `pad`: the `k` largest values (with multiplicity) into ``vals`` in
    descending order and their columns into ``idx``, equal values in ascending column order (the
    k-th of equal values takes the k-th occurrence), so the columns are distinct. Finite inputs.

    One pass keeps the k best in order, a new value behind those equal to it (strict compares),
    and an eviction drops the latest of equal tail entries: `router.hardware_topk`'s stable sort.
    """
    count = 0
    for c in range(n + pad_count):
        v = x[c] if c < n else pad
        if count < k:
            p = count
            count += 1
        elif v > vals[k - 1]:
            p = k - 1
        else:
            continue
        while p > 0 and vals[p - 1] < v:
            vals[p] = vals[p - 1]
            idx[p] = idx[p - 1]
            p -= 1
        vals[p] = v
        idx[p] = c


_ROUTE_ROWS = 64  # tokens per parallel work item (its scratch buffers are allocated once)


@njit_cached(parallel=True)
def _noaux_rows(score, bias, n_group, topk_group, top_k, scale, sentinel, lowest, eps, out, bad):  # type: ignore[no-untyped-def]
    T, E = score.shape
    epg = E // n_group
    for item in prange((T + _ROUTE_ROWS - 1) // _ROUTE_ROWS):
        sfc = np.empty(E, dtype=np.float32)
        masked = np.empty(E, dtype=np.float32)
        onehot = np.empty(E, dtype=np.float32)
        gs = np.empty(n_group, dtype=np.float32)
        gcount = np.empty(n_group, dtype=np.float32)
        vals = np.empty(8, dtype=np.float32)
        kept = np.empty(8, dtype=np.int64)
        sel = np.empty(8, dtype=np.int64)
        for t in range(item * _ROUTE_ROWS, min(T, (item + 1) * _ROUTE_ROWS)):
            s = score[t]
            o = out[t]
            finite = True
            for e in range(E):
                finite = finite and np.isfinite(s[e])
                sfc[e] = s[e] + bias[e]
            bad[t] = not finite
            if not finite:
                continue  # the caller routes this row on the torch path
            # group score = top1 + top2 of the group padded with -sentinel to 8 (max8)
            for g in range(n_group):
                m1 = np.float32(-np.inf)
                m2 = np.float32(-np.inf)
                for i in range(epg + min(2, max(0, 8 - epg))):
                    v = sfc[g * epg + i] if i < epg else -sentinel
                    if v > m1:
                        m2 = m1
                        m1 = v
                    elif v > m2:
                        m2 = v
                gs[g] = m1 + m2
            _top_k_hw(gs, n_group, topk_group, -sentinel, max(0, 8 - n_group), vals, kept)
            gcount[:] = 0.0
            for j in range(topk_group):
                if kept[j] < n_group:
                    gcount[kept[j]] += np.float32(1.0)
            # kept: sfc; dropped: sfc - sentinel (errata 4: both adds in fp32)
            for e in range(E):
                masked[e] = sfc[e] + (gcount[e // epg] - np.float32(1.0)) * sentinel
            _top_k_hw(masked, E, top_k, lowest, max(0, 8 - E), vals, sel)
            onehot[:] = 0.0
            for j in range(top_k):
                if sel[j] < E:
                    onehot[sel[j]] += np.float32(1.0)
            for e in range(E):
                o[e] = s[e] * onehot[e]  # w, scaled in place below
            # den: the (distinct) selected columns in ascending order (errata 4), from 0
            order = np.sort(sel[:top_k])
            den = np.float32(0.0)
            for j in range(top_k):
                den += o[order[j]]
            den += eps
            c = scale * (np.float32(1.0) / den)
            for e in range(E):
                o[e] = o[e] * c


def noaux_tc(
    score: torch.Tensor,
    bias: torch.Tensor,
    n_group: int,
    topk_group: int,
    top_k: int,
    routed_scaling_factor: float,
    sentinel: float,
    lowest: float,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """NOAUX_TC selection and weights (§5.3, errata 4) from the sigmoid scores ``[T, E]`` fp32
    and the finite fp32 bias ``[E]``: the dense fp32 affinities ``[T, E]`` and the tokens whose
    scores are not all finite (their rows are left for the torch path)."""
    match_torch_threads()
    T, E = score.shape
    out = torch.empty((T, E), dtype=torch.float32)
    bad = torch.empty(T, dtype=torch.bool)
    _noaux_rows(
        score.contiguous().numpy(),
        bias.contiguous().numpy(),
        n_group,
        topk_group,
        top_k,
        np.float32(routed_scaling_factor),
        np.float32(sentinel),
        np.float32(lowest),
        np.float32(eps),
        out.numpy(),
        bad.numpy(),
    )
    return out, bad.nonzero().squeeze(1)
