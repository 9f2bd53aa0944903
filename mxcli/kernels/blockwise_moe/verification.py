"""The verification of ``blockwise_mm_bwd_mxfp8`` (its `VerificationPart`): the independent exact
math, the tolerance rows of the ``strict`` and ``hardware`` profiles, and the ``verify --suite``
cases. It sits on the floor of `mxcli.verification`; the spec names it and never imports it.

bwd (``check_bwd``): the forward of the layer, ``out[t] = sum_e a[t,e] * (silu(g) * u) @ W_d[e]``,
run in float64 with autograd, with ``g`` and ``u`` taken from the gate/up checkpoint (a
straight-through substitution, so the comparison sees only the backward's MXFP8 error, not the
forward's) and the clamp masks applied; its gradients with respect to ``hidden_states``, the
affinities and both weights are compared with the reference's outputs under the upstream
bound (cosine >= 0.99, normalised L2 <= 0.7, ``|diff| <= 0.5 * max|exact|``) tightened to
cosine >= 0.995 and normalised L2 ``|a - b| / (|a| + |b|) <= 0.04``. MXFP8 operands measure
about 0.027 (cosine ~0.9986) across the suite; a gradient off by a 10% scale fails.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from mxcli.errors import InputError
from mxcli.kernels.blockwise_moe.config import MXFP8MOEBwdConfig
from mxcli.kernels.blockwise_moe.numerics import Grouping
from mxcli.kernels.blockwise_moe.prequant import (
    PrequantizedWeights,
    ScaleLayout,
    dequantize_weights,
)
from mxcli.kernels.blockwise_moe.spec import SPEC as BWD
from mxcli.verification.cases import Case
from mxcli.verification.compare import TensorReport, Tolerance, add_note, compare_tensors
from mxcli.verification.exact import CHECK, F64
from mxcli.verification.finite import any_nonfinite_input
from mxcli.verification.policy import ULP

_BWD_TOL = Tolerance("close", atol_of_max=0.5, min_cosine=0.995, max_norm_l2=0.04)

# --------------------------------------------------------------------------------------------
# bwd
# --------------------------------------------------------------------------------------------


def bwd_exact(
    inputs: Mapping[str, torch.Tensor],
    kwargs: Mapping[str, Any],
    weights: Mapping[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """float64 autograd gradients of the blockwise MoE layer (see the module docstring).

    ``weights`` holds the bf16 ``gate_up_proj_weight [E, H, 2, I]`` and ``down_proj_weight
    [E, I, H]`` (for pre-quantized inputs: their dequantized values).
    """
    config = kwargs.get("config")
    B = int(kwargs["block_size"])
    X = inputs["hidden_states"].to(F64).detach().requires_grad_(True)
    T, H = X.shape
    w_gu = weights["gate_up_proj_weight"].to(F64)
    w_d = weights["down_proj_weight"].to(F64)
    E, _, _, I = w_gu.shape  # noqa: E741 (spec notation I = I_TP)
    # one leaf per expert and matrix: slicing a stacked leaf would give every slice's backward a
    # full-size gradient buffer
    Wg = [w_gu[e, :, 0, :].clone().requires_grad_(True) for e in range(E)]  # [H, I]
    Wu = [w_gu[e, :, 1, :].clone().requires_grad_(True) for e in range(E)]
    Wd = [w_d[e].clone().requires_grad_(True) for e in range(E)]  # [I, H]
    A = inputs["expert_affinities_masked"].to(F64).reshape(T, E).detach().requires_grad_(True)
    dY = inputs["output_hidden_states_grad"].to(F64)
    if "gate_up_proj_act_checkpoint_T" not in inputs:  # the exact forward starts from it
        raise InputError(
            "gate_up_proj_act_checkpoint_T: missing from the inputs (verify --inputs needs it)"
        )
    ckpt = inputs["gate_up_proj_act_checkpoint_T"].to(F64)  # [N, 2, I, B]
    tpi = inputs["token_position_to_id"].long().reshape(-1)
    b2e = inputs["block_to_expert"].long().reshape(-1)
    N = b2e.numel()
    nv = inputs.get("num_valid_tokens")
    n_valid = min(int(nv.reshape(-1)[0]), T) if nv is not None else T
    clamp = getattr(config, "clamp_limits", None)
    has_bias = bool(getattr(config, "bias", False))
    bg = [torch.zeros(I, dtype=F64, requires_grad=has_bias) for _ in range(E)]
    bu = [torch.zeros(I, dtype=F64, requires_grad=has_bias) for _ in range(E)]
    bd = [torch.zeros(H, dtype=F64, requires_grad=has_bias) for _ in range(E)]

    # every (token, expert) pair is independent up to the final sum: batch the valid block rows
    # of each expert; the loss <out, dY> is the sum of <y_row, dY[token]> over those rows
    pos_tok = tpi[: N * B]
    pos_exp = b2e.repeat_interleave(B)
    valid = (pos_tok >= 0) & (pos_tok < n_valid)
    ck_rows = ckpt.permute(0, 3, 1, 2).reshape(N * B, 2, I)  # [N*B, 2, I]: row = position
    loss = torch.zeros((), dtype=F64)
    for e in range(E):
        sel = valid & (pos_exp == e)
        if not bool(sel.any()):
            continue
        toks = pos_tok[sel]
        x = X[toks]  # [n, H]
        g_lin = x @ Wg[e] + bg[e]
        u_lin = x @ Wu[e] + bu[e]
        g_ck, u_ck = ck_rows[sel, 0], ck_rows[sel, 1]  # [n, I]
        # straight-through: values of the checkpoint, gradients of the linear maps
        g = g_lin + (g_ck - g_lin).detach()
        u = u_lin + (u_ck - u_lin).detach()
        if clamp is not None:
            g = _clamp_grad(
                g, g_ck, clamp.non_linear_clamp_lower_limit, clamp.non_linear_clamp_upper_limit
            )
            u = _clamp_grad(u, u_ck, clamp.linear_clamp_lower_limit, clamp.linear_clamp_upper_limit)
        h = torch.nn.functional.silu(g) * u
        alpha = A[toks, e][:, None]
        y = (alpha * h) @ Wd[e] + alpha * bd[e]
        loss = loss + (y * dY[toks]).sum()
    leaves = [X, A, *Wg, *Wu, *Wd] + ([*bg, *bu, *bd] if has_bias else [])
    grads = list(torch.autograd.grad(loss, leaves, allow_unused=True))
    grads = [torch.zeros_like(t) if g_ is None else g_ for g_, t in zip(grads, leaves, strict=True)]
    dX, dA = grads[0], grads[1]
    dWg, dWu, dWd = grads[2 : 2 + E], grads[2 + E : 2 + 2 * E], grads[2 + 2 * E : 2 + 3 * E]
    result = {
        "hidden_states_grad": dX,
        "expert_affinities_masked_grad": dA.reshape(T * E, 1),
        "gate_up_proj_weight_grad": torch.stack(
            [torch.stack(p, 1) for p in zip(dWg, dWu, strict=True)]
        ),
        "down_proj_weight_grad": torch.stack(dWd),
    }
    if has_bias:
        rest = grads[2 + 3 * E :]
        dbg, dbu, dbd = rest[:E], rest[E : 2 * E], rest[2 * E :]
        result["gate_and_up_proj_bias_grad"] = torch.stack(
            [torch.stack(p) for p in zip(dbg, dbu, strict=True)]
        )
        result["down_proj_bias_grad"] = torch.stack(dbd)
    return result


def _clamp_grad(
    v: torch.Tensor, ck: torch.Tensor, lo: float | None, hi: float | None
) -> torch.Tensor:
    """Zero the gradient where the checkpoint sits at or beyond a clamp bound (strict masks)."""
    keep = torch.ones_like(ck, dtype=torch.bool)
    if lo is not None:
        keep &= ck > lo
    if hi is not None:
        keep &= ck < hi
    return torch.where(keep, v, v.detach())


def check_bwd(
    inputs: Mapping[str, torch.Tensor],
    kwargs: Mapping[str, Any],
    outputs: Mapping[str, torch.Tensor],
    weights: Mapping[str, torch.Tensor],
) -> list[TensorReport]:
    """The reference's bwd outputs against float64 autograd (module docstring bounds)."""
    exact = bwd_exact(inputs, kwargs, weights)
    # the backward mixes all tokens: a NaN/Inf input explains any NaN/Inf output (and exact
    # value), which are counted, not compared (`mxcli.verification.finite`)
    explains = any_nonfinite_input(inputs, BWD.nonfinite.x4_inputs)
    reports = []
    for name, ex in exact.items():
        if name not in outputs:
            continue
        actual = outputs[name].to(F64)
        mask = None
        if explains:
            mask = torch.isfinite(actual) & torch.isfinite(ex)
        rep = compare_tensors(name, actual, ex, _BWD_TOL, check=CHECK, mask=mask)
        if mask is not None and not bool(mask.all()):
            add_note(
                rep,
                f"{int((~mask).sum())} NaN/Inf value(s) explained by NaN/Inf inputs, not compared",
            )
        reports.append(rep)
    return reports


