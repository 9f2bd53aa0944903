"""The cost model against latencies AWS measured on Trn3 (`mxcli.nkisim.measured`).

A plain tiled bf16 NKI matmul of ours (tests/nkisim/matmul_kernels.py) runs in check-only mode;
its list-schedule estimate (tests/nkisim/matmul_estimate.py: one-core samples extrapolated to
the full size) is compared with AWS's measured ``torch.matmul`` latency at the same shape (LNC
2), on every shape of AWS's table (`measured.MATMUL_BF16_TABLE`).

This is a MODEL-versus-HARDWARE check, not an exactness test: the model is approximate by design
(documented engine figures, no compiler, no launch overhead), and AWS's kernel is the compiler's
``torch.matmul``, not ours. The bands are what they are: +-15% where the PE's work dominates
(AWS measured >= 100 us and reached >= 60% of the BF16 peak: the model's PE figures, checked at
the scale of whole kernels, where the unit tests in test_cost.py check single instructions); on
the small, latency-bound shapes (measured < 100 us) the band only bounds how far the model,
which has no fixed per-launch cost, is known to be off (README, "How far the model was
checked": the spread scripts/bench_bf16_baseline.py prints).
"""

from __future__ import annotations

import importlib
from typing import Any

import pytest

import mxcli.nkisim as nkisim
from mxcli.nkisim import measured
from tests.nkisim.matmul_estimate import estimate_us, makespan_us

TOL = 0.15


@pytest.fixture(scope="module")
def mm() -> Any:
    if nkisim.real_nki_available():
        pytest.skip("a real nki is installed: the kernel would bind to it")
    with nkisim.installed():
        yield importlib.import_module("tests.nkisim.matmul_kernels")


def _point(M: int, K: int, N: int) -> measured.MatmulPoint:
    return measured.matmul_point(f"{M}x{K}x{N}")


CI_SHAPES = [(4096, 4096, 4096), (4096, 4096, 1536), (4096, 1024, 4096), (4096, 4096, 1024)]
MORE_SHAPES = [(p.M, p.K, p.N) for p in measured.MATMUL_BF16 if (p.M, p.K, p.N) not in CI_SHAPES]


@pytest.mark.parametrize("shape", CI_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_bf16_matmul_estimate_within_15_percent_of_measured(mm: Any, shape: tuple) -> None:
    p = _point(*shape)
    est = estimate_us(mm, *shape)
    ratio = est / p.us
    assert 1 - TOL <= ratio <= 1 + TOL, (
        f"{shape}: estimate {est:.1f} us vs measured {p.us:.1f} us ({measured.MATMUL_SOURCE})"
    )


@pytest.mark.slow
@pytest.mark.parametrize("shape", MORE_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_more_bf16_matmul_shapes_within_15_percent(mm: Any, shape: tuple) -> None:
    p = _point(*shape)
    ratio = estimate_us(mm, *shape) / p.us
    assert 1 - TOL <= ratio <= 1 + TOL, (shape, ratio)


@pytest.mark.slow
@pytest.mark.parametrize("shape", CI_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_extrapolation_matches_the_full_lnc2_run(mm: Any, shape: tuple) -> None:
    """The extrapolation reproduces the full-size LNC-2 schedule (within 2%: it was 0-1.2%)."""
    full = makespan_us(mm, *shape, 2)
    assert estimate_us(mm, *shape) == pytest.approx(full, rel=0.02)


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
