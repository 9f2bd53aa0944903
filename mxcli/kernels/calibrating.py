"""Ranges of a kernel profile's estimates, and calibration files (``mxcli profile --calibrate``,
``--calibration``; issue 29 items 5 and 7). The arithmetic is `mxcli.nkisim.calibration`'s;
this module ties it to recorded kernel runs and to files.

**Measurements**: `mxcli.kernels.measurements` reads them and records each launch.

**Calibration file**: ``{"format": "mxcli-calibration", "version": 1, "mxcli": VERSION,
"target": "trn3", "figures": {key: value}, "ranges": {key: [low, high]}, "measurements":
[... each with "predicted_us" and "log_residual"], "rms_residual": r}``. Only ``fitted`` figures
appear in it; a later run (``--calibration``) uses its values and ranges for them.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mxcli.errors import InputError, MxcliError, OutputExistsError
from mxcli.nkisim import calibration as cal
from mxcli.nkisim import cost, schedule
from mxcli.nkisim.cost import Figure

__all__ = [
    "FORMAT",
    "Calibration",
    "Measurement",
    "load_calibration",
    "profile_ranges",
    "comparison_ranges",
    "calibrate",
    "write_calibration",
]

FORMAT = "mxcli-calibration"
_VERSION = 1


@dataclass(frozen=True)
class Calibration:
    """Figure values and ranges from a calibration file (`path`), or none (the table's)."""

    values: dict[str, float] = field(default_factory=dict)
    ranges: dict[str, tuple[float, float]] = field(default_factory=dict)
    path: str | None = None

    def hardware(
        self, target: str = "trn3", figures: Sequence[Figure] | None = None
    ) -> cost.Hardware:
        return cal.hardware_with(target, self.values, figures)


def input_error(where: str, msg: str) -> InputError:
    return InputError(f"{where}: {msg}")


def read_json(path: str | os.PathLike[str]) -> Any:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(f"{p}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{p}: cannot read ({exc})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"{p}: not JSON ({exc.msg} at line {exc.lineno})") from None


def finite_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def load_calibration(
    path: str | os.PathLike[str], figures: Sequence[Figure] | None = None
) -> Calibration:
    """Read a calibration file; every key must be a ``fitted`` figure of `figures`, with a value
    (and range) inside the figure's declared range."""
    figures = cost.FIGURES if figures is None else figures
    doc = read_json(path)
    where = str(path)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise input_error(where, f'not a calibration file (expected "format": "{FORMAT}")')
    vals = doc.get("figures")
    if not isinstance(vals, dict):
        raise input_error(where, "missing key 'figures' (an object: figure key -> value)")
    by_key = {f.key: f for f in figures}
    values: dict[str, float] = {}
    ranges: dict[str, tuple[float, float]] = {}
    raw_ranges = doc.get("ranges", {})
    if not isinstance(raw_ranges, dict):
        raise input_error(where, "'ranges': expected an object (figure key -> [low, high])")
    for key, v in vals.items():
        f = by_key.get(key)
        if f is None:
            raise input_error(where, f"unknown figure key {key!r} in 'figures'")
        if f.kind != "fitted":
            raise input_error(
                where, f"figure {key!r} is {f.kind}, not fitted; only fitted figures calibrate"
            )
        assert f.low is not None and f.high is not None
        if not finite_number(v) or not f.low <= v <= f.high:
            raise input_error(
                where, f"figures[{key!r}]: expected a number in [{f.low:g}, {f.high:g}], got {v!r}"
            )
        values[key] = float(v)
        r = raw_ranges.get(key, [f.low, f.high])
        if (not isinstance(r, list) or len(r) != 2 or not all(map(finite_number, r))
                or not f.low <= r[0] <= v <= r[1] <= f.high):  # fmt: skip
            raise input_error(where, f"ranges[{key!r}]: expected [low, high] around {v:g} within "
                        f"[{f.low:g}, {f.high:g}], got {r!r}")  # fmt: skip
        ranges[key] = (float(r[0]), float(r[1]))
    unknown = sorted(set(raw_ranges) - set(values))
    if unknown:
        raise input_error(where, f"ranges for figure(s) without a value: {', '.join(unknown)}")
    return Calibration(values, ranges, where)


# -- ranges of a profile ------------------------------------------------------------------------


class _Evaluator:
    """A profile's schedule and lower bound (us) under figure overrides, re-scheduling the
    profile's recorded streams once per distinct setting."""

    def __init__(self, kp: Any, calibration: Calibration, figures: Sequence[Figure] | None) -> None:
        if not kp.recorders:
            raise ValueError("the profile holds no recorded instruction stream")
        self.kp, self.calibration, self.figures = kp, calibration, figures
        self.cache: dict[tuple[tuple[str, float], ...], tuple[float, dict[str, float]]] = {}

    def _eval(self, s: cal.Settings) -> tuple[float, dict[str, float]]:
        key = tuple(sorted(s.items()))
        if key not in self.cache:
            prof = self.kp.profile
            hw = cal.hardware_with(prof.target, {**self.calibration.values, **s}, self.figures)
            p = schedule.build_profile(self.kp.recorders, prof.target, hw, prof.lnc)
            self.cache[key] = (p.makespan_ns / 1e3, {k: v / 1e3 for k, v in p.busy_ns().items()})
        return self.cache[key]

    def schedule_us(self, s: cal.Settings) -> float:
        return self._eval(s)[0]

    def busy_us(self, s: cal.Settings) -> dict[str, float]:
        return self._eval(s)[1]

    def lower_bound_us(self, s: cal.Settings) -> float:
        return max(self.busy_us(s).values(), default=0.0)


def profile_ranges(
    kp: Any, calibration: Calibration | None = None, figures: Sequence[Figure] | None = None
) -> dict[str, Any]:
    """The ranges of a `profiling.KernelProfile`'s list schedule and lower bound over the free
    figures (``assumed`` and ``fitted``; a calibration's values and ranges for the latter),
    JSON-ready: ``{"schedule_us": {nominal, low, high, directions, non_monotone},
    "lower_bound_us": {...}, "figures": {key: [low, high]}, "method": ...}``."""
    figures = cost.FIGURES if figures is None else figures
    c = calibration or Calibration()
    ev = _Evaluator(kp, c, figures)
    free = cal.free_figures(figures)
    sched = cal.estimate_range(ev.schedule_us, free, c.ranges)
    lb = cal.estimate_range(ev.lower_bound_us, free, c.ranges)
    return _ranges_doc(sched, lb, free, c)


class _Extrapolated:
    """`_Evaluator`'s interface for ``base + sum(w * (sample - base))`` over recorded runs
    (`profiling.profile_bwd_scaled`'s extrapolation), per figure setting."""

    def __init__(self, base: _Evaluator, samples: Sequence[tuple[_Evaluator, float]]) -> None:
        self.base, self.samples = base, list(samples)

    def schedule_us(self, s: cal.Settings) -> float:
        b = self.base.schedule_us(s)
        return b + sum(w * (e.schedule_us(s) - b) for e, w in self.samples)

    def lower_bound_us(self, s: cal.Settings) -> float:
        b = self.base.busy_us(s)
        per = [(e.busy_us(s), w) for e, w in self.samples]
        return max(b[k] + sum(w * (x[k] - b[k]) for x, w in per) for k in b)


def extrapolated_ranges(
    base: Any,
    samples: Sequence[tuple[Any, float]],
    calibration: Calibration | None = None,
    figures: Sequence[Figure] | None = None,
) -> dict[str, Any]:
    """`profile_ranges` of the extrapolation ``base + sum(w * (sample - base))`` of recorded
    runs (`base`, (`sample`, `w`) pairs of `profiling.KernelProfile`): the extrapolation is
    redone at each figure setting (JSON-ready)."""
    figures = cost.FIGURES if figures is None else figures
    c = calibration or Calibration()
    ev = _Extrapolated(_Evaluator(base, c, figures),
                       [(_Evaluator(kp, c, figures), w) for kp, w in samples])  # fmt: skip
    free = cal.free_figures(figures)
    sched = cal.estimate_range(ev.schedule_us, free, c.ranges)
    lb = cal.estimate_range(ev.lower_bound_us, free, c.ranges)
    return _ranges_doc(sched, lb, free, c)


def _ranges_doc(sched: cal.EstimateRange, lb: cal.EstimateRange, free: list[Figure],
                c: Calibration) -> dict[str, Any]:  # fmt: skip
    return {
        "schedule_us": sched.as_dict(),
        "lower_bound_us": lb.as_dict(),
        "figures": {f.key: list(c.ranges.get(f.key, (f.low, f.high))) for f in free},
        "method": "re-scheduled the recorded stream at each free figure's low and high end "
        "(others nominal) and at the slow and fast corners built from those directions; "
        "min / max over these settings",
        **({"calibration": c.path} if c.path else {}),
    }


def comparison_ranges(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    """Ratio a / b of two profiles' estimates (their ``"range"`` documents) with the figures
    SHARED: per figure setting both evaluated, never the ratio of independent extremes."""
    return {
        "schedule_ratio": cal.ratio_of_docs(a["schedule_us"], b["schedule_us"]),
        "lower_bound_ratio": cal.ratio_of_docs(a["lower_bound_us"], b["lower_bound_us"]),
    }


def verdict(a: Mapping[str, Any], b: Mapping[str, Any], name_a: str, name_b: str) -> str:
    """ "A faster" / "B faster" only when one's whole schedule range lies below the other's."""
    ra, rb = a["schedule_us"], b["schedule_us"]
    if ra["high"] < rb["low"]:
        return f"{name_a} faster"
    if rb["high"] < ra["low"]:
        return f"{name_b} faster"
    return "not distinguishable under the model's uncertainty"


# -- measurements and the fit ------------------------------------------------------------------


@dataclass
class Measurement:
    """One measured latency (module docstring for the file format)."""

    kernel: str  # the spec's name
    shape: dict[str, Any]
    lnc: int
    us: float
    kwargs: dict[str, Any]
    nki_kernel: str
    entry: dict[str, Any]  # as read


def calibrate(
    profiles: Sequence[Any],
    measurements: Sequence[Measurement],
    figures: Sequence[Figure] | None = None,
    start: Calibration | None = None,
) -> cal.FitResult:
    """Refit the ``fitted`` figures of `figures` to `measurements` (their recorded
    `profiles`, in the same order): least squares on log time, bounded by each figure's
    range (`mxcli.nkisim.calibration.fit`)."""
    figures = cost.FIGURES if figures is None else figures
    fitted = cal.free_figures(figures, ("fitted",))
    if not fitted:
        raise MxcliError("calibrate: the cost model has no fitted figure to calibrate")
    base = start or Calibration()
    evs = [_Evaluator(kp, Calibration(), figures) for kp in profiles]

    def evaluate(i: int, s: cal.Settings) -> float:
        return evs[i].schedule_us(s)

    return cal.fit(evaluate, [m.us for m in measurements], fitted, base.values or None)


def calibration_doc(result: cal.FitResult, measurements: Sequence[Measurement],
                    target: str = "trn3") -> dict[str, Any]:  # fmt: skip
    """The JSON document of a calibration (module docstring)."""
    from mxcli import __version__

    return {
        "format": FORMAT,
        "version": _VERSION,
        "mxcli": __version__,
        "target": target,
        "figures": dict(result.values),
        "ranges": {k: [lo, hi] for k, (lo, hi) in result.ranges.items()},
        "start": dict(result.start),
        "fit": "least squares on log(estimate / measured), fitted figures bounded by their "
        "ranges; ranges: +-2 standard errors of the fit (the declared range when there are no "
        "more measurements than figures)",
        "iterations": result.iterations,
        "rms_residual": result.rms_residual,
        "measurements": [
            {**m.entry, "predicted_us": p, "log_residual": r}
            for m, p, r in zip(measurements, result.predicted_us, result.residuals, strict=True)
        ],
    }


def check_replaceable(path: str | os.PathLike[str], force: bool) -> None:
    """Before any work: the output may be written (`fsutil.check_output_path`), and with
    `force` an existing file is replaced only when it is a calibration file mxcli wrote."""
    from mxcli.fsutil import check_output_path

    p = check_output_path(path, force)
    if p.exists():
        try:
            doc = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            doc = None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise OutputExistsError(
                f"{p}: exists and is not a calibration file mxcli wrote; --force replaces only "
                "what mxcli wrote (move it away or choose another name)"
            )


def write_calibration(path: str | os.PathLike[str], doc: Mapping[str, Any], force: bool) -> None:
    """Write `doc` atomically (nothing partial; see `fsutil.atomic_output`)."""
    from mxcli.fsutil import atomic_output

    check_replaceable(path, force)
    with atomic_output(path, force) as tmp:
        tmp.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
