"""Entries of the environment kernels (``cuda_src/env.cu``, reference
``foxhunt.reference.kernels.env``): reset, observation, step, epsilon-greedy actions and the
segment metrics of a walk.

Sizes per shape case: ``batch`` envs (32 / 256 / 257, and 5 for the extremal cases), tables of
``items`` bars (515 / 100,003 / 66,563) and ``hidden`` state columns (32 / 256 / 259), of which
up to 32 are market features. Prices are a random walk whose bars trade through their
neighbours' closes both ways (limit and passive orders fill and miss); some envs start at their
last bar (frozen), next to it or at their episode's end (resets); actions cover every branch
value; the record arrays hold noise, so rows that must be kept are checked too.

Every output is exact (the kernels round where the reference does, in its order) except: the
two ``tanh`` columns of the states (CUDA ``tanhf``, 2 ulp, against NumPy's float32 ``tanh``,
measured within 1 ulp of the correctly rounded value: :data:`TANH_ULP`; the other columns are
copied or exact, compared bit for bit through the ``exact`` mask), and ``eval_metrics``, whose
sums run in float64 in another order (:data:`F64_REDUCTION`; its equity scan is sequential like
the reference's, so total return and drawdown match to the float32 rounding).
"""

from __future__ import annotations

import math

import numpy as np

from foxhunt.conformance.kernel_spec import Dims, Kwargs, SpecEntry
from foxhunt.conformance.specs.inputs import (
    F32,
    I32,
    error_cases,
    f32,
    i32,
    normal,
    reduction,
    replace,
    uniform,
    wrong_dtype,
)
from foxhunt.conformance.tolerance import EXACT, REDUCTION_RTOL, Tolerance
from foxhunt.reference.env import ExecutionCosts
from foxhunt.reference.kernels.env import EVAL_FIELDS, cost_table
from foxhunt.reference.market import N_POSITION_FEATURES

#: CUDA ``tanhf`` (2 ulp) against NumPy's float32 ``tanh`` (within 1 ulp of the correctly
#: rounded value on the SIMD paths measured; 1 more for other CPUs' dispatch).
TANH_ULP = Tolerance.ulp(4)
#: Metrics computed in float64 then rounded to float32 once: one float32 rounding apart
#: (``REDUCTION_RTOL`` covers it) plus the float64 sums' reordering, four float64 roundings per
#: term of the largest magnitude.
F64_REDUCTION = Tolerance.reduction(REDUCTION_RTOL, 4.0 * 2.0**-53)

#: Market features per state (at most), the episode length and the record rows of the samples.
MAX_FEATURES = 32
EPISODE_LEN = 50
RECORD_ROWS = 40
#: A key with both 32-bit words set.
KEY = (0x1234_5678 << 32) | 0x9ABC_DEF0
BARS_PER_YEAR = 252 * 23 * 60.0


def _n_features(d: Dims) -> int:
    return min(MAX_FEATURES, d.hidden - N_POSITION_FEATURES - 1)


def _cycle(rng) -> np.ndarray:
    return np.array([int(rng.integers(0, 2**40))], np.int64)


def _market(rng, n_bars: int, n_features: int) -> dict:
    """Random-walk bars (log returns of 0.2%) whose highs and lows reach past the neighbouring
    closes by about 0.1%, features ~ N(0, 1), regime labels in {0, 1, 2}."""
    close = 100.0 * np.exp(np.cumsum(rng.standard_normal(n_bars) * 2e-3))
    open_ = np.concatenate([[100.0], close[:-1]])
    high = np.maximum(open_, close) * np.exp(np.abs(rng.standard_normal(n_bars)) * 1e-3)
    low = np.minimum(open_, close) * np.exp(-np.abs(rng.standard_normal(n_bars)) * 1e-3)
    return {"close": close.astype(F32), "high": high.astype(F32), "low": low.astype(F32),
            "features": normal(rng, (n_bars, n_features)),
            "regime": rng.integers(0, 3, n_bars).astype(I32)}


