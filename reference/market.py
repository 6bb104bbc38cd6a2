"""The bundled synthetic futures market, the OHLCV CSV loader and the state features.

Three pieces, all plain NumPy and deterministic:

* :class:`SyntheticMarket` -- a seedable, Markov regime-switching price process (trend up,
  trend down, mean-reverting high volatility) that produces :class:`Bars` with regime labels.
* :func:`load_csv` -- real OHLCV bars from a CSV file, validated row by row.
* :func:`market_features` / :func:`state_features` -- the causal per-bar market features and
  the agent's state vector (market features, then position features, zero-padded to
  ``state_dim``; 128 for the ``seed`` preset).

These are not CUDA kernels (the environment runs on the host), so this module has no
``KERNELS`` table. Price paths and features are computed in float64 internally, on purpose
(cumulative sums over tens of thousands of bars), and rounded to float32 once at the end;
every array handed out is float32 (prices, volumes, features) or int64/float64 (timestamps)
or int8 (regime labels).
"""

from __future__ import annotations

import bisect
import csv
import gzip
import io
import math
import zlib
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

__all__ = [
    "Bars",
    "RegimeParams",
    "SyntheticMarket",
    "REGIME_TREND_UP",
    "REGIME_TREND_DOWN",
    "REGIME_MEAN_REVERT",
    "REGIME_NAMES",
    "DEFAULT_REGIMES",
    "DEFAULT_TRANSITION",
    "CSV_COLUMNS",
    "load_csv",
    "REGIME_LABEL_WINDOW",
    "REGIME_LABEL_LOOKBACK",
    "causal_regime_labels",
    "regime_labels",
    "DEFAULT_WINDOWS",
    "FEATURE_CLIP",
    "N_GLOBAL_FEATURES",
    "N_WINDOW_FEATURES",
    "N_POSITION_FEATURES",
    "n_market_features",
    "market_feature_names",
    "feature_warmup",
    "market_features",
    "state_features",
]

# --------------------------------------------------------------------------------------------
# Bars
# --------------------------------------------------------------------------------------------

_PRICE_FIELDS = ("open", "high", "low", "close")


@dataclass(frozen=True)
class Bars:
    """A series of OHLCV bars, oldest first.

    Fields (all 1-D, one length ``n``):

    * ``timestamp`` -- int64 (e.g. epoch seconds) or float64, strictly increasing (the CSV
      loader enforces this; the constructor only checks shape and dtype).
    * ``open``, ``high``, ``low``, ``close``, ``volume`` -- float32.
    * ``regime`` -- int8 regime labels (synthetic data) or ``None`` (real data).

    The constructor converts array-likes to these dtypes (prices and volume are rounded to
    float32 once) and raises ``ValueError`` for mismatched lengths or non-1-D inputs.
    """

    timestamp: np.ndarray
    open: np.ndarray
    high: np.ndarray
    low: np.ndarray
    close: np.ndarray
    volume: np.ndarray
    regime: np.ndarray | None = field(default=None)

    def __post_init__(self) -> None:
        ts = np.asarray(self.timestamp)
        if ts.dtype.kind in "iub":
            ts = ts.astype(np.int64)
        elif ts.dtype.kind == "f":
            ts = ts.astype(np.float64)
        else:
            raise ValueError(
                f"timestamp: dtype {ts.dtype} is not allowed; use int64 or float64 values"
            )
        if ts.ndim != 1:
            raise ValueError(f"timestamp: shape {ts.shape} is not allowed; must be 1-D")
        object.__setattr__(self, "timestamp", ts)
        n = ts.shape[0]
        for name in (*_PRICE_FIELDS, "volume"):
            arr = np.asarray(getattr(self, name), dtype=np.float32)
            if arr.shape != (n,):
                raise ValueError(
                    f"{name}: shape {arr.shape} does not match timestamp shape ({n},); "
                    "all bar fields must be 1-D of one length"
                )
            object.__setattr__(self, name, arr)
        if self.regime is not None:
            reg = np.asarray(self.regime)
            if reg.shape != (n,):
                raise ValueError(f"regime: shape {reg.shape} does not match timestamp shape ({n},)")
            if reg.dtype.kind not in "iu":
                raise ValueError(f"regime: dtype {reg.dtype} is not allowed; use integers")
            object.__setattr__(self, "regime", reg.astype(np.int8))

    def __len__(self) -> int:
        return int(self.timestamp.shape[0])

    def slice(self, start: int | None = None, stop: int | None = None) -> Bars:
        """Bars ``[start, stop)`` (Python slice semantics; arrays are copied)."""
        sl = slice(start, stop)
        return Bars(
            timestamp=self.timestamp[sl].copy(),
            open=self.open[sl].copy(),
            high=self.high[sl].copy(),
            low=self.low[sl].copy(),
            close=self.close[sl].copy(),
            volume=self.volume[sl].copy(),
            regime=None if self.regime is None else self.regime[sl].copy(),
        )


# --------------------------------------------------------------------------------------------
# Synthetic market
# --------------------------------------------------------------------------------------------

