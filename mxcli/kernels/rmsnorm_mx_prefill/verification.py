"""The verification of ``rmsnorm_mx_prefill`` (its `VerificationPart`): the independent exact
math, the tolerance rows of the ``strict`` and ``hardware`` profiles, and the ``verify --suite``
cases. It sits on the floor of `mxcli.verification`; the spec names it and never imports it.

The exact check does not reuse the reference's numerics: it recomputes the kernel's *intended*
function in float64 and bounds the difference.

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
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from mxcli.kernels.rmsnorm_mx_prefill.router_weights import unarrange_router_weights
from mxcli.kernels.rmsnorm_mx_prefill.spec import SPEC as PREFILL
from mxcli.kernels.rmsnorm_mx_prefill.spec import decode_packed
from mxcli.mx import ElemFormat
from mxcli.verification.cases import Case
from mxcli.verification.compare import EXACT, TensorReport, Tolerance, add_note, compare_tensors
from mxcli.verification.exact import CHECK, F64
from mxcli.verification.finite import explained_tokens
from mxcli.verification.policy import ULP

_BOUND_REL = 2.0**-4 + 3 * 2.0**-8  # e4m3 half-ulp + three 16-bit roundings
_AFF_TOL = Tolerance("close", atol=3e-2, rtol=2.0**-7, min_cosine=0.999)
_ROUND_BF16 = Tolerance("close", rtol=2.0**-7, atol=1e-6, min_cosine=0.9999)


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


def check_exact(
    inputs: Mapping[str, torch.Tensor],
    kwargs: Mapping[str, Any],
    outputs: Mapping[str, torch.Tensor],
    weights: Mapping[str, torch.Tensor] | None,
    source: str,
) -> list[TensorReport]:
    """The reference's outputs against the exact math (`check_prefill`)."""
    return check_prefill(inputs, kwargs, outputs)


# --------------------------------------------------------------------------------------------
# Tolerance rows (`mxcli.verification.policy`): the packed rows are compared through their
# decoded parts (prefill spec §4.2). strict: codes, scale bytes and indices bit-exact, floats to
# the last place. hardware (prefill spec §7): at most 1% of codes and scale bytes may flip,
# dequantized values within 5e-2 * max for 99% of elements, indices on at least 95% of the
# tokens, affinities cosine >= 0.98 and within 5e-2 * max + 1e-3 for 95%.
# --------------------------------------------------------------------------------------------

STRICT: dict[str, Tolerance] = {
    "norm_quant_packed.codes": EXACT,
    "norm_quant_packed.scales": EXACT,
    "norm_quant_packed.values": Tolerance("close", min_cosine=0.99999),
    "norm_quant_packed.affinities": ULP,
    "expert_index": EXACT,
    "expert_affinities": ULP,
    "output_residual": ULP,
    "norm_bf16": ULP,
}

_HW_AFF = Tolerance("close", atol=1e-3, atol_of_max=5e-2, min_cosine=0.98, max_mismatch_frac=0.05)

HARDWARE: dict[str, Tolerance] = {
    "norm_quant_packed.codes": Tolerance("exact", max_mismatch_frac=0.01),
    "norm_quant_packed.scales": Tolerance("exact", max_mismatch_frac=0.01),
    "norm_quant_packed.values": Tolerance(
        "close", atol=1e-5, atol_of_max=5e-2, max_mismatch_frac=0.01
    ),
    "norm_quant_packed.affinities": _HW_AFF,
    "expert_index": Tolerance("exact", max_mismatch_frac=0.05),
    "expert_affinities": _HW_AFF,
    "output_residual": Tolerance("close", rtol=1e-2, atol=1e-5),
    "norm_bf16": Tolerance("close", rtol=1e-2, atol=1e-5),
}


# --------------------------------------------------------------------------------------------
# The ``verify --suite`` cases: ``quick`` covers every output and every feature path at small
# shapes (it runs in CI); ``full`` adds the upstream test shapes that fit a CPU (prefill spec
# §7), trimmed in T, and the remaining feature combinations.
# --------------------------------------------------------------------------------------------


def _p(name: str, quick: bool = False, **params: Any) -> Case:
    return Case(f"{PREFILL.short}/{name}", PREFILL.name, params, quick)


_SOFTMAX: dict[str, Any] = {"router_act_fn": "SOFTMAX"}
_NOAUX: dict[str, Any] = {"router_act_fn": "NOAUX_TC", "routed_scaling_factor": 2.5}