def bwd_exact_weights(tensors: Mapping[str, Any], config: Any) -> dict[str, Any]:
    """bf16-valued weights of a bwd input: as given, or dequantized when pre-quantized."""
    w = {k: tensors[k] for k in ("gate_up_proj_weight", "down_proj_weight")}
    if "gate_up_weight_scales" not in tensors and "down_weight_scales" not in tensors:
        return w
    cfg = config if config is not None else MXFP8MOEBwdConfig()
    p1, p2 = cfg.phase1_config, cfg.phase2_config  # filled by the config's validation
    assert p1 is not None and p2 is not None
    gu, gu_s = tensors["gate_up_proj_weight"], tensors.get("gate_up_weight_scales")
    d, d_s = tensors["down_proj_weight"], tensors.get("down_weight_scales")
    H = int(tensors["hidden_states"].shape[-1])
    pq = PrequantizedWeights(
        gu if gu_s is not None else None, gu_s, d if d_s is not None else None, d_s,
        Grouping.for_phase(p2), Grouping.for_phase(p1, H, cfg.fast_dma_transpose),
        ScaleLayout.PACKED if p2.enable_scale_packing else ScaleLayout.UNPACKED,
        ScaleLayout.PACKED if p1.enable_scale_packing else ScaleLayout.UNPACKED,
    )  # fmt: skip
    gu_deq, d_deq = dequantize_weights(pq)
    if gu_deq is not None:
        w["gate_up_proj_weight"] = gu_deq
    if d_deq is not None:
        w["down_proj_weight"] = d_deq
    return w


