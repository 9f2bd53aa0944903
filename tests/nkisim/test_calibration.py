"""Ranges of the cost model's estimates and the refit of its fitted figures (issue 29 items 5
and 7): the same recorded instruction stream re-scheduled under other figure values.

The figure tables here are built by the tests (a documented figure re-marked ``fitted`` or
``assumed`` with a range), so the tests do not depend on which figures `cost.FIGURES` marks free
today; `test_every_free_figure_of_the_table_is_monotone` checks whatever the table holds."""

from __future__ import annotations

import dataclasses
import json
import random
from typing import Any

import pytest

from mxcli.errors import InputError
from mxcli.kernels import calibrating as kc
from mxcli.kernels import measurements
from mxcli.kernels import profiling as prof
from mxcli.kernels.blockwise_moe import profile as bwd_profile
from mxcli.kernels.rmsnorm_mx_prefill import profile as prefill_profile
from mxcli.nkisim import calibration as cal
from mxcli.nkisim import cost

PREFILL_SHAPES = [(32, 512, 16), (64, 512, 16), (32, 1024, 32)]  # (T, H, E), LNC 1


def _prefill(T: int, H: int, E: int, lnc: int = 1) -> Any:
    s = prefill_profile.PrefillShape(T, H, E, 2, "softmax", 4, 2, False)
    return prof.profile_kernel("prefill", *prefill_profile.prefill_inputs(s), lnc=lnc)


@pytest.fixture(scope="module")
def prefills() -> list[Any]:
    return [_prefill(*s) for s in PREFILL_SHAPES]


@pytest.fixture(scope="module")
def bwd() -> Any:
    s = bwd_profile.BwdShape(128, 256, 128, 2, 2, 128)
    return prof.profile_kernel("bwd", *bwd_profile.bwd_inputs(s), lnc=2)


def _table(**free: tuple[str, float, float]) -> tuple[cost.Figure, ...]:
    """`cost.FIGURES` with the named figures re-marked (kind, low, high) and every other one
    documented (fixed at its value), whatever the table marks free today."""
    out = []
    for f in cost.FIGURES:
        if f.key in free:
            kind, lo, hi = free[f.key]
            f = dataclasses.replace(f, kind=kind, low=lo, high=hi)
        else:
            f = dataclasses.replace(f, kind="documented", low=None, high=None)
        out.append(f)
    return tuple(out)


def _schedule_us(kp: Any, figures: Any, values: dict[str, float]) -> float:
    return kc._Evaluator(kp, kc.Calibration(), figures).schedule_us(values)


_TRN3 = {f.key: float(f.trn3) for f in cost.FIGURES}

# mixed directions: a higher rate or clock is faster, a higher overhead slower
MIXED = _table(
    dma_descriptor_overhead_bytes=("assumed", 128, 2048),
    dma_engine_bytes_per_ns=("assumed", 20, 40),
    vector_ghz=("assumed", 0.8, 1.6),
    act_vec_overhead_cycles=("assumed", 50, 400),
)


def _departure(ys: list[float]) -> float:
    """How far `ys` is from monotone (either way), relative to its largest value."""
    up = max(max(ys[: i + 1]) - y for i, y in enumerate(ys))
    down = max(y - min(ys[: i + 1]) for i, y in enumerate(ys))
    return min(up, down) / max(ys)


def test_the_schedule_is_nearly_monotone_in_each_figure(prefills: list[Any], bwd: Any) -> None:
    """The corners (calibration's docstring) are the extremes where the estimate is monotone in
    each figure: five points across each range, the others nominal, on a prefill and an LNC-2
    bwd; a greedy list schedule may depart from monotone, by at most 1% of the estimate here."""
    for kp in (prefills[0], bwd):
        ev = kc._Evaluator(kp, kc.Calibration(), MIXED)
        for f in cal.free_figures(MIXED):
            assert f.low is not None and f.high is not None
            ys = [ev.schedule_us({f.key: f.low + (f.high - f.low) * i / 4}) for i in range(5)]
            assert _departure(ys) <= 0.01, (f.key, ys)
            assert ys[0] != ys[-1], (f.key, "does not move this kernel")


