# ruff: noqa: E741  (spec notation: I is the per-rank intermediate size I_TP)
"""`blockwise_mm_fwd_mxfp8`: §2.4 rounding points against a plain per-block loop, checkpoint
layouts, weight layouts, exact mode, validation."""

from __future__ import annotations

import pytest
import torch

from mxcli.kernels import blockwise_mm_fwd_mxfp8, build_block_plan, build_expert_affinities_masked
from mxcli.kernels.blockwise_moe import AffinityOption, BwdValidationError, ClampLimits
from mxcli.kernels.blockwise_moe.upstream_cases import make_upstream_case
from mxcli.mx import fake_quantize_mx
from mxcli.verification.mxchain import bf16_ulp, compare_chain, propagated_step_bound


def plain_kernel_fwd(x, ea, wgu, wd, tpi, b2e, B, clamp=None, scheme="wrapx", tile_k=512):
    """Bwd spec §2.4 written block by block: MX along H (projections) and I (down), bf16 at the
    listed points, two bf16 output slabs by block parity, then one bf16 add.

    Also returns the output's bound of one step propagated (`mxcli.verification.mxchain`): G/U
    come from a matmul and a bf16 rounding, S = bf(φ(G)·U·α) is MX-quantized for the down
    projection (one fp8 code step propagated), and the slabs sum bf16 block results (one bf16
    ulp of each summand)."""
    bf = lambda t: t.to(torch.bfloat16).float()  # noqa: E731

    def q(t, axis):
        return fake_quantize_mx(t, axis, scheme=scheme, tile_k=tile_k)

    T, H = x.shape
    E, _, _, I = wgu.shape
    N = b2e.shape[0]
    slabs = torch.zeros(2, T, H)
    ck = torch.zeros(N, 2, I, B)
    step = torch.zeros(T, H, dtype=torch.float64)
    for b in range(N):
        e = int(b2e[b, 0])
        rows = tpi[b * B : (b + 1) * B].long()
        valid = (rows >= 0) & (rows < T)
        X = torch.zeros(B, H)
        X[valid] = x[rows[valid]].float()
        al = torch.zeros(B, 1)
        al[valid, 0] = ea.float().view(-1)[rows[valid] * E + e]
        G = bf(q(X, 1) @ q(wgu[e, :, 0, :].float(), 0))
        U = bf(q(X, 1) @ q(wgu[e, :, 1, :].float(), 0))
        if clamp is not None:
            G = G.clamp(clamp.non_linear_clamp_lower_limit, clamp.non_linear_clamp_upper_limit)
            U = U.clamp(clamp.linear_clamp_lower_limit, clamp.linear_clamp_upper_limit)
        ck[b, 0], ck[b, 1] = G.T, U.T
        Hm = bf(G * torch.sigmoid(G) * U)
        S = bf(Hm * al)
        S_q, wd_q = q(S, 1), q(wd[e].float(), 0)
        Y = bf(S_q @ wd_q)
        s = b % 2
        slabs[s, rows[valid]] = bf(slabs[s, rows[valid]] + Y[valid])
        step[rows[valid]] += (propagated_step_bound(S_q, wd_q) + bf16_ulp(Y))[valid]
    out = bf(slabs[0] + slabs[1])
    return out, ck, step + bf16_ulp(slabs).sum(0)


@pytest.mark.parametrize(
    "shape,clamp", [((256, 256, 2, 128, 2, 256), None), ((384, 256, 3, 128, 2, 384), ClampLimits(-1.0, 1.0, -0.5, 0.5))]
)  # fmt: skip
def test_forward_matches_plain_block_loop(shape, clamp):
    H, T, E, B, K, I = shape
    inp = make_upstream_case(T, H, E, B, K, I)
    args = (inp.hidden_states, inp.expert_affinities_masked, inp.gate_up_proj_weight,
            inp.down_proj_weight, inp.token_position_to_id, inp.block_to_expert, B)  # fmt: skip
    got = blockwise_mm_fwd_mxfp8(*args, clamp_limits=clamp)
    out, ck, step = plain_kernel_fwd(*args, clamp=clamp)
    assert (
        got.output.dtype == torch.bfloat16
        and got.gate_up_proj_act_checkpoint_T.dtype == torch.bfloat16
    )
    # the tolerance model of mxcli.verification.mxchain (fp32 summation order flips a bf16
    # rounding): checkpoints, one matmul then bf16, within 2 ulps and nothing stepped
    ck_res = compare_chain(got.gate_up_proj_act_checkpoint_T.float(), ck, 0.0)
    assert ck_res.passed and ck_res.stepped == 0, ck_res.describe()
    assert ck_res.identical >= 0.998 * ck_res.numel, ck_res.describe()
    # the output: S is quantized after G's rounding, the slabs sum bf16 results
    out_res = compare_chain(got.output.float(), out, step)
    assert out_res.passed, out_res.describe()
    assert out_res.identical >= 0.98 * out_res.numel, out_res.describe()
    # the other checkpoints follow from G, U, α exactly as §2.4 says
    G, U = got.gate_up_proj_act_checkpoint_T.float().unbind(1)  # [N, I, B]
    act = G * torch.sigmoid(G)  # φ(g) = g·σ(g) in fp32 (spec §2.2)
    bf = lambda t: t.to(torch.bfloat16)  # noqa: E731
    assert torch.equal(got.gate_act_checkpoint_T, bf(act))
    assert torch.equal(got.intermediate_checkpoint_T, bf(act * U))
    N = G.shape[0]
    ids = inp.token_position_to_id.long().view(N, B)
    valid = ids >= 0
    alpha = (
        inp.expert_affinities_masked.float().view(-1)[
            ids.clamp(min=0) * E + inp.block_to_expert.long()
        ]
        * valid
    )
    assert torch.equal(
        got.scaled_intermediate_checkpoint_T,
        bf(got.intermediate_checkpoint_T.float() * alpha[:, None, :]),
    )