def check_exact(
    inputs: Mapping[str, torch.Tensor],
    kwargs: Mapping[str, Any],
    outputs: Mapping[str, torch.Tensor],
    weights: Mapping[str, torch.Tensor] | None,
    source: str,
) -> list[TensorReport]:
    """The reference's outputs against float64 autograd; `weights` are the bf16 weights behind
    pre-quantized ones (default: as given, or dequantized); `source` names the inputs in the
    error when they lack the weights."""
    if weights is None:
        missing = [k for k in ("gate_up_proj_weight", "down_proj_weight") if k not in inputs]
        if missing:
            raise InputError(
                f"{source}: missing {', '.join(missing)} (given by --weights at "
                "run time?); the exact check needs the input file to hold them"
            )
        weights = bwd_exact_weights(inputs, kwargs.get("config"))
    return check_bwd(inputs, kwargs, outputs, weights)


# --------------------------------------------------------------------------------------------
# Tolerance rows (`mxcli.verification.policy`). strict: weight gradients accumulate in bf16 over
# blocks, so their bound is rtol = 2^-5 with an absolute floor of 2^-8 * max|golden|. Outputs
# downstream of dG/dU (the hidden-state, gate/up weight and bias gradients) pass through the P1
# matmul, a bf16 rounding and an MX quantization: they follow the ``chain`` model of
# `mxcli.verification.mxchain` (2 bf16 ulps, at most 1% of the elements one step further,
# bounded by 2^-3 * max|golden|: one E4M3 code step is at most 2^-3 of its group's largest
# magnitude). hardware: the upstream bound (bwd spec §11.3): cosine >= 0.99, normalised L2 <= 0.7
# and within 0.5 * max.
# --------------------------------------------------------------------------------------------

_WGRAD = Tolerance("close", rtol=2.0**-5, atol_of_max=2.0**-8, min_cosine=0.9999)
# mxchain model; the ulp floor 2^-8 * max keeps _WGRAD's floor (bf16 accumulation over blocks)
_CHAIN = Tolerance(
    "chain", ulps=2.0, atol_of_max=2.0**-8, step_of_max=2.0**-3, max_mismatch_frac=0.01,
    min_cosine=0.9999,
)  # fmt: skip

STRICT: dict[str, Tolerance] = {
    "hidden_states_grad": _CHAIN,
    "expert_affinities_masked_grad": ULP,
    "gate_up_proj_weight_grad": _CHAIN,
    "down_proj_weight_grad": _WGRAD,
    "gate_and_up_proj_bias_grad": _CHAIN,
    "down_proj_bias_grad": _WGRAD,
}

_UPSTREAM_BWD = Tolerance("close", rtol=1e-3, atol_of_max=0.5, min_cosine=0.99, max_norm_l2=0.7)

HARDWARE: dict[str, Tolerance] = {name: _UPSTREAM_BWD for name in STRICT}


