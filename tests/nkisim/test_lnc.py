"""LNC=2: two programs with their own program_id, shared HBM, sendrecv, core_barrier (spec §3.2, §6.4-§6.5)."""

from __future__ import annotations

import numpy as np
import pytest

from mxcli import nkisim
from mxcli.nkisim import NkiValidationError
from mxcli.nkisim.kernel import jit
from mxcli.nkisim.nki import isa as nisa
from mxcli.nkisim.nki import language as nl


def _exchange_kernel(x):
    # each program sums its half of the rows, swaps partial sums with the other core, adds
    P, F = x.shape
    pid = nl.program_id(0)
    n = nl.num_programs(0)
    out = nl.ndarray((n, F), nl.float32, buffer=nl.shared_hbm, name="out")
    half = P // n
    t = nl.ndarray((half, F), nl.float32)
    nisa.dma_copy(dst=t, src=x[pid * half : (pid + 1) * half, :])
    ones = nl.ones((half, 1), nl.float32)
    ps = nl.ndarray((1, F), nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=ps, stationary=ones, moving=t)  # cross-partition sum via a ones matrix
    mine = nl.ndarray((1, F), nl.float32)
    nisa.tensor_copy(dst=mine, src=ps)
    other = nl.ndarray((1, F), nl.float32)
    nisa.sendrecv(src=mine, dst=other, send_to_rank=1 - pid, recv_from_rank=1 - pid, pipe_id=0)
    tot = nl.ndarray((1, F), nl.float32)
    nisa.tensor_tensor(dst=tot, data1=mine, data2=other, op=nl.add)
    nisa.dma_copy(dst=out[pid : pid + 1, :], src=tot)
    nisa.core_barrier(out, (0, 1))
    return out


def test_lnc2_sendrecv_exchange_and_shared_output(rng) -> None:
    x = rng.standard_normal((128, 16)).astype(np.float32)
    k = jit(_exchange_kernel)
    sk = nkisim.simulate(k[2])
    out = sk(x)
    total = x.sum(0)
    np.testing.assert_allclose(out[0], total, rtol=1e-5, atol=1e-5)  # fp32 order
    np.testing.assert_allclose(out[1], total, rtol=1e-5, atol=1e-5)  # fp32 order
    assert len(sk.report.programs) == 2
    assert sk.report.programs[0].ops["sendrecv"] == 1
    assert sk.report.counters.ops["core_barrier"] == 2


def test_lnc_errors_propagate_and_sendrecv_needs_lnc2(rng) -> None:
    x = rng.standard_normal((128, 16)).astype(np.float32)
    with pytest.raises(NkiValidationError, match="only allowed when LNC is enabled"):
        nkisim.simulate(_exchange_kernel)(x)

    def fails_on_one(x):
        if nl.program_id(0) == 1:
            nisa.memset(nl.ndarray((4, 4), nl.int32), 2.0)
        nisa.core_barrier(x, (0, 1))

    with pytest.raises(NkiValidationError, match="float value"):
        nkisim.simulate(fails_on_one, lnc=2)(x)

    def unmatched(x):
        if nl.program_id(0) == 0:
            nisa.core_barrier(x, (0, 1))

    with pytest.raises(NkiValidationError, match="without reaching"):
        nkisim.simulate(unmatched, lnc=2)(x)


def test_private_memory_is_per_program_and_lnc_limits() -> None:
    box = {}

    def k(x):
        t = nl.ndarray((1, 1), nl.float32, buffer=nl.private_hbm)
        box[nl.program_id(0)] = t
        nisa.core_barrier(x, (0, 1))
        if nl.program_id(0) == 0:
            nisa.dma_copy(dst=box[1], src=x)  # another core's private memory

    x = np.zeros((1, 1), np.float32)
    with pytest.raises(NkiValidationError, match="private memory of another core"):
        nkisim.simulate(k, lnc=2)(x)
    with pytest.raises(NkiValidationError, match="LNC degree"):
        nkisim.simulate(k, lnc=2, target="trn1")(x)
    with pytest.raises(TypeError, match="LNC degree"):
        jit(k)[0]


def _many_outputs_kernel(x):
    # each program writes its half of the rows of several shared outputs; the k-th shared
    # allocation must be the same tensor in both programs even when they allocate at once
    P, F = x.shape
    pid = nl.program_id(0)
    half = P // nl.num_programs(0)
    outs = []
    for i in range(6):
        outs.append(nl.ndarray((P, F), nl.float32, buffer=nl.shared_hbm, name=f"o{i}"))
    t = nl.ndarray((half, F), nl.float32)
    nisa.dma_copy(dst=t, src=x[pid * half : (pid + 1) * half, :])
    for o in outs:
        nisa.dma_copy(dst=o[pid * half : (pid + 1) * half, :], src=t)
    return tuple(outs)


def test_lnc2_concurrent_shared_allocations_agree(rng) -> None:
    x = rng.standard_normal((128, 8)).astype(np.float32)
    sk = nkisim.simulate(jit(_many_outputs_kernel)[2])
    for _ in range(5):
        outs = sk(x)
        assert len(outs) == 6
        for o in outs:
            np.testing.assert_array_equal(o, x)
