"""Interpreter rules of issue 11 item 2: each rule rejects a kernel that breaks it, naming the
rule, and accepts the same kernel fixed."""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest

from mxcli import nkisim
from mxcli.nkisim import NkiRuleError, Rule
from mxcli.nkisim.kernel import jit
from mxcli.nkisim.nki import isa as nisa
from mxcli.nkisim.nki import language as nl
from mxcli.nkisim.nki.isa.constants import oob_mode
from tests.nkisim.conftest import DUMMY, run

BF16 = ml_dtypes.bfloat16


def _rejects(rule: Rule, fn, *args, **opts) -> NkiRuleError:
    with pytest.raises(NkiRuleError, match=re.escape(f"[{rule.value}]")) as exc:
        run(fn, *args, **opts)
    assert exc.value.rule is rule
    return exc.value


def _store(t):
    out = nl.ndarray(t.shape, t.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=t)
    return out


# -- partition dim <= 128 at allocation --------------------------------------------------------


@pytest.mark.parametrize("buffer", ["sbuf", "psum"])
def test_on_chip_partition_dim_at_most_128(buffer) -> None:
    region = getattr(nl, buffer)

    def k(_, parts):
        nl.ndarray((parts, 4), nl.float32, buffer=region, name="big")

    err = _rejects(Rule.PARTITION_DIM, k, DUMMY, 129)
    assert "big" in str(err) and "129 partitions" in str(err)
    run(k, DUMMY, 128)


def test_hbm_tensors_have_no_partition_limit() -> None:
    def k(_):
        return nl.ndarray((256, 4), nl.float32, buffer=nl.shared_hbm)

    assert run(k, DUMMY, uninit="ignore").shape == (256, 4)


# -- tensor_scalar operands are fp32 -----------------------------------------------------------


def test_tensor_scalar_tile_operand_must_be_fp32() -> None:
    offs = np.array([[3], [5]], dtype=np.int32)
    data = np.array([[1, 2], [3, 4]], dtype=np.int32)

    def k(data, offs, as_fp32):
        d = nl.ndarray((2, 2), nl.int32)
        nisa.dma_copy(dst=d, src=data)
        o = nl.ndarray((2, 1), nl.int32)
        nisa.dma_copy(dst=o, src=offs)
        operand = o
        if as_fp32:  # the fix: convert the int32 offsets to fp32 first
            operand = nl.ndarray((2, 1), nl.float32)
            nisa.tensor_copy(dst=operand, src=o)
        out = nl.ndarray((2, 2), nl.int32)
        nisa.tensor_scalar(dst=out, data=d, op0=nl.add, operand0=operand)
        return _store(out)

    err = _rejects(Rule.TENSOR_SCALAR_FP32, k, data, offs, False)
    assert "operand0 tile must be float32 (got int32)" in str(err)
    np.testing.assert_array_equal(run(k, data, offs, True), data + offs)


def test_tensor_scalar_python_int_and_bitvec_int_tiles_are_fine() -> None:
    data = np.array([[1, 2], [3, 4]], dtype=np.int32)

    def k(data):
        d = nl.ndarray((2, 2), nl.int32)
        nisa.dma_copy(dst=d, src=data)
        m = nl.ndarray((2, 1), nl.int32)
        nisa.memset(m, 6)
        out = nl.ndarray((2, 2), nl.int32)
        nisa.tensor_scalar(dst=out, data=d, op0=nl.multiply, operand0=3)  # an fp32 immediate
        nisa.tensor_scalar(dst=out, data=out, op0=nl.bitwise_and, operand0=m)  # bitvec: ints
        return _store(out)

    np.testing.assert_array_equal(run(k, data), (data * 3) & 6)


