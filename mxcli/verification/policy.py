"""Which tolerance applies to which output, and kernel-aware comparison of two output sets.

Profiles (the tolerance a comparison of two runs of the *same* numerics deserves):

- ``strict``: for two emulations of the kernel (reference on CPU vs CUDA, the NKI simulator vs
  the reference, a re-run against a golden file): integer outputs bit-exact, floating outputs to
  the last place of their dtype (fp32 accumulation order, transcendental functions).
- ``hardware``: for a Trainium device against the reference, the upstream tests' tolerances.

Each kernel's rows (output name -> `Tolerance`, per profile) are its own, in its verification
part (``mxcli/kernels/<kernel>/verification.py``: ``STRICT``, ``HARDWARE``), with the spec
section each row implements. An output no row names is bit-exact when integer, else ``ULP``
(``rtol = 2^-7`` per element, ``atol`` 1e-6, cosine >= 0.9999).

A kernel's packed output (`KernelSpec.packed`) is never compared byte by byte (its holes and
pads may be unspecified): it is decoded into its parts (``<name>.codes``, ``.scales``,
``.values``, ``.affinities``), each compared under its own row.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch

from mxcli.kernels.spec import PackedOutput, all_specs, find_spec
from mxcli.verification.compare import (
    EXACT,
    TensorReport,
    Tolerance,
    add_note,
    compare_tensors,
    fail_report,
    missing_report,
)

PROFILES = ("strict", "hardware")

# strict, for floating outputs no row names: the last place of their dtype
ULP = Tolerance("close", rtol=2.0**-7, atol=1e-6, min_cosine=0.9999)


@functools.cache
def _rows(profile: str) -> dict[str, Tolerance]:
    """Output name -> tolerance of `profile`, from every registered kernel's verification part
    (``STRICT`` / ``HARDWARE``)."""
    rows: dict[str, Tolerance] = {}
    for spec in all_specs():
        part = spec.verification()
        if part is not None:
            rows.update(part.HARDWARE if profile == "hardware" else part.STRICT)
    return rows


def profile_for_backend(backend: str) -> str:
    """``hardware`` for the Trainium device backend, ``strict`` for every emulation."""
    return "hardware" if backend == "neuron" else "strict"


def tolerance_for(
    name: str,
    profile: str,
    tensor: torch.Tensor | None = None,
    overrides: Mapping[str, Any] | None = None,
    exact: bool = False,
) -> Tolerance:
    """The tolerance of output ``name`` under ``profile``, with user overrides applied.

    Unknown names: bit-exact for integer tensors, ``strict`` float tolerance otherwise.
    ``overrides`` (rtol, atol, min_cosine, max_mismatch_frac) apply to floating comparisons;
    ``max_mismatch_frac`` applies to bit-exact ones too; ``exact`` makes everything bit-exact.
    """
    tol = _rows("hardware" if profile == "hardware" else "strict").get(name)
    if tol is None:
        is_float = tensor is not None and tensor.is_floating_point()
        tol = ULP if is_float else EXACT
    ov = dict(overrides or {})
    if exact:
        return Tolerance("exact", max_mismatch_frac=ov.get("max_mismatch_frac") or 0.0)
    if tol.kind == "exact":
        return tol.with_overrides(max_mismatch_frac=ov.get("max_mismatch_frac"))
    if tol.kind == "chain" and (ov.get("rtol") is not None or ov.get("atol") is not None):
        # an explicit rtol/atol replaces the model by a plain element-wise bound
        return Tolerance("close", min_cosine=tol.min_cosine).with_overrides(**ov)
    return tol.with_overrides(**ov)


def geometry_args(geometry: Any) -> dict[str, Any]:
    """`compare_outputs`' ``hidden`` and ``num_experts`` from a recorded ``geometry`` (see
    `KernelSpec.geometry`); empty without one."""
    if isinstance(geometry, Mapping) and geometry.get("hidden_size"):
        return {"hidden": int(geometry["hidden_size"]), "num_experts": geometry.get("num_experts")}
    return {}


def compare_outputs(
    kernel: str,
    actual: Mapping[str, torch.Tensor],
    expected: Mapping[str, torch.Tensor],
    kwargs: Mapping[str, Any],
    *,
    profile: str = "strict",
    overrides: Mapping[str, Any] | None = None,
    exact: bool = False,
    check: str = "",
    hidden: int | None = None,
    num_experts: int | None = None,
) -> list[TensorReport]:
    """Compare two output sets of ``kernel`` name by name (the golden is ``expected``)."""
    reports: list[TensorReport] = []
    spec = find_spec(kernel or None)
    packed = spec.packed if spec is not None else None
    order = {n: i for i, n in enumerate(spec.outputs)} if spec is not None else {}
    expected = dict(sorted(expected.items(), key=lambda kv: order.get(kv[0], len(order))))
    for name in expected:
        if name not in actual:
            reports.append(missing_report(name, check, "output"))
    for name in actual:
        if name not in expected:
            reports.append(fail_report(name, check, "not in the golden (unexpected output)"))
    for name, exp in expected.items():
        act = actual.get(name)
        if act is None:
            continue
        if packed is not None and name == packed.name:
            reports.extend(
                _compare_packed(
                    packed,
                    act,
                    exp,
                    kwargs,
                    actual,
                    expected,
                    profile,
                    overrides,
                    exact,
                    check,
                    hidden,
                    num_experts,
                )
            )
            continue
        tol = tolerance_for(name, profile, exp, overrides, exact)
        reports.append(compare_tensors(name, act, exp, tol, check=check))
    return reports


def _compare_packed(
    packed: PackedOutput,
    act: torch.Tensor,
    exp: torch.Tensor,
    kwargs: Mapping[str, Any],
    actual: Mapping[str, torch.Tensor],
    expected: Mapping[str, torch.Tensor],
    profile: str,
    overrides: Mapping[str, Any] | None,
    exact: bool,
    check: str,
    hidden: int | None,
    num_experts: int | None,
) -> list[TensorReport]:
    a_bytes, e_bytes = packed.as_bytes(act), packed.as_bytes(exp)
    if a_bytes.shape != e_bytes.shape:
        return [
            fail_report(
                packed.name,
                check,
                f"row shape {list(a_bytes.shape)} != expected {list(e_bytes.shape)}",
            )
        ]
    H, E = hidden, num_experts  # the kernel's decode reads E only where its rows hold it
    if H is None:
        H, E = packed.geometry(kwargs, exp)
    da = packed.decode(a_bytes, kwargs, H, E)
    de = packed.decode(e_bytes, kwargs, H, E)
    # bytes the API leaves unspecified (`PackedOutput.defined`: holes, pads) are excluded from the comparison and counted
    holes = differ = 0
    if packed.defined is not None:
        keep = packed.defined(kwargs, H, E, int(a_bytes.shape[1]))
        holes = int((~keep).sum()) * int(a_bytes.shape[0])
        differ = int((a_bytes[:, ~keep] != e_bytes[:, ~keep]).sum()) if holes else 0
    out = []
    for i, part in enumerate(packed.parts):
        x, y = getattr(da, part), getattr(de, part)
        if y is None:
            continue
        name = f"{packed.name}.{part}"
        rep = compare_tensors(
            name, x, y, tolerance_for(name, profile, y, overrides, exact), check=check
        )
        if i == 0 and holes:
            add_note(rep, f"{holes} hole/pad bytes not compared ({differ} differ)")
        out.append(rep)
    return out


__all__ = [
    "PROFILES",
    "ULP",
    "compare_outputs",
    "geometry_args",
    "profile_for_backend",
    "tolerance_for",
]
