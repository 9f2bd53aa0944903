"""Launch setup: the output tensors, the HBM scratch (the two sets of phase-1 -> phase-2
hand-over tensors alternate between blocks, `_block_tensors`), the constant tiles, and the
DMAs zeroing what this core later updates (bwd spec §4.3).
"""

from __future__ import annotations

from typing import Any

import nki.isa as nisa
import nki.language as nl

from .operands import _hbm_operand, _index_dma
from .plan import ZCOLS, BwdKernelConfig, Geometry, P, QLayout
from .state import BlockTensors, LaunchTensors, MxOperand


def _alloc_outputs(cfg: BwdKernelConfig, t: LaunchTensors) -> None:
    sh = nl.shared_hbm
    bf = cfg.compute_dtype
    t.hsg = nl.ndarray(
        (cfg.T, cfg.H), dtype=t.hidden_states.dtype, buffer=sh, name="hidden_states_grad"
    )
    t.dea = nl.ndarray(
        (cfg.T * cfg.E, 1), dtype=t.expert_affinities_masked.dtype, buffer=sh,
        name="expert_affinities_masked_grad",
    )  # fmt: skip
    t.dwgu = nl.ndarray(
        (cfg.E, cfg.H, 2, cfg.I), dtype=bf, buffer=sh, name="gate_up_proj_weight_grad"
    )
    t.dwd = nl.ndarray((cfg.E, cfg.I, cfg.H), dtype=bf, buffer=sh, name="down_proj_weight_grad")
    # row views (expert-major rows) for the indirect weight-gradient reads (`_rmw_index`)
    t.dwgu_rows = t.dwgu.reshape((cfg.E * cfg.H, 2 * cfg.I))
    t.dwd_rows = t.dwd.reshape((cfg.E * cfg.I, cfg.H))
    if cfg.bias:
        t.dbgu = nl.ndarray(
            (cfg.E, 2, cfg.I), dtype=bf, buffer=sh, name="gate_and_up_proj_bias_grad"
        )
        t.dbd = nl.ndarray((cfg.E, cfg.H), dtype=bf, buffer=sh, name="down_proj_bias_grad")


def _scratch_operand(
    rows: int, F: int, tiles: tuple[Any, ...], runs: tuple[tuple[int, int], ...], name: str
) -> MxOperand:
    """A private-HBM quantized operand ``[rows, F]`` (x4 data + unpacked scales)."""
    pr = nl.private_hbm
    data = nl.ndarray((rows, F), dtype=nl.float8_e4m3fn_x4, buffer=pr, name=name)
    scales = nl.ndarray((rows, F), dtype=nl.uint8, buffer=pr, name=f"{name}_s")
    return _hbm_operand(data, scales, QLayout(tiles, runs, F, (), ()), None)


