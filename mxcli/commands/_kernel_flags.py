"""Kernel flags generated from the kernels' own tables, so that help and behaviour cannot drift;
the commands that carry them are built only when asked for (`LazyCommands`).

A run command's kwarg flags come from its spec's scalar table (`ScalarArg`: flag, help, type,
and the default read from the public signature); make-inputs' and profile's from the kernel's
generator parameters (`InputParam`). typer reads a command's parameters from its function's
signature: `command` builds that signature from such tables (``inspect.Signature`` plus the
``Annotated`` hints typer reads), so one generic function serves every registered kernel.

Building them needs the kernels' specs, hence torch; `mxcli --help` and the commands that need
no kernel do not: their group lists the generated commands from `Lazy` entries (name and help,
from `mxcli.kernels.spec.kernel_identities`, which loads no kernel) and builds one when it is
invoked or its own ``--help`` is asked for.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Optional

import typer

from mxcli.commands._shared import PlainCommand, journey_group
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


# ---- commands built when asked for ----
@dataclass(frozen=True)
class Lazy:
    """A generated command of a group: its help (what the group's ``--help`` lists: built from
    the same function as the command's own help, from what a kernel's identity says) and how to
    build it (reading the kernel's spec)."""

    help: str
    build: Callable[[], Any]  # -> the click command


def click_command(fn: Callable[..., Any], name: str) -> Any:
    """The click command typer makes of `fn` (a `command` or any typer function) as ``name``,
    with the CLI's plain help layout (`PlainCommand`)."""
    t = typer.Typer(add_completion=False, rich_markup_mode=None, pretty_exceptions_enable=False)
    t.command(name, cls=PlainCommand)(fn)
    return typer.main.get_command(t)


class LazyCommands(MutableMapping[str, Any]):
    """A group's commands (click's ``Group.commands``), the generated ones built on first access:
    ``mxcli run-bwd`` builds run-bwd alone, ``mxcli --help`` and ``mxcli verify`` none. The
    names are the generated ones (in `lazy`'s order), then the others. `hooks` run on each
    command as it is built (the root's global flags)."""

    def __init__(self, commands: Mapping[str, Any], lazy: Callable[[], dict[str, Lazy]]) -> None:
        self.built: dict[str, Any] = dict(commands)
        self._lazy = lazy
        self._pending: dict[str, Lazy] | None = None
        self._names: list[str] | None = None
        self.hooks: list[Callable[[Any], None]] = []

    def _entries(self) -> dict[str, Lazy]:
        if self._pending is None:
            self._pending = {n: e for n, e in self._lazy().items() if n not in self.built}
            self._names = [*self._pending, *self.built]
        return self._pending

    def __getitem__(self, name: str) -> Any:
        if name in self.built:
            return self.built[name]
        cmd = self._entries()[name].build()  # KeyError: no such command
        del self._entries()[name]
        self.built[name] = cmd
        for hook in self.hooks:
            hook(cmd)
        return cmd

    def __setitem__(self, name: str, cmd: Any) -> None:
        self.built[name] = cmd
        if self._names is not None and name not in self._names:
            self._names.append(name)

    def __delitem__(self, name: str) -> None:
        self._entries()
        if name in self.built:
            del self.built[name]
        else:
            del self._entries()[name]  # KeyError: no such command
        assert self._names is not None
        self._names.remove(name)

    def __iter__(self) -> Iterator[str]:
        self._entries()
        assert self._names is not None
        return iter(list(self._names))

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def listed(self, name: str) -> Any:
        """The command as its group's ``--help`` lists it: built, or a stand-in holding only
        its help (nothing of the kernel is loaded)."""
        if name in self.built:
            return self.built[name]
        return PlainCommand(name=name, help=self._entries()[name].help)


def lazy_group(order: tuple[str, ...], lazy: Callable[[], dict[str, Lazy]]) -> type:
    """A `journey_group` whose commands are `LazyCommands`: its ``--help`` lists the generated
    ones without building them."""

    class LazyGroup(journey_group(order)):  # type: ignore[misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.commands: LazyCommands = LazyCommands(self.commands, lazy)

        def format_commands(self, ctx: Any, formatter: Any) -> None:
            """typer's (click's) command list, from `LazyCommands.listed`."""
            rows = []
            for name in self.list_commands(ctx):
                cmd = self.commands.listed(name)
                if not cmd.hidden:
                    rows.append((name, cmd))
            if rows:
                limit = formatter.width - 6 - max(len(name) for name, _ in rows)
                with formatter.section("Commands"):
                    formatter.write_dl([(n, cmd.get_short_help_str(limit)) for n, cmd in rows])

    return LazyGroup


def each_command(commands: Mapping[str, Any], apply: Callable[[Any], None]) -> None:
    """`apply` to every command and sub-command of `commands`, now for those built and when
    built for the generated ones (`LazyCommands.hooks`)."""

    def visit(cmd: Any) -> None:
        apply(cmd)
        subs = getattr(cmd, "commands", None)
        if subs is not None:
            each_command(subs, apply)

    if isinstance(commands, LazyCommands):
        built = list(commands.built.values())
        commands.hooks.append(visit)
    else:
        built = list(commands.values())
    for cmd in built:
        visit(cmd)


__all__ = [
    "Lazy",
    "LazyCommands",
    "MergedParam",
    "click_command",
    "command",
    "each_command",
    "lazy_group",
    "merge_params",
    "merged_param",
    "scalar_param",
]
