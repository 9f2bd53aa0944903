"""Quantization into the wrapX layout (bwd spec §5.2-§5.5): one ``quantize_mx`` per
interleaved bf16 tile (`_quantize_tile`), into an on-chip operand in place or through a staging
tile spilled to HBM scratch (`_quantize_chunk_to`), and the three ways the phase-3/4 operands
are brought into token lanes: token rows interleaved by copies (`_rows_q`, X and dY),
feature-major tiles PE-transposed (`_transposed_q`, S) and phase 2's ``[dG|dU]`` row tiles
PE-transposed (`_rows_t_q`).
"""

from __future__ import annotations

from typing import Any

import nki.isa as nisa
import nki.language as nl

from .operands import _op_tiles, _spill
from .plan import NMAX, SPILL_COLS, BwdKernelConfig, Geometry, KTile, P
from .state import MxOperand


def _quantize_tile(ilv: Any, kt: KTile, n: int, q_dst: Any, s_dst: Any) -> None:
    """``quantize_mx`` of an interleaved bf16 tile ``ilv [v, n, 4]`` (bwd spec §5.2 rule)."""
    nisa.quantize_mx(dst=q_dst, src=ilv[0 : kt.v, 0:n, :], dst_scale=s_dst)


def _quantize_chunk_to(
    ilv: Any, kt: KTile, n: int, name: str, dst: MxOperand, c0: int, ci: int = 0
) -> None:
    """Quantize ``ilv [v, n, 4]`` (chunk `ci` of `dst`) into columns ``[c0, c0+n)`` of `dst`: in
    place when `dst` is on chip, else through a staging tile spilled to its HBM scratch."""
    if dst.layout is None:
        o = c0 - dst.c_lo
        sv = dst.views[ci]
        _quantize_tile(ilv, kt, n, dst.q[0 : kt.v, ci, o : o + n], sv[:, o : o + n])
        return
    q = nl.ndarray((P, n), dtype=nl.float8_e4m3fn_x4, buffer=nl.sbuf, name=f"{name}_q")
    s = nl.ndarray((P, n), dtype=nl.uint8, buffer=nl.sbuf, name=f"{name}_s")
    nisa.memset(dst=s[0 : kt.v, :], value=0)
    _quantize_tile(ilv, kt, n, q[0 : kt.v, :], s[0 : kt.v, :])
    _spill(dst, kt, c0, n, q[0 : kt.v, :], s[0 : kt.v, :])


def _window_tiles(op: MxOperand, w0: int, Wn: int) -> list[tuple[int, Any]]:
    """(index, chunk) of the token chunks of `op` that start inside the window ``[w0, w0+Wn)``."""
    out = []
    tiles = _op_tiles(op)
    for ci in range(len(tiles)):
        kt = tiles[ci]
        if kt.k0 >= w0 and kt.k0 < w0 + Wn:
            out.append((ci, kt))
    return out


def _rows_q(
    cfg: BwdKernelConfig,
    rows: Any,
    r0: int,
    win: int,
    dst: MxOperand,
    F: int,
    c0: int,
    name: str,
) -> None:
    """Token rows of window `win` (``rows [P, W/P, *]``, tokens on partitions, columns
    ``[r0, r0+F)``) quantized along the tokens into columns ``[c0, c0+F)`` of `dst` (wrapX
    chunks inside the window: one copy per byte interleaves them)."""
    Wn, w0 = cfg.W, win * cfg.W
    bf = cfg.compute_dtype
    spill = dst.layout is not None
    # a spilled operand is staged and written back SPILL_COLS columns at a time (as in
    # `_rows_t_q`; phase 1, where this runs for dY, has less SBUF to spare than phase 2)
    step = SPILL_COLS if spill else NMAX
    for ci, kt in _window_tiles(dst, w0, Wn):
        v = kt.v
        for s0 in range(0, F, step):
            sn = min(step, F - s0)
            if spill:
                sq = nl.ndarray((P, sn), dtype=nl.float8_e4m3fn_x4, buffer=nl.sbuf,
                                name=f"{name}_q")  # fmt: skip
                ss = nl.ndarray((P, sn), dtype=nl.uint8, buffer=nl.sbuf, name=f"{name}_s")
                nisa.memset(dst=ss[0:v, :], value=0)
            for f0 in range(s0, s0 + sn, NMAX):
                n = min(NMAX, s0 + sn - f0)
                ilv = nl.ndarray((P, n, 4), dtype=bf, buffer=nl.sbuf, name=f"{name}_ilv")
                for j in range(4):
                    pos = kt.k0 - w0 + j * v  # window position of lane 0 of byte j
                    tt = pos // P
                    p0 = pos % P
                    src = rows[p0 : p0 + v, tt, r0 + f0 : r0 + f0 + n]
                    nisa.tensor_copy(dst=ilv[0:v, :, j], src=src)
                if spill:
                    o = f0 - s0
                    _quantize_tile(ilv, kt, n, sq[0:v, o : o + n], ss[0:v, o : o + n])
                else:
                    _quantize_chunk_to(ilv, kt, n, name, dst, c0 + f0, ci)
            if spill:
                _spill(dst, kt, c0 + s0, sn, sq[0:v, :], ss[0:v, :])