def _alloc_scratch(cfg: BwdKernelConfig, geo: Geometry, t: LaunchTensors) -> None:
    sh = nl.shared_hbm
    # phase-1 -> phase-2 hand-over (both cores read all of it): bf16 [2I, B], [I, B], fp32
    # affinity-grad partials [lnc, B]
    bf = cfg.compute_dtype
    # Two sets, used by alternate blocks (`_block_tensors`): block b+1's phase 1 runs during
    # block b's phases 3/4 (`blockwise_mm_bwd_mxfp8_nki`), while block b still reads its set.
    t.dgu_s2 = []
    t.s_s2 = []
    t.da_s2 = []
    t.yq2 = []
    for k in range(min(2, cfg.N)):
        t.dgu_s2.append(
            nl.ndarray((2 * cfg.I, cfg.B), dtype=bf, buffer=sh, name=f"dgu_T_scratch{k}")
        )
        t.s_s2.append(nl.ndarray((cfg.I, cfg.B), dtype=bf, buffer=sh, name=f"s_T_scratch{k}"))
        t.da_s2.append(
            nl.ndarray((geo.lnc, cfg.B), dtype=nl.float32, buffer=sh, name=f"da_scratch{k}")
        )
    t.alpha_s = nl.ndarray((cfg.B,), dtype=nl.float32, buffer=nl.private_hbm, name="alpha_s")
    # the block's two weight-gradient row offsets, broadcast through HBM (`_rmw_index`)
    t.rmw_s = nl.ndarray((2,), dtype=nl.int32, buffer=nl.private_hbm, name="rmw_offset_s")
    t.seen_s = nl.ndarray((cfg.E,), dtype=nl.int32, buffer=nl.private_hbm, name="seen_s")
    t.knock_s = nl.ndarray((cfg.E,), dtype=nl.int32, buffer=nl.private_hbm, name="knock_s")
    # quantized phase-3/4 operands, token lanes (rows = B/4), unpacked scales
    rows = cfg.B // 4
    # (X and S when they stay on chip are allocated per block, see `_block_phase2`)
    t.xq_hbm = None
    t.sq_hbm = None
    if not geo.res_x:
        t.xq_hbm = _scratch_operand(rows, cfg.H, geo.k3, cfg.runs3, "xq")
    t.gq_hbm = None
    if not geo.res_moving:
        t.gq_hbm = _scratch_operand(rows, 2 * cfg.I, geo.k3, cfg.runs3, "dguq")
    for k in range(min(2, cfg.N)):
        y: Any = None
        if not geo.res_moving:
            y = _scratch_operand(rows, cfg.H, geo.k4, cfg.runs4, f"dyq{k}")
        t.yq2.append(y)
    if not geo.res_s:
        t.sq_hbm = _scratch_operand(rows, cfg.I, geo.k4, cfg.runs4, "sq")
    # quantized weights of the current expert when they are streamed (not resident)
    t.wdq_s = None
    t.wguq_s = None
    if not cfg.pq_d and not geo.res_d:
        t.wdq_s = _scratch_operand(cfg.H // 4, cfg.I, geo.k1, cfg.runs1, "wdq")
    if not cfg.pq_gu and not geo.res_gu and cfg.dense:
        # (routed launches quantize a streamed W_gu per phase-2 column group, `_wgu_fly`)
        t.wguq_s = _scratch_operand(2 * cfg.I // 4, cfg.H, geo.k2, cfg.runs2, "wguq")


def _constants(cfg: BwdKernelConfig, t: LaunchTensors) -> None:
    bf = cfg.compute_dtype
    t.zero = nl.ndarray((P, ZCOLS), dtype=bf, buffer=nl.sbuf, name="zero")
    nisa.memset(dst=t.zero, value=0.0)
    t.ones_f32 = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf, name="ones_f32")
    nisa.memset(dst=t.ones_f32, value=1.0)
    t.ones_bf = nl.ndarray((P, 1), dtype=bf, buffer=nl.sbuf, name="ones_bf")
    nisa.memset(dst=t.ones_bf, value=1.0)
    t.nv_col = None
    if not cfg.dense:
        _rmw_constants(cfg, t)
    if cfg.nv:
        # count clamped to [0, T] (API reference), broadcast to every partition, fp32
        nvi = nl.ndarray((P, 1), dtype=nl.int32, buffer=nl.sbuf, name="nv_i")
        nisa.dma_copy(dst=nvi, src=t.num_valid_tokens.ap([[0, P], [1, 1]], offset=0))
        nv_col = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf, name="nv_f")
        nisa.tensor_scalar(
            dst=nv_col, data=nvi, op0=nl.minimum, operand0=float(cfg.T),
            op1=nl.maximum, operand1=0.0,
        )  # fmt: skip
        t.nv_col = nv_col


