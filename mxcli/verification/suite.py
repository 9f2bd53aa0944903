"""``verify --suite``: for every case, generate inputs, run the backend, compare with the
reference, and check the reference against independent exact math (`mxcli.verification.exact`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from mxcli.errors import MxcliError
from mxcli.tensorio import (
    BWD,
    PREFILL,
    geometry_metadata,
    kernel_io,
    resolve_backend,
    resolve_kwargs,
    run_kernel,
)
from mxcli.verification.cases import Case
from mxcli.verification.exact import check_bwd, check_prefill
from mxcli.verification.policy import compare_outputs, geometry_args, profile_for_backend
from mxcli.verification.report import CaseResult


def resolve_backends(backend: str, cases: Sequence[Case]) -> dict[str, str]:
    """The concrete backend per kernel of ``cases``; raises a user error if one cannot run."""
    return {
        kernel: resolve_backend(kernel, backend) for kernel in sorted({c.kernel for c in cases})
    }


def run_case(
    case: Case, backend: str, *, device: str = "cpu", nki_kernel: Any = None
) -> CaseResult:
    """One case: inputs, reference (on ``device``), backend vs reference, reference vs exact.

    ``nki_kernel``: the NKI kernel the sim / neuron backend runs (`mxcli.kernels.selection`); a
    combination it refuses marks the case skipped ("not supported by this kernel")."""
    from mxcli.kernels.selection import KernelUnsupportedError

    result = CaseResult(case=case.name, kernel=case.kernel)
    t0 = time.perf_counter()
    try:
        inputs = case.make()
        io = kernel_io(case.kernel)
        kwargs = resolve_kwargs(io, inputs.kwargs)
        ref = run_kernel(case.kernel, inputs.tensors, kwargs, backend="reference", device=device)
        result.info["reference_s"] = round(ref.seconds, 4)
        geometry = geometry_args(geometry_metadata(case.kernel, inputs.tensors).get("geometry"))
        if backend != "reference":
            try:
                got = run_kernel(
                    case.kernel, inputs.tensors, kwargs, backend=backend, nki_kernel=nki_kernel
                )
            except KernelUnsupportedError as exc:
                result.skipped = f"not supported by this kernel: {exc}"
                result.seconds = time.perf_counter() - t0
                return result
            result.info[f"{backend}_s"] = round(got.seconds, 4)
            if got.nki_kernel is not None:
                result.info["nki_kernel"] = got.nki_kernel.get("kernel")
            if got.uninit_reads:
                result.info["uninit_reads"] = got.uninit_reads
            result.reports += compare_outputs(
                case.kernel, got.outputs, ref.outputs, kwargs,
                profile=profile_for_backend(backend), check=f"{backend} vs reference", **geometry,
            )  # fmt: skip
        else:
            result.info["note"] = "backend is the reference: only the exact-math check applies"
        if case.kernel == PREFILL:
            result.reports += check_prefill(inputs.tensors, kwargs, ref.outputs)
        else:
            result.reports += check_bwd(
                inputs.tensors, kwargs, ref.outputs, inputs.extras["weights"]
            )
    except MxcliError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    except Exception as exc:  # a backend bug fails its case, not the whole suite
        result.error = f"{type(exc).__name__}: {exc}"
        result.info["traceback"] = _traceback()
    result.seconds = time.perf_counter() - t0
    return result


def _traceback() -> str:
    import traceback

    return traceback.format_exc(limit=8)


def run_suite(
    cases: Sequence[Case],
    backend: str = "auto",
    *,
    device: str = "cpu",
    on_case: Callable[[Case, CaseResult | None], None] | None = None,
    nki_kernel: Any = None,
) -> list[CaseResult]:
    """Run ``cases`` on ``backend`` (``auto`` allowed) with the NKI kernel ``nki_kernel``
    (``mxcli``, ``nkilib``, ``MODULE:FUNCTION``); ``on_case`` is told before and after each."""
    names = resolve_backends(backend, cases)
    results = []
    for case in cases:
        if on_case is not None:
            on_case(case, None)
        # a mapping (`mxcli.kernels.selection.resolve_for`): per kernel a choice, or the reason
        # the chosen implementation cannot run that kernel's cases
        choice = nki_kernel.get(case.kernel) if isinstance(nki_kernel, dict) else nki_kernel
        if isinstance(choice, str) and choice.startswith("not "):
            res = CaseResult(case=case.name, kernel=case.kernel, skipped=choice)
        else:
            res = run_case(case, names[case.kernel], device=device, nki_kernel=choice)
        res.info["backend"] = names[case.kernel]
        results.append(res)
        if on_case is not None:
            on_case(case, res)
    return results


__all__ = ["BWD", "PREFILL", "resolve_backends", "run_case", "run_suite"]
