"""The environment kernels' twins against the reference environment and evaluation.

``env_reset`` / ``env_step`` / ``env_observe`` on N envs against ``BranchingEnv`` over long random
action sequences (every order route, episode ends, walks reaching the last bar, resets), with
the restart offsets the kernels draw handed to ``BranchingEnv.reset`` (it draws its own
otherwise): positions, entry prices, time in position, costs, positions held, rewards, done,
next states, post-reset states, next-bar returns and regime labels must be equal bit for bit.
Then the kernels' greedy walk (``env_walk.greedy_walk`` + ``eval_metrics``) against
``loop.evaluate`` / ``loop.evaluate_segment`` on real fold segments.
"""

from __future__ import annotations

import numpy as np
import pytest

from foxhunt.reference import loop
from foxhunt.reference.backend import get_backend
from foxhunt.reference.config import DQNConfig
from foxhunt.reference.env import (
    ROUTE_FALLBACK,
    ROUTE_LIMIT,
    ROUTE_MARKET,
    ROUTE_NONE,
    ROUTE_PASSIVE,
    BranchingEnv,
    ExecutionCosts,
)
from foxhunt.reference.kernels import env as K
from foxhunt.reference.kernels.env_walk import greedy_walk
from foxhunt.reference.market import Bars, SyntheticMarket, market_features
from foxhunt.reference.metrics import METRIC_NAMES, bar_seconds, bars_per_year

F32, I32 = np.float32, np.int32
WINDOWS = (5, 15)
KEY = 2026
REWARD_SCALE = np.float32(1000.0)


def _bars(labels: bool) -> Bars:
    bars = SyntheticMarket(11, 1500).generate()
    if labels:
        return bars
    return Bars(bars.timestamp, bars.open, bars.high, bars.low, bars.close, bars.volume)


def _actions(rng, n: int, branches) -> np.ndarray:
    return np.stack([rng.integers(0, b, n) for b in branches], axis=1).astype(I32)


@pytest.mark.parametrize("branches, episode_len, n_envs, labels", [
    ((3, 3, 2), 40, 16, True),
    ((3, 2), None, 7, True),    # walks run to the last bar, then restart
    ((3,), 300, 5, False),      # market orders only; regime labels from the causal rule
])
def test_kernel_envs_reproduce_branching_env(branches, episode_len, n_envs, labels):
    bars = _bars(labels)
    feats = market_features(bars, WINDOWS)
    tables = K.market_tables(bars, feats)
    state_dim = feats.shape[1] + 5
    costs = ExecutionCosts()
    ref = BranchingEnv(bars, feats, state_dim=state_dim, n_envs=n_envs, branches=branches,
                       costs=costs, episode_len=episode_len, windows=WINDOWS, auto_reset=False)
    lo, hi, n_bars = ref.min_start, ref.last_start, len(bars)
    state = K.env_reset(None, n_envs, lo, hi, KEY, np.zeros(1, np.int64))
    np.testing.assert_array_equal(
        K.env_observe(tables.features, tables.close, *state[:1], state.position,
                      state.entry_price, state.time_in_position, state_dim),
        ref.reset(state.t.astype(np.int64)))
    rows = n_bars if episode_len is None else episode_len
    rec = [np.zeros((rows, n_envs), F32) for _ in range(3)]
    rng = np.random.default_rng(5)
    routes = np.zeros(ROUTE_FALLBACK + 1, np.int64)
    resets = 0
    for cycle in range(1, 2501):
        actions = _actions(rng, n_envs, branches)
        steps_before = state.steps.copy()
        out = K.env_step(*tables, *state, actions, *rec, K.cost_table(costs), n_bars, lo, hi,
                         episode_len or 0, 1, REWARD_SCALE, state_dim, KEY,
                         np.array([cycle], np.int64))
        s2, reward, done, info = ref.step(actions)
        np.testing.assert_array_equal(out.s2, s2)
        np.testing.assert_array_equal(out.r, (reward * REWARD_SCALE).astype(F32))
        np.testing.assert_array_equal(out.done, done.astype(F32))
        np.testing.assert_array_equal(out.next_ret, info["ret"])
        np.testing.assert_array_equal(out.regime, info["regime"].astype(I32))
        envs = np.arange(n_envs)
        np.testing.assert_array_equal(out.rec_reward[steps_before, envs], reward)
        np.testing.assert_array_equal(out.rec_held[steps_before, envs], info["held"])
        np.testing.assert_array_equal(out.rec_cost[steps_before, envs], info["cost"])
        routes += np.bincount(info["route"], minlength=routes.size)
        if done.any():
            resets += int(done.sum())
            ref.reset(out.t.astype(np.int64), mask=done)
        np.testing.assert_array_equal(out.obs, ref.observe())
        for name in K.EnvState._fields:
            np.testing.assert_array_equal(getattr(out, name), getattr(ref, name), err_msg=name)
        state, rec = K.EnvState(*out[:5]), [out.rec_reward, out.rec_held, out.rec_cost]
    # The sequence exercised every route the configuration has, and many restarts. (A limit
    # order at the close almost never misses here: the synthetic bar after it opens at that
    # close and its low reaches below; passive orders, one half-spread away, do miss.)
    with_limit = {ROUTE_LIMIT} if len(branches) > 1 else set()
    with_passive = {ROUTE_PASSIVE, ROUTE_FALLBACK} if len(branches) > 1 and branches[1] > 2 \
        else set()
    expected_routes = {ROUTE_NONE, ROUTE_MARKET} | with_limit | with_passive
    assert {r for r in range(routes.size) if routes[r]} == expected_routes
    assert resets >= 20


