"""Reference twins of the environment kernels (``cuda_src/env.cu``, SPEC 10: the environment on
the device): reset, observation, one step of N parallel walks, epsilon-greedy action choice from
the network's expected Q, and the metrics of a greedy walk over a segment.

The semantics are ``foxhunt.reference.env.BranchingEnv`` 's (fills, order types, urgency,
slippage, costs, rewards, positions, entry prices, time in position, episode ends); its module
docstring is the specification and ``tests/test_env_twin.py`` proves the twins reproduce it bit
for bit. What differs, because a kernel cannot raise or hold a generator: auto-reset offsets come
from the counter-based generator (``rng.uniform(key, STREAMS["episode_start"], cycle, env)``,
``key`` the run's seed, ``cycle`` the collector's counter),
and an env already at its last bar does not move (below).

**Device tables** (uploaded once per run; one row per bar of the whole series, so every fold's
training, validation and test walks index the same tables by absolute bar number): ``close``,
``high``, ``low`` float32 ``[T]``, ``features`` float32 ``[T, F]`` (``market.market_features``)
and ``regime`` int32 ``[T]`` (``market.regime_labels``): :func:`market_tables`. A walk ends at
its own ``n_bars <= T`` (the reference env's ``len(bars)``: the end of the fold's training
segment, or of the evaluated segment).

**Env state** (one entry per env, structure of arrays, :class:`EnvState`): ``t`` (bar index),
``steps`` (steps since the episode began), ``time_in_position`` int32; ``position``,
``entry_price`` float32. States written for the network, ``f32 [N, state_dim]``, are
``market.state_features`` of that state (``[features[t], position, tanh(100 pnl),
tanh(time / 64), 0...]``).

**Step** (:func:`env_step`), per env, with ``actions [N, nb]`` (exposure, then order type,
then urgency; a missing branch takes its default, market / now): the reference env's step at
bar ``t``, then ``done = t' >= n_bars - 1 or (episode_len > 0 and steps' >= episode_len)``;
``s2`` is the state after the step, ``obs`` the state after any auto-reset (``auto_reset``:
done envs restart flat at a drawn offset in ``[min_start, last_start]``). An env at its last
bar (``t == n_bars - 1``; the reference env raises there) is *frozen*: nothing trades, the
state is kept, ``r = next_ret = 0``, ``done = 1`` (so it restarts under ``auto_reset``).

**NaN contract** (market data may carry NaN): every float follows IEEE arithmetic in the
reference env's order, so a non-finite feature reaches only its own column of ``s2``/``obs``;
a non-finite price of bar t or t+1 reaches ``r``, ``next_ret``, the costs (through the bar
range) and, through a fill at that price, ``entry_price`` and later unrealised-PnL features;
comparisons with NaN are false (a limit or passive order never fills against a NaN bar: it
falls back to a market order at a NaN price under urgency "now"). Integer state (``t``,
``steps``, ``done``) never depends on prices. ``time_in_position`` and ``position`` depend on
fills only.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import numpy as np

from foxhunt.reference import metrics
from foxhunt.reference.env import ExecutionCosts
from foxhunt.reference.kernels.argcheck import (
    check_array,
    check_f32_array,
    check_int,
    data_f32,
    ieee,
)
from foxhunt.reference.kernels.distributional import double_dqn_select
from foxhunt.reference.kernels.fused import branch_offsets, require_branches
from foxhunt.reference.kernels.replay import validate_cycle
from foxhunt.reference.kernels.rng import MAX_U64, STREAMS, uniform
from foxhunt.reference.market import N_POSITION_FEATURES, Bars, regime_labels, state_features

F32, I32 = np.float32, np.int32

#: The cost table's entries, in order (``env.ExecutionCosts`` fields; ``ENV_COST_*`` in env.cu).
COST_FIELDS = tuple(f.name for f in dataclasses.fields(ExecutionCosts))
#: Actions per branch of the full configuration, and each branch's default (market, now).
FULL_BRANCHES = (3, 3, 2)
BRANCH_DEFAULTS = (1, 0, 0)
ORDER_MARKET, ORDER_LIMIT, ORDER_PASSIVE = 0, 1, 2
URGENCY_NOW, URGENCY_PATIENT = 0, 1
#: Bars of the device tables + 1: bar counts stay exact in float32 (the start-offset draw).
MAX_BARS = 2**24
#: ``eval_metrics``' outputs, in order (``EVAL_*`` in env.cu).
EVAL_FIELDS = metrics.METRIC_NAMES


# --------------------------------------------------------------------------------------------
# Tables and state
# --------------------------------------------------------------------------------------------


class MarketTables(NamedTuple):
    """The per-run device tables (module docstring): prices ``[T]``, ``features [T, F]``,
    ``regime`` int32 ``[T]``."""

    close: np.ndarray
    high: np.ndarray
    low: np.ndarray
    features: np.ndarray
    regime: np.ndarray


def market_tables(bars: Bars, features: np.ndarray) -> MarketTables:
    """The device tables of ``bars`` with their ``features`` (``market_features(bars, ...)``)
    and ``market.regime_labels(bars)``, in the kernels' dtypes."""
    features = check_f32_array("features", np.ascontiguousarray(features), ndim=2)
    n = len(bars)
    if features.shape[0] != n:
        raise ValueError(f"features: shape {features.shape} is not allowed; need [{n}, F] "
                         "(one row per bar)")
    return MarketTables(*(np.ascontiguousarray(a, dtype=F32) for a in (bars.close, bars.high,
                                                                         bars.low)),
                        features, regime_labels(bars).astype(I32))


