"""Kernel-faithful reference of `blockwise_mm_bwd_mxfp8` (bwd spec §4, §6; API reference G4).

Computation is organised per expert: the blocks of one expert are gathered once (one index
gather per activation), each weight is quantized once per expert (errata 7: the device
re-quantizes per block, with identical values), P1 and P2 run as one fp32 matmul over the rows
of all the expert's blocks, and P3/P4 quantize all blocks at once with the block as a batch
axis (their MX groups run along the tokens of each block) followed by one matmul per block.
This is numerically the device's block loop: the only cross-block order dependences (the bf16
read-add-write accumulation of the weight/bias grads and of the hidden-state grad) are replayed
in block order. Inside a block, rows are held in the MX group order of the token axis (see
`_TokenOrder`), which only the token-axis quantization can see.

With numba installed (and ``MXCLI_FUSED`` not 0), the gathers, the SwiGLU backward chain, the
bf16 roundings/accumulations and the hidden-grad scatter run as fused passes (`_fused`,
`_FusedPasses`) with the same bytes as the torch expressions kept here; matmuls and MX
quantization are the same calls on both paths.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
import torch

from mxcli.kernels.blockwise_moe import _checks as ck
from mxcli.kernels.blockwise_moe.config import AffinityOption, MXFP8MOEBwdConfig
from mxcli.kernels.blockwise_moe.contract import as_call
from mxcli.kernels.blockwise_moe.forward import project_gate_up
from mxcli.kernels.blockwise_moe.numerics import (
    Grouping,
    Numerics,
    clamp_masks,
    ordered_scatter,
)
from mxcli.kernels.blockwise_moe.prequant import ScaleLayout, dequantize_weight_x4
from mxcli.mx import QuantScheme, group_order

__all__ = ["blockwise_mm_bwd_mxfp8_reference"]

# Bias-grad reduction tile over tokens (spec §6 "Bias": per 128-token tile, bf16 running sum).
_BIAS_TILE = 128


@dataclass
class _Weights:
    """Per-expert quantized weights (fp32 values the MX matmuls multiply)."""

    wgu: torch.Tensor  # bf16 [E, H, 2, I] or pre-quantized x4 [E, 2I/4, H]
    wd: torch.Tensor  # bf16 [E, I, H] or pre-quantized x4 [E, H/4, I]
    gu_scales: torch.Tensor | None
    d_scales: torch.Tensor | None
    g1: Grouping
    g2: Grouping
    g_fwd: Grouping
    gu_layout: ScaleLayout
    d_layout: ScaleLayout
    H: int
    I: int  # noqa: E741 (spec notation I = I_TP)
    nm: Numerics

    def down(self, e: int) -> torch.Tensor:
        """``[I, H]``, MX along H (phase 1 grouping)."""
        if self.d_scales is None:
            return self.nm.q(self.wd[e], -1, self.g1)
        w = dequantize_weight_x4(
            self.wd[e : e + 1], self.d_scales[e : e + 1], self.g1, self.d_layout
        )  # [1, H, I]
        return w[0].t()

    def gate_up_cat(self, e: int) -> torch.Tensor:
        """``[H, 2I]`` (column ``c·I + i``), MX along 2I (phase 2 grouping)."""
        if self.gu_scales is None:
            return self.nm.q(self.wgu[e].reshape(self.H, 2 * self.I), -1, self.g2)
        w = dequantize_weight_x4(
            self.wgu[e : e + 1], self.gu_scales[e : e + 1], self.g2, self.gu_layout
        )  # [1, 2I, H]
        return w[0].t()

    def gate_up_fwd(self, e: int) -> torch.Tensor:
        """``[H, 2I]``, MX along H per output column: the forward's projection operand."""
        return self.nm.q(self.wgu[e].reshape(self.H, 2 * self.I), 0, self.g_fwd)


