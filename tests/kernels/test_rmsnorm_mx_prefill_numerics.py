"""rmsnorm_mx_prefill numerics and byte layout: spec §3 (norm, three roundings, MX quantization)
and §4 (packed row), checked byte for byte against the spec's worked examples and against an
independent numpy + ml_dtypes model (tests/kernels/_prefill_oracle.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mxcli.kernels.rmsnorm_mx_prefill import (
    HoleFill,
    decode_packed_rows,
    rmsnorm_mx_prefill,
    rmsnorm_mx_prefill_reference,
    row_geometry,
)
from mxcli.mx import ScaleRule
from tests.kernels import _prefill_oracle as O

U8 = torch.uint8


def _bytes(packed: torch.Tensor) -> np.ndarray:
    assert packed.dtype == torch.float8_e4m3fn
    return packed.view(U8).cpu().numpy()


def _bf16(v) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float32).to(torch.bfloat16)


# ----------------------------------------------------------------------------- §3.4 worked table


def test_spec_3_4_table_through_kernel():
    """§3.4 single-group examples, with r = R_bf16(inv_rms) == 1 so that y == x exactly."""
    H = 512
    row = torch.zeros(H)
    row[0] = 1.0  # group 0: amax 1.0 -> byte 0x78, code 0x70
    row[32:37] = torch.tensor([3.0, 0.01, -0.5, 2.99, 1e-5])  # group 1: amax 3.0 -> 0x79
    row[64] = 0.99609375  # group 2 -> byte 0x77, code 0x78 (=256)
    row[96] = 16.0  # group 3 -> byte 0x7C, code 0x70
    # group 4.. all zero -> byte 0x00, codes 0x00
    x = row.to(torch.bfloat16)
    ss = float((x.double() ** 2).sum())
    N = round(ss)  # mean square ~1: inv_rms within half a bf16 ulp of 1
    assert O.round_to(np.float32(1 / np.sqrt(ss / N + 1e-6)), O.BF16) == 1.0
    out = rmsnorm_mx_prefill(
        x.view(1, 1, H), torch.ones(H, dtype=torch.bfloat16), unpadded_hidden_size=N
    )
    b = _bytes(out[0])[0]
    scale = {g: b[H + O.spec_scale_offset(g, H, True)] for g in range(16)}
    assert [scale[g] for g in range(5)] == [0x78, 0x79, 0x77, 0x7C, 0x00]
    assert all(scale[g] == 0 for g in range(4, 16))
    assert b[0] == 0x70
    assert list(b[32:37]) == [0x74, 0x32, 0xE0, 0x74, 0x00]  # errata 6: 2.99 -> 2.984375 -> 191
    assert b[64] == 0x78 and b[96] == 0x70
    assert not b[97:H].any() and not b[1:32].any()
    dec = decode_packed_rows(out[0], H)
    assert dec.values[0, 0] == 1.0 and dec.values[0, 32] == 3.0 and dec.values[0, 64] == 1.0
    assert (
        dec.values[0, 33] == 0.009765625 and dec.values[0, 35] == 3.0 and dec.values[0, 96] == 16.0
    )


# ----------------------------------------------------------------------------- §4.4 layouts


@pytest.mark.parametrize("H", [512, 1024, 3072, 7168])
@pytest.mark.parametrize("pack_scales", [True, False])
def test_scale_byte_layout(H, pack_scales):
    """Group g holds 2^e_g (e_g distinct-ish): byte_g - byte_0 must equal e_g - e_0 at the spec
    offset of g (independent of the unknown R(inv_rms)), holes are zero."""
    G = H // 32
    e = np.array([(g * 5) % 13 - 6 for g in range(G)])
    zero = np.arange(G) % 7 == 3  # some all-zero groups -> byte 0
    vals = np.repeat(np.where(zero, 0.0, np.ldexp(1.0, e)), 32)
    T = 2
    x = torch.tensor(np.stack([vals, -vals]), dtype=torch.float32).to(torch.bfloat16).view(1, T, H)
    out = rmsnorm_mx_prefill(x, torch.ones(H, dtype=torch.bfloat16), pack_scales=pack_scales)
    geo = row_geometry(H, pack_scales=pack_scales)
    b = _bytes(out[0])
    assert b.shape == (T, geo.row_region) == (T, H + O.spec_scale_region(H, pack_scales))
    offs = np.array([O.spec_scale_offset(g, H, pack_scales) for g in range(G)])
    scales = b[:, H + offs].astype(int)  # [T, G]
    ref = scales[:, ~zero][:, :1]
    rel = np.where(zero, 0, e - e[~zero][0])
    assert (scales[:, zero] == 0).all()
    assert (scales[:, ~zero] - ref == rel[~zero]).all()
    hole = np.ones(geo.scale_region, dtype=bool)
    hole[offs] = False
    assert hole.sum() == geo.scale_region - G
    assert not b[:, H:][:, hole].any()
    # every nonzero element has the same code (same mantissa), sign flips between the rows
    codes = b[:, :H].reshape(T, G, 32)
    c0 = codes[0, ~zero][0, 0]
    assert (codes[0, ~zero] == c0).all() and (codes[1, ~zero] == c0 | 0x80).all()
    assert not (codes[:, zero] & 0x7F).any()  # ±0 (row 1 holds -0.0: sign kept, §3.4)


def test_h1024_offsets_spec_table():
    # §4.4 H = 1024: groups -> absolute scale byte
    folded = {0: 1024, 1: 1025, 3: 1027, 4: 1056, 15: 1123, 16: 1028, 17: 1029, 31: 1127}
    unfolded = {0: 1024, 1: 1025, 3: 1027, 4: 1056, 15: 1123, 16: 1152, 17: 1153, 31: 1251}
    H = 1024
    vals = np.zeros(H)
    for g in range(32):
        vals[32 * g] = 2.0 ** (g % 16 - 8)
    x = torch.tensor(vals, dtype=torch.float32).to(torch.bfloat16).view(1, 1, H)
    for pack, table in ((True, folded), (False, unfolded)):
        b = _bytes(rmsnorm_mx_prefill(x, torch.ones(H), pack_scales=pack)[0])[0]
        s0 = int(b[table[0]])
        for g, pos in table.items():
            assert int(b[pos]) - s0 == g % 16, (pack, g)


def test_hole_fill_unfolded_ff():
    H = 1024
    x = (torch.randn(1, 3, H, generator=torch.Generator().manual_seed(6)) * 0.5).to(torch.bfloat16)
    a = _bytes(
        rmsnorm_mx_prefill_reference(
            x, torch.ones(H), pack_scales=False, hole_fill=HoleFill.UNFOLDED_FF
        )[0]
    )
    z = _bytes(rmsnorm_mx_prefill_reference(x, torch.ones(H), pack_scales=False)[0])
    offs = np.array([O.spec_scale_offset(g, H, False) for g in range(H // 32)])
    hole = np.ones(256, dtype=bool)
    hole[offs] = False
    assert (a[:, H:][:, hole] == 0xFF).all() and not z[:, H:][:, hole].any()
    assert np.array_equal(a[:, H + offs], z[:, H + offs]) and np.array_equal(a[:, :H], z[:, :H])
    # folded rows are never filled with 0xFF
    f = _bytes(rmsnorm_mx_prefill_reference(x, torch.ones(H), hole_fill=HoleFill.UNFOLDED_FF)[0])
    assert np.array_equal(f, _bytes(rmsnorm_mx_prefill(x, torch.ones(H))[0]))


# ----------------------------------------------------------------------------- §3.2-3.4 vs oracle


def _oracle_rows(x32, gamma32, N, eps, cd, H, pack_scales, elem="e4m3fn", offset=7):
    inv64 = O.inv_rms_f64(x32, N, eps)
    _, y = O.faithful_chain(x32, gamma32, inv64.astype(np.float32), cd)
    codes, scales = O.mx_encode(y, elem, offset)
    rows = O.assemble_rows(codes, scales, H, pack_scales, H + O.spec_scale_region(H, pack_scales))
    return rows, O.ambiguous_tokens(inv64, cd)


@pytest.mark.parametrize(
    "H,T,pack_scales,N,hidden_dtype,gamma_dtype",
    [
        (512, 130, True, None, torch.bfloat16, torch.bfloat16),
        (1536, 33, False, 1500, torch.bfloat16, torch.float32),
        (2048, 20, True, None, torch.float16, torch.float16),
    ],
)
def test_packed_rows_match_oracle(H, T, pack_scales, N, hidden_dtype, gamma_dtype):
    """Bit-exact bytes vs the numpy model, except tokens whose R_cd(inv_rms) sits within 1e-6 of a
    rounding boundary (the hardware rsqrt is approximate there, spec §1)."""
    g = torch.Generator().manual_seed(H + T)
    x = (torch.randn(1, T, H, generator=g) * 0.5).to(hidden_dtype)
    x[0, 0, :64] = 0  # an all-zero group
    gamma = (torch.randn(H, generator=g) * 0.2 + 1).to(gamma_dtype)
    out = rmsnorm_mx_prefill(x, gamma, pack_scales=pack_scales, unpadded_hidden_size=N)
    cd = O.np_cd(hidden_dtype)
    rows, amb = _oracle_rows(O.to_np32(x[0]), O.to_np32(gamma), N or H, 1e-6, cd, H, pack_scales)
    got = _bytes(out[0])
    assert amb.mean() < 0.05
    assert np.array_equal(got[~amb], rows[~amb])


def test_e5m2_output_dtype():
    H, T = 1024, 16
    x = (torch.randn(1, T, H, generator=torch.Generator().manual_seed(3)) * 0.5).to(torch.bfloat16)
    gamma = torch.ones(H, dtype=torch.bfloat16)
    out = rmsnorm_mx_prefill(x, gamma, qmx_output_dtype="float8_e5m2_x4")
    assert out[0].dtype == torch.float8_e4m3fn  # still labelled e4m3fn (§9.9)
    rows, amb = _oracle_rows(
        O.to_np32(x[0]), O.to_np32(gamma), H, 1e-6, O.BF16, H, True, "e5m2", 14
    )
    assert np.array_equal(_bytes(out[0])[~amb], rows[~amb])
    dec = decode_packed_rows(out[0], H, qmx_output_dtype="float8_e5m2_x4")
    offs = H + np.array([O.spec_scale_offset(g, H, True) for g in range(H // 32)])
    q = rows[:, :H].view(O.E5M2).astype(np.float64).reshape(T, -1, 32)
    expect = (q * np.ldexp(1.0, rows[:, offs].astype(int) - 127)[..., None]).reshape(T, H)
    assert np.array_equal(dec.values.numpy()[~amb], expect.astype(np.float32)[~amb])


def test_ocp_scale_rule_switch():
    H = 512
    x = (torch.randn(1, 4, H, generator=torch.Generator().manual_seed(1))).to(torch.bfloat16)
    a = _bytes(rmsnorm_mx_prefill(x, torch.ones(H))[0])
    b = _bytes(rmsnorm_mx_prefill_reference(x, torch.ones(H), scale_rule=ScaleRule.OCP)[0])
    offs = H + np.array([O.spec_scale_offset(g, H, True) for g in range(16)])
    assert (a[:, offs].astype(int) - b[:, offs].astype(int) == 1).all()  # emax 7 vs 8


def test_three_rounding_chain_is_used():
    """§3.3: R(R(x*g)*R(inv)) differs from R(x*inv*g) for some elements, and the kernel's codes
    follow the three-rounding chain."""
    H, T = 512, 64
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(1, T, H, generator=g) * 0.5).to(torch.bfloat16)
    gamma = (torch.randn(H, generator=g) * 0.2 + 1).to(torch.bfloat16)
    out = rmsnorm_mx_prefill(x, gamma, emit_norm_bf16=True)
    x32, g32 = O.to_np32(x[0]), O.to_np32(gamma)
    inv64 = O.inv_rms_f64(x32, H, 1e-6)
    inv32 = inv64.astype(np.float32)
    _, y_faithful = O.faithful_chain(x32, g32, inv32, O.BF16)
    y_plain = O.round_to(x32 * inv32[:, None] * g32[None, :], O.BF16)  # upstream golden order
    c_faithful, _ = O.mx_encode(y_faithful)
    c_plain, _ = O.mx_encode(y_plain)
    amb = O.ambiguous_tokens(inv64, O.BF16)
    got = _bytes(out[0])[:, :H]
    differ = (c_faithful != c_plain) & ~amb[:, None]
    assert differ.sum() > 10  # the chains really differ on this input
    assert np.array_equal(got[differ], c_faithful[differ])
    assert not np.array_equal(got[differ], c_plain[differ])
    # A crafted row: x = 0.8125 everywhere but x[0] = 1.0, gamma[0] = 1.625.
    # inv_rms = 1.23015 -> R(inv) = 1.2265625; faithful y0 = R(1.625 * 1.2265625) = 1.9921875
    # (scale byte 0x78, code 0x78 = 256); the fp32 chain gives R(1.0 * 1.23015 * 1.625) = 2.0
    # (byte 0x79, code 0x70).
    row = torch.full((H,), 0.8125, dtype=torch.bfloat16)
    row[0] = 1.0
    gm = torch.ones(H, dtype=torch.bfloat16)
    gm[0] = 1.625
    b = _bytes(rmsnorm_mx_prefill(row.view(1, 1, H), gm)[0])[0]
    assert (b[0], b[H]) == (0x78, 0x78)
    # other elements: R(0.8125 * 1.2265625) = 0.99609375 -> x 2^7 = 127.5 -> e4m3 128 = 0x70
    assert b[1] == 0x70


# ----------------------------------------------------------------------------- §3.1, §3.5


def test_residual_interleaved_and_norm_bf16():
    H, T = 1024, 7
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(1, T, H, generator=g) * 0.5).to(torch.bfloat16)
    res = (torch.randn(1, T, H, generator=g) * 0.5).to(torch.bfloat16)
    gamma = (torch.randn(H, generator=g) * 0.2 + 1).to(torch.bfloat16)
    base = rmsnorm_mx_prefill(x, gamma, residual=res, emit_norm_bf16=True)
    s = (x.float() + res.float()).to(torch.bfloat16).view(T, H)
    assert torch.equal(base[1], s)  # output_residual, natural order
    # §3.5: norm_bf16 = bf16((x * inv_rms) * gamma) with fp32 inv_rms
    s64 = s.double()
    inv = 1 / torch.sqrt((s64**2).sum(1, keepdim=True) / H + 1e-6)
    norm = (s64 * inv * gamma.double()).float()
    assert (base[2].float() - norm).abs().max() <= 2**-7 * norm.abs().max()

    # §3.1 interleaved storage: stored[q*(H/4) + p] = natural[4p + q]
    def interleave(t):
        return t.view(1, T, H // 4, 4).transpose(2, 3).reshape(1, T, H)

    inter = rmsnorm_mx_prefill(
        interleave(x), gamma, residual=interleave(res), emit_norm_bf16=True, hidden_interleaved=True
    )
    assert torch.equal(inter[0].view(U8), base[0].view(U8))  # packed: natural order
    assert torch.equal(inter[2], base[2])  # norm_bf16: natural order
    assert torch.equal(inter[1], interleave(s.view(1, T, H)).view(T, H))  # residual: stored order
    assert interleave(x)[0, 0, 1] == x[0, 0, 4]


def test_unpadded_hidden_size_only_changes_divisor():
    H, T = 1024, 5
    x = (torch.randn(1, T, H, generator=torch.Generator().manual_seed(2)) * 0.5).to(torch.bfloat16)
    x[..., 960:] = 0
    gamma = torch.ones(H, dtype=torch.bfloat16)
    out = rmsnorm_mx_prefill(x, gamma, unpadded_hidden_size=960, emit_norm_bf16=True)
    s = x.double().view(T, H)
    inv = 1 / torch.sqrt((s**2).sum(1, keepdim=True) / 960 + 1e-6)
    assert torch.allclose(out[1].double(), s * inv, rtol=2**-7, atol=0)
    b = out[0].view(U8)
    assert not b[:, 960:H].any()  # zero pad quantizes to code 0, its groups get byte 0
    offs = H + torch.tensor([O.spec_scale_offset(g, H, True) for g in (30, 31)])
    assert not b[:, offs].any()


def test_results_independent_of_token_chunking():
    """Tokens are independent (spec §1): the quant path is bit-identical whatever the chunking or
    the batch; router logits come from a BLAS fp32 matmul whose summation order may depend on
    the batch size (§5.1: not bit-exact by nature), so routing is compared to fp32 rounding."""
    H, T = 512, 300
    g = torch.Generator().manual_seed(9)
    x = (torch.randn(2, T // 2, H, generator=g) * 0.5).to(torch.bfloat16)
    gamma = (torch.randn(H, generator=g) * 0.2 + 1).to(torch.bfloat16)
    w = (torch.randn(H, 16, generator=g) * 0.1).to(torch.bfloat16)
    for act, bias in (("noaux_tc", torch.zeros(16)), ("softmax", None)):
        args = (gamma, w, bias, 1e-6, 4, act, 4, 2, 2.5)
        a = rmsnorm_mx_prefill_reference(x, *args, emit_norm_bf16=True)
        b = rmsnorm_mx_prefill_reference(x, *args, emit_norm_bf16=True, token_chunk=7)
        c = rmsnorm_mx_prefill_reference(x[:1], *args, emit_norm_bf16=True)
        for other, n in ((b, T), (c, T // 2)):
            assert torch.equal(a[0][:n].view(U8), other[0].view(U8))
            assert torch.equal(a[-1][:n], other[-1])  # norm_bf16
            assert torch.allclose(a[-2][:n].float(), other[-2].float(), rtol=1e-5, atol=1e-6)
            if act == "softmax":
                assert torch.equal(a[1][:n], other[1])  # expert_index


def test_decode_matches_dequantize_formula():
    H, T = 1024, 9
    x = (torch.randn(1, T, H, generator=torch.Generator().manual_seed(4)) * 3).to(torch.bfloat16)
    for pack in (True, False):
        out = rmsnorm_mx_prefill(x, torch.ones(H), pack_scales=pack)
        dec = decode_packed_rows(out[0], H, pack_scales=pack)
        b = _bytes(out[0])
        offs = H + np.array([O.spec_scale_offset(g, H, pack) for g in range(H // 32)])
        assert np.array_equal(dec.codes.numpy(), b[:, :H]) and np.array_equal(
            dec.scales.numpy(), b[:, offs]
        )
        q = b[:, :H].view(O.E4M3).astype(np.float64).reshape(T, -1, 32)
        expect = q * np.ldexp(1.0, b[:, offs].astype(int) - 127)[..., None]
        assert np.array_equal(dec.values.numpy(), expect.reshape(T, H).astype(np.float32))
        # the MX round trip stays within e4m3's half-ulp (2^-4 relative) of the normalized input,
        # plus the flush of elements far below the group max
        s = x.double().view(T, H)
        y = s / torch.sqrt((s**2).mean(1, keepdim=True) + 1e-6)
        err = (dec.values.double() - y).abs()
        assert (err <= y.abs() * (2**-4 + 2**-7) + y.abs().amax(1, keepdim=True) * 2**-9).all()
