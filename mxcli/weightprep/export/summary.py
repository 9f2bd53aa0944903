"""The human-readable lines of an export's result (``--json`` prints the dict itself)."""

from __future__ import annotations

from typing import Any


def format_export(res: dict[str, Any], width: int = 80) -> str:
    """The export's result as lines fitting `width` (`mxcli.weightprep.summary`'s wrapping)."""
    from mxcli.weightprep.summary import _fit

    fp8 = res.get("fp8")
    lines = [
        f"{res['output_format']} export of a {res['family']} model ({res['source_format']}) "
        f"-> {res['output']}",
        f"experts: {res.get('expert_tensors', 0)} tensors in {res.get('experts_format', '?')}",
    ]
    if fp8:
        lines.append(f"FP8: {fp8['description']}, scale rule {fp8['scale_rule']}")
    if res.get("values"):
        # what changed relative to what: the decoded MXFP8 values against the source's
        lines.append(
            f"MXFP8: {res['changed_values']:,} of {res['values']:,} values differ from the "
            f"{res['source_format']} source, worst SQNR {res['worst_sqnr_db']} dB; "
            f"{res.get('fp8_clipped', 0)} codes clipped"
        )
    for note in res.get("notes", []):
        lines.append(f"note: {note}")
    return _fit(lines, width)
