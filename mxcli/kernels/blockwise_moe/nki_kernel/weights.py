"""The expert's phase-1/2 weight operands (package docstring, step 1): W_d and
W_gu brought into the wrapX layout by one 3-D ``dma_transpose`` per chunk and quantized on chip
(resident in SBUF or spilled to HBM scratch), or the pre-quantized inputs as they are; a
streamed W_gu quantized per phase-2 column group (`_wgu_group`).
"""

from __future__ import annotations

from typing import Any

import nki.isa as nisa
import nki.language as nl

from .operands import _ap, _hbm_operand, _load_q, _onchip_operand, _resident
from .plan import NMAX, BwdKernelConfig, Geometry, KTile, P, QLayout
from .quant import _quantize_chunk_to
from .state import LaunchTensors, MxOperand, Weights


def _quantize_weights(
    cfg: BwdKernelConfig,
    geo: Geometry,
    t: LaunchTensors,
    expert: Any,
    which: str = "both",
    w: Weights | None = None,
) -> Weights:
    """Phase-1/2 weight operands of the current expert (`Weights`): quantized on chip (into
    SBUF when resident, else into the HBM scratch), or the pre-quantized inputs themselves
    (loaded into SBUF once per block when resident). `which`: "d", "gu" or "both" (into `w`)."""
    if w is None:
        w = Weights()
    lo_d = geo.i_lo * P
    if which == "gu":
        pass
    elif cfg.pq_d:
        lay = QLayout(geo.k1, cfg.runs1, cfg.I, cfg.d_groups, cfg.d_place)
        data = t.down_proj_weight.view(cfg.x4_dtype)
        hq = _hbm_operand(data, t.down_weight_scales, lay, expert)
        w.d = _resident(hq, lo_d, geo.d_cols, "wd_res") if geo.res_d else hq
    elif geo.d_cols:
        # W_d[e] [I, H] -> lanes along H, columns i (this core's phase-1 I tiles)
        cols = []
        for j in range(geo.n_i):
            cols.append((lo_d + j * P, P))
        w.d = _quantize_weight(
            t.down_proj_weight, cfg.H, geo.k1, expert, cols, lo_d, geo.d_cols, t.wdq_s,
            cfg.compute_dtype, "wd",
        )  # fmt: skip
    if which == "d":
        pass
    elif cfg.pq_gu:
        lay = QLayout(geo.k2, cfg.runs2, cfg.H, cfg.gu_groups, cfg.gu_place)
        data = t.gate_up_proj_weight.view(cfg.x4_dtype)
        hq = _hbm_operand(data, t.gate_up_weight_scales, lay, expert)
        w.gu = _resident(hq, geo.h0, geo.Hc, "wgu_res") if geo.res_gu else hq
    elif geo.Hc:
        # W_gu[e] viewed [H, 2I]: lanes along 2I, columns h (this core's H range)
        cols = []
        for c0 in range(geo.h0, geo.h0 + geo.Hc, NMAX):
            cols.append((c0, min(NMAX, geo.h0 + geo.Hc - c0)))
        w.gu = _quantize_weight(
            t.gate_up_proj_weight, 2 * cfg.I, geo.k2, expert, cols, geo.h0, geo.Hc,
            t.wguq_s, cfg.compute_dtype, "wgu",
        )  # fmt: skip
    return w


