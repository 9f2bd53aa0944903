"""Numeric building blocks shared by the forward and backward references.

`Numerics` is the one switch between kernel emulation and exact fp32: every MXFP8 matmul operand
goes through `Numerics.q` and every on-chip rounding to bf16 through `Numerics.bf`, so both modes
run the same code path.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from mxcli.io.kwargs import coerce_enum
from mxcli.kernels.blockwise_moe.config import (
    BwdValidationError,
    ClampLimits,
    MatmulMxfp8KernelConfig,
)
from mxcli.mx import ElemFormat, QuantScheme, ScaleRule, fake_quantize_mx
from mxcli.mx.quantize import uses_fused_kernels

__all__ = [
    "Emulate",
    "Grouping",
    "Numerics",
    "as_emulate",
    "mx_rule",
    "clamp_masks",
    "ordered_scatter",
    "silu",
    "silu_grad",
]


class Emulate(str, enum.Enum):
    """What the reference computes.

    - ``KERNEL``: the device numerics. Every matmul operand is MXFP8 (E4M3FN elements, one E8M0
      scale per 32 elements along the contraction axis, NEURON scale rule
      ``byte = clamp(expfield(amax) − 7, 0, 255)``, round-to-nearest-even; bwd spec §5), products
      accumulate in fp32, and values are rounded to bf16 (RNE) exactly where the kernel stores
      them (bwd spec §2.4 forward, §6 backward). Outputs have the kernel's dtypes.
    - ``EXACT``: the same data flow in fp32 with no quantization and no bf16 rounding at all
      (outputs fp32). This is the unquantized golden of bwd spec §11.2 and matches autograd.
    """

    KERNEL = "kernel"
    EXACT = "exact"


def as_emulate(emulate: Emulate | str) -> Emulate:
    """The enum from itself or its value or name, any case (`coerce_enum`)."""
    return coerce_enum(
        Emulate, emulate, "emulate", expected="'kernel' or 'exact'", error=BwdValidationError
    )


# Scale rule of every `Numerics.q` in kernel mode: the device's NEURON rule unless a study
# (`mxcli.emulate`) asks for OCP's, or for None = no MX quantization (the same chain with every
# bf16 rounding point kept: a like-for-like bf16 baseline). Not part of the device contract.
_MX_RULE: contextvars.ContextVar[ScaleRule | None] = contextvars.ContextVar(
    "mxcli_mx_rule", default=ScaleRule.NEURON
)


@contextlib.contextmanager
def mx_rule(rule: ScaleRule | None) -> Iterator[None]:
    """Within the block, kernel-mode quantization uses `rule` (None: operands pass unquantized)."""
    token = _MX_RULE.set(rule)
    try:
        yield
    finally:
        _MX_RULE.reset(token)


Chunks = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Grouping:
    """MX grouping along one contraction axis (bwd spec §5.3).

    ``scheme`` WRAPX (chunks of ``tile_k``, then 256, then 128, 4-lane interleave) or 1x32;
    ``chunks`` overrides the wrapX chunk list (errata 1: fast-DMA 384-chunk).
    """

    scheme: QuantScheme = QuantScheme.WRAPX
    tile_k: int = 512
    chunks: Chunks | None = None

    @staticmethod
    def make(
        scheme: QuantScheme, tile_k: int, K: int | None = None, fast_dma_transpose: bool = False
    ) -> Grouping:
        """Grouping for a contraction of length `K`.

        Errata 1: with ``fast_dma_transpose``, WRAPX, tile_k 512 and ``K ≡ 384 (mod 512)`` the
        last 384 elements form ONE 384-chunk (lane stride 96) instead of 256 + 128. Only phase 1
        (K = H) can meet that condition (P2 has K = 2I ≡ 0 or 256 mod 512, P3/P4 K = B a power
        of two), and only phase 1 passes the flag.
        """
        chunks: Chunks | None = None
        if (
            fast_dma_transpose
            and K is not None
            and scheme is QuantScheme.WRAPX
            and tile_k == 512
            and K % 512 == 384
        ):
            head = K - 384
            chunks = tuple((k, 512) for k in range(0, head, 512)) + ((head, 384),)
        return Grouping(scheme, tile_k, chunks)

    @staticmethod
    def for_phase(
        pc: MatmulMxfp8KernelConfig, K: int | None = None, fast_dma_transpose: bool = False
    ) -> Grouping:
        """Grouping of a phase (its scheme and effective tile_k) for contraction length `K`."""
        scheme = pc.quant_scheme or QuantScheme.WRAPX
        return Grouping.make(scheme, pc.effective_tile_k, K, fast_dma_transpose)


class Numerics:
    """Kernel emulation (`Emulate.KERNEL`) or exact fp32 (`Emulate.EXACT`) primitives."""

    def __init__(self, emulate: Emulate | str) -> None:
        self.emulate = as_emulate(emulate)
        self.exact = self.emulate is Emulate.EXACT
        # Dtype activations are held in between ops: the kernel's HBM/SBUF copies are bf16.
        self.store_dtype = torch.float32 if self.exact else torch.bfloat16

    def bf(self, x: torch.Tensor) -> torch.Tensor:
        """Round to bf16 (RNE) and back to fp32; identity in exact mode."""
        if self.exact:
            return x
        return x.to(torch.bfloat16).to(torch.float32)

    def rb(self, x: torch.Tensor) -> torch.Tensor:
        """Round to bf16 (RNE) and keep the bf16 dtype (fp32 in exact mode).

        Later fp32 ops read such tensors exactly (type promotion), and a product of two bf16
        tensors is computed in fp32 (exact) and rounded once, i.e. ``bf16(a·b)``.
        """
        if self.exact:
            return x
        return x.to(torch.bfloat16)

    def q(self, x: torch.Tensor, axis: int, grouping: Grouping) -> torch.Tensor:
        """MXFP8 quantize-dequantize along the contraction `axis` (fp32 result); exact: fp32 copy."""
        rule = _MX_RULE.get()
        if self.exact or rule is None:
            return x.to(torch.float32)
        if (
            x.dtype == torch.bfloat16
            and grouping.scheme is QuantScheme.WRAPX
            and x.is_contiguous()
            and not uses_fused_kernels(x)
        ):
            # Performance only (values are identical): mxcli.mx's pure-torch wrapX path runs
            # faster on fp32 rows than on bf16 ones (the fused kernels read bf16 directly).
            x = x.to(torch.float32)
        return fake_quantize_mx(
            x,
            axis,
            elem=ElemFormat.E4M3FN,
            rule=rule,
            scheme=grouping.scheme,
            tile_k=grouping.tile_k,
            chunks=None if grouping.chunks is None else list(grouping.chunks),
        )

    def out(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Cast a result to its output dtype (exact mode keeps fp32)."""
        return x if self.exact else x.to(dtype)