REGIME_TREND_UP = 0
REGIME_TREND_DOWN = 1
REGIME_MEAN_REVERT = 2
REGIME_NAMES = ("trend_up", "trend_down", "mean_revert")


@dataclass(frozen=True)
class RegimeParams:
    """Per-bar dynamics of one regime (all in log-price units per bar).

    Log return of bar t in this regime::

        r_t = drift - kappa * dev_{t-1} + vol * eps_t,      eps_t ~ N(0, 1)

    where ``dev`` is the log price minus its value just before the regime was entered
    (so ``kappa = 0`` is a random walk with drift, ``0 < kappa < 1`` an Ornstein-Uhlenbeck
    pull back to the entry level: lag-1 autocorrelation of returns about ``-kappa/2``).

    ``volume_mean`` is the mean bar volume; ``range_scale`` sets how far high/low reach
    beyond max/min(open, close), in units of ``vol``.
    """

    drift: float
    vol: float
    kappa: float = 0.0
    volume_mean: float = 1000.0
    range_scale: float = 0.5

    def __post_init__(self) -> None:
        for name in ("drift", "vol", "kappa", "volume_mean", "range_scale"):
            value = getattr(self, name)
            if not math.isfinite(value):
                raise ValueError(f"RegimeParams.{name}: {value!r} is not finite")
        if self.vol <= 0:
            raise ValueError(f"RegimeParams.vol: {self.vol!r} is not allowed; must be > 0")
        if not 0.0 <= self.kappa < 1.0:
            raise ValueError(
                f"RegimeParams.kappa: {self.kappa!r} is not allowed; need 0 <= kappa < 1"
            )
        if self.volume_mean <= 0:
            raise ValueError(
                f"RegimeParams.volume_mean: {self.volume_mean!r} is not allowed; must be > 0"
            )
        if self.range_scale < 0:
            raise ValueError(
                f"RegimeParams.range_scale: {self.range_scale!r} is not allowed; must be >= 0"
            )


DEFAULT_REGIMES = (
    RegimeParams(drift=2e-4, vol=1e-3, kappa=0.0, volume_mean=1000.0),  # trend up
    RegimeParams(drift=-2e-4, vol=1e-3, kappa=0.0, volume_mean=1000.0),  # trend down
    RegimeParams(drift=0.0, vol=2.5e-3, kappa=0.3, volume_mean=2000.0),  # mean-reverting, high vol
)
# Rows: from-regime; columns: to-regime. Expected stay of about 100 bars in each regime.
DEFAULT_TRANSITION = (
    (0.990, 0.003, 0.007),
    (0.003, 0.990, 0.007),
    (0.005, 0.005, 0.990),
)

# "strong_trend": a persistent, clearly profitable up-trend (drift/vol = 0.5 per bar) with
# short mean-reverting interruptions; used where a test needs "a trained policy beats flat".
STRONG_TREND_REGIMES = (
    RegimeParams(drift=5e-4, vol=1e-3, kappa=0.0, volume_mean=1000.0),
    RegimeParams(drift=-2e-4, vol=1e-3, kappa=0.0, volume_mean=1000.0),
    RegimeParams(drift=0.0, vol=1.5e-3, kappa=0.3, volume_mean=1500.0),
)
STRONG_TREND_TRANSITION = (
    (0.998, 0.000, 0.002),
    (0.200, 0.800, 0.000),
    (0.100, 0.000, 0.900),
)

VOLUME_NOISE = 0.3  # log-normal volume noise (sigma of log volume)
DEFAULT_START_PRICE = 100.0
DEFAULT_START_TIMESTAMP = 1_700_000_000  # epoch seconds (2023-11-14)
DEFAULT_BAR_SECONDS = 60
_ROW_SUM_TOL = 1e-6


def _stationary_distribution(transition: np.ndarray) -> np.ndarray:
    """pi with pi P = pi, sum pi = 1 (least squares; uniform if that fails)."""
    k = transition.shape[0]
    a = np.vstack([transition.T - np.eye(k), np.ones((1, k))])
    b = np.zeros(k + 1)
    b[-1] = 1.0
    pi, *_ = np.linalg.lstsq(a, b, rcond=None)
    pi = np.clip(pi, 0.0, None)
    total = pi.sum()
    return pi / total if total > 0 else np.full(k, 1.0 / k)


