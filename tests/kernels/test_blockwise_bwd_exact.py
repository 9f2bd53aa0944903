# ruff: noqa: E741  (spec notation: I is the per-rank intermediate size I_TP)
"""`emulate="exact"` (fp32, no quantization) against torch.autograd of an independent,
plainly written dense MoE forward; the §12.1 scalar example; checkpoint combinations;
AFFINITY_ON_H; num_valid_tokens; padding."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from mxcli.kernels import (
    MXFP8MOEBwdConfig,
    blockwise_mm_bwd_mxfp8,
    blockwise_mm_fwd_mxfp8,
    build_block_plan,
    build_expert_affinities_masked,
)
from mxcli.kernels.blockwise_moe import AffinityOption, BwdValidationError, ClampLimits

CLAMPS = ClampLimits(-1.0, 1.0, -0.75, 0.5)


# ---------------------------------------------------------------------------------------------
# The oracle: a dense MoE layer written plainly (loop over experts, fp32), differentiated by
# autograd. It shares nothing with the package except nothing: routing is a [T, E] bool mask.
# ---------------------------------------------------------------------------------------------
def oracle_moe_forward(x, aff, routed, w_gu, w_d, b_gu=None, b_d=None, clamp=None, on_h=False):
    """out[t] = sum over experts e routed for t of  a[t,e] * (silu(g) * u) @ W_d[e]  (+ a * b_d).

    x [T, H], aff [T, E], routed [T, E] bool, w_gu [E, H, 2, I], w_d [E, I, H],
    b_gu [E, 2, I], b_d [E, H]. The affinity gradient of the kernel omits the bias term
    (bwd spec §2.3), so the bias is multiplied by a detached affinity here.
    """
    T, H = x.shape
    E = w_d.shape[0]
    out = torch.zeros(T, H, dtype=torch.float32)
    for e in range(E):
        tokens = routed[:, e].nonzero().view(-1)
        if tokens.numel() == 0:
            continue
        xe = x[tokens]
        a = aff[tokens, e].unsqueeze(1)
        gate = xe @ w_gu[e, :, 0, :]
        up = xe @ w_gu[e, :, 1, :]
        if b_gu is not None:
            gate = gate + b_gu[e, 0]
            up = up + b_gu[e, 1]
        if clamp is not None:
            gate = torch.clamp(
                gate, clamp.non_linear_clamp_lower_limit, clamp.non_linear_clamp_upper_limit
            )
            up = torch.clamp(up, clamp.linear_clamp_lower_limit, clamp.linear_clamp_upper_limit)
        h = F.silu(gate) * up
        if on_h:
            y = a * (h @ w_d[e])
        else:
            y = (a * h) @ w_d[e]
        if b_d is not None:
            y = y + a.detach() * b_d[e]
        out = out.index_add(0, tokens, y)
    return out


@dataclass
class Case:
    x: torch.Tensor
    aff: torch.Tensor  # [T, E] masked
    routed: torch.Tensor
    w_gu: torch.Tensor
    w_d: torch.Tensor
    dy: torch.Tensor
    b_gu: torch.Tensor | None
    b_d: torch.Tensor | None
    tpi: torch.Tensor
    b2e: torch.Tensor
    B: int
    K: int


def make_case(T=96, H=128, I=128, E=4, K=2, B=128, bias=False, seed=0) -> Case:
    g = torch.Generator().manual_seed(seed)
    choices = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    routed = torch.zeros(T, E, dtype=torch.bool).scatter_(1, choices, True)
    aff = torch.rand(T, E, generator=g) * routed
    x = torch.randn(T, H, generator=g)
    w_gu = torch.randn(E, H, 2, I, generator=g) * 0.1
    w_d = torch.randn(E, I, H, generator=g) * 0.1
    dy = torch.randn(T, H, generator=g)
    b_gu = torch.randn(E, 2, I, generator=g) * 0.1 if bias else None
    b_d = torch.randn(E, H, generator=g) * 0.1 if bias else None
    tpi, b2e = build_block_plan(choices, E, B)
    return Case(x, aff, routed, w_gu, w_d, dy, b_gu, b_d, tpi, b2e, B, K)


def oracle_grads(c: Case, clamp=None, on_h=False):
    leaves = [t.clone().requires_grad_(True) for t in (c.x, c.aff, c.w_gu, c.w_d)]
    biases = [None if t is None else t.clone().requires_grad_(True) for t in (c.b_gu, c.b_d)]
    out = oracle_moe_forward(*leaves[:2], c.routed, *leaves[2:], *biases, clamp=clamp, on_h=on_h)
    (out * c.dy).sum().backward()
    grads = [leaves[0].grad, leaves[1].grad.reshape(-1, 1), leaves[2].grad, leaves[3].grad]
    if c.b_gu is not None:
        grads += [biases[0].grad, biases[1].grad]
    return out.detach(), grads


def run_exact(c: Case, clamp=None, on_h=False, accumulate=None, **ckpt_kwargs):
    ea = build_expert_affinities_masked(c.aff)
    cfg = MXFP8MOEBwdConfig.routed(
        c.K,
        bias=c.b_gu is not None,
        clamp_limits=clamp or ClampLimits(),
        affinity_option=AffinityOption.AFFINITY_ON_H if on_h else AffinityOption.AFFINITY_ON_I,
        **({} if accumulate is None else {"accumulate_hidden_states_grad": accumulate}),
    )
    fwd = blockwise_mm_fwd_mxfp8(
        c.x, ea, c.w_gu, c.w_d, c.tpi, c.b2e, c.B,
        clamp_limits=clamp, gate_up_proj_bias=c.b_gu, down_proj_bias=c.b_d,
        affinity_option=cfg.affinity_option, emulate="exact",
    )  # fmt: skip
    kwargs = {"gate_up_proj_act_checkpoint_T": fwd.gate_up_proj_act_checkpoint_T}
    kwargs.update(ckpt_kwargs)
    grads = blockwise_mm_bwd_mxfp8(
        c.x, ea, c.w_gu, c.w_d, c.tpi, c.b2e, c.dy, c.B, **kwargs, config=cfg, emulate="exact"
    )
    return fwd, grads


def max_rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| (elementwise relative error is meaningless near zero)."""
    assert got.shape == want.shape
    return float((got.float() - want).abs().max() / want.abs().max())


