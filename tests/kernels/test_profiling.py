"""Cost-model profiles of the kernels (mxcli.kernels.profiling): the backward's extrapolation."""

from __future__ import annotations

import pytest

from mxcli.kernels import profiling as prof


def test_bwd_extrapolation_matches_the_full_plan() -> None:
    """Three short runs extrapolated to the real plan's N blocks and E experts reproduce the full
    run's compute-engine busy times and PE FLOPs (the same instruction stream per block) and bound
    its DMA time from above (the real plan's padding rows are skipped by the DMAs), and so GpSimd's,
    which generates the software-DGE descriptors of the rows moved (issue 29 item 3)."""
    s = prof.BwdShape(tokens=128, hidden=256, intermediate=128, experts=4, top_k=2, block_size=128)
    full = prof.profile_kernel(prof.BWD, *prof.bwd_inputs(s), lnc=1).summary()
    est = prof.profile_bwd_scaled(s, lnc=1)
    assert est["plan_padding"]["blocks"] == 5 and est["plan_padding"]["pairs"] == 256
    for eng in ("tensor", "vector", "scalar"):
        assert est["busy_us"][eng] == pytest.approx(full["busy_us"][eng], rel=1e-9, abs=1e-9)
    assert est["pe_flops"]["mx"] == pytest.approx(full["pe_flops"]["mx"])
    for eng in ("dma", "gpsimd"):
        assert full["busy_us"][eng] <= est["busy_us"][eng] <= 1.5 * full["busy_us"][eng]
    assert est["bottleneck"] == max(est["busy_us"], key=lambda k: est["busy_us"][k])
