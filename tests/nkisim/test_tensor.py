"""Data model: storage + views, indexing, nl.ds, reshape, view(dtype), .ap, sentinels (spec §2-§4)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from mxcli.nkisim import NkiUninitializedReadError, NkiValidationError
from mxcli.nkisim.nki import isa as nisa
from mxcli.nkisim.nki import language as nl
from mxcli.nkisim.tensor import resolve
from tests.nkisim.conftest import DUMMY, run


def _in_kernel(body):  # run `body()` inside a kernel context, return its value
    box = {}

    def k(_):
        box["v"] = body()

    run(k, DUMMY)
    return box["v"]


def test_fresh_ndarray_strides_offset() -> None:
    def body():
        t = nl.ndarray((128, 64), nl.float32)
        u = nl.ndarray((16, 4, 8), nl.bfloat16)
        return t.shape, t.strides, t.offset, u.strides, t.size, t.ndim, str(t.dtype)

    assert _in_kernel(body) == ((128, 64), (64, 1), 0, (32, 8, 1), 8192, 2, "float32")


def test_on_chip_integer_indexing_rules_spec_4_3() -> None:
    # language guide examples: t(64,64,64)[0,0,10] -> (1,1), t[:,0] -> (64,64),
    # t[:,0,10] -> (64,1), t[0,...,:] -> (1,64,64)
    def body():
        t = nl.ndarray((64, 64, 64), nl.float32)
        h = nl.ndarray((64, 64, 64), nl.float32, buffer=nl.hbm)
        return (
            t[0, 0, 10].shape,
            t[:, 0].shape,
            t[:, 0, 10].shape,
            t[0, ..., :].shape,
            h[0].shape,
            h[:, 0, 10].shape,
            t[:, 0, 10].offset,
        )

    assert _in_kernel(body) == ((1, 1), (64, 64), (64, 1), (1, 64, 64), (64, 64), (64,), 10)


def test_slices_ds_and_bounds() -> None:
    def body():
        t = nl.ndarray((128, 100), nl.float32)
        a = t[8:16, 10:90:4]
        b = t[nl.ds(32, 32), nl.ds(5, 10)]
        c = t[-8:, :-1]
        return a.shape, a.strides, a.offset, b.shape, b.offset, c.shape, c.offset

    assert _in_kernel(body) == ((8, 20), (100, 4), 810, (32, 10), 3205, (8, 99), 12000)

    def bad():
        t = nl.ndarray((128, 100), nl.float32)
        return t[0:129]

    with pytest.raises(NkiValidationError, match="out of range"):
        _in_kernel(bad)


def test_reshape_permute_view_and_layout_errors() -> None:
    def body():
        h = nl.ndarray((4, 6, 8), nl.float32, buffer=nl.hbm)
        r = h.reshape((24, 8))
        p = h.reshape((4, 48)).reshape((4, 6, 8)).permute((1, 0, 2))
        s = nl.ndarray((128, 256), nl.float32)
        v = s.view(nl.bfloat16)
        w = nl.ndarray((128, 64), nl.uint8).view(nl.float8_e4m3fn_x4)
        return r.strides, p.shape, p.strides, v.shape, v.strides, w.shape, str(w.dtype)

    assert _in_kernel(body) == (
        (8, 1),
        (6, 4, 8),
        (8, 48, 1),
        (128, 512),
        (512, 1),
        (128, 16),
        "float8_e4m3fn_x4",
    )

    def bad_reshape():
        h = nl.ndarray((4, 6, 8), nl.float32, buffer=nl.hbm)
        return h[:, 0:3, :].reshape((12, 8))  # non-contiguous merge

    with pytest.raises(NkiValidationError, match="incompatible"):
        _in_kernel(bad_reshape)

    def bad_view():
        return nl.ndarray((128, 6), nl.uint8).view(nl.float32)  # 6 not divisible by 4

    with pytest.raises(NkiValidationError, match="divisible"):
        _in_kernel(bad_view)

    def bad_onchip_reshape():
        return nl.ndarray((128, 64), nl.float32).reshape((64, 128))

    with pytest.raises(NkiValidationError, match="partition dim"):
        _in_kernel(bad_onchip_reshape)


def test_ap_offsets_land_on_partitions_spec_2_3() -> None:
    # inv_rms.ap([[2,128],[0,128]], offset=1) reads column 1 of every row, broadcast
    def k(x):
        inv = nl.ndarray((128, 2), nl.float32)
        nisa.dma_copy(dst=inv, src=x)
        out = nl.ndarray((128, 128), nl.float32, buffer=nl.shared_hbm)
        tile = nl.ndarray((128, 128), nl.float32)
        nisa.tensor_copy(dst=tile, src=inv.ap([[2, 128], [0, 128]], offset=1))
        nisa.dma_copy(dst=out, src=tile)
        return out

    x = np.arange(256, dtype=np.float32).reshape(128, 2)
    out = run(k, x)
    np.testing.assert_array_equal(out, np.repeat(x[:, 1:2], 128, axis=1))


def test_ap_partition_step_must_equal_row_length() -> None:
    def k(x):
        t = nl.ndarray((16, 32), nl.float32)
        nisa.dma_copy(dst=t, src=x)
        u = nl.ndarray((8, 32), nl.float32)
        nisa.tensor_copy(dst=u, src=t.ap([[64, 8], [1, 32]]))  # every other partition: illegal

    with pytest.raises(NkiValidationError, match="partition step"):
        run(k, np.zeros((16, 32), np.float32))


def test_ap_validated_at_use_not_at_build_spec_4_5() -> None:
    # the prefill kernel builds an .ap whose full extent overruns each row, then slices it back
    H = 64

    def k(x, use_full_extent):
        t = nl.ndarray((128, H), nl.float32)
        nisa.dma_copy(dst=t, src=x)
        big = t.ap(pattern=[[H, 128], [4, H // 4], [1, 4]], offset=(H // 8) * 4)
        ok = big[0:128, 0 : H // 8, 0:4]
        out = nl.ndarray((128, H // 2), nl.float32, buffer=nl.shared_hbm)
        tile = nl.ndarray((128, H // 2), nl.float32)
        nisa.tensor_copy(dst=tile, src=ok)
        nisa.dma_copy(dst=out, src=tile)
        if use_full_extent:  # the full extent spills out of the row
            nisa.tensor_copy(dst=nl.ndarray((128, H), nl.float32), src=big)
        return out

    x = np.arange(128 * H, dtype=np.float32).reshape(128, H)
    np.testing.assert_array_equal(run(k, x, False), x[:, H // 2 :])
    with pytest.raises(NkiValidationError, match="spills|out of bounds"):
        run(k, x, True)


def test_views_share_storage_and_dtype_reinterpretation_is_bit_exact() -> None:
    def k(x):
        t = nl.ndarray((128, 8), nl.float32)
        nisa.dma_copy(dst=t, src=x)
        # write bf16 halves through a bf16 view of the same storage
        hv = t.view(nl.bfloat16)  # (128, 16)
        nisa.memset(hv[:, 0:1], 1.0)
        out = nl.ndarray((128, 8), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=t)
        return out

    x = np.zeros((128, 8), np.float32)
    out = run(k, x)
    # little-endian: bf16 element 0 is the low half of float32 element 0
    expect_bits = np.uint32(np.array(1.0, ml_dtypes.bfloat16).view(np.uint16))
    assert (out.view(np.uint32)[:, 0] == expect_bits).all()
    assert (out[:, 1:] == 0).all()


def test_sentinel_fill_and_uninitialized_read() -> None:
    seen = {}

    def k(x):
        f = nl.ndarray((4, 4), nl.float32)
        i = nl.ndarray((4, 4), nl.int32)
        q = nl.ndarray((4, 4), nl.float8_e4m3fn_x4)
        seen["f"] = resolve(f, "t", "f").read(check_init=False)
        seen["i"] = resolve(i, "t", "i").read(check_init=False)
        seen["q"] = resolve(q, "t", "q").read(check_init=False)
        o = nl.ndarray((4, 4), nl.float32)
        nisa.tensor_copy(dst=o, src=f)  # reads never-written memory

    with pytest.raises(NkiUninitializedReadError, match="never written"):
        run(k, DUMMY)
    assert np.isnan(seen["f"]).all()
    assert (seen["i"] == 4).all()
    assert (seen["q"] == 0xFFFFFFFF).all()
    # the relaxed policies read the sentinel like the real simulator
    with pytest.warns(UserWarning, match="never written"):
        run(k, DUMMY, uninit="warn")
    run(k, DUMMY, uninit="ignore")


def test_broadcast_and_stride0_source() -> None:
    def k(x):
        row = nl.ndarray((128, 1), nl.float32)
        nisa.dma_copy(dst=row, src=x)
        out_t = nl.ndarray((128, 4), nl.float32)
        nisa.tensor_copy(dst=out_t, src=row.ap([[1, 128], [0, 4]]))  # [[0, 4]] stride-0 read
        b = nl.ndarray((128, 4), nl.float32)
        nisa.tensor_copy(dst=b, src=row.broadcast(1, 4))
        out = nl.ndarray((2, 128, 4), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out[0], src=out_t)
        nisa.dma_copy(dst=out[1], src=b)
        return out

    x = np.arange(128, dtype=np.float32).reshape(128, 1)
    out = run(k, x)
    np.testing.assert_array_equal(out[0], np.repeat(x, 4, axis=1))
    np.testing.assert_array_equal(out[1], np.repeat(x, 4, axis=1))


def test_dtype_objects() -> None:
    assert str(nl.bfloat16) == "bfloat16"
    assert str(nl.float8_e4m3fn_x4) == "float8_e4m3fn_x4"
    assert nl.float32 == nl.float32 and nl.float32 != nl.bfloat16
    assert nl.bfloat16 == "bfloat16"  # spec §12.3 decision
    assert len({nl.float32, nl.float32, nl.int32}) == 2
    from mxcli.nkisim.nki import dtype as nki_dtype

    assert nki_dtype.float8_e4m3fn_x4 is nl.float8_e4m3fn_x4


def test_register_offsets_via_ds() -> None:
    def k(x):
        t = nl.ndarray((4, 16), nl.float32)
        nisa.dma_copy(dst=t, src=x)
        r = nisa.register_alloc(3)
        o = nl.ndarray((4, 4), nl.float32)
        nisa.tensor_copy(dst=o, src=t[:, nl.ds(r, 4)])  # columns 3..6
        out = nl.ndarray((4, 4), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=o)
        return out

    x = np.arange(64, dtype=np.float32).reshape(4, 16)
    np.testing.assert_array_equal(run(k, x), x[:, 3:7])