NAMES = ["hidden", "affinity", "gate_up_w", "down_w", "gate_up_b", "down_b"]


@pytest.mark.parametrize(
    "K,bias,clamp",
    [(1, False, None), (2, False, None), (2, True, None), (3, True, CLAMPS), (1, False, CLAMPS)],
)
def test_exact_matches_autograd(K, bias, clamp):
    c = make_case(K=K, bias=bias, seed=K + 10 * bias)
    want_out, want = oracle_grads(c, clamp)
    fwd, got = run_exact(c, clamp)
    assert len(got) == (6 if bias else 4)
    assert max_rel_err(fwd.output, want_out) <= 1e-5
    for name, g, w in zip(NAMES, got, want, strict=False):
        assert g.dtype == torch.float32
        assert max_rel_err(g, w) <= 1e-5, name
        assert float(w.abs().max()) > 0  # the check is not vacuous
    # the affinity grad is zero exactly where the pair is not routed
    assert torch.all(got[1].view(c.routed.shape)[~c.routed] == 0)
    if clamp is not None:  # clamps really bite in this data
        ck = fwd.gate_up_proj_act_checkpoint_T
        assert int((ck[:, 0] == 1.0).sum()) > 200 and int((ck[:, 0] == -1.0).sum()) > 200
        assert int((ck[:, 1] == 0.5).sum()) > 200 and int((ck[:, 1] == -0.75).sum()) > 200


def test_exact_affinity_on_h_matches_autograd():
    c = make_case(K=2, seed=3)
    want_out, want = oracle_grads(c, CLAMPS, on_h=True)
    fwd, got = run_exact(c, CLAMPS, on_h=True)
    assert fwd.scaled_intermediate_checkpoint_T is None
    assert max_rel_err(fwd.output, want_out) <= 1e-5
    for name, g, w in zip(NAMES, got, want, strict=False):
        assert max_rel_err(g, w) <= 1e-5, name


def test_down_proj_act_checkpoint_on_h():
    c = make_case(K=2, seed=4)
    _, want = oracle_grads(c, on_h=True)
    # API reference: down_proj_act_checkpoint [N, B, H] = output_grad[block] * affinity
    ea = c.aff.reshape(-1)
    E = c.aff.shape[1]
    N = c.b2e.shape[0]
    ids = c.tpi.long().view(N, c.B)
    valid = ids >= 0
    safe = ids.clamp(min=0)
    alpha = ea[safe * E + c.b2e.long().view(N, 1)] * valid
    dys = c.dy[safe] * alpha[..., None]
    dys[~valid] = 123.0  # padding rows are ignored
    _, got = run_exact(c, on_h=True, down_proj_act_checkpoint=dys)
    for name, g, w in zip(NAMES, got, want, strict=False):
        assert max_rel_err(g, w) <= 1e-5, name


