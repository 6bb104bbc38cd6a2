"""Second wave (issue 18): the auxiliary labels (market -> env -> replay -> batch), and the
step-level composition of the second-wave sources."""

import dataclasses
import math

import numpy as np
import pytest

from foxhunt.reference import market
from foxhunt.reference.batch import Batch
from foxhunt.reference.config import DQNConfig
from foxhunt.reference.env import BranchingEnv
from foxhunt.reference.loop import LoopSettings, run
from foxhunt.reference.market import Bars, SyntheticMarket, causal_regime_labels, regime_labels
from foxhunt.reference.replay import ReplayBuffer

TINY = DQNConfig.preset("tiny")


# -------------------------------------------------------------------------------- labels


def _bars(close, regime=None) -> Bars:
    close = np.asarray(close, np.float64)
    n = close.shape[0]
    return Bars(np.arange(n) * 60, close, close * 1.001, close * 0.999, close, np.ones(n), regime)


def _labels_by_loop(close, window, lookback):
    """The README's rule, one bar at a time in plain Python floats (an independent method)."""
    r = [0.0] + [close[t] / close[t - 1] - 1.0 for t in range(1, len(close))]
    vols, out = [], []
    for t in range(len(close)):
        recent = r[max(0, t - window + 1): t + 1]
        trend = sum(recent)
        vols.append(math.sqrt(sum(x * x for x in recent) / len(recent)))
        ranked = vols[max(0, t - lookback + 1): t + 1]
        below = sum(v < vols[t] for v in ranked)
        if 3 * below >= 2 * len(ranked):
            out.append(market.REGIME_MEAN_REVERT)
        else:
            out.append(market.REGIME_TREND_UP if trend >= 0 else market.REGIME_TREND_DOWN)
    return out


def test_causal_regime_labels_by_hand():
    # window 2, lookback 3. r = [0, .01, -.0099, .04, 0, -.05, -.001, -.001];
    # vol = sqrt(mean r^2 of 2) = [0, .0071, .0099, .0291, .0283, .0354, .03536, .001];
    # high iff 3 * #(trailing vols below vol_t) >= 2 * #(trailing vols), else the trend sign.
    close = [100.0, 101.0, 100.0, 104.0, 104.0, 98.8, 98.7012, 98.6024988]
    labels = causal_regime_labels(_bars(close), window=2, lookback=3)
    assert labels.dtype == np.int8
    assert labels.tolist() == [0, 0, 2, 2, 0, 2, 2, 1]
    # Halving every bar (exact in f32): r = -0.5 from bar 1, vol = [0, .354, .408, .5, .5, ...]
    # with window 3; lookback 4 ranks bar 3 high (3 of 4 below), then ties are not "below".
    halving = 4096.0 * 0.5 ** np.arange(8)
    assert causal_regime_labels(_bars(halving), window=3, lookback=4).tolist() == \
        [0, 1, 2, 2, 1, 1, 1, 1]


@pytest.mark.parametrize("window,lookback", [(20, 500), (5, 7), (1, 1), (3, 4100)])
def test_causal_regime_labels_match_a_plain_loop(window, lookback):
    bars = SyntheticMarket(3, 1200).generate()
    plain = _bars(bars.close)  # no labels: the CSV case
    expect = _labels_by_loop(bars.close.astype(np.float64).tolist(), window, lookback)
    assert causal_regime_labels(plain, window, lookback).tolist() == expect


def test_causal_regime_labels_use_past_bars_only():
    bars = _bars(SyntheticMarket(4, 2000).generate().close)
    full = causal_regime_labels(bars)
    for cut in (1, 2, 21, 499, 501, 1234):
        assert np.array_equal(causal_regime_labels(bars.slice(0, cut)), full[:cut])
    changed = bars.close.copy()
    changed[1500:] *= 1.7
    later = causal_regime_labels(_bars(changed))
    assert np.array_equal(later[:1500], full[:1500]) and not np.array_equal(later, full)


def test_causal_regime_labels_find_the_synthetic_regimes():
    """The CSV rule is a proxy: on the synthetic market it agrees with the true regimes far
    above chance (1/3)."""
    bars = SyntheticMarket(5, 20_000).generate()
    guess = causal_regime_labels(_bars(bars.close))
    assert np.mean(guess == bars.regime) > 0.5


def test_regime_labels_prefer_the_market_own_and_reject_bad_arguments():
    bars = SyntheticMarket(6, 300).generate()
    assert regime_labels(bars) is bars.regime
    plain = _bars(bars.close)
    assert np.array_equal(regime_labels(plain), causal_regime_labels(plain))
    for kw, name in (({"window": 0}, "window"), ({"lookback": 1.5}, "lookback")):
        with pytest.raises(ValueError, match=f"{name}: .* need an integer >= 1"):
            causal_regime_labels(plain, **kw)


@pytest.mark.parametrize("labelled", [True, False])
def test_env_info_carries_the_next_bar_return_and_the_regime_of_bar_t(labelled):
    source = SyntheticMarket(7, 400).generate()
    bars = source if labelled else _bars(source.close)
    expect_regime = source.regime if labelled else causal_regime_labels(bars)
    env = BranchingEnv(bars, state_dim=64, n_envs=3, branches=(3, 2), seed=1)
    env.reset(np.array([100, 200, 300]))
    for _ in range(5):
        t = env.t.copy()
        _, _, _, info = env.step(np.zeros((3, 2), np.int32))
        c, c1 = bars.close[t].astype(np.float64), bars.close[t + 1].astype(np.float64)
        np.testing.assert_allclose(info["ret"], (c1 - c) / c, rtol=2e-7)
        assert info["regime"].tolist() == expect_regime[t].tolist()


