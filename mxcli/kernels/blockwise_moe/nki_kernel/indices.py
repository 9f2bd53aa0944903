"""A block's indices (bwd spec §3.1, §4.1; package docstring step 0): token ids, affinity
indices and affinities, and the read-modify-write row offsets of its weight grads
(`_rmw_index`); gathers of token rows through them.
"""

from __future__ import annotations

from typing import Any

import nki.isa as nisa
import nki.language as nl

from .operands import _index_dma
from .plan import ZCOLS, BwdKernelConfig, P
from .state import BlockIndices, LaunchTensors


def _oob(cfg: BwdKernelConfig) -> Any:
    return nisa.oob_mode.skip if cfg.skip_token or cfg.nv else nisa.oob_mode.error


def _rows_src(
    cfg: BwdKernelConfig, blk: BlockIndices, src: Any, b: int, tt: int, c0: int, n: int
) -> Any:
    """Rows of token tile `tt` of block `b` of a ``[T, H]`` tensor, columns ``[c0, c0+n)``:
    an indirect view (routed / dense with a token count) or a plain slice (dense)."""
    tok = blk.tok
    if tok is None:
        r0 = b * cfg.B + tt * P
        return src[r0 : r0 + P, c0 : c0 + n]
    return src.ap(
        [[cfg.H, P], [1, n]], offset=c0, vector_offset=tok[:, tt : tt + 1], indirect_dim=0
    )


def _gather_rows(
    cfg: BwdKernelConfig,
    blk: BlockIndices,
    dst: Any,
    src: Any,
    b: int,
    tt: int,
    c0: int,
    n: int,
    zero_engine: Any = None,
    zero: Any = None,
) -> None:
    """dst ``[P, n]`` <- token rows (padding rows 0, zeroed first on `zero_engine`: VectorE by
    default, GpSimd where it is otherwise idle; ScalarE, which has no memset, copies them
    from the zero tile `zero`)."""
    if blk.tok is not None:
        if zero_engine is None:
            nisa.memset(dst=dst, value=0.0)
        elif zero is not None:
            for z0 in range(0, n, ZCOLS):
                nz = min(ZCOLS, n - z0)
                nisa.tensor_copy(dst=dst[:, z0 : z0 + nz], src=zero[:, 0:nz], engine=zero_engine)
        else:
            nisa.memset(dst=dst, value=0.0, engine=zero_engine)
        nisa.dma_copy(dst=dst, src=_rows_src(cfg, blk, src, b, tt, c0, n), oob_mode=_oob(cfg))
    else:
        nisa.dma_copy(dst=dst, src=_rows_src(cfg, blk, src, b, tt, c0, n))


def _indices_load(cfg: BwdKernelConfig, t: LaunchTensors, b: int) -> BlockIndices:
    """The index loads of block `b` (token ids, expert id), as the `BlockIndices` that
    `_setup_indices` completes. The three stages (loads, integer
    ops and gathers, `_rmw_index_finish`) are issued at three points of the previous block
    (`blockwise_mm_bwd_mxfp8_nki`): each waits for DMAs issued a phase earlier, so that no
    in-order engine stalls on the chain's DMA latencies."""
    NT = cfg.B // P
    blk = BlockIndices()
    if not cfg.dense:
        # tok[p, t] = token_position_to_id[b*B + t*P + p]
        tok = nl.ndarray((P, NT), dtype=nl.int32, buffer=nl.sbuf, name="tok")
        _index_dma(tok, t.token_position_to_id.ap([[1, P], [P, NT]], offset=b * cfg.B))
        ecol = nl.ndarray((P, 1), dtype=nl.int32, buffer=nl.sbuf, name="expert_col")
        _index_dma(ecol, t.block_to_expert.ap([[0, P], [1, 1]], offset=b))
        blk.expert = ecol[0:1, 0:1]
        blk.tok = tok
        blk.ecol = ecol
    return blk


