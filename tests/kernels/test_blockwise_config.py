"""`MXFP8MOEBwdConfig`: defaults of bwd spec §8 and the validation of §10."""

from __future__ import annotations

import pytest
import torch

from mxcli.errors import InputError
from mxcli.kernels import MXFP8MOEBwdConfig
from mxcli.kernels.backends import backend_names
from mxcli.kernels.blockwise_moe import (
    ActFnType,
    AffinityOption,
    BwdConfigTypeError,
    BwdValidationError,
    ClampLimits,
    MatmulMxfp8KernelConfig,
    QuantScheme,
    ShardOption,
    SkipMode,
    SwizzleMode,
    TransposeMode,
)
from mxcli.mx import ElemFormat

SWIZZLE_FIELDS = [
    "output_grad_swizzle_mode",
    "down_weight_swizzle_mode",
    "d_gate_up_swizzle_mode",
    "gate_up_weight_swizzle_mode",
    "d_gate_up_t_swizzle_mode",
    "hidden_states_t_swizzle_mode",
    "output_grad_t_swizzle_mode",
    "scaled_intermediate_t_swizzle_mode",
]


def test_defaults_follow_g3():
    c = MXFP8MOEBwdConfig()
    assert c.compute_dtype == torch.bfloat16
    assert c.fp8_x4_dtype is ElemFormat.E4M3FN
    assert c.activation_type is ActFnType.SiLU
    assert c.shard_option is ShardOption.SHARD_ON_FREE
    assert c.affinity_option is AffinityOption.AFFINITY_ON_I
    assert c.quant_scheme is QuantScheme.WRAPX
    assert c.accumulate_hidden_states_grad is False
    assert c.skip_grad_initialization is False
    assert c.single_expert_dense is True
    assert c.fast_dma_transpose is False and c.pe_transpose_only is False
    assert c.clamp_limits == ClampLimits() and not c.clamp_limits.any
    assert c.skip_dma is None and c.effective_skip_dma == SkipMode(False, False)
    assert c.bias is False
    assert c.phase3_transpose_mode is TransposeMode.NC
    assert c.phase4_transpose_mode is TransposeMode.NC
    assert all(getattr(c, f) is SwizzleMode.PE for f in SWIZZLE_FIELDS)
    for pc in c.phase_configs():  # the config's own phase defaults (errata 5)
        assert isinstance(pc, MatmulMxfp8KernelConfig)
        assert pc.enable_scale_packing is True and pc.spill_reload is True
        assert pc.quant_scheme is QuantScheme.WRAPX
        assert pc.tile_k is None and pc.effective_tile_k == 512
    # a phase config a user builds defaults to no packing, no spill/reload (errata 5)
    user = MatmulMxfp8KernelConfig()
    assert user.enable_scale_packing is False and user.spill_reload is False


def test_routed_helper():
    c = MXFP8MOEBwdConfig.routed(top_k=2)
    assert c.single_expert_dense is False
    assert c.accumulate_hidden_states_grad is True
    assert c.effective_skip_dma.skip_token is True
    assert all(getattr(c, f) is SwizzleMode.DGT for f in SWIZZLE_FIELDS)
    assert MXFP8MOEBwdConfig.routed(top_k=1).accumulate_hidden_states_grad is False
    assert MXFP8MOEBwdConfig.routed(1, bias=True).bias is True
    with pytest.raises(BwdValidationError, match="top_k"):
        MXFP8MOEBwdConfig.routed(top_k=0)


def test_quant_scheme_propagates_and_must_agree():
    c = MXFP8MOEBwdConfig(quant_scheme=QuantScheme.MX1X32)
    assert all(pc.quant_scheme is QuantScheme.MX1X32 for pc in c.phase_configs())
    c2 = MXFP8MOEBwdConfig(quant_scheme="1x32", phase3_config=MatmulMxfp8KernelConfig(tile_k=256))
    assert c2.phase3_config is not None and c2.phase3_config.quant_scheme is QuantScheme.MX1X32
    with pytest.raises(BwdValidationError, match="phase2_config.quant_scheme: all four phases"):
        MXFP8MOEBwdConfig(phase2_config=MatmulMxfp8KernelConfig(quant_scheme=QuantScheme.MX1X32))


