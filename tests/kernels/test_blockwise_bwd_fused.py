# ruff: noqa: E741  (spec notation: I is the per-rank intermediate size I_TP)
"""The fused numba passes of the bwd reference (`blockwise_moe._fused`) give the same bytes as
its pure-torch path (``MXCLI_FUSED=0``, which also turns off mxcli.mx's fused quantizer).

The bf16 rounding and the bf16 read-add-write are checked against torch's casts and adds on
every special fp32 class (ties, overflow, subnormals, ±Inf, NaNs of any sign and payload); the
whole backward is compared bit for bit on configurations that reach every branch of the fused
passes: clamp masks (a bound that fp32 cannot hold), AFFINITY_ON_H with and without its
checkpoint, the act/Hm/S checkpoints, G/U recomputed, fp16 inputs, the dense path with a valid
token count, an expert without blocks, padding, top-k accumulation and Inf/NaN inputs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mxcli.kernels import MXFP8MOEBwdConfig, blockwise_mm_bwd_mxfp8, blockwise_mm_fwd_mxfp8
from mxcli.kernels.blockwise_moe import AffinityOption, ClampLimits, QuantScheme
from mxcli.kernels.blockwise_moe import backward as bwd
from mxcli.kernels.blockwise_moe.numerics import Numerics
from mxcli.kernels.blockwise_moe.upstream_cases import UpstreamCase, make_upstream_case

pytest.importorskip("numba")
from mxcli.kernels.blockwise_moe import _fused  # noqa: E402  (needs numba)


def special_fp32() -> torch.Tensor:
    """fp32 values of every rounding class for the fp32 -> bf16 cast, both signs."""
    g = torch.Generator().manual_seed(0)
    patterns = [
        0x00000000, 0x00000001, 0x00007FFF, 0x00008000, 0x00018000, 0x007FFFFF, 0x00800000,
        0x3F800000, 0x3F807FFF, 0x3F808000, 0x3F818000, 0x3F808001, 0x3F80FFFF,
        0x7F7F7FFF, 0x7F7F8000, 0x7F7FFFFF, 0x7F800000,  # max finite, ties to Inf, Inf
        0x7F800001, 0x7FC00000, 0x7FFFFFFF, 0x7FA12345, 0x7F80FFFF,  # NaNs, incl. payloads
    ]  # fmt: skip
    base = torch.tensor(patterns, dtype=torch.int64)
    base = torch.cat([base, base | 0x80000000])  # negatives (and negative NaNs)
    rnd = torch.randint(0, 2**32, (4096 - base.numel(),), generator=g, dtype=torch.int64)
    return torch.cat([base, rnd]).to(torch.int32).view(torch.float32).view(64, 64)


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns (NaNs compare by pattern)."""
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def test_bf16_rounding_and_accumulation_match_torch():
    c = special_fp32()
    nan = _fused.torch_bf16_nan()
    got = torch.empty(64, 64, dtype=torch.bfloat16)
    _fused.acc_block(_fused.u16(got), c.numpy(), True, nan)  # acc = bf16(c)
    assert torch.equal(bits(got), bits(c.to(torch.bfloat16)))
    # acc = bf16(acc + bf16(c)) against torch's bf16 add, every class against every class
    acc0 = c.flip(0).to(torch.bfloat16)
    got = acc0.clone()
    _fused.acc_block(_fused.u16(got), c.numpy(), False, nan)
    assert torch.equal(bits(got), bits(acc0.clone().add_(c.to(torch.bfloat16))))
    # the NaN pattern is torch's, whichever CPU kernel produced it
    assert (
        int(nan)
        == int(torch.full((64,), float("nan")).to(torch.bfloat16).view(torch.int16)[0]) & 0xFFFF
    )


