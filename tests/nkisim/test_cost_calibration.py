"""The cost model against latencies AWS measured on Trn3 (`mxcli.nkisim.measured`).

A plain tiled bf16 NKI matmul of ours (tests/nkisim/matmul_kernels.py) runs in check-only mode;
its list-schedule estimate must lie within +-15% of AWS's measured ``torch.matmul`` latency at
the same shape (LNC 2). The model is approximate by design (documented engine figures, no
compiler), hence the tolerance: it checks the figures and the schedule at the scale of whole
kernels, where the unit tests (test_cost.py) check single instructions.

Fast evaluation: under LNC 2 the kernel's two cores share nothing (each takes half of M), so
one program with M/2 has core 0's exact instruction stream; and, for each 512-row M block, the
same instructions repeat per 512-column N tile, so past the pipeline fill (the second tile
still overlaps the first's) the makespan is linear in the number of N tiles: runs with two and
three N tiles (at the real M and K) give the full-size estimate. A slow test checks the extrapolation against full LNC-2 runs.
"""

from __future__ import annotations

import importlib
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import mxcli.nkisim as nkisim
from mxcli.nkisim import cost, measured, schedule, trace

BM = BN = 512
TOL = 0.15


@pytest.fixture(scope="module")
def mm() -> Any:
    if nkisim.real_nki_available():
        pytest.skip("a real nki is installed: the kernel would bind to it")
    with nkisim.installed():
        yield importlib.import_module("tests.nkisim.matmul_kernels")


def _makespan_us(mm: Any, M: int, K: int, N: int, lnc: int) -> float:
    a = np.zeros((M, K), dtype=ml_dtypes.bfloat16)
    b = np.zeros((K, N), dtype=ml_dtypes.bfloat16)
    with trace.recording() as recs:
        nkisim.simulate(mm.matmul_bf16, lnc=lnc, check_only=True)(a, b)
    prof = schedule.build_profile(recs, "trn3", cost.hardware("trn3"), lnc)
    return prof.makespan_ns / 1e3


def _estimate_us(mm: Any, M: int, K: int, N: int) -> float:
    """LNC-2 estimate of ``[M, K] @ [K, N]`` from one-core runs (module docstring): the
    full N when it is at most 3 tiles, else 2 and 3 tiles extrapolated linearly."""
    nb = N // BN
    if nb <= 3:
        return _makespan_us(mm, M // 2, K, N, 1)
    t2 = _makespan_us(mm, M // 2, K, 2 * BN, 1)
    t3 = _makespan_us(mm, M // 2, K, 3 * BN, 1)
    return t2 + (t3 - t2) * (nb - 2)


def _point(M: int, K: int, N: int) -> measured.MatmulPoint:
    return next(p for p in measured.MATMUL_BF16 if (p.M, p.K, p.N) == (M, K, N))


CI_SHAPES = [(4096, 4096, 4096), (4096, 4096, 1536), (4096, 1024, 4096), (4096, 4096, 1024)]
MORE_SHAPES = [(p.M, p.K, p.N) for p in measured.MATMUL_BF16 if (p.M, p.K, p.N) not in CI_SHAPES]


@pytest.mark.parametrize("shape", CI_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_bf16_matmul_estimate_within_15_percent_of_measured(mm: Any, shape: tuple) -> None:
    p = _point(*shape)
    est = _estimate_us(mm, *shape)
    ratio = est / p.us
    assert 1 - TOL <= ratio <= 1 + TOL, (
        f"{shape}: estimate {est:.1f} us vs measured {p.us:.1f} us ({measured.MATMUL_SOURCE})"
    )


@pytest.mark.slow
@pytest.mark.parametrize("shape", MORE_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_more_bf16_matmul_shapes_within_15_percent(mm: Any, shape: tuple) -> None:
    p = _point(*shape)
    ratio = _estimate_us(mm, *shape) / p.us
    assert 1 - TOL <= ratio <= 1 + TOL, (shape, ratio)


@pytest.mark.slow
@pytest.mark.parametrize("shape", CI_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_extrapolation_matches_the_full_lnc2_run(mm: Any, shape: tuple) -> None:
    """The extrapolation reproduces the full-size LNC-2 schedule (within 2%: it was 0-1.2%)."""
    full = _makespan_us(mm, *shape, 2)
    assert _estimate_us(mm, *shape) == pytest.approx(full, rel=0.02)


def test_measured_figures_carry_their_source() -> None:
    """The carried-over figures are AWS's (spot values from the files, with commit)."""
    assert "092a49dcdffb3ee0d63dbb71abd65dc70ca80821" in measured.MATMUL_SOURCE
    assert _point(4096, 4096, 4096).us == pytest.approx(999.124272)
    # MFU against the documented BF16 peak (2 cores x 2*128*128*2.4 GHz): the file's MFU
    p = _point(4096, 4096, 4096)
    peak = 2 * 2 * 128 * 128 * 2.4e9
    assert 2 * p.M * p.K * p.N / (p.us * 1e-6) / peak == pytest.approx(p.mfu_percent / 100, 0.01)
    assert measured.BWD_MXFP8.us_pe_transposes == 2190.0
    assert "e9ef98fc47b3323bf0de8ebcc984b8e2f3adff07" in measured.BWD_SOURCE