@pytest.mark.parametrize(
    "kwargs, exc, pattern",
    [
        ({"compute_dtype": torch.float32}, BwdValidationError, "compute_dtype: only torch.bfloat16"),
        ({"compute_dtype": "bf16"}, BwdConfigTypeError, "compute_dtype: expected torch.dtype"),
        ({"fp8_x4_dtype": ElemFormat.E5M2}, BwdValidationError, "fp8_x4_dtype: only float8_e4m3fn_x4"),
        ({"activation_type": ActFnType.GELU}, BwdValidationError, "only SiLU is implemented"),
        ({"shard_option": ShardOption.SHARD_ON_HIDDEN}, BwdValidationError, "only SHARD_ON_FREE"),
        ({"quant_scheme": 3}, BwdConfigTypeError, "quant_scheme: expected QuantScheme"),
        ({"quant_scheme": "nvfp4"}, BwdValidationError, "quant_scheme: expected WRAPX or 1x32"),
        ({"phase1_config": {"tile_k": 512}}, BwdConfigTypeError, "phase1_config: expected MatmulMxfp8KernelConfig"),
        ({"clamp_limits": None}, BwdValidationError, "clamp_limits: expected a ClampLimits"),
        ({"skip_dma": (True, False)}, BwdConfigTypeError, "skip_dma: expected SkipMode"),
        ({"phase3_transpose_mode": "DMA"}, BwdConfigTypeError, "phase3_transpose_mode: expected TransposeMode"),
        ({"d_gate_up_swizzle_mode": "PE"}, BwdValidationError, "d_gate_up_swizzle_mode: expected SwizzleMode"),
        ({"bias": 1}, BwdConfigTypeError, "bias: expected bool"),
        ({"single_expert_dense": True, "accumulate_hidden_states_grad": True}, BwdValidationError,
         "accumulate_hidden_states_grad: single_expert_dense requires False"),
        ({"single_expert_dense": True, "bias": True}, BwdValidationError, "bias: single_expert_dense requires False"),
        ({"pe_transpose_only": True, "single_expert_dense": False}, BwdValidationError,
         "pe_transpose_only: requires single_expert_dense"),
        ({"pe_transpose_only": True, "fast_dma_transpose": True}, BwdValidationError,
         "pe_transpose_only: requires fast_dma_transpose=False"),
        ({"pe_transpose_only": True, "phase4_transpose_mode": TransposeMode.DMA}, BwdValidationError,
         "phase4_transpose_mode: pe_transpose_only requires NC"),
        ({"pe_transpose_only": True, "output_grad_swizzle_mode": SwizzleMode.DGT}, BwdValidationError,
         "output_grad_swizzle_mode: pe_transpose_only requires PE"),
    ],
)  # fmt: skip
def test_config_validation(kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern) as info:
        MXFP8MOEBwdConfig(**kwargs)
    # every validation error is a user error (ValueError subclass), type errors also TypeError
    assert isinstance(info.value, InputError) and isinstance(info.value, ValueError)
    if exc is BwdConfigTypeError:
        assert isinstance(info.value, TypeError)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        ({"tile_k": 384}, "tile_k: expected 128, 256 or 512, got 384"),
        ({"tile_m": 256}, "tile_m: expected <= 128"),
        ({"tile_n": 1024}, "tile_n: expected <= 512"),
        ({"TILES_IN_BLOCK_K": 3, "TILES_IN_LOAD_K": 2}, "TILES_IN_LOAD_K: expected a divisor"),
        ({"TILES_IN_LOAD_N": 4, "TILES_IN_BLOCK_N": 4, "tile_n": 512}, "TILES_IN_LOAD_N \\* tile_n <= 1024"),
        ({"tile_k": 0}, "tile_k: expected a positive int"),
        ({"float8_dtype": ElemFormat.E5M2}, "float8_dtype: expected e4m3fn"),
        ({"block_loop_order": "XYZ"}, "block_loop_order: expected one of"),
        ({"spill_reload": "yes"}, "spill_reload: expected bool"),
    ],
)  # fmt: skip
def test_phase_config_validation(kwargs, pattern):
    with pytest.raises(BwdValidationError, match=pattern):
        MatmulMxfp8KernelConfig(**kwargs)


def test_clamp_limits_validation():
    assert ClampLimits(-1.0, 1.0, None, 0.5).any
    with pytest.raises(BwdValidationError, match="non_linear_clamp_lower_limit: expected < upper"):
        ClampLimits(1.0, 1.0)
    with pytest.raises(BwdValidationError, match="finite"):
        ClampLimits(linear_clamp_upper_limit=float("inf"))
    with pytest.raises(BwdConfigTypeError, match="expected a float or None"):
        ClampLimits(non_linear_clamp_lower_limit="1")  # type: ignore[arg-type]


def test_enum_strings_are_coerced():
    c = MXFP8MOEBwdConfig(affinity_option="AFFINITY_ON_H", quant_scheme="_1x32")
    assert c.affinity_option is AffinityOption.AFFINITY_ON_H
    assert c.quant_scheme is QuantScheme.MX1X32


def test_reference_backend_registered():
    import mxcli.kernels.blockwise_moe  # noqa: F401  (registers on import)

    assert "reference" in backend_names("blockwise_mm_bwd_mxfp8")