def test_every_free_figure_of_the_table_is_nearly_monotone(bwd: Any) -> None:
    """Whatever `cost.FIGURES` marks fitted or assumed: the bwd schedule departs from monotone
    in it by at most 1% of the estimate."""
    ev = kc._Evaluator(bwd, kc.Calibration(), None)
    for f in cal.free_figures():
        assert f.low is not None and f.high is not None
        xs = sorted({f.low, f.trn3, f.high, (f.low + f.high) / 2})
        ys = [ev.schedule_us({f.key: x}) for x in xs]
        assert _departure(ys) <= 0.01, (f.key, xs, ys)


def test_range_of_a_monotone_estimate_is_its_exact_extremes() -> None:
    """A linear estimate with mixed directions: the all-low / all-high corners are NOT its
    extremes, the slow and fast corners are (and no figure is flagged)."""
    figs = (
        cost.Figure("a", 2, 2, "x", "test", "assumed", 1, 3),
        cost.Figure("b", 15, 15, "x", "test", "assumed", 10, 20),
    )

    def est(s: dict[str, float]) -> float:
        return 100 + 5 * s.get("a", 2) - 2 * s.get("b", 15)

    r = cal.estimate_range(est, figs)
    assert r.directions == {"a": 1, "b": -1} and r.non_monotone == []
    assert (r.low, r.high) == (est({"a": 1, "b": 20}), est({"a": 3, "b": 10})) == (65, 95)
    assert r.low < r.values["all-high"] < r.values["all-low"] < r.high
    assert r.nominal == 100 + 10 - 30


def test_range_flags_a_figure_the_estimate_is_not_monotone_in() -> None:
    figs = (cost.Figure("a", 2, 2, "x", "test", "assumed", 1, 3),)
    r = cal.estimate_range(lambda s: 10 - (s.get("a", 2) - 2) ** 2, figs)
    assert r.non_monotone == ["a"] and r.high == 10 and r.directions == {"a": 0}


def test_range_holds_the_box_on_a_kernel(bwd: Any) -> None:
    """Mixed directions on a real stream: the slow corner is well above the all-high one, and
    held-out points of the box lie in the range (within the 1% a greedy schedule may depart
    from monotone)."""
    ev = kc._Evaluator(bwd, kc.Calibration(), MIXED)
    free = cal.free_figures(MIXED)
    r = cal.estimate_range(ev.schedule_us, free)
    assert r.directions == {"act_vec_overhead_cycles": 1, "vector_ghz": -1,
                            "dma_engine_bytes_per_ns": -1, "dma_descriptor_overhead_bytes": 1}  # fmt: skip
    assert r.low <= r.values["fast"] < r.values["all-low"] < r.values["slow"] <= r.high
    assert r.values["all-high"] < 0.9 * r.values["slow"] and r.high <= 1.01 * r.values["slow"]
    assert r.low < r.nominal < r.high
    rng = random.Random(29)
    for _ in range(6):
        s = {f.key: rng.uniform(f.low, f.high) for f in free}  # type: ignore[arg-type]
        assert 0.99 * r.low <= ev.schedule_us(s) <= 1.01 * r.high


def test_ratio_range_shares_the_figures(prefills: list[Any]) -> None:
    """A kernel against itself: 1.0 at every shared setting, while the ratio of independent
    extremes would be high / low > 1; two different shapes: the ratio per setting."""
    a, b = prefills[0], prefills[2]
    free = cal.free_figures(MIXED)
    ea = kc._Evaluator(a, kc.Calibration(), MIXED)
    eb = kc._Evaluator(b, kc.Calibration(), MIXED)
    ra = cal.estimate_range(ea.schedule_us, free)
    rb = cal.estimate_range(eb.schedule_us, free)
    assert ra.high / ra.low > 1.2
    assert cal.ratio_range(ra, ra, ea.schedule_us, ea.schedule_us) == (1.0, 1.0, 1.0)
    nom, lo, hi = cal.ratio_range(ra, rb, ea.schedule_us, eb.schedule_us)
    settings = [*ra.settings.values(), *rb.settings.values()]
    per = [ea.schedule_us(s) / eb.schedule_us(s) for s in settings]
    assert (lo, hi) == (min(per), max(per)) and lo <= nom <= hi
    assert ra.low / rb.high < lo and hi < ra.high / rb.low  # tighter than independent extremes
    # from the JSON documents alone (what profile --json and bench_nki carry): the same
    # settings where both kernels' corners agree
    assert ra.settings["slow"] == rb.settings["slow"]
    doc = cal.ratio_of_docs(ra.as_dict(), rb.as_dict())
    assert (doc["nominal"], doc["low"], doc["high"]) == pytest.approx((nom, lo, hi), rel=1e-12)
    same = kc.comparison_ranges(kc.profile_ranges(a), kc.profile_ranges(a))
    assert same["schedule_ratio"] == {"nominal": 1.0, "low": 1.0, "high": 1.0}


