"""Tests for foxhunt.reference.market: synthetic market, CSV loader, features."""

import math
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from foxhunt.reference import market
from foxhunt.reference.market import (
    Bars,
    RegimeParams,
    SyntheticMarket,
    feature_warmup,
    load_csv,
    market_feature_names,
    market_features,
    n_market_features,
    state_features,
)

# Explicit regime parameters for the statistics tests (expectations derive from these).
UP = RegimeParams(drift=3e-4, vol=1e-3, kappa=0.0, volume_mean=1000.0)
DOWN = RegimeParams(drift=-3e-4, vol=1e-3, kappa=0.0, volume_mean=1000.0)
CHOP = RegimeParams(drift=0.0, vol=3e-3, kappa=0.4, volume_mean=3000.0)
TRANSITION = np.array([[0.98, 0.01, 0.01], [0.01, 0.98, 0.01], [0.02, 0.02, 0.96]])
N_STATS = 60_000


@pytest.fixture(scope="module")
def stats_bars():
    return SyntheticMarket(11, N_STATS, (UP, DOWN, CHOP), TRANSITION).generate()


def _log_returns(bars):
    return np.diff(np.log(bars.close.astype(np.float64)))


def _fields(bars):
    return ("timestamp", "open", "high", "low", "close", "volume", "regime")


# ------------------------------------------------------------------------------------------
# Synthetic market
# ------------------------------------------------------------------------------------------


def test_same_seed_gives_identical_bars():
    a = SyntheticMarket(3, 5000).generate()
    b = SyntheticMarket(3, 5000).generate()
    for name in _fields(a):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype
        assert np.array_equal(x, y), name


def test_different_seeds_give_different_bars():
    a = SyntheticMarket(3, 2000).generate()
    b = SyntheticMarket(4, 2000).generate()
    assert not np.array_equal(a.close, b.close)
    assert np.mean(a.close == b.close) < 0.01


def test_bar_dtypes_and_ohlc_consistency():
    bars = SyntheticMarket(
        5, 3000, start_price=50.0, start_timestamp=1000, bar_seconds=300
    ).generate()
    assert len(bars) == 3000
    for name in ("open", "high", "low", "close", "volume"):
        assert getattr(bars, name).dtype == np.float32
    assert bars.timestamp.dtype == np.int64
    assert bars.regime.dtype == np.int8
    assert np.array_equal(bars.timestamp, 1000 + 300 * np.arange(3000))
    assert bars.open[0] == np.float32(50.0)
    assert np.array_equal(bars.open[1:], bars.close[:-1])
    assert np.all(bars.low > 0) and np.all(bars.volume > 0)
    assert np.all(bars.high >= np.maximum(bars.open, bars.close))
    assert np.all(bars.low <= np.minimum(bars.open, bars.close))
    assert set(np.unique(bars.regime)) <= {0, 1, 2}


def test_regime_mean_return_sign_and_size(stats_bars):
    r = _log_returns(stats_bars)
    reg = stats_bars.regime[1:]
    for k, params in ((0, UP), (1, DOWN)):
        sample = r[reg == k]
        assert sample.size > 5000
        se = params.vol / math.sqrt(sample.size)
        assert np.sign(sample.mean()) == np.sign(params.drift)
        assert abs(sample.mean() - params.drift) < 5 * se


def test_mean_reverting_regime_has_higher_volatility(stats_bars):
    r = _log_returns(stats_bars)
    reg = stats_bars.regime[1:]
    std = [r[reg == k].std() for k in range(3)]
    # Trend regimes: vol as given; the OU regime's bar vol is at least its shock vol.
    assert std[0] == pytest.approx(UP.vol, rel=0.05)
    assert std[1] == pytest.approx(DOWN.vol, rel=0.05)
    assert std[2] > CHOP.vol * 0.98
    assert std[2] > 2.5 * max(std[0], std[1])


def _lag1_autocorr_within(r, reg, k):
    both = (reg[1:] == k) & (reg[:-1] == k)
    x, y = r[1:][both], r[:-1][both]
    x = x - x.mean()
    y = y - y.mean()
    return float(np.sum(x * y) / math.sqrt(np.sum(x * x) * np.sum(y * y))), int(both.sum())


