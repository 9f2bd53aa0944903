"""MX quantization: the specs' worked examples byte for byte, oracles, invariants, edge cases."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from mxcli.errors import InputError
from mxcli.mx import (
    ScaleRule,
    dequantize_mx,
    exponent_field,
    fake_quantize_mx,
    group_index,
    group_order,
    quantize_mx,
    to_group_order,
    wrapx_chunks,
)


def one_group(values: list[float], dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    g = torch.zeros(32, dtype=torch.float32)
    g[: len(values)] = torch.tensor(values)
    return g.to(dtype)


# prefill spec §3.4 single-group table: amax -> (byte, code of amax, dequantized amax)
PREFILL_TABLE = [
    (1.0, 0x78, 0x70, 1.0),
    (3.0, 0x79, 0x74, 3.0),
    (0.99609375, 0x77, 0x78, 1.0),
    (16.0, 0x7C, 0x70, 16.0),
    (0.0, 0x00, 0x00, 0.0),
]


@pytest.mark.parametrize(("amax", "byte", "code", "deq"), PREFILL_TABLE)
def test_prefill_single_group_table(amax: float, byte: int, code: int, deq: float) -> None:
    codes, scales = quantize_mx(one_group([amax]))
    assert scales.tolist() == [byte]
    assert codes[0].item() == code
    assert dequantize_mx(codes, scales)[0].item() == deq


def test_prefill_other_elements_of_the_3_group() -> None:
    # prefill spec §3.4 (and errata 6: 2.99 is first rounded to bf16 2.984375)
    codes, scales = quantize_mx(one_group([3.0, 0.01, -0.5, 2.99, 1e-5]))
    assert codes[:5].tolist() == [0x74, 0x32, 0xE0, 0x74, 0x00]
    deq = dequantize_mx(codes, scales)
    assert deq[:5].tolist() == [3.0, 0.009765625, -0.5, 3.0, 0.0]


def test_bwd_worked_example() -> None:
    # bwd spec §5.2: max |x| = 0.30078125 -> byte 118, scale 2^-9
    vals = [0.30078125, -0.0498046875, 0.1318359375, 1e-6]
    codes, scales = quantize_mx(one_group(vals))
    assert scales.tolist() == [118]
    deq = dequantize_mx(codes, scales)[:4].tolist()
    assert deq == [0.3125, -0.05078125, 0.125, 0.0]


def test_ocp_rule_and_e5m2_offsets() -> None:
    g = one_group([1.0])
    assert quantize_mx(g, rule=ScaleRule.OCP)[1].tolist() == [119]
    assert quantize_mx(g, elem="e5m2")[1].tolist() == [113]
    assert quantize_mx(g, elem="e5m2", rule="ocp")[1].tolist() == [112]
    # OCP: amax 1.0 -> 1.0 / 2^-8 = 256 is representable; 1.9375 -> 496 saturates to 448
    codes, scales = quantize_mx(one_group([1.9375]), rule="ocp")
    assert codes[0].item() == 0x7E and dequantize_mx(codes, scales)[0].item() == 1.75


def oracle_quantize(x: torch.Tensor, offset: int = 7) -> tuple[np.ndarray, np.ndarray]:
    """Plain numpy/ml_dtypes model of the NEURON e4m3fn rule over contiguous groups of 32."""
    xf = x.float().numpy().reshape(-1, 32)
    e = exponent_field(torch.from_numpy(np.abs(xf).max(axis=1))).numpy()
    byte = np.clip(e - offset, 0, 255)
    scale = np.ldexp(np.float32(1.0), byte.astype(np.int32) - 127).astype(np.float32)
    scaled = np.clip(xf / scale[:, None], -448, 448)
    codes = scaled.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    return codes.reshape(x.shape), byte.astype(np.uint8).reshape(*x.shape[:-1], -1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_random_data_matches_oracle(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(64, 512, generator=gen) * torch.logspace(-6, 3, 512)).to(dtype)
    codes, scales = quantize_mx(x)
    oc, ob = oracle_quantize(x)
    assert np.array_equal(codes.numpy(), oc)
    assert np.array_equal(scales.numpy(), ob)


def test_every_bf16_pattern_matches_oracle() -> None:
    x = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    x = x[torch.isfinite(x)]
    x = x[: (x.numel() // 32) * 32].reshape(-1, 32)
    codes, scales = quantize_mx(x)
    oc, ob = oracle_quantize(x)
    assert np.array_equal(codes.numpy(), oc)
    assert np.array_equal(scales.numpy(), ob)


def test_fake_quantize_equals_dequantize_of_quantize() -> None:
    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(8, 3, 1024, generator=gen) * 5).to(torch.bfloat16)
    for scheme in ("1x32", "wrapx"):
        for axis in (-1, 0, 1):
            if x.shape[axis] % (128 if scheme == "wrapx" else 32):
                continue
            c, s = quantize_mx(x, axis, scheme=scheme)
            ref = dequantize_mx(c, s, axis, scheme=scheme)
            assert torch.equal(fake_quantize_mx(x, axis, scheme=scheme), ref)


def test_power_of_two_scaling_is_exact() -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(16, 256, generator=gen).to(torch.bfloat16)
    base = fake_quantize_mx(x)
    for k in (-20, -3, 1, 7, 30):
        scaled = fake_quantize_mx(x * 2.0**k)
        assert torch.equal(scaled, base * 2.0**k)


def test_representable_group_is_exact() -> None:
    # bwd spec §12.3: small multiples of a common power of two are reproduced exactly
    g = one_group([1.0, 0.5, 0.75, 0.0, -0.625, 0.375])
    assert torch.equal(fake_quantize_mx(g), g.float())


def test_edge_groups() -> None:
    tiny = one_group([2.0**-125, -(2.0**-126)], torch.float32)  # E_amax 2 < 7: byte clamps to 0
    c, s = quantize_mx(tiny)
    assert s.tolist() == [0]
    assert dequantize_mx(c, s)[:2].tolist() == [2.0**-125, -(2.0**-126)]
    # group max in [128, 256) under NEURON: amax 255 -> byte 127 (X = 1), 255 rounds up to 256 (0x78)
    c, s = quantize_mx(one_group([255.0]))
    assert s.tolist() == [127] and c[0].item() == 0x78
    # subnormal codes: 2^-13 relative to amax 1.0 (X = 2^-7) -> 2^-6 -> code 0x08 (min normal);
    # 2^-16 -> 2^-9 -> code 0x01; exact tie 2^-17 -> 2^-10 -> 0 (to even)
    c, s = quantize_mx(one_group([1.0, 2.0**-13, 2.0**-16, 2.0**-17, 3 * 2.0**-17]))
    assert c[:5].tolist() == [0x70, 0x08, 0x01, 0x00, 0x02]


def test_nan_and_inf_policy() -> None:
    c, s = quantize_mx(one_group([float("inf"), 1.0]))
    assert s.tolist() == [248]  # exponent field 255 - 7
    assert c[0].item() == 0x7E and c[1].item() == 0x00
    neg_nan = one_group([0.0, 1.0])
    # -NaN from its bits: ATen's scalar fp32 -> bf16 cast (ATEN_CPU_CAPABILITY=default) drops
    # a NaN's sign, so casting -nan would test +NaN there
    neg_nan.view(torch.int16)[0] = -64  # 0xFFC0
    c, s = quantize_mx(neg_nan)
    assert s.tolist() == [248] and c[0].item() == 0xFF


def test_wrapx_group_membership() -> None:
    # bwd spec §5.3 / §12.3
    assert sorted(group_order(512, "wrapx")[:32].tolist()) == [
        *range(0, 8),
        *range(128, 136),
        *range(256, 264),
        *range(384, 392),
    ]
    o768 = group_order(768, "wrapx")
    assert o768.numel() == 768
    assert sorted(o768[16 * 32 : 17 * 32].tolist()) == [
        *range(512, 520),
        *range(576, 584),
        *range(640, 648),
        *range(704, 712),
    ]
    assert sorted(o768[17 * 32 : 18 * 32].tolist()) == [
        *range(520, 528),
        *range(584, 592),
        *range(648, 656),
        *range(712, 720),
    ]
    assert sorted(group_order(128, "wrapx")[:32].tolist()) == [
        *range(0, 8),
        *range(32, 40),
        *range(64, 72),
        *range(96, 104),
    ]
    assert wrapx_chunks(896) == [(0, 512), (512, 256), (768, 128)]
    assert wrapx_chunks(384, 512) == [(0, 256), (256, 128)]
    assert wrapx_chunks(1024, 256) == [(0, 256), (256, 256), (512, 256), (768, 256)]


def test_wrapx_quantizes_its_groups() -> None:
    # one large element per wrapX group: each group's scale follows its own maximum
    K = 768
    x = torch.full((K,), 2.0**-4)
    order = group_order(K, "wrapx")
    for g in range(K // 32):
        x[order[32 * g]] = 2.0 ** (g % 8)
    c, s = quantize_mx(x.to(torch.bfloat16), scheme="wrapx")
    assert s.tolist() == [127 + (g % 8) - 7 for g in range(K // 32)]
    gidx = group_index(K, "wrapx")
    assert torch.equal(gidx[order], torch.arange(K) // 32)


def test_custom_chunks_384() -> None:
    # bwd errata 1: one 384-chunk (lane stride 96) instead of 256 + 128
    order = group_order(384, "wrapx", chunks=[(0, 384)])
    assert sorted(order[:32].tolist()) == [
        *range(0, 8),
        *range(96, 104),
        *range(192, 200),
        *range(288, 296),
    ]


def test_axis_argument() -> None:
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(256, 5, generator=gen).to(torch.bfloat16)
    c0, s0 = quantize_mx(x, axis=0, scheme="wrapx", tile_k=128)
    c1, s1 = quantize_mx(x.t().contiguous(), axis=-1, scheme="wrapx", tile_k=128)
    assert torch.equal(c0, c1.t()) and torch.equal(s0, s1.t())
    assert s0.shape == (8, 5)


def test_bad_inputs() -> None:
    with pytest.raises(InputError, match="multiple of 32"):
        quantize_mx(torch.zeros(48))
    with pytest.raises(InputError, match="multiple of 128"):
        quantize_mx(torch.zeros(96), scheme="wrapx")
    with pytest.raises(InputError, match="tile_k"):
        quantize_mx(torch.zeros(512), scheme="wrapx", tile_k=64)
    with pytest.raises(InputError, match="scheme"):
        quantize_mx(torch.zeros(64), scheme="2x16")
    with pytest.raises(InputError, match="x: expected"):
        quantize_mx(torch.zeros(64, dtype=torch.int32))


@pytest.mark.parametrize(
    ("K", "scheme", "tile_k", "chunks"),
    [
        (896, "wrapx", 512, None),
        (1024, "wrapx", 256, None),
        (384, "wrapx", 512, [(0, 384)]),
        (256, "1x32", 512, None),
    ],
)
def test_to_group_order_equals_gather(K: int, scheme: str, tile_k: int, chunks: object) -> None:
    gen = torch.Generator().manual_seed(5)
    x = torch.randint(0, 256, (3, K, 2), generator=gen, dtype=torch.int32).to(torch.uint8)
    order = group_order(K, scheme, tile_k, chunks)  # type: ignore[arg-type]
    fast = to_group_order(x, 1, scheme, tile_k, chunks)  # type: ignore[arg-type]
    assert torch.equal(fast, x.index_select(1, order))
