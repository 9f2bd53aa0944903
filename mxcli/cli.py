"""The typer app: the root (the global flags, parsed once, and the one error boundary of every
command) and the registration of the commands, each in its own module under mxcli/commands/
(which only parses, calls the library and prints)."""

from __future__ import annotations

import copy
import functools
import sys
from collections.abc import Callable
from typing import Annotated, Any

import typer

from mxcli import __version__
from mxcli.commands._kernel_flags import Lazy, click_command, each_command, lazy_group
from mxcli.commands._shared import GlobalOptions, global_options
from mxcli.errors import MxcliError, report_exception


def _usage_error_class() -> type[Exception]:
    """click's ``UsageError`` of the click that typer runs, from public API: the base of
    ``typer.BadParameter``. typer >= 0.20 runs a private copy of click (``typer._click``), older
    typer click itself; both may be installed (huggingface_hub brings click), and only the one
    typer runs raises."""
    for cls in typer.BadParameter.__mro__:
        if cls.__name__ == "UsageError":
            return cls
    raise ImportError("typer.BadParameter does not derive from click's UsageError")


_USAGE_ERROR = _usage_error_class()
# typer.Abort: what typer (or, before 0.20, click) raises for an EOF or an unhandled interrupt
_ABORTS: tuple[type[BaseException], ...] = (typer.Abort,)


# The commands in the order of the user's journey: `mxcli --help` lists them so.
JOURNEY = ("prep-weights", "make-inputs", "run-prefill", "run-bwd", "verify", "inspect",
           "profile", "demo", "emulate")  # fmt: skip

# ---- the global flags: declared once (here), parsed once (by click, wherever they stand) ----
# `mxcli --json verify OUT` and `mxcli verify OUT --json` both work: the root declares the flags
# and `RootGroup` gives every command the very same parameters, whose one callback records the
# value in the invocation's `GlobalOptions` (the context object). No command declares them.
GLOBAL_FLAGS = {"json_out": "json", "quiet": "quiet", "debug": "debug"}


def _remember(ctx: typer.Context, param: typer.CallbackParam, value: bool) -> bool:
    if value:
        setattr(global_options(ctx), GLOBAL_FLAGS[str(param.name)], True)
    return value


def _flag(*names: str, help: str, **kw: Any) -> Any:
    # eager: recorded before any other parameter is checked, so that a bad value of one is
    # already reported the way --json asks
    return typer.Option(
        *names, help=help, callback=_remember, expose_value=False, is_eager=True, **kw
    )


Json = Annotated[
    bool, _flag("--json", help="Print a JSON summary on stdout; progress stays on stderr.")
]
Quiet = Annotated[
    bool, _flag("--quiet", "-q", help="No progress bars and no summary (errors still print).")
]
Debug = Annotated[
    bool,
    _flag(
        "--debug",
        help="On an error, show the Python traceback (also MXCLI_DEBUG=1).",
        envvar="MXCLI_DEBUG",
        show_envvar=False,
    ),
]


def _global_flags_to(flags: list[Any]) -> Callable[[Any], None]:
    """Give a command or sub-group the root's global flag parameters (the same objects'
    copies: one declaration, one callback)."""

    def give(cmd: Any) -> None:
        have = {p.name for p in cmd.params}
        cmd.params.extend(copy.copy(p) for p in flags if p.name not in have)

    return give


def _generated() -> dict[str, Lazy]:
    """The commands generated from the registered kernels, built when asked for: make-inputs
    and ``run-<short>`` of each kernel (listed from the kernels' identities, which load no
    kernel: `mxcli --help` imports no torch)."""
    from mxcli.kernels.spec import get_spec, kernel_identities

    def run(short: str) -> Any:
        return click_command(_run.run_command(get_spec(short)), f"run-{short}")

    out = {"make-inputs": Lazy(_make_inputs.DOC, _make_inputs_command)}
    for k in kernel_identities():
        out[f"run-{k.short}"] = Lazy(_run.run_doc(k.name, k.title), functools.partial(run, k.short))
    return out


def _make_inputs_command() -> Any:
    return click_command(_make_inputs.make_command(), "make-inputs")


class RootGroup(lazy_group(JOURNEY, lambda: _generated())):  # type: ignore[misc]
    """The root command: the global flags for every command, and the one error boundary."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        flags = [p for p in self.params if p.name in GLOBAL_FLAGS]
        each_command(self.commands, _global_flags_to(flags))

    def make_context(
        self, info_name: str | None, args: list[str], parent: Any = None, **extra: Any
    ) -> Any:
        extra.setdefault("obj", GlobalOptions())  # one per invocation (also under CliRunner)
        return super().make_context(info_name, args, parent=parent, **extra)

    def invoke(self, ctx: Any) -> Any:
        """Every command runs inside this boundary: a user error becomes one line on stderr
        (and ``{"error", "exit_code"}`` on stdout with --json) and exit code 2, an interrupt one
        line and 130 (128 + the signal); --debug lets the traceback through instead
        (`mxcli.errors.report_exception`). A bug keeps its traceback."""
        opts = global_options(ctx)
        try:
            return super().invoke(ctx)
        except (MxcliError, ValueError, OSError, KeyboardInterrupt) as exc:
            if opts.debug:
                raise
            code = report_exception(exc, json_out=opts.json, interrupt_hint=opts.interrupt_hint)
            if code is None:
                raise
            raise typer.Exit(code) from None


app = typer.Typer(
    name="mxcli",
    cls=RootGroup,
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
    json_out: Json = False,
    quiet: Quiet = False,
    debug: Debug = False,
) -> None:
    """mxcli: MXFP8 MoE kernels for AWS Trainium."""


# Commands are registered below, one line each (mxcli/commands/<name>.py exposes `main`); those
# generated from the kernels (make-inputs, run-<short>) are `_generated`'s, built when asked for.
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
    """Console entry point: the process's streams and signals, then the app (whose root group
    holds the error boundary of the commands). Usage errors become one line on stderr and exit
    code 2; with ``--json`` they are also printed as ``{"error": ..., "exit_code": ...}``."""
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
    opts = GlobalOptions()

    def json_out() -> bool:
        # click's parser rejects an unknown option or a missing value before it processes any
        # flag, --json included: the command line then says what the user asked for
        return opts.json or "--json" in sys.argv[1:]

    try:
        code = app(standalone_mode=False, obj=opts)
    except _USAGE_ERROR as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":  # click >= 8.2; older click prints it
            ctx = getattr(exc, "ctx", None)
            print(ctx.get_help() if ctx is not None else str(exc))
            sys.exit(0)
        report_error(_usage_message(exc), EXIT_USER_ERROR, json_out=json_out())
        sys.exit(EXIT_USER_ERROR)
    except _ABORTS:
        report_error("aborted", 130, json_out=json_out())
        sys.exit(130)
    except MxcliError as exc:  # outside a command body: e.g. listing the kernels for --help
        if opts.debug or "--debug" in sys.argv[1:]:  # --debug: the traceback, as in a command
            raise
        sys.exit(report_exception(exc, json_out=json_out(), interrupt_hint=opts.interrupt_hint))
    except KeyboardInterrupt as exc:  # outside a command body (which reports its own)
        message, code = interrupted_message(exc)
        report_error(message, code, json_out=json_out())
        sys.exit(code)
    code = code if isinstance(code, int) else 0
    late = unreported_interrupt(code)
    if late is not None:
        report_error(late[0], late[1], json_out=json_out())
        code = late[1]
    sys.exit(code)
