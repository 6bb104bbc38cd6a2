"""Tests for foxhunt.reference.env: fills, costs, rewards, episodes, Sharpe helpers."""

import math
import statistics

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from foxhunt.reference import env as envmod
from foxhunt.reference.env import (
    BranchingEnv,
    ExecutionCosts,
    annualised_sharpe,
    bars_per_year,
    equity_curve,
    rollout,
)
from foxhunt.reference.market import Bars, SyntheticMarket, market_features, n_market_features

SHORT, FLAT, LONG = 0, 1, 2
MARKET, LIMIT, PASSIVE = 0, 1, 2
NOW, PATIENT = 0, 1

# Hand-made bars (open = previous close). Chosen so that at t=0 a limit buy does not fill
# (next low == close: touching is not trading through) and at t=1 a limit buy fills but a
# passive buy (resting 0.2 % lower) does not.
CLOSE = [100.0, 101.0, 101.5, 102.0, 99.0, 100.0]
HIGH = [100.5, 101.6, 101.8, 102.5, 102.1, 100.3]
LOW = [99.5, 100.0, 100.9, 99.9, 98.9, 98.95]
FEE, PASSIVE_FEE, HALF_SPREAD, SLIP, PATIENT_SCALE = 1e-3, 4e-4, 2e-3, 0.5, 0.25
COSTS = ExecutionCosts(
    fee=FEE,
    passive_fee=PASSIVE_FEE,
    half_spread=HALF_SPREAD,
    slippage_coef=SLIP,
    patient_slippage_scale=PATIENT_SCALE,
)
N_FEAT = 2
STATE_DIM = 8
POS, PNL, TIME = N_FEAT, N_FEAT + 1, N_FEAT + 2  # state columns of the position features


def _c(t):
    return float(np.float32(CLOSE[t]))


def _range(t):
    return (float(np.float32(HIGH[t])) - float(np.float32(LOW[t]))) / _c(t)


def _ret(t):
    return _c(t + 1) / _c(t) - 1


def _hand_bars():
    open_ = [CLOSE[0]] + CLOSE[:-1]
    return Bars(np.arange(6) * 60, open_, HIGH, LOW, CLOSE, [10.0] * 6, regime=[0, 0, 1, 1, 2, 2])


def _hand_env(n_envs=1, **kwargs):
    features = np.zeros((6, N_FEAT), dtype=np.float32)
    features[:, 0] = np.arange(6)  # lets tests see which bar a state came from
    args = dict(state_dim=STATE_DIM, n_envs=n_envs, costs=COSTS, min_start=0, auto_reset=False)
    args.update(kwargs)
    return BranchingEnv(_hand_bars(), features, **args)


def _act(*rows):
    return np.array(rows, dtype=np.int32)


def _approx(x):
    return pytest.approx(x, rel=1e-5, abs=1e-7)


# ------------------------------------------------------------------------------------------
# Hand-computed fills, costs and rewards
# ------------------------------------------------------------------------------------------


def test_market_entry_hold_and_flip_by_hand():
    env = _hand_env()
    s0 = env.reset(0)
    assert s0.shape == (1, STATE_DIM) and s0.dtype == np.float32
    assert np.all(s0[0, N_FEAT:] == 0)

    # t=0: flat -> long, market, now: fee + half spread + full slippage on bar 0's range.
    s1, r1, d1, info = env.step(_act([LONG, MARKET, NOW]))
    cost1 = FEE + HALF_SPREAD + SLIP * 1.0 * _range(0)
    assert info["cost"][0] == _approx(cost1)
    assert r1[0] == _approx(_ret(0) - cost1)
    assert r1.dtype == np.float32 and d1.dtype == bool and not d1[0]
    assert info["route"][0] == envmod.ROUTE_MARKET and info["filled"][0]
    assert s1[0, 0] == 1.0  # features of bar 1
    assert s1[0, POS] == 1.0
    assert s1[0, PNL] == _approx(math.tanh(100 * (_c(1) / _c(0) - 1)))
    assert s1[0, TIME] == _approx(math.tanh(1 / 64))
    assert np.all(s1[0, TIME + 1 :] == 0)

    # t=1: stay long (order type and urgency do not matter without a trade).
    s2, r2, _, info = env.step(_act([LONG, LIMIT, PATIENT]))
    assert info["cost"][0] == 0 and info["route"][0] == envmod.ROUTE_NONE
    assert r2[0] == _approx(_ret(1))
    assert s2[0, PNL] == _approx(math.tanh(100 * (_c(2) / _c(0) - 1)))
    assert s2[0, TIME] == _approx(math.tanh(2 / 64))

    # t=2: long -> short, market, patient: twice the per-unit cost, quarter slippage.
    s3, r3, _, info = env.step(_act([SHORT, MARKET, PATIENT]))
    cost3 = 2 * (FEE + HALF_SPREAD + SLIP * PATIENT_SCALE * _range(2))
    assert info["cost"][0] == _approx(cost3)
    assert r3[0] == _approx(-_ret(2) - cost3)
    assert s3[0, POS] == -1.0
    assert s3[0, PNL] == _approx(math.tanh(100 * -(_c(3) / _c(2) - 1)))
    assert s3[0, TIME] == _approx(math.tanh(1 / 64))
    assert info["held"][0] == -1.0 and info["position"][0] == -1.0
    assert info["ret"][0] == _approx(_ret(2))
    assert info["regime"][0] == 1  # label of bar t=2