def test_checkpoint_layout_and_weight_layouts():
    """ckpt[b, 0, i, r] = G of the token at row r of block b (exact mode checks the layout)."""
    g = torch.Generator().manual_seed(0)
    T, H, I, E, B = 40, 128, 128, 2, 128
    x = torch.randn(T, H, generator=g)
    choices = torch.randint(0, E, (T, 1), generator=g)
    aff = build_expert_affinities_masked(torch.rand(T, E, generator=g), choices)
    wgu = torch.randn(E, H, 2, I, generator=g) * 0.1
    wd = torch.randn(E, I, H, generator=g) * 0.1
    tpi, b2e = build_block_plan(choices, E, B)
    res = blockwise_mm_fwd_mxfp8(x, aff, wgu, wd, tpi, b2e, B, emulate="exact")
    for b, r in ((0, 0), (0, 3), (b2e.shape[0] - 1, 1)):
        t = int(tpi[b * B + r])
        e = int(b2e[b, 0])
        if t < 0:
            continue
        want_g = x[t] @ wgu[e, :, 0, :]
        assert torch.allclose(res.gate_up_proj_act_checkpoint_T[b, 0, :, r], want_g, atol=1e-5)
        assert torch.allclose(
            res.gate_up_proj_act_checkpoint_T[b, 1, :, r], x[t] @ wgu[e, :, 1, :], atol=1e-5
        )
    # forward-natural weights ([E, 2, I, H], [E, H, I]) give the same result
    fwd_layout = blockwise_mm_fwd_mxfp8(
        x.bfloat16(), aff, wgu.permute(0, 2, 3, 1).bfloat16(), wd.transpose(1, 2).bfloat16(),
        tpi, b2e, B, weight_layout="forward",
    )  # fmt: skip
    bwd_layout = blockwise_mm_fwd_mxfp8(
        x.bfloat16(), aff, wgu.bfloat16(), wd.bfloat16(), tpi, b2e, B
    )
    for a, c in zip(fwd_layout, bwd_layout, strict=True):
        assert torch.equal(a, c)


def test_forward_kernel_vs_exact_and_affinity_on_h():
    inp = make_upstream_case(256, 256, 2, 128, 2, 256)
    args = (inp.hidden_states, inp.expert_affinities_masked, inp.gate_up_proj_weight,
            inp.down_proj_weight, inp.token_position_to_id, inp.block_to_expert, 128)  # fmt: skip
    k = blockwise_mm_fwd_mxfp8(*args).output.float()
    e = blockwise_mm_fwd_mxfp8(*args, emulate="exact").output
    cos = float(k.flatten() @ e.flatten() / (k.norm() * e.norm()))
    assert cos > 0.995  # upstream threshold 0.99 (§11.3); MXFP8 forward measures ~0.998
    h = blockwise_mm_fwd_mxfp8(*args, affinity_option=AffinityOption.AFFINITY_ON_H)
    assert h.scaled_intermediate_checkpoint_T is None
    hf = h.output.float()
    assert float(hf.flatten() @ e.flatten() / (hf.norm() * e.norm())) > 0.995
    assert not torch.equal(h.output.float(), k)  # α applied at a different rounding point


def test_forward_validation():
    inp = make_upstream_case(256, 128, 2, 128, 1, 128)
    args = [inp.hidden_states, inp.expert_affinities_masked, inp.gate_up_proj_weight,
            inp.down_proj_weight, inp.token_position_to_id, inp.block_to_expert, 128]  # fmt: skip
    bad = list(args)
    bad[0] = inp.hidden_states.float()
    with pytest.raises(BwdValidationError, match="hidden_states: expected dtype bfloat16"):
        blockwise_mm_fwd_mxfp8(*bad)
    bad = list(args)
    bad[2] = inp.gate_up_proj_weight[:, :, :, :64]
    with pytest.raises(BwdValidationError, match="gate_up_proj_weight: expected shape"):
        blockwise_mm_fwd_mxfp8(*bad)
    with pytest.raises(BwdValidationError, match="weight_layout"):
        blockwise_mm_fwd_mxfp8(*args, weight_layout="natural")
    with pytest.raises(BwdValidationError, match="tile_k"):
        blockwise_mm_fwd_mxfp8(*args, tile_k=64)
    with pytest.raises(
        BwdValidationError, match=r"gate_up_proj_bias: expected shape \(2, 2, 128\)"
    ):
        blockwise_mm_fwd_mxfp8(*args, gate_up_proj_bias=torch.zeros(2, 128))
