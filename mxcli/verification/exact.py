"""Independent exact math, and the MXFP8 error bounds the references must stay within.

These checks do not reuse the references' numerics: they recompute each kernel's *intended*
function in float64 (prefill) or with autograd in float64 (bwd), and bound the difference.

prefill (``check_prefill``), per token, in float64:

- ``y = x * gamma / sqrt(sum(x^2) / N + eps)`` with ``x = hidden (+ residual)`` in natural order.
- ``norm_quant_packed.values`` (dequantized): ``|deq - y| <= 0.0742 * |y| + 2^-16 * amax_g``,
  i.e. half an e4m3 ulp (``2^-4`` relative) plus three 16-bit roundings on the way
  (``3 * 2^-8``), plus half the smallest e4m3 subnormal step of the group (``amax_g`` = the
  group's max ``|y|``).
- ``norm_quant_packed.scales``: the exponent rule ``byte = floor(log2 amax_g) + 127 - (emax - 1)``
  bit-exact on every group whose ``amax_g`` is not within 2% of a power of two (there the
  kernel's 16-bit roundings may move ``amax`` into the neighbouring binade).
- router logits ``y @ W (+ bias)`` with ``W`` in natural row order: ``expert_index`` bit-exact and
  affinities within ``3e-2`` (cosine >= 0.999) on every token whose top-(K+1) logits are either
  exactly equal or separated by more than ``1e-2 * rms(logits) + 1e-3`` (for NOAUX_TC: the group
  scores at the topk_group boundary and the masked selection scores at the K boundary, with
  ``5e-3``). Exact ties (padding tokens, all-zero router columns) are decided as the hardware
  does (``nc_find_index8``: the k-th of equal values takes the k-th occurrence, api spec §8.14),
  i.e. in ascending expert order, which a stable sort gives. Near-ties (``0 < gap <= tau``),
  whose order the kernel's fp32 rounding may flip, are skipped and counted in the message.
- ``norm_bf16`` and ``output_residual``: one bf16 rounding of ``y`` and ``hidden + residual``
  (``rtol 2^-7``).

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

import math
from collections.abc import Mapping
from typing import Any

import torch

from mxcli.errors import InputError
from mxcli.kernels import unarrange_router_weights
from mxcli.kernels.blockwise_moe import SPEC as BWD
from mxcli.kernels.blockwise_moe import (
    MXFP8MOEBwdConfig,
    PrequantizedWeights,
    ScaleLayout,
    dequantize_weights,
)
from mxcli.kernels.blockwise_moe.numerics import Grouping
from mxcli.kernels.rmsnorm_mx_prefill import SPEC as PREFILL
from mxcli.kernels.rmsnorm_mx_prefill.spec import decode_packed
from mxcli.kernels.spec import get_spec
from mxcli.mx import ElemFormat
from mxcli.verification.compare import TensorReport, Tolerance, add_note, compare_tensors
from mxcli.verification.finite import any_nonfinite_input, explained_tokens

CHECK = "reference vs exact"
F64 = torch.float64

_BOUND_REL = 2.0**-4 + 3 * 2.0**-8  # e4m3 half-ulp + three 16-bit roundings
_AFF_TOL = Tolerance("close", atol=3e-2, rtol=2.0**-7, min_cosine=0.999)
_ROUND_BF16 = Tolerance("close", rtol=2.0**-7, atol=1e-6, min_cosine=0.9999)
_BWD_TOL = Tolerance("close", atol_of_max=0.5, min_cosine=0.995, max_norm_l2=0.04)


# --------------------------------------------------------------------------------------------
# prefill
# --------------------------------------------------------------------------------------------


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Stored ``x_st[q*(H/4) + p]`` -> natural ``x[4p + q]`` (prefill spec §3.1)."""
    T, H = x.shape
    return x.reshape(T, 4, H // 4).transpose(1, 2).reshape(T, H)


def _act_name(kwargs: Mapping[str, Any]) -> str:
    act = PREFILL.value(kwargs, "router_act_fn")
    return str(getattr(act, "name", act)).upper()


def prefill_exact(inputs: Mapping[str, torch.Tensor], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """float64 RMSNorm (and router logits) of the prefill inputs."""
    hs = inputs["hidden_states"]
    H = int(hs.shape[-1])
    x = hs.reshape(-1, H).to(F64)
    res = inputs.get("residual")
    if res is not None:
        x = x + res.reshape(-1, H).to(F64)
    pre_norm = x
    if kwargs.get("hidden_interleaved"):
        x = _deinterleave(x)
    N = kwargs.get("unpadded_hidden_size") or H
    eps = float(PREFILL.value(kwargs, "eps"))
    gamma = inputs["gamma"].reshape(H).to(F64)
    inv = 1.0 / torch.sqrt((x * x).sum(-1, keepdim=True) / N + eps)
    y = x * inv * gamma
    out: dict[str, Any] = {"y": y, "pre_norm": pre_norm}
    w = inputs.get("router_weights")
    if w is not None:
        w_nat = unarrange_router_weights(w, PREFILL.value(kwargs, "router_act_fn")).to(F64)
        logits = y @ w_nat
        bias = inputs.get("router_bias")
        out["bias"] = bias.reshape(-1).to(F64) if bias is not None else None
        out["logits"] = logits
    return out


def _group_amax(y: torch.Tensor) -> torch.Tensor:
    T, H = y.shape
    return y.abs().reshape(T, H // 32, 32).amax(-1)  # [T, H/32]


def _routing_exact(ex: Mapping[str, Any], kwargs: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Exact top-K routing: indices [T, K] (ties in ascending expert order), dense affinities
    [T, E], and the mask of tokens without near-ties."""
    logits: torch.Tensor = ex["logits"]
    bias = ex.get("bias")
    T, E = logits.shape
    K = int(PREFILL.value(kwargs, "top_k"))
    act = _act_name(kwargs)
    if act == "NOAUX_TC":
        return _noaux_exact(logits, bias, kwargs)
    lg = logits + bias if bias is not None else logits
    order = torch.sort(lg, dim=-1, descending=True, stable=True)
    top = order.values[:, : min(K + 1, E)]
    idx = order.indices[:, :K]
    rms = lg.pow(2).mean(-1).sqrt()
    tau = 1e-2 * rms + 1e-3
    gaps = (
        (top[:, :-1] - top[:, 1:]) if top.shape[1] > 1 else torch.full((T, 1), math.inf, dtype=F64)
    )
    ok = _decided(gaps, tau[:, None]).all(-1)  # exact ties are compared, near-ties skipped
    sel = lg.gather(1, idx)
    if act == "SOFTMAX":
        w = torch.softmax(sel, dim=-1)
    else:
        w = torch.sigmoid(sel)
    dense = torch.zeros(T, E, dtype=F64).scatter_(1, idx, w)
    return {"index": idx.to(torch.int32), "affinities": dense, "ok": ok}


def _decided(gap: torch.Tensor, tau: float | torch.Tensor) -> torch.Tensor:
    """A selection boundary both sides decide alike: an exact tie (the lower index wins) or a
    gap wider than fp32 rounding can close."""
    return (gap > tau) | (gap == 0)


def _noaux_exact(
    logits: torch.Tensor, bias: torch.Tensor | None, kwargs: Mapping[str, Any]
) -> dict[str, torch.Tensor]:
    """DeepSeek-V3 group-limited routing (prefill spec §5.3), float64, bias for selection only."""
    T, E = logits.shape
    K = int(PREFILL.value(kwargs, "top_k"))
    G = int(PREFILL.value(kwargs, "n_group"))
    TG = int(PREFILL.value(kwargs, "topk_group"))
    rsf = float(PREFILL.value(kwargs, "routed_scaling_factor"))
    s = torch.sigmoid(logits)
    sfc = s + (bias if bias is not None else 0.0)
    epg = E // G
    grouped = sfc.reshape(T, G, epg)
    top2 = torch.topk(grouped, min(2, epg), dim=-1).values
    gs = top2.sum(-1) if epg >= 2 else top2[..., 0] - 30000.0  # epg == 1: second is the pad
    g_order = torch.sort(gs, dim=-1, descending=True, stable=True)
    kept = g_order.indices[:, :TG]
    tau = 5e-3
    ok = torch.ones(T, dtype=torch.bool)
    if TG < G:
        ok &= _decided(g_order.values[:, TG - 1] - g_order.values[:, TG], tau)
    gmask = torch.zeros(T, G, dtype=torch.bool).scatter_(1, kept, True)
    emask = gmask.repeat_interleave(epg, dim=1)
    masked = torch.where(emask, sfc, sfc - 30000.0)
    e_order = torch.sort(masked, dim=-1, descending=True, stable=True)
    sel = e_order.indices[:, :K]
    if K < E:
        ok &= _decided(e_order.values[:, K - 1] - e_order.values[:, K], tau)
    w = s.gather(1, sel)
    aff = rsf * w / (w.sum(-1, keepdim=True) + 1e-20)
    dense = torch.zeros(T, E, dtype=F64).scatter_(1, sel, aff)
    return {"index": sel.to(torch.int32), "affinities": dense, "ok": ok}


def check_prefill(
    inputs: Mapping[str, torch.Tensor],
    kwargs: Mapping[str, Any],
    outputs: Mapping[str, torch.Tensor],
) -> list[TensorReport]:
    """The reference's prefill outputs against float64 math within MXFP8 bounds (module doc)."""

    ex = prefill_exact(inputs, kwargs)
    y: torch.Tensor = ex["y"]
    T, H = y.shape
    # tokens a NaN/Inf input explains (--allow-nonfinite runs, `mxcli.verification.finite`):
    # their exact values are NaN too, so they are counted, not compared
    explained = explained_tokens(PREFILL.name, inputs)
    keep = ~explained if explained is not None else torch.ones(T, dtype=torch.bool)
    n_explained = T - int(keep.sum())
    explained_note = (
        f"{n_explained} of {T} tokens with NaN/Inf inputs (explained, not compared)"
        if n_explained
        else ""
    )
    row_mask = keep[:, None] if n_explained else None
    reports: list[TensorReport] = []
    w = inputs.get("router_weights")
    E = int(w.shape[1]) if w is not None else None
    pack_aff = bool(kwargs.get("pack_affinities")) and w is not None
    dec = decode_packed(outputs["norm_quant_packed"], kwargs, H, E if pack_aff else None)
    amax = _group_amax(y)  # [T, H/32]
    bound_rel = _BOUND_REL
    qmx = str(getattr(kwargs.get("qmx_output_dtype"), "value", kwargs.get("qmx_output_dtype")))
    elem = ElemFormat.E5M2 if "e5m2" in qmx.lower() else ElemFormat.E4M3FN
    if elem is ElemFormat.E5M2:
        bound_rel = 2.0**-3 + 3 * 2.0**-8
    floor = (amax * 2.0**-16).repeat_interleave(32, dim=1)
    values = dec.values.to(F64)
    bound = bound_rel * y.abs() + floor
    rep = _bounded(
        "norm_quant_packed.values",
        values,
        y,
        bound,
        f"|d| <= {bound_rel:.4f}|y| + 2^-16 amax_g",
        mask=row_mask,
    )
    add_note(rep, explained_note)
    reports.append(rep)
    # scale bytes: exponent rule where amax is not just below a power of two
    e_amax = torch.floor(torch.log2(amax.clamp_min(1e-300)))
    frac = amax / torch.pow(2.0, e_amax + 1)  # in [0.5, 1)
    near = (frac > 0.98) | (frac < 0.51)
    exp_byte = (e_amax + 127 - (elem.emax - 1)).clamp(0, 255)
    exp_byte = torch.where(amax == 0, torch.zeros_like(exp_byte), exp_byte).to(torch.uint8)
    rep = compare_tensors(
        "norm_quant_packed.scales",
        dec.scales,
        exp_byte,
        Tolerance("exact"),
        check=CHECK,
        mask=~near & keep[:, None],
    )
    add_note(rep, explained_note)
    reports.append(rep)

    if w is not None:
        r = _routing_exact(ex, kwargs)
        ok = r["ok"] & keep
        skipped = int((~ok).sum()) - n_explained
        note = f"{skipped} of {T} tokens skipped (near-ties)" if skipped else ""
        note = "; ".join(n for n in (note, explained_note) if n)
        if "expert_index" in outputs:
            rep = compare_tensors(
                "expert_index",
                outputs["expert_index"],
                r["index"],
                Tolerance("exact"),
                check=CHECK,
                mask=ok[:, None],
            )
            add_note(rep, note)
            reports.append(rep)
        aff = outputs.get("expert_affinities")
        if aff is None and dec.affinities is not None:
            aff, aff_name = dec.affinities, "norm_quant_packed.affinities"
        else:
            aff_name = "expert_affinities"
        if aff is not None:
            rep = compare_tensors(
                aff_name, aff.to(F64), r["affinities"], _AFF_TOL, check=CHECK, mask=ok[:, None]
            )
            add_note(rep, note)
            reports.append(rep)
    for name, exact in (("norm_bf16", y), ("output_residual", ex["pre_norm"])):
        if name in outputs:
            rep = compare_tensors(
                name, outputs[name].to(F64), exact, _ROUND_BF16, check=CHECK, mask=row_mask
            )
            add_note(rep, explained_note)
            reports.append(rep)
    return reports


def _bounded(
    name: str,
    actual: torch.Tensor,
    exact: torch.Tensor,
    bound: torch.Tensor,
    desc: str,
    mask: torch.Tensor | None = None,
) -> TensorReport:
    """Elementwise ``|actual - exact| <= bound`` (NaN anywhere fails) where `mask` is set."""
    rep = compare_tensors(
        name, actual, exact, Tolerance("close", rtol=math.inf), check=CHECK, mask=mask
    )
    diff = (actual - exact).abs()
    bad = ~(diff <= bound)
    if mask is not None:
        bad &= torch.broadcast_to(mask, bad.shape)
    rep.mismatches = int(bad.sum())
    rep.tolerance = desc
    rep.passed = rep.mismatches == 0
    rep.message = "" if rep.passed else f"{rep.mismatches} of {rep.numel} elements out of bound"
    return rep


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
    explains = any_nonfinite_input(inputs)
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


def _check_prefill(
    inputs: Mapping[str, torch.Tensor],
    kwargs: Mapping[str, Any],
    outputs: Mapping[str, torch.Tensor],
    weights: Mapping[str, torch.Tensor] | None,
    source: str,
) -> list[TensorReport]:
    return check_prefill(inputs, kwargs, outputs)


def _check_bwd(
    inputs: Mapping[str, torch.Tensor],
    kwargs: Mapping[str, Any],
    outputs: Mapping[str, torch.Tensor],
    weights: Mapping[str, torch.Tensor] | None,
    source: str,
) -> list[TensorReport]:
    if weights is None:
        missing = [k for k in ("gate_up_proj_weight", "down_proj_weight") if k not in inputs]
        if missing:
            raise InputError(
                f"{source}: missing {', '.join(missing)} (given by --weights at "
                "run time?); the exact check needs the input file to hold them"
            )
        weights = bwd_exact_weights(inputs, kwargs.get("config"))
    return check_bwd(inputs, kwargs, outputs, weights)


_CHECKS = {PREFILL.name: _check_prefill, BWD.name: _check_bwd}


def check_exact(
    kernel: str,
    inputs: Mapping[str, torch.Tensor],
    kwargs: Mapping[str, Any],
    outputs: Mapping[str, torch.Tensor],
    *,
    weights: Mapping[str, torch.Tensor] | None = None,
    source: str = "inputs",
) -> list[TensorReport]:
    """The reference's outputs of `kernel` against its independent exact math (module doc).

    bwd: `weights` are the bf16 weights behind pre-quantized ones (default: as given, or
    dequantized); `source` names the inputs in the error when they lack the weights."""
    return _CHECKS[get_spec(kernel).name](inputs, kwargs, outputs, weights, source)
