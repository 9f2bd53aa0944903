"""``mxcli verify``: compare an output file with a golden, or run the built-in case matrix.

Exit codes: 0 all checks passed, 1 a check failed, 2 a user error (bad file, flag, backend).
"""

from __future__ import annotations

import enum
import math
from pathlib import Path
from typing import Annotated, Any

import typer

from mxcli.commands._shared import (
    Debug,
    Json,
    Kernel,
    KernelPath,
    Quiet,
    Steps,
    complete_backend,
    guarded,
    print_json,
    stdout_console,
)


class Suite(str, enum.Enum):
    quick = "quick"
    full = "full"


class Profile(str, enum.Enum):
    auto = "auto"
    strict = "strict"
    hardware = "hardware"


def verify(
    output: Annotated[
        Path | None,
        typer.Argument(help="Output .safetensors to check against --golden.", show_default=False),
    ] = None,
    golden: Annotated[
        Path | None,
        typer.Option(
            "--golden",
            "-g",
            help="Golden output file (same kernel and inputs).",
            show_default=False,
        ),
    ] = None,
    inputs: Annotated[
        Path | None,
        typer.Option(
            "--inputs",
            "-i",
            help="Input file of OUT's run: check OUT against "
            "independent exact math within MXFP8 error bounds.",
            show_default=False,
        ),
    ] = None,
    suite: Annotated[
        Suite | None,
        typer.Option(
            "--suite", help="Run the built-in case matrix: quick (CI) or full.", show_default=False
        ),
    ] = None,
    backend: Annotated[
        str,
        typer.Option(
            "--backend",
            "-b",
            help="Backend the suite checks against the reference: auto or a registered backend.",
            autocompletion=complete_backend,
        ),
    ] = "auto",
    kernel: Kernel = "mxcli",
    kernel_path: KernelPath = None,
    device: Annotated[
        str, typer.Option("--device", help="Device of the reference in the suite: cpu or cuda[:N].")
    ] = "cpu",
    case: Annotated[
        str | None,
        typer.Option(
            "--case",
            "-k",
            help="Only suite cases whose name matches (substring or glob).",
            show_default=False,
        ),
    ] = None,
    list_cases: Annotated[
        bool, typer.Option("--list", help="List the suite's cases and exit.")
    ] = False,
    profile: Annotated[
        Profile,
        typer.Option(
            "--profile",
            help="Golden tolerances: strict (emulations), hardware (device "
            "vs reference), auto (hardware when OUT ran on neuron).",
        ),
    ] = Profile.auto,
    rtol: Annotated[
        float | None,
        typer.Option("--rtol", help="Override the relative tolerance.", show_default=False),
    ] = None,
    atol: Annotated[
        float | None,
        typer.Option("--atol", help="Override the absolute tolerance.", show_default=False),
    ] = None,
    min_cosine: Annotated[
        float | None,
        typer.Option(
            "--min-cosine", help="Override the minimum cosine similarity.", show_default=False
        ),
    ] = None,
    max_mismatch: Annotated[
        float | None,
        typer.Option(
            "--max-mismatch",
            help="Fraction of elements allowed out of tolerance.",
            show_default=False,
        ),
    ] = None,
    exact: Annotated[bool, typer.Option("--exact", help="Require every tensor bit-exact.")] = False,
    checkpoint: Annotated[
        Path | None,
        typer.Option(
            "--checkpoint",
            help="A prep-weights or exported weight folder to check against --against SRC: key "
            "coverage per family, shapes, TP/EP divisibility, SQNR / exactness, the manifest's "
            "sha256 of every tensor, and every MXFP8 code and scale byte re-derived from SRC.",
            show_default=False,
        ),
    ] = None,
    against: Annotated[
        Path | None,
        typer.Option(
            "--against", help="The source checkpoint of --checkpoint.", show_default=False
        ),
    ] = None,
    forward: Annotated[
        bool,
        typer.Option(
            "--forward",
            help="With --checkpoint (a compressed-tensors export): also run the exported model "
            "beside the source through transformers and compressed-tensors on fixed tokens and "
            "report the logit error (small models: both are held in memory in float32).",
        ),
    ] = False,
    hashes_only: Annotated[
        bool,
        typer.Option(
            "--hashes-only",
            help="With --checkpoint, for huge models: skip re-deriving the weights from SRC "
            "(no source tensor is read); check keys, shapes and the manifest's sha256 of every "
            "tensor only. A prep-weights folder only (exports record no hashes).",
        ),
    ] = False,
    junit: Annotated[
        Path | None,
        typer.Option(
            "--junit",
            help="Also write a JUnit XML report to this file (an existing one needs --force).",
            show_default=False,
        ),
    ] = None,
    force: Annotated[
        bool, typer.Option("--force", "-f", help="Overwrite an existing --junit report.")
    ] = False,
    json_out: Json = False,
    quiet: Quiet = False,
    debug: Debug = False,
) -> None:
    """Check outputs, or prepared weights, against references.

    OUT --golden GOLDEN, OUT --inputs IN, or --suite quick|full; or a weight folder:
    --checkpoint OUT --against SRC. Per tensor: max abs/rel error, cosine, mismatch count,
    bit-exactness (codes, scales, indices). Exit code 1 when any check fails, 2 on a user error.
    """

    def body() -> int:
        from mxcli.errors import InputError
        from mxcli.fsutil import check_output_path, refuse_inputs

        if checkpoint is not None or against is not None:
            return _checkpoint(checkpoint, against, json_out, quiet, forward, hashes_only)
        if forward:
            raise InputError("verify: --forward needs --checkpoint OUT --against SRC")
        if hashes_only:
            raise InputError("verify: --hashes-only goes with --checkpoint OUT --against SRC")
        if junit is not None:  # before any work: the report must be writable
            check_output_path(junit, force)
            refuse_inputs(
                junit, [("OUT file", output), ("--golden file", golden), ("--inputs file", inputs)]
            )
        if suite is not None and (output is not None or golden is not None or inputs is not None):
            raise InputError("verify: give either OUT with --golden/--inputs, or --suite, not both")
        if suite is None and list_cases:
            raise InputError("verify: --list needs --suite quick|full")
        if suite is not None:
            return _suite(
                suite.value, backend, device, case, list_cases, junit, force, json_out, quiet,
                kernel, kernel_path,
            )  # fmt: skip
        if output is None or (golden is None and inputs is None):
            raise InputError(
                "verify: give OUT --golden GOLDEN, OUT --inputs IN, or --suite quick|full"
            )
        overrides = {
            "rtol": _in_range("rtol", rtol, 0.0, math.inf),
            "atol": _in_range("atol", atol, 0.0, math.inf),
            "min_cosine": _in_range("min_cosine", min_cosine, -1.0, 1.0),
            "max_mismatch_frac": _fraction(max_mismatch),
        }
        warnings = _self_comparison(output, golden)
        return _files(
            output, golden, inputs, profile.value, overrides, exact, junit, force, json_out,
            quiet, warnings, kernel, kernel_path,
        )  # fmt: skip

    code = guarded(debug, body, json_out=json_out)
    if code:
        raise typer.Exit(code)


