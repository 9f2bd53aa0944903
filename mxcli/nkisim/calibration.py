"""Uncertainty ranges of a cost-model estimate and the refit of its ``fitted`` figures
(issue 29 items 5 and 7).

Both re-cost and re-schedule the SAME recorded instruction streams (`mxcli.nkisim.trace`) with
other figure values; the kernel is never run again.

**Ranges** (`estimate_range`). The free figures are those of `FIGURES` not ``documented``: an
``assumed`` figure's plausible ``low``..``high``, and a ``fitted`` one's range the fit's residual
allows. The estimate is evaluated at: the nominal values; each figure at its low and at its high
end, the others nominal (which MEASURES the figure's direction on this stream); the slow corner
(every figure at the end that made the estimate slower) and the fast corner; all-low and
all-high; and `SAMPLES` seeded points of the box (the same points for every kernel, so a ratio
is taken per shared setting). The range is the minimum and maximum over these settings.
If the estimate were monotone in each figure, the slow and fast corners would be its exact
extremes; an in-order schedule (every start a max of earlier ends, every end a start plus a
cost) is, but a list schedule that fills gaps and picks queues greedily is not in general (a
shorter instruction can move a later one into a worse gap), so the range is the extremes over
these settings, not a proof. A figure whose nominal estimate lies outside its two ends'
estimates is reported in ``non_monotone``; ``tests/nkisim/test_calibration.py`` checks that
each figure's departures from monotone stay within 1% of the estimate on small kernels.

**Calibration** (`fit`). Least squares on log time over the measurements (relative error, so
a 10 us and a 10 ms kernel weigh the same), over the ``fitted`` figures only, each bounded by
its range: a projected Levenberg-Marquardt in normalized coordinates (0 at ``low``, 1 at
``high``; logarithmic where ``low > 0``), with a forward-difference Jacobian. The fitted
figures' new ranges come from the residual: +-2 standard errors of the fit (``s^2 (J^T J)^-1``,
``s^2`` = residual sum of squares over n - p), clipped to the declared range; with no more
measurements than figures (n <= p) the declared range is kept.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mxcli.nkisim import cost
from mxcli.nkisim.cost import Figure, Hardware

__all__ = [
    "FREE_KINDS",
    "free_figures",
    "hardware_with",
    "Settings",
    "range_settings",
    "EstimateRange",
    "estimate_range",
    "ratio_range",
    "FitResult",
    "fit",
]

FREE_KINDS = ("fitted", "assumed")
SAMPLES = 8  # seeded points of the box evaluated besides the ends and corners
Settings = dict[str, float]  # figure key -> value (the others at their nominal value)


def free_figures(
    figures: Sequence[Figure] | None = None, kinds: Sequence[str] = FREE_KINDS
) -> list[Figure]:
    """The figures of `kinds` (default: every figure with a range), in table order (default
    table: `cost.FIGURES`, read at call time)."""
    figures = cost.FIGURES if figures is None else figures
    return [f for f in figures if f.kind in kinds]


def hardware_with(
    target: str,
    overrides: Mapping[str, float] | None = None,
    figures: Sequence[Figure] | None = None,
) -> Hardware:
    """`cost.hardware(target)` built from `figures`, with `overrides` (figure key -> value)."""
    figures = cost.FIGURES if figures is None else figures
    if target not in ("trn2", "trn3"):
        raise ValueError(f"target must be trn2 or trn3, got {target!r}")
    values = {f.key: float(getattr(f, target)) for f in figures}
    unknown = sorted(set(overrides or {}) - set(values))
    if unknown:
        raise KeyError(f"unknown figure key(s) {', '.join(unknown)}")
    values.update({k: float(v) for k, v in (overrides or {}).items()})
    return Hardware(target, values)


def _bounds(f: Figure, ranges: Mapping[str, tuple[float, float]] | None) -> tuple[float, float]:
    if ranges is not None and f.key in ranges:
        lo, hi = ranges[f.key]
        return float(lo), float(hi)
    assert f.low is not None and f.high is not None  # Figure's own check
    return float(f.low), float(f.high)


def range_settings(
    figures: Sequence[Figure], ranges: Mapping[str, tuple[float, float]] | None = None
) -> dict[str, Settings]:
    """The per-figure extremes: ``"<key>=low"`` / ``"<key>=high"`` -> that one figure at that
    end (`ranges` overrides a figure's declared ``low``/``high``, e.g. from a calibration),
    plus ``"nominal"`` (no override), ``"all-low"`` and ``"all-high"``."""
    out: dict[str, Settings] = {"nominal": {}}
    for f in figures:
        lo, hi = _bounds(f, ranges)
        out[f"{f.key}=low"] = {f.key: lo}
        out[f"{f.key}=high"] = {f.key: hi}
    out["all-low"] = {f.key: _bounds(f, ranges)[0] for f in figures}
    out["all-high"] = {f.key: _bounds(f, ranges)[1] for f in figures}
    return out


@dataclass
class EstimateRange:
    """An estimate (``nominal``) and its ``low``..``high`` over the free figures' ranges.

    ``directions``: per free figure, +1 when its high end raises the estimate, -1 when it lowers
    it, 0 when neither end moves it; ``non_monotone``: figures whose low and high end both move
    the estimate the same way (or the nominal lies outside their two ends' values): the corners
    are then not guaranteed extremes. ``values``: the estimate at every evaluated setting (name
    -> value), ``settings``: those settings (name -> figure overrides)."""

    nominal: float
    low: float
    high: float
    directions: dict[str, int]
    non_monotone: list[str]
    values: dict[str, float] = field(default_factory=dict)
    settings: dict[str, Settings] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        return {
            "nominal": self.nominal,
            "low": self.low,
            "high": self.high,
            "directions": dict(self.directions),
            "non_monotone": list(self.non_monotone),
            # the estimate at every setting (names are the same settings for every kernel
            # under the same figures, except the two corners, whose settings are given)
            "values": dict(self.values),
            "corners": {k: dict(self.settings[k]) for k in ("slow", "fast")},
        }


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-30)


def estimate_range(
    evaluate: Callable[[Settings], float],
    figures: Sequence[Figure],
    ranges: Mapping[str, tuple[float, float]] | None = None,
    *,
    samples: int = SAMPLES,
    seed: int = 0,
    tol: float = 1e-12,
) -> EstimateRange:
    """The range of ``evaluate(settings)`` (an estimate of one recorded stream under figure
    overrides) over the box of `figures`' ranges (module docstring: per-figure extremes measured,
    the slow and the fast corner built from their directions, and `samples` seeded points of
    the box)."""
    settings = range_settings(figures, ranges)
    rng = random.Random(seed)  # the same points for every kernel: ratios per shared setting
    for i in range(samples if figures else 0):
        settings[f"sample-{i}"] = {f.key: rng.uniform(*_bounds(f, ranges)) for f in figures}
    values = {name: evaluate(s) for name, s in settings.items()}
    nom = values["nominal"]
    directions: dict[str, int] = {}
    non_mono: list[str] = []
    for f in figures:
        lo, hi = values[f"{f.key}=low"], values[f"{f.key}=high"]
        d = 0 if _rel(lo, hi) <= tol else (1 if hi > lo else -1)
        directions[f.key] = d
        # the nominal value lies inside the range: an estimate outside its two ends' values
        # is not monotone in this figure
        if not (min(lo, hi) - tol * abs(nom) <= nom <= max(lo, hi) + tol * abs(nom)):
            non_mono.append(f.key)
    slow: Settings = {}
    fast: Settings = {}
    for f in figures:
        lo, hi = _bounds(f, ranges)
        d = directions[f.key]
        if d != 0:
            slow[f.key], fast[f.key] = (hi, lo) if d > 0 else (lo, hi)
    settings["slow"], settings["fast"] = slow, fast
    for name in ("slow", "fast"):
        values[name] = evaluate(settings[name])
    return EstimateRange(
        nom, min(values.values()), max(values.values()), directions, non_mono, values, settings
    )


def ratio_range(
    a: EstimateRange,
    b: EstimateRange,
    evaluate_a: Callable[[Settings], float],
    evaluate_b: Callable[[Settings], float],
) -> tuple[float, float, float]:
    """``(nominal, low, high)`` of ``a / b`` with the figures SHARED: the ratio at each setting
    either range evaluated (both kernels' corners and per-figure extremes), never the ratio of
    independent extremes. Settings one side has not evaluated are evaluated now."""
    ratios = []
    for side in (a, b):
        for name, s in side.settings.items():
            va = a.values[name] if a.settings.get(name) == s else evaluate_a(s)
            vb = b.values[name] if b.settings.get(name) == s else evaluate_b(s)
            ratios.append(va / vb if vb else math.inf)
    nominal = a.nominal / b.nominal if b.nominal else math.inf
    return nominal, min(ratios), max(ratios)


def ratio_of_docs(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, float]:
    """`ratio_range` from two `EstimateRange.as_dict` documents (no re-evaluation): the ratio
    at every setting both evaluated (the corners only where their settings agree), so the
    figures are shared. ``{"nominal", "low", "high"}``."""
    va, vb = a["values"], b["values"]
    ratios = []
    for name in va:
        if name not in vb or not vb[name]:
            continue
        if name in ("slow", "fast") and a["corners"][name] != b["corners"][name]:
            continue
        ratios.append(va[name] / vb[name])
    nominal = a["nominal"] / b["nominal"] if b["nominal"] else math.inf
    return {"nominal": nominal, "low": min(ratios, default=nominal),
            "high": max(ratios, default=nominal)}  # fmt: skip


# -- calibration -----------------------------------------------------------------------------


def _to_u(f: Figure, v: float, lo: float, hi: float) -> float:
    if hi == lo:
        return 0.0
    if lo > 0:
        return (math.log(v) - math.log(lo)) / (math.log(hi) - math.log(lo))
    return (v - lo) / (hi - lo)


def _from_u(u: float, lo: float, hi: float) -> float:
    u = min(1.0, max(0.0, u))
    if lo > 0:
        return math.exp(math.log(lo) + u * (math.log(hi) - math.log(lo)))
    return lo + u * (hi - lo)


@dataclass
class FitResult:
    """The refit figures, their ranges from the fit's residual, and the fit's quality.

    ``values``: figure key -> fitted value; ``ranges``: key -> (low, high); ``predicted_us``:
    per measurement, the model's estimate at the fitted values; ``residuals``: per measurement,
    ``log(predicted / measured)``; ``iterations``; ``start``: the values the fit started from."""

    values: dict[str, float]
    ranges: dict[str, tuple[float, float]]
    predicted_us: list[float]
    residuals: list[float]
    iterations: int
    start: dict[str, float]

    @property
    def rms_residual(self) -> float:
        r = self.residuals
        return math.sqrt(sum(x * x for x in r) / len(r)) if r else 0.0


def fit(
    evaluate: Callable[[int, Settings], float],
    measured_us: Sequence[float],
    figures: Sequence[Figure],
    start: Mapping[str, float] | None = None,
    *,
    max_iter: int = 50,
    step: float = 1e-3,
    xtol: float = 1e-10,
) -> FitResult:
    """Fit `figures` (within their ``low``..``high``) so that ``evaluate(i, settings)`` (the
    estimate of measurement i, in us) matches ``measured_us[i]`` in least squares on log time.

    `start`: the values to start from (default each figure's trn3 value)."""
    n, p = len(measured_us), len(figures)
    if n == 0:
        raise ValueError("no measurements to fit")
    if p == 0:
        raise ValueError("no fitted figures")
    bounds = [_bounds(f, None) for f in figures]
    v0 = [float((start or {}).get(f.key, f.trn3)) for f in figures]
    u = np.array([_to_u(f, min(max(v, lo), hi), lo, hi)
                  for f, v, (lo, hi) in zip(figures, v0, bounds, strict=True)])  # fmt: skip
    logm = np.log(np.asarray(measured_us, dtype=float))

    def settings_of(uu: np.ndarray) -> Settings:
        return {f.key: _from_u(float(x), lo, hi)
                for f, x, (lo, hi) in zip(figures, uu, bounds, strict=True)}  # fmt: skip

    def residual(uu: np.ndarray) -> np.ndarray:
        s = settings_of(uu)
        return np.array([math.log(max(evaluate(i, s), 1e-30)) for i in range(n)]) - logm

    def jacobian(uu: np.ndarray, r0: np.ndarray) -> np.ndarray:
        J = np.zeros((n, p))
        for j in range(p):
            h = step if uu[j] + step <= 1.0 else -step  # stay inside the box
            du = uu.copy()
            du[j] += h
            J[:, j] = (residual(du) - r0) / h
        return J

    r = residual(u)
    lam = 1e-3
    it = 0
    moved = math.inf
    for it in range(1, max_iter + 1):  # noqa: B007 (reported)
        J = jacobian(u, r)
        g = J.T @ r
        A = J.T @ J
        improved = False
        for _ in range(30):
            try:
                delta = -np.linalg.solve(A + lam * np.diag(np.diag(A) + 1e-12), g)
            except np.linalg.LinAlgError:
                lam *= 10
                continue
            un = np.clip(u + delta, 0.0, 1.0)
            rn = residual(un)
            if float(rn @ rn) < float(r @ r):
                improved = True
                moved = float(np.max(np.abs(un - u)))
                u, r = un, rn
                lam = max(lam / 10, 1e-12)
                break
            lam *= 10
        if not improved or moved < xtol or float(r @ r) < 1e-24:
            break
    values = settings_of(u)
    ranges: dict[str, tuple[float, float]] = {
        f.key: b for f, b in zip(figures, bounds, strict=True)
    }
    if n > p:
        J = jacobian(u, r)
        s2 = float(r @ r) / (n - p)
        try:
            cov = s2 * np.linalg.inv(J.T @ J)
            for j, (f, (lo, hi)) in enumerate(zip(figures, bounds, strict=True)):
                sd = math.sqrt(max(float(cov[j, j]), 0.0))
                if not math.isfinite(sd) or not np.all(np.isfinite(cov)):
                    continue  # a figure the measurements do not constrain: its declared range
                ranges[f.key] = (_from_u(u[j] - 2 * sd, lo, hi), _from_u(u[j] + 2 * sd, lo, hi))
        except np.linalg.LinAlgError:  # a figure the measurements do not constrain
            pass
    s = settings_of(u)
    predicted = [evaluate(i, s) for i in range(n)]
    return FitResult(
        values,
        ranges,
        predicted,
        [math.log(pr / m) for pr, m in zip(predicted, measured_us, strict=True)],
        it,
        {f.key: v for f, v in zip(figures, v0, strict=True)},
    )