def cost_table(costs: ExecutionCosts) -> np.ndarray:
    """``costs`` as the kernels' float32 ``[len(COST_FIELDS)]`` table."""
    return np.array([getattr(costs, name) for name in COST_FIELDS], dtype=F32)


class EnvState(NamedTuple):
    """Per-env state: ``t``, ``steps``, ``time_in_position`` int32 ``[N]``; ``position``,
    ``entry_price`` float32 ``[N]``."""

    t: np.ndarray
    steps: np.ndarray
    time_in_position: np.ndarray
    position: np.ndarray
    entry_price: np.ndarray


class EnvStep(NamedTuple):
    """Outputs of :func:`env_step`: the new state (after any auto-reset), ``r`` (reward times
    ``reward_scale``), ``done`` (float32 0/1), ``s2`` (states after the step, before any reset),
    ``obs`` (states after any reset), ``next_ret`` ((C' - P) / P), ``regime`` (bar t's label),
    and the record arrays ``rec_*`` ``[R, N]`` with row ``steps`` (before the step) written."""

    t: np.ndarray
    steps: np.ndarray
    time_in_position: np.ndarray
    position: np.ndarray
    entry_price: np.ndarray
    r: np.ndarray
    done: np.ndarray
    s2: np.ndarray
    obs: np.ndarray
    next_ret: np.ndarray
    regime: np.ndarray
    rec_reward: np.ndarray
    rec_held: np.ndarray
    rec_cost: np.ndarray


# --------------------------------------------------------------------------------------------
# Validation (shared with the fast test entries, foxhunt.fast.kernels.env)
# --------------------------------------------------------------------------------------------


def check_key(key) -> int:
    """The Philox key (the run's seed): an integer in ``[0, 2**64)``."""
    return check_int("key", key, minimum=0, maximum=MAX_U64 - 1)


def _check_tables(close, high, low, features, regime, n_bars) -> tuple[int, int]:
    """Tables of one length T (``regime`` optional); ``2 <= n_bars <= T`` unless ``n_bars`` is
    None. Returns ``(T, F)``."""
    for name, x in (("close", close), ("high", high), ("low", low)):
        check_f32_array(name, x, ndim=1)
    check_f32_array("features", features, ndim=2)
    n = close.shape[0]
    shapes = [high.shape, low.shape, features.shape[:1]]
    if regime is not None:
        check_array("regime", regime, I32, ndim=1)
        shapes.append(regime.shape)
    if any(s != (n,) for s in shapes):
        raise ValueError(f"close, high, low, features, regime: lengths {[close.shape] + shapes} "
                         "differ; the tables need one row per bar")
    if n >= MAX_BARS:
        raise ValueError(f"close: {n} bars is not allowed; need fewer than {MAX_BARS} (the "
                         "kernels convert bar counts to float32 exactly)")
    if n_bars is not None:
        check_int("n_bars", n_bars, minimum=2, maximum=n)
    return n, features.shape[1]


