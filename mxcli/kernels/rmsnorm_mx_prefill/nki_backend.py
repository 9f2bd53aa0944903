"""The ``sim`` and ``neuron`` backends of ``rmsnorm_mx_prefill``: the NKI kernel (`nki_kernel`)
launched through `mxcli.kernels.nki_runtime`.

Both take the reference's parameters (same order, same defaults) and return the reference's
list of torch tensors (prefill spec §2.2): the packed rows as ``torch.float8_e4m3fn`` (the kernel
writes raw bytes), then index / affinities / residual / norm as the reference does, on the device
of ``hidden_states``. Arguments are validated with the contract (`contract.validate`) and the
launch is planned (`kernel_config`) here, on the host, once and before the kernel is traced: the
kernel receives tensors and a `PrefillKernelConfig` NKIObject, as NKI 0.6 requires (issue 11).
"""

from __future__ import annotations

from typing import Any

import torch

from mxcli.kernels import nki_runtime, selection
from mxcli.kernels.nki_runtime import DTypeName, KernelObject, SimEngine, SimResult
from mxcli.kernels.rmsnorm_mx_prefill.contract import PrefillConfig, RouterActFnType, validate
from mxcli.kernels.rmsnorm_mx_prefill.kernel_types import RouterMode

KERNEL_MODULE = "mxcli.kernels.rmsnorm_mx_prefill.nki_kernel"
KERNEL = f"{KERNEL_MODULE}:rmsnorm_mx_prefill_kernel"
KERNEL_CONFIG = f"{KERNEL_MODULE}:PrefillKernelConfig"


def _nki_dtype(dt: torch.dtype) -> DTypeName:
    """The ``nl`` dtype named like the 16-bit torch dtype (``torch.bfloat16`` -> bfloat16)."""
    return DTypeName(str(dt).removeprefix("torch."))


def kernel_config(cfg: PrefillConfig) -> KernelObject:
    """The kernel's launch plan (`nki_kernel.PrefillKernelConfig`) from a validated
    configuration: shapes, row geometry (prefill spec §2.4), router mode and ``nki`` dtypes."""
    geo = cfg.geometry
    fields: dict[str, object] = dict(
        T=cfg.T,
        H=cfg.H,
        NB=geo.num_h512,
        N=cfg.unpadded_hidden_size,
        eps=cfg.eps,
        E=cfg.num_experts,
        K=cfg.top_k,
        router_mode=RouterMode[cfg.act.name],
        n_group=cfg.n_group,
        topk_group=cfg.topk_group,
        routed_scaling_factor=cfg.routed_scaling_factor,
        compute_dtype=_nki_dtype(cfg.compute_dtype),
        qmx_dtype=DTypeName(cfg.qmx.value),  # nl.float8_e4m3fn_x4 / nl.float8_e5m2_x4
        pack_scales=cfg.pack_scales,
        n_packs=geo.scale_region // 128,
        pack_affinities=cfg.pack_affinities,
        aff_width=4 if cfg.act is RouterActFnType.NOAUX_TC else 2,
        affin_off=geo.affin_off,
        row=geo.row_region,
        emit_norm_bf16=cfg.emit_norm_bf16,
        hidden_interleaved=cfg.hidden_interleaved,
    )
    return KernelObject(KERNEL_CONFIG, tuple(fields.items()))


def _prepare(
    hidden_states: torch.Tensor,
    gamma: torch.Tensor,
    router_weights: torch.Tensor | None,
    router_bias: torch.Tensor | None,
    eps: float,
    top_k: int,
    router_act_fn: Any,
    n_group: int,
    topk_group: int,
    routed_scaling_factor: float,
    qmx_output_dtype: Any,
    pack_scales: bool,
    pack_affinities: bool,
    unpadded_hidden_size: int | None,
    residual: torch.Tensor | None,
    emit_norm_bf16: bool,
    hidden_interleaved: bool,
) -> list[Any]:
    """Validate (prefill spec §2.3), plan, and build the kernel's positional arguments."""
    cfg = validate(
        hidden_states,
        gamma,
        router_weights,
        router_bias,
        eps,
        top_k,
        router_act_fn,
        n_group,
        topk_group,
        routed_scaling_factor,
        qmx_output_dtype,
        pack_scales,
        pack_affinities,
        unpadded_hidden_size,
        residual,
        emit_norm_bf16,
        hidden_interleaved,
    )
    # the kernel's positional parameters: tensors, the plan, optional tensors
    return [hidden_states, gamma, kernel_config(cfg), router_weights, router_bias, residual]


