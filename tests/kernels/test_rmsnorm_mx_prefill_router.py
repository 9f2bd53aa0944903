"""rmsnorm_mx_prefill router (spec §5): worked values through the full kernel path with exactly
crafted logits, first-occurrence ties, NOAUX_TC, packed affinities, and the vectorized router
functions against plainly written per-token loops."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mxcli.kernels.rmsnorm_mx_prefill import (
    LogitAccumulation,
    RouterActFnType,
    arrange_router_weights,
    decode_packed_rows,
    rmsnorm_mx_prefill,
    rmsnorm_mx_prefill_reference,
)
from mxcli.kernels.rmsnorm_mx_prefill.router import (
    hardware_topk,
    noaux_tc_affinities,
    topk_affinities,
)
from tests.kernels import _prefill_oracle as O

SIG, SOFT, NOAUX = RouterActFnType.SIGMOID, RouterActFnType.SOFTMAX, RouterActFnType.NOAUX_TC
H = 512


def _exact_logit_call(logits, act, top_k, x_value=1.0, bias=None, wdtype=torch.bfloat16, **kw):
    """Run the kernel on one token whose router logits equal fp32(`logits`) exactly.

    x = x_value (a power of two) everywhere, gamma = 1, eps = 0: a = x_value and
    inv_rms = 1/x_value exactly; rows 0..2 of the natural weight hold a 3-way bf16 split of the
    logit (whose fp32 sum is exact), so raw * inv_rms = x_value * logit / x_value = logit.
    """
    E = len(logits)
    w = torch.zeros(H, E)
    for e, v in enumerate(logits):
        w[:3, e] = torch.tensor(O.split3_bf16(v))
    x = torch.full((1, 1, H), x_value, dtype=torch.bfloat16)
    return rmsnorm_mx_prefill(
        x,
        torch.ones(H, dtype=torch.bfloat16),
        arrange_router_weights(w.to(wdtype), act),
        bias,
        0.0,
        top_k,
        act,
        **kw,
    )


# ----------------------------------------------------------------------------- §5.2 values


def test_softmax_worked_example():
    out = _exact_logit_call([2.0, 1.0], SOFT, 2)
    assert out[1].tolist() == [[0, 1]]
    assert out[2].dtype == torch.bfloat16
    assert out[2].float().tolist() == [[0.73046875, 0.26953125]]


def test_sigmoid_worked_example_no_renormalisation():
    out = _exact_logit_call([0.3, -1.2, -5.0], SIG, 2)
    assert out[1].tolist() == [[0, 1]]
    assert out[2].float().tolist() == [[0.57421875, 0.2314453125, 0.0]]


def test_softmax_k1_gives_one():
    out = _exact_logit_call([0.1, 0.7, -0.4, 0.2], SOFT, 1)
    assert out[1].tolist() == [[1]] and out[2].float().tolist() == [[0.0, 1.0, 0.0, 0.0]]


def test_bias_added_after_inv_rms_scale():
    # x = 2 -> inv_rms = 0.5 exactly; raw = 2 * logit; logit = raw * inv + bias (§5.1)
    logits, bias = [0.25, -1.0], torch.tensor([0.5, 3.0], dtype=torch.float16)
    out = _exact_logit_call(logits, SIG, 1, x_value=2.0, bias=bias)
    assert out[1].tolist() == [[1]]  # -1.0 + 3.0 = 2.0 beats 0.25 + 0.5
    expect = torch.sigmoid(torch.tensor(2.0)).to(torch.bfloat16)
    assert out[2][0, 1] == expect and out[2][0, 0] == 0


def test_exact_tie_takes_successive_occurrences():
    """api spec §8.14: max8 returns (3, 3, 1); nc_find_index8 gives the first 3 the first
    occurrence (1) and the second 3 the second (2): distinct experts, lower index first."""
    out = _exact_logit_call([1.0, 3.0, 3.0, 0.5], SIG, 3)
    assert out[1].tolist() == [[1, 2, 0]]
    s3 = torch.sigmoid(torch.tensor(3.0)).to(torch.bfloat16)
    s1 = torch.sigmoid(torch.tensor(1.0)).to(torch.bfloat16)
    assert out[2][0].tolist() == [s1.item(), s3.item(), s3.item(), 0.0]
    soft = _exact_logit_call([1.0, 3.0, 3.0, 0.5], SOFT, 2)
    assert soft[1].tolist() == [[1, 2]] and soft[2][0].float().tolist() == [0.0, 0.5, 0.5, 0.0]
    # a tie across the K boundary: the lower index wins the last slot
    soft = _exact_logit_call([2.0, 1.0, 0.0, 1.0, 1.0], SOFT, 2)
    assert soft[1].tolist() == [[0, 1]]
    # rows shorter than 8: the -FLT_MAX pads are equal too, and take successive pad columns
    vals, idx = hardware_topk(torch.tensor([[0.5, 0.25], [0.0, -0.0]]), 4)
    assert idx.tolist() == [[0, 1, 2, 3], [0, 1, 2, 3]]  # -0 == +0 in the fp32 compare
    assert vals[0].tolist() == [0.5, 0.25, -3.4028234663852886e38, -3.4028234663852886e38]


def test_fp16_router_sets_compute_dtype():
    """cd = router dtype (§1): with an fp16 router the quant chain rounds to fp16."""
    T = 24
    g = torch.Generator().manual_seed(21)
    x = (torch.randn(1, T, H, generator=g) * 0.5).to(torch.bfloat16)
    gamma = (torch.randn(H, generator=g) * 0.2 + 1).to(torch.bfloat16)
    w = (torch.randn(H, 8, generator=g) * 0.1).to(torch.float16)
    out = rmsnorm_mx_prefill(x, gamma, arrange_router_weights(w, SOFT), None, 1e-6, 2, SOFT)
    x32, g32 = O.to_np32(x[0]), O.to_np32(gamma)
    inv64 = O.inv_rms_f64(x32, H, 1e-6)
    amb = O.ambiguous_tokens(inv64, np.float16) | O.ambiguous_tokens(inv64, O.BF16)
    for cd, same in ((np.float16, True), (O.BF16, False)):
        _, y = O.faithful_chain(x32, g32, inv64.astype(np.float32), cd)
        codes, _ = O.mx_encode(y)
        got = out[0].view(torch.uint8).numpy()[:, :H]
        assert np.array_equal(got[~amb], codes[~amb]) is same


# ----------------------------------------------------------------------------- §5.3 NOAUX_TC

TOY_LOGITS = [0.5, -0.2, 1.0, 0.1, -0.3, 0.4, 0.0, 0.2]
TOY_BIAS = [0.0, 0.3, -0.5, 0.0, 0.2, 0.0, 0.1, 0.0]
TOY_KW = dict(n_group=4, topk_group=2, routed_scaling_factor=2.5)


def test_noaux_toy_example_router_function():
    aff = noaux_tc_affinities(torch.tensor([TOY_LOGITS]), torch.tensor(TOY_BIAS), 4, 2, 2, 2.5)
    expect = torch.zeros(1, 8)
    expect[0, 1], expect[0, 4] = 1.285126, 1.214874
    assert torch.allclose(aff, expect, atol=1e-6, rtol=0)
    assert (aff[0, [0, 2, 3, 5, 6, 7]] == 0).all()


@pytest.mark.parametrize("pack", [False, True])
def test_noaux_toy_example_full_kernel(pack):
    bias = torch.tensor([TOY_BIAS])  # fp32 [1, E]
    out = _exact_logit_call(TOY_LOGITS, NOAUX, 2, bias=bias, pack_affinities=pack, **TOY_KW)
    if pack:
        assert len(out) == 1 and out[0].shape == (1, 640 + 32)  # H + 128 + 8 fp32
        aff = decode_packed_rows(out[0], H, num_experts=8, router_act_fn=NOAUX).affinities
        assert aff is not None and aff.dtype == torch.float32
        assert torch.equal(out[0].view(torch.float32)[:, 160:], aff)  # fp32 column affin_off/4
    else:
        assert len(out) == 2 and out[1].dtype == torch.float32
        aff = out[1]
    assert abs(aff[0, 1].item() - 1.285126) < 1e-6 and abs(aff[0, 4].item() - 1.214874) < 1e-6
    assert aff[0].count_nonzero() == 2


def test_noaux_upstream_double_bias_switch():
    lg, b = torch.tensor([TOY_LOGITS]), torch.tensor(TOY_BIAS)
    a = noaux_tc_affinities(lg, b, 4, 2, 2, 2.5)
    u = noaux_tc_affinities(lg, b, 4, 2, 2, 2.5, emulate_upstream_ref_bias_bug=True)
    score = torch.sigmoid(lg + b).numpy()
    expect = O.noaux_loop(lg.numpy(), b.numpy(), score, 4, 2, 2, 2.5)
    assert not torch.equal(a, u) and np.array_equal(u.numpy(), expect)
    # through the kernel: the switch is a keyword of the reference backend
    gen = torch.Generator().manual_seed(12)
    w = arrange_router_weights((torch.randn(H, 8, generator=gen) * 0.1).to(torch.bfloat16), NOAUX)
    x = torch.randn(1, 3, H, generator=gen).to(torch.bfloat16)
    args = (x, torch.ones(H), w, b, 1e-6, 2, NOAUX, 4, 2, 2.5)
    r0 = rmsnorm_mx_prefill_reference(*args)
    r1 = rmsnorm_mx_prefill_reference(*args, emulate_upstream_ref_bias_bug=True)
    assert torch.equal(r0[0].view(torch.uint8), r1[0].view(torch.uint8)) and not torch.equal(
        r0[1], r1[1]
    )


# ----------------------------------------------------------------------------- vs plain loops


def _tied_logits(T, E, seed):
    g = torch.Generator().manual_seed(seed)
    # few distinct values -> many exact ties
    return (torch.randint(-6, 7, (T, E), generator=g).float() / 4) + torch.where(
        torch.rand(T, E, generator=g) < 0.5, 0.0, torch.randn(T, E, generator=g) * 1e-3
    )


@pytest.mark.parametrize("E", [5, 8, 64])
def test_hardware_topk_vs_loop(E):
    x = _tied_logits(200, E, E)
    for k in (1, 3, min(E, 8)):
        vals, idx = hardware_topk(x, k)
        for t in range(x.shape[0]):
            assert idx[t].tolist() == O.hardware_topk_loop(x[t].tolist(), k, -3.4028234663852886e38)
        assert torch.equal(vals, torch.topk(x, k).values)


@pytest.mark.parametrize("act", [SIG, SOFT])
def test_topk_affinities_vs_loop(act):
    T, E, K = 120, 12, 4
    lg = _tied_logits(T, E, 3)
    idx, aff = topk_affinities(lg, K, act)
    for t in range(T):
        sel = O.hardware_topk_loop(lg[t].tolist(), K, -3.4028234663852886e38)
        assert idx[t].tolist() == sel
        v = lg[t, sel]
        if act is SIG:
            s = torch.sigmoid(v)
        else:
            e = torch.exp(v - v[0])
            tot = torch.zeros((), dtype=torch.float32)
            for j in range(K):
                tot = tot + e[j]
            s = e * (1.0 / tot)
        row = torch.zeros(E, dtype=torch.bfloat16)
        for j in range(K):
            row[sel[j]] = (row[sel[j]].float() + s[j].to(torch.bfloat16).float()).to(torch.bfloat16)
        assert torch.equal(aff[t], row), t


@pytest.mark.parametrize(
    "E,G,TG,K,rsf",
    [
        (8, 4, 2, 2, 2.5),
        (32, 4, 2, 2, 2.5),
        (8, 8, 3, 4, 1.0),
        (64, 8, 4, 8, 2.5),
        (24, 2, 1, 8, 1.5),
        (16, 1, 1, 3, 1.0),
    ],
)
def test_noaux_vs_loop(E, G, TG, K, rsf):
    T = 60
    lg = _tied_logits(T, E, E + G)
    bias = torch.randint(-2, 3, (E,), generator=torch.Generator().manual_seed(1)).float() / 8
    aff = noaux_tc_affinities(lg, bias, G, TG, K, rsf)
    expect = O.noaux_loop(lg.numpy(), bias.numpy(), torch.sigmoid(lg).numpy(), G, TG, K, rsf)
    assert np.array_equal(aff.numpy(), expect)


def test_noaux_sentinel_and_group_tie():
    """Errata 4: scores within the fp32 ulp of 30000 tie after the -30000 shift; a tie between
    two group scores selects the lower group index."""
    E, G = 8, 2
    # both groups identical -> equal group scores -> TG=1 keeps group 0 (first occurrence)
    lg = torch.tensor([[0.5, 0.1, -0.2, 0.3, 0.5, 0.1, -0.2, 0.3]])
    aff = noaux_tc_affinities(lg, torch.zeros(E), G, 1, 2, 1.0)
    assert aff[0, :4].count_nonzero() == 2 and aff[0, 4:].count_nonzero() == 0
    # K larger than the kept experts: masked experts are selected with their pre-bias scores
    aff = noaux_tc_affinities(lg, torch.zeros(E), G, 1, 6, 1.0)
    assert aff[0].count_nonzero() == 6
    expect = O.noaux_loop(
        lg.numpy(), np.zeros(E, np.float32), torch.sigmoid(lg).numpy(), G, 1, 6, 1.0
    )
    assert np.array_equal(aff.numpy(), expect)


# ----------------------------------------------------------------------------- packing, accumulation


@pytest.mark.parametrize("act,E", [(SOFT, 17), (SIG, 16), (NOAUX, 32)])
def test_packed_affinities_equal_unpacked(act, E):
    T = 40
    g = torch.Generator().manual_seed(E)
    x = (torch.randn(1, T, 1024, generator=g) * 0.5).to(torch.bfloat16)
    gamma = (torch.randn(1024, generator=g) * 0.2 + 1).to(torch.bfloat16)
    w = arrange_router_weights((torch.randn(1024, E, generator=g) * 0.1).to(torch.bfloat16), act)
    bias = torch.randn(E, generator=g) * 0.1
    args = (x, gamma, w, bias, 1e-6, 4, act, 4, 2, 2.5)
    plain = rmsnorm_mx_prefill(*args)
    packed = rmsnorm_mx_prefill(*args, pack_affinities=True)
    dec = decode_packed_rows(packed[0], 1024, num_experts=E, router_act_fn=act)
    aff_plain = plain[1] if act is NOAUX else plain[2]
    assert torch.equal(dec.affinities, aff_plain)
    raw = packed[0].view(torch.uint8)
    assert torch.equal(raw[:, :1152], plain[0].view(torch.uint8))  # hidden + scales unchanged
    if act is not NOAUX:
        assert torch.equal(packed[1], plain[1])
        assert raw.shape[1] == -(-(1152 + 2 * E) // 4) * 4
        assert not raw[:, 1152 + 2 * E :].any()  # row pad is zero


def test_psum_chain_accumulation():
    T, E = 50, 16
    g = torch.Generator().manual_seed(8)
    x = (torch.randn(1, T, 1024, generator=g) * 0.5).to(torch.bfloat16)
    w = arrange_router_weights((torch.randn(1024, E, generator=g) * 0.1).to(torch.bfloat16), SOFT)
    args = (x, torch.ones(1024), w, None, 1e-6, 4, SOFT)
    flat = rmsnorm_mx_prefill_reference(*args)
    chain = rmsnorm_mx_prefill_reference(*args, logit_accumulation=LogitAccumulation.PSUM_CHAIN)
    assert torch.equal(flat[0].view(torch.uint8), chain[0].view(torch.uint8))
    assert (flat[1] == chain[1]).float().mean() > 0.98
    assert torch.allclose(flat[2].float(), chain[2].float(), atol=2**-7)
    # exact logits make both orders agree bit for bit
    a = _exact_logit_call([0.3, 1.5, -0.25, 0.75], SOFT, 3)
    w2 = torch.zeros(H, 4)
    for e, v in enumerate([0.3, 1.5, -0.25, 0.75]):
        w2[:3, e] = torch.tensor(O.split3_bf16(v))
    b = rmsnorm_mx_prefill_reference(
        torch.ones(1, 1, H, dtype=torch.bfloat16),
        torch.ones(H),
        arrange_router_weights(w2.bfloat16(), SOFT),
        None,
        0.0,
        3,
        SOFT,
        logit_accumulation="psum_chain",
    )
    assert torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])
