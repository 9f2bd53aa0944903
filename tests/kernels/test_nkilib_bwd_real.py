"""AWS's MXFP8 backward (nkilib ``experimental/moe_mxfp8/bwd``) on mxcli's interpreter, against
mxcli's golden with verify's own checks (issue 29). Runs only where that nkilib package is
importable (e.g. the scratch closure the issue's recipe assembles, on PYTHONPATH)."""

from __future__ import annotations

import importlib.util
from typing import Any

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


def test_real_nkilib_bwd_bias_case_equals_mxcli_kernel_byte_for_byte() -> None:
    """routed-e4-k2-bias: AWS's MXFP8 dropless hands both bias gradients to the bf16 dropless's
    helpers (experimental/moe/bwd/bwmm_bwd_dropless.py @092a49dc: the down-bias one gathers the
    scattered rows and weights them by the per-token affinity). All six outputs pass verify's
    checks; five are bit-exact against the golden, and all six are byte-identical to mxcli's own
    kernel on the same interpreter. hidden_states_grad differs from the golden in 1 of 65,536
    elements by 1 bf16 ulp in BOTH kernels alike (inside verify's 2-ulp bound), so the golden,
    not AWS's kernel, is the odd one out there."""
    import torch

    from mxcli.kernels.spec import get_spec
    from mxcli.runs import run_case, run_kernel
    from mxcli.verification import cases

    (c,) = cases.select("quick", "bwd/routed-e4-k2-bias")
    result = run_case(c, "sim", nki_kernel="nkilib")
    assert result.error is None, result.error
    assert not result.skipped, result.skipped
    failed = [str(r) for r in result.reports if not r.passed]
    assert not failed, failed
    vs_ref = {r.name: r for r in result.reports if "vs reference" in r.check}
    assert {"down_proj_bias_grad", "gate_and_up_proj_bias_grad"} <= set(vs_ref)
    exact = {n for n, r in vs_ref.items() if r.bit_exact}
    assert exact == set(vs_ref) - {"hidden_states_grad"}, exact
    assert vs_ref["hidden_states_grad"].mismatches <= 1

    inputs = c.make()
    kwargs = get_spec(c.kernel).resolve_kwargs(inputs.kwargs)
    aws = run_kernel(c.kernel, inputs.tensors, kwargs, backend="sim", nki_kernel="nkilib")
    ours = run_kernel(c.kernel, inputs.tensors, kwargs, backend="sim", nki_kernel="mxcli")
    assert set(aws.outputs) == set(ours.outputs) and len(aws.outputs) == 6
    for name, got in aws.outputs.items():
        want = ours.outputs[name]
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name


def test_real_nkilib_bwd_refuses_what_its_own_asserts_refuse() -> None:
    """dense-e1 (I_TP 128 over two cores: 64-wide PE-swizzle tiles) trips AWS's kernel_assert
    "tile_f must be divisible by 128": reported as not supported, not as a failure."""
    from mxcli.runs import run_case
    from mxcli.verification import cases

    (c,) = cases.select("quick", "bwd/dense-e1")
    result = run_case(c, "sim", nki_kernel="nkilib")
    assert result.skipped and "tile_f must be divisible by 128" in result.skipped


def _aws_tuned_launch(p2_block_m: int) -> Any:
    """AWS's backward at its tuned shape (H 4096, I_TP 1536, B = T = 4096, one expert, LNC 2)
    with the tuned per-phase blocking of its measurement: aws-neuron/nki-library
    tuned_blocking.py, SHAPE_TUNED_CONFIGS[B=4096, H=4096, I_TP=1536] (TILES_IN_LOAD_* as its
    derive_load_tiles gives them), phase 2's M-blocking replaced by `p2_block_m`. Check-only,
    the capacity check on."""
    import dataclasses

    from mxcli.kernels import launcher, selection
    from mxcli.kernels.blockwise_moe import profile as bwd_profile
    from mxcli.kernels.blockwise_moe.config import MatmulMxfp8KernelConfig as M
    from mxcli.kernels.blockwise_moe.config import TransposeMode
    from mxcli.kernels.blockwise_moe.spec import SPEC as BWD

    tensors, kwargs = bwd_profile.bwd_inputs(bwd_profile.BwdShape(4096, 4096, 1536, 1, 1, 4096))

    def phase(m: int, n: int, k: int, load_m: int) -> Any:
        return M(
            TILES_IN_BLOCK_M=m, TILES_IN_BLOCK_N=n, TILES_IN_BLOCK_K=k, tile_n=512,
            TILES_IN_LOAD_M=load_m, TILES_IN_LOAD_N=2,
        )  # fmt: skip

    cfg = dataclasses.replace(
        kwargs["config"],
        phase1_config=phase(16, 2, 4, 8),
        phase2_config=phase(p2_block_m, 2, 6, 8),
        phase3_config=phase(6, 4, 2, 6),
        phase4_config=phase(8, 2, 2, 8),
        phase3_transpose_mode=TransposeMode.NC,
        phase4_transpose_mode=TransposeMode.NC,
    )
    choice = selection.parse_implementation("nkilib", "blockwise_mm_bwd_mxfp8")
    return launcher.launch_sim(
        BWD, **tensors, **{**kwargs, "config": cfg}, lnc=2, check_only=True,
        implementation=choice,
    )  # fmt: skip