CASES: tuple[Case, ...] = (
    _p("norm-only-h512", True, seq=128, hidden=512, experts=None, seed=42),
    _p(
        "softmax-e16-k2-residual-norm",
        True,
        seq=96,
        hidden=1024,
        experts=16,
        top_k=2,
        residual=True,
        emit_norm_bf16=True,
        seed=5,
        **_SOFTMAX,
    ),
    _p(
        "sigmoid-e8-k1-bias-unfolded-unpadded",
        True,
        batch=2,
        seq=32,
        hidden=1024,
        experts=8,
        top_k=1,
        router_act_fn="SIGMOID",
        router_bias=True,
        pack_scales=False,
        unpadded_hidden_size=960,
        seed=6,
    ),
    _p(
        "softmax-e17-k2-packaff",
        True,
        seq=64,
        hidden=2048,
        experts=17,
        top_k=2,
        pack_affinities=True,
        seed=7,
        **_SOFTMAX,
    ),
    _p(
        "noaux-e32-g4-tg2-k2",
        True,
        seq=64,
        hidden=512,
        experts=32,
        n_group=4,
        topk_group=2,
        top_k=2,
        seed=7,
        **_NOAUX,
    ),
    _p(
        "noaux-e32-g4-tg2-k2-packaff",
        True,
        seq=64,
        hidden=512,
        experts=32,
        n_group=4,
        topk_group=2,
        top_k=2,
        pack_affinities=True,
        seed=8,
        **_NOAUX,
    ),
    _p("norm-only-h3072", seq=256, hidden=3072, experts=None, seed=42),
    _p("norm-only-h2048-b3", batch=3, seq=128, hidden=2048, experts=None, seed=43),
    _p("softmax-e16-k1-h2048", seq=512, hidden=2048, experts=16, top_k=1, seed=5, **_SOFTMAX),
    _p(
        "softmax-e128-k4-h3072-unpadded-residual-packaff",
        seq=256,
        hidden=3072,
        unpadded_hidden_size=2880,
        experts=128,
        top_k=4,
        residual=True,
        pack_affinities=True,
        seed=5,
        **_SOFTMAX,
    ),
    _p(
        "softmax-e128-k4-b16-s1",
        batch=16,
        seq=1,
        hidden=3072,
        unpadded_hidden_size=2880,
        experts=128,
        top_k=4,
        seed=5,
        **_SOFTMAX,
    ),
    _p(
        "softmax-e256-k4-h7168-residual",
        seq=64,
        hidden=7168,
        experts=256,
        top_k=4,
        residual=True,
        seed=5,
        **_SOFTMAX,
    ),
    _p(
        "sigmoid-e64-k8-fp16-residual",
        seq=128,
        hidden=1024,
        experts=64,
        top_k=8,
        router_act_fn="SIGMOID",
        residual=True,
        seed=9,
    ),
    _p(
        "noaux-e256-g8-tg4-k8",
        seq=256,
        hidden=2048,
        experts=256,
        n_group=8,
        topk_group=4,
        top_k=8,
        seed=7,
        **_NOAUX,
    ),
    _p(
        "noaux-e256-g8-tg4-k8-packaff",
        seq=128,
        hidden=2048,
        experts=256,
        n_group=8,
        topk_group=4,
        top_k=8,
        pack_affinities=True,
        seed=7,
        **_NOAUX,
    ),
    _p(
        "noaux-e256-h7168",
        seq=64,
        hidden=7168,
        experts=256,
        n_group=8,
        topk_group=4,
        top_k=8,
        seed=7,
        **_NOAUX,
    ),
    _p(
        "norm-bf16-h7168-residual",
        seq=64,
        hidden=7168,
        experts=None,
        residual=True,
        emit_norm_bf16=True,
        seed=11,
    ),
    _p(
        "upstream-softmax-e256-k4-h7168-t2048-residual",
        seq=2048,
        hidden=7168,
        experts=256,
        top_k=4,
        residual=True,
        seed=5,
        **_SOFTMAX,
    ),
    _p(
        "upstream-softmax-e128-k4-h3072-t2048-packaff",
        seq=2048,
        hidden=3072,
        unpadded_hidden_size=2880,
        experts=128,
        top_k=4,
        residual=True,
        pack_affinities=True,
        seed=5,
        **_SOFTMAX,
    ),
    _p(
        "upstream-noaux-e256-h7168-t128",
        seq=128,
        hidden=7168,
        experts=256,
        n_group=8,
        topk_group=4,
        top_k=8,
        seed=7,
        **_NOAUX,
    ),
)

__all__ = ["CASES", "HARDWARE", "STRICT", "check_exact", "check_prefill", "prefill_exact"]
