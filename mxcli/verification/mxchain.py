"""The tolerance of results that pass through an fp32 matmul, a bf16 rounding and an MX quantization.

Why a tolerance at all. Two correct emulations of the same kernel (the reference and a plain
oracle, the reference on two CPUs, the reference and the NKI interpreter) sum their fp32 matmul
products in different orders: BLAS picks the order from the CPU (MKL differs between AVX2 and
AVX-512/AMX) and ATen's reductions from its vector width. The fp32 results then differ in their
last bits, and rarely that moves a bf16 rounding by one step. Two things follow:

1. **Within 2 bf16 ulps.** A value that is only rounded to bf16 (and perhaps summed again in
   fp32 and rounded once more) moves by at most one bf16 ulp per rounding it passes through. The
   bound is 2 ulps of the golden value, the ulp taken at ``max(|golden|, floor * max|golden|)``:
   near zero (cancellation) the error scales with the summands, not with the result.
2. **One fp8 code step, for a bounded fraction.** When a flipped bf16 value is then MX-quantized,
   its E4M3 code moves by one code whenever the flip crosses an E4M3 rounding boundary (about
   one flip in 16: there are 2^5 bf16 values per E4M3 step in a binade). The dequantized value then
   moves by one E4M3 code step at the group's scale, which is at most 2^-3 of the largest
   magnitude in the group (``2^(floor(log2 amax) - 3)``). If that operand feeds another matmul,
   the step is multiplied by the other operand: an output element moves by at most
   ``step(row max of the quantized operand) * max|other operand|`` (`propagated_step_bound`).
   Such a flip touches one row (or column) of the consumer's output, so only a small fraction of
   the elements may be stepped (``max_step_frac``, 1% by default); every other element stays
   within the 2 ulps of (1).

`compare_chain` sorts every element into *identical*, *within* (1), *stepped* (2) or *beyond*, and
passes when nothing is beyond and at most ``max_step_frac`` of the elements are stepped.
`mxcli.verification.compare` uses it for the ``chain`` tolerance kind (``verify``); the kernel
tests use it with the exact per-element bound from the operands.

Not covered (and so reported as a failure if it happened): a flip of a group's largest element
across a power of two, which changes the group's scale byte and so re-rounds all 32 elements.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BF16_MANTISSA_BITS = 7
E4M3_MANTISSA_BITS = 3
E4M3_MIN_NORMAL_EXP = -6


def _floor_log2(x: torch.Tensor) -> torch.Tensor:
    """``floor(log2 x)`` of positive finite fp32/fp64 values, exactly (from the exponent)."""
    _, exp = torch.frexp(x)
    return (exp - 1).to(x.dtype)


def _pow2_floor(x: torch.Tensor) -> torch.Tensor:
    """``2^floor(log2 x)`` of positive normal fp64 values: the exponent bits alone (cheap)."""
    return (x.view(torch.int64) & 0x7FF0000000000000).view(torch.float64)


def bf16_ulp(x: torch.Tensor, floor: float = 0.0) -> torch.Tensor:
    """The bf16 spacing at ``max(|x|, floor)``: ``2^(floor(log2 |x|) - 7)`` (fp64).

    ``floor`` must be positive when ``x`` may hold zeros (the ulp of 0 is the smallest subnormal,
    which no accumulation-order difference respects)."""
    a = x.detach().double().abs().clamp_min(max(floor, 2.0**-133))
    return _pow2_floor(a) * 2.0**-BF16_MANTISSA_BITS


def e4m3_code_step(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """One E4M3 code step at each dequantized value's magnitude and group scale (fp64).

    ``values`` are dequantized MX values and ``scales`` their group scales ``2^(byte - 127)``
    (broadcastable). The step of ``|v|/X`` is ``2^(max(floor(log2 |v|/X), -6) - 3)`` (subnormals
    below ``2^-6``). Taken at the larger of two neighbouring codes it is their distance, also
    across a binade (``1.875 * 2^e`` and ``2^(e+1)`` are ``2^(e-3)`` apart).
    """
    x = scales.detach().double()
    m = (values.detach().double().abs() / x).clamp(2.0**E4M3_MIN_NORMAL_EXP, 448.0)
    return torch.exp2(_floor_log2(m) - E4M3_MANTISSA_BITS) * x


def propagated_step_bound(
    quantized: torch.Tensor, other: torch.Tensor, *, flipped: str = "left"
) -> torch.Tensor:
    """Bound on how far one flipped E4M3 code of an MX operand moves ``left @ right`` (fp64).

    ``quantized`` is the dequantized MX operand whose code may flip, ``other`` the second
    operand (natural matmul shapes: ``left [M, K] @ right [K, N]``). ``flipped="left"``: a flip of
    ``left[i, k]`` by one code step (at most ``2^(floor(log2 max_k |left[i, k]|) - 3)``, the
    step at the row's largest group scale) moves ``out[i, j]`` by that step times
    ``|right[k, j]| <= max_k |right[k, j]|``. ``flipped="right"`` is the transpose. Returns
    ``[M, N]``.
    """
    q = quantized.detach().double().abs()
    o = other.detach().double().abs()
    if flipped == "left":
        step = _row_step(q.amax(dim=1))  # [M]
        return step[:, None] * o.amax(dim=0)[None, :]
    if flipped == "right":
        step = _row_step(q.amax(dim=0))  # [N]
        return o.amax(dim=1)[:, None] * step[None, :]
    raise ValueError(f"flipped: expected 'left' or 'right', got {flipped!r}")


def _row_step(amax: torch.Tensor) -> torch.Tensor:
    """One E4M3 code step at the largest group scale of a line with maximum ``amax``
    (0 for an all-zero line: nothing there can flip)."""
    step = torch.exp2(_floor_log2(amax.clamp_min(2.0**-1000)) - E4M3_MANTISSA_BITS)
    return torch.where(amax > 0, step, torch.zeros_like(step))


@dataclass(frozen=True)
class ChainTolerance:
    """``ulps`` bf16 ulps for everything (ulp floor ``ulp_floor_of_max * max|golden|``); at most
    ``max_step_frac`` of the elements may in addition be one fp8 code step away."""

    ulps: float = 2.0
    ulp_floor_of_max: float = 2.0**-12
    max_step_frac: float = 0.01

    def describe(self) -> str:
        return (
            f"{self.ulps:g} bf16 ulps, <= {self.max_step_frac:.3g} one fp8 step"
            if self.max_step_frac
            else f"{self.ulps:g} bf16 ulps"
        )


@dataclass(frozen=True)
class ChainResult:
    """How the elements of one comparison fall into the model's classes."""

    numel: int
    identical: int
    within: int  # not identical, within the ulps
    stepped: int  # beyond the ulps, within ulps + one code step
    beyond: int  # outside the model
    allowed_steps: int
    worst_excess: float  # max |diff| / allowed over the elements beyond (0 when none)

    @property
    def passed(self) -> bool:
        return self.beyond == 0 and self.stepped <= self.allowed_steps

    def describe(self) -> str:
        parts = [f"{self.identical}/{self.numel} identical", f"{self.within} within ulps"]
        parts.append(f"{self.stepped} one fp8 step away (<= {self.allowed_steps} allowed)")
        if self.beyond:
            parts.append(f"{self.beyond} beyond (worst {self.worst_excess:.3g}x the bound)")
        return ", ".join(parts)


def compare_chain(
    actual: torch.Tensor,
    expected: torch.Tensor,
    step_bound: torch.Tensor | float,
    tol: ChainTolerance = ChainTolerance(),
) -> ChainResult:
    """Classify ``actual`` against the golden ``expected`` under the model (see the module doc).

    ``step_bound``: per element (broadcastable) or scalar bound of one fp8 code step (at the
    element's group scale for MX values, `propagated_step_bound` for matmul outputs). Non-finite
    elements must sit at the same places with the same values, else they count as beyond.
    """
    a = actual.detach().double().reshape(expected.shape)
    b = expected.detach().double()
    finite = torch.isfinite(a) & torch.isfinite(b)
    all_finite = bool(finite.all())
    babs = b.abs().where(finite, torch.zeros_like(b))
    bmax = float(babs.max()) if b.numel() else 0.0
    diff = (a - b).abs().where(finite, torch.zeros_like(a))
    equal = diff == 0
    if not all_finite:
        equal = (equal & finite) | (torch.isnan(a) & torch.isnan(b)) | (~finite & (a == b))
    n = b.numel()
    ulp = bf16_ulp(babs, tol.ulp_floor_of_max * bmax)
    within_ulps = diff <= tol.ulps * ulp
    bound = tol.ulps * ulp + torch.as_tensor(step_bound, dtype=torch.float64)
    out_of_ulps = ~within_ulps  # non-finite elements have diff 0: within
    outside = diff > bound
    beyond = outside if all_finite else (outside | ~equal & ~finite)
    n_beyond = int(beyond.sum())
    worst = float((diff / bound.clamp_min(1e-300))[outside].max()) if bool(outside.any()) else 0.0
    return ChainResult(
        numel=n,
        identical=int(equal.sum()),
        within=int((within_ulps & ~equal).sum()),
        stepped=int((out_of_ulps & ~outside).sum()),
        beyond=n_beyond,
        allowed_steps=int(tol.max_step_frac * n),
        worst_excess=worst,
    )


__all__ = [
    "ChainResult",
    "ChainTolerance",
    "bf16_ulp",
    "compare_chain",
    "e4m3_code_step",
    "propagated_step_bound",
]
