"""Kernel flags generated from the kernels' own tables, so that help and behaviour cannot drift.

A run command's kwarg flags come from its spec's scalar table (`ScalarArg`: flag, help, type,
and the default read from the public signature); make-inputs' and profile's from the kernel's
generator parameters (`InputParam`). typer reads a command's parameters from its function's
signature: `command` builds that signature from such tables (``inspect.Signature`` plus the
``Annotated`` hints typer reads), so one generic function serves every registered kernel.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Optional

import typer

from mxcli.kernels.spec import InputParam, KernelSpec, ScalarArg, show_value


def command(
    fn: Callable[..., Any], name: str, doc: str, params: Sequence[tuple[str, Any, Any]]
) -> Callable[..., Any]:
    """`fn` (which takes ``**kwargs``) presented to typer as a function ``name`` whose
    parameters are `params`: ``(python name, Annotated hint, default)`` in order."""
    sig = inspect.Signature(
        [
            inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, annotation=hint, default=d)
            for n, hint, d in params
        ]
    )

    def wrapper(**kwargs: Any) -> Any:
        return fn(**kwargs)

    wrapper.__name__ = wrapper.__qualname__ = name.replace("-", "_")
    wrapper.__doc__ = doc
    wrapper.__signature__ = sig  # type: ignore[attr-defined]
    wrapper.__annotations__ = {n: hint for n, hint, _ in params}
    return wrapper


def scalar_param(arg: ScalarArg) -> tuple[str, Any, Any]:
    """A run command's flag for kwarg `arg`: unset (None) unless given, so the input file's
    value stands; the help shows the kernel API's default (read from its signature)."""
    t = arg.flag_type
    flag = arg.flag_name
    if t is bool and "/" not in flag:
        flag = f"{flag}/--no-{flag.removeprefix('--')}"
    if arg.file is not None:
        help_ = (
            f"JSON file of {arg.file}; updates the {arg.name} stored in the input file "
            "field by field."
        )
    else:
        help_ = f"{arg.help.rstrip('.')} (kernel API: {arg.shown_default()})."
    option = typer.Option(flag, help=help_, show_default=False)
    return f"k_{arg.name}", Annotated[Optional[t], option], None  # noqa: UP045 (a runtime type)


@dataclass(frozen=True)
class MergedParam:
    """One make-inputs (or profile) flag: the parameter of every kernel that has it."""

    name: str
    owners: dict[str, InputParam]  # kernel short name -> its parameter

    @property
    def first(self) -> InputParam:
        return next(iter(self.owners.values()))

    @property
    def common_default(self) -> tuple[bool, Any]:
        """(whether every kernel has the same default, that default)."""
        values = [p.default for p in self.owners.values()]
        same = all(v == values[0] and type(v) is type(values[0]) for v in values)
        return same, values[0]

    def default_for(self, short: str) -> Any:
        return self.owners[short].default


def merge_params(tables: Sequence[tuple[KernelSpec, Sequence[InputParam]]]) -> list[MergedParam]:
    """The union of the kernels' parameters, in order of first appearance."""
    merged: dict[str, dict[str, InputParam]] = {}
    for spec, params in tables:
        for p in params:
            merged.setdefault(p.name, {})[spec.short] = p
    return [MergedParam(n, owners) for n, owners in merged.items()]


def merged_param(
    m: MergedParam, specs: dict[str, KernelSpec], with_kernels: bool = True
) -> tuple[str, Any, Any]:
    """The typer parameter of a merged flag: one help per distinct text (prefixed by the kernels
    it is theirs when not every kernel has it), the common default or, where the kernels' defaults
    differ, None (each kernel's own then applies; the help lists them), and each kernel API's
    default where the flag is a kwarg of its signature with another default."""
    p = m.first
    groups: dict[str, list[str]] = {}
    for short, q in m.owners.items():
        groups.setdefault(q.help, []).append(short)
    everyone = len(m.owners) == len(specs)
    if len(groups) == 1 and (everyone or not with_kernels):
        help_ = p.help
    else:
        help_ = " ".join(f"{'/'.join(shorts)}: {h}" for h, shorts in groups.items())
    same, default = m.common_default
    if not same:
        default = None
        help_ += (
            " Default: "
            + ", ".join(f"{short} {show_value(q.default)}" for short, q in m.owners.items())
            + "."
        )
    for short, q in m.owners.items():
        spec = specs[short]
        if q.name in spec.scalar_names:
            api = spec.default(q.name)
            if show_value(api) != show_value(q.default):
                where = "the kernel API's" if len(m.owners) == 1 else f"the {short} kernel API's"
                help_ = help_.rstrip(".") + f" ({where} default: {show_value(api)})."
    t = p.value_type
    flag = p.flag_name
    optional = default is None
    hint_t: Any = Optional[t] if optional else t  # noqa: UP045 (a runtime type)
    option = typer.Option(flag, help=help_, show_default=not optional)
    return m.name, Annotated[hint_t, option], default


__all__ = ["MergedParam", "command", "merge_params", "merged_param", "scalar_param"]
