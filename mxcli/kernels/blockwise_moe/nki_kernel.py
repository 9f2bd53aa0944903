"""NKI kernel of ``blockwise_mm_bwd_mxfp8`` for Trn3 (NeuronCore-v4), NKI 0.6 API.

MXFP8 backward of a blockwise, dropless MoE layer with SwiGLU experts. The numerics are those
of the torch reference beside this file (`backward.py`, bwd spec §4, §6); this module is the same
computation written as NKI instructions and runs unchanged on the real ``nki.simulate``, on
mxcli's interpreter (`mxcli.nkisim`) and on Trainium.

Import this module only with an ``nki`` package importable: the real one, or mxcli's interpreter
activated by `mxcli.kernels.nki_runtime` (never at package import time).

Dataflow of one block ``b`` of ``B`` token positions, expert ``e = block_to_expert[b]``
(bwd spec §4.2, §6; ``P = 128`` partitions, ``W = min(B, 512)`` tokens per window):

0. indices: ``tok [P, B/P]`` (position ``t*P + p`` on partition ``p``), ``ea_idx = tok*E + e``;
   padding ids (-1, or >= T) are out of bounds, so ``oob_mode.skip`` drops them from every
   indirect gather (rows stay 0) and scatter. ``alpha`` is gathered per token, then broadcast
   to all partitions through a small HBM scratch (stride-0 read).
1. weights: ``W_d[e]`` (contraction H) and ``W_gu[e]`` as ``[2I, H]`` (contraction 2I) are
   loaded transposed into the wrapX layout and quantized on chip, or taken pre-quantized (same
   layout, §5.5). They stay resident in SBUF for the block when they fit `RESIDENT_BUDGET`,
   else they are spilled to an HBM scratch (x4 data + e8m0 scales) and streamed per window.
   Dense mode quantizes them once for all blocks.
2. phase 1 per window: ``dY`` rows gathered (tokens on partitions), PE-transposed into the wrapX
   layout along H and ``quantize_mx``-ed; ``D^T [I, W] = mx(W_d, dY^T)`` per 128-row I tile
   (``nc_matmul_mx``, fp32 PSUM accumulation over the H chunks). SwiGLU backward on ``[i, tok]``
   tiles against the bf16 checkpoint (ScalarE ``silu``/``silu_dx``, VectorE products with the
   spec's bf16 rounding points), clamp masks, affinity grad ``sum_i D*Hm`` as a ones-matmul over
   the partitions. ``dG | dU`` and ``S`` (bf16, ``[2I, B]`` / ``[I, B]``) go to a shared HBM
   scratch: under LNC 2 phase 1 is split over I (SHARD_ON_FREE) and the halves meet there.
3. phase 2 per window: ``[dG|dU]^T`` loaded in the wrapX layout along 2I, quantized;
   ``R [W, H] = mx(dGU, W_gu)`` per 128-token tile; hidden-state grad rows scattered (or
   gathered, added in fp32, rounded to bf16 and scattered when accumulating).
4. phases 3/4 operands (contraction over the block's tokens): ``X`` and ``dY`` rows gathered,
   interleaved into the wrapX layout along tokens; ``dGU`` and ``S`` PE-transposed from the
   scratch; all quantized and spilled to HBM scratch (they are needed for every output tile).
5. phases 3/4: ``dW_gu[e] = bf16(dW_gu[e] + bf16(mx(X^T, dGU)))`` and
   ``dW_d[e] = bf16(dW_d[e] + bf16(mx(S^T, dY)))`` tile by tile, read-modify-write through a
   ``scalar_offset`` (the expert id) DMA; dense block 0 writes instead.
6. bias grads (routed only): per 128-token tile fp32 sums (ones-matmul / free-axis reduce),
   bf16 running sums per block, then a bf16 read-modify-write per block.

LNC 2 (SHARD_ON_FREE): phase 1 splits the 128-row I tiles, phases 2-4 split the 128-column H
tiles between the two cores; the affinity-grad partials are added in fp32 (core 0's half
first) and written by core 0. Both cores zero exactly the output regions they later update, so
only the phase-1 -> phase-2 hand-over and the end of a block need a ``core_barrier``.

Supported: routed and ``single_expert_dense`` paths, on-the-fly or pre-quantized weights
(packed or unpacked scales), ``accumulate_hidden_states_grad``, bias grads, clamp masks,
``num_valid_tokens`` (dense), ``fast_dma_transpose`` grouping (errata 1), any ``tile_k``,
the optional ``gate_act`` / ``intermediate`` / ``scaled_intermediate`` checkpoints (used as
given), LNC 1 and 2. Rejected with an `NkiKernelUnsupportedError` (the reference handles them):
the 1x32 quant scheme, AFFINITY_ON_H, a missing gate/up checkpoint (recompute from hidden
states with the forward's projection).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import nki
import nki.isa as nisa
import nki.language as nl

from mxcli.kernels.blockwise_moe.config import (
    AffinityOption,
    BwdValidationError,
    MXFP8MOEBwdConfig,
)
from mxcli.kernels.blockwise_moe.numerics import Grouping
from mxcli.mx import QuantScheme, wrapx_chunks

__all__ = ["NkiKernelUnsupportedError", "blockwise_mm_bwd_mxfp8_nki", "kernel_plan"]

P = 128  # partitions (nl.tile_size.pmax)
NMAX = 512  # moving free size of one matmul (one fp32 PSUM bank)
ZCOLS = 2048  # columns of the zero tile used to initialise outputs
# SBUF bytes per partition the resident quantized weights may take (of 245752 on Trn3; the
# rest of the kernel peaks near 60 KB at the production shape).
RESIDENT_BUDGET = 96 * 1024
BLOCK_SIZES = (128, 256, 512, 1024, 2048, 4096)


class NkiKernelUnsupportedError(BwdValidationError):
    """A valid configuration that this NKI kernel does not implement (the reference does)."""


# --------------------------------------------------------------------------------------------
# Trace-time planning (pure Python: shapes, chunk lists, shard ranges)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KTile:
    """One wrapX chunk of a contraction axis: ``c`` values from ``k0``, ``v = c/4`` lanes.

    Lane ``p`` of x4 element byte ``j`` holds contraction index ``k0 + j*v + p`` (bwd spec §5.3),
    so an MX group (8 lanes x 4 bytes) is ``{k0 + j*v + 8g + i}``. In HBM (x4 data and
    unpacked scales) the chunk occupies rows ``[k0/4, k0/4 + v)``; scale row of lane ``p`` is
    ``k0/4 + 32*(p//32) + (p%32)//8`` (the hardware quadrant layout, §5.5).
    """

    k0: int
    c: int

    @property
    def v(self) -> int:
        return self.c // 4

    @property
    def row0(self) -> int:
        return self.k0 // 4

    def packed_scale(self) -> tuple[int, int]:
        """(128-row group, start partition) of this chunk in the packed scale layout (§5.5)."""
        m0 = self.k0 // 32
        t512, ml0 = divmod(m0, 16)
        return t512 // 4, 4 * (t512 % 4) + 32 * (ml0 // 4)


def ktiles(K: int, grouping: Grouping) -> list[KTile]:
    """wrapX chunks of a contraction of length K (config tile_k, errata-1 override)."""
    chunks = (
        list(grouping.chunks) if grouping.chunks is not None else wrapx_chunks(K, grouping.tile_k)
    )
    return [KTile(int(k0), int(c)) for k0, c in chunks]


def _split(n: int, parts: int, idx: int) -> range:
    """Tiles of core `idx` when `n` tiles are split into `parts` contiguous runs (first ones
    one larger)."""
    base, extra = divmod(n, parts)
    lo = idx * base + min(idx, extra)
    return range(lo, lo + base + (1 if idx < extra else 0))


@dataclass(frozen=True)
class Plan:
    """Static facts of one launch (everything the instruction stream depends on)."""

    T: int
    H: int
    I: int  # noqa: E741 - the spec's name
    E: int
    B: int
    N: int
    W: int  # tokens per window
    dense: bool
    nv: bool  # num_valid_tokens given
    accumulate: bool
    bias: bool
    skip_token: bool
    pq_gu: bool  # gate/up pre-quantized
    pq_d: bool
    gu_packed: bool  # scale layout of a pre-quantized gate/up weight
    d_packed: bool
    clamp: tuple[float | None, float | None, float | None, float | None]
    k1: tuple[KTile, ...]  # phase 1: contraction H
    k2: tuple[KTile, ...]  # phase 2: contraction 2I
    k3: tuple[KTile, ...]  # phase 3: contraction B
    k4: tuple[KTile, ...]  # phase 4: contraction B

    @property
    def NT(self) -> int:
        return self.B // P

    @property
    def nI(self) -> int:
        return self.I // P

    @property
    def nH(self) -> int:
        return self.H // P


def kernel_plan(
    T: int,
    H: int,
    I: int,  # noqa: E741
    E: int,
    B: int,
    N: int,
    cfg: MXFP8MOEBwdConfig,
    *,
    nv: bool = False,
    pq_gu: bool = False,
    pq_d: bool = False,
) -> Plan:
    """Check the configuration against what this kernel implements and plan the launch."""
    if cfg.quant_scheme is not QuantScheme.WRAPX:
        raise NkiKernelUnsupportedError(
            f"config.quant_scheme: the NKI kernel implements WRAPX only, got {cfg.quant_scheme.name}"
        )
    if cfg.affinity_option is not AffinityOption.AFFINITY_ON_I:
        raise NkiKernelUnsupportedError(
            "config.affinity_option: the NKI kernel implements AFFINITY_ON_I only, got "
            f"{cfg.affinity_option.name}"
        )
    p1, p2, p3, p4 = cfg.phase_configs()
    cl = cfg.clamp_limits
    assert cl is not None
    return Plan(
        T=T, H=H, I=I, E=E, B=B, N=N, W=min(B, 512),
        dense=cfg.single_expert_dense, nv=nv,
        accumulate=cfg.accumulate_hidden_states_grad, bias=cfg.bias,
        skip_token=cfg.effective_skip_dma.skip_token,
        pq_gu=pq_gu, pq_d=pq_d,
        gu_packed=p2.enable_scale_packing, d_packed=p1.enable_scale_packing,
        clamp=(
            cl.non_linear_clamp_lower_limit, cl.non_linear_clamp_upper_limit,
            cl.linear_clamp_lower_limit, cl.linear_clamp_upper_limit,
        ),
        k1=tuple(ktiles(H, Grouping.for_phase(p1, H, cfg.fast_dma_transpose))),
        k2=tuple(ktiles(2 * I, Grouping.for_phase(p2, 2 * I))),
        k3=tuple(ktiles(B, Grouping.for_phase(p3, B))),
        k4=tuple(ktiles(B, Grouping.for_phase(p4, B))),
    )  # fmt: skip


def _fail(msg: str) -> None:
    raise BwdValidationError(msg)


def _shape(name: str, t: Any, expected: tuple[int, ...]) -> None:
    if tuple(t.shape) != tuple(expected):
        _fail(f"{name}: expected shape {tuple(expected)}, got {tuple(t.shape)}")


# --------------------------------------------------------------------------------------------
# Quantized operands in HBM
# --------------------------------------------------------------------------------------------


class HbmQ:
    """An MX operand in HBM, wrapX layout along its contraction (bwd spec §5.5).

    ``data``: x4 ``[.., K/4, F]``; ``scales``: uint8, unpacked ``[.., K/4, F]`` or packed
    ``[.., ceil(K/2048)*128, F]``. With ``expert`` (a ``(1, 1)`` int32 SBUF view) the
    leading axis is selected at run time through ``scalar_offset``.
    """

    def __init__(
        self,
        data: Any,
        scales: Any,
        tiles: tuple[KTile, ...],
        F: int,
        packed: bool,
        expert: Any = None,
    ) -> None:
        self.data, self.scales, self.tiles, self.F = data, scales, tiles, F
        self.packed, self.expert = packed, expert

    def _src(self, t: Any, row: int, nrows: int, c0: int, n: int) -> Any:
        pattern = [[self.F, nrows], [1, n]]
        if self.expert is None:
            return t.ap(pattern, offset=row * self.F + c0)
        return t.ap(pattern, offset=row * self.F + c0, scalar_offset=self.expert, indirect_dim=0)

    def runs(self) -> list[tuple[int, int]]:
        """``(first tile, count)`` runs of full 128-lane k-tiles with contiguous rows (one DMA
        each); remainder chunks form runs of one."""
        out: list[tuple[int, int]] = []
        for i, kt in enumerate(self.tiles):
            if out:
                i0, m = out[-1]
                last = self.tiles[i0 + m - 1]
                if kt.v == P and last.v == P and last.row0 + P == kt.row0:
                    out[-1] = (i0, m + 1)
                    continue
            out.append((i, 1))
        return out

    def _src_run(self, t: Any, i0: int, m: int, c0: int, n: int) -> Any:
        kt = self.tiles[i0]
        pattern = [[self.F, kt.v], [P * self.F, m], [1, n]]
        off = kt.row0 * self.F + c0
        if self.expert is None:
            return t.ap(pattern, offset=off)
        return t.ap(pattern, offset=off, scalar_offset=self.expert, indirect_dim=0)

    def load(self, c0: int, n: int, name: str) -> tuple[Any, Any, list[Any]]:
        """All k-tiles of columns ``[c0, c0+n)`` into SBUF; returns (data [P, nk, n] x4,
        scales, per-tile scale views for `nc_matmul_mx`)."""
        nk = len(self.tiles)
        q = nl.ndarray((P, nk, n), dtype=nl.float8_e4m3fn_x4, buffer=nl.sbuf, name=f"{name}_q")
        for i0, m in self.runs():
            v = self.tiles[i0].v
            nisa.dma_copy(dst=q[0:v, i0 : i0 + m, :], src=self._src_run(self.data, i0, m, c0, n))
        views: list[Any] = []
        if self.packed:
            groups = sorted({kt.packed_scale()[0] for kt in self.tiles})
            s = nl.ndarray((P, len(groups), n), dtype=nl.uint8, buffer=nl.sbuf, name=f"{name}_s")
            for gi, g in enumerate(groups):
                nisa.dma_copy(dst=s[:, gi, :], src=self._src(self.scales, g * P, P, c0, n))
            for kt in self.tiles:
                g, start = kt.packed_scale()
                views.append(s[start:P, groups.index(g), :])
        else:
            s = nl.ndarray((P, nk, n), dtype=nl.uint8, buffer=nl.sbuf, name=f"{name}_s")
            for i0, m in self.runs():
                v = self.tiles[i0].v
                nisa.dma_copy(
                    dst=s[0:v, i0 : i0 + m, :], src=self._src_run(self.scales, i0, m, c0, n)
                )
            views = [s[0 : kt.v, i, :] for i, kt in enumerate(self.tiles)]
        return q, s, views


class SbufQ:
    """A quantized operand resident in SBUF for a whole block (or the whole launch in dense
    mode): x4 data ``[P, nk, n]`` over columns ``[c_lo, c_lo + n)`` and one scale view per
    k-tile. `load` hands out column slices without any DMA (same interface as `HbmQ.load`)."""

    def __init__(self, q: Any, views: list[Any], c_lo: int) -> None:
        self.q, self.views, self.c_lo = q, views, c_lo

    @staticmethod
    def from_hbm(src: HbmQ, c_lo: int, n: int, name: str) -> SbufQ:
        q, _, views = src.load(c_lo, n, name)
        return SbufQ(q, views, c_lo)

    def load(self, c0: int, n: int, name: str) -> tuple[Any, Any, list[Any]]:
        off = c0 - self.c_lo
        return self.q[:, :, off : off + n], None, [v[:, off : off + n] for v in self.views]


def _quantize_tile(ilv: Any, kt: KTile, n: int, q_dst: Any, s_dst: Any) -> None:
    """``quantize_mx`` of an interleaved bf16 tile ``ilv [v, n, 4]`` (bwd spec §5.2 rule)."""
    nisa.quantize_mx(dst=q_dst, src=ilv[0 : kt.v, 0:n, :], dst_scale=s_dst)


def _spill(dst: HbmQ, kt: KTile, row_base: int, c0: int, n: int, q: Any, s: Any) -> None:
    """Write one quantized k-tile (x4 data [v, n], unpacked scales [v, n]) to HBM scratch."""
    r = row_base + kt.row0
    nisa.dma_copy(dst=dst.data[r : r + kt.v, c0 : c0 + n], src=q)
    nisa.dma_copy(dst=dst.scales[r : r + kt.v, c0 : c0 + n], src=s)


# --------------------------------------------------------------------------------------------
# The kernel
# --------------------------------------------------------------------------------------------


class _Bwd:
    """Trace-time builder of the instruction stream (one object per program)."""

    def __init__(self, plan: Plan, t: dict[str, Any]) -> None:
        self.p = plan
        self.t = t
        self.lnc = int(nl.num_programs(axes=0))
        self.pid = int(nl.program_id(axis=0))
        # SHARD_ON_FREE: phase 1 splits the I tiles, phases 2-4 the H tiles (bwd spec §8).
        self.i_tiles = _split(plan.nI, self.lnc, self.pid)
        self.h_tiles = _split(plan.nH, self.lnc, self.pid)
        self.h0 = self.h_tiles.start * P
        self.Hc = len(self.h_tiles) * P
        # Quantized phase-1/2 weights stay in SBUF for the block when they fit a budget
        # (x4 data + one scale byte per lane and column); otherwise they are spilled to HBM
        # and streamed per window. Gate/up first: it is reloaded twice as much.
        self.d_cols = len(self.i_tiles) * P
        wgu_bytes = len(plan.k2) * self.Hc * 5
        wd_bytes = len(plan.k1) * self.d_cols * 5
        self.res_gu = 0 < wgu_bytes <= RESIDENT_BUDGET
        self.res_d = 0 < wd_bytes <= RESIDENT_BUDGET - (wgu_bytes if self.res_gu else 0)

    # -- small helpers ---------------------------------------------------------------------

    def zeros_hbm(self, t: Any, offset: int, row_stride: int, nrows: int, ncols: int) -> None:
        """Zero a ``[nrows, ncols]`` region (row stride `row_stride` elements) of an HBM tensor."""
        z = self.zero
        for r0 in range(0, nrows, P):
            nr = min(P, nrows - r0)
            for c0 in range(0, ncols, ZCOLS):
                nc = min(ZCOLS, ncols - c0)
                nisa.dma_copy(
                    dst=t.ap([[row_stride, nr], [1, nc]], offset=offset + r0 * row_stride + c0),
                    src=z[0:nr, 0:nc],
                )

    def zeros_flat(self, t: Any, start: int, count: int) -> None:
        """Zero ``count`` contiguous elements of an HBM tensor from flat element `start`."""
        full = count // ZCOLS
        if full:
            self.zeros_hbm(t, start, ZCOLS, full, ZCOLS)
        rest = count - full * ZCOLS
        if rest:
            self.zeros_hbm(t, start + full * ZCOLS, rest, 1, rest)

    def rows_src(self, t: Any, b: int, tt: int, c0: int, n: int) -> Any:
        """Rows of token tile `tt` of block `b` of a ``[T, H]`` tensor, columns ``[c0, c0+n)``:
        an indirect view (routed / dense with a token count) or a plain slice (dense)."""
        p = self.p
        if self.tok is None:
            r0 = b * p.B + tt * P
            return t[r0 : r0 + P, c0 : c0 + n]
        return t.ap(
            [[p.H, P], [1, n]], offset=c0, vector_offset=self.tok[:, tt : tt + 1], indirect_dim=0
        )

    @property
    def oob(self) -> Any:
        return nisa.oob_mode.skip if self.p.skip_token or self.p.nv else nisa.oob_mode.error

    def gather_rows(self, dst: Any, t: Any, b: int, tt: int, c0: int, n: int) -> None:
        """dst ``[P, n]`` <- token rows (padding rows 0)."""
        if self.tok is not None:
            nisa.memset(dst=dst, value=0.0)
            nisa.dma_copy(dst=dst, src=self.rows_src(t, b, tt, c0, n), oob_mode=self.oob)
        else:
            nisa.dma_copy(dst=dst, src=self.rows_src(t, b, tt, c0, n))

    # -- setup -------------------------------------------------------------------------------

    def run(self) -> tuple[Any, ...]:
        p, t = self.p, self.t
        self.alloc_outputs()
        self.alloc_scratch()
        self.zero = nl.ndarray((P, ZCOLS), dtype=nl.bfloat16, buffer=nl.sbuf, name="zero")
        nisa.memset(dst=self.zero, value=0.0)
        self.ones_f32 = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf, name="ones_f32")
        nisa.memset(dst=self.ones_f32, value=1.0)
        self.ones_bf = nl.ndarray((P, 1), dtype=nl.bfloat16, buffer=nl.sbuf, name="ones_bf")
        nisa.memset(dst=self.ones_bf, value=1.0)
        self.nv_col = None
        if p.nv:
            # count clamped to [0, T] (API reference), broadcast to every partition, fp32
            nvi = nl.ndarray((P, 1), dtype=nl.int32, buffer=nl.sbuf, name="nv_i")
            nisa.dma_copy(dst=nvi, src=t["num_valid_tokens"].ap([[0, P], [1, 1]], offset=0))
            self.nv_col = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf, name="nv_f")
            nisa.tensor_scalar(
                dst=self.nv_col, data=nvi, op0=nl.minimum, operand0=float(p.T),
                op1=nl.maximum, operand1=0.0,
            )  # fmt: skip
        if not p.dense or p.nv:
            self.init_outputs()
        if p.dense:
            self.expert = None
            self.quantize_weights(None)
        for b in range(p.N):
            self.block(b)
        outs = [self.hsg, self.dea, self.dwgu, self.dwd]
        if p.bias:
            outs += [self.dbgu, self.dbd]
        return tuple(outs)

    def alloc_outputs(self) -> None:
        p, t = self.p, self.t
        sh = nl.shared_hbm
        self.hsg = nl.ndarray(
            (p.T, p.H), dtype=t["hidden_states"].dtype, buffer=sh, name="hidden_states_grad"
        )
        ea_dt = t["expert_affinities_masked"].dtype
        self.dea = nl.ndarray(
            (p.T * p.E, 1), dtype=ea_dt, buffer=sh, name="expert_affinities_masked_grad"
        )
        self.dwgu = nl.ndarray(
            (p.E, p.H, 2, p.I), dtype=nl.bfloat16, buffer=sh, name="gate_up_proj_weight_grad"
        )
        self.dwd = nl.ndarray(
            (p.E, p.I, p.H), dtype=nl.bfloat16, buffer=sh, name="down_proj_weight_grad"
        )
        if p.bias:
            self.dbgu = nl.ndarray(
                (p.E, 2, p.I), dtype=nl.bfloat16, buffer=sh, name="gate_and_up_proj_bias_grad"
            )
            self.dbd = nl.ndarray(
                (p.E, p.H), dtype=nl.bfloat16, buffer=sh, name="down_proj_bias_grad"
            )

    def alloc_scratch(self) -> None:
        p = self.p
        sh, pr = nl.shared_hbm, nl.private_hbm
        x4, u8 = nl.float8_e4m3fn_x4, nl.uint8
        # phase-1 -> phase-2 hand-over (both cores read all of it): bf16 [2I, B], [I, B], fp32
        # affinity-grad partials [lnc, B]
        self.dgu_s = nl.ndarray((2 * p.I, p.B), dtype=nl.bfloat16, buffer=sh, name="dgu_T_scratch")
        self.s_s = nl.ndarray((p.I, p.B), dtype=nl.bfloat16, buffer=sh, name="s_T_scratch")
        self.da_s = nl.ndarray((self.lnc, p.B), dtype=nl.float32, buffer=sh, name="da_scratch")
        self.alpha_s = nl.ndarray((p.B,), dtype=nl.float32, buffer=pr, name="alpha_scratch")
        # quantized phase-3/4 operands, token lanes (rows = B/4), unpacked scales
        self.xq = HbmQ(
            nl.ndarray((p.B // 4, p.H), dtype=x4, buffer=pr, name="xq"),
            nl.ndarray((p.B // 4, p.H), dtype=u8, buffer=pr, name="xq_s"), p.k3, p.H, False,
        )  # fmt: skip
        self.gq = HbmQ(
            nl.ndarray((p.B // 4, 2 * p.I), dtype=x4, buffer=pr, name="dguq"),
            nl.ndarray((p.B // 4, 2 * p.I), dtype=u8, buffer=pr, name="dguq_s"), p.k3, 2 * p.I, False,
        )  # fmt: skip
        self.yq = HbmQ(
            nl.ndarray((p.B // 4, p.H), dtype=x4, buffer=pr, name="dyq"),
            nl.ndarray((p.B // 4, p.H), dtype=u8, buffer=pr, name="dyq_s"), p.k4, p.H, False,
        )  # fmt: skip
        self.sq = HbmQ(
            nl.ndarray((p.B // 4, p.I), dtype=x4, buffer=pr, name="sq"),
            nl.ndarray((p.B // 4, p.I), dtype=u8, buffer=pr, name="sq_s"), p.k4, p.I, False,
        )  # fmt: skip
        # quantized weights of the current expert (unless pre-quantized)
        self.wdq_s = self.wguq_s = None
        if not p.pq_d:
            self.wdq_s = HbmQ(
                nl.ndarray((p.H // 4, p.I), dtype=x4, buffer=pr, name="wdq"),
                nl.ndarray((p.H // 4, p.I), dtype=u8, buffer=pr, name="wdq_s"), p.k1, p.I, False,
            )  # fmt: skip
        if not p.pq_gu:
            self.wguq_s = HbmQ(
                nl.ndarray((2 * p.I // 4, p.H), dtype=x4, buffer=pr, name="wguq"),
                nl.ndarray((2 * p.I // 4, p.H), dtype=u8, buffer=pr, name="wguq_s"), p.k2, p.H, False,
            )  # fmt: skip

    def init_outputs(self) -> None:
        """Zero what this core updates (bwd spec §4.3). Dense with a token count: the hidden and
        affinity grads only (rows past the count are then 0, as in the reference)."""
        p = self.p
        self.zeros_hbm(self.hsg, self.h0, p.H, p.T, self.Hc)
        if self.pid == 0:
            self.zeros_flat(self.dea, 0, p.T * p.E)
        if p.dense:
            return
        for e in range(p.E):
            self.zeros_flat(self.dwgu, (e * p.H + self.h0) * 2 * p.I, self.Hc * 2 * p.I)
            self.zeros_hbm(self.dwd, e * p.I * p.H + self.h0, p.H, p.I, self.Hc)
            if p.bias:
                self.zeros_hbm(self.dbd, e * p.H + self.h0, p.H, 1, self.Hc)
                for g in range(2):
                    for it in self.i_tiles:
                        self.zeros_flat(self.dbgu, (e * 2 + g) * p.I + it * P, P)

    # -- weights -------------------------------------------------------------------------

    def quantize_weights(self, expert: Any) -> None:
        """Phase-1/2 weight operands of the current expert: quantized on chip (into SBUF when
        resident, else into the HBM scratch), or the pre-quantized inputs themselves (loaded
        into SBUF once per block when resident)."""
        p, t = self.p, self.t
        d_cols = [(i * P, P) for i in self.i_tiles]
        gu_cols = [
            (c0, min(NMAX, self.h0 + self.Hc - c0))
            for c0 in range(self.h0, self.h0 + self.Hc, NMAX)
        ]
        lo_d = self.i_tiles.start * P
        if p.pq_d:
            hq = HbmQ(
                t["down_proj_weight"].view(nl.float8_e4m3fn_x4), t["down_weight_scales"],
                p.k1, p.I, p.d_packed, expert,
            )  # fmt: skip
            self.wdq = SbufQ.from_hbm(hq, lo_d, self.d_cols, "wd_res") if self.res_d else hq
        elif self.d_cols:
            # W_d[e] [I, H] -> lanes along H, columns i (this core's phase-1 I tiles)
            self.wdq = self._quantize_weight(
                t["down_proj_weight"], p.H, p.k1, expert, d_cols, lo_d, self.d_cols,
                None if self.res_d else self.wdq_s, "wd",
            )  # fmt: skip
        if p.pq_gu:
            hq = HbmQ(
                t["gate_up_proj_weight"].view(nl.float8_e4m3fn_x4), t["gate_up_weight_scales"],
                p.k2, p.H, p.gu_packed, expert,
            )  # fmt: skip
            self.wguq = SbufQ.from_hbm(hq, self.h0, self.Hc, "wgu_res") if self.res_gu else hq
        elif self.Hc:
            # W_gu[e] viewed [H, 2I]: lanes along 2I, columns h (this core's H range)
            self.wguq = self._quantize_weight(
                t["gate_up_proj_weight"], 2 * p.I, p.k2, expert, gu_cols, self.h0, self.Hc,
                None if self.res_gu else self.wguq_s, "wgu",
            )  # fmt: skip

    def _quantize_weight(
        self,
        w: Any,
        K: int,
        tiles: tuple[KTile, ...],
        expert: Any,
        cols: list[tuple[int, int]],
        c_lo: int,
        n_all: int,
        spill: HbmQ | None,
        name: str,
    ) -> HbmQ | SbufQ:
        """``w`` viewed per expert as ``[F, K]`` (row f, contraction k contiguous): load each
        wrapX chunk transposed (lane p, column f, byte j <- w[f, k0 + j*v + p]) and quantize
        it (bwd spec §5.4: W_d along H in phase 1, W_gu along 2I in phase 2), into a resident
        SBUF operand, or into the HBM scratch `spill`."""
        nk = len(tiles)
        res_q: Any = None
        res_s: Any = None
        if spill is None:
            res_q = nl.ndarray(
                (P, nk, n_all), dtype=nl.float8_e4m3fn_x4, buffer=nl.sbuf, name=f"{name}_res_q"
            )
            res_s = nl.ndarray((P, nk, n_all), dtype=nl.uint8, buffer=nl.sbuf, name=f"{name}_res_s")
        for c0, n in cols:
            for i, kt in enumerate(tiles):
                v = kt.v
                ilv = nl.ndarray((P, n, 4), dtype=nl.bfloat16, buffer=nl.sbuf, name=f"{name}_ilv")
                pattern = [[1, v], [K, n], [v, 4]]
                off = c0 * K + kt.k0
                src = (
                    w.ap(pattern, offset=off)
                    if expert is None
                    else w.ap(pattern, offset=off, scalar_offset=expert, indirect_dim=0)
                )
                nisa.dma_copy(dst=ilv[0:v, :, :], src=src)
                if res_q is not None:
                    cs = slice(c0 - c_lo, c0 - c_lo + n)
                    _quantize_tile(ilv, kt, n, res_q[0:v, i, cs], res_s[0:v, i, cs])
                    continue
                assert spill is not None
                q = nl.ndarray((P, n), dtype=nl.float8_e4m3fn_x4, buffer=nl.sbuf, name=f"{name}_q")
                sc = nl.ndarray((P, n), dtype=nl.uint8, buffer=nl.sbuf, name=f"{name}_s")
                nisa.memset(dst=sc[0:v, :], value=0)
                _quantize_tile(ilv, kt, n, q[0:v, :], sc[0:v, :])
                _spill(spill, kt, 0, c0, n, q[0:v, :], sc[0:v, :])
        if res_q is not None:
            return SbufQ(res_q, [res_s[0 : kt.v, i, :] for i, kt in enumerate(tiles)], c_lo)
        assert spill is not None
        return spill

    # -- one block -----------------------------------------------------------------------

    def block(self, b: int) -> None:
        p = self.p
        self.setup_indices(b)
        if not p.dense:
            self.quantize_weights(self.expert)
        self.acc_bgu: Any = None
        if p.bias:
            self.acc_bgu = nl.ndarray(
                (P, 2, max(1, len(self.i_tiles))), dtype=nl.bfloat16, buffer=nl.sbuf, name="acc_bgu"
            )
            nisa.memset(dst=self.acc_bgu, value=0.0)
        for w in range(p.B // p.W):
            self.phase1(b, w)
        if self.lnc > 1:
            nisa.core_barrier(self.da_s, (0, 1))
        self.write_affinity_grad(b)
        self.acc_bd: Any = None
        if p.bias:
            self.acc_bd = nl.ndarray(
                (1, max(1, self.Hc)), dtype=nl.bfloat16, buffer=nl.sbuf, name="acc_bd"
            )
            nisa.memset(dst=self.acc_bd, value=0.0)
        for w in range(p.B // p.W):
            self.phase2(b, w)
            self.phase34_operands(b, w)
        self.phase3(b)
        self.phase4(b)
        if p.bias:
            self.write_bias(b)
        if self.lnc > 1:
            nisa.core_barrier(self.dgu_s, (0, 1))

    def setup_indices(self, b: int) -> None:
        """Token ids, affinity indices and affinities of block `b` (bwd spec §3.1, §4.1)."""
        p, t = self.p, self.t
        NT = p.NT
        self.tok = None
        self.ea_idx = None
        if not p.dense:
            # tok[p, t] = token_position_to_id[b*B + t*P + p]
            self.tok = nl.ndarray((P, NT), dtype=nl.int32, buffer=nl.sbuf, name="tok")
            nisa.dma_copy(
                dst=self.tok, src=t["token_position_to_id"].ap([[1, P], [P, NT]], offset=b * p.B)
            )
            ecol = nl.ndarray((P, 1), dtype=nl.int32, buffer=nl.sbuf, name="expert_col")
            nisa.dma_copy(dst=ecol, src=t["block_to_expert"].ap([[0, P], [1, 1]], offset=b))
            self.expert = ecol[0:1, 0:1]
            # ea_idx = tok*E + e: padding (-1) -> negative, ids >= T -> >= T*E: both OOB
            self.ea_idx = nl.ndarray((P, NT), dtype=nl.int32, buffer=nl.sbuf, name="ea_idx")
            nisa.tensor_scalar(
                dst=self.ea_idx,
                data=self.tok,
                op0=nl.multiply,
                operand0=p.E,
                op1=nl.add,
                operand1=ecol,
            )
        elif p.nv:
            # dense with a token count: positions >= count become padding (-1)
            pos = nl.ndarray((P, NT), dtype=nl.float32, buffer=nl.sbuf, name="pos")
            nisa.iota(dst=pos, pattern=[[P, NT]], offset=b * p.B, channel_multiplier=1)
            valid = nl.ndarray((P, NT), dtype=nl.float32, buffer=nl.sbuf, name="valid")
            nisa.tensor_scalar(dst=valid, data=pos, op0=nl.less, operand0=self.nv_col)
            idx_f = nl.ndarray((P, NT), dtype=nl.float32, buffer=nl.sbuf, name="idx_f")
            nisa.scalar_tensor_tensor(
                dst=idx_f, data=pos, op0=nl.add, operand0=1.0, op1=nl.multiply, operand1=valid
            )
            self.tok = nl.ndarray((P, NT), dtype=nl.int32, buffer=nl.sbuf, name="tok")
            nisa.tensor_scalar(dst=self.tok, data=idx_f, op0=nl.subtract, operand0=1.0)
            self.ea_idx = self.tok  # E == 1
        # alpha per token (fp32, 0 for padding), then broadcast along the free axis via HBM
        self.alpha_tok = nl.ndarray((P, NT), dtype=nl.float32, buffer=nl.sbuf, name="alpha_tok")
        ea = t["expert_affinities_masked"]
        if self.ea_idx is not None:
            nisa.memset(dst=self.alpha_tok, value=0.0)
            for tt in range(NT):
                nisa.dma_copy(
                    dst=self.alpha_tok[:, tt : tt + 1],
                    src=ea.ap(
                        [[1, P], [1, 1]],
                        offset=0,
                        vector_offset=self.ea_idx[:, tt : tt + 1],
                        indirect_dim=0,
                    ),
                    oob_mode=self.oob,
                )
        else:
            nisa.dma_copy(dst=self.alpha_tok, src=ea.ap([[1, P], [P, NT]], offset=b * p.B))
        nisa.dma_copy(dst=self.alpha_s.ap([[1, P], [P, NT]], offset=0), src=self.alpha_tok)

    # -- phase 1 -------------------------------------------------------------------------

    def phase1(self, b: int, w: int) -> None:
        """D^T = mx(W_d, dY^T) per I tile of this core, SwiGLU backward, affinity-grad partials
        (bwd spec §6 P1)."""
        p, t = self.p, self.t
        Wn, nTw, w0 = p.W, p.W // P, w * p.W
        ntk = len(p.k1)
        # dY rows of the window, tokens on partitions: [P, nTw, H]
        dyw = nl.ndarray((P, nTw, p.H), dtype=nl.bfloat16, buffer=nl.sbuf, name="p1_dy")
        for j in range(nTw):
            self.gather_rows(dyw[:, j, :], t["output_hidden_states_grad"], b, w * nTw + j, 0, p.H)
        # dY^T in the wrapX layout along H, quantized: [lanes, chunk, W]
        yq = nl.ndarray((P, ntk, Wn), dtype=nl.float8_e4m3fn_x4, buffer=nl.sbuf, name="p1_yq")
        ys = nl.ndarray((P, ntk, Wn), dtype=nl.uint8, buffer=nl.sbuf, name="p1_ys")
        for ci, kt in enumerate(p.k1):
            v = kt.v
            ilv = nl.ndarray((P, Wn, 4), dtype=nl.bfloat16, buffer=nl.sbuf, name="p1_ilv")
            for j in range(4):
                ps = nl.ndarray((P, Wn), dtype=nl.bfloat16, buffer=nl.psum, name="p1_tp")
                h = kt.k0 + j * v
                for tt in range(nTw):
                    nisa.nc_transpose(
                        dst=ps[0:v, tt * P : (tt + 1) * P], data=dyw[:, tt, h : h + v]
                    )
                nisa.tensor_copy(dst=ilv[0:v, :, j], src=ps[0:v, :])
            _quantize_tile(ilv, kt, Wn, yq[0:v, ci, :], ys[0:v, ci, :])
        alpha = nl.ndarray((P, Wn), dtype=nl.float32, buffer=nl.sbuf, name="alpha_row")
        nisa.dma_copy(dst=alpha, src=self.alpha_s.ap([[0, P], [1, Wn]], offset=w0))
        da_ps = nl.ndarray((P, nTw), dtype=nl.float32, buffer=nl.psum, name="da_ps")
        ckpt = t["gate_up_proj_act_checkpoint_T"]
        for n_it, it in enumerate(self.i_tiles):
            wq, _, wsv = self.wdq.load(it * P, P, "p1_w")
            d = nl.ndarray((P, Wn), dtype=nl.float32, buffer=nl.psum, name="p1_d")
            for ci, kt in enumerate(p.k1):
                nisa.nc_matmul_mx(
                    dst=d, stationary=wq[0 : kt.v, ci, :], moving=yq[0 : kt.v, ci, :],
                    stationary_scale=wsv[ci], moving_scale=ys[0 : kt.v, ci, :], accumulate=ci > 0,
                )  # fmt: skip
            self.swiglu(b, w, it, n_it, d, alpha, da_ps, ckpt)
        # affinity-grad partial of this core -> scratch row `pid`
        da = nl.ndarray((P, nTw), dtype=nl.float32, buffer=nl.sbuf, name="da")
        if len(self.i_tiles):
            nisa.tensor_copy(dst=da, src=da_ps)
        else:
            nisa.memset(dst=da, value=0.0)
        nisa.dma_copy(dst=self.da_s.ap([[1, P], [P, nTw]], offset=self.pid * p.B + w0), src=da)

    def swiglu(
        self, b: int, w: int, it: int, n_it: int, d: Any, alpha: Any, da_ps: Any, ckpt: Any
    ) -> None:
        """SwiGLU backward on one ``[128 i, W tok]`` tile, rounding points of bwd spec §6 P1."""
        p = self.p
        Wn, nTw, w0 = p.W, p.W // P, w * p.W
        i0 = it * P
        bf, f32 = nl.bfloat16, nl.float32
        t = self.t
        cdt = ckpt.dtype  # checkpoint values are used as given (bf16, or fp16)
        g = nl.ndarray((P, Wn), dtype=cdt, buffer=nl.sbuf, name="g")
        u = nl.ndarray((P, Wn), dtype=cdt, buffer=nl.sbuf, name="u")
        nisa.dma_copy(dst=g, src=ckpt[b, 0, i0 : i0 + P, w0 : w0 + Wn])
        nisa.dma_copy(dst=u, src=ckpt[b, 1, i0 : i0 + P, w0 : w0 + Wn])
        ck_act = t["gate_act_checkpoint_T"]
        if ck_act is not None:  # phi(G) as checkpointed by the forward
            act = nl.ndarray((P, Wn), dtype=ck_act.dtype, buffer=nl.sbuf, name="act")
            nisa.dma_copy(dst=act, src=ck_act[b, i0 : i0 + P, w0 : w0 + Wn])
        else:
            act = nl.ndarray((P, Wn), dtype=bf, buffer=nl.sbuf, name="act")
            nisa.activation(dst=act, op=nl.silu, data=g)  # act = bf16(silu(G))
        dph = nl.ndarray((P, Wn), dtype=bf, buffer=nl.sbuf, name="dphi")
        nisa.activation(dst=dph, op=nl.silu_dx, data=g)  # bf16(silu'(G))
        dga = nl.ndarray((P, Wn), dtype=bf, buffer=nl.sbuf, name="dga")
        nisa.tensor_tensor(dst=dga, data1=dph, data2=u, op=nl.multiply)  # bf16(dphi*U)
        ck_h = t["intermediate_checkpoint_T"]
        if ck_h is not None:
            hm = nl.ndarray((P, Wn), dtype=ck_h.dtype, buffer=nl.sbuf, name="hm")
            nisa.dma_copy(dst=hm, src=ck_h[b, i0 : i0 + P, w0 : w0 + Wn])
        else:
            hm = nl.ndarray((P, Wn), dtype=bf, buffer=nl.sbuf, name="hm")
            nisa.tensor_tensor(dst=hm, data1=act, data2=u, op=nl.multiply)  # Hm = bf16(act*U)
        # affinity grad: sum_i fp32(D*Hm), the partition sum as a ones-matmul (fp32 in PSUM)
        prod = nl.ndarray((P, Wn), dtype=f32, buffer=nl.sbuf, name="dhm")
        nisa.tensor_tensor(dst=prod, data1=d, data2=hm, op=nl.multiply)
        for tt in range(nTw):
            nisa.nc_matmul(
                dst=da_ps[:, tt : tt + 1], stationary=prod[:, tt * P : (tt + 1) * P],
                moving=self.ones_f32, accumulate=n_it > 0,
            )  # fmt: skip
        ck_s = t["scaled_intermediate_checkpoint_T"]
        s = nl.ndarray((P, Wn), dtype=bf, buffer=nl.sbuf, name="s")
        if ck_s is not None:  # phase 4's operand as the forward saved it
            nisa.dma_copy(dst=s, src=ck_s[b, i0 : i0 + P, w0 : w0 + Wn])
        else:
            nisa.tensor_tensor(dst=s, data1=hm, data2=alpha, op=nl.multiply)  # S = bf16(Hm*alpha)
        ds = nl.ndarray((P, Wn), dtype=f32, buffer=nl.sbuf, name="ds")
        nisa.tensor_tensor(dst=ds, data1=d, data2=alpha, op=nl.multiply)  # Ds = D*alpha (fp32)
        dg = nl.ndarray((P, Wn), dtype=bf, buffer=nl.sbuf, name="dg")
        nisa.tensor_tensor(dst=dg, data1=ds, data2=dga, op=nl.multiply)
        du = nl.ndarray((P, Wn), dtype=bf, buffer=nl.sbuf, name="du")
        nisa.tensor_tensor(dst=du, data1=ds, data2=act, op=nl.multiply)
        nl_lo, nl_hi, l_lo, l_hi = p.clamp
        # gradient masks on the checkpoint values, strict inequalities (bwd spec §4.2)
        for x, src, lo, hi in ((dg, g, nl_lo, nl_hi), (du, u, l_lo, l_hi)):
            if hi is not None:
                nisa.scalar_tensor_tensor(
                    dst=x, data=src, op0=nl.less, operand0=float(hi), op1=nl.multiply, operand1=x
                )
            if lo is not None:
                nisa.scalar_tensor_tensor(
                    dst=x, data=src, op0=nl.greater, operand0=float(lo), op1=nl.multiply, operand1=x
                )
        nisa.dma_copy(dst=self.dgu_s[i0 : i0 + P, w0 : w0 + Wn], src=dg)
        nisa.dma_copy(dst=self.dgu_s[p.I + i0 : p.I + i0 + P, w0 : w0 + Wn], src=du)
        nisa.dma_copy(dst=self.s_s[i0 : i0 + P, w0 : w0 + Wn], src=s)
        if p.bias:
            # gate/up bias grad: per 128-token tile an fp32 sum, then a bf16 running sum (§6)
            acc = self.acc_bgu
            red = nl.ndarray((P, 1), dtype=f32, buffer=nl.sbuf, name="bgu_red")
            for gi, x in enumerate((dg, du)):
                for tt in range(nTw):
                    nisa.tensor_reduce(dst=red, op=nl.add, data=x[:, tt * P : (tt + 1) * P], axis=1)
                    col = acc[:, gi, n_it : n_it + 1]
                    nisa.tensor_tensor(dst=col, data1=col, data2=red, op=nl.add)

    def write_affinity_grad(self, b: int) -> None:
        """dEA[tok*E + e] = bf16(partial_0 + partial_1) for the block's valid rows (core 0)."""
        p = self.p
        if self.pid != 0:
            return
        NT = p.NT
        da = nl.ndarray((P, NT), dtype=nl.float32, buffer=nl.sbuf, name="da_all")
        nisa.dma_copy(dst=da, src=self.da_s.ap([[1, P], [P, NT]], offset=0))
        for c in range(1, self.lnc):
            other = nl.ndarray((P, NT), dtype=nl.float32, buffer=nl.sbuf, name="da_other")
            nisa.dma_copy(dst=other, src=self.da_s.ap([[1, P], [P, NT]], offset=c * p.B))
            nisa.tensor_tensor(dst=da, data1=da, data2=other, op=nl.add)
        dab = nl.ndarray((P, NT), dtype=nl.bfloat16, buffer=nl.sbuf, name="da_bf")
        nisa.tensor_copy(dst=dab, src=da)
        if self.ea_idx is None:
            nisa.dma_copy(dst=self.dea.ap([[1, P], [P, NT]], offset=b * p.B), src=dab)
            return
        for tt in range(NT):
            nisa.dma_copy(
                dst=self.dea.ap(
                    [[1, P], [1, 1]],
                    offset=0,
                    vector_offset=self.ea_idx[:, tt : tt + 1],
                    indirect_dim=0,
                ),
                src=dab[:, tt : tt + 1],
                oob_mode=self.oob,
            )

    # -- phase 2 -------------------------------------------------------------------------

    def phase2(self, b: int, w: int) -> None:
        """R = bf16(mx([dG|dU], W_gu)) per 128-token tile, into the hidden-state grad (§6 P2)."""
        p = self.p
        Wn, nTw, w0 = p.W, p.W // P, w * p.W
        if not self.Hc:
            return
        ntk = len(p.k2)
        gq = nl.ndarray((P, ntk, Wn), dtype=nl.float8_e4m3fn_x4, buffer=nl.sbuf, name="p2_gq")
        gs = nl.ndarray((P, ntk, Wn), dtype=nl.uint8, buffer=nl.sbuf, name="p2_gs")
        for ci, kt in enumerate(p.k2):
            v = kt.v
            ilv = nl.ndarray((P, Wn, 4), dtype=nl.bfloat16, buffer=nl.sbuf, name="p2_ilv")
            for j in range(4):
                r = kt.k0 + j * v
                nisa.dma_copy(dst=ilv[0:v, :, j], src=self.dgu_s[r : r + v, w0 : w0 + Wn])
            _quantize_tile(ilv, kt, Wn, gq[0:v, ci, :], gs[0:v, ci, :])
        hsg = self.hsg
        for c0 in range(self.h0, self.h0 + self.Hc, NMAX):
            n = min(NMAX, self.h0 + self.Hc - c0)
            wq, _, wsv = self.wguq.load(c0, n, "p2_w")
            for tt in range(nTw):
                r_ps = nl.ndarray((P, n), dtype=nl.float32, buffer=nl.psum, name="p2_r")
                for ci, kt in enumerate(p.k2):
                    nisa.nc_matmul_mx(
                        dst=r_ps, stationary=gq[0 : kt.v, ci, tt * P : (tt + 1) * P],
                        moving=wq[0 : kt.v, ci, :], stationary_scale=gs[0 : kt.v, ci, tt * P : (tt + 1) * P],
                        moving_scale=wsv[ci], accumulate=ci > 0,
                    )  # fmt: skip
                r = nl.ndarray((P, n), dtype=nl.bfloat16, buffer=nl.sbuf, name="p2_rb")
                nisa.tensor_copy(dst=r, src=r_ps)
                gtt = w * nTw + tt
                if self.tok is None:
                    r0 = b * p.B + gtt * P
                    nisa.dma_copy(dst=hsg[r0 : r0 + P, c0 : c0 + n], src=r)
                    continue
                if p.accumulate:
                    # read-add-write in bf16 (one token per row of a block, bwd spec §3.2)
                    old = nl.ndarray((P, n), dtype=nl.bfloat16, buffer=nl.sbuf, name="p2_old")
                    self.gather_rows(old, hsg, b, gtt, c0, n)
                    nisa.tensor_tensor(dst=r, data1=old, data2=r, op=nl.add)
                nisa.dma_copy(dst=self.rows_src(hsg, b, gtt, c0, n), src=r, oob_mode=self.oob)

    # -- phase 3/4 operands ----------------------------------------------------------------

    def _token_rows_q(self, src: Any, b: int, w: int, dst: HbmQ, F: int, c0: int, name: str) -> Any:
        """Gather token rows (columns [c0, c0+F)) of window `w`, quantize them along the tokens
        (wrapX chunks of `dst.tiles` inside the window) and spill; returns the bf16 rows."""
        p = self.p
        Wn, nTw, w0 = p.W, p.W // P, w * p.W
        rows = nl.ndarray((P, nTw, F), dtype=nl.bfloat16, buffer=nl.sbuf, name=f"{name}_rows")
        for j in range(nTw):
            self.gather_rows(rows[:, j, :], src, b, w * nTw + j, c0, F)
        for kt in dst.tiles:
            if not w0 <= kt.k0 < w0 + Wn:
                continue
            v = kt.v
            for f0 in range(0, F, NMAX):
                n = min(NMAX, F - f0)
                ilv = nl.ndarray((P, n, 4), dtype=nl.bfloat16, buffer=nl.sbuf, name=f"{name}_ilv")
                for j in range(4):
                    pos = kt.k0 - w0 + j * v  # window position of lane 0 of byte j
                    tt, p0 = divmod(pos, P)
                    nisa.tensor_copy(dst=ilv[0:v, :, j], src=rows[p0 : p0 + v, tt, f0 : f0 + n])
                q = nl.ndarray((P, n), dtype=nl.float8_e4m3fn_x4, buffer=nl.sbuf, name=f"{name}_q")
                s = nl.ndarray((P, n), dtype=nl.uint8, buffer=nl.sbuf, name=f"{name}_s")
                nisa.memset(dst=s[0:v, :], value=0)
                _quantize_tile(ilv, kt, n, q[0:v, :], s[0:v, :])
                _spill(dst, kt, 0, c0 + f0, n, q[0:v, :], s[0:v, :])
        return rows

    def _transposed_q(self, src: Any, rows: int, w: int, dst: HbmQ, name: str) -> None:
        """``src [rows, B]`` (bf16 HBM scratch, feature-major) -> token lanes: PE transposes of
        ``[128 f, v tok]`` slices into the wrapX layout along the tokens, quantize, spill."""
        p = self.p
        Wn, w0 = p.W, w * p.W
        tiles = [kt for kt in dst.tiles if w0 <= kt.k0 < w0 + Wn]
        for f0 in range(0, rows, NMAX):
            n = min(NMAX, rows - f0)
            nf = n // P
            ft = nl.ndarray((P, nf, Wn), dtype=nl.bfloat16, buffer=nl.sbuf, name=f"{name}_ft")
            nisa.dma_copy(
                dst=ft, src=src.ap([[p.B, P], [P * p.B, nf], [1, Wn]], offset=f0 * p.B + w0)
            )
            for kt in tiles:
                v = kt.v
                ilv = nl.ndarray((P, n, 4), dtype=nl.bfloat16, buffer=nl.sbuf, name=f"{name}_ilv")
                for j in range(4):
                    k = kt.k0 - w0 + j * v  # window position of lane 0 of byte j
                    ps = nl.ndarray((P, n), dtype=nl.bfloat16, buffer=nl.psum, name=f"{name}_tp")
                    for fi in range(nf):
                        nisa.nc_transpose(
                            dst=ps[0:v, fi * P : (fi + 1) * P], data=ft[:, fi, k : k + v]
                        )
                    nisa.tensor_copy(dst=ilv[0:v, :, j], src=ps[0:v, :])
                q = nl.ndarray((P, n), dtype=nl.float8_e4m3fn_x4, buffer=nl.sbuf, name=f"{name}_q")
                s = nl.ndarray((P, n), dtype=nl.uint8, buffer=nl.sbuf, name=f"{name}_s")
                nisa.memset(dst=s[0:v, :], value=0)
                _quantize_tile(ilv, kt, n, q[0:v, :], s[0:v, :])
                _spill(dst, kt, 0, f0, n, q[0:v, :], s[0:v, :])

    def phase34_operands(self, b: int, w: int) -> None:
        p, t = self.p, self.t
        if not self.Hc:
            return
        self._token_rows_q(t["hidden_states"], b, w, self.xq, self.Hc, self.h0, "p3_x")
        dy = self._token_rows_q(
            t["output_hidden_states_grad"], b, w, self.yq, self.Hc, self.h0, "p4_dy"
        )
        self._transposed_q(self.dgu_s, 2 * p.I, w, self.gq, "p3_g")
        self._transposed_q(self.s_s, p.I, w, self.sq, "p4_s")
        if p.bias:
            self.bias_down(w, dy)

    def bias_down(self, w: int, dy: Any) -> None:
        """Down bias grad: per 128-token tile ``sum_r bf16(dY*bf16(alpha))`` in fp32 (a
        ones-matmul over the partitions), bf16 running sum over the block's tiles (§6)."""
        p = self.p
        nTw = p.W // P
        acc = self.acc_bd
        for tt in range(nTw):
            gtt = w * nTw + tt
            # bf16(alpha) held in an fp32 (P, 1) operand tile
            a_bf = nl.ndarray((P, 1), dtype=nl.bfloat16, buffer=nl.sbuf, name="bd_a")
            nisa.tensor_copy(dst=a_bf, src=self.alpha_tok[:, gtt : gtt + 1])
            a_f = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf, name="bd_af")
            nisa.tensor_copy(dst=a_f, src=a_bf)
            prod = nl.ndarray((P, self.Hc), dtype=nl.bfloat16, buffer=nl.sbuf, name="bd_prod")
            nisa.tensor_scalar(dst=prod, data=dy[:, tt, :], op0=nl.multiply, operand0=a_f)
            for c0 in range(0, self.Hc, NMAX):
                n = min(NMAX, self.Hc - c0)
                red = nl.ndarray((1, n), dtype=nl.float32, buffer=nl.psum, name="bd_red")
                nisa.nc_matmul(dst=red, stationary=self.ones_bf, moving=prod[:, c0 : c0 + n])
                nisa.tensor_tensor(
                    dst=acc[:, c0 : c0 + n], data1=acc[:, c0 : c0 + n], data2=red, op=nl.add
                )

    # -- phases 3 and 4 ------------------------------------------------------------------

    def _rmw(self, dst_ap: Any, c_ps: Any, first_dense: bool, rows: int, n: int, name: str) -> None:
        """dst = bf16(dst + bf16(C)) through one DMA read and one write (dense block 0: write)."""
        c = nl.ndarray((P, n), dtype=nl.bfloat16, buffer=nl.sbuf, name=f"{name}_c")
        nisa.tensor_copy(dst=c[0:rows, :], src=c_ps)
        if not first_dense:
            old = nl.ndarray((P, n), dtype=nl.bfloat16, buffer=nl.sbuf, name=f"{name}_old")
            nisa.dma_copy(dst=old[0:rows, :], src=dst_ap)
            nisa.tensor_tensor(
                dst=c[0:rows, :], data1=old[0:rows, :], data2=c[0:rows, :], op=nl.add
            )
        nisa.dma_copy(dst=dst_ap, src=c[0:rows, :])

    def _w_ap(self, t: Any, pattern: list[list[int]], offset: int) -> Any:
        if self.expert is None:
            return t.ap(pattern, offset=offset)
        return t.ap(pattern, offset=offset, scalar_offset=self.expert, indirect_dim=0)

    def phase3(self, b: int) -> None:
        """dW_gu[e][h, g, i] += bf16(mx(X^T, dGU)) per [128 h, <=512 i] tile (§6 P3)."""
        p = self.p
        first = p.dense and b == 0
        I2 = 2 * p.I
        for g in range(2):
            for i0 in range(0, p.I, NMAX):
                n = min(NMAX, p.I - i0)
                gq, _, gsv = self.gq.load(g * p.I + i0, n, "p3_g")
                for ht in self.h_tiles:
                    xq, _, xsv = self.xq.load(ht * P, P, "p3_x")
                    c_ps = nl.ndarray((P, n), dtype=nl.float32, buffer=nl.psum, name="p3_c")
                    for ci, kt in enumerate(p.k3):
                        nisa.nc_matmul_mx(
                            dst=c_ps, stationary=xq[0 : kt.v, ci, :], moving=gq[0 : kt.v, ci, :],
                            stationary_scale=xsv[ci], moving_scale=gsv[ci], accumulate=ci > 0,
                        )  # fmt: skip
                    dst = self._w_ap(self.dwgu, [[I2, P], [1, n]], ht * P * I2 + g * p.I + i0)
                    self._rmw(dst, c_ps, first, P, n, "p3")

    def phase4(self, b: int) -> None:
        """dW_d[e][i, h] += bf16(mx(S^T, dY)) per [128 i, <=512 h] tile (§6 P4)."""
        p = self.p
        first = p.dense and b == 0
        for c0 in range(self.h0, self.h0 + self.Hc, NMAX):
            n = min(NMAX, self.h0 + self.Hc - c0)
            yq, _, ysv = self.yq.load(c0, n, "p4_y")
            for it in range(p.nI):
                sq, _, ssv = self.sq.load(it * P, P, "p4_s")
                c_ps = nl.ndarray((P, n), dtype=nl.float32, buffer=nl.psum, name="p4_c")
                for ci, kt in enumerate(p.k4):
                    nisa.nc_matmul_mx(
                        dst=c_ps, stationary=sq[0 : kt.v, ci, :], moving=yq[0 : kt.v, ci, :],
                        stationary_scale=ssv[ci], moving_scale=ysv[ci], accumulate=ci > 0,
                    )  # fmt: skip
                dst = self._w_ap(self.dwd, [[p.H, P], [1, n]], it * P * p.H + c0)
                self._rmw(dst, c_ps, first, P, n, "p4")

    def write_bias(self, b: int) -> None:
        """Bias grads: bf16 read-modify-write of this block's bf16 sums (§6 "Bias")."""
        p = self.p
        if self.Hc:
            old = nl.ndarray((1, self.Hc), dtype=nl.bfloat16, buffer=nl.sbuf, name="bd_old")
            dst = self._w_ap(self.dbd, [[p.H, 1], [1, self.Hc]], self.h0)
            nisa.dma_copy(dst=old, src=dst)
            nisa.tensor_tensor(dst=old, data1=old, data2=self.acc_bd, op=nl.add)
            nisa.dma_copy(dst=dst, src=old)
        for n_it, it in enumerate(self.i_tiles):
            for g in range(2):
                old = nl.ndarray((P, 1), dtype=nl.bfloat16, buffer=nl.sbuf, name="bgu_old")
                dst = self._w_ap(self.dbgu, [[1, P], [1, 1]], g * p.I + it * P)
                nisa.dma_copy(dst=old, src=dst)
                col = self.acc_bgu[:, g, n_it : n_it + 1]
                nisa.tensor_tensor(dst=old, data1=old, data2=col, op=nl.add)
                nisa.dma_copy(dst=dst, src=old)