def _transposed_q(
    cfg: BwdKernelConfig, fts: list[Any], rows: int, win: int, dst: MxOperand, name: str
) -> None:
    """Feature-major tiles ``fts`` (``[128 f, <=4, W tok]`` per 512 of `rows` features, from
    `_phase2_loads`) -> token lanes: PE transposes of ``[128 f, v tok]`` slices into the wrapX
    layout along the tokens, quantized into `dst`."""
    Wn, w0 = cfg.W, win * cfg.W
    bf = cfg.compute_dtype
    tiles = _window_tiles(dst, w0, Wn)
    for f0 in range(0, rows, NMAX):
        n = min(NMAX, rows - f0)
        nf = n // P
        ft = fts[f0 // NMAX]
        for ci, kt in tiles:
            v = kt.v
            ilv = nl.ndarray((P, n, 4), dtype=bf, buffer=nl.sbuf, name=f"{name}_ilv")
            for j in range(4):
                k = kt.k0 - w0 + j * v  # window position of lane 0 of byte j
                ps = nl.ndarray((P, n), dtype=bf, buffer=nl.psum, name=f"{name}_tp")
                for fi in range(nf):
                    nisa.nc_transpose(dst=ps[0:v, fi * P : (fi + 1) * P], data=ft[:, fi, k : k + v])
                nisa.tensor_copy(dst=ilv[0:v, :, j], src=ps[0:v, :])
            _quantize_chunk_to(ilv, kt, n, name, dst, f0, ci)


def _rows_t_q(
    cfg: BwdKernelConfig,
    geo: Geometry,
    rows2: list[Any],
    win: int,
    dst: MxOperand,
    name: str,
) -> None:
    """``[dG|dU]^T`` of window `win` to token lanes from phase 2's row tiles (``rows2[i]
    [v2, 4, W]``: feature ``k0 + j*v2 + p`` of 2I chunk `i` on partition `p`): PE transposes of
    ``[v2 f, v tok]`` slices into the wrapX layout along the tokens, quantized into `dst`."""
    Wn, w0 = cfg.W, win * cfg.W
    bf = cfg.compute_dtype
    tiles = _window_tiles(dst, w0, Wn)
    F = 2 * cfg.I
    spill = dst.layout is not None
    for ci, kt in tiles:
        v = kt.v
        if spill:
            # a spilled operand: the whole 2I row range staged and written back at once
            # (4*2I-byte data / 2I-byte scale runs instead of per 2I chunk: 2 KiB / 512 B,
            # ~80% / ~50% of peak, nki-dma-bandwidth-guide.rst)
            sq = nl.ndarray((P, F), dtype=nl.float8_e4m3fn_x4, buffer=nl.sbuf, name=f"{name}_q")
            ss = nl.ndarray((P, F), dtype=nl.uint8, buffer=nl.sbuf, name=f"{name}_s")
            nisa.memset(dst=ss[0:v, :], value=0)
        for i2 in range(len(geo.k2)):
            k2 = geo.k2[i2]
            v2, c2 = k2.v, k2.c
            rows = rows2[i2]
            ilv = nl.ndarray((P, c2, 4), dtype=bf, buffer=nl.sbuf, name=f"{name}_ilv")
            for j in range(4):
                k = kt.k0 - w0 + j * v  # window position of lane 0 of byte j
                ps = nl.ndarray((P, c2), dtype=bf, buffer=nl.psum, name=f"{name}_tp")
                for g in range(4):
                    nisa.nc_transpose(
                        dst=ps[0:v, g * v2 : (g + 1) * v2], data=rows[0:v2, g, k : k + v]
                    )
                nisa.tensor_copy(dst=ilv[0:v, :, j], src=ps[0:v, :])
            if spill:
                c_hi = k2.k0 + c2
                _quantize_tile(ilv, kt, c2, sq[0:v, k2.k0 : c_hi], ss[0:v, k2.k0 : c_hi])
            else:
                _quantize_chunk_to(ilv, kt, c2, name, dst, k2.k0, ci)
        if spill:
            _spill(dst, kt, 0, F, sq[0:v, :], ss[0:v, :])