def _checkpoint(
    checkpoint: Path | None,
    against: Path | None,
    json_out: bool,
    quiet: bool,
    forward: bool,
    hashes_only: bool,
) -> int:
    """``verify --checkpoint OUT --against SRC [--forward] [--hashes-only]``
    (`mxcli.verification.checkpoints`, `mxcli.verification.forward`)."""
    from mxcli.errors import InputError
    from mxcli.verification.checkpoints import format_report, verify_checkpoint

    if checkpoint is None or against is None:
        raise InputError("verify: --checkpoint OUT needs --against SRC (and the other way round)")
    rep = verify_checkpoint(checkpoint, against, hashes_only=hashes_only)
    text = format_report(rep)
    if forward:
        from mxcli.verification.forward import format_forward, forward_check

        rep["forward"] = forward_check(checkpoint, against)
        rep["passed"] = bool(rep["passed"] and rep["forward"]["passed"])
        text += "\n" + format_forward(rep["forward"])
    if json_out:
        print_json(rep)
    elif not quiet or not rep["passed"]:
        typer.echo(text)
    return 0 if rep["passed"] else 1


def _fraction(v: float | None) -> float | None:
    from mxcli.errors import InputError

    if v is not None and not 0.0 <= v <= 1.0:
        raise InputError(f"max_mismatch: expected a fraction in [0, 1], got {v}")
    return v


def _in_range(name: str, v: float | None, low: float, high: float) -> float | None:
    """A tolerance flag: a bad value is a usage error (exit 2), not a failed check (exit 1)."""
    from mxcli.errors import InputError

    if v is not None and not low <= v <= high:  # NaN fails too
        bounds = f">= {low:g}" if high == math.inf else f"in [{low:g}, {high:g}]"
        raise InputError(f"{name}: expected a value {bounds}, got {v}")
    return v


def _self_comparison(output: Path, golden: Path | None) -> list[str]:
    """A warning when OUT and GOLDEN are one file, or two files with the same bytes."""
    import hashlib
    import os

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