def test_limit_and_passive_fill_rules_and_fallbacks_by_hand():
    env = _hand_env(n_envs=8)
    env.reset(np.array([0, 0, 1, 1, 1, 0, 0, 3]))
    actions = _act(
        [LONG, LIMIT, NOW],  # t=0: next low == close -> no fill -> market at close 1
        [LONG, LIMIT, PATIENT],  # t=0: no fill -> cancelled
        [LONG, LIMIT, NOW],  # t=1: next low < close -> fills at the mid
        [LONG, PASSIVE, PATIENT],  # t=1: next low above close*(1-hs) -> cancelled
        [LONG, PASSIVE, NOW],  # t=1: no fill -> market at close 2
        [SHORT, PASSIVE, NOW],  # t=0: next high > close*(1+hs) -> fills
        [SHORT, LIMIT, PATIENT],  # t=0: next high > close -> fills
        [FLAT, MARKET, NOW],  # t=3: no trade
    )
    states, rewards, dones, info = env.step(actions)
    fallback0 = FEE + HALF_SPREAD + SLIP * _range(1)
    fallback4 = FEE + HALF_SPREAD + SLIP * _range(2)
    expected_cost = [fallback0, 0.0, FEE, 0.0, fallback4, PASSIVE_FEE, FEE, 0.0]
    expected_reward = [
        -fallback0,
        0.0,
        _ret(1) - FEE,
        0.0,
        -fallback4,
        -_ret(0) - PASSIVE_FEE,
        -_ret(0) - FEE,
        0.0,
    ]
    for i in range(8):
        assert info["cost"][i] == _approx(expected_cost[i]), i
        assert rewards[i] == _approx(expected_reward[i]), i
    r = envmod
    assert info["route"].tolist() == [
        r.ROUTE_FALLBACK, r.ROUTE_NONE, r.ROUTE_LIMIT, r.ROUTE_NONE,
        r.ROUTE_FALLBACK, r.ROUTE_PASSIVE, r.ROUTE_LIMIT, r.ROUTE_NONE,
    ]  # fmt: skip
    assert info["held"].tolist() == [0, 0, 1, 0, 0, -1, -1, 0]
    assert info["position"].tolist() == [1, 0, 1, 0, 1, -1, -1, 0]
    assert states[:, POS].tolist() == [1, 0, 1, 0, 1, -1, -1, 0]
    # Fallback fills enter at the next close: no PnL and no time in position yet.
    assert states[0, PNL] == 0 and states[0, TIME] == 0 and states[4, PNL] == 0
    assert states[2, TIME] == _approx(math.tanh(1 / 64))
    assert states[5, PNL] == _approx(math.tanh(100 * -(_c(1) / _c(0) - 1)))
    assert not dones.any()


def test_cancelled_exit_keeps_the_position_and_its_pnl():
    env = _hand_env()
    env.reset(2)
    env.step(_act([LONG, MARKET, NOW]))  # t=2 -> long from close 2
    # t=3: passive sell rests at close*(1+hs) = 102.204 > next high 102.1 -> not filled.
    s, r, _, info = env.step(_act([FLAT, PASSIVE, PATIENT]))
    assert info["route"][0] == envmod.ROUTE_NONE and info["cost"][0] == 0
    assert info["held"][0] == 1.0
    assert r[0] == _approx(_ret(3))
    assert s[0, POS] == 1.0
    assert s[0, TIME] == _approx(math.tanh(2 / 64))
    assert s[0, PNL] == _approx(math.tanh(100 * (_c(4) / _c(2) - 1)))
    # t=4: market exit; flat afterwards -> no PnL, no time in position.
    s, r, done, info = env.step(_act([FLAT, MARKET, NOW]))
    exit_cost = FEE + HALF_SPREAD + SLIP * _range(4)
    assert r[0] == _approx(-exit_cost)
    assert s[0, POS] == 0 and s[0, PNL] == 0 and s[0, TIME] == 0
    assert done[0]  # reached the last bar


