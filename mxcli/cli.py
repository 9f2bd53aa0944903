"""The typer app: wiring only. Each command lives in its own module under mxcli/commands/."""

from __future__ import annotations

import importlib
import sys
from typing import Any

import typer

from mxcli import __version__
from mxcli.commands._shared import journey_group


def _exception_classes(name: str) -> tuple[type[BaseException], ...]:
    """`name` from every click flavour present: typer >= 0.20 raises the exceptions of its own
    vendored copy (``typer._click``), older typer raises click's. Both may be installed (click
    comes with huggingface_hub, for one), so catch from both."""
    found = []
    for module in ("typer._click.exceptions", "click.exceptions"):
        try:
            cls = getattr(importlib.import_module(module), name, None)
        except ImportError:
            continue
        if isinstance(cls, type) and issubclass(cls, BaseException):
            found.append(cls)
    return tuple(found)


_NO_ARGS_IS_HELP = _exception_classes("NoArgsIsHelpError")
_USAGE_ERRORS = _exception_classes("UsageError")
_ABORTS: tuple[type[BaseException], ...] = (typer.Abort, *_exception_classes("Abort"))

# The commands in the order of the user's journey: `mxcli --help` lists them so.
JOURNEY = ("prep-weights", "make-inputs", "run-prefill", "run-bwd", "verify", "inspect",
           "profile", "demo", "emulate")  # fmt: skip

app = typer.Typer(
    name="mxcli",
    cls=journey_group(JOURNEY),
    help="MXFP8 MoE kernels for AWS Trainium: prepare weights, run kernels, verify outputs.\n\n"
    "In journey order: prep-weights, make-inputs, run-prefill / run-bwd, verify; inspect and "
    "profile look inside; demo runs it all on tiny models; emulate measures what MXFP8 does "
    "to a training loss.",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    # click's plain help layout: option names are never truncated and flags show no metavar,
    # which rich's option table does in an 80-column terminal (``--routed-scaling-…  <bool>``)
    rich_markup_mode=None,
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
from mxcli.commands import emulate as _emulate  # noqa: E402
from mxcli.commands import inspect as _inspect  # noqa: E402
from mxcli.commands import make_inputs as _make_inputs  # noqa: E402
from mxcli.commands import prep_weights  # noqa: E402
from mxcli.commands import profile as _profile  # noqa: E402
from mxcli.commands import run as _run  # noqa: E402
from mxcli.commands import verify as _verify  # noqa: E402
from mxcli.commands._shared import PlainCommand  # noqa: E402

app.command("prep-weights", cls=PlainCommand)(prep_weights.main)
app.command("make-inputs", cls=PlainCommand)(_make_inputs.make_command())
for _name, _command in _run.commands():  # run-prefill, run-bwd, ...: one per registered kernel
    app.command(_name, cls=PlainCommand)(_command)
app.command("verify", cls=PlainCommand)(_verify.verify)
app.command("inspect", cls=PlainCommand)(_inspect.inspect)
app.command("emulate", cls=PlainCommand)(_emulate.emulate)
app.add_typer(_profile.app, name="profile")
app.command("demo", cls=PlainCommand)(_demo.demo)


def _usage_message(exc: Any) -> str:
    """A usage error as one line, with the failing command's --help as the hint (the whole
    command path: ``mxcli profile prefill --help``)."""
    ctx = getattr(exc, "ctx", None)
    names = []
    while ctx is not None:
        names.append(ctx.info_name if ctx.parent is not None else "mxcli")
        ctx = ctx.parent
    hint = f" (see '{' '.join(reversed(names))} --help')" if names else ""
    return " ".join(exc.format_message().split()) + hint


def main() -> None:
    """Console entry point: usage errors become one line on stderr and exit code 2; with
    ``--json`` they are also printed as ``{"error": ..., "exit_code": ...}`` on stdout."""
    from mxcli.errors import (
        EXIT_USER_ERROR,
        install_signal_handlers,
        interrupted_message,
        report_error,
        unreported_interrupt,
    )
    from mxcli.streams import guard_std_streams

    guard_std_streams()  # a closed or broken stdout is neither a failed check nor a traceback
    install_signal_handlers()
    json_out = "--json" in sys.argv[1:]
    try:
        code = app(standalone_mode=False)
    except _NO_ARGS_IS_HELP as exc:
        ctx = getattr(exc, "ctx", None)
        print(ctx.get_help() if ctx is not None else str(exc))
        sys.exit(0)
    except _USAGE_ERRORS as exc:
        report_error(_usage_message(exc), EXIT_USER_ERROR, json_out=json_out)
        sys.exit(EXIT_USER_ERROR)
    except _ABORTS:
        report_error("aborted", 130, json_out=json_out)
        sys.exit(130)
    except KeyboardInterrupt as exc:  # outside a command body (which reports its own)
        message, code = interrupted_message(exc)
        report_error(message, code, json_out=json_out)
        sys.exit(code)
    code = code if isinstance(code, int) else 0
    late = unreported_interrupt(code)
    if late is not None:
        report_error(late[0], late[1], json_out=json_out)
        code = late[1]
    sys.exit(code)
