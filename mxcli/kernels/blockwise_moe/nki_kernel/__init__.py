"""NKI kernel of ``blockwise_mm_bwd_mxfp8`` (package; see `phase1`)."""

from __future__ import annotations

from .phase1 import (
    SBUF_BUDGET,
    BwdKernelConfig,
    KTile,
    blockwise_mm_bwd_mxfp8_jit,
    blockwise_mm_bwd_mxfp8_nki,
)

__all__ = [
    "SBUF_BUDGET",
    "BwdKernelConfig",
    "KTile",
    "blockwise_mm_bwd_mxfp8_jit",
    "blockwise_mm_bwd_mxfp8_nki",
]