def test_tensor_scalar_reduce_operand_fp32_and_reduction() -> None:
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    scale = np.array([[1.0], [2.0], [3.0]], dtype=np.float32)

    def k(x, scale, operand_dtype):
        t = nl.ndarray((3, 4), nl.float32)
        nisa.dma_copy(dst=t, src=x)
        s = nl.ndarray((3, 1), operand_dtype)
        nisa.dma_copy(dst=s, src=scale)  # casting copy when operand_dtype is int32
        y = nl.ndarray((3, 4), nl.float32)
        r = nl.ndarray((3, 1), nl.float32)
        m = nl.ndarray((3, 1), nl.float32)
        nisa.tensor_scalar_reduce(
            dst=y, data=t, op0=nl.multiply, operand0=s, reduce_op=nl.add, reduce_res=r
        )
        nisa.tensor_scalar_reduce(
            dst=y, data=t, op0=nl.subtract, operand0=1.0, reduce_op=nl.maximum,
            reduce_res=m, reduce_res_negate=True,
        )  # fmt: skip
        return _store(r), _store(m)

    err = _rejects(Rule.TENSOR_SCALAR_FP32, k, x, scale, nl.int32)
    assert "tensor_scalar_reduce: operand0" in str(err)
    r, m = run(k, x, scale, nl.float32)
    np.testing.assert_array_equal(r[:, 0], (x * scale).sum(1))  # small integers: exact
    np.testing.assert_array_equal(m[:, 0], -(x - 1).max(1))


# -- MX scales in their data's quadrant --------------------------------------------------------


def _mx_kernel(x, scale_start):
    """quantize_mx of 32 partitions of data at partitions 32..63, scales at `scale_start`."""
    src = nl.ndarray((128, 16), nl.bfloat16)
    nisa.dma_copy(dst=src, src=x)
    q = nl.ndarray((128, 4), nl.float8_e4m3fn_x4)
    sc = nl.ndarray((128, 4), nl.uint8)
    nisa.memset(sc, 0)
    nisa.quantize_mx(dst=q[32:64, :], src=src[32:64, :], dst_scale=sc[scale_start:, :])
    return _store(sc)


def test_quantize_mx_scales_in_the_data_quadrant() -> None:
    x = np.ones((128, 16), dtype=BF16)
    err = _rejects(Rule.MX_SCALE_QUADRANT, _mx_kernel, x, 4)
    assert "quadrant 0" in str(err) and "quadrant 1" in str(err)
    sc = run(_mx_kernel, x, 36)  # quadrant 1, offset 4: the 4 groups' scales in rows 36..39
    assert (sc[36:40] == sc[36, 0]).all() and sc[36, 0] != 0
    assert (sc[:36] == 0).all() and (sc[40:] == 0).all()


def _mx_matmul_kernel(a, b, scale_start):
    qa = nl.ndarray((128, 8), nl.float8_e4m3fn_x4)
    sa = nl.ndarray((128, 8), nl.uint8)
    qb = nl.ndarray((128, 8), nl.float8_e4m3fn_x4)
    sb = nl.ndarray((128, 8), nl.uint8)
    for t in (sa, sb):
        nisa.memset(t, 0)
    ta = nl.ndarray((128, 32), nl.bfloat16)
    nisa.dma_copy(dst=ta, src=a)
    tb = nl.ndarray((128, 32), nl.bfloat16)
    nisa.dma_copy(dst=tb, src=b)
    nisa.quantize_mx(dst=qa, src=ta, dst_scale=sa)
    nisa.quantize_mx(dst=qb, src=tb, dst_scale=sb)
    # the moving scales read through a view starting `scale_start` partitions in
    ps = nl.ndarray((8, 8), nl.float32, buffer=nl.psum)
    nisa.nc_matmul_mx(
        dst=ps,
        stationary=qa[64:96, :],
        moving=qb[64:96, :],
        stationary_scale=sa[64:, :],
        moving_scale=sb[scale_start:, :],
    )
    out = nl.ndarray((8, 8), nl.float32)
    nisa.tensor_copy(dst=out, src=ps)
    return _store(out)