# ------------------------------------------------------------------ greedy evaluation
@pytest.fixture(scope="module")
def run_setup():
    config = DQNConfig.preset("tiny")
    trainer = get_backend("reference")(config, seed=3)
    bars = SyntheticMarket(4, 2400).generate()
    windows = loop.choose_windows(config.state_dim)
    feats = market_features(bars, windows)
    from foxhunt.reference.market import feature_warmup

    segments = loop.fold_segments(len(bars), feature_warmup(windows), 2, 0.125, 0.125)
    return config, trainer, bars, feats, segments


def test_greedy_walk_reproduces_evaluate_segment(run_setup):
    config, trainer, bars, feats, segments = run_setup
    tables = K.market_tables(bars, feats)
    per_year = bars_per_year(bar_seconds(bars.timestamp))
    for seg in segments:
        for name in loop.EVAL_SEGMENTS:
            start, stop = getattr(seg, name)
            walk = greedy_walk(trainer.q_values, tables, ExecutionCosts(), config.branches,
                                 config.state_dim, start, stop)
            want = loop.evaluate(trainer, bars, feats, config.state_dim, config.branches, start,
                                 stop)
            np.testing.assert_array_equal(walk.rewards.astype(np.float64), want["rewards"])
            np.testing.assert_array_equal(walk.positions.astype(np.float64), want["positions"])
            np.testing.assert_array_equal(walk.costs.astype(np.float64), want["costs"])
            got = K.eval_metrics(walk.rewards, walk.positions, walk.costs, per_year)
            metrics, _ = loop.evaluate_segment(trainer, bars, feats, config, (start, stop),
                                               "greedy", per_year)
            assert got.tolist() == [np.float32(getattr(metrics, m)) for m in METRIC_NAMES]
            assert metrics.turnover > 0  # the greedy policy trades: the walk is not trivial


@pytest.mark.parametrize("policy", sorted(loop.BASELINE_ACTIONS))
def test_baselines_are_greedy_walks_of_one_hot_q(run_setup, policy):
    """A baseline's fixed actions as the greedy choice of one-hot Q: the same walk."""
    config, _, bars, feats, segments = run_setup
    fixed = loop.BASELINE_ACTIONS[policy][:len(config.branches)]

    def one_hot(states):
        return [np.eye(n, dtype=F32)[a][None].repeat(len(states), 0)
                for a, n in zip(fixed, config.branches)]

    start, stop = segments[1].test
    walk = greedy_walk(one_hot, K.market_tables(bars, feats), ExecutionCosts(),
                         config.branches, config.state_dim, start, stop)
    want = loop.evaluate(None, bars, feats, config.state_dim, config.branches, start, stop,
                         policy)
    np.testing.assert_array_equal(walk.rewards.astype(np.float64), want["rewards"])
    np.testing.assert_array_equal(walk.positions.astype(np.float64), want["positions"])
