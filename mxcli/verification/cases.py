"""The case matrix of ``mxcli verify --suite quick|full``.

Each case is a seeded input generator call (`mxcli.inputs`). Each kernel lists its own cases
(its verification part's ``CASES``, ``mxcli/kernels/<kernel>/verification.py``): ``quick``
covers every output and every feature path at small shapes (it runs in CI); ``full`` adds the
upstream test shapes that fit a CPU and the remaining feature combinations.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from mxcli.errors import InputError
from mxcli.inputs import KernelInputs, make_inputs
from mxcli.kernels.spec import all_specs

SUITES = ("quick", "full")


@dataclass(frozen=True)
class Case:
    name: str
    kernel: str
    params: dict[str, Any] = field(default_factory=dict)
    quick: bool = False  # also in the quick suite (the full suite runs every case)

    def make(self) -> KernelInputs:
        """The case's seeded inputs (`mxcli.inputs.make_inputs`)."""
        return make_inputs(self.kernel, **self.params)


def all_cases() -> tuple[Case, ...]:
    """Every registered kernel's cases (its verification part's ``CASES``), in spec order."""
    out: list[Case] = []
    for spec in all_specs():
        part = spec.verification()
        if part is not None:
            out.extend(part.CASES)
    return tuple(out)


def __getattr__(name: str) -> Any:
    if name == "CASES":  # read when asked: the kernels' parts sit beside this module
        return all_cases()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def select(
    suite: str,
    pattern: str | None = None,
    kernel: str | None = None,
    cases: Iterable[Case] | None = None,
) -> list[Case]:
    """Cases of ``suite`` (``quick`` or ``full``), optionally filtered by a name substring or
    glob and by kernel."""
    import fnmatch

    if suite not in SUITES:
        raise InputError(f"suite: expected one of {', '.join(SUITES)}, got {suite!r}")
    out = [c for c in (all_cases() if cases is None else cases) if suite == "full" or c.quick]
    if kernel is not None:
        out = [c for c in out if c.kernel == kernel or c.name.startswith(kernel + "/")]
    if pattern:
        pat = pattern if any(ch in pattern for ch in "*?[") else f"*{pattern}*"
        out = [c for c in out if fnmatch.fnmatch(c.name, pat)]
        if not out:
            raise InputError(f"case: no {suite} case matches {pattern!r}")
    return out