def silu(g: torch.Tensor) -> torch.Tensor:
    """``φ(g) = g·σ(g)`` in fp32 (bwd spec §2.2)."""
    return g * torch.sigmoid(g)


def silu_grad(g: torch.Tensor) -> torch.Tensor:
    """``φ'(g) = σ(g)·(1 + g·(1 − σ(g)))`` in fp32 (bwd spec §2.2)."""
    s = torch.sigmoid(g)
    return s * (1.0 + g * (1.0 - s))


def clamp_forward(g: torch.Tensor, u: torch.Tensor, limits: ClampLimits | None) -> None:
    """In place: ``g ← clip(g, nl_lower, nl_upper)``, ``u ← clip(u, l_lower, l_upper)`` (§2.1)."""
    if limits is None:
        return
    lo, hi = limits.non_linear_clamp_lower_limit, limits.non_linear_clamp_upper_limit
    if lo is not None or hi is not None:
        g.clamp_(lo, hi)
    lo, hi = limits.linear_clamp_lower_limit, limits.linear_clamp_upper_limit
    if lo is not None or hi is not None:
        u.clamp_(lo, hi)


def _strict_mask(x: torch.Tensor, lo: float | None, hi: float | None) -> torch.Tensor | None:
    m: torch.Tensor | None = None
    if hi is not None:
        m = x < hi
    if lo is not None:
        m2 = x > lo
        m = m2 if m is None else m & m2
    return m


def clamp_masks(
    g: torch.Tensor, u: torch.Tensor, limits: ClampLimits | None
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Gradient masks of bwd spec §4.2 on the checkpoint values, strict inequalities.

    Returns ``(mask_nl, mask_l)``; None where no bound is set (all true).
    """
    if limits is None:
        return None, None
    return (
        _strict_mask(g, limits.non_linear_clamp_lower_limit, limits.non_linear_clamp_upper_limit),
        _strict_mask(u, limits.linear_clamp_lower_limit, limits.linear_clamp_upper_limit),
    )


def occurrence_rank(ids: torch.Tensor) -> torch.Tensor:
    """For each entry, how many earlier entries hold the same id (0 for the first)."""
    n = ids.numel()
    if n == 0:
        return torch.zeros(0, dtype=torch.int64, device=ids.device)
    sorted_ids, perm = torch.sort(ids, stable=True)
    _, counts = torch.unique_consecutive(sorted_ids, return_counts=True)
    run_start = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    rank = torch.empty(n, dtype=torch.int64, device=ids.device)
    rank[perm] = torch.arange(n, device=ids.device) - run_start
    return rank


def ordered_scatter(
    out: torch.Tensor,
    ids: torch.Tensor,
    vals: torch.Tensor,
    accumulate: bool,
    numerics: Numerics,
) -> None:
    """Write rows ``vals[j]`` to the zero-initialised ``out[ids[j]]`` in the order of j, as a
    block loop would.

    ``accumulate``: ``out[t] = bf16(out[t] + v)`` per write (read-add-write, bf16 stored);
    otherwise ``out[t] = v`` (the last write wins). A token's writes are applied in order of
    occurrence, one vectorized pass per occurrence rank (at most top-k passes). The first write
    to a token lands on zero, where ``bf16(0 + v) = v`` for the bf16 values written, so it is a
    plain store.
    """
    if ids.numel() == 0:
        return
    rank = occurrence_rank(ids)
    for r in range(int(rank.max()) + 1):
        sel = (rank == r).nonzero().squeeze(1)
        t = ids.index_select(0, sel)
        v = vals.index_select(0, sel)
        if accumulate and r > 0:
            summed = out.index_select(0, t).to(torch.float32) + v
            out.index_copy_(0, t, numerics.rb(summed).to(out.dtype))
        else:
            out.index_copy_(0, t, v.to(out.dtype))
