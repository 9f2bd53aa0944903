"""What every command shares: the global options, consoles, progress on stderr, error handling."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Annotated, Any

import typer
from typer.core import TyperCommand, TyperGroup


# ---- the global options: declared and parsed once, by the root (mxcli.cli) ----
@dataclasses.dataclass
class GlobalOptions:
    """What the root's global flags asked for (``--json``, ``--quiet``, ``--debug``), given
    before or after the command's name, and what an interrupt of this command should tell the
    user. One object per invocation, carried by click's context (``ctx.obj``) from the root to
    every command; the root's error boundary reads it."""

    json: bool = False
    quiet: bool = False
    debug: bool = False
    interrupt_hint: str = ""


def global_options(ctx: Any) -> GlobalOptions:
    """The invocation's `GlobalOptions` (a fresh one for a command run without the root)."""
    found = ctx.find_object(GlobalOptions)
    return found if found is not None else ctx.ensure_object(GlobalOptions)


def force_option(help: str = "Overwrite existing output files.") -> Any:
    """``-f/--force``, declared here only: a command that writes an output takes it, with a
    help naming what it replaces; a command that writes nothing has none."""
    return typer.Option("--force", "-f", help=help)


Force = Annotated[bool, force_option()]
NoVerifyHashes = Annotated[
    bool,
    typer.Option(
        "--no-verify-hashes",
        help="--weights: skip the sha256 check of the layer file against the manifest (for "
        "huge layers; shapes and padding are still checked).",
    ),
]
# the NKI kernel the sim / neuron backends run (mxcli.kernels.selection)
Kernel = Annotated[
    str,
    typer.Option(
        "--kernel",
        help="NKI kernel for --backend sim/neuron: mxcli (its own), nkilib (AWS's NKI Library) "
        "or MODULE:FUNCTION (any kernel with the API reference's signature).",
    ),
]
KernelPath = Annotated[
    str | None,
    typer.Option(
        "--kernel-path",
        help="Folder put first on the import path for --kernel nkilib / MODULE:FUNCTION.",
        show_default=False,
    ),
]


def _width(stream: Any) -> int | None:
    """The terminal's width; COLUMNS when set; 160 in pipes and logs (rich reads COLUMNS)."""
    return None if stream.isatty() or os.environ.get("COLUMNS") else 160


def stdout_console() -> Any:
    from mxcli.streams import rich_console

    return rich_console(file=sys.stdout, width=_width(sys.stdout), soft_wrap=False)


def stderr_console() -> Any:
    from mxcli.streams import rich_console

    return rich_console(file=sys.stderr, width=_width(sys.stderr))


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

        from mxcli.streams import spinner_name

        console = stderr_console()
        self.progress = Progress(
            SpinnerColumn(spinner_name()),
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
    from mxcli.kernels.spec import all_specs
    from mxcli.runs import available_backends

    names = ["auto", *(n for spec in all_specs() for n in available_backends(spec.name))]
    return sorted({n for n in names if n.startswith(incomplete)})


# ---- help layout ----
def _plain_argument_name(param: Any) -> str:
    """An argument as a conventional usage line names it: ``SOURCE``, or ``{prefill|bwd}`` for a
    choice (typer 0.29 writes ``{source}`` for a required argument and adds ``<str>``)."""
    if param.metavar:
        return str(param.metavar)
    desc = getattr(param, "type_descriptor", None)
    choices = getattr(desc, "choices", None) or getattr(
        getattr(param, "type", None), "choices", None
    )
    if choices:
        return "{" + "|".join(str(getattr(c, "value", c)) for c in choices) + "}"
    return str(param.name).upper()


_NB_HYPHEN = "\u2011"  # stands in for "-" while click wraps help text


# click's formatter, reached through the public ``Context.formatter_class`` (click >= 8.0): typer
# >= 0.20 runs its own private copy of click (``typer._click``), older typer runs click itself,
# and a subclass of the class the context really uses is right for both
_ClickFormatter: Any = typer.Context.formatter_class


class _HelpFormatter(_ClickFormatter):  # type: ignore[misc]
    """click's formatter, except that lines never break at a hyphen: ``run-prefill`` and
    ``--weights`` stay whole (the wrapper breaks only at spaces)."""

    def write_usage(self, prog: str, args: str = "", prefix: str | None = None) -> None:
        super().write_usage(prog.replace("-", _NB_HYPHEN), args.replace("-", _NB_HYPHEN), prefix)

    def write_text(self, text: str) -> None:
        super().write_text(text.replace("-", _NB_HYPHEN))

    def write_dl(self, rows: Any, *args: Any, **kwargs: Any) -> None:
        rows = [(a.replace("-", _NB_HYPHEN), b.replace("-", _NB_HYPHEN)) for a, b in rows]
        super().write_dl(rows, *args, **kwargs)

    def getvalue(self) -> str:
        return super().getvalue().replace(_NB_HYPHEN, "-")


class _Context(typer.Context):
    formatter_class = _HelpFormatter


class PlainCommand(TyperCommand):
    """click's conventional help: ``Usage: mxcli prep-weights [OPTIONS] SOURCE [OUTPUT]``,
    and the Arguments rows named as in the usage line."""

    context_class = _Context

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for p in self.params:  # error messages then say 'SOURCE', as the usage line does
            if p.param_type_name == "argument" and p.metavar is None:
                name = _plain_argument_name(p)
                if not name.startswith("{"):
                    p.metavar = name

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        for p in self.get_params(ctx):
            if p.param_type_name != "argument":
                continue
            name = _plain_argument_name(p)
            name = name if p.required else f"[{name}]"
            pieces.append(name + ("..." if p.nargs != 1 else ""))
        return pieces

    def format_options(self, ctx: Any, formatter: Any) -> None:
        args, opts = [], []
        for p in self.get_params(ctx):
            rv = p.get_help_record(ctx)
            if rv is None:
                continue
            if p.param_type_name == "argument":
                args.append((_plain_argument_name(p), rv[1]))
            else:
                opts.append(rv)
        for title, rows in (("Arguments", args), ("Options", opts)):
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)


