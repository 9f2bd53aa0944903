"""Exports for other serving stacks (``prep-weights --output-format``), beside mxcli's own layout.

- `compressed_tensors`: a Hugging Face checkpoint folder whose routed experts are MXFP8 in
  compressed-tensors form (vLLM Neuron, GPU vLLM, transformers), or bf16 with ``--formats bf16``;
- `nxdi`: NxD Inference's MoE key names and layouts, one file per rank;
- `folder`: publishing an export folder atomically, and its ``mxcli-export.json`` sidecar.
"""

from __future__ import annotations

from typing import Any


def check_export(plan: Any) -> None:
    """What the export of `plan` refuses, before any byte is written (``--dry-run`` too)."""
    if plan.options.output_format == "compressed-tensors":
        from mxcli.weightprep.export.compressed_tensors import check_plan as check_ct

        check_ct(plan)
    elif plan.options.output_format == "nxdi":
        from mxcli.weightprep.export.nxdi import check_plan as check_nx

        check_nx(plan)


def run_export(plan: Any, out: Any, force: bool, reporter: Any = None) -> dict[str, Any]:
    """Write `plan` in its ``options.output_format``; the result as a JSON-able dict.
    `reporter` (a `mxcli.weightprep.reporter.Reporter`) gets the bf16 expert bytes as they go."""
    from mxcli.weightprep.reporter import Reporter

    check_export(plan)  # before the bar starts and before any byte is written
    rep = reporter or Reporter()
    rep.start(plan, plan.layers, [])
    try:
        if plan.options.output_format == "compressed-tensors":
            from mxcli.weightprep.export.compressed_tensors import export_compressed_tensors

            return export_compressed_tensors(plan, out, force, rep.advance)
        from mxcli.weightprep.export.nxdi import export_nxdi

        return export_nxdi(plan, out, force, rep.advance)
    finally:
        rep.finish()
