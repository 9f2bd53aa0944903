"""The emulated experts layer against the kernels' references and torch autograd."""

from __future__ import annotations

import pytest
import torch

from mxcli.emulate import MxExperts, experts_forward
from mxcli.kernels.blockwise_moe import (
    MXFP8MOEBwdConfig,
    blockwise_mm_bwd_mxfp8,
    blockwise_mm_fwd_mxfp8,
    build_block_plan,
)
from mxcli.kernels.blockwise_moe.numerics import mx_rule
from mxcli.mx import ScaleRule

T, H, I, E, K = 96, 128, 128, 4, 2  # noqa: E741


def _inputs(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).bfloat16().float()
    logits = torch.randn(T, E, generator=g)
    w, idx = torch.softmax(logits, -1).topk(K, -1)
    gu = (torch.randn(E, 2 * I, H, generator=g) * 0.05).bfloat16().float()
    dn = (torch.randn(E, H, I, generator=g) * 0.05).bfloat16().float()
    dy = torch.randn(T, H, generator=g).bfloat16().float()
    return dict(x=x, idx=idx, w=w / w.sum(-1, keepdim=True), gu=gu, dn=dn, dy=dy)


def _layer_grads(d: dict[str, torch.Tensor], mode: str) -> tuple[torch.Tensor, ...]:
    x = d["x"].clone().requires_grad_()
    w = d["w"].clone().requires_grad_()
    gu = d["gu"].clone().requires_grad_()
    dn = d["dn"].clone().requires_grad_()
    y = experts_forward(x, d["idx"], w, gu, dn, mode)
    y.backward(d["dy"])
    assert x.grad is not None and w.grad is not None and gu.grad is not None
    assert dn.grad is not None
    return y.detach(), x.grad, w.grad, gu.grad, dn.grad


@pytest.mark.parametrize("mode", ["neuron", "ocp"])
def test_grads_equal_backward_reference_bit_for_bit(mode: str) -> None:
    d = _inputs()
    y, dx, dw, dgu, ddn = _layer_grads(d, mode)
    # The kernels called directly, in their own layouts, on the same inputs.
    xb = d["x"].bfloat16()
    wgu = d["gu"].bfloat16().view(E, 2, I, H).permute(0, 3, 1, 2).contiguous()
    wd = d["dn"].bfloat16().transpose(1, 2).contiguous()
    ea = torch.zeros(T, E).scatter_(1, d["idx"], d["w"]).reshape(T * E, 1)
    tpi, b2e = build_block_plan(d["idx"], E, 128)
    rule = ScaleRule.NEURON if mode == "neuron" else ScaleRule.OCP
    with mx_rule(rule):
        fwd = blockwise_mm_fwd_mxfp8(xb, ea, wgu, wd, tpi, b2e, 128)
        dxr, dear, dwgur, dwdr = blockwise_mm_bwd_mxfp8(
            xb, ea, wgu, wd, tpi, b2e, d["dy"].bfloat16(), 128, *fwd[1:],
            config=MXFP8MOEBwdConfig.routed(K),
        )  # fmt: skip
    assert torch.equal(y, fwd.output.float())
    assert torch.equal(dx, dxr.float())
    assert torch.equal(dw, dear.float().reshape(T, E).gather(1, d["idx"]))
    assert torch.equal(dgu, dwgur.float().permute(0, 2, 3, 1).reshape(E, 2 * I, H))
    assert torch.equal(ddn, dwdr.float().transpose(1, 2))


def test_scale_rules_differ() -> None:
    """NEURON and OCP give different gradients (the switch reaches the kernels), and both
    differ from the unquantized bf16 chain."""
    d = _inputs(1)
    neu, ocp, bf = (_layer_grads(d, m) for m in ("neuron", "ocp", "bf16"))
    for a, b in ((neu, ocp), (neu, bf), (ocp, bf)):
        assert not torch.equal(a[3], b[3])


def _plain(x, idx, w, gu, dn):  # type: ignore[no-untyped-def]
    """The Hugging Face experts math (Qwen3MoeExperts.forward), dense over experts."""
    out = torch.zeros_like(x)
    for e in range(E):
        tok, k = (idx == e).nonzero(as_tuple=True)
        g, u = torch.nn.functional.linear(x[tok], gu[e]).chunk(2, -1)
        h = torch.nn.functional.linear(torch.nn.functional.silu(g) * u, dn[e])
        out = out.index_add(0, tok, h * w[tok, k, None])
    return out


def test_exact_mode_matches_autograd_of_plain_layer() -> None:
    d = _inputs(2)
    got = _layer_grads(d, "exact")
    x = d["x"].clone().requires_grad_()
    w = d["w"].clone().requires_grad_()
    gu = d["gu"].clone().requires_grad_()
    dn = d["dn"].clone().requires_grad_()
    y = _plain(x, d["idx"], w, gu, dn)
    y.backward(d["dy"])
    # fp32 on both sides with no rounding point; only the fp32 summation order differs
    # (blocked matmuls vs per-expert linears), hence a tolerance of a few fp32 ulps.
    for a, b in zip(got, (y.detach(), x.grad, w.grad, gu.grad, dn.grad), strict=True):
        assert b is not None
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_bf16_mode_close_to_plain_layer() -> None:
    """The bf16 chain differs from fp32 autograd only by its bf16 rounding points (relative
    error of a few bf16 ulps, 2^-8), not by MX quantization (NEURON is ~10x further off)."""
    d = _inputs(3)
    ref = _layer_grads(d, "exact")
    bf = _layer_grads(d, "bf16")
    neu = _layer_grads(d, "neuron")

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).norm() / b.norm())

    for i in (0, 1, 3, 4):
        assert rel(bf[i], ref[i]) < 2**-7
        assert rel(neu[i], ref[i]) > 3 * rel(bf[i], ref[i])


def test_module_holds_the_same_parameters() -> None:
    gu = torch.nn.Parameter(torch.zeros(E, 2 * I, H))
    dn = torch.nn.Parameter(torch.zeros(E, H, I))
    m = MxExperts(gu, dn, "neuron")
    assert m.gate_up_proj is gu and m.down_proj is dn
    assert [p for p in m.parameters()] == [gu, dn]