# ---- output layout: lines that fit the terminal, never cut inside a name or a number ----
# the dtype names of the safetensors format (as the README's I/O contract writes them)
_ST_DTYPE = {
    "bfloat16": "BF16", "float16": "F16", "float32": "F32", "float64": "F64",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "float8_e8m0fnu": "F8_E8M0",
    "int8": "I8", "int16": "I16", "int32": "I32", "int64": "I64", "uint8": "U8",
    "uint16": "U16", "uint32": "U32", "uint64": "U64", "bool": "BOOL",
}  # fmt: skip
HASH_DIGITS = 12  # hex digits of a sha256 shown on screen (--json has all 64)


def st_dtype(name: str) -> str:
    """A torch dtype name (``bfloat16``) as safetensors names it (``BF16``), for the screen."""
    return _ST_DTYPE.get(name.removeprefix("torch."), name)


def shape_text(shape: Any) -> str:
    return "[" + ", ".join(str(n) for n in shape) + "]"


def wrap_items(head: str, items: list[str], width: int, indent: int = 4) -> list[str]:
    """``head`` then the items separated by ", ", wrapped only between items; continuation
    lines are indented by `indent`."""
    lines: list[str] = []
    cur = head
    for i, item in enumerate(items):
        piece = item + ("," if i < len(items) - 1 else "")
        if cur.strip() and len(cur) + 1 + len(piece) > width and cur != head:
            lines.append(cur)
            cur = " " * indent + piece
        else:
            cur = f"{cur} {piece}" if cur else piece
    lines.append(cur)
    return lines


def kernel_lines(prefix: str, info: Any, width: int) -> list[str]:
    """``prefix`` and the line naming an NKI kernel (`mxcli.kernels.selection.describe_line`),
    wrapped to `width` between its parenthesised items (file, sha256, version)."""
    from mxcli.kernels.selection import describe_line

    line = prefix + describe_line(info)
    head, sep, rest = line.partition(" (")
    if len(line) <= width or not sep:
        return [line]
    items = ("(" + rest).split(", ")
    indent = len(prefix) - len(prefix.lstrip()) + 4
    if len(head) + len(items[0]) + 2 > width:  # the file on a line of its own
        return [head, *wrap_items(" " * (indent - 1), items, width, indent=indent)]
    return wrap_items(head, items, width, indent=indent)


def aligned_rows(rows: list[list[str]], right: frozenset[int] = frozenset()) -> list[str]:
    """Rows of cells as aligned text columns (two spaces apart; `right` columns right-aligned)."""
    if not rows:
        return []
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ).rstrip()
        for r in rows
    ]


def print_rows(
    con: Any,
    header: list[str],
    rows: list[list[str]],
    *,
    right: frozenset[int] = frozenset(),
    indent: int = 0,
    title: str | None = None,
) -> None:
    """A table as aligned columns when it fits the console; otherwise each row as its first
    cell on a line of its own and the other cells (``header value``) wrapped below it. No cell
    is ever cut or wrapped inside. The rows are indented by `indent`, the title is not."""
    from rich.text import Text

    pad = " " * indent
    if title:
        con.print(Text(title, style="bold"), soft_wrap=True)
    lines = aligned_rows([header, *rows], right)
    if all(len(pad) + len(line) <= con.width for line in lines):
        con.print(Text(pad + lines[0], style="bold"), soft_wrap=True)
        for line in lines[1:]:
            con.print(Text(pad + line), soft_wrap=True)
        return
    for row in rows:
        con.print(Text(pad + row[0]), soft_wrap=True)
        items = [f"{h} {v}" for h, v in zip(header[1:], row[1:], strict=True)]
        for line in wrap_items(pad + "   ", items, con.width, indent=len(pad) + 4):
            con.print(Text(line), soft_wrap=True)


def journey_group(order: tuple[str, ...]) -> type:
    """A command group that lists its commands in `order` (the user's journey) in --help,
    whether they are commands or sub-groups (typer lists the groups last)."""

    class JourneyGroup(TyperGroup):
        context_class = _Context

        def list_commands(self, ctx: Any) -> list[str]:
            names = list(self.commands)  # the names only: generated ones are built when invoked
            return sorted(names, key=lambda n: order.index(n) if n in order else len(order))

    return JourneyGroup