def test_order_types_are_ordered_by_cost():
    env = _hand_env(n_envs=3)
    env.reset(0)
    _, _, _, info = env.step(_act([SHORT, MARKET, NOW], [SHORT, LIMIT, NOW], [SHORT, PASSIVE, NOW]))
    assert info["filled"].all()
    assert info["cost"][0] > info["cost"][1] > info["cost"][2] > 0


def test_zero_costs_give_pure_position_times_return():
    bars = SyntheticMarket(3, 800).generate()
    env = BranchingEnv(
        bars, state_dim=128, n_envs=2, costs=ExecutionCosts(0, 0, 0, 0, 0), auto_reset=False
    )
    out = rollout(
        env, lambda s: _act([LONG, MARKET, NOW], [SHORT, MARKET, NOW]), 100, start_idx=500
    )
    close = bars.close.astype(np.float64)
    expected = close[501:601] / close[500:600] - 1
    np.testing.assert_allclose(out["rewards"][:, 0], expected, rtol=1e-4, atol=1e-8)
    np.testing.assert_allclose(out["rewards"][:, 1], -expected, rtol=1e-4, atol=1e-8)
    assert np.all(out["costs"] == 0)


# ------------------------------------------------------------------------------------------
# Branch configurations and validation
# ------------------------------------------------------------------------------------------


def test_tiny_branches_map_missing_urgency_to_now():
    env = _hand_env(n_envs=2, branches=(3, 2))
    env.reset(0)
    _, rewards, _, info = env.step(_act([LONG, LIMIT], [LONG, MARKET]))
    fallback = FEE + HALF_SPREAD + SLIP * _range(1)
    market = FEE + HALF_SPREAD + SLIP * _range(0)
    assert info["route"].tolist() == [envmod.ROUTE_FALLBACK, envmod.ROUTE_MARKET]
    assert rewards[0] == _approx(-fallback)
    assert rewards[1] == _approx(_ret(0) - market)
    with pytest.raises(ValueError, match="order type action 2"):
        env.step(_act([LONG, PASSIVE], [LONG, MARKET]))


def test_exposure_only_branch_uses_market_orders():
    env = _hand_env(branches=(3,))
    env.reset(0)
    _, rewards, _, info = env.step(_act([LONG]))
    assert info["route"][0] == envmod.ROUTE_MARKET
    assert rewards[0] == _approx(_ret(0) - (FEE + HALF_SPREAD + SLIP * _range(0)))


@pytest.mark.parametrize("branches", [(2, 3, 2), (3, 4), (3, 3, 3), (3, 3, 2, 2), (), (3, 0)])
def test_bad_branch_configs_are_rejected(branches):
    with pytest.raises(ValueError, match="branches"):
        _hand_env(branches=branches)


@pytest.mark.parametrize(
    "actions, match",
    [
        (np.array([[LONG, MARKET]], np.int32), "shape"),
        (np.array([[3, MARKET, NOW]], np.int32), "exposure action 3"),
        (np.array([[LONG, MARKET, 2]], np.int32), "urgency action 2"),
        (np.array([[-1, MARKET, NOW]], np.int32), "exposure action -1"),
        (np.array([[2.0, 0.0, 0.0]]), "float64"),
    ],
)
def test_bad_actions_are_rejected(actions, match):
    env = _hand_env()
    env.reset(0)
    with pytest.raises(ValueError, match=match):
        env.step(actions)


