"""`MXFP8MOEBwdConfig`, its enums and the validation of bwd spec §10.

Every field of bwd spec §8 is accepted, validated and recorded. Only a few change results
(the spec's "numerics" column); the docstring of each field says which. The performance-only
fields (blocking, spill/reload, transpose and swizzle modes, loop orders) are kept so that a
config written for the device kernel is accepted unchanged by the reference, where they have no
effect on any value.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from mxcli.errors import InputError
from mxcli.io.kwargs import coerce_enum
from mxcli.mx import ElemFormat, QuantScheme
from mxcli.mx.quantize import as_scheme

E = TypeVar("E", bound=enum.Enum)

__all__ = [
    "ActFnType",
    "AffinityOption",
    "BwdConfigTypeError",
    "BwdValidationError",
    "ClampLimits",
    "LoopOrder",
    "MXFP8MOEBwdConfig",
    "MatmulMxfp8KernelConfig",
    "ShardOption",
    "SkipMode",
    "SwizzleMode",
    "TransposeMode",
]


class BwdValidationError(InputError):
    """A tensor, argument or config field of the blockwise MoE kernels is invalid.

    The one-line message names the tensor/field, the expected and the actual value.
    """


class BwdConfigTypeError(BwdValidationError, TypeError):
    """A config field has the wrong type (spec §10 raises TypeError; this is also a ValueError)."""


class ActFnType(enum.IntEnum):
    """Gate activation φ (bwd spec §2.2). Only ``SiLU`` is implemented by the MXFP8 kernels.

    - ``SiLU``: ``φ(g) = g·σ(g)``, ``φ'(g) = σ(g)·(1 + g·(1 − σ(g)))``.
    - ``GELU``, ``GELU_Tanh_Approx``, ``Swish``, ``ReLU``: enum members of the device API,
      rejected by the MXFP8 kernels ("only SiLU is implemented").
    """

    SiLU = 0
    GELU = 1
    GELU_Tanh_Approx = 2
    Swish = 3
    ReLU = 4


class AffinityOption(enum.Enum):
    """Where the routing affinity α multiplies (bwd spec §2.1; the two are the same function).

    - ``AFFINITY_ON_I`` (default): ``s = α·h`` is the down-projection input, ``y = s·W_d``.
      Backward: ``D = mx(dY, W_d)`` (fp32), ``Ds = D·α`` in fp32; P4 reads ``S = bf16(Hm·α)``.
    - ``AFFINITY_ON_H``: ``y = α·(h·W_d)``. Backward (API reference): the P1 left operand is
      ``dYs = bf16(dY·α)`` (or ``down_proj_act_checkpoint``), ``Ds = mx(dYs, W_d)``; P4 reads
      ``Hm`` and ``dYs``. The affinity grad still uses the un-scaled ``mx(dY, W_d)`` (one extra
      P1 matmul in the reference; how the device kernel obtains it is unconfirmed [U]).
    """

    AFFINITY_ON_H = 0
    AFFINITY_ON_I = 1


class ShardOption(enum.Enum):
    """LNC2 work split between the two NeuronCores (bwd spec §8). Performance only.

    ``SHARD_ON_FREE`` (each core takes half of the free/output dimension of every matmul) is the
    only option the backward accepts. In the reference its one numeric trace is kept: the
    affinity-grad reduction over I is done as two fp32 halves that are then added (spec §6 P1.4).
    """

    SHARD_ON_FREE = 0
    SHARD_ON_HIDDEN = 1
    SHARD_ON_INTERMEDIATE = 2
    SHARD_ON_BLOCK = 3


class TransposeMode(enum.Enum):
    """Engine building the ``[F, B]`` operands of P3/P4: ``NC`` (PE transpose) or ``DMA``.

    Performance only: transposes are exact, results do not change.
    """

    NC = 0
    DMA = 1


class SwizzleMode(enum.Enum):
    """How an operand's wrapX matmul layout is built: ``DGT`` (DMA gather-transpose) or ``PE``.

    Performance only (spec §5.3: both build the identical wrapX layout). Weight modes must be
    ``DGT`` when E > 1.
    """

    DGT = 0
    PE = 1


class LoopOrder(str, enum.Enum):
    """Nesting of the M/N/K loops of one phase matmul (outermost first). Performance only:
    it changes only the fp32 summation order, which the reference does not model."""

    MNK = "MNK"
    MKN = "MKN"
    NMK = "NMK"
    NKM = "NKM"
    KMN = "KMN"
    KNM = "KNM"


@dataclass(frozen=True)
class ClampLimits:
    """Forward clamps and backward gradient masks (bwd spec §2.1 step 2 and §4.2).

    Forward: ``g ← clip(g, non_linear_lower, non_linear_upper)``,
    ``u ← clip(u, linear_lower, linear_upper)``. Backward masks evaluated on the bf16
    checkpoint values with strict inequalities: ``mask_nl = (G < nl_upper) ∧ (G > nl_lower)``,
    ``mask_l = (U < l_upper) ∧ (U > l_lower)``; a missing bound counts as true. The comparison
    is with the fp32 limit, so a limit that bf16 cannot represent exactly lets clamped values
    through (the device compares the same way).
    """

    non_linear_clamp_lower_limit: float | None = None
    non_linear_clamp_upper_limit: float | None = None
    linear_clamp_lower_limit: float | None = None
    linear_clamp_upper_limit: float | None = None

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise BwdConfigTypeError(
                    f"clamp_limits.{f.name}: expected a float or None, got {type(v).__name__}"
                )
            if not math.isfinite(v):
                raise BwdValidationError(f"clamp_limits.{f.name}: expected a finite value, got {v}")
        for kind in ("non_linear", "linear"):
            lo = getattr(self, f"{kind}_clamp_lower_limit")
            hi = getattr(self, f"{kind}_clamp_upper_limit")
            if lo is not None and hi is not None and not lo < hi:
                raise BwdValidationError(
                    f"clamp_limits.{kind}_clamp_lower_limit: expected < upper limit {hi}, got {lo}"
                )

    @property
    def any(self) -> bool:
        """True when at least one bound is set."""
        return any(getattr(self, f.name) is not None for f in dataclasses.fields(self))


@dataclass(frozen=True)
class SkipMode:
    """Out-of-bounds handling of token gathers/scatters (bwd spec §3.1).

    ``skip_token=True`` lets padding ids (-1, or any id outside ``[0, T)``) be skipped: gathers
    read zero rows, scatters drop them. Without it the device raises on any padding id, and so
    does the reference (routed path). ``skip_weight`` is accepted and unused (as on the device).
    """

    skip_token: bool = False
    skip_weight: bool = False


def _check_type(name: str, value: Any, types: type | tuple[type, ...], allow_none: bool) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise BwdConfigTypeError(f"{name}: expected {_tname(types)}, got bool")
    if not isinstance(value, types):
        raise BwdConfigTypeError(f"{name}: expected {_tname(types)}, got {type(value).__name__}")


def _tname(types: type | tuple[type, ...]) -> str:
    ts = types if isinstance(types, tuple) else (types,)
    return " or ".join(t.__name__ for t in ts)


def _coerce_enum(name: str, value: Any, enum_cls: type[E]) -> E:
    """A config field's enum from a member or a string naming one (`coerce_enum`); any other
    type is a `BwdConfigTypeError`."""
    return coerce_enum(
        enum_cls, value, name, error=BwdValidationError, type_error=BwdConfigTypeError
    )


def _coerce_scheme(name: str, value: Any) -> QuantScheme:
    return as_scheme(
        value,
        name,
        expected="WRAPX or 1x32",
        error=BwdValidationError,
        type_error=BwdConfigTypeError,
    )


@dataclass
class MatmulMxfp8KernelConfig:
    """Per-phase MXFP8 matmul configuration (bwd spec §8).

    Numerics: ``quant_scheme`` and ``tile_k`` choose the MX groups along the contraction axis
    (§5.3: wrapX chunks of ``tile_k``, then 256, then 128; or contiguous 1x32), and
    ``enable_scale_packing`` of phase 1 (down) / phase 2 (gate/up) says which layout the scales
    of a pre-quantized weight are in (§5.5). ``tile_k=None`` means the device default
    ``min(512, K)``, which groups exactly as ``tile_k=512`` for every K the kernel accepts.

    Everything else (tile sizes M/N, ``TILES_IN_*`` blocking, loop orders, ``spill_reload``,
    ``enable_psum_copy_in``, ``output_dtype``) steers device performance only and does not change
    any result of the reference (at most the fp32 summation order on the device).
    """

    tile_m: int | None = None
    tile_k: int | None = None
    tile_n: int | None = None
    TILES_IN_BLOCK_M: int | None = None
    TILES_IN_BLOCK_N: int | None = None
    TILES_IN_BLOCK_K: int | None = None
    TILES_IN_LOAD_M: int | None = None
    TILES_IN_LOAD_N: int | None = None
    TILES_IN_LOAD_K: int | None = None
    block_loop_order: LoopOrder | None = None
    tile_loop_order: LoopOrder | None = None
    float8_dtype: ElemFormat | None = None
    enable_scale_packing: bool = False
    spill_reload: bool = False
    enable_psum_copy_in: bool = False
    quant_scheme: QuantScheme | None = None
    output_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        self.validate("phase_config")

    @property
    def effective_tile_k(self) -> int:
        """The tile_k that sets the wrapX chunking (None -> 512, see the class docstring)."""
        return 512 if self.tile_k is None else self.tile_k

    def validate(self, name: str) -> None:
        """Check types and values; `name` prefixes the messages (e.g. ``phase1_config``)."""
        for f in ("tile_m", "tile_k", "tile_n") + tuple(
            f"TILES_IN_{kind}_{d}" for kind in ("BLOCK", "LOAD") for d in "MNK"
        ):
            v = getattr(self, f)
            _check_type(f"{name}.{f}", v, int, allow_none=True)
            if v is not None and v <= 0:
                raise BwdValidationError(f"{name}.{f}: expected a positive int, got {v}")
        if self.tile_k is not None and self.tile_k not in (128, 256, 512):
            raise BwdValidationError(f"{name}.tile_k: expected 128, 256 or 512, got {self.tile_k}")
        if self.tile_m is not None and self.tile_m > 128:
            raise BwdValidationError(f"{name}.tile_m: expected <= 128, got {self.tile_m}")
        if self.tile_n is not None and self.tile_n > 512:
            raise BwdValidationError(f"{name}.tile_n: expected <= 512, got {self.tile_n}")
        for d in "MNK":
            blk = getattr(self, f"TILES_IN_BLOCK_{d}") or 1
            load = getattr(self, f"TILES_IN_LOAD_{d}") or 1
            if blk % load:
                raise BwdValidationError(
                    f"{name}.TILES_IN_LOAD_{d}: expected a divisor of TILES_IN_BLOCK_{d}={blk}, "
                    f"got {load}"
                )
        load_n = self.TILES_IN_LOAD_N or 1
        if load_n * (self.tile_n or 512) > 1024:
            raise BwdValidationError(
                f"{name}.TILES_IN_LOAD_N: expected TILES_IN_LOAD_N * tile_n <= 1024, got "
                f"{load_n} * {self.tile_n or 512}"
            )
        for f in ("block_loop_order", "tile_loop_order"):
            v = getattr(self, f)
            if v is not None:
                setattr(self, f, _coerce_enum(f"{name}.{f}", v, LoopOrder))
        if self.float8_dtype is not None:
            fmt = _coerce_enum(f"{name}.float8_dtype", self.float8_dtype, ElemFormat)
            if fmt is not ElemFormat.E4M3FN:
                raise BwdValidationError(f"{name}.float8_dtype: expected e4m3fn, got {fmt.value}")
            self.float8_dtype = fmt
        for f in ("enable_scale_packing", "spill_reload", "enable_psum_copy_in"):
            _check_type(f"{name}.{f}", getattr(self, f), bool, allow_none=False)
        if self.quant_scheme is not None:
            self.quant_scheme = _coerce_scheme(f"{name}.quant_scheme", self.quant_scheme)
        _check_type(f"{name}.output_dtype", self.output_dtype, torch.dtype, allow_none=True)


def default_phase_config(quant_scheme: QuantScheme = QuantScheme.WRAPX) -> MatmulMxfp8KernelConfig:
    """The config's own default phase config: one-tile blocking, ``spill_reload=True``,
    ``enable_scale_packing=True`` (spec §8, errata 5)."""
    return MatmulMxfp8KernelConfig(
        enable_scale_packing=True, spill_reload=True, quant_scheme=quant_scheme
    )


_SWIZZLE_FIELDS = (
    "output_grad_swizzle_mode",
    "down_weight_swizzle_mode",
    "d_gate_up_swizzle_mode",
    "gate_up_weight_swizzle_mode",
    "d_gate_up_t_swizzle_mode",
    "hidden_states_t_swizzle_mode",
    "output_grad_t_swizzle_mode",
    "scaled_intermediate_t_swizzle_mode",
)


@dataclass
class MXFP8MOEBwdConfig:
    """Every non-tensor knob of `blockwise_mm_bwd_mxfp8` (bwd spec §8, newest generation G3).

    Fields that change results:

    - ``quant_scheme`` (``WRAPX`` | ``1x32``) and each phase config's ``tile_k``: MX grouping (§5.3).
    - ``phase1_config.enable_scale_packing`` / ``phase2_config.enable_scale_packing``: layout of
      the scales of a pre-quantized down / gate-up weight (§5.5; the default phase configs pack).
    - ``fast_dma_transpose``: errata 1 — with ``H ≡ 384 (mod 512)`` and phase-1 tile_k 512 the
      phase-1 contraction (K = H) ends in ONE 384-chunk (lane stride 96) instead of 256 + 128.
    - ``affinity_option``, ``clamp_limits``, ``bias``, ``accumulate_hidden_states_grad``,
      ``single_expert_dense``, ``skip_dma``, ``skip_grad_initialization``: semantics (§4, §9).
    - ``compute_dtype`` (must be bf16), ``fp8_x4_dtype`` (must be E4M3FN), ``activation_type``
      (must be SiLU), ``shard_option`` (must be SHARD_ON_FREE): fixed by the kernel.

    Performance only (accepted, validated, recorded; they do not change any result):
    the phase configs' blocking/tiles/loop orders/``spill_reload``/``enable_psum_copy_in``,
    ``phase3_transpose_mode``, ``phase4_transpose_mode``, the eight ``*_swizzle_mode`` fields and
    ``pe_transpose_only``.

    Defaults follow G3: ``config=None`` selects ``single_expert_dense=True`` with PE swizzles,
    valid only for E = 1 dense inputs. Use `MXFP8MOEBwdConfig.routed` for routed inputs.
    ``skip_grad_initialization=True``: the device then accumulates onto whatever its output
    buffers hold; the reference's outputs are fresh zeros, so the flag has no effect there.
    """

    compute_dtype: torch.dtype = torch.bfloat16
    fp8_x4_dtype: ElemFormat = ElemFormat.E4M3FN
    activation_type: ActFnType = ActFnType.SiLU
    shard_option: ShardOption = ShardOption.SHARD_ON_FREE
    affinity_option: AffinityOption = AffinityOption.AFFINITY_ON_I
    quant_scheme: QuantScheme = QuantScheme.WRAPX
    phase1_config: MatmulMxfp8KernelConfig | None = None
    phase2_config: MatmulMxfp8KernelConfig | None = None
    phase3_config: MatmulMxfp8KernelConfig | None = None
    phase4_config: MatmulMxfp8KernelConfig | None = None
    accumulate_hidden_states_grad: bool = False
    skip_grad_initialization: bool = False
    single_expert_dense: bool = True
    fast_dma_transpose: bool = False
    pe_transpose_only: bool = False
    clamp_limits: ClampLimits | None = field(default_factory=ClampLimits)
    skip_dma: SkipMode | None = None
    bias: bool = False
    phase3_transpose_mode: TransposeMode = TransposeMode.NC
    phase4_transpose_mode: TransposeMode = TransposeMode.NC
    output_grad_swizzle_mode: SwizzleMode = SwizzleMode.PE
    down_weight_swizzle_mode: SwizzleMode = SwizzleMode.PE
    d_gate_up_swizzle_mode: SwizzleMode = SwizzleMode.PE
    gate_up_weight_swizzle_mode: SwizzleMode = SwizzleMode.PE
    d_gate_up_t_swizzle_mode: SwizzleMode = SwizzleMode.PE
    hidden_states_t_swizzle_mode: SwizzleMode = SwizzleMode.PE
    output_grad_t_swizzle_mode: SwizzleMode = SwizzleMode.PE
    scaled_intermediate_t_swizzle_mode: SwizzleMode = SwizzleMode.PE

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def routed(cls, top_k: int = 1, **overrides: Any) -> MXFP8MOEBwdConfig:
        """Config for the routed (multi-block, multi-expert) path as the upstream tests build it.

        ``single_expert_dense=False``, all eight swizzle modes ``DGT``,
        ``skip_dma=SkipMode(skip_token=True)`` (padding ids are -1) and
        ``accumulate_hidden_states_grad = top_k > 1``; `overrides` replace any field.
        """
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
            raise BwdValidationError(f"top_k: expected a positive int, got {top_k!r}")
        kwargs: dict[str, Any] = {
            "single_expert_dense": False,
            "skip_dma": SkipMode(skip_token=True),
            "accumulate_hidden_states_grad": top_k > 1,
        }
        kwargs.update({f: SwizzleMode.DGT for f in _SWIZZLE_FIELDS})
        kwargs.update(overrides)
        return cls(**kwargs)

    def phase_configs(self) -> tuple[MatmulMxfp8KernelConfig, ...]:
        """The four filled phase configs (P1..P4)."""
        return tuple(getattr(self, f"phase{i}_config") for i in range(1, 5))

    @property
    def effective_skip_dma(self) -> SkipMode:
        """``skip_dma`` with None resolved as at kernel entry: ``SkipMode(False, False)``."""
        return self.skip_dma if self.skip_dma is not None else SkipMode()

    def validate(self) -> None:
        """Type and value checks of bwd spec §10 that do not depend on the tensors.

        Fills the phase configs (None -> the default phase config) and propagates
        ``quant_scheme`` into them; a phase config whose explicit scheme differs raises.
        """
        if not isinstance(self.compute_dtype, torch.dtype):
            raise BwdConfigTypeError(
                f"compute_dtype: expected torch.dtype, got {type(self.compute_dtype).__name__}"
            )
        if self.compute_dtype != torch.bfloat16:
            raise BwdValidationError(
                f"compute_dtype: only torch.bfloat16 is supported, got {self.compute_dtype}"
            )
        self.fp8_x4_dtype = _coerce_enum("fp8_x4_dtype", self.fp8_x4_dtype, ElemFormat)
        if self.fp8_x4_dtype is not ElemFormat.E4M3FN:
            raise BwdValidationError(
                f"fp8_x4_dtype: only float8_e4m3fn_x4 is supported, got {self.fp8_x4_dtype.value}"
            )
        self.activation_type = _coerce_enum("activation_type", self.activation_type, ActFnType)
        if self.activation_type is not ActFnType.SiLU:
            raise BwdValidationError(
                f"activation_type: only SiLU is implemented, got {self.activation_type.name}"
            )
        self.shard_option = _coerce_enum("shard_option", self.shard_option, ShardOption)
        if self.shard_option is not ShardOption.SHARD_ON_FREE:
            raise BwdValidationError(
                f"shard_option: only SHARD_ON_FREE is supported, got {self.shard_option.name}"
            )
        self.affinity_option = _coerce_enum("affinity_option", self.affinity_option, AffinityOption)
        self.quant_scheme = _coerce_scheme("quant_scheme", self.quant_scheme)
        for i in range(1, 5):
            name = f"phase{i}_config"
            pc = getattr(self, name)
            if pc is None:
                pc = default_phase_config(self.quant_scheme)
                setattr(self, name, pc)
            if not isinstance(pc, MatmulMxfp8KernelConfig):
                raise BwdConfigTypeError(
                    f"{name}: expected MatmulMxfp8KernelConfig, got {type(pc).__name__}"
                )
            pc.validate(name)
            if pc.quant_scheme is None:
                pc.quant_scheme = self.quant_scheme
            elif pc.quant_scheme is not self.quant_scheme:
                raise BwdValidationError(
                    f"{name}.quant_scheme: all four phases must use quant_scheme="
                    f"{self.quant_scheme.name}, got {pc.quant_scheme.name}"
                )
        for f in (
            "accumulate_hidden_states_grad",
            "skip_grad_initialization",
            "single_expert_dense",
            "fast_dma_transpose",
            "pe_transpose_only",
            "bias",
        ):
            _check_type(f, getattr(self, f), bool, allow_none=False)
        if self.clamp_limits is None:
            raise BwdValidationError(
                "clamp_limits: expected a ClampLimits (may be all None), got None"
            )
        _check_type("clamp_limits", self.clamp_limits, ClampLimits, allow_none=False)
        _check_type("skip_dma", self.skip_dma, SkipMode, allow_none=True)
        for f in ("phase3_transpose_mode", "phase4_transpose_mode"):
            v = getattr(self, f)
            if not isinstance(v, TransposeMode):
                raise BwdConfigTypeError(f"{f}: expected TransposeMode, got {type(v).__name__}")
        for f in _SWIZZLE_FIELDS:
            v = getattr(self, f)
            if not isinstance(v, SwizzleMode):
                raise BwdValidationError(
                    f"{f}: expected SwizzleMode.DGT or SwizzleMode.PE, got {v!r}"
                )
        if self.pe_transpose_only:
            if not self.single_expert_dense:
                raise BwdValidationError(
                    "pe_transpose_only: requires single_expert_dense=True, got False"
                )
            if self.fast_dma_transpose:
                raise BwdValidationError(
                    "pe_transpose_only: requires fast_dma_transpose=False, got True"
                )
            for f in ("phase3_transpose_mode", "phase4_transpose_mode"):
                if getattr(self, f) is not TransposeMode.NC:
                    raise BwdValidationError(
                        f"{f}: pe_transpose_only requires NC, got {getattr(self, f).name}"
                    )
            for f in _SWIZZLE_FIELDS:
                if getattr(self, f) is not SwizzleMode.PE:
                    raise BwdValidationError(
                        f"{f}: pe_transpose_only requires PE, got {getattr(self, f).name}"
                    )
        if self.single_expert_dense:
            if self.accumulate_hidden_states_grad:
                raise BwdValidationError(
                    "accumulate_hidden_states_grad: single_expert_dense requires False, got True"
                )
            if self.bias:
                raise BwdValidationError("bias: single_expert_dense requires False, got True")
