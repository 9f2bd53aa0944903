"""Seeded test cases in the manner of the upstream backward tests (bwd spec §11.1): the upstream
router, seed and draw order, for tests, benchmarks and demos. (Complete inputs for the CLI, with
mxcli's own seeded generator, are `mxcli.kernels.blockwise_moe.inputs.generate`.)"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mxcli.kernels.blockwise_moe.config import ClampLimits
from mxcli.kernels.blockwise_moe.forward import blockwise_mm_fwd_mxfp8
from mxcli.kernels.blockwise_moe.plan import (
    build_block_plan,
    build_dense_block_plan,
    build_expert_affinities_masked,
)

__all__ = ["UpstreamCase", "make_upstream_case", "upstream_router_choices", "upstream_seed"]


def upstream_router_choices(T: int, E: int, K: int, seed: int = 0) -> torch.Tensor:
    """Expert choices ``[T, K]`` of the upstream test router (bwd spec §3.2): legacy numpy RNG
    seeded with `seed`, then per token ``choice(range(E), K, replace=False)``."""
    rs = np.random.RandomState(seed)
    rows = [rs.choice(range(E), K, replace=False) for _ in range(T)]
    return torch.from_numpy(np.asarray(rows, dtype=np.int64).reshape(T, K))


def upstream_seed(
    T: int,
    K: int,
    B: int,
    E: int,
    I: int,  # noqa: E741 (spec notation I = I_TP)
    H: int,
    suffix: str = "_mxfp8",
) -> int:
    """``int(sha256(f"{T}_{K}_{B}_{E}_{I}_{H}{suffix}")) mod 2**32`` (bwd spec §11.1)."""
    digest = hashlib.sha256(f"{T}_{K}_{B}_{E}_{I}_{H}{suffix}".encode()).hexdigest()
    return int(digest, 16) % 2**32


def _bf16(a: np.ndarray) -> torch.Tensor:
    # float64 -> float32 -> bf16 (RNE at each step; the fp32 step is exact for these ranges'
    # purposes: it only matters within 2^-24 relative of a bf16 tie)
    return torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16)


@dataclass
class UpstreamCase:
    """One upstream-style backward case; `kwargs` gives the tensor arguments of the kernel."""

    hidden_states: torch.Tensor  # [T, H] bf16
    expert_affinities_masked: torch.Tensor  # [T*E, 1] bf16
    gate_up_proj_weight: torch.Tensor  # [E, H, 2, I] bf16
    down_proj_weight: torch.Tensor  # [E, I, H] bf16
    token_position_to_id: torch.Tensor  # [N*B] int32
    block_to_expert: torch.Tensor  # [N, 1] int32
    output_hidden_states_grad: torch.Tensor  # [T, H] bf16
    block_size: int
    gate_up_proj_act_checkpoint_T: torch.Tensor  # [N, 2, I, B] bf16
    choices: torch.Tensor  # [T, K] int64
    top_k: int
    gate_up_proj_bias: torch.Tensor | None = None  # [E, 2, I] bf16
    down_proj_bias: torch.Tensor | None = None  # [E, H] bf16
    clamp_limits: ClampLimits | None = None

    def kwargs(self) -> dict[str, Any]:
        return {
            "hidden_states": self.hidden_states,
            "expert_affinities_masked": self.expert_affinities_masked,
            "gate_up_proj_weight": self.gate_up_proj_weight,
            "down_proj_weight": self.down_proj_weight,
            "token_position_to_id": self.token_position_to_id,
            "block_to_expert": self.block_to_expert,
            "output_hidden_states_grad": self.output_hidden_states_grad,
            "block_size": self.block_size,
            "gate_up_proj_act_checkpoint_T": self.gate_up_proj_act_checkpoint_T,
        }


def make_upstream_case(
    T: int,
    H: int,
    E: int,
    B: int,
    K: int,
    I: int,  # noqa: E741 (spec notation I = I_TP)
    *,
    bias: bool = False,
    clamp_limits: ClampLimits | None = None,
    dense: bool = False,
) -> UpstreamCase:
    """A backward case drawn as in bwd spec §11.1.

    Router: `upstream_router_choices` (seed 0). Data: legacy numpy RNG seeded with
    `upstream_seed`, draw order ``W_d, W_gu, A, X, dY (, b_gu, b_d)``, each converted to bf16.
    The gate/up checkpoint is the unquantized fp32 forward of §2.5 (bias added and clamped in
    fp32), rounded to bf16 — i.e. `blockwise_mm_fwd_mxfp8` with ``emulate="exact"``.
    `dense`: the single-expert dense layout (needs E = K = 1, T % B == 0).
    """
    choices = upstream_router_choices(T, E, K)
    rs = np.random.RandomState(upstream_seed(T, K, B, E, I, H))
    wd = _bf16(rs.uniform(-0.1, 0.1, (E, I, H)))
    wgu = _bf16(rs.uniform(-0.1, 0.1, (E, H, 2, I)))
    a = rs.random_sample((T, E))
    x = _bf16(rs.random_sample((T, H)))
    dy = _bf16(rs.uniform(-1.0, 1.0, (T, H)))
    bgu = bd = None
    if bias:
        bgu = _bf16(rs.uniform(-0.1, 0.1, (E, 2, I)))
        bd = _bf16(rs.uniform(-0.1, 0.1, (E, H)))
    ea = build_expert_affinities_masked(_bf16(a), choices)  # [T*E, 1] bf16
    if dense:
        tpi, b2e = build_dense_block_plan(T, B)
    else:
        tpi, b2e = build_block_plan(choices, E, B)
    fwd = blockwise_mm_fwd_mxfp8(
        x, ea, wgu, wd, tpi, b2e, B,
        clamp_limits=clamp_limits, gate_up_proj_bias=bgu, down_proj_bias=bd, emulate="exact",
    )  # fmt: skip
    ckpt = fwd.gate_up_proj_act_checkpoint_T.to(torch.bfloat16)
    return UpstreamCase(x, ea, wgu, wd, tpi, b2e, dy, B, ckpt, choices, K, bgu, bd, clamp_limits)
