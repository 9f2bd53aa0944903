"""``mxcli demo``: the whole journey on built-in tiny checkpoints, in under a minute
(`mxcli.demo`: this module parses, calls and prints)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from mxcli.commands._shared import (
    Force,
    Steps,
    aligned_rows,
    complete_backend,
    global_options,
    print_json,
    stdout_console,
)
from mxcli.demo import MODELS


def demo(
    ctx: typer.Context,
    out: Annotated[
        Path | None,
        typer.Option(
            "--out",
            help="Folder for everything the demo writes, kept (default: a temporary folder, "
            "removed at the end unless --keep).",
            show_default=False,
        ),
    ] = None,
    keep: Annotated[
        bool,
        typer.Option("--keep", help="Keep the temporary folder (without --out) to look at it."),
    ] = False,
    models: Annotated[
        str, typer.Option("--models", help="Comma list of tiny models: qwen3_moe, deepseek_v3.")
    ] = ",".join(MODELS),
    tokens: Annotated[
        int, typer.Option("--tokens", help="Tokens per kernel run: a multiple of 128.")
    ] = 256,
    backend: Annotated[
        str,
        typer.Option(
            "--backend",
            "-b",
            help="Backend of the runs (auto, reference, ...); verified against the reference.",
            autocompletion=complete_backend,
        ),
    ] = "auto",
    force: Force = False,
) -> None:
    """Run the whole journey on tiny built-in models.

    It lists every file written: prep-weights -> make-inputs -> run-prefill -> run-bwd -> verify, for a Qwen3-style (softmax)
    and a DeepSeek-V3-style (noaux_tc) model. Without --out it works in a temporary folder and
    removes it at the end (--keep keeps it); the summary says where it was.
    """

    from mxcli import demo as journey

    opts = global_options(ctx)
    opts.interrupt_hint = journey.INTERRUPT_HINT
    chosen = journey.parse_models(models)
    journey.check_tokens(tokens)
    with Steps(opts.quiet) as steps:
        with steps.counted("mxcli demo", journey.step_count(chosen)) as advance:
            summary = journey.run_demo(
                chosen, tokens=tokens, backend=backend, out=out, keep=keep, force=force,
                advance=advance,
            )  # fmt: skip
    if opts.json:
        print_json(summary)
    elif not opts.quiet:
        _print(summary)
    if not summary["passed"]:
        raise typer.Exit(1)


def _print(summary: dict[str, Any]) -> None:
    import textwrap

    from rich.text import Text

    root, rows, files = summary["out"], summary["steps"], summary["files"]
    passed, removed = summary["passed"], summary["removed"]

    con = stdout_console()
    con.print(Text("mxcli demo", style="bold"), soft_wrap=True)
    # a row per step, its command and detail below it, wrapped at spaces only (a path or a flag
    # is never split, as a table column folding at 80 columns would)
    cells = [[r["model"], r["step"], f"{r['seconds']:.2f} s", "ok" if r["passed"] else "FAIL"]
             for r in rows]  # fmt: skip
    for r, line in zip(rows, aligned_rows(cells, right=frozenset({2})), strict=True):
        con.print(Text("  " + line, style="" if r["passed"] else "red bold"), soft_wrap=True)
        for text, style in ((r["command"], ""), (r["detail"], "dim")):
            for part in textwrap.wrap(str(text), max(con.width, 40), initial_indent="      ",
                                      subsequent_indent="        ", break_long_words=False,
                                      break_on_hyphens=False):  # fmt: skip
                con.print(Text(part, style=style), soft_wrap=True)
    if removed:
        con.print(Text(f"{len(files)} files written under {root}, now removed", style="bold"),
                  soft_wrap=True)  # fmt: skip
        con.print(Text("  (keep them with --keep or --out DIR)"), soft_wrap=True)
    else:
        con.print(f"[bold]files written[/] under {root}:")
        for f in files:
            con.print(f"  {f}")
    con.print("[green bold]demo passed[/]" if passed else "[red bold]demo FAILED[/]")
