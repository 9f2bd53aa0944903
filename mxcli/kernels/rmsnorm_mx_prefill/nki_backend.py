"""The host side of ``rmsnorm_mx_prefill``'s NKI launch: the hooks of its spec's `NkiLaunch`,
which the one launcher (`mxcli.kernels.launcher`) calls on the ``sim`` and ``neuron`` backends.

The launch of mxcli's kernel (`nki_kernel`) is planned (`kernel_config`) here, on the host, once
and before the kernel is traced: the kernel receives tensors and a `PrefillKernelConfig`
NKIObject, as NKI 0.6 requires (issue 11). A third-party kernel gets the API reference's
arguments (`api_arguments`). Either returns the reference's list of torch tensors (prefill spec
§2.2, `finish`): the packed rows as ``torch.float8_e4m3fn`` (the kernel writes raw bytes), then
index / affinities / residual / norm as the reference does, on the device of ``hidden_states``.
"""

from __future__ import annotations

from typing import Any

import torch

from mxcli.kernels.nki_runtime import DTypeName, KernelObject
from mxcli.kernels.rmsnorm_mx_prefill.contract import PrefillCall, RouterActFnType
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
    (`mxcli.kernels.spec.ThirdParty.arguments`): the router mode as `RouterActFnType`, the MX
    dtype as the ``nki`` dtype of its name."""
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
        "qmx_output_dtype": DTypeName(call.qmx.value),
        "pack_scales": call.pack_scales,
        "pack_affinities": call.pack_affinities,
        "unpadded_hidden_size": call.unpadded_hidden_size,
        "residual": call.residual,
        "emit_norm_bf16": call.emit_norm_bf16,
        "hidden_interleaved": call.hidden_interleaved,
    }


def prepare(call: PrefillCall) -> tuple[list[Any], dict[str, Any]]:
    """The launch of mxcli's kernel (`mxcli.kernels.spec.NkiLaunch.prepare`): all positional
    (`kernel_args`)."""
    return kernel_args(call), {}


def finish(call: PrefillCall, outputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The packed rows as fp8 (the kernel's HBM tensor holds raw bytes), all on the device of
    ``hidden_states``."""
    first = outputs[0]
    if first.dtype != torch.float8_e4m3fn:
        first = first.contiguous().view(torch.uint8).view(torch.float8_e4m3fn)
    return [t.to(call.hidden_states.device) for t in [first, *outputs[1:]]]
