"""User-facing errors and how the CLI reports them.

Every error a user can cause (bad tensor, bad flag, corrupt file, existing output) is an
`MxcliError`. The CLI prints its message as one line on stderr and exits with code 2; a Python
traceback is shown only with `--debug` (or MXCLI_DEBUG=1).
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import Any, TypeVar

EXIT_USER_ERROR = 2

F = TypeVar("F", bound=Callable[..., Any])


class MxcliError(Exception):
    """An error caused by the user's input; reported as one line, exit code 2."""


class InputError(MxcliError, ValueError):
    """A tensor or argument has the wrong shape, dtype or value.

    The message names the tensor or argument, the expected and the actual value.
    """


class OutputExistsError(MxcliError, FileExistsError):
    """An output already exists and `--force` was not given."""


def shape_error(name: str, expected: object, actual: object) -> InputError:
    """`InputError` for a shape mismatch, worded the same everywhere."""
    return InputError(f"{name}: expected shape {expected}, got {actual}")


def dtype_error(name: str, expected: object, actual: object) -> InputError:
    """`InputError` for a dtype mismatch, worded the same everywhere."""
    return InputError(f"{name}: expected dtype {expected}, got {actual}")


def debug_enabled() -> bool:
    return os.environ.get("MXCLI_DEBUG", "") not in ("", "0")


def report_user_errors(func: F) -> F:
    """Decorator for command functions: user errors become one stderr line and exit code 2.

    `ValueError` raised by kernel validation is a user error too (kernels raise `InputError`,
    a `ValueError`). Anything else is a bug and keeps its traceback.
    """

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except (MxcliError, ValueError, FileNotFoundError, PermissionError) as exc:
            if debug_enabled():
                raise
            msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            print(f"error: {msg}", file=sys.stderr)
            import typer

            raise typer.Exit(EXIT_USER_ERROR) from None

    return wrapper  # type: ignore[return-value]
