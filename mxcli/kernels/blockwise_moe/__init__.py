"""Blockwise dropless MXFP8 Mixture-of-Experts: block plan, forward reference, backward
reference, the contract of `blockwise_mm_bwd_mxfp8` (signature, validation into a `BwdCall`), its
`KernelSpec`, its config and weight pre-quantization.

Registers the ``reference``, ``sim`` and ``neuron`` backends of ``blockwise_mm_bwd_mxfp8``.
"""

from __future__ import annotations

from mxcli.kernels import backends
from mxcli.kernels.blockwise_moe.backward import blockwise_mm_bwd_mxfp8_reference
from mxcli.kernels.blockwise_moe.config import (
    ActFnType,
    AffinityOption,
    BwdConfigTypeError,
    BwdValidationError,
    ClampLimits,
    LoopOrder,
    MatmulMxfp8KernelConfig,
    MXFP8MOEBwdConfig,
    ShardOption,
    SkipMode,
    SwizzleMode,
    TransposeMode,
)
from mxcli.kernels.blockwise_moe.contract import BwdCall, blockwise_mm_bwd_mxfp8
from mxcli.kernels.blockwise_moe.forward import ForwardResult, blockwise_mm_fwd_mxfp8
from mxcli.kernels.blockwise_moe.numerics import Emulate
from mxcli.kernels.blockwise_moe.plan import (
    build_block_plan,
    build_dense_block_plan,
    build_expert_affinities_masked,
    num_blocks,
)
from mxcli.kernels.blockwise_moe.prequant import (
    PrequantizedWeights,
    ScaleLayout,
    dequantize_weights,
    prequantize_weights,
)
from mxcli.kernels.blockwise_moe.spec import SPEC
from mxcli.mx import QuantScheme

backends.register(SPEC.name, "reference", blockwise_mm_bwd_mxfp8_reference)
backends.register_nki(SPEC.name)

__all__ = [
    "ActFnType",
    "SPEC",
    "AffinityOption",
    "BwdCall",
    "BwdConfigTypeError",
    "BwdValidationError",
    "ClampLimits",
    "Emulate",
    "ForwardResult",
    "LoopOrder",
    "MXFP8MOEBwdConfig",
    "MatmulMxfp8KernelConfig",
    "PrequantizedWeights",
    "QuantScheme",
    "ScaleLayout",
    "ShardOption",
    "SkipMode",
    "SwizzleMode",
    "TransposeMode",
    "blockwise_mm_bwd_mxfp8",
    "blockwise_mm_bwd_mxfp8_reference",
    "blockwise_mm_fwd_mxfp8",
    "build_block_plan",
    "build_dense_block_plan",
    "build_expert_affinities_masked",
    "dequantize_weights",
    "num_blocks",
    "prequantize_weights",
]