class SyntheticMarket:
    """Deterministic, seedable, Markov regime-switching synthetic futures market.

    ``SyntheticMarket(seed, n_bars, regimes=DEFAULT_REGIMES, transition=DEFAULT_TRANSITION,
    ...).generate()`` returns :class:`Bars` with regime labels (indices into ``regimes``;
    for the default set 0 = trend up, 1 = trend down, 2 = mean-reverting high volatility).

    Process (see :class:`RegimeParams` for the per-regime return equation):

    * regimes follow a Markov chain with row-stochastic ``transition[from, to]``; the first
      bar's regime is ``initial_regime`` or, if ``None``, drawn from the chain's stationary
      distribution;
    * ``close_t = start_price * exp(sum_{s<=t} r_s)``, ``open_t = close_{t-1}``
      (``open_0 = start_price``);
    * ``high_t = max(open_t, close_t) * exp(range_scale * vol * |a_t|)``,
      ``low_t = min(open_t, close_t) * exp(-range_scale * vol * |b_t|)``, a, b ~ N(0, 1);
    * ``volume_t = volume_mean * exp(VOLUME_NOISE * n_t - VOLUME_NOISE^2 / 2) *
      (0.5 + 0.5 * |r_t| / vol)`` -- busier bars trade more;
    * ``timestamp_t = start_timestamp + bar_seconds * t`` (int64 epoch seconds).

    Determinism: every random number comes from ``np.random.default_rng(seed)`` drawn in a
    fixed order, so one seed gives bit-identical bars on every platform NumPy supports.
    Computed in float64 and rounded to float32 once.
    """

    def __init__(
        self,
        seed: int,
        n_bars: int = 20_000,
        regimes: tuple[RegimeParams, ...] = DEFAULT_REGIMES,
        transition=DEFAULT_TRANSITION,
        *,
        initial_regime: int | None = None,
        start_price: float = DEFAULT_START_PRICE,
        start_timestamp: int = DEFAULT_START_TIMESTAMP,
        bar_seconds: int = DEFAULT_BAR_SECONDS,
    ) -> None:
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"seed: {seed!r} is not allowed; need a non-negative integer")
        if isinstance(n_bars, bool) or not isinstance(n_bars, (int, np.integer)) or n_bars < 2:
            raise ValueError(f"n_bars: {n_bars!r} is not allowed; need an integer >= 2")
        regimes = tuple(regimes)
        if not regimes or not all(isinstance(r, RegimeParams) for r in regimes):
            raise ValueError(
                f"regimes: {regimes!r} is not allowed; need a non-empty tuple of RegimeParams"
            )
        k = len(regimes)
        trans = np.asarray(transition, dtype=np.float64)
        if trans.shape != (k, k):
            raise ValueError(
                f"transition: shape {trans.shape} is not allowed; need ({k}, {k}) for {k} regimes"
            )
        if not np.all(np.isfinite(trans)) or np.any(trans < 0):
            raise ValueError(f"transition: {trans.tolist()} must be finite and non-negative")
        row_sums = trans.sum(axis=1)
        if np.any(np.abs(row_sums - 1.0) > _ROW_SUM_TOL):
            raise ValueError(
                f"transition: row sums {row_sums.tolist()} are not allowed; every row must sum to 1"
            )
        if initial_regime is not None and not 0 <= initial_regime < k:
            raise ValueError(
                f"initial_regime: {initial_regime!r} is not allowed; need 0 <= r < {k}"
            )
        if not (math.isfinite(start_price) and start_price > 0):
            raise ValueError(
                f"start_price: {start_price!r} is not allowed; need a finite value > 0"
            )
        if bar_seconds <= 0:
            raise ValueError(f"bar_seconds: {bar_seconds!r} is not allowed; must be > 0")
        self.seed = int(seed)
        self.n_bars = int(n_bars)
        self.regimes = regimes
        self.transition = trans / row_sums[:, None]
        self.initial_regime = initial_regime
        self.start_price = float(start_price)
        self.start_timestamp = int(start_timestamp)
        self.bar_seconds = int(bar_seconds)

    @classmethod
    def strong_trend(cls, seed: int, n_bars: int = 20_000, **kwargs) -> SyntheticMarket:
        """Preset: a persistent up-trend (drift 5e-4, vol 1e-3 per bar, stays ~500 bars) with
        short interruptions; starts in the up-trend. Long-and-hold clearly beats flat."""
        kwargs.setdefault("initial_regime", REGIME_TREND_UP)
        return cls(seed, n_bars, STRONG_TREND_REGIMES, STRONG_TREND_TRANSITION, **kwargs)

    @classmethod
    def preset(cls, name: str, seed: int, n_bars: int = 20_000, **kwargs) -> SyntheticMarket:
        """``"default"`` (three balanced regimes) or ``"strong_trend"``."""
        if name == "default":
            return cls(seed, n_bars, **kwargs)
        if name == "strong_trend":
            return cls.strong_trend(seed, n_bars, **kwargs)
        raise ValueError(f"preset: {name!r} is not allowed; use 'default' or 'strong_trend'")

    def _regime_path(self, rng: np.random.Generator, n: int) -> np.ndarray:
        k = len(self.regimes)
        u = rng.random(n)
        if self.initial_regime is None:
            pi_cum = np.cumsum(_stationary_distribution(self.transition))
            first = min(int(np.searchsorted(pi_cum, u[0], side="right")), k - 1)
        else:
            first = int(self.initial_regime)
        cum_rows = [np.cumsum(row).tolist() for row in self.transition]
        regime = [first] * n
        current = first
        last = k - 1
        for t in range(1, n):
            # Inverse-CDF draw of the next regime from row `current`.
            current = min(bisect.bisect_right(cum_rows[current], u[t]), last)
            regime[t] = current
        return np.asarray(regime, dtype=np.int8)

    def generate(self) -> Bars:
        """Generate the bars (see the class docstring for the process)."""
        n = self.n_bars
        rng = np.random.default_rng(self.seed)
        regime = self._regime_path(rng, n)
        eps = rng.standard_normal(n)
        high_noise = np.abs(rng.standard_normal(n))
        low_noise = np.abs(rng.standard_normal(n))
        volume_noise = rng.standard_normal(n)

        drift = np.array([r.drift for r in self.regimes])[regime]
        vol = np.array([r.vol for r in self.regimes])[regime]
        kappa = np.array([r.kappa for r in self.regimes])[regime]
        shocks = drift + vol * eps
        returns = shocks.copy()
        if np.any(kappa > 0):
            # Ornstein-Uhlenbeck pull towards the log level at regime entry (sequential).
            kappa_l = kappa.tolist()
            shocks_l = shocks.tolist()
            regime_l = regime.tolist()
            ret_l = returns.tolist()
            dev = 0.0
            prev = -1
            for t in range(n):
                kap = kappa_l[t]
                if regime_l[t] != prev:
                    dev = 0.0
                    prev = regime_l[t]
                if kap > 0.0:
                    r = shocks_l[t] - kap * dev
                    ret_l[t] = r
                    dev += r
            returns = np.asarray(ret_l)

        log_close = np.log(self.start_price) + np.cumsum(returns)
        close = np.exp(log_close)
        open_ = np.empty(n)
        open_[0] = self.start_price
        open_[1:] = close[:-1]
        range_scale = np.array([r.range_scale for r in self.regimes])[regime]
        high = np.maximum(open_, close) * np.exp(range_scale * vol * high_noise)
        low = np.minimum(open_, close) * np.exp(-range_scale * vol * low_noise)
        volume_mean = np.array([r.volume_mean for r in self.regimes])[regime]
        volume = (
            volume_mean
            * np.exp(VOLUME_NOISE * volume_noise - 0.5 * VOLUME_NOISE**2)
            * (0.5 + 0.5 * np.abs(returns) / vol)
        )
        timestamp = self.start_timestamp + self.bar_seconds * np.arange(n, dtype=np.int64)
        bars = Bars(timestamp, open_, high, low, close, volume, regime)
        # Rounding to float32 may put open/close a hair outside [low, high]; widen high/low.
        hi = np.maximum(bars.high, np.maximum(bars.open, bars.close))
        lo = np.minimum(bars.low, np.minimum(bars.open, bars.close))
        object.__setattr__(bars, "high", hi)
        object.__setattr__(bars, "low", lo)
        return bars


