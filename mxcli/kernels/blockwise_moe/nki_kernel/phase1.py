"""Phase 1 of a block (bwd spec §6 P1; package docstring step 2): its prologue (indices,
W_d, the first windows' dY rows), then per window ``D^T = mx(W_d, dY^T)`` per 128-row I tile,
the SwiGLU backward against the checkpoints, the affinity-grad partials and the hand-over of
``dG | dU`` and ``S`` to phases 2-4 through the shared HBM scratch; phase 4's dY operand and
the down bias grad come from the rows gathered here.
"""

from __future__ import annotations

from typing import Any

import nki.isa as nisa
import nki.language as nl

from .alloc import _run_zeros
from .indices import _gather_rows, _indices_load, _oob, _rmw_index_finish, _setup_indices
from .operands import _load, _load_q, _onchip_operand, _store
from .plan import NMAX, BwdKernelConfig, Geometry, P, _pipeline_depth, _wgu_fly, _wgu_staged
from .quant import _quantize_chunk_to, _quantize_tile, _rows_q
from .state import (
    BlockIndices,
    BlockTensors,
    Checkpoints,
    LaunchTensors,
    P1Loads,
    P1Operands,
    Phase1Out,
    Prologue,
    SwigluTerms,
    Weights,
)
from .weights import _quantize_weights, _wgu_load, _wgu_pairs


def _hand_over(geo: Geometry, t: BlockTensors) -> None:
    """LNC 2: after phase 1 both cores synchronize on the shared scratch tensors of both sets:
    this block's (written by both, read by both from here on) and the other one (the previous
    block's, whose last reads, in phases 2-3, precede this point on both cores; the next
    block's phase 1, after this point, overwrites it)."""
    if geo.lnc > 1:
        for cur, other in ((t.dgu_s, t.dgu_s_o), (t.s_s, t.s_s_o), (t.da_s, t.da_s_o)):
            nisa.core_barrier(cur, (0, 1))
            if t.two_sets:
                nisa.core_barrier(other, (0, 1))


def _prologue_indices(cfg: BwdKernelConfig, t: LaunchTensors, b: int) -> BlockIndices:
    """Block `b`'s indices, all three stages at once (the first block)."""
    blk = _indices_load(cfg, t, b)
    _setup_indices(cfg, t, blk, b)
    return blk


def _prologue(
    cfg: BwdKernelConfig,
    geo: Geometry,
    t: LaunchTensors,
    w_dense: Any,
    b: int,
    blk: BlockIndices | None = None,
) -> Prologue:
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
        w = _quantize_weights(cfg, geo, t, blk.expert, "d")
    q_ahead, ahead = _pipeline_depth(cfg, geo)
    nwin = cfg.B // cfg.W
    rows = []
    for win in range(min(ahead, nwin)):
        rows.append(_phase1_rows(cfg, t, blk, b, win))
    pre: Any = None
    if q_ahead:
        pre = _phase1_loads(cfg, geo, t, b, 0, rows[0])
    return Prologue(blk, w, rows, pre)


