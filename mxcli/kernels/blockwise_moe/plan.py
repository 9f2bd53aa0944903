"""Routing -> block plan (bwd spec §3): `token_position_to_id`, `block_to_expert` and the masked
affinity vector the blockwise MoE kernels read."""

from __future__ import annotations

from typing import Any

import torch

from mxcli.kernels.blockwise_moe.config import BwdValidationError
from mxcli.mx.formats import as_tensor

__all__ = [
    "build_block_plan",
    "build_dense_block_plan",
    "build_expert_affinities_masked",
    "num_blocks",
    "routing_mask",
]


def num_blocks(num_pairs: int, num_experts: int, block_size: int) -> int:
    """Static block count of the dropless plan (bwd spec §3.2):
    ``N = ceil((P − (E−1)) / B) + E − 1`` with ``P = T·K`` routed (token, expert) pairs.

    It is the worst case of ``Σ_e ceil(c_e / B)`` over all routings with ``Σ c_e = P``, so every
    routing fits. (With ``P < E − 1`` the ceiling is of a negative number, as upstream.)
    """
    e1 = num_experts - 1
    return -(-(num_pairs - e1) // block_size) + e1


def routing_mask(expert_index: Any, num_experts: int) -> torch.Tensor:
    """Bool ``[T, E]`` mask of routed (token, expert) pairs.

    `expert_index` is either integer choices ``[T, K]`` (each row lists K distinct experts) or
    dense affinities ``[T, E]`` (float or bool; nonzero = routed).
    """
    x = as_tensor(expert_index)
    if x.dim() != 2:
        raise BwdValidationError(f"expert_index: expected a 2-D tensor, got shape {tuple(x.shape)}")
    T = x.shape[0]
    if x.is_floating_point() or x.dtype == torch.bool:
        if x.shape[1] != num_experts:
            raise BwdValidationError(
                f"expert_index: dense affinities need shape (T, {num_experts}), got {tuple(x.shape)}"
            )
        return x != 0
    if x.numel() and (int(x.min()) < 0 or int(x.max()) >= num_experts):
        raise BwdValidationError(
            f"expert_index: expected expert ids in [0, {num_experts}), got "
            f"[{int(x.min())}, {int(x.max())}]"
        )
    xl = x.long()
    mask = torch.zeros(T, num_experts, dtype=torch.bool, device=x.device)
    mask.scatter_(1, xl, True)
    if int(mask.sum()) != x.numel():
        bad = int((mask.sum(1) != x.shape[1]).nonzero()[0, 0])
        raise BwdValidationError(
            f"expert_index: expected distinct experts per token, got {xl[bad].tolist()} for token {bad}"
        )
    return mask


def build_block_plan(
    expert_index: Any, num_experts: int, block_size: int, pad: int = -1
) -> tuple[torch.Tensor, torch.Tensor]:
    """The canonical dropless block plan of bwd spec §3.2.

    Args:
        expert_index: integer choices ``[T, K]`` (distinct experts per token) or dense
            affinities ``[T, E]`` (nonzero = routed; tokens may then have different fan-outs).
        num_experts: E.
        block_size: B, tokens per block.
        pad: padding marker (-1 for the MXFP8 kernels; any id outside ``[0, T)`` is padding).

    Returns:
        ``(token_position_to_id [N*B] int32, block_to_expert [N, 1] int32)`` with
        ``N = ceil((P − (E−1)) / B) + E − 1`` (`num_blocks`, P = routed pairs = T·K). Experts own
        contiguous block ranges in increasing expert order, ``ceil(c_e / B)`` blocks each (none
        for an expert without tokens); their tokens are written in increasing token id order,
        the rest of each range is `pad`; the surplus blocks (pure padding) go to expert E−1.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise BwdValidationError(f"block_size: expected a positive int, got {block_size!r}")
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts <= 0:
        raise BwdValidationError(f"num_experts: expected a positive int, got {num_experts!r}")
    mask = routing_mask(expert_index, num_experts)  # [T, E]
    device = mask.device
    E, B = num_experts, block_size
    counts = mask.sum(0)  # [E] c_e
    nb = (counts + B - 1) // B  # [E] ceil(c_e / B)
    P = int(counts.sum())
    N = num_blocks(P, E, B)
    surplus = N - int(nb.sum())
    if surplus < 0:  # cannot happen for this N (see num_blocks); guard the invariant
        raise AssertionError(f"block plan: {int(nb.sum())} blocks needed, N={N}")
    nb[E - 1] += surplus
    block_to_expert = torch.repeat_interleave(torch.arange(E, device=device), nb)
    block_to_expert = block_to_expert.to(torch.int32).view(N, 1)
    tpi = torch.full((N * B,), pad, dtype=torch.int32, device=device)
    # (expert, token) pairs, expert-major then token ascending: torch.nonzero is row-major.
    pairs = mask.t().nonzero()  # [P, 2]
    e, t = pairs[:, 0], pairs[:, 1]
    first_pair = torch.cumsum(counts, 0) - counts  # [E] index of each expert's first pair
    start = B * (torch.cumsum(nb, 0) - nb)  # [E] first position of each expert's range
    pos = start[e] + (torch.arange(P, device=device) - first_pair[e])
    tpi[pos] = t.to(torch.int32)
    return tpi, block_to_expert


def build_dense_block_plan(
    num_tokens: int, block_size: int, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``single_expert_dense`` layout (bwd spec §3.4): ``tpi = arange(T)``, ``b2e = 0``.

    Requires ``T % B == 0``; block b holds tokens ``b·B … b·B+B−1``.
    """
    if block_size <= 0 or num_tokens % block_size:
        raise BwdValidationError(
            f"num_tokens: expected a multiple of block_size={block_size}, got {num_tokens}"
        )
    tpi = torch.arange(num_tokens, dtype=torch.int32, device=device)
    b2e = torch.zeros(num_tokens // block_size, 1, dtype=torch.int32, device=device)
    return tpi, b2e


def build_expert_affinities_masked(
    weights: Any,
    expert_index: Any = None,
    num_experts: int | None = None,
) -> torch.Tensor:
    """The ``expert_affinities_masked [T*E, 1]`` vector (token-major: entry ``t*E + e``).

    Three forms, chosen by which arguments are given:

    - ``weights [T, E]`` alone: already masked (zero = not routed); only flattened.
    - ``weights [T, E]`` (e.g. router probabilities) and ``expert_index [T, K]``: entries of the
      chosen experts kept, all others zeroed.
    - ``weights [T, K]`` (top-k weights aligned with ``expert_index [T, K]``) and `num_experts`:
      scattered into ``[T, E]``.

    The dtype of `weights` is kept (the kernels load it to fp32).
    """
    w = as_tensor(weights)
    if w.dim() != 2 or not w.is_floating_point():
        raise BwdValidationError(
            f"weights: expected a 2-D float tensor, got shape {tuple(w.shape)} dtype {w.dtype}"
        )
    T = w.shape[0]
    if expert_index is None:
        dense = w
    else:
        idx = as_tensor(expert_index).to(w.device)
        if idx.dim() != 2 or idx.shape[0] != T or idx.is_floating_point():
            raise BwdValidationError(
                f"expert_index: expected an integer tensor of shape ({T}, K), got "
                f"{tuple(idx.shape)} {idx.dtype}"
            )
        if num_experts is None:
            mask = routing_mask(idx, w.shape[1])
            dense = torch.where(mask, w, torch.zeros((), dtype=w.dtype, device=w.device))
        else:
            if w.shape != idx.shape:
                raise BwdValidationError(
                    f"weights: expected shape {tuple(idx.shape)} (aligned with expert_index), "
                    f"got {tuple(w.shape)}"
                )
            routing_mask(idx, num_experts)  # validates ids and distinctness
            dense = torch.zeros(T, num_experts, dtype=w.dtype, device=w.device)
            dense.scatter_(1, idx.long(), w)
    return dense.reshape(-1, 1).clone()
