"""Cost-model profiles of the kernels (mxcli.kernels.profiling): the backward's extrapolation."""

from __future__ import annotations

import pytest

from mxcli.kernels import profiling as prof
from mxcli.kernels.blockwise_moe import profile as bwd_profile
from mxcli.kernels.blockwise_moe.spec import SPEC as BWD


def test_bwd_extrapolation_matches_the_full_plan() -> None:
    """Three short runs extrapolated to the real plan's N blocks and E experts reproduce the full
    run's compute-engine busy times and PE FLOPs (the same instruction stream per block) and bound
    its DMA time from above (the real plan's padding rows are skipped by the DMAs)."""
    s = bwd_profile.BwdShape(
        tokens=128, hidden=256, intermediate=128, experts=4, top_k=2, block_size=128
    )
    full = prof.profile_kernel(BWD, *bwd_profile.bwd_inputs(s), lnc=1).summary()
    est = bwd_profile.profile_bwd_scaled(s, lnc=1)
    assert est["plan_padding"]["blocks"] == 5 and est["plan_padding"]["pairs"] == 256
    for eng in ("tensor", "vector", "scalar", "gpsimd"):
        assert est["busy_us"][eng] == pytest.approx(full["busy_us"][eng], rel=1e-9, abs=1e-9)
    assert est["pe_flops"]["mx"] == pytest.approx(full["pe_flops"]["mx"])
    assert full["busy_us"]["dma"] <= est["busy_us"]["dma"] <= 1.5 * full["busy_us"]["dma"]
    assert est["bottleneck"] == max(est["busy_us"], key=lambda k: est["busy_us"][k])