def test_mean_reversion_means_negative_lag1_autocorrelation(stats_bars):
    r = _log_returns(stats_bars)
    reg = stats_bars.regime[1:]
    ac_mr, n_mr = _lag1_autocorr_within(r, reg, 2)
    # Stationary OU increments have lag-1 autocorrelation -kappa/2 = -0.2; segments start
    # at the anchor, so the sample value is somewhat closer to 0.
    assert ac_mr < -0.1
    assert ac_mr > -CHOP.kappa / 2 - 5 / math.sqrt(n_mr)
    for k in (0, 1):
        ac, n = _lag1_autocorr_within(r, reg, k)
        assert abs(ac) < 4 / math.sqrt(n)


def test_regime_transitions_follow_the_matrix(stats_bars):
    reg = stats_bars.regime.astype(np.int64)
    counts = np.zeros((3, 3))
    np.add.at(counts, (reg[:-1], reg[1:]), 1)
    for i in range(3):
        n_i = counts[i].sum()
        assert n_i > 1000
        freq = counts[i] / n_i
        se = np.sqrt(TRANSITION[i] * (1 - TRANSITION[i]) / n_i)
        assert np.all(np.abs(freq - TRANSITION[i]) < 5 * se + 1e-12), (i, freq)


def test_default_market_regimes_and_signs():
    bars = SyntheticMarket(0, 40_000).generate()
    r = _log_returns(bars)
    reg = bars.regime[1:]
    assert np.bincount(bars.regime, minlength=3).min() > 4000
    assert r[reg == market.REGIME_TREND_UP].mean() > 0
    assert r[reg == market.REGIME_TREND_DOWN].mean() < 0
    std = [r[reg == k].std() for k in range(3)]
    assert std[market.REGIME_MEAN_REVERT] > 2 * max(std[0], std[1])
    assert _lag1_autocorr_within(r, reg, market.REGIME_MEAN_REVERT)[0] < -0.05


def test_initial_regime_is_respected():
    for k in range(3):
        assert SyntheticMarket(9, 10, initial_regime=k).generate().regime[0] == k


def test_strong_trend_preset_is_a_persistent_uptrend():
    bars = SyntheticMarket.strong_trend(2, 20_000).generate()
    assert bars.regime[0] == market.REGIME_TREND_UP
    assert np.mean(bars.regime == market.REGIME_TREND_UP) > 0.8
    r = _log_returns(bars)
    # Buy-and-hold clearly positive: t-statistic of the mean return far above 3.
    assert r.mean() / r.std() * math.sqrt(r.size) > 10
    assert bars.close[-1] > 2 * bars.close[0]
    preset = SyntheticMarket.preset("strong_trend", 2, 20_000).generate()
    assert np.array_equal(preset.close, bars.close)
    with pytest.raises(ValueError, match="preset"):
        SyntheticMarket.preset("sideways", 2)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"seed": -1}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"n_bars": 1}, "n_bars"),
        ({"transition": [[0.5, 0.5], [0.5, 0.5]]}, "transition: shape"),
        ({"transition": [[0.9, 0.05, 0.04], [0, 1, 0], [0, 0, 1]]}, "row sums"),
        ({"transition": [[1.1, -0.1, 0], [0, 1, 0], [0, 0, 1]]}, "non-negative"),
        ({"transition": [[np.nan, 0.5, 0.5], [0, 1, 0], [0, 0, 1]]}, "finite"),
        ({"initial_regime": 3}, "initial_regime"),
        ({"start_price": 0.0}, "start_price"),
        ({"regimes": ()}, "regimes"),
    ],
)
def test_market_rejects_bad_arguments(kwargs, match):
    args = {"seed": 0, "n_bars": 100}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        SyntheticMarket(**args)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"vol": 0.0}, "vol"),
        ({"kappa": 1.0}, "kappa"),
        ({"kappa": -0.1}, "kappa"),
        ({"drift": float("nan")}, "drift"),
        ({"volume_mean": 0.0}, "volume_mean"),
    ],
)
def test_regime_params_reject_bad_values(kwargs, match):
    args = {"drift": 0.0, "vol": 1e-3}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        RegimeParams(**args)


