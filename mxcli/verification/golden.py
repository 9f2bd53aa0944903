"""File-level verification.

- ``verify OUT --golden GOLDEN`` (`compare_files`): two output files, tensor by tensor, plus
  their provenance: the two files must agree on the kernel kwargs and on the sha256 of every
  input (when both record them), since comparing outputs of different inputs proves nothing.
- ``verify OUT --inputs IN`` (`check_run`): one run's outputs against independent exact math of
  its inputs, within the MXFP8 bounds of `mxcli.verification.exact`.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from typing import Any

from mxcli.errors import InputError
from mxcli.io.files import TensorFile, tensor_sha256
from mxcli.io.metadata import INPUTS_FORMAT, OUTPUTS_FORMAT
from mxcli.kernels.spec import all_specs, find_spec, get_spec, read_kernel_file
from mxcli.verification.compare import TensorReport, fail_report, missing_report
from mxcli.verification.exact import CHECK as EXACT_CHECK
from mxcli.verification.exact import check_exact
from mxcli.verification.policy import compare_outputs, geometry_args, profile_for_backend
from mxcli.verification.report import CaseResult
from mxcli.weightprep.padding import repad_bwd_outputs

CHECK = "output vs golden"


def compare_files(
    output: str | os.PathLike[str],
    golden: str | os.PathLike[str],
    *,
    profile: str = "auto",
    overrides: Mapping[str, Any] | None = None,
    exact: bool = False,
) -> CaseResult:
    """Compare output file ``output`` with ``golden``; unreadable files raise ``InputError``."""
    t0 = time.perf_counter()
    out = read_kernel_file(output)
    gold = read_kernel_file(golden)
    if out.kernel and gold.kernel and out.kernel != gold.kernel:
        raise InputError(
            f"{out.path}: outputs of {out.kernel}, but the golden {gold.path} is of {gold.kernel}"
        )
    kernel = gold.kernel or out.kernel
    if kernel is not None and find_spec(kernel) is None:
        raise InputError(f"{gold.path}: unknown kernel {kernel!r} in the metadata")
    for f in (out, gold):
        _require_format(f, OUTPUTS_FORMAT)
    if profile == "auto":
        backends = (str(f.metadata.get("backend")) for f in (out, gold))
        hardware = any(profile_for_backend(b) == "hardware" for b in backends)
        profile = "hardware" if hardware else "strict"

    result = CaseResult(case="golden", kernel=kernel or "-")
    result.info.update(
        output=str(out.path), golden=str(gold.path), profile=profile,
        output_backend=out.metadata.get("backend"), golden_backend=gold.metadata.get("backend"),
    )  # fmt: skip
    result.reports += _provenance(out.metadata, gold.metadata)
    result.reports += padding_reports(out.meta_json("padding"), CHECK)

    kwargs: dict[str, Any] = {}
    geometry: dict[str, Any] = {}
    if kernel is not None:
        kwargs = get_spec(kernel).resolve_kwargs(gold.kwargs)
        geometry = geometry_args(gold.meta_json("geometry") or out.meta_json("geometry"))
    missing: list[str] = []
    if kernel is not None:  # a golden without the kernel's outputs would pass on nothing
        recorded = gold.meta_json("input_sha256") or out.meta_json("input_sha256")
        names = list(recorded) if isinstance(recorded, Mapping) else None
        required = get_spec(kernel).required_outputs(kwargs, names)
        missing = [n for n in required if n not in gold.tensors]
        result.reports += [missing_report(n, CHECK, f"the golden {gold.path}") for n in missing]
    if not gold.tensors:
        result.reports.append(fail_report("(outputs)", CHECK, f"{gold.path} holds no tensors"))
    result.reports += [
        r
        for r in compare_outputs(
            kernel or "",
            out.tensors,
            gold.tensors,
            kwargs,
            profile=profile,
            overrides=overrides,
            exact=exact,
            check=CHECK,
            **geometry,
        )  # fmt: skip
        if r.name not in missing  # reported once, as missing in the golden
    ]
    result.seconds = time.perf_counter() - t0
    return result


def _require_format(f: TensorFile, expected: str) -> None:
    """Refuse an input file given as an output, or the reverse (a usage error, exit 2)."""
    fmt = f.metadata.get("format")
    if fmt is not None and fmt != expected:
        what = {INPUTS_FORMAT: "an input file: ", OUTPUTS_FORMAT: "an output file: "}.get(fmt, "")
        wanted = "an output" if expected == OUTPUTS_FORMAT else "an input"
        raise InputError(f"{f.path}: not {wanted} file ({what}format {fmt!r}, expected {expected})")


def padding_reports(meta: Any, check: str) -> list[Any]:
    """A run on zero-padded weights (metadata ``padding``, `mxcli.weightprep.padding`) must have
    left every gradient's pad rows and columns exactly zero before they were cut off."""
    if not isinstance(meta, Mapping) or not isinstance(meta.get("pad_max_abs"), Mapping):
        return []
    reports: list[Any] = []
    for name, v in sorted(meta["pad_max_abs"].items()):
        ok = float(v) == 0.0
        reports.append(
            TensorReport(
                name=f"{name} (padding)",
                check=check,
                passed=ok,
                tolerance="exact zero",
                max_abs=float(v),
                message="" if ok else f"pad rows/columns hold values up to {float(v):g} (not zero)",
            )  # fmt: skip
        )
    return reports


