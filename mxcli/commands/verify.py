"""``mxcli verify``: compare an output file with a golden, or run the built-in case matrix.

Exit codes: 0 all checks passed, 1 a check failed, 2 a user error (bad file, flag, backend).
Each mode is a function of `mxcli.verification.modes` (``--suite``: `mxcli.runs.verify_suite`);
this module parses the flags, calls one of them and prints its report.
"""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer

from mxcli.commands._shared import (
    GlobalOptions,
    Kernel,
    KernelPath,
    Steps,
    complete_backend,
    force_option,
    global_options,
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
    ctx: typer.Context,
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
    force: Annotated[bool, force_option("Overwrite an existing --junit report.")] = False,
) -> None:
    """Check outputs, or prepared weights, against references.

    OUT --golden GOLDEN, OUT --inputs IN, or --suite quick|full; or a weight folder:
    --checkpoint OUT --against SRC. Per tensor: max abs/rel error, cosine, mismatch count,
    bit-exactness (codes, scales, indices). Exit code 1 when any check fails, 2 on a user error.
    """
    from mxcli.errors import InputError

    opts = global_options(ctx)
    if checkpoint is not None or against is not None:
        if checkpoint is None or against is None:
            raise InputError(
                "verify: --checkpoint OUT needs --against SRC (and the other way round)"
            )
        _exit(_checkpoint(checkpoint, against, forward, hashes_only, opts))
    if forward:
        raise InputError("verify: --forward needs --checkpoint OUT --against SRC")
    if hashes_only:
        raise InputError("verify: --hashes-only goes with --checkpoint OUT --against SRC")
    if junit is not None:  # before any work: the report must be writable
        from mxcli.fsutil import check_output_path, refuse_inputs

        check_output_path(junit, force)
        refuse_inputs(
            junit, [("OUT file", output), ("--golden file", golden), ("--inputs file", inputs)]
        )
    if suite is not None and (output is not None or golden is not None or inputs is not None):
        raise InputError("verify: give either OUT with --golden/--inputs, or --suite, not both")
    if suite is None and list_cases:
        raise InputError("verify: --list needs --suite quick|full")
    if suite is not None and list_cases:
        _list(suite.value, case, opts)
        return
    if suite is not None:
        _exit(_report(_suite(suite.value, backend, device, case, kernel, kernel_path, opts),
                      junit, force, opts))  # fmt: skip
    if output is None or (golden is None and inputs is None):
        raise InputError("verify: give OUT --golden GOLDEN, OUT --inputs IN, or --suite quick|full")
    from mxcli.verification import modes

    tolerances = modes.Tolerances(
        profile=profile.value, rtol=rtol, atol=atol, min_cosine=min_cosine,
        max_mismatch=max_mismatch, exact=exact,
    )  # fmt: skip
    with Steps(opts.quiet) as steps:
        outcome = modes.files(
            output, golden=golden, inputs=inputs, tolerances=tolerances, kernel=kernel,
            kernel_path=kernel_path, step=steps.step,
        )  # fmt: skip
    _exit(_report(outcome, junit, force, opts))


def _exit(code: int) -> NoReturn:
    raise typer.Exit(code)


def _checkpoint(
    checkpoint: Path, against: Path, forward: bool, hashes_only: bool, opts: GlobalOptions
) -> int:
    from mxcli.verification.modes import checkpoint as check

    rep, text = check(checkpoint, against, forward=forward, hashes_only=hashes_only)
    if opts.json:
        print_json(rep)
    elif not opts.quiet or not rep["passed"]:
        typer.echo(text)
    return 0 if rep["passed"] else 1


def _list(suite: str, pattern: str | None, opts: GlobalOptions) -> None:
    from mxcli.verification.modes import case_rows

    rows = list(case_rows(suite, pattern))
    if opts.json:
        print_json(rows)
    else:
        for row in rows:
            typer.echo(row["case"])


def _suite(
    suite: str,
    backend: str,
    device: str,
    pattern: str | None,
    kernel: str,
    kernel_path: str | None,
    opts: GlobalOptions,
) -> Any:
    from mxcli.runs import verify_suite
    from mxcli.verification.cases import select

    cases = select(suite, pattern)
    with (
        Steps(opts.quiet) as steps,
        steps.counted(f"verify --suite {suite}", len(cases)) as advance,
    ):

        def on_case(case: Any, result: Any) -> None:
            advance(case.name, done=result is not None)

        return verify_suite(
            suite, cases, backend=backend, device=device, kernel=kernel,
            kernel_path=kernel_path, on_case=on_case,
        )  # fmt: skip


def _report(outcome: Any, junit: Path | None, force: bool, opts: GlobalOptions) -> int:
    """The outcome's report: its table (or JSON), warnings on stderr, the JUnit file; the exit
    code (1 when a case failed)."""
    import sys

    from mxcli.verification.report import render_table, to_json, write_junit

    if junit is not None:
        write_junit(outcome.results, junit, force=force)
    for w in outcome.warnings:
        print(f"warning: {w}", file=sys.stderr)
    if opts.json:
        print_json(to_json(outcome.results, **outcome.fields, warnings=list(outcome.warnings)))
    elif not opts.quiet:
        render_table(outcome.results, stdout_console(), title=outcome.title)
        if junit is not None:
            stdout_console().print(f"JUnit report: {junit}")
    return 0 if outcome.passed else 1
