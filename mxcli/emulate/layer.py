"""An autograd MoE experts layer with the MXFP8 kernels' numerics (issue 23).

Forward = `blockwise_mm_fwd_mxfp8` (bwd spec §2.4), backward = `blockwise_mm_bwd_mxfp8` in kernel
mode (bwd spec §4, §6), both on the block plan built from this step's routing (`build_block_plan`,
§3.2). The weights are parameters in the Hugging Face fused layout (``gate_up_proj [E, 2I, H]``,
gate rows first; ``down_proj [E, H, I]``); every step reads them rounded to bf16 and the kernels
quantize them on the fly, exactly as they quantize bf16 weights on the device.

Modes (`Mode`): ``neuron`` (Trn3's scale rule), ``ocp`` (OCP / torchao FLOOR rule), ``rceil``
(torchao MoE training's and cuBLAS's round-up rule; all three are `ScaleRule`), ``bf16`` (the
same kernel chain with every bf16 rounding point but no MX quantization: the like-for-like
baseline) and ``exact`` (fp32, no rounding at all: equals autograd of the plain layer).

Device: plain torch ops, so it runs on CPU and CUDA. Quantization, bf16 roundings and the ordered
accumulations are exact and give the same bytes on both; the fp32 matmul accumulations follow
the BLAS's summation order (cuBLAS on CUDA, MKL/oneDNN on CPU), which neither the reference nor
the device's PE array fix, so fp32 products may differ in the last bits between devices.
"""

from __future__ import annotations

import enum
from typing import Any

import torch

from mxcli.kernels.blockwise_moe import (
    MXFP8MOEBwdConfig,
    blockwise_mm_bwd_mxfp8,
    blockwise_mm_fwd_mxfp8,
    build_block_plan,
)
from mxcli.kernels.blockwise_moe.numerics import mx_rule
from mxcli.mx import ScaleRule

__all__ = ["MODES", "Mode", "MxExperts", "experts_forward"]


class Mode(str, enum.Enum):
    NEURON = "neuron"
    OCP = "ocp"
    RCEIL = "rceil"
    BF16 = "bf16"
    EXACT = "exact"


MODES = tuple(m.value for m in Mode)
_RULE: dict[Mode, ScaleRule | None] = {
    Mode.NEURON: ScaleRule.NEURON,
    Mode.OCP: ScaleRule.OCP,
    Mode.RCEIL: ScaleRule.RCEIL,
    Mode.BF16: None,
}


def as_mode(mode: Mode | str) -> Mode:
    if isinstance(mode, Mode):
        return mode
    try:
        return Mode(str(mode).lower())
    except ValueError:
        raise ValueError(f"mode: expected one of {', '.join(MODES)}, got {mode!r}") from None


def _emulate(mode: Mode) -> str:
    return "exact" if mode is Mode.EXACT else "kernel"


def _dense_affinities(index: torch.Tensor, weights: torch.Tensor, E: int) -> torch.Tensor:
    T = index.shape[0]
    dense = torch.zeros(T, E, dtype=torch.float32, device=weights.device)
    dense.scatter_(1, index.long(), weights.to(torch.float32))
    return dense.reshape(T * E, 1)


