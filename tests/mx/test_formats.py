"""FP8 and E8M0 codecs against independent oracles (ml_dtypes) over every bf16 bit pattern."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from mxcli.mx import (
    ElemFormat,
    e8m0_decode,
    e8m0_encode_exponent,
    exponent_field,
    fp8_decode,
    fp8_encode,
)

ML = {"e4m3fn": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}


def all_bf16() -> torch.Tensor:
    return torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


@pytest.mark.parametrize("elem", ["e4m3fn", "e5m2"])
def test_encode_matches_ml_dtypes_on_every_bf16_pattern(elem: str) -> None:
    x = all_bf16()
    finite = x[torch.isfinite(x)]
    m = ElemFormat(elem).max_finite
    ours = fp8_encode(finite, elem).numpy()
    # oracle: clip to the finite range (our documented saturation), then ml_dtypes' RNE cast
    oracle = np.clip(finite.float().numpy(), -m, m).astype(ML[elem]).view(np.uint8)
    assert np.array_equal(ours, oracle)


@pytest.mark.parametrize("elem", ["e4m3fn", "e5m2"])
def test_decode_matches_ml_dtypes_on_every_code(elem: str) -> None:
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    ours = fp8_decode(codes, elem).numpy()
    oracle = codes.numpy().view(ML[elem]).astype(np.float32)
    assert np.array_equal(ours, oracle, equal_nan=True)


@pytest.mark.parametrize("elem", ["e4m3fn", "e5m2"])
def test_decode_encode_round_trip_of_representable_values(elem: str) -> None:
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    values = fp8_decode(codes, elem)
    ok = torch.isfinite(values)
    again = fp8_encode(values[ok], elem)
    assert torch.equal(again, codes[ok])


def test_saturation_nan_and_signed_zero() -> None:
    x = torch.tensor(
        [500.0, -500.0, float("inf"), -float("inf"), float("nan"), -float("nan"), -1e-9, 2.0**-10]
    )
    assert fp8_encode(x, "e4m3fn").tolist() == [0x7E, 0xFE, 0x7E, 0xFE, 0x7F, 0xFF, 0x80, 0x00]
    assert fp8_encode(x, "e5m2").tolist()[:6] == [0x60, 0xE0, 0x7B, 0xFB, 0x7F, 0xFF]


def test_e4m3_subnormals_and_ties() -> None:
    # 2^-9 is the smallest subnormal (code 1); 1.5 * 2^-9 is a tie between codes 1 and 2 -> even
    x = torch.tensor([2.0**-9, 1.5 * 2.0**-9, 2.5 * 2.0**-9, 7 * 2.0**-9, 2.0**-6])
    assert fp8_encode(x).tolist() == [0x01, 0x02, 0x02, 0x07, 0x08]
    # tie between 1.0 (0x38) and 1.125 (0x39) -> 1.0 (even mantissa); 1.1875 -> 1.25 (0x3A)
    assert fp8_encode(torch.tensor([1.0625, 1.1875])).tolist() == [0x38, 0x3A]


def test_e8m0() -> None:
    b = torch.tensor([0, 1, 120, 127, 128, 254, 255], dtype=torch.uint8)
    d = e8m0_decode(b)
    assert d[0].item() == 2.0**-127 and d[1].item() == 2.0**-126
    assert d[2].item() == 2.0**-7 and d[3].item() == 1.0 and d[4].item() == 2.0
    assert d[5].item() == 2.0**127 and torch.isnan(d[6])
    assert e8m0_encode_exponent(torch.tensor([-127, -7, 0, 127])).tolist() == [0, 120, 127, 254]


def test_exponent_field_bf16_fp16_fp32_agree() -> None:
    x = torch.tensor([1.0, 3.0, 0.99609375, 16.0, 0.0, 2.0**-20, -448.0])
    expect = [127, 128, 126, 131, 0, 107, 135]
    assert exponent_field(x).tolist() == expect
    assert exponent_field(x.to(torch.bfloat16)).tolist() == expect
    assert exponent_field(x.to(torch.float16)).tolist() == expect
    # an fp16 subnormal gets its true fp32 exponent (prefill spec §3.4)
    assert exponent_field(torch.tensor([2.0**-20], dtype=torch.float16)).tolist() == [107]


def test_numpy_and_ml_dtypes_inputs() -> None:
    a = np.array([1.0, 3.0], dtype=np.float32)
    assert fp8_encode(a).tolist() == [0x38, 0x44]
    b = np.array([1.0, 3.0], dtype=ml_dtypes.bfloat16)
    assert fp8_encode(b).tolist() == [0x38, 0x44]
