"""Contract of `blockwise_mm_bwd_mxfp8`: the public signature, validation once into a frozen
`BwdCall` (bwd spec §10 "Inputs", config/launch rules, §9), and dispatch to a backend.

The public function `blockwise_mm_bwd_mxfp8` is the only place holding the kernel's signature
(API reference G4). `validate` binds arguments to it and applies every rule the reference and
the NKI backends share, with the same messages; the backends take the `BwdCall` (the NKI
launcher then checks only what its kernel does not implement).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mxcli.kernels import backends
from mxcli.kernels.blockwise_moe import _checks as ck
from mxcli.kernels.blockwise_moe.config import (
    AffinityOption,
    BwdValidationError,
    MXFP8MOEBwdConfig,
    SwizzleMode,
)
from mxcli.kernels.blockwise_moe.numerics import Emulate, as_emulate
from mxcli.kernels.blockwise_moe.prequant import ScaleLayout, scale_row_index, scale_rows
from mxcli.kernels.spec import bind_arguments

__all__ = [
    "OUTPUT_NAMES",
    "BwdCall",
    "as_call",
    "blockwise_mm_bwd_mxfp8",
    "check_inputs",
    "check_launch_rules",
    "validate",
]

ACT_DTYPES = (torch.bfloat16, torch.float16)
DIM_MULTIPLE = 128  # bwd spec §10: H and I are multiples of 128 (the partition count)
# every return of the API, in order: four gradients, then the two bias grads with config.bias
OUTPUT_NAMES = (
    "hidden_states_grad",
    "expert_affinities_masked_grad",
    "gate_up_proj_weight_grad",
    "down_proj_weight_grad",
    "gate_and_up_proj_bias_grad",
    "down_proj_bias_grad",
)


def output_names(bias: bool) -> tuple[str, ...]:
    """The returns of a call, in API order: four gradients, and the bias grads with ``bias``."""
    return OUTPUT_NAMES if bias else OUTPUT_NAMES[:4]


_CHECKPOINTS = (
    "gate_up_proj_act_checkpoint_T",
    "gate_act_checkpoint_T",
    "intermediate_checkpoint_T",
    "scaled_intermediate_checkpoint_T",
    "down_proj_act_checkpoint",
)


@dataclass(frozen=True, eq=False)
class BwdCall:
    """One validated call of `blockwise_mm_bwd_mxfp8`: its tensors (as torch tensors), the
    validated config, the dimensions and the clamped token count (what every backend takes;
    built by `validate`, once per call)."""

    config: MXFP8MOEBwdConfig  # validated (phase configs filled)
    emulate: Emulate  # the reference's numerics; the NKI backends run KERNEL only
    hidden_states: torch.Tensor  # [T, H]
    output_hidden_states_grad: torch.Tensor  # [T, H]
    expert_affinities_masked: torch.Tensor  # [T*E, 1]
    gate_up_proj_weight: torch.Tensor  # [E, H, 2, I] or x4 [E, 2I/4, H]
    down_proj_weight: torch.Tensor  # [E, I, H] or x4 [E, H/4, I]
    token_position_to_id: torch.Tensor  # [N*B]
    block_to_expert: torch.Tensor  # [N, 1]
    gate_up_weight_scales: torch.Tensor | None
    down_weight_scales: torch.Tensor | None
    gate_up_proj_act_checkpoint_T: torch.Tensor | None  # [N, 2, I, B]
    gate_act_checkpoint_T: torch.Tensor | None  # [N, I, B]
    intermediate_checkpoint_T: torch.Tensor | None  # [N, I, B]
    scaled_intermediate_checkpoint_T: torch.Tensor | None  # [N, I, B]
    down_proj_act_checkpoint: torch.Tensor | None  # [N, B, H]
    num_valid_tokens: Any  # as given (an int or a tensor), None when absent
    nv: int | None  # num_valid_tokens clamped to [0, T]
    B: int
    T: int
    H: int
    E: int
    I: int  # noqa: E741 (spec notation I = I_TP)
    N: int
    gu_layout: ScaleLayout  # scale layout of a pre-quantized gate/up weight (phase 2)
    d_layout: ScaleLayout  # ... of a pre-quantized down weight (phase 1)

    @property
    def exact(self) -> bool:
        return self.emulate is Emulate.EXACT

    @property
    def output_names(self) -> tuple[str, ...]:
        """Names of this call's returns, in API order: four gradients, plus the bias grads with
        ``config.bias``."""
        return output_names(self.config.bias)


def validate(*args: Any, **kwargs: Any) -> BwdCall:
    """Bind the arguments of `blockwise_mm_bwd_mxfp8` (positional or by name, defaults from its
    signature; ``emulate`` included) and check them: the config, then the tensors and their
    dimensions (bwd spec §10 "Inputs"), the checkpoints and their combinations (errata 3) and
    the path rules (§10 config/launch, §9). Raises `BwdValidationError`."""
    a = bind_arguments(blockwise_mm_bwd_mxfp8, *args, **kwargs)
    cfg = a["config"] if a["config"] is not None else MXFP8MOEBwdConfig()
    if not isinstance(cfg, MXFP8MOEBwdConfig):
        raise BwdValidationError(f"config: expected MXFP8MOEBwdConfig, got {type(cfg).__name__}")
    cfg.validate()
    emulate = as_emulate(a["emulate"])
    act_dtypes = None if emulate is Emulate.EXACT else ACT_DTYPES
    inp = check_inputs(
        a["hidden_states"], a["expert_affinities_masked"], a["gate_up_proj_weight"],
        a["down_proj_weight"], a["token_position_to_id"], a["block_to_expert"],
        a["output_hidden_states_grad"], a["block_size"], a["gate_up_weight_scales"],
        a["down_weight_scales"], cfg, act_dtypes,
    )  # fmt: skip
    N, I, B, H = inp["N"], inp["I"], inp["B"], inp["H"]  # noqa: E741
    shapes = {
        "gate_up_proj_act_checkpoint_T": (N, 2, I, B),
        "gate_act_checkpoint_T": (N, I, B),
        "intermediate_checkpoint_T": (N, I, B),
        "scaled_intermediate_checkpoint_T": (N, I, B),
        "down_proj_act_checkpoint": (N, B, H),
    }
    ckpts = {name: ck.tensor(name, a[name], False) for name in _CHECKPOINTS}
    for name, t in ckpts.items():
        if t is not None:
            ck.check_shape(name, t, shapes[name])
            ck.check_float(name, t, act_dtypes)
    on_i = cfg.affinity_option is AffinityOption.AFFINITY_ON_I
    _check_combinations(
        cfg, on_i, ckpts["gate_up_proj_act_checkpoint_T"], ckpts["gate_act_checkpoint_T"],
        ckpts["intermediate_checkpoint_T"], ckpts["scaled_intermediate_checkpoint_T"],
        ckpts["down_proj_act_checkpoint"], inp["gate_up_weight_scales"],
    )  # fmt: skip
    ckpt_s = ckpts["scaled_intermediate_checkpoint_T"]
    nv = check_launch_rules(cfg, inp, a["num_valid_tokens"], ckpt_s is not None)
    return BwdCall(
        config=cfg, emulate=emulate, **inp,
        gate_up_proj_act_checkpoint_T=ckpts["gate_up_proj_act_checkpoint_T"],
        gate_act_checkpoint_T=ckpts["gate_act_checkpoint_T"],
        intermediate_checkpoint_T=ckpts["intermediate_checkpoint_T"],
        scaled_intermediate_checkpoint_T=ckpt_s,
        down_proj_act_checkpoint=ckpts["down_proj_act_checkpoint"],
        num_valid_tokens=a["num_valid_tokens"], nv=nv,
    )  # fmt: skip


def as_call(*args: Any, **kwargs: Any) -> BwdCall:
    """A `BwdCall` given as the only argument, else `validate` of the arguments."""
    if len(args) == 1 and not kwargs and isinstance(args[0], BwdCall):
        return args[0]
    return validate(*args, **kwargs)


def check_inputs(
    hidden_states: Any,
    expert_affinities_masked: Any,
    gate_up_proj_weight: Any,
    down_proj_weight: Any,
    token_position_to_id: Any,
    block_to_expert: Any,
    output_hidden_states_grad: Any,
    block_size: Any,
    gate_up_weight_scales: Any,
    down_weight_scales: Any,
    cfg: MXFP8MOEBwdConfig,
    act_dtypes: tuple[torch.dtype, ...] | None,
) -> dict[str, Any]:
    """The required tensors, weights and scales against bwd spec §10 "Inputs" (checkpoints
    excepted); `act_dtypes`: the allowed activation dtypes (None: any floating dtype).

    Returns the `BwdCall` fields they give: the tensors (by their argument names), the dims and
    the scale layouts."""
    B = ck.check_block_size(block_size)
    x = ck.tensor("hidden_states", hidden_states)
    dy = ck.tensor("output_hidden_states_grad", output_hidden_states_grad)
    ea = ck.tensor("expert_affinities_masked", expert_affinities_masked)
    wgu = ck.tensor("gate_up_proj_weight", gate_up_proj_weight)
    wd = ck.tensor("down_proj_weight", down_proj_weight)
    tpi = ck.tensor("token_position_to_id", token_position_to_id)
    b2e = ck.tensor("block_to_expert", block_to_expert)
    assert x is not None and dy is not None and ea is not None and wgu is not None
    assert wd is not None and tpi is not None and b2e is not None
    ck.check_rank("hidden_states", x, 2, "(T, H)")
    ck.check_float("hidden_states", x, act_dtypes)
    T, H = x.shape
    ck.check_shape("output_hidden_states_grad", dy, (T, H))
    ck.check_float("output_hidden_states_grad", dy, act_dtypes)

    gu_s = ck.tensor("gate_up_weight_scales", gate_up_weight_scales, required=False)
    d_s = ck.tensor("down_weight_scales", down_weight_scales, required=False)
    ck.check_rank("down_proj_weight", wd, 3, "(E, I, H) or pre-quantized (E, H/4, I)")
    E = wd.shape[0]
    if d_s is None:
        ck.check_float("down_proj_weight", wd, None)
        I = wd.shape[1]  # noqa: E741 (spec notation I = I_TP)
        ck.check_shape("down_proj_weight", wd, (E, I, H))
    else:
        I = wd.shape[2]  # noqa: E741 (spec notation I = I_TP)
        _check_prequant("down_proj_weight", wd, (E, H // 4, I))
    if H % DIM_MULTIPLE or H == 0:
        raise BwdValidationError(f"hidden_states: expected H a positive multiple of 128, got {H}")
    if I % DIM_MULTIPLE or I == 0:
        raise BwdValidationError(
            f"down_proj_weight: expected I a positive multiple of 128, got {I}"
        )
    p1, p2 = cfg.phase1_config, cfg.phase2_config
    assert p1 is not None and p2 is not None
    d_layout = ScaleLayout.PACKED if p1.enable_scale_packing else ScaleLayout.UNPACKED
    gu_layout = ScaleLayout.PACKED if p2.enable_scale_packing else ScaleLayout.UNPACKED
    if d_s is not None:
        _check_scales("down_weight_scales", d_s, (E, scale_rows(H, d_layout), I))
        ck.check_e8m0_scales("down_weight_scales", d_s, scale_row_index(H, d_layout))
    if gu_s is None:
        ck.check_float("gate_up_proj_weight", wgu, None)
        ck.check_shape("gate_up_proj_weight", wgu, (E, H, 2, I))
    else:
        _check_prequant("gate_up_proj_weight", wgu, (E, 2 * I // 4, H))
        _check_scales("gate_up_weight_scales", gu_s, (E, scale_rows(2 * I, gu_layout), H))
        ck.check_e8m0_scales("gate_up_weight_scales", gu_s, scale_row_index(2 * I, gu_layout))

    N = ck.check_block_plan(tpi, b2e, B)
    ck.check_shape("expert_affinities_masked", ea, (T * E, 1))
    ck.check_float("expert_affinities_masked", ea, None)
    return dict(
        hidden_states=x, output_hidden_states_grad=dy, expert_affinities_masked=ea,
        gate_up_proj_weight=wgu, down_proj_weight=wd, token_position_to_id=tpi,
        block_to_expert=b2e, gate_up_weight_scales=gu_s, down_weight_scales=d_s, B=B, T=T, H=H, E=E, I=I, N=N, gu_layout=gu_layout, d_layout=d_layout,
    )  # fmt: skip


def check_launch_rules(
    cfg: MXFP8MOEBwdConfig,
    inp: dict[str, Any],
    num_valid_tokens: Any,
    has_scaled_intermediate_checkpoint: bool,
) -> int | None:
    """The path rules of bwd spec §10 (config/launch) and §9, including the data-dependent
    ones (expert ids in range, padding ids need ``skip_token``). Returns ``num_valid_tokens``
    clamped to ``[0, T]`` (None when not given)."""
    E, T, B, N = inp["E"], inp["T"], inp["B"], inp["N"]
    if E > 1:
        for f in ("down_weight_swizzle_mode", "gate_up_weight_swizzle_mode"):
            if getattr(cfg, f) is SwizzleMode.PE:
                raise BwdValidationError(f"{f}: PE requires E == 1, got E={E}; use SwizzleMode.DGT")
    nv: int | None = None
    if num_valid_tokens is not None:
        if not cfg.single_expert_dense:
            raise BwdValidationError(
                "num_valid_tokens: requires config.single_expert_dense=True, got False"
            )
        if has_scaled_intermediate_checkpoint:
            raise BwdValidationError(
                "num_valid_tokens: unsupported with scaled_intermediate_checkpoint_T, got both"
            )
        nv = ck.valid_token_count(num_valid_tokens, T)
    if cfg.single_expert_dense:
        if E != 1:
            raise BwdValidationError(
                f"down_proj_weight: single_expert_dense requires E == 1, got E={E}"
            )
        if T % B:
            raise BwdValidationError(
                f"hidden_states: single_expert_dense requires T % block_size == 0, got T={T}, B={B}"
            )
        if N != T // B:
            raise BwdValidationError(
                f"token_position_to_id: single_expert_dense requires N == T/B = {T // B} blocks, got {N}"
            )
        return nv
    b2e, tpi = inp["block_to_expert"], inp["token_position_to_id"]
    if N and (int(b2e.min()) < 0 or int(b2e.max()) >= E):
        raise BwdValidationError(
            f"block_to_expert: expected expert ids in [0, {E}), got "
            f"[{int(b2e.min())}, {int(b2e.max())}]"
        )
    has_pad = bool(((tpi < 0) | (tpi >= T)).any())
    if has_pad and not cfg.effective_skip_dma.skip_token:
        raise BwdValidationError(
            "token_position_to_id: padding ids outside [0, T) need "
            "config.skip_dma=SkipMode(skip_token=True), got skip_token=False"
        )
    return nv


def _check_prequant(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if t.dtype not in (torch.uint32, torch.int32):
        raise BwdValidationError(
            f"{name}: pre-quantized (scales given) data must be x4 uint32/int32 words, got {t.dtype}"
        )
    ck.check_shape(name, t, shape)


def _check_scales(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if t.dtype not in (torch.uint8, torch.float8_e8m0fnu):
        raise BwdValidationError(f"{name}: expected dtype uint8 (E8M0 bytes), got {t.dtype}")
    ck.check_shape(name, t, shape)


def _check_combinations(
    cfg: MXFP8MOEBwdConfig,
    on_i: bool,
    ckpt_gu: torch.Tensor | None,
    ckpt_act: torch.Tensor | None,
    ckpt_h: torch.Tensor | None,
    ckpt_s: torch.Tensor | None,
    ckpt_dys: torch.Tensor | None,
    gu_scales: torch.Tensor | None,
) -> None:
    """Checkpoint combinations of the API reference (errata 3)."""
    if ckpt_gu is None:
        if ckpt_act is None and ckpt_h is None:  # name the checkpoint the I/O contract documents
            raise BwdValidationError(
                "gate_up_proj_act_checkpoint_T: required (or both gate_act_checkpoint_T and "
                "intermediate_checkpoint_T), got None"
            )
        for name, t in (("gate_act_checkpoint_T", ckpt_act), ("intermediate_checkpoint_T", ckpt_h)):
            if t is None:
                raise BwdValidationError(
                    f"{name}: required when gate_up_proj_act_checkpoint_T is None, got None"
                )
        if gu_scales is not None:
            raise BwdValidationError(
                "gate_up_proj_act_checkpoint_T: required with a pre-quantized gate/up weight "
                "(G/U cannot be recomputed from weights quantized along 2I), got None"
            )
        if cfg.bias:
            raise BwdValidationError(
                "gate_up_proj_act_checkpoint_T: required when config.bias=True (the backward has "
                "no bias values to recompute G/U), got None"
            )
    if on_i and ckpt_dys is not None:
        raise BwdValidationError(
            "down_proj_act_checkpoint: must be None under AFFINITY_ON_I, got a tensor"
        )
    if not on_i and ckpt_s is not None:
        raise BwdValidationError(
            "scaled_intermediate_checkpoint_T: must be None under AFFINITY_ON_H, got a tensor"
        )


def blockwise_mm_bwd_mxfp8(
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
    *,
    backend: str = "reference",
    emulate: Emulate | str = Emulate.KERNEL,
    kernel: Any = None,
) -> tuple[torch.Tensor, ...]:
    """MXFP8 backward pass of a blockwise, dropless Mixture-of-Experts MLP (SwiGLU experts).

    ``kernel`` picks the NKI kernel the ``sim`` / ``neuron`` backends run: ``"mxcli"``
    (default), ``"nkilib"`` (AWS's NKI Library) or ``"MODULE:FUNCTION"``
    (`mxcli.kernels.selection`).

    Arguments follow the device kernel's API (bwd spec §1 notation; E from
    ``down_proj_weight.shape[0]``, I from the weights, ``N = len(token_position_to_id) // B``):

    Args:
        hidden_states: ``[T, H]`` bf16 or fp16 (fp16 is used as its bf16 rounding, §14.5).
        expert_affinities_masked: ``[T*E, 1]``, entry ``t*E + e`` (0 = not routed); read as fp32.
        gate_up_proj_weight: ``[E, H, 2, I]`` (gate ``[:, :, 0]``, up ``[:, :, 1]``), or
            pre-quantized x4 ``[E, 2I/4, H]`` (uint32/int32) when `gate_up_weight_scales` is given.
        down_proj_weight: ``[E, I, H]``, or pre-quantized x4 ``[E, H/4, I]`` with `down_weight_scales`.
        token_position_to_id: ``[N*B]`` int; ids outside ``[0, T)`` are padding (needs
            ``config.skip_dma.skip_token``). Not read with ``single_expert_dense``.
        block_to_expert: ``[N, 1]`` int. Not read with ``single_expert_dense``.
        output_hidden_states_grad: ``[T, H]`` bf16 or fp16.
        block_size: B, one of 128 … 4096.
        gate_up_proj_act_checkpoint_T: ``[N, 2, I, B]`` clamped bf16 gate/up pre-activations. If
            None, `gate_act_checkpoint_T` and `intermediate_checkpoint_T` are required (API
            reference) and G/U — still needed for φ'(G)·U and the clamp masks — are recomputed
            from `hidden_states` with the forward's quantized projection (§2.4: config
            ``quant_scheme``, phase-1 ``tile_k``, ``config.clamp_limits``; no fast-DMA chunking).
            Not possible with a pre-quantized gate/up weight or ``config.bias`` (rejected).
        gate_act_checkpoint_T: ``[N, I, B]`` φ(G); None -> ``bf16(silu(G))``.
        intermediate_checkpoint_T: ``[N, I, B]`` Hm; None -> ``bf16(act·U)``.
        scaled_intermediate_checkpoint_T: ``[N, I, B]`` S (ON_I only): phase 4's operand as given;
            None -> ``bf16(Hm·α)``.
        down_proj_act_checkpoint: ``[N, B, H]`` output_grad·α (ON_H only, API reference): phase
            1's left operand; None -> ``bf16(dY·α)``. Its padding rows are treated as zero.
        config: `MXFP8MOEBwdConfig`; None = the default (single-expert dense, E = 1). Routed
            inputs need e.g. ``MXFP8MOEBwdConfig.routed(top_k)``.
        gate_up_weight_scales, down_weight_scales: E8M0 scales of pre-quantized weights, in the
            layout ``phase2_config`` / ``phase1_config.enable_scale_packing`` selects (§5.5; see
            `prequantize_weights`). Results are bit-identical to on-the-fly quantization.
        num_valid_tokens: ``[1]`` int32: the leading rows of `hidden_states` that are real.
            Only with ``single_expert_dense``; rejected with `scaled_intermediate_checkpoint_T` or
            ``config.bias``. Clamped to ``[0, T]`` (negative -> 0). Choices where the API is
            silent: blocks ``b < ceil(count / B)`` are processed and, inside the last partial
            block, rows ``>= count`` are masked as padding, so they add nothing to the weight
            grads (the result equals a full run with those rows zeroed); count = 0 gives zero
            weight grads. Rows of ``hidden_states_grad`` and entries of the affinity grad past the
            count are UNDEFINED on the device; the reference writes zeros there.
        backend: ``"reference"`` (this CPU/CUDA torch emulation), or another registered backend
            (``"auto"``: neuron when available, else reference).
        emulate: reference only. ``"kernel"`` (MXFP8 + bf16 rounding points of §6) or
            ``"exact"`` (fp32, no quantization or rounding; outputs fp32).

    Returns:
        ``(hidden_states_grad [T, H], expert_affinities_masked_grad [T*E, 1],
        gate_up_proj_weight_grad [E, H, 2, I], down_proj_weight_grad [E, I, H])`` and, when
        ``config.bias``, ``(gate_and_up_proj_bias_grad [E, 2, I], down_proj_bias_grad [E, H])``.
        Dtypes: hidden grad as `hidden_states`, affinity grad as the affinities (both
        bf16-rounded), weight and bias grads bf16; all fp32 with ``emulate="exact"``.

    Numerics (bwd spec §4.2, §6), per block in order, ``mx`` = MXFP8 matmul, fp32 accumulate:
    ``D = mx(dY, W_d)`` (groups along H); ``act = bf16(φ(G))``, ``Hm = bf16(act·U)``,
    ``dA = Σ_i D·Hm`` (no bias term, §2.3) -> ``bf16``; ``Ds = D·α``;
    ``dG = bf16(Ds·bf16(φ'(G)·U))·mask_nl``, ``dU = bf16(Ds·act)·mask_l``;
    P2 ``bf16(mx([dG|dU], W_gu))`` (groups along 2I) written or read-add-written
    (``accumulate_hidden_states_grad``; otherwise the last write wins for top-k > 1);
    P3/P4 ``bf16(mx(·, ·))`` with groups along the block's tokens, accumulated across the
    expert's blocks as ``bf16(acc + C)``; bias grads as in §6. Masks use strict inequalities on
    the checkpoint values.

    AFFINITY_ON_H (API reference; the device kernel of the spec asserts ON_I): phase 1 reads
    ``dYs = bf16(dY·α)`` (or `down_proj_act_checkpoint`), ``Ds = mx(dYs, W_d)``, phase 4 reads
    ``Hm`` and ``dYs``; the affinity grad still uses the un-scaled ``mx(dY, W_d)`` (one extra
    matmul in the reference) [U]. Bias grads use the same formulas under both options.

    Further documented choices: the affinity grad of every non-routed pair is 0, also for odd
    E > 1 (errata 6: the device leaves part of it un-zeroed); signed zeros and the device's
    fp32 summation order are not modelled; a (token, expert) pair listed twice is outside the
    contract (which write wins is unspecified); ``skip_grad_initialization`` has no effect
    (fresh zero outputs); LNC2-only launch checks do not apply to the reference; with
    ``emulate="exact"`` pre-quantized weights enter with their dequantized values.
    """
    arguments = dict(locals())  # the parameters as given: this signature is the only one
    backend = arguments.pop("backend")
    arguments.pop("kernel")
    resolved = backends.resolve(blockwise_mm_bwd_mxfp8.__name__, backend, kernel)
    name = resolved.backend
    if name != "reference" and as_emulate(emulate) is not Emulate.KERNEL:
        raise BwdValidationError(f"emulate: only 'kernel' is meaningful for backend {name!r}")
    return resolved.run(validate(**arguments))  # type: ignore[no-any-return]
