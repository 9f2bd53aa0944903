"""The matmul -> bf16 -> MX tolerance model (`mxcli.verification.mxchain`): worked values, a real
fp8 code flip caused by one bf16 step, and the pass/fail classes; its use by `verify`."""

from __future__ import annotations

import torch

from mxcli.mx import dequantize_mx, quantize_mx
from mxcli.verification.compare import Tolerance, compare_tensors
from mxcli.verification.mxchain import (
    ChainTolerance,
    bf16_ulp,
    compare_chain,
    e4m3_code_step,
    propagated_step_bound,
)
from mxcli.verification.policy import compare_outputs, tolerance_for


def test_worked_ulps_and_steps() -> None:
    assert bf16_ulp(torch.tensor([1.0, 1.5, 0.75, -3.0])).tolist() == [2**-7, 2**-7, 2**-8, 2**-6]
    assert bf16_ulp(torch.tensor([0.0]), floor=1.0).tolist() == [2**-7]
    # |v|/X = 128 (binade [128, 256): step 16) and 0 (subnormal step 2^-9) at X = 2^-7
    steps = e4m3_code_step(torch.tensor([1.0, 0.0, -1.9]), torch.tensor(2.0**-7))
    assert steps.tolist() == [2**-3, 2**-16, 2**-3]
    # row max 1 -> step 2^-3; column max of the other operand 4 -> 0.5
    left = torch.tensor([[1.0, 0.5], [0.0, 0.0]])
    right = torch.tensor([[2.0], [-4.0]])
    assert propagated_step_bound(left, right).tolist() == [[0.5], [0.0]]
    assert propagated_step_bound(right, left, flipped="right").tolist() == [[0.5], [0.0]]


def test_one_bf16_step_flips_one_fp8_code_by_one_step() -> None:
    """1.0625 sits on the E4M3 tie between 1.0 and 1.125 at the group's scale 2^-7 (136 between
    128 and 144; ties to even: 128). The next bf16 value up rounds to 1.125: one bf16 step
    before the quantizer is exactly one code step after it."""
    y = torch.full((1, 32), 0.5, dtype=torch.bfloat16)
    y[0, 0] = 1.0625
    y2 = y.clone()
    y2[0, 0] = 1.0703125  # one bf16 ulp up
    v1 = dequantize_mx(*quantize_mx(y, -1, scheme="1x32"), axis=-1, scheme="1x32")
    v2 = dequantize_mx(*quantize_mx(y2, -1, scheme="1x32"), axis=-1, scheme="1x32")
    assert float(v1[0, 0]) == 1.0 and float(v2[0, 0]) == 1.125
    step = e4m3_code_step(v1, torch.tensor(2.0**-7))
    res = compare_chain(v2, v1, step, ChainTolerance(ulps=0, max_step_frac=1 / 32))
    assert res.passed and res.stepped == 1 and res.identical == 31
    # without the step allowance it is beyond
    assert not compare_chain(v2, v1, 0.0).passed


def test_compare_chain_classes_and_limits() -> None:
    want = torch.ones(1000)
    got = want.clone()
    got[0] += 2**-7  # one bf16 ulp: within
    got[1] += 0.1  # within one step of 0.125: stepped
    res = compare_chain(got, want, 0.125)
    assert (res.identical, res.within, res.stepped, res.beyond) == (998, 1, 1, 0)
    assert res.passed and res.allowed_steps == 10
    many = want.clone()
    many[:11] += 0.1  # 11 > 1% stepped
    assert not compare_chain(many, want, 0.125).passed
    far = want.clone()
    far[0] += 0.2  # more than 2 ulps + one step
    bad = compare_chain(far, want, 0.125)
    assert not bad.passed and bad.beyond == 1 and bad.worst_excess > 1
    # a systematic 3-ulp error fails even with a generous step: every element is stepped
    assert not compare_chain(want + 3 * 2**-7, want, 1.0).passed
    # NaN must sit where the golden has it
    nan = want.clone()
    nan[5] = float("nan")
    assert compare_chain(nan, nan.clone(), 0.0).passed
    assert not compare_chain(nan, want, 0.0).passed


def test_verify_uses_the_chain_model_for_dgu_outputs() -> None:
    tol = tolerance_for("hidden_states_grad", "strict")
    assert tol.kind == "chain" and tol.ulps == 2 and tol.max_mismatch_frac == 0.01
    g = torch.Generator().manual_seed(0)
    want = torch.randn(128, 128, generator=g).to(torch.bfloat16)
    got = want.clone()
    got[3, :] += 2**-5 * want.abs().max()  # one flipped dG/dU code: one row moves
    reps = compare_outputs("blockwise_mm_bwd_mxfp8", {"hidden_states_grad": got},
                           {"hidden_states_grad": want}, {})  # fmt: skip
    assert reps[0].passed and reps[0].mismatches > 0
    # a plain ulp tolerance rejects the same flip
    assert not compare_tensors("h", got, want, Tolerance("close", rtol=2**-7)).passed
    # ... and the chain model rejects two rows plus a shifted tensor
    got[4:6, :] += 2**-5 * want.abs().max()
    rep = compare_tensors("h", got, want, tol)
    assert not rep.passed
    # explicit --rtol/--atol replace the model
    assert tolerance_for("hidden_states_grad", "strict", overrides={"rtol": 0.5}).kind == "close"
