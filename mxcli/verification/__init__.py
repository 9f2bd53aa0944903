"""Verification: tensor comparison, the built-in case matrix, and reports.

- `compare`: per-tensor statistics (max abs/rel error, cosine, mismatches, bit-exactness) and
  tolerances.
- `policy`: which tolerance applies to which kernel output; kernel-aware comparison of two
  output sets (``verify OUT --golden GOLDEN``, backend vs reference).
- `exact`: independent float64 math and the MXFP8 error bounds the references must meet.
- `cases`: the case matrix of ``verify --suite quick|full`` (run by `mxcli.runs.run_suite`).
- `report`: rich table, JSON, JUnit XML.
"""

from mxcli.verification.compare import TensorReport, Tolerance, compare_tensors
from mxcli.verification.report import CaseResult

__all__ = ["CaseResult", "TensorReport", "Tolerance", "compare_tensors"]
