# ruff: noqa: E741  (spec notation: I is the per-rank intermediate size I_TP)
"""Zero padding to the kernels' multiples: conversion of non-multiple models, and exactness.

Sizes copy the released models' awkward remainders at tiny scale: gpt-oss has H = I = 2880
(2880 % 128 = 64, so H = 320 here), Qwen3-30B-A3B with --tp 4 has I_TP = 768/4 = 192.
"""

from __future__ import annotations

from pathlib import Path

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
from mxcli.weightprep.manifest import load_layer_tensors, load_manifest
from mxcli.weightprep.padding import (
    Padding,
    pad_bwd_inputs,
    pad_dims,
    pad_region_max_abs,
    unpad_bwd_outputs,
)
from mxcli.weightprep.plan import PrepOptions
from mxcli.weightprep.runner import prepare_weights
from mxcli.weightprep.synthetic import build_checkpoint
from tests.kernels.test_blockwise_bwd_exact import oracle_moe_forward
from tests.weightprep.reference import Source, restack


def test_padding_sizes() -> None:
    # gpt-oss-20b/120b (H = I = 2880), tp 1 and 4; Qwen3-30B-A3B (H 2048, I 768) with tp 4
    assert Padding.of(2880, 2880).to_dict() == {
        "hidden_size": 2880,
        "prefill_hidden_size": 3072,
        "backward_hidden_size": 2944,
        "intermediate_size_per_rank": 2880,
        "padded_intermediate_size_per_rank": 2944,
        "shared_intermediate_size_per_rank": None,
        "padded_shared_intermediate_size_per_rank": None,
    }
    assert Padding.of(2880, 720).padded_intermediate_size == 768
    q = Padding.of(2048, 192)
    assert (q.prefill_hidden_size, q.backward_hidden_size, q.padded_intermediate_size) == (
        2048,
        2048,
        256,
    )
    assert Padding.of(7168, 2048).any is False


@pytest.mark.parametrize(
    "family,kw,tp",
    [
        ("gpt_oss", {"hidden_size": 320, "intermediate_size": 320}, 1),  # MXFP4 source
        ("gpt_oss", {"hidden_size": 320, "intermediate_size": 320, "quantized": False}, 2),
        ("qwen3_moe", {"hidden_size": 256, "intermediate_size": 768, "num_experts": 4}, 4),
        ("qwen2_moe", {"hidden_size": 320, "intermediate_size": 192}, 2),  # shared expert 96/rank
    ],
)
def test_non_multiple_models_prepare_exactly(
    family: str, kw: dict, tp: int, tmp_path: Path
) -> None:
    ck = build_checkpoint(family, tmp_path / "src", num_layers=1, **kw)
    out = tmp_path / "out"
    prepare_weights(ck.path, out, PrepOptions(tp=tp, check=True))
    m = load_manifest(out)
    H, I = kw["hidden_size"], kw["intermediate_size"] // tp
    pad = m.padding()
    assert pad == Padding.of(H, I, pad.shared_intermediate_size)
    assert m.data["padding"] == pad.to_dict()
    Hb, Ip = pad.backward_hidden_size, pad.padded_intermediate_size
    assert Hb % 128 == 0 and Ip % 128 == 0 and (Hb, Ip) != (H, I)
    L = m.layers[0]
    assert m.layer(L)["prefill_kwargs"]["unpadded_hidden_size"] == H
    ref = restack(Source(ck.path), family, L)  # independent: [E, H, 2, I], [E, I, H] at full I
    for r in m.ranks:
        t = load_layer_tensors(m, L, r)
        gu, dn = t["gate_up_proj_weight"], t["down_proj_weight"]
        assert tuple(gu.shape) == (gu.shape[0], Hb, 2, Ip) and tuple(dn.shape[1:]) == (Ip, Hb)
        i0 = r * I
        assert torch.equal(gu[:, :H, :, :I], ref["gate_up"][:, :, :, i0 : i0 + I])
        assert torch.equal(dn[:, :I, :H], ref["down"][:, i0 : i0 + I, :])
        assert not gu[:, H:].any() and not gu[..., I:].any()
        assert not dn[:, I:].any() and not dn[..., H:].any()
        if "gate_up_proj_bias" in t:
            assert tuple(t["gate_up_proj_bias"].shape[1:]) == (2, Ip)
            assert not t["gate_up_proj_bias"][..., I:].any()
            assert tuple(t["down_proj_bias"].shape[1:]) == (Hb,)
            assert not t["down_proj_bias"][:, H:].any()
        if "shared_expert.down_proj_weight" in t:
            Is, Isp = pad.shared_intermediate_size, pad.padded_shared_intermediate_size
            assert Is is not None and Isp is not None and Isp % 128 == 0
            assert tuple(t["shared_expert.down_proj_weight"].shape) == (1, Isp, Hb)
            assert not t["shared_expert.down_proj_weight"][:, Is:].any()
        # --check re-read every output against the (padded) source: bf16 exact, router exact
        check = m.layer(L)["check"][str(r)]
        assert all(v["exact"] for k, v in check.items() if "_mxfp8" not in k), check
    assert any("zero-padded" in n for n in m.data["notes"])


