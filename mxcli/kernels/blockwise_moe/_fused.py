"""Fused elementwise passes of the backward reference (numba), bit-identical to its torch ops.

Optional (numba, extra ``fast``): `backward.py` uses these kernels (`_fused_kernels` there) and runs
its pure-torch path when numba is missing or ``MXCLI_FUSED=0``; both give the same bytes
(tests/kernels/test_blockwise_bwd_fused.py). They replace chains of torch passes (gathers,
transposes, fp32 -> bf16 round trips, the SwiGLU backward, bf16 read-add-write accumulations)
with one pass each; matmuls and MX quantization stay where they were.

Every fp32 operation is the same IEEE operation, in the same order, as the torch expression it
replaces (numba without ``fastmath`` neither reassociates nor contracts into FMAs), and every
store to bf16 is `_round_bf16`: round to nearest even on the bit pattern, which is torch's CPU
cast for all non-NaN inputs (overflow to ±Inf and subnormals included). NaN becomes the one
pattern torch's cast produces on this CPU (0xFFFF with ATen's AVX2/AVX-512 kernels, 0x7FC0
with ``ATEN_CPU_CAPABILITY=default``), measured once (`torch_bf16_nan`).

bf16 tensors cross as their uint16 patterns (or uint64 words of 4); integer math stays in
uint32 lanes (checked in the generated code). Compiled lazily on first use, cached on disk.
Callers pass C-contiguous arrays: numba compiles a strided ("A" layout) array's loops without
SIMD, several times slower.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from mxcli.jit import njit_cached

# shared with mxcli.mx (re-exported for backward.py)
from mxcli.mx._fused import enabled as enabled
from mxcli.mx._fused import match_torch_threads as match_torch_threads
from mxcli.mx._fused import torch_bf16_nan_bits as torch_bf16_nan_bits

# Tile edge of the SwiGLU pass (rows of I per item) and of the ordered scatter's column split.
_TILE = 32


@intrinsic
def _f32_bits(typingctx, x):  # type: ignore[no-untyped-def]
    sig = types.uint32(types.float32)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.bitcast(args[0], ir.IntType(32))

    return sig, codegen


@intrinsic
def _bits_f32(typingctx, x):  # type: ignore[no-untyped-def]
    sig = types.float32(types.uint32)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen


@njit(inline="always")
def _f(h):  # type: ignore[no-untyped-def]
    """bf16 pattern (uint16) -> fp32 value (exact)."""
    return _bits_f32(np.uint32(h) << np.uint32(16))


@njit(inline="always")
def _round_bf16(v, nan_bits):  # type: ignore[no-untyped-def]
    """fp32 -> bf16 pattern, round to nearest even; NaN -> `nan_bits` (torch's cast)."""
    b = _f32_bits(v)
    r = np.uint16((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
    return nan_bits if (b & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000) else r


@njit_cached(parallel=True)
def gather_gate_up(src, blocks, perm, out):  # type: ignore[no-untyped-def]
    """``out[k, c, i, j] = src[blocks[k], c, i, perm[j]]`` as fp32 (``src`` bf16 ``[N, 2, I, B]``)."""
    nb, C, F, B = out.shape
    for kf in prange(nb * C * F):
        k = kf // (C * F)
        c = (kf // F) % C
        i = kf % F
        s = src[blocks[k], c, i]
        o = out[k, c, i]
        for j in range(B):
            o[j] = _f(s[perm[j]])


# Gather work item: tokens x uint64 words (4 columns each), a 64 KiB buffer. Wide enough that
# each transposed output row gets whole cache lines (rows B/4 words apart alias in L1 otherwise).
_GATHER_TOKENS = 128
_GATHER_WORDS = 64
_M16 = np.uint64(0x0000FFFF0000FFFF)
_M32 = np.uint64(0x00000000FFFFFFFF)


@njit(inline="always")
def _transpose32(src, sr, sc, dst, dr, dc):  # type: ignore[no-untyped-def]
    """Transpose a 32 x 32 tile of uint16, rows held as 8 uint64 words each (4 lanes a word):
    lane ``4w + l`` of ``src[sr + r, sc + w]`` goes to lane ``r % 4`` of
    ``dst[dr + 4w + l, dc + r // 4]``. 4 x 4 sub-tiles are transposed in registers with shifts
    and masks (two 2 x 2 steps), 16 elements per 8 word loads/stores."""
    s16 = np.uint64(16)
    s32 = np.uint64(32)
    for rg in range(8):
        for w in range(8):
            r0 = src[sr + 4 * rg, sc + w]
            r1 = src[sr + 4 * rg + 1, sc + w]
            r2 = src[sr + 4 * rg + 2, sc + w]
            r3 = src[sr + 4 * rg + 3, sc + w]
            t0 = (r0 & _M16) | ((r1 & _M16) << s16)  # lanes (r0[0], r1[0], r0[2], r1[2])
            t1 = ((r0 >> s16) & _M16) | (r1 & ~_M16)  # (r0[1], r1[1], r0[3], r1[3])
            t2 = (r2 & _M16) | ((r3 & _M16) << s16)
            t3 = ((r2 >> s16) & _M16) | (r3 & ~_M16)
            dst[dr + 4 * w, dc + rg] = (t0 & _M32) | (t2 << s32)
            dst[dr + 4 * w + 1, dc + rg] = (t1 & _M32) | (t3 << s32)
            dst[dr + 4 * w + 2, dc + rg] = (t0 >> s32) | (t2 & ~_M32)
            dst[dr + 4 * w + 3, dc + rg] = (t1 >> s32) | (t3 & ~_M32)


@njit_cached(parallel=True)
def gather_rows_t(src, ids, n_src, B, rows, rows_t, want_rows):  # type: ignore[no-untyped-def]
    """Token rows ``src[ids[r]]`` (zero where ``ids[r] >= n_src``, the padding id) of bf16
    patterns, all arrays as uint64 words (4 values each): ``rows [R, H/4]`` (if `want_rows`)
    and per block of B rows, transposed, ``rows_t [R/B, H, B/4]``. Needs H, B multiples of 32.
    """
    R = ids.shape[0]
    W = src.shape[1]
    nb = R // B
    n_jt = (B + _GATHER_TOKENS - 1) // _GATHER_TOKENS
    n_wc = (W + _GATHER_WORDS - 1) // _GATHER_WORDS
    zero = np.uint64(0)
    # one item: up to _GATHER_TOKENS tokens x _GATHER_WORDS words, copied into a buffer, then
    # written out as 32 x 32 transposed tiles
    for item in prange(nb * n_jt * n_wc):
        k = item // (n_jt * n_wc)
        j0 = ((item // n_wc) % n_jt) * _GATHER_TOKENS
        c0 = (item % n_wc) * _GATHER_WORDS
        nj = min(B, j0 + _GATHER_TOKENS) - j0
        nc = min(W, c0 + _GATHER_WORDS) - c0
        buf = np.empty((_GATHER_TOKENS, _GATHER_WORDS), dtype=np.uint64)
        for jj in range(nj):
            tid = ids[k * B + j0 + jj]
            if tid < n_src:
                buf[jj, :nc] = src[tid, c0 : c0 + nc]
            else:
                buf[jj, :nc] = zero
            if want_rows:
                rows[k * B + j0 + jj, c0 : c0 + nc] = buf[jj, :nc]
        for w0 in range(0, nc, 8):
            for r0 in range(0, nj, 32):
                _transpose32(buf, r0, w0, rows_t[k], 4 * (c0 + w0), (j0 + r0) // 4)


@njit_cached(parallel=True)
def swiglu_bwd(  # type: ignore[no-untyped-def]
    gu, sig, d, ds, al, on_i,
    act_src, has_act, h_src, has_h, s_src, has_s, blocks, perm,
    clamp, nan_bits, dgu_t, dgu_t64, dgu_rows, p4_t, prod,
):  # fmt: skip
    """The P1 elementwise chain of `backward.py` (spec §6 P1.3-P1.6) for ``[nb, I, B]`` blocks.

    Inputs fp32 ``gu [nb, 2, I, B]`` (G, U), ``sig = σ(G)``, ``d`` (un-scaled P1 product), ``ds`` (ON_H: the scaled P1
    product; ON_I: unused, ``Ds = D·α``), ``al [nb, B]``; optional bf16 checkpoints
    ``act_src / h_src / s_src [N, I, B]`` read at ``[blocks[k], i, perm[j]]``. ``clamp``: 4
    fp32 bounds (nl_lo, nl_hi, l_lo, l_hi), NaN where unset, a mask applied only where a bound
    of its pair is set. Outputs (bf16 patterns): ``dgu_t [nb, 2I, B]`` (``dgu_t64``: the same
    memory as uint64 words), its rows ``dgu_rows [nb*B, 2I/4]`` (uint64 words), the P4 operand ``p4_t [nb, I, B]``; fp32 ``prod [2, nb, I/2, B]``:
    ``D·Hm`` in the two LNC2 halves over I (summed by the caller, as torch sums them).
    """
    nb, F, B = d.shape
    half = F // 2
    one = np.float32(1.0)
    zero = np.float32(0.0)
    nl_lo, nl_hi, l_lo, l_hi = clamp[0], clamp[1], clamp[2], clamp[3]
    no_nl_lo, no_nl_hi = np.isnan(nl_lo), np.isnan(nl_hi)
    no_l_lo, no_l_hi = np.isnan(l_lo), np.isnan(l_hi)
    has_nl = not (no_nl_lo and no_nl_hi)
    has_l = not (no_l_lo and no_l_hi)
    n_it = (F + _TILE - 1) // _TILE
    # one item: _TILE rows i of one block, each row a few branch-free (vectorizable) loops over
    # the tokens; then the tile's rows of dgu_rows, a transposed copy that stays in cache
    for item in prange(nb * n_it):
        k = item // n_it
        i0 = (item % n_it) * _TILE
        i1 = min(F, i0 + _TILE)
        blk = blocks[k]
        alk = al[k]
        act = np.empty(B, dtype=np.uint16)
        hm = np.empty(B, dtype=np.uint16)
        dsv = np.empty(B, dtype=np.float32)
        for i in range(i0, i1):
            hi_half = 1 if i >= half else 0
            pr = prod[hi_half, k, i - hi_half * half]
            # rows by integer indexing keep numba's contiguous layout (vectorized loops)
            gr, ur, sr, dr = gu[k, 0, i], gu[k, 1, i], sig[k, i], d[k, i]
            dgr, dur, p4r = dgu_t[k, i], dgu_t[k, F + i], p4_t[k, i]
            if has_act:
                ar = act_src[blk, i]
                for j in range(B):
                    act[j] = ar[perm[j]]
            else:
                for j in range(B):
                    act[j] = _round_bf16(gr[j] * sr[j], nan_bits)
            if has_h:
                hr = h_src[blk, i]
                for j in range(B):
                    hm[j] = hr[perm[j]]
            else:
                for j in range(B):
                    hm[j] = _round_bf16(_f(act[j]) * ur[j], nan_bits)
            if on_i:
                for j in range(B):
                    dsv[j] = dr[j] * alk[j]
            else:
                dsv[:] = ds[k, i]
            for j in range(B):
                s = sr[j]
                dphi = one - s  # σ(1 + g(1 − σ)), left to right as torch evaluates it
                dphi = dphi * gr[j]
                dphi = dphi + one
                dphi = dphi * s
                dga = _round_bf16(_f(_round_bf16(dphi, nan_bits)) * ur[j], nan_bits)
                pr[j] = dr[j] * _f(hm[j])
                dgr[j] = _round_bf16(dsv[j] * _f(dga), nan_bits)
                dur[j] = _round_bf16(dsv[j] * _f(act[j]), nan_bits)
            if has_nl:  # strict inequalities on the checkpoint value (spec §4.2)
                for j in range(B):
                    gv = gr[j]
                    m = (no_nl_hi | (gv < nl_hi)) & (no_nl_lo | (gv > nl_lo))
                    dgr[j] = _round_bf16(_f(dgr[j]) * (one if m else zero), nan_bits)
            if has_l:
                for j in range(B):
                    uv = ur[j]
                    m = (no_l_hi | (uv < l_hi)) & (no_l_lo | (uv > l_lo))
                    dur[j] = _round_bf16(_f(dur[j]) * (one if m else zero), nan_bits)
            if not on_i:
                p4r[:] = hm
            elif has_s:
                sr2 = s_src[blk, i]
                for j in range(B):
                    p4r[j] = sr2[perm[j]]
            else:
                for j in range(B):
                    p4r[j] = _round_bf16(_f(hm[j]) * alk[j], nan_bits)
        for j0 in range(0, B, 32):
            for c0 in range(i0, i1, 32):  # the dG and the dU halves
                _transpose32(dgu_t64[k], c0, j0 // 4, dgu_rows, k * B + j0, c0 // 4)
                _transpose32(dgu_t64[k], F + c0, j0 // 4, dgu_rows, k * B + j0, (F + c0) // 4)


@njit_cached(parallel=True)
def acc_block(acc, c, first, nan_bits):  # type: ignore[no-untyped-def]
    """``acc = bf16(c)`` (`first`) else ``acc = bf16(acc + bf16(c))``, on bf16 patterns."""
    M, N = c.shape
    for m in prange(M):
        a = acc[m]
        cm = c[m]
        if first:
            for n in range(N):
                a[n] = _round_bf16(cm[n], nan_bits)
        else:
            for n in range(N):
                a[n] = _round_bf16(_f(a[n]) + _f(_round_bf16(cm[n], nan_bits)), nan_bits)


@njit_cached(parallel=True)
def round_rows(src, sel, dest, out, nan_bits):  # type: ignore[no-untyped-def]
    """``out[dest[m]] = bf16(src[sel[m]])`` (fp32 rows in, bf16 pattern rows out)."""
    H = src.shape[1]
    for m in prange(sel.shape[0]):
        s = src[sel[m]]
        o = out[dest[m]]
        for h in range(H):
            o[h] = _round_bf16(s[h], nan_bits)


@njit_cached(parallel=True)
def ordered_scatter(out, ids, vals, accumulate, nan_bits):  # type: ignore[no-untyped-def]
    """Rows ``vals[j]`` into ``out[ids[j]]`` in the order of j, onto zeros: the first write to
    a row is a store, later ones ``bf16(out + v)`` (`accumulate`) or a store (the last wins).
    Rows no id names are zeroed (`out` may come uninitialised)."""
    n = ids.shape[0]
    T = out.shape[0]
    # stable counting sort of the writes by row: each row's writes keep their order
    start = np.zeros(T + 1, dtype=np.int64)
    for j in range(n):
        start[ids[j] + 1] += 1
    for t in range(T):
        start[t + 1] += start[t]
    fill = start[:T].copy()
    order = np.empty(n, dtype=np.int64)
    for j in range(n):
        t = ids[j]
        order[fill[t]] = j
        fill[t] += 1
    for t in prange(T):
        a = start[t]
        b = start[t + 1]
        o = out[t]
        if a == b:
            o[:] = np.uint16(0)
        elif not accumulate:
            o[:] = vals[order[b - 1]]
        else:
            o[:] = vals[order[a]]
            for m in range(a + 1, b):
                v = vals[order[m]]
                for h in range(o.shape[0]):
                    o[h] = _round_bf16(_f(o[h]) + _f(v[h]), nan_bits)


# ---- torch-facing helpers ------------------------------------------------------------------


def torch_bf16_nan() -> np.uint16:
    """The bf16 pattern torch's CPU fp32 -> bf16 cast gives NaN (`torch_bf16_nan_bits`; callers
    check first that there is one pattern)."""
    bits = torch_bf16_nan_bits()
    assert bits is not None, "torch's bf16 cast keeps NaN payloads: the fused passes do not apply"
    return np.uint16(bits)


def u16(t: torch.Tensor) -> Any:
    """The uint16 patterns of a bf16 tensor as a numpy view (shares memory)."""
    return t.detach().view(torch.int16).numpy().view(np.uint16)


def u64(t: torch.Tensor) -> Any:
    """A contiguous bf16 tensor's patterns as uint64 words (4 values each; last dim % 4 == 0)."""
    return u16(t).view(np.uint64)
