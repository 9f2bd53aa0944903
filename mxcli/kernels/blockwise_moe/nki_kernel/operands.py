"""Quantized MX operands and the DMA helpers that move them (bwd spec §5.5).

An operand is an `MxOperand`: in HBM (``layout`` a `QLayout`, ``data`` x4 words, ``scales``
uint8, ``expert`` a ``(1, 1)`` int32 SBUF view selecting the leading axis at run time through
``scalar_offset``, or None), or resident in SBUF (``layout`` None, ``q`` x4 data ``[lanes,
chunk, F]``, per-chunk scale ``views``, first column ``c_lo``). `_load_q` hands out the
columns of either kind the same way: (x4 data, per-chunk scale views) for ``nc_matmul_mx``.
"""

from __future__ import annotations

from typing import Any

import nki.isa as nisa
import nki.language as nl

from .plan import QUAD, STATIONARY_BUDGET, KTile, P, QLayout
from .state import MxOperand


def _load(dst: Any, src: Any) -> None:
    """A plain load (the compiler's default descriptors).

    The kernel spreads its DMAs over the queues (nki-dge.rst: the queue follows the trigger
    engine and the descriptor-generation method): loads and output zeroing here, write-backs on
    the scalar engine's hardware-DGE queue (`_store`), indirect gathers and scatters on the
    software-DGE queue. A queue starts its transfers in order, so a write-back waiting for its
    compute would otherwise hold back every later load behind it."""
    nisa.dma_copy(dst=dst, src=src)


def _store(dst: Any, src: Any) -> None:
    """A plain write-back on the scalar engine's hardware-DGE queue (see `_load`)."""
    nisa.dma_copy(dst=dst, src=src, dge_mode=nisa.dge_mode.hwdge, engine=nisa.engine.scalar)


def _index_dma(dst: Any, src: Any) -> None:
    """A small DMA of a block's index chain (`_indices_load`, `_setup_indices`) on the sync
    engine's hardware-DGE queue, which carries nothing else: the chain alternates DMAs and
    integer ops, and on a shared queue each link would hold back the loads behind it (`_load`)."""
    nisa.dma_copy(dst=dst, src=src, dge_mode=nisa.dge_mode.hwdge, engine=nisa.engine.sync)


def _hbm_operand(data: Any, scales: Any, layout: QLayout, expert: Any) -> MxOperand:
    return MxOperand(layout=layout, data=data, scales=scales, expert=expert)


def _ap(t: Any, pattern: list[list[int]], offset: int, expert: Any) -> Any:
    """An access pattern of `t`, through the expert's ``scalar_offset`` when given."""
    if expert is None:
        return t.ap(pattern, offset=offset)
    return t.ap(pattern, offset=offset, scalar_offset=expert, indirect_dim=0)


def _run_src(t: Any, lay: QLayout, expert: Any, i0: int, m: int, c0: int, n: int) -> Any:
    """Rows of chunks ``i0 .. i0+m-1`` (one run), columns ``[c0, c0+n)``."""
    kt = lay.tiles[i0]
    pattern = [[lay.F, kt.v], [P * lay.F, m], [1, n]]
    return _ap(t, pattern, kt.row0 * lay.F + c0, expert)


