"""The ``sim`` and ``neuron`` backends of ``rmsnorm_mx_prefill``: the NKI kernel (`nki_kernel`)
launched through `mxcli.kernels.nki_runtime`.

Both take the validated `PrefillCall` (or the arguments of `rmsnorm_mx_prefill`, validated
with `contract.validate`) and return the reference's list of torch tensors (prefill spec §2.2):
the packed rows as ``torch.float8_e4m3fn`` (the kernel writes raw bytes), then index /
affinities / residual / norm as the reference does, on the device of ``hidden_states``. The
launch is planned (`kernel_config`) here, on the host, once and before the kernel is traced: the
kernel receives tensors and a `PrefillKernelConfig` NKIObject, as NKI 0.6 requires (issue 11).
"""

from __future__ import annotations

from typing import Any

import torch

from mxcli.kernels import nki_runtime, selection
from mxcli.kernels.nki_runtime import DTypeName, KernelObject, SimEngine, SimResult
from mxcli.kernels.rmsnorm_mx_prefill.contract import PrefillCall, RouterActFnType, as_call
from mxcli.kernels.rmsnorm_mx_prefill.kernel_types import RouterMode
from mxcli.kernels.rmsnorm_mx_prefill.spec import MXCLI_KERNEL

KERNEL = str(MXCLI_KERNEL.kernel)  # the jit entry, "module:function"
KERNEL_MODULE = KERNEL.partition(":")[0]
KERNEL_CONFIG = f"{KERNEL_MODULE}:PrefillKernelConfig"


def _nki_dtype(dt: torch.dtype) -> DTypeName:
    """The ``nl`` dtype named like the 16-bit torch dtype (``torch.bfloat16`` -> bfloat16)."""
    return DTypeName(str(dt).removeprefix("torch."))


def kernel_config(cfg: PrefillCall) -> KernelObject:
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


def kernel_args(call: PrefillCall) -> list[Any]:
    """The kernel's positional parameters for a validated call: tensors, the plan, optional
    tensors."""
    return [
        call.hidden_states,
        call.gamma,
        kernel_config(call),
        call.router_weights,
        call.router_bias,
        call.residual,
    ]


def api_arguments(call: PrefillCall) -> dict[str, Any]:
    """A validated call's arguments by the API reference's names, for a third-party kernel
    (`mxcli.kernels.selection`): the router mode as `RouterActFnType`, the MX dtype by name."""
    return {
        "hidden_states": call.hidden_states,
        "gamma": call.gamma,
        "router_weights": call.router_weights,
        "router_bias": call.router_bias,
        "eps": call.eps,
        "top_k": call.top_k,
        "router_act_fn": call.act,
        "n_group": call.n_group,
        "topk_group": call.topk_group,
        "routed_scaling_factor": call.routed_scaling_factor,
        "qmx_output_dtype": call.qmx.value,
        "pack_scales": call.pack_scales,
        "pack_affinities": call.pack_affinities,
        "unpadded_hidden_size": call.unpadded_hidden_size,
        "residual": call.residual,
        "emit_norm_bf16": call.emit_norm_bf16,
        "hidden_interleaved": call.hidden_interleaved,
    }


def _third_party(kernel: Any) -> selection.KernelChoice | None:
    choice = selection.parse_kernel(kernel, selection.PREFILL)
    return None if choice.is_own else choice


def _finish(outputs: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """The packed rows as fp8 (the kernel's HBM tensor holds raw bytes), all on `device`."""
    first = outputs[0]
    if first.dtype != torch.float8_e4m3fn:
        first = first.contiguous().view(torch.uint8).view(torch.float8_e4m3fn)
    return [t.to(device) for t in [first, *outputs[1:]]]


def launch_sim(
    *args: Any,
    lnc: int = 1,
    check_only: bool = False,
    engine: SimEngine | str = SimEngine.AUTO,
    check_capacity: bool = True,
    kernel: Any = selection.MXCLI,
    **kwargs: Any,
) -> SimResult:
    """Run the NKI kernel on a simulator and return the full `SimResult` (outputs in the
    reference's form, the interpreter's counters, the engine that ran).

    Arguments: a `PrefillCall`, or those of `rmsnorm_mx_prefill` (validated here, prefill spec
    §2.3). `lnc`: 1 or 2 programs splitting the tokens. `check_only` (interpreter only): every
    hardware rule and the SBUF/PSUM capacity are checked, arithmetic is skipped (outputs are
    zeros). `kernel`: ``"mxcli"`` (default), ``"nkilib"``, ``"MODULE:FUNCTION"`` or a
    `selection.KernelChoice`: the third-party ones take the API reference's arguments.
    """
    call = as_call(*args, **kwargs)
    choice = _third_party(kernel)
    if choice is not None:
        res = selection.launch_sim(
            choice,
            api_arguments(call),
            lnc=lnc,
            check_only=check_only,
            check_capacity=check_capacity,
        )
        res.outputs = _finish(res.outputs, call.hidden_states.device)
        return res
    res = nki_runtime.run_sim(
        KERNEL,
        kernel_args(call),
        lnc=lnc,
        check_only=check_only,
        engine=engine,
        check_capacity=check_capacity,
    )
    selection.record(selection.parse_kernel(None, selection.PREFILL), res.engine.value, res.report)
    res.outputs = _finish(res.outputs, call.hidden_states.device)
    return res


def launch_nkilib(*args: Any, **kwargs: Any) -> SimResult:
    """`launch_sim` of AWS's NKI Library kernel (the spec's ``nkilib`` implementation)."""
    return launch_sim(*args, kernel=selection.NKILIB, **kwargs)


def run_sim(
    *args: Any,
    lnc: int = 1,
    engine: SimEngine | str = SimEngine.AUTO,
    kernel: Any = selection.MXCLI,
    **kwargs: Any,
) -> list[torch.Tensor]:
    """The ``sim`` backend: the NKI kernel on ``nki.simulate`` or mxcli's interpreter.

    Takes a `PrefillCall` (or the arguments of `rmsnorm_mx_prefill`) and returns the
    reference's outputs; `lnc` (1 or 2) splits the tokens over two programs, `engine` forces a
    simulator (`SimEngine`), `kernel` picks the NKI kernel (`mxcli.kernels.selection`).
    """
    return launch_sim(*args, lnc=lnc, engine=engine, kernel=kernel, **kwargs).outputs


def run_neuron(
    *args: Any, lnc: int | None = None, kernel: Any = selection.MXCLI, **kwargs: Any
) -> list[torch.Tensor]:
    """The ``neuron`` backend: the NKI kernel on a Trainium (Trn3) device via torch-neuronx.

    Takes a `PrefillCall` (or the arguments of `rmsnorm_mx_prefill`). `lnc` defaults to
    ``NEURON_LOGICAL_NC_CONFIG`` (2 on Trn3). Raises `BackendUnavailableError` naming what is
    missing when the Neuron SDK or a device is absent. `kernel` picks the NKI kernel
    (`mxcli.kernels.selection`); the same launch path runs it.
    """
    choice = _third_party(kernel)
    if choice is not None:
        nki_runtime.require_neuron(selection.describe_name(choice))  # before validating anything
        call = as_call(*args, **kwargs)
        outs = selection.launch_neuron(choice, api_arguments(call), lnc=lnc)
        return _finish(list(outs), call.hidden_states.device)
    call = as_call(*args, **kwargs)
    outputs = nki_runtime.run_neuron(KERNEL, kernel_args(call), lnc=lnc)
    return _finish(outputs, call.hidden_states.device)