_API_NAMES = (
    "hidden_states",
    "gamma",
    "router_weights",
    "router_bias",
    "eps",
    "top_k",
    "router_act_fn",
    "n_group",
    "topk_group",
    "routed_scaling_factor",
    "qmx_output_dtype",
    "pack_scales",
    "pack_affinities",
    "unpadded_hidden_size",
    "residual",
    "emit_norm_bf16",
    "hidden_interleaved",
)


def _third_party(kernel: Any) -> selection.KernelChoice | None:
    choice = selection.parse_kernel(kernel, selection.PREFILL)
    return None if choice.is_own else choice


def _api_args(values: tuple[Any, ...]) -> dict[str, Any]:
    """mxcli's positional arguments by their API reference names, validated by the contract
    first (mxcli's own messages), with the router mode as `RouterActFnType`."""
    validate(*values)
    args = dict(zip(_API_NAMES, values, strict=True))
    args["router_act_fn"] = RouterActFnType.coerce(args["router_act_fn"])
    return args


def _finish(outputs: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """The packed rows as fp8 (the kernel's HBM tensor holds raw bytes), all on `device`."""
    first = outputs[0]
    if first.dtype != torch.float8_e4m3fn:
        first = first.contiguous().view(torch.uint8).view(torch.float8_e4m3fn)
    return [t.to(device) for t in [first, *outputs[1:]]]


def launch_sim(
    hidden_states: torch.Tensor,
    gamma: torch.Tensor,
    router_weights: torch.Tensor | None = None,
    router_bias: torch.Tensor | None = None,
    eps: float = 1e-6,
    top_k: int = 1,
    router_act_fn: Any = RouterActFnType.SIGMOID,
    n_group: int = 1,
    topk_group: int = 1,
    routed_scaling_factor: float = 1.0,
    qmx_output_dtype: Any = "float8_e4m3fn_x4",
    pack_scales: bool = True,
    pack_affinities: bool = False,
    unpadded_hidden_size: int | None = None,
    residual: torch.Tensor | None = None,
    emit_norm_bf16: bool = False,
    hidden_interleaved: bool = False,
    *,
    lnc: int = 1,
    check_only: bool = False,
    engine: SimEngine | str = SimEngine.AUTO,
    check_capacity: bool = True,
    kernel: Any = selection.MXCLI,
) -> SimResult:
    """Run the NKI kernel on a simulator and return the full `SimResult` (outputs in the
    reference's form, the interpreter's counters, the engine that ran).

    `lnc`: 1 or 2 programs splitting the tokens. `check_only` (interpreter only): every hardware
    rule and the SBUF/PSUM capacity are checked, arithmetic is skipped (outputs are zeros).
    `kernel`: ``"mxcli"`` (default), ``"nkilib"``, ``"MODULE:FUNCTION"`` or a
    `selection.KernelChoice` (`mxcli.kernels.selection`).
    """
    values = (
        hidden_states, gamma, router_weights, router_bias, eps, top_k, router_act_fn, n_group,
        topk_group, routed_scaling_factor, qmx_output_dtype, pack_scales, pack_affinities,
        unpadded_hidden_size, residual, emit_norm_bf16, hidden_interleaved,
    )  # fmt: skip
    choice = _third_party(kernel)
    if choice is not None:
        res = selection.launch_sim(
            choice, _api_args(values), lnc=lnc, check_only=check_only, check_capacity=check_capacity
        )
        res.outputs = _finish(res.outputs, hidden_states.device)
        return res
    args = _prepare(
        hidden_states,
        gamma,
        router_weights,
        router_bias,
        eps,
        top_k,
        router_act_fn,
        n_group,
        topk_group,
        routed_scaling_factor,
        qmx_output_dtype,
        pack_scales,
        pack_affinities,
        unpadded_hidden_size,
        residual,
        emit_norm_bf16,
        hidden_interleaved,
    )
    res = nki_runtime.run_sim(
        KERNEL,
        args,
        lnc=lnc,
        check_only=check_only,
        engine=engine,
        check_capacity=check_capacity,
    )
    selection.record(
        selection.parse_kernel(selection.MXCLI, selection.PREFILL), res.engine.value, res.report
    )
    res.outputs = _finish(res.outputs, hidden_states.device)
    return res


def run_sim(
    hidden_states: torch.Tensor,
    gamma: torch.Tensor,
    router_weights: torch.Tensor | None = None,
    router_bias: torch.Tensor | None = None,
    eps: float = 1e-6,
    top_k: int = 1,
    router_act_fn: Any = RouterActFnType.SIGMOID,
    n_group: int = 1,
    topk_group: int = 1,
    routed_scaling_factor: float = 1.0,
    qmx_output_dtype: Any = "float8_e4m3fn_x4",
    pack_scales: bool = True,
    pack_affinities: bool = False,
    unpadded_hidden_size: int | None = None,
    residual: torch.Tensor | None = None,
    emit_norm_bf16: bool = False,
    hidden_interleaved: bool = False,
    *,
    lnc: int = 1,
    engine: SimEngine | str = SimEngine.AUTO,
    kernel: Any = selection.MXCLI,
) -> list[torch.Tensor]:
    """The ``sim`` backend: the NKI kernel on ``nki.simulate`` or mxcli's interpreter.

    Same parameters and outputs as `rmsnorm_mx_prefill_reference`; `lnc` (1 or 2) splits the
    tokens over two programs, `engine` forces a simulator (`SimEngine`), `kernel` picks the
    NKI kernel (`mxcli.kernels.selection`: mxcli's, nkilib's or MODULE:FUNCTION).
    """
    return launch_sim(
        hidden_states,
        gamma,
        router_weights,
        router_bias,
        eps,
        top_k,
        router_act_fn,
        n_group,
        topk_group,
        routed_scaling_factor,
        qmx_output_dtype,
        pack_scales,
        pack_affinities,
        unpadded_hidden_size,
        residual,
        emit_norm_bf16,
        hidden_interleaved,
        lnc=lnc,
        engine=engine,
        kernel=kernel,
    ).outputs


def run_neuron(
    hidden_states: torch.Tensor,
    gamma: torch.Tensor,
    router_weights: torch.Tensor | None = None,
    router_bias: torch.Tensor | None = None,
    eps: float = 1e-6,
    top_k: int = 1,
    router_act_fn: Any = RouterActFnType.SIGMOID,
    n_group: int = 1,
    topk_group: int = 1,
    routed_scaling_factor: float = 1.0,
    qmx_output_dtype: Any = "float8_e4m3fn_x4",
    pack_scales: bool = True,
    pack_affinities: bool = False,
    unpadded_hidden_size: int | None = None,
    residual: torch.Tensor | None = None,
    emit_norm_bf16: bool = False,
    hidden_interleaved: bool = False,
    *,
    lnc: int | None = None,
    kernel: Any = selection.MXCLI,
) -> list[torch.Tensor]:
    """The ``neuron`` backend: the NKI kernel on a Trainium (Trn3) device via torch-neuronx.

    `lnc` defaults to ``NEURON_LOGICAL_NC_CONFIG`` (2 on Trn3). Raises `BackendUnavailableError`
    naming what is missing when the Neuron SDK or a device is absent. `kernel` picks the NKI
    kernel (`mxcli.kernels.selection`); the same launch path runs it.
    """
    choice = _third_party(kernel)
    if choice is not None:
        values = (
            hidden_states, gamma, router_weights, router_bias, eps, top_k, router_act_fn,
            n_group, topk_group, routed_scaling_factor, qmx_output_dtype, pack_scales,
            pack_affinities, unpadded_hidden_size, residual, emit_norm_bf16, hidden_interleaved,
        )  # fmt: skip
        nki_runtime.require_neuron(selection.describe_name(choice))
        outs = selection.launch_neuron(choice, _api_args(values), lnc=lnc)
        return _finish(list(outs), hidden_states.device)
    args = _prepare(
        hidden_states,
        gamma,
        router_weights,
        router_bias,
        eps,
        top_k,
        router_act_fn,
        n_group,
        topk_group,
        routed_scaling_factor,
        qmx_output_dtype,
        pack_scales,
        pack_affinities,
        unpadded_hidden_size,
        residual,
        emit_norm_bf16,
        hidden_interleaved,
    )
    outputs = nki_runtime.run_neuron(KERNEL, args, lnc=lnc)
    return _finish(outputs, hidden_states.device)
