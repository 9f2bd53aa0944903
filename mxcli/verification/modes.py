"""The modes of ``mxcli verify``, one small function each; the command only parses, calls and
prints.

- `files`: ``verify OUT --golden GOLDEN`` and/or ``OUT --inputs IN`` (`mxcli.verification.golden`:
  two output files tensor by tensor, one run against exact math of its inputs).
- `checkpoint`: ``verify --checkpoint OUT --against SRC [--forward] [--hashes-only]``
  (`mxcli.verification.checkpoints`, `mxcli.verification.forward`).
- ``verify --suite quick|full``: the case matrix runs kernels, which sit a floor above this
  package, so its function is `mxcli.runs.verify_suite`; it returns an `Outcome` too.

A mode returns an `Outcome`: the case results, the report's title and the mode's own fields of
the ``--json`` summary, in the order that summary prints them.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mxcli.errors import InputError
from mxcli.verification.report import CaseResult, summary

# a progress step: ``with step("Comparing ..."): ...`` (the CLI shows a spinner)
Step = Callable[[str], AbstractContextManager[Any]]


def _no_step(_description: str) -> AbstractContextManager[Any]:
    return nullcontext()


@dataclass
class Outcome:
    """What a mode found: case results, the report's title, the ``--json`` fields of the mode
    (placed before ``cases``) and warnings for stderr (also in the JSON)."""

    results: list[CaseResult]
    title: str
    fields: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return summary(self.results)["cases_failed"] == 0


@dataclass(frozen=True)
class Tolerances:
    """The golden comparison's tolerance flags: ``--profile`` (auto, strict, hardware),
    overrides of the profile's figures, and ``--exact``. A value out of range is a usage
    error (exit 2), not a failed check (exit 1)."""

    profile: str = "auto"
    rtol: float | None = None
    atol: float | None = None
    min_cosine: float | None = None
    max_mismatch: float | None = None
    exact: bool = False

    def overrides(self) -> dict[str, float | None]:
        return {
            "rtol": _in_range("rtol", self.rtol, 0.0, math.inf),
            "atol": _in_range("atol", self.atol, 0.0, math.inf),
            "min_cosine": _in_range("min_cosine", self.min_cosine, -1.0, 1.0),
            "max_mismatch_frac": _fraction(self.max_mismatch),
        }


def _fraction(v: float | None) -> float | None:
    if v is not None and not 0.0 <= v <= 1.0:
        raise InputError(f"max_mismatch: expected a fraction in [0, 1], got {v}")
    return v


def _in_range(name: str, v: float | None, low: float, high: float) -> float | None:
    if v is not None and not low <= v <= high:  # NaN fails too
        bounds = f">= {low:g}" if high == math.inf else f"in [{low:g}, {high:g}]"
        raise InputError(f"{name}: expected a value {bounds}, got {v}")
    return v


def self_comparison(output: Path, golden: Path | None) -> list[str]:
    """A warning when OUT and GOLDEN are one file, or two files with the same bytes."""
    if golden is None or not output.is_file() or not golden.is_file():
        return []
    same = os.path.samefile(output, golden)
    if not same and output.stat().st_size == golden.stat().st_size:

        def digest(p: Path) -> str:
            with p.open("rb") as fh:
                return hashlib.file_digest(fh, "sha256").hexdigest()

        same = digest(output) == digest(golden)
    if not same:
        return []
    what = "the same file" if os.path.samefile(output, golden) else "identical files (same sha256)"
    return [
        f"{output} and --golden {golden} are {what}: a file compared with itself proves nothing"
    ]


def files(
    output: Path,
    *,
    golden: Path | None = None,
    inputs: Path | None = None,
    tolerances: Tolerances | None = None,
    kernel: str = "mxcli",
    kernel_path: str | None = None,
    step: Step = _no_step,
) -> Outcome:
    """``verify OUT --golden GOLDEN`` and/or ``--inputs IN``: OUT against another run's outputs
    (`compare_files`) and/or against exact math of its inputs (`check_run`). With `kernel`
    other than mxcli, OUT must have been made by that kernel (`recorded_kernel`)."""
    from mxcli.verification.golden import check_run, compare_files, recorded_kernel

    if golden is None and inputs is None:
        raise InputError("verify: give OUT --golden GOLDEN, OUT --inputs IN, or --suite quick|full")
    tolerances = tolerances or Tolerances()
    overrides = tolerances.overrides()
    warnings = self_comparison(output, golden)
    recorded = recorded_kernel(output, kernel, kernel_path)
    title = f"mxcli verify {output}"
    if recorded is not None:
        from mxcli.kernels.selection import describe_line

        title += f" (kernel: {describe_line(recorded)})"
    results = []
    if golden is not None:
        with step(f"Comparing {output} with {golden}"):
            results.append(
                compare_files(
                    output,
                    golden,
                    profile=tolerances.profile,
                    overrides=overrides,
                    exact=tolerances.exact,
                )
            )
        title += f" --golden {golden}"
    if inputs is not None:
        with step(f"Checking {output} against exact math of {inputs}"):
            results.append(check_run(output, inputs))
        title += f" --inputs {inputs}"
    fields = {
        "mode": "files",
        "nki_kernel": recorded,
        "output": str(output),
        "golden": None if golden is None else str(golden),
        "inputs": None if inputs is None else str(inputs),
    }
    return Outcome(results, title, fields, warnings)


def checkpoint(
    out: Path, against: Path, *, forward: bool = False, hashes_only: bool = False
) -> tuple[dict[str, Any], str]:
    """``verify --checkpoint OUT --against SRC``: the report (its ``passed`` covers the
    ``--forward`` logit check too) and its text."""
    from mxcli.verification.checkpoints import format_report, verify_checkpoint

    rep = verify_checkpoint(out, against, hashes_only=hashes_only)
    text = format_report(rep)
    if forward:
        from mxcli.verification.forward import format_forward, forward_check

        rep["forward"] = forward_check(out, against)
        rep["passed"] = bool(rep["passed"] and rep["forward"]["passed"])
        text += "\n" + format_forward(rep["forward"])
    return rep, text


def case_rows(suite: str, pattern: str | None = None) -> Iterator[dict[str, Any]]:
    """``verify --suite S --list``: the cases of suite `suite` matching `pattern`."""
    from mxcli.verification.cases import select

    for c in select(suite, pattern):
        yield {"case": c.name, "kernel": c.kernel, "quick": c.quick, "params": c.params}
