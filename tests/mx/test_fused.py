"""The fused numba kernels (mxcli.mx._fused) give the same bytes as the pure-torch path.

Every bf16 bit pattern is quantized under both schemes (1x32, wrapX incl. a 384-chunk), both
rules (NEURON, OCP) and both formats (E4M3FN, E5M2), in groups whose largest magnitude ranges
from 0 to the bf16 maximum, Inf and NaN, so every element meets many scale bytes, the fp8
subnormal range, saturation and the special values. Codes, scale bytes and fake-quantized fp32
values are compared bit for bit (NaNs by their bit patterns).
"""

from __future__ import annotations

import pytest
import torch

from mxcli.mx import ScaleRule, fake_quantize_mx, quantize_mx

pytest.importorskip("numba")

# value forced into element 0 of every group: sets the group's scale byte (or leaves it to the
# group's own max when smaller)
ANCHORS = [None, 0.0, 2.0**-126, 2.0**-100, 1.0, 3.0, 2.0**20, 2.0**127, float("inf"), float("nan")]
CASES = [
    ("1x32", None),
    ("wrapx", None),  # K = 1024: two 512-chunks
    ("wrapx", [(0, 512), (512, 384), (896, 128)]),  # errata 1 384-chunk, then a 128-chunk
]


def all_bf16(perm_seed: int | None) -> torch.Tensor:
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    if perm_seed is not None:
        g = torch.Generator().manual_seed(perm_seed)
        bits = bits[torch.randperm(bits.numel(), generator=g)]
    return bits.view(torch.bfloat16).view(64, 1024)


def inputs() -> list[torch.Tensor]:
    out = []
    for seed in (None, 1):
        base = all_bf16(seed)
        for anchor in ANCHORS:
            x = base.clone()
            if anchor is not None:
                x[:, ::32] = anchor
            out.append(x)
    return out


def both_paths(fn, monkeypatch: pytest.MonkeyPatch, *args, **kwargs):  # type: ignore[no-untyped-def]
    monkeypatch.setenv("MXCLI_FUSED", "1")
    fused = fn(*args, **kwargs)
    monkeypatch.setenv("MXCLI_FUSED", "0")
    plain = fn(*args, **kwargs)
    return fused, plain


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t


@pytest.mark.parametrize(("scheme", "chunks"), CASES)
@pytest.mark.parametrize("rule", [ScaleRule.NEURON, ScaleRule.OCP])
@pytest.mark.parametrize("elem", ["e4m3fn", "e5m2"])
def test_every_bf16_pattern_same_bytes(
    scheme: str, chunks: object, rule: ScaleRule, elem: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    kw = {"elem": elem, "rule": rule, "scheme": scheme, "chunks": chunks}
    stacked = torch.cat(inputs())  # [1280, 1024] bf16
    (fc, fs), (pc, ps) = both_paths(quantize_mx, monkeypatch, stacked, **kw)
    assert torch.equal(fs, ps)
    assert torch.equal(fc, pc)
    fq, pq = both_paths(fake_quantize_mx, monkeypatch, stacked, **kw)
    assert torch.equal(bits(fq), bits(pq))


def test_fp32_input_and_axis_same_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    # fp32 inputs with all 32 bits in use (low mantissa bits decide round-to-nearest-even ties),
    # quantized along a leading axis
    g = torch.Generator().manual_seed(3)
    x = torch.randn(512, 96, generator=g) * torch.exp2(torch.randint(-140, 120, (512, 96)).float())
    x[:32, 0] = 0.0
    x[64:96, 5] = float("inf")
    for scheme in ("1x32", "wrapx"):
        for elem in ("e4m3fn", "e5m2"):
            kw = {"elem": elem, "scheme": scheme}
            (fc, fs), (pc, ps) = both_paths(quantize_mx, monkeypatch, x, 0, **kw)
            assert torch.equal(fs, ps) and torch.equal(fc, pc)
            fq, pq = both_paths(fake_quantize_mx, monkeypatch, x, 0, **kw)
            assert torch.equal(bits(fq), bits(pq))


def test_fused_path_is_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    # the comparison above is only meaningful if the fused kernels actually run
    from mxcli.mx import quantize

    monkeypatch.setenv("MXCLI_FUSED", "1")
    assert quantize._fused_kernels(torch.zeros(32, dtype=torch.bfloat16)) is not None
    monkeypatch.setenv("MXCLI_FUSED", "0")
    assert quantize._fused_kernels(torch.zeros(32, dtype=torch.bfloat16)) is None
