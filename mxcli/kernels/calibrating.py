"""Ranges of a kernel profile's estimates, and calibration files (``mxcli profile calibrate``,
``--calibration``; issue 29 items 5 and 7). The arithmetic is `mxcli.nkisim.calibration`'s;
this module ties it to recorded kernel runs and to files.

**Measurements** (``MEASURED.json``): a JSON list (or ``{"measurements": [...]}``) of objects

    {"kernel": "bwd", "shape": {"tokens": 4096, "hidden": 4096, "intermediate": 1536,
     "experts": 1, "top_k": 1, "block_size": 4096}, "lnc": 2, "us": 2190.0,
     "kwargs": {...}, "nki_kernel": "mxcli"}

``kernel``: ``prefill`` / ``bwd`` (or the kernel's name); ``shape``: every field of
`profiling.PrefillShape` / `profiling.BwdShape`; ``lnc``: 1 or 2; ``us``: the measured latency
(microseconds, > 0); optional ``kwargs``: kernel keyword arguments over the shape's own (as
``make-inputs`` records them; an object such as the bwd ``config`` is merged field by field
into the shape's); optional ``nki_kernel``: which
implementation was timed (default ``mxcli``).

**Calibration file**: ``{"format": "mxcli-calibration", "version": 1, "mxcli": VERSION,
"target": "trn3", "figures": {key: value}, "ranges": {key: [low, high]}, "measurements":
[... each with "predicted_us" and "residual"], "rms_residual": r}``. Only ``fitted`` figures
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
    "read_measurements",
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


def _fail(where: str, msg: str) -> InputError:
    return InputError(f"{where}: {msg}")


def _read_json(path: str | os.PathLike[str]) -> Any:
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


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def load_calibration(
    path: str | os.PathLike[str], figures: Sequence[Figure] | None = None
) -> Calibration:
    """Read a calibration file; every key must be a ``fitted`` figure of `figures`, with a value
    (and range) inside the figure's declared range."""
    figures = cost.FIGURES if figures is None else figures
    doc = _read_json(path)
    where = str(path)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise _fail(where, f'not a calibration file (expected "format": "{FORMAT}")')
    vals = doc.get("figures")
    if not isinstance(vals, dict):
        raise _fail(where, "missing key 'figures' (an object: figure key -> value)")
    by_key = {f.key: f for f in figures}
    values: dict[str, float] = {}
    ranges: dict[str, tuple[float, float]] = {}
    raw_ranges = doc.get("ranges", {})
    if not isinstance(raw_ranges, dict):
        raise _fail(where, "'ranges': expected an object (figure key -> [low, high])")
    for key, v in vals.items():
        f = by_key.get(key)
        if f is None:
            raise _fail(where, f"unknown figure key {key!r} in 'figures'")
        if f.kind != "fitted":
            raise _fail(
                where, f"figure {key!r} is {f.kind}, not fitted; only fitted figures calibrate"
            )
        assert f.low is not None and f.high is not None
        if not _number(v) or not f.low <= v <= f.high:
            raise _fail(
                where, f"figures[{key!r}]: expected a number in [{f.low:g}, {f.high:g}], got {v!r}"
            )
        values[key] = float(v)
        r = raw_ranges.get(key, [f.low, f.high])
        if (not isinstance(r, list) or len(r) != 2 or not all(map(_number, r))
                or not f.low <= r[0] <= v <= r[1] <= f.high):  # fmt: skip
            raise _fail(where, f"ranges[{key!r}]: expected [low, high] around {v:g} within "
                        f"[{f.low:g}, {f.high:g}], got {r!r}")  # fmt: skip
        ranges[key] = (float(r[0]), float(r[1]))
    unknown = sorted(set(raw_ranges) - set(values))
    if unknown:
        raise _fail(where, f"ranges for figure(s) without a value: {', '.join(unknown)}")
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


def _shape_class(spec_name: str) -> Any:
    from mxcli.kernels import profiling as prof

    return prof.PrefillShape if spec_name == prof.PREFILL.name else prof.BwdShape