def test_row_rounding_and_ordered_scatter_match_torch():
    nan = _fused.torch_bf16_nan()
    c = special_fp32()
    out = torch.full((64, 64), 7.0, dtype=torch.bfloat16)
    sel = torch.tensor([5, 0, 63, 7])
    dest = torch.tensor([1, 2, 3, 60])
    _fused.round_rows(c.numpy(), sel.numpy(), dest.numpy(), _fused.u16(out), nan)
    want = torch.full((64, 64), 7.0, dtype=torch.bfloat16)
    want[dest] = c[sel].to(torch.bfloat16)
    assert torch.equal(bits(out), bits(want))
    # rows written in order: token 3 three times, token 0 twice, others once or never
    ids = torch.tensor([3, 0, 3, 9, 0, 3])
    vals = special_fp32()[:6].to(torch.bfloat16)
    for accumulate in (True, False):
        got = torch.full((12, 64), 5.0, dtype=torch.bfloat16)  # garbage: rows no id names -> 0
        _fused.ordered_scatter(_fused.u16(got), ids.numpy(), _fused.u16(vals), accumulate, nan)
        want = torch.zeros(12, 64, dtype=torch.bfloat16)
        bwd.ordered_scatter(want, ids, vals, accumulate, Numerics("kernel"))
        assert torch.equal(bits(got), bits(want)), accumulate


@pytest.mark.parametrize("H,B", [(256, 128), (384, 512)])  # whole and partial work items
def test_token_last_gather_matches_index_select(H, B):
    g = torch.Generator().manual_seed(1)
    T = 100
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, T + 1, (3 * B,), generator=g)  # T = padding
    rows = torch.empty(3 * B, H, dtype=torch.bfloat16)
    rows_t = torch.empty(3, H, B, dtype=torch.bfloat16)
    _fused.gather_rows_t(
        _fused.u64(x), ids.numpy(), T, B, _fused.u64(rows), _fused.u64(rows_t), True
    )
    want = torch.cat([x, torch.zeros(1, H, dtype=torch.bfloat16)]).index_select(0, ids)
    assert torch.equal(bits(rows), bits(want))
    assert torch.equal(bits(rows_t), bits(want.view(3, B, H).transpose(1, 2).contiguous()))


# ---------------------------------------------------------------------------------------------
# The whole backward: fused == torch path, bit for bit
# ---------------------------------------------------------------------------------------------
def both_paths(monkeypatch: pytest.MonkeyPatch, kw: dict, cfg: MXFP8MOEBwdConfig) -> None:
    monkeypatch.setenv("MXCLI_FUSED", "1")
    assert bwd._fused_kernels(Numerics("kernel"), torch.device("cpu")) is not None
    fused = blockwise_mm_bwd_mxfp8(**kw, config=cfg)
    monkeypatch.setenv("MXCLI_FUSED", "0")
    assert bwd._fused_kernels(Numerics("kernel"), torch.device("cpu")) is None
    plain = blockwise_mm_bwd_mxfp8(**kw, config=cfg)
    assert len(fused) == len(plain)
    for i, (f, p) in enumerate(zip(fused, plain, strict=True)):
        assert f.dtype == p.dtype and f.shape == p.shape, i
        assert torch.equal(bits(f), bits(p)), i
        finite = p.float()[p.float().isfinite()]
        assert finite.abs().max() > 0, i  # real values, not all zeros or NaN


def routed(inp: UpstreamCase, **kw) -> MXFP8MOEBwdConfig:  # type: ignore[no-untyped-def]
    return MXFP8MOEBwdConfig.routed(inp.top_k, clamp_limits=inp.clamp_limits or ClampLimits(), **kw)


def test_fused_equals_torch_bias_clamp_specials(monkeypatch):
    # 0.1 and -0.3 are not fp32 values: the masks compare in fp32, as torch does
    clamp = ClampLimits(-0.3, 0.1, None, 0.25)
    inp = make_upstream_case(256, 256, 2, 128, 2, 256, bias=True, clamp_limits=clamp)
    # the checkpoint's Inf/NaN reach single elements of dG/dU (a NaN in dY would reach whole
    # matmul rows); dY near the fp32 maximum overflows products to Inf
    dy = inp.output_hidden_states_grad.clone()
    dy[3, 7], dy[10, 100] = 3e38, -3e38
    inp.output_hidden_states_grad = dy
    ck = inp.gate_up_proj_act_checkpoint_T.clone()
    ck[0, 0, 5, 7], ck[0, 1, 9, 3], ck[1, 0, 2, 2] = float("nan"), float("inf"), float("-inf")
    ck[0, 1, 3, :64] = 0.25  # U exactly at its upper bound: masked (strict inequality)
    inp.gate_up_proj_act_checkpoint_T = ck
    both_paths(monkeypatch, inp.kwargs(), routed(inp, bias=True))