def _check_state_dim(state_dim, n_features: int) -> int:
    return check_int("state_dim", state_dim, minimum=n_features + N_POSITION_FEATURES)


def _check_state(t, steps, time_in_position, position, entry_price, n_bars: int) -> int:
    """The env-state arrays of one length N; ``0 <= t < n_bars`` (the tables are read at t).
    Returns N."""
    for name, x in (("t", t), ("steps", steps), ("time_in_position", time_in_position)):
        check_array(name, x, I32, ndim=1)
    for name, x in (("position", position), ("entry_price", entry_price)):
        check_f32_array(name, x, ndim=1)
    n = t.shape[0]
    if any(x.shape != (n,) for x in (steps, time_in_position, position, entry_price)) or n < 1:
        raise ValueError("t, steps, time_in_position, position, entry_price: shapes "
                         f"{[x.shape for x in (t, steps, time_in_position, position, entry_price)]}"
                         "; need one length N >= 1")
    if t.min() < 0 or t.max() >= n_bars:
        raise ValueError(f"t: values in [{t.min()}, {t.max()}] are not allowed; need "
                         f"0 <= t < n_bars={n_bars}")
    if steps.min() < 0 or time_in_position.min() < 0:
        raise ValueError("steps, time_in_position: negative values are not allowed")
    return n


def _check_start_range(min_start, last_start, n_bars: int) -> tuple[int, int]:
    last = check_int("last_start", last_start, minimum=0, maximum=n_bars - 2)
    return check_int("min_start", min_start, minimum=0, maximum=last), last


def validate_env_observe(features, close, t, position, entry_price, time_in_position,
                         state_dim) -> int:
    """The argument checks of ``env_observe``; returns ``state_dim``."""
    _, f = _check_tables(close, close, close, features, None, None)
    _check_state(t, t, time_in_position, position, entry_price, close.shape[0])
    return _check_state_dim(state_dim, f)


def validate_env_reset(start, n_envs, min_start, last_start, key, cycle):
    """The argument checks of ``env_reset``; returns ``(n_envs, min_start, last_start, key,
    cycle)`` as integers (``cycle``: ``replay.validate_cycle``, int64 ``[1]`` on the device)."""
    n = check_int("n_envs", n_envs, minimum=1)
    hi = check_int("last_start", last_start, minimum=0, maximum=MAX_BARS - 2)
    lo = check_int("min_start", min_start, minimum=0, maximum=hi)
    if start is not None:
        check_array("start", start, I32, ndim=1)
        if start.shape != (n,) or start.min() < 0 or start.max() > hi:
            raise ValueError(f"start: shape {start.shape}, values in [{start.min()}, "
                             f"{start.max()}] are not allowed; need [{n}] in [0, {hi}]")
    return n, lo, hi, check_key(key), validate_cycle(cycle)


def validate_env_step(close, high, low, features, regime, t, steps, time_in_position, position,
                      entry_price, actions, rec_reward, rec_held, rec_cost, costs, n_bars,
                      min_start, last_start, episode_len, auto_reset, reward_scale, state_dim,
                      key, cycle):
    """The argument checks of ``env_step``; returns ``(n_envs, n_branches, record_len, scalars)``
    with ``scalars`` the integer and float32 arguments as the kernel receives them."""
    if regime is None:
        raise ValueError("regime: None is not allowed; env_step needs the int32 [T] label table")
    _, f = _check_tables(close, high, low, features, regime, n_bars)
    n = _check_state(t, steps, time_in_position, position, entry_price, n_bars)
    check_array("actions", actions, I32, ndim=2)
    nb = actions.shape[1]
    if actions.shape[0] != n or not 1 <= nb <= len(FULL_BRANCHES):
        raise ValueError(f"actions: shape {actions.shape} is not allowed; need [{n}, nb] with "
                         f"1 <= nb <= {len(FULL_BRANCHES)}")
    for d in range(nb):
        col = actions[:, d]
        if col.min() < 0 or col.max() >= FULL_BRANCHES[d]:
            raise ValueError(f"actions[:, {d}]: values in [{col.min()}, {col.max()}] are not "
                             f"allowed; need 0 <= a < {FULL_BRANCHES[d]}")
    for name, x in (("rec_reward", rec_reward), ("rec_held", rec_held), ("rec_cost", rec_cost)):
        check_f32_array(name, x, ndim=2)
        if x.shape != rec_reward.shape or x.shape[1] != n:
            raise ValueError(f"{name}: shape {x.shape} is not allowed; need [R, {n}] like "
                             f"rec_reward {rec_reward.shape}")
    check_f32_array("costs", costs, ndim=1)
    if costs.shape != (len(COST_FIELDS),):
        raise ValueError(f"costs: shape {costs.shape} is not allowed; need [{len(COST_FIELDS)}] "
                         f"({', '.join(COST_FIELDS)})")
    lo, hi = _check_start_range(min_start, last_start, n_bars)
    scalars = (lo, hi, check_int("episode_len", episode_len, minimum=0),
               check_int("auto_reset", int(auto_reset) if isinstance(auto_reset, bool)
                         else auto_reset, minimum=0, maximum=1),
               data_f32("reward_scale", reward_scale), _check_state_dim(state_dim, f),
               check_key(key), validate_cycle(cycle))
    return n, nb, rec_reward.shape[0], scalars