def _rmw_constants(cfg: BwdKernelConfig, t: LaunchTensors) -> None:
    """Launch state of `_rmw_index`: the per-expert "has had a block" flags (int32, zeroed),
    a one to set them with, and the output rows each partition reads for every tile of phase
    3 (``ht*P + p``, all H tiles) and phase 4 (``it*P + p``), before the expert's offset."""
    nh, ni = cfg.H // P, cfg.I // P
    z = nl.ndarray((1, cfg.E), dtype=nl.int32, buffer=nl.sbuf, name="seen_zero")
    nisa.memset(dst=z, value=0)
    _index_dma(t.seen_s.ap([[cfg.E, 1], [1, cfg.E]], offset=0), z)
    one = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf, name="seen_one")
    nisa.memset(dst=one, value=1)
    rows = nl.ndarray((P, nh + ni), dtype=nl.int32, buffer=nl.sbuf, name="rmw_rows")
    nisa.iota(dst=rows[:, 0:nh], pattern=[[P, nh]], offset=0, channel_multiplier=1)
    nisa.iota(dst=rows[:, nh : nh + ni], pattern=[[P, ni]], offset=0, channel_multiplier=1)
    t.seen_one = one
    t.rmw_rows = rows


def _zero_unused_experts(cfg: BwdKernelConfig, geo: Geometry, t: LaunchTensors) -> None:
    """Zero this core's part of the weight grads of every expert no block had (bwd spec §4.3),
    once the last block's `_rmw_index` has set the flags: scatters from the zero tile whose
    rows are all skipped (-1) for an expert that had a block, so those move no bytes.

    Per expert, the rows of its tiles (``e*H + ht*P + p``, ``e*I + it*P + p``) plus
    ``-big * seen[e]`` (negative for a seen expert, clamped to -1); ``seen`` reaches every
    partition through HBM, converted to the fp32 per-partition operand on the way."""
    E, ni, I2 = cfg.E, cfg.I // P, 2 * cfg.I
    big = E * max(cfg.H, cfg.I)  # > every row of the row views
    sv = nl.ndarray((1, E), dtype=nl.int32, buffer=nl.sbuf, name="unused_seen")
    _index_dma(sv, t.seen_s.ap([[E, 1], [1, E]], offset=0))
    nisa.tensor_scalar(dst=sv, data=sv, op0=nl.multiply, operand0=float(-big))
    _index_dma(t.knock_s.ap([[E, 1], [1, E]], offset=0), sv)
    kf = nl.ndarray((P, E), dtype=nl.float32, buffer=nl.sbuf, name="unused_knock")
    nisa.dma_copy(dst=kf, src=t.knock_s.ap([[0, P], [1, E]], offset=0))
    z = t.zero
    for e in range(E):
        idx = nl.ndarray((P, geo.n_h + ni), dtype=nl.int32, buffer=nl.sbuf, name="unused_idx")
        if geo.n_h:
            nisa.iota(
                dst=idx[:, 0 : geo.n_h], pattern=[[P, geo.n_h]], offset=e * cfg.H + geo.h0,
                channel_multiplier=1,
            )  # fmt: skip
        nisa.iota(dst=idx[:, geo.n_h :], pattern=[[P, ni]], offset=e * cfg.I, channel_multiplier=1)
        nisa.tensor_scalar(
            dst=idx, data=idx, op0=nl.add, operand0=kf[:, e : e + 1], op1=nl.maximum,
            operand1=-1.0,
        )  # fmt: skip
        for j in range(geo.n_h):
            for c0 in range(0, I2, ZCOLS):
                n = min(ZCOLS, I2 - c0)
                dst = t.dwgu_rows.ap(
                    [[I2, P], [1, n]], offset=c0, vector_offset=idx[:, j : j + 1], indirect_dim=0
                )
                nisa.dma_copy(dst=dst, src=z[:, 0:n], oob_mode=nisa.oob_mode.skip)
        for it in range(ni):
            col = geo.n_h + it
            for c0 in range(geo.h0, geo.h0 + geo.Hc, ZCOLS):
                n = min(ZCOLS, geo.h0 + geo.Hc - c0)
                dst = t.dwd_rows.ap(
                    [[cfg.H, P], [1, n]], offset=c0, vector_offset=idx[:, col : col + 1],
                    indirect_dim=0,
                )  # fmt: skip
                nisa.dma_copy(dst=dst, src=z[:, 0:n], oob_mode=nisa.oob_mode.skip)


