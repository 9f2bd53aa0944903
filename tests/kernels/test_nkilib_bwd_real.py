"""AWS's MXFP8 backward (nkilib ``experimental/moe_mxfp8/bwd``) on mxcli's interpreter, against
mxcli's golden with verify's own checks (issue 29). Runs only where that nkilib package is
importable (e.g. the scratch closure the issue's recipe assembles, on PYTHONPATH)."""

from __future__ import annotations

import importlib.util

import pytest

_MODULE = "nkilib.experimental.moe_mxfp8.bwd.blockwise_mm_backward_mxfp8"


def _importable() -> bool:
    try:
        return importlib.util.find_spec(_MODULE) is not None
    except ModuleNotFoundError:
        return False


pytestmark = [
    pytest.mark.skipif(
        not _importable(), reason="nkilib with the MXFP8 backward is not importable"
    ),
    pytest.mark.slow,
]


@pytest.mark.parametrize("case", ["bwd/routed-e2-k1", "bwd/routed-e2-k2-clamp-prequant"])
def test_real_nkilib_bwd_passes_verify_checks(case: str) -> None:
    """The routed default load path (DGT gather-transpose with [128, n] index grids, E > 1),
    two LNC cores each with its own SBUF manager, pre-quantized x4 weights: every output is
    bit-exact against mxcli's golden."""
    from mxcli.runs import run_case
    from mxcli.verification import cases

    (c,) = cases.select("quick", case)
    result = run_case(c, "sim", nki_kernel="nkilib")
    assert result.error is None, result.error
    assert not result.skipped, result.skipped
    failed = [str(r) for r in result.reports if not r.passed]
    assert not failed, failed
    vs_ref = [r for r in result.reports if "vs reference" in str(getattr(r, "check", ""))]
    assert vs_ref and all(getattr(r, "bit_exact", False) for r in vs_ref)
    assert result.info.get("nki_kernel") == "nkilib"


def test_real_nkilib_bwd_refuses_what_its_own_asserts_refuse() -> None:
    """dense-e1 (I_TP 128 over two cores: 64-wide PE-swizzle tiles) trips AWS's kernel_assert
    "tile_f must be divisible by 128": reported as not supported, not as a failure."""
    from mxcli.runs import run_case
    from mxcli.verification import cases

    (c,) = cases.select("quick", "bwd/dense-e1")
    result = run_case(c, "sim", nki_kernel="nkilib")
    assert result.skipped and "tile_f must be divisible by 128" in result.skipped
