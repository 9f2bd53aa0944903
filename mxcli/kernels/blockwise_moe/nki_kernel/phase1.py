"""NKI kernel of ``blockwise_mm_bwd_mxfp8`` for Trn3 (NeuronCore-v4), NKI 0.6 API.

MXFP8 backward of a blockwise, dropless MoE layer with SwiGLU experts. The numerics are those
of the torch reference beside this file (`backward.py`, bwd spec §4, §6); this module is the same
computation written as NKI instructions and runs unchanged on the real ``nki.simulate``, on
mxcli's interpreter (`mxcli.nkisim`) and on Trainium.

Import this module only with an ``nki`` package importable: the real one, or mxcli's interpreter
activated by `mxcli.kernels.nki_runtime` (never at package import time).

Everything here is inside the NKI 0.6 meta-programming subset (nki_python_subset.md): the
kernel receives tensors and one `BwdKernelConfig` (an ``nl.NKIObject`` of ints, bools, tuples
and ``nki`` dtypes) that the launcher (`nki_backend.kernel_config`) builds after validating the
inputs and planning the launch (wrapX chunk lists, packed-scale placement, DMA runs). Helper
classes are ``NKIObject`` dataclasses that hold no tensors; tensors travel in dicts with string
keys. There is no validation here beyond ``assert``s of what the launcher guarantees.

Dataflow of one block ``b`` of ``B`` token positions, expert ``e = block_to_expert[b]``
(bwd spec §4.2, §6; ``P = 128`` partitions, ``W = min(B, 512)`` tokens per window):

0. indices: ``tok [P, B/P]`` (position ``t*P + p`` on partition ``p``), clamped below at -1,
   ``ea_idx = max(tok*E + e, -1)``: an fp32 multiply by ``E`` (tensor_scalar operands are fp32),
   then an int32 add of the broadcast expert id, as upstream computes affinity offsets. Padding
   ids (-1, or >= T) are then -1 or past the end, so ``oob_mode.skip`` drops them from every
   indirect gather (rows stay 0) and scatter. ``alpha`` is gathered per token, then broadcast
   to all partitions through a small HBM scratch (stride-0 read).
1. weights: ``W_d[e]`` (contraction H) and ``W_gu[e]`` as ``[2I, H]`` (contraction 2I) are
   loaded with one 3-D ``dma_transpose`` per wrapX chunk straight into the wrapX layout
   (lane ``p``, column ``f``, byte ``j`` <- ``w[f, k0 + j*v + p]``) and quantized on chip, or
   taken pre-quantized (same layout, §5.5; packed scales of a chunk that does not start on a
   512 boundary are moved into their data's 32-partition quadrant while loading). They stay
   resident in SBUF for the block when they fit `RESIDENT_BUDGET` (W_gu quantized a share per
   phase-1 window, `_wgu_staged`), else W_d is spilled to an HBM scratch (x4 data + e8m0
   scales) and streamed per window, and W_gu is quantized per phase-2 column group from its
   transpose (`_wgu_fly`). Dense mode quantizes both once into the scratch.
2. phase 1 per window: ``dY`` rows gathered (tokens on partitions), PE-transposed into the wrapX
   layout along H and ``quantize_mx``-ed; ``D^T [I, W] = mx(W_d, dY^T)`` per 128-row I tile
   (``nc_matmul_mx``, fp32 PSUM accumulation over the H chunks). SwiGLU backward on ``[i, tok]``
   tiles against the bf16 checkpoint (ScalarE ``silu``/``silu_dx``, VectorE products with the
   spec's bf16 rounding points), clamp masks, affinity grad ``sum_i D*Hm`` as a ones-matmul over
   the partitions. ``dG | dU`` and ``S`` (bf16, ``[2I, B]`` / ``[I, B]``) go to a shared HBM
   scratch: under LNC 2 phase 1 is split over I (SHARD_ON_FREE) and the halves meet there.
3. phase 2 per window: ``[dG|dU]^T`` chunk rows loaded whole (contiguous DMA runs), then
   interleaved into the wrapX layout along 2I by one VectorE copy, quantized;
   ``R [W, H] = mx(dGU, W_gu)`` per 128-token tile; hidden-state grad rows scattered (or
   gathered, added in fp32, rounded to bf16 and scattered when accumulating).
4. phases 3/4 operands (contraction over the block's tokens), quantized along the tokens:
   ``X`` rows gathered and ``dY``'s taken from phase 1's rows, interleaved into the wrapX
   layout; ``dGU`` PE-transposed from phase 2's row tiles and ``S`` from the scratch (during
   phase 3). The stationary ``X`` and ``S`` stay in SBUF when they fit `STATIONARY_BUDGET`
   (scales packed four chunks to a tile), the moving ``dGU`` / ``dY`` go through HBM scratch.
5. phases 3/4: ``dW_gu[e] = bf16(dW_gu[e] + bf16(mx(X^T, dGU)))`` and
   ``dW_d[e] = bf16(dW_d[e] + bf16(mx(S^T, dY)))`` tile by tile, or a whole output row tile at
   a time where the moving operands are on chip and blocks do not overlap (`_phase34_rows`):
   the old value gathered per row (``oob_mode.skip``) only where an earlier block had expert
   ``e`` (a per-expert flag, `_rmw_index`), else taken as +0 without a read; written through a
   ``scalar_offset`` DMA.
   The weight grads of experts without any block are zeroed once the flags are final
   (`_zero_unused_experts`); dense block 0 writes instead.
6. bias grads (routed only): per 128-token tile fp32 sums (ones-matmul / free-axis reduce),
   bf16 running sums per block, then a bf16 read-modify-write per block.

Engine balance and overlap (cost model, `mxcli profile bwd`): the PSUM evictions of the
phase-2 and phase-3/4 results run on ScalarE (``tensor_copy(engine=scalar)``, bit-exact as on
VectorE: one fp32 -> bf16 rounding; alternating with VectorE in `_phase34_rows`), the
checkpoint-only SwiGLU products on GpSimd, the other
elementwise work on VectorE. Every phase is a software pipeline: the loads (and in phase 1 the
operands) of window / column group k+1 are issued before the compute and write-backs of k,
since DMA engines and queues start transfers in program order; loads, write-backs, gathers
and zeroing use different DMA queues (`_load`, `_store`).

LNC 2 (SHARD_ON_FREE): phase 1 splits the 128-row I tiles, phases 2-4 split the 128-column H
tiles between the two cores; the affinity-grad partials are added in fp32 (core 0's half
first) and written by core 0. Both cores zero exactly the output regions they later update.
Blocks overlap: block b+1's indices, prologue and phase 1 are issued during block b's phases
3/4 where their working sets fit (`_geometry`), so the three shared scratch tensors handed
between the cores (``dgu_s``, ``s_s``, ``da_s``) come in two sets used by alternate blocks
(`_block_tensors`); after each block's phase 1 both cores ``core_barrier`` on both sets: this
block's (written by both, then read by both) and the previous block's (its last reads, in
phases 2-3, come before this point on both cores; the next writes after it).

Supported: routed and ``single_expert_dense`` paths, on-the-fly or pre-quantized weights
(packed or unpacked scales), ``accumulate_hidden_states_grad``, bias grads, clamp masks,
``num_valid_tokens`` (dense), ``fast_dma_transpose`` grouping (errata 1), any ``tile_k``,
the optional ``gate_act`` / ``intermediate`` / ``scaled_intermediate`` checkpoints (used as
given), LNC 1 and 2. The launcher rejects what this kernel does not implement (the 1x32 quant
scheme, AFFINITY_ON_H, a missing gate/up checkpoint).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import nki
import nki.isa as nisa
import nki.language as nl

__all__ = [
    "BwdKernelConfig",
    "KTile",
    "blockwise_mm_bwd_mxfp8_jit",
    "blockwise_mm_bwd_mxfp8_nki",
]

P = 128  # partitions (nl.tile_size.pmax)
NMAX = 512  # moving free size of one matmul (one fp32 PSUM bank)
ZCOLS = 2048  # columns of the zero tile used to initialise outputs
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


# --------------------------------------------------------------------------------------------
# Quantized operands. An operand is a dict: in HBM {"layout": QLayout, "data", "scales",
# "expert"} (expert: a (1, 1) int32 SBUF view selecting the leading axis at run time through
# ``scalar_offset``, or None), resident in SBUF {"layout": None, "q", "views", "c_lo"}.
# --------------------------------------------------------------------------------------------


def _hbm_operand(data: Any, scales: Any, layout: QLayout, expert: Any) -> dict[str, Any]:
    return {"layout": layout, "data": data, "scales": scales, "expert": expert}


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


def _load_packed_scales(op: dict[str, Any], c0: int, n: int, name: str) -> list[Any]:
    """Packed scales of columns ``[c0, c0+n)``, one view per chunk (bwd spec §5.5).

    A chunk starting on a 512 boundary finds its scales in one 128-row group at partition
    offset 0/4/8/12, lane ``p`` at ``start + 32*(p//32) + (p%32)//8``: the group is loaded
    whole into a slot. A chunk that does not (a 256/128 remainder, any chunk of tile_k < 512)
    has them one to three quadrants lower than its data, which the MX matmul does not allow:
    its 4 rows per quadrant are copied into a slot of their own, into the data's quadrants.
    """
    lay = op["layout"]
    t, expert = op["scales"], op["expert"]
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


def _load_q(op: dict[str, Any], c0: int, n: int, name: str) -> tuple[Any, list[Any]]:
    """All chunks of columns ``[c0, c0+n)``: (x4 data ``[P, nk, n]``, per-chunk scale views
    for `nc_matmul_mx`). Resident operands hand out column slices without any DMA."""
    lay = op["layout"]
    if lay is None:
        off = c0 - op["c_lo"]
        views = []
        for v in op["views"]:
            views.append(v[:, off : off + n])
        return op["q"][:, :, off : off + n], views
    nk = len(lay.tiles)
    q = nl.ndarray((P, nk, n), dtype=nl.float8_e4m3fn_x4, buffer=nl.sbuf, name=f"{name}_q")
    for i0, m in lay.runs:
        v = lay.tiles[i0].v
        src = _run_src(op["data"], lay, op["expert"], i0, m, c0, n)
        _load(q[0:v, i0 : i0 + m, :], src)
    if len(lay.place):
        return q, _load_packed_scales(op, c0, n, name)
    s = nl.ndarray((P, nk, n), dtype=nl.uint8, buffer=nl.sbuf, name=f"{name}_s")
    for i0, m in lay.runs:
        v = lay.tiles[i0].v
        src = _run_src(op["scales"], lay, op["expert"], i0, m, c0, n)
        _load(s[0:v, i0 : i0 + m, :], src)
    views = []
    for i in range(nk):
        views.append(s[0 : lay.tiles[i].v, i, :])
    return q, views


def _resident(op: dict[str, Any], c_lo: int, n: int, name: str) -> dict[str, Any]:
    """An HBM operand's columns ``[c_lo, c_lo+n)`` loaded into SBUF for the block."""
    q, views = _load_q(op, c_lo, n, name)
    return {"layout": None, "q": q, "views": views, "c_lo": c_lo}


def _stationary(op: dict[str, Any], c_lo: int, n: int, name: str) -> dict[str, Any]:
    """A phase-3/4 stationary operand's columns ``[c_lo, c_lo+n)``: loaded once (whole-row DMA
    runs) when its x4 data and scales fit `STATIONARY_BUDGET`, else left in HBM and loaded per
    128-column tile (short runs, and once per output tile of the other operand)."""
    if op["layout"] is None:
        return op
    if n and len(op["layout"].tiles) * n * 5 <= STATIONARY_BUDGET:
        return _resident(op, c_lo, n, name)
    return op


def _quantize_tile(ilv: Any, kt: KTile, n: int, q_dst: Any, s_dst: Any) -> None:
    """``quantize_mx`` of an interleaved bf16 tile ``ilv [v, n, 4]`` (bwd spec §5.2 rule)."""
    nisa.quantize_mx(dst=q_dst, src=ilv[0 : kt.v, 0:n, :], dst_scale=s_dst)


def _spill(op: dict[str, Any], kt: KTile, c0: int, n: int, q: Any, s: Any) -> None:
    """Write one quantized chunk (x4 data [v, n], unpacked scales [v, n]) to HBM scratch."""
    r = kt.row0
    _store(op["data"][r : r + kt.v, c0 : c0 + n], q)
    _store(op["scales"][r : r + kt.v, c0 : c0 + n], s)


def _packed_bytes(nk: int, F: int) -> int:
    """SBUF bytes per partition of an on-chip operand of `nk` chunks x `F` columns: x4 data plus
    scales packed four chunks to a tile (quadrant offsets 0/4/8/12, api spec §7.3)."""
    return nk * F * 4 + ((nk + 3) // 4) * F


def _onchip_operand(tiles: tuple[Any, ...], c_lo: int, F: int, name: str) -> dict[str, Any]:
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
    return {"layout": None, "q": q, "views": views, "c_lo": c_lo, "tiles": tiles}


def _op_tiles(op: dict[str, Any]) -> tuple[Any, ...]:
    if op["layout"] is None:
        return op["tiles"]
    return op["layout"].tiles


def _quantize_chunk_to(
    ilv: Any, kt: KTile, n: int, name: str, dst: dict[str, Any], c0: int, ci: int = 0
) -> None:
    """Quantize ``ilv [v, n, 4]`` (chunk `ci` of `dst`) into columns ``[c0, c0+n)`` of `dst`: in
    place when `dst` is on chip, else through a staging tile spilled to its HBM scratch."""
    if dst["layout"] is None:
        o = c0 - dst["c_lo"]
        sv = dst["views"][ci]
        _quantize_tile(ilv, kt, n, dst["q"][0 : kt.v, ci, o : o + n], sv[:, o : o + n])
        return
    q = nl.ndarray((P, n), dtype=nl.float8_e4m3fn_x4, buffer=nl.sbuf, name=f"{name}_q")
    s = nl.ndarray((P, n), dtype=nl.uint8, buffer=nl.sbuf, name=f"{name}_s")
    nisa.memset(dst=s[0 : kt.v, :], value=0)
    _quantize_tile(ilv, kt, n, q[0 : kt.v, :], s[0 : kt.v, :])
    _spill(dst, kt, c0, n, q[0 : kt.v, :], s[0 : kt.v, :])


# --------------------------------------------------------------------------------------------
# Setup: outputs, scratch, constants
# --------------------------------------------------------------------------------------------


def _alloc_outputs(cfg: BwdKernelConfig, t: dict[str, Any]) -> None:
    sh = nl.shared_hbm
    bf = cfg.compute_dtype
    t["hsg"] = nl.ndarray(
        (cfg.T, cfg.H), dtype=t["hidden_states"].dtype, buffer=sh, name="hidden_states_grad"
    )
    t["dea"] = nl.ndarray(
        (cfg.T * cfg.E, 1), dtype=t["expert_affinities_masked"].dtype, buffer=sh,
        name="expert_affinities_masked_grad",
    )  # fmt: skip
    t["dwgu"] = nl.ndarray(
        (cfg.E, cfg.H, 2, cfg.I), dtype=bf, buffer=sh, name="gate_up_proj_weight_grad"
    )
    t["dwd"] = nl.ndarray((cfg.E, cfg.I, cfg.H), dtype=bf, buffer=sh, name="down_proj_weight_grad")
    # row views (expert-major rows) for the indirect weight-gradient reads (`_rmw_index`)
    t["dwgu_rows"] = t["dwgu"].reshape((cfg.E * cfg.H, 2 * cfg.I))
    t["dwd_rows"] = t["dwd"].reshape((cfg.E * cfg.I, cfg.H))
    if cfg.bias:
        t["dbgu"] = nl.ndarray(
            (cfg.E, 2, cfg.I), dtype=bf, buffer=sh, name="gate_and_up_proj_bias_grad"
        )
        t["dbd"] = nl.ndarray((cfg.E, cfg.H), dtype=bf, buffer=sh, name="down_proj_bias_grad")


def _scratch_operand(
    rows: int, F: int, tiles: tuple[Any, ...], runs: tuple[tuple[int, int], ...], name: str
) -> dict[str, Any]:
    """A private-HBM quantized operand ``[rows, F]`` (x4 data + unpacked scales)."""
    pr = nl.private_hbm
    data = nl.ndarray((rows, F), dtype=nl.float8_e4m3fn_x4, buffer=pr, name=name)
    scales = nl.ndarray((rows, F), dtype=nl.uint8, buffer=pr, name=f"{name}_s")
    return _hbm_operand(data, scales, QLayout(tiles, runs, F, (), ()), None)


def _alloc_scratch(cfg: BwdKernelConfig, geo: Geometry, t: dict[str, Any]) -> None:
    sh = nl.shared_hbm
    # phase-1 -> phase-2 hand-over (both cores read all of it): bf16 [2I, B], [I, B], fp32
    # affinity-grad partials [lnc, B]
    bf = cfg.compute_dtype
    # Two sets, used by alternate blocks (`_block_tensors`): block b+1's phase 1 runs during
    # block b's phases 3/4 (`blockwise_mm_bwd_mxfp8_nki`), while block b still reads its set.
    t["dgu_s2"] = []
    t["s_s2"] = []
    t["da_s2"] = []
    t["yq2"] = []
    for k in range(min(2, cfg.N)):
        t["dgu_s2"].append(
            nl.ndarray((2 * cfg.I, cfg.B), dtype=bf, buffer=sh, name=f"dgu_T_scratch{k}")
        )
        t["s_s2"].append(nl.ndarray((cfg.I, cfg.B), dtype=bf, buffer=sh, name=f"s_T_scratch{k}"))
        t["da_s2"].append(
            nl.ndarray((geo.lnc, cfg.B), dtype=nl.float32, buffer=sh, name=f"da_scratch{k}")
        )
    t["alpha_s"] = nl.ndarray((cfg.B,), dtype=nl.float32, buffer=nl.private_hbm, name="alpha_s")
    # the block's two weight-gradient row offsets, broadcast through HBM (`_rmw_index`)
    t["rmw_s"] = nl.ndarray((2,), dtype=nl.int32, buffer=nl.private_hbm, name="rmw_offset_s")
    t["seen_s"] = nl.ndarray((cfg.E,), dtype=nl.int32, buffer=nl.private_hbm, name="seen_s")
    t["knock_s"] = nl.ndarray((cfg.E,), dtype=nl.int32, buffer=nl.private_hbm, name="knock_s")
    # quantized phase-3/4 operands, token lanes (rows = B/4), unpacked scales
    rows = cfg.B // 4
    # (X and S when they stay on chip are allocated per block, see `_block_phase2`)
    t["xq_hbm"] = None
    t["sq_hbm"] = None
    if not geo.res_x:
        t["xq_hbm"] = _scratch_operand(rows, cfg.H, geo.k3, cfg.runs3, "xq")
    t["gq"] = None
    if not geo.res_moving:
        t["gq"] = _scratch_operand(rows, 2 * cfg.I, geo.k3, cfg.runs3, "dguq")
    for k in range(min(2, cfg.N)):
        y: Any = None
        if not geo.res_moving:
            y = _scratch_operand(rows, cfg.H, geo.k4, cfg.runs4, f"dyq{k}")
        t["yq2"].append(y)
    if not geo.res_s:
        t["sq_hbm"] = _scratch_operand(rows, cfg.I, geo.k4, cfg.runs4, "sq")
    # quantized weights of the current expert when they are streamed (not resident)
    t["wdq_s"] = None
    t["wguq_s"] = None
    if not cfg.pq_d and not geo.res_d:
        t["wdq_s"] = _scratch_operand(cfg.H // 4, cfg.I, geo.k1, cfg.runs1, "wdq")
    if not cfg.pq_gu and not geo.res_gu and cfg.dense:
        # (routed launches quantize a streamed W_gu per phase-2 column group, `_wgu_fly`)
        t["wguq_s"] = _scratch_operand(2 * cfg.I // 4, cfg.H, geo.k2, cfg.runs2, "wguq")


def _constants(cfg: BwdKernelConfig, t: dict[str, Any]) -> None:
    bf = cfg.compute_dtype
    t["zero"] = nl.ndarray((P, ZCOLS), dtype=bf, buffer=nl.sbuf, name="zero")
    nisa.memset(dst=t["zero"], value=0.0)
    t["ones_f32"] = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf, name="ones_f32")
    nisa.memset(dst=t["ones_f32"], value=1.0)
    t["ones_bf"] = nl.ndarray((P, 1), dtype=bf, buffer=nl.sbuf, name="ones_bf")
    nisa.memset(dst=t["ones_bf"], value=1.0)
    t["nv_col"] = None
    if not cfg.dense:
        _rmw_constants(cfg, t)
    if cfg.nv:
        # count clamped to [0, T] (API reference), broadcast to every partition, fp32
        nvi = nl.ndarray((P, 1), dtype=nl.int32, buffer=nl.sbuf, name="nv_i")
        nisa.dma_copy(dst=nvi, src=t["num_valid_tokens"].ap([[0, P], [1, 1]], offset=0))
        nv_col = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf, name="nv_f")
        nisa.tensor_scalar(
            dst=nv_col, data=nvi, op0=nl.minimum, operand0=float(cfg.T),
            op1=nl.maximum, operand1=0.0,
        )  # fmt: skip
        t["nv_col"] = nv_col


def _rmw_constants(cfg: BwdKernelConfig, t: dict[str, Any]) -> None:
    """Launch state of `_rmw_index`: the per-expert "has had a block" flags (int32, zeroed),
    a one to set them with, and the output rows each partition reads for every tile of phase
    3 (``ht*P + p``, all H tiles) and phase 4 (``it*P + p``), before the expert's offset."""
    nh, ni = cfg.H // P, cfg.I // P
    z = nl.ndarray((1, cfg.E), dtype=nl.int32, buffer=nl.sbuf, name="seen_zero")
    nisa.memset(dst=z, value=0)
    _index_dma(t["seen_s"].ap([[cfg.E, 1], [1, cfg.E]], offset=0), z)
    one = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf, name="seen_one")
    nisa.memset(dst=one, value=1)
    rows = nl.ndarray((P, nh + ni), dtype=nl.int32, buffer=nl.sbuf, name="rmw_rows")
    nisa.iota(dst=rows[:, 0:nh], pattern=[[P, nh]], offset=0, channel_multiplier=1)
    nisa.iota(dst=rows[:, nh : nh + ni], pattern=[[P, ni]], offset=0, channel_multiplier=1)
    t["seen_one"] = one
    t["rmw_rows"] = rows


def _zero_unused_experts(cfg: BwdKernelConfig, geo: Geometry, t: dict[str, Any]) -> None:
    """Zero this core's part of the weight grads of every expert no block had (bwd spec §4.3),
    once the last block's `_rmw_index` has set the flags: scatters from the zero tile whose
    rows are all skipped (-1) for an expert that had a block, so those move no bytes.

    Per expert, the rows of its tiles (``e*H + ht*P + p``, ``e*I + it*P + p``) plus
    ``-big * seen[e]`` (negative for a seen expert, clamped to -1); ``seen`` reaches every
    partition through HBM, converted to the fp32 per-partition operand on the way."""
    E, ni, I2 = cfg.E, cfg.I // P, 2 * cfg.I
    big = E * max(cfg.H, cfg.I)  # > every row of the row views
    sv = nl.ndarray((1, E), dtype=nl.int32, buffer=nl.sbuf, name="unused_seen")
    _index_dma(sv, t["seen_s"].ap([[E, 1], [1, E]], offset=0))
    nisa.tensor_scalar(dst=sv, data=sv, op0=nl.multiply, operand0=float(-big))
    _index_dma(t["knock_s"].ap([[E, 1], [1, E]], offset=0), sv)
    kf = nl.ndarray((P, E), dtype=nl.float32, buffer=nl.sbuf, name="unused_knock")
    nisa.dma_copy(dst=kf, src=t["knock_s"].ap([[0, P], [1, E]], offset=0))
    z = t["zero"]
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
                dst = t["dwgu_rows"].ap(
                    [[I2, P], [1, n]], offset=c0, vector_offset=idx[:, j : j + 1], indirect_dim=0
                )
                nisa.dma_copy(dst=dst, src=z[:, 0:n], oob_mode=nisa.oob_mode.skip)
        for it in range(ni):
            col = geo.n_h + it
            for c0 in range(geo.h0, geo.h0 + geo.Hc, ZCOLS):
                n = min(ZCOLS, geo.h0 + geo.Hc - c0)
                dst = t["dwd_rows"].ap(
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


def _run_zeros(t: dict[str, Any], jobs: list[Any]) -> None:
    """Issue zeroing DMAs (from the zero tile, static descriptors)."""
    z = t["zero"]
    for view, nr, nc in jobs:
        nisa.dma_copy(dst=view, src=z[0:nr, 0:nc])


def _init_outputs(cfg: BwdKernelConfig, geo: Geometry, t: dict[str, Any]) -> list[Any]:
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
    _zeros_hbm(jobs, t["hsg"], geo.h0, cfg.H, cfg.T, geo.Hc)
    if geo.pid == 0:
        _zeros_flat(jobs, t["dea"], 0, cfg.T * cfg.E)
    if cfg.dense:
        return [jobs, wjobs]
    for e in range(cfg.E):
        if cfg.bias:
            _zeros_hbm(wjobs, t["dbd"], e * cfg.H + geo.h0, cfg.H, 1, geo.Hc)
            for g in range(2):
                for j in range(geo.n_i):
                    _zeros_flat(wjobs, t["dbgu"], (e * 2 + g) * cfg.I + (geo.i_lo + j) * P, P)
    return [jobs, wjobs]


# --------------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------------


def _quantize_weights(
    cfg: BwdKernelConfig,
    geo: Geometry,
    t: dict[str, Any],
    expert: Any,
    which: str = "both",
    w: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Phase-1/2 weight operands of the current expert ({"d", "gu"}): quantized on chip (into
    SBUF when resident, else into the HBM scratch), or the pre-quantized inputs themselves
    (loaded into SBUF once per block when resident). `which`: "d", "gu" or "both" (into `w`)."""
    if w is None:
        w = {"d": None, "gu": None}
    lo_d = geo.i_lo * P
    if which == "gu":
        pass
    elif cfg.pq_d:
        lay = QLayout(geo.k1, cfg.runs1, cfg.I, cfg.d_groups, cfg.d_place)
        data = t["down_proj_weight"].view(cfg.x4_dtype)
        hq = _hbm_operand(data, t["down_weight_scales"], lay, expert)
        w["d"] = _resident(hq, lo_d, geo.d_cols, "wd_res") if geo.res_d else hq
    elif geo.d_cols:
        # W_d[e] [I, H] -> lanes along H, columns i (this core's phase-1 I tiles)
        cols = []
        for j in range(geo.n_i):
            cols.append((lo_d + j * P, P))
        w["d"] = _quantize_weight(
            t["down_proj_weight"], cfg.H, geo.k1, expert, cols, lo_d, geo.d_cols, t["wdq_s"],
            cfg.compute_dtype, "wd",
        )  # fmt: skip
    if which == "d":
        pass
    elif cfg.pq_gu:
        lay = QLayout(geo.k2, cfg.runs2, cfg.H, cfg.gu_groups, cfg.gu_place)
        data = t["gate_up_proj_weight"].view(cfg.x4_dtype)
        hq = _hbm_operand(data, t["gate_up_weight_scales"], lay, expert)
        w["gu"] = _resident(hq, geo.h0, geo.Hc, "wgu_res") if geo.res_gu else hq
    elif geo.Hc:
        # W_gu[e] viewed [H, 2I]: lanes along 2I, columns h (this core's H range)
        cols = []
        for c0 in range(geo.h0, geo.h0 + geo.Hc, NMAX):
            cols.append((c0, min(NMAX, geo.h0 + geo.Hc - c0)))
        w["gu"] = _quantize_weight(
            t["gate_up_proj_weight"], 2 * cfg.I, geo.k2, expert, cols, geo.h0, geo.Hc,
            t["wguq_s"], cfg.compute_dtype, "wgu",
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
    spill: dict[str, Any] | None,
    bf: Any,
    name: str,
) -> dict[str, Any]:
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


def _wgu_group(cfg: BwdKernelConfig, geo: Geometry, t: dict[str, Any], expert: Any, c0: int,
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


def _wgu_load(cfg: BwdKernelConfig, geo: Geometry, t: dict[str, Any], expert: Any,
              step: tuple[int, int, int]) -> Any:  # fmt: skip
    """One W_gu step's ``dma_transpose`` into the wrapX layout (`_quantize_weight`), bf16."""
    c0, n, i = step
    w = t["gate_up_proj_weight"]
    return _transpose_chunk(w, 2 * cfg.I, geo.k2[i], expert, c0, n, cfg.compute_dtype, "wgu")


# --------------------------------------------------------------------------------------------
# Token rows
# --------------------------------------------------------------------------------------------


def _oob(cfg: BwdKernelConfig) -> Any:
    return nisa.oob_mode.skip if cfg.skip_token or cfg.nv else nisa.oob_mode.error


def _rows_src(
    cfg: BwdKernelConfig, blk: dict[str, Any], src: Any, b: int, tt: int, c0: int, n: int
) -> Any:
    """Rows of token tile `tt` of block `b` of a ``[T, H]`` tensor, columns ``[c0, c0+n)``:
    an indirect view (routed / dense with a token count) or a plain slice (dense)."""
    tok = blk["tok"]
    if tok is None:
        r0 = b * cfg.B + tt * P
        return src[r0 : r0 + P, c0 : c0 + n]
    return src.ap(
        [[cfg.H, P], [1, n]], offset=c0, vector_offset=tok[:, tt : tt + 1], indirect_dim=0
    )


def _gather_rows(
    cfg: BwdKernelConfig,
    blk: dict[str, Any],
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
    if blk["tok"] is not None:
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


def _indices_load(cfg: BwdKernelConfig, t: dict[str, Any], b: int) -> dict[str, Any]:
    """The index loads of block `b` (token ids, expert id), as the
    per-block tensor dict that `_setup_indices` completes. The three stages (loads, integer
    ops and gathers, `_rmw_index_finish`) are issued at three points of the previous block
    (`blockwise_mm_bwd_mxfp8_nki`): each waits for DMAs issued a phase earlier, so that no
    in-order engine stalls on the chain's DMA latencies."""
    NT = cfg.B // P
    blk: dict[str, Any] = {"tok": None, "ea_idx": None, "expert": None, "rmw_idx": None}
    if not cfg.dense:
        # tok[p, t] = token_position_to_id[b*B + t*P + p]
        tok = nl.ndarray((P, NT), dtype=nl.int32, buffer=nl.sbuf, name="tok")
        _index_dma(tok, t["token_position_to_id"].ap([[1, P], [P, NT]], offset=b * cfg.B))
        ecol = nl.ndarray((P, 1), dtype=nl.int32, buffer=nl.sbuf, name="expert_col")
        _index_dma(ecol, t["block_to_expert"].ap([[0, P], [1, 1]], offset=b))
        blk["expert"] = ecol[0:1, 0:1]
        blk["tok"] = tok
        blk["ecol"] = ecol
    return blk


def _setup_indices(cfg: BwdKernelConfig, t: dict[str, Any], blk: dict[str, Any], b: int) -> None:
    """Affinity indices and affinities of block `b` (bwd spec §3.1, §4.1) from its loads
    `blk` (`_indices_load`), and `_rmw_index`'s integer ops."""
    NT = cfg.B // P
    if not cfg.dense:
        tok = blk["tok"]
        ecol = blk["ecol"]
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
        blk["ea_idx"] = ea_idx
    elif cfg.nv:
        # dense with a token count: positions >= count become padding (-1)
        pos = nl.ndarray((P, NT), dtype=nl.float32, buffer=nl.sbuf, name="pos")
        nisa.iota(dst=pos, pattern=[[P, NT]], offset=b * cfg.B, channel_multiplier=1)
        valid = nl.ndarray((P, NT), dtype=nl.float32, buffer=nl.sbuf, name="valid")
        nisa.tensor_scalar(dst=valid, data=pos, op0=nl.less, operand0=t["nv_col"])
        idx_f = nl.ndarray((P, NT), dtype=nl.float32, buffer=nl.sbuf, name="idx_f")
        nisa.scalar_tensor_tensor(
            dst=idx_f, data=pos, op0=nl.add, operand0=1.0, op1=nl.multiply, operand1=valid
        )
        tok = nl.ndarray((P, NT), dtype=nl.int32, buffer=nl.sbuf, name="tok")
        nisa.tensor_scalar(dst=tok, data=idx_f, op0=nl.subtract, operand0=1.0)
        blk["tok"] = tok
        blk["ea_idx"] = tok  # E == 1
    # alpha per token (fp32, 0 for padding), then broadcast along the free axis via HBM
    alpha_tok = nl.ndarray((P, NT), dtype=nl.float32, buffer=nl.sbuf, name="alpha_tok")
    ea = t["expert_affinities_masked"]
    if blk["ea_idx"] is not None:
        nisa.memset(dst=alpha_tok, value=0.0)
        for tt in range(NT):
            nisa.dma_copy(
                dst=alpha_tok[:, tt : tt + 1],
                src=ea.ap(
                    [[1, P], [1, 1]], offset=0, vector_offset=blk["ea_idx"][:, tt : tt + 1],
                    indirect_dim=0,
                ),
                oob_mode=_oob(cfg),
            )  # fmt: skip
    else:
        nisa.dma_copy(dst=alpha_tok, src=ea.ap([[1, P], [P, NT]], offset=b * cfg.B))
    _index_dma(t["alpha_s"].ap([[1, P], [P, NT]], offset=0), alpha_tok)
    blk["alpha_tok"] = alpha_tok
    if not cfg.dense:
        _rmw_index(cfg, t, blk, b)


def _rmw_index(cfg: BwdKernelConfig, t: dict[str, Any], blk: dict[str, Any], b: int) -> None:
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
    e = blk["expert"]
    flag = t["seen_s"].ap([[1, 1], [1, 1]], offset=0, scalar_offset=e, indirect_dim=0)
    seen = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf, name="rmw_seen")
    _index_dma(seen, flag)
    _index_dma(flag, t["seen_one"])
    # off = (e*F + big) * seen - big: e*F when seen, else -big (int32, exact below 2^24)
    off = nl.ndarray((1, 2), dtype=nl.int32, buffer=nl.sbuf, name="rmw_off")
    for j, F in ((0, cfg.H), (1, cfg.I)):
        col = off[0:1, j : j + 1]
        nisa.tensor_scalar(
            dst=col, data=e, op0=nl.multiply, operand0=float(F), op1=nl.add, operand1=float(big)
        )
        nisa.tensor_tensor(dst=col, data1=col, data2=seen, op=nl.multiply)
    nisa.tensor_scalar(dst=off, data=off, op0=nl.subtract, operand0=float(big))
    _index_dma(t["rmw_s"].ap([[2, 1], [1, 2]], offset=0), off)


def _rmw_index_finish(cfg: BwdKernelConfig, t: dict[str, Any], blk: dict[str, Any]) -> None:
    """`_rmw_index`'s two offsets read back onto every partition and added to the rows."""
    nh, ni = cfg.H // P, cfg.I // P
    offb = nl.ndarray((P, nh + ni), dtype=nl.int32, buffer=nl.sbuf, name="rmw_offb")
    _index_dma(offb[:, 0:nh], t["rmw_s"].ap([[0, P], [0, nh]], offset=0))
    _index_dma(offb[:, nh : nh + ni], t["rmw_s"].ap([[0, P], [0, ni]], offset=1))
    idx = nl.ndarray((P, nh + ni), dtype=nl.int32, buffer=nl.sbuf, name="rmw_idx")
    nisa.tensor_tensor(dst=idx, data1=t["rmw_rows"], data2=offb, op=nl.add)
    # a skipped row is marked -1 (oob_mode.skip, as the token ids in `_setup_indices`)
    nisa.tensor_scalar(dst=idx, data=idx, op0=nl.maximum, operand0=-1.0)
    blk["rmw_idx"] = idx


# --------------------------------------------------------------------------------------------
# One block
# --------------------------------------------------------------------------------------------


def _block_tensors(t: dict[str, Any], b: int) -> dict[str, Any]:
    """The tensor dict of block `b`: the launch's tensors, with the scratch set of its parity
    (``dgu_s``, ``s_s``, ``da_s``, ``yq``) and the other set (``*_o``, for `_hand_over`)."""
    tb: dict[str, Any] = {}
    for k in t:
        tb[k] = t[k]
    n = len(t["dgu_s2"])
    tb["two_sets"] = n > 1
    for k in ("dgu_s", "s_s", "da_s", "yq"):
        tb[k] = t[k + "2"][b % n]
        tb[k + "_o"] = t[k + "2"][(b + 1) % n]
    return tb


def _hand_over(geo: Geometry, t: dict[str, Any]) -> None:
    """LNC 2: after phase 1 both cores synchronize on the shared scratch tensors of both sets:
    this block's (written by both, read by both from here on) and the other one (the previous
    block's, whose last reads, in phases 2-3, precede this point on both cores; the next
    block's phase 1, after this point, overwrites it)."""
    if geo.lnc > 1:
        for k in ("dgu_s", "s_s", "da_s"):
            nisa.core_barrier(t[k], (0, 1))
            if t["two_sets"]:
                nisa.core_barrier(t[k + "_o"], (0, 1))


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


def _prologue_indices(cfg: BwdKernelConfig, t: dict[str, Any], b: int) -> dict[str, Any]:
    """Block `b`'s indices, all three stages at once (the first block)."""
    blk = _indices_load(cfg, t, b)
    _setup_indices(cfg, t, blk, b)
    return blk


def _prologue(
    cfg: BwdKernelConfig,
    geo: Geometry,
    t: dict[str, Any],
    w_dense: Any,
    b: int,
    blk: Any = None,
) -> dict[str, Any]:
    """What block `b` reads before its phase-1 compute: indices, the read-modify-write rows,
    W_d quantized, the first windows' dY rows and window 0's loads. Issued for block b+1
    during block b's phases 3/4 (`blockwise_mm_bwd_mxfp8_nki`), whose DMA-bound read-modify-writes leave the
    other engines and queues room: the blocks overlap instead of starting cold. `blk`: the
    block's indices from `_prologue_indices` (issued earlier still), else issued here."""
    if blk is None:
        blk = _prologue_indices(cfg, t, b)
    if not cfg.dense and b > 0:
        _rmw_index_finish(cfg, t, blk)
    w = w_dense
    if not cfg.dense:
        # W_gu (phase 2) is quantized after phase 1's first window is under way
        w = _quantize_weights(cfg, geo, t, blk["expert"], "d")
    q_ahead, ahead = _pipeline_depth(cfg, geo)
    nwin = cfg.B // cfg.W
    rows = []
    for win in range(min(ahead, nwin)):
        rows.append(_phase1_rows(cfg, t, blk, b, win))
    pre: Any = None
    if q_ahead:
        pre = _phase1_loads(cfg, geo, t, b, 0, rows[0])
    return {"blk": blk, "w": w, "rows": rows, "pre": pre}


def _block_phase1(
    cfg: BwdKernelConfig,
    geo: Geometry,
    t: dict[str, Any],
    b: int,
    zero_jobs: list[Any],
    st: dict[str, Any],
    tn: Any,
) -> dict[str, Any]:
    """Phase 1 of block `b` (module docstring) from its `_prologue` `st`, the hand-over to phase
    2 and the affinity grad; `zero_jobs`: output-zeroing DMAs to spread over its windows; `tn`:
    the next block's tensor dict (None for the last block), whose indices are issued here.
    Returns what phases 2-4 need and the next block's indices: ``{"blk", "w", "next"}``."""
    blk, w, rows, pre = st["blk"], st["w"], st["rows"], st["pre"]
    if geo.res_moving:
        t["yq"] = _onchip_operand(geo.k4, geo.h0, geo.Hc, "p4_yres")
    blk["acc_bgu"] = None
    if cfg.bias:
        acc_bgu = nl.ndarray(
            (P, 2, max(1, geo.n_i)), dtype=cfg.compute_dtype, buffer=nl.sbuf, name="acc_bgu"
        )
        nisa.memset(dst=acc_bgu, value=0.0)
        blk["acc_bgu"] = acc_bgu
    blk["acc_bd"] = None
    if cfg.bias:
        acc_bd = nl.ndarray(
            (1, max(1, geo.Hc)), dtype=cfg.compute_dtype, buffer=nl.sbuf, name="acc_bd"
        )
        nisa.memset(dst=acc_bd, value=0.0)
        blk["acc_bd"] = acc_bd
    # phase 1 as a software pipeline: window w+1's loads and operands are issued before window
    # w's matmuls and SwiGLU backward (`_pipeline_depth`)
    nwin = cfg.B // cfg.W
    q_ahead, ahead = _pipeline_depth(cfg, geo)
    staged = _wgu_staged(cfg, geo)
    steps: list[Any] = []
    staged_prev: list[Any] = []
    if staged:
        steps = _wgu_pairs(cfg, geo)
        w["gu"] = _onchip_operand(geo.k2, geo.h0, geo.Hc, "wgu_res")
    q: Any = None
    if q_ahead:
        q = _phase1_operands(cfg, geo, t, blk, 0, pre)
    for win in range(nwin):
        # staged W_gu (below): the previous window's share, before this window's allocations
        for step, ilv in staged_prev:
            _quantize_chunk_to(ilv, geo.k2[step[2]], step[1], "wgu", w["gu"], step[0], step[2])
        if not q_ahead:
            pre = _phase1_loads(cfg, geo, t, b, win, rows[win])
            q = _phase1_operands(cfg, geo, t, blk, win, pre)
        cur_pre, cur_q = pre, q
        if win + ahead < nwin and len(rows) == win + ahead:
            rows.append(_phase1_rows(cfg, t, blk, b, win + ahead))
        if q_ahead and win + 1 < nwin:
            pre = _phase1_loads(cfg, geo, t, b, win + 1, rows[win + 1])
            q = _phase1_operands(cfg, geo, t, blk, win + 1, pre)
        nz = len(zero_jobs)
        _run_zeros(t, zero_jobs[(win * nz) // nwin : ((win + 1) * nz) // nwin])
        if win == 0 and not cfg.dense and not staged and not _wgu_fly(cfg, geo):
            # W_gu (needed from phase 2 on) once phase 1's first window is under way
            _quantize_weights(cfg, geo, t, blk["expert"], "gu", w)
        # staged W_gu: this window's share of the chunks loaded before its SwiGLU backward,
        # quantized before the next window's (after it in the last window), so that VectorE
        # does not wait on those loads
        share = []
        if staged:
            lo, hi = (win * len(steps)) // nwin, ((win + 1) * len(steps)) // nwin
            for k in range(lo, hi):
                share.append((steps[k], _wgu_load(cfg, geo, t, blk["expert"], steps[k])))
        staged_prev = share
        _phase1(cfg, geo, t, blk, w, b, win, cur_pre, cur_q)
        if win + 1 == nwin:
            for step, ilv in share:
                _quantize_chunk_to(ilv, geo.k2[step[2]], step[1], "wgu", w["gu"], step[0], step[2])
    # the next block's index loads (the first stage of its chain, `_indices_load`)
    # once this block's phase-1 loads are all issued: the next prologue's loads wait for them
    nblk: Any = None
    if tn is not None:
        nblk = _indices_load(cfg, tn, b + 1)
    # hand-over 1: dgu_s / s_s / da_s written by both cores, read by both from here on
    _hand_over(geo, t)
    if geo.overlap:
        _write_affinity_grad(cfg, geo, t, blk, b)
    return {"blk": blk, "w": w, "next": nblk}


def _block_phase2(
    cfg: BwdKernelConfig,
    geo: Geometry,
    t: dict[str, Any],
    b: int,
    zero_jobs: list[Any],
    fr: dict[str, Any],
) -> None:
    """Phase 2 of block `b` and phase 3's operands (`_block_phase1`'s `fr`); `zero_jobs`: output-
    zeroing DMAs to spread over its windows."""
    blk, w = fr["blk"], fr["w"]
    nwin = cfg.B // cfg.W
    t["xq"] = t["xq_hbm"]
    if geo.res_x:
        t["xq"] = _onchip_operand(geo.k3, geo.h0, geo.Hc, "p3_xres")
    if geo.res_moving:
        t["gq"] = _onchip_operand(geo.k3, 0, 2 * cfg.I, "p3_gres")
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
        _run_zeros(t, zero_jobs[(win * nz) // nwin : ((win + 1) * nz) // nwin])
        if pipelined:
            _phase34_operands(cfg, geo, t, blk, b, win, pre)
            if win + 1 < nwin and not geo.x_ahead:
                # window w+1's X rows once window w's are last read (`X_AHEAD_BUDGET`)
                nxt["x"] = _phase3_x_rows(cfg, geo, t, blk, b, win + 1)
            _phase2(cfg, geo, t, blk, w, b, win, pre, q)
            if win + 1 < nwin and geo.Hc:
                nxt_q = _phase2_quant(cfg, geo, nxt)
        else:
            q = _phase2_quant(cfg, geo, pre) if geo.Hc else None
            _phase2(cfg, geo, t, blk, w, b, win, pre, q)
            _phase34_operands(cfg, geo, t, blk, b, win, pre)
            if win + 1 < nwin and not geo.x_ahead:
                nxt["x"] = _phase3_x_rows(cfg, geo, t, blk, b, win + 1)
        if win == 0 and not geo.overlap:
            # the affinity grad (core 0 reads both cores' partials) once window 0 is under
            # way: right after the hand-over its small dependent DMAs would hold the queue
            # phase 2's first loads wait in (where blocks overlap, phase 1 ends during the
            # previous block's phases 3/4 instead, and it goes there)
            _write_affinity_grad(cfg, geo, t, blk, b)
    # S quantized along the tokens during phase 3 (W_gu is no longer live: SBUF room for S on
    # chip)
    t["sq"] = t["sq_hbm"]
    if geo.res_s:
        t["sq"] = _onchip_operand(geo.k4, 0, cfg.I, "p4_sres")


# -- phase 1 ---------------------------------------------------------------------------------


def _load_checkpoints(
    cfg: BwdKernelConfig, t: dict[str, Any], b: int, win: int, it: int
) -> dict[str, Any]:
    """The checkpoint tiles ``[128 i, W tok]`` of I tile `it` in window `win`: G and U, and the
    optional phi(G), Hm and S checkpoints (None when not given; used as given, bwd spec §4)."""
    Wn, w0 = cfg.W, win * cfg.W
    i0 = it * P
    ckpt = t["gate_up_proj_act_checkpoint_T"]
    cdt = ckpt.dtype  # checkpoint values are used as given (bf16, or fp16)
    out: dict[str, Any] = {}
    out["g"] = nl.ndarray((P, Wn), dtype=cdt, buffer=nl.sbuf, name="g")
    out["u"] = nl.ndarray((P, Wn), dtype=cdt, buffer=nl.sbuf, name="u")
    _load(out["g"], ckpt[b, 0, i0 : i0 + P, w0 : w0 + Wn])
    _load(out["u"], ckpt[b, 1, i0 : i0 + P, w0 : w0 + Wn])
    for key, tname in (("act", "gate_act_checkpoint_T"), ("hm", "intermediate_checkpoint_T"),
                       ("s", "scaled_intermediate_checkpoint_T")):  # fmt: skip
        src = t[tname]
        out[key] = None
        if src is not None:
            x = nl.ndarray((P, Wn), dtype=src.dtype, buffer=nl.sbuf, name=f"ck_{key}")
            _load(x, src[b, i0 : i0 + P, w0 : w0 + Wn])
            out[key] = x
    return out


def _phase1_rows(cfg: BwdKernelConfig, t: dict[str, Any], blk: dict[str, Any], b: int,
                 win: int) -> Any:  # fmt: skip
    """The dY rows of window `win` (tokens on partitions, ``[P, W/P, H]``), gathered two
    windows ahead of their use (`_block_phase1`; zeroed on ScalarE, copies of the zero tile:
    GpSimd and VectorE are the busier engines in phase 1)."""
    nTw = cfg.W // P
    dyw = nl.ndarray((P, nTw, cfg.H), dtype=cfg.compute_dtype, buffer=nl.sbuf, name="p1_dy")
    for j in range(nTw):
        _gather_rows(
            cfg, blk, dyw[:, j, :], t["output_hidden_states_grad"], b, win * nTw + j, 0, cfg.H,
            nisa.engine.scalar, t["zero"],
        )  # fmt: skip
    return dyw


def _phase1_loads(
    cfg: BwdKernelConfig, geo: Geometry, t: dict[str, Any], b: int, win: int, dyw: Any
) -> dict[str, Any]:
    """What phase 1 reads from HBM for window `win`: the dY rows `dyw` (`_phase1_rows`), the
    alpha row and the checkpoint tiles of this core's I tiles. Issued one window ahead of their
    compute (`_block_phase1`): DMA engines and queues start transfers in program order, so a load
    issued after a window's write-backs would wait for them."""
    Wn, w0 = cfg.W, win * cfg.W
    alpha = nl.ndarray((P, Wn), dtype=nl.float32, buffer=nl.sbuf, name="alpha_row")
    _load(alpha, t["alpha_s"].ap([[0, P], [1, Wn]], offset=w0))
    cks = []
    for n_it in range(geo.n_i):
        cks.append(_load_checkpoints(cfg, t, b, win, geo.i_lo + n_it))
    return {"dyw": dyw, "alpha": alpha, "ck": cks}


def _phase1(
    cfg: BwdKernelConfig,
    geo: Geometry,
    t: dict[str, Any],
    blk: dict[str, Any],
    w: dict[str, Any],
    b: int,
    win: int,
    pre: dict[str, Any],
    q: dict[str, Any],
) -> None:
    """D^T = mx(W_d, dY^T) per I tile of this core, SwiGLU backward, affinity-grad partials
    (bwd spec §6 P1), on the window's loads `pre` (`_phase1_loads`) and operands `q`
    (`_phase1_operands`, built one window ahead)."""
    Wn, nTw, w0 = cfg.W, cfg.W // P, win * cfg.W
    ntk = len(geo.k1)
    yq, ys = q["yq"], q["ys"]
    alpha = pre["alpha"]
    prods: list[Any] = []
    for n_it in range(geo.n_i):
        it = geo.i_lo + n_it
        wq, wsv = _load_q(w["d"], it * P, P, "p1_w")
        d = nl.ndarray((P, Wn), dtype=nl.float32, buffer=nl.psum, name="p1_d")
        for ci in range(ntk):
            v = geo.k1[ci].v
            nisa.nc_matmul_mx(
                dst=d, stationary=wq[0:v, ci, :], moving=yq[0:v, ci, :],
                stationary_scale=wsv[ci], moving_scale=ys[0:v, ci, :], accumulate=ci > 0,
            )  # fmt: skip
        _swiglu(cfg, t, blk, win, it, n_it, d, alpha, prods, pre["ck"][n_it], q["sw"][n_it])
    # affinity grad: sum_i fp32(D*Hm), the partition sum as a ones-matmul (fp32 in PSUM), in
    # I-tile order; issued after the window's MX matmuls so that the Tensor engine's in-order
    # queue does not wait on each tile's VectorE product between them
    da_ps = nl.ndarray((P, nTw), dtype=nl.float32, buffer=nl.psum, name="da_ps")
    for n_it in range(geo.n_i):
        prod = prods[n_it]
        for tt in range(nTw):
            nisa.nc_matmul(
                dst=da_ps[:, tt : tt + 1], stationary=prod[:, tt * P : (tt + 1) * P],
                moving=t["ones_f32"], accumulate=n_it > 0,
            )  # fmt: skip
    # affinity-grad partial of this core -> scratch row `pid`
    da = nl.ndarray((P, nTw), dtype=nl.float32, buffer=nl.sbuf, name="da")
    if geo.n_i:
        nisa.tensor_copy(dst=da, src=da_ps)
    else:
        nisa.memset(dst=da, value=0.0)
    dst = t["da_s"].ap([[1, P], [P, nTw]], offset=geo.pid * cfg.B + w0)
    _store(dst, da)


def _phase1_operands(
    cfg: BwdKernelConfig,
    geo: Geometry,
    t: dict[str, Any],
    blk: dict[str, Any],
    win: int,
    pre: dict[str, Any],
) -> dict[str, Any]:
    """What phase 1 computes from window `win`'s loads before its matmuls, issued one window
    ahead of them (so that no engine's in-order queue waits on another engine at a window
    boundary): dY^T quantized along H (``yq``, ``ys``), the SwiGLU terms that need only the
    checkpoints (``sw``, `_swiglu_terms`), and phase 4's dY operand (this core's H columns,
    quantized along the tokens; with the down bias grad: dY is gathered once per block)."""
    Wn, nTw = cfg.W, cfg.W // P
    bf = cfg.compute_dtype
    ntk = len(geo.k1)
    dyw = pre["dyw"]
    # dY^T in the wrapX layout along H, quantized: [lanes, chunk, W]
    yq = nl.ndarray((P, ntk, Wn), dtype=nl.float8_e4m3fn_x4, buffer=nl.sbuf, name="p1_yq")
    ys = nl.ndarray((P, ntk, Wn), dtype=nl.uint8, buffer=nl.sbuf, name="p1_ys")
    for ci in range(ntk):
        kt = geo.k1[ci]
        v = kt.v
        ilv = nl.ndarray((P, Wn, 4), dtype=bf, buffer=nl.sbuf, name="p1_ilv")
        for j in range(4):
            ps = nl.ndarray((P, Wn), dtype=bf, buffer=nl.psum, name="p1_tp")
            h = kt.k0 + j * v
            for tt in range(nTw):
                nisa.nc_transpose(dst=ps[0:v, tt * P : (tt + 1) * P], data=dyw[:, tt, h : h + v])
            # phase 1 is VectorE-bound: one eviction in four on ScalarE (bit-exact copies)
            if j == 0:
                nisa.tensor_copy(dst=ilv[0:v, :, j], src=ps[0:v, :], engine=nisa.engine.scalar)
            else:
                nisa.tensor_copy(dst=ilv[0:v, :, j], src=ps[0:v, :])
        _quantize_tile(ilv, kt, Wn, yq[0:v, ci, :], ys[0:v, ci, :])
    sw = []
    for n_it in range(geo.n_i):
        sw.append(_swiglu_terms(cfg, pre["ck"][n_it]))
    if geo.Hc:
        # phase 4's dY operand (this core's H columns, quantized along the tokens) and the
        # down bias grad come from the rows gathered here: dY is gathered once per block
        _rows_q(cfg, dyw, geo.h0, win, t["yq"], geo.Hc, geo.h0, "p4_dy")
        if cfg.bias:
            _bias_down(cfg, geo, t, blk, win, dyw[:, :, geo.h0 : geo.h0 + geo.Hc])
    return {"yq": yq, "ys": ys, "sw": sw}


def _swiglu_terms(cfg: BwdKernelConfig, ck: dict[str, Any]) -> dict[str, Any]:
    """The SwiGLU backward terms of one ``[128 i, W tok]`` tile that need only its checkpoints
    `ck` (bwd spec §6 P1 rounding points): ``act = bf16(silu(G))`` (or phi(G) as given),
    ``dga = bf16(bf16(silu'(G)) * U)``, ``hm = bf16(act * U)`` (or Hm as given). The SBUF-only
    products run on GpSimd, which phase 1 (VectorE-bound) otherwise leaves idle."""
    Wn, bf = cfg.W, cfg.compute_dtype
    g, u = ck["g"], ck["u"]
    act = ck["act"]
    if act is None:
        act = nl.ndarray((P, Wn), dtype=bf, buffer=nl.sbuf, name="act")
        nisa.activation(dst=act, op=nl.silu, data=g)  # act = bf16(silu(G))
    dph = nl.ndarray((P, Wn), dtype=bf, buffer=nl.sbuf, name="dphi")
    nisa.activation(dst=dph, op=nl.silu_dx, data=g)  # bf16(silu'(G))
    dga = nl.ndarray((P, Wn), dtype=bf, buffer=nl.sbuf, name="dga")
    nisa.tensor_tensor(dst=dga, data1=dph, data2=u, op=nl.multiply, engine=nisa.engine.gpsimd)
    hm = ck["hm"]
    if hm is None:
        hm = nl.ndarray((P, Wn), dtype=bf, buffer=nl.sbuf, name="hm")
        nisa.tensor_tensor(dst=hm, data1=act, data2=u, op=nl.multiply, engine=nisa.engine.gpsimd)
    return {"act": act, "dga": dga, "hm": hm}


def _swiglu(
    cfg: BwdKernelConfig,
    t: dict[str, Any],
    blk: dict[str, Any],
    win: int,
    it: int,
    n_it: int,
    d: Any,
    alpha: Any,
    prods: list[Any],
    ck: dict[str, Any],
    sw: dict[str, Any],
) -> None:
    """SwiGLU backward on one ``[128 i, W tok]`` tile, rounding points of bwd spec §6 P1, on
    the checkpoint tiles `ck` (`_load_checkpoints`) and terms `sw` (`_swiglu_terms`); the
    affinity-grad product ``fp32(D*Hm)`` is appended to `prods`."""
    Wn, nTw, w0 = cfg.W, cfg.W // P, win * cfg.W
    i0 = it * P
    bf, f32 = cfg.compute_dtype, nl.float32
    g, u = ck["g"], ck["u"]
    act, dga, hm = sw["act"], sw["dga"], sw["hm"]
    # affinity grad: sum_i fp32(D*Hm), the partition sum as a ones-matmul (fp32 in PSUM)
    prod = nl.ndarray((P, Wn), dtype=f32, buffer=nl.sbuf, name="dhm")
    nisa.tensor_tensor(dst=prod, data1=d, data2=hm, op=nl.multiply)
    prods.append(prod)
    s = ck["s"]  # phase 4's operand as the forward saved it, if it did
    if s is None:
        s = nl.ndarray((P, Wn), dtype=bf, buffer=nl.sbuf, name="s")
        nisa.tensor_tensor(dst=s, data1=hm, data2=alpha, op=nl.multiply)  # S = bf16(Hm*alpha)
    ds = nl.ndarray((P, Wn), dtype=f32, buffer=nl.sbuf, name="ds")
    nisa.tensor_tensor(dst=ds, data1=d, data2=alpha, op=nl.multiply)  # Ds = D*alpha (fp32)
    dg = nl.ndarray((P, Wn), dtype=bf, buffer=nl.sbuf, name="dg")
    nisa.tensor_tensor(dst=dg, data1=ds, data2=dga, op=nl.multiply)
    du = nl.ndarray((P, Wn), dtype=bf, buffer=nl.sbuf, name="du")
    nisa.tensor_tensor(dst=du, data1=ds, data2=act, op=nl.multiply)
    nl_lo, nl_hi, l_lo, l_hi = cfg.clamp
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
    I = cfg.I  # noqa: E741 - the spec's name
    _store(t["dgu_s"][i0 : i0 + P, w0 : w0 + Wn], dg)
    _store(t["dgu_s"][I + i0 : I + i0 + P, w0 : w0 + Wn], du)
    _store(t["s_s"][i0 : i0 + P, w0 : w0 + Wn], s)
    if cfg.bias:
        # gate/up bias grad: per 128-token tile an fp32 sum, then a bf16 running sum (§6)
        acc = blk["acc_bgu"]
        red = nl.ndarray((P, 1), dtype=f32, buffer=nl.sbuf, name="bgu_red")
        gi = 0
        for x in (dg, du):
            for tt in range(nTw):
                nisa.tensor_reduce(dst=red, op=nl.add, data=x[:, tt * P : (tt + 1) * P], axis=1)
                col = acc[:, gi, n_it : n_it + 1]
                nisa.tensor_tensor(dst=col, data1=col, data2=red, op=nl.add)
            gi = gi + 1


def _write_affinity_grad(
    cfg: BwdKernelConfig, geo: Geometry, t: dict[str, Any], blk: dict[str, Any], b: int
) -> None:
    """dEA[tok*E + e] = bf16(partial_0 + partial_1) for the block's valid rows (core 0)."""
    if geo.pid != 0:
        return
    NT = cfg.B // P
    da = nl.ndarray((P, NT), dtype=nl.float32, buffer=nl.sbuf, name="da_all")
    nisa.dma_copy(dst=da, src=t["da_s"].ap([[1, P], [P, NT]], offset=0))
    for c in range(1, geo.lnc):
        other = nl.ndarray((P, NT), dtype=nl.float32, buffer=nl.sbuf, name="da_other")
        nisa.dma_copy(dst=other, src=t["da_s"].ap([[1, P], [P, NT]], offset=c * cfg.B))
        nisa.tensor_tensor(dst=da, data1=da, data2=other, op=nl.add)
    dab = nl.ndarray((P, NT), dtype=cfg.compute_dtype, buffer=nl.sbuf, name="da_bf")
    nisa.tensor_copy(dst=dab, src=da)
    ea_idx = blk["ea_idx"]
    if ea_idx is None:
        nisa.dma_copy(dst=t["dea"].ap([[1, P], [P, NT]], offset=b * cfg.B), src=dab)
        return
    for tt in range(NT):
        nisa.dma_copy(
            dst=t["dea"].ap(
                [[1, P], [1, 1]], offset=0, vector_offset=ea_idx[:, tt : tt + 1], indirect_dim=0
            ),
            src=dab[:, tt : tt + 1],
            oob_mode=_oob(cfg),
        )


# -- phase 2 ---------------------------------------------------------------------------------


def _phase2_quant(cfg: BwdKernelConfig, geo: Geometry, pre: dict[str, Any]) -> tuple[Any, Any]:
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
        rows = pre["rows"][ci]
        ilv = nl.ndarray((P, Wn, 4), dtype=bf, buffer=nl.sbuf, name="p2_ilv")
        nisa.tensor_copy(dst=ilv[0:v, :, :], src=rows[0:v, :, :].permute((0, 2, 1)))
        _quantize_tile(ilv, kt, Wn, gq[0:v, ci, :], gs[0:v, ci, :])
    return gq, gs


def _phase2(
    cfg: BwdKernelConfig,
    geo: Geometry,
    t: dict[str, Any],
    blk: dict[str, Any],
    w: dict[str, Any],
    b: int,
    win: int,
    pre: dict[str, Any],
    q: Any,
) -> None:
    """R = bf16(mx([dG|dU], W_gu)) per 128-token tile, into the hidden-state grad (§6 P2), on
    the window's loads `pre` (`_phase2_loads`) and its quantized ``[dG|dU]`` `q`
    (`_phase2_quant`)."""
    nTw = cfg.W // P
    if not geo.Hc:
        return
    bf = cfg.compute_dtype
    hsg = t["hsg"]
    hold = pre["hsg_old"]
    if cfg.accumulate and blk["tok"] is not None and hold is None:
        hold = _hsg_old(cfg, geo, t, blk, b, win)
    groups = []
    for c0 in range(geo.h0, geo.h0 + geo.Hc, NMAX):
        groups.append((c0, min(NMAX, geo.h0 + geo.Hc - c0)))
    fly = _wgu_fly(cfg, geo)
    if not fly and w["gu"]["layout"] is None:
        # resident W_gu: per token tile all column groups, then one write-back of the whole
        # row range (Hc-element runs instead of 512: nki-dma-bandwidth-guide.rst, 1 KiB runs
        # ~67% of peak, 4 KiB ~89%)
        for tt in range(nTw):
            r = nl.ndarray((P, geo.Hc), dtype=bf, buffer=nl.sbuf, name="p2_rb")
            for c0, n in groups:
                r_ps = _p2_tile(geo, q, _load_q(w["gu"], c0, n, "p2_w"), tt, n)
                o = c0 - geo.h0
                nisa.tensor_copy(dst=r[:, o : o + n], src=r_ps, engine=nisa.engine.scalar)
            _p2_write(cfg, geo, blk, hsg, hold, b, win, tt, r, geo.h0, geo.Hc)
        return
    # streamed W_gu: each column group's load (or on-chip quantization, `_wgu_fly`) issued one
    # group ahead of its matmuls where a second group fits (`_geometry`)
    nxt_w = _p2_weights(cfg, geo, t, blk, w, groups[0][0], groups[0][1], fly)
    for k in range(len(groups)):
        c0, n = groups[k]
        if k > 0 and not geo.w2_ahead:
            nxt_w = _p2_weights(cfg, geo, t, blk, w, c0, n, fly)
        wk = nxt_w
        if k + 1 < len(groups) and geo.w2_ahead:
            nxt_w = _p2_weights(cfg, geo, t, blk, w, groups[k + 1][0], groups[k + 1][1], fly)
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


def _p2_weights(cfg: BwdKernelConfig, geo: Geometry, t: dict[str, Any], blk: dict[str, Any],
                w: dict[str, Any], c0: int, n: int, fly: bool) -> tuple[Any, list[Any]]:  # fmt: skip
    """A streamed W_gu's columns ``[c0, c0+n)`` for phase 2's matmuls."""
    if fly:
        return _wgu_group(cfg, geo, t, blk["expert"], c0, n)
    return _load_q(w["gu"], c0, n, "p2_w")


def _p2_write(
    cfg: BwdKernelConfig,
    geo: Geometry,
    blk: dict[str, Any],
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
    if blk["tok"] is None:
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
    t: dict[str, Any],
    blk: dict[str, Any],
    b: int,
    win: int,
    with_x: bool,
) -> dict[str, Any]:
    """What phases 2 and 3/4's operands read from HBM for window `win`, issued one window
    ahead (see `_phase1_loads`): ``[dG|dU]^T`` row tiles (one ``[v, 4, W]`` per 2I chunk, also
    phase 3's operand) and, with `with_x`, X rows (`_phase3_x_rows`; else the caller gathers
    them later)."""
    Wn, nTw, w0 = cfg.W, cfg.W // P, win * cfg.W
    bf = cfg.compute_dtype
    out: dict[str, Any] = {"rows": [], "x": None}
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
        src = t["dgu_s"].ap([[cfg.B, v], [v * cfg.B, 4], [1, Wn]], offset=kt.k0 * cfg.B + w0)
        _load(rows[0:v, :, :], src)
        out["rows"].append(rows)
    if with_x:
        out["x"] = _phase3_x_rows(cfg, geo, t, blk, b, win)
    out["hsg_old"] = None
    if cfg.accumulate and blk["tok"] is not None and 4 * nTw * geo.Hc * 2 <= OLD_AHEAD_BUDGET:
        out["hsg_old"] = _hsg_old(cfg, geo, t, blk, b, win)
    return out


def _phase3_x_rows(
    cfg: BwdKernelConfig, geo: Geometry, t: dict[str, Any], blk: dict[str, Any], b: int, win: int
) -> Any:
    """Window `win`'s X rows (``[P, W/P, Hc]``, gathered), phase 3's stationary operand."""
    nTw = cfg.W // P
    x = nl.ndarray((P, nTw, geo.Hc), dtype=cfg.compute_dtype, buffer=nl.sbuf, name="p3_x_rows")
    for j in range(nTw):
        _gather_rows(
            cfg, blk, x[:, j, :], t["hidden_states"], b, win * nTw + j, geo.h0, geo.Hc,
            nisa.engine.gpsimd,
        )  # fmt: skip
    return x


def _hsg_old(
    cfg: BwdKernelConfig, geo: Geometry, t: dict[str, Any], blk: dict[str, Any], b: int, win: int
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
            cfg, blk, old[:, j, :], t["hsg"], b, win * nTw + j, geo.h0, geo.Hc,
            nisa.engine.gpsimd,
        )  # fmt: skip
    return old


def _s_loads(cfg: BwdKernelConfig, t: dict[str, Any], win: int) -> list[Any]:
    """S^T tiles of window `win` (``[128 i, <=4, W tok]`` per 512 rows of ``s_s``)."""
    Wn, w0 = cfg.W, win * cfg.W
    fts = []
    for f0 in range(0, cfg.I, NMAX):
        nf = min(NMAX, cfg.I - f0) // P
        ft = nl.ndarray((P, nf, Wn), dtype=cfg.compute_dtype, buffer=nl.sbuf, name="p4_s_ft")
        _load(ft, t["s_s"].ap([[cfg.B, P], [P * cfg.B, nf], [1, Wn]], offset=f0 * cfg.B + w0))
        fts.append(ft)
    return fts


# -- phase 3/4 operands ----------------------------------------------------------------------


def _window_tiles(op: dict[str, Any], w0: int, Wn: int) -> list[tuple[int, Any]]:
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
    dst: dict[str, Any],
    F: int,
    c0: int,
    name: str,
) -> None:
    """Token rows of window `win` (``rows [P, W/P, *]``, tokens on partitions, columns
    ``[r0, r0+F)``) quantized along the tokens into columns ``[c0, c0+F)`` of `dst` (wrapX
    chunks inside the window: one copy per byte interleaves them)."""
    Wn, w0 = cfg.W, win * cfg.W
    bf = cfg.compute_dtype
    spill = dst["layout"] is not None
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
    cfg: BwdKernelConfig, fts: list[Any], rows: int, win: int, dst: dict[str, Any], name: str
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
    dst: dict[str, Any],
    name: str,
) -> None:
    """``[dG|dU]^T`` of window `win` to token lanes from phase 2's row tiles (``rows2[i]
    [v2, 4, W]``: feature ``k0 + j*v2 + p`` of 2I chunk `i` on partition `p`): PE transposes of
    ``[v2 f, v tok]`` slices into the wrapX layout along the tokens, quantized into `dst`."""
    Wn, w0 = cfg.W, win * cfg.W
    bf = cfg.compute_dtype
    tiles = _window_tiles(dst, w0, Wn)
    F = 2 * cfg.I
    spill = dst["layout"] is not None
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


def _phase34_operands(
    cfg: BwdKernelConfig,
    geo: Geometry,
    t: dict[str, Any],
    blk: dict[str, Any],
    b: int,
    win: int,
    pre: dict[str, Any],
) -> None:
    """Phase-3 operands of window `win` quantized along the tokens from its loads `pre`
    (`_phase2_loads`): X (gathered rows) and [dG|dU] (phase 2's rows, transposed). dY's came
    with phase 1; S's follow phase 2 (`_phase3`)."""
    if not geo.Hc:
        return
    _rows_q(cfg, pre["x"], 0, win, t["xq"], geo.Hc, geo.h0, "p3_x")
    _rows_t_q(cfg, geo, pre["rows"], win, t["gq"], "p3_g")


def _bias_down(
    cfg: BwdKernelConfig, geo: Geometry, t: dict[str, Any], blk: dict[str, Any], win: int, dy: Any
) -> None:
    """Down bias grad: per 128-token tile ``sum_r bf16(dY*bf16(alpha))`` in fp32 (a
    ones-matmul over the partitions), bf16 running sum over the block's tiles (§6)."""
    nTw = cfg.W // P
    bf = cfg.compute_dtype
    acc = blk["acc_bd"]
    for tt in range(nTw):
        gtt = win * nTw + tt
        # bf16(alpha) held in an fp32 (P, 1) operand tile
        a_bf = nl.ndarray((P, 1), dtype=bf, buffer=nl.sbuf, name="bd_a")
        nisa.tensor_copy(dst=a_bf, src=blk["alpha_tok"][:, gtt : gtt + 1])
        a_f = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf, name="bd_af")
        nisa.tensor_copy(dst=a_f, src=a_bf)
        prod = nl.ndarray((P, geo.Hc), dtype=bf, buffer=nl.sbuf, name="bd_prod")
        nisa.tensor_scalar(dst=prod, data=dy[:, tt, :], op0=nl.multiply, operand0=a_f)
        for c0 in range(0, geo.Hc, NMAX):
            n = min(NMAX, geo.Hc - c0)
            red = nl.ndarray((1, n), dtype=nl.float32, buffer=nl.psum, name="bd_red")
            nisa.nc_matmul(dst=red, stationary=t["ones_bf"], moving=prod[:, c0 : c0 + n])
            nisa.tensor_tensor(
                dst=acc[:, c0 : c0 + n], data1=acc[:, c0 : c0 + n], data2=red, op=nl.add
            )


# -- phases 3 and 4 --------------------------------------------------------------------------


def _rmw_load(bf: Any, dst_ap: Any, first_dense: bool, n: int, name: str) -> Any:
    """The current value of an output tile for `_rmw` (dense; None for block 0, which writes)."""
    if first_dense:
        return None
    old = nl.ndarray((P, n), dtype=bf, buffer=nl.sbuf, name=f"{name}_old")
    _load(old, dst_ap)
    return old


def _rmw_olds(
    cfg: BwdKernelConfig,
    t: dict[str, Any],
    blk: dict[str, Any],
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
    if blk["rmw_idx"] is None:
        out = []
        for _ in tiles:
            out.append(t["zero"][:, 0:n])
        return out
    old = nl.ndarray((P, len(tiles), n), dtype=cfg.compute_dtype, buffer=nl.sbuf,
                     name=f"{name}_old")  # fmt: skip
    nisa.memset(dst=old, value=0.0, engine=nisa.engine.gpsimd)
    out = []
    for k in range(len(tiles)):
        _rt, col = tiles[k]
        src = rows.ap(
            [[rows.shape[1], P], [1, n]], offset=c0, vector_offset=blk["rmw_idx"][:, col : col + 1],
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


def _p3_dst(cfg: BwdKernelConfig, t: dict[str, Any], blk: dict[str, Any], col: int, n: int,
            ht: int) -> Any:  # fmt: skip
    """dW_gu[e] rows of H tile `ht`, columns ``[col, col+n)`` of the flattened (2, I)."""
    I2 = 2 * cfg.I
    return _ap(t["dwgu"], [[I2, P], [1, n]], ht * P * I2 + col, blk["expert"])


def _p3_loads(cfg: BwdKernelConfig, geo: Geometry, t: dict[str, Any], blk: dict[str, Any],
              first: bool, col: int, n: int) -> tuple[Any, Any, list[Any]]:  # fmt: skip
    """Phase 3's loads for dGU columns ``[col, col+n)``: the moving operand and the current
    value of this core's output tiles."""
    gq, gsv = _load_q(t["gq"], col, n, "p3_g")
    if not cfg.dense:
        tiles = []
        for j in range(geo.n_h):
            tiles.append((geo.h_lo + j, geo.h_lo + j))
        return gq, gsv, _rmw_olds(cfg, t, blk, t["dwgu_rows"], tiles, col, n, "p3")
    olds = []
    for j in range(geo.n_h):
        dst = _p3_dst(cfg, t, blk, col, n, geo.h_lo + j)
        olds.append(_rmw_load(cfg.compute_dtype, dst, first, n, "p3"))
    return gq, gsv, olds


def _p3_s_loads(cfg: BwdKernelConfig, t: dict[str, Any], k: int, ng: int) -> list[Any]:
    """(window, S^T tiles) of the windows whose S is quantized after phase-3 group `k` of
    `ng`."""
    nwin = cfg.B // cfg.W
    out = []
    for win in range((k * nwin) // ng, ((k + 1) * nwin) // ng):
        out.append((win, _s_loads(cfg, t, win)))
    return out


def _phase3(
    cfg: BwdKernelConfig, geo: Geometry, t: dict[str, Any], blk: dict[str, Any], b: int
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
    x_op = _stationary(t["xq"], geo.h0, geo.Hc, "p3_xres")
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
            _rmw(bf, _p3_dst(cfg, t, blk, col, n, ht), c_ps, olds[j], n, "p3")
        for win, ft in fts:
            _transposed_q(cfg, ft, cfg.I, win, t["sq"], "p4_s")


def _rmw_row_olds(cfg: BwdKernelConfig, t: dict[str, Any], blk: dict[str, Any], rows: Any,
                  tile: tuple[int, int], dst: Any, first: bool, c0: int, n: int,
                  name: str) -> tuple[Any, bool]:  # fmt: skip
    """The current value of one whole output row tile (`_rmw_olds` / `_rmw_load`), as (tile
    or None, whether to add +0 instead: routed block 0, whose zero tile is narrower)."""
    if cfg.dense:
        return _rmw_load(cfg.compute_dtype, dst, first, n, name), False
    if blk["rmw_idx"] is None:
        return None, True
    return _rmw_olds(cfg, t, blk, rows, [tile], c0, n, name)[0], False


def _phase34_rows(
    cfg: BwdKernelConfig,
    t: dict[str, Any],
    blk: dict[str, Any],
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
                nisa.tensor_tensor(dst=r, data1=t["zero"][:, 0:zn], data2=r, op=nl.add)
        _store(dst, row)
        for after, job in side:
            if after == k:
                _transposed_q(job[0], job[1], job[2], job[3], job[4], job[5])


def _phase3_rows(
    cfg: BwdKernelConfig,
    geo: Geometry,
    t: dict[str, Any],
    blk: dict[str, Any],
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
        dst = _ap(t["dwgu"], [[I2, P], [1, I2]], ht * P * I2, blk["expert"])
        tiles.append((ht * P, t["dwgu_rows"], (ht, ht), dst))
    nwin = cfg.B // cfg.W
    side = []
    for win in range(nwin):
        after = (win * len(tiles)) // nwin
        side.append((after, (cfg, _s_loads(cfg, t, win), cfg.I, win, t["sq"], "p4_s")))
    _phase34_rows(cfg, t, blk, first, tiles, groups, 0, x_op, t["gq"], geo.k3, side, "p3")


def _p4_dst(cfg: BwdKernelConfig, t: dict[str, Any], blk: dict[str, Any], c0: int, n: int,
            it: int) -> Any:  # fmt: skip
    """dW_d[e] rows of I tile `it`, columns ``[c0, c0+n)``."""
    return _ap(t["dwd"], [[cfg.H, P], [1, n]], it * P * cfg.H + c0, blk["expert"])


def _p4_loads(cfg: BwdKernelConfig, t: dict[str, Any], blk: dict[str, Any], first: bool,
              c0: int, n: int) -> tuple[Any, Any, list[Any]]:  # fmt: skip
    """Phase 4's loads for H columns ``[c0, c0+n)``: dY's operand and the output tiles."""
    yq, ysv = _load_q(t["yq"], c0, n, "p4_y")
    if not cfg.dense:
        tiles = []
        for it in range(cfg.I // P):
            tiles.append((it, cfg.H // P + it))
        return yq, ysv, _rmw_olds(cfg, t, blk, t["dwd_rows"], tiles, c0, n, "p4")
    olds = []
    for it in range(cfg.I // P):
        dst = _p4_dst(cfg, t, blk, c0, n, it)
        olds.append(_rmw_load(cfg.compute_dtype, dst, first, n, "p4"))
    return yq, ysv, olds


def _phase4(
    cfg: BwdKernelConfig, geo: Geometry, t: dict[str, Any], blk: dict[str, Any], b: int
) -> None:
    """dW_d[e][i, h] += bf16(mx(S^T, dY)) per [128 i, <=512 h] tile (§6 P4), loads one column
    group ahead as in `_phase3`."""
    if not geo.Hc:
        return
    first = cfg.dense and b == 0
    bf = cfg.compute_dtype
    s_op = _stationary(t["sq"], 0, cfg.I, "p4_sres")
    groups = []
    for c0 in range(geo.h0, geo.h0 + geo.Hc, NMAX):
        groups.append((c0, min(NMAX, geo.h0 + geo.Hc - c0)))
    if geo.res_moving and not geo.overlap:
        # row by row (`_phase34_rows`): dW_d[e] rows of each I tile, this core's H columns
        tiles = []
        for it in range(cfg.I // P):
            dst = _ap(t["dwd"], [[cfg.H, P], [1, geo.Hc]], it * P * cfg.H + geo.h0, blk["expert"])
            tiles.append((it * P, t["dwd_rows"], (it, cfg.H // P + it), dst))
        _phase34_rows(cfg, t, blk, first, tiles, groups, geo.h0, s_op, t["yq"], geo.k4, [], "p4")
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
            _rmw(bf, _p4_dst(cfg, t, blk, c0, n, it), c_ps, olds[it], n, "p4")


def _write_bias(
    cfg: BwdKernelConfig, geo: Geometry, t: dict[str, Any], blk: dict[str, Any]
) -> None:
    """Bias grads: bf16 read-modify-write of this block's bf16 sums (§6 "Bias")."""
    bf = cfg.compute_dtype
    expert = blk["expert"]
    if geo.Hc:
        old = nl.ndarray((1, geo.Hc), dtype=bf, buffer=nl.sbuf, name="bd_old")
        dst = _ap(t["dbd"], [[cfg.H, 1], [1, geo.Hc]], geo.h0, expert)
        nisa.dma_copy(dst=old, src=dst)
        nisa.tensor_tensor(dst=old, data1=old, data2=blk["acc_bd"], op=nl.add)
        nisa.dma_copy(dst=dst, src=old)
    for n_it in range(geo.n_i):
        it = geo.i_lo + n_it
        for g in range(2):
            old = nl.ndarray((P, 1), dtype=bf, buffer=nl.sbuf, name="bgu_old")
            dst = _ap(t["dbgu"], [[1, P], [1, 1]], g * cfg.I + it * P, expert)
            nisa.dma_copy(dst=old, src=dst)
            col = blk["acc_bgu"][:, g, n_it : n_it + 1]
            nisa.tensor_tensor(dst=old, data1=old, data2=col, op=nl.add)
            nisa.dma_copy(dst=dst, src=old)


# --------------------------------------------------------------------------------------------
# The kernel
# --------------------------------------------------------------------------------------------


def blockwise_mm_bwd_mxfp8_nki(
    hidden_states: Any,
    expert_affinities_masked: Any,
    gate_up_proj_weight: Any,
    down_proj_weight: Any,
    token_position_to_id: Any,
    block_to_expert: Any,
    output_hidden_states_grad: Any,
    gate_up_proj_act_checkpoint_T: Any,
    config: BwdKernelConfig,
    gate_act_checkpoint_T: Any = None,
    intermediate_checkpoint_T: Any = None,
    scaled_intermediate_checkpoint_T: Any = None,
    gate_up_weight_scales: Any = None,
    down_weight_scales: Any = None,
    num_valid_tokens: Any = None,
) -> tuple[Any, ...]:
    """The NKI kernel. Tensors are HBM tensors in the API reference's layouts (bwd spec §0
    G4; MX data as uint32 x4 words / uint8 scales); `config` is the launcher's plan
    (`nki_backend.kernel_config`), which also did every input check of bwd spec §10. Returns
    the gradient tuple of the API reference (bias grads appended when ``config.bias``)."""
    cfg = config
    assert tuple(hidden_states.shape) == (cfg.T, cfg.H), "hidden_states: shape differs from config"
    assert tuple(gate_up_proj_act_checkpoint_T.shape) == (cfg.N, 2, cfg.I, cfg.B), (
        "gate_up_proj_act_checkpoint_T: shape differs from config"
    )
    assert cfg.pq_d == (down_weight_scales is not None), "down_weight_scales: config mismatch"
    assert cfg.pq_gu == (gate_up_weight_scales is not None), "gate_up_weight_scales: mismatch"
    assert cfg.nv == (num_valid_tokens is not None), "num_valid_tokens: config mismatch"
    lnc = nl.num_programs(axes=0)
    pid = nl.program_id(axis=0)
    assert lnc == 1 or lnc == 2, "launch: LNC 1 or 2"
    geo = _geometry(cfg, lnc, pid)
    t: dict[str, Any] = {
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
    _alloc_outputs(cfg, t)
    _alloc_scratch(cfg, geo, t)
    _constants(cfg, t)
    zero_jobs: list[Any] = [[], []]
    if not cfg.dense or cfg.nv:
        zero_jobs = _init_outputs(cfg, geo, t)
    w_dense = None
    if cfg.dense:
        w_dense = _quantize_weights(cfg, geo, t, None)
    # Blocks overlap: block b+1's indices, prologue and phase 1 are issued during block b's
    # phases 3/4 (DMA-bound read-modify-writes that leave the compute engines room; engines
    # and DMA queues run in program order, so the overlap has to be in the program). The
    # scratch handed from phase 1 to phases 2-4 alternates between two sets (`_block_tensors`).
    tb = _block_tensors(t, 0)
    st = _prologue(cfg, geo, tb, w_dense, 0)
    tn: Any = None
    if cfg.N > 1:
        tn = _block_tensors(t, 1)
    fr = _block_phase1(cfg, geo, tb, 0, zero_jobs[0], st, tn)
    for b in range(cfg.N):
        tnn: Any = None
        if b + 2 < cfg.N:
            tnn = _block_tensors(t, b + 2)
        jobs: list[Any] = []
        if b == 0:
            jobs = zero_jobs[1]
        if tn is not None:
            _setup_indices(cfg, tn, fr["next"], b + 1)
        if b + 1 == cfg.N and not cfg.dense:
            # every block's expert flag is set by now (`_rmw_index`); before the last block's
            # phases 2-4 rather than at the end, where nothing would overlap it
            _zero_unused_experts(cfg, geo, t)
        _block_phase2(cfg, geo, tb, b, jobs, fr)
        nfr: Any = None
        if tn is not None and geo.overlap:
            st = _prologue(cfg, geo, tn, w_dense, b + 1, fr["next"])
        _phase3(cfg, geo, tb, fr["blk"], b)
        # (before phase 3 it would overwrite the S scratch phase 3 of the other core may still
        # be reading: the LNC race check catches that order)
        if tn is not None and geo.overlap:
            nfr = _block_phase1(cfg, geo, tn, b + 1, [], st, tnn)
        if tn is not None and not geo.overlap and geo.overlap4:
            st = _prologue(cfg, geo, tn, w_dense, b + 1, fr["next"])
        _phase4(cfg, geo, tb, fr["blk"], b)
        if cfg.bias:
            _write_bias(cfg, geo, tb, fr["blk"])
        if tn is not None and not geo.overlap:
            if not geo.overlap4:
                st = _prologue(cfg, geo, tn, w_dense, b + 1, fr["next"])
            nfr = _block_phase1(cfg, geo, tn, b + 1, [], st, tnn)
        tb, fr, tn = tn, nfr, tnn
    if cfg.bias:
        return (t["hsg"], t["dea"], t["dwgu"], t["dwd"], t["dbgu"], t["dbd"])
    return (t["hsg"], t["dea"], t["dwgu"], t["dwd"])


# ``nki.jit`` object for launches (``blockwise_mm_bwd_mxfp8_jit[2](...)``); the plain function
# above is what ``nki.simulate`` and the interpreter run.
blockwise_mm_bwd_mxfp8_jit = nki.jit(blockwise_mm_bwd_mxfp8_nki)
