"""What an output format of ``prep-weights`` is (`Exporter`), and the one registry of them.

Everything that depends on ``--output-format`` asks the registered `Exporter` (issue 32):
its defaults (``--formats auto``, ``--scale-rule auto``), the options only it takes, what it
refuses before a byte is written, its ``--dry-run`` view, its writer and its
``verify --checkpoint``. No other module compares a format's name. A new format is one
`Exporter` and one `register` line (`mxcli.weightprep.export`).

This module knows no format and imports no torch: `mxcli.weightprep.plan` and the CLI's
``--output-format`` help ask it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mxcli.errors import InputError

# the --scale-rule values every format's outputs take (`mxcli.weightprep.fp8`)
COMMON_SCALE_RULES = ("neuron", "ocp")


def _neuron(fp8_range: int) -> str:
    return "neuron"


def _nothing_refused(what: Any) -> None:
    return None


def _no_view(plan: Any) -> dict[str, Any] | None:
    return None


@dataclass(frozen=True)
class Exporter:
    """One ``--output-format``: its name, defaults, checks, dry-run view, writer and verifier.

    `write` takes ``(plan, out, force, progress)`` and returns the result dict (with
    ``output_format``); an exporter without one (``resumable``, mxcli's own layout) is written
    layer by layer by `mxcli.weightprep.runner`, which resumes and shards it. `verify` takes
    ``(out, against, hashes_only)`` and returns the ``verify --checkpoint`` report."""

    name: str
    summary: str  # its phrase in --output-format's help: "name (what it is)"
    default_formats: tuple[str, ...]  # --formats auto
    verify: Callable[[Path, Path, bool], dict[str, Any]]
    scale_rules: tuple[str, ...] = COMMON_SCALE_RULES  # the --scale-rule values it takes
    default_scale_rule: Callable[[int], str] = _neuron  # --scale-rule auto, by --fp8-range
    options: tuple[str, ...] = ()  # `PrepOptions` fields only this format takes
    check_options: Callable[[Any], None] = _nothing_refused  # its own refusals of the options
    check_plan: Callable[[Any], None] = _nothing_refused  # refusals before any byte is written
    dry_run_view: Callable[[Any], dict[str, Any] | None] = _no_view  # None: the plan's own
    write: Callable[..., dict[str, Any]] | None = None
    resumable: bool = False  # written layer by layer, --resume and --shard take it
    # a Hugging Face folder transformers loads as it is: `verify --forward` runs its logits
    hf_loadable: bool = False

    def __post_init__(self) -> None:
        if (self.write is None) != self.resumable:
            raise ValueError(
                f"exporter {self.name}: a writer, or resumable (written by the runner), not both"
            )


_REGISTRY: dict[str, Exporter] = {}


def register(exporter: Exporter) -> Exporter:
    """Add `exporter` (its name must be new); returns it."""
    if exporter.name in _REGISTRY:
        raise ValueError(f"exporter {exporter.name!r} is already registered")
    _REGISTRY[exporter.name] = exporter
    return exporter


def unregister(name: str) -> None:
    """Remove a registered exporter (tests that register a toy one)."""
    _REGISTRY.pop(name, None)


def names() -> tuple[str, ...]:
    """The registered formats, in registration order (mxcli's own layout first)."""
    return tuple(_REGISTRY)


def find(name: str) -> Exporter | None:
    return _REGISTRY.get(name)


def default() -> Exporter:
    """The first registered format (mxcli's own layout): ``--output-format``'s default."""
    return next(iter(_REGISTRY.values()))


def get(name: str) -> Exporter:
    """The exporter of `name`, else the one-line ``--output-format`` error."""
    exp = _REGISTRY.get(name)
    if exp is None:
        raise InputError(f"--output-format: expected one of {', '.join(_REGISTRY)}, got {name!r}")
    return exp


def taking_rule(rule: str) -> list[str]:
    """The formats whose outputs take scale rule `rule`."""
    return [e.name for e in _REGISTRY.values() if rule in e.scale_rules]


def taking_option(option: str) -> list[str]:
    """The formats that take the `PrepOptions` field `option`."""
    return [e.name for e in _REGISTRY.values() if option in e.options]


def formats_help() -> str:
    """``--formats auto``'s meaning for each registered format."""
    return ", ".join(
        f"{'both' if len(e.default_formats) > 1 else e.default_formats[0]} for {e.name}"
        for e in _REGISTRY.values()
    )


def tensor_row(name: str, dtype: str, shape: tuple[int, ...]) -> dict[str, Any]:
    """One tensor of a ``--dry-run`` view's ``outputs_per_layer``."""
    from mxcli.weightprep.writer import TensorSpec

    return {"name": name, "dtype": dtype, "shape": list(shape),
            "bytes": TensorSpec(name, dtype, shape).nbytes}  # fmt: skip


def choices_help() -> str:
    """``--output-format``'s help: every registered format with its summary."""
    parts = [e.summary for e in _REGISTRY.values()]
    listed = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " or " + parts[-1]
    return listed + "."