def test_constructor_and_reset_validation():
    bars = _hand_bars()
    feats = np.zeros((6, N_FEAT), np.float32)
    with pytest.raises(ValueError, match="state_dim"):
        BranchingEnv(bars, feats, state_dim=N_FEAT + 2, min_start=0)
    with pytest.raises(ValueError, match="features"):
        BranchingEnv(bars, feats.astype(np.float64), state_dim=8, min_start=0)
    with pytest.raises(ValueError, match="features"):
        BranchingEnv(bars, np.zeros((5, N_FEAT), np.float32), state_dim=8, min_start=0)
    bad = feats.copy()
    bad[3, 1] = np.nan
    with pytest.raises(ValueError, match="row 3"):
        BranchingEnv(bars, bad, state_dim=8, min_start=0)
    with pytest.raises(ValueError, match="n_envs"):
        BranchingEnv(bars, feats, state_dim=8, n_envs=0, min_start=0)
    with pytest.raises(ValueError, match="episode_len"):
        BranchingEnv(bars, feats, state_dim=8, episode_len=6, min_start=0)
    with pytest.raises(ValueError, match="min_start"):
        BranchingEnv(bars, feats, state_dim=8, min_start=5)
    with pytest.raises(ValueError, match="ExecutionCosts.passive_fee"):
        ExecutionCosts(fee=1e-4, passive_fee=2e-4)
    with pytest.raises(ValueError, match="ExecutionCosts.fee"):
        ExecutionCosts(fee=-1e-4)
    env = _hand_env(n_envs=2)
    with pytest.raises(RuntimeError, match="reset"):
        env.step(_act([LONG, MARKET, NOW], [LONG, MARKET, NOW]))
    with pytest.raises(ValueError, match="start_idx: 5"):
        env.reset(5)
    with pytest.raises(ValueError, match="start_idx"):
        env.reset(np.array([0, 1, 2]))


# ------------------------------------------------------------------------------------------
# Episodes
# ------------------------------------------------------------------------------------------


def test_done_at_last_bar_without_auto_reset_then_step_raises():
    env = _hand_env()
    env.reset(4)
    s, _, done, info = env.step(_act([LONG, MARKET, NOW]))
    assert done[0] and info["t"][0] == 5 and s[0, 0] == 5.0
    with pytest.raises(RuntimeError, match="last bar"):
        env.step(_act([LONG, MARKET, NOW]))
    assert env.reset(1)[0, 0] == 1.0


def test_auto_reset_returns_terminal_states_and_restarts_flat():
    env = _hand_env(n_envs=2, auto_reset=True, episode_len=2, seed=5)
    env.reset(np.array([0, 2]))
    _, _, done, _ = env.step(_act([LONG, MARKET, NOW], [SHORT, MARKET, NOW]))
    assert not done.any()
    s, _, done, _ = env.step(_act([LONG, MARKET, NOW], [SHORT, MARKET, NOW]))
    assert done.all()
    assert s[:, POS].tolist() == [1.0, -1.0]  # terminal next states, for the replay buffer
    assert s[:, 0].tolist() == [2.0, 4.0]
    after = env.observe()
    assert np.all(after[:, N_FEAT:] == 0)  # flat, no PnL, no time
    assert np.all((env.t >= 0) & (env.t <= env.last_start))
    assert env.last_start == 3


def test_partial_reset_with_mask():
    env = _hand_env(n_envs=2)
    env.reset(0)
    env.step(_act([LONG, MARKET, NOW], [LONG, MARKET, NOW]))
    states = env.reset(3, mask=np.array([False, True]))
    assert states[:, 0].tolist() == [1.0, 3.0]
    assert states[:, POS].tolist() == [1.0, 0.0]


def test_random_starts_are_seeded_and_respect_warmup():
    bars = SyntheticMarket(0, 3000).generate()
    feats = market_features(bars)
    a = BranchingEnv(bars, feats, n_envs=16, seed=9, episode_len=100)
    b = BranchingEnv(bars, feats, n_envs=16, seed=9, episode_len=100)
    a.reset()
    b.reset()
    assert np.array_equal(a.t, b.t)
    assert np.all(a.t >= 480) and np.all(a.t <= 3000 - 1 - 100)


@settings(max_examples=30)
@given(seed=st.integers(0, 2**16), n_steps=st.integers(1, 40))
def test_random_policies_keep_accounting_consistent(seed, n_steps):
    bars = SyntheticMarket(seed % 7, 700).generate()
    env = BranchingEnv(bars, state_dim=128, n_envs=8, episode_len=30, seed=seed)
    rng = np.random.default_rng(seed)
    states = env.reset()
    close = bars.close.astype(np.float64)
    for _ in range(n_steps):
        t = env.t.copy()
        before = env.position.copy()
        actions = rng.integers(0, [3, 3, 2], size=(8, 3)).astype(np.int32)
        next_states, rewards, dones, info = env.step(actions)
        target = actions[:, 0].astype(np.float32) - 1
        assert np.all(np.isfinite(next_states)) and np.all(np.isfinite(rewards))
        assert np.all(info["cost"] >= 0)
        assert np.array_equal(info["cost"] > 0, info["route"] != envmod.ROUTE_NONE)
        assert np.all((info["route"] == envmod.ROUTE_NONE) == (info["position"] == before))
        executed_now = np.isin(
            info["route"], [envmod.ROUTE_MARKET, envmod.ROUTE_LIMIT, envmod.ROUTE_PASSIVE]
        )
        assert np.array_equal(info["held"][executed_now], target[executed_now])
        assert np.array_equal(info["held"][~executed_now], before[~executed_now])
        np.testing.assert_allclose(info["ret"], close[t + 1] / close[t] - 1, rtol=1e-4, atol=1e-9)
        np.testing.assert_allclose(
            rewards, info["held"] * info["ret"] - info["cost"], rtol=1e-5, atol=1e-8
        )
        f = n_market_features()
        assert np.array_equal(next_states[:, f], info["position"])  # position column
        states = env.observe()
        assert np.all(states[dones][:, f:] == 0)
    assert states.shape == (8, 128)


