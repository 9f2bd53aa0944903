"""Exact ties in the router's top-K (issue 18 item 2): tokens whose logits tie exactly, such as
padding (an all-zero token), a row of -0, or any token under all-zero router weights.

The hardware's ``max8`` returns equal values repeatedly and ``nc_find_index8`` gives the k-th of
equal values the k-th occurrence in the row (api spec §8.13, §8.14), so a tie selects K distinct
experts in ascending index order. The reference (torch path and numba path), the NKI kernel on
the interpreter and ``verify --inputs`` must agree on these rows bit for bit: indices, and the
affinity bits (here worked out by hand: every tied logit is 0, so sigmoid 0.5, softmax 1/K).
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from mxcli.kernels.launcher import run_sim as _run_sim
from mxcli.kernels.rmsnorm_mx_prefill import (
    RouterActFnType,
    arrange_router_weights,
    rmsnorm_mx_prefill,
)

A = RouterActFnType
T, H, E = 4, 512, 16
run_sim = functools.partial(_run_sim, rmsnorm_mx_prefill.__name__)
NOAUX_KW = dict(n_group=4, topk_group=2, routed_scaling_factor=2.5)


def _case(act: RouterActFnType, K: int, zero_weights: bool = False) -> tuple[list, dict[str, Any]]:
    """Token 0 ordinary, token 1 all zero (padding), token 2 all -0, token 3 ordinary."""
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(1, T, H, generator=g) * 0.5).to(torch.bfloat16)
    x[0, 1] = 0.0
    x[0, 2] = -0.0
    gamma = (torch.randn(H, generator=g) * 0.2 + 1).to(torch.bfloat16)
    w = (torch.randn(H, E, generator=g) * 0.1).to(torch.bfloat16)
    if zero_weights:
        w.zero_()
    kw: dict[str, Any] = dict(
        router_weights=arrange_router_weights(w, act), top_k=K, router_act_fn=act, eps=1e-6
    )
    if act is A.NOAUX_TC:
        kw.update(NOAUX_KW, router_bias=torch.zeros(E, dtype=torch.bfloat16))
    return [x, gamma], kw


def _bits(t: torch.Tensor) -> list[int]:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32).tolist()


@pytest.mark.parametrize("act", [A.SIGMOID, A.SOFTMAX])
def test_tie_rows_topk_reference_paths_and_sim(act: RouterActFnType, monkeypatch) -> None:
    K = 4
    args, kw = _case(act, K)
    outs = {}
    for fused in ("1", "0"):
        monkeypatch.setenv("MXCLI_FUSED", fused)
        outs[fused] = rmsnorm_mx_prefill(*args, **kw)
    outs["sim"] = run_sim(*args, **kw, engine="mxcli.nkisim")
    s = torch.tensor(0.5 if act is A.SIGMOID else 1 / K, dtype=torch.bfloat16)  # sigmoid(0), 1/K
    for name, (packed, idx, aff) in outs.items():
        for t in (1, 2):  # padding and -0 tokens: all logits exactly 0
            assert idx[t].tolist() == [0, 1, 2, 3], name
            assert _bits(aff[t]) == _bits(
                torch.cat([s.repeat(K), torch.zeros(E - K, dtype=s.dtype)])
            )
            code = 0x80 if t == 2 else 0x00  # E4M3 codes of +0 / -0
            assert packed.view(torch.uint8)[t, :H].tolist() == [code] * H, name
    ref, sim = outs["1"], outs["sim"]
    assert torch.equal(outs["0"][1], ref[1]) and torch.equal(sim[1], ref[1])
    assert _bits(outs["0"][2]) == _bits(ref[2])
    assert _bits(sim[2][1:3]) == _bits(ref[2][1:3])  # tie rows bit for bit


def test_tie_rows_noaux_groups_reference_paths_and_sim(monkeypatch) -> None:
    """NOAUX_TC with a zero bias: every score is sigmoid(0) = 0.5, every group score 1.0, so the
    first two groups are kept (group tie) and experts 0..3 selected: 2.5 * 0.5 / 2.0 = 0.625."""
    K = 4
    args, kw = _case(A.NOAUX_TC, K)
    outs = {}
    for fused in ("1", "0"):
        monkeypatch.setenv("MXCLI_FUSED", fused)
        outs[fused] = rmsnorm_mx_prefill(*args, **kw)
    outs["sim"] = run_sim(*args, **kw, engine="mxcli.nkisim")
    expect = torch.zeros(E)
    expect[:K] = 0.625
    for name, (_, aff) in outs.items():
        for t in (1, 2):
            assert _bits(aff[t]) == _bits(expect), name
    assert _bits(outs["0"][1]) == _bits(outs["1"][1])
    assert _bits(outs["sim"][1][1:3]) == _bits(outs["1"][1][1:3])


@pytest.mark.parametrize("act", [A.SOFTMAX, A.NOAUX_TC])
def test_zero_router_weights_tie_every_token(act: RouterActFnType, monkeypatch) -> None:
    """All-zero router weights: every token's logits tie (0, or sigmoid 0.5 for NOAUX_TC)."""
    args, kw = _case(act, 2, zero_weights=True)
    outs = []
    for fused in ("1", "0"):
        monkeypatch.setenv("MXCLI_FUSED", fused)
        outs.append(rmsnorm_mx_prefill(*args, **kw))
    outs.append(run_sim(*args, **kw, engine="mxcli.nkisim"))
    expect = torch.zeros(T, E)
    expect[:, :2] = 0.5 if act is A.SOFTMAX else 1.25  # softmax 1/2; 2.5 * 0.5 / 1.0
    for o in outs:
        aff = o[-1]
        assert _bits(aff) == _bits(expect.to(aff.dtype))
        if act is A.SOFTMAX:
            assert o[1].tolist() == [[0, 1]] * T