# --------------------------------------------------------------------------------------------
# Regime labels for bars without them (a user's CSV)
# --------------------------------------------------------------------------------------------

REGIME_LABEL_WINDOW = 20     # bars in the trailing return and volatility
REGIME_LABEL_LOOKBACK = 500  # bars whose volatilities rank bar t's (its own included)
_REGIME_LABEL_CHUNK = 4096   # rows ranked at once (bounds the memory to CHUNK x LOOKBACK)


def causal_regime_labels(bars: Bars, window: int = REGIME_LABEL_WINDOW,
                         lookback: int = REGIME_LABEL_LOOKBACK) -> np.ndarray:
    """Regime labels ``int8[len(bars)]`` computed causally (bar t's label uses bars ``<= t``
    only), in the synthetic market's ids, for data that has none (a user's CSV):

    * ``r_t = c_t / c_{t-1} - 1`` (``r_0 = 0``); over the last ``window`` bars (fewer at the
      start): ``trend_t = sum r``, ``vol_t = sqrt(mean r^2)``;
    * ``REGIME_MEAN_REVERT`` (2, "high volatility") if ``vol_t`` is in the top tercile of
      the last ``lookback`` volatilities, its own included: ``#{s in (t-lookback, t] :
      vol_s < vol_t} >= 2/3 * #{s in (t-lookback, t], s >= 0}``;
    * else ``REGIME_TREND_UP`` (0) if ``trend_t >= 0``, ``REGIME_TREND_DOWN`` (1) if not.

    Computed in float64; the labels are data for the regime head's cross-entropy, not a
    kernel's output. Bar 0 (no history) is ``REGIME_TREND_UP``."""
    for name, value in (("window", window), ("lookback", lookback)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name}: {value!r} is not allowed; need an integer >= 1")
    close = bars.close.astype(np.float64)
    n = close.shape[0]
    r = np.zeros(n)
    if n > 1:
        r[1:] = close[1:] / close[:-1] - 1.0
    count = np.minimum(np.arange(1, n + 1), window)
    trend = np.convolve(r, np.ones(window))[:n]
    vol = np.sqrt(np.convolve(r * r, np.ones(window))[:n] / count)
    # Rank vol_t among the trailing `lookback` values: NaN padding before bar 0 compares
    # False and is not counted.
    padded = np.concatenate([np.full(lookback - 1, np.nan), vol])
    high = np.zeros(n, dtype=bool)
    for start in range(0, n, _REGIME_LABEL_CHUNK):
        stop = min(start + _REGIME_LABEL_CHUNK, n)
        win = sliding_window_view(padded[start : stop + lookback - 1], lookback)
        below = (win < vol[start:stop, None]).sum(axis=1)
        seen = np.minimum(np.arange(start + 1, stop + 1), lookback)
        high[start:stop] = 3 * below >= 2 * seen
    labels = np.where(high, REGIME_MEAN_REVERT,
                      np.where(trend >= 0, REGIME_TREND_UP, REGIME_TREND_DOWN))
    return labels.astype(np.int8)


