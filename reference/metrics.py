"""Trading metrics of a segment, written once (SPEC 10: "metrics that mean what they say").

Every function takes per-bar series of one segment, oldest first, as 1-D float arrays:
``returns`` (the policy's per-bar reward: ``held * next-bar return - costs``, a fraction of
notional), ``positions`` (the position held during each bar, in units of notional) and
``costs`` (the cost paid at each bar, a fraction of notional). All are computed in float64.
Non-finite inputs raise ``ValueError`` naming the index: a metric of a series with a NaN in it
would be NaN, and nothing downstream could tell which bar was at fault.

Annualisation follows the data's own bar spacing (``bar_seconds`` of the timestamps, then
``bars_per_year``): 1-minute, hourly and daily bars each give the textbook figure.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

SECONDS_PER_DAY = 86_400.0
#: Futures exchanges trade about 252 days a year, CME-style sessions about 23 hours a day.
TRADING_DAYS_PER_YEAR = 252
TRADING_HOURS_PER_DAY = 23.0
#: Bars a week or more apart span their weekends: they count calendar years of 365.25 days.
CALENDAR_DAYS_PER_YEAR = 365.25
#: The synthetic market's 1-minute bars: 252 * 23 * 60 = 347,760 bars a year.
DEFAULT_BARS_PER_YEAR = TRADING_DAYS_PER_YEAR * 23 * 60


def _series(name: str, values) -> np.ndarray:
    x = np.asarray(values, dtype=np.float64)
    if x.ndim != 1:
        raise ValueError(f"{name}: shape {x.shape} is not allowed; need a 1-D per-bar series")
    if not np.all(np.isfinite(x)):
        i = int(np.argmax(~np.isfinite(x)))
        raise ValueError(f"{name}: non-finite value {float(x[i])!r} at index {i}; {name} must be finite")
    return x


def bar_seconds(timestamps) -> float:
    """The bar spacing of a series: the median of ``diff(timestamps)`` in seconds (float).

    The median, not the mean: intraday data has overnight and weekend gaps, daily data has
    weekends and holidays, and the median still gives the bar size. ``timestamps`` are
    seconds (``Bars.timestamp``: epoch seconds, int64 or float64). Raises ``ValueError`` for
    fewer than two timestamps or a median spacing that is not > 0.
    """
    ts = np.asarray(timestamps, dtype=np.float64)
    if ts.ndim != 1 or ts.size < 2:
        raise ValueError(f"timestamps: shape {ts.shape} is not allowed; need at least two "
                         "bar timestamps to measure the bar spacing")
    spacing = float(np.median(np.diff(ts)))
    if not (math.isfinite(spacing) and spacing > 0):
        raise ValueError(f"timestamps: median spacing {spacing!r} s is not allowed; "
                         "timestamps must be increasing seconds")
    return spacing


def bars_per_year(bar_seconds: float, trading_days: int = TRADING_DAYS_PER_YEAR,
                  hours_per_day: float = TRADING_HOURS_PER_DAY) -> float:
    """Bars in a year for bars ``bar_seconds`` apart (``dt``):

    - intraday (``dt`` < 1 day): ``trading_days * hours_per_day * 3600 / dt``, the bars in a
      year of trading sessions (1-minute bars: 252 * 23 * 60 = 347,760; hourly: 5,796);
    - daily up to weekly (1 day <= ``dt`` < 7 days): ``trading_days * 86400 / dt`` (daily
      bars: 252, the textbook ``sqrt(252)``; the data holds trading days only);
    - a week or longer: ``365.25 * 86400 / dt`` calendar periods (weekly: 52.18; a bar that
      long spans its weekends and holidays, so the trading-day count does not apply).
    """
    if not (isinstance(bar_seconds, (int, float, np.floating, np.integer))
            and math.isfinite(bar_seconds) and bar_seconds > 0):
        raise ValueError(f"bar_seconds: {bar_seconds!r} is not allowed; must be a finite value > 0")
    dt = float(bar_seconds)
    if dt < SECONDS_PER_DAY:
        return trading_days * hours_per_day * 3600.0 / dt
    if dt < 7 * SECONDS_PER_DAY:
        return trading_days * SECONDS_PER_DAY / dt
    return CALENDAR_DAYS_PER_YEAR * SECONDS_PER_DAY / dt


def annualised_sharpe(returns, bars_per_year: float = DEFAULT_BARS_PER_YEAR) -> float:
    """``mean(r) / std(r, ddof=1) * sqrt(bars_per_year)`` over per-bar returns ``r``.

    No risk-free rate. 0.0 for fewer than two returns or zero variance (e.g. a flat policy).
    Raises ``ValueError`` for non-finite returns or a ``bars_per_year`` that is not > 0.
    """
    r = _series("returns", returns)
    if not (isinstance(bars_per_year, (int, float, np.floating, np.integer))
            and math.isfinite(bars_per_year) and bars_per_year > 0):
        raise ValueError(f"bars_per_year: {bars_per_year!r} is not allowed; need a finite value > 0")
    if r.size < 2 or np.all(r == r[0]):
        return 0.0
    std = float(np.std(r, ddof=1))
    if std == 0.0:
        return 0.0
    return float(np.mean(r) / std * math.sqrt(bars_per_year))


def equity_curve(returns, initial: float = 1.0) -> np.ndarray:
    """Compounded equity ``initial * cumprod(1 + r)``, float64 ``[len(returns)]`` (the value
    after each bar). Raises ``ValueError`` for non-finite returns or a return <= -1."""
    r = _series("returns", returns)
    if np.any(r <= -1):
        i = int(np.argmax(r <= -1))
        raise ValueError(f"returns: {r[i]!r} at index {i} is not allowed; a return <= -1 wipes "
                         "out equity")
    return float(initial) * np.cumprod(1.0 + r)


def total_return(returns) -> float:
    """``prod(1 + r) - 1``: the compounded return of the segment (0.0 for no bars)."""
    eq = equity_curve(returns)
    return float(eq[-1] - 1.0) if eq.size else 0.0


def max_drawdown(returns) -> float:
    """``max_t (1 - E_t / max_{s <= t} E_s)`` over the equity ``E`` (starting at 1 before the
    first bar, so a first-bar loss counts): the largest fall from a peak, a fraction in
    ``[0, 1)``; 0.0 when equity never falls below an earlier peak."""
    eq = np.concatenate([[1.0], equity_curve(returns)])
    peak = np.maximum.accumulate(eq)
    return float(np.max(1.0 - eq / peak))


def turnover(positions) -> float:
    """``sum_t |p_t - p_{t-1}|`` with ``p_{-1} = 0`` (the segment starts flat): units of
    notional traded over the segment (a flat -> long -> short path: 1 + 2 = 3)."""
    p = _series("positions", positions)
    return float(np.sum(np.abs(np.diff(p, prepend=0.0))))


def costs_paid(costs) -> float:
    """``sum_t cost_t``: execution costs paid over the segment, a fraction of notional."""
    return float(np.sum(_series("costs", costs)))


@dataclass(frozen=True)
class SegmentMetrics:
    """The metrics of one policy on one segment (each field the function of the same name)."""

    sharpe: float
    total_return: float
    max_drawdown: float
    turnover: float
    costs: float
    bars: int


#: The metric names, in report order (``SegmentMetrics`` without the bar count).
METRIC_NAMES = tuple(f.name for f in dataclasses.fields(SegmentMetrics) if f.name != "bars")


def segment_metrics(returns, positions, costs, bars_per_year: float) -> SegmentMetrics:
    """All the metrics of one segment; ``returns``, ``positions``, ``costs`` of one length."""
    r, p, c = _series("returns", returns), _series("positions", positions), _series("costs", costs)
    if not r.shape == p.shape == c.shape:
        raise ValueError(f"returns, positions, costs: lengths {r.size}, {p.size}, {c.size} "
                         "are not allowed; need one length")
    return SegmentMetrics(sharpe=annualised_sharpe(r, bars_per_year), total_return=total_return(r),
                          max_drawdown=max_drawdown(r), turnover=turnover(p), costs=costs_paid(c),
                          bars=int(r.size))