def test_generate_and_features_are_fast():
    t0 = time.perf_counter()
    bars = SyntheticMarket(1, 20_000).generate()
    feats = market_features(bars)
    elapsed = time.perf_counter() - t0
    assert feats.shape == (20_000, n_market_features())
    assert elapsed < 1.0, f"generate + features took {elapsed:.3f} s"


# ------------------------------------------------------------------------------------------
# Bars
# ------------------------------------------------------------------------------------------


def test_bars_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="close: shape"):
        Bars([1, 2, 3], [1, 1, 1], [1, 1, 1], [1, 1, 1], [1, 1], [1, 1, 1])
    with pytest.raises(ValueError, match="regime"):
        Bars([1, 2], [1, 1], [1, 1], [1, 1], [1, 1], [1, 1], regime=[0])
    with pytest.raises(ValueError, match="timestamp"):
        Bars(["a", "b"], [1, 1], [1, 1], [1, 1], [1, 1], [1, 1])


def test_bars_slice_copies_a_range():
    bars = SyntheticMarket(0, 50).generate()
    part = bars.slice(10, 20)
    assert len(part) == 10
    assert np.array_equal(part.close, bars.close[10:20])
    assert np.array_equal(part.regime, bars.regime[10:20])
    part.close[0] = -1.0
    assert bars.close[10] != -1.0


# ------------------------------------------------------------------------------------------
# CSV loader
# ------------------------------------------------------------------------------------------

HEADER = "timestamp,open,high,low,close,volume\n"
GOOD_ROWS = [
    "1000,100,101,99,100.5,10\n",
    "1060,100.5,102,100,101.5,12\n",
    "1120,101.5,101.5,100.25,100.75,0\n",
]