def validate_env_act(q, branches, eps, key, cycle):
    """The argument checks of ``env_act``; returns ``(branches, n_envs, eps, key, cycle)``."""
    br = require_branches(branches)
    check_f32_array("q", q, ndim=1)
    total = sum(br)
    if q.size == 0 or q.size % total:
        raise ValueError(f"q: shape {q.shape} is not allowed; need [N * {total}] (branch-packed "
                         f"expected Q of N >= 1 states, branches {br})")
    return br, q.size // total, data_f32("eps", eps), check_key(key), validate_cycle(cycle)


def validate_eval_metrics(rewards, positions, costs, bars_per_year) -> float:
    """The argument checks of ``eval_metrics``; returns ``bars_per_year`` as a float."""
    for name, x in (("rewards", rewards), ("positions", positions), ("costs", costs)):
        check_f32_array(name, x, ndim=1)
    if not rewards.shape == positions.shape == costs.shape:
        raise ValueError(f"rewards, positions, costs: shapes {rewards.shape}, {positions.shape}, "
                         f"{costs.shape} are not allowed; need one length")
    ok = isinstance(bars_per_year, (int, float, np.integer, np.floating)) and not isinstance(
        bars_per_year, (bool, np.bool_)) and math.isfinite(bars_per_year) and bars_per_year > 0
    if not ok:
        raise ValueError(f"bars_per_year: {bars_per_year!r} is not allowed; need a finite "
                         "value > 0")
    return float(bars_per_year)


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


def _unrealised_pnl(close, t, position, entry_price) -> np.ndarray:
    """``BranchingEnv._unrealised_pnl``: ``position * ((c - e) / e)`` with ``c = close[t]`` and
    ``e = entry_price`` (``c`` when ``position == 0``)."""
    c = close[t]
    entry = np.where(position != 0, entry_price, c)
    return (position * ((c - entry) / entry)).astype(F32)


def _observe(features, close, t, position, entry_price, time_in_position, state_dim):
    return state_features(features[t], position,
                          _unrealised_pnl(close, t, position, entry_price),
                          time_in_position.astype(F32), state_dim)


@ieee
def env_observe(features: np.ndarray, close: np.ndarray, t: np.ndarray, position: np.ndarray,
                entry_price: np.ndarray, time_in_position: np.ndarray,
                state_dim: int) -> np.ndarray:
    """States ``f32 [N, state_dim]`` of the envs: ``market.state_features(features[t],
    position, pnl, time_in_position, state_dim)``, ``pnl`` the unrealised PnL (module
    docstring). Exact but for the two ``tanh`` columns (CUDA ``tanhf`` against NumPy's)."""
    sd = validate_env_observe(features, close, t, position, entry_price, time_in_position,
                              state_dim)
    return _observe(features, close, t, position, entry_price, time_in_position, sd)


