"""The bf16 matmul kernel the cost-model check runs (tests/nkisim/matmul_kernels.py) computes
``a @ b`` at shapes that are not multiples of its tiles, on both of its paths.

Small-integer inputs make every fp32 PSUM sum exact, so the result is exactly the integer
product rounded once to bf16 (round to nearest even), whatever the summation order: the oracle
is NumPy's float64 product cast to bf16.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest

import mxcli.nkisim as nkisim


@pytest.fixture(scope="module")
def mm(matmul_kernels: Any) -> Any:
    return matmul_kernels


def _inputs(M: int, K: int, N: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    a = rng.integers(-4, 5, (M, K)).astype(ml_dtypes.bfloat16)
    b = rng.integers(-4, 5, (K, N)).astype(ml_dtypes.bfloat16)
    want = (a.astype(np.float64) @ b.astype(np.float64)).astype(ml_dtypes.bfloat16)
    return a, b, want


def _run(mm: Any, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with nkisim.installed():
        return np.asarray(nkisim.simulate(mm.matmul_bf16, lnc=2)(a, b))


@pytest.mark.parametrize(
    "shape",
    [(260, 200, 600), (128, 72, 130), (1100, 128, 512)],
    ids=["all-partial", "small", "partial-M-block"],
)
def test_partial_tiles_compute_the_product(mm: Any, shape: tuple) -> None:
    a, b, want = _inputs(*shape, seed=sum(shape))
    got = _run(mm, a, b)
    assert got.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))


def test_streamed_path_computes_the_product(mm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """K > RESIDENT_K stages A's transpose in private HBM (K 1100: two chunks, the last partial;
    two M blocks per core, so the second block's staging is spread over the first's N tiles)."""
    a, b, want = _inputs(1040, 1100, 600, seed=7)
    monkeypatch.setattr(mm, "RESIDENT_K", 256)
    got = _run(mm, a, b)
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
