"""``rmsnorm_mx_prefill``: fused RMSNorm + MXFP8 quantization + router top-K for prefill.

Contract (signature, enums, validation, row geometry) in `contract`; the kernel-faithful torch
reference in `reference` (registered as the ``reference`` backend); the router in `router`;
host-side helpers: `arrange_router_weights` / `unarrange_router_weights` (offline weight prep,
prefill spec §6.1) and `decode_packed_rows` (packed rows -> codes, scales, fp32, affinities, §6.2).
"""

from __future__ import annotations

import inspect
import sys
import types
from typing import Any

from mxcli.kernels import backends
from mxcli.kernels.rmsnorm_mx_prefill.contract import (
    KERNEL_NAME,
    PrefillConfig,
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

backends.register(KERNEL_NAME, "reference", rmsnorm_mx_prefill_reference)


class _CallableModule(types.ModuleType):
    """This package shares its name with the kernel function it exports.

    ``from mxcli.kernels import rmsnorm_mx_prefill`` may yield this package rather than the
    function (the import system binds a loaded subpackage as an attribute of its parent), so the
    package is callable too and forwards to `rmsnorm_mx_prefill` with the same signature.
    """

    def __call__(self, *args: Any, **kwargs: Any) -> list[Any]:
        return rmsnorm_mx_prefill(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
__signature__ = inspect.signature(rmsnorm_mx_prefill)

__all__ = [
    "KERNEL_NAME",
    "DecodedRows",
    "HoleFill",
    "LogitAccumulation",
    "PrefillConfig",
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
