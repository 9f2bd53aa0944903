"""Independent exact math: the reference's outputs against each kernel's *intended* function.

The checks themselves are the kernels' (their verification part, `VerificationPart.check_exact`,
in ``mxcli/kernels/<kernel>/verification.py``): they do not reuse the references' numerics but
recompute the intended function in float64 and bound the difference by the MXFP8 error the
kernel's spec allows. This module names the check and dispatches to the kernel's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from mxcli.errors import InputError
from mxcli.kernels.spec import get_spec
from mxcli.verification.compare import TensorReport

CHECK = "reference vs exact"
F64 = torch.float64


def check_exact(
    kernel: str,
    inputs: Mapping[str, torch.Tensor],
    kwargs: Mapping[str, Any],
    outputs: Mapping[str, torch.Tensor],
    *,
    weights: Mapping[str, torch.Tensor] | None = None,
    source: str = "inputs",
) -> list[TensorReport]:
    """The reference's outputs of `kernel` against its independent exact math.

    `weights`: what the kernel's check needs besides the input file (e.g. the bf16 weights
    behind pre-quantized ones); `source` names the inputs in its errors."""
    spec = get_spec(kernel)
    part = spec.verification()
    if part is None:
        raise InputError(f"kernel: {spec.name} has no exact check ({spec.package}.verification)")
    reports: list[TensorReport] = part.check_exact(inputs, kwargs, outputs, weights, source)
    return reports


__all__ = ["CHECK", "F64", "check_exact"]
