"""``nki.isa`` as provided by mxcli's interpreter (api spec §5-§8)."""

from __future__ import annotations

from typing import Any

from mxcli.nkisim.errors import NkiValidationError
from mxcli.nkisim.nki.isa import constants
from mxcli.nkisim.nki.isa._common import NkiInstruction
from mxcli.nkisim.nki.isa.control import (
    get_nc_sub_version,
    get_nc_version,
    register_alloc,
    register_load,
    register_move,
    register_store,
)
from mxcli.nkisim.nki.isa.dma import core_barrier, dma_compute, dma_copy, dma_transpose, sendrecv
from mxcli.nkisim.nki.isa.enums import (
    dge_mode,
    dma_engine,
    engine,
    matmul_perf_mode,
    nc_version,
    oob_mode,
    reduce_cmd,
)
from mxcli.nkisim.nki.isa.pe import nc_matmul, nc_matmul_mx, nc_transpose, quantize_mx
from mxcli.nkisim.nki.isa.vector import (
    activate2,
    activation,
    activation_reduce,
    exponential,
    iota,
    max8,
    memset,
    nc_find_index8,
    nc_stream_shuffle,
    reciprocal,
    scalar_tensor_tensor,
    tensor_copy,
    tensor_reduce,
    tensor_scalar,
    tensor_scalar_reduce,
    tensor_tensor,
    topk,
)
from mxcli.nkisim.tensor import VirtualRegister

# deprecated engine aliases still used by 2.32 kernels (api spec §1)
tensor_engine = engine.tensor
vector_engine = engine.vector
scalar_engine = engine.scalar
gpsimd_engine = engine.gpsimd
unknown_engine = engine.unknown

__all__ = [
    "NkiInstruction",
    "NkiValidationError",
    "VirtualRegister",
    "activate2",
    "activation",
    "activation_reduce",
    "constants",
    "core_barrier",
    "dge_mode",
    "dma_compute",
    "dma_copy",
    "dma_engine",
    "dma_transpose",
    "engine",
    "exponential",
    "get_nc_sub_version",
    "get_nc_version",
    "gpsimd_engine",
    "iota",
    "matmul_perf_mode",
    "max8",
    "memset",
    "nc_find_index8",
    "nc_matmul",
    "nc_matmul_mx",
    "nc_stream_shuffle",
    "nc_transpose",
    "nc_version",
    "oob_mode",
    "quantize_mx",
    "reciprocal",
    "reduce_cmd",
    "register_alloc",
    "register_load",
    "register_move",
    "register_store",
    "scalar_engine",
    "scalar_tensor_tensor",
    "sendrecv",
    "tensor_copy",
    "tensor_engine",
    "tensor_reduce",
    "tensor_scalar",
    "tensor_scalar_reduce",
    "tensor_tensor",
    "topk",
    "unknown_engine",
    "vector_engine",
]

# api spec §1: APIs removed by earlier releases must not exist; say why when a kernel asks.
_REMOVED = {
    "tensor_copy_dynamic_src": "removed in NKI 0.4: use .ap(scalar_offset=...) with tensor_copy / dma_copy",
    "tensor_copy_dynamic_dst": "removed in NKI 0.4: use .ap(scalar_offset=...) with tensor_copy / dma_copy",
}
_NOT_IMPLEMENTED = {
    "affine_select",
    "select_reduce",
    "tensor_copy_predicated",
    "range_select",
    "tensor_scalar_cumulative",
    "bn_stats",
    "bn_aggr",
    "nonzero_with_count",
}


def __getattr__(name: str) -> Any:
    if name in _REMOVED:
        raise AttributeError(f"nki.isa.{name} was {_REMOVED[name]}")
    if name in _NOT_IMPLEMENTED:
        raise AttributeError(
            f"nki.isa.{name} exists in NKI 0.6 but is not implemented by mxcli's interpreter"
        )
    raise AttributeError(f"module 'nki.isa' has no attribute {name!r}")