def _setup_indices(cfg: BwdKernelConfig, t: LaunchTensors, blk: BlockIndices, b: int) -> None:
    """Affinity indices and affinities of block `b` (bwd spec §3.1, §4.1) from its loads
    `blk` (`_indices_load`), and `_rmw_index`'s integer ops."""
    NT = cfg.B // P
    if not cfg.dense:
        tok = blk.tok
        ecol = blk.ecol
        if cfg.skip_token:
            # every padding id below 0 becomes -1, the skipped index (upstream's convention)
            nisa.tensor_scalar(dst=tok, data=tok, op0=nl.maximum, operand0=-1.0)
        # ea_idx = tok*E + e: the multiply with an fp32 operand (exact below 2^24), then an
        # int32 add of the expert id column; padding -> negative (clamped to -1) or >= T*E
        addr = nl.ndarray((P, NT), dtype=nl.int32, buffer=nl.sbuf, name="ea_addr")
        nisa.tensor_scalar(dst=addr, data=tok, op0=nl.multiply, operand0=float(cfg.E))
        ea_idx = nl.ndarray((P, NT), dtype=nl.int32, buffer=nl.sbuf, name="ea_idx")
        for tt in range(NT):
            nisa.tensor_tensor(
                dst=ea_idx[:, tt : tt + 1], data1=addr[:, tt : tt + 1], data2=ecol, op=nl.add
            )
        if cfg.skip_token:
            nisa.tensor_scalar(dst=ea_idx, data=ea_idx, op0=nl.maximum, operand0=-1.0)
        blk.ea_idx = ea_idx
    elif cfg.nv:
        # dense with a token count: positions >= count become padding (-1)
        pos = nl.ndarray((P, NT), dtype=nl.float32, buffer=nl.sbuf, name="pos")
        nisa.iota(dst=pos, pattern=[[P, NT]], offset=b * cfg.B, channel_multiplier=1)
        valid = nl.ndarray((P, NT), dtype=nl.float32, buffer=nl.sbuf, name="valid")
        nisa.tensor_scalar(dst=valid, data=pos, op0=nl.less, operand0=t.nv_col)
        idx_f = nl.ndarray((P, NT), dtype=nl.float32, buffer=nl.sbuf, name="idx_f")
        nisa.scalar_tensor_tensor(
            dst=idx_f, data=pos, op0=nl.add, operand0=1.0, op1=nl.multiply, operand1=valid
        )
        tok = nl.ndarray((P, NT), dtype=nl.int32, buffer=nl.sbuf, name="tok")
        nisa.tensor_scalar(dst=tok, data=idx_f, op0=nl.subtract, operand0=1.0)
        blk.tok = tok
        blk.ea_idx = tok  # E == 1
    # alpha per token (fp32, 0 for padding), then broadcast along the free axis via HBM
    alpha_tok = nl.ndarray((P, NT), dtype=nl.float32, buffer=nl.sbuf, name="alpha_tok")
    ea = t.expert_affinities_masked
    if blk.ea_idx is not None:
        nisa.memset(dst=alpha_tok, value=0.0)
        for tt in range(NT):
            nisa.dma_copy(
                dst=alpha_tok[:, tt : tt + 1],
                src=ea.ap(
                    [[1, P], [1, 1]], offset=0, vector_offset=blk.ea_idx[:, tt : tt + 1],
                    indirect_dim=0,
                ),
                oob_mode=_oob(cfg),
            )  # fmt: skip
    else:
        nisa.dma_copy(dst=alpha_tok, src=ea.ap([[1, P], [P, NT]], offset=b * cfg.B))
    _index_dma(t.alpha_s.ap([[1, P], [P, NT]], offset=0), alpha_tok)
    blk.alpha_tok = alpha_tok
    if not cfg.dense:
        _rmw_index(cfg, t, blk, b)


def _rmw_index(cfg: BwdKernelConfig, t: LaunchTensors, blk: BlockIndices, b: int) -> None:
    """Routed block `b`: whether an earlier block had its expert ``e`` (the flag ``seen_s[e]``,
    then set), and from it the row offsets `_rmw_index_finish` completes: per partition, the
    row of ``dW_gu[e]`` / ``dW_d[e]`` (as the expert-major row views ``[E*H, 2I]`` /
    ``[E*I, H]``) that each phase-3/4 tile reads for its read-modify-write, or -1 where the
    block is its expert's first.

    Those rows still hold the zeros of `_init_outputs`, so the read is skipped (``oob_mode.skip``
    into a zeroed tile: the sum starts from +0 as in bwd spec §4.3) and moves no bytes. Block
    0 is always its expert's first and reads nothing (`_rmw_olds`). The work per block does
    not depend on N (one flag lookup), and the two offsets reach every partition through a
    2-element HBM scratch (stride-0 read)."""
    big = max(cfg.H, cfg.I)  # > every row in rmw_rows: rows - big < 0, skipped
    e = blk.expert
    flag = t.seen_s.ap([[1, 1], [1, 1]], offset=0, scalar_offset=e, indirect_dim=0)
    seen = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf, name="rmw_seen")
    _index_dma(seen, flag)
    _index_dma(flag, t.seen_one)
    # off = (e*F + big) * seen - big: e*F when seen, else -big (int32, exact below 2^24)
    off = nl.ndarray((1, 2), dtype=nl.int32, buffer=nl.sbuf, name="rmw_off")
    for j, F in ((0, cfg.H), (1, cfg.I)):
        col = off[0:1, j : j + 1]
        nisa.tensor_scalar(
            dst=col, data=e, op0=nl.multiply, operand0=float(F), op1=nl.add, operand1=float(big)
        )
        nisa.tensor_tensor(dst=col, data1=col, data2=seen, op=nl.multiply)
    nisa.tensor_scalar(dst=off, data=off, op0=nl.subtract, operand0=float(big))
    _index_dma(t.rmw_s.ap([[2, 1], [1, 2]], offset=0), off)


def _rmw_index_finish(cfg: BwdKernelConfig, t: LaunchTensors, blk: BlockIndices) -> None:
    """`_rmw_index`'s two offsets read back onto every partition and added to the rows."""
    nh, ni = cfg.H // P, cfg.I // P
    offb = nl.ndarray((P, nh + ni), dtype=nl.int32, buffer=nl.sbuf, name="rmw_offb")
    _index_dma(offb[:, 0:nh], t.rmw_s.ap([[0, P], [0, nh]], offset=0))
    _index_dma(offb[:, nh : nh + ni], t.rmw_s.ap([[0, P], [0, ni]], offset=1))
    idx = nl.ndarray((P, nh + ni), dtype=nl.int32, buffer=nl.sbuf, name="rmw_idx")
    nisa.tensor_tensor(dst=idx, data1=t.rmw_rows, data2=offb, op=nl.add)
    # a skipped row is marked -1 (oob_mode.skip, as the token ids in `_setup_indices`)
    nisa.tensor_scalar(dst=idx, data=idx, op0=nl.maximum, operand0=-1.0)
    blk.rmw_idx = idx