def test_nc_matmul_mx_scales_in_the_data_quadrant() -> None:
    a = np.ones((128, 32), dtype=BF16)
    b = np.ones((128, 32), dtype=BF16)
    err = _rejects(Rule.MX_SCALE_QUADRANT, _mx_matmul_kernel, a, b, 32)
    assert "moving_scale" in str(err)
    out = run(_mx_matmul_kernel, a, b, 64)
    np.testing.assert_array_equal(out, np.full((8, 8), 4 * 32, np.float32))  # sum of 4K ones


# -- negative DMA indices: -1 skips, other negatives are errors --------------------------------


def _gather(table, idx):
    it = nl.ndarray((4, 1), nl.int32)
    nisa.dma_copy(dst=it, src=idx)
    rows = nl.ndarray((4, 2), nl.float32)
    nisa.memset(rows, 0.0)
    view = table.ap([[2, 4], [1, 2]], offset=0, vector_offset=it, indirect_dim=0)
    nisa.dma_copy(dst=rows, src=view, oob_mode=oob_mode.skip)
    return _store(rows)


def test_dma_index_minus_one_skips_other_negatives_rejected() -> None:
    table = np.arange(8, dtype=np.float32).reshape(4, 2)
    bad = np.array([[0], [-2], [3], [1]], dtype=np.int32)
    err = _rejects(Rule.DMA_NEGATIVE_INDEX, _gather, table, bad)
    assert "index -2" in str(err)
    good = np.array([[0], [-1], [3], [1]], dtype=np.int32)
    out = run(_gather, table, good)
    np.testing.assert_array_equal(out, [[0, 1], [0, 0], [6, 7], [2, 3]])


# -- LNC race detector on shared HBM -----------------------------------------------------------


def _handover(x, barrier):
    """Core 0 writes a shared scratch tensor; core 1 reads it back. `barrier`: "none", "other"
    (a barrier on another shared tensor) or "same" (on the scratch tensor itself)."""
    pid = nl.program_id(0)
    scratch = nl.ndarray((4, 4), nl.float32, buffer=nl.shared_hbm, name="scratch")
    other = nl.ndarray((4, 4), nl.float32, buffer=nl.shared_hbm, name="other")
    out = nl.ndarray((4, 4), nl.float32, buffer=nl.shared_hbm, name="out")
    t = nl.ndarray((4, 4), nl.float32)
    if pid == 0:
        nisa.dma_copy(dst=t, src=x)
        nisa.dma_copy(dst=scratch, src=t)  # the write
    if barrier == "same":
        nisa.core_barrier(scratch, (0, 1))
    elif barrier == "other":
        nisa.core_barrier(other, (0, 1))
    if pid == 1:
        nisa.dma_copy(dst=t, src=scratch)  # the read
        nisa.dma_copy(dst=out, src=t)
    return out


@pytest.mark.parametrize("barrier", ["none", "other"])
def test_lnc_race_read_after_other_cores_write(barrier) -> None:
    x = np.arange(16, dtype=np.float32).reshape(4, 4)
    with pytest.raises(NkiRuleError, match=r"\[lnc-race\]") as exc:
        nkisim.simulate(jit(_handover)[2])(x, barrier)
    msg = str(exc.value)
    # both access sites are named: the read by core 1 and the write by core 0 (file:line)
    assert "scratch" in msg and "core 1 read it" in msg and "core 0 wrote it" in msg
    assert msg.count("test_rules.py:") == 2
    out = nkisim.simulate(jit(_handover)[2])(x, "same")
    np.testing.assert_array_equal(out, x)


