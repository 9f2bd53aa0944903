"""Vector / Scalar / GpSimd ops, registers and dynamic loops (spec §5, §8)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from mxcli.nkisim import NkiValidationError
from mxcli.nkisim.nki import isa as nisa
from mxcli.nkisim.nki import language as nl
from tests.nkisim.conftest import DUMMY, run, run_report


def _load(x, dtype=None):
    t = nl.ndarray(x.shape, dtype or x.dtype)
    nisa.dma_copy(dst=t, src=x)
    return t


def _store(t):
    out = nl.ndarray(t.shape, t.dtype, buffer=nl.shared_hbm)
    if t.buffer == nl.psum:
        s = nl.ndarray(t.shape, t.dtype)
        nisa.tensor_copy(dst=s, src=t)
        t = s
    nisa.dma_copy(dst=out, src=t)
    return out


def test_tensor_copy_psum_to_sbuf_cast_and_engine_rules(rng) -> None:
    x = rng.standard_normal((64, 32)).astype(np.float32)

    def k(x):
        p = nl.ndarray((64, 32), nl.float32, buffer=nl.psum)
        nisa.tensor_copy(dst=p, src=_load(x))
        b = nl.ndarray((64, 32), nl.bfloat16)
        nisa.tensor_copy(dst=b, src=p, engine=nisa.scalar_engine)
        return _store(b)

    out, rep = run_report(k, x)
    np.testing.assert_array_equal(out, x.astype(ml_dtypes.bfloat16))
    assert rep.counters.instructions["scalar"] == 1

    def gpsimd_psum(x):
        p = nl.zeros((64, 32), nl.float32, buffer=nl.psum)
        nisa.tensor_copy(dst=nl.ndarray((64, 32), nl.float32), src=p, engine=nisa.gpsimd_engine)

    with pytest.raises(NkiValidationError, match="gpsimd engine cannot access"):
        run(gpsimd_psum, x)


def test_memset_rules_and_all_ones_literal() -> None:
    def k(_):
        i = nl.ndarray((4, 4), nl.int32)
        nisa.memset(i, value=0xFFFFFFFF)
        f = nl.ndarray((4, 4), nl.bfloat16)
        nisa.memset(f, 3)
        return _store(i), _store(f)

    i, f = run(k, DUMMY)
    assert (i == -1).all() and (f.astype(np.float32) == 3).all()

    def bad(_):
        nisa.memset(nl.ndarray((4, 4), nl.int32), 2.0)

    with pytest.raises(NkiValidationError, match="float value cannot fill an integer"):
        run(bad, DUMMY)

    def bad_x4(_):
        nisa.memset(nl.ndarray((4, 4), nl.float8_e4m3fn_x4), 1)

    with pytest.raises(NkiValidationError, match="value=0"):
        run(bad_x4, DUMMY)


def test_iota_patterns() -> None:
    def k(_):
        a = nl.ndarray((128, 6), nl.float32)
        nisa.iota(dst=a, pattern=[[1, 6]], offset=0, channel_multiplier=0)
        b = nl.ndarray((128, 1), nl.int32)
        nisa.iota(dst=b, pattern=[[0, 1]], channel_multiplier=1)  # partition index column
        c = nl.ndarray((4, 6), nl.int32)
        nisa.iota(c, [[1, 2], [0, 3]], 10, 2)  # group id per expert, positional form
        return _store(a), _store(b), _store(c)

    a, b, c = run(k, DUMMY)
    np.testing.assert_array_equal(a, np.tile(np.arange(6, dtype=np.float32), (128, 1)))
    np.testing.assert_array_equal(b[:, 0], np.arange(128))
    expect = 10 + 2 * np.arange(4)[:, None] + np.repeat(np.arange(2), 3)[None, :]
    np.testing.assert_array_equal(c, expect)


def test_tensor_tensor_fp32_int_and_bitvec(rng) -> None:
    x = rng.standard_normal((32, 16)).astype(ml_dtypes.bfloat16)
    y = rng.standard_normal((32, 16)).astype(ml_dtypes.bfloat16)
    ia = rng.integers(-(2**30), 2**30, (32, 16)).astype(np.int32)
    ib = rng.integers(-(2**30), 2**30, (32, 16)).astype(np.int32)

    def k(x, y, ia, ib):
        d = nl.ndarray((32, 16), nl.bfloat16)
        nisa.tensor_tensor(dst=d, data1=_load(x), data2=_load(y), op=nl.multiply)
        s = nl.ndarray((32, 16), nl.int32)
        nisa.tensor_tensor(dst=s, data1=_load(ia), data2=_load(ib), op=nl.add)  # exact on GpSimd
        bx = nl.ndarray((32, 16), nl.int32)
        nisa.tensor_tensor(dst=bx, data1=_load(ia), data2=_load(ib), op=nl.bitwise_xor)
        return _store(d), _store(s), _store(bx)

    (d, s, bx), rep = run_report(k, x, y, ia, ib)
    ref = (x.astype(np.float32) * y.astype(np.float32)).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(d, ref)
    np.testing.assert_array_equal(s, (ia.astype(np.int64) + ib).astype(np.int32))
    np.testing.assert_array_equal(bx, ia ^ ib)
    assert rep.counters.instructions["gpsimd"] == 1

    def divide(x, y, ia, ib):
        nisa.tensor_tensor(dst=_load(x), data1=_load(x), data2=_load(y), op=nl.divide)

    with pytest.raises(NkiValidationError, match="divide"):
        run(divide, x, y, ia, ib)

    def psum2(x, y, ia, ib):
        p = nl.zeros((32, 16), nl.float32, buffer=nl.psum)
        q = nl.zeros((32, 16), nl.float32, buffer=nl.psum)
        nisa.tensor_tensor(dst=nl.ndarray((32, 16), nl.float32), data1=p, data2=q, op=nl.add)

    with pytest.raises(NkiValidationError, match="both be in PSUM"):
        run(psum2, x, y, ia, ib)


def test_tensor_scalar_forms(rng) -> None:
    x = rng.standard_normal((64, 8)).astype(np.float32)
    col = rng.standard_normal((64, 1)).astype(np.float32)
    ids = rng.integers(0, 4, (64, 8)).astype(np.float32)

    def k(x, col, ids):
        xt, ct = _load(x), _load(col)
        a = nl.ndarray((64, 8), nl.float32)
        nisa.tensor_scalar(dst=a, data=xt, op0=nl.multiply, operand0=ct, engine=nisa.scalar_engine)
        b = nl.ndarray((64, 8), nl.float32)
        nisa.tensor_scalar(
            dst=b, data=xt, op0=nl.subtract, operand0=1.0, op1=nl.multiply, operand1=30000.0
        )
        c = nl.ndarray((64, 8), nl.float32)
        nisa.tensor_scalar(dst=c, data=xt, op0=nl.subtract, operand0=1.0, reverse0=True)
        oh = nl.ndarray((64, 8), nl.float32)
        nisa.tensor_scalar(
            dst=oh, data=_load(ids), op0=nl.equal, operand0=2.0, op1=nl.multiply, operand1=ct
        )
        return _store(a), _store(b), _store(c), _store(oh)

    a, b, c, oh = run(k, x, col, ids)
    np.testing.assert_array_equal(a, x * col)
    np.testing.assert_array_equal(b, (x - np.float32(1)) * np.float32(30000))
    np.testing.assert_array_equal(c, np.float32(1) - x)
    np.testing.assert_array_equal(oh, (ids == 2) * col)

    def scalar_engine_pair(x, col, ids):
        t = _load(x)
        nisa.tensor_scalar(
            dst=t,
            data=t,
            op0=nl.subtract,
            operand0=1.0,
            op1=nl.multiply,
            operand1=2.0,
            engine=nisa.scalar_engine,
        )

    with pytest.raises(NkiValidationError, match="scalar engine supports"):
        run(scalar_engine_pair, x, col, ids)

    def half(x, col, ids):
        t = _load(x)
        nisa.tensor_scalar(dst=t, data=t, op0=nl.add, operand0=1.0, op1=nl.multiply)

    with pytest.raises(NkiValidationError, match="both be given"):
        run(half, x, col, ids)


def test_scalar_tensor_tensor_in_place_accumulate(rng) -> None:
    x = rng.standard_normal((32, 16)).astype(np.float32)
    inv = rng.random((32, 1)).astype(np.float32)
    g = rng.standard_normal((32, 16)).astype(np.float32)

    def k(x, inv, g):
        d = nl.ndarray((32, 16), nl.float32)
        nisa.scalar_tensor_tensor(
            dst=d,
            data=_load(x),
            op0=nl.multiply,
            operand0=_load(inv),
            op1=nl.multiply,
            operand1=_load(g),
        )
        m = _load(g)
        nisa.scalar_tensor_tensor(
            dst=m, data=_load(x), op0=nl.greater, operand0=0.0, op1=nl.add, operand1=m
        )  # dst aliases operand1
        return _store(d), _store(m)

    d, m = run(k, x, inv, g)
    np.testing.assert_array_equal(d, (x * inv) * g)
    np.testing.assert_array_equal(m, (x > 0).astype(np.float32) + g)


def test_tensor_reduce(rng) -> None:
    x = rng.standard_normal((16, 4, 8)).astype(np.float32)

    def k(x):
        t = _load(x)
        s = nl.ndarray((16, 4), nl.float32)
        nisa.tensor_reduce(dst=s, op=nl.add, data=t, axis=2)
        m = nl.ndarray((16, 1), nl.float32)
        nisa.tensor_reduce(dst=m, op=nl.maximum, data=t, axis=(1, 2), negate=True)
        return _store(s), _store(m)

    s, m = run(k, x)
    np.testing.assert_allclose(s, x.sum(-1), rtol=1e-6)
    np.testing.assert_array_equal(m[:, 0], -x.reshape(16, -1).max(-1))

    def bad(x):
        nisa.tensor_reduce(dst=nl.ndarray((16, 8), nl.float32), op=nl.add, data=_load(x), axis=1)

    with pytest.raises(NkiValidationError, match="trailing"):
        run(bad, x)


def test_activation_reduce_chain_rsqrt_and_tokens(rng) -> None:
    # fused-prefill pattern: sum of squares over blocks, reduce_res on the last block
    x = rng.standard_normal((128, 3, 32)).astype(np.float32)
    H = 96

    def k(x):
        inv = nl.ndarray((128, 2), nl.float32)
        eps = nl.ndarray((128, 1), nl.float32)
        nisa.memset(eps, 1e-6)
        sq = nl.ndarray((128, 32), nl.float32)
        for b in range(3):
            nisa.activation(
                dst=sq,
                op=nl.square,
                data=_load(x[:, b, :]),
                reduce_op=nl.add,
                reduce_cmd=nisa.reduce_cmd.reset_reduce if b == 0 else nisa.reduce_cmd.reduce,
                reduce_res=inv[:, 0:1] if b == 2 else None,
            )
        nisa.activation(dst=inv[:, 1:2], op=nl.rsqrt, data=inv[:, 0:1], bias=eps, scale=1.0 / H)
        return _store(inv)

    inv = run(k, x)
    ss = (x.astype(np.float64) ** 2).sum((1, 2))
    np.testing.assert_allclose(inv[:, 0], ss, rtol=1e-5)
    np.testing.assert_allclose(inv[:, 1], 1 / np.sqrt(inv[:, 0] / H + 1e-6), rtol=1e-6)


@pytest.mark.parametrize(
    "tok, ref",
    [
        ("silu", lambda t: torch.nn.functional.silu(t)),
        ("sigmoid", torch.sigmoid),
        ("exp", torch.exp),
        ("gelu", lambda t: torch.nn.functional.gelu(t)),
        ("gelu_apprx_tanh", lambda t: torch.nn.functional.gelu(t, approximate="tanh")),
        ("tanh", torch.tanh),
        ("softplus", torch.nn.functional.softplus),
        ("erf", torch.erf),
    ],
)
def test_activation_functions_exact_in_fp32(rng, tok, ref) -> None:
    x = (rng.standard_normal((32, 64)) * 3).astype(np.float32)

    act = getattr(nl, tok)

    def k(x):
        d = nl.ndarray((32, 64), nl.float32)
        nisa.activation(dst=d, op=act, data=_load(x))
        return _store(d)

    out = run(k, x)
    expect = ref(torch.from_numpy(x).double()).float().numpy()
    np.testing.assert_allclose(out, expect, rtol=2e-6, atol=1e-7)


def test_silu_dx_matches_autograd(rng) -> None:
    x = (rng.standard_normal((16, 32)) * 4).astype(np.float32)
    scale = rng.random((16, 1)).astype(np.float32) + 0.5

    def k(x, scale):
        d = nl.ndarray((16, 32), nl.float32)
        nisa.activation(dst=d, op=nl.silu_dx, data=_load(x), bias=None, scale=_load(scale))
        return _store(d)

    out = run(k, x, scale)
    t = torch.from_numpy((x * scale).astype(np.float32)).double().requires_grad_(True)
    torch.nn.functional.silu(t).sum().backward()
    np.testing.assert_allclose(out, t.grad.float().numpy(), rtol=2e-6, atol=1e-7)


def test_reciprocal_exponential_and_accumulator(rng) -> None:
    x = rng.standard_normal((8, 16)).astype(np.float32)

    def k(x):
        t = _load(x)
        mx = nl.ndarray((8, 1), nl.float32)
        nisa.tensor_reduce(dst=mx, op=nl.maximum, data=t, axis=1)
        e = nl.ndarray((8, 16), nl.float32)
        s = nl.ndarray((8, 1), nl.float32)
        nisa.exponential(
            dst=e, src=t, max_value=mx, reduce_res=s, reduce_cmd=nisa.reduce_cmd.reset_reduce
        )
        nisa.reciprocal(dst=s, data=s)
        return _store(e), _store(s)

    e, s = run(k, x)
    ref = np.exp(x.astype(np.float64) - x.max(1, keepdims=True))
    np.testing.assert_allclose(e, ref, rtol=1e-6)
    np.testing.assert_allclose(s[:, 0], 1 / ref.sum(1), rtol=1e-5)
    with pytest.raises(NkiValidationError, match="NeuronCore-v4"):
        run(k, x, target="trn2")


def test_max8_find_index8_duplicates_and_missing() -> None:
    data = np.array(
        [[5, 1, 9, 9, 3, 7, 2, 8, 0, 6], [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]], dtype=np.float32
    )

    def k(d):
        t = _load(d)
        top = nl.ndarray((2, 8), nl.float32)
        nisa.max8(dst=top, src=t)
        idx = nl.ndarray((2, 8), nl.int32)
        nisa.nc_find_index8(dst=idx.view(nl.uint32), data=t, vals=top)
        miss = nl.ndarray((2, 8), nl.uint32)
        nisa.memset(top, 42.0)
        nisa.nc_find_index8(dst=miss, data=t, vals=top)
        return _store(top), _store(idx), _store(miss)

    top_after, idx, miss = run(k, data)
    np.testing.assert_array_equal(idx[0], [2, 3, 7, 5, 9, 0, 4, 6])  # 9 twice: successive hits
    np.testing.assert_array_equal(idx[1], np.arange(8))
    assert (miss == 0xFFFFFFFF).all()


def test_topk_snake_layout_spec_12_26(rng) -> None:
    n, K = 40, 5
    v = rng.permutation(64)[:n].astype(np.float32)
    src = np.zeros((16, 3), np.float32)
    for e in range(n):  # plain loop: element e at partition e % 16, column e // 16
        src[e % 16, e // 16] = v[e]

    def k(s):
        vd = nl.ndarray((16, K), nl.bfloat16)
        idd = nl.ndarray((16, K), nl.uint32)
        nisa.topk(vd, idd, _load(s, nl.bfloat16), n)
        return _store(vd), _store(idd)

    vals, idx = run(k, src)
    order = np.argsort(v)[-K:]
    np.testing.assert_array_equal(idx[0], order)
    np.testing.assert_array_equal(vals[3].astype(np.float32), v[order])


def test_stream_shuffle_broadcast() -> None:
    x = np.arange(8, dtype=np.float32).reshape(1, 8)

    def k(x):
        src = _load(x)
        dst = nl.ndarray((128, 8), nl.float32)
        for i in range(4):
            nisa.nc_stream_shuffle(
                dst=dst[32 * i : 32 * i + 32, :], src=src[0:1, :], shuffle_mask=[0] * 32
            )
        return _store(dst)

    np.testing.assert_array_equal(run(k, x), np.repeat(x, 128, axis=0))


def test_registers_and_dynamic_loops() -> None:
    n = np.array([[5]], dtype=np.int32)

    def k(n):
        nt = _load(n)
        r = nisa.register_alloc()
        nisa.register_load(r, nt)
        acc = nl.zeros((1, 1), nl.float32)
        one = nl.ones((1, 1), nl.float32)

        def body(i):
            nisa.tensor_tensor(dst=acc, data1=acc, data2=one, op=nl.add)

        nl.fori_loop(0, r, body)
        cnt = nisa.register_alloc(3)

        def wbody(c):
            nisa.tensor_tensor(dst=acc, data1=acc, data2=one, op=nl.add)
            nisa.register_move(c, c.value - 1)
            return c

        nl.while_loop(cnt, wbody)
        out = nl.ndarray((1, 1), nl.int32)
        nisa.register_store(out, r)
        return _store(acc), _store(out)

    acc, out = run(k, n)
    assert acc[0, 0] == 8 and out[0, 0] == 5

    def frozen(n):
        def body(i):
            nisa.register_move(i, 3)

        nl.fori_loop(0, 2, body)

    with pytest.raises(AssertionError, match="frozen"):
        run(frozen, n)

    def in_no_reorder(n):
        with nl.no_reorder():
            nl.fori_loop(0, 2, lambda i: None)

    with pytest.raises(NkiValidationError, match="no_reorder"):
        run(in_no_reorder, n)
