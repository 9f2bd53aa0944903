"""Forward reference of the blockwise MXFP8 MoE MLP (bwd spec §2.4), producing the checkpoints
`blockwise_mm_bwd_mxfp8` reads."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from mxcli.kernels.blockwise_moe import _checks as ck
from mxcli.kernels.blockwise_moe.config import (
    AffinityOption,
    BwdValidationError,
    ClampLimits,
    _coerce_enum,
    _coerce_scheme,
)
from mxcli.kernels.blockwise_moe.numerics import (
    Emulate,
    Grouping,
    Numerics,
    clamp_forward,
    ordered_scatter,
    silu,
)
from mxcli.mx import QuantScheme

__all__ = ["ForwardResult", "blockwise_mm_fwd_mxfp8", "project_gate_up"]


class ForwardResult(NamedTuple):
    """Output and checkpoints of `blockwise_mm_fwd_mxfp8` (token axis last, as the backward reads).

    ``output [T, H]``; ``gate_up_proj_act_checkpoint_T [N, 2, I, B]`` (clamped gate pre-activation
    at ``[:, 0]``, clamped up at ``[:, 1]``); ``gate_act_checkpoint_T [N, I, B]`` = bf16(φ(G));
    ``intermediate_checkpoint_T [N, I, B]`` = Hm; ``scaled_intermediate_checkpoint_T [N, I, B]``
    = S = bf16(Hm·α) (None under AFFINITY_ON_H, where the forward does not form S).
    """

    output: torch.Tensor
    gate_up_proj_act_checkpoint_T: torch.Tensor
    gate_act_checkpoint_T: torch.Tensor
    intermediate_checkpoint_T: torch.Tensor
    scaled_intermediate_checkpoint_T: torch.Tensor | None


def project_gate_up(
    xq: torch.Tensor,
    w_q: torch.Tensor,
    bias: torch.Tensor | None,
    clamp: ClampLimits | None,
    nm: Numerics,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward gate/up projection of bwd spec §2.4 for quantized operands.

    ``xq [R, H]`` (MX along H), ``w_q [H, 2I]`` (MX along H, per output column), ``bias [2I]``.
    Returns ``(Gc, Uc)``, each ``[R, I]`` fp32 holding bf16 values: ``clip(bf16(x·W + b))``,
    rounded to bf16 first, then clamped, then stored as bf16.
    """
    gu = xq @ w_q  # [R, 2I] fp32 accumulation
    if bias is not None:
        gu += bias  # mxcli extension: the BF16 goldens add the bias before the clamp (§2.1)
    gu = nm.bf(gu)
    I = gu.shape[1] // 2  # noqa: E741 (spec notation I = I_TP)
    g, u = gu[:, :I], gu[:, I:]
    clamp_forward(g, u, clamp)
    return nm.bf(g), nm.bf(u)


