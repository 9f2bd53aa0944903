"""The kernel API: each kernel beside its torch reference and its NKI source.

Names are resolved lazily so that importing one kernel does not import the other.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

_EXPORTS: dict[str, str] = {
    # rmsnorm_mx_prefill
    "rmsnorm_mx_prefill": "mxcli.kernels.rmsnorm_mx_prefill",
    "RouterActFnType": "mxcli.kernels.rmsnorm_mx_prefill",
    "arrange_router_weights": "mxcli.kernels.rmsnorm_mx_prefill",
    "unarrange_router_weights": "mxcli.kernels.rmsnorm_mx_prefill",
    "decode_packed_rows": "mxcli.kernels.rmsnorm_mx_prefill",
    # blockwise MoE
    "build_block_plan": "mxcli.kernels.blockwise_moe",
    "build_expert_affinities_masked": "mxcli.kernels.blockwise_moe",
    "blockwise_mm_fwd_mxfp8": "mxcli.kernels.blockwise_moe",
    "blockwise_mm_bwd_mxfp8": "mxcli.kernels.blockwise_moe",
    "MXFP8MOEBwdConfig": "mxcli.kernels.blockwise_moe",
    "prequantize_weights": "mxcli.kernels.blockwise_moe",
}

__all__ = sorted(_EXPORTS)

# The prefill package shares its name with the kernel function. Importing the package binds the
# *module* as an attribute of this package (the import system's ``setattr`` on the parent); this
# module's class refuses that one binding, so that `from mxcli.kernels import rmsnorm_mx_prefill`
# is the function (`__getattr__`), whatever is imported later. Nothing is imported here: the CLI
# reads the kernel registry (`mxcli.kernels.spec`) without loading a kernel or torch.


class _Kernels(types.ModuleType):
    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and _EXPORTS.get(name) == value.__name__:
            return  # a subpackage named as one of its exports: the export wins
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Kernels


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'mxcli.kernels' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
