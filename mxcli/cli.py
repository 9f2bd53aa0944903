"""The typer app: wiring only. Each command lives in its own module under mxcli/commands/."""

from __future__ import annotations

import typer

from mxcli import __version__

app = typer.Typer(
    name="mxcli",
    help="MXFP8 MoE kernels for AWS Trainium: prepare weights, run kernels, verify outputs.",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
)


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(f"mxcli {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version_callback, is_eager=True, help="Print the version."
    ),
) -> None:
    """mxcli: MXFP8 MoE kernels for AWS Trainium."""


# Commands are registered below, one line each (mxcli/commands/<name>.py exposes `main`).
from mxcli.commands import run as _run  # noqa: E402

app.command("run-prefill")(_run.run_prefill)
app.command("run-bwd")(_run.run_bwd)


def main() -> None:
    app()
