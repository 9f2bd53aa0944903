"""The cost model against latencies AWS measured on Trn3 (`mxcli.nkisim.measured`).

A plain tiled bf16 NKI matmul of ours (tests/nkisim/matmul_kernels.py) runs in check-only mode;
its list-schedule estimate (tests/nkisim/matmul_estimate.py: one-core samples extrapolated to
the full size) is compared with AWS's measured ``torch.matmul`` latency at the same shape (LNC
2), on every shape of AWS's table (`measured.MATMUL_BF16_TABLE`).

This is a MODEL-versus-HARDWARE check, not an exactness test: the model is approximate by design
(documented engine figures, no compiler, no launch overhead), and AWS's kernel is the compiler's
``torch.matmul``, not ours. The bands are what they are: +-15% at the 10 chosen shapes and
wherever AWS's kernel ran near the PE's peak (`PEAK_MFU`: the model's PE figures, checked at the
scale of whole kernels, where test_cost.py checks single instructions); elsewhere (`FAR_BAND`)
only a bound on how far off the model is known to be (the spread
scripts/bench_bf16_baseline.py prints, in README's "How far the model was checked").
"""

from __future__ import annotations

from typing import Any

import pytest

from mxcli.nkisim import measured
from tests.nkisim.matmul_estimate import estimate_us, makespan_us

TOL = 0.15


@pytest.fixture(scope="module")
def mm(matmul_kernels: Any) -> Any:
    return matmul_kernels


def _point(M: int, K: int, N: int) -> measured.MatmulPoint:
    return measured.matmul_point(f"{M}x{K}x{N}")


CI_SHAPES = [(4096, 4096, 1536), (4096, 1024, 4096), (4096, 4096, 1024)]
"""Three of the 10 chosen shapes (`measured.MATMUL_BF16`) in the default suite: two run in full (N
1536 and 1024), one extrapolated in N (a few seconds together)."""
FAST_OTHER = ["4096x1280x2880", "128x720x2880", "4096x128x4096"]
"""Default-suite shapes outside the chosen 10: partial K and N tiles near the peak (K 1280, N
2880 = 5.6 tiles), every tile partial in a small launch (M 128, K 720), and a large outlier."""
PEAK_MFU = 80.0
"""Where AWS's ``torch.matmul`` reached at least this share of the BF16 peak (the file's MFU; 60
of its 162 shapes), the PE's work decides both kernels' time: the model is held to +-15% there
(0.85-1.07 of measured on 2026-12-03, median 0.91)."""
FAR_BAND = (0.25, 2.0)
"""The other 101 shapes (AWS's kernel below 80% of the peak, the chosen 10 aside: small, latency-
or DMA-bound launches; how our kernel splits them, M across the two cores, decides the estimate
more than the model's figures): 0.29-1.74 of measured on 2026-12-03 (README, "How far the model
was checked"). This bounds how far off the model is known to be there; it is not a tolerance the
model meets by design."""


def _band(p: measured.MatmulPoint) -> tuple[float, float]:
    near = p.mfu_percent >= PEAK_MFU or p.key in measured.MATMUL_BF16_CHOSEN
    return (1 - TOL, 1 + TOL) if near else FAR_BAND


@pytest.mark.parametrize("shape", CI_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_bf16_matmul_estimate_within_15_percent_of_measured(mm: Any, shape: tuple) -> None:
    """Model versus hardware (module docstring): +-15% at three of the chosen shapes."""
    p = _point(*shape)
    est = estimate_us(mm, *shape)
    ratio = est / p.us
    assert 1 - TOL <= ratio <= 1 + TOL, (
        f"{shape}: estimate {est:.1f} us vs measured {p.us:.1f} us ({measured.MATMUL_SOURCE})"
    )


def _check_band(mm: Any, key: str) -> None:
    p = measured.matmul_point(key)
    est = estimate_us(mm, p.M, p.K, p.N)
    lo, hi = _band(p)
    assert lo <= est / p.us <= hi, (
        f"{key}: estimate {est:.1f} us vs measured {p.us:.1f} us = {est / p.us:.2f}, outside "
        f"the model-vs-hardware band {lo}-{hi} ({measured.MATMUL_SOURCE})"
    )


@pytest.mark.parametrize("key", FAST_OTHER)
def test_bf16_matmul_other_shapes_within_their_band(mm: Any, key: str) -> None:
    """Model versus hardware on shapes with partial tiles and small launches (module docstring)."""
    _check_band(mm, key)


@pytest.mark.slow
@pytest.mark.parametrize("key", [p.key for p in measured.MATMUL_BF16_TABLE])
def test_every_bf16_baseline_shape_within_its_band(mm: Any, key: str) -> None:
    """Every shape of AWS's table (162; minutes): model versus hardware, the bands above."""
    _check_band(mm, key)


EXTRAPOLATED = [
    (4096, 4096, 4096),  # N extrapolated (8 tiles)
    (4096, 1024, 4096),  # N extrapolated, short steps (the 2-3-tile samples were 2.5% low)
    (6144, 4096, 4096),  # M (6 blocks per core) and N extrapolated
    (5120, 4096, 6400),  # M and N extrapolated, a partial N tile (6400 = 12.5 x 512)
    (4096, 8192, 5120),  # N extrapolated on the streamed path (K > RESIDENT_K)
]


@pytest.mark.slow
@pytest.mark.parametrize("shape", EXTRAPOLATED, ids=lambda s: "x".join(map(str, s)))
def test_extrapolation_matches_the_full_lnc2_run(mm: Any, shape: tuple) -> None:
    """The extrapolation reproduces the full-size LNC-2 schedule within 2% (an approximation of
    the model by itself, not against hardware)."""
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


def test_every_baseline_shape_is_carried_over() -> None:
    """All 162 keys of bf16_baseline_cache.json@092a49d, values as typed from the file (spot
    values: its first, last and extreme rows), the 10 chosen first among them."""
    table = measured.MATMUL_BF16_TABLE
    assert len(table) == 162
    assert len({p.key for p in table}) == 162
    first, last = table[0], table[-1]
    assert (first.key, first.us, first.name) == (
        "4096x4096x1536", 403.826035, "Qwen3-8B-TP4 - FWD-FuseQKV",
    )  # fmt: skip
    assert (last.key, last.us, last.mfu_percent) == (
        "4096x8192x4096",
        1984.901898,
        87.9842351867636,
    )
    p = measured.matmul_point("51200x4096x5120")
    assert (p.us, p.mfu_percent) == (14300.04099, 95.46533714825061)
    assert p.name == "Qwen3-32B-TP1 - BWD-MLP-FuseGateUp-WTGrad"
    assert measured.matmul_point("256x128x256").us == 17.765805
    assert measured.matmul_point("4096x64x4096").mfu_percent == 23.395389833336864
    assert measured.matmul_point("128x720x2880").name == "GPT-OSS-20B-TP4 - FWD-MoE-Down(cap=128)"
    with pytest.raises(KeyError):
        measured.matmul_point("4096x4096x4097")
    assert [p.key for p in measured.MATMUL_BF16] == list(measured.MATMUL_BF16_CHOSEN)
    assert all(p in table for p in measured.MATMUL_BF16)
    # each row's time against its MFU (the file's MFU over the BF16 peak of two cores): a typo in
    # a leading digit of either, or in M, K or N, breaks this; the file itself agrees within 1.6%
    peak = 2 * 2 * 128 * 128 * 2.4e9
    for q in table:
        mfu = 2 * q.M * q.K * q.N / (q.us * 1e-6) / peak * 100
        assert mfu == pytest.approx(q.mfu_percent, rel=0.02), q.key
