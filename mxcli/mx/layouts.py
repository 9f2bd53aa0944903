"""Byte layouts shared by encoders and decoders: x4 packing, the prefill H swizzle, and the
scale-byte offsets of a packed prefill row."""

from __future__ import annotations

import sys
from typing import Any

import torch

from mxcli.errors import InputError
from mxcli.mx.formats import as_tensor


def pack_x4(codes: Any, axis: int = -1) -> torch.Tensor:
    """Pack 4 consecutive fp8 codes along `axis` into one little-endian uint32.

    Byte ``k`` of word ``w`` is element ``4w + k`` (the ``float8_*_x4`` dtypes, bwd spec §5.1).
    The axis length must be a multiple of 4; the result has it divided by 4.
    """
    c = as_tensor(codes)
    if c.dtype != torch.uint8:
        raise InputError(f"codes: expected dtype uint8, got {c.dtype}")
    ax = axis % c.dim()
    if c.shape[ax] % 4:
        raise InputError(f"codes: axis {ax} length must be a multiple of 4, got {c.shape[ax]}")
    last = c.movedim(ax, -1).contiguous()
    if sys.byteorder == "little":
        words = last.view(torch.uint32)  # byte k of a LE word is element k: a free view
    else:
        b = last.reshape(*last.shape[:-1], -1, 4).to(torch.int64)
        w64 = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)
        words = w64.to(torch.uint32)
    return words if ax == c.dim() - 1 else words.movedim(-1, ax).contiguous()


def unpack_x4(words: Any, axis: int = -1) -> torch.Tensor:
    """Inverse of `pack_x4`: uint32 (or int32 bit pattern) words -> uint8 codes, axis x 4."""
    w = as_tensor(words)
    if w.dtype not in (torch.uint32, torch.int32):
        raise InputError(f"words: expected dtype uint32, got {w.dtype}")
    ax = axis % w.dim()
    last = w.movedim(ax, -1).contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    shifts = torch.tensor([0, 8, 16, 24], dtype=torch.int64, device=last.device)
    b = ((last.unsqueeze(-1) >> shifts) & 0xFF).to(torch.uint8)
    return b.reshape(*last.shape[:-1], -1).movedim(-1, ax).contiguous()


def _num_h512(H: int) -> int:
    if H <= 0 or H % 512:
        raise InputError(f"H: expected a positive multiple of 512, got {H}")
    return H // 512


def swizzle_h_index(H: int) -> torch.Tensor:
    """Prefill spec §6.1: swizzle slot ``s = h512*512 + q*128 + p`` -> natural ``h512*512 + 4p + q``.

    ``router_weights_arranged = router_weights_natural[swizzle_h_index(H)]``.
    """
    nb = _num_h512(H)
    h512 = torch.arange(nb).view(nb, 1, 1)
    q = torch.arange(4).view(1, 4, 1)
    p = torch.arange(128).view(1, 1, 128)
    return (h512 * 512 + 4 * p + q).reshape(-1)


def unswizzle_h_index(H: int) -> torch.Tensor:
    """Inverse permutation of `swizzle_h_index`: natural ``h`` -> swizzle slot."""
    idx = swizzle_h_index(H)
    inv = torch.empty_like(idx)
    inv[idx] = torch.arange(H)
    return inv


def prefill_scale_region_size(H: int, pack_scales: bool) -> int:
    """Bytes of the scale region of a packed prefill row (prefill spec §2.4)."""
    nb = _num_h512(H)
    return 128 * ((nb + 3) // 4 if pack_scales else nb)


def prefill_scale_offsets(H: int, pack_scales: bool) -> torch.Tensor:
    """Byte offset, relative to ``H``, of the scale of group ``g`` (elements ``[32g, 32g+32)``).

    Prefill spec §4.2, with ``h512 = g // 16`` and ``b = g % 16``:
    folded   ``(h512 // 4)*128 + (b // 4)*32 + (h512 % 4)*4 + (b % 4)``;
    unfolded ``h512*128 + (b // 4)*32 + (b % 4)``.
    """
    nb = _num_h512(H)
    g = torch.arange(nb * 16)
    h512, b = g // 16, g % 16
    quadrant = (b // 4) * 32 + (b % 4)
    if pack_scales:
        return (h512 // 4) * 128 + (h512 % 4) * 4 + quadrant
    return h512 * 128 + quadrant
