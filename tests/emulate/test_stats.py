"""The paired-interval code against a hand-worked example and a statistics table."""

from __future__ import annotations

import math

import pytest

from mxcli.emulate.stats import interval, t_quantile_975, verdict


def test_t_quantiles_table_and_expansion() -> None:
    assert t_quantile_975(1) == pytest.approx(12.7062, abs=1e-4)
    assert t_quantile_975(3) == pytest.approx(3.1824, abs=1e-4)
    assert t_quantile_975(4) == pytest.approx(2.7764, abs=1e-4)
    # past the table: the Cornish-Fisher expansion against table values (df 40, 60, 120)
    assert t_quantile_975(40) == pytest.approx(2.021075, abs=2e-5)
    assert t_quantile_975(60) == pytest.approx(2.000298, abs=2e-5)
    assert t_quantile_975(120) == pytest.approx(1.979930, abs=2e-5)
    # and it joins the table smoothly: its df=31 value sits between df 30 and the df 40 value
    assert 2.021075 < t_quantile_975(31) < t_quantile_975(30)
    with pytest.raises(ValueError):
        t_quantile_975(0)


def test_interval_hand_worked() -> None:
    """Issue 31's four paired gaps NEURON - bf16: +0.007, +0.001, +0.065, -0.004.

    mean = 0.069 / 4 = 0.01725; deviations -0.01025, -0.01625, +0.04775, -0.02125; squares sum
    to 0.00310075; sd = sqrt(0.00310075 / 3) = 0.0321494; se = sd / 2 = 0.0160747 (t = 1.07, as
    the issue says); half-width = t(0.975, 3) * se = 3.182446 * 0.0160747 = 0.0511568."""
    iv = interval([0.007, 0.001, 0.065, -0.004])
    assert iv["n"] == 4 and iv["missing"] == 0
    assert iv["mean"] == pytest.approx(0.01725, abs=1e-12)
    assert iv["sd"] == pytest.approx(0.0321494, abs=1e-7)
    assert iv["mean"] / (iv["sd"] / 2) == pytest.approx(1.0731, abs=1e-4)
    assert iv["half_width"] == pytest.approx(0.0511568, abs=1e-6)
    assert iv["low"] == pytest.approx(-0.0339068, abs=1e-6)
    assert iv["high"] == pytest.approx(0.0684068, abs=1e-6)
    assert verdict(iv) == "not distinguishable from bf16"


def test_verdict_only_when_interval_excludes_zero() -> None:
    assert verdict(interval([0.02, 0.03, 0.025, 0.028, 0.022])).endswith("higher loss")
    assert verdict(interval([-0.02, -0.03, -0.025])).endswith("lower loss")
    assert verdict(interval([0.02, -0.001, 0.03])) == "not distinguishable from bf16"


def test_missing_values_and_too_few() -> None:
    iv = interval([0.01, None, math.nan, 0.03])
    assert iv["n"] == 2 and iv["missing"] == 2 and iv["mean"] == pytest.approx(0.02)
    one = interval([0.5])
    assert one["mean"] == 0.5 and one["low"] is None and verdict(one).startswith("undetermined")
    assert interval([])["mean"] is None


def test_ema_hand_worked() -> None:
    from mxcli.emulate.study import ema, ema_two_way

    assert ema([1.0, 3.0, 3.0], 0.5) == [1.0, 2.0, 2.5]
    # backward over [1, 2, 2.5]: 2.5, 2.5 + 0.5 (2 - 2.5) = 2.25, 2.25 + 0.5 (1 - 2.25) = 1.625
    assert ema_two_way([1.0, 3.0, 3.0], 0.5) == [1.625, 2.25, 2.5]
    assert ema([1.0, None, 3.0], 0.5) == [1.0, None, None]
    assert ema_two_way([1.0, 3.0, None], 0.5) == [1.5, 2.0, None]
