"""Exports for other serving stacks (``prep-weights --output-format``), beside mxcli's own layout.

- `compressed_tensors`: a Hugging Face checkpoint folder whose routed experts are MXFP8 in
  compressed-tensors form (compressed-tensors decompresses it; GPU vLLM's MoE probe matches its
  targets; transformers 5.23 cannot load it: README "Weights for other serving stacks"), or
  bf16 with ``--formats bf16`` (transformers loads it);
- `nxdi`: NxD Inference's MoE key names and layouts, one file per rank: complete rank files
  with ``--nxdi-base``, else MoE-only files under a name NxDI does not read;
- `folder`: publishing an export folder atomically, and its ``mxcli-export.json`` sidecar.
"""

from __future__ import annotations

from typing import Any

from mxcli.weightprep.writer import TensorSpec


def check_export(plan: Any) -> None:
    """What the export of `plan` refuses, before any byte is written (``--dry-run`` too)."""
    if plan.options.output_format == "compressed-tensors":
        from mxcli.weightprep.export.compressed_tensors import check_plan as check_ct

        check_ct(plan)
    elif plan.options.output_format == "nxdi":
        from mxcli.weightprep.export.nxdi import check_plan as check_nx

        check_nx(plan)


def _row(name: str, dtype: str, shape: tuple[int, ...]) -> dict[str, Any]:
    return {"name": name, "dtype": dtype, "shape": list(shape),
            "bytes": TensorSpec(name, dtype, shape).nbytes}  # fmt: skip


def dry_run_view(plan: Any) -> dict[str, Any]:
    """What ``--dry-run`` shows of an export instead of mxcli's own layout: the tensors of the
    first converted layer in the first output file (``outputs_per_layer``, keyed by that file),
    and the bytes written per layer and in all (the MoE tensors the export rewrites)."""
    L = plan.layers[0]
    fmt = plan.options.output_format
    if fmt == "nxdi":
        from mxcli.weightprep.export.nxdi import expected_tensors, plan_rank_file

        per_rank = expected_tensors(plan)
        mark = f"layers.{L}."
        r0 = min(per_rank)
        rows = [_row(n, d, s) for n, (d, s) in per_rank[r0].items() if n.startswith(mark)]
        total = sum(
            TensorSpec(n, d, s).nbytes for t in per_rank.values() for n, (d, s) in t.items()
        )
        what = "complete" if plan.options.nxdi_base else "MoE tensors only"
        note = f"{len(per_rank)} rank file(s) {plan_rank_file(plan, r0)}, ...; {what}"
        return {"outputs_per_layer": {f"rank {r0}": rows},
                "write_per_layer": total // len(plan.layers), "write_total": total, "note": note}  # fmt: skip
    from mxcli.weightprep.export.compressed_tensors import MX_GROUP

    m = plan.model
    rows = []
    # check_plan admits PerExpert layouts only: expert 0's Linear weights, [out, in]
    for n, (o_, i_) in m.family.experts.expected(plan.layer_prefix(L), 1, m.H, m.I).items():
        if "mxfp8" in plan.options.formats:
            rows += [_row(n, "F8_E4M3", (o_, i_)), _row(n + "_scale", "U8", (o_, i_ // MX_GROUP))]
        else:
            rows.append(_row(n, "BF16", (o_, i_)))
    per_layer = sum(r["bytes"] for r in rows) * m.E
    note = f"expert 0 of {m.E} shown; every other tensor is copied unchanged"
    return {"outputs_per_layer": {f"layer {L}": rows}, "write_per_layer": per_layer,
            "write_total": per_layer * len(plan.layers), "note": note}  # fmt: skip


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