def _draw_starts(key: int, offset: int, n: int, lo: int, hi: int) -> np.ndarray:
    """``lo + min(floor(u_i * span), span - 1)``, ``span = hi - lo + 1``, ``u_i = uniform(key,
    episode_start, offset, i)`` for env ``i < n`` (float32 product, truncated)."""
    span = hi - lo + 1
    u = uniform(key, STREAMS["episode_start"], offset, np.arange(n, dtype=np.int64))
    k = (u * F32(span)).astype(np.int64)
    return (lo + np.minimum(k, span - 1)).astype(I32)


def env_reset(start: np.ndarray | None, n_envs: int, min_start: int, last_start: int,
              key: int, cycle: np.ndarray) -> EnvState:
    """Start every env flat: ``t = start[i]`` (``start`` int32 ``[N]`` in ``[0, last_start]``)
    or, with ``start=None``, a drawn offset in ``[min_start, last_start]``:
    ``min_start + min(floor(u * span), span - 1)``, ``span = last_start - min_start + 1``,
    ``u = rng.uniform(key, STREAMS["episode_start"], cycle[0], i)``. ``steps``,
    ``time_in_position``, ``position`` and ``entry_price`` are 0. Exact."""
    n, lo, hi, key, offset = validate_env_reset(start, n_envs, min_start, last_start, key, cycle)
    t = start.copy() if start is not None else _draw_starts(key, offset, n, lo, hi)
    zero_i, zero_f = np.zeros(n, I32), np.zeros(n, F32)
    return EnvState(t, zero_i, zero_i.copy(), zero_f, zero_f.copy())


def _branch_columns(actions: np.ndarray) -> list[np.ndarray]:
    """Exposure, order type and urgency columns (a missing branch: its default)."""
    n, nb = actions.shape
    return [actions[:, d].astype(I32) if d < nb else np.full(n, BRANCH_DEFAULTS[d], I32)
            for d in range(len(FULL_BRANCHES))]


