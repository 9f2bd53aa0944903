"""Tensor engine and MX ops: nc_matmul, nc_transpose, quantize_mx, nc_matmul_mx (spec §7)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from mxcli import mx
from mxcli.nkisim import NkiValidationError
from mxcli.nkisim.nki import isa as nisa
from mxcli.nkisim.nki import language as nl
from tests.nkisim.conftest import run, run_report

BF16 = ml_dtypes.bfloat16


def _bf16(a: np.ndarray) -> np.ndarray:
    return a.astype(BF16)


def _load(x, dtype=None, shape=None):
    t = nl.ndarray(shape or x.shape, dtype or x.dtype)
    nisa.dma_copy(dst=t, src=x)
    return t


def _store(tile, dtype=None):
    out = nl.ndarray(tile.shape, dtype or tile.dtype, buffer=nl.shared_hbm)
    if tile.buffer == nl.psum:
        sb = nl.ndarray(tile.shape, dtype or tile.dtype)
        nisa.tensor_copy(dst=sb, src=tile)
        tile = sb
    nisa.dma_copy(dst=out, src=tile)
    return out


# -- nc_matmul -------------------------------------------------------------------------------


def test_nc_matmul_auto_accumulate_and_explicit(rng) -> None:
    a = _bf16(rng.standard_normal((3, 128, 64)))
    b = _bf16(rng.standard_normal((3, 128, 200)))

    def k(a, b):
        ps = nl.ndarray((64, 200), nl.float32, buffer=nl.psum)
        for i in range(3):  # accumulate=None: first write overwrites, later ones add
            nisa.nc_matmul(dst=ps, stationary=_load(a[i]), moving=_load(b[i]))
        ps2 = nl.ndarray((64, 200), nl.float32, buffer=nl.psum)
        for i in range(3):
            nisa.nc_matmul(dst=ps2, stationary=_load(a[i]), moving=_load(b[i]), accumulate=(i > 0))
        ps3 = nl.ndarray((64, 200), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=ps3, stationary=_load(a[0]), moving=_load(b[0]))
        nisa.nc_matmul(dst=ps3, stationary=_load(a[1]), moving=_load(b[1]), accumulate=False)
        return _store(ps), _store(ps2), _store(ps3)

    (o1, o2, o3), rep = run_report(k, a, b)
    af, bf = a.astype(np.float32), b.astype(np.float32)
    ref = sum(af[i].T @ bf[i] for i in range(3))
    np.testing.assert_allclose(o1, ref, rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(o1, o2)
    np.testing.assert_allclose(o3, af[1].T @ bf[1], rtol=1e-5, atol=1e-4)
    assert rep.counters.matmul_flops == 8 * 2 * 128 * 64 * 200
    assert rep.counters.instructions["tensor"] == 8


def test_nc_matmul_auto_accumulate_counts_non_matmul_writes_spec_12_5(rng) -> None:
    a = _bf16(rng.standard_normal((128, 32)))
    b = _bf16(rng.standard_normal((128, 16)))

    def k(a, b):
        ps = nl.ndarray((32, 16), nl.float32, buffer=nl.psum)
        nisa.memset(ps[:, 0:8], 1.0)  # half the columns written by a non-matmul instruction
        nisa.nc_matmul(dst=ps, stationary=_load(a), moving=_load(b))
        return _store(ps)

    out = run(k, a, b)
    ref = a.astype(np.float32).T @ b.astype(np.float32)
    np.testing.assert_allclose(out[:, :8], ref[:, :8] + 1.0, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(out[:, 8:], ref[:, 8:], rtol=1e-5, atol=1e-4)


def test_nc_matmul_accumulate_true_on_unwritten_psum_is_an_uninit_read(rng) -> None:
    def k(a):
        ps = nl.ndarray((8, 8), nl.float32, buffer=nl.psum)
        t = _load(a)
        nisa.nc_matmul(dst=ps, stationary=t, moving=t, accumulate=True)

    with pytest.raises(NkiValidationError, match="never written"):
        run(k, _bf16(rng.standard_normal((16, 8))))


def test_nc_matmul_bf16_psum_rounds_each_write(rng) -> None:
    a = _bf16(rng.standard_normal((128, 8)))
    b = _bf16(rng.standard_normal((128, 8)))

    def k(a, b):
        ps = nl.ndarray((8, 8), nl.bfloat16, buffer=nl.psum)
        nisa.nc_matmul(dst=ps, stationary=_load(a), moving=_load(b))
        nisa.nc_matmul(dst=ps, stationary=_load(a), moving=_load(b))
        return _store(ps)

    out = run(k, a, b).astype(np.float32)
    r = (a.astype(np.float32).T @ b.astype(np.float32)).astype(BF16).astype(np.float32)
    expect = (r + (a.astype(np.float32).T @ b.astype(np.float32))).astype(BF16).astype(np.float32)
    np.testing.assert_allclose(out, expect, rtol=1e-2)
    # bf16 dst is v4-only
    with pytest.raises(NkiValidationError, match="dst dtype"):
        run(k, a, b, target="trn2")


@pytest.mark.parametrize(
    "shapes, match",
    [
        (((128, 129), (128, 64), (128, 64)), "stationary free size"),
        (((128, 64), (128, 600), (64, 600)), "moving free size"),
        # dim 0 of an on-chip tensor is its partition dim: rejected at allocation
        (((256, 64), (256, 64), (64, 64)), r"256 partitions.*\[partition-dim\]"),
        (((128, 64), (64, 64), (64, 64)), "partition count differs"),
    ],
)
def test_nc_matmul_limits(shapes, match) -> None:
    (sk, sm), (mk, mn), dshape = shapes

    def k(_):
        s = nl.zeros((sk, sm), nl.bfloat16)
        m = nl.zeros((mk, mn), nl.bfloat16)
        d = nl.ndarray(dshape, nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=d, stationary=s, moving=m)

    with pytest.raises(NkiValidationError, match=match):
        run(k, np.zeros(1, np.float32), target="trn2")


def test_nc_matmul_moving_limit_is_larger_on_trn3() -> None:
    def k(_):
        s = nl.zeros((128, 8), nl.bfloat16)
        m = nl.zeros((128, 2048), nl.bfloat16)
        d = nl.ndarray((8, 2048), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=d, stationary=s, moving=m)

    run(k, np.zeros(1, np.float32), target="trn3")
    with pytest.raises(NkiValidationError, match="moving free size 2048 exceeds 512"):
        run(k, np.zeros(1, np.float32), target="trn2")


def test_nc_matmul_buffer_and_dtype_rules() -> None:
    def psum_input(_):
        s = nl.zeros((128, 8), nl.float32, buffer=nl.psum)
        m = nl.zeros((128, 8), nl.float32)
        nisa.nc_matmul(dst=nl.ndarray((8, 8), nl.float32, buffer=nl.psum), stationary=s, moving=m)

    with pytest.raises(NkiValidationError, match="stationary must be in sbuf"):
        run(psum_input, np.zeros(1, np.float32))

    def mixed(_):
        s = nl.zeros((128, 8), nl.float32)
        m = nl.zeros((128, 8), nl.bfloat16)
        nisa.nc_matmul(dst=nl.ndarray((8, 8), nl.float32, buffer=nl.psum), stationary=s, moving=m)

    with pytest.raises(NkiValidationError, match="fp32/tf32"):
        run(mixed, np.zeros(1, np.float32))

    def bank(_):  # v2/v3: 512 fp32 starting mid-bank crosses into the next bank
        s = nl.zeros((128, 8), nl.bfloat16)
        m = nl.zeros((128, 512), nl.bfloat16)
        d = nl.ndarray((8, 1024), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=d[:, 256:768], stationary=s, moving=m)

    with pytest.raises(NkiValidationError, match="PSUM bank"):
        run(bank, np.zeros(1, np.float32), target="trn2")


def test_nc_matmul_is_transpose_and_nc_transpose_bit_exact(rng) -> None:
    x = rng.standard_normal((128, 96)).astype(np.float32)
    x.view(np.uint32)[0, 0] = 0x7FC01234  # a NaN payload must survive

    def k(x):
        t = _load(x)
        ident = nl.shared_identity_matrix(128, dtype=nl.float32)
        p1 = nl.ndarray((96, 128), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(
            dst=p1, stationary=t, moving=ident, is_transpose=True, is_moving_onezero=True
        )
        p2 = nl.ndarray((96, 128), nl.float32, buffer=nl.psum)
        nisa.nc_transpose(dst=p2, data=t)
        small = nl.ndarray((32, 32), nl.float32)
        nisa.nc_transpose(dst=small, data=t[0:32, 0:32])  # SBUF dst -> Vector engine
        return _store(p1), _store(p2), _store(small)

    (o1, o2, o3), rep = run_report(k, x)
    assert (o1.view(np.uint32) == x.T.view(np.uint32)).all()
    assert (o2.view(np.uint32) == x.T.view(np.uint32)).all()
    assert (o3.view(np.uint32) == x[:32, :32].T.view(np.uint32)).all()
    assert rep.counters.instructions["vector"] >= 1

    def too_big(x):
        t = _load(x)
        nisa.nc_transpose(dst=nl.ndarray((96, 128), nl.float32), data=t)  # Vector caps 32x32

    with pytest.raises(NkiValidationError, match="at most 32x32"):
        run(too_big, x)


def test_broadcast_by_transpose_keeps_nan_in_its_column_matmul_spreads_it() -> None:
    """A column broadcast to 128 partitions (the prefill kernel's inv_rms, one value per token).
    As a PE transpose of the stride-0 view it is a data move (api spec §7.4 "Bit-exact copy of
    elements"): a NaN stays in its token's column. As a matmul against the identity it is fp32
    arithmetic (§7.1 "Products and accumulation in fp32"): NaN * 0 = NaN reaches every column."""
    col = np.arange(1, 9, dtype=np.float32).reshape(8, 1)
    col[3, 0] = np.nan

    def k(c):
        t = _load(c)
        by_transpose = nl.ndarray((128, 8), nl.float32, buffer=nl.psum)
        nisa.nc_transpose(dst=by_transpose, data=t.broadcast(1, 128))
        ident = nl.shared_identity_matrix(128, dtype=nl.float32)
        by_matmul = nl.ndarray((128, 8), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(
            dst=by_matmul, stationary=t.broadcast(1, 128), moving=ident[0:8, 0:8],
            is_moving_onezero=True,
        )  # fmt: skip
        return _store(by_transpose), _store(by_matmul)

    tr, mm = run(k, col)
    expect = np.broadcast_to(col.T, (128, 8))
    assert np.array_equal(tr, expect, equal_nan=True)  # NaN in column 3 only
    assert np.isnan(mm).all()  # 0 * NaN in every column


def test_fp8_pe_transpose_into_step2_psum_view() -> None:
    codes = np.arange(128 * 128, dtype=np.uint8).reshape(128, 128)

    def k(c):
        t = _load(c)
        p = nl.ndarray((128, 128, 2), nl.float8_e5m2, buffer=nl.psum)
        nisa.nc_transpose(dst=p[:, :, 0], data=t.view(nl.float8_e5m2))
        out = nl.ndarray((128, 128), nl.float8_e5m2)
        nisa.tensor_copy(dst=out, src=p[:, :, 0])
        return _store(out.view(nl.uint8))

    out = run(k, codes)
    np.testing.assert_array_equal(out, codes.T)


# -- quantize_mx -----------------------------------------------------------------------------


def _oracle_quant(x: np.ndarray, elem: str) -> tuple[np.ndarray, np.ndarray]:
    """Hardware grouping (8 partitions x 4 columns) expressed with mxcli.mx's 32-groups."""
    P, n = x.shape
    xt = torch.from_numpy(np.ascontiguousarray(x).view(np.int16)).view(torch.bfloat16)
    g = xt.reshape(P // 8, 8, n // 4, 4).permute(0, 2, 1, 3).reshape(P // 8, n // 4, 32)
    c, s = mx.quantize_mx(g, axis=-1, elem=elem, rule=mx.ScaleRule.NEURON)
    codes = c.reshape(P // 8, n // 4, 8, 4).permute(0, 2, 1, 3).reshape(P, n).numpy()
    return codes, s.reshape(P // 8, n // 4).numpy()


@pytest.mark.parametrize("elem, dt", [("e4m3fn", "float8_e4m3fn_x4"), ("e5m2", "float8_e5m2_x4")])
@pytest.mark.parametrize("start", [0, 4, 8, 12])
def test_quantize_mx_bit_identical_to_mxcli_mx(rng, elem, dt, start) -> None:
    P, n = 128, 64
    x = (rng.standard_normal((P, n)) * np.exp2(rng.integers(-20, 20, (P, 1)))).astype(BF16)
    x[0:8, 0:4] = 0  # an all-zero group
    x[8, 8] = np.inf

    code_dtype = getattr(nl, dt)

    def k(x):
        src = _load(x)
        q = nl.ndarray((P, n // 4), code_dtype)
        s = nl.ndarray((P, n // 4), nl.uint8)
        nisa.memset(s, 0)
        nisa.quantize_mx(dst=q, src=src, dst_scale=s[start:, :])
        return _store(q.view(nl.uint8)), _store(s)

    qb, s = run(k, x)
    codes, scales = _oracle_quant(x, elem)
    np.testing.assert_array_equal(qb, codes)  # byte k of word j = code of column 4j + k
    words = mx.pack_x4(torch.from_numpy(codes), axis=-1).numpy()
    np.testing.assert_array_equal(qb.view(np.uint32), words)
    rows = [start + 32 * q + g for q in range(4) for g in range(4)]
    np.testing.assert_array_equal(s[rows], scales)
    other = np.setdiff1d(np.arange(P), rows)
    assert (s[other] == 0).all()  # nothing else written


def test_quantize_mx_3d_views_and_rules(rng) -> None:
    x = rng.standard_normal((32, 16)).astype(BF16)

    def k(x):
        src = _load(x)
        q = nl.ndarray((32, 2, 4), nl.float8_e4m3fn_x4)
        s = nl.ndarray((4, 2, 4), nl.uint8)  # compact K <= 32 scale tile (K//8 rows)
        nisa.quantize_mx(dst=q[0:32, 1:2, 0:4], src=src, dst_scale=s[0:4, 1:2, 0:4])
        return _store(q[:, 1, :].view(nl.uint8)), _store(s[:, 1, :])

    qb, s = run(k, x)
    codes, scales = _oracle_quant(x, "e4m3fn")
    np.testing.assert_array_equal(qb, codes)
    np.testing.assert_array_equal(s, scales)

    def bad_p(x):
        nisa.quantize_mx(
            dst=nl.ndarray((16, 4), nl.float8_e4m3fn_x4),
            src=_load(x)[0:16],
            dst_scale=nl.ndarray((16, 4), nl.uint8),
        )

    with pytest.raises(NkiValidationError, match="multiple of 32"):
        run(bad_p, x)

    def bad_start(x):
        nisa.quantize_mx(
            dst=nl.ndarray((32, 4), nl.float8_e4m3fn_x4),
            src=_load(x),
            dst_scale=nl.ndarray((32, 4), nl.uint8)[2:, :],
        )

    with pytest.raises(NkiValidationError, match="quadrant offset"):
        run(bad_start, x)

    def fp32_src(x):
        nisa.quantize_mx(
            dst=nl.ndarray((32, 4), nl.float8_e4m3fn_x4),
            src=nl.zeros((32, 16), nl.float32),
            dst_scale=nl.ndarray((32, 4), nl.uint8),
        )

    with pytest.raises(NkiValidationError, match="bfloat16 or float16"):
        run(fp32_src, x)

    def ok(x):
        nisa.quantize_mx(
            dst=nl.ndarray((32, 4), nl.float8_e4m3fn_x4),
            src=_load(x),
            dst_scale=nl.ndarray((4, 4), nl.uint8),
        )

    with pytest.raises(NkiValidationError, match="NeuronCore-v4"):
        run(ok, x, target="trn2")


# -- nc_matmul_mx ----------------------------------------------------------------------------


def test_nc_matmul_mx_equals_dequantize_then_matmul(rng) -> None:
    K, M, N = 128, 32, 48  # contraction 4K = 512
    a = (rng.standard_normal((K, 4 * M))).astype(BF16)  # [K, 4M]: x4 lanes along free
    b = (rng.standard_normal((K, 4 * N)) * 10).astype(BF16)

    def k(a, b):
        qa = nl.ndarray((K, M), nl.float8_e4m3fn_x4)
        sa = nl.ndarray((K, M), nl.uint8)
        qb = nl.ndarray((K, N), nl.float8_e5m2_x4)
        sb = nl.ndarray((K, N), nl.uint8)
        nisa.memset(sa, 0)
        nisa.memset(sb, 0)
        nisa.quantize_mx(dst=qa, src=_load(a), dst_scale=sa)
        nisa.quantize_mx(dst=qb, src=_load(b), dst_scale=sb[4:, :])
        ps = nl.ndarray((M, N), nl.float32, buffer=nl.psum)
        nisa.nc_matmul_mx(
            dst=ps, stationary=qa, moving=qb, stationary_scale=sa, moving_scale=sb[4:, :]
        )
        # a 16-row "short" scale view of a 128-partition operand reads rows 32q+g of storage
        ps2 = nl.ndarray((M, N), nl.float32, buffer=nl.psum)
        nisa.nc_matmul_mx(
            dst=ps2,
            stationary=qa,
            moving=qb,
            stationary_scale=sa[0:16, :],
            moving_scale=sb[4:20, :],
        )
        return (
            _store(ps),
            _store(ps2),
            _store(qa.view(nl.uint8)),
            _store(sa),
            _store(qb.view(nl.uint8)),
            _store(sb),
        )

    (o, o2, ca, sa, cb, sb), rep = run_report(k, a, b)
    np.testing.assert_array_equal(o, o2)

    def deq(codes, scales, elem, start):  # codes [K, 4F], scales storage [K, F]
        vals = mx.fp8_decode(torch.from_numpy(codes), elem).numpy()  # [K, 4F]
        rows = np.array([start + 32 * (p // 32) + (p % 32) // 8 for p in range(K)])
        sc = mx.e8m0_decode(torch.from_numpy(scales[rows])).numpy()  # [K, F]
        return vals * np.repeat(sc, 4, axis=1)

    da = deq(ca, sa, "e4m3fn", 0).reshape(K, M, 4).transpose(0, 2, 1).reshape(4 * K, M)
    db = deq(cb, sb, "e5m2", 4).reshape(K, N, 4).transpose(0, 2, 1).reshape(4 * K, N)
    ref = da.astype(np.float64).T @ db.astype(np.float64)
    np.testing.assert_allclose(o, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    # and it approximates the bf16 product (MXFP8 error ~ a few %)
    exact = a.astype(np.float32).reshape(K, M, 4).transpose(0, 2, 1).reshape(4 * K, M).T @ b.astype(
        np.float32
    ).reshape(K, N, 4).transpose(0, 2, 1).reshape(4 * K, N)
    assert np.linalg.norm(o - exact) / np.linalg.norm(exact) < 0.1
    assert rep.counters.mx_matmul_flops == 2 * 2 * 4 * K * M * N


def test_nc_matmul_mx_rules() -> None:
    def mk(K, M, N, sdt=nl.float8_e4m3fn_x4, scale_rows=None, dst_dt=nl.float32):
        def k(_):
            s = nl.zeros((K, M), sdt)
            m = nl.zeros((K, N), nl.float8_e4m3fn_x4)
            ss = nl.zeros((scale_rows or K, M), nl.uint8)
            ms = nl.zeros((K, N), nl.uint8)
            d = nl.ndarray((M, N), dst_dt, buffer=nl.psum)
            nisa.nc_matmul_mx(dst=d, stationary=s, moving=m, stationary_scale=ss, moving_scale=ms)

        return k

    z = np.zeros(1, np.float32)
    run(mk(64, 16, 64), z)
    with pytest.raises(NkiValidationError, match="multiple of 32"):
        run(mk(48, 16, 64), z)
    with pytest.raises(NkiValidationError, match="even"):
        run(mk(64, 15, 64), z)
    with pytest.raises(NkiValidationError, match="x4"):
        run(mk(64, 16, 64, sdt=nl.bfloat16), z)
    with pytest.raises(NkiValidationError, match="scale rows"):
        run(mk(64, 16, 64, scale_rows=8), z)
    with pytest.raises(NkiValidationError, match="NeuronCore-v4"):
        run(mk(64, 16, 64), z, target="trn2")