def _zeros_hbm(
    jobs: list[Any], dst: Any, offset: int, row_stride: int, nrows: int, ncols: int
) -> None:
    """Append the DMAs zeroing a ``[nrows, ncols]`` region (row stride `row_stride` elements)
    of an HBM tensor to `jobs`: ``(dst view, rows, cols)`` each."""
    for r0 in range(0, nrows, P):
        nr = min(P, nrows - r0)
        for c0 in range(0, ncols, ZCOLS):
            nc = min(ZCOLS, ncols - c0)
            view = dst.ap([[row_stride, nr], [1, nc]], offset=offset + r0 * row_stride + c0)
            jobs.append((view, nr, nc))


def _zeros_flat(jobs: list[Any], dst: Any, start: int, count: int) -> None:
    """Append the DMAs zeroing ``count`` contiguous elements from flat element `start`."""
    full = count // ZCOLS
    if full:
        _zeros_hbm(jobs, dst, start, ZCOLS, full, ZCOLS)
    rest = count - full * ZCOLS
    if rest:
        _zeros_hbm(jobs, dst, start + full * ZCOLS, rest, 1, rest)


def _run_zeros(t: LaunchTensors, jobs: list[Any]) -> None:
    """Issue zeroing DMAs (from the zero tile, static descriptors)."""
    z = t.zero
    for view, nr, nc in jobs:
        nisa.dma_copy(dst=view, src=z[0:nr, 0:nc])


def _init_outputs(cfg: BwdKernelConfig, geo: Geometry, t: LaunchTensors) -> list[Any]:
    """The DMAs zeroing what this core updates (bwd spec §4.3), as two lists: the hidden and
    affinity grads, and the weight and bias grads. Dense with a token count: the hidden and
    affinity grads only (rows past the count are then 0, as in the reference).
    The first block issues them spread over its phase-1 windows and phase-2 windows respectively
    (`_block_phase1`, `_block_phase2`): nothing touches the hidden grad before phase 2 or the weight grads before phase
    3, and a burst at the start would hold back the DMA engines phase 1 starts with. The
    weight grads are not zeroed here: an expert's first block writes every element of them
    (`_rmw_olds`), and `_zero_unused_experts` zeroes those of experts without a block."""
    jobs: list[Any] = []
    wjobs: list[Any] = []
    _zeros_hbm(jobs, t.hsg, geo.h0, cfg.H, cfg.T, geo.Hc)
    if geo.pid == 0:
        _zeros_flat(jobs, t.dea, 0, cfg.T * cfg.E)
    if cfg.dense:
        return [jobs, wjobs]
    for e in range(cfg.E):
        if cfg.bias:
            _zeros_hbm(wjobs, t.dbd, e * cfg.H + geo.h0, cfg.H, 1, geo.Hc)
            for g in range(2):
                for j in range(geo.n_i):
                    _zeros_flat(wjobs, t.dbgu, (e * 2 + g) * cfg.I + (geo.i_lo + j) * P, P)
    return [jobs, wjobs]


def _block_tensors(t: LaunchTensors, b: int) -> BlockTensors:
    """The tensors of block `b`: the launch's, with the scratch set of its parity (``dgu_s``,
    ``s_s``, ``da_s``, ``yq``) and the other set (``*_o``, for `_hand_over`)."""
    n = len(t.dgu_s2)
    k, o = b % n, (b + 1) % n
    return BlockTensors(
        launch=t, two_sets=n > 1, dgu_s=t.dgu_s2[k], s_s=t.s_s2[k], da_s=t.da_s2[k],
        yq=t.yq2[k], dgu_s_o=t.dgu_s2[o], s_s_o=t.s_s2[o], da_s_o=t.da_s2[o], yq_o=t.yq2[o],
        gq=t.gq_hbm,
    )  # fmt: skip
