"""Phases 3 and 4 of a block, the weight grads (bwd spec §6 P3, P4; package docstring step
5): ``dW_gu[e] += bf16(mx(X^T, dGU))`` and ``dW_d[e] += bf16(mx(S^T, dY))`` as read-modify-writes
tile by tile or a whole output row at a time (`_phase34_rows`), then the bias grads (step 6).
"""

from __future__ import annotations

from typing import Any

import nki.isa as nisa
import nki.language as nl

from .operands import _ap, _load, _load_q, _stationary, _store
from .plan import NMAX, ZCOLS, BwdKernelConfig, Geometry, P
from .quant import _transposed_q
from .state import BlockIndices, BlockTensors, LaunchTensors


def _s_loads(cfg: BwdKernelConfig, t: BlockTensors, win: int) -> list[Any]:
    """S^T tiles of window `win` (``[128 i, <=4, W tok]`` per 512 rows of ``s_s``)."""
    Wn, w0 = cfg.W, win * cfg.W
    fts = []
    for f0 in range(0, cfg.I, NMAX):
        nf = min(NMAX, cfg.I - f0) // P
        ft = nl.ndarray((P, nf, Wn), dtype=cfg.compute_dtype, buffer=nl.sbuf, name="p4_s_ft")
        _load(ft, t.s_s.ap([[cfg.B, P], [P * cfg.B, nf], [1, Wn]], offset=f0 * cfg.B + w0))
        fts.append(ft)
    return fts


def _rmw_load(bf: Any, dst_ap: Any, first_dense: bool, n: int, name: str) -> Any:
    """The current value of an output tile for `_rmw` (dense; None for block 0, which writes)."""
    if first_dense:
        return None
    old = nl.ndarray((P, n), dtype=bf, buffer=nl.sbuf, name=f"{name}_old")
    _load(old, dst_ap)
    return old


def _rmw_olds(
    cfg: BwdKernelConfig,
    t: LaunchTensors,
    blk: BlockIndices,
    rows: Any,
    tiles: list[tuple[int, int]],
    c0: int,
    n: int,
    name: str,
) -> list[Any]:
    """Routed: the current value of output tiles ``(row tile, index column)`` of the row view
    `rows`, columns ``[c0, c0+n)``, for `_rmw`. Block 0 reads nothing (the zero tile: every
    block-0 tile is its expert's first); later blocks gather the rows `_rmw_index` gives into
    a tile zeroed on GpSimd (idle in phases 3/4), skipping an expert's first block."""
    if blk.rmw_idx is None:
        out = []
        for _ in tiles:
            out.append(t.zero[:, 0:n])
        return out
    old = nl.ndarray((P, len(tiles), n), dtype=cfg.compute_dtype, buffer=nl.sbuf,
                     name=f"{name}_old")  # fmt: skip
    nisa.memset(dst=old, value=0.0, engine=nisa.engine.gpsimd)
    out = []
    for k in range(len(tiles)):
        _rt, col = tiles[k]
        src = rows.ap(
            [[rows.shape[1], P], [1, n]], offset=c0, vector_offset=blk.rmw_idx[:, col : col + 1],
            indirect_dim=0,
        )  # fmt: skip
        nisa.dma_copy(dst=old[:, k, :], src=src, oob_mode=nisa.oob_mode.skip)
        out.append(old[:, k, :])
    return out


def _rmw(bf: Any, dst_ap: Any, c_ps: Any, old: Any, n: int, name: str) -> None:
    """dst = bf16(old + bf16(C)) (old from `_rmw_load`; None: dst = bf16(C))."""
    c = nl.ndarray((P, n), dtype=bf, buffer=nl.sbuf, name=f"{name}_c")
    nisa.tensor_copy(dst=c, src=c_ps, engine=nisa.engine.scalar)
    if old is not None:
        nisa.tensor_tensor(dst=c, data1=old, data2=c, op=nl.add)
    _store(dst_ap, c)


def _p3_dst(cfg: BwdKernelConfig, t: LaunchTensors, blk: BlockIndices, col: int, n: int,
            ht: int) -> Any:  # fmt: skip
    """dW_gu[e] rows of H tile `ht`, columns ``[col, col+n)`` of the flattened (2, I)."""
    I2 = 2 * cfg.I
    return _ap(t.dwgu, [[I2, P], [1, n]], ht * P * I2 + col, blk.expert)