def read_measurements(path: str | os.PathLike[str]) -> list[Measurement]:
    """Parse and check a measurements file (one `InputError` line naming the file, entry and
    key)."""
    import dataclasses

    from mxcli.kernels.spec import get_spec

    doc = _read_json(path)
    if isinstance(doc, dict) and "measurements" in doc:
        doc = doc["measurements"]
    if not isinstance(doc, list) or not doc:
        raise InputError(f"{path}: expected a non-empty list of measurements")
    out = []
    for i, e in enumerate(doc):
        where = f"{path}: measurement {i}"
        if not isinstance(e, dict):
            raise _fail(where, f"expected an object, got {type(e).__name__}")
        for key in ("kernel", "shape", "lnc", "us"):
            if key not in e:
                raise _fail(where, f"missing key {key!r}")
        extra = sorted(set(e) - {"kernel", "shape", "lnc", "us", "kwargs", "nki_kernel"})
        if extra:
            raise _fail(where, f"unknown key {extra[0]!r} (expected kernel, shape, lnc, us, "
                        "kwargs, nki_kernel)")  # fmt: skip
        try:
            spec = get_spec(str(e["kernel"]))
        except InputError:
            raise _fail(where, f"kernel: unknown kernel {e['kernel']!r}; expected prefill or bwd"
                        ) from None  # fmt: skip
        us = e["us"]
        if not _number(us) or us <= 0:
            raise _fail(where, f"us: expected a positive latency in microseconds, got {us!r}")
        if e["lnc"] not in (1, 2) or isinstance(e["lnc"], bool):
            raise _fail(where, f"lnc: expected 1 or 2, got {e['lnc']!r}")
        shape = e["shape"]
        cls = _shape_class(spec.name)
        names = [f.name for f in dataclasses.fields(cls)]
        if not isinstance(shape, dict):
            raise _fail(where, f"shape: expected an object with {', '.join(names)}")
        for n in names:
            if n not in shape:
                raise _fail(where, f"shape: missing key {n!r}")
        unknown = sorted(set(shape) - set(names))
        if unknown:
            raise _fail(where, f"shape: unknown key {unknown[0]!r} (expected {', '.join(names)})")
        kw = e.get("kwargs", {})
        if not isinstance(kw, dict):
            raise _fail(where, "kwargs: expected an object")
        nk = e.get("nki_kernel", "mxcli")
        if not isinstance(nk, str):
            raise _fail(where, f"nki_kernel: expected a string, got {nk!r}")
        out.append(Measurement(spec.name, dict(shape), int(e["lnc"]), float(us), kw, nk, e))
    return out


def _merged(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        b = out.get(k)
        out[k] = _merged(b, v) if isinstance(b, Mapping) and isinstance(v, Mapping) else v
    return out


def _inputs(m: Measurement, where: str) -> tuple[dict[str, Any], dict[str, Any]]:
    from mxcli.kernels import profiling as prof
    from mxcli.kernels.spec import get_spec

    spec = get_spec(m.kernel)
    cls = _shape_class(spec.name)
    try:
        s = cls(**m.shape)
        tensors, kwargs = prof.prefill_inputs(s) if cls is prof.PrefillShape else prof.bwd_inputs(s)
        if m.kwargs:  # over the shape's own kwargs, objects (a bwd config) field by field
            kwargs = spec.resolve_kwargs(_merged(spec.dump_kwargs(kwargs), m.kwargs))
    except (InputError, TypeError) as exc:
        raise _fail(where, str(exc)) from None
    return tensors, kwargs


def record(m: Measurement, where: str = "measurement") -> Any:
    """Run the measured kernel once in check-only mode (recorded): its `KernelProfile`."""
    from mxcli.kernels import profiling as prof

    tensors, kwargs = _inputs(m, where)
    try:
        return prof.profile_kernel(m.kernel, tensors, kwargs, lnc=m.lnc, shape=m.shape,
                                   nki_kernel=m.nki_kernel)  # fmt: skip
    except InputError as exc:
        raise _fail(where, str(exc)) from None


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
            {**m.entry, "predicted_us": p, "residual": r}
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