def test_replay_stores_and_samples_the_labels():
    cfg = TINY.replace(batch_size=8)
    buf = ReplayBuffer(cfg, 16)
    rng = np.random.default_rng(0)
    src = Batch.random(cfg.replace(batch_size=12), rng)
    next_ret = np.arange(12, dtype=np.float32) / 100
    regime = np.arange(12, dtype=np.int32) % 3
    buf.add(src.s, src.a, src.r, src.s2, src.done, next_ret=next_ret, regime=regime)
    batch, idx = buf.sample(rng)
    assert batch.next_ret.dtype == np.float32 and batch.regime.dtype == np.int32
    assert np.array_equal(batch.next_ret, next_ret[idx])
    assert np.array_equal(batch.regime, regime[idx])
    assert np.array_equal(batch.s, src.s[idx])  # the labels travel with their transitions
    # The ring wraps: transitions 12..16 land in slots 12..15 and 0 with their labels.
    buf.add(src.s[:5], src.a[:5], src.r[:5], src.s2[:5], src.done[:5],
            next_ret=np.full(5, -1.0, np.float32), regime=np.full(5, 2, np.int32))
    assert buf.next_ret[[12, 13, 14, 15, 0]].tolist() == [-1.0] * 5
    assert buf.regime[:4].tolist() == [2, 1, 2, 0] and buf.next_ret[1] == np.float32(0.01)
    restored = ReplayBuffer(cfg, 16)
    restored.load_state(buf.state())
    assert np.array_equal(restored.next_ret, buf.next_ret)
    assert np.array_equal(restored.regime, buf.regime)
    with pytest.raises(TypeError, match="next_ret"):
        buf.add(src.s, src.a, src.r, src.s2, src.done)  # labels are not optional here


def test_batch_random_fills_labels_in_range():
    cfg = TINY.replace(n_regimes=5, aux_regime_weight=0.1, aux_next_bar_weight=0.1)
    b = Batch.random(cfg, np.random.default_rng(1))
    assert b.next_ret.shape == (cfg.batch_size,) and b.next_ret.dtype == np.float32
    assert np.isfinite(b.next_ret).all() and 0 < np.abs(b.next_ret).max() < 0.1
    assert b.regime.dtype == np.int32 and set(b.regime.tolist()) == set(range(5))


def test_batch_labels_are_validated():
    cfg = TINY.replace(aux_regime_weight=0.1, aux_next_bar_weight=0.1)
    b = Batch.random(cfg, np.random.default_rng(2))
    # Missing labels: fine while their head is off, one line naming the weight otherwise.
    core = dataclasses.replace(b, next_ret=None, regime=None)
    assert core.validate(TINY) is core
    with pytest.raises(ValueError, match=r"batch.next_ret: missing; aux_next_bar_weight=0.1"):
        core.validate(cfg)
    with pytest.raises(ValueError, match=r"batch.regime: missing; aux_regime_weight=0.1"):
        dataclasses.replace(b, regime=None).validate(cfg)
    with pytest.raises(ValueError, match=r"batch.regime: dtype int64, expected int32"):
        dataclasses.replace(b, regime=b.regime.astype(np.int64)).validate(cfg)
    with pytest.raises(ValueError, match=r"batch.next_ret: shape \(31,\)"):
        dataclasses.replace(b, next_ret=b.next_ret[:-1]).validate(TINY)
    for bad in (-1, 3, 127):
        regime = b.regime.copy()
        regime[7] = bad
        with pytest.raises(ValueError, match=rf"batch.regime\[7\]={bad}: regime ids must be in "
                                             r"\[0, 2\] \(n_regimes=3\)"):
            dataclasses.replace(b, regime=regime).validate(cfg)
        # The range belongs to the regime head: with it off the ids are not read.
        dataclasses.replace(b, regime=regime).validate(TINY)
    # A non-finite next-bar return is data (masked out of the loss), not an error.
    next_ret = b.next_ret.copy()
    next_ret[3] = np.nan
    dataclasses.replace(b, next_ret=next_ret).validate(cfg)


def test_loop_feeds_the_env_labels_to_the_trainer(monkeypatch):
    from foxhunt.reference.trainer import Trainer

    seen = []
    step = Trainer.step

    def spy(self, batch):
        seen.append(batch)
        return step(self, batch)

    monkeypatch.setattr(Trainer, "step", spy)
    bars = SyntheticMarket(8, 1600).generate()
    settings = LoopSettings(folds=1, epochs=1, steps_per_epoch=3, n_envs=2, warmup_transitions=64,
                            replay_capacity=256, seed=3)
    run(TINY, bars, settings)
    assert len(seen) == 3
    c = bars.close  # f32: each label is some bar's f32 return (C' - P) / P
    rets = set(((c[1:] - c[:-1]) / c[:-1]).tolist())
    for b in seen:
        assert b.regime.dtype == np.int32 and set(b.regime.tolist()) <= {0, 1, 2}
        assert set(b.next_ret.tolist()) <= rets
        assert np.abs(b.next_ret).max() > 0  # not the replay's zero fill


def test_loop_refuses_too_few_regime_classes():
    bars = SyntheticMarket(9, 1600).generate()
    cfg = TINY.replace(aux_regime_weight=0.1, n_regimes=2)
    assert int(bars.regime.max()) == 2
    with pytest.raises(ValueError, match=r"n_regimes=2: the market's regime labels reach 2; "
                                         r"need n_regimes >= 3"):
        run(cfg, bars, LoopSettings(folds=1, epochs=1, steps_per_epoch=1))
