"""Which tolerance applies to which output, and kernel-aware comparison of two output sets.

Profiles (the tolerance a comparison of two runs of the *same* numerics deserves):

- ``strict``: for two emulations of the kernel (reference on CPU vs CUDA, the NKI simulator vs
  the reference, a re-run against a golden file). Codes, scale bytes and indices must be
  bit-exact; floating outputs may differ by the last place of their dtype (fp32 accumulation
  order, transcendental functions): ``rtol = 2^-7`` per element, ``atol`` 1e-6, cosine >= 0.9999.
  Weight gradients accumulate in bf16 over blocks, so their bound is ``rtol = 2^-5`` with an
  absolute floor of ``2^-8 * max|golden|``. Outputs downstream of dG/dU (the hidden-state,
  gate/up weight and bias gradients) pass through the P1 matmul, a bf16 rounding and an MX
  quantization: they follow the ``chain`` model of `mxcli.verification.mxchain` (2 bf16 ulps,
  at most 1% of the elements one step further, bounded by ``2^-3 * max|golden|``: one E4M3 code
  step is at most 2^-3 of its group's largest magnitude).
- ``hardware``: for a Trainium device against the reference, the upstream test tolerances
  (prefill spec §7, bwd spec §11.3): at most 1% of codes and scale bytes may flip, dequantized
  values within ``5e-2 * max`` for 99% of elements, indices on at least 95% of the tokens,
  affinities cosine >= 0.98 (0.93 for NOAUX_TC) and within ``5e-2 * max + 1e-3`` for 95%; every
  bwd output cosine >= 0.99, normalised L2 <= 0.7 and within ``0.5 * max``.

A kernel's packed output (`KernelSpec.packed`: ``norm_quant_packed``) is never compared byte by
byte (its holes and pads are unspecified, prefill spec §4.2): it is decoded into ``.codes``
(bit-exact), ``.scales`` (bit-exact), ``.values`` (dequantized) and, with ``pack_affinities``,
``.affinities``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from mxcli.kernels.spec import PackedOutput, find_spec
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

_ULP = Tolerance("close", rtol=2.0**-7, atol=1e-6, min_cosine=0.9999)
_WGRAD = Tolerance("close", rtol=2.0**-5, atol_of_max=2.0**-8, min_cosine=0.9999)
# mxchain model; the ulp floor 2^-8 * max keeps _WGRAD's floor (bf16 accumulation over blocks)
_CHAIN = Tolerance(
    "chain", ulps=2.0, atol_of_max=2.0**-8, step_of_max=2.0**-3, max_mismatch_frac=0.01,
    min_cosine=0.9999,
)  # fmt: skip

_STRICT: dict[str, Tolerance] = {
    "norm_quant_packed.codes": EXACT,
    "norm_quant_packed.scales": EXACT,
    "norm_quant_packed.values": Tolerance("close", min_cosine=0.99999),
    "norm_quant_packed.affinities": _ULP,
    "expert_index": EXACT,
    "expert_affinities": _ULP,
    "output_residual": _ULP,
    "norm_bf16": _ULP,
    "hidden_states_grad": _CHAIN,
    "expert_affinities_masked_grad": _ULP,
    "gate_up_proj_weight_grad": _CHAIN,
    "down_proj_weight_grad": _WGRAD,
    "gate_and_up_proj_bias_grad": _CHAIN,
    "down_proj_bias_grad": _WGRAD,
}

_UPSTREAM_BWD = Tolerance("close", rtol=1e-3, atol_of_max=0.5, min_cosine=0.99, max_norm_l2=0.7)
_HW_AFF = Tolerance("close", atol=1e-3, atol_of_max=5e-2, min_cosine=0.98, max_mismatch_frac=0.05)

_HARDWARE: dict[str, Tolerance] = {
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
    "hidden_states_grad": _UPSTREAM_BWD,
    "expert_affinities_masked_grad": _UPSTREAM_BWD,
    "gate_up_proj_weight_grad": _UPSTREAM_BWD,
    "down_proj_weight_grad": _UPSTREAM_BWD,
    "gate_and_up_proj_bias_grad": _UPSTREAM_BWD,
    "down_proj_bias_grad": _UPSTREAM_BWD,
}


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
    table = _HARDWARE if profile == "hardware" else _STRICT
    tol = table.get(name)
    if tol is None:
        is_float = tensor is not None and tensor.is_floating_point()
        tol = _ULP if is_float else EXACT
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
    H, E = hidden, (num_experts if kwargs.get("pack_affinities") else None)
    if H is None:
        H, E = packed.geometry(kwargs, exp)
    da = packed.decode(a_bytes, kwargs, H, E)
    de = packed.decode(e_bytes, kwargs, H, E)
    # bytes the API leaves unspecified (scale-region holes, the row pad; prefill spec §4.2)
    # are excluded from the comparison and counted
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


__all__ = ["PROFILES", "compare_outputs", "geometry_args", "profile_for_backend", "tolerance_for"]
