"""Phase 2 of a block (bwd spec §6 P2; package docstring step 3): the hidden-state grad
``R = bf16(mx([dG|dU], W_gu))`` per 128-token tile, scattered (or accumulated) into its rows,
and phase 3's operands (X rows and ``[dG|dU]`` quantized along the tokens) from the same
window's loads.
"""

from __future__ import annotations

from typing import Any

import nki.isa as nisa
import nki.language as nl

from .alloc import _run_zeros
from .indices import _gather_rows, _oob, _rows_src
from .operands import _load, _load_q, _onchip_operand, _store
from .phase1 import _write_affinity_grad
from .plan import NMAX, OLD_AHEAD_BUDGET, BwdKernelConfig, Geometry, P, _wgu_fly
from .quant import _quantize_tile, _rows_q, _rows_t_q
from .state import BlockIndices, BlockTensors, LaunchTensors, P2Loads, Phase1Out, Weights
from .weights import _wgu_group


def _block_phase2(
    cfg: BwdKernelConfig,
    geo: Geometry,
    t: BlockTensors,
    b: int,
    zero_jobs: list[Any],
    fr: Phase1Out,
) -> None:
    """Phase 2 of block `b` and phase 3's operands (`_block_phase1`'s `fr`); `zero_jobs`: output-
    zeroing DMAs to spread over its windows."""
    blk, w = fr.blk, fr.w
    nwin = cfg.B // cfg.W
    t.xq = t.launch.xq_hbm
    if geo.res_x:
        t.xq = _onchip_operand(geo.k3, geo.h0, geo.Hc, "p3_xres")
    if geo.res_moving:
        t.gq = _onchip_operand(geo.k3, 0, 2 * cfg.I, "p3_gres")
    # Without block overlap, a software pipeline over the windows: in program order window
    # w's phase-3 operands (PE transposes, then VectorE copies and quantization) come before
    # its phase-2 matmuls, and window w+1's phase-2 quantization after them, so that VectorE
    # prepares window w+1's matmul operand while the PE runs window w's matmuls (the other
    # order left the PE idle while VectorE worked through window w's transposes and w+1's
    # quantization). Where blocks overlap (`_geometry`), the matmuls come first: the next
    # block's phase 1 fills those gaps, and the hidden-grad write-backs start earlier (cost
    # model, `scripts/bench_nki.py`: Qwen3-30B-A3B 1.29 / 1.26 of the bound against 1.33 /
    # 1.37 the other way).
    pipelined = not geo.overlap
    nxt = _phase2_loads(cfg, geo, t, blk, b, 0, True)
    nxt_q = _phase2_quant(cfg, geo, nxt) if geo.Hc and pipelined else None
    for win in range(nwin):
        pre, q = nxt, nxt_q
        if win + 1 < nwin:
            nxt = _phase2_loads(cfg, geo, t, blk, b, win + 1, geo.x_ahead)
        nz = len(zero_jobs)
        _run_zeros(t.launch, zero_jobs[(win * nz) // nwin : ((win + 1) * nz) // nwin])
        if pipelined:
            _phase34_operands(cfg, geo, t, blk, b, win, pre)
            if win + 1 < nwin and not geo.x_ahead:
                # window w+1's X rows once window w's are last read (`X_AHEAD_BUDGET`)
                nxt.x = _phase3_x_rows(cfg, geo, t.launch, blk, b, win + 1)
            _phase2(cfg, geo, t, blk, w, b, win, pre, q)
            if win + 1 < nwin and geo.Hc:
                nxt_q = _phase2_quant(cfg, geo, nxt)
        else:
            q = _phase2_quant(cfg, geo, pre) if geo.Hc else None
            _phase2(cfg, geo, t, blk, w, b, win, pre, q)
            _phase34_operands(cfg, geo, t, blk, b, win, pre)
            if win + 1 < nwin and not geo.x_ahead:
                nxt.x = _phase3_x_rows(cfg, geo, t.launch, blk, b, win + 1)
        if win == 0 and not geo.overlap:
            # the affinity grad (core 0 reads both cores' partials) once window 0 is under
            # way: right after the hand-over its small dependent DMAs would hold the queue
            # phase 2's first loads wait in (where blocks overlap, phase 1 ends during the
            # previous block's phases 3/4 instead, and it goes there)
            _write_affinity_grad(cfg, geo, t, blk, b)
    # S quantized along the tokens during phase 3 (W_gu is no longer live: SBUF room for S on
    # chip)
    t.sq = t.launch.sq_hbm
    if geo.res_s:
        t.sq = _onchip_operand(geo.k4, 0, cfg.I, "p4_sres")


def _phase2_quant(cfg: BwdKernelConfig, geo: Geometry, pre: P2Loads) -> tuple[Any, Any]:
    """Phase 2's stationary ``[dG|dU]`` of a window, quantized along 2I from its row tiles
    (`_phase2_loads`): one VectorE copy per chunk interleaves the rows into the wrapX layout."""
    Wn = cfg.W
    bf = cfg.compute_dtype
    ntk = len(geo.k2)
    gq = nl.ndarray((P, ntk, Wn), dtype=nl.float8_e4m3fn_x4, buffer=nl.sbuf, name="p2_gq")
    gs = nl.ndarray((P, ntk, Wn), dtype=nl.uint8, buffer=nl.sbuf, name="p2_gs")
    for ci in range(ntk):
        kt = geo.k2[ci]
        v = kt.v
        rows = pre.rows[ci]
        ilv = nl.ndarray((P, Wn, 4), dtype=bf, buffer=nl.sbuf, name="p2_ilv")
        nisa.tensor_copy(dst=ilv[0:v, :, :], src=rows[0:v, :, :].permute((0, 2, 1)))
        _quantize_tile(ilv, kt, Wn, gq[0:v, ci, :], gs[0:v, ci, :])
    return gq, gs


def _phase2(
    cfg: BwdKernelConfig,
    geo: Geometry,
    t: BlockTensors,
    blk: BlockIndices,
    w: Weights,
    b: int,
    win: int,
    pre: P2Loads,
    q: Any,
) -> None:
    """R = bf16(mx([dG|dU], W_gu)) per 128-token tile, into the hidden-state grad (§6 P2), on
    the window's loads `pre` (`_phase2_loads`) and its quantized ``[dG|dU]`` `q`
    (`_phase2_quant`)."""
    nTw = cfg.W // P
    if not geo.Hc:
        return
    bf = cfg.compute_dtype
    hsg = t.launch.hsg
    hold = pre.hsg_old
    if cfg.accumulate and blk.tok is not None and hold is None:
        hold = _hsg_old(cfg, geo, t.launch, blk, b, win)
    groups = []
    for c0 in range(geo.h0, geo.h0 + geo.Hc, NMAX):
        groups.append((c0, min(NMAX, geo.h0 + geo.Hc - c0)))
    fly = _wgu_fly(cfg, geo)
    if not fly and w.gu.layout is None:
        # resident W_gu: per token tile all column groups, then one write-back of the whole
        # row range (Hc-element runs instead of 512: nki-dma-bandwidth-guide.rst, 1 KiB runs
        # ~67% of peak, 4 KiB ~89%)
        for tt in range(nTw):
            r = nl.ndarray((P, geo.Hc), dtype=bf, buffer=nl.sbuf, name="p2_rb")
            for c0, n in groups:
                r_ps = _p2_tile(geo, q, _load_q(w.gu, c0, n, "p2_w"), tt, n)
                o = c0 - geo.h0
                nisa.tensor_copy(dst=r[:, o : o + n], src=r_ps, engine=nisa.engine.scalar)
            _p2_write(cfg, geo, blk, hsg, hold, b, win, tt, r, geo.h0, geo.Hc)
        return
    # streamed W_gu: each column group's load (or on-chip quantization, `_wgu_fly`) issued one
    # group ahead of its matmuls where a second group fits (`_geometry`)
    nxt_w = _p2_weights(cfg, geo, t.launch, blk, w, groups[0][0], groups[0][1], fly)
    for k in range(len(groups)):
        c0, n = groups[k]
        if k > 0 and not geo.w2_ahead:
            nxt_w = _p2_weights(cfg, geo, t.launch, blk, w, c0, n, fly)
        wk = nxt_w
        if k + 1 < len(groups) and geo.w2_ahead:
            nxt_w = _p2_weights(cfg, geo, t.launch, blk, w, groups[k + 1][0], groups[k + 1][1], fly)
        for tt in range(nTw):
            r_ps = _p2_tile(geo, q, wk, tt, n)
            r = nl.ndarray((P, n), dtype=bf, buffer=nl.sbuf, name="p2_rb")
            nisa.tensor_copy(dst=r, src=r_ps, engine=nisa.engine.scalar)
            _p2_write(cfg, geo, blk, hsg, hold, b, win, tt, r, c0, n)


def _p2_tile(geo: Geometry, q: Any, wk: tuple[Any, list[Any]], tt: int, n: int) -> Any:
    """R of token tile `tt` against one W_gu column group `wk` (``n`` columns), fp32 in PSUM:
    the MX matmuls accumulated over the 2I chunks of the quantized ``[dG|dU]`` `q`."""
    gq, gs = q
    wq, wsv = wk
    r_ps = nl.ndarray((P, n), dtype=nl.float32, buffer=nl.psum, name="p2_r")
    for ci in range(len(geo.k2)):
        v = geo.k2[ci].v
        nisa.nc_matmul_mx(
            dst=r_ps, stationary=gq[0:v, ci, tt * P : (tt + 1) * P], moving=wq[0:v, ci, :],
            stationary_scale=gs[0:v, ci, tt * P : (tt + 1) * P], moving_scale=wsv[ci],
            accumulate=ci > 0,
        )  # fmt: skip
    return r_ps


def _p2_weights(cfg: BwdKernelConfig, geo: Geometry, t: LaunchTensors, blk: BlockIndices,
                w: Weights, c0: int, n: int, fly: bool) -> tuple[Any, list[Any]]:  # fmt: skip
    """A streamed W_gu's columns ``[c0, c0+n)`` for phase 2's matmuls."""
    if fly:
        return _wgu_group(cfg, geo, t, blk.expert, c0, n)
    return _load_q(w.gu, c0, n, "p2_w")


def _p2_write(
    cfg: BwdKernelConfig,
    geo: Geometry,
    blk: BlockIndices,
    hsg: Any,
    hold: Any,
    b: int,
    win: int,
    tt: int,
    r: Any,
    c0: int,
    n: int,
) -> None:
    """Write token tile `tt` of window `win`'s R (bf16 ``[P, n]``, columns ``[c0, c0+n)``) into
    the hidden-state grad: stored (dense), scattered, or added to the old rows `hold` and
    scattered (accumulating)."""
    gtt = win * (cfg.W // P) + tt
    if blk.tok is None:
        r0 = b * cfg.B + gtt * P
        _store(hsg[r0 : r0 + P, c0 : c0 + n], r)
        return
    if cfg.accumulate:
        # read-add-write in bf16 (one token per row of a block, bwd spec §3.2); the rows were
        # gathered before the window's scatters (`_hsg_old`)
        o = c0 - geo.h0
        nisa.tensor_tensor(dst=r, data1=hold[:, tt, o : o + n], data2=r, op=nl.add)
    dst = _rows_src(cfg, blk, hsg, b, gtt, c0, n)
    nisa.dma_copy(dst=dst, src=r, oob_mode=_oob(cfg))


def _phase2_loads(
    cfg: BwdKernelConfig,
    geo: Geometry,
    t: BlockTensors,
    blk: BlockIndices,
    b: int,
    win: int,
    with_x: bool,
) -> P2Loads:
    """What phases 2 and 3/4's operands read from HBM for window `win`, issued one window
    ahead (see `_phase1_loads`): ``[dG|dU]^T`` row tiles (one ``[v, 4, W]`` per 2I chunk, also
    phase 3's operand) and, with `with_x`, X rows (`_phase3_x_rows`; else the caller gathers
    them later)."""
    Wn, nTw, w0 = cfg.W, cfg.W // P, win * cfg.W
    bf = cfg.compute_dtype
    out = P2Loads([])
    if not geo.Hc:
        return out
    for ci in range(len(geo.k2)):
        kt = geo.k2[ci]
        v = kt.v
        # The chunk's 4 row groups as whole rows (lane p, group j <- dgu_s[k0 + j*v + p]):
        # one DMA of contiguous Wn-element runs, then one engine copy interleaves them into
        # the wrapX layout. A DMA straight into ilv[..., j] would write 2-byte elements at a
        # 4-element stride, one descriptor per element (nki-dma-bandwidth-guide.rst: runs
        # under 256 B are overhead-bound).
        rows = nl.ndarray((P, 4, Wn), dtype=bf, buffer=nl.sbuf, name="p2_rows")
        src = t.dgu_s.ap([[cfg.B, v], [v * cfg.B, 4], [1, Wn]], offset=kt.k0 * cfg.B + w0)
        _load(rows[0:v, :, :], src)
        out.rows.append(rows)
    if with_x:
        out.x = _phase3_x_rows(cfg, geo, t.launch, blk, b, win)
    if cfg.accumulate and blk.tok is not None and 4 * nTw * geo.Hc * 2 <= OLD_AHEAD_BUDGET:
        out.hsg_old = _hsg_old(cfg, geo, t.launch, blk, b, win)
    return out


def _phase3_x_rows(
    cfg: BwdKernelConfig, geo: Geometry, t: LaunchTensors, blk: BlockIndices, b: int, win: int
) -> Any:
    """Window `win`'s X rows (``[P, W/P, Hc]``, gathered), phase 3's stationary operand."""
    nTw = cfg.W // P
    x = nl.ndarray((P, nTw, geo.Hc), dtype=cfg.compute_dtype, buffer=nl.sbuf, name="p3_x_rows")
    for j in range(nTw):
        _gather_rows(
            cfg, blk, x[:, j, :], t.hidden_states, b, win * nTw + j, geo.h0, geo.Hc,
            nisa.engine.gpsimd,
        )  # fmt: skip
    return x


def _hsg_old(
    cfg: BwdKernelConfig, geo: Geometry, t: LaunchTensors, blk: BlockIndices, b: int, win: int
) -> Any:
    """The hidden-grad rows window `win` adds to (``[P, W/P, Hc]``), gathered before any of its
    scatters: gathered per tile between the scatters, each gather would wait in the gather
    queue for the previous tile's scatter. The block's tokens are distinct (bwd spec §3.2),
    so no row gathered here is scattered earlier in the block. Issued with the window's loads
    (a window ahead) where two windows' rows and X rows fit `OLD_AHEAD_BUDGET`, else at the
    start of the window's phase 2."""
    nTw = cfg.W // P
    old = nl.ndarray((P, nTw, geo.Hc), dtype=cfg.compute_dtype, buffer=nl.sbuf, name="p2_old")
    for j in range(nTw):
        _gather_rows(
            cfg, blk, old[:, j, :], t.hsg, b, win * nTw + j, geo.h0, geo.Hc,
            nisa.engine.gpsimd,
        )  # fmt: skip
    return old


def _phase34_operands(
    cfg: BwdKernelConfig,
    geo: Geometry,
    t: BlockTensors,
    blk: BlockIndices,
    b: int,
    win: int,
    pre: P2Loads,
) -> None:
    """Phase-3 operands of window `win` quantized along the tokens from its loads `pre`
    (`_phase2_loads`): X (gathered rows) and [dG|dU] (phase 2's rows, transposed). dY's came
    with phase 1; S's follow phase 2 (`_phase3`)."""
    if not geo.Hc:
        return
    _rows_q(cfg, pre.x, 0, win, t.xq, geo.Hc, geo.h0, "p3_x")
    _rows_t_q(cfg, geo, pre.rows, win, t.gq, "p3_g")