def _p3_loads(cfg: BwdKernelConfig, geo: Geometry, t: BlockTensors, blk: BlockIndices,
              first: bool, col: int, n: int) -> tuple[Any, Any, list[Any]]:  # fmt: skip
    """Phase 3's loads for dGU columns ``[col, col+n)``: the moving operand and the current
    value of this core's output tiles."""
    gq, gsv = _load_q(t.gq, col, n, "p3_g")
    if not cfg.dense:
        tiles = []
        for j in range(geo.n_h):
            tiles.append((geo.h_lo + j, geo.h_lo + j))
        return gq, gsv, _rmw_olds(cfg, t.launch, blk, t.launch.dwgu_rows, tiles, col, n, "p3")
    olds = []
    for j in range(geo.n_h):
        dst = _p3_dst(cfg, t.launch, blk, col, n, geo.h_lo + j)
        olds.append(_rmw_load(cfg.compute_dtype, dst, first, n, "p3"))
    return gq, gsv, olds


def _p3_s_loads(cfg: BwdKernelConfig, t: BlockTensors, k: int, ng: int) -> list[Any]:
    """(window, S^T tiles) of the windows whose S is quantized after phase-3 group `k` of
    `ng`."""
    nwin = cfg.B // cfg.W
    out = []
    for win in range((k * nwin) // ng, ((k + 1) * nwin) // ng):
        out.append((win, _s_loads(cfg, t, win)))
    return out


def _phase3(
    cfg: BwdKernelConfig, geo: Geometry, t: BlockTensors, blk: BlockIndices, b: int
) -> None:
    """dW_gu[e][h, g, i] += bf16(mx(X^T, dGU)) per [128 h, <=512 i] tile (§6 P3). Per column
    group of dGU the moving operand and the current output tiles are loaded one group ahead
    of the group's matmuls (see `_phase1_loads`). S (phase 4's operand) is quantized along the
    tokens here too, its windows spread over the groups (phase 3 is PE-bound: the transposes
    fill its gaps), its loads one group ahead."""
    if not geo.Hc:
        return
    first = cfg.dense and b == 0
    bf = cfg.compute_dtype
    x_op = _stationary(t.xq, geo.h0, geo.Hc, "p3_xres")
    groups = []
    for g in range(2):
        for i0 in range(0, cfg.I, NMAX):
            groups.append((g * cfg.I + i0, min(NMAX, cfg.I - i0)))
    if geo.res_moving and not geo.overlap:
        _phase3_rows(cfg, geo, t, blk, first, x_op, groups)
        return
    ng = len(groups)
    nxt = _p3_loads(cfg, geo, t, blk, first, groups[0][0], groups[0][1])
    nxt_s = _p3_s_loads(cfg, t, 0, ng)
    for k in range(ng):
        col, n = groups[k]
        gq, gsv, olds = nxt
        fts = nxt_s
        if k + 1 < ng:
            nxt = _p3_loads(cfg, geo, t, blk, first, groups[k + 1][0], groups[k + 1][1])
            nxt_s = _p3_s_loads(cfg, t, k + 1, ng)
        for j in range(geo.n_h):
            ht = geo.h_lo + j
            xq, xsv = _load_q(x_op, ht * P, P, "p3_x")
            c_ps = nl.ndarray((P, n), dtype=nl.float32, buffer=nl.psum, name="p3_c")
            for ci in range(len(geo.k3)):
                v = geo.k3[ci].v
                nisa.nc_matmul_mx(
                    dst=c_ps, stationary=xq[0:v, ci, :], moving=gq[0:v, ci, :],
                    stationary_scale=xsv[ci], moving_scale=gsv[ci], accumulate=ci > 0,
                )  # fmt: skip
            _rmw(bf, _p3_dst(cfg, t.launch, blk, col, n, ht), c_ps, olds[j], n, "p3")
        for win, ft in fts:
            _transposed_q(cfg, ft, cfg.I, win, t.sq, "p4_s")


def _rmw_row_olds(cfg: BwdKernelConfig, t: LaunchTensors, blk: BlockIndices, rows: Any,
                  tile: tuple[int, int], dst: Any, first: bool, c0: int, n: int,
                  name: str) -> tuple[Any, bool]:  # fmt: skip
    """The current value of one whole output row tile (`_rmw_olds` / `_rmw_load`), as (tile
    or None, whether to add +0 instead: routed block 0, whose zero tile is narrower)."""
    if cfg.dense:
        return _rmw_load(cfg.compute_dtype, dst, first, n, name), False
    if blk.rmw_idx is None:
        return None, True
    return _rmw_olds(cfg, t, blk, rows, [tile], c0, n, name)[0], False


def _phase34_rows(
    cfg: BwdKernelConfig,
    t: LaunchTensors,
    blk: BlockIndices,
    first: bool,
    tiles: list[Any],
    groups: list[tuple[int, int]],
    c_lo: int,
    stat: Any,
    mov: Any,
    ks: tuple[Any, ...],
    side: list[Any],
    name: str,
) -> None:
    """Phases 3/4 with the moving operand `mov` on chip (`_geometry`'s ``res_moving``): per
    output row tile all column groups into one SBUF row, then one read-modify-write of the
    whole row (columns ``[c_lo, c_lo + sum n)``: long DMA runs, and one write-back instead of
    one per 512 columns, each of which holds its hardware-DGE queue ~600 ns). `tiles`:
    ``(stationary column, row view, (row tile, index column), dst)`` per row tile, the row's
    current value loaded one tile ahead. `side`: ``(after row tile k, callable args)`` work
    spread over the rows (phase 3: S's quantization)."""
    bf = cfg.compute_dtype
    F = 0
    for _c0, n in groups:
        F = F + n
    t0 = tiles[0]
    nxt = _rmw_row_olds(cfg, t, blk, t0[1], t0[2], t0[3], first, c_lo, F, name)
    for k in range(len(tiles)):
        s0, rows, _tile, dst = tiles[k]
        old, add_zero = nxt
        if k + 1 < len(tiles):
            nt = tiles[k + 1]
            nxt = _rmw_row_olds(cfg, t, blk, nt[1], nt[2], nt[3], first, c_lo, F, name)
        sq, ssv = _load_q(stat, s0, P, f"{name}_st")
        row = nl.ndarray((P, F), dtype=bf, buffer=nl.sbuf, name=f"{name}_row")
        for gi in range(len(groups)):
            c0, n = groups[gi]
            mq, msv = _load_q(mov, c0, n, f"{name}_mv")
            c_ps = nl.ndarray((P, n), dtype=nl.float32, buffer=nl.psum, name=f"{name}_c")
            for ci in range(len(ks)):
                v = ks[ci].v
                nisa.nc_matmul_mx(
                    dst=c_ps, stationary=sq[0:v, ci, :], moving=mq[0:v, ci, :],
                    stationary_scale=ssv[ci], moving_scale=msv[ci], accumulate=ci > 0,
                )  # fmt: skip
            o = c0 - c_lo
            # PSUM evictions alternate between ScalarE and VectorE (bit-exact on either: one
            # fp32 -> bf16 rounding); on ScalarE alone they bound these phases
            eng = nisa.engine.scalar
            if (k + gi) % 2:
                eng = nisa.engine.vector
            nisa.tensor_copy(dst=row[:, o : o + n], src=c_ps, engine=eng)
        if old is not None:
            nisa.tensor_tensor(dst=row, data1=old, data2=row, op=nl.add)
        if add_zero:
            # bf16(+0 + bf16(C)) as `_rmw` computes it for a block-0 tile (-0 becomes +0)
            for z0 in range(0, F, ZCOLS):
                zn = min(ZCOLS, F - z0)
                r = row[:, z0 : z0 + zn]
                nisa.tensor_tensor(dst=r, data1=t.zero[:, 0:zn], data2=r, op=nl.add)
        _store(dst, row)
        for after, job in side:
            if after == k:
                _transposed_q(job[0], job[1], job[2], job[3], job[4], job[5])


def _phase3_rows(
    cfg: BwdKernelConfig,
    geo: Geometry,
    t: BlockTensors,
    blk: BlockIndices,
    first: bool,
    x_op: Any,
    groups: list[tuple[int, int]],
) -> None:
    """Phase 3 row by row (`_phase34_rows`): dW_gu[e] rows of each H tile, all 2I columns;
    S's windows quantized along the tokens spread over the rows (as in `_phase3`)."""
    I2 = 2 * cfg.I
    tiles = []
    for j in range(geo.n_h):
        ht = geo.h_lo + j
        dst = _ap(t.launch.dwgu, [[I2, P], [1, I2]], ht * P * I2, blk.expert)
        tiles.append((ht * P, t.launch.dwgu_rows, (ht, ht), dst))
    nwin = cfg.B // cfg.W
    side = []
    for win in range(nwin):
        after = (win * len(tiles)) // nwin
        side.append((after, (cfg, _s_loads(cfg, t, win), cfg.I, win, t.sq, "p4_s")))
    _phase34_rows(cfg, t.launch, blk, first, tiles, groups, 0, x_op, t.gq, geo.k3, side, "p3")


def _p4_dst(cfg: BwdKernelConfig, t: LaunchTensors, blk: BlockIndices, c0: int, n: int,
            it: int) -> Any:  # fmt: skip
    """dW_d[e] rows of I tile `it`, columns ``[c0, c0+n)``."""
    return _ap(t.dwd, [[cfg.H, P], [1, n]], it * P * cfg.H + c0, blk.expert)


def _p4_loads(cfg: BwdKernelConfig, t: BlockTensors, blk: BlockIndices, first: bool,
              c0: int, n: int) -> tuple[Any, Any, list[Any]]:  # fmt: skip
    """Phase 4's loads for H columns ``[c0, c0+n)``: dY's operand and the output tiles."""
    yq, ysv = _load_q(t.yq, c0, n, "p4_y")
    if not cfg.dense:
        tiles = []
        for it in range(cfg.I // P):
            tiles.append((it, cfg.H // P + it))
        return yq, ysv, _rmw_olds(cfg, t.launch, blk, t.launch.dwd_rows, tiles, c0, n, "p4")
    olds = []
    for it in range(cfg.I // P):
        dst = _p4_dst(cfg, t.launch, blk, c0, n, it)
        olds.append(_rmw_load(cfg.compute_dtype, dst, first, n, "p4"))
    return yq, ysv, olds


def _phase4(
    cfg: BwdKernelConfig, geo: Geometry, t: BlockTensors, blk: BlockIndices, b: int
) -> None:
    """dW_d[e][i, h] += bf16(mx(S^T, dY)) per [128 i, <=512 h] tile (§6 P4), loads one column
    group ahead as in `_phase3`."""
    if not geo.Hc:
        return
    first = cfg.dense and b == 0
    bf = cfg.compute_dtype
    s_op = _stationary(t.sq, 0, cfg.I, "p4_sres")
    groups = []
    for c0 in range(geo.h0, geo.h0 + geo.Hc, NMAX):
        groups.append((c0, min(NMAX, geo.h0 + geo.Hc - c0)))
    if geo.res_moving and not geo.overlap:
        # row by row (`_phase34_rows`): dW_d[e] rows of each I tile, this core's H columns
        tiles = []
        for it in range(cfg.I // P):
            dst = _ap(t.launch.dwd, [[cfg.H, P], [1, geo.Hc]], it * P * cfg.H + geo.h0, blk.expert)
            tiles.append((it * P, t.launch.dwd_rows, (it, cfg.H // P + it), dst))
        _phase34_rows(
            cfg, t.launch, blk, first, tiles, groups, geo.h0, s_op, t.yq, geo.k4, [], "p4"
        )
        return
    nxt = _p4_loads(cfg, t, blk, first, groups[0][0], groups[0][1])
    for k in range(len(groups)):
        c0, n = groups[k]
        yq, ysv, olds = nxt
        if k + 1 < len(groups):
            nxt = _p4_loads(cfg, t, blk, first, groups[k + 1][0], groups[k + 1][1])
        for it in range(cfg.I // P):
            sq, ssv = _load_q(s_op, it * P, P, "p4_s")
            c_ps = nl.ndarray((P, n), dtype=nl.float32, buffer=nl.psum, name="p4_c")
            for ci in range(len(geo.k4)):
                v = geo.k4[ci].v
                nisa.nc_matmul_mx(
                    dst=c_ps, stationary=sq[0:v, ci, :], moving=yq[0:v, ci, :],
                    stationary_scale=ssv[ci], moving_scale=ysv[ci], accumulate=ci > 0,
                )  # fmt: skip
            _rmw(bf, _p4_dst(cfg, t.launch, blk, c0, n, it), c_ps, olds[it], n, "p4")


def _write_bias(cfg: BwdKernelConfig, geo: Geometry, t: LaunchTensors, blk: BlockIndices) -> None:
    """Bias grads: bf16 read-modify-write of this block's bf16 sums (§6 "Bias")."""
    bf = cfg.compute_dtype
    expert = blk.expert
    if geo.Hc:
        old = nl.ndarray((1, geo.Hc), dtype=bf, buffer=nl.sbuf, name="bd_old")
        dst = _ap(t.dbd, [[cfg.H, 1], [1, geo.Hc]], geo.h0, expert)
        nisa.dma_copy(dst=old, src=dst)
        nisa.tensor_tensor(dst=old, data1=old, data2=blk.acc_bd, op=nl.add)
        nisa.dma_copy(dst=dst, src=old)
    for n_it in range(geo.n_i):
        it = geo.i_lo + n_it
        for g in range(2):
            old = nl.ndarray((P, 1), dtype=bf, buffer=nl.sbuf, name="bgu_old")
            dst = _ap(t.dbgu, [[1, P], [1, 1]], g * cfg.I + it * P, expert)
            nisa.dma_copy(dst=old, src=dst)
            col = blk.acc_bgu[:, g, n_it : n_it + 1]
            nisa.tensor_tensor(dst=old, data1=old, data2=col, op=nl.add)
            nisa.dma_copy(dst=dst, src=old)
