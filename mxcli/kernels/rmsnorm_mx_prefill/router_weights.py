"""Offline router-weight arrangement for ``rmsnorm_mx_prefill`` (prefill spec §6.1).

The kernel contracts the router against its swizzle-transposed activations, whose partition
axis is the swizzle slot ``s = h512*512 + q*128 + p`` holding natural row
``h = h512*512 + 4p + q`` (`mxcli.mx.swizzle_h_index`). The host therefore stores the router
weight rows in slot order; NOAUX_TC loads the weight contiguously as ``[128, H/128, E]`` and
needs one more "partition transpose" of the slot-ordered weight.

Both functions are pure row permutations: any dtype, any device, bit-exact round trips.
"""

from __future__ import annotations

from typing import Any

import torch

from mxcli.kernels.rmsnorm_mx_prefill.contract import (
    HIDDEN_MULTIPLE,
    PrefillValidationError,
    RouterActFnType,
)
from mxcli.mx import swizzle_h_index, unswizzle_h_index
from mxcli.mx.formats import as_tensor

_PARTITIONS = 128


def _check(name: str, w: Any) -> torch.Tensor:
    t = as_tensor(w)
    if t.dim() != 2:
        raise PrefillValidationError(
            f"{name}: expected an [H, E] tensor (rank 2), got shape {tuple(t.shape)}"
        )
    H = int(t.shape[0])
    if H <= 0 or H % HIDDEN_MULTIPLE:
        raise PrefillValidationError(
            f"{name}: expected H (dim 0) a positive multiple of 512, got H={H}"
        )
    return t


def arrange_router_weights(
    w_natural: torch.Tensor, act_fn: RouterActFnType | str | int = RouterActFnType.SIGMOID
) -> torch.Tensor:
    """Natural-order router weight ``[H, E]`` -> the kernel's arranged ``[H, E]`` (spec §6.1).

    - SIGMOID / SOFTMAX: ``W_in = W_nat[swizzle_h_index(H)]`` (row ``r`` = slot ``r``).
    - NOAUX_TC: additionally partition-transposed:
      ``W_in = W_swz.reshape(H/128, 128, E).transpose(0, 1).reshape(H, E)``, so row
      ``p*(H/128) + t`` holds natural row ``(t//4)*512 + 4p + t%4``.
    """
    w = _check("w_natural", w_natural)
    act = RouterActFnType.coerce(act_fn, "act_fn")
    H, E = (int(d) for d in w.shape)
    w_swz = w.index_select(0, swizzle_h_index(H).to(w.device))  # [H, E], row = swizzle slot
    if act is RouterActFnType.NOAUX_TC:
        # [H/128 (t), 128 (p), E] -> [128 (p), H/128 (t), E]: the contiguous [128, H/128, E] load
        w_swz = w_swz.view(H // _PARTITIONS, _PARTITIONS, E).transpose(0, 1).reshape(H, E)
    return w_swz.contiguous()


def unarrange_router_weights(
    w_arranged: torch.Tensor, act_fn: RouterActFnType | str | int = RouterActFnType.SIGMOID
) -> torch.Tensor:
    """Inverse of `arrange_router_weights`: arranged ``[H, E]`` -> natural-order ``[H, E]``."""
    w = _check("w_arranged", w_arranged)
    act = RouterActFnType.coerce(act_fn, "act_fn")
    H, E = (int(d) for d in w.shape)
    if act is RouterActFnType.NOAUX_TC:
        # [128 (p), H/128 (t), E] -> [H/128 (t), 128 (p), E] = slot order
        w = w.reshape(_PARTITIONS, H // _PARTITIONS, E).transpose(0, 1).reshape(H, E)
    # W_nat[swizzle_h_index[s]] = W_swz[s]  <=>  W_nat[h] = W_swz[unswizzle_h_index[h]]
    return w.index_select(0, unswizzle_h_index(H).to(w.device)).contiguous()
