"""The `KernelSpec` of ``rmsnorm_mx_prefill``: its file contract, outputs, padding, non-finite
rule and NKI implementations (see `mxcli.kernels.spec`).

Names, order and defaults of the arguments come from the signature of `rmsnorm_mx_prefill`;
the tables below add only what a signature cannot say (stored dtypes, help, JSON parsing).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from mxcli.errors import InputError
from mxcli.io.kwargs import enum_dump, typed
from mxcli.kernels.rmsnorm_mx_prefill import identity
from mxcli.kernels.rmsnorm_mx_prefill.contract import (
    QmxOutputDtype,
    RouterActFnType,
    output_names,
    rmsnorm_mx_prefill,
    row_geometry,
    validate,
)
from mxcli.kernels.rmsnorm_mx_prefill.decode import (
    DecodedRows,
    decode_packed_rows,
    defined_bytes,
    packed_bytes,
)
from mxcli.kernels.rmsnorm_mx_prefill.nkilib import NKILIB_KERNEL, THIRD_PARTY
from mxcli.kernels.spec import (
    Implementation,
    KernelSpec,
    NkiLaunch,
    NonfiniteRule,
    PackedOutput,
    PaddedDims,
    ScalarArg,
    TensorArg,
    register_spec,
)

FLOAT16 = (torch.bfloat16, torch.float16)
FLOATS = (torch.bfloat16, torch.float16, torch.float32)
PACKED = "norm_quant_packed"


# mxcli's own NKI kernel; AWS's (`nkilib.NKILIB_KERNEL`) and any MODULE:FUNCTION beside it
MXCLI_KERNEL = Implementation(
    "mxcli",
    "mxcli.kernels.rmsnorm_mx_prefill.nki_kernel:rmsnorm_mx_prefill_kernel",
    own=True,
    doc="mxcli's NKI kernel (mxcli/kernels/rmsnorm_mx_prefill/nki_kernel.py)",
)
# the host side of every NKI launch (`mxcli.kernels.launcher`): validation, planning, outputs
NKI_LAUNCH = NkiLaunch(
    as_call="mxcli.kernels.rmsnorm_mx_prefill.contract:as_call",
    prepare="mxcli.kernels.rmsnorm_mx_prefill.nki_backend:prepare",
    finish="mxcli.kernels.rmsnorm_mx_prefill.nki_backend:finish",
    result=list,
    lnc=1,
    third_party=THIRD_PARTY,
)


def decode_packed(
    packed: torch.Tensor, kwargs: Mapping[str, Any], hidden: int, num_experts: int | None
) -> DecodedRows:
    """`decode_packed_rows` of output rows, with the layout the call's kwargs give (`num_experts`
    is read only when the rows hold the affinities)."""
    return decode_packed_rows(
        packed,
        hidden,
        pack_scales=bool(SPEC.value(kwargs, "pack_scales")),
        num_experts=num_experts if SPEC.value(kwargs, "pack_affinities") else None,
        router_act_fn=SPEC.value(kwargs, "router_act_fn"),
        qmx_output_dtype=SPEC.value(kwargs, "qmx_output_dtype"),
    )


def packed_defined(
    kwargs: Mapping[str, Any], hidden: int, num_experts: int | None, row_bytes: int
) -> torch.Tensor:
    """``[row_bytes]`` bool: the bytes of a row the API defines (codes, scales, affinity tail);
    the scale-region holes and the row pad are unspecified (prefill spec §4.2)."""
    return defined_bytes(
        hidden,
        pack_scales=bool(SPEC.value(kwargs, "pack_scales")),
        num_experts=num_experts if SPEC.value(kwargs, "pack_affinities") else None,
        router_act_fn=SPEC.value(kwargs, "router_act_fn"),
        row_bytes=row_bytes,
    )


def packed_geometry(kwargs: Mapping[str, Any], packed: torch.Tensor) -> tuple[int, int | None]:
    """(H, E or None) of packed rows without recorded geometry: H from the row width.

    Only possible without an affinity tail (its width depends on E and its pad); output files
    written by mxcli record ``geometry`` (``hidden_size``, ``num_experts``) in their metadata.
    """
    width = int(packed_bytes(packed).shape[1])
    if SPEC.value(kwargs, "pack_affinities"):
        raise InputError(
            f"{PACKED}: rows with packed affinities need the geometry "
            "(hidden_size, num_experts) in the file metadata"
        )
    pack_scales = bool(SPEC.value(kwargs, "pack_scales"))
    for H in range(512, width + 1, 512):
        if row_geometry(H, pack_scales=pack_scales).row_region == width:
            return H, None
    raise InputError(f"{PACKED}: row width {width} matches no hidden size")


def _geometry(inputs: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """H and E of the rows: what a reader of the outputs needs besides the kwargs."""
    if "hidden_states" not in inputs:
        return {}
    w = inputs.get("router_weights")
    return {
        "geometry": {
            "hidden_size": int(inputs["hidden_states"].shape[-1]),
            "num_experts": int(w.shape[1]) if w is not None else None,
        }
    }


def _required_outputs(kwargs: Mapping[str, Any], input_names: Any) -> tuple[str, ...]:
    """The outputs a run with these kwargs and inputs returns (the router and the residual are
    read from `input_names`; when unknown, only what the kwargs alone decide)."""
    names = set(input_names or ())
    return output_names(
        has_router="router_weights" in names,
        act=RouterActFnType.coerce(SPEC.value(kwargs, "router_act_fn")),
        pack_affinities=bool(SPEC.value(kwargs, "pack_affinities")),
        has_residual="residual" in names,
        emit_norm_bf16=bool(SPEC.value(kwargs, "emit_norm_bf16")),
    )


def _value_views(
    outputs: Mapping[str, torch.Tensor],
    kwargs: Mapping[str, Any],
    inputs: Mapping[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """The floating values of each output; the packed rows decoded (codes x scales, affinity
    tail), never their raw bytes (holes and scale bytes are not fp8 values)."""
    H = int(inputs["hidden_states"].shape[-1])
    w = inputs.get("router_weights")
    E = int(w.shape[1]) if w is not None else None
    views: dict[str, torch.Tensor] = {}
    for name, t in outputs.items():
        if name == PACKED:
            packed_e = E if SPEC.value(kwargs, "pack_affinities") else None
            dec = decode_packed(packed_bytes(t).cpu(), kwargs, H, packed_e)
            views[PACKED] = dec.values
            if dec.affinities is not None:
                views[f"{PACKED}.affinities"] = dec.affinities
        elif t.is_floating_point():
            views[name] = t
    return views


SPEC = register_spec(
    KernelSpec(
        rmsnorm_mx_prefill,
        short=identity.SHORT,
        tensors=(
            TensorArg("hidden_states", "[B, S, H]", FLOAT16),
            TensorArg("gamma", "[1, H] or [H]", FLOATS),
            TensorArg("router_weights", "[H, E] (arranged)", FLOAT16),
            TensorArg("router_bias", "[1, E] or [E]", FLOATS),
            TensorArg("residual", "[B, S, H]", FLOAT16),
        ),
        scalars=(
            ScalarArg("eps", "RMSNorm epsilon.", typed(float, "eps", low=0.0)),
            ScalarArg("top_k", "Experts per token (<= 8).", typed(int, "top_k", low=1)),
            ScalarArg(
                "router_act_fn",
                "Router activation: sigmoid, softmax or noaux_tc.",
                RouterActFnType.coerce,
                enum_dump,
                flag="--router-act",
            ),
            ScalarArg("n_group", "NOAUX_TC expert groups.", typed(int, "n_group", low=1)),
            ScalarArg("topk_group", "NOAUX_TC groups kept.", typed(int, "topk_group", low=1)),
            ScalarArg(
                "routed_scaling_factor",
                "NOAUX_TC multiplier on the normalised affinities.",
                typed(float, "routed_scaling_factor"),
            ),
            ScalarArg(
                "qmx_output_dtype",
                "Packed MX element dtype: float8_e4m3fn_x4 or float8_e5m2_x4.",
                QmxOutputDtype.coerce,
                enum_dump,
            ),
            ScalarArg(
                "pack_scales",
                "Fold 4 H512 tiles of scales into 128 bytes.",
                typed(bool, "pack_scales"),
            ),
            ScalarArg(
                "pack_affinities",
                "Append the affinities to each packed row.",
                typed(bool, "pack_affinities"),
            ),
            ScalarArg(
                "unpadded_hidden_size",
                "Real hidden size for the RMS mean when H is zero-padded.",
                typed(int, "unpadded_hidden_size", low=1, allow_none=True),
                value_type=int,
                shown="H",
            ),
            ScalarArg(
                "emit_norm_bf16",
                "Also return the bf16 RMSNorm output.",
                typed(bool, "emit_norm_bf16"),
            ),
            ScalarArg(
                "hidden_interleaved",
                "hidden_states/residual stored 4-way interleaved (a documented extra).",
                typed(bool, "hidden_interleaved"),
            ),
        ),
        outputs=(PACKED, "expert_index", "expert_affinities", "output_residual", "norm_bf16"),
        validate=validate,
        required_outputs=_required_outputs,
        # prefill spec §2.3: H % 512 == 0; the real H only changes the RMS divisor (§3)
        padded=PaddedDims(
            inputs={"hidden_states": {-1: "H"}, "residual": {-1: "H"}}, hidden="prefill_hidden_size"
        ),
        # tokens are independent (§3): a token's outputs are explained by its own rows
        nonfinite=NonfiniteRule(token_inputs=("hidden_states", "residual"), views=_value_views),
        packed=PackedOutput(
            PACKED, decode_packed, packed_geometry, packed_bytes, defined=packed_defined
        ),
        geometry=_geometry,
        implementations=(MXCLI_KERNEL, NKILIB_KERNEL),
        nki=NKI_LAUNCH,
        title=identity.TITLE,
        tokens="hidden_states",
    )
)

__all__ = [
    "MXCLI_KERNEL",
    "NKILIB_KERNEL",
    "NKI_LAUNCH",
    "SPEC",
    "decode_packed",
    "packed_geometry",
]


def prefill_input_bytes(T: int, H: int, residual: bool) -> int:
    """A lower bound of make-inputs' peak for prefill: each [T, H] activation is drawn in fp32
    and kept in bf16 (6 bytes an element). Also one of ``profile prefill``'s from shapes (its
    bf16 zeros, the packed rows and the interpreter's copies: 12.5 bytes an element measured
    at H 7168, T 8192 and 32768)."""
    return 6 * T * H * (2 if residual else 1)