@ieee
def env_step(close: np.ndarray, high: np.ndarray, low: np.ndarray, features: np.ndarray,
             regime: np.ndarray, t: np.ndarray, steps: np.ndarray, time_in_position: np.ndarray,
             position: np.ndarray, entry_price: np.ndarray, actions: np.ndarray,
             rec_reward: np.ndarray, rec_held: np.ndarray, rec_cost: np.ndarray,
             costs: np.ndarray, n_bars: int, min_start: int, last_start: int, episode_len: int,
             auto_reset: int, reward_scale, state_dim: int, key: int, cycle: np.ndarray) -> EnvStep:
    """One step of every env (module docstring; ``BranchingEnv.step`` in its float32 order).

    With ``P = close[t]``, next bar ``(H', L', C')`` at ``t + 1``, ``target = exposure - 1``,
    ``delta = target - position``, ``size = |delta|``, ``buy = delta > 0``,
    ``range_t = (high[t] - low[t]) / close[t]``, ``u_s`` = 1 (now) or
    ``patient_slippage_scale`` (patient)::

        limit fill   = buy ? L' < P : H' > P
        passive fill = buy ? L' < P (1 - half_spread) : H' > P (1 + half_spread)
        filled   = delta != 0 and (market or limit and limit fill or passive and passive fill)
        fallback = delta != 0 and not filled and urgency == now
        market unit   = (fee + half_spread) + (slippage_coef * u_s) * range_t
        fill unit     = market unit | fee (limit) | passive_fee (passive)
        fallback unit = (fee + half_spread) + slippage_coef * range_{t+1}
        cost = (filled ? size * fill unit : 0) + (fallback ? size * fallback unit : 0)
        held = filled ? target : position;  next_ret = (C' - P) / P
        reward = held * next_ret - cost;    r = reward * reward_scale
        position' = filled or fallback ? target : position
        entry'    = filled ? P : fallback ? C' : entry
        time'     = filled ? (target != 0) : fallback ? 0 : position != 0 ? time + 1 : 0

    then ``t + 1``, ``steps + 1``, ``done``, ``s2``, the record (``rec_*[steps, i] = reward,
    held, cost`` while ``steps < R``; other rows keep their values) and, for done envs under
    ``auto_reset``, the reset of :func:`env_reset` (drawn offset, this ``cycle``) and ``obs``.

    Shapes: tables ``[T]`` / ``[T, F]``; state ``[N]``; ``actions`` int32 ``[N, nb]``;
    ``rec_*`` ``[R, N]`` (R >= 0); ``costs`` float32 ``[5]`` (``COST_FIELDS``). Exact but for
    the ``tanh`` columns of ``s2`` / ``obs``.
    """
    n, _, record_len, scalars = validate_env_step(
        close, high, low, features, regime, t, steps, time_in_position, position, entry_price,
        actions, rec_reward, rec_held, rec_cost, costs, n_bars, min_start, last_start,
        episode_len, auto_reset, reward_scale, state_dim, key, cycle)
    lo, hi, ep_len, auto, scale, sd, key, offset = scalars
    fee, passive_fee, half_spread, slip, patient = (F32(c) for c in costs)
    one, zero = F32(1), F32(0)
    exposure, order, urgency = _branch_columns(actions)
    live = t < n_bars - 1
    t1 = np.where(live, t + 1, t)
    price, next_close, next_high, next_low = close[t], close[t1], high[t1], low[t1]

    target = (exposure - 1).astype(F32)
    delta = target - position
    size = np.abs(delta)
    trading = live & (delta != 0)
    buy = delta > 0
    is_market, is_limit, is_passive = order == ORDER_MARKET, order == ORDER_LIMIT, \
        order == ORDER_PASSIVE
    limit_fill = np.where(buy, next_low < price, next_high > price)
    passive_fill = np.where(buy, next_low < price * (one - half_spread),
                            next_high > price * (one + half_spread))
    filled = trading & (is_market | (is_limit & limit_fill) | (is_passive & passive_fill))
    fallback = trading & ~filled & (urgency == URGENCY_NOW)

    range_t = (high[t] - low[t]) / close[t]
    range_t1 = (next_high - next_low) / next_close
    urgency_scale = np.where(urgency == URGENCY_PATIENT, patient, one)
    market_unit = (fee + half_spread) + (slip * urgency_scale) * range_t
    fill_unit = np.where(is_market, market_unit, np.where(is_limit, fee, passive_fee))
    fallback_unit = (fee + half_spread) + slip * range_t1
    cost = (np.where(filled, size * fill_unit, zero)
            + np.where(fallback, size * fallback_unit, zero)).astype(F32)
    held = np.where(filled, target, position).astype(F32)
    next_ret = np.where(live, (next_close - price) / price, zero).astype(F32)
    reward = np.where(live, held * next_ret - cost, zero).astype(F32)

    new_position = np.where(filled | fallback, target, position).astype(F32)
    new_entry = np.where(filled, price, np.where(fallback, next_close, entry_price)).astype(F32)
    held_on = np.where(position != 0, time_in_position + 1, 0)
    new_time = np.where(filled, (target != 0).astype(I32),
                        np.where(fallback, 0, np.where(live, held_on, time_in_position)))
    new_time = new_time.astype(I32)
    new_t = t1.astype(I32)
    new_steps = np.where(live, steps + 1, steps).astype(I32)
    done = ~live | (new_t >= n_bars - 1) | ((ep_len > 0) & (new_steps >= ep_len))
    s2 = _observe(features, close, new_t, new_position, new_entry, new_time, sd)

    recs = [rec.copy() for rec in (rec_reward, rec_held, rec_cost)]
    rows = live & (steps < record_len)
    for rec, value in zip(recs, (reward, held, cost)):
        rec[steps[rows], np.flatnonzero(rows)] = value[rows]

    if auto:
        reset = done
        new_t = np.where(reset, _draw_starts(key, offset, n, lo, hi), new_t).astype(I32)
        new_steps = np.where(reset, 0, new_steps).astype(I32)
        new_time = np.where(reset, 0, new_time).astype(I32)
        new_position = np.where(reset, zero, new_position).astype(F32)
        new_entry = np.where(reset, zero, new_entry).astype(F32)
        obs = _observe(features, close, new_t, new_position, new_entry, new_time, sd)
    else:
        obs = s2.copy()
    return EnvStep(new_t, new_steps, new_time, new_position, new_entry,
                   (reward * scale).astype(F32), done.astype(F32), s2, obs, next_ret,
                   regime[t].astype(I32), *recs)


