"""The ``sim`` and ``neuron`` backends of ``blockwise_mm_bwd_mxfp8``: the NKI kernel
(`nki_kernel.blockwise_mm_bwd_mxfp8_nki`) launched through `mxcli.kernels.nki_runtime`.

`run_sim` and `run_neuron` take the reference's arguments (same order, same defaults, minus the
reference-only ``emulate``) and return the reference's tuple of torch tensors on the device of
``hidden_states``. Inputs are validated on the host first, with the reference's rules and error
messages (bwd spec §10), including the data-dependent ones the device can only report as a DMA
fault (padding ids without ``skip_token``, expert ids out of range).

Tensors cross as NKI-compatible dtypes: token ids and expert ids as int32, ``num_valid_tokens``
as a ``[1]`` int32 tensor, pre-quantized weights as uint32 x4 words and uint8 scale bytes
(nki_execution.md §7.2).
"""

from __future__ import annotations

from typing import Any

import torch

from mxcli.kernels import nki_runtime
from mxcli.kernels.blockwise_moe import _checks as ck
from mxcli.kernels.blockwise_moe.config import BwdValidationError, MXFP8MOEBwdConfig, SwizzleMode
from mxcli.kernels.blockwise_moe.prequant import ScaleLayout, scale_rows
from mxcli.kernels.nki_runtime import SimEngine, SimResult

__all__ = ["KERNEL", "launch_sim", "prepare", "run_neuron", "run_sim"]

KERNEL = "mxcli.kernels.blockwise_moe.nki_kernel:blockwise_mm_bwd_mxfp8_jit"
_ACT_DTYPES = (torch.bfloat16, torch.float16)
_NAMES = (
    "hidden_states",
    "expert_affinities_masked",
    "gate_up_proj_weight",
    "down_proj_weight",
    "token_position_to_id",
    "block_to_expert",
    "output_hidden_states_grad",
    "block_size",
    "gate_up_proj_act_checkpoint_T",
    "gate_act_checkpoint_T",
    "intermediate_checkpoint_T",
    "scaled_intermediate_checkpoint_T",
    "down_proj_act_checkpoint",
    "config",
    "gate_up_weight_scales",
    "down_weight_scales",
    "num_valid_tokens",
)


