"""FP8 block dequantization and MXFP4 decoding against plainly written loops."""

from __future__ import annotations

import pytest
import torch

from mxcli.errors import InputError
from mxcli.weightprep.sources import decode_mxfp4, dequant_fp8_block
from mxcli.weightprep.synthetic import fp8_block_quantize
from tests.weightprep.reference import fp8_dequant_loop, mxfp4_decode_loop


@pytest.mark.parametrize("shape", [(256, 384), (200, 300), (128, 128), (1, 129)])
def test_fp8_block_dequant_equals_loop(shape: tuple[int, int]) -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(shape, generator=g) * 0.05
    q, s = fp8_block_quantize(w)
    s = s * torch.exp2(torch.randint(-3, 4, s.shape, generator=g).float())  # varied block scales
    got = dequant_fp8_block(q, s)
    want = fp8_dequant_loop(q, s)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_fp8_block_dequant_other_block_size() -> None:
    g = torch.Generator().manual_seed(2)
    q = (torch.randn(96, 80, generator=g) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.rand(3, 3, generator=g) + 0.5
    assert torch.equal(dequant_fp8_block(q, s, (32, 32)), fp8_dequant_loop(q, s, (32, 32)))


def test_fp8_block_dequant_rejects_bad_scale_shape() -> None:
    q = torch.zeros(256, 256, dtype=torch.float8_e4m3fn)
    with pytest.raises(InputError, match=r"w_scale_inv: expected shape \[2, 2\]"):
        dequant_fp8_block(q, torch.ones(2, 3), name="w")


def test_mxfp4_decode_equals_loop() -> None:
    g = torch.Generator().manual_seed(3)
    blocks = torch.randint(0, 256, (2, 5, 3, 16), generator=g, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(110, 135, (2, 5, 3), generator=g, dtype=torch.int32).to(torch.uint8)
    got = decode_mxfp4(blocks, scales)
    want = mxfp4_decode_loop(blocks, scales)
    assert got.shape == (2, 5, 96)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_mxfp4_nibble_order() -> None:
    # byte 0x21: low nibble 1 (0.5) first, high nibble 2 (1.0) second; scale 128 -> x2
    blocks = torch.zeros(1, 16, dtype=torch.uint8)
    blocks[0, 0] = 0x21
    out = decode_mxfp4(blocks, torch.tensor([128], dtype=torch.uint8))
    assert out[:2].tolist() == [1.0, 2.0]


def test_mxfp4_rejects_bad_shapes() -> None:
    with pytest.raises(InputError, match="mxfp4"):
        decode_mxfp4(torch.zeros(2, 8, dtype=torch.uint8), torch.zeros(2, dtype=torch.uint8))
