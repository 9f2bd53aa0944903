"""Small validation and bookkeeping helpers shared by the forward and backward references."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mxcli.kernels.blockwise_moe.config import BwdValidationError
from mxcli.mx.formats import as_tensor

BLOCK_SIZES = (128, 256, 512, 1024, 2048, 4096)
# Blocks of one expert are processed together up to this many token rows (bounds memory).
ROWS_PER_CHUNK = 8192


def tensor(name: str, x: Any, required: bool = True) -> torch.Tensor | None:
    """`x` as a torch tensor (numpy accepted); None allowed when not `required`."""
    if x is None:
        if required:
            raise BwdValidationError(f"{name}: expected a tensor, got None")
        return None
    try:
        return as_tensor(x)
    except Exception:
        raise BwdValidationError(f"{name}: expected a tensor, got {type(x).__name__}") from None


def check_shape(name: str, t: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(t.shape) != tuple(expected):
        raise BwdValidationError(f"{name}: expected shape {tuple(expected)}, got {tuple(t.shape)}")


def check_rank(name: str, t: torch.Tensor, rank: int, legend: str) -> None:
    if t.dim() != rank:
        raise BwdValidationError(f"{name}: expected shape {legend}, got {tuple(t.shape)}")


def check_float(name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...] | None) -> None:
    """`allowed` None: any floating dtype."""
    if allowed is None:
        if not t.is_floating_point():
            raise BwdValidationError(f"{name}: expected a floating dtype, got {t.dtype}")
    elif t.dtype not in allowed:
        names = " or ".join(str(d).removeprefix("torch.") for d in allowed)
        raise BwdValidationError(f"{name}: expected dtype {names}, got {t.dtype}")


def check_int(name: str, t: torch.Tensor) -> None:
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise BwdValidationError(f"{name}: expected an integer dtype (int32), got {t.dtype}")


E8M0_NAN = 255  # bwd spec §5.2 / OCP MX: the E8M0 byte 0xFF encodes NaN


def check_e8m0_scales(name: str, scales: torch.Tensor, rows: torch.Tensor) -> None:
    """No NaN scale among the valid rows ``rows`` (the layout's scale rows) of ``scales [E, R, F]``.

    A byte of 255 would make every value of its MX group NaN (and, through the matmuls, every
    hidden-state gradient). Rows outside ``rows`` are layout holes the kernel never reads.
    """
    s = scales.view(torch.uint8) if scales.dtype != torch.uint8 else scales
    bad = (s.index_select(1, rows.to(s.device)) == E8M0_NAN).nonzero()
    if bad.numel():
        e, m, f = (int(v) for v in bad[0])
        raise BwdValidationError(
            f"{name}: expected E8M0 scale bytes < 255, got 255 (NaN) at "
            f"[{e}, {int(rows[m])}, {f}] (expert {e}, MX group {m}, column {f}; "
            f"{bad.shape[0]} such byte(s))"
        )


def check_block_size(block_size: Any) -> int:
    if (
        isinstance(block_size, bool)
        or not isinstance(block_size, int)
        or block_size not in BLOCK_SIZES
    ):
        raise BwdValidationError(
            f"block_size: expected one of {', '.join(map(str, BLOCK_SIZES))}, got {block_size!r}"
        )
    return block_size


def check_block_plan(tpi: torch.Tensor, b2e: torch.Tensor, B: int) -> int:
    """``token_position_to_id [N*B]`` and ``block_to_expert [N, 1]``, both integer; returns N."""
    check_rank("token_position_to_id", tpi, 1, "(N*B,)")
    check_int("token_position_to_id", tpi)
    if tpi.numel() % B:
        raise BwdValidationError(
            f"token_position_to_id: expected a length that is a multiple of block_size={B}, "
            f"got {tpi.numel()}"
        )
    N = tpi.numel() // B
    check_shape("block_to_expert", b2e, (N, 1))
    check_int("block_to_expert", b2e)
    return N


def valid_token_count(num_valid_tokens: Any, T: int) -> int:
    """``num_valid_tokens`` ([1] int32 tensor or int) clamped to ``[0, T]`` (API reference)."""
    if isinstance(num_valid_tokens, bool):
        raise BwdValidationError("num_valid_tokens: expected a [1] int32 tensor, got bool")
    if isinstance(num_valid_tokens, int):
        value = num_valid_tokens
    else:
        t = tensor("num_valid_tokens", num_valid_tokens)
        assert t is not None
        check_int("num_valid_tokens", t)
        if t.numel() != 1:
            raise BwdValidationError(f"num_valid_tokens: expected shape (1,), got {tuple(t.shape)}")
        value = int(t.reshape(-1)[0])
    return max(0, min(value, T))


@dataclass
class BlockPlan:
    """Device-side view of a block plan.

    ``idx [N, B]``: token id of each position, padding replaced by ``T`` (the index of an
    appended zero row, so one gather serves padding); ``valid [N, B]``; ``expert [N]``.
    """

    T: int
    B: int
    idx: torch.Tensor
    valid: torch.Tensor
    expert: torch.Tensor

    @property
    def N(self) -> int:
        return int(self.idx.shape[0])

    @staticmethod
    def make(
        tpi: torch.Tensor, b2e: torch.Tensor, T: int, B: int, device: torch.device
    ) -> BlockPlan:
        ids = tpi.to(device=device, dtype=torch.int64).reshape(-1, B)
        valid = (ids >= 0) & (ids < T)
        idx = torch.where(valid, ids, torch.full_like(ids, T))
        return BlockPlan(T, B, idx, valid, b2e.to(device=device, dtype=torch.int64).reshape(-1))

    def chunks(self, e: int, skip_empty: bool) -> list[torch.Tensor]:
        """Block ids of expert `e` in increasing order, split into chunks of <= ROWS_PER_CHUNK rows.

        `skip_empty`: drop blocks without a valid row (they contribute exactly zero).
        """
        sel = self.expert == e
        if skip_empty:
            sel = sel & self.valid.any(1)
        blocks = sel.nonzero().squeeze(1)
        per = max(1, ROWS_PER_CHUNK // self.B)
        return [blocks[i : i + per] for i in range(0, blocks.numel(), per)]


def with_zero_row(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x [T, F]`` cast to `dtype` with one zero row appended (the padding gather target)."""
    out = torch.zeros(x.shape[0] + 1, x.shape[1], dtype=dtype, device=x.device)
    out[:-1] = x
    return out