def regime_labels(bars: Bars) -> np.ndarray:
    """The regime label of every bar, ``int8[len(bars)]``: ``bars.regime`` where the data
    has them (the synthetic market's regime path), else :func:`causal_regime_labels` (a
    user's CSV). The one place the environment, the loop and the device env get them."""
    if bars.regime is not None:
        return bars.regime
    return causal_regime_labels(bars)


# --------------------------------------------------------------------------------------------
# CSV loader
# --------------------------------------------------------------------------------------------

CSV_COLUMNS = ("timestamp", "open", "high", "low", "close", "volume")


def _parse_timestamp(text: str) -> float | int | None:
    """int, float, or ISO-8601 (naive = UTC) -> epoch seconds; None if unparsable."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        pass
    try:
        dt = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return dt.timestamp()


def load_csv(path: str | Path) -> Bars:
    """Load OHLCV bars from a CSV file with a header row.

    Required columns (any order, names case-insensitive, surrounding spaces ignored; extra
    columns are ignored): ``timestamp, open, high, low, close, volume``. ``timestamp`` is an
    integer, a float, or an ISO-8601 date-time (naive means UTC), converted to epoch
    seconds; the result is int64 if every timestamp is an integer, else float64.

    Raises ``ValueError`` (message naming the problem, the column and the data row number,
    1-based, and the file line number) for: a missing file header or required column, a row
    with the wrong number of fields, an empty / unparsable / NaN / infinite value (a "NaN
    row"), a non-positive open/high/low/close, a negative volume, ``high < max(open, close)``
    or ``low > min(open, close)``, a timestamp not strictly greater than the previous one,
    or a file with no data rows. Blank lines are skipped (line numbers still count them).

    Encoding: UTF-8, with or without a byte-order mark (stripped). A gzip-compressed file
    (recognised by its magic bytes, whatever its name, e.g. ``bars.csv.gz``) is decompressed
    first. Anything else that is not UTF-8 (e.g. Latin-1 or Windows-1252 text) raises
    ``ValueError`` naming the file, the offending byte, its byte offset and line, rather than
    being guessed at: a wrong guess would silently change values or column names.
    """
    path = Path(path)
    with io.StringIO(_read_csv_text(path), newline="") as fh:
        reader = csv.reader(fh)
        header = next(reader, None)
        if header is None:
            raise ValueError(
                f"{path}: empty file; expected a header row with columns {', '.join(CSV_COLUMNS)}"
            )
        names = [h.strip().lower() for h in header]
        missing = [c for c in CSV_COLUMNS if c not in names]
        if missing:
            raise ValueError(
                f"{path}: missing required column(s) {', '.join(missing)}; header has "
                f"{', '.join(repr(h) for h in header)}; required: {', '.join(CSV_COLUMNS)}"
            )
        col = {c: names.index(c) for c in CSV_COLUMNS}
        n_fields = len(header)

        timestamps: list = []
        values: dict[str, list[float]] = {c: [] for c in CSV_COLUMNS[1:]}
        row_no = 0
        prev_ts = None
        for fields in reader:
            line_no = reader.line_num
            if not fields or all(not f.strip() for f in fields):
                continue
            row_no += 1
            where = f"{path}: row {row_no} (line {line_no})"
            if len(fields) != n_fields:
                raise ValueError(f"{where}: has {len(fields)} fields, header has {n_fields}")
            ts_text = fields[col["timestamp"]].strip()
            if ts_text == "" or ts_text.lower() in ("nan", "na", "null", "none"):
                raise ValueError(f"{where}: NaN/empty value in column 'timestamp' ({ts_text!r})")
            ts = _parse_timestamp(ts_text)
            if ts is None or (isinstance(ts, float) and not math.isfinite(ts)):
                raise ValueError(
                    f"{where}: column 'timestamp' value {ts_text!r} is not an integer, float or "
                    "ISO-8601 date-time"
                )
            if prev_ts is not None and not ts > prev_ts:
                raise ValueError(
                    f"{where}: non-monotonic timestamp {ts_text!r} (previous row's timestamp "
                    f"is {prev_ts!r}); timestamps must be strictly increasing"
                )
            prev_ts = ts
            bar: dict[str, float] = {}
            for c in CSV_COLUMNS[1:]:
                text = fields[col[c]].strip()
                try:
                    value = float(text)
                except ValueError:
                    if text == "":
                        raise ValueError(f"{where}: NaN/empty value in column '{c}'") from None
                    raise ValueError(
                        f"{where}: column '{c}' value {text!r} is not a number"
                    ) from None
                if math.isnan(value):
                    raise ValueError(f"{where}: NaN value in column '{c}' ({text!r})")
                if math.isinf(value):
                    raise ValueError(f"{where}: infinite value in column '{c}' ({text!r})")
                if c == "volume":
                    if value < 0:
                        raise ValueError(f"{where}: negative volume {text!r}; volume must be >= 0")
                elif value <= 0:
                    raise ValueError(
                        f"{where}: non-positive price {text!r} in column '{c}'; prices must be > 0"
                    )
                bar[c] = value
            if bar["high"] < max(bar["open"], bar["close"]):
                raise ValueError(
                    f"{where}: high {bar['high']!r} is below max(open, close) = "
                    f"{max(bar['open'], bar['close'])!r}"
                )
            if bar["low"] > min(bar["open"], bar["close"]):
                raise ValueError(
                    f"{where}: low {bar['low']!r} is above min(open, close) = "
                    f"{min(bar['open'], bar['close'])!r}"
                )
            timestamps.append(ts)
            for c, v in bar.items():
                values[c].append(v)
    if row_no == 0:
        raise ValueError(f"{path}: no data rows after the header")
    if all(isinstance(t, int) for t in timestamps):
        ts_arr = np.asarray(timestamps, dtype=np.int64)
    else:
        ts_arr = np.asarray(timestamps, dtype=np.float64)
    return Bars(ts_arr, *(np.asarray(values[c], dtype=np.float32) for c in CSV_COLUMNS[1:]))


_GZIP_MAGIC = b"\x1f\x8b"
_UTF8_BOM = b"\xef\xbb\xbf"


def _read_csv_text(path: Path) -> str:
    """The text of a CSV file for ``load_csv``: gunzipped if gzip, UTF-8 with any BOM removed."""
    raw = path.read_bytes()
    where = ""
    if raw[:2] == _GZIP_MAGIC:
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as exc:
            raise ValueError(f"{path}: starts like a gzip file but cannot be decompressed ({exc})") from None
        where = " of the decompressed data"
    skip = len(_UTF8_BOM) if raw.startswith(_UTF8_BOM) else 0
    try:
        return raw[skip:].decode("utf-8")
    except UnicodeDecodeError as exc:
        offset = skip + exc.start
        line = raw.count(b"\n", 0, offset) + 1
        raise ValueError(
            f"{path}: not UTF-8 text: byte 0x{raw[offset]:02x} at byte offset {offset}{where} "
            f"(line {line}); save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)"
        ) from None


# --------------------------------------------------------------------------------------------
# Features
# --------------------------------------------------------------------------------------------

DEFAULT_WINDOWS = (5, 15, 60, 240)
FEATURE_CLIP = 5.0  # every unbounded feature is clipped to [-FEATURE_CLIP, FEATURE_CLIP]
SIGMA_FLOOR = 1e-8  # floor under volatility estimates used as divisors (log-return units)
CUSUM_K = 0.25  # CUSUM reference value (allowance), in units of normalised return
GLOBAL_FEATURE_NAMES = ("ret_1", "close_location", "cusum", "autocorr_1")
WINDOW_FEATURE_NAMES = ("ret", "rvol", "range", "volume", "adx", "di", "efficiency")
N_GLOBAL_FEATURES = len(GLOBAL_FEATURE_NAMES)
N_WINDOW_FEATURES = len(WINDOW_FEATURE_NAMES)
POSITION_FEATURE_NAMES = ("position", "unrealised_pnl", "time_in_position")
N_POSITION_FEATURES = len(POSITION_FEATURE_NAMES)
PNL_SCALE = 100.0  # unrealised-PnL feature = tanh(PNL_SCALE * pnl): 1 % of price -> tanh(1)
TIME_IN_POSITION_SCALE = 64.0  # time feature = tanh(bars / TIME_IN_POSITION_SCALE)


def _check_windows(windows) -> tuple[int, ...]:
    allowed = "a non-empty, strictly increasing sequence of integers >= 2"
    try:
        items = tuple(windows)
    except TypeError:
        raise ValueError(f"windows: {windows!r} is not allowed; need {allowed}") from None
    if not items or not all(
        isinstance(w, (int, np.integer)) and not isinstance(w, bool) for w in items
    ):
        raise ValueError(f"windows: {windows!r} is not allowed; need {allowed}")
    ws = tuple(int(w) for w in items)
    if ws[0] < 2 or any(b <= a for a, b in zip(ws, ws[1:], strict=False)):
        raise ValueError(f"windows: {windows!r} is not allowed; need {allowed}")
    return ws


def n_market_features(windows=DEFAULT_WINDOWS) -> int:
    """Number of market features: ``N_GLOBAL_FEATURES + N_WINDOW_FEATURES * len(windows)``."""
    return N_GLOBAL_FEATURES + N_WINDOW_FEATURES * len(_check_windows(windows))


def market_feature_names(windows=DEFAULT_WINDOWS) -> tuple[str, ...]:
    """Column names of :func:`market_features`, in order (``"ret_w15"`` etc.)."""
    ws = _check_windows(windows)
    return GLOBAL_FEATURE_NAMES + tuple(f"{name}_w{w}" for w in ws for name in WINDOW_FEATURE_NAMES)


def feature_warmup(windows=DEFAULT_WINDOWS) -> int:
    """First fully-defined feature row: ``2 * max(windows)`` (the volatility normaliser
    looks back ``2 * max(windows)`` returns, the ADX-like smoothing ``2w - 1`` bars). Rows
    before it are all zeros."""
    return 2 * max(_check_windows(windows))


def _rolling_sum(x: np.ndarray, w: int) -> np.ndarray:
    """out[t] = sum(x[t-w+1 .. t]) for t >= w-1, 0 before (cumsum difference, float64)."""
    c = np.concatenate([[0.0], np.cumsum(x)])
    out = np.zeros_like(x)
    out[w - 1 :] = c[w:] - c[:-w]
    return out


def _rolling_min(x: np.ndarray, w: int) -> np.ndarray:
    """out[t] = min(x[max(0, t-w+1) .. t])."""
    padded = np.concatenate([np.full(w - 1, np.inf), x])
    return sliding_window_view(padded, w).min(axis=1)


def _safe_ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """num / den where den > 0, else 0."""
    out = np.zeros_like(num)
    np.divide(num, den, out=out, where=den > 0)
    return out


def _safe_log_ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """log(num / den) floored at -FEATURE_CLIP; 0 where den <= 0."""
    ratio = _safe_ratio(num, den)
    out = np.zeros_like(num)
    np.log(np.fmax(ratio, math.exp(-FEATURE_CLIP)), out=out, where=den > 0)
    return out


def market_features(bars: Bars, windows=DEFAULT_WINDOWS) -> np.ndarray:
    """Causal per-bar market features, ``f32[len(bars), n_market_features(windows)]``.

    Row t uses only bars ``<= t`` (bars after t never change it). Rows
    ``t < feature_warmup(windows)`` are zeros. Notation: ``r_t = log(c_t / c_{t-1})``
    (``r_0 = 0``), ``W = max(windows)``, ``sigma_t = max(sqrt(mean(r^2 over the last 2W
    bars)), SIGMA_FLOOR)`` (the volatility every return is normalised by),
    ``clip(x) = clip(x, -FEATURE_CLIP, FEATURE_CLIP)``.

    Global columns (``GLOBAL_FEATURE_NAMES``):

    * ``ret_1 = clip(r_t / sigma_t)``;
    * ``close_location = ((c - l) - (h - c)) / (h - l)`` in [-1, 1] (0 when h == l);
    * ``cusum``: two-sided CUSUM over the last W bars of ``z = r / sigma`` with allowance
      ``CUSUM_K``: ``S+_t = X_t - min(X_{t-W}..X_t)``, ``X = cumsum(z - K)``; ``S-`` likewise
      with ``-z``; feature ``clip((S+ - S-) / sqrt(W))``; positive in up-trends;
    * ``autocorr_1 = sum(r_s r_{s-1}) / sum(r_s^2)`` over the last W bars, clipped to [-1, 1]
      (negative under mean reversion).

    Per window w (``WINDOW_FEATURE_NAMES``, repeated for each w in order):

    * ``ret = clip(log(c_t / c_{t-w}) / (sigma_t * sqrt(w)))``;
    * ``rvol = clip(log(rms(r over w) / sigma_t))``;
    * ``range = clip(log(mean((h - l) / c over w) / sigma_t))``;
    * ``volume = clip(log(v_t / mean(v over w)))`` (0 if that mean is 0);
    * ``adx`` (ADX-like, in [0, 1]): with ``TR``, ``+DM``, ``-DM`` as in Wilder's DMI,
      ``DI+- = sum(+-DM over w) / sum(TR over w)``, ``DX = |DI+ - DI-| / (DI+ + DI-)``,
      ``adx = mean(DX over w)`` (simple means replace Wilder smoothing);
    * ``di = (DI+ - DI-) / (DI+ + DI-)`` in [-1, 1];
    * ``efficiency = (c_t - c_{t-w}) / sum(|c_s - c_{s-1}| over w)`` in [-1, 1] (signed
      Kaufman efficiency ratio: +-1 for a straight line, near 0 for chop).

    Computed in float64, returned float32; always finite for valid bars (positive prices,
    non-negative volume). Takes about 20 ms for 20k bars.
    """
    ws = _check_windows(windows)
    n = len(bars)
    n_feat = n_market_features(ws)
    warm = feature_warmup(ws)
    out = np.zeros((n, n_feat), dtype=np.float32)
    if n <= warm:
        return out
    c = bars.close.astype(np.float64)
    h = bars.high.astype(np.float64)
    lo = bars.low.astype(np.float64)
    v = bars.volume.astype(np.float64)
    big_w = max(ws)
    clip = FEATURE_CLIP

    r = np.zeros(n)
    r[1:] = np.log(c[1:] / c[:-1])
    r2 = r * r
    sigma = np.fmax(np.sqrt(_rolling_sum(r2, warm) / warm), SIGMA_FLOOR)

    cols: list[np.ndarray] = []
    cols.append(np.clip(r / sigma, -clip, clip))
    hl = h - lo
    cols.append(_safe_ratio((c - lo) - (h - c), hl))
    z = r / sigma
    x_up = np.cumsum(z - CUSUM_K)
    x_dn = np.cumsum(-z - CUSUM_K)
    # Window of W+1 cumulative values so that S+ covers the last W increments.
    s_up = x_up - _rolling_min(x_up, big_w + 1)
    s_dn = x_dn - _rolling_min(x_dn, big_w + 1)
    cols.append(np.clip((s_up - s_dn) / math.sqrt(big_w), -clip, clip))
    r_lag = np.zeros(n)
    r_lag[1:] = r[:-1]
    cols.append(
        np.clip(_safe_ratio(_rolling_sum(r * r_lag, big_w), _rolling_sum(r2, big_w)), -1.0, 1.0)
    )

    c_prev = np.concatenate([[c[0]], c[:-1]])
    h_prev = np.concatenate([[h[0]], h[:-1]])
    lo_prev = np.concatenate([[lo[0]], lo[:-1]])
    true_range = np.fmax(h, c_prev) - np.fmin(lo, c_prev)
    up_move = h - h_prev
    down_move = lo_prev - lo
    plus_dm = np.where((up_move > down_move) & (up_move > 0), up_move, 0.0)
    minus_dm = np.where((down_move > up_move) & (down_move > 0), down_move, 0.0)
    plus_dm[0] = minus_dm[0] = true_range[0] = 0.0
    abs_dc = np.abs(c - c_prev)
    rel_range = hl / c

    for w in ws:
        c_lag = np.concatenate([np.full(w, c[0]), c[:-w]])
        cols.append(np.clip(np.log(c / c_lag) / (sigma * math.sqrt(w)), -clip, clip))
        rms_w = np.sqrt(_rolling_sum(r2, w) / w)
        cols.append(np.clip(np.log(np.fmax(rms_w, SIGMA_FLOOR) / sigma), -clip, clip))
        cols.append(np.clip(_safe_log_ratio(_rolling_sum(rel_range, w) / w, sigma), -clip, clip))
        cols.append(np.clip(_safe_log_ratio(v, _rolling_sum(v, w) / w), -clip, clip))
        tr_w = _rolling_sum(true_range, w)
        di_plus = _safe_ratio(_rolling_sum(plus_dm, w), tr_w)
        di_minus = _safe_ratio(_rolling_sum(minus_dm, w), tr_w)
        di_sum = di_plus + di_minus
        dx = _safe_ratio(np.abs(di_plus - di_minus), di_sum)
        cols.append(_rolling_sum(dx, w) / w)
        cols.append(_safe_ratio(di_plus - di_minus, di_sum))
        cols.append(np.clip(_safe_ratio(c - c_lag, _rolling_sum(abs_dc, w)), -1.0, 1.0))

    feats = np.stack(cols, axis=1)
    out[warm:] = feats[warm:].astype(np.float32)
    return out


def state_features(
    market_feats,
    position,
    unrealised_pnl,
    time_in_position,
    state_dim: int,
) -> np.ndarray:
    """The agent's state: ``f32[..., state_dim]``.

    Layout: ``[market_feats (F), position, tanh(PNL_SCALE * unrealised_pnl),
    tanh(time_in_position / TIME_IN_POSITION_SCALE), 0, ..., 0]``.

    * ``market_feats``: ``[..., F]`` (a row of :func:`market_features`);
    * ``position``: ``[...]`` exposure in [-1, 1]; ``unrealised_pnl``: ``[...]`` as a fraction
      of the entry price (0.01 = 1 %); ``time_in_position``: ``[...]`` bars held (>= 0);
      scalars broadcast.

    Raises ``ValueError`` if ``state_dim < F + N_POSITION_FEATURES``, or the leading shapes do
    not broadcast. Non-finite inputs propagate (the environment never produces them).
    """
    mf = np.asarray(market_feats, dtype=np.float32)
    if mf.ndim < 1:
        raise ValueError(f"market_feats: shape {mf.shape} is not allowed; need [..., F]")
    n_used = mf.shape[-1] + N_POSITION_FEATURES
    if (
        isinstance(state_dim, bool)
        or not isinstance(state_dim, (int, np.integer))
        or state_dim < n_used
    ):
        raise ValueError(
            f"state_dim: {state_dim!r} is not allowed; need an integer >= {n_used} "
            f"({mf.shape[-1]} market features + {N_POSITION_FEATURES} position features)"
        )
    lead = mf.shape[:-1]
    pos = np.asarray(position, dtype=np.float32)
    pnl = np.asarray(unrealised_pnl, dtype=np.float32)
    tip = np.asarray(time_in_position, dtype=np.float32)
    try:
        pos, pnl, tip = (a if a.shape == lead else np.broadcast_to(a, lead)
                         for a in (pos, pnl, tip))
    except ValueError:
        raise ValueError(
            f"position/unrealised_pnl/time_in_position: shapes {np.shape(position)}, "
            f"{np.shape(unrealised_pnl)}, {np.shape(time_in_position)} do not broadcast to {lead}"
        ) from None
    out = np.zeros(lead + (int(state_dim),), dtype=np.float32)
    f = mf.shape[-1]
    out[..., :f] = mf
    out[..., f] = pos
    out[..., f + 1] = np.tanh(pnl * np.float32(PNL_SCALE))
    out[..., f + 2] = np.tanh(tip / np.float32(TIME_IN_POSITION_SCALE))
    return out
