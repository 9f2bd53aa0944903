"""Paired confidence intervals for the loss study (issue 31 item 1): pure functions, no torch.

Each seed gives one paired difference ``d_s = loss(arm, s) - loss(bf16, s)`` (same initial
weights, same batches): the seed-to-seed variation of the loss itself cancels, and the
interval is Student's t over the seeds, ``mean ± t(0.975, n-1) · sd / sqrt(n)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

__all__ = ["interval", "t_quantile_975", "verdict"]

# Two-sided 95% Student t quantiles t(0.975, df) for df = 1..30 (any statistics table, e.g.
# NIST/SEMATECH e-Handbook of Statistical Methods, section 1.3.6.7.2), to 6 decimals.
_T975 = (
    12.706205, 4.302653, 3.182446, 2.776445, 2.570582, 2.446912, 2.364624, 2.306004,
    2.262157, 2.228139, 2.200985, 2.178813, 2.160369, 2.144787, 2.131450, 2.119905,
    2.109816, 2.100922, 2.093024, 2.085963, 2.079614, 2.073873, 2.068658, 2.063899,
    2.059539, 2.055529, 2.051831, 2.048407, 2.045230, 2.042272,
)  # fmt: skip
_Z975 = 1.959963984540054


def t_quantile_975(df: int) -> float:
    """``t(0.975, df)``: the table up to 30 degrees of freedom, then the Cornish-Fisher
    expansion in ``1/df`` (Abramowitz & Stegun 26.7.5; error below 1e-5 from df = 30 on)."""
    if df < 1:
        raise ValueError(f"df: expected at least 1, got {df}")
    if df <= len(_T975):
        return _T975[df - 1]
    z, v = _Z975, float(df)
    g1 = (z**3 + z) / 4
    g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
    g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
    g4 = (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160
    return z + g1 / v + g2 / v**2 + g3 / v**3 + g4 / v**4


def interval(values: Sequence[float | None]) -> dict[str, Any]:
    """Mean and 95% t-interval of paired differences; None entries (a diverged seed) are left
    out and counted. ``low``/``high``/``half_width`` are None with fewer than two values."""
    xs = [float(v) for v in values if v is not None and math.isfinite(v)]
    n = len(xs)
    out: dict[str, Any] = {"n": n, "missing": len(values) - n, "mean": None, "sd": None,
                           "half_width": None, "low": None, "high": None}  # fmt: skip
    if n == 0:
        return out
    mean = math.fsum(xs) / n
    out["mean"] = mean
    if n < 2:
        return out
    sd = math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / (n - 1))
    hw = t_quantile_975(n - 1) * sd / math.sqrt(n)
    out.update(sd=sd, half_width=hw, low=mean - hw, high=mean + hw)
    return out


def verdict(iv: dict[str, Any], what: str = "bf16") -> str:
    """Decided by the interval alone: distinguishable only when it excludes 0."""
    if iv.get("low") is None or iv.get("high") is None:
        return "undetermined (fewer than two finite seeds)"
    if iv["low"] > 0:
        return f"distinguishable from {what}: higher loss"
    if iv["high"] < 0:
        return f"distinguishable from {what}: lower loss"
    return f"not distinguishable from {what}"