def _overwrite(x, barrier):
    """Core 1 reads an input that core 0 then overwrites in place (write after read). The
    sendrecv makes core 0 write after core 1 read in time; it is no barrier on x."""
    pid = nl.program_id(0)
    t = nl.ndarray((4, 4), nl.float32)
    if pid == 1:
        nisa.dma_copy(dst=t, src=x)
    token = nl.ndarray((1, 1), nl.float32)
    nisa.memset(token, 1.0)
    got = nl.ndarray((1, 1), nl.float32)
    nisa.sendrecv(src=token, dst=got, send_to_rank=1 - pid, recv_from_rank=1 - pid, pipe_id=0)
    if barrier:
        nisa.core_barrier(x, (0, 1))
    if pid == 0:
        nisa.memset(t, 0.0)
        nisa.dma_copy(dst=x, src=t)


def test_lnc_race_overwrite_of_what_the_other_core_reads() -> None:
    x = np.ones((4, 4), np.float32)
    with pytest.raises(NkiRuleError, match=r"overwrites bytes the other core read.*\[lnc-race\]"):
        nkisim.simulate(jit(_overwrite)[2])(x, False)
    x = np.ones((4, 4), np.float32)
    nkisim.simulate(jit(_overwrite)[2])(x, True)
    assert (x == 0).all()


def test_disjoint_halves_need_no_barrier() -> None:
    def k(x):
        pid = nl.program_id(0)
        out = nl.ndarray((4, 4), nl.float32, buffer=nl.shared_hbm)
        t = nl.ndarray((2, 4), nl.float32)
        nisa.dma_copy(dst=t, src=x[pid * 2 : pid * 2 + 2, :])
        nisa.dma_copy(dst=out[pid * 2 : pid * 2 + 2, :], src=t)
        return out

    x = np.arange(16, dtype=np.float32).reshape(4, 4)
    np.testing.assert_array_equal(nkisim.simulate(jit(k)[2])(x), x)


def _indirect_handover(table, idx, barrier):
    """Core 0 scatters rows through indices; core 1 gathers rows through indices. Rows with
    index -1 are skipped and are no access."""
    pid = nl.program_id(0)
    it = nl.ndarray((4, 1), nl.int32)
    nisa.dma_copy(dst=it, src=idx[pid * 4 : pid * 4 + 4, :])
    view = table.ap([[2, 4], [1, 2]], offset=0, vector_offset=it, indirect_dim=0)
    rows = nl.ndarray((4, 2), nl.float32)
    if pid == 0:
        nisa.memset(rows, 5.0)
        nisa.dma_copy(dst=view, src=rows, oob_mode=oob_mode.skip)
    if barrier:
        nisa.core_barrier(table, (0, 1))
    out = nl.ndarray((4, 2), nl.float32, buffer=nl.shared_hbm)
    if pid == 1:
        nisa.memset(rows, 0.0)
        nisa.dma_copy(dst=rows, src=view, oob_mode=oob_mode.skip)
        nisa.dma_copy(dst=out, src=rows)
    return out


def test_lnc_race_through_indirect_dma_rows() -> None:
    # core 0 writes rows 1 and 3 (the -1 rows are skipped); core 1 reads rows 0 and 3
    idx = np.array([[1], [-1], [3], [-1], [0], [3], [-1], [-1]], dtype=np.int32)
    table = np.zeros((4, 2), np.float32)
    with pytest.raises(NkiRuleError, match=r"tensor table.*\[lnc-race\]"):
        nkisim.simulate(jit(_indirect_handover)[2])(table, idx, False)
    table = np.zeros((4, 2), np.float32)
    out = nkisim.simulate(jit(_indirect_handover)[2])(table, idx, True)
    np.testing.assert_array_equal(out, [[0, 0], [5, 5], [0, 0], [0, 0]])
    # disjoint rows: core 1 reads rows 0 and 2 only, which core 0 never writes
    idx2 = np.array([[1], [-1], [3], [-1], [0], [2], [-1], [-1]], dtype=np.int32)
    table = np.zeros((4, 2), np.float32)
    out = nkisim.simulate(jit(_indirect_handover)[2])(table, idx2, False)
    np.testing.assert_array_equal(out, np.zeros((4, 2), np.float32))