def test_verdict_needs_disjoint_ranges() -> None:
    def r(lo: float, hi: float) -> dict[str, Any]:
        return {"schedule_us": {"low": lo, "high": hi}}

    assert kc.verdict(r(1, 2), r(3, 4), "a", "b") == "a faster"
    assert kc.verdict(r(3, 4), r(1, 2.9), "a", "b") == "b faster"
    assert "not distinguishable" in kc.verdict(r(1, 3), r(2.9, 4), "a", "b")


def test_profile_ranges_on_the_table(prefills: list[Any]) -> None:
    """`profile_ranges` over the table's free figures: nominal = the profile's own estimate."""
    rg = kc.profile_ranges(prefills[0])
    sched = rg["schedule_us"]
    assert sched["nominal"] == pytest.approx(prefills[0].profile.makespan_ns / 1e3, rel=1e-12)
    assert sched["low"] <= sched["nominal"] <= sched["high"]
    assert set(rg["figures"]) == {f.key for f in cal.free_figures()}
    json.dumps(rg)  # JSON-ready


def _measure(kps: list[Any], figures: Any, truth: dict[str, float]) -> list[kc.Measurement]:
    return [kc.Measurement("rmsnorm_mx_prefill", {}, 1, _schedule_us(kp, figures, truth), {},
                           "mxcli", {}) for kp in kps]  # fmt: skip


@pytest.mark.parametrize(
    "truth",
    [{"dma_descriptor_overhead_bytes": 900.0},
     {"dma_descriptor_overhead_bytes": 300.0, "vector_ghz": 0.9}],
)  # fmt: skip
def test_calibration_recovers_the_figures_that_produced_the_latencies(
    prefills: list[Any], truth: dict[str, float]
) -> None:
    """Latencies the model produced at known figure values (3 tiny shapes) -> the fit, started
    from the table's values, finds those values again (the model is exact here: residual 0)."""
    figures = _table(
        dma_descriptor_overhead_bytes=("fitted", 128, 4096),
        vector_ghz=("fitted" if "vector_ghz" in truth else "documented", 0.6, 2.4),
    )
    ms = _measure(prefills, figures, truth)
    res = kc.calibrate(prefills, ms, figures)
    assert res.start["dma_descriptor_overhead_bytes"] == _TRN3["dma_descriptor_overhead_bytes"]
    assert set(res.values) == set(truth)
    for k, v in truth.items():
        assert res.values[k] == pytest.approx(v, rel=1e-6), (k, res)
        lo, hi = res.ranges[k]
        assert lo <= res.values[k] <= hi and hi - lo <= 1e-6 * v  # zero residual: a point
    assert res.rms_residual < 1e-9


def test_calibration_bounds_and_residual_ranges(prefills: list[Any]) -> None:
    """Latencies beyond what the range allows: the figure stops at its bound; noisy latencies
    give a range from the residual that holds the value."""
    figures = _table(dma_descriptor_overhead_bytes=("fitted", 256, 1024))
    ms = _measure(prefills, figures, {"dma_descriptor_overhead_bytes": 1024.0})
    for m in ms:
        m.us *= 1.5
    res = kc.calibrate(prefills, ms, figures)
    assert res.values["dma_descriptor_overhead_bytes"] == pytest.approx(1024.0)
    assert all(r < 0 for r in res.residuals)  # the model stays below the latencies: bounded
    ms = _measure(prefills, figures, {"dma_descriptor_overhead_bytes": 600.0})
    for m, f in zip(ms, (1.01, 0.99, 1.005), strict=True):
        m.us *= f
    res = kc.calibrate(prefills, ms, figures)
    lo, hi = res.ranges["dma_descriptor_overhead_bytes"]
    assert 256 <= lo < res.values["dma_descriptor_overhead_bytes"] < hi <= 1024
    assert 0 < res.rms_residual < 0.02