# ---------------------------------------------------------------------------------------------
# The backward on padded tensors equals the unpadded math, bit for bit.
#
# Exact equality between two fp32 computations with different reduction lengths holds when no
# sum rounds. The data are chosen so: inputs, weights, affinities and output gradients are small
# dyadic numbers, and every gate pre-activation is 0 or 32, where sigmoid (0.5, and 1.0 once
# 1 + e^-32 rounds to 1 in fp32) and silu (0, 32) are exact. Every product and partial sum is
# then a dyadic rational far inside fp32's 24-bit range (the test asserts the bound), so any
# summation order gives the same bits, and the padded and unpadded computations must agree
# exactly. The pad rows and columns of every gradient must be exactly zero.
# ---------------------------------------------------------------------------------------------


def _dyadic_case(T: int, H: int, I: int, E: int, K: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def sparse(shape: tuple[int, ...], p: float, values: list[float]) -> torch.Tensor:
        v = torch.tensor(values)[torch.randint(len(values), shape, generator=g)]
        return v * (torch.rand(shape, generator=g) < p)

    x = sparse((T, H), 0.25, [1.0])
    x[:, 0] = 1.0  # an always-on input column carries the gate pre-activation
    w_gu = torch.zeros(E, H, 2, I)
    active = torch.rand(E, I, generator=g) < 0.75
    w_gu[:, 0, 0, :] = 32.0 * active  # gate = 32 (active column) or 0
    w_gu[:, :, 1, :] = sparse((E, H, I), 0.125, [-1.0, 1.0])
    w_d = sparse((E, I, H), 0.125, [-1.0, 1.0])
    choices = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    routed = torch.zeros(T, E, dtype=torch.bool).scatter_(1, choices, True)
    aff = sparse((T, E), 1.0, [0.25, 0.5, 0.75, 1.0]) * routed
    dy = sparse((T, H), 0.25, [-1.0, 1.0])
    return {"x": x, "w_gu": w_gu, "w_d": w_d, "choices": choices, "routed": routed, "aff": aff,
            "dy": dy}  # fmt: skip


def _partial_sum_bound(c: dict[str, torch.Tensor]) -> float:
    """An upper bound of |any partial sum| in the layer's forward and backward: the sums of
    absolute terms of the widest reductions (over H: g, u, D; over I: y, dA, dX; over T: dW),
    for every token and expert (a superset of the routed pairs), in float64."""
    d = torch.float64
    x, dy = c["x"].to(d).abs(), c["dy"].to(d).abs()
    worst = 0.0
    for e in range(c["w_gu"].shape[0]):
        wg, wu, wd = (c["w_gu"][e, :, 0].to(d), c["w_gu"][e, :, 1].to(d), c["w_d"][e].to(d))
        g, u = x @ wg.abs(), x @ wu.abs()  # [T, I]
        h = g * u  # |silu(g)| <= |g|
        D = dy @ wd.abs().T
        dG, dU = D * u, D * g  # affinities <= 1, silu' <= 1 at these points
        sums = [g, u, D, h @ wd.abs(), (D * h).sum(1), dG @ wg.abs().T + dU @ wu.abs().T]
        sums += [x.T @ dG, x.T @ dU, h.T @ dy]
        worst = max(worst, *(float(s.max()) for s in sums))
    return worst


def _oracle(c: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    leaves = [c[k].clone().requires_grad_(True) for k in ("x", "aff", "w_gu", "w_d")]
    out = oracle_moe_forward(leaves[0], leaves[1], c["routed"], leaves[2], leaves[3])
    (out * c["dy"]).sum().backward()
    assert all(t.grad is not None for t in leaves)
    return [leaves[0].grad, leaves[1].grad.reshape(-1, 1), leaves[2].grad, leaves[3].grad]  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "H,I", [(320, 192), (2880 // 9, 2880 // 9)]
)  # Qwen3-30B-A3B tp 4 I_TP; gpt-oss H = I remainder (2880 % 128 = 320 % 128 = 64)
def test_padded_backward_equals_unpadded_exactly(H: int, I: int) -> None:
    assert torch.sigmoid(torch.tensor(32.0)) == 1.0 and F.silu(torch.tensor(32.0)) == 32.0
    T, E, K, B = 96, 4, 2, 128
    c = _dyadic_case(T, H, I, E, K, seed=H + I)
    want = _oracle(c)
    assert _partial_sum_bound(c) < 2**21  # every term is a multiple of 1/8: sums are exact

    pad = Padding.of(H, I)
    Hb, Ip = pad.backward_hidden_size, pad.padded_intermediate_size
    assert (Hb, Ip) != (H, I)
    w_gu = pad_dims(c["w_gu"], {1: Hb, 3: Ip})  # what prep-weights writes (test above)
    w_d = pad_dims(c["w_d"], {1: Ip, 2: Hb})
    ea = build_expert_affinities_masked(c["aff"], c["choices"])
    tpi, b2e = build_block_plan(c["choices"], E, B)
    inp = pad_bwd_inputs({"hidden_states": c["x"], "output_hidden_states_grad": c["dy"]}, pad)
    assert tuple(inp["hidden_states"].shape) == (T, Hb)
    fwd = blockwise_mm_fwd_mxfp8(inp["hidden_states"], ea, w_gu, w_d, tpi, b2e, B, emulate="exact")
    grads = blockwise_mm_bwd_mxfp8(
        inp["hidden_states"], ea, w_gu, w_d, tpi, b2e, inp["output_hidden_states_grad"], B,
        gate_up_proj_act_checkpoint_T=fwd.gate_up_proj_act_checkpoint_T,
        config=MXFP8MOEBwdConfig.routed(K), emulate="exact",
    )  # fmt: skip
    names = [
        "hidden_states_grad",
        "expert_affinities_masked_grad",
        "gate_up_proj_weight_grad",
        "down_proj_weight_grad",
    ]
    padded = dict(zip(names, grads, strict=True))
    assert tuple(padded["gate_up_proj_weight_grad"].shape) == (E, Hb, 2, Ip)
    # the pad rows and columns of every gradient are zero
    assert pad_region_max_abs(padded, pad) == {
        "hidden_states_grad": 0.0,
        "gate_up_proj_weight_grad": 0.0,
        "down_proj_weight_grad": 0.0,
    }
    assert not padded["hidden_states_grad"][:, H:].any()
    assert not padded["gate_up_proj_weight_grad"][:, H:].any()
    assert not padded["gate_up_proj_weight_grad"][..., I:].any()
    assert not padded["down_proj_weight_grad"][:, I:].any()
    assert not padded["down_proj_weight_grad"][..., H:].any()
    # the un-padded gradients equal the unpadded computation exactly
    got = unpad_bwd_outputs(padded, pad)
    for name, w in zip(names, want, strict=True):
        assert got[name].shape == w.shape, name
        assert torch.equal(got[name], w), name
        assert float(w.abs().max()) > 0, name  # not vacuous
    # the data exercise both gate values and real cancellation in the sums
    gate = fwd.gate_up_proj_act_checkpoint_T[:, 0]
    assert set(torch.unique(gate).tolist()) <= {0.0, 32.0} and bool((gate == 32.0).any())


def test_padded_backward_random_data_matches_oracle() -> None:
    """Random (non-dyadic) data: equal to the unpadded autograd up to fp32 reassociation."""
    T, H, I, E, K, B = 64, 320, 192, 3, 2, 128
    g = torch.Generator().manual_seed(7)
    x, dy = torch.randn(T, H, generator=g), torch.randn(T, H, generator=g)
    w_gu, w_d = torch.randn(E, H, 2, I, generator=g) * 0.1, torch.randn(E, I, H, generator=g) * 0.1
    choices = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    routed = torch.zeros(T, E, dtype=torch.bool).scatter_(1, choices, True)
    aff = torch.rand(T, E, generator=g) * routed
    want = _oracle({"x": x, "aff": aff, "routed": routed, "w_gu": w_gu, "w_d": w_d, "dy": dy})
    pad = Padding.of(H, I)
    ea = build_expert_affinities_masked(aff, choices)
    tpi, b2e = build_block_plan(choices, E, B)
    inp = pad_bwd_inputs({"hidden_states": x, "output_hidden_states_grad": dy}, pad)
    wgp = pad_dims(w_gu, {1: pad.backward_hidden_size, 3: pad.padded_intermediate_size})
    wdp = pad_dims(w_d, {1: pad.padded_intermediate_size, 2: pad.backward_hidden_size})
    fwd = blockwise_mm_fwd_mxfp8(inp["hidden_states"], ea, wgp, wdp, tpi, b2e, B, emulate="exact")
    grads = blockwise_mm_bwd_mxfp8(
        inp["hidden_states"], ea, wgp, wdp, tpi, b2e, inp["output_hidden_states_grad"], B,
        gate_up_proj_act_checkpoint_T=fwd.gate_up_proj_act_checkpoint_T,
        config=MXFP8MOEBwdConfig.routed(K), emulate="exact",
    )  # fmt: skip
    names = ["hidden_states_grad", "expert_affinities_masked_grad", "gate_up_proj_weight_grad",
             "down_proj_weight_grad"]  # fmt: skip
    padded = dict(zip(names, grads, strict=True))
    assert all(v == 0.0 for v in pad_region_max_abs(padded, pad).values())
    got = unpad_bwd_outputs(padded, pad)
    for name, w in zip(names, want, strict=True):
        # fp32 sums of up to H or 2I terms in another order: relative to the largest value
        assert float((got[name] - w).abs().max() / w.abs().max()) <= 1e-5, name


# ---------------------------------------------------------------------------------------------
# make-inputs, run-* and verify read the padding from the manifest
# ---------------------------------------------------------------------------------------------


def test_cli_journey_on_padded_weights(tmp_path: Path) -> None:
    """Qwen3-30B-A3B-like --tp 4 (I_TP 192 -> 256) with a gpt-oss-like H (320 -> 384 / 512):
    the user never pads or un-pads anything."""
    import json

    from typer.testing import CliRunner

    from mxcli.cli import app
    from mxcli.kernels.spec import read_kernel_file
    from mxcli.weightprep.padding import BWD_OUTPUT_DIMS

    def cli(*args: object) -> str:
        r = CliRunner().invoke(app, [str(a) for a in args])
        assert r.exit_code == 0, r.output
        return str(r.stdout)

    H, I, E = 320, 768, 4
    ck = build_checkpoint("qwen3_moe", tmp_path / "src", num_layers=1, hidden_size=H,
                          intermediate_size=I, num_experts=E)  # fmt: skip
    w = tmp_path / "w"
    cli("prep-weights", ck.path, w, "--tp", "4", "--quiet")
    bwd_in, bwd_out = tmp_path / "bwd-in.safetensors", tmp_path / "bwd-out.safetensors"
    cli("make-inputs", "bwd", "-o", bwd_in, "--weights", w, "--layer", 0, "--tokens", 128,
        "--quiet")  # fmt: skip
    f = read_kernel_file(bwd_in)
    assert tuple(f.tensors["hidden_states"].shape) == (128, 384)  # padded for the kernel
    assert not f.tensors["output_hidden_states_grad"][:, H:].any()
    summary = json.loads(cli("run-bwd", bwd_in, "-o", bwd_out, "--backend", "reference", "--json"))
    assert summary["padding"]["outputs"] == "unpadded"
    assert set(summary["padding"]["pad_max_abs"].values()) == {0.0}
    o = read_kernel_file(bwd_out)
    assert tuple(o.tensors["hidden_states_grad"].shape) == (128, H)
    assert tuple(o.tensors["gate_up_proj_weight_grad"].shape) == (E, H, 2, I // 4)
    assert tuple(o.tensors["down_proj_weight_grad"].shape) == (E, I // 4, H)
    assert set(BWD_OUTPUT_DIMS) >= {k for k in o.tensors if k != "expert_affinities_masked_grad"}
    report = json.loads(cli("verify", bwd_out, "--inputs", bwd_in, "--json"))
    names = [t["name"] for c in report["cases"] for t in c["tensors"]]
    assert "down_proj_weight_grad (padding)" in names and report["summary"]["cases_failed"] == 0

    # the same run from activations at the model's true sizes, weights from --weights
    slim = tmp_path / "slim.safetensors"
    from mxcli.io.files import write_file

    keep = {k: v for k, v in f.tensors.items() if "weight" not in k}
    keep["hidden_states"] = keep["hidden_states"][:, :H].contiguous()
    keep["output_hidden_states_grad"] = keep["output_hidden_states_grad"][:, :H].contiguous()
    keep["gate_up_proj_act_checkpoint_T"] = keep["gate_up_proj_act_checkpoint_T"][:, :, : I // 4]
    meta = {k: v for k, v in f.metadata.items() if k != "generator"}
    write_file(slim, {k: v.contiguous() for k, v in keep.items()}, meta)
    out2 = tmp_path / "bwd-out2.safetensors"
    cli("run-bwd", slim, "-o", out2, "--weights", w, "--layer", 0, "--backend", "reference",
        "--quiet")  # fmt: skip
    o2 = read_kernel_file(out2)
    for k, t in o.tensors.items():
        assert torch.equal(o2.tensors[k], t), k

    # prefill: hidden states padded to 512 with unpadded_hidden_size, outputs marked padded
    pf_in, pf_out = tmp_path / "pf-in.safetensors", tmp_path / "pf-out.safetensors"
    cli("make-inputs", "prefill", "-o", pf_in, "--weights", w, "--layer", 0, "--tokens", 64,
        "--quiet")  # fmt: skip
    assert read_kernel_file(pf_in).tensors["hidden_states"].shape[-1] == 512
    s = json.loads(cli("run-prefill", pf_in, "-o", pf_out, "--backend", "reference", "--json"))
    assert s["padding"]["outputs"].startswith("padded")
    assert (
        json.loads(cli("verify", pf_out, "--inputs", pf_in, "--json"))["summary"]["cases_failed"]
        == 0
    )
