"""The metrics of SPEC 10 against hand-computed values: Sharpe annualised from the bars' own
spacing (daily, hourly, minute, weekly), total return, max drawdown, turnover, costs."""

import datetime as dt
import math
import statistics

import numpy as np
import pytest

from foxhunt.reference.metrics import (
    METRIC_NAMES,
    SegmentMetrics,
    annualised_sharpe,
    bar_seconds,
    bars_per_year,
    costs_paid,
    max_drawdown,
    segment_metrics,
    total_return,
    turnover,
)

RETURNS = [0.01, -0.02, 0.03, 0.0, 0.015, -0.005]


def _hand_sharpe(r, periods_per_year):
    return statistics.mean(r) / statistics.stdev(r) * math.sqrt(periods_per_year)


def _business_days(n, start=dt.date(2021, 1, 4)):
    """Epoch seconds of ``n`` weekdays at midnight UTC (weekends skipped: 3-day gaps)."""
    days, d = [], start
    while len(days) < n:
        if d.weekday() < 5:
            days.append(int(dt.datetime(d.year, d.month, d.day, tzinfo=dt.timezone.utc).timestamp()))
        d += dt.timedelta(days=1)
    return np.array(days, np.int64)


def test_daily_bars_give_the_textbook_sqrt_252_sharpe():
    ts = _business_days(len(RETURNS) + 1)
    assert bar_seconds(ts) == 86_400.0  # the weekend gaps do not move the median
    per_year = bars_per_year(bar_seconds(ts))
    assert per_year == 252
    assert annualised_sharpe(RETURNS, per_year) == pytest.approx(_hand_sharpe(RETURNS, 252), rel=1e-12)
    # The bug: annualised as 1-minute bars the daily figure came out 37x too large.
    assert annualised_sharpe(RETURNS) / annualised_sharpe(RETURNS, per_year) == pytest.approx(
        math.sqrt(252 * 23 * 60 / 252))


def test_minute_bars_with_overnight_gaps_annualise_over_the_trading_session():
    # Two sessions of 1-minute bars with a one-hour break between them.
    day1 = 1_700_000_000 + 60 * np.arange(300)
    ts = np.concatenate([day1, day1[-1] + 3600 + 60 * np.arange(300)])
    assert bar_seconds(ts) == 60.0
    assert bars_per_year(60.0) == 252 * 23 * 60
    assert annualised_sharpe(RETURNS, bars_per_year(60.0)) == pytest.approx(
        _hand_sharpe(RETURNS, 252 * 23 * 60), rel=1e-12)


@pytest.mark.parametrize("seconds, per_year", [
    (3600, 252 * 23),                 # hourly: 23-hour futures sessions
    (300, 252 * 23 * 12),             # 5-minute
    (1.5, 252 * 23 * 3600 / 1.5),     # sub-second spacing, float timestamps
    (2 * 86_400, 126),                # every other trading day
    (7 * 86_400, 365.25 / 7),         # weekly: calendar weeks, 52.18
    (30 * 86_400, 365.25 / 30),       # monthly-ish
])
def test_bars_per_year_by_spacing(seconds, per_year):
    assert bars_per_year(seconds) == pytest.approx(per_year, rel=1e-12)


def test_bar_spacing_errors_name_the_problem():
    with pytest.raises(ValueError, match="at least two"):
        bar_seconds([5])
    with pytest.raises(ValueError, match="increasing"):
        bar_seconds([10, 5, 0])
    with pytest.raises(ValueError, match="bar_seconds"):
        bars_per_year(0)
    with pytest.raises(ValueError, match="bar_seconds"):
        bars_per_year(float("nan"))


def test_total_return_compounds():
    assert total_return([0.1, -0.2, 0.05, 0.1]) == pytest.approx(1.1 * 0.8 * 1.05 * 1.1 - 1, rel=1e-12)
    assert total_return([]) == 0.0


def test_max_drawdown_by_hand():
    # equity 1.1, 0.88, 0.924, 1.0164: the fall from 1.1 to 0.88 is 20%.
    assert max_drawdown([0.1, -0.2, 0.05, 0.1]) == pytest.approx(0.2, rel=1e-12)
    # A loss on the first bar counts from the starting equity of 1.
    assert max_drawdown([-0.1, 0.05]) == pytest.approx(0.1, rel=1e-12)
    # Two drawdowns: 1 -> 1.2 -> 0.9 (25%), then 0.9 -> 1.5 -> 1.35 (10%).
    r = [0.2, 0.9 / 1.2 - 1, 1.5 / 0.9 - 1, 1.35 / 1.5 - 1]
    assert max_drawdown(r) == pytest.approx(0.25, rel=1e-12)
    assert max_drawdown([0.01, 0.02, 0.0]) == 0.0


def test_turnover_counts_units_traded_from_flat():
    assert turnover([0, 1, 1, -1, 0]) == 4.0  # 1 in, 2 to flip, 1 out
    assert turnover([1, 1, 1]) == 1.0        # entering the first position counts
    assert turnover([0, 0]) == 0.0


def test_costs_are_summed():
    assert costs_paid([1e-4, 0.0, 2.5e-4]) == pytest.approx(3.5e-4, rel=1e-12)


def test_non_finite_inputs_raise_naming_the_index():
    with pytest.raises(ValueError, match="positions: non-finite value nan at index 2"):
        turnover([0, 1, np.nan])
    with pytest.raises(ValueError, match="costs: non-finite value inf at index 0"):
        costs_paid([np.inf])
    with pytest.raises(ValueError, match="returns: non-finite"):
        max_drawdown([0.1, np.nan])


def test_segment_metrics_gathers_each_metric():
    r, p, c = [0.1, -0.2, 0.05, 0.1], [1, 1, -1, 0], [0.001, 0.0, 0.002, 0.001]
    m = segment_metrics(r, p, c, 252)
    want = dict(sharpe=_hand_sharpe(r, 252), total_return=1.1 * 0.8 * 1.05 * 1.1 - 1,
                max_drawdown=0.2, turnover=1 + 2 + 1, costs=0.004)
    assert isinstance(m, SegmentMetrics) and m.bars == 4
    for name, value in want.items():
        assert getattr(m, name) == pytest.approx(value, rel=1e-12), name
    assert METRIC_NAMES == ("sharpe", "total_return", "max_drawdown", "turnover", "costs")
    with pytest.raises(ValueError, match="lengths 4, 3, 4"):
        segment_metrics(r, p[:3], c, 252)