# --------------------------------------------------------------------------------------------
# The ``verify --suite`` cases: ``quick`` covers every output and feature path at small shapes;
# ``full`` adds bwd spec §11.4 shapes and feature paths at small T, and the upstream sizes
# (its baseline and blocking tables).
# --------------------------------------------------------------------------------------------


def _b(name: str, quick: bool = False, **params: Any) -> Case:
    return Case(f"{BWD.short}/{name}", BWD.name, params, quick)


CASES: tuple[Case, ...] = (
    _b(
        "routed-e2-k1",
        True,
        tokens=256,
        hidden=256,
        intermediate=128,
        experts=2,
        top_k=1,
        block_size=128,
        seed=1,
    ),
    _b(
        "routed-e4-k2-bias",
        True,
        tokens=128,
        hidden=512,
        intermediate=256,
        experts=4,
        top_k=2,
        block_size=128,
        bias=True,
        seed=2,
    ),
    _b(
        "dense-e1",
        True,
        tokens=256,
        hidden=256,
        intermediate=128,
        experts=1,
        top_k=1,
        block_size=128,
        dense=True,
        seed=3,
    ),
    _b(
        "routed-e2-k2-clamp-prequant",
        True,
        tokens=128,
        hidden=384,
        intermediate=256,
        experts=2,
        top_k=2,
        block_size=128,
        clamp=(-1.0, 1.0, -0.5, 0.5),
        prequantize=True,
        seed=4,
    ),
    _b(
        "routed-h1024-e4-k4-i256",
        tokens=256,
        hidden=1024,
        intermediate=256,
        experts=4,
        top_k=4,
        block_size=128,
        seed=11,
    ),
    _b(
        "routed-h2048-e2-k2-i256",
        tokens=256,
        hidden=2048,
        intermediate=256,
        experts=2,
        top_k=2,
        block_size=128,
        seed=12,
    ),
    _b(
        "routed-h384-e4-k2-i512",
        tokens=256,
        hidden=384,
        intermediate=512,
        experts=4,
        top_k=2,
        block_size=128,
        seed=13,
    ),
    _b(
        "routed-h512-e2-k2-b256-i256-bias",
        tokens=512,
        hidden=512,
        intermediate=256,
        experts=2,
        top_k=2,
        block_size=256,
        bias=True,
        seed=14,
    ),
    _b(
        "dense-h512-b512-i256",
        tokens=512,
        hidden=512,
        intermediate=256,
        experts=1,
        top_k=1,
        block_size=512,
        dense=True,
        seed=15,
    ),
    _b(
        "routed-block-larger-than-tokens",
        tokens=128,
        hidden=512,
        intermediate=256,
        experts=1,
        top_k=1,
        block_size=256,
        seed=16,
    ),
    _b(
        "routed-e8-k2-prequant-unpacked",
        tokens=256,
        hidden=512,
        intermediate=384,
        experts=8,
        top_k=2,
        block_size=128,
        prequantize=True,
        scale_layout="unpacked",
        seed=17,
    ),
    _b(
        "routed-prefill-router-e8-k2",
        tokens=256,
        hidden=512,
        intermediate=256,
        experts=8,
        top_k=2,
        block_size=128,
        router="prefill",
        seed=18,
    ),
    _b(
        "upstream-h2048-t1024-e2-b128-k1-i512",
        tokens=1024,
        hidden=2048,
        intermediate=512,
        experts=2,
        top_k=1,
        block_size=128,
        seed=21,
    ),
    _b(
        "upstream-h1024-t1024-e4-b512-k4-i256",
        tokens=1024,
        hidden=1024,
        intermediate=256,
        experts=4,
        top_k=4,
        block_size=512,
        seed=22,
    ),
    _b(
        "upstream-h384-t1024-e4-b128-k2-i512",
        tokens=1024,
        hidden=384,
        intermediate=512,
        experts=4,
        top_k=2,
        block_size=128,
        seed=23,
    ),
    _b(
        "upstream-h2048-t1024-e4-b256-k2-i384-prequant",
        tokens=1024,
        hidden=2048,
        intermediate=384,
        experts=4,
        top_k=2,
        block_size=256,
        prequantize=True,
        seed=24,
    ),
    _b(
        "upstream-dense-h2048-t1024-b512-i768",
        tokens=1024,
        hidden=2048,
        intermediate=768,
        experts=1,
        top_k=1,
        block_size=512,
        dense=True,
        seed=25,
    ),
)

__all__ = [
    "CASES",
    "HARDWARE",
    "STRICT",
    "bwd_exact",
    "bwd_exact_weights",
    "check_bwd",
    "check_exact",
]
