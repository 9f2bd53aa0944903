"""``verify --checkpoint OUT --against SRC``: a prepared or exported weight folder against its
source checkpoint (issue 22: the check that silent-load failures lack).

The expected key set of OUT is derived from SRC through the family table and the settings OUT
records (its manifest or ``mxcli-export.json``), then compared with the safetensors headers of
OUT:

- key coverage, per family: every expert of every MoE layer present (named by layer and expert
  when missing); nothing unexpected (an unmapped tensor); no expert left unquantized where the
  output is MXFP8; every scale key present;
- shapes and dtypes, and the TP/EP divisibility of the recorded degrees;
- numerics: SQNR per quantized tensor, bit-exactness where the output is exact (bf16 experts,
  router, everything copied);
- every byte (issue 28): the sha256 the manifest records for each tensor of the mxcli layout,
  and the MXFP8 codes and scales re-derived from the source and compared byte for byte (the
  conversion and the exports are deterministic), under the scale rule and FP8 range the
  manifest or export record says were used. ``hashes_only`` (``--hashes-only``, for huge
  models) skips the re-derivation and every read of the source's tensors: keys, shapes and the
  recorded hashes only (the exports record none: refused there).

`verify_checkpoint` returns a report; ``passed`` is False when anything is missing or wrong.
Each format's checks live with its `mxcli.weightprep.export.Exporter` (``verify``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mxcli.errors import InputError, MxcliError
from mxcli.weightprep.export.verifying import MIN_MXFP8_SQNR_DB, compare_keys  # noqa: F401


def detect_kind(out: Path) -> str:
    """The output format of `out`: its export record's, else mxcli's own layout (a manifest)."""
    from mxcli.weightprep.export.folder import read_record
    from mxcli.weightprep.export.mxcli_layout import NAME as MXCLI_LAYOUT
    from mxcli.weightprep.manifest import MANIFEST_NAME

    if not out.is_dir():
        raise InputError(f"--checkpoint {out}: not a folder")
    side = read_record(out)
    if side is not None:
        return str(side.output_format)
    if (out / MANIFEST_NAME).is_file():
        return MXCLI_LAYOUT
    raise InputError(
        f"--checkpoint {out}: neither a prep-weights folder (manifest.json) nor an mxcli "
        "export (mxcli-export.json)"
    )


def verify_checkpoint(
    out: str | Path, against: str | Path, *, hashes_only: bool = False
) -> dict[str, Any]:
    """Check `out` against its source `against` (see the module doc): the verifier of the
    `mxcli.weightprep.export.Exporter` that wrote it."""
    from mxcli.weightprep import export

    o, a = Path(out), Path(against)
    kind = detect_kind(o)
    exp = export.find(kind)
    if exp is None:
        raise InputError(f"--checkpoint {o}: unknown output format {kind!r}")
    return exp.verify(o, a, hashes_only)


def format_report(rep: dict[str, Any]) -> str:
    lines = [
        f"verify --checkpoint {rep['checkpoint']} ({rep['output_format']}) against "
        f"{rep['against']}: {'PASS' if rep['passed'] else 'FAIL'}"
    ]
    for key in ("missing", "unexpected", "wrong", "unquantized", "failures"):
        for item in rep[key]:
            lines.append(f"  {key}: {item}")
    if rep.get("rederived") is False:
        lines.append("  hashes only (--hashes-only): no weight re-derived from the source")
    num = rep["numerics"]
    sq = [v["sqnr_db"] for v in num.values() if v.get("sqnr_db") is not None]
    ex = sum(1 for v in num.values() if v["exact"])
    lines.append(
        f"  numerics: {len(num)} tensors compared, {ex} bit-exact"
        + (f", worst SQNR {min(sq):.2f} dB" if sq else "")
    )
    return "\n".join(lines)


__all__ = ["MxcliError", "detect_kind", "format_report", "verify_checkpoint"]
