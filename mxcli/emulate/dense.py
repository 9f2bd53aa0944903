"""MXFP8 training of the dense ``nn.Linear`` layers (issue 31 item 3): an autograd linear whose
three GEMMs take MXFP8 operands, as MXFP8 linear training does, and `patch_dense` to swap it in.

TorchAO's ``MXLinear`` (which TorchAO Neuron runs on Trainium as ``MXFP8Linear`` and as the fused
``neuron_fused_mx_linear``) computes, for ``y = x Wᵀ`` with ``x [T, K]`` and ``W [N, K]``:

- forward ``y = q(x, K) · q(W, K)ᵀ``;
- ``dx = q(dy, N) · q(W, N)``;
- ``dW = q(dy, T)ᵀ · q(x, T)``;

where ``q(t, d)`` is MX quantization (E4M3FN elements, one E8M0 scale per 32 consecutive elements
along ``d``, the GEMM's contraction dimension) under the arm's `ScaleRule`. Operands are read
in bf16 (the fp32 master weights rounded once per step), products accumulate in fp32 and every
GEMM output is rounded to bf16; the weight gradient reaches the fp32 master weight as that bf16
value. With no rule (the ``bf16`` arm) the same chain runs with bf16 operands and no MX.

Which linears stay in high precision: those TorchAO Neuron's recipe does not convert. AWS's
TorchTitan Neuron MXFP8 tutorial (Neuron SDK 2.34) converts the attention and FFN linears and
moves the routed experts onto the MXFP8 MoE kernels; the router and the output projection are
neither, and torchtitan's published MXFP8 MoE run keeps ``output`` and ``router.gate`` in bf16
(pytorch/torchtitan ``torchtitan/components/quantization/mxfp8.md`` line 200 at b5bcd76).
Embeddings are not linears. So: every ``nn.Linear`` except the LM head and the router / gate
modules (`HIGH_PRECISION`), and except expert modules (`mxcli.emulate.layer` handles those).
"""

from __future__ import annotations

from typing import Any

import torch

from mxcli.mx import ElemFormat, QuantScheme, ScaleRule, fake_quantize_mx

__all__ = [
    "HIGH_PRECISION",
    "MxLinear",
    "dense_targets",
    "mx_linear",
    "patch_dense",
    "set_dense_rule",
]

# Last name components of linears the recipe leaves in high precision (see the module doc).
HIGH_PRECISION = ("lm_head", "output", "gate", "router", "shared_expert_gate", "classifier")
GROUP = 32


def _q(t: torch.Tensor, axis: int, rule: ScaleRule | None) -> torch.Tensor:
    """bf16 `t` as an fp32 MXFP8 operand quantized along `axis` (no rule: the bf16 values)."""
    if rule is None:
        return t.to(torch.float32)
    return fake_quantize_mx(t, axis, elem=ElemFormat.E4M3FN, rule=rule, scheme=QuantScheme.MX1X32)


def _pad_rows(t: torch.Tensor) -> torch.Tensor:
    """Zero rows up to a multiple of 32: zeros change no group maximum and add nothing."""
    extra = -t.shape[0] % GROUP
    return t if extra == 0 else torch.nn.functional.pad(t, (0, 0, 0, extra))


class _MxLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        rule: ScaleRule | None,
    ) -> torch.Tensor:
        lead, K = x.shape[:-1], x.shape[-1]
        xb = x.detach().reshape(-1, K).to(torch.bfloat16)
        wb = weight.detach().to(torch.bfloat16)
        acc = _q(xb, 1, rule) @ _q(wb, 1, rule).t()
        if bias is not None:
            acc = acc + bias.detach().to(torch.bfloat16).to(torch.float32)
        ctx.save_for_backward(xb, wb)
        ctx.rule, ctx.has_bias, ctx.lead = rule, bias is not None, lead
        ctx.dtypes = (x.dtype, weight.dtype)
        return acc.to(torch.bfloat16).to(x.dtype).reshape(*lead, wb.shape[0])

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        xb, wb = ctx.saved_tensors
        rule: ScaleRule | None = ctx.rule
        T, N = xb.shape[0], wb.shape[0]
        dyb = dy.reshape(T, N).to(torch.bfloat16)
        dx = (_q(dyb, 1, rule) @ _q(wb, 0, rule)).to(torch.bfloat16)
        dyp, xp = _pad_rows(dyb), _pad_rows(xb)
        dw = (_q(dyp, 0, rule).t() @ _q(xp, 0, rule)).to(torch.bfloat16)
        db = dy.reshape(T, N).to(torch.float32).sum(0) if ctx.has_bias else None
        xd, wd = ctx.dtypes
        return dx.to(xd).reshape(*ctx.lead, wb.shape[1]), dw.to(wd), db, None


def mx_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    rule: ScaleRule | None = ScaleRule.NEURON,
) -> torch.Tensor:
    """``x Wᵀ + b`` computed and differentiated with MXFP8 GEMM operands (see the module doc).

    ``x [..., K]``, ``weight [N, K]`` with K and N multiples of 32; `rule` None: the bf16 chain.
    """
    out: torch.Tensor = _MxLinearFn.apply(x, weight, bias, rule)
    return out


class MxLinear(torch.nn.Module):
    """Drop-in for ``nn.Linear`` holding the SAME parameter objects (optimizer state carries
    over); ``rule`` None runs the bf16 chain, ``exact`` the plain fp32 linear."""

    def __init__(
        self,
        weight: torch.nn.Parameter,
        bias: torch.nn.Parameter | None,
        rule: ScaleRule | None = ScaleRule.NEURON,
        exact: bool = False,
    ) -> None:
        super().__init__()
        self.weight = weight
        self.bias = bias
        self.rule = rule
        self.exact = exact

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.exact:
            return torch.nn.functional.linear(x, self.weight, self.bias)
        return mx_linear(x, self.weight, self.bias, self.rule)

    def extra_repr(self) -> str:
        N, K = self.weight.shape
        how = "fp32" if self.exact else (self.rule.value if self.rule else "bf16")
        return f"in={K}, out={N}, {how}"


def dense_targets(model: Any) -> tuple[list[str], list[str]]:
    """``(eligible, kept)``: names of the ``nn.Linear`` / `MxLinear` modules of `model` the recipe
    trains in MXFP8, and of those it leaves in high precision (`HIGH_PRECISION`, expert modules,
    or a dimension not a multiple of 32, which MX groups cannot cover)."""
    eligible: list[str] = []
    kept: list[str] = []
    for name, mod in model.named_modules():
        if not isinstance(mod, torch.nn.Linear | MxLinear):
            continue
        parts = name.split(".")
        N, K = mod.weight.shape
        if parts[-1] in HIGH_PRECISION or "experts" in parts or N % GROUP or K % GROUP:
            kept.append(name)
        else:
            eligible.append(name)
    return eligible, kept


def patch_dense(model: Any) -> tuple[list[str], list[str]]:
    """Swap every eligible linear of `model` (`dense_targets`) for `MxLinear`, exact until a rule
    is set (`set_dense_rule`); returns ``(patched, kept)``."""
    eligible, kept = dense_targets(model)
    for name in eligible:
        mod = model.get_submodule(name)
        if isinstance(mod, MxLinear):
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, MxLinear(mod.weight, mod.bias, None, exact=True))
    return eligible, kept


def set_dense_rule(model: Any, rule: ScaleRule | None, exact: bool = False) -> None:
    """Set every `MxLinear` of `model` to `rule` (None: bf16 chain) or to exact fp32."""
    for mod in model.modules():
        if isinstance(mod, MxLinear):
            mod.rule, mod.exact = rule, exact
