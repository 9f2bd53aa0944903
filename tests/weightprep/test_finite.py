"""`all_finite`: the integer test on the bits against torch.isfinite, on every bf16 and fp16
pattern and on fp32 edge patterns, in numba and in torch (MXCLI_FUSED=0)."""

from __future__ import annotations

import pytest
import torch

from mxcli.weightprep import finite


@pytest.fixture(params=["fused", "torch"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "torch":
        monkeypatch.setenv("MXCLI_FUSED", "0")
    elif finite._kernel() is None:
        pytest.skip("numba not installed")
    return str(request.param)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_16bit_pattern_alone(path: str, dtype: torch.dtype) -> None:
    """Each of the 65,536 patterns, placed alone in a finite tensor, is flagged iff isfinite
    says it is NaN/Inf."""
    pats = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    bad = ~torch.isfinite(pats)
    assert int(bad.sum()) == (2 * 128 if dtype == torch.bfloat16 else 2 * 1024)  # +-(Inf, NaNs)
    base = torch.ones(97, dtype=dtype)
    flagged = []
    for i in range(pats.numel()):
        if i % 61 and not bool(bad[i]):  # every non-finite, a sample of the finite ones
            continue
        base[50] = pats[i]
        flagged.append((bool(bad[i]), not finite.all_finite(base)))
    assert all(a == b for a, b in flagged)
    assert finite.all_finite(pats[~bad])  # all the finite patterns at once
    assert not finite.all_finite(pats)


def test_fp32_edges_and_other_dtypes(path: str) -> None:
    edges = torch.tensor([0x7F7FFFFF, 0xFF7FFFFF, 0x7F800000, 0xFF800000, 0x7F800001, 0xFFFFFFFF,
                          0x00000001, 0x80000000], dtype=torch.int64).to(torch.int32).view(torch.float32)  # fmt: skip
    expect = [True, True, False, False, False, False, True, True]
    for v, ok in zip(edges, expect, strict=True):
        assert finite.all_finite(torch.cat([torch.zeros(1000), v.reshape(1)])) is ok
    assert finite.all_finite(torch.arange(5))  # integers are finite
    assert not finite.all_finite(torch.tensor([1.0, float("nan")], dtype=torch.float64))
    assert finite.all_finite(torch.empty(0, dtype=torch.bfloat16))
    x = torch.zeros(4, 6, dtype=torch.bfloat16)
    x[1, 4] = float("-inf")
    assert not finite.all_finite(x.t())  # non-contiguous views are read whole


def test_torch_blocks_cover_the_tail(monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch path reads in blocks: an Inf in the last, partial block is found."""
    monkeypatch.setenv("MXCLI_FUSED", "0")
    monkeypatch.setattr(finite, "_BLOCK", 1000)
    x = torch.zeros(2500, dtype=torch.bfloat16)
    assert finite.all_finite(x)
    x[2499] = float("inf")
    assert not finite.all_finite(x)
