"""The launch plan the kernel specializes on: the launcher's `BwdKernelConfig`, the wrapX
chunks (`KTile`, `QLayout`), one core's `Geometry` (its tiles, and which operands stay in SBUF,
decided against the SBUF budgets below) and the phase-1 pipeline depth.

Everything here is compile-time arithmetic on ints and bools (no instruction is issued).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import nki.language as nl

P = 128  # partitions (nl.tile_size.pmax)
NMAX = 512  # moving free size of one matmul (one fp32 PSUM bank)
# Columns of the zero tile used to initialise outputs (2 KiB runs: nki-dma-bandwidth-guide.rst,
# ">= 2 KiB approaches peak"). 1024, not 2048: the zero tile is live for the whole kernel, and
# with software-DGE descriptor storage counted (nkisim.machine.SWDGE_DESCRIPTOR_BYTES, assumed
# 256 B) 2048 put AWS's shape 12 B past `SBUF_BUDGET` (212,484 B on core 0); 1024 peaks at
# 210,436 B (cost model: 816 -> 858 us there, the README shapes within 0.5%).
ZCOLS = 1024
QUAD = 32  # partitions per SBUF quadrant (MX scales live in their data's quadrant)
# Columns of a spilled phase-3/4 operand staged per write-back in phase 1 (`_rows_q`): 4 KiB
# data / 1 KiB scale runs (nki-dma-bandwidth-guide.rst: ~89% / ~67% of peak, against ~80% /
# ~50% for one 512-column matmul group), in 5 KiB of SBUF per partition.
SPILL_COLS = 1024
# SBUF bytes per partition the kernel plans to stay within, below the Trn3 capacity (245752):
# the margin AWS's own MXFP8 backward keeps at its tuned shape (issue #29's figure). AWS's
# tuned_blocking.py (aws-neuron/nki-library, SHAPE_TUNED_CONFIGS, the B=4096 H=4096 I_TP=1536
# entry) halves its phase-2 M-blocking from 32 to 16 because 32 "overflow SBUF during
# QuantizeMx (NCC_IBIR229)"; the byte figure itself is not a literal in AWS's code. The
# `*_BUDGET` figures below keep the peak within it at AWS's shape and at the README's shapes
# (tests/kernels/test_nki_blockwise_mm_bwd_mxfp8.py::test_peak_sbuf_within_aws_margin).
SBUF_BUDGET = 212472
# SBUF bytes per partition the resident quantized weights may take (of 245752 on Trn3; the
# rest of the kernel peaks near 60 KB at the production shape).
RESIDENT_BUDGET = 96 * 1024
# SBUF bytes per partition the phase-3/4 stationary operands (X and S, quantized along the
# block's tokens, scales packed) may take together to stay on chip for the block instead of
# going through HBM scratch and being loaded again for every output tile.
STATIONARY_BUDGET = 120 * 1024
# SBUF bytes per partition the phase-3/4 moving operands (dGU and dY, quantized along the
# block's tokens, scales packed) may take together to stay on chip instead of going through
# HBM scratch.
MOVING_BUDGET = 48 * 1024
# SBUF bytes per partition block b's phase-3/4 working set and block b+1's prologue and
# phase-1 loads may take together for the two to overlap (`_geometry`).
OVERLAP_BUDGET = 160 * 1024
OVERLAP4_BUDGET = 180 * 1024
# SBUF bytes per partition of the resident phase-3 X under which a streamed W_gu's phase-2
# column groups are loaded one ahead (the B=1024 DeepSeek-V3 shape, with X twice as large,
# would exceed the SBUF by the second group).
W_AHEAD_X_BUDGET = 24 * 1024
# The same for a W_gu quantized on chip per phase-2 column group (`_wgu_fly`): DeepSeek-V3's
# B=1024 and 2048 shapes fit (X 32 / 61 KB, peaks 195 / 215 KB), B=4096 (X 118 KB) does not.
W_AHEAD_FLY_X_BUDGET = 64 * 1024
# SBUF bytes per partition two windows' phase-2 X rows and hidden-grad rows may take for the
# latter to be gathered a window ahead (`_hsg_old`).
OLD_AHEAD_BUDGET = 32 * 1024
# SBUF bytes per partition phase 1's gathered dY rows may take to be gathered two windows
# ahead of their use (three windows' rows live) instead of one.
ROWS_AHEAD_BUDGET = 96 * 1024
# SBUF bytes per partition the resident phase-2 W_gu, the resident phase-3 X and two windows'
# X rows may take together for window w+1's X rows to be gathered with its phase-2 loads (a
# window ahead); else right after window w's X rows are last read (AWS's shape: 160 KB, whose
# phase 2 would peak 16 KB past `SBUF_BUDGET`).
X_AHEAD_BUDGET = 144 * 1024
# SBUF bytes per partition (resident phase-1/2 weights + two windows' phase-1 loads and
# operands + one window's dY rows) under which phase 1 runs as a software pipeline.
PIPELINE_BUDGET = 230 * 1024


@dataclass
class BwdKernelConfig(nl.NKIObject):
    """Everything the instruction stream depends on besides the tensors, planned by the
    launcher (`mxcli.kernels.blockwise_moe.nki_backend.kernel_config`).

    Shapes ``T, H, I, E, B, N`` and ``W`` (tokens per window). Paths: ``dense``
    (single_expert_dense), ``nv`` (num_valid_tokens given), ``accumulate`` (hidden-grad
    read-add-write), ``bias``, ``skip_token``, ``pq_gu`` / ``pq_d`` (pre-quantized weights).
    ``clamp``: ``(nl_lower, nl_upper, l_lower, l_upper)``, floats or None (bwd spec §4.2).
    ``k1..k4``: the wrapX chunks ``((k0, c), ...)`` of the four contractions (H, 2I, B, B);
    ``runs1..runs4``: ``((first chunk, count), ...)`` of full 128-lane chunks with contiguous
    HBM rows (one DMA each). ``d_groups`` / ``gu_groups``: the 128-row groups of a packed
    pre-quantized scale tensor loaded whole; ``d_place`` / ``gu_place``: per chunk
    ``(slot, start partition, first HBM row or -1)`` of its scales (see `_load_packed_scales`);
    both empty for unpacked scales. ``x4_dtype``, ``compute_dtype``: ``nki`` dtypes.
    """

    T: int
    H: int
    I: int  # noqa: E741 - the spec's name
    E: int
    B: int
    N: int
    W: int
    dense: bool
    nv: bool
    accumulate: bool
    bias: bool
    skip_token: bool
    pq_gu: bool
    pq_d: bool
    clamp: tuple[Any, ...]
    k1: tuple[tuple[int, int], ...]
    k2: tuple[tuple[int, int], ...]
    k3: tuple[tuple[int, int], ...]
    k4: tuple[tuple[int, int], ...]
    runs1: tuple[tuple[int, int], ...]
    runs2: tuple[tuple[int, int], ...]
    runs3: tuple[tuple[int, int], ...]
    runs4: tuple[tuple[int, int], ...]
    d_groups: tuple[int, ...]
    d_place: tuple[tuple[int, int, int], ...]
    gu_groups: tuple[int, ...]
    gu_place: tuple[tuple[int, int, int], ...]
    x4_dtype: Any
    compute_dtype: Any


@dataclass
class KTile(nl.NKIObject):
    """One wrapX chunk of a contraction axis: ``c`` values from ``k0``, ``v = c/4`` lanes.

    Lane ``p`` of x4 element byte ``j`` holds contraction index ``k0 + j*v + p`` (bwd spec §5.3),
    so an MX group (8 lanes x 4 bytes) is ``{k0 + j*v + 8g + i}``. In HBM (x4 data and
    unpacked scales) the chunk occupies rows ``[row0, row0 + v)`` with ``row0 = k0/4``; the
    scale of lane ``p`` sits on partition ``32*(p//32) + (p%32)//8`` of the scale tile (the
    hardware quadrant layout, §5.5).
    """

    k0: int
    c: int
    v: int
    row0: int


@dataclass
class QLayout(nl.NKIObject):
    """Layout of an MX operand in HBM, wrapX along its contraction (bwd spec §5.5): x4 data
    ``[.., K/4, F]``, uint8 scales unpacked ``[.., K/4, F]`` or packed (``groups`` / ``place``
    non-empty, see `BwdKernelConfig`)."""

    tiles: tuple[Any, ...]
    runs: tuple[tuple[int, int], ...]
    F: int
    groups: tuple[int, ...]
    place: tuple[tuple[int, int, int], ...]


@dataclass
class Geometry(nl.NKIObject):
    """What one program (core) works on: its 128-row I tiles ``[i_lo, i_lo + n_i)`` in
    phase 1, its 128-column H tiles ``[h_lo, h_lo + n_h)`` (columns ``[h0, h0 + Hc)``) in
    phases 2-4 (SHARD_ON_FREE, bwd spec §8), whether its quantized weights stay resident in
    SBUF, and the four contractions' chunks as `KTile`s."""

    pid: int
    lnc: int
    i_lo: int
    n_i: int
    h_lo: int
    n_h: int
    h0: int
    Hc: int
    d_cols: int
    res_gu: bool
    res_d: bool
    res_x: bool
    res_s: bool
    res_moving: bool
    overlap: bool
    overlap4: bool
    w2_ahead: bool
    x_ahead: bool
    k1: tuple[Any, ...]
    k2: tuple[Any, ...]
    k3: tuple[Any, ...]
    k4: tuple[Any, ...]