def _validate(kw: dict[str, Any], cfg: MXFP8MOEBwdConfig) -> None:
    """The reference's input rules (bwd spec §10) on the host, before any launch."""
    B = ck.check_block_size(kw["block_size"])
    x = ck.tensor("hidden_states", kw["hidden_states"])
    dy = ck.tensor("output_hidden_states_grad", kw["output_hidden_states_grad"])
    ea = ck.tensor("expert_affinities_masked", kw["expert_affinities_masked"])
    wgu = ck.tensor("gate_up_proj_weight", kw["gate_up_proj_weight"])
    wd = ck.tensor("down_proj_weight", kw["down_proj_weight"])
    tpi = ck.tensor("token_position_to_id", kw["token_position_to_id"])
    b2e = ck.tensor("block_to_expert", kw["block_to_expert"])
    assert x is not None and dy is not None and ea is not None and wgu is not None
    assert wd is not None and tpi is not None and b2e is not None
    ck.check_rank("hidden_states", x, 2, "(T, H)")
    ck.check_float("hidden_states", x, _ACT_DTYPES)
    T, H = x.shape
    ck.check_shape("output_hidden_states_grad", dy, (T, H))
    ck.check_float("output_hidden_states_grad", dy, _ACT_DTYPES)
    gu_s = ck.tensor("gate_up_weight_scales", kw["gate_up_weight_scales"], required=False)
    d_s = ck.tensor("down_weight_scales", kw["down_weight_scales"], required=False)
    ck.check_rank("down_proj_weight", wd, 3, "(E, I, H) or pre-quantized (E, H/4, I)")
    E = wd.shape[0]
    p1, p2 = cfg.phase1_config, cfg.phase2_config
    assert p1 is not None and p2 is not None
    if d_s is None:
        ck.check_float("down_proj_weight", wd, None)
        I = wd.shape[1]  # noqa: E741
        ck.check_shape("down_proj_weight", wd, (E, I, H))
    else:
        I = wd.shape[2]  # noqa: E741
        _check_x4("down_proj_weight", wd, (E, H // 4, I))
    if H % 128 or H == 0:
        raise BwdValidationError(f"hidden_states: expected H a positive multiple of 128, got {H}")
    if I % 128 or I == 0:
        raise BwdValidationError(
            f"down_proj_weight: expected I a positive multiple of 128, got {I}"
        )
    if d_s is not None:
        lay = ScaleLayout.PACKED if p1.enable_scale_packing else ScaleLayout.UNPACKED
        _check_scales("down_weight_scales", d_s, (E, scale_rows(H, lay), I))
    if gu_s is None:
        ck.check_float("gate_up_proj_weight", wgu, None)
        ck.check_shape("gate_up_proj_weight", wgu, (E, H, 2, I))
    else:
        _check_x4("gate_up_proj_weight", wgu, (E, 2 * I // 4, H))
        lay = ScaleLayout.PACKED if p2.enable_scale_packing else ScaleLayout.UNPACKED
        _check_scales("gate_up_weight_scales", gu_s, (E, scale_rows(2 * I, lay), H))
    ck.check_rank("token_position_to_id", tpi, 1, "(N*B,)")
    ck.check_int("token_position_to_id", tpi)
    if tpi.numel() % B:
        raise BwdValidationError(
            f"token_position_to_id: expected a length that is a multiple of block_size={B}, "
            f"got {tpi.numel()}"
        )
    N = tpi.numel() // B
    ck.check_shape("block_to_expert", b2e, (N, 1))
    ck.check_int("block_to_expert", b2e)
    ck.check_shape("expert_affinities_masked", ea, (T * E, 1))
    ck.check_float("expert_affinities_masked", ea, None)
    ckpt = ck.tensor("gate_up_proj_act_checkpoint_T", kw["gate_up_proj_act_checkpoint_T"], False)
    if ckpt is not None:
        ck.check_shape("gate_up_proj_act_checkpoint_T", ckpt, (N, 2, I, B))
        ck.check_float("gate_up_proj_act_checkpoint_T", ckpt, _ACT_DTYPES)
    if E > 1:
        for f in ("down_weight_swizzle_mode", "gate_up_weight_swizzle_mode"):
            if getattr(cfg, f) is SwizzleMode.PE:
                raise BwdValidationError(f"{f}: PE requires E == 1, got E={E}; use SwizzleMode.DGT")
    if kw["num_valid_tokens"] is not None:
        if not cfg.single_expert_dense:
            raise BwdValidationError(
                "num_valid_tokens: requires config.single_expert_dense=True, got False"
            )
        if kw["scaled_intermediate_checkpoint_T"] is not None:
            raise BwdValidationError(
                "num_valid_tokens: unsupported with scaled_intermediate_checkpoint_T, got both"
            )
        ck.valid_token_count(kw["num_valid_tokens"], T)
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
        return
    if N and (int(b2e.min()) < 0 or int(b2e.max()) >= E):
        raise BwdValidationError(
            f"block_to_expert: expected expert ids in [0, {E}), got [{int(b2e.min())}, {int(b2e.max())}]"
        )
    if bool(((tpi < 0) | (tpi >= T)).any()) and not cfg.effective_skip_dma.skip_token:
        raise BwdValidationError(
            "token_position_to_id: padding ids outside [0, T) need "
            "config.skip_dma=SkipMode(skip_token=True), got skip_token=False"
        )


def _check_x4(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if t.dtype not in (torch.uint32, torch.int32):
        raise BwdValidationError(
            f"{name}: pre-quantized (scales given) data must be x4 uint32/int32 words, got {t.dtype}"
        )
    ck.check_shape(name, t, shape)


def _check_scales(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if t.dtype not in (torch.uint8, torch.float8_e8m0fnu):
        raise BwdValidationError(f"{name}: expected dtype uint8 (E8M0 bytes), got {t.dtype}")
    ck.check_shape(name, t, shape)


def prepare(*args: Any, **kwargs: Any) -> tuple[dict[str, Any], torch.device]:
    """Validate the reference-style arguments and convert them for the kernel.

    Returns ``(kernel kwargs, device of hidden_states)``.
    """
    if len(args) > len(_NAMES):
        raise TypeError(
            f"blockwise_mm_bwd_mxfp8: takes {len(_NAMES)} positional arguments, got {len(args)}"
        )
    kw = dict(zip(_NAMES, args, strict=False))
    for k, v in kwargs.items():
        if k not in _NAMES:
            raise TypeError(f"blockwise_mm_bwd_mxfp8: unexpected keyword argument {k!r}")
        if k in kw:
            raise TypeError(f"blockwise_mm_bwd_mxfp8: got multiple values for argument {k!r}")
        kw[k] = v
    defaults = {"block_size": 4096}
    for k in _NAMES:
        kw.setdefault(k, defaults.get(k))
    for k in _NAMES[:7]:
        if k not in kw or kw[k] is None:
            raise BwdValidationError(f"{k}: expected a tensor, got None")
    cfg = kw["config"] if kw["config"] is not None else MXFP8MOEBwdConfig()
    if not isinstance(cfg, MXFP8MOEBwdConfig):
        raise BwdValidationError(f"config: expected MXFP8MOEBwdConfig, got {type(cfg).__name__}")
    cfg.validate()
    kw["config"] = cfg
    _validate(kw, cfg)
    device = ck.tensor("hidden_states", kw["hidden_states"]).device  # type: ignore[union-attr]
    out: dict[str, Any] = {}
    for k in _NAMES:
        v = kw[k]
        if k in ("config", "block_size") or v is None:
            out[k] = v
            continue
        if k == "num_valid_tokens" and isinstance(v, int) and not isinstance(v, bool):
            out[k] = torch.tensor([min(max(v, -(2**31)), 2**31 - 1)], dtype=torch.int32)
            continue
        t = ck.tensor(k, v)
        assert t is not None
        if k in ("token_position_to_id", "block_to_expert"):
            t = t.to(torch.int32)
        elif k == "num_valid_tokens":
            # [1] int32, clamped to [0, T] on the device (API reference)
            t = t.reshape(-1)[:1].to(torch.int64).clamp(-(2**31), 2**31 - 1).to(torch.int32)
        elif k.endswith("_scales") and t.dtype == torch.float8_e8m0fnu:
            t = t.view(torch.uint8)
        out[k] = t.contiguous()
    return out, device


def launch_sim(
    *args: Any,
    lnc: int = 2,
    check_only: bool = False,
    engine: SimEngine | str = SimEngine.AUTO,
    check_capacity: bool = True,
    **kwargs: Any,
) -> SimResult:
    """Run the NKI kernel on a simulator; the full `SimResult` (outputs in the reference's form,
    the interpreter's counters, the engine that ran).

    Positional / keyword arguments: those of `blockwise_mm_bwd_mxfp8`. `lnc`: 1 or 2 programs
    (2, the API's launch, splits the free dims, SHARD_ON_FREE). `check_only` (interpreter only):
    every hardware rule and the SBUF/PSUM capacity are checked, arithmetic is skipped (outputs
    are then meaningless).
    """
    kw, device = prepare(*args, **kwargs)
    res = nki_runtime.run_sim(
        KERNEL, (), kw, lnc=lnc, check_only=check_only, engine=engine, check_capacity=check_capacity
    )
    res.outputs = [t.to(device) for t in res.outputs]
    return res


def run_sim(
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
    lnc: int = 2,
    engine: SimEngine | str = SimEngine.AUTO,
) -> tuple[torch.Tensor, ...]:
    """The ``sim`` backend: the NKI kernel on ``nki.simulate`` or mxcli's interpreter.

    Same arguments and outputs as `blockwise_mm_bwd_mxfp8_reference` (without ``emulate``);
    `lnc` 2 (default, the API's launch) or 1; `engine` forces a simulator (`SimEngine`).
    """
    res = launch_sim(
        hidden_states, expert_affinities_masked, gate_up_proj_weight, down_proj_weight,
        token_position_to_id, block_to_expert, output_hidden_states_grad, block_size,
        gate_up_proj_act_checkpoint_T, gate_act_checkpoint_T, intermediate_checkpoint_T,
        scaled_intermediate_checkpoint_T, down_proj_act_checkpoint, config,
        gate_up_weight_scales, down_weight_scales, num_valid_tokens,
        lnc=lnc, engine=engine,
    )  # fmt: skip
    return tuple(res.outputs)


def run_neuron(
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
    lnc: int | None = None,
) -> tuple[torch.Tensor, ...]:
    """The ``neuron`` backend: the NKI kernel on a Trainium (Trn3) device through torch-neuronx.

    Same arguments and outputs as the reference. `lnc`: the launch's LNC degree (default
    ``NEURON_LOGICAL_NC_CONFIG``, else 2). Raises `BackendUnavailableError` listing what is
    missing (SDK packages, device) before touching any of it.
    """
    reason = nki_runtime.neuron_unavailable_reason()
    if reason is not None:
        from mxcli.kernels.backends import BackendUnavailableError

        raise BackendUnavailableError(
            f"backend: 'neuron' cannot run blockwise_mm_bwd_mxfp8 here: {reason}"
        )
    kw, device = prepare(
        hidden_states, expert_affinities_masked, gate_up_proj_weight, down_proj_weight,
        token_position_to_id, block_to_expert, output_hidden_states_grad, block_size,
        gate_up_proj_act_checkpoint_T, gate_act_checkpoint_T, intermediate_checkpoint_T,
        scaled_intermediate_checkpoint_T, down_proj_act_checkpoint, config,
        gate_up_weight_scales, down_weight_scales, num_valid_tokens,
    )  # fmt: skip
    outs = nki_runtime.run_neuron(KERNEL, (), kw, lnc=lnc)
    return tuple(t.to(device) for t in outs)