def _report(
    results: list[Any],
    *,
    title: str,
    junit: Path | None,
    force: bool,
    json_out: bool,
    quiet: bool,
    warnings: list[str] | None = None,
    **extra: Any,
) -> int:
    import sys

    from mxcli.verification.report import render_table, summary, to_json, write_junit

    if junit is not None:
        write_junit(results, junit, force=force)
    for w in warnings or []:
        print(f"warning: {w}", file=sys.stderr)
    if json_out:
        print_json(to_json(results, **extra, warnings=list(warnings or [])))
    elif not quiet:
        render_table(results, stdout_console(), title=title)
        if junit is not None:
            stdout_console().print(f"JUnit report: {junit}")
    return 1 if summary(results)["cases_failed"] else 0


def _suite(
    suite: str,
    backend: str,
    device: str,
    pattern: str | None,
    list_cases: bool,
    junit: Path | None,
    force: bool,
    json_out: bool,
    quiet: bool,
    nki_kernel: str = "mxcli",
    kernel_path: str | None = None,
) -> int:
    from mxcli.kernels import selection
    from mxcli.runs import resolve_backends, resolve_device, run_suite
    from mxcli.verification.cases import select

    cases = select(suite, pattern)
    if list_cases:
        if json_out:
            print_json(
                [
                    {"case": c.name, "kernel": c.kernel, "quick": c.quick, "params": c.params}
                    for c in cases
                ]
            )
        else:
            for c in cases:
                typer.echo(c.name)
        return 0
    resolve_device(device)
    names = resolve_backends(backend, cases)
    kernels = sorted({c.kernel for c in cases})
    for k in kernels:  # a non-default kernel needs a backend that runs NKI kernels
        selection.backend_kwargs(
            selection.parse_implementation(nki_kernel, k, kernel_path), names[k], k
        )
    choices = selection.resolve_for(nki_kernel, kernels, kernel_path)
    described = {
        k: selection.describe(c)
        for k, c in choices.items()
        if isinstance(c, selection.ImplementationChoice)
    }
    with Steps(quiet) as steps, steps.counted(f"verify --suite {suite}", len(cases)) as advance:

        def on_case(case: Any, result: Any) -> None:
            advance(case.name, done=result is not None)

        results = run_suite(cases, backend, device=device, on_case=on_case, nki_kernel=choices)
    title = f"mxcli verify --suite {suite} (backend: {', '.join(sorted(set(names.values())))})"
    if nki_kernel != selection.MXCLI or any(n in ("sim", "neuron") for n in names.values()):
        title += "; " + "; ".join(
            f"kernel: {selection.describe_line(info)}" for info in described.values()
        )
    reads = [f"{r.case}: {line}" for r in results for line in r.info.get("uninit_reads", ())]
    return _report(
        results,
        title=title,
        junit=junit,
        force=force,
        json_out=json_out,
        quiet=quiet,
        mode="suite",
        suite=suite,
        backends=names,
        device=device,
        nki_kernels=described,
        uninit_reads=reads,
        warnings=[f"never-written memory read at {line}" for line in reads],
    )


def _files(
    output: Path,
    golden: Path | None,
    inputs: Path | None,
    profile: str,
    overrides: dict[str, Any],
    exact: bool,
    junit: Path | None,
    force: bool,
    json_out: bool,
    quiet: bool,
    warnings: list[str],
    nki_kernel: str = "mxcli",
    kernel_path: str | None = None,
) -> int:
    from mxcli.verification.golden import check_run, compare_files, recorded_kernel

    recorded = recorded_kernel(output, nki_kernel, kernel_path)
    results = []
    title = f"mxcli verify {output}"
    if recorded is not None:
        from mxcli.kernels.selection import describe_line

        title += f" (kernel: {describe_line(recorded)})"
    with Steps(quiet) as steps:
        if golden is not None:
            with steps.step(f"Comparing {output} with {golden}"):
                results.append(
                    compare_files(output, golden, profile=profile, overrides=overrides, exact=exact)
                )
            title += f" --golden {golden}"
        if inputs is not None:
            with steps.step(f"Checking {output} against exact math of {inputs}"):
                results.append(check_run(output, inputs))
            title += f" --inputs {inputs}"
    return _report(
        results,
        title=title,
        junit=junit,
        force=force,
        json_out=json_out,
        quiet=quiet,
        warnings=warnings,
        mode="files",
        nki_kernel=recorded,
        output=str(output),
        golden=None if golden is None else str(golden),
        inputs=None if inputs is None else str(inputs),
    )
