"""The typer app: wiring only. Each command lives in its own module under mxcli/commands/."""

from __future__ import annotations

import sys

import typer

from mxcli import __version__

# Newer typer releases carry their own copy of click and raise its exceptions, even when a
# separate click is installed (huggingface_hub, the `hub` extra, brings one); typer < 0.20
# runs on click itself.
try:
    import typer._click.exceptions as _cx
except ImportError:  # pragma: no cover - depends on the installed typer
    import click.exceptions as _cx  # type: ignore[no-redef]

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
from mxcli.commands import demo as _demo  # noqa: E402
from mxcli.commands import inspect as _inspect  # noqa: E402
from mxcli.commands import make_inputs as _make_inputs  # noqa: E402
from mxcli.commands import prep_weights  # noqa: E402
from mxcli.commands import run as _run  # noqa: E402
from mxcli.commands import verify as _verify  # noqa: E402

app.command("make-inputs")(_make_inputs.make_inputs)
app.command("run-prefill")(_run.run_prefill)
app.command("run-bwd")(_run.run_bwd)
app.command("verify")(_verify.verify)
app.command("inspect")(_inspect.inspect)
app.command("demo")(_demo.demo)
app.command("prep-weights")(prep_weights.main)


def main() -> None:
    """Console entry point: usage errors become one line on stderr and exit code 2."""
    try:
        code = app(standalone_mode=False)
    except _cx.NoArgsIsHelpError as exc:
        print(exc.ctx.get_help() if exc.ctx else str(exc))
        sys.exit(0)
    except _cx.UsageError as exc:
        hint = f" (see 'mxcli {exc.ctx.info_name} --help')" if exc.ctx and exc.ctx.parent else ""
        print(f"error: {exc.format_message()}{hint}", file=sys.stderr)
        sys.exit(2)
    except (typer.Abort, KeyboardInterrupt):
        print("error: aborted", file=sys.stderr)
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)