def _load_packed_scales(op: MxOperand, c0: int, n: int, name: str) -> list[Any]:
    """Packed scales of columns ``[c0, c0+n)``, one view per chunk (bwd spec §5.5).

    A chunk starting on a 512 boundary finds its scales in one 128-row group at partition
    offset 0/4/8/12, lane ``p`` at ``start + 32*(p//32) + (p%32)//8``: the group is loaded
    whole into a slot. A chunk that does not (a 256/128 remainder, any chunk of tile_k < 512)
    has them one to three quadrants lower than its data, which the MX matmul does not allow:
    its 4 rows per quadrant are copied into a slot of their own, into the data's quadrants.
    """
    lay = op.layout
    t, expert = op.scales, op.expert
    nslots = 0
    for slot, _start, _row in lay.place:
        nslots = max(nslots, slot + 1)
    s = nl.ndarray((P, nslots, n), dtype=nl.uint8, buffer=nl.sbuf, name=f"{name}_s")
    for gi in range(len(lay.groups)):
        src = _ap(t, [[lay.F, P], [1, n]], lay.groups[gi] * P * lay.F + c0, expert)
        nisa.dma_copy(dst=s[:, gi, :], src=src)
    views = []
    for i in range(len(lay.tiles)):
        slot, start, row = lay.place[i]
        if row >= 0:
            for q in range(lay.tiles[i].v // QUAD):
                p0 = start + q * QUAD
                src = _ap(t, [[lay.F, 4], [1, n]], (row + q * QUAD) * lay.F + c0, expert)
                nisa.dma_copy(dst=s[p0 : p0 + 4, slot, :], src=src)
        views.append(s[start:P, slot, :])
    return views


def _load_q(op: MxOperand, c0: int, n: int, name: str) -> tuple[Any, list[Any]]:
    """All chunks of columns ``[c0, c0+n)``: (x4 data ``[P, nk, n]``, per-chunk scale views
    for `nc_matmul_mx`). Resident operands hand out column slices without any DMA."""
    lay = op.layout
    if lay is None:
        off = c0 - op.c_lo
        views = []
        for v in op.views:
            views.append(v[:, off : off + n])
        return op.q[:, :, off : off + n], views
    nk = len(lay.tiles)
    q = nl.ndarray((P, nk, n), dtype=nl.float8_e4m3fn_x4, buffer=nl.sbuf, name=f"{name}_q")
    for i0, m in lay.runs:
        v = lay.tiles[i0].v
        src = _run_src(op.data, lay, op.expert, i0, m, c0, n)
        _load(q[0:v, i0 : i0 + m, :], src)
    if len(lay.place):
        return q, _load_packed_scales(op, c0, n, name)
    s = nl.ndarray((P, nk, n), dtype=nl.uint8, buffer=nl.sbuf, name=f"{name}_s")
    for i0, m in lay.runs:
        v = lay.tiles[i0].v
        src = _run_src(op.scales, lay, op.expert, i0, m, c0, n)
        _load(s[0:v, i0 : i0 + m, :], src)
    views = []
    for i in range(nk):
        views.append(s[0 : lay.tiles[i].v, i, :])
    return q, views


def _resident(op: MxOperand, c_lo: int, n: int, name: str) -> MxOperand:
    """An HBM operand's columns ``[c_lo, c_lo+n)`` loaded into SBUF for the block."""
    q, views = _load_q(op, c_lo, n, name)
    return MxOperand(q=q, views=views, c_lo=c_lo)


def _stationary(op: MxOperand, c_lo: int, n: int, name: str) -> MxOperand:
    """A phase-3/4 stationary operand's columns ``[c_lo, c_lo+n)``: loaded once (whole-row DMA
    runs) when its x4 data and scales fit `STATIONARY_BUDGET`, else left in HBM and loaded per
    128-column tile (short runs, and once per output tile of the other operand)."""
    if op.layout is None:
        return op
    if n and len(op.layout.tiles) * n * 5 <= STATIONARY_BUDGET:
        return _resident(op, c_lo, n, name)
    return op


def _spill(op: MxOperand, kt: KTile, c0: int, n: int, q: Any, s: Any) -> None:
    """Write one quantized chunk (x4 data [v, n], unpacked scales [v, n]) to HBM scratch."""
    r = kt.row0
    _store(op.data[r : r + kt.v, c0 : c0 + n], q)
    _store(op.scales[r : r + kt.v, c0 : c0 + n], s)


def _onchip_operand(tiles: tuple[Any, ...], c_lo: int, F: int, name: str) -> MxOperand:
    """An SBUF operand ``[lanes, chunk, F]`` that `_quantize_chunk_to` fills in place: chunk `i`'s
    scales at partition offset ``4 * (i % 4)`` of scale slot ``i // 4`` (one scale byte per
    column for four chunks instead of one; the rows quantize_mx writes and nc_matmul_mx reads
    are ``start + 32 q + g``, bwd spec §5.5)."""
    nk = len(tiles)
    q = nl.ndarray((P, nk, F), dtype=nl.float8_e4m3fn_x4, buffer=nl.sbuf, name=f"{name}_q")
    s = nl.ndarray((P, (nk + 3) // 4, F), dtype=nl.uint8, buffer=nl.sbuf, name=f"{name}_s")
    views = []
    for i in range(nk):
        views.append(s[4 * (i % 4) : P, i // 4, :])
    return MxOperand(q=q, views=views, c_lo=c_lo, tiles=tiles)


def _op_tiles(op: MxOperand) -> tuple[Any, ...]:
    if op.layout is None:
        return op.tiles
    return op.layout.tiles