def env_act(q: np.ndarray, branches, eps, key: int, cycle: np.ndarray) -> np.ndarray:
    """Epsilon-greedy actions ``int32 [N, nb]`` from branch-packed expected Q.

    ``q`` float32 ``[N * A_total]``: branch d's ``[N, n_d]`` block at element ``N * off_d``
    (the fast forward's ``q_e``; :func:`pack_q`). Per env i and branch d: the greedy action is
    ``double_dqn_select`` of the row (argmax, lowest index on ties, NaN never wins, an all-NaN
    row gives 0) unless ``uniform(key, explore, cycle[0], 2 nb i + 2 d) < eps`` (float32),
    then it is ``min(floor(uniform(key, explore_action, cycle[0], nb i + d) * n_d), n_d - 1)``.
    ``eps`` is data: NaN or ``eps <= 0`` never explores, ``eps >= 1`` always does. Exact.
    """
    br, n, eps, key, offset = validate_env_act(q, branches, eps, key, cycle)
    nb = len(br)
    env = np.arange(n, dtype=np.int64)
    out = np.empty((n, nb), I32)
    for d, (n_d, off) in enumerate(zip(br, branch_offsets(br))):
        greedy = double_dqn_select(q[n * off:n * (off + n_d)].reshape(n, n_d))
        with np.errstate(invalid="ignore"):
            explore = uniform(key, STREAMS["explore"], offset, 2 * nb * env + 2 * d) < eps
        u = uniform(key, STREAMS["explore_action"], offset, nb * env + d)
        random = np.minimum((u * F32(n_d)).astype(np.int64), n_d - 1)
        out[:, d] = np.where(explore, random, greedy)
    return out


def pack_q(qs) -> np.ndarray:
    """Per-branch expected Q ``[N, n_d]`` (``Trainer.q_values``) as :func:`env_act`'s
    branch-packed ``float32 [N * A_total]``."""
    return np.concatenate([np.ascontiguousarray(q, dtype=F32).reshape(-1) for q in qs])


@ieee
def eval_metrics(rewards: np.ndarray, positions: np.ndarray, costs: np.ndarray,
                 bars_per_year) -> np.ndarray:
    """The segment metrics of a walk, float32 ``[len(EVAL_FIELDS)]`` in ``EVAL_FIELDS``
    (``metrics.METRIC_NAMES``) order: ``metrics.segment_metrics`` of the per-bar rewards
    (unscaled), positions held and costs (float32 ``[L]`` each, as the walk records them),
    computed in float64 and rounded to float32 once.

    NaN contract (the metrics functions raise; a kernel cannot): Sharpe, total return and max
    drawdown are NaN if any reward is non-finite; total return and max drawdown also if any
    reward is ``<= -1`` (equity wiped out); turnover is NaN if any position is non-finite,
    costs if any cost is. The kernel sums in another order (float64 block trees; the equity
    scan is sequential, as here): a float64 reduction.
    """
    per_year = validate_eval_metrics(rewards, positions, costs, bars_per_year)
    r, p, c = (x.astype(np.float64) for x in (rewards, positions, costs))
    nan = math.nan
    finite_r = bool(np.all(np.isfinite(r)))
    solvent = finite_r and bool(np.all(r > -1))
    values = {
        "sharpe": metrics.annualised_sharpe(r, per_year) if finite_r else nan,
        "total_return": metrics.total_return(r) if solvent else nan,
        "max_drawdown": metrics.max_drawdown(r) if solvent else nan,
        "turnover": metrics.turnover(p) if np.all(np.isfinite(p)) else nan,
        "costs": metrics.costs_paid(c) if np.all(np.isfinite(c)) else nan,
    }
    return np.array([values[name] for name in EVAL_FIELDS], dtype=F32)


KERNELS = {
    "env_reset": env_reset,
    "env_observe": env_observe,
    "env_step": env_step,
    "env_act": env_act,
    "eval_metrics": eval_metrics,
}

__all__ = [
    "BRANCH_DEFAULTS", "COST_FIELDS", "EVAL_FIELDS", "EnvState", "EnvStep", "FULL_BRANCHES",
    "KERNELS", "MAX_BARS", "MarketTables", "cost_table", "env_act", "env_observe",
    "env_reset", "env_step", "eval_metrics", "market_tables", "pack_q",
    "validate_env_act", "validate_env_observe", "validate_env_reset", "validate_env_step",
    "validate_eval_metrics",
]
