"""User-facing errors and how the CLI reports them.

Every error a user can cause (bad tensor, bad flag, corrupt file, existing output) is an
`MxcliError`. The CLI prints its message as one line on stderr and exits with code 2; a Python
traceback is shown only with `--debug` (or MXCLI_DEBUG=1, read by that flag). An output that cannot be written (disk
full, read-only folder) is reported the same way: the command could not do its work, and no
partial file is left. Exit code 1 is kept for a check that ran and failed (`verify`, `--strict`).

An interrupt (Ctrl-C, SIGTERM) unwinds like an error, so every temporary file is removed, then
prints one line and exits with 128 + the signal number (130 for Ctrl-C, 143 for SIGTERM).
"""

from __future__ import annotations

import json
import signal
import sys
from typing import Any

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 128 + signal.SIGINT


class MxcliError(Exception):
    """An error caused by the user's input; reported as one line, exit code 2."""


class InputError(MxcliError, ValueError):
    """A tensor or argument has the wrong shape, dtype or value.

    The message names the tensor or argument, the expected and the actual value.
    """


class OutputExistsError(MxcliError, FileExistsError):
    """An output already exists and `--force` was not given."""


class Terminated(KeyboardInterrupt):
    """SIGTERM (or SIGHUP) received: unwinds like Ctrl-C so temporaries are cleaned up."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


# what the console entry point needs to know after typer has turned an interrupt into exit 130
_STATE: dict[str, Any] = {"signal": None, "reported": False}


def raise_terminated(signum: int, _frame: Any) -> None:
    """Signal handler: turn SIGTERM/SIGHUP into a `Terminated` exception in the main thread."""
    _STATE["signal"] = signum
    raise Terminated(signum)


def unreported_interrupt(code: int) -> tuple[str, int] | None:
    """(message, exit code) for an interrupt that no command reported (it came while the
    arguments were parsed: typer turns it into a silent exit 130), else None."""
    if code != EXIT_INTERRUPTED or _STATE["reported"]:
        return None
    signum = _STATE["signal"]
    exc = Terminated(signum) if signum is not None else KeyboardInterrupt()
    return interrupted_message(exc)


def install_signal_handlers() -> None:
    """SIGTERM and SIGHUP raise `Terminated`; SIGINT raises KeyboardInterrupt (Python's default,
    restored here if it was changed). Temporary files are removed as the exception unwinds."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, raise_terminated)


def shape_error(name: str, expected: object, actual: object) -> InputError:
    """`InputError` for a shape mismatch, worded the same everywhere."""
    return InputError(f"{name}: expected shape {expected}, got {actual}")


def dtype_error(name: str, expected: object, actual: object) -> InputError:
    """`InputError` for a dtype mismatch, worded the same everywhere."""
    return InputError(f"{name}: expected dtype {expected}, got {actual}")


def one_line(exc: BaseException) -> str:
    """The message of an error as one line (OS errors as 'path: reason')."""
    if isinstance(exc, OSError) and not isinstance(exc, MxcliError) and exc.strerror:
        where = exc.filename if exc.filename is not None else ""
        text = f"{where}: {exc.strerror}" if where else exc.strerror
    else:
        text = str(exc) or type(exc).__name__
    return " ".join(text.split())


def report_error(message: str, exit_code: int, *, json_out: bool = False) -> None:
    """One line on stderr; with ``--json`` also ``{"error", "exit_code"}`` on stdout."""
    _STATE["reported"] = True
    print(f"error: {message}", file=sys.stderr)
    if json_out:
        sys.stdout.write(json.dumps({"error": message, "exit_code": exit_code}) + "\n")
        sys.stdout.flush()


def interrupted_message(exc: KeyboardInterrupt, hint: str = "") -> tuple[str, int]:
    """(message, exit code) for an interrupt; `hint` says how to continue (``--resume``)."""
    if isinstance(exc, Terminated):
        name, code = signal.Signals(exc.signum).name, 128 + exc.signum
    else:
        name, code = "Ctrl-C", EXIT_INTERRUPTED
    return f"interrupted ({name}); {hint or 'no output was written'}", code


def report_exception(
    exc: BaseException, *, json_out: bool = False, interrupt_hint: str = ""
) -> int | None:
    """Report an error the user caused, or an interrupt, as one line; return its exit code, or
    None for anything else (a bug: it keeps its traceback). The CLI's one error boundary
    (`mxcli.cli`) calls it for every command.

    User errors exit 2: `MxcliError`, a `ValueError` (kernel validation raises `InputError`, a
    `ValueError`) and an `OSError` (a folder given as a file, a full disk). An interrupt prints
    `interrupted_message` (with `interrupt_hint`) and exits 130 (Ctrl-C) or 128 + the signal.
    With `json_out` the error is also printed on stdout as ``{"error": ..., "exit_code": ...}``.
    """
    if isinstance(exc, KeyboardInterrupt):
        message, code = interrupted_message(exc, interrupt_hint)
    elif isinstance(exc, MxcliError | ValueError | OSError):
        message, code = one_line(exc), EXIT_USER_ERROR
    else:
        return None
    report_error(message, code, json_out=json_out)
    return code
