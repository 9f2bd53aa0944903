"""Cost-model profiles of the kernels (mxcli.kernels.profiling): the backward's extrapolation."""

from __future__ import annotations

import pytest

from mxcli.kernels import profiling as prof
from mxcli.kernels.blockwise_moe import profile as bwd_profile
from mxcli.kernels.blockwise_moe.spec import SPEC as BWD


def test_bwd_extrapolation_matches_the_full_plan() -> None:
    """Three short runs extrapolated to the real plan's N blocks and E experts reproduce the full
    run's compute-engine busy times and PE FLOPs (the same instruction stream per block) and bound
    its DMA time from above (the real plan's padding rows are skipped by the DMAs), and so GpSimd's,
    which generates the software-DGE descriptors of the rows moved (issue 29 item 3)."""
    s = bwd_profile.BwdShape(
        tokens=128, hidden=256, intermediate=128, experts=4, top_k=2, block_size=128
    )
    full = prof.profile_kernel(BWD, *bwd_profile.bwd_inputs(s), lnc=1).summary()
    est = bwd_profile.profile_bwd_scaled(s, lnc=1)
    assert est["plan_padding"]["blocks"] == 5 and est["plan_padding"]["pairs"] == 256
    for eng in ("tensor", "vector", "scalar"):
        assert est["busy_us"][eng] == pytest.approx(full["busy_us"][eng], rel=1e-9, abs=1e-9)
    assert est["pe_flops"]["mx"] == pytest.approx(full["pe_flops"]["mx"])
    for eng in ("dma", "gpsimd"):
        assert full["busy_us"][eng] <= est["busy_us"][eng] <= 1.5 * full["busy_us"][eng]
    assert est["bottleneck"] == max(est["busy_us"], key=lambda k: est["busy_us"][k])


def test_aws_tuned_config_is_the_table_entry_and_only_at_aws_shape() -> None:
    """AWS's kernel is costed at its measured shape with its tuned blocking (issue 29 item 4):
    phases 1-4 of tuned_blocking.py's entry, PE or DMA transposes; other shapes, or a launch
    with a config of its own, keep theirs."""
    from mxcli.kernels.blockwise_moe.config import TransposeMode

    pe, dma = bwd_profile.aws_tuned_config(), bwd_profile.aws_tuned_config(dma_transposes=True)
    assert [(c.TILES_IN_BLOCK_M, c.TILES_IN_BLOCK_N, c.TILES_IN_BLOCK_K) for c in
            (pe.phase1_config, pe.phase2_config, pe.phase3_config, pe.phase4_config)] == [
        (16, 2, 4), (16, 2, 6), (6, 4, 2), (8, 2, 2)]  # fmt: skip
    assert pe.phase3_transpose_mode is TransposeMode.NC is pe.phase4_transpose_mode
    assert dma.phase3_transpose_mode is TransposeMode.DMA is dma.phase4_transpose_mode
    at = bwd_profile.bwd_inputs(bwd_profile.AWS_SHAPE)
    assert bwd_profile.launch_kwargs("nkilib", *at)["config"] == pe
    assert bwd_profile.launch_kwargs("mxcli", *at) == at[1]  # ours keeps its own plan
    own = {**at[1], "config": dma}
    assert bwd_profile.launch_kwargs("nkilib", at[0], own) == own
    small = bwd_profile.bwd_inputs(bwd_profile.BwdShape(128, 256, 128, 1, 1, 128))
    assert bwd_profile.launch_kwargs("nkilib", *small) == small[1]


def test_profile_comparison_gives_ours_over_aws() -> None:
    from mxcli.commands.profile import comparison

    def s(kernel: str, sched: float, bound: float) -> dict:
        return {"nki_kernel": {"kernel": kernel}, "schedule_us": sched, "lower_bound_us": bound,
                "bottleneck": "dma"}  # fmt: skip

    cmp = comparison([s("mxcli", 800.0, 600.0), s("nkilib", 2000.0, 1500.0)])
    assert cmp["ours_over_aws"] == {"schedule": 0.4, "lower_bound": 0.4}
    assert "ours_over_aws" not in comparison([s("mxcli", 800.0, 600.0)])
