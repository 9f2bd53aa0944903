"""MX numerics: FP8/E8M0 codecs, MX quantization (scale rules, grouping schemes), byte layouts.

Everything is exact to the bit and vectorized; torch tensors (CPU or CUDA) in and out, numpy
arrays accepted.
"""

from mxcli.mx.formats import (
    ElemFormat,
    e8m0_decode,
    e8m0_encode_exponent,
    exponent_field,
    fp8_decode,
    fp8_encode,
)
from mxcli.mx.layouts import (
    pack_x4,
    prefill_scale_offsets,
    prefill_scale_region_size,
    swizzle_h_index,
    unpack_x4,
    unswizzle_h_index,
)
from mxcli.mx.quantize import (
    GROUP_SIZE,
    QuantScheme,
    ScaleRule,
    dequantize_mx,
    fake_quantize_mx,
    group_index,
    group_order,
    quantize_mx,
    to_group_order,
    wrapx_chunks,
)

__all__ = [
    "GROUP_SIZE",
    "ElemFormat",
    "QuantScheme",
    "ScaleRule",
    "dequantize_mx",
    "e8m0_decode",
    "e8m0_encode_exponent",
    "exponent_field",
    "fake_quantize_mx",
    "fp8_decode",
    "fp8_encode",
    "group_index",
    "group_order",
    "pack_x4",
    "prefill_scale_offsets",
    "prefill_scale_region_size",
    "quantize_mx",
    "swizzle_h_index",
    "to_group_order",
    "unpack_x4",
    "unswizzle_h_index",
    "wrapx_chunks",
]
