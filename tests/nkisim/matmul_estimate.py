"""The cost model's estimate of our plain bf16 NKI matmul (tests/nkisim/matmul_kernels.py) at
the shapes of AWS's measured ``torch.matmul`` table (`mxcli.nkisim.measured.MATMUL_BF16_TABLE`);
shared by tests/nkisim/test_cost_calibration.py and scripts/bench_bf16_baseline.py.

Fast evaluation. Under LNC 2 the kernel's two cores share nothing (each takes half of M), so one
program with M/2 has core 0's exact instruction stream. Per 512-row M block the same
instructions repeat per 512-column N tile, and per block the same per M block, so past the
pipeline's fill the makespan is linear in the number of full N tiles and of full M blocks (a
partial last tile or block is kept in every sample). The fill is not over after the second N
tile: while A blocks overlap, the extra tiles of a short run fill idle gaps of the fill rather
than add a steady step (4096x1024x4096: +24.9, +26.0, +27.0, +27.3, +27.0 us per added N tile),
so the N samples are 4 and 6 full tiles and the M samples 2 and 4 full blocks (the M steps are
steady from the second block on); a shape with at most that many runs in full.
test_cost_calibration.py's slow test checks the extrapolation against full LNC-2 runs.

The kernel module must be imported while the interpreter's modules are installed
(``nkisim.installed()``): pass it in as `mm`.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

import mxcli.nkisim as nkisim
from mxcli.nkisim import cost, schedule, trace

BM = BN = 512  # the kernel's M block and N tile (matmul_kernels.BM, BN)
N_SAMPLES = (4, 6)  # full N tiles of the two N samples (the full N when it has at most 6)
M_SAMPLES = (2, 4)  # full M blocks per core of the two M samples (the full M at most 4)


def makespan_us(mm: Any, M: int, K: int, N: int, lnc: int) -> float:
    """The list-schedule makespan of ``[M, K] @ [K, N]`` on Trn3 under `lnc`, in us."""
    a = np.zeros((M, K), dtype=ml_dtypes.bfloat16)
    b = np.zeros((K, N), dtype=ml_dtypes.bfloat16)
    with trace.recording() as recs:
        nkisim.simulate(mm.matmul_bf16, lnc=lnc, check_only=True)(a, b)
    prof = schedule.build_profile(recs, "trn3", cost.hardware("trn3"), lnc)
    return prof.makespan_ns / 1e3


def axis_samples(n: int, tile: int, samples: tuple[int, int]) -> list[tuple[int, float]]:
    """``[(size, weight), ...]``: the sample sizes along one axis of size `n` (its partial last
    tile kept in each) and their weights in the linear extrapolation to `n`."""
    full, rem = divmod(n, tile)
    lo, hi = samples
    if full <= hi:
        return [(n, 1.0)]
    w = (full - lo) / (hi - lo)  # t(n) = t(lo) + w * (t(hi) - t(lo))
    return [(lo * tile + rem, 1.0 - w), (hi * tile + rem, w)]


def estimate_us(mm: Any, M: int, K: int, N: int) -> float:
    """LNC-2 estimate of ``[M, K] @ [K, N]`` from one-core runs (module docstring): bilinear in
    the number of full N tiles and of full M blocks per core."""
    return sum(
        wm * wn * makespan_us(mm, m, K, n, 1)
        for m, wm in axis_samples(M // 2, BM, M_SAMPLES)
        for n, wn in axis_samples(N, BN, N_SAMPLES)
    )