# ------------------------------------------------------------------------------------------
# Rollouts, equity, Sharpe
# ------------------------------------------------------------------------------------------


def test_flat_policy_earns_exactly_nothing():
    bars = SyntheticMarket(1, 2000).generate()
    env = BranchingEnv(bars, n_envs=4, episode_len=200)
    out = rollout(env, lambda s: np.tile(_act([FLAT, MARKET, NOW]), (4, 1)), 500)
    assert out["rewards"].shape == (500, 4)
    assert np.all(out["rewards"] == 0) and np.all(out["costs"] == 0)
    assert annualised_sharpe(out["rewards"][:, 0]) == 0.0
    assert out["dones"].sum(axis=0).tolist() == [2, 2, 2, 2]


def test_long_and_hold_beats_flat_on_the_strong_trend():
    bars = SyntheticMarket.strong_trend(4, 6000).generate()
    env = BranchingEnv(bars, n_envs=4, episode_len=1000)
    out = rollout(env, lambda s: np.tile(_act([LONG, MARKET, NOW]), (4, 1)), 1000)
    per_env = out["rewards"].sum(axis=0)
    assert np.all(per_env > 0)
    assert np.all(out["costs"][1:] == 0)  # one entry, then holding
    assert annualised_sharpe(out["rewards"].mean(axis=1)) > 3.0


def test_rollout_without_auto_reset_stops_at_done():
    env = _hand_env(branches=(3, 2))
    out = rollout(env, lambda s: _act([LONG, MARKET]), 10, start_idx=2)
    assert out["rewards"].shape == (3, 1)
    assert out["dones"][:, 0].tolist() == [False, False, True]


def test_equity_curve_compounds():
    np.testing.assert_allclose(
        equity_curve([0.1, -0.5, 0.2], initial=2.0), [2.2, 1.1, 1.32], rtol=1e-12
    )
    with pytest.raises(ValueError, match="index 1"):
        equity_curve([0.1, -1.0])
    with pytest.raises(ValueError, match="non-finite"):
        equity_curve([0.1, np.nan])


def test_annualised_sharpe_by_hand():
    r = [0.01, -0.02, 0.03, 0.0]
    expected = statistics.mean(r) / statistics.stdev(r) * math.sqrt(252)
    assert annualised_sharpe(r, 252) == pytest.approx(expected, rel=1e-12)
    assert annualised_sharpe(np.array(r, np.float32), 252) == pytest.approx(expected, rel=1e-6)
    default = statistics.mean(r) / statistics.stdev(r) * math.sqrt(252 * 23 * 60)
    assert annualised_sharpe(r) == pytest.approx(default, rel=1e-12)


def test_annualised_sharpe_degenerate_cases():
    assert annualised_sharpe([]) == 0.0
    assert annualised_sharpe([0.01]) == 0.0
    assert annualised_sharpe([0.0] * 10) == 0.0
    assert annualised_sharpe([0.003] * 7) == 0.0  # zero variance, non-zero mean
    with pytest.raises(ValueError, match="index 2"):
        annualised_sharpe([0.0, 0.1, np.inf])
    with pytest.raises(ValueError, match="bars_per_year"):
        annualised_sharpe([0.1, 0.2], 0)
    with pytest.raises(ValueError, match="returns: shape"):
        annualised_sharpe(np.zeros((2, 2)))


def test_bars_per_year_constant():
    assert envmod.DEFAULT_BARS_PER_YEAR == 347_760
    assert bars_per_year(60) == pytest.approx(347_760)
    assert bars_per_year(300) == pytest.approx(347_760 / 5)
    assert bars_per_year(86_400, trading_days=252, hours_per_day=24) == pytest.approx(252)
    with pytest.raises(ValueError, match="bar_seconds"):
        bars_per_year(0)
