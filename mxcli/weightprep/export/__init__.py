"""The output formats of ``prep-weights --output-format``, each an `Exporter` registered here once.

- `mxcli_layout`: mxcli's own layout (the kernels' inputs and ``manifest.json``), written layer
  by layer by `mxcli.weightprep.runner` (its verifier here);
- `compressed_tensors`: a Hugging Face checkpoint folder whose routed experts are MXFP8 in
  compressed-tensors form (compressed-tensors decompresses it; GPU vLLM's MoE probe matches its
  targets; transformers 5.23 cannot load it: README "Weights for other serving stacks"), or
  bf16 with ``--formats bf16`` (transformers loads it);
- `nxdi`: NxD Inference's MoE key names and layouts, one file per rank: complete rank files
  with ``--nxdi-base``, else MoE-only files under a name NxDI does not read;
- `folder`: publishing an export folder atomically, and its ``mxcli-export.json`` record
  (`mxcli.weightprep.manifest.ExportRecord`); `base`: the `Exporter` and its registry.

A new format is a module with its functions and one `register` call below (or, in a test,
`mxcli.weightprep.export.base.register` of an `Exporter` built there).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mxcli.weightprep.export.base import (
    COMMON_SCALE_RULES,
    Exporter,
    choices_help,
    default,
    find,
    formats_help,
    get,
    names,
    register,
    taking_option,
    taking_rule,
)

# Each format's declaration: its facts here (this module imports no torch: the CLI's help
# reads them), its behaviour in its module, imported when called.


def _late(module: str, name: str) -> Callable[..., Any]:
    """`name` of the format's `module`, imported when first called: the registry is data that
    the planner reads, a format's behaviour stands on the planner, so the registry names its
    behaviour (as a kernel spec names its implementations) instead of importing it."""

    def call(*args: Any) -> Any:
        return getattr(importlib.import_module(f"mxcli.weightprep.export.{module}"), name)(*args)

    call.__name__ = name
    return call


def _mxcli_verify(out: Path, against: Path, hashes_only: bool) -> dict[str, Any]:
    return _late("mxcli_layout", "verify")(out, against, hashes_only)  # type: ignore[no-any-return]


MXCLI = register(
    Exporter(
        name="mxcli",
        summary="mxcli (the kernels' layout)",
        default_formats=("bf16", "mxfp8"),
        verify=_mxcli_verify,
        resumable=True,  # written layer by layer by `mxcli.weightprep.runner`
    )
)


def _ct(name: str) -> Callable[..., Any]:
    return _late("compressed_tensors", name)


def _ct_auto_rule(fp8_range: int) -> str:
    # what compressed-tensors' own MXFP8 compressor writes (issue 30); at +-240 the bytes are
    # byte = exponent - 7 whatever the rule (`Fp8Semantics`), recorded as ocp
    return "ct" if fp8_range == 448 else "ocp"


COMPRESSED_TENSORS = register(
    Exporter(
        name="compressed-tensors",
        summary="compressed-tensors (HF checkpoint, MXFP8 experts: vLLM)",
        default_formats=("mxfp8",),
        verify=_ct("verify"),
        scale_rules=(*COMMON_SCALE_RULES, "rceil", "ct"),
        default_scale_rule=_ct_auto_rule,
        check_plan=_ct("check_plan"),
        dry_run_view=_ct("dry_run_view"),
        write=_ct("export_compressed_tensors"),
        hf_loadable=True,
    )
)


def _nxdi(name: str) -> Callable[..., Any]:
    return _late("nxdi", name)


NXDI = register(
    Exporter(
        name="nxdi",
        summary="nxdi (NxD Inference per-rank files)",
        default_formats=("bf16",),
        verify=_nxdi("verify"),
        options=("nxdi_base",),
        check_options=_nxdi("check_options"),
        check_plan=_nxdi("check_plan"),
        dry_run_view=_nxdi("dry_run_view"),
        write=_nxdi("export_nxdi"),
    )
)

__all__ = [
    "COMPRESSED_TENSORS",
    "MXCLI",
    "NXDI",
    "Exporter",
    "check_export",
    "choices_help",
    "default",
    "dry_run_view",
    "find",
    "formats_help",
    "get",
    "names",
    "register",
    "taking_option",
    "taking_rule",
]


def check_export(plan: Any) -> None:
    """What the export of `plan` refuses, before any byte is written (``--dry-run`` too)."""
    get(plan.options.output_format).check_plan(plan)


def dry_run_view(plan: Any) -> dict[str, Any] | None:
    """What ``--dry-run`` shows of an export instead of mxcli's own layout (None: the plan's
    own): the tensors of the first converted layer in the first output file
    (``outputs_per_layer``, keyed by that file), and the bytes written per layer and in all
    (the tensors the export rewrites)."""
    return get(plan.options.output_format).dry_run_view(plan)