def test_real_nkilib_tuned_blocking_fits_and_the_one_the_compiler_refused_does_not() -> None:
    """The capacity check accepts what AWS compiled and measured (its tuned blocking: 209,288 B
    per partition at most, software-DGE descriptors included; under whole-tensor lifetimes it
    needed 274,568 B and was refused) and refuses what AWS's compiler refused: phase-2
    M-blocking 32, which tuned_blocking.py says overflows SBUF during QuantizeMx
    (NCC_IBIR229), peaks at 369,032 B."""
    from mxcli.nkisim import NkiCapacityError

    res = _aws_tuned_launch(16)
    peaks = [p.peak_sbuf_bytes for p in res.report.programs]
    assert max(peaks) == 209288, peaks
    with pytest.raises(NkiCapacityError, match=r"\(got 369032, expected <= 245752\)"):
        _aws_tuned_launch(32)


def _aws_tuned_schedule(dma_transposes: bool) -> Any:
    """The cost model's schedule of AWS's backward at its measured launch (tuned blocking,
    phase-3/4 transposes on the DMA or the PE), with the table's figures."""
    import warnings

    from mxcli.kernels import launcher, selection
    from mxcli.kernels.blockwise_moe import profile as bwd_profile
    from mxcli.kernels.blockwise_moe.spec import SPEC as BWD
    from mxcli.nkisim import cost, schedule, trace

    tensors, kwargs = bwd_profile.bwd_inputs(bwd_profile.AWS_SHAPE)
    cfg = bwd_profile.aws_tuned_config(dma_transposes=dma_transposes)
    choice = selection.parse_implementation("nkilib", "blockwise_mm_bwd_mxfp8")
    with trace.recording() as recs, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*reads memory never written")
        launcher.launch_sim(
            BWD, **tensors, **{**kwargs, "config": cfg}, lnc=2, check_only=True,
            implementation=choice,
        )  # fmt: skip
    return schedule.build_profile(recs, "trn3", cost.hardware("trn3"), 2)


def test_real_nkilib_pe_waits_as_aws_reports_and_the_dma_launch_is_slower() -> None:
    """AWS's note on its measured launches (tuned_blocking.py, `measured.BWD_SOURCE`): with DMA
    transposes "the PE idles ~49% of wall-clock waiting for its operands before the first
    matmul"; with PE transposes "matmuls start immediately", and the launch is faster (2.190 vs
    2.342 ms). Neither the wait nor the DMA launch was fitted (the one fitted figure was fitted
    to the PE launch's 2.190 ms), so these are predictions: issue 29 asks the DMA launch within
    +-10% of its measured 2.342 ms. Tolerance for the wait: a model against one hardware
    observation stated as "~49%"; +-9 points (0.40-0.58) is what we call near."""
    from mxcli.nkisim import measured

    dma, pe = _aws_tuned_schedule(True), _aws_tuned_schedule(False)
    assert dma.makespan_ns > pe.makespan_ns  # the ranking AWS measured
    # the fit reproduces the PE launch (2.190 ms) within 1%
    assert pe.makespan_ns / 1e3 == pytest.approx(measured.BWD_MXFP8.us_pe_transposes, rel=0.01)
    # the held-out DMA launch (2.342 ms), not fitted, within 10%
    assert dma.makespan_ns / 1e3 == pytest.approx(measured.BWD_MXFP8.us_dma_transposes, rel=0.10)
    dma_start, pe_start = dma.pe_start(), pe.pe_start()
    assert dma_start is not None and pe_start is not None
    assert 0.40 <= dma_start["share"] <= 0.58, dma_start
    assert pe_start["share"] < 0.10, pe_start  # the PE transposes start at once