def _split(n: int, parts: int, idx: int) -> tuple[int, int]:
    """(first, count) of core `idx`'s tiles when `n` tiles are split into `parts` contiguous
    runs (the first ones one larger)."""
    base = n // parts
    extra = n % parts
    lo = idx * base + min(idx, extra)
    count = base + 1 if idx < extra else base
    return lo, count


def _ktiles(pairs: tuple[tuple[int, int], ...]) -> tuple[Any, ...]:
    out = []
    for k0, c in pairs:
        out.append(KTile(k0, c, c // 4, k0 // 4))
    return tuple(out)


def _geometry(cfg: BwdKernelConfig, lnc: int, pid: int) -> Geometry:
    i_lo, n_i = _split(cfg.I // P, lnc, pid)
    h_lo, n_h = _split(cfg.H // P, lnc, pid)
    Hc = n_h * P
    d_cols = n_i * P
    # Quantized phase-1/2 weights stay in SBUF for the block when they fit the budget (x4 data
    # plus one scale byte per lane and column); gate/up first: it is reloaded twice as much.
    wgu_bytes = len(cfg.k2) * Hc * 5
    wd_bytes = len(cfg.k1) * d_cols * 5
    res_gu = wgu_bytes > 0 and wgu_bytes <= RESIDENT_BUDGET
    budget_d = RESIDENT_BUDGET - wgu_bytes if res_gu else RESIDENT_BUDGET
    res_d = wd_bytes > 0 and wd_bytes <= budget_d
    # The phase-3/4 stationary operands X [tok lanes, Hc] and S [tok lanes, I] are quantized
    # straight into SBUF when they fit `STATIONARY_BUDGET` (X first: it has more output tiles),
    # else spilled to HBM scratch and loaded back per output tile.
    x_bytes = _packed_bytes(len(cfg.k3), Hc)
    s_bytes = _packed_bytes(len(cfg.k4), cfg.I)
    # (with a streamed W_gu, phase 2 also holds two windows' X rows and hidden-grad rows and a
    # W_gu column group or two: X stays on chip up to `W_AHEAD_FLY_X_BUDGET` only)
    res_x = Hc > 0 and x_bytes <= (STATIONARY_BUDGET if res_gu else W_AHEAD_FLY_X_BUDGET)
    res_s = Hc > 0 and s_bytes <= STATIONARY_BUDGET - (x_bytes if res_x else 0)
    # The moving operands dGU [tok lanes, 2I] and dY [tok lanes, Hc] likewise stay on chip
    # from the phase that quantizes them to phases 3/4 when they fit `MOVING_BUDGET` (short
    # blocks): no spill and reload through HBM scratch on the way.
    g_bytes = _packed_bytes(len(cfg.k3), 2 * cfg.I)
    y_bytes = _packed_bytes(len(cfg.k4), Hc)
    res_moving = Hc > 0 and g_bytes + y_bytes <= MOVING_BUDGET
    # Block b+1's prologue and phase 1 run during block b's phases 3/4 where both working sets
    # fit `OVERLAP_BUDGET`: phase 3/4's on-chip operands and two column groups of output tiles,
    # and the next block's resident W_d, first dY rows and window-0 loads.
    p34 = (x_bytes if res_x else 0) + (s_bytes if res_s else 0)
    p34 = p34 + (g_bytes + y_bytes if res_moving else 0)
    p34 = p34 + 2 * max(n_h, cfg.I // P) * NMAX * 2
    nxt = _packed_bytes(len(cfg.k1), d_cols) + 2 * (cfg.W // P) * cfg.H * 2
    nxt = nxt + n_i * cfg.W * 2 * 2 + cfg.W * 4
    overlap = p34 + nxt <= OVERLAP_BUDGET
    # else block b+1's prologue alone during block b's phase 4 where that fits
    # `OVERLAP4_BUDGET` (phase 4's operands and output tiles only)
    p4 = (s_bytes if res_s else 0) + (y_bytes if res_moving else 0) + 2 * (cfg.I // P) * NMAX * 2
    overlap4 = p4 + nxt <= OVERLAP4_BUDGET
    # a streamed W_gu's phase-2 column groups loaded one ahead where the resident X leaves room
    # for the second group (`W_AHEAD_X_BUDGET`; `W_AHEAD_FLY_X_BUDGET` for one quantized on chip
    # per group, `_wgu_fly`, whose packed scales make a group 17 KB instead of 20)
    x_res = x_bytes if res_x else 0
    fly = _streams_gu_on_chip(cfg, res_gu)
    w2_ahead = not res_gu and (x_res <= W_AHEAD_X_BUDGET or (fly and x_res <= W_AHEAD_FLY_X_BUDGET))
    # phase 3's X rows gathered a window ahead where they fit beside the resident operands
    x_ahead = (wgu_bytes if res_gu else 0) + x_res + 2 * (cfg.W // P) * Hc * 2 <= X_AHEAD_BUDGET
    return Geometry(
        pid, lnc, i_lo, n_i, h_lo, n_h, h_lo * P, Hc, d_cols, res_gu, res_d, res_x, res_s,
        res_moving, overlap, overlap4, w2_ahead, x_ahead,
        _ktiles(cfg.k1), _ktiles(cfg.k2), _ktiles(cfg.k3), _ktiles(cfg.k4),
    )  # fmt: skip


def _packed_bytes(nk: int, F: int) -> int:
    """SBUF bytes per partition of an on-chip operand of `nk` chunks x `F` columns: x4 data plus
    scales packed four chunks to a tile (quadrant offsets 0/4/8/12, api spec §7.3)."""
    return nk * F * 4 + ((nk + 3) // 4) * F


def _streams_gu_on_chip(cfg: BwdKernelConfig, res_gu: bool) -> bool:
    """Whether a W_gu that is not resident is quantized per phase-2 column group on chip
    (`_wgu_fly`): routed launches of on-the-fly quantization (dense ones quantize once for all
    blocks into the scratch, pre-quantized weights are loaded as they are)."""
    return not cfg.dense and not cfg.pq_gu and not res_gu


def _wgu_staged(cfg: BwdKernelConfig, geo: Geometry) -> bool:
    """Whether W_gu is quantized on chip into SBUF a few chunks per phase-1 window
    (`_wgu_pairs`) rather than all at once after window 0's loads."""
    return not cfg.dense and not cfg.pq_gu and geo.Hc > 0 and geo.res_gu


def _wgu_fly(cfg: BwdKernelConfig, geo: Geometry) -> bool:
    """Whether a streamed (not resident) W_gu is quantized per phase-2 column group straight
    from its ``dma_transpose`` (`_wgu_group`) instead of once per block into an HBM scratch
    that phase 2 then reads back: the weights' x4 data and scales go through HBM twice less
    (dense launches quantize once for all blocks and keep the scratch)."""
    return geo.Hc > 0 and _streams_gu_on_chip(cfg, geo.res_gu)


def _pipeline_depth(cfg: BwdKernelConfig, geo: Geometry) -> tuple[bool, int]:
    """Phase 1's software pipeline (`_block_phase1`): whether window w+1's loads and operands are
    issued before window w's compute (where they fit `PIPELINE_BUDGET`; else the operands just
    before their compute), and how many windows ahead the dY rows are gathered (two where
    they fit `ROWS_AHEAD_BUDGET` and, with the operands' pipeline or without it, the
    `PIPELINE_BUDGET`)."""
    Wn, bpe = cfg.W, 2
    dy_bytes = (Wn // P) * cfg.H * bpe
    win_bytes = geo.n_i * Wn * bpe * 5 + Wn * 4 + _packed_bytes(len(geo.k1), Wn)
    w_bytes = 0
    if geo.res_d:
        w_bytes = w_bytes + _packed_bytes(len(geo.k1), geo.d_cols)
    if geo.res_gu:
        w_bytes = w_bytes + _packed_bytes(len(geo.k2), geo.Hc)
    q_ahead = 2 * win_bytes + dy_bytes + w_bytes <= PIPELINE_BUDGET
    ahead = 1
    if 3 * dy_bytes <= ROWS_AHEAD_BUDGET:
        if 2 * win_bytes + 3 * dy_bytes + w_bytes <= PIPELINE_BUDGET:
            ahead = 2
        elif q_ahead and win_bytes + 3 * dy_bytes + w_bytes <= PIPELINE_BUDGET:
            # the rows two windows ahead rather than the operands one window ahead (AWS's
            # shape: the cost model puts the operands' pipeline at 1% of the schedule, the
            # rows' second window at 7%; both would peak 28 KB past `SBUF_BUDGET`)
            ahead = 2
            q_ahead = False
    return q_ahead, ahead
