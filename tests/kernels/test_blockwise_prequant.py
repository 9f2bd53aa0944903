# ruff: noqa: E741  (spec notation: I is the per-rank intermediate size I_TP)
"""Pre-quantized weights (bwd spec §5.5): x4 packing, scale layouts, round trips."""

from __future__ import annotations

import pytest
import torch

from mxcli.kernels import MXFP8MOEBwdConfig, prequantize_weights
from mxcli.kernels.blockwise_moe import BwdValidationError, ScaleLayout, dequantize_weights
from mxcli.kernels.blockwise_moe.numerics import Grouping
from mxcli.kernels.blockwise_moe.prequant import scale_row_index, scale_rows
from mxcli.mx import QuantScheme, fake_quantize_mx, group_order, quantize_mx


def test_unpacked_rows():
    # compact row m at (m // 4)·32 + m % 4: 4 valid rows per 32-row quadrant
    idx = scale_row_index(1024, "unpacked")
    assert idx.tolist()[:10] == [0, 1, 2, 3, 32, 33, 34, 35, 64, 65]
    assert scale_rows(1024, ScaleLayout.UNPACKED) == 256
    assert int(idx.max()) < 256


@pytest.mark.parametrize(
    "K, rows, checks",
    [
        # 512-tile t -> scaling group t // 4, slot 4·(t % 4); tile-local group ml -> (ml//4)·32 + ml%4
        (2048, 128, {0: 0, 3: 3, 4: 32, 15: 99, 16: 4, 17: 5, 20: 36, 48: 12, 63: 111}),
        (4096, 256, {64: 128, 65: 129, 127: 128 + 12 + 99}),
        # 768 = 512 + 256: the 256-remainder is tile 1, groups 16..23
        (768, 128, {16: 4, 19: 7, 20: 36, 23: 39}),
        # 896 = 512 + 256 + 128: the 128-remainder after a 256-remainder goes +64
        (896, 128, {24: 4 + 64, 27: 7 + 64}),
        # 640 = 512 + 128: a lone 128-remainder does not
        (640, 128, {16: 4, 19: 7}),
        (256, 128, {0: 0, 7: 35}),
    ],
)
def test_packed_rows(K, rows, checks):
    idx = scale_row_index(K, "packed")
    assert scale_rows(K, "packed") == rows == -(-K // 2048) * 128
    for m, row in checks.items():
        assert int(idx[m]) == row, m
    assert len(set(idx.tolist())) == K // 32  # injective


def test_prequantize_layout_and_bytes():
    """x4 word [e, p, f] holds the codes of src[order[4p + j], f], byte j; scales at their rows."""
    g = torch.Generator().manual_seed(0)
    E, H, I = 2, 640, 128
    wgu = (torch.randn(E, H, 2, I, generator=g) * 0.05).to(torch.bfloat16)
    wd = (torch.randn(E, I, H, generator=g) * 0.05).to(torch.bfloat16)
    for layout in ("packed", "unpacked"):
        pq = prequantize_weights(wgu, wd, scale_layout=layout)
        assert pq.down_proj_weight is not None and pq.down_weight_scales is not None
        assert (
            pq.down_proj_weight.shape == (E, H // 4, I)
            and pq.down_proj_weight.dtype == torch.uint32
        )
        assert pq.down_weight_scales.shape == (E, scale_rows(H, layout), I)
        assert pq.down_weight_scales.dtype == torch.uint8
        assert pq.gate_up_proj_weight is not None and pq.gate_up_weight_scales is not None
        assert pq.gate_up_proj_weight.shape == (E, 2 * I // 4, H)
        assert pq.gate_up_weight_scales.shape == (E, scale_rows(2 * I, layout), H)
        # independent view of the down weight: [K = H, F = I] per expert, wrapX/512 groups
        src = wd[1].T  # [H, I]
        codes, compact = quantize_mx(src, 0, scheme="wrapx")
        order = group_order(H, "wrapx")
        words = pq.down_proj_weight[1].view(torch.int32).to(torch.int64) & 0xFFFFFFFF  # [H/4, I]
        for p, f in ((0, 0), (5, 7), (H // 4 - 1, I - 1), (130, 3)):
            for j in range(4):
                byte = (int(words[p, f]) >> (8 * j)) & 0xFF
                assert byte == int(codes[int(order[4 * p + j]), f])
        rows = scale_row_index(H, layout)
        assert torch.equal(pq.down_weight_scales[1][rows], compact)
        unused = torch.ones(scale_rows(H, layout), dtype=torch.bool)
        unused[rows] = False
        assert torch.all(pq.down_weight_scales[1][unused] == 0)


def test_spec_worked_example_scale_byte():
    """Spec §5.2: a group with max |x| = 0.30078125 gets byte 118; codes decode as listed."""
    wd = torch.zeros(1, 128, 512)  # [E, I, H]; the down weight is quantized along H
    vals = [0.30078125, -0.0498046875, 0.1318359375, 1e-6]
    for k, v in zip((0, 128, 256, 1), vals, strict=True):  # all in wrapX group 0 of K = 512
        wd[0, 0, k] = v
    pq = prequantize_weights(down_proj_weight=wd.to(torch.bfloat16), scale_layout="unpacked")
    assert pq.down_weight_scales is not None
    assert int(pq.down_weight_scales[0, 0, 0]) == 118
    _, d = dequantize_weights(pq)
    assert d is not None
    got = [float(d[0, 0, k]) for k in (0, 128, 256, 1)]
    want = [0.3125, -0.05078125, 0.125, 0.0]
    bf = [float(torch.tensor(v).to(torch.bfloat16)) for v in vals]
    assert bf[:3] == vals[:3]
    assert got == want


@pytest.mark.parametrize("layout", ["packed", "unpacked"])
@pytest.mark.parametrize("scheme,tile_k,fast", [("wrapx", 512, False), ("wrapx", 256, False),
                                                ("1x32", 512, False), ("wrapx", 512, True)])  # fmt: skip
def test_round_trip_equals_fake_quantization(layout, scheme, tile_k, fast):
    g = torch.Generator().manual_seed(1)
    E, H, I = 2, 896, 384
    wgu = (
        torch.randn(E, H, 2, I, generator=g)
        * 2.0 ** torch.randint(-8, 2, (E, H, 2, I), generator=g)
    ).to(torch.bfloat16)
    wd = (torch.randn(E, I, H, generator=g)).to(torch.bfloat16)
    pq = prequantize_weights(wgu, wd, scale_layout=layout, scheme=scheme, tile_k=tile_k,
                             fast_dma_transpose=fast)  # fmt: skip
    gu, d = dequantize_weights(pq)
    assert gu is not None and d is not None
    chunks = [(0, 512), (512, 384)] if fast and scheme == "wrapx" and tile_k == 512 else None
    want_d = fake_quantize_mx(wd, 2, scheme=scheme, tile_k=tile_k, chunks=chunks)  # along H
    want_gu = fake_quantize_mx(wgu.reshape(E, H, 2 * I), 2, scheme=scheme, tile_k=tile_k)
    assert torch.equal(d, want_d)
    assert torch.equal(gu, want_gu.view(E, H, 2, I))
    assert pq.down_grouping.chunks == (None if chunks is None else tuple(chunks))


def test_settings_come_from_the_config():
    cfg = MXFP8MOEBwdConfig.routed(
        1, quant_scheme=QuantScheme.MX1X32, fast_dma_transpose=True,
        phase1_config=__import__("mxcli.kernels.blockwise_moe", fromlist=["x"]).MatmulMxfp8KernelConfig(
            tile_k=256, enable_scale_packing=False),
    )  # fmt: skip
    wd = torch.ones(1, 128, 896, dtype=torch.bfloat16)
    wgu = torch.ones(1, 896, 2, 128, dtype=torch.bfloat16)
    pq = prequantize_weights(wgu, wd, config=cfg)
    assert pq.down_grouping == Grouping(QuantScheme.MX1X32, 256)
    assert pq.down_scale_layout is ScaleLayout.UNPACKED
    assert pq.gate_up_scale_layout is ScaleLayout.PACKED  # phase 2 default config packs
    assert pq.gate_up_grouping == Grouping(QuantScheme.MX1X32, 512)
    pq2 = prequantize_weights(wgu, wd)  # default config: wrapX/512, packed
    assert pq2.down_grouping == Grouping(QuantScheme.WRAPX, 512)
    assert pq2.down_scale_layout is ScaleLayout.PACKED
    kw = pq2.as_kwargs()
    assert set(kw) == {"gate_up_proj_weight", "gate_up_weight_scales", "down_proj_weight",
                       "down_weight_scales"}  # fmt: skip


def test_prequantize_errors():
    with pytest.raises(BwdValidationError, match="at least one weight"):
        prequantize_weights()
    with pytest.raises(
        BwdValidationError, match=r"gate_up_proj_weight: expected shape \(E, H, 2, I\)"
    ):
        prequantize_weights(torch.ones(1, 128, 3, 128))
    with pytest.raises(BwdValidationError, match="down_proj_weight: expected shape"):
        prequantize_weights(torch.ones(1, 128, 2, 128), torch.ones(1, 256, 128))
    with pytest.raises(BwdValidationError, match="scale_layout"):
        prequantize_weights(torch.ones(1, 128, 2, 128), scale_layout="folded")
    with pytest.raises(BwdValidationError, match="tile_k"):
        prequantize_weights(torch.ones(1, 128, 2, 128), tile_k=384)


@pytest.mark.parametrize(
    "H, I, scheme, chunks",
    [
        (256, 128, "wrapx", None),  # K = 2I = 256 (gate/up), K = H = 256 (down)
        (896, 384, "wrapx", None),  # 512 + 256 + 128 remainders
        (640, 192, "1x32", None),
        (1024, 256, "wrapx", ((0, 512), (512, 512))),
    ],
)
@pytest.mark.parametrize("layout", ["packed", "unpacked"])
def test_fused_x4_pass_gives_the_torch_bytes(monkeypatch, H, I, scheme, chunks, layout):
    """The one-pass numba x4/scale placement (`mxcli.mx._fused.x4_transposed`) against the
    torch path's permute + pack + transpose (MXCLI_FUSED=0), on every byte of data and scales."""
    pytest.importorskip("numba")
    from mxcli.kernels.blockwise_moe.prequant import quantize_weight_x4

    g = torch.Generator().manual_seed(3)
    w = (torch.randn(3, H, 2 * I, generator=g) * 4).to(torch.bfloat16)  # [E, F=H, K=2I]
    w.view(-1)[::97] = 0
    K = 2 * I
    ch = chunks if chunks is None or sum(c for _, c in chunks) == K else ((0, K),)
    grouping = Grouping(QuantScheme(scheme), 512, ch)
    outs = {}
    for fused in ("1", "0"):
        monkeypatch.setenv("MXCLI_FUSED", fused)
        outs[fused] = quantize_weight_x4(w.transpose(1, 2), grouping, layout)
    (x4a, sa), (x4b, sb) = outs["1"], outs["0"]
    assert x4a.dtype == x4b.dtype == torch.uint32 and sa.dtype == sb.dtype == torch.uint8
    assert x4a.shape == x4b.shape == (3, K // 4, H) and sa.shape == sb.shape
    assert torch.equal(x4a.view(torch.int32), x4b.view(torch.int32))
    assert torch.equal(sa, sb)
    assert int(sa.count_nonzero()) > 0