def _provenance(out: Mapping[str, str], gold: Mapping[str, str]) -> list[Any]:
    reports = []
    for key, what in (("kwargs", "kernel kwargs"), ("input_sha256", "input sha256")):
        a, b = out.get(key), gold.get(key)
        if a is None or b is None:
            continue
        try:
            ja, jb = json.loads(a), json.loads(b)
        except (ValueError, RecursionError):
            ja, jb = a, b
        if ja != jb:
            diff = (
                sorted(k for k in set(ja) | set(jb) if ja.get(k) != jb.get(k))
                if isinstance(ja, dict) and isinstance(jb, dict)
                else []
            )
            detail = f" ({', '.join(diff)})" if diff else ""
            reports.append(fail_report(f"metadata.{key}", CHECK, f"{what} differ{detail}"))
    return reports


def check_run(
    output: str | os.PathLike[str],
    inputs: str | os.PathLike[str],
) -> CaseResult:
    """``verify OUT --inputs IN``: the outputs of a run against independent exact math of its
    inputs (`mxcli.verification.exact`); the input hashes recorded in OUT must match IN."""
    t0 = time.perf_counter()
    out = read_kernel_file(output)
    inp = read_kernel_file(inputs)
    _require_format(out, OUTPUTS_FORMAT)
    _require_format(inp, INPUTS_FORMAT)
    kernel = out.kernel or inp.kernel
    spec = find_spec(kernel)
    if kernel is None or spec is None:
        raise InputError(f"{out.path}: no kernel recorded in the metadata")
    if inp.kernel not in (None, kernel):
        raise InputError(
            f"{inp.path}: inputs of {inp.kernel}, but {out.path} holds {kernel} outputs"
        )
    result = CaseResult(case="exact", kernel=kernel)
    result.info.update(
        output=str(out.path), inputs=str(inp.path), backend=out.metadata.get("backend")
    )
    recorded = out.meta_json("input_sha256")
    if isinstance(recorded, Mapping):
        wrong = sorted(
            k
            for k, h in recorded.items()
            if k in inp.tensors and tensor_sha256(inp.tensors[k]) != h
        )
        missing = sorted(k for k in recorded if k not in inp.tensors)
        if wrong or missing:
            detail = ", ".join(wrong + [f"{m} (missing)" for m in missing])
            result.reports.append(
                fail_report(
                    "metadata.input_sha256",
                    EXACT_CHECK,
                    f"{inp.path} is not the input of {out.path}: {detail}",
                )
            )
            result.seconds = time.perf_counter() - t0
            return result
    # the kwargs the run used (recorded in OUT), else those of the input file
    kwargs = spec.resolve_kwargs(spec.metadata_kwargs(inp.metadata), out.kwargs)
    tensors = dict(inp.tensors)
    # a run must have written every output its kernel returns for these inputs and kwargs
    missing_out = [n for n in spec.required_outputs(kwargs, tensors) if n not in out.tensors]
    result.reports += [missing_report(n, EXACT_CHECK, str(out.path)) for n in missing_out]
    pad_meta = out.meta_json("padding")
    outputs = out.tensors
    if isinstance(pad_meta, Mapping):  # un-padded results: compare at the kernel's sizes
        result.reports += padding_reports(pad_meta, EXACT_CHECK)
        outputs = repad_bwd_outputs(outputs, pad_meta)
    # the other outputs are read through the packed one (the prefill's rows)
    if spec.packed is None or spec.packed.name not in missing_out:
        result.reports += check_exact(kernel, tensors, kwargs, outputs, source=str(inp.path))
    result.seconds = time.perf_counter() - t0
    return result


def recorded_kernel(
    path: str | os.PathLike[str], expected: str = "mxcli", kernel_path: str | None = None
) -> dict[str, Any] | None:
    """The NKI kernel an output file records (``nki_kernel`` in its metadata; None for runs of
    the reference). With `expected` other than mxcli, the file must have been made by that
    kernel (same ``--kernel`` value, and the same module file sha256 when it can be loaded here):
    else a user error naming both."""
    from mxcli.kernels import selection

    f = read_kernel_file(path)
    meta = f.meta_json("nki_kernel")
    info = dict(meta) if isinstance(meta, Mapping) else None
    kernel = f.kernel or all_specs()[0].name  # a file of no recorded kernel: the first's
    choice = selection.parse_implementation(expected, kernel, kernel_path)
    if choice.is_own:
        return info
    if info is None:
        raise InputError(
            f"{path}: records no NKI kernel (a reference run), not --kernel {expected}"
        )
    if info.get("kernel") != choice.label:
        raise InputError(
            f"{path}: was made by kernel {info.get('kernel')}, not --kernel {choice.label}"
        )
    here = selection.describe(choice)
    if info.get("sha256") and here.get("sha256") and info["sha256"] != here["sha256"]:
        raise InputError(
            f"{path}: was made by {info.get('file')} (sha256 {str(info['sha256'])[:12]}), "
            f"--kernel {choice.label} is {here.get('file')} (sha256 {str(here['sha256'])[:12]})"
        )
    return info