def test_scalar_example_12_1():
    """Spec §12.1 embedded in H = I = 128 (element 0 carries the example, the rest are 0)."""
    T, H, I, E, B = 1, 128, 128, 1, 128
    x = torch.zeros(T, H)
    x[0, 0] = 1.0
    w_gu = torch.zeros(E, H, 2, I)
    w_gu[0, 0, 0, 0], w_gu[0, 0, 1, 0] = 0.5, 2.0
    w_d = torch.zeros(E, I, H)
    w_d[0, 0, 0] = 3.0
    ea = torch.tensor([[0.5]])
    dy = torch.zeros(T, H)
    dy[0, 0] = 1.0
    tpi, b2e = build_block_plan(torch.tensor([[0]]), E, B)
    cfg = MXFP8MOEBwdConfig.routed(1)
    fwd = blockwise_mm_fwd_mxfp8(x, ea, w_gu, w_d, tpi, b2e, B, emulate="exact")
    assert fwd.output[0, 0].item() == pytest.approx(0.9336889968, abs=1e-7)
    assert fwd.scaled_intermediate_checkpoint_T[0, 0, 0].item() == pytest.approx(
        0.3112296656, abs=1e-7
    )
    dx, dea, dwgu, dwd = blockwise_mm_bwd_mxfp8(
        x, ea, w_gu, w_d, tpi, b2e, dy, B,
        gate_up_proj_act_checkpoint_T=fwd.gate_up_proj_act_checkpoint_T, config=cfg, emulate="exact",
    )  # fmt: skip
    assert dea[0, 0].item() == pytest.approx(1.8673779936, abs=1e-6)
    assert dx[0, 0].item() == pytest.approx(2.0436307778, abs=1e-6)
    assert dwgu[0, 0, 0, 0].item() == pytest.approx(2.2198835619, abs=1e-6)  # dWg = dG
    assert dwgu[0, 0, 1, 0].item() == pytest.approx(0.4668444984, abs=1e-6)  # dWu = dU
    assert dwd[0, 0, 0].item() == pytest.approx(0.3112296656, abs=1e-7)  # S
    # everything else is zero
    assert dx.abs().sum().item() == pytest.approx(abs(dx[0, 0].item()))
    assert int((dwgu != 0).sum()) == 2 and int((dwd != 0).sum()) == 1
    # kernel mode: the example's values are exact in MXFP8; only bf16 roundings remain
    k = blockwise_mm_bwd_mxfp8(
        x.bfloat16(), ea.bfloat16(), w_gu.bfloat16(), w_d.bfloat16(), tpi, b2e, dy.bfloat16(), B,
        gate_up_proj_act_checkpoint_T=fwd.gate_up_proj_act_checkpoint_T.bfloat16(), config=cfg,
    )  # fmt: skip
    assert k[1][0, 0].item() == pytest.approx(1.8673779936, rel=2**-7)
    assert k[0][0, 0].item() == pytest.approx(2.0436307778, rel=2**-6)
    assert k[2][0, 0, 0, 0].item() == pytest.approx(2.2198835619, rel=2**-6)


@pytest.mark.parametrize("on_h", [False, True])
def test_checkpoint_combinations_exact(on_h):
    """Every form of the API reference gives the autograd gradients in exact mode."""
    c = make_case(K=2, seed=5)
    _, want = oracle_grads(c, CLAMPS, on_h=on_h)
    fwd, _ = run_exact(c, CLAMPS, on_h=on_h)
    forms = [
        {"gate_act_checkpoint_T": fwd.gate_act_checkpoint_T},
        {"intermediate_checkpoint_T": fwd.intermediate_checkpoint_T},
        {
            "gate_act_checkpoint_T": fwd.gate_act_checkpoint_T,
            "intermediate_checkpoint_T": fwd.intermediate_checkpoint_T,
        },
        # gate/up checkpoint absent: G/U recomputed from hidden_states (API reference)
        {
            "gate_up_proj_act_checkpoint_T": None,
            "gate_act_checkpoint_T": fwd.gate_act_checkpoint_T,
            "intermediate_checkpoint_T": fwd.intermediate_checkpoint_T,
        },
    ]
    if not on_h:
        forms.append({"scaled_intermediate_checkpoint_T": fwd.scaled_intermediate_checkpoint_T})
    for form in forms:
        _, got = run_exact(c, CLAMPS, on_h=on_h, **form)
        for name, g, w in zip(NAMES, got, want, strict=False):
            assert max_rel_err(g, w) <= 1e-5, (sorted(form), name)


