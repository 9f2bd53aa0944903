"""Progress on stderr: a rich bar over the source bytes, and one line per finished layer."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from mxcli.weightprep.plan import Plan
from mxcli.weightprep.reporter import Reporter


class RichReporter(Reporter):
    """Bar over the bf16 bytes of the layers to convert; a line per layer with its throughput.

    The bar shows only on a terminal (in a pipe or a log it would print its last frame), and
    it shrinks to the terminal's width; the layer lines are short and never wrapped by rich.
    """

    def __init__(self, console: Console | None = None) -> None:
        from mxcli.streams import rich_console

        self.console = console or rich_console(stderr=True, highlight=False)
        self.progress: Progress | None = None
        self.task: Any = None
        self.plan: Plan | None = None
        self._t = time.perf_counter()

    def start(self, plan: Plan, layers: list[int], skipped: list[int]) -> None:
        self.plan = plan
        if skipped:
            self.console.print(f"resume: {len(skipped)} layer(s) already complete, skipped")
        self.progress = Progress(
            TextColumn("[bold]prep-weights[/] {task.description}"),
            BarColumn(bar_width=None),  # takes what the other columns leave
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            console=self.console,
            transient=True,
            expand=True,
            disable=not self.console.is_terminal,
        )
        self.progress.start()
        total = plan.source_bf16_bytes * len(layers)
        self.task = self.progress.add_task(f"0/{len(layers)} layers", total=total)
        self._n, self._total_layers = 0, len(layers)
        self._t = time.perf_counter()

    def advance(self, nbytes: int) -> None:
        if self.progress is not None:
            self.progress.advance(self.task, nbytes)

    def layer_done(self, layer: int, record: dict[str, Any]) -> None:
        assert self.plan is not None
        self._n += 1
        secs = max(float(record.get("seconds") or 0.0), 1e-9)
        if self.progress is not None:
            self.progress.update(self.task, description=f"{self._n}/{self._total_layers} layers")
        from mxcli.memory import human_bytes

        size = self.plan.source_bf16_bytes
        msg = f"layer {layer}: {human_bytes(size)} in {secs:.1f} s"
        if not record.get("check"):  # with --check the time includes the check: no rate
            msg += f", {human_bytes(size / secs)}/s"
        if record.get("check"):
            from mxcli.weightprep.check import summarize

            s = summarize(record["check"])
            sq = [v["sqnr_db"] for v in s.values() if v.get("sqnr_db") is not None]
            exact = all(v["exact"] for k, v in s.items() if "_mxfp8" not in k)
            msg += f"; bf16/router {'exact' if exact else 'MISMATCH'}"
            if sq:
                msg += f", SQNR >= {min(sq):.1f} dB"
        # soft_wrap: rich never breaks the line itself (it fits 80 columns up to layer 999)
        (self.progress.console if self.progress else self.console).print(msg, soft_wrap=True)

    def finish(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None
