"""What every command shares: the global options, consoles, progress on stderr, error handling."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Annotated, Any, TypeVar

import typer

from mxcli.errors import report_user_errors

T = TypeVar("T")

# ---- options shared by the commands (typer.Option in Annotated aliases can be reused) ----
Debug = Annotated[bool, typer.Option("--debug", help="On an error, show the Python traceback.")]
Quiet = Annotated[
    bool,
    typer.Option("--quiet", "-q", help="No progress bars and no summary (errors still print)."),
]
Json = Annotated[
    bool, typer.Option("--json", help="Print a JSON summary on stdout; progress stays on stderr.")
]
Force = Annotated[bool, typer.Option("--force", "-f", help="Overwrite existing output files.")]
NoVerifyHashes = Annotated[
    bool,
    typer.Option(
        "--no-verify-hashes",
        help="--weights: skip the sha256 check of the layer file against the manifest (for "
        "huge layers; shapes and padding are still checked).",
    ),
]


@contextlib.contextmanager
def _debug_env(debug: bool) -> Iterator[None]:
    if not debug:
        yield
        return
    old = os.environ.get("MXCLI_DEBUG")
    os.environ["MXCLI_DEBUG"] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("MXCLI_DEBUG", None)
        else:
            os.environ["MXCLI_DEBUG"] = old


def guarded(
    debug: bool, fn: Callable[[], T], *, json_out: bool = False, interrupt_hint: str = ""
) -> T:
    """Run a command body: user errors become one stderr line and exit code 2, an interrupt one
    line and exit code 130 (see `mxcli.errors.report_user_errors`); ``--debug`` lets the
    traceback through instead. With ``json_out`` errors are also printed as JSON on stdout."""
    with _debug_env(debug):
        return report_user_errors(fn, json_out=json_out, interrupt_hint=interrupt_hint)()


def _width(stream: Any) -> int | None:
    """The terminal's width; COLUMNS when set; 160 in pipes and logs (rich reads COLUMNS)."""
    return None if stream.isatty() or os.environ.get("COLUMNS") else 160


def stdout_console() -> Any:
    from rich.console import Console

    return Console(file=sys.stdout, width=_width(sys.stdout), soft_wrap=False)


def stderr_console() -> Any:
    from rich.console import Console

    return Console(file=sys.stderr, width=_width(sys.stderr))


def print_json(data: Any) -> None:
    """JSON on stdout, nothing else on that line (for ``--json``)."""
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")
    sys.stdout.flush()


class Steps:
    """Progress on stderr: one spinner line per step, or a bar for counted work.

    Disabled with ``--quiet`` and when stderr is not a terminal.
    """

    def __init__(self, quiet: bool) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            SpinnerColumn,
            TextColumn,
            TimeElapsedColumn,
        )

        console = stderr_console()
        self.progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=True,
            # a live display needs a terminal; in logs and pipes it would only add blank lines
            disable=quiet or not console.is_terminal,
        )
        self.timings: dict[str, float] = {}

    def __enter__(self) -> Steps:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.progress.__exit__(*exc)

    @contextlib.contextmanager
    def step(self, description: str, key: str | None = None) -> Iterator[None]:
        task = self.progress.add_task(description, total=None)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.timings[key or description] = time.perf_counter() - t0
            self.progress.remove_task(task)

    @contextlib.contextmanager
    def counted(self, description: str, total: int) -> Iterator[Callable[..., None]]:
        """A bar of ``total`` items; the callable shows a label and/or counts one item done:
        ``advance(label)`` names the item now running, ``advance(done=True)`` counts one."""
        task = self.progress.add_task(description, total=total)

        def advance(label: str | None = None, done: bool = False) -> None:
            if label is not None:
                self.progress.update(task, description=f"{description}: {label}")
            if done:
                self.progress.advance(task)

        try:
            yield advance
        finally:
            self.progress.remove_task(task)


def complete_backend(incomplete: str) -> list[str]:
    from mxcli.tensorio import BWD, PREFILL, available_backends

    names = ["auto", *available_backends(PREFILL), *available_backends(BWD)]
    return sorted({n for n in names if n.startswith(incomplete)})