class _ExpertsFn(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        index: torch.Tensor,
        weights: torch.Tensor,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        mode: Mode,
        block_size: int,
    ) -> torch.Tensor:
        E, two_i, H = gate_up.shape
        I = two_i // 2  # noqa: E741 (spec notation)
        sd = torch.float32 if mode is Mode.EXACT else torch.bfloat16
        # HF [E, 2I, H] (gate rows, then up rows) -> backward layout [E, H, 2, I].
        wgu = gate_up.detach().to(sd).view(E, 2, I, H).permute(0, 3, 1, 2).contiguous()
        wd = down.detach().to(sd).transpose(1, 2).contiguous()  # [E, H, I] -> [E, I, H]
        xs = x.detach().to(sd).contiguous()
        ea = _dense_affinities(index, weights.detach(), E)
        tpi, b2e = build_block_plan(index, E, block_size)
        with mx_rule(_RULE.get(mode, ScaleRule.NEURON)):
            res = blockwise_mm_fwd_mxfp8(
                xs, ea, wgu, wd, tpi, b2e, block_size, emulate=_emulate(mode)
            )
        ctx.save_for_backward(xs, ea, wgu, wd, tpi, b2e, index, *res[1:4])
        ctx.s = res[4]
        ctx.mode, ctx.B, ctx.K = mode, block_size, index.shape[1]
        ctx.dtypes = (x.dtype, weights.dtype, gate_up.dtype, down.dtype)
        return res.output.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        xs, ea, wgu, wd, tpi, b2e, index, ck_gu, ck_act, ck_h = ctx.saved_tensors
        mode: Mode = ctx.mode
        E, H, _, I = wgu.shape  # noqa: E741
        # Set again here: autograd may run backward on another thread (CUDA), where the
        # forward's context variable is not visible.
        with mx_rule(_RULE.get(mode, ScaleRule.NEURON)):
            dx, dea, dwgu, dwd = blockwise_mm_bwd_mxfp8(
                xs,
                ea,
                wgu,
                wd,
                tpi,
                b2e,
                dy.to(xs.dtype).contiguous(),
                ctx.B,
                ck_gu,
                ck_act,
                ck_h,
                ctx.s,
                config=MXFP8MOEBwdConfig.routed(ctx.K),
                emulate=_emulate(mode),
            )[:4]
        xd, wtd, gud, dd = ctx.dtypes
        dw = dea.reshape(-1, E).gather(1, index.long()).to(wtd)  # [T, K]
        dgu = dwgu.permute(0, 2, 3, 1).reshape(E, 2 * I, H).to(gud)  # back to HF [E, 2I, H]
        ddn = dwd.transpose(1, 2).contiguous().to(dd)  # [E, H, I]
        return dx.to(xd), None, dw, dgu, ddn, None, None


def experts_forward(
    x: torch.Tensor,
    index: torch.Tensor,
    weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    mode: Mode | str = Mode.NEURON,
    block_size: int = 128,
) -> torch.Tensor:
    """``Σ_k w[t,k] · down[e](silu(gate[e] x_t) · up[e] x_t)`` with ``e = index[t,k]``, computed
    and differentiated with the kernels' numerics (see the module doc).

    ``x [T, H]``, ``index [T, K]`` distinct experts per token, ``weights [T, K]``,
    ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``. Gradients flow to x, weights (hence
    the model's router) and both expert weights.
    """
    out: torch.Tensor = _ExpertsFn.apply(
        x, index, weights, gate_up_proj, down_proj, as_mode(mode), block_size
    )
    return out


class MxExperts(torch.nn.Module):
    """Drop-in for a transformers 5 fused experts module (``forward(hidden, top_k_index,
    top_k_weights)``), holding the SAME parameter objects (optimizer state carries over)."""

    def __init__(
        self,
        gate_up_proj: torch.nn.Parameter,
        down_proj: torch.nn.Parameter,
        mode: Mode | str = Mode.NEURON,
        block_size: int = 128,
    ) -> None:
        super().__init__()
        self.gate_up_proj = gate_up_proj
        self.down_proj = down_proj
        self.mode = as_mode(mode)
        self.block_size = block_size
        self.num_experts = gate_up_proj.shape[0]

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        return experts_forward(
            hidden_states,
            top_k_index,
            top_k_weights,
            self.gate_up_proj,
            self.down_proj,
            self.mode,
            self.block_size,
        )

    def extra_repr(self) -> str:
        E, two_i, H = self.gate_up_proj.shape
        return f"E={E}, H={H}, I={two_i // 2}, mode={self.mode.value}, block_size={self.block_size}"