class _TokenOrder:
    """Row order used inside every block: the MX group order of the token axis (phase 3).

    Rows of a block are gathered in this order (a permutation of the block's positions, which
    the row-wise phases P1/P2 and the elementwise math do not see), so that the token-axis MX
    groups of P3/P4 (§5.3 wrapX over B) are consecutive runs of 32 and quantize with the
    contiguous 1x32 kernel: the same groups, hence bit-identical values, at lower cost. Both
    operands of a matmul share the order, so the contraction is unchanged (up to fp32
    summation order, which the reference does not model anyway).
    """

    def __init__(self, B: int, g3: Grouping, nm: Numerics, device: torch.device) -> None:
        self.nm = nm
        chunks = None if g3.chunks is None else list(g3.chunks)
        self.perm = group_order(B, g3.scheme, g3.tile_k, chunks).to(device)  # [B]
        self.inv = torch.empty_like(self.perm)
        self.inv[self.perm] = torch.arange(B, device=device)
        self.tile = self.perm // _BIAS_TILE  # [B] natural 128-token tile of each row

    def q(self, x_t: torch.Tensor, g: Grouping) -> torch.Tensor:
        """MX-quantize ``x_t [nb, F, B]`` (last axis in this order) along the tokens with `g`.

        The result's last axis is in this order when `g` is the order's grouping, else in
        natural order; both operands of one matmul use the same `g`, so they always agree.
        """
        if self.nm.exact:
            return x_t.to(torch.float32)
        chunks = None if g.chunks is None else list(g.chunks)
        order = group_order(x_t.shape[-1], g.scheme, g.tile_k, chunks).to(self.perm.device)
        if torch.equal(order, self.perm):
            return self.nm.q(x_t, -1, Grouping(QuantScheme.MX1X32))
        return self.nm.q(x_t.index_select(-1, self.inv), -1, g)


def _cols(ckpt: torch.Tensor, bl: torch.Tensor, order: _TokenOrder) -> torch.Tensor:
    """Blocks `bl` of a token-last checkpoint ``[N, F, B]`` as ``[nb, F, B]``, tokens in
    block row order."""
    return ckpt.index_select(0, bl).index_select(2, order.perm)


