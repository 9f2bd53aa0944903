"""`mxcli.emulate.dense` against an independent exact implementation: MX fake-quantization
written from the rules' formulas with ``frexp`` (not `mxcli.mx`), the three GEMMs written out
in float64 on explicit transposes."""

from __future__ import annotations

import pytest
import torch

from mxcli.emulate.dense import MxLinear, dense_targets, mx_linear, patch_dense, set_dense_rule
from mxcli.mx import ScaleRule

T, K, N = 80, 96, 64  # T is not a multiple of 32: the weight-gradient GEMM pads it


def _oracle_q(t: torch.Tensor, axis: int, rule: ScaleRule | None) -> torch.Tensor:
    """float64 MXFP8 (E4M3FN) values of bf16-valued `t`, groups of 32 along `axis` (zero rows
    appended to a multiple of 32 and cut again)."""
    t = t.double().movedim(axis, -1)
    if rule is None:
        return t.movedim(-1, axis)
    n = t.shape[-1]
    pad = -n % 32
    g = torch.nn.functional.pad(t, (0, pad)).reshape(*t.shape[:-1], -1, 32)
    amax = g.abs().amax(-1, keepdim=True)
    m, e = torch.frexp(amax)  # amax = m * 2^e, m in [0.5, 1): floor(log2 amax) = e - 1
    exp = (e - 1) - 8  # OCP: floor(log2 amax) - emax(E4M3FN) = 8
    if rule is ScaleRule.NEURON:
        exp = exp + 1
    elif rule is ScaleRule.RCEIL:
        exp = exp + (2 * m > 1.75).long()
    scale = torch.pow(2.0, exp.double())
    q = (g / scale).clamp(-448, 448).to(torch.float8_e4m3fn).double() * scale
    q = torch.where(amax == 0, torch.zeros_like(q), q)
    return q.reshape(*t.shape[:-1], n + pad)[..., :n].movedim(-1, axis)


def _oracle(x, w, dy, rule):  # type: ignore[no-untyped-def]
    xb, wb, dyb = (a.bfloat16() for a in (x, w, dy))
    y = _oracle_q(xb, 1, rule) @ _oracle_q(wb, 1, rule).T
    dx = _oracle_q(dyb, 1, rule) @ _oracle_q(wb, 0, rule)
    # dW = dy^T x contracts over tokens: operands grouped along T, i.e. along rows
    dw = _oracle_q(dyb.T.contiguous(), 1, rule) @ _oracle_q(xb.T.contiguous(), 1, rule).T
    return y, dx, dw


def _data(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, K, generator=g) * 2
    w = torch.randn(N, K, generator=g) * 0.05
    dy = torch.randn(T, N, generator=g) * 1e-3
    return x, w, dy


def _ours(x, w, dy, rule):  # type: ignore[no-untyped-def]
    xr = x.clone().requires_grad_()
    wr = w.clone().requires_grad_()
    y = mx_linear(xr, wr, None, rule)
    y.backward(dy)
    return y.detach(), xr.grad, wr.grad


def _close_in_bf16(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal after bf16 rounding but for the fp32 accumulation order: our GEMMs sum in fp32
    (BLAS order), the oracle in float64, so a sum near a bf16 rounding boundary may land one
    bf16 ulp apart. Everything else must agree exactly."""
    w = want.float().bfloat16().float()
    assert got.dtype == torch.float32
    assert torch.equal(got, got.bfloat16().float()), "outputs are bf16 values"
    ulp = torch.where(w == 0, torch.full_like(w, 2.0**-133), w.abs() * 2.0**-7)
    assert bool(((got - w).abs() <= ulp).all())
    assert float((got == w).float().mean()) > 0.97


@pytest.mark.parametrize("rule", [ScaleRule.NEURON, ScaleRule.OCP, ScaleRule.RCEIL, None])
def test_mx_linear_matches_exact_oracle(rule: ScaleRule | None) -> None:
    x, w, dy = _data(0)
    for got, want in zip(_ours(x, w, dy, rule), _oracle(x, w, dy, rule), strict=True):
        _close_in_bf16(got, want)


def test_operands_are_quantized_along_each_contraction() -> None:
    """The oracle with the weight-gradient operands grouped along the wrong axis (K/N instead
    of T) is far off: the test above would catch an axis mix-up."""
    x, w, dy = _data(1)
    _, _, dw = _ours(x, w, dy, ScaleRule.NEURON)
    wrong = _oracle_q(dy.bfloat16(), 1, ScaleRule.NEURON).T @ _oracle_q(
        x.bfloat16(), 1, ScaleRule.NEURON
    )
    right = _oracle(x, w, dy, ScaleRule.NEURON)[2].float().bfloat16().double()
    assert float((dw.double() - wrong).norm()) > 30 * float((dw.double() - right).norm())


def test_rules_differ_and_exact_module_is_plain_linear() -> None:
    x, w, dy = _data(2)
    outs = {r: _ours(x, w, dy, r)[2] for r in (ScaleRule.NEURON, ScaleRule.OCP, None)}
    assert not torch.equal(outs[ScaleRule.NEURON], outs[ScaleRule.OCP])
    assert not torch.equal(outs[ScaleRule.NEURON], outs[None])
    weight = torch.nn.Parameter(w.clone())
    m = MxLinear(weight, None, None, exact=True)
    assert torch.equal(m(x), torch.nn.functional.linear(x, weight))
    assert list(m.parameters()) == [weight]


def test_patch_keeps_router_and_lm_head_in_high_precision() -> None:
    pytest.importorskip("transformers")
    from mxcli.emulate.study import PRESETS, default_model

    model = default_model(PRESETS["tiny"].model, 0)
    eligible, kept = dense_targets(model)
    assert "lm_head" in kept and not any("gate" == n.rsplit(".", 1)[-1] for n in eligible)
    assert "model.layers.0.mlp.gate_proj" in eligible  # the dense layer's FFN is converted
    assert "model.layers.1.self_attn.q_proj" in eligible
    before = {n: p for n, p in model.named_parameters()}
    patched, _ = patch_dense(model)
    assert patched == eligible
    assert all(isinstance(model.get_submodule(n), MxLinear) for n in patched)
    assert {n: p for n, p in model.named_parameters()} == before  # same parameter objects
    assert isinstance(model.get_submodule("lm_head"), torch.nn.Linear)
    set_dense_rule(model, ScaleRule.RCEIL)
    assert all(model.get_submodule(n).rule is ScaleRule.RCEIL for n in patched)
