"""The progress callbacks of a prep-weights run (`Reporter`), apart from the runner so that
every writer (the runner, the other stacks' exports, the CLI's rich bar in `progress`) can
take them without importing the runner."""

from __future__ import annotations

from typing import Any

from mxcli.weightprep.plan import Plan


class Reporter:
    """Progress callbacks; the CLI passes one that drives a rich progress bar on stderr."""

    def start(self, plan: Plan, layers: list[int], skipped: list[int]) -> None: ...

    def advance(self, nbytes: int) -> None: ...

    def layer_done(self, layer: int, record: dict[str, Any]) -> None: ...

    def finish(self) -> None: ...