def _env_state(rng, n: int, n_bars: int, close: np.ndarray) -> dict:
    """Envs anywhere in ``[0, n_bars)``, the first three at the last bar (frozen), the one
    before it and an episode's end; half in a position entered near the current close."""
    t = rng.integers(0, n_bars, n)
    t[:3] = (n_bars - 1, n_bars - 2, n_bars // 2)
    steps = rng.integers(0, EPISODE_LEN + 10, n)
    steps[2] = EPISODE_LEN - 1
    position = rng.choice(np.array([-1.0, 0.0, 1.0], F32), n)
    entry = np.where(position != 0, close[t] * (1 + rng.standard_normal(n) * 1e-3), 0.0)
    return {"t": t.astype(I32), "steps": steps.astype(I32),
            "time_in_position": np.where(position != 0, rng.integers(0, 100, n), 0).astype(I32),
            "position": position.astype(F32), "entry_price": entry.astype(F32)}


def _s_step(d: Dims, rng) -> Kwargs:
    n, n_bars = d.batch, d.items - 3  # the tables run past the walk's end
    nb = 2 if d.case == "tiny" else 3  # tiny: the tiny preset's (3, 2), defaults for urgency
    market = _market(rng, d.items, _n_features(d))
    actions = np.stack([rng.integers(0, (3, 3, 2)[k], n) for k in range(nb)], axis=1)
    rec = {name: normal(rng, (RECORD_ROWS, n)) for name in ("rec_reward", "rec_held", "rec_cost")}
    return {**market, **_env_state(rng, n, n_bars, market["close"]),
            "actions": actions.astype(I32), **rec, "costs": cost_table(ExecutionCosts()),
            "n_bars": n_bars, "min_start": 10, "last_start": n_bars - 1 - EPISODE_LEN,
            "episode_len": EPISODE_LEN, "auto_reset": int(d.case != "odd"),
            "reward_scale": 1000.0, "state_dim": d.hidden, "key": KEY, "cycle": _cycle(rng)}


def _s_observe(d: Dims, rng) -> Kwargs:
    market = _market(rng, d.items, _n_features(d))
    state = _env_state(rng, d.batch, d.items, market["close"])
    return {"features": market["features"], "close": market["close"], "t": state["t"],
            "position": state["position"], "entry_price": state["entry_price"],
            "time_in_position": state["time_in_position"], "state_dim": d.hidden}


def _s_reset(d: Dims, rng) -> Kwargs:
    """Drawn offsets, but explicit starts in ``odd``."""
    n, last = d.batch, d.items - 2
    start = rng.integers(0, last + 1, n).astype(I32) if d.case == "odd" else None
    return {"start": start, "n_envs": n, "min_start": 7, "last_start": last, "key": KEY,
            "cycle": _cycle(rng)}


def _branches(d: Dims) -> tuple[int, ...]:
    return (3, 2) if d.case == "tiny" else (3, 3, 2)


def _s_act(d: Dims, rng) -> Kwargs:
    """Q on a coarse grid (ties: the lowest index wins) and eps 0.3."""
    q = (np.round(rng.standard_normal(d.batch * sum(_branches(d))) * 2) / 2).astype(F32)
    return {"q": q, "branches": _branches(d), "eps": 0.3, "key": KEY, "cycle": _cycle(rng)}


def _s_metrics(d: Dims, rng) -> Kwargs:
    n = d.items
    return {"rewards": normal(rng, n, 1e-3),
            "positions": rng.choice(np.array([-1.0, 0.0, 1.0], F32), n),
            "costs": np.where(rng.random(n) < 0.3, uniform(rng, n, 0.0, 3e-4), 0).astype(F32),
            "bars_per_year": BARS_PER_YEAR}


# ------------------------------------------------------------------------------ scales
def _state_mask(kwargs: Kwargs, shape) -> np.ndarray:
    """True on the state columns compared bit for bit (all but the two tanh columns)."""
    f = kwargs["features"].shape[1]
    mask = np.ones(shape, bool)
    mask[:, f + 1:f + N_POSITION_FEATURES] = False
    return mask


def _sc_step(kwargs, expected):
    return {name: {"exact": _state_mask(kwargs, expected[name].shape)} for name in ("s2", "obs")}


def _sc_observe(kwargs, expected):
    return {"out": {"exact": _state_mask(kwargs, expected["out"].shape)}}


def _finite(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x[np.isfinite(x)]


def _sc_metrics(kwargs, expected):
    """Per output, the largest term: the Sharpe ratio's ``sqrt(bars_per_year) max|r| / std(r)``,
    the equity's largest value (total return, drawdown), ``max |p_k - p_k-1|``, ``max c``."""
    r, p, c = (_finite(kwargs[k]) for k in ("rewards", "positions", "costs"))
    big = lambda x: float(np.max(np.abs(x))) if x.size else 0.0  # noqa: E731
    std = float(np.std(r, ddof=1)) if r.size > 1 else 0.0
    sharpe = math.sqrt(kwargs["bars_per_year"]) * big(r) / std if std > 0 else 0.0
    with np.errstate(all="ignore"):
        equity = big(_finite(np.cumprod(1.0 + r))) if r.size else 1.0
    turn = big(np.diff(p, prepend=0.0)) if p.size else 0.0
    by_name = {"sharpe": sharpe, "total_return": max(equity, 1.0),
               "max_drawdown": max(equity, 1.0), "turnover": turn, "costs": big(c)}
    return {"out": reduction(kwargs["rewards"].size, np.array([by_name[k] for k in EVAL_FIELDS]))}


# ------------------------------------------------------------------------------ contracts
def _c_states(state_out: str, position_source: str, from_outputs: bool):
    """The position column holds the position bit for bit and the padding is +0.0."""
    def check(kwargs, outputs, poisoned):
        states = outputs[state_out]
        f = kwargs["features"].shape[1]
        position = (outputs if from_outputs else kwargs)[position_source]
        problems = []
        if not np.array_equal(states[:, f].view(np.uint32), position.view(np.uint32)):
            problems.append(f"{state_out}: the position column differs from {position_source!r}")
        pad = states[:, f + N_POSITION_FEATURES:]
        if pad.size and np.any(pad.view(np.uint32) != 0):
            problems.append(f"{state_out}: the padding columns are not all +0.0")
        return problems
    return check


def _c_step(kwargs, outputs, poisoned) -> list[str]:
    problems = _c_states("obs", "position", True)(kwargs, outputs, poisoned)
    done = outputs["done"]
    if not np.all((done == 0) | (done == 1)):
        problems.append("done: values other than 0 and 1")
    frozen = kwargs["t"] >= kwargs["n_bars"] - 1
    if not np.all(done[frozen] == 1) or np.any(outputs["r"][frozen] != 0):
        problems.append("an env at its last bar must give done = 1 and r = 0")
    return problems


def _c_act(kwargs, outputs, poisoned) -> list[str]:
    out = outputs["out"]
    limits = np.array(kwargs["branches"])
    if np.any(out < 0) or np.any(out >= limits[None, :]):
        return ["out: an action outside its branch's range"]
    return []


def _state_errors(sample):
    return error_cases(
        sample,
        lambda k: wrong_dtype(k, "position"),
        lambda k: replace(k, t=np.full_like(k["t"], k["close"].shape[0])),
        lambda k: replace(k, state_dim=k["features"].shape[1] + N_POSITION_FEATURES - 1),
    )


ENTRIES: tuple[SpecEntry, ...] = (
    SpecEntry(
        name="env_reset",
        outputs={"t": i32(EXACT), "steps": i32(EXACT), "time_in_position": i32(EXACT),
                 "position": f32(EXACT), "entry_price": f32(EXACT)},
        sample=_s_reset,
        targets=(),
        errors=error_cases(
            _s_reset,
            lambda k: replace(k, min_start=k["last_start"] + 1),
            lambda k: replace(k, cycle=np.array([-1], np.int64)),
            lambda k: replace(k, key=-1),
            lambda k: replace(k, start=np.full(k["n_envs"], k["last_start"] + 1, I32)),
        ),
    ),
    SpecEntry(
        name="env_observe",
        outputs={"out": f32(TANH_ULP)},
        sample=_s_observe,
        targets=("features", "close", "position", "entry_price"),
        errors=_state_errors(_s_observe),
        scales=_sc_observe,
        contract=_c_states("out", "position", False),
    ),
    SpecEntry(
        name="env_step",
        outputs={"t": i32(EXACT), "steps": i32(EXACT), "time_in_position": i32(EXACT),
                 "position": f32(EXACT), "entry_price": f32(EXACT), "r": f32(EXACT),
                 "done": f32(EXACT), "s2": f32(TANH_ULP), "obs": f32(TANH_ULP),
                 "next_ret": f32(EXACT), "regime": i32(EXACT), "rec_reward": f32(EXACT),
                 "rec_held": f32(EXACT), "rec_cost": f32(EXACT)},
        sample=_s_step,
        targets=("close", "high", "low", "features", "position", "entry_price", "costs"),
        errors=error_cases(
            _s_step,
            lambda k: wrong_dtype(k, "close"),
            lambda k: replace(k, t=np.full_like(k["t"], k["n_bars"])),
            lambda k: replace(k, actions=np.full_like(k["actions"], 3)),
            lambda k: replace(k, actions=k["actions"][:-1]),
            lambda k: replace(k, rec_held=k["rec_held"][:, :-1]),
            lambda k: replace(k, costs=k["costs"][:-1]),
            lambda k: replace(k, regime=None),
            lambda k: replace(k, n_bars=k["close"].shape[0] + 1),
        ),
        scales=_sc_step,
        contract=_c_step,
    ),
    SpecEntry(
        name="env_act",
        outputs={"out": i32(EXACT)},
        sample=_s_act,
        targets=("q", "eps"),
        errors=error_cases(
            _s_act,
            lambda k: replace(k, q=k["q"][:-1]),
            lambda k: wrong_dtype(k, "q"),
            lambda k: replace(k, branches=(3, 0)),
            lambda k: replace(k, cycle=np.array([-1], np.int64)),
        ),
        contract=_c_act,
    ),
    SpecEntry(
        name="eval_metrics",
        outputs={"out": f32(F64_REDUCTION)},
        sample=_s_metrics,
        targets=("rewards", "positions", "costs"),
        errors=error_cases(
            _s_metrics,
            lambda k: replace(k, costs=k["costs"][:-1]),
            lambda k: wrong_dtype(k, "rewards"),
            lambda k: replace(k, bars_per_year=0.0),
        ),
        scales=_sc_metrics,
    ),
)