def test_checkpoints_are_really_used():
    """A wrong optional checkpoint changes exactly the gradients that read it."""
    c = make_case(K=1, seed=6)
    fwd, base = run_exact(c)
    bad = fwd.scaled_intermediate_checkpoint_T * 2
    _, got = run_exact(c, scaled_intermediate_checkpoint_T=bad)
    assert max_rel_err(got[3], base[3] * 2) <= 1e-5  # P4 reads S
    for i in (0, 1, 2):
        assert torch.equal(got[i], base[i])
    _, got = run_exact(c, intermediate_checkpoint_T=fwd.intermediate_checkpoint_T * 3)
    assert max_rel_err(got[1], base[1] * 3) <= 1e-5  # dA = <D, Hm>
    assert torch.equal(got[0], base[0])


def test_top_k_without_accumulation_keeps_the_last_write():
    c = make_case(K=2, seed=7)
    _, acc = run_exact(c, accumulate=True)
    _, last = run_exact(c, accumulate=False)
    # per token, the contribution of its last block (highest expert under the canonical plan)
    E = c.aff.shape[1]
    last_e = torch.where(c.routed, torch.arange(E), -1).amax(1)
    only_last = c.routed & (torch.arange(E)[None, :] == last_e[:, None])
    c_last = Case(
        c.x, c.aff * only_last, only_last, c.w_gu, c.w_d, c.dy, None, None, c.tpi, c.b2e, c.B, c.K
    )
    _, want_last = oracle_grads(c_last)
    assert max_rel_err(last[0], want_last[0]) <= 1e-5
    assert not torch.allclose(last[0], acc[0])
    assert torch.equal(last[2], acc[2]) and torch.equal(last[3], acc[3])


def test_padding_rows_contribute_zero():
    """Garbage in the padding columns of the checkpoint changes nothing (zero X, dY, α)."""
    c = make_case(K=2, seed=8)
    fwd, base = run_exact(c)
    ck = fwd.gate_up_proj_act_checkpoint_T.clone()
    pad = (c.tpi.view(-1, c.B) < 0)[:, None, None, :].expand_as(ck)
    assert pad.any()
    ck[pad] = 7.5
    _, got = run_exact(c, gate_up_proj_act_checkpoint_T=ck)
    for g, b in zip(got, base, strict=True):
        assert torch.equal(g, b)