def test_fused_equals_torch_1x32_no_accumulate_idle_expert(monkeypatch):
    inp = make_upstream_case(256, 384, 3, 128, 2, 128)
    b2e = inp.block_to_expert.clone()
    b2e[b2e == 1] = 0  # expert 1 gets no block: its weight grads must be zeros
    inp.block_to_expert = b2e
    cfg = routed(inp, quant_scheme=QuantScheme.MX1X32, accumulate_hidden_states_grad=False)
    both_paths(monkeypatch, inp.kwargs(), cfg)


@pytest.mark.parametrize("with_ckpt", [False, True])
def test_fused_equals_torch_affinity_on_h(monkeypatch, with_ckpt):
    inp = make_upstream_case(256, 256, 2, 128, 2, 256)
    kw = inp.kwargs()
    if with_ckpt:
        n = inp.token_position_to_id.numel() // inp.block_size
        g = torch.Generator().manual_seed(5)
        kw["down_proj_act_checkpoint"] = torch.randn(n, 128, 256, generator=g).to(torch.bfloat16)
    both_paths(monkeypatch, kw, routed(inp, affinity_option=AffinityOption.AFFINITY_ON_H))


def test_fused_equals_torch_checkpoints_and_recompute(monkeypatch):
    inp = make_upstream_case(256, 256, 2, 128, 2, 256)
    fwd = blockwise_mm_fwd_mxfp8(
        inp.hidden_states, inp.expert_affinities_masked, inp.gate_up_proj_weight,
        inp.down_proj_weight, inp.token_position_to_id, inp.block_to_expert, inp.block_size,
    )  # fmt: skip
    cfg = routed(inp)
    ckpts = {
        "gate_act_checkpoint_T": fwd.gate_act_checkpoint_T,
        "intermediate_checkpoint_T": fwd.intermediate_checkpoint_T,
    }
    # G/U recomputed from hidden_states (transposed views), act and Hm read from checkpoints
    both_paths(monkeypatch, inp.kwargs() | {"gate_up_proj_act_checkpoint_T": None} | ckpts, cfg)
    # all three ON_I checkpoints, S given as a non-contiguous tensor
    s = fwd.intermediate_checkpoint_T.transpose(1, 2).contiguous().transpose(1, 2) * 0.5
    both_paths(monkeypatch, inp.kwargs() | ckpts | {"scaled_intermediate_checkpoint_T": s}, cfg)


def test_fused_equals_torch_fp16_and_dense_valid_count(monkeypatch):
    inp = make_upstream_case(256, 256, 2, 128, 1, 128)
    kw = inp.kwargs()
    kw["hidden_states"] = kw["hidden_states"].half()
    kw["output_hidden_states_grad"] = kw["output_hidden_states_grad"].half()
    both_paths(monkeypatch, kw, routed(inp))
    dense = make_upstream_case(512, 256, 1, 256, 1, 128, dense=True)
    kw = dense.kwargs() | {"num_valid_tokens": torch.tensor([300], dtype=torch.int32)}
    both_paths(monkeypatch, kw, MXFP8MOEBwdConfig())


def test_fused_kernels_only_where_they_apply(monkeypatch):
    monkeypatch.setenv("MXCLI_FUSED", "1")
    cpu = torch.device("cpu")
    assert bwd._fused_kernels(Numerics("exact"), cpu) is None  # exact mode: fp32 throughout
    f16 = torch.zeros(2, dtype=torch.float16)
    assert bwd._fused_kernels(Numerics("kernel"), cpu, None, f16) is None  # fp16 checkpoint
    assert bwd._fused_kernels(Numerics("kernel"), torch.device("meta")) is None
    assert np.uint16(_fused.torch_bf16_nan()) in (np.uint16(0xFFFF), np.uint16(0x7FC0))
