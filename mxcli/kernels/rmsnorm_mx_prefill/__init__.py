"""``rmsnorm_mx_prefill``: fused RMSNorm + MXFP8 quantization + router top-K for prefill.

Contract (the signature, enums, validation into a `PrefillCall`, row geometry) in `contract`;
the `KernelSpec` in `spec`; the kernel-faithful torch
reference in `reference` (registered as the ``reference`` backend); the router in `router`;
host-side helpers: `arrange_router_weights` / `unarrange_router_weights` (offline weight prep,
prefill spec §6.1) and `decode_packed_rows` (packed rows -> codes, scales, fp32, affinities, §6.2).
"""

from __future__ import annotations

from mxcli.kernels import backends
from mxcli.kernels.rmsnorm_mx_prefill.contract import (
    PrefillCall,
    PrefillValidationError,
    QmxOutputDtype,
    RouterActFnType,
    RowGeometry,
    rmsnorm_mx_prefill,
    row_geometry,
    validate,
)
from mxcli.kernels.rmsnorm_mx_prefill.decode import DecodedRows, decode_packed_rows, packed_bytes
from mxcli.kernels.rmsnorm_mx_prefill.reference import HoleFill, rmsnorm_mx_prefill_reference
from mxcli.kernels.rmsnorm_mx_prefill.router import LogitAccumulation
from mxcli.kernels.rmsnorm_mx_prefill.router_weights import (
    arrange_router_weights,
    unarrange_router_weights,
)
from mxcli.kernels.rmsnorm_mx_prefill.spec import SPEC

backends.register(SPEC.name, "reference", rmsnorm_mx_prefill_reference)
backends.register_nki(SPEC.name)


__all__ = [
    "SPEC",
    "DecodedRows",
    "HoleFill",
    "LogitAccumulation",
    "PrefillCall",
    "PrefillValidationError",
    "QmxOutputDtype",
    "RouterActFnType",
    "RowGeometry",
    "arrange_router_weights",
    "decode_packed_rows",
    "packed_bytes",
    "rmsnorm_mx_prefill",
    "rmsnorm_mx_prefill_reference",
    "row_geometry",
    "unarrange_router_weights",
    "validate",
]