def _write(tmp_path, text, name="bars.csv"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_load_csv_parses_values_and_dtypes(tmp_path):
    bars = load_csv(_write(tmp_path, HEADER + "".join(GOOD_ROWS)))
    assert len(bars) == 3
    assert bars.timestamp.dtype == np.int64
    assert np.array_equal(bars.timestamp, [1000, 1060, 1120])
    assert bars.close.dtype == np.float32
    assert np.array_equal(bars.close, np.array([100.5, 101.5, 100.75], dtype=np.float32))
    assert np.array_equal(bars.high, np.array([101, 102, 101.5], dtype=np.float32))
    assert np.array_equal(bars.volume, np.array([10, 12, 0], dtype=np.float32))
    assert bars.regime is None


def test_load_csv_column_order_case_extra_columns_and_blank_lines(tmp_path):
    text = (
        " Volume ,CLOSE,symbol,Low,High,Open,TimeStamp\n"
        "10,100.5,ES,99,101,100,2024-01-02T00:00:00\n"
        "\n"
        "12,101.5,ES,100,102,100.5,2024-01-02T00:01:00Z\n"
    )
    bars = load_csv(_write(tmp_path, text))
    assert bars.timestamp.dtype == np.float64
    assert np.array_equal(bars.timestamp, [1704153600.0, 1704153660.0])
    assert np.array_equal(bars.open, np.array([100, 100.5], dtype=np.float32))
    assert np.array_equal(bars.low, np.array([99, 100], dtype=np.float32))


def test_load_csv_round_trips_synthetic_bars(tmp_path):
    bars = SyntheticMarket(8, 200).generate()
    lines = [HEADER]
    for i in range(len(bars)):
        vals = [
            repr(float(getattr(bars, f)[i])) for f in ("open", "high", "low", "close", "volume")
        ]
        lines.append(f"{int(bars.timestamp[i])},{','.join(vals)}\n")
    loaded = load_csv(_write(tmp_path, "".join(lines)))
    for name in ("timestamp", "open", "high", "low", "close", "volume"):
        assert np.array_equal(getattr(loaded, name), getattr(bars, name)), name


def _bad(rows, row_index, replacement):
    rows = list(rows)
    rows[row_index] = replacement
    return HEADER + "".join(rows)


@pytest.mark.parametrize(
    "text, patterns",
    [
        ("timestamp,open,high,low,close\n1,1,1,1,1\n", ["missing required column", "volume"]),
        (
            "time,open,high,low,close,volume\n1,1,1,1,1,1\n",
            ["missing required column", "timestamp"],
        ),
        (
            _bad(GOOD_ROWS, 2, "1060,101.5,101.5,100.25,100.75,0\n"),
            ["row 3", "line 4", "non-monotonic", "timestamp"],
        ),
        (_bad(GOOD_ROWS, 1, "900,100.5,102,100,101.5,12\n"), ["row 2", "non-monotonic"]),
        (_bad(GOOD_ROWS, 1, "1060,100.5,102,100,0,12\n"), ["row 2", "non-positive", "close"]),
        (_bad(GOOD_ROWS, 0, "1000,-1,101,99,100.5,10\n"), ["row 1", "non-positive", "open"]),
        (_bad(GOOD_ROWS, 2, "1120,101.5,nan,100.25,100.75,0\n"), ["row 3", "NaN", "high"]),
        (_bad(GOOD_ROWS, 1, "1060,100.5,102,,101.5,12\n"), ["row 2", "NaN", "low"]),
        (_bad(GOOD_ROWS, 1, "NaN,100.5,102,100,101.5,12\n"), ["row 2", "NaN", "timestamp"]),
        (_bad(GOOD_ROWS, 1, "1060,100.5,102,100,101.5,inf\n"), ["row 2", "infinite", "volume"]),
        (_bad(GOOD_ROWS, 1, "1060,100.5,102,100,101.5,-3\n"), ["row 2", "negative volume"]),
        (_bad(GOOD_ROWS, 1, "1060,100.5,102,100,abc,12\n"), ["row 2", "close", "not a number"]),
        (
            _bad(GOOD_ROWS, 1, "yesterday,100.5,102,100,101.5,12\n"),
            ["row 2", "timestamp", "yesterday"],
        ),
        (_bad(GOOD_ROWS, 1, "1060,100.5,102,100,101.5\n"), ["row 2", "5 fields"]),
        (_bad(GOOD_ROWS, 1, "1060,100.5,101,100,101.5,12\n"), ["row 2", "high", "below"]),
        (_bad(GOOD_ROWS, 1, "1060,100.5,102,101,101.5,12\n"), ["row 2", "low", "above"]),
        (HEADER, ["no data rows"]),
        ("", ["empty file"]),
    ],
)
def test_load_csv_errors_name_the_problem_and_row(tmp_path, text, patterns):
    with pytest.raises(ValueError) as excinfo:
        load_csv(_write(tmp_path, text))
    message = str(excinfo.value)
    for pattern in patterns:
        assert pattern in message, (pattern, message)


def test_load_csv_row_numbers_skip_blank_lines(tmp_path):
    text = HEADER + GOOD_ROWS[0] + "\n" + "1060,100.5,102,100,nan,12\n"
    with pytest.raises(ValueError, match=r"row 2 \(line 4\)"):
        load_csv(_write(tmp_path, text))


def _assert_same_bars(a, b):
    for name in ("timestamp", "open", "high", "low", "close", "volume"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name


def test_load_csv_strips_a_utf8_byte_order_mark(tmp_path):
    # Excel's "CSV UTF-8" starts with a BOM; without stripping, the first column would be
    # named "\ufefftimestamp" and the file refused as missing its timestamp column.
    plain = load_csv(_write(tmp_path, HEADER + "".join(GOOD_ROWS)))
    path = tmp_path / "bom.csv"
    path.write_bytes(b"\xef\xbb\xbf" + (HEADER + "".join(GOOD_ROWS)).encode())
    _assert_same_bars(load_csv(path), plain)


@pytest.mark.parametrize("name", ["bars.csv.gz", "bars_gzipped.csv"])
def test_load_csv_reads_gzip_by_its_magic_bytes(tmp_path, name):
    import gzip

    plain = load_csv(_write(tmp_path, HEADER + "".join(GOOD_ROWS)))
    path = tmp_path / name
    path.write_bytes(gzip.compress(b"\xef\xbb\xbf" + (HEADER + "".join(GOOD_ROWS)).encode()))
    _assert_same_bars(load_csv(path), plain)


def test_load_csv_truncated_gzip_is_one_clear_error(tmp_path):
    import gzip

    path = tmp_path / "bars.csv.gz"
    path.write_bytes(gzip.compress((HEADER + "".join(GOOD_ROWS)).encode())[:20])
    with pytest.raises(ValueError, match="gzip") as excinfo:
        load_csv(path)
    assert str(path) in str(excinfo.value)


@pytest.mark.parametrize("bom", [b"", b"\xef\xbb\xbf"])
def test_load_csv_latin1_names_the_file_byte_offset_and_line(tmp_path, bom):
    # 'symbol' column value "Zürich" in Latin-1: the ü is the single byte 0xfc.
    text = "timestamp,open,high,low,close,volume,symbol\n1000,100,101,99,100.5,10,Z\xfcrich\n"
    raw = bom + text.encode("latin-1")
    path = tmp_path / "latin1.csv"
    path.write_bytes(raw)
    expected_offset = raw.index(b"\xfc")  # counted by hand: BOM + header (44) + "1000,100,101,99,100.5,10,Z" (26)
    assert expected_offset == len(bom) + 44 + 26
    with pytest.raises(ValueError) as excinfo:
        load_csv(path)
    message = str(excinfo.value)
    assert str(path) in message and "not UTF-8" in message
    assert f"byte offset {expected_offset} " in message and "0xfc" in message
    assert "(line 2)" in message


# ------------------------------------------------------------------------------------------
# Market features
# ------------------------------------------------------------------------------------------

WINDOWS = (4, 8)
N_FEAT = market.N_GLOBAL_FEATURES + market.N_WINDOW_FEATURES * len(WINDOWS)


def _col(name):
    return market_feature_names(WINDOWS).index(name)


def _bars_from_close(close, half_range=5e-4, volume=None):
    close = np.asarray(close, dtype=np.float64)
    n = close.size
    open_ = np.concatenate([[close[0]], close[:-1]])
    high = np.maximum(open_, close) * (1 + half_range)
    low = np.minimum(open_, close) * (1 - half_range)
    vol = np.full(n, 100.0) if volume is None else volume
    return Bars(np.arange(n), open_, high, low, close, vol)


def test_feature_counts_names_and_warmup():
    assert n_market_features(WINDOWS) == N_FEAT == 4 + 7 * 2
    names = market_feature_names(WINDOWS)
    assert len(names) == N_FEAT and len(set(names)) == N_FEAT
    assert feature_warmup(WINDOWS) == 16
    assert n_market_features() + market.N_POSITION_FEATURES <= 128
    assert n_market_features((5,)) + market.N_POSITION_FEATURES <= 16  # tiny preset SD=16


@pytest.mark.parametrize("windows", [(), (1, 5), (5, 5), (10, 5), ("a",), 5])
def test_feature_windows_are_validated(windows):
    with pytest.raises(ValueError, match="windows"):
        n_market_features(windows)


def test_features_shape_dtype_range_and_warmup_rows():
    bars = SyntheticMarket(4, 3000).generate()
    feats = market_features(bars, WINDOWS)
    assert feats.dtype == np.float32 and feats.shape == (3000, N_FEAT)
    assert np.all(np.isfinite(feats))
    assert np.all(np.abs(feats) <= market.FEATURE_CLIP)
    warm = feature_warmup(WINDOWS)
    assert np.all(feats[:warm] == 0)
    assert np.all(np.any(feats[warm:] != 0, axis=1))
    bounded = [
        _col(n) for n in ("close_location", "autocorr_1", "adx_w4", "di_w4", "efficiency_w8")
    ]
    assert np.all(np.abs(feats[:, bounded]) <= 1)
    assert np.all(feats[:, _col("adx_w8")] >= 0)


def test_features_are_causal():
    bars = SyntheticMarket(6, 1500).generate()
    full = market_features(bars, WINDOWS)
    cut = 700
    prefix = market_features(bars.slice(0, cut), WINDOWS)
    assert np.array_equal(prefix, full[:cut])
    # Perturbing the future leaves the past untouched.
    close = bars.close.copy()
    close[cut:] *= np.float32(1.3)
    high = np.maximum(bars.high, close)
    volume = bars.volume.copy()
    volume[cut:] *= np.float32(3)
    changed = Bars(bars.timestamp, bars.open, high, bars.low, close, volume)
    assert not np.array_equal(market_features(changed, WINDOWS)[cut:], full[cut:])
    assert np.array_equal(market_features(changed, WINDOWS)[:cut], full[:cut])


def test_features_of_a_steady_uptrend_by_hand():
    growth = 1.001
    n = 40
    bars = _bars_from_close(100.0 * growth ** np.arange(n))
    f = market_features(bars, WINDOWS)[-1]
    tol = dict(rel=2e-3, abs=2e-3)  # float32 prices: per-bar returns carry ~1e-4 relative error
    # Every 1-bar log return equals sigma: normalised return 1, window return sqrt(w).
    assert f[_col("ret_1")] == pytest.approx(1.0, **tol)
    assert f[_col("ret_w4")] == pytest.approx(2.0, **tol)
    assert f[_col("ret_w8")] == pytest.approx(math.sqrt(8), **tol)
    assert f[_col("rvol_w4")] == pytest.approx(0.0, **tol)
    assert f[_col("autocorr_1")] == pytest.approx(1.0, **tol)
    # CUSUM: z = 1 each bar, allowance 0.25 -> S+ = 0.75 * W, S- = 0; scaled by 1/sqrt(W).
    assert f[_col("cusum")] == pytest.approx(0.75 * 8 / math.sqrt(8), **tol)
    # Only up moves: DI- = 0, so DX = 1, ADX = 1, DI spread = 1; straight line: efficiency 1.
    for w in WINDOWS:
        assert f[_col(f"adx_w{w}")] == pytest.approx(1.0, **tol)
        assert f[_col(f"di_w{w}")] == pytest.approx(1.0, **tol)
        assert f[_col(f"efficiency_w{w}")] == pytest.approx(1.0, **tol)
        assert f[_col(f"volume_w{w}")] == 0.0
    # Range (h - l)/c with h = max(o,c)(1+x), l = min(o,c)(1-x): (growth(1+x) - (1-x))/growth.
    x = 5e-4
    rel_range = (growth * (1 + x) - (1 - x)) / growth
    assert f[_col("range_w4")] == pytest.approx(math.log(rel_range / math.log(growth)), **tol)


def test_features_of_a_steady_downtrend_mirror_the_uptrend():
    bars = _bars_from_close(100.0 * 0.999 ** np.arange(40))
    f = market_features(bars, WINDOWS)[-1]
    tol = dict(rel=2e-3, abs=2e-3)
    assert f[_col("ret_1")] == pytest.approx(-1.0, **tol)
    assert f[_col("cusum")] == pytest.approx(-0.75 * math.sqrt(8), **tol)
    assert f[_col("adx_w8")] == pytest.approx(1.0, **tol)
    assert f[_col("di_w8")] == pytest.approx(-1.0, **tol)
    assert f[_col("efficiency_w8")] == pytest.approx(-1.0, **tol)


def test_features_of_a_zigzag():
    close = 100.0 * (1 + 0.002 * (-1.0) ** np.arange(41))
    f = market_features(_bars_from_close(close), WINDOWS)[-1]
    assert f[_col("autocorr_1")] == pytest.approx(-1.0, abs=1e-3)
    for w in WINDOWS:  # even windows: back where it started
        assert f[_col(f"ret_w{w}")] == pytest.approx(0.0, abs=1e-3)
        assert f[_col(f"efficiency_w{w}")] == pytest.approx(0.0, abs=1e-3)
        assert f[_col(f"di_w{w}")] == pytest.approx(0.0, abs=1e-3)


def test_volume_feature_by_hand():
    volume = np.full(40, 100.0)
    volume[-1] = 300.0
    f = market_features(_bars_from_close(np.full(40, 50.0), volume=volume), WINDOWS)[-1]
    for w in WINDOWS:
        mean = (100.0 * (w - 1) + 300.0) / w
        assert f[_col(f"volume_w{w}")] == pytest.approx(math.log(300.0 / mean), rel=1e-6)


def test_features_of_flat_prices_and_zero_volume_are_finite():
    n = 40
    price = np.full(n, 10.0)
    bars = Bars(np.arange(n), price, price, price, price, np.zeros(n))
    with np.errstate(all="raise"):
        f = market_features(bars, WINDOWS)
    assert np.all(np.isfinite(f))
    assert np.all(np.abs(f) <= market.FEATURE_CLIP)
    keep = [
        i for i, name in enumerate(market_feature_names(WINDOWS)) if not name.startswith("range")
    ]
    assert np.all(f[:, keep] == 0)


def test_short_series_gives_all_warmup_rows():
    bars = SyntheticMarket(0, 10).generate()
    f = market_features(bars, WINDOWS)
    assert f.shape == (10, N_FEAT) and np.all(f == 0)


@settings(max_examples=25)
@given(
    log_returns=st.lists(st.floats(-0.2, 0.2), min_size=20, max_size=60),
    volume_scale=st.floats(0.0, 1e6),
    spike=st.integers(0, 19),
)
def test_features_finite_and_bounded_for_arbitrary_paths(log_returns, volume_scale, spike):
    r = np.asarray(log_returns)
    r[spike] = 0.0  # exact flat bar somewhere
    close = 100.0 * np.exp(np.cumsum(r))
    volume = np.full(r.size, volume_scale)
    volume[spike] = 0.0
    bars = _bars_from_close(close, half_range=0.0, volume=volume)
    with np.errstate(all="raise"):
        f = market_features(bars, WINDOWS)
    assert f.dtype == np.float32
    assert np.all(np.isfinite(f))
    assert np.all(np.abs(f) <= market.FEATURE_CLIP)


# ------------------------------------------------------------------------------------------
# State features
# ------------------------------------------------------------------------------------------


def test_state_features_layout_and_padding():
    mf = np.array([[0.5, -1.0, 2.0], [1.0, 0.0, -3.0]], dtype=np.float32)
    s = state_features(mf, np.array([1.0, -1.0]), np.array([0.01, -0.005]), np.array([0, 64]), 10)
    assert s.dtype == np.float32 and s.shape == (2, 10)
    assert np.array_equal(s[:, :3], mf)
    assert np.array_equal(s[:, 3], [1.0, -1.0])
    assert s[0, 4] == pytest.approx(math.tanh(1.0), rel=1e-6)
    assert s[1, 4] == pytest.approx(math.tanh(-0.5), rel=1e-6)
    assert s[0, 5] == 0.0
    assert s[1, 5] == pytest.approx(math.tanh(1.0), rel=1e-6)
    assert np.all(s[:, 6:] == 0)


def test_state_features_broadcast_scalars_and_exact_fit():
    mf = np.ones((4, 5, 13), dtype=np.float32)
    s = state_features(mf, 0.0, 0.0, 0, 16)
    assert s.shape == (4, 5, 16)
    assert np.all(s[..., 13:] == 0) and np.all(s[..., :13] == 1)
    row = state_features(mf[0, 0], -1.0, 0.0, 0, 16)
    assert row.shape == (16,) and row[13] == -1.0


@pytest.mark.parametrize("state_dim", [15, 3, 0, 15.0, True])
def test_state_features_rejects_too_small_state_dim(state_dim):
    with pytest.raises(ValueError, match="state_dim"):
        state_features(np.zeros(13, np.float32), 0.0, 0.0, 0, state_dim)


def test_state_features_rejects_mismatched_position_shape():
    with pytest.raises(ValueError, match="broadcast"):
        state_features(np.zeros((4, 3), np.float32), np.zeros(3), 0.0, 0, 8)