def blockwise_mm_fwd_mxfp8(
    hidden_states: Any,
    expert_affinities_masked: Any,
    gate_up_proj_weight: Any,
    down_proj_weight: Any,
    token_position_to_id: Any,
    block_to_expert: Any,
    block_size: int = 4096,
    *,
    weight_layout: str = "backward",
    clamp_limits: ClampLimits | None = None,
    gate_up_proj_bias: Any = None,
    down_proj_bias: Any = None,
    affinity_option: AffinityOption | str = AffinityOption.AFFINITY_ON_I,
    quant_scheme: QuantScheme | str = QuantScheme.WRAPX,
    tile_k: int = 512,
    num_valid_tokens: Any = None,
    emulate: Emulate | str = Emulate.KERNEL,
) -> ForwardResult:
    """Forward of the blockwise dropless MoE MLP with the MXFP8 kernel's rounding points.

    Per block b of expert e (bwd spec §2.4), ``X_b`` the gathered rows (zero for padding)::

        G, U = clip(bf16(mx(X_b, W_g[e]))), clip(bf16(mx(X_b, W_u[e])))   # contraction over H
        act  = silu(G)                       # fp32 (the forward does not round it)
        Hm   = bf16(act · U)
        S    = bf16(Hm · α)                  # AFFINITY_ON_I
        Y_b  = bf16(mx(S, W_d[e]))           # contraction over I, one rounding

    ``mx`` quantizes X per row and the weights per output column along the contraction axis
    (`quant_scheme`, `tile_k`). Outputs accumulate as on the device: two bf16 slabs (blocks of
    even / odd index, each in block order, ``slab[t] = bf16(slab[t] + Y_b[r])``), then
    ``out = bf16(slab_0 + slab_1)``; padding rows are dropped.

    Args:
        hidden_states: ``[T, H]`` bf16 (any float with ``emulate="exact"``).
        expert_affinities_masked: ``[T*E, 1]``, read as fp32.
        gate_up_proj_weight, down_proj_weight: ``[E, H, 2, I]`` and ``[E, I, H]`` with
            ``weight_layout="backward"`` (default, the backward's layout); ``[E, 2, I, H]`` and
            ``[E, H, I]`` with ``weight_layout="forward"`` (the device forward kernel's layout).
        token_position_to_id, block_to_expert: the block plan (`build_block_plan`); ids outside
            ``[0, T)`` are padding.
        block_size: B.
        clamp_limits: optional GPT-OSS clamps (applied to the bf16 G/U before they are stored).
        gate_up_proj_bias ``[E, 2, I]``, down_proj_bias ``[E, H]``: mxcli extension (the device
            MXFP8 forward has no bias tensors): added in fp32 before the bf16 rounding of the
            projection (gate/up) and of the block output (down: ``+ α·b_d`` under ON_I,
            ``(· + b_d)·α`` under ON_H).
        affinity_option: ON_I (device) or ON_H (mxcli extension: ``Y_b = bf16(mx(Hm, W_d)·α)``).
        quant_scheme, tile_k: MX grouping of every forward matmul; give the backward the same
            (config ``quant_scheme`` and phase-1 ``tile_k``) if it is to recompute G/U.
        num_valid_tokens: optional count (int or [1] tensor), clamped to ``[0, T]``; tokens with
            id >= count are treated as padding (zero output rows, padding checkpoint columns).
        emulate: ``"kernel"`` or ``"exact"`` (fp32, no quantization, no bf16 rounding, fp32
            outputs and checkpoints).

    Returns:
        `ForwardResult` (output in the dtype of `hidden_states`; checkpoints bf16, fp32 exact).
    """
    nm = Numerics(emulate)
    aff = _coerce_enum("affinity_option", affinity_option, AffinityOption)
    scheme = _coerce_scheme("quant_scheme", quant_scheme)
    if tile_k not in (128, 256, 512):
        raise BwdValidationError(f"tile_k: expected 128, 256 or 512, got {tile_k!r}")
    if weight_layout not in ("backward", "forward"):
        raise BwdValidationError(
            f"weight_layout: expected 'backward' or 'forward', got {weight_layout!r}"
        )
    if clamp_limits is not None and not isinstance(clamp_limits, ClampLimits):
        raise BwdValidationError(
            f"clamp_limits: expected ClampLimits or None, got {type(clamp_limits).__name__}"
        )
    B = ck.check_block_size(block_size)
    x = ck.tensor("hidden_states", hidden_states)
    ea = ck.tensor("expert_affinities_masked", expert_affinities_masked)
    wgu = ck.tensor("gate_up_proj_weight", gate_up_proj_weight)
    wd = ck.tensor("down_proj_weight", down_proj_weight)
    tpi = ck.tensor("token_position_to_id", token_position_to_id)
    b2e = ck.tensor("block_to_expert", block_to_expert)
    assert x is not None and ea is not None and wgu is not None and wd is not None
    assert tpi is not None and b2e is not None
    ck.check_rank("hidden_states", x, 2, "(T, H)")
    ck.check_float("hidden_states", x, None if nm.exact else (torch.bfloat16,))
    T, H = x.shape
    ck.check_rank("down_proj_weight", wd, 3, "(E, I, H)")
    ck.check_float("down_proj_weight", wd, None)
    ck.check_float("gate_up_proj_weight", wgu, None)
    if weight_layout == "forward":
        E, I = wd.shape[0], wd.shape[2]  # noqa: E741 (spec notation I = I_TP)
        ck.check_shape("down_proj_weight", wd, (E, H, I))
        ck.check_shape("gate_up_proj_weight", wgu, (E, 2, I, H))
        wgu = wgu.permute(0, 3, 1, 2)  # [E, 2, I, H] -> [E, H, 2, I]
        wd = wd.transpose(1, 2)  # [E, H, I] -> [E, I, H]
    else:
        E, I = wd.shape[0], wd.shape[1]  # noqa: E741 (spec notation I = I_TP)
        ck.check_shape("down_proj_weight", wd, (E, I, H))
        ck.check_shape("gate_up_proj_weight", wgu, (E, H, 2, I))
    N = ck.check_block_plan(tpi, b2e, B)
    if N and (int(b2e.min()) < 0 or int(b2e.max()) >= E):
        raise BwdValidationError(
            f"block_to_expert: expected expert ids in [0, {E}), got [{int(b2e.min())}, {int(b2e.max())}]"
        )
    ck.check_shape("expert_affinities_masked", ea, (T * E, 1))
    ck.check_float("expert_affinities_masked", ea, None)
    bgu = ck.tensor("gate_up_proj_bias", gate_up_proj_bias, required=False)
    bd = ck.tensor("down_proj_bias", down_proj_bias, required=False)
    if bgu is not None:
        ck.check_shape("gate_up_proj_bias", bgu, (E, 2, I))
    if bd is not None:
        ck.check_shape("down_proj_bias", bd, (E, H))

    dev = x.device
    plan = ck.BlockPlan.make(tpi, b2e, T, B, dev)
    if num_valid_tokens is not None:
        nv = ck.valid_token_count(num_valid_tokens, T)
        keep = plan.valid & (plan.idx < nv)
        plan.idx = torch.where(keep, plan.idx, torch.full_like(plan.idx, T))
        plan.valid = keep
    g_h = Grouping.make(scheme, tile_k)  # contraction over H (gate/up projections)
    g_i = Grouping.make(scheme, tile_k)  # contraction over I (down projection)
    sd = nm.store_dtype
    x_ext = ck.with_zero_row(x, sd)  # [T+1, H]
    ea_ext = ck.with_zero_row(ea.reshape(T, E).to(device=dev), torch.float32)  # [T+1, E]

    ckpt_gu = torch.zeros(N, 2, I, B, dtype=sd, device=dev)
    ckpt_act = torch.zeros(N, I, B, dtype=sd, device=dev)
    ckpt_h = torch.zeros(N, I, B, dtype=sd, device=dev)
    ckpt_s = (
        torch.zeros(N, I, B, dtype=sd, device=dev) if aff is AffinityOption.AFFINITY_ON_I else None
    )
    y_pos = torch.zeros(N, B, H, dtype=sd, device=dev)  # per-position block outputs

    for e in range(E):
        chunks = plan.chunks(
            e, skip_empty=False
        )  # padding columns of the checkpoints are filled too
        if not chunks:
            continue
        w_cat = wgu[e].reshape(H, 2 * I)  # [H, 2I]: column c*I + i = (gate|up, i)
        wgu_q = nm.q(w_cat, 0, g_h)  # per output column along H
        wd_q = nm.q(wd[e], 0, g_i)  # [I, H] per output column along I
        b_gu = None if bgu is None else bgu[e].reshape(2 * I).to(device=dev, dtype=torch.float32)
        b_d = None if bd is None else bd[e].to(device=dev, dtype=torch.float32)
        for bl in chunks:
            nb = bl.numel()
            flat = plan.idx.index_select(0, bl).reshape(-1)  # [R]
            xg = x_ext.index_select(0, flat)  # [R, H]
            al = ea_ext[:, e].index_select(0, flat)[:, None]  # [R, 1] fp32
            g, u = project_gate_up(nm.q(xg, -1, g_h), wgu_q, b_gu, clamp_limits, nm)  # [R, I]
            act = silu(g)  # fp32, not rounded in the forward (§2.4)
            hm = nm.bf(act * u)
            if aff is AffinityOption.AFFINITY_ON_I:
                s = nm.bf(hm * al)
                y = nm.q(s, -1, g_i) @ wd_q
                if b_d is not None:
                    y += al * b_d
                assert ckpt_s is not None
                ckpt_s[bl] = s.view(nb, B, I).transpose(1, 2).to(sd)
            else:
                y = nm.q(hm, -1, g_i) @ wd_q
                if b_d is not None:
                    y += b_d
                y = y * al
            y_pos[bl] = nm.bf(y).view(nb, B, H).to(sd)
            ckpt_gu[bl, 0] = g.view(nb, B, I).transpose(1, 2).to(sd)
            ckpt_gu[bl, 1] = u.view(nb, B, I).transpose(1, 2).to(sd)
            ckpt_act[bl] = nm.bf(act).view(nb, B, I).transpose(1, 2).to(sd)
            ckpt_h[bl] = hm.view(nb, B, I).transpose(1, 2).to(sd)

    # Two cores, blocks b ≡ s (mod 2) each into its own bf16 slab, then one bf16 add (§2.4).
    slabs = []
    for s_ in range(2):
        sel = torch.zeros(N, B, dtype=torch.bool, device=dev)
        sel[s_::2] = True
        pos = (plan.valid & sel).reshape(-1).nonzero().squeeze(1)  # ascending = block order
        slab = torch.zeros(T, H, dtype=torch.float32, device=dev)
        ordered_scatter(
            slab,
            plan.idx.reshape(-1).index_select(0, pos),
            y_pos.view(N * B, H).index_select(0, pos).to(torch.float32),
            True,
            nm,
        )
        slabs.append(slab)
    out = nm.bf(slabs[0] + slabs[1])
    return ForwardResult(nm.out(out, x.dtype), ckpt_gu, ckpt_act, ckpt_h, ckpt_s)