def dense_case(T=512, H=128, I=128, B=128, seed=9):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    ea = torch.rand(T, 1, generator=g)
    w_gu = torch.randn(1, H, 2, I, generator=g) * 0.1
    w_d = torch.randn(1, I, H, generator=g) * 0.1
    dy = torch.randn(T, H, generator=g)
    tpi = torch.arange(T, dtype=torch.int32)
    b2e = torch.zeros(T // B, 1, dtype=torch.int32)
    return x, ea, w_gu, w_d, tpi, b2e, dy


@pytest.mark.parametrize("emulate", ["exact", "kernel"])
@pytest.mark.parametrize("nv", [300, 256, 0, 10_000])
def test_num_valid_tokens(emulate, nv):
    """Dense path with a count: equals a full run whose rows >= count are zeroed; rows past the
    count are zero (documented choice: they are undefined on the device)."""
    x, ea, w_gu, w_d, tpi, b2e, dy = dense_case()
    T, B = x.shape[0], 128
    dt = torch.float32 if emulate == "exact" else torch.bfloat16
    x, ea, w_gu, w_d, dy = (t.to(dt) for t in (x, ea, w_gu, w_d, dy))
    fwd = blockwise_mm_fwd_mxfp8(x, ea, w_gu, w_d, tpi, b2e, B, emulate=emulate)
    ck = fwd.gate_up_proj_act_checkpoint_T
    cfg = MXFP8MOEBwdConfig()  # the default: single_expert_dense
    got = blockwise_mm_bwd_mxfp8(
        x, ea, w_gu, w_d, tpi, b2e, dy, B, gate_up_proj_act_checkpoint_T=ck, config=cfg,
        num_valid_tokens=torch.tensor([nv], dtype=torch.int32), emulate=emulate,
    )  # fmt: skip
    n = min(nv, T)
    keep = (torch.arange(T) < n)[:, None]
    want = blockwise_mm_bwd_mxfp8(
        x * keep, ea * keep, w_gu, w_d, tpi, b2e, dy * keep, B,
        gate_up_proj_act_checkpoint_T=ck, config=cfg, emulate=emulate,
    )  # fmt: skip
    for gt, wt in zip(got, want, strict=True):
        assert torch.equal(gt, wt)
    assert torch.all(got[0][n:] == 0) and torch.all(got[1][n:] == 0)
    if n == 0:
        assert torch.all(got[2] == 0) and torch.all(got[3] == 0)
    else:
        assert got[3].abs().max() > 0


def test_num_valid_tokens_rules():
    x, ea, w_gu, w_d, tpi, b2e, dy = (
        t.bfloat16() if t.is_floating_point() else t for t in dense_case()
    )
    fwd = blockwise_mm_fwd_mxfp8(x, ea, w_gu, w_d, tpi, b2e, 128)
    args = (x, ea, w_gu, w_d, tpi, b2e, dy, 128)
    ck = {"gate_up_proj_act_checkpoint_T": fwd.gate_up_proj_act_checkpoint_T}
    nv = torch.tensor([5], dtype=torch.int32)
    with pytest.raises(
        BwdValidationError, match="num_valid_tokens: requires config.single_expert_dense"
    ):
        blockwise_mm_bwd_mxfp8(*args, **ck, config=MXFP8MOEBwdConfig.routed(1), num_valid_tokens=nv)
    with pytest.raises(
        BwdValidationError, match="num_valid_tokens: unsupported with scaled_intermediate"
    ):
        blockwise_mm_bwd_mxfp8(
            *args, **ck, scaled_intermediate_checkpoint_T=fwd.scaled_intermediate_checkpoint_T,
            num_valid_tokens=nv,
        )  # fmt: skip
    with pytest.raises(BwdValidationError, match=r"num_valid_tokens: expected shape \(1,\)"):
        blockwise_mm_bwd_mxfp8(*args, **ck, num_valid_tokens=torch.tensor([1, 2]))
    with pytest.raises(BwdValidationError, match="num_valid_tokens: expected an integer dtype"):
        blockwise_mm_bwd_mxfp8(*args, **ck, num_valid_tokens=torch.tensor([1.0]))
    # bias gradients are impossible on the dense path, hence with a count (config rejects)
    with pytest.raises(BwdValidationError, match="bias: single_expert_dense requires False"):
        MXFP8MOEBwdConfig(bias=True)


def test_routed_bookkeeping_example_12_2():
    """Spec §12.2 (plan §3.3 case 1, blocks widened to 128): dEA lands at flat indices
    1·2+0, 2·2+0 (block 0) and 0·2+1, 3·2+1 (block 1); indices 0, 3, 5, 6 stay 0."""
    T, H, I, E, B = 4, 128, 128, 2, 128
    g = torch.Generator().manual_seed(11)
    choices = torch.tensor([[1], [0], [0], [1]])
    tpi, b2e = build_block_plan(choices, E, B)
    assert b2e.view(-1).tolist() == [0, 1]
    assert tpi.view(-1, B)[:, :2].tolist() == [[1, 2], [0, 3]]
    aff = build_expert_affinities_masked(torch.rand(T, E, generator=g) + 0.1, choices)
    x = torch.randn(T, H, generator=g)
    w_gu = torch.randn(E, H, 2, I, generator=g) * 0.1
    w_d = torch.randn(E, I, H, generator=g) * 0.1
    dy = torch.randn(T, H, generator=g)
    fwd = blockwise_mm_fwd_mxfp8(x, aff, w_gu, w_d, tpi, b2e, B, emulate="exact")
    dx, dea, dwgu, dwd = blockwise_mm_bwd_mxfp8(
        x, aff, w_gu, w_d, tpi, b2e, dy, B,
        gate_up_proj_act_checkpoint_T=fwd.gate_up_proj_act_checkpoint_T,
        config=MXFP8MOEBwdConfig.routed(1), emulate="exact",
    )  # fmt: skip
    nonzero = (dea.view(-1) != 0).nonzero().view(-1).tolist()
    assert nonzero == [1, 2, 4, 7]
    # dW_gu[0] only from block 0 (tokens 1, 2), dW_d[1] from block 1 (tokens 0, 3)
    dgu_like = dwgu[0].reshape(H, 2 * I)
    assert torch.linalg.matrix_rank(dgu_like).item() <= 2


def test_odd_expert_count_zeroes_all_unrouted_affinity_grads():
    """Errata 6: the device leaves part of dEA un-zeroed for odd E > 1; the reference zeros it."""
    c = make_case(T=64, E=3, K=1, seed=12)
    _, want = oracle_grads(c)
    _, got = run_exact(c)
    assert torch.all(got[1].view(c.routed.shape)[~c.routed] == 0)
    assert max_rel_err(got[1], want[1]) <= 1e-5
