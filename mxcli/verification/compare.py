"""Tensor-by-tensor comparison: error statistics, tolerances, pass/fail.

Every comparison yields a :class:`TensorReport` with the maximum absolute and relative error,
the cosine similarity, the number of mismatching elements and whether the two tensors are
bit-identical. A :class:`Tolerance` decides pass or fail:

- ``exact``: the stored bits must be equal (codes, scale bytes, indices, block plans); at most
  ``max_mismatch_frac`` of the elements may differ.
- ``close``: element ``i`` passes when ``|a_i - b_i| <= atol + atol_of_max * max|b| + rtol * |b_i|``
  and the NaN/Inf positions agree; at most ``max_mismatch_frac`` of the elements may fail, the
  cosine similarity must reach ``min_cosine`` and the normalised L2 error
  ``|a - b| / (|a| + |b|)`` must stay under ``max_norm_l2`` when those are set.
- ``chain``: the tolerance model of results that pass through an fp32 matmul, a bf16 rounding
  and an MX quantization (`mxcli.verification.mxchain`): every element within ``ulps`` bf16 ulps
  (ulp floor ``atol_of_max * max|b|``), except at most ``max_mismatch_frac`` of them, which may
  be one step further, bounded by ``step_of_max * max|b|``; cosine and L2 as for ``close``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from mxcli.verification.mxchain import ChainTolerance, compare_chain


@dataclass(frozen=True)
class Tolerance:
    kind: str = "close"  # "exact" | "close"
    rtol: float = 0.0
    atol: float = 0.0
    atol_of_max: float = 0.0
    min_cosine: float | None = None
    max_norm_l2: float | None = None
    max_mismatch_frac: float = 0.0
    ulps: float = 0.0  # chain: bf16 ulps for every element
    step_of_max: float = 0.0  # chain: bound of one step for max_mismatch_frac of them

    def describe(self) -> str:
        if self.kind == "exact":
            text = "bit-exact"
        elif self.kind == "chain":
            text = f"{self.ulps:g} bf16 ulps"
            if self.max_mismatch_frac:
                text += f", {self.max_mismatch_frac:.0%} 1 step <= {self.step_of_max:.3g}*max"
            if self.min_cosine is not None:
                text += f", cos>={self.min_cosine:.6g}"
            return text
        else:
            parts = []
            if self.rtol:
                parts.append(f"rtol {self.rtol:.3g}")
            if self.atol:
                parts.append(f"atol {self.atol:.3g}")
            if self.atol_of_max:
                parts.append(f"atol {self.atol_of_max:.3g}*max")
            if self.min_cosine is not None:
                parts.append(f"cos>={self.min_cosine:.6g}")
            if self.max_norm_l2 is not None:
                parts.append(f"l2<={self.max_norm_l2:.3g}")
            text = ", ".join(parts) or "equal values"
        if self.max_mismatch_frac:
            text += f", <= {self.max_mismatch_frac:.3g} mismatching"
        return text

    def with_overrides(self, **kw: Any) -> Tolerance:
        return replace(self, **{k: v for k, v in kw.items() if v is not None})


EXACT = Tolerance("exact")


@dataclass
class TensorReport:
    """The comparison of one tensor (or one decoded part of it, like ``norm_quant_packed.codes``)."""

    name: str
    check: str
    passed: bool
    tolerance: str
    shape: list[int] = field(default_factory=list)
    dtype: str = ""
    numel: int = 0
    max_abs: float | None = None
    max_rel: float | None = None
    cosine: float | None = None
    mismatches: int = 0
    bit_exact: bool = False
    message: str = ""

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("max_abs", "max_rel", "cosine"):
            v = d[k]
            if v is not None and not math.isfinite(v):
                d[k] = str(v)
        return d


def _bits(t: torch.Tensor) -> torch.Tensor:
    """An integer view of the stored bits (same element count)."""
    t = t.detach().cpu().contiguous()
    size = t.element_size()
    if t.dtype == torch.bool:
        return t.to(torch.uint8)
    if t.is_floating_point() or t.dtype in (torch.uint16, torch.uint32, torch.uint64):
        as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]
        return t.view(as_int)
    return t


def _values(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu()
    if t.dtype in (torch.uint16, torch.uint32, torch.uint64):
        return t.to(torch.int64).to(torch.float64)
    return t.to(torch.float64)


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def compare_tensors(
    name: str,
    actual: torch.Tensor,
    expected: torch.Tensor,
    tol: Tolerance,
    *,
    check: str = "",
    mask: torch.Tensor | None = None,
) -> TensorReport:
    """Compare ``actual`` with ``expected`` (the golden) under ``tol``.

    ``mask`` (bool, broadcastable to the shape) restricts the comparison to some elements, for
    example the tokens without near-ties in the router check.
    """
    rep = TensorReport(
        name=name,
        check=check,
        passed=False,
        tolerance=tol.describe(),
        shape=list(expected.shape),
        dtype=_dtype_name(expected),
        numel=expected.numel(),
    )
    if tuple(actual.shape) != tuple(expected.shape):
        rep.message = f"shape {list(actual.shape)} != expected {list(expected.shape)}"
        return rep
    if actual.dtype != expected.dtype:
        rep.message = f"dtype {_dtype_name(actual)} != expected {_dtype_name(expected)}"
        if tol.kind == "exact":
            return rep

    same_bits = actual.dtype == expected.dtype and bool(torch.equal(_bits(actual), _bits(expected)))
    rep.bit_exact = same_bits
    a = _values(actual).reshape(-1)
    b = _values(expected).reshape(-1)
    if mask is not None:
        m = torch.broadcast_to(mask.detach().cpu().bool(), expected.shape).reshape(-1)
        a, b = a[m], b[m]
        rep.numel = int(m.sum())
        rep.message = f"{rep.numel} of {expected.numel()} elements compared"
    if rep.numel == 0:
        rep.passed = True
        return rep

    finite = torch.isfinite(a) & torch.isfinite(b)
    # NaN/Inf must sit at the same places with the same values (NaN == NaN here)
    nonfinite_bad = (~finite) & ~((torch.isnan(a) & torch.isnan(b)) | (a == b))
    diff = (a - b).abs().where(finite, torch.zeros_like(a))
    bmax = float(b[finite].abs().max()) if bool(finite.any()) else 0.0
    rep.max_abs = float(diff.max()) if bool(finite.any()) else 0.0
    floor = max(bmax / 1024.0, 1e-30)
    rep.max_rel = float((diff / b.abs().clamp_min(floor)).max()) if bool(finite.any()) else 0.0
    af, bf = a[finite], b[finite]
    na, nb = float(af.norm()), float(bf.norm())
    if na == 0.0 and nb == 0.0:
        rep.cosine = 1.0
        norm_l2 = 0.0
    else:
        rep.cosine = float((af @ bf) / (na * nb + 1e-12))
        norm_l2 = float((af - bf).norm()) / (na + nb + 1e-12)
    if nonfinite_bad.any():
        add_note(rep, f"{int(nonfinite_bad.sum())} NaN/Inf mismatch(es)")

    chain = None
    if tol.kind == "chain":
        chain = compare_chain(
            a.where(finite, b),
            b,
            tol.step_of_max * bmax,
            ChainTolerance(tol.ulps, tol.atol_of_max or 2.0**-12, tol.max_mismatch_frac),
        )
        rep.mismatches = chain.stepped + chain.beyond + int(nonfinite_bad.sum())
    elif tol.kind == "exact":
        if mask is None:
            bad = _bits(actual).reshape(-1) != _bits(expected).reshape(-1)
        else:
            bad = (_bits(actual).reshape(-1) != _bits(expected).reshape(-1))[m]
        rep.mismatches = int(bad.sum())
        if rep.mismatches and mask is None:
            first = int(torch.nonzero(bad)[0])
            where = tuple(int(i) for i in torch.unravel_index(torch.tensor(first), expected.shape))
            got, want = actual.reshape(-1)[first], expected.reshape(-1)[first]
            add_note(
                rep, f"first mismatch at {list(where)}: {_item(got)} != expected {_item(want)}"
            )
    else:
        allowed = tol.atol + tol.atol_of_max * bmax + tol.rtol * b.abs()
        bad = ((diff > allowed) & finite) | nonfinite_bad
        rep.mismatches = int(bad.sum())

    ok = rep.mismatches <= math.floor(tol.max_mismatch_frac * rep.numel)
    if chain is not None:
        ok = chain.passed and not bool(nonfinite_bad.any())
        if chain.beyond:
            add_note(rep, f"{chain.beyond} element(s) beyond one step")
    if tol.kind != "exact":
        if tol.min_cosine is not None and rep.cosine < tol.min_cosine:
            ok = False
            add_note(rep, f"cosine {rep.cosine:.6f} < {tol.min_cosine}")
        if tol.max_norm_l2 is not None and norm_l2 > tol.max_norm_l2:
            ok = False
            add_note(rep, f"normalised L2 {norm_l2:.4g} > {tol.max_norm_l2}")
    if rep.mismatches and not ok:
        add_note(rep, f"{rep.mismatches} of {rep.numel} elements out of tolerance")
    rep.passed = ok
    return rep


def _item(t: torch.Tensor) -> str:
    """One element as text: integers as is, floats with their bits' value."""
    t = t.detach().cpu()
    if t.dtype in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool):
        return str(int(t))
    return f"{float(t.to(torch.float64)):.6g}"


def add_note(rep: TensorReport, text: str) -> None:
    """Append ``text`` (when not empty) to the report's message."""
    if text:
        rep.message = f"{rep.message}; {text}" if rep.message else text


def missing_report(name: str, check: str, where: str) -> TensorReport:
    return TensorReport(
        name=name, check=check, passed=False, tolerance="-", message=f"missing in {where}"
    )


def fail_report(name: str, check: str, message: str) -> TensorReport:
    return TensorReport(name=name, check=check, passed=False, tolerance="-", message=message)
