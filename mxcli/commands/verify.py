"""``mxcli verify``: compare an output file with a golden, or run the built-in case matrix.

Exit codes: 0 all checks passed, 1 a check failed, 2 a user error (bad file, flag, backend).
"""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Annotated, Any

import typer

from mxcli.commands._shared import (
    Debug,
    Json,
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
    junit: Annotated[
        Path | None,
        typer.Option(
            "--junit", help="Also write a JUnit XML report to this file.", show_default=False
        ),
    ] = None,
    json_out: Json = False,
    quiet: Quiet = False,
    debug: Debug = False,
) -> None:
    """Verify kernel outputs: OUT --golden GOLDEN, OUT --inputs IN, or --suite quick|full.

    Per tensor: max abs/rel error, cosine, mismatch count, bit-exactness (codes, scales,
    indices). Exit code 1 when any check fails, 2 on a user error.
    """

    def body() -> int:
        from mxcli.errors import InputError

        if suite is not None and (output is not None or golden is not None or inputs is not None):
            raise InputError("verify: give either OUT with --golden/--inputs, or --suite, not both")
        if suite is None and list_cases:
            raise InputError("verify: --list needs --suite quick|full")
        if suite is not None:
            return _suite(suite.value, backend, device, case, list_cases, junit, json_out, quiet)
        if output is None or (golden is None and inputs is None):
            raise InputError(
                "verify: give OUT --golden GOLDEN, OUT --inputs IN, or --suite quick|full"
            )
        overrides = {
            "rtol": rtol,
            "atol": atol,
            "min_cosine": min_cosine,
            "max_mismatch_frac": _fraction(max_mismatch),
        }
        return _files(
            output, golden, inputs, profile.value, overrides, exact, junit, json_out, quiet
        )

    code = guarded(debug, body)
    if code:
        raise typer.Exit(code)


def _fraction(v: float | None) -> float | None:
    from mxcli.errors import InputError

    if v is not None and not 0.0 <= v <= 1.0:
        raise InputError(f"max_mismatch: expected a fraction in [0, 1], got {v}")
    return v


def _report(
    results: list[Any], *, title: str, junit: Path | None, json_out: bool, quiet: bool, **extra: Any
) -> int:
    from mxcli.verification.report import render_table, summary, to_json, write_junit

    if junit is not None:
        write_junit(results, junit)
    if json_out:
        print_json(to_json(results, **extra))
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
    json_out: bool,
    quiet: bool,
) -> int:
    from mxcli.tensorio import resolve_device
    from mxcli.verification.cases import select
    from mxcli.verification.suite import resolve_backends, run_suite

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
    with Steps(quiet) as steps, steps.counted(f"verify --suite {suite}", len(cases)) as advance:

        def on_case(case: Any, result: Any) -> None:
            advance(case.name, done=result is not None)

        results = run_suite(cases, backend, device=device, on_case=on_case)
    title = f"mxcli verify --suite {suite} (backend: {', '.join(sorted(set(names.values())))})"
    return _report(
        results,
        title=title,
        junit=junit,
        json_out=json_out,
        quiet=quiet,
        mode="suite",
        suite=suite,
        backends=names,
        device=device,
    )


def _files(
    output: Path,
    golden: Path | None,
    inputs: Path | None,
    profile: str,
    overrides: dict[str, Any],
    exact: bool,
    junit: Path | None,
    json_out: bool,
    quiet: bool,
) -> int:
    from mxcli.verification.golden import check_run, compare_files

    results = []
    title = f"mxcli verify {output}"
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
        json_out=json_out,
        quiet=quiet,
        mode="files",
        output=str(output),
        golden=None if golden is None else str(golden),
        inputs=None if inputs is None else str(inputs),
    )