def test_calibration_file_round_trip_and_bad_keys(prefills: list[Any], tmp_path: Any) -> None:
    figures = _table(dma_descriptor_overhead_bytes=("fitted", 128, 4096))
    ms = _measure(prefills, figures, {"dma_descriptor_overhead_bytes": 700.0})
    res = kc.calibrate(prefills, ms, figures)
    doc = kc.calibration_doc(res, ms)
    path = tmp_path / "cal.json"
    kc.write_calibration(path, doc, force=False)
    c = kc.load_calibration(path, figures)
    assert c.values["dma_descriptor_overhead_bytes"] == pytest.approx(700.0, rel=1e-6)
    assert (
        c.hardware("trn3", figures)["dma_descriptor_overhead_bytes"]
        == c.values["dma_descriptor_overhead_bytes"]
    )
    # the calibrated profile is the model at the calibrated value
    kp = prof.profile_kernel(
        "prefill", *prefill_profile.prefill_inputs(prefill_profile.PrefillShape(32, 512, 16, 2, "softmax", 4, 2, False)),
        lnc=1, calibration=c,
    )  # fmt: skip
    assert kp.profile.makespan_ns / 1e3 == pytest.approx(ms[0].us, rel=1e-6)
    bad = [
        ({**doc, "figures": {"no_such_figure": 1.0}}, "unknown figure key 'no_such_figure'"),
        ({**doc, "figures": {"vector_ghz": 1.2}}, "'vector_ghz' is documented, not fitted"),
        ({**doc, "figures": {"dma_descriptor_overhead_bytes": 9000}}, "expected a number in"),
        ({k: v for k, v in doc.items() if k != "figures"}, "missing key 'figures'"),
        ({**doc, "format": "x"}, "not a calibration file"),
    ]
    for d, msg in bad:
        p = tmp_path / "bad.json"
        p.write_text(json.dumps(d))
        with pytest.raises(InputError, match=msg) as ei:
            kc.load_calibration(p, figures)
        assert str(p) in str(ei.value)


def test_fit_needs_fitted_figures(prefills: list[Any]) -> None:
    figures = _table()  # every figure documented
    with pytest.raises(Exception, match="no fitted figure"):
        kc.calibrate(prefills, _measure(prefills, figures, {}), figures)


def test_extrapolated_profile_carries_its_range() -> None:
    """`profile_bwd_scaled` (bench_nki's README shapes): the range's nominal is the
    extrapolated estimate itself (the extrapolation redone per figure setting)."""
    out = bwd_profile.profile_bwd_scaled(bwd_profile.BwdShape(256, 256, 128, 4, 2, 128), lnc=1)
    sched, lb = out["range"]["schedule_us"], out["range"]["lower_bound_us"]
    assert sched["nominal"] == pytest.approx(out["schedule_us"], rel=1e-9)
    assert lb["nominal"] == pytest.approx(out["lower_bound_us"], rel=1e-9)
    assert sched["low"] <= sched["nominal"] <= sched["high"]
    assert lb["low"] <= lb["nominal"] <= lb["high"]


def test_a_figure_the_measurements_do_not_move_keeps_its_value_and_range(
    prefills: list[Any],
) -> None:
    """A fitted figure no measured instruction uses (this prefill has no VectorE exponential): the fit
    leaves it where it started, and its range stays the declared one (nothing constrains it)."""
    figures = _table(
        dma_descriptor_overhead_bytes=("fitted", 128, 4096),
        exponential_vs_scalar=("fitted", 2, 8),
    )
    ev = kc._Evaluator(prefills[0], kc.Calibration(), figures)
    assert ev.schedule_us({"exponential_vs_scalar": 2}) == ev.schedule_us(
        {"exponential_vs_scalar": 8}
    )
    ms = _measure(prefills, figures, {"dma_descriptor_overhead_bytes": 700.0})
    for m, f in zip(ms, (1.01, 0.99, 1.005), strict=True):
        m.us *= f
    res = kc.calibrate(prefills, ms, figures)
    assert res.values["exponential_vs_scalar"] == pytest.approx(_TRN3["exponential_vs_scalar"])
    assert res.ranges["exponential_vs_scalar"] == (2.0, 8.0)
    lo, hi = res.ranges["dma_descriptor_overhead_bytes"]
    assert lo < res.values["dma_descriptor_overhead_bytes"] < hi


def test_measurement_kwargs_merge_into_the_shapes_field_by_field() -> None:
    base = {"block_size": 128, "config": {"bias": False, "skip_dma": {"a": 1, "b": 2}}}
    over = {"config": {"skip_dma": {"b": 3}, "bias": True}}
    assert measurements._merged(base, over) == {
        "block_size": 128, "config": {"bias": True, "skip_dma": {"a": 1, "b": 3}}
    }  # fmt: skip
