"""The fused prefill chain (mxcli.kernels.rmsnorm_mx_prefill._fused) gives the torch chain's bytes.

The reference runs once with the numba kernels and once with ``MXCLI_FUSED=0`` (pure torch); every
output is compared bit for bit (NaNs by their bit patterns). Inputs mix ordinary values with the
cases where a rounding or a special value decides a byte: bf16 ties of ``x*gamma``, subnormals,
rows whose sum of squares overflows, ±Inf, NaN of both signs, all-zero groups.
"""

from __future__ import annotations

import pytest
import torch

from mxcli.kernels.rmsnorm_mx_prefill import (
    RouterActFnType,
    arrange_router_weights,
    rmsnorm_mx_prefill_reference,
)
from mxcli.mx import ScaleRule

pytest.importorskip("numba")


def _hidden(T: int, H: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g) * torch.exp2(torch.randint(-20, 8, (T, 1), generator=g))
    x = x.to(torch.bfloat16)
    bits = torch.randint(-32768, 32768, (H,), generator=g, dtype=torch.int32).to(torch.int16)
    x[0] = bits.view(torch.bfloat16)  # every kind of bf16 pattern: NaN, Inf, subnormal, ...
    x[1, :64] = 0.0  # all-zero groups
    x[2] = 2.0**100  # sum of squares overflows: inv_rms = 0
    x[3, 5] = float("-inf")
    x[4, 7] = -float("nan")
    x[5] = torch.tensor(2.0**-133).to(torch.bfloat16)  # bf16 subnormals
    return x.view(1, T, H)


def _run(monkeypatch: pytest.MonkeyPatch, fused: bool, *args, **kwargs):  # type: ignore[no-untyped-def]
    monkeypatch.setenv("MXCLI_FUSED", "1" if fused else "0")
    return rmsnorm_mx_prefill_reference(*args, **kwargs)


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for u, v in zip(a, b, strict=True):
        assert u.dtype == v.dtype and u.shape == v.shape
        assert torch.equal(u.contiguous().view(torch.uint8), v.contiguous().view(torch.uint8))


def test_fused_path_is_taken() -> None:
    # the comparisons below are only meaningful if the fused chain actually runs
    from mxcli.kernels.rmsnorm_mx_prefill import _fused
    from mxcli.kernels.rmsnorm_mx_prefill.contract import validate
    from mxcli.kernels.rmsnorm_mx_prefill.reference import _fused_chain

    x = torch.zeros(1, 4, 512, dtype=torch.bfloat16)
    cfg = validate(
        x,
        torch.ones(512, dtype=torch.bfloat16),
        None,
        None,
        1e-6,
        1,
        "sigmoid",
        1,
        1,
        1.0,
        "float8_e4m3fn_x4",
        True,
        False,
        None,
        None,
        False,
        False,
    )
    assert _fused_chain(cfg, x) is _fused
    assert _fused.bf16_nan_bits() in (0xFFFF, 0x7FC0)


@pytest.mark.parametrize(
    "case",
    [
        "no_router",
        "noaux_tc_packed",
        "sigmoid",
        "softmax_bias",
        "interleaved_residual_norm",
        "e5m2_unfolded",
        "ocp",
    ],
)
def test_fused_chain_same_bytes(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    T, H, E = 40, 1536, 64
    x = _hidden(T, H, seed=7)
    g = torch.Generator().manual_seed(8)
    gamma = (torch.randn(H, generator=g) * 0.5 + 1).to(torch.bfloat16)
    gamma[3] = 0.0
    gamma[9] = 2.0**60
    w_nat = (torch.randn(H, E, generator=g) * 0.05).to(torch.bfloat16)
    bias = torch.randn(E, generator=g) * 0.1
    kw: dict = {}
    args: tuple = (x, gamma)
    if case == "noaux_tc_packed":
        args = (x, gamma, arrange_router_weights(w_nat, RouterActFnType.NOAUX_TC), bias)
        kw = dict(
            top_k=4,
            router_act_fn="noaux_tc",
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            pack_affinities=True,
        )
    elif case == "sigmoid":
        args = (x, gamma, arrange_router_weights(w_nat, RouterActFnType.SIGMOID))
        kw = dict(top_k=2, router_act_fn="sigmoid")
    elif case == "softmax_bias":
        args = (x, gamma, arrange_router_weights(w_nat, RouterActFnType.SOFTMAX), bias)
        kw = dict(top_k=8, router_act_fn="softmax")
    elif case == "interleaved_residual_norm":
        res = _hidden(T, H, seed=9)
        kw = dict(residual=res, emit_norm_bf16=True, hidden_interleaved=True)
    elif case == "e5m2_unfolded":
        kw = dict(qmx_output_dtype="float8_e5m2_x4", pack_scales=False, unpadded_hidden_size=1500)
    elif case == "ocp":
        kw = dict(scale_rule=ScaleRule.OCP, token_chunk=16)
    fused = _run(monkeypatch, True, *args, **kw)
    plain = _run(monkeypatch, False, *args, **kw)
    _same(fused, plain)


@pytest.mark.parametrize(
    ("E", "n_group", "topk_group", "top_k"),
    [(256, 8, 4, 8), (64, 8, 3, 6), (16, 8, 2, 4), (8, 1, 1, 8), (32, 4, 4, 1), (16, 16, 5, 3)],
)
@pytest.mark.parametrize("bias_bug", [False, True])
def test_fused_noaux_tc_same_bytes(
    E: int,
    n_group: int,
    topk_group: int,
    top_k: int,
    bias_bug: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """NOAUX_TC routing, fused vs torch. Logits from a handful of values give exact ties in
    the scores, in the group scores and in the masked scores (successive occurrences: K
    distinct experts, lower index first); ±0, huge logits (sigmoid 0 or 1), tiny scores, and
    rows with NaN/±Inf (which the fused path hands to the torch path) are mixed in."""
    from mxcli.kernels.rmsnorm_mx_prefill.router import noaux_tc_affinities

    g = torch.Generator().manual_seed(E + n_group + top_k)
    T = 300
    levels = torch.tensor([-3.0, -0.5, -0.0, 0.0, 0.25, 0.25, 1.0, 4.0, 200.0, -200.0])
    pick = torch.randint(0, levels.numel(), (T, E), generator=g)
    logits = levels[pick]
    logits[: T // 3] = torch.randn(T // 3, E, generator=g)  # distinct values
    logits[T // 3 : T // 3 + 5] = 0.5  # a whole row tied
    logits[T // 3 + 5 : T // 3 + 8] = -87.0  # scores ~1.6e-38: the epsilon decides the weights
    logits[-1, 3] = float("nan")
    logits[-2, 0] = float("inf")
    logits[-3, E - 1] = float("-inf")
    bias = torch.randint(-2, 3, (E,), generator=g).float() * 0.125
    kw = dict(emulate_upstream_ref_bias_bug=bias_bug)
    args = (logits, bias, n_group, topk_group, top_k, 2.5)
    fused = _run_fn(monkeypatch, True, noaux_tc_affinities, *args, **kw)
    plain = _run_fn(monkeypatch, False, noaux_tc_affinities, *args, **kw)
    assert torch.equal(fused.view(torch.int32), plain.view(torch.int32))
    assert (plain[:-3] != 0).sum(dim=1).le(top_k).all()  # the comparison saw real selections


def _run_fn(monkeypatch: pytest.MonkeyPatch, fused: bool, fn, *args, **kwargs):  # type: ignore[no-untyped-def]
    monkeypatch.setenv("MXCLI_FUSED", "1" if fused else "0")
    return fn(*args, **kwargs)
