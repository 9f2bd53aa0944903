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
from mxcli.kernels.blockwise_moe.backward import check_inputs, check_launch_rules
from mxcli.kernels.blockwise_moe.config import BwdValidationError, MXFP8MOEBwdConfig
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


def _validate(kw: dict[str, Any], cfg: MXFP8MOEBwdConfig) -> torch.device:
    """The reference's input rules (bwd spec §10) on the host, before any launch; the device
    of ``hidden_states``."""
    inp = check_inputs(
        kw["hidden_states"], kw["expert_affinities_masked"], kw["gate_up_proj_weight"],
        kw["down_proj_weight"], kw["token_position_to_id"], kw["block_to_expert"],
        kw["output_hidden_states_grad"], kw["block_size"], kw["gate_up_weight_scales"],
        kw["down_weight_scales"], cfg, _ACT_DTYPES,
    )  # fmt: skip
    name = "gate_up_proj_act_checkpoint_T"
    ckpt = ck.tensor(name, kw[name], False)
    if ckpt is not None:
        ck.check_shape(name, ckpt, (inp.N, 2, inp.I, inp.B))
        ck.check_float(name, ckpt, _ACT_DTYPES)
    check_launch_rules(
        cfg, inp, kw["num_valid_tokens"], kw["scaled_intermediate_checkpoint_T"] is not None
    )
    return inp.x.device


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
    device = _validate(kw, cfg)
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
    nki_runtime.require_neuron("blockwise_mm_bwd_mxfp8")  # before validating anything
    kw, device = prepare(
        hidden_states, expert_affinities_masked, gate_up_proj_weight, down_proj_weight,
        token_position_to_id, block_to_expert, output_hidden_states_grad, block_size,
        gate_up_proj_act_checkpoint_T, gate_act_checkpoint_T, intermediate_checkpoint_T,
        scaled_intermediate_checkpoint_T, down_proj_act_checkpoint, config,
        gate_up_weight_scales, down_weight_scales, num_valid_tokens,
    )  # fmt: skip
    outs = nki_runtime.run_neuron(KERNEL, (), kw, lnc=lnc)
    return tuple(t.to(device) for t in outs)