def blockwise_mm_bwd_mxfp8_nki(
    hidden_states: Any,
    expert_affinities_masked: Any,
    gate_up_proj_weight: Any,
    down_proj_weight: Any,
    token_position_to_id: Any,
    block_to_expert: Any,
    output_hidden_states_grad: Any,
    block_size: int = 4096,
    gate_up_proj_act_checkpoint_T: Any = None,
    gate_act_checkpoint_T: Any = None,
    intermediate_checkpoint_T: Any = None,
    scaled_intermediate_checkpoint_T: Any = None,
    down_proj_act_checkpoint: Any = None,
    config: MXFP8MOEBwdConfig | None = None,
    gate_up_weight_scales: Any = None,
    down_weight_scales: Any = None,
    num_valid_tokens: Any = None,
) -> tuple[Any, ...]:
    """The NKI kernel (API reference signature, bwd spec §0 G4). Tensors are HBM tensors;
    MX data arrives as uint32 (x4 words) / uint8 (scales). Returns the gradient tuple of the
    API reference (bias grads appended when ``config.bias``). Shape and configuration checks of
    bwd spec §10 are trace-time errors (`BwdValidationError`)."""
    cfg = config if config is not None else MXFP8MOEBwdConfig()
    cfg.validate()
    if gate_up_proj_act_checkpoint_T is None:
        raise NkiKernelUnsupportedError(
            "gate_up_proj_act_checkpoint_T: the NKI kernel needs the gate/up checkpoint (no "
            "recompute from hidden_states), got None"
        )
    if down_proj_act_checkpoint is not None:
        _fail("down_proj_act_checkpoint: must be None under AFFINITY_ON_I, got a tensor")
    if block_size not in BLOCK_SIZES:
        _fail(f"block_size: expected one of {', '.join(map(str, BLOCK_SIZES))}, got {block_size!r}")
    B = int(block_size)
    T, H = hidden_states.shape
    _shape("output_hidden_states_grad", output_hidden_states_grad, (T, H))
    E = down_proj_weight.shape[0]
    pq_d = down_weight_scales is not None
    pq_gu = gate_up_weight_scales is not None
    I = down_proj_weight.shape[2] if pq_d else down_proj_weight.shape[1]  # noqa: E741
    if H % P or I % P:
        _fail(f"hidden_states/down_proj_weight: H and I must be multiples of 128, got H={H}, I={I}")
    _shape("down_proj_weight", down_proj_weight, (E, H // 4, I) if pq_d else (E, I, H))
    _shape(
        "gate_up_proj_weight", gate_up_proj_weight, (E, 2 * I // 4, H) if pq_gu else (E, H, 2, I)
    )
    n_tok = token_position_to_id.shape[0]
    if len(token_position_to_id.shape) != 1 or n_tok % B:
        _fail(
            f"token_position_to_id: expected shape (N*{B},), got {tuple(token_position_to_id.shape)}"
        )
    N = n_tok // B
    _shape("block_to_expert", block_to_expert, (N, 1))
    _shape("expert_affinities_masked", expert_affinities_masked, (T * E, 1))
    _shape("gate_up_proj_act_checkpoint_T", gate_up_proj_act_checkpoint_T, (N, 2, I, B))
    for name, x in (
        ("gate_act_checkpoint_T", gate_act_checkpoint_T),
        ("intermediate_checkpoint_T", intermediate_checkpoint_T),
        ("scaled_intermediate_checkpoint_T", scaled_intermediate_checkpoint_T),
    ):
        if x is not None:
            _shape(name, x, (N, I, B))
    if cfg.single_expert_dense and (E != 1 or T % B or N != T // B):
        _fail(
            f"single_expert_dense: requires E == 1, T % B == 0 and N == T/B, got E={E}, T={T}, B={B}, N={N}"
        )
    if num_valid_tokens is not None and not cfg.single_expert_dense:
        _fail("num_valid_tokens: requires config.single_expert_dense=True, got False")
    plan = kernel_plan(
        T, H, I, E, B, N, cfg, nv=num_valid_tokens is not None, pq_gu=pq_gu, pq_d=pq_d
    )
    tensors = {
        "hidden_states": hidden_states,
        "expert_affinities_masked": expert_affinities_masked,
        "gate_up_proj_weight": gate_up_proj_weight,
        "down_proj_weight": down_proj_weight,
        "token_position_to_id": token_position_to_id,
        "block_to_expert": block_to_expert,
        "output_hidden_states_grad": output_hidden_states_grad,
        "gate_up_proj_act_checkpoint_T": gate_up_proj_act_checkpoint_T,
        "gate_act_checkpoint_T": gate_act_checkpoint_T,
        "intermediate_checkpoint_T": intermediate_checkpoint_T,
        "scaled_intermediate_checkpoint_T": scaled_intermediate_checkpoint_T,
        "gate_up_weight_scales": gate_up_weight_scales,
        "down_weight_scales": down_weight_scales,
        "num_valid_tokens": num_valid_tokens,
    }
    return _Bwd(plan, tensors).run()


# ``nki.jit`` object for launches (``blockwise_mm_bwd_mxfp8_jit[2](...)``); the plain function
# above is what ``nki.simulate`` and the interpreter run.
blockwise_mm_bwd_mxfp8_jit = nki.jit(blockwise_mm_bwd_mxfp8_nki)
