"""The three MX scale rules of the study (`ScaleRule`) against their formulas on worked values."""

from __future__ import annotations

import math

import pytest
import torch

from mxcli.mx import ScaleRule, dequantize_mx, quantize_mx

# amax -> expected E8M0 byte (E4M3FN, max 448), worked by hand from each rule's formula:
# NEURON: E - 7; OCP: E - 8 (E = floor(log2 amax) + 127); RCEIL: 127 + ceil(log2(amax / 448)).
WORKED = [
    # amax      NEURON OCP RCEIL
    (1.0, 120, 119, 119),  # E=127; log2(1/448) = -8.81 -> ceil -8
    (3.5, 121, 120, 120),  # 3.5 = 1.75 * 2: 3.5/448 = 2^-7 exactly, no round-up
    (3.75, 121, 120, 121),  # significand 1.875 > 1.75: 3.75/448 = 2^-6.9 -> -6
    (448.0, 128, 127, 127),  # 448/448 = 2^0
    (450.0, 128, 127, 128),  # just above 448: round up
    (0.015625, 114, 113, 113),  # 2^-6: E=121; 2^-6/448 = 2^-14.8 -> -14
]


def _byte(amax: float, rule: ScaleRule) -> int:
    x = torch.zeros(1, 32)
    x[0, 5] = amax
    x[0, 9] = -amax / 3
    return int(quantize_mx(x, -1, rule=rule)[1][0, 0])


@pytest.mark.parametrize("amax, neuron, ocp, rceil", WORKED)
def test_worked_scale_bytes(amax: float, neuron: int, ocp: int, rceil: int) -> None:
    assert _byte(amax, ScaleRule.NEURON) == neuron
    assert _byte(amax, ScaleRule.OCP) == ocp
    assert _byte(amax, ScaleRule.RCEIL) == rceil


def test_zero_and_nonfinite_groups() -> None:
    assert _byte(0.0, ScaleRule.RCEIL) == 0
    # torchao _f32_to_e8m0_rceil: a non-finite group gets the E8M0 NaN byte 255
    assert _byte(math.inf, ScaleRule.RCEIL) == 255
    assert _byte(math.inf, ScaleRule.NEURON) == 248  # E=255 - 7, unchanged by RCEIL's addition


def test_rceil_formula_on_every_bf16_value() -> None:
    """Every positive finite bf16 amax from 2^-118 up: the byte is 127 + ceil(log2(amax/448))
    (float64, exact here: amax/448 is a power of two only for significand 1.75), i.e. OCP's
    byte plus one exactly when the significand of amax exceeds 1.75."""
    bits = torch.arange(0x0480, 0x7F80, dtype=torch.int32).to(torch.int16)
    amax = bits.view(torch.bfloat16).float()
    x = torch.zeros(amax.numel(), 32)
    x[:, 0] = amax
    rceil = quantize_mx(x, -1, rule="rceil")[1][:, 0].long()
    ocp = quantize_mx(x, -1, rule="ocp")[1][:, 0].long()
    want = torch.tensor([127 + math.ceil(math.log2(a / 448.0)) for a in amax.double().tolist()])
    assert torch.equal(rceil, want)
    sig_above = (amax.view(torch.int32) & 0x7FFFFF) > 0x600000
    assert torch.equal(rceil - ocp, sig_above.long())


def test_rceil_never_saturates_and_other_rules_unchanged() -> None:
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 256, generator=g) * 5).bfloat16().float()
    codes, scales = quantize_mx(x, -1, rule="rceil")
    deq = dequantize_mx(codes, scales, -1)
    # group max lands in (224, 448]: representable without saturation
    assert float((deq.abs().amax() - 0).item()) > 0
    X = 2.0 ** (scales.double() - 127)
    ratio = x.abs().reshape(64, 8, 32).amax(-1).double() / X
    assert bool(((ratio > 224) & (ratio <= 448)).all())
    # NEURON and OCP: same bytes as their offsets (E - 7, E - 8)
    E = (x.abs().reshape(64, 8, 32).amax(-1).view(torch.int32) >> 23) & 0xFF
    assert torch.equal(quantize_mx(x, -1, rule="neuron")[1].int(), E - 7)
    assert torch.equal(quantize_mx(x, -1, rule="ocp")[1].int(), E - 8)


@pytest.mark.parametrize("rule", ["rceil", "ct"])
@pytest.mark.parametrize("scheme", ["1x32", "wrapx"])
def test_rounding_fused_path_equals_torch_path(
    scheme: str, rule: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rounding rule (RCEIL, compressed-tensors') through the fused kernels (NEURON or OCP
    per group) gives the torch path's bytes, codes and values; a non-finite group falls back to
    the torch path."""
    import mxcli.mx.quantize as q

    g = torch.Generator().manual_seed(3)
    x = torch.randn(16, 512, generator=g) * torch.logspace(-4, 4, 512)
    x[0, :32] = 0
    x[1, 7] = math.inf
    for t in (x, x.bfloat16(), x.t().contiguous().t()):
        before = t.clone()
        fused = (quantize_mx(t, -1, rule=rule, scheme=scheme),
                 q.fake_quantize_mx(t, -1, rule=rule, scheme=scheme))  # fmt: skip
        monkeypatch.setenv("MXCLI_FUSED", "0")
        plain = (quantize_mx(t, -1, rule=rule, scheme=scheme),
                 q.fake_quantize_mx(t, -1, rule=rule, scheme=scheme))  # fmt: skip
        monkeypatch.delenv("MXCLI_FUSED")
        assert torch.equal(fused[0][0], plain[0][0]) and torch.equal(fused[0][1], plain[0][1])
        assert torch.equal(fused[1].nan_to_num(), plain[1].nan_to_num())
        assert torch.equal(t.nan_to_num(), before.nan_to_num())  # the input is left alone
        # and the values are the input's, to MX precision (a group's relative error < 2^-4)
        ok = torch.isfinite(t).all(-1)
        err = (fused[1][ok] - t.float()[ok]).norm() / t.float()[ok].norm()
        assert float(err) < 2**-5