def _block_phase1(
    cfg: BwdKernelConfig,
    geo: Geometry,
    t: BlockTensors,
    b: int,
    zero_jobs: list[Any],
    st: Prologue,
    tn: BlockTensors | None,
) -> Phase1Out:
    """Phase 1 of block `b` (package docstring) from its `_prologue` `st`, the hand-over to
    phase 2 and the affinity grad; `zero_jobs`: output-zeroing DMAs to spread over its windows;
    `tn`: the next block's tensors (None for the last block), whose indices are issued here.
    Returns what phases 2-4 need and the next block's indices."""
    blk, w, rows, pre = st.blk, st.w, st.rows, st.pre
    if geo.res_moving:
        t.yq = _onchip_operand(geo.k4, geo.h0, geo.Hc, "p4_yres")
    blk.acc_bgu = None
    if cfg.bias:
        acc_bgu = nl.ndarray(
            (P, 2, max(1, geo.n_i)), dtype=cfg.compute_dtype, buffer=nl.sbuf, name="acc_bgu"
        )
        nisa.memset(dst=acc_bgu, value=0.0)
        blk.acc_bgu = acc_bgu
    blk.acc_bd = None
    if cfg.bias:
        acc_bd = nl.ndarray(
            (1, max(1, geo.Hc)), dtype=cfg.compute_dtype, buffer=nl.sbuf, name="acc_bd"
        )
        nisa.memset(dst=acc_bd, value=0.0)
        blk.acc_bd = acc_bd
    # phase 1 as a software pipeline: window w+1's loads and operands are issued before window
    # w's matmuls and SwiGLU backward (`_pipeline_depth`)
    nwin = cfg.B // cfg.W
    q_ahead, ahead = _pipeline_depth(cfg, geo)
    staged = _wgu_staged(cfg, geo)
    steps: list[Any] = []
    staged_prev: list[Any] = []
    if staged:
        steps = _wgu_pairs(cfg, geo)
        w.gu = _onchip_operand(geo.k2, geo.h0, geo.Hc, "wgu_res")
    q: Any = None
    if q_ahead:
        q = _phase1_operands(cfg, geo, t, blk, 0, pre)
    for win in range(nwin):
        # staged W_gu (below): the previous window's share, before this window's allocations
        for step, ilv in staged_prev:
            _quantize_chunk_to(ilv, geo.k2[step[2]], step[1], "wgu", w.gu, step[0], step[2])
        if not q_ahead:
            pre = _phase1_loads(cfg, geo, t.launch, b, win, rows[win])
            q = _phase1_operands(cfg, geo, t, blk, win, pre)
        cur_pre, cur_q = pre, q
        if win + ahead < nwin and len(rows) == win + ahead:
            rows.append(_phase1_rows(cfg, t.launch, blk, b, win + ahead))
        if q_ahead and win + 1 < nwin:
            pre = _phase1_loads(cfg, geo, t.launch, b, win + 1, rows[win + 1])
            q = _phase1_operands(cfg, geo, t, blk, win + 1, pre)
        nz = len(zero_jobs)
        _run_zeros(t.launch, zero_jobs[(win * nz) // nwin : ((win + 1) * nz) // nwin])
        if win == 0 and not cfg.dense and not staged and not _wgu_fly(cfg, geo):
            # W_gu (needed from phase 2 on) once phase 1's first window is under way
            _quantize_weights(cfg, geo, t.launch, blk.expert, "gu", w)
        # staged W_gu: this window's share of the chunks loaded before its SwiGLU backward,
        # quantized before the next window's (after it in the last window), so that VectorE
        # does not wait on those loads
        share = []
        if staged:
            lo, hi = (win * len(steps)) // nwin, ((win + 1) * len(steps)) // nwin
            for k in range(lo, hi):
                share.append((steps[k], _wgu_load(cfg, geo, t.launch, blk.expert, steps[k])))
        staged_prev = share
        _phase1(cfg, geo, t, blk, w, b, win, cur_pre, cur_q)
        if win + 1 == nwin:
            for step, ilv in share:
                _quantize_chunk_to(ilv, geo.k2[step[2]], step[1], "wgu", w.gu, step[0], step[2])
    # the next block's index loads (the first stage of its chain, `_indices_load`)
    # once this block's phase-1 loads are all issued: the next prologue's loads wait for them
    nblk: Any = None
    if tn is not None:
        nblk = _indices_load(cfg, tn.launch, b + 1)
    # hand-over 1: dgu_s / s_s / da_s written by both cores, read by both from here on
    _hand_over(geo, t)
    if geo.overlap:
        _write_affinity_grad(cfg, geo, t, blk, b)
    return Phase1Out(blk, w, nblk)


def _load_checkpoints(
    cfg: BwdKernelConfig, t: LaunchTensors, b: int, win: int, it: int
) -> Checkpoints:
    """The checkpoint tiles ``[128 i, W tok]`` of I tile `it` in window `win`: G and U, and the
    optional phi(G), Hm and S checkpoints (None when not given; used as given, bwd spec §4)."""
    Wn, w0 = cfg.W, win * cfg.W
    i0 = it * P
    ckpt = t.gate_up_proj_act_checkpoint_T
    cdt = ckpt.dtype  # checkpoint values are used as given (bf16, or fp16)
    g = nl.ndarray((P, Wn), dtype=cdt, buffer=nl.sbuf, name="g")
    u = nl.ndarray((P, Wn), dtype=cdt, buffer=nl.sbuf, name="u")
    _load(g, ckpt[b, 0, i0 : i0 + P, w0 : w0 + Wn])
    _load(u, ckpt[b, 1, i0 : i0 + P, w0 : w0 + Wn])
    opt = []
    for key, src in (("act", t.gate_act_checkpoint_T), ("hm", t.intermediate_checkpoint_T),
                     ("s", t.scaled_intermediate_checkpoint_T)):  # fmt: skip
        x: Any = None
        if src is not None:
            x = nl.ndarray((P, Wn), dtype=src.dtype, buffer=nl.sbuf, name=f"ck_{key}")
            _load(x, src[b, i0 : i0 + P, w0 : w0 + Wn])
        opt.append(x)
    return Checkpoints(g, u, opt[0], opt[1], opt[2])


def _phase1_rows(cfg: BwdKernelConfig, t: LaunchTensors, blk: BlockIndices, b: int,
                 win: int) -> Any:  # fmt: skip
    """The dY rows of window `win` (tokens on partitions, ``[P, W/P, H]``), gathered two
    windows ahead of their use (`_block_phase1`; zeroed on ScalarE, copies of the zero tile:
    GpSimd and VectorE are the busier engines in phase 1)."""
    nTw = cfg.W // P
    dyw = nl.ndarray((P, nTw, cfg.H), dtype=cfg.compute_dtype, buffer=nl.sbuf, name="p1_dy")
    for j in range(nTw):
        _gather_rows(
            cfg, blk, dyw[:, j, :], t.output_hidden_states_grad, b, win * nTw + j, 0, cfg.H,
            nisa.engine.scalar, t.zero,
        )  # fmt: skip
    return dyw


def _phase1_loads(
    cfg: BwdKernelConfig, geo: Geometry, t: LaunchTensors, b: int, win: int, dyw: Any
) -> P1Loads:
    """What phase 1 reads from HBM for window `win`: the dY rows `dyw` (`_phase1_rows`), the
    alpha row and the checkpoint tiles of this core's I tiles. Issued one window ahead of their
    compute (`_block_phase1`): DMA engines and queues start transfers in program order, so a load
    issued after a window's write-backs would wait for them."""
    Wn, w0 = cfg.W, win * cfg.W
    alpha = nl.ndarray((P, Wn), dtype=nl.float32, buffer=nl.sbuf, name="alpha_row")
    _load(alpha, t.alpha_s.ap([[0, P], [1, Wn]], offset=w0))
    cks = []
    for n_it in range(geo.n_i):
        cks.append(_load_checkpoints(cfg, t, b, win, geo.i_lo + n_it))
    return P1Loads(dyw, alpha, cks)


def _phase1(
    cfg: BwdKernelConfig,
    geo: Geometry,
    t: BlockTensors,
    blk: BlockIndices,
    w: Weights,
    b: int,
    win: int,
    pre: P1Loads,
    q: P1Operands,
) -> None:
    """D^T = mx(W_d, dY^T) per I tile of this core, SwiGLU backward, affinity-grad partials
    (bwd spec §6 P1), on the window's loads `pre` (`_phase1_loads`) and operands `q`
    (`_phase1_operands`, built one window ahead)."""
    Wn, nTw, w0 = cfg.W, cfg.W // P, win * cfg.W
    ntk = len(geo.k1)
    yq, ys = q.yq, q.ys
    alpha = pre.alpha
    prods: list[Any] = []
    for n_it in range(geo.n_i):
        it = geo.i_lo + n_it
        wq, wsv = _load_q(w.d, it * P, P, "p1_w")
        d = nl.ndarray((P, Wn), dtype=nl.float32, buffer=nl.psum, name="p1_d")
        for ci in range(ntk):
            v = geo.k1[ci].v
            nisa.nc_matmul_mx(
                dst=d, stationary=wq[0:v, ci, :], moving=yq[0:v, ci, :],
                stationary_scale=wsv[ci], moving_scale=ys[0:v, ci, :], accumulate=ci > 0,
            )  # fmt: skip
        _swiglu(cfg, t, blk, win, it, n_it, d, alpha, prods, pre.ck[n_it], q.sw[n_it])
    # affinity grad: sum_i fp32(D*Hm), the partition sum as a ones-matmul (fp32 in PSUM), in
    # I-tile order; issued after the window's MX matmuls so that the Tensor engine's in-order
    # queue does not wait on each tile's VectorE product between them
    da_ps = nl.ndarray((P, nTw), dtype=nl.float32, buffer=nl.psum, name="da_ps")
    for n_it in range(geo.n_i):
        prod = prods[n_it]
        for tt in range(nTw):
            nisa.nc_matmul(
                dst=da_ps[:, tt : tt + 1], stationary=prod[:, tt * P : (tt + 1) * P],
                moving=t.launch.ones_f32, accumulate=n_it > 0,
            )  # fmt: skip
    # affinity-grad partial of this core -> scratch row `pid`
    da = nl.ndarray((P, nTw), dtype=nl.float32, buffer=nl.sbuf, name="da")
    if geo.n_i:
        nisa.tensor_copy(dst=da, src=da_ps)
    else:
        nisa.memset(dst=da, value=0.0)
    dst = t.da_s.ap([[1, P], [P, nTw]], offset=geo.pid * cfg.B + w0)
    _store(dst, da)


def _phase1_operands(
    cfg: BwdKernelConfig,
    geo: Geometry,
    t: BlockTensors,
    blk: BlockIndices,
    win: int,
    pre: P1Loads,
) -> P1Operands:
    """What phase 1 computes from window `win`'s loads before its matmuls, issued one window
    ahead of them (so that no engine's in-order queue waits on another engine at a window
    boundary): dY^T quantized along H (``yq``, ``ys``), the SwiGLU terms that need only the
    checkpoints (``sw``, `_swiglu_terms`), and phase 4's dY operand (this core's H columns,
    quantized along the tokens; with the down bias grad: dY is gathered once per block)."""
    Wn, nTw = cfg.W, cfg.W // P
    bf = cfg.compute_dtype
    ntk = len(geo.k1)
    dyw = pre.dyw
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
        sw.append(_swiglu_terms(cfg, pre.ck[n_it]))
    if geo.Hc:
        # phase 4's dY operand (this core's H columns, quantized along the tokens) and the
        # down bias grad come from the rows gathered here: dY is gathered once per block
        _rows_q(cfg, dyw, geo.h0, win, t.yq, geo.Hc, geo.h0, "p4_dy")
        if cfg.bias:
            _bias_down(cfg, geo, t.launch, blk, win, dyw[:, :, geo.h0 : geo.h0 + geo.Hc])
    return P1Operands(yq, ys, sw)


def _swiglu_terms(cfg: BwdKernelConfig, ck: Checkpoints) -> SwigluTerms:
    """The SwiGLU backward terms of one ``[128 i, W tok]`` tile that need only its checkpoints
    `ck` (bwd spec §6 P1 rounding points): ``act = bf16(silu(G))`` (or phi(G) as given),
    ``dga = bf16(bf16(silu'(G)) * U)``, ``hm = bf16(act * U)`` (or Hm as given). The SBUF-only
    products run on GpSimd, which phase 1 (VectorE-bound) otherwise leaves idle."""
    Wn, bf = cfg.W, cfg.compute_dtype
    g, u = ck.g, ck.u
    act = ck.act
    if act is None:
        act = nl.ndarray((P, Wn), dtype=bf, buffer=nl.sbuf, name="act")
        nisa.activation(dst=act, op=nl.silu, data=g)  # act = bf16(silu(G))
    dph = nl.ndarray((P, Wn), dtype=bf, buffer=nl.sbuf, name="dphi")
    nisa.activation(dst=dph, op=nl.silu_dx, data=g)  # bf16(silu'(G))
    dga = nl.ndarray((P, Wn), dtype=bf, buffer=nl.sbuf, name="dga")
    nisa.tensor_tensor(dst=dga, data1=dph, data2=u, op=nl.multiply, engine=nisa.engine.gpsimd)
    hm = ck.hm
    if hm is None:
        hm = nl.ndarray((P, Wn), dtype=bf, buffer=nl.sbuf, name="hm")
        nisa.tensor_tensor(dst=hm, data1=act, data2=u, op=nl.multiply, engine=nisa.engine.gpsimd)
    return SwigluTerms(act, dga, hm)


def _swiglu(
    cfg: BwdKernelConfig,
    t: BlockTensors,
    blk: BlockIndices,
    win: int,
    it: int,
    n_it: int,
    d: Any,
    alpha: Any,
    prods: list[Any],
    ck: Checkpoints,
    sw: SwigluTerms,
) -> None:
    """SwiGLU backward on one ``[128 i, W tok]`` tile, rounding points of bwd spec §6 P1, on
    the checkpoint tiles `ck` (`_load_checkpoints`) and terms `sw` (`_swiglu_terms`); the
    affinity-grad product ``fp32(D*Hm)`` is appended to `prods`."""
    Wn, nTw, w0 = cfg.W, cfg.W // P, win * cfg.W
    i0 = it * P
    bf, f32 = cfg.compute_dtype, nl.float32
    g, u = ck.g, ck.u
    act, dga, hm = sw.act, sw.dga, sw.hm
    # affinity grad: sum_i fp32(D*Hm), the partition sum as a ones-matmul (fp32 in PSUM)
    prod = nl.ndarray((P, Wn), dtype=f32, buffer=nl.sbuf, name="dhm")
    nisa.tensor_tensor(dst=prod, data1=d, data2=hm, op=nl.multiply)
    prods.append(prod)
    s = ck.s  # phase 4's operand as the forward saved it, if it did
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
    _store(t.dgu_s[i0 : i0 + P, w0 : w0 + Wn], dg)
    _store(t.dgu_s[I + i0 : I + i0 + P, w0 : w0 + Wn], du)
    _store(t.s_s[i0 : i0 + P, w0 : w0 + Wn], s)
    if cfg.bias:
        # gate/up bias grad: per 128-token tile an fp32 sum, then a bf16 running sum (§6)
        acc = blk.acc_bgu
        red = nl.ndarray((P, 1), dtype=f32, buffer=nl.sbuf, name="bgu_red")
        gi = 0
        for x in (dg, du):
            for tt in range(nTw):
                nisa.tensor_reduce(dst=red, op=nl.add, data=x[:, tt * P : (tt + 1) * P], axis=1)
                col = acc[:, gi, n_it : n_it + 1]
                nisa.tensor_tensor(dst=col, data1=col, data2=red, op=nl.add)
            gi = gi + 1


def _write_affinity_grad(
    cfg: BwdKernelConfig, geo: Geometry, t: BlockTensors, blk: BlockIndices, b: int
) -> None:
    """dEA[tok*E + e] = bf16(partial_0 + partial_1) for the block's valid rows (core 0)."""
    if geo.pid != 0:
        return
    NT = cfg.B // P
    da = nl.ndarray((P, NT), dtype=nl.float32, buffer=nl.sbuf, name="da_all")
    nisa.dma_copy(dst=da, src=t.da_s.ap([[1, P], [P, NT]], offset=0))
    for c in range(1, geo.lnc):
        other = nl.ndarray((P, NT), dtype=nl.float32, buffer=nl.sbuf, name="da_other")
        nisa.dma_copy(dst=other, src=t.da_s.ap([[1, P], [P, NT]], offset=c * cfg.B))
        nisa.tensor_tensor(dst=da, data1=da, data2=other, op=nl.add)
    dab = nl.ndarray((P, NT), dtype=cfg.compute_dtype, buffer=nl.sbuf, name="da_bf")
    nisa.tensor_copy(dst=dab, src=da)
    ea_idx = blk.ea_idx
    if ea_idx is None:
        nisa.dma_copy(dst=t.launch.dea.ap([[1, P], [P, NT]], offset=b * cfg.B), src=dab)
        return
    for tt in range(NT):
        nisa.dma_copy(
            dst=t.launch.dea.ap(
                [[1, P], [1, 1]], offset=0, vector_offset=ea_idx[:, tt : tt + 1], indirect_dim=0
            ),
            src=dab[:, tt : tt + 1],
            oob_mode=_oob(cfg),
        )


def _bias_down(
    cfg: BwdKernelConfig, geo: Geometry, t: LaunchTensors, blk: BlockIndices, win: int, dy: Any
) -> None:
    """Down bias grad: per 128-token tile ``sum_r bf16(dY*bf16(alpha))`` in fp32 (a
    ones-matmul over the partitions), bf16 running sum over the block's tiles (§6)."""
    nTw = cfg.W // P
    bf = cfg.compute_dtype
    acc = blk.acc_bd
    for tt in range(nTw):
        gtt = win * nTw + tt
        # bf16(alpha) held in an fp32 (P, 1) operand tile
        a_bf = nl.ndarray((P, 1), dtype=bf, buffer=nl.sbuf, name="bd_a")
        nisa.tensor_copy(dst=a_bf, src=blk.alpha_tok[:, gtt : gtt + 1])
        a_f = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf, name="bd_af")
        nisa.tensor_copy(dst=a_f, src=a_bf)
        prod = nl.ndarray((P, geo.Hc), dtype=bf, buffer=nl.sbuf, name="bd_prod")
        nisa.tensor_scalar(dst=prod, data=dy[:, tt, :], op0=nl.multiply, operand0=a_f)
        for c0 in range(0, geo.Hc, NMAX):
            n = min(NMAX, geo.Hc - c0)
            red = nl.ndarray((1, n), dtype=nl.float32, buffer=nl.psum, name="bd_red")
            nisa.nc_matmul(dst=red, stationary=t.ones_bf, moving=prod[:, c0 : c0 + n])
            nisa.tensor_tensor(
                dst=acc[:, c0 : c0 + n], data1=acc[:, c0 : c0 + n], data2=red, op=nl.add
            )
