"""Unit tests of the environment kernels' reference twins (``reference/kernels/env.py``) and of
the facts ``cuda_src/env.cu`` / ``env.cuh`` repeat as constants (cost-table order, metric order,
state-feature scales, branch values, stream ids): expected values are worked out by hand from
the execution model of ``reference/env.py``'s docstring, not from the code under test.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from foxhunt.fast.cuda_parse import parse_cuda_dir
from foxhunt.fast.kernels import env as fast_env
from foxhunt.reference import env as ref_env
from foxhunt.reference import market
from foxhunt.reference import metrics
from foxhunt.reference.kernels import env as K
from foxhunt.reference.kernels.rng import STREAMS, uniform
from foxhunt.conformance.registry import default_cuda_dir

F32, I32 = np.float32, np.int32
CUDA = default_cuda_dir()
COSTS = ref_env.ExecutionCosts()
KEY = 77


def _defines(prefix: str) -> dict[str, str]:
    text = (CUDA / "env.cuh").read_text() + (CUDA / "env.cu").read_text()
    return dict(re.findall(rf"#define {prefix}(\w+) (\S+)", text))


def _cycle(c: int = 0) -> np.ndarray:
    return np.array([c], np.int64)


# ------------------------------------------------------------------ constants in the CUDA source
def test_cost_table_order_matches_the_cuda_indices():
    idx = {k.lower(): int(v) for k, v in _defines("ENV_COST_").items()}
    assert idx == {name: i for i, name in enumerate(K.COST_FIELDS)}
    assert K.cost_table(COSTS).tolist() == [np.float32(getattr(COSTS, n)) for n in K.COST_FIELDS]


def test_metric_order_matches_the_cuda_indices():
    idx = {k.lower(): int(v) for k, v in _defines("EVAL_").items() if k.isupper()
           and k not in ("THREADS", "WARPS", "TILE", "INF", "NAN")}
    assert idx == {name: i for i, name in enumerate(metrics.METRIC_NAMES)}


def test_state_feature_constants_match_the_market_module():
    d = _defines("ENV_")
    assert float(d["PNL_SCALE"].rstrip("f")) == market.PNL_SCALE
    assert float(d["TIME_IN_POSITION_SCALE"].rstrip("f")) == market.TIME_IN_POSITION_SCALE
    assert int(d["N_POSITION_FEATURES"]) == market.N_POSITION_FEATURES
    assert (int(d["ORDER_MARKET"]), int(d["ORDER_LIMIT"]), int(d["ORDER_PASSIVE"])) == (
        ref_env.ORDER_MARKET, ref_env.ORDER_LIMIT, ref_env.ORDER_PASSIVE)
    assert (int(d["URGENCY_NOW"]), int(d["URGENCY_PATIENT"])) == (
        ref_env.URGENCY_NOW, ref_env.URGENCY_PATIENT)
    assert K.FULL_BRANCHES == ref_env.FULL_BRANCHES
    assert ref_env.EXPOSURE_VALUES.tolist() == [a - 1 for a in range(3)]  # exposure = a - 1


def test_stream_arguments_are_kernel_parameters_with_the_rng_ids():
    kernels = parse_cuda_dir(CUDA)
    params = {name for k in ("env_reset", "env_step", "env_act") for _, name in kernels[k].params}
    assert set(fast_env.STREAM_ARGS) <= params
    assert fast_env.STREAM_ARGS == {"start_stream": STREAMS["episode_start"],
                                    "explore_stream": STREAMS["explore"],
                                    "action_stream": STREAMS["explore_action"]}


def test_pack_q_is_the_fast_forwards_q_layout():
    from foxhunt.fast.step_layout import EvalLayout, StepLayout
    from foxhunt.reference.config import DQNConfig

    config = DQNConfig.preset("seed")
    rows = 5
    evl = EvalLayout(StepLayout(config), rows)
    rng = np.random.default_rng(0)
    qs = [rng.standard_normal((rows, n)).astype(F32) for n in config.branches]
    packed = K.pack_q(qs)
    assert packed.size == evl.specs["q_e"][0][0]
    for got, want in zip(evl.split_q(packed), qs):
        np.testing.assert_array_equal(got, want)


# ------------------------------------------------------------------ one env, worked by hand
def _tables(close, high, low, n_features=2):
    n = len(close)
    feats = np.arange(n * n_features, dtype=F32).reshape(n, n_features)
    return K.MarketTables(np.array(close, F32), np.array(high, F32), np.array(low, F32), feats,
                          np.arange(n, dtype=I32) % 3)


def _state(t=0, steps=0, tip=0, position=0.0, entry=0.0):
    return K.EnvState(np.array([t], I32), np.array([steps], I32), np.array([tip], I32),
                      np.array([position], F32), np.array([entry], F32))


def _step(tables, state, action, *, n_bars=None, episode_len=0, auto_reset=0, scale=1.0,
          record=0, state_dim=8, cycle=0):
    rec = [np.full((record, 1), -7.0, F32) for _ in range(3)]
    n_bars = len(tables.close) if n_bars is None else n_bars
    return K.env_step(*tables, *state, np.array([action], I32), *rec, K.cost_table(COSTS),
                      n_bars, 0, n_bars - 2, episode_len, auto_reset, scale, state_dim, KEY,
                      _cycle(cycle))


BARS = _tables(close=[100.0, 101.0, 100.5, 102.0], high=[100.5, 101.5, 101.0, 102.5],
               low=[99.5, 99.8, 100.2, 101.0])


def test_market_buy_from_flat_pays_fee_spread_and_slippage():
    out = _step(BARS, _state(), (2, 0, 0), scale=1000.0)
    unit = COSTS.fee + COSTS.half_spread + COSTS.slippage_coef * (100.5 - 99.5) / 100.0
    ret = (101.0 - 100.0) / 100.0
    assert out.next_ret[0] == pytest.approx(ret, rel=1e-6)
    assert out.r[0] == pytest.approx(1000.0 * (ret - unit), rel=1e-5)
    assert (out.position[0], out.entry_price[0], out.time_in_position[0]) == (1.0, 100.0, 1)
    assert (out.t[0], out.steps[0], out.done[0], out.regime[0]) == (1, 1, 0.0, 0)


def test_patient_market_order_pays_the_scaled_slippage():
    out = _step(BARS, _state(), (0, 0, 1), record=1)
    unit = COSTS.fee + COSTS.half_spread + (
        COSTS.slippage_coef * COSTS.patient_slippage_scale * (100.5 - 99.5) / 100.0)
    assert out.rec_cost[0, 0] == pytest.approx(unit, rel=1e-6)  # short from flat: size 1
    assert out.rec_held[0, 0] == -1.0


def test_limit_buy_fills_only_when_the_next_bar_trades_through():
    through = _step(BARS, _state(), (2, 1, 1), record=1)  # next low 99.8 < 100
    assert through.position[0] == 1.0 and through.rec_cost[0, 0] == pytest.approx(COSTS.fee)
    touch = _tables(close=[100.0, 101.0], high=[100.5, 101.5], low=[99.5, 100.0])
    missed = _step(touch, _state(), (2, 1, 1), record=1)  # touching 100 is not enough
    assert missed.position[0] == 0.0 and missed.rec_cost[0, 0] == 0.0
    assert missed.r[0] == 0.0  # cancelled (patient), nothing held


def test_unfilled_passive_order_with_urgency_now_falls_back_to_the_next_close():
    # Passive sell rests at 100 * (1 + half_spread) = 100.01; the next high 100.005 misses it.
    bars = _tables(close=[100.0, 99.0, 99.0], high=[100.5, 100.005, 99.5], low=[99.5, 98.5, 98.0])
    out = _step(bars, _state(), (0, 2, 0), record=1)
    fallback_unit = COSTS.fee + COSTS.half_spread + COSTS.slippage_coef * (100.005 - 98.5) / 99.0
    assert out.rec_held[0, 0] == 0.0  # the position changes only after bar t + 1
    assert out.rec_cost[0, 0] == pytest.approx(fallback_unit, rel=1e-5)
    assert out.rec_reward[0, 0] == pytest.approx(-fallback_unit, rel=1e-5)
    assert (out.position[0], out.entry_price[0], out.time_in_position[0]) == (-1.0, 99.0, 0)


def test_flip_from_short_to_long_pays_for_two_units():
    out = _step(BARS, _state(position=-1.0, entry=99.0, tip=5), (2, 2, 0), record=1)
    # Passive buy at 100 * (1 - 1e-4) = 99.99: the next low 99.8 trades through it.
    assert out.rec_cost[0, 0] == pytest.approx(2 * COSTS.passive_fee, rel=1e-6)
    assert (out.position[0], out.entry_price[0], out.time_in_position[0]) == (1.0, 100.0, 1)


def test_holding_counts_bars_and_the_state_shows_unrealised_pnl():
    out = _step(BARS, _state(t=1, position=1.0, entry=100.0, tip=3), (2, 0, 0), state_dim=8)
    assert out.rec_cost.size == 0 and out.time_in_position[0] == 4
    s = out.s2[0]
    pnl = (100.5 - 100.0) / 100.0  # bar 2's close against the entry
    np.testing.assert_array_equal(s[:2], BARS.features[2])
    assert s[2] == 1.0
    assert s[3] == pytest.approx(math.tanh(market.PNL_SCALE * pnl), rel=1e-6)
    assert s[4] == pytest.approx(math.tanh(4 / market.TIME_IN_POSITION_SCALE), rel=1e-6)
    assert np.all(s[5:] == 0)


def test_record_rows_follow_the_step_count_and_others_are_kept():
    out = _step(BARS, _state(t=1, steps=2), (1, 0, 0), record=4)
    assert out.rec_reward[:, 0].tolist() == [-7.0, -7.0, 0.0, -7.0]
    late = _step(BARS, _state(t=1, steps=4), (1, 0, 0), record=4)
    assert np.all(late.rec_reward == -7.0)


def test_an_env_at_its_last_bar_is_frozen_and_done():
    state = _state(t=3, steps=9, tip=2, position=1.0, entry=101.0)
    out = _step(BARS, state, (0, 0, 0), record=10)
    assert (out.r[0], out.next_ret[0], out.done[0]) == (0.0, 0.0, 1.0)
    for got, want in zip(out[:5], state):
        np.testing.assert_array_equal(got, want)
    assert np.all(out.rec_reward == -7.0)


def test_episode_end_resets_to_a_drawn_offset_with_the_terminal_state_in_s2():
    bars = _tables(close=np.linspace(100, 110, 40), high=np.linspace(100.5, 110.5, 40),
                   low=np.linspace(99.5, 109.5, 40))
    out = _step(bars, _state(t=10, steps=4, position=1.0, entry=100.0), (2, 0, 0),
                episode_len=5, auto_reset=1, cycle=3)
    assert out.done[0] == 1.0 and out.s2[0, 2] == 1.0  # s2: still long at bar 11
    u = float(uniform(KEY, STREAMS["episode_start"], 3, 0))
    assert out.t[0] == int(u * 39)  # min_start 0, last_start 38: 39 offsets
    assert (out.steps[0], out.position[0], out.entry_price[0]) == (0, 0.0, 0.0)
    want = K.env_observe(bars.features, bars.close, out.t, out.position, out.entry_price,
                         out.time_in_position, 8)
    np.testing.assert_array_equal(out.obs, want)


def test_walk_end_is_done_without_auto_reset():
    out = _step(BARS, _state(t=2), (1, 0, 0), auto_reset=0)
    assert out.done[0] == 1.0 and out.t[0] == 3
    np.testing.assert_array_equal(out.obs, out.s2)


# ------------------------------------------------------------------ resets and actions
def test_drawn_starts_cover_the_range_and_depend_on_key_and_cycle():
    a = K.env_reset(None, 4000, 5, 14, KEY, _cycle(1)).t
    assert a.min() == 5 and a.max() == 14
    counts = np.bincount(a - 5, minlength=10)
    # 4000 draws over 10 offsets: each count ~ Binomial(4000, 0.1), sd 19; 6 sd bounds.
    assert np.all(np.abs(counts - 400) < 6 * 19)
    assert not np.array_equal(a, K.env_reset(None, 4000, 5, 14, KEY, _cycle(2)).t)
    assert not np.array_equal(a, K.env_reset(None, 4000, 5, 14, KEY + 1, _cycle(1)).t)
    np.testing.assert_array_equal(a, K.env_reset(None, 4000, 5, 14, KEY, _cycle(1)).t)


def test_greedy_actions_take_the_lowest_index_of_the_maximum():
    branches = (3, 2)
    q0 = np.array([[1.0, 3.0, 3.0], [np.nan, -1.0, -2.0], [np.nan, np.nan, np.nan]], F32)
    q1 = np.array([[0.5, 0.5], [-np.inf, 0.0], [2.0, np.nan]], F32)
    out = K.env_act(K.pack_q([q0, q1]), branches, 0.0, KEY, _cycle())
    assert out.tolist() == [[1, 0], [1, 1], [0, 0]]


def test_exploration_rate_and_draw_indices_follow_the_contract():
    n, branches = 3000, (3, 3, 2)
    q = K.pack_q([np.tile(np.arange(b, dtype=F32), (n, 1)) for b in branches])  # greedy: last
    out = K.env_act(q, branches, 0.25, KEY, _cycle(9))
    env = np.arange(n)
    for d, n_d in enumerate(branches):
        explore = uniform(KEY, STREAMS["explore"], 9, 6 * env + 2 * d) < np.float32(0.25)
        drawn = np.floor(uniform(KEY, STREAMS["explore_action"], 9, 3 * env + d).astype(
            np.float64) * n_d).astype(int)
        np.testing.assert_array_equal(out[:, d], np.where(explore, drawn, n_d - 1))
        # explore ~ Binomial(3000, 0.25): sd 23.7; 6 sd.
        assert abs(explore.sum() - 750) < 6 * 23.7
    assert np.all(K.env_act(q, branches, 1.0, KEY, _cycle(9)) == np.stack(
        [np.floor(uniform(KEY, STREAMS["explore_action"], 9, 3 * env + d).astype(np.float64)
                  * n_d).astype(int) for d, n_d in enumerate(branches)], axis=1))
    assert np.all(K.env_act(q, branches, np.nan, KEY, _cycle(9))
                  == np.array([n_d - 1 for n_d in branches]))


# ------------------------------------------------------------------ metrics
def test_eval_metrics_are_the_segment_metrics_rounded_to_float32():
    rng = np.random.default_rng(3)
    r = (rng.standard_normal(1000) * 1e-3).astype(F32)
    p = rng.choice(np.array([-1, 0, 1], F32), 1000)
    c = (rng.random(1000) * 1e-4).astype(F32)
    want = metrics.segment_metrics(r, p, c, 5796.0)
    got = K.eval_metrics(r, p, c, 5796.0)
    assert got.tolist() == [np.float32(getattr(want, name)) for name in metrics.METRIC_NAMES]


def test_eval_metrics_nan_contract_and_short_segments():
    ok = np.array([1e-3, -2e-3, 5e-4], F32)
    zeros = np.zeros(3, F32)
    bad = ok.copy()
    bad[1] = np.nan
    out = K.eval_metrics(bad, zeros, zeros, 252.0)
    assert np.isnan(out[:3]).all() and out[3:].tolist() == [0.0, 0.0]
    wiped = ok.copy()
    wiped[0] = -1.0
    out = K.eval_metrics(wiped, zeros + np.float32(np.inf), zeros, 252.0)
    assert not np.isnan(out[0]) and np.isnan(out[1:4]).all() and out[4] == 0.0
    empty = np.zeros(0, F32)
    assert K.eval_metrics(empty, empty, empty, 252.0).tolist() == [0.0] * 5
    one = np.array([0.01], F32)
    assert K.eval_metrics(one, one, one, 252.0)[0] == 0.0  # fewer than two returns


@pytest.mark.parametrize("bad, match", [
    (dict(bars_per_year=-1.0), "bars_per_year"),
    (dict(costs=np.zeros(2, F32)), "one length"),
])
def test_eval_metrics_errors_name_the_argument(bad, match):
    args = dict(rewards=np.zeros(3, F32), positions=np.zeros(3, F32), costs=np.zeros(3, F32),
                bars_per_year=252.0)
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        K.eval_metrics(**args)
