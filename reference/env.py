"""Vectorised branching-action trading environment over :class:`~foxhunt.reference.market.Bars`.

``BranchingEnv`` runs ``n_envs`` independent walks over one bar series (each from its own
start offset), one bar per step, with the branching actions of SPEC section 10:

* branch 0, exposure: ``{0: short (-1), 1: flat (0), 2: long (+1)}`` -- the target position;
* branch 1, order type: ``{0: market, 1: limit, 2: passive}``;
* branch 2, urgency: ``{0: now, 1: patient}``.

Branch configurations: ``branches`` has 1 to 3 entries, in the order above; exposure
must have 3 actions, order type 1-3 and urgency 1-2. A branch with ``n`` actions uses the
first ``n`` choices above (so the ``tiny`` preset's ``(3, 2)`` is exposure x {market,
limit}); a missing branch takes its default (market order, urgency now).

Execution model (deterministic; all prices and fractions float32). At step t the agent has
seen bar t (its state is built from bar t's features) and chooses a target ``e``; with
``delta = e - position``, ``side = sign(delta)``, ``P = close_t``, next bar ``(H', L', C')``:

* ``delta == 0``: nothing trades, cost 0, whatever the order type and urgency.
* **market** -- always fills at bar t's close. Cost per unit traded:
  ``fee + half_spread + slippage_coef * s_u * (high_t - low_t) / close_t`` where
  ``s_now = 1`` and ``s_patient = patient_slippage_scale`` (for market orders "patient" is
  simply cheaper: the timing risk of working an order is not modelled; urgency matters
  for limit/passive orders through the no-fill rule below).
* **limit** -- a limit order at the mid ``P``; fills iff the next bar trades *through* it:
  buy iff ``L' < P``, sell iff ``H' > P`` (touching is not enough: no queue priority).
  Cost per unit if filled: ``fee``.
* **passive** -- rests on its own side of the book at ``P * (1 - side * half_spread)``;
  fills iff the next bar trades through that price: buy iff ``L' < P (1 - half_spread)``,
  sell iff ``H' > P (1 + half_spread)``. Cost per unit if filled: ``passive_fee``
  (<= ``fee``): the cheapest, and the least likely to fill.
* A limit/passive order that does not fill: with urgency **now** it is completed by a
  market order at the next bar's close (cost ``fee + half_spread + slippage_coef *
  (H' - L') / C'`` per unit; the position changes only after bar t+1, so it earns
  nothing during bar t+1); with urgency **patient** it is cancelled (position unchanged,
  cost 0).
* A filled limit/passive order is booked at the close ``P`` (like a market order): the
  price improvement of a resting order is not credited, so costs are never negative and no
  round trip can profit from costs alone (the synthetic high/low are not adversely selected).

Reward (float32): ``reward_t = held_t * (C' - P) / P - cost_t`` where ``held_t`` is the
position held during bar t+1 (the target if the order filled at t, else the old position)
and ``cost_t = |delta| * per-unit cost`` of the route that executed (a short -> long flip
pays twice a flat -> long entry).

Position bookkeeping for the state: the entry price is ``P`` for a fill at t and ``C'``
for a fallback market order; ``time_in_position`` counts bars held (1 after the first bar
of a new position, 0 when flat or just filled by a fallback); unrealised PnL is
``position * (close - entry) / entry``.

Episodes: an env is done after the step that reaches the last bar (no next return exists)
or after ``episode_len`` steps. Done envs are re-started at random offsets when
``auto_reset`` is on (the next states returned by ``step`` are still the terminal ones,
for replay; ``observe()`` gives the post-reset states). Positions are not force-closed at
the end of an episode.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from foxhunt.reference.market import (
    DEFAULT_WINDOWS,
    N_POSITION_FEATURES,
    Bars,
    feature_warmup,
    market_features,
    regime_labels,
    state_features,
)
# The Sharpe and equity helpers live in ``metrics`` (one definition); re-exported here.
from foxhunt.reference.metrics import (
    DEFAULT_BARS_PER_YEAR,
    annualised_sharpe,
    bars_per_year,
    equity_curve,
)

__all__ = [
    "EXPOSURE_VALUES",
    "ORDER_MARKET",
    "ORDER_LIMIT",
    "ORDER_PASSIVE",
    "URGENCY_NOW",
    "URGENCY_PATIENT",
    "FULL_BRANCHES",
    "ExecutionCosts",
    "BranchingEnv",
    "rollout",
    "equity_curve",
    "annualised_sharpe",
    "bars_per_year",
    "DEFAULT_BARS_PER_YEAR",
]

EXPOSURE_VALUES = np.array([-1.0, 0.0, 1.0], dtype=np.float32)  # short, flat, long
EXPOSURE_FLAT_ACTION = 1
ORDER_MARKET, ORDER_LIMIT, ORDER_PASSIVE = 0, 1, 2
URGENCY_NOW, URGENCY_PATIENT = 0, 1
FULL_BRANCHES = (3, 3, 2)  # exposure, order type, urgency
_BRANCH_DEFAULTS = (EXPOSURE_FLAT_ACTION, ORDER_MARKET, URGENCY_NOW)
_BRANCH_NAMES = ("exposure", "order type", "urgency")

# Route codes reported in info["route"].
ROUTE_NONE, ROUTE_MARKET, ROUTE_LIMIT, ROUTE_PASSIVE, ROUTE_FALLBACK = 0, 1, 2, 3, 4



@dataclass(frozen=True)
class ExecutionCosts:
    """Cost model, every value a fraction of notional per unit of position traded.

    ``fee`` (1 bp): commission on market and limit fills; ``passive_fee`` (0.5 bp, must be
    <= ``fee``): commission on passive fills; ``half_spread`` (1 bp): paid by market orders,
    and the distance of a passive order from the mid; ``slippage_coef`` (0.1): market-order
    slippage as a fraction of the bar's relative range ``(high - low) / close``;
    ``patient_slippage_scale`` (0.5, in [0, 1]): slippage multiplier for urgency "patient".
    """

    fee: float = 1e-4
    passive_fee: float = 5e-5
    half_spread: float = 1e-4
    slippage_coef: float = 0.1
    patient_slippage_scale: float = 0.5

    def __post_init__(self) -> None:
        for name in (
            "fee",
            "passive_fee",
            "half_spread",
            "slippage_coef",
            "patient_slippage_scale",
        ):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(
                    f"ExecutionCosts.{name}: {value!r} is not allowed; need a finite value >= 0"
                )
        if self.passive_fee > self.fee:
            raise ValueError(
                f"ExecutionCosts.passive_fee: {self.passive_fee!r} is not allowed; "
                f"must be <= fee ({self.fee!r})"
            )
        if self.patient_slippage_scale > 1:
            raise ValueError(
                f"ExecutionCosts.patient_slippage_scale: {self.patient_slippage_scale!r} is not "
                "allowed; must be in [0, 1]"
            )


def _check_branches(branches) -> tuple[int, ...]:
    try:
        br = tuple(int(b) for b in branches)
    except TypeError:
        raise ValueError(
            f"branches: {branches!r} is not allowed; need a tuple like (3, 3, 2)"
        ) from None
    ok = 1 <= len(br) <= len(FULL_BRANCHES) and br[0] == FULL_BRANCHES[0]
    ok = ok and all(1 <= b <= full for b, full in zip(br[1:], FULL_BRANCHES[1:], strict=False))
    if not ok:
        raise ValueError(
            f"branches: {branches!r} is not allowed; need exposure = 3 actions, then optionally "
            f"order type (1-3 actions) and urgency (1-2 actions), e.g. (3, 3, 2) or (3, 2)"
        )
    return br


class BranchingEnv:
    """Vectorised trading environment with branching actions (see the module docstring).

    Args:
        bars: the bar series (needs at least 2 bars).
        features: ``f32[len(bars), F]`` market features (row t built from bars <= t), or
            ``None`` to compute ``market_features(bars, windows)``.
        state_dim: state width; states are ``state_features(features[t], position,
            unrealised_pnl, time_in_position, state_dim)``.
        n_envs: number of parallel walks.
        branches: actions per branch, ``(3, 3, 2)`` or a shorter configuration such as ``(3, 2)``.
        costs: the :class:`ExecutionCosts`.
        episode_len: steps per episode, or ``None`` (run to the last bar).
        windows: feature windows (used for ``features=None`` and the default ``min_start``).
        min_start: smallest start offset drawn by random resets (default: the feature
            warm-up, capped so that at least one step fits).
        seed: seed of the env's own generator (random start offsets only).
        auto_reset: restart done envs at random offsets inside ``step``.

    Methods: ``reset(start_idx=None, mask=None) -> f32[n_envs, state_dim]``,
    ``step(actions int[n_envs, n_branches]) -> (next_states f32[n_envs, state_dim],
    rewards f32[n_envs], dones bool[n_envs], info dict)``, ``observe()``.

    ``info`` holds per-env arrays: ``ret`` (next-bar return), ``cost``, ``held`` (position
    during the bar), ``position`` (after the step), ``route`` (0 none, 1 market, 2 limit,
    3 passive, 4 fallback market), ``filled`` (an order executed at t), ``t`` (bar index
    of next_states), ``regime`` (int8, regime label of bar t: the synthetic market's regime
    path, or for bars without labels (a user's CSV) ``market.causal_regime_labels``, the
    causal rule of the README). ``ret`` and ``regime`` are the auxiliary heads' labels
    (``Batch.next_ret``, ``Batch.regime``).
    """

    def __init__(
        self,
        bars: Bars,
        features: np.ndarray | None = None,
        *,
        state_dim: int = 128,
        n_envs: int = 1,
        branches=FULL_BRANCHES,
        costs: ExecutionCosts = ExecutionCosts(),
        episode_len: int | None = None,
        windows=DEFAULT_WINDOWS,
        min_start: int | None = None,
        seed: int = 0,
        auto_reset: bool = True,
    ) -> None:
        if not isinstance(bars, Bars):
            raise ValueError(f"bars: {type(bars).__name__} is not allowed; need a Bars instance")
        n = len(bars)
        if n < 2:
            raise ValueError(f"bars: {n} bars is not allowed; need at least 2")
        if features is None:
            features = market_features(bars, windows)
        features = np.asarray(features)
        if features.dtype != np.float32 or features.ndim != 2 or features.shape[0] != n:
            raise ValueError(
                f"features: {features.dtype} array of shape {features.shape} is not allowed; "
                f"need float32 [{n}, F]"
            )
        if not np.all(np.isfinite(features)):
            bad = int(np.argwhere(~np.isfinite(features))[0, 0])
            raise ValueError(f"features: non-finite value in row {bad}; features must be finite")
        if state_dim < features.shape[1] + N_POSITION_FEATURES:
            raise ValueError(
                f"state_dim: {state_dim!r} is not allowed; need >= "
                f"{features.shape[1] + N_POSITION_FEATURES} ({features.shape[1]} market "
                f"features + {N_POSITION_FEATURES} position features)"
            )
        if isinstance(n_envs, bool) or not isinstance(n_envs, (int, np.integer)) or n_envs < 1:
            raise ValueError(f"n_envs: {n_envs!r} is not allowed; need an integer >= 1")
        if not isinstance(costs, ExecutionCosts):
            raise ValueError(f"costs: {type(costs).__name__} is not allowed; need ExecutionCosts")
        if episode_len is not None and (
            isinstance(episode_len, bool) or episode_len < 1 or episode_len > n - 1
        ):
            raise ValueError(
                f"episode_len: {episode_len!r} is not allowed; "
                f"need None or 1 <= episode_len <= {n - 1}"
            )
        last_start = n - 2 if episode_len is None else n - 1 - episode_len
        if min_start is None:
            min_start = min(feature_warmup(windows), last_start)
        if not 0 <= min_start <= last_start:
            raise ValueError(
                f"min_start: {min_start!r} is not allowed; need 0 <= min_start <= {last_start}"
            )

        self.bars = bars
        self.features = features
        self.state_dim = int(state_dim)
        self.n_envs = int(n_envs)
        self.branches = _check_branches(branches)
        self.costs = costs
        self.episode_len = episode_len
        self.min_start = int(min_start)
        self.last_start = int(last_start)
        self.auto_reset = bool(auto_reset)
        self._rng = np.random.default_rng(seed)
        self._n_bars = n
        self._range = ((bars.high - bars.low) / bars.close).astype(np.float32)
        self.regime = regime_labels(bars)  # int8[n]: the auxiliary regime head's labels
        f32 = np.float32
        self._fee = f32(costs.fee)
        self._passive_fee = f32(costs.passive_fee)
        self._half_spread = f32(costs.half_spread)
        self._slip = f32(costs.slippage_coef)
        self._urgency_scale = np.array([1.0, costs.patient_slippage_scale], dtype=np.float32)
        # Per-env state.
        self.t = np.zeros(self.n_envs, dtype=np.int64)
        self.position = np.zeros(self.n_envs, dtype=np.float32)
        self.entry_price = np.zeros(self.n_envs, dtype=np.float32)
        self.time_in_position = np.zeros(self.n_envs, dtype=np.int64)
        self.steps = np.zeros(self.n_envs, dtype=np.int64)
        self._started = False

    # -- state ---------------------------------------------------------------------------

    @property
    def n_branches(self) -> int:
        return len(self.branches)

    def _unrealised_pnl(self) -> np.ndarray:
        close = self.bars.close[self.t]
        entry = np.where(self.position != 0, self.entry_price, close)
        return (self.position * ((close - entry) / entry)).astype(np.float32)

    def observe(self) -> np.ndarray:
        """Current states ``f32[n_envs, state_dim]`` (after any auto-reset)."""
        if not self._started:
            raise RuntimeError("BranchingEnv: call reset() before observe() or step()")
        return state_features(
            self.features[self.t],
            self.position,
            self._unrealised_pnl(),
            self.time_in_position.astype(np.float32),
            self.state_dim,
        )

    def reset(self, start_idx=None, mask=None) -> np.ndarray:
        """Start (some) envs flat at bar ``start_idx`` and return all current states.

        ``start_idx``: ``None`` (uniform random offsets in ``[min_start, last_start]``), an
        int (all envs) or ``int[n_envs]``; each must be in ``[0, last_start]``.
        ``mask``: ``bool[n_envs]`` selecting the envs to reset (default all).
        """
        if mask is None:
            mask = np.ones(self.n_envs, dtype=bool)
        mask = np.asarray(mask)
        if mask.shape != (self.n_envs,) or mask.dtype != bool:
            raise ValueError(
                f"mask: {mask.dtype} array of shape {mask.shape} is not allowed; "
                f"need bool[{self.n_envs}]"
            )
        if not self._started and not mask.all():
            raise ValueError("mask: the first reset() must reset every env")
        if start_idx is None:
            start = self._rng.integers(self.min_start, self.last_start + 1, size=self.n_envs)
        else:
            start = np.asarray(start_idx)
            if start.dtype.kind not in "iu" or start.ndim > 1:
                raise ValueError(
                    f"start_idx: {start_idx!r} is not allowed; need an int or int[{self.n_envs}]"
                )
            try:
                start = np.broadcast_to(start, (self.n_envs,))
            except ValueError:
                raise ValueError(
                    f"start_idx: shape {start.shape} is not allowed; "
                    f"need a scalar or ({self.n_envs},)"
                ) from None
            bad = mask & ((start < 0) | (start > self.last_start))
            if bad.any():
                i = int(np.argmax(bad))
                raise ValueError(
                    f"start_idx: {int(start[i])} (env {i}) is not allowed; "
                    f"need 0 <= start <= {self.last_start}"
                )
        self.t = np.where(mask, start, self.t).astype(np.int64)
        self.position = np.where(mask, np.float32(0), self.position).astype(np.float32)
        self.entry_price = np.where(mask, np.float32(0), self.entry_price).astype(np.float32)
        self.time_in_position = np.where(mask, 0, self.time_in_position).astype(np.int64)
        self.steps = np.where(mask, 0, self.steps).astype(np.int64)
        self._started = True
        return self.observe()

    # -- resume --------------------------------------------------------------------------

    #: The per-env arrays ``state()`` saves, with their dtypes.
    STATE_ARRAYS = {"t": np.int64, "position": np.float32, "entry_price": np.float32,
                    "time_in_position": np.int64, "steps": np.int64}

    def state(self) -> dict:
        """Everything that moves as the env steps: the per-env arrays (``STATE_ARRAYS``,
        copies), ``started`` and ``rng`` (the generator's ``bit_generator.state``, a
        JSON-ready dict). ``load_state(state())`` on an env built with the same arguments
        continues bitwise where this one stands."""
        out = {name: getattr(self, name).copy() for name in self.STATE_ARRAYS}
        out["started"] = bool(self._started)
        out["rng"] = self._rng.bit_generator.state
        return out

    def load_state(self, state: dict) -> None:
        """Restore ``state()``; raises ``ValueError`` naming an array of the wrong shape."""
        for name, dtype in self.STATE_ARRAYS.items():
            arr = np.asarray(state[name])
            if arr.shape != (self.n_envs,):
                raise ValueError(f"env state {name}: shape {arr.shape} is not allowed; "
                                 f"need ({self.n_envs},)")
            setattr(self, name, arr.astype(dtype, copy=True))
        self._started = bool(state["started"])
        self._rng.bit_generator.state = state["rng"]

    # -- dynamics ------------------------------------------------------------------------

    def _split_actions(self, actions) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        a = np.asarray(actions)
        if a.dtype.kind not in "iu" or a.shape != (self.n_envs, self.n_branches):
            raise ValueError(
                f"actions: {a.dtype} array of shape {a.shape} is not allowed; need integer "
                f"[{self.n_envs}, {self.n_branches}] (branches {self.branches})"
            )
        a = a.astype(np.int64)
        bad = (a < 0) | (a >= np.asarray(self.branches, dtype=np.int64))
        if bad.any():  # the first branch with a bad action, and its first env
            d = int(np.argmax(bad.any(axis=0)))
            i = int(np.argmax(bad[:, d]))
            raise ValueError(
                f"actions: {_BRANCH_NAMES[d]} action {int(a[i, d])} (env {i}) is not "
                f"allowed; need 0 <= a < {self.branches[d]}"
            )
        cols = [a[:, d] if d < self.n_branches
                else np.full(self.n_envs, _BRANCH_DEFAULTS[d], dtype=np.int64)
                for d in range(len(FULL_BRANCHES))]
        return cols[0], cols[1], cols[2]

    def step(self, actions):
        """Advance every env one bar; see the module docstring for fills, costs and reward."""
        if not self._started:
            raise RuntimeError("BranchingEnv: call reset() before observe() or step()")
        exposure, order, urgency = self._split_actions(actions)
        at_end = self.t >= self._n_bars - 1
        if at_end.any():
            i = int(np.argmax(at_end))
            raise RuntimeError(
                f"BranchingEnv: env {i} is at the last bar (done); reset it before stepping"
            )
        one = np.float32(1)
        bars = self.bars
        t = self.t
        t1 = t + 1
        price = bars.close[t]
        next_close = bars.close[t1]
        next_high = bars.high[t1]
        next_low = bars.low[t1]

        target = EXPOSURE_VALUES[exposure]
        delta = (target - self.position).astype(np.float32)
        size = np.abs(delta)
        trading = delta != 0
        buy = delta > 0
        is_market = order == ORDER_MARKET
        is_limit = order == ORDER_LIMIT
        is_passive = order == ORDER_PASSIVE
        limit_fill = np.where(buy, next_low < price, next_high > price)
        buy_level = price * (one - self._half_spread)
        sell_level = price * (one + self._half_spread)
        passive_fill = np.where(buy, next_low < buy_level, next_high > sell_level)
        filled = trading & (is_market | (is_limit & limit_fill) | (is_passive & passive_fill))
        fallback = trading & ~filled & (urgency == URGENCY_NOW)

        market_unit = (
            self._fee
            + self._half_spread
            + self._slip * self._urgency_scale[urgency] * self._range[t]
        )
        fill_unit = np.where(
            is_market, market_unit, np.where(is_limit, self._fee, self._passive_fee)
        )
        fallback_unit = self._fee + self._half_spread + self._slip * self._range[t1]
        zero = np.float32(0)
        cost = (
            np.where(filled, size * fill_unit, zero)
            + np.where(fallback, size * fallback_unit, zero)
        ).astype(np.float32)
        held = np.where(filled, target, self.position).astype(np.float32)
        # (C' - P) / P: for bars within a factor 2 the f32 difference is exact (Sterbenz),
        # so only the division rounds (relative error 2^-24 of the return itself).
        ret = ((next_close - price) / price).astype(np.float32)
        reward = (held * ret - cost).astype(np.float32)

        route = np.zeros(self.n_envs, dtype=np.int8)
        route[filled & is_market] = ROUTE_MARKET
        route[filled & is_limit] = ROUTE_LIMIT
        route[filled & is_passive] = ROUTE_PASSIVE
        route[fallback] = ROUTE_FALLBACK

        new_position = np.where(filled | fallback, target, self.position).astype(np.float32)
        self.entry_price = np.where(
            filled, price, np.where(fallback, next_close, self.entry_price)
        ).astype(np.float32)
        self.time_in_position = np.where(
            filled,
            (target != 0).astype(np.int64),
            np.where(fallback, 0, np.where(self.position != 0, self.time_in_position + 1, 0)),
        ).astype(np.int64)
        self.position = new_position
        self.t = t1
        self.steps = self.steps + 1
        done = self.t >= self._n_bars - 1
        if self.episode_len is not None:
            done |= self.steps >= self.episode_len
        next_states = self.observe()
        regime = self.regime[t]
        info = {
            "ret": ret,
            "cost": cost,
            "held": held,
            "position": new_position.copy(),
            "route": route,
            "filled": filled,
            "t": self.t.copy(),
            "regime": regime,
        }
        if self.auto_reset and done.any():
            self.reset(None, mask=done)
        return next_states, reward, done, info


def rollout(
    env: BranchingEnv,
    act: Callable[[np.ndarray], np.ndarray],
    n_steps: int,
    start_idx=None,
) -> dict[str, np.ndarray]:
    """Reset ``env`` at ``start_idx`` and run ``act(states) -> int[n_envs, n_branches]`` for
    ``n_steps`` steps. Returns ``{"rewards", "costs", "positions": f32[n_steps, n_envs],
    "dones": bool[n_steps, n_envs]}`` (envs that finish restart if ``env.auto_reset``)."""
    if n_steps < 1:
        raise ValueError(f"n_steps: {n_steps!r} is not allowed; need >= 1")
    states = env.reset(start_idx)
    out = {
        "rewards": np.zeros((n_steps, env.n_envs), dtype=np.float32),
        "costs": np.zeros((n_steps, env.n_envs), dtype=np.float32),
        "positions": np.zeros((n_steps, env.n_envs), dtype=np.float32),
        "dones": np.zeros((n_steps, env.n_envs), dtype=bool),
    }
    for i in range(n_steps):
        next_states, reward, done, info = env.step(act(states))
        out["rewards"][i] = reward
        out["costs"][i] = info["cost"]
        out["positions"][i] = info["held"]
        out["dones"][i] = done
        if done.any() and not env.auto_reset:
            for key in out:
                out[key] = out[key][: i + 1]
            break
        # step's next states are the current ones unless an env restarted (auto-reset)
        states = env.observe() if done.any() else next_states
    return out
