"""The rounding scale rules (issue 30): CT (compressed-tensors' MX rule) and RCEIL (torchao's).

Oracles: compressed_tensors' own `calculate_qparams` + MXFP8 compressor (installed), an exact
integer statement of each rule on bf16 inputs, and torchao's `to_mx` where torchao is installed
(it is not a project dependency; checked once with torchao 0.18.0: 0 bytes differ).
"""

from __future__ import annotations

import pytest
import torch

from mxcli.mx import ScaleRule, dequantize_mx, quantize_mx


def _all_bf16(rows: int, seed: int) -> torch.Tensor:
    """Every kind of finite bf16 bit pattern (subnormals, zeros, both signs, all exponents),
    below 1.75 * 2^127 (where compressed_tensors' own arithmetic overflows)."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 1 << 16, (rows, 2048), generator=g, dtype=torch.int32).to(torch.int16)
    w = bits.view(torch.bfloat16)
    w = torch.where(torch.isfinite(w) & (w.abs() < 1e37), w, torch.zeros_like(w))
    w[0, :32] = 0  # an all-zero group
    w[1, :32] = 0
    w[1, 3] = 1.75  # mantissa exactly 1.75: CT rounds up, RCEIL does not
    return w.contiguous()


def _fields(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    amax = w.float().abs().view(w.shape[0], -1, 32).amax(-1).view(torch.int32)
    return (amax >> 23) & 0xFF, amax & 0x7FFFFF


def test_ct_is_byte_identical_to_the_compressed_tensors_compressor() -> None:
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    scheme = preset_name_to_scheme("MXFP8", ["Linear"])
    comp = BaseCompressor.get_value_from_registry("mxfp8-quantized")
    w = _all_bf16(256, 30)
    g = w.view(256, -1, 32)
    scale, _ = calculate_qparams(g.amin(-1), g.amax(-1), scheme.weights)
    lib = comp.compress({"weight": w, "weight_scale": scale}, scheme)
    codes, scales = quantize_mx(w, rule="ct")
    assert torch.equal(scales, lib["weight_scale"])
    assert torch.equal(codes, lib["weight"].view(torch.uint8))
    assert int(scales[1, 0]) == 127 - 8 + 1  # amax 1.75: OCP's byte, rounded up


@pytest.mark.parametrize("rule", ["ct", "rceil"])
def test_rounding_rules_in_integers(rule: str) -> None:
    """On bf16 data: byte = OCP's (E - 8) + 1 when amax's mantissa is >= 1.75 (CT) or > 1.75
    (RCEIL: ceil(log2(amax / 448)) with fl32(1/448) is exact for a 7-bit mantissa), 0 at the
    bottom; the codes are the data times 2^(127 - byte), saturated."""
    w = _all_bf16(128, 31)
    e, m = _fields(w)
    up = (m >= 0x600000) if rule == "ct" else (m > 0x600000)
    want = (e - 8 + up.to(torch.int32)).clamp(0, 255)
    codes, scales = quantize_mx(w, rule=rule)
    assert torch.equal(scales.to(torch.int32), want)
    back = dequantize_mx(codes, scales)
    assert (
        int((back.abs() > 448 * 2.0 ** (scales.float() - 127).repeat_interleave(32, 1)).sum()) == 0
    )
    assert int(scales[1, 0]) == (120 if rule == "ct" else 119)  # amax 1.75


def test_rceil_matches_torchao_where_installed() -> None:
    mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    from torchao.prototype.mx_formats.config import ScaleCalculationMode

    for w in (_all_bf16(64, 32), torch.randn(64, 512) * torch.logspace(-20, 20, 512)):
        s, d = mx.to_mx(w.contiguous(), torch.float8_e4m3fn, 32, ScaleCalculationMode.RCEIL)
        codes, scales = quantize_mx(w, rule="rceil")
        assert torch.equal(s.view(torch.uint8), scales)
        assert torch.equal(d.view(torch.uint8), codes)


def test_rule_names() -> None:
    assert ScaleRule("rceil") is ScaleRule.RCEIL and ScaleRule("ct") is ScaleRule.CT
    assert ScaleRule.RCEIL.rounds and ScaleRule.CT.rounds and not ScaleRule.OCP.rounds