def _gate_up_cols(
    ckpt_gu: torch.Tensor, bl: torch.Tensor, order: _TokenOrder
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(G, U)`` ``[nb, I, B]`` (fp32 views) of the gate/up checkpoint ``[N, 2, I, B]``."""
    c = ckpt_gu.index_select(0, bl).index_select(3, order.perm).to(torch.float32)
    return c[:, 0], c[:, 1]


def _p1(dy_q: torch.Tensor, wd_q: torch.Tensor, nb: int, B: int) -> torch.Tensor:
    """Phase-1 products per block, token-last: ``D^T[k] = W_d dY_k^T`` -> ``[nb, I, B]`` fp32.

    ``dy_q [nb*B, H]`` and ``wd_q [I, H]`` are MX-quantized along H (the contraction)."""
    out = torch.empty(nb, wd_q.shape[0], B, dtype=torch.float32, device=dy_q.device)
    for k in range(nb):
        torch.mm(wd_q, dy_q[k * B : (k + 1) * B].t(), out=out[k])
    return out


def _acc_block(acc: torch.Tensor | None, c: torch.Tensor, nm: Numerics) -> torch.Tensor:
    """One block's fp32 result `c` into its accumulator: ``acc = bf16(acc + bf16(c))`` (the
    device rounds the block result to bf16, then does a bf16 read-add-write; the first block
    starts from the zero-initialised output). Exact mode: fp32 add."""
    cr = nm.rb(c)
    if acc is None:
        return cr
    return acc.add_(cr)  # bf16 += bf16: torch adds in fp32 and rounds once (RNE)


def _tile_bias_sum(v: torch.Tensor, order: _TokenOrder, nm: Numerics) -> torch.Tensor:
    """Spec §6 bias reduction of ``v [nb, B, F]`` (rows in block row order, values already
    rounded): per natural 128-token tile an fp32 sum, then a bf16 running sum over the tiles of
    each block. Returns ``[nb, F]`` (bf16 values)."""
    nb, B, F = v.shape
    red = torch.zeros(nb, B // _BIAS_TILE, F, dtype=torch.float32, device=v.device)
    red.index_add_(1, order.tile, v.to(torch.float32))  # [nb, tiles, F]
    acc = red[:, 0]
    for t in range(1, red.shape[1]):
        acc = nm.bf(nm.bf(acc) + red[:, t])
    return nm.bf(acc)


def _swiglu_bwd(
    g: torch.Tensor,
    u: torch.Tensor,
    sig: torch.Tensor,
    d_t: torch.Tensor,
    ds_t: torch.Tensor | None,
    al_t: torch.Tensor,
    bl: torch.Tensor,
    order: _TokenOrder,
    ckpt_act: torch.Tensor | None,
    ckpt_h: torch.Tensor | None,
    ckpt_s: torch.Tensor | None,
    cfg: MXFP8MOEBwdConfig,
    nm: Numerics,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """P1 elementwise chain (spec §6 P1.3-P1.6) in torch, token-last ``[nb, I, B]``.

    `d_t`: the un-scaled P1 product (ON_I: scaled in place into ``Ds = D·α``); `ds_t`: the ON_H
    P1 product of ``dYs``, else None. Returns ``(dGU^T [nb, 2I, B], P4 operand [nb, I, B],
    affinity grad [nb, B] fp32)``. `_fused.swiglu_bwd` is the same chain in one pass.
    """
    nb, I, B = d_t.shape  # noqa: E741 (spec notation I = I_TP)
    half = I // 2
    on_i = ds_t is None
    # act = bf16(φ(G)), dphi = φ'(G), dga = bf16(dphi·U), Hm = bf16(act·U)
    act = _cols(ckpt_act, bl, order) if ckpt_act is not None else nm.rb(g * sig)
    dphi = torch.rsub(sig, 1.0).mul_(g).add_(1.0).mul_(sig)  # σ(1 + g(1 − σ)), fp32
    dga = nm.rb(nm.rb(dphi) * u)
    del dphi
    hm = _cols(ckpt_h, bl, order) if ckpt_h is not None else nm.rb(act * u)
    # affinity grad from the un-scaled D; LNC2: two fp32 halves over I, then added
    da = (d_t[:, :half] * hm[:, :half]).sum(1) + (d_t[:, half:] * hm[:, half:]).sum(1)
    if ds_t is None:
        ds_t = d_t.mul_(al_t)  # Ds = D·α in fp32 (spec §6 P1.6)
    dgu_t = torch.empty(nb, 2 * I, B, dtype=nm.store_dtype, device=d_t.device)
    torch.mul(ds_t, dga, out=dgu_t[:, :I])  # fp32 product, rounded once on the store
    torch.mul(ds_t, act, out=dgu_t[:, I:])
    del ds_t, dga
    mask_nl, mask_l = clamp_masks(g, u, cfg.clamp_limits)
    if mask_nl is not None:
        dgu_t[:, :I] *= mask_nl
    if mask_l is not None:
        dgu_t[:, I:] *= mask_l
    if on_i:  # P4 operand S = bf16(Hm·α), or the checkpoint
        p4_t = _cols(ckpt_s, bl, order) if ckpt_s is not None else nm.rb(hm * al_t)
    else:
        p4_t = hm
    return dgu_t, p4_t, da


def _fused_kernels(
    nm: Numerics, device: torch.device, *ckpts: torch.Tensor | None
) -> ModuleType | None:
    """`_fused` when it applies (numba installed, ``MXCLI_FUSED`` not 0, kernel emulation on CPU,
    bf16 checkpoints), else None: then the torch path runs (same bytes)."""
    global _FUSED
    if nm.exact or device.type != "cpu":
        return None
    if any(t is not None and t.dtype != torch.bfloat16 for t in ckpts):
        return None
    if _FUSED is None:
        try:
            from mxcli.kernels.blockwise_moe import _fused

            _FUSED = _fused
        except Exception:  # numba missing or broken: the torch path gives the same bytes
            _FUSED = False
    if _FUSED is False or not _FUSED.enabled() or _FUSED.torch_bf16_nan_bits() is None:
        return None
    return _FUSED


_FUSED: Any = None


class _FusedPasses:
    """The fused (numba) passes of one call, bound to its settings; see `_fused`."""

    def __init__(
        self,
        fz: ModuleType,
        cfg: MXFP8MOEBwdConfig,
        order: _TokenOrder,
        H: int,
        I: int,  # noqa: E741 (spec notation I = I_TP)
        ckpt_act: torch.Tensor | None,
        ckpt_h: torch.Tensor | None,
        ckpt_s: torch.Tensor | None,
    ) -> None:
        fz.match_torch_threads()
        self.fz = fz
        self.nan = fz.torch_bf16_nan()
        lim = cfg.clamp_limits
        bounds = (
            (None,) * 4
            if lim is None
            else (
                lim.non_linear_clamp_lower_limit,
                lim.non_linear_clamp_upper_limit,
                lim.linear_clamp_lower_limit,
                lim.linear_clamp_upper_limit,
            )
        )
        # fp32 like torch's comparison of an fp32 tensor with a Python float; NaN = unset
        self.clamp = np.array([np.nan if b is None else b for b in bounds], dtype=np.float32)
        self.perm = order.perm.numpy()
        self.B, self.H, self.I = order.perm.numel(), H, I
        none = np.zeros((1, 1, 1), dtype=np.uint16)  # stands for an absent checkpoint
        self.ckpts = [
            (none, False) if t is None else (fz.u16(t.contiguous()), True)
            for t in (ckpt_act, ckpt_h, ckpt_s)
        ]
        self.no_rows = np.zeros((1, 1), dtype=np.uint64)
        # every P3 [2I, H] and P4 [I, H] block product lands in this one fp32 buffer
        self.mm_buf = torch.empty(2 * I * H, dtype=torch.float32)

    def gather(
        self, src: torch.Tensor, flat: torch.Tensor, T: int, rows: bool
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """``(rows [R, H] or None, token-last [nb, H, B])`` of token rows ``src[flat]`` (zero for
        the padding id T)."""
        R, B, H = flat.numel(), self.B, self.H
        out_rows = torch.empty(R, H, dtype=torch.bfloat16) if rows else None
        out_t = torch.empty(R // B, H, B, dtype=torch.bfloat16)
        u64 = self.fz.u64
        self.fz.gather_rows_t(
            u64(src), flat.numpy(), T, B, self.no_rows if out_rows is None else u64(out_rows),
            u64(out_t), rows,
        )  # fmt: skip
        return out_rows, out_t

    def gate_up_cols(self, ckpt_gu: torch.Tensor, bl: torch.Tensor) -> torch.Tensor:
        """The tensor `_gate_up_cols` views: ``[nb, 2, I, B]`` fp32, tokens in block row order."""
        c = torch.empty(bl.numel(), 2, self.I, self.B, dtype=torch.float32)
        self.fz.gather_gate_up(self.fz.u16(ckpt_gu.contiguous()), bl.numpy(), self.perm, c.numpy())
        return c

    def swiglu_bwd(
        self,
        gu: torch.Tensor,
        sig: torch.Tensor,
        d_t: torch.Tensor,
        ds_t: torch.Tensor | None,
        al_t: torch.Tensor,
        bl: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """`_swiglu_bwd` in one pass, from ``gu [nb, 2, I, B]`` (G, U): ``(dGU^T, its rows
        [R, 2I], P4 operand, D·Hm in two halves over I)``."""
        nb, I, B = d_t.shape  # noqa: E741 (spec notation I = I_TP)
        dgu_t = torch.empty(nb, 2 * I, B, dtype=torch.bfloat16)
        dgu_rows = torch.empty(nb * B, 2 * I, dtype=torch.bfloat16)
        p4_t = torch.empty(nb, I, B, dtype=torch.bfloat16)
        prod = torch.empty(2, nb, I // 2, B, dtype=torch.float32)
        (act, has_act), (h, has_h), (s, has_s) = self.ckpts
        u16, u64 = self.fz.u16, self.fz.u64
        ds = d_t if ds_t is None else ds_t
        self.fz.swiglu_bwd(
            gu.contiguous().numpy(), sig.contiguous().numpy(), d_t.contiguous().numpy(),
            ds.contiguous().numpy(), al_t.reshape(nb, B).contiguous().numpy(), ds_t is None,
            act, has_act, h, has_h, s, has_s, bl.numpy(), self.perm,
            self.clamp, self.nan, u16(dgu_t), u64(dgu_t), u64(dgu_rows), u16(p4_t), prod.numpy(),
        )  # fmt: skip
        return dgu_t, dgu_rows, p4_t, prod

    def round_rows(
        self, r: torch.Tensor, sel: torch.Tensor, dest: torch.Tensor, out: torch.Tensor
    ) -> None:
        """``out[dest] = bf16(r[sel])``."""
        self.fz.round_rows(r.numpy(), sel.numpy(), dest.numpy(), self.fz.u16(out), self.nan)

    def acc_block(self, acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, first: bool) -> None:
        """`_acc_block` of the block product ``a b^T`` into the bf16 `acc` in place."""
        M, N = a.shape[0], b.shape[0]
        c = self.mm_buf[: M * N].view(M, N)
        torch.mm(a, b.t(), out=c)
        self.fz.acc_block(self.fz.u16(acc), c.numpy(), first, self.nan)

    def ordered_scatter(
        self, out: torch.Tensor, ids: torch.Tensor, vals: torch.Tensor, accumulate: bool
    ) -> None:
        """`numerics.ordered_scatter` for bf16 `out` and `vals`; `out` may be uninitialised (rows
        no id names are zeroed)."""
        self.fz.ordered_scatter(
            self.fz.u16(out), ids.numpy(), self.fz.u16(vals), accumulate, self.nan
        )


def blockwise_mm_bwd_mxfp8_reference(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, ...]:
    """The ``reference`` backend of `blockwise_mm_bwd_mxfp8`: takes its `BwdCall` (whose
    ``emulate`` picks kernel or exact numerics), or the arguments of `blockwise_mm_bwd_mxfp8`
    (``emulate`` included), validated here into one."""
    call = as_call(*args, **kwargs)
    cfg = call.config
    nm = Numerics(call.emulate)
    on_i = cfg.affinity_option is AffinityOption.AFFINITY_ON_I
    p1, p2, p3, p4 = cfg.phase_configs()

    x, dy = call.hidden_states, call.output_hidden_states_grad
    ea, wgu, wd = call.expert_affinities_masked, call.gate_up_proj_weight, call.down_proj_weight
    tpi, b2e = call.token_position_to_id, call.block_to_expert
    gu_s, d_s = call.gate_up_weight_scales, call.down_weight_scales
    B, T, H, E, I, N = call.B, call.T, call.H, call.E, call.I, call.N  # noqa: E741
    dev = x.device
    ckpt_gu, ckpt_act = call.gate_up_proj_act_checkpoint_T, call.gate_act_checkpoint_T
    ckpt_h, ckpt_s = call.intermediate_checkpoint_T, call.scaled_intermediate_checkpoint_T
    ckpt_dys = call.down_proj_act_checkpoint
    nv = call.nv

    # ---- path rules checked by the contract (spec §10 config/launch, §9) -----------------
    if cfg.single_expert_dense:
        # §3.4: the routing tensors are not read; block b is tokens b·B … b·B+B−1.
        tpi_used = torch.arange(T, dtype=torch.int64, device=dev)
        if nv is not None:  # positions >= count are padding (see the public docstring)
            tpi_used = torch.where(tpi_used < nv, tpi_used, torch.full_like(tpi_used, -1))
        b2e_used = torch.zeros(N, dtype=torch.int64, device=dev)
    else:
        tpi_used, b2e_used = tpi, b2e
    plan = ck.BlockPlan.make(tpi_used, b2e_used, T, B, dev)

    # ---- groupings and weights -------------------------------------------------------------
    g1 = Grouping.for_phase(p1, H, cfg.fast_dma_transpose)  # contraction H (errata 1)
    g2 = Grouping.for_phase(p2, 2 * I)  # contraction 2I
    g3 = Grouping.for_phase(p3, B)  # contraction B (tokens)
    g4 = Grouping.for_phase(p4, B)
    g_fwd = Grouping.for_phase(p1)  # G/U recompute: the forward's projection over H
    W = _Weights(wgu, wd, gu_s, d_s, g1, g2, g_fwd, call.gu_layout, call.d_layout, H, I, nm)

    # ---- outputs (spec §4.3: zero-initialised; dense writes every entry it defines) --------
    sd = nm.store_dtype
    fz = _fused_kernels(nm, dev, ckpt_gu, ckpt_act, ckpt_h, ckpt_s)
    # Token rows are gathered from [T+1, F] copies whose last row is zero (the padding target);
    # the fused gathers read bf16 inputs in place and write the zeros of padding themselves.
    x_ext = x.contiguous() if fz is not None and x.dtype == sd else ck.with_zero_row(x, sd)
    dy_ext = dy.contiguous() if fz is not None and dy.dtype == sd else ck.with_zero_row(dy, sd)
    ea_ext = ck.with_zero_row(ea.reshape(T, E).to(device=dev), torch.float32)  # [T+1, E]
    dea = torch.zeros(T * E, dtype=torch.float32, device=dev)
    # the fused path overwrites each expert's weight grads with its first block (zeroing only
    # experts without blocks) and writes every row of the hidden grad
    new_out = torch.empty if fz is not None else torch.zeros
    dwgu = new_out(E, 2 * I, H, dtype=sd, device=dev)  # [E, 2I, H], transposed at the end
    dwd = new_out(E, I, H, dtype=sd, device=dev)
    dbgu = torch.zeros(E, 2 * I, dtype=sd, device=dev) if cfg.bias else None
    dbd = torch.zeros(E, H, dtype=sd, device=dev) if cfg.bias else None
    valid_flat = plan.valid.reshape(-1)
    vpos = valid_flat.nonzero().squeeze(1)  # valid positions, block order
    compact = torch.cumsum(valid_flat, 0) - 1  # position -> row of r_valid
    r_valid = torch.empty(vpos.numel(), H, dtype=sd, device=dev)  # P2 rows of valid positions
    order = _TokenOrder(B, g3, nm, dev)
    fused = _FusedPasses(fz, cfg, order, H, I, ckpt_act, ckpt_h, ckpt_s) if fz else None

    for e in range(E):
        chunks = plan.chunks(e, skip_empty=True)  # all-padding blocks contribute exactly 0
        if not chunks:
            if fused is not None:
                dwgu[e].zero_()
                dwd[e].zero_()
            continue
        wd_q = W.down(e)  # [I, H]
        wcat_q = W.gate_up_cat(e)  # [H, 2I]
        wfwd_q = W.gate_up_fwd(e) if ckpt_gu is None else None
        acc_gu: torch.Tensor | None = None  # [2I, H] dW_gu[e] accumulator
        acc_d: torch.Tensor | None = None  # [I, H] dW_d[e]
        acc_bgu: torch.Tensor | None = None  # [2I]
        acc_bd: torch.Tensor | None = None  # [H]
        for bl in chunks:
            nb = bl.numel()
            R = nb * B
            ids = plan.idx.index_select(0, bl).index_select(1, order.perm)  # [nb, B]
            flat = ids.reshape(-1)  # [R] token ids (T = padding), block row order
            vrow = plan.valid.index_select(0, bl).index_select(1, order.perm).reshape(-1)
            pos = (bl[:, None] * B + order.perm[None, :]).reshape(-1)  # [R] natural positions
            vsel = vrow.nonzero().squeeze(1)
            al = ea_ext[:, e].index_select(0, flat)[:, None]  # [R, 1] fp32, 0 for padding
            al_t = al.view(nb, 1, B)
            if fused is not None:  # rows and token-last copies of X and dY, one pass each
                xg, x_tok = fused.gather(x_ext, flat, T, rows=ckpt_gu is None)
                dyg_rows, dy_tok = fused.gather(dy_ext, flat, T, rows=True)
                assert dyg_rows is not None
                dyg = dyg_rows
            else:
                xg = x_ext.index_select(0, flat)  # [R, H]
                dyg = dy_ext.index_select(0, flat)  # [R, H]
                x_tok = xg.view(nb, B, H).transpose(1, 2)  # [nb, H, B]
                dy_tok = dyg.view(nb, B, H).transpose(1, 2)

            # Elementwise P1 math runs token-last, [nb, I, B] (the checkpoints' own layout), so
            # that the P3/P4 operands dGU^T and S^T come out ready for their token-axis groups.
            gu: torch.Tensor | None = None  # fused path: [nb, 2, I, B] holding G and U
            if ckpt_gu is not None:
                if fused is not None:
                    gu = fused.gate_up_cols(ckpt_gu, bl)
                    g, u = gu[:, 0], gu[:, 1]  # the torch path's views, see _gate_up_cols
                else:
                    g, u = _gate_up_cols(ckpt_gu, bl, order)  # [nb, I, B] each, fp32
            else:  # the forward's projection recomputed from hidden_states (API reference)
                assert wfwd_q is not None and xg is not None
                g, u = project_gate_up(nm.q(xg, -1, g_fwd), wfwd_q, None, cfg.clamp_limits, nm)
                g, u = (t.view(nb, B, I).transpose(1, 2) for t in (g, u))
            sig = torch.sigmoid(g)  # on the same layout in both paths

            # P1 matmul: contraction over H (dY per token row, W_d per row i), fp32, per block
            # D^T [I, B] = W_d[e] dY_b^T
            d_t = _p1(nm.q(dyg, -1, g1), wd_q, nb, B)  # [nb, I, B], un-scaled
            ds_t: torch.Tensor | None = None
            if on_i:
                dys = dyg
            else:  # ON_H: the P1 operand is output_grad·α (API reference)
                if ckpt_dys is not None:
                    dys = ckpt_dys.index_select(0, bl).index_select(1, order.perm).reshape(R, H)
                    dys = dys * vrow[:, None].to(dys.dtype)  # padding rows contribute zero
                else:
                    dys = nm.rb(dyg.to(torch.float32) * al)
                dy_tok = dys.view(nb, B, H).transpose(1, 2)
                ds_t = _p1(nm.q(dys, -1, g1), wd_q, nb, B)

            # P1 elementwise (spec §6 P1.3-P1.6) -> dGU^T [nb, 2I, B] and its rows [R, 2I], the
            # P4 operand [nb, I, B] and the affinity grad (un-scaled D; LNC2: two fp32 halves)
            if fused is not None:
                if gu is None:
                    gu = torch.stack((g, u), 1)
                dgu_t, dgu_rows, p4_t, d_hm = fused.swiglu_bwd(gu, sig, d_t, ds_t, al_t, bl)
                da = d_hm[0].sum(1) + d_hm[1].sum(1)  # the torch path's sums (same tensors)
            else:
                dgu_t, p4_t, da = _swiglu_bwd(
                    g, u, sig, d_t, ds_t, al_t, bl, order, ckpt_act, ckpt_h, ckpt_s, cfg, nm
                )
                dgu_rows = dgu_t.transpose(1, 2).reshape(R, 2 * I)  # [R, 2I]
            del g, u, gu, sig, d_t, ds_t
            da = da.reshape(R)
            dea.index_copy_(0, flat.index_select(0, vsel) * E + e, nm.bf(da.index_select(0, vsel)))

            # P2: contraction over 2I (dGU per token row); rows kept for the ordered scatter
            r = nm.q(dgu_rows, -1, g2) @ wcat_q.t()  # [R, H] fp32
            dest = compact.index_select(0, pos.index_select(0, vsel))
            if fused is not None:
                fused.round_rows(r, vsel, dest, r_valid)
            else:
                r_valid.index_copy_(0, dest, nm.rb(r.index_select(0, vsel)))
            del r, dgu_rows

            # P3: dW_gu[e] += X^T dGU and P4: dW_d[e] += S^T dY (ON_H: Hm^T dYs), one matmul
            # per block with the MX groups along the block's tokens (operands token-last)
            dgu_q = order.q(dgu_t, g3)  # [nb, 2I, B]
            x_t = order.q(x_tok, g3)  # [nb, H, B]
            for k in range(nb):  # block order: bf16 read-add-write of the accumulator
                if fused is not None:
                    fused.acc_block(dwgu[e], dgu_q[k], x_t[k], acc_gu is None)
                    acc_gu = dwgu[e]
                else:
                    acc_gu = _acc_block(acc_gu, torch.mm(dgu_q[k], x_t[k].t()), nm)  # [2I, H]
            del dgu_q, x_t, x_tok
            s_q = order.q(p4_t, g4)  # [nb, I, B]
            dy_t = order.q(dy_tok, g4)  # [nb, H, B]
            for k in range(nb):
                if fused is not None:
                    fused.acc_block(dwd[e], s_q[k], dy_t[k], acc_d is None)
                    acc_d = dwd[e]
                else:
                    acc_d = _acc_block(acc_d, torch.mm(s_q[k], dy_t[k].t()), nm)  # [I, H]
            del s_q, dy_t, dy_tok, p4_t

            if cfg.bias:  # spec §6 "Bias": per 128-token tile fp32 sums, bf16 running sums
                prod = nm.rb(dyg * nm.rb(al))  # bf16(dY·bf16(α)), [R, H]
                bd_blocks = _tile_bias_sum(prod.view(nb, B, H), order, nm)  # [nb, H]
                bgu_blocks = _tile_bias_sum(dgu_t.transpose(1, 2), order, nm)  # [nb, 2I]
                for k in range(nb):
                    acc_bd = _acc_block(acc_bd, bd_blocks[k], nm)
                    acc_bgu = _acc_block(acc_bgu, bgu_blocks[k], nm)
            del dgu_t, xg, dyg, dys
        assert acc_gu is not None and acc_d is not None
        if fused is None:
            dwgu[e] = acc_gu
            dwd[e] = acc_d
        if cfg.bias:
            assert dbgu is not None and dbd is not None
            assert acc_bgu is not None and acc_bd is not None
            dbgu[e] = acc_bgu
            dbd[e] = acc_bd

    # P2 results into the hidden-state grad, in block order (spec §6 P2)
    hsg = new_out(T, H, dtype=sd, device=dev)
    hs_ids = plan.idx.reshape(-1).index_select(0, vpos)
    if fused is not None:
        fused.ordered_scatter(hsg, hs_ids, r_valid, cfg.accumulate_hidden_states_grad)
    else:
        ordered_scatter(hsg, hs_ids, r_valid, cfg.accumulate_hidden_states_grad, nm)

    ea_dtype = ea.dtype
    outputs: list[torch.Tensor] = [
        nm.out(hsg, x.dtype),
        nm.out(dea.view(T * E, 1), ea_dtype),
        nm.out(dwgu.transpose(1, 2).reshape(E, H, 2, I), torch.bfloat16),
        nm.out(dwd, torch.bfloat16),
    ]
    if cfg.bias:
        assert dbgu is not None and dbd is not None
        outputs += [nm.out(dbgu.view(E, 2, I), cfg.compute_dtype), nm.out(dbd, cfg.compute_dtype)]
    return tuple(t.contiguous() if t.dtype == torch.float32 else t for t in outputs)