def _quantize_weight(
    w: Any,
    K: int,
    tiles: tuple[Any, ...],
    expert: Any,
    cols: list[tuple[int, int]],
    c_lo: int,
    n_all: int,
    spill: MxOperand | None,
    bf: Any,
    name: str,
) -> MxOperand:
    """``w`` viewed per expert as ``[F, K]`` (row f, contraction k contiguous): each wrapX
    chunk is brought into the interleaved layout (lane p, column f, byte j <- w[f, k0 + j*v + p])
    by one 3-D ``dma_transpose`` (src ``[4, n, v]`` -> dst ``[v, n, 4]``) and quantized (bwd
    spec §5.4: W_d along H in phase 1, W_gu along 2I in phase 2), into a resident SBUF operand,
    or into the HBM scratch `spill`. Weights that are not bf16 are transposed in their own
    dtype and rounded to bf16 on chip (the DMA transpose does not cast)."""
    nk = len(tiles)
    res: Any = None
    if spill is None:
        # resident: scales packed four chunks to a tile (`_onchip_operand`)
        res = _onchip_operand(tiles, c_lo, n_all, f"{name}_res")
    for c0, n in cols:
        for i in range(nk):
            kt = tiles[i]
            ilv = _transpose_chunk(w, K, kt, expert, c0, n, bf, name)
            if spill is None:
                _quantize_chunk_to(ilv, kt, n, name, res, c0, i)
            else:
                _quantize_chunk_to(ilv, kt, n, name, spill, c0)
    if spill is not None:
        return spill
    return res


def _transpose_chunk(w: Any, K: int, kt: KTile, expert: Any, c0: int, n: int, bf: Any,
                     name: str) -> Any:  # fmt: skip
    """Rows ``[c0, c0+n)`` of the weight `w` (viewed ``[F, K]`` per expert) for wrapX chunk `kt`
    in the interleaved layout (`_quantize_weight`), bf16: one 3-D ``dma_transpose``, in the
    weight's own dtype and rounded on chip when it is not bf16 (the DMA does not cast)."""
    v = kt.v
    src = _ap(w, [[v, 4], [K, n], [1, v]], c0 * K + kt.k0, expert)
    ilv = nl.ndarray((P, n, 4), dtype=bf, buffer=nl.sbuf, name=f"{name}_ilv")
    if w.dtype == bf:
        nisa.dma_transpose(dst=ilv[0:v, :, :], src=src, axes=(2, 1, 0))
    else:
        raw = nl.ndarray((P, n, 4), dtype=w.dtype, buffer=nl.sbuf, name=f"{name}_raw")
        nisa.dma_transpose(dst=raw[0:v, :, :], src=src, axes=(2, 1, 0))
        nisa.tensor_copy(dst=ilv[0:v, :, :], src=raw[0:v, :, :])
    return ilv


def _wgu_group(cfg: BwdKernelConfig, geo: Geometry, t: LaunchTensors, expert: Any, c0: int,
               n: int) -> tuple[Any, list[Any]]:  # fmt: skip
    """Columns ``[c0, c0+n)`` of the expert's W_gu quantized on chip (`_wgu_fly`), as
    `_load_q` hands them out."""
    op = _onchip_operand(geo.k2, c0, n, "p2_wf")
    for i in range(len(geo.k2)):
        ilv = _wgu_load(cfg, geo, t, expert, (c0, n, i))
        _quantize_chunk_to(ilv, geo.k2[i], n, "p2_wf", op, c0, i)
    return _load_q(op, c0, n, "p2_wf")


def _wgu_pairs(cfg: BwdKernelConfig, geo: Geometry) -> list[tuple[int, int, int]]:
    """W_gu's (column start, columns, chunk) quantization steps, as in `_quantize_weights`."""
    out = []
    for c0 in range(geo.h0, geo.h0 + geo.Hc, NMAX):
        for i in range(len(geo.k2)):
            out.append((c0, min(NMAX, geo.h0 + geo.Hc - c0), i))
    return out


def _wgu_load(cfg: BwdKernelConfig, geo: Geometry, t: LaunchTensors, expert: Any,
              step: tuple[int, int, int]) -> Any:  # fmt: skip
    """One W_gu step's ``dma_transpose`` into the wrapX layout (`_quantize_weight`), bf16."""
    c0, n, i = step
    w = t.gate_up_proj_weight
    return _transpose_chunk(w, 2 * cfg.I, geo.k2[i], expert, c0, n, cfg.compute_dtype, "wgu")
