"""x4 packing, the prefill H swizzle and scale-byte offsets (prefill spec §4.4, §6.1)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mxcli.errors import InputError
from mxcli.mx import (
    pack_x4,
    prefill_scale_offsets,
    prefill_scale_region_size,
    swizzle_h_index,
    unpack_x4,
    unswizzle_h_index,
)


def test_pack_x4_is_little_endian() -> None:
    codes = torch.tensor([[0x01, 0x02, 0x03, 0x04, 0xFF, 0x00, 0x80, 0x7F]], dtype=torch.uint8)
    words = pack_x4(codes)
    assert words.dtype == torch.uint32 and words.shape == (1, 2)
    assert words.view(torch.int32).tolist() == [[0x04030201, 0x7F8000FF]]
    # independent oracle: numpy's little-endian uint32 view
    assert np.array_equal(
        words.view(torch.int32).numpy().view(np.uint32), codes.numpy().view("<u4")
    )


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_pack_unpack_round_trip(axis: int) -> None:
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 256, (8, 12, 16), generator=gen, dtype=torch.int32).to(torch.uint8)
    words = pack_x4(codes, axis)
    assert words.shape[axis] == codes.shape[axis] // 4
    assert torch.equal(unpack_x4(words, axis), codes)


def test_pack_x4_rejects_bad_length() -> None:
    with pytest.raises(InputError, match="multiple of 4"):
        pack_x4(torch.zeros(6, dtype=torch.uint8))


def test_swizzle_index() -> None:
    idx = swizzle_h_index(1024)
    assert idx[:4].tolist() == [0, 4, 8, 12]
    assert idx[127].item() == 508 and idx[128].item() == 1 and idx[129].item() == 5
    assert idx[512].item() == 512
    assert torch.equal(torch.sort(idx).values, torch.arange(1024))
    inv = unswizzle_h_index(1024)
    assert torch.equal(idx[inv], torch.arange(1024))
    with pytest.raises(InputError, match="multiple of 512"):
        swizzle_h_index(1000)


def test_scale_offsets_h1024() -> None:
    groups = [0, 1, 3, 4, 15, 16, 17, 31]
    folded = (prefill_scale_offsets(1024, True)[groups] + 1024).tolist()
    assert folded == [1024, 1025, 1027, 1056, 1123, 1028, 1029, 1127]
    unfolded = (prefill_scale_offsets(1024, False)[groups] + 1024).tolist()
    assert unfolded == [1024, 1025, 1027, 1056, 1123, 1152, 1153, 1251]


def test_scale_offsets_h512_and_regions() -> None:
    expect = [0, 1, 2, 3, 32, 33, 34, 35, 64, 65, 66, 67, 96, 97, 98, 99]
    assert prefill_scale_offsets(512, True).tolist() == expect
    assert prefill_scale_offsets(512, False).tolist() == expect
    sizes = {
        (H, p): prefill_scale_region_size(H, p) for H in (512, 1024, 3072, 7168) for p in (1, 0)
    }
    assert sizes == {
        (512, 1): 128,
        (512, 0): 128,
        (1024, 1): 128,
        (1024, 0): 256,
        (3072, 1): 256,
        (3072, 0): 768,
        (7168, 1): 512,
        (7168, 0): 1792,
    }


@pytest.mark.parametrize("H", [512, 1024, 3072, 7168])
@pytest.mark.parametrize("pack", [True, False])
def test_scale_offsets_distinct_and_in_region(H: int, pack: bool) -> None:
    off = prefill_scale_offsets(H, pack)
    region = prefill_scale_region_size(H, pack)
    assert off.unique().numel() == H // 32
    assert int(off.min()) >= 0 and int(off.max()) < region
    # holes = region - H/32 (prefill spec §10.3)
    assert region - off.numel() == region - H // 32


def test_scale_offsets_h3072_folded_pack1() -> None:
    off = prefill_scale_offsets(3072, True)
    tile4 = off[4 * 16 : 5 * 16].tolist()  # tile 4 -> pack 1, shift 0
    assert tile4 == [128 + v for v in [0, 1, 2, 3, 32, 33, 34, 35, 64, 65, 66, 67, 96, 97, 98, 99]]
    tile5 = off[5 * 16 : 6 * 16].tolist()  # tile 5 -> pack 1, shift 4
    assert tile5[:4] == [132, 133, 134, 135]
