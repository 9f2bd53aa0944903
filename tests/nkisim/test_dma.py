"""DMA: dma_copy (casts, gather/scatter, OOB), dma_compute, dma_transpose (spec §6)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from mxcli.nkisim import NkiOutOfBoundsError, NkiValidationError
from mxcli.nkisim.nki import isa as nisa
from mxcli.nkisim.nki import language as nl
from mxcli.nkisim.nki.isa.constants import dge_mode, oob_mode
from tests.nkisim.conftest import run, run_report


def test_dma_copy_casts_through_fp32_with_rne() -> None:
    # values chosen on bf16 ties: 1 + 2^-8 rounds to 1 (even), 1 + 3*2^-8 rounds up
    x = np.array([[1 + 2**-8, 1 + 3 * 2**-8, 500.0, 1e6]], dtype=np.float32)

    def k(x):
        b = nl.ndarray((1, 4), nl.bfloat16)
        nisa.dma_copy(dst=b, src=x)
        f8 = nl.ndarray((1, 4), nl.float8_e4m3fn)
        nisa.dma_copy(dst=f8, src=x)
        i = nl.ndarray((1, 4), nl.int8)
        nisa.dma_copy(dst=i, src=x)
        ob = nl.ndarray((1, 4), nl.bfloat16, buffer=nl.shared_hbm)
        o8 = nl.ndarray((1, 4), nl.uint8, buffer=nl.shared_hbm)
        oi = nl.ndarray((1, 4), nl.int8, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=ob, src=b)
        nisa.dma_copy(dst=o8, src=f8.view(nl.uint8))
        nisa.dma_copy(dst=oi, src=i)
        return ob, o8, oi

    ob, o8, oi = run(k, x)
    np.testing.assert_array_equal(ob.astype(np.float32)[0, :2], [1.0, 1 + 2**-6])
    assert ob.dtype == ml_dtypes.bfloat16
    # e4m3fn: 500 > 464 -> NaN (ml_dtypes overflow rule, spec §2.4)
    np.testing.assert_array_equal(o8[0], x.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)[0])
    np.testing.assert_array_equal(oi[0], [1, 1, 127, 127])  # RNE then saturate


def test_dma_copy_same_dtype_is_bit_exact_and_shapes_may_differ() -> None:
    x = np.arange(64, dtype=np.uint32).view(np.float32)  # denormal / odd patterns

    def k(x):
        t = nl.ndarray((1, 64), nl.float32)
        nisa.dma_copy(dst=t, src=x)
        out = nl.ndarray((8, 8), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=t)
        return out

    out = run(k, x)
    np.testing.assert_array_equal(out.view(np.uint32).reshape(-1), np.arange(64))

    def bad(x):
        t = nl.ndarray((1, 32), nl.float32)
        nisa.dma_copy(dst=t, src=x)

    with pytest.raises(NkiValidationError, match="element count"):
        run(bad, x)


def test_dma_copy_rejects_psum_and_hwdge_dtype_change() -> None:
    def psum(x):
        p = nl.ndarray((1, 4), nl.float32, buffer=nl.psum)
        nisa.dma_copy(dst=p, src=x)

    with pytest.raises(NkiValidationError, match="PSUM"):
        run(psum, np.zeros((1, 4), np.float32))

    def hw(x):
        t = nl.ndarray((1, 4), nl.bfloat16)
        nisa.dma_copy(dst=t, src=x, dge_mode=dge_mode.hwdge)

    with pytest.raises(NkiValidationError, match="hwdge needs equal"):
        run(hw, np.zeros((1, 4), np.float32))

    def removed(x):
        t = nl.ndarray((1, 4), nl.float32)
        nisa.dma_copy(dst=t, src=x, dst_rmw_op=nl.add)

    with pytest.raises(TypeError, match="dma_compute"):
        run(removed, np.zeros((1, 4), np.float32))


def _gather_kernel(skip: bool):
    def k(table, idx):
        # table [V, H] in HBM, idx [P, 1] int32 (-1 = padding)
        V, H = table.shape
        P = idx.shape[0]
        it = nl.ndarray((P, 1), nl.int32)
        nisa.dma_copy(dst=it, src=idx)
        rows = nl.ndarray((P, H), nl.float32)
        nisa.memset(rows, 0.0)
        nisa.dma_copy(
            dst=rows,
            src=table.ap([[H, P], [1, H]], offset=0, vector_offset=it, indirect_dim=0),
            oob_mode=oob_mode.skip if skip else oob_mode.error,
        )
        out = nl.ndarray((P, H), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=rows)
        return out

    return k


def test_indirect_gather_with_padding_skip_and_error(rng) -> None:
    table = rng.standard_normal((50, 16)).astype(np.float32)
    idx = rng.integers(0, 50, (128, 1)).astype(np.int32)
    idx[::7] = -1
    out, rep = run_report(_gather_kernel(True), table, idx)
    expect = np.where(idx >= 0, table[np.clip(idx[:, 0], 0, None)], 0.0)
    np.testing.assert_array_equal(out, expect)
    valid = int((idx >= 0).sum())
    assert rep.counters.hbm_read_bytes == 128 * 4 + valid * 16 * 4 + 0
    with pytest.raises(NkiOutOfBoundsError, match="row 0 index -1"):
        run(_gather_kernel(False), table, idx)
    idx2 = idx.copy()
    idx2[::7] = 50  # index == V is out of bounds too
    with pytest.raises(NkiOutOfBoundsError, match="out of bounds"):
        run(_gather_kernel(False), table, idx2)


def test_indirect_scatter_last_write_wins_and_skip(rng) -> None:
    def k(dst, src, idx):
        P, H = src.shape
        it = nl.ndarray((P, 1), nl.int32)
        nisa.dma_copy(dst=it, src=idx)
        s = nl.ndarray((P, H), nl.float32)
        nisa.dma_copy(dst=s, src=src)
        nisa.dma_copy(
            dst=dst.ap([[H, P], [1, H]], offset=0, vector_offset=it, indirect_dim=0),
            src=s,
            oob_mode=oob_mode.skip,
        )

    dst = np.zeros((10, 4), np.float32)
    src = np.arange(32, dtype=np.float32).reshape(8, 4)
    idx = np.array([[3], [1], [3], [-1], [9], [0], [12], [1]], dtype=np.int32)
    run(k, dst, src, idx)  # writes the caller's array in place
    expect = np.zeros((10, 4), np.float32)
    for p in range(8):  # plain loop oracle: in partition order, OOB skipped
        if 0 <= idx[p, 0] < 10:
            expect[idx[p, 0]] = src[p]
    np.testing.assert_array_equal(dst, expect)


def test_dma_compute_residual_add_and_scatter_add(rng) -> None:
    a = rng.standard_normal((128, 32)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((128, 32)).astype(ml_dtypes.bfloat16)

    def residual(a, b):
        t = nl.ndarray((128, 32), nl.float32)
        nisa.dma_compute(dst=t, srcs=[a, b], reduce_op=nl.add)
        out = nl.ndarray((128, 32), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=t)
        return out

    out = run(residual, a, b)
    np.testing.assert_array_equal(out, a.astype(np.float32) + b.astype(np.float32))

    def scatter_add(acc, data, idx):
        P, H = data.shape
        it = nl.ndarray((P, 1), nl.int32)
        nisa.dma_copy(dst=it, src=idx)
        d = nl.ndarray((P, H), nl.float32)
        nisa.dma_copy(dst=d, src=data)
        view = acc.ap([[H, P], [1, H]], offset=0, vector_offset=it, indirect_dim=0)
        nisa.dma_compute(dst=view, srcs=[view, d], reduce_op=nl.add, oob_mode=oob_mode.skip)

    acc = rng.standard_normal((20, 8)).astype(np.float32)
    before = acc.copy()
    data = rng.standard_normal((16, 8)).astype(np.float32)
    idx = rng.permutation(20)[:16].reshape(16, 1).astype(np.int32)
    idx[5] = -1
    run(scatter_add, acc, data, idx)
    expect = before.copy()
    for p in range(16):
        if idx[p, 0] >= 0:
            expect[idx[p, 0]] += data[p]
    np.testing.assert_allclose(acc, expect, rtol=1e-6)
    idx[3] = idx[4]
    with pytest.raises(NkiValidationError, match="duplicate"):
        run(scatter_add, acc, data, idx)


def test_dma_compute_rules() -> None:
    def bad_op(a):
        t = nl.ndarray((1, 4), nl.float32)
        nisa.dma_compute(dst=t, srcs=[a, a], reduce_op=nl.multiply)

    with pytest.raises(NkiValidationError, match="nl.add"):
        run(bad_op, np.zeros((1, 4), np.float32))

    def bad_skip(a):
        t = nl.ndarray((1, 4), nl.float32)
        nisa.dma_compute(dst=t, srcs=[a], reduce_op=nl.add, oob_mode=oob_mode.skip)

    with pytest.raises(NkiValidationError, match="vector_offset"):
        run(bad_skip, np.zeros((1, 4), np.float32))


def test_dma_transpose_2d_and_4d_ap_form() -> None:
    x = np.arange(16 * 24, dtype=np.int32).reshape(16, 24)

    def k(x):
        t = nl.ndarray((24, 16), nl.int32)
        nisa.dma_transpose(dst=t, src=x)
        out = nl.ndarray((24, 16), nl.int32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=t)
        return out

    np.testing.assert_array_equal(run(k, x), x.T)

    NT = 3
    idx = np.arange(128 * NT, dtype=np.int32)

    def k4(idx):  # MoE token-index load: 4-D .ap views emulate a 2-D transpose
        sb = nl.ndarray((NT, 128), nl.int32)
        nisa.dma_transpose(
            dst=sb.ap([[128, NT], [1, 1], [1, 1], [1, 128]]),
            src=idx.ap([[1, 128], [1, 1], [1, 1], [128, NT]], offset=0),
        )
        out = nl.ndarray((NT, 128), nl.int32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=sb)
        return out

    np.testing.assert_array_equal(run(k4, idx), idx.reshape(NT, 128))

    def bad_shape(x):
        nisa.dma_transpose(dst=nl.ndarray((16, 24), nl.int32), src=x)

    with pytest.raises(NkiValidationError, match="permuted src shape"):
        run(bad_shape, x)

    def hw4(x):
        nisa.dma_transpose(dst=nl.ndarray((24, 16), nl.int32), src=x, dge_mode=dge_mode.hwdge)

    with pytest.raises(NkiValidationError, match="2-byte"):
        run(hw4, x)


def test_scalar_offset_hwdge_expert_slice() -> None:
    # per-expert weight slice addressed by a (1,1) SBUF int32 scalar offset (MoE backward)
    E, R, C = 4, 8, 16
    w = np.arange(E * R * C, dtype=np.float32).reshape(E, R, C)

    def k(w, e):
        et = nl.ndarray((1, 1), nl.int32)
        nisa.dma_copy(dst=et, src=e)
        t = nl.ndarray((R, C), nl.float32)
        nisa.dma_copy(
            dst=t,
            src=w.ap([[C, R], [1, C]], offset=0, scalar_offset=et[0:1, 0:1], indirect_dim=0),
            dge_mode=dge_mode.hwdge,
        )
        out = nl.ndarray((R, C), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=t)
        return out

    np.testing.assert_array_equal(run(k, w, np.array([[2]], np.int32)), w[2])
    with pytest.raises(NkiOutOfBoundsError, match="dynamic offset 4"):
        run(k, w, np.array([[4]], np.int32))
