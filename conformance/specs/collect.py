"""Entries of the collection cycle's fused kernels (``cuda_src/collect.cu``, reference
``foxhunt.reference.kernels.collect``: each the composition of the kernels it fuses).

``collect_transition``: ``batch`` envs (at most 64) on the env entries' random-walk market
(``conformance.specs.env``: frozen envs, episode ends and resets, every branch value), n-step
windows of every fill with ``n_step = 3``, a ring of at most 2,048 rows with ``state_dim =
hidden`` whose cursor sits three rows before the end (the add wraps). Exact but for the states'
two ``tanh`` columns (``env.TANH_ULP``; the other columns bit for bit through the ``exact``
mask), in every state-valued output: ``obs``, ``s2``, the windows' and the ring's states.
``replay_batch``: the replay entries' ring (``conformance.specs.replay``) and the ring scan's
tiles of its priorities (``scan_tiles``); exact but for the weights (``importance_weights``'
tolerance).
"""

from __future__ import annotations

import numpy as np

from foxhunt.conformance.kernel_spec import Dims, Kwargs, SpecEntry
from foxhunt.conformance.specs.env import (
    EPISODE_LEN,
    KEY,
    TANH_ULP,
    _branches,
    _cycle,
    _env_state,
    _market,
    _n_features,
)
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
from foxhunt.conformance.specs.replay import _ring
from foxhunt.conformance.tolerance import EXACT, REDUCTION
from foxhunt.reference.env import ExecutionCosts
from foxhunt.reference.kernels.env import cost_table
from foxhunt.reference.kernels.replay import nstep_counts, scan_tiles
from foxhunt.reference.market import N_POSITION_FEATURES

N_STEP = 3
MAX_ENVS = 64
MAX_RING = 2048
#: The outputs holding state rows (their last axis the state's columns).
STATE_OUTPUTS = ("obs", "s2", "win_s", "ring_s", "ring_s2")
INT_OUTPUTS = ("t", "steps", "time_in_position", "actions", "regime_out", "win_a", "win_regime",
               "win_len", "ring_a", "ring_regime", "ring_pos")


def _s_transition(d: Dims, rng) -> Kwargs:
    n, n_bars, sd = min(d.batch, MAX_ENVS), d.items - 3, d.hidden
    br = _branches(d)
    nb = len(br)
    market = _market(rng, d.items, _n_features(d))
    cap = max(n * N_STEP, min(d.items, MAX_RING))
    size = int(rng.integers(0, cap + 1))
    prio = np.zeros(cap, F32)
    prio[:size] = uniform(rng, size, 0.05, 2.0)
    q = (np.round(rng.standard_normal(n * sum(br)) * 2) / 2).astype(F32)  # ties included
    return {"q": q, "branches": br, "eps": 0.3, "key": KEY, "cycle": _cycle(rng), **market,
            **_env_state(rng, n, n_bars, market["close"]), "costs": cost_table(ExecutionCosts()),
            "n_bars": n_bars, "min_start": 10, "last_start": n_bars - 1 - EPISODE_LEN,
            "episode_len": EPISODE_LEN, "reward_scale": 1000.0, "state_dim": sd,
            "obs": normal(rng, (n, sd)), "win_s": normal(rng, (n, N_STEP, sd)),
            "win_a": np.stack([rng.integers(0, br[k], (n, N_STEP)) for k in range(nb)],
                              axis=2).astype(I32),
            "win_r": normal(rng, (n, N_STEP)), "win_next_ret": normal(rng, (n, N_STEP), 0.01),
            "win_regime": rng.integers(0, 3, (n, N_STEP)).astype(I32),
            "win_len": rng.integers(0, N_STEP, n).astype(I32), "n_step": N_STEP,
            "gamma_ref": 0.97, "ring_s": normal(rng, (cap, sd)),
            "ring_a": rng.integers(0, 2, (cap, nb)).astype(I32), "ring_r": normal(rng, cap),
            "ring_s2": normal(rng, (cap, sd)), "ring_done": (rng.random(cap) < 0.1).astype(F32),
            "ring_next_ret": normal(rng, cap, 0.01),
            "ring_regime": rng.integers(0, 3, cap).astype(I32),
            "ring_discount": uniform(rng, cap, 0.9, 1.0), "priority": prio,
            "ring_pos": np.array([cap - 3, size], I32), "max_priority": np.array([2.5], F32)}


def _state_exact(kwargs: Kwargs, shape) -> np.ndarray:
    """True on the state columns compared bit for bit (all but the two tanh columns)."""
    f = kwargs["features"].shape[1]
    mask = np.ones(shape, bool)
    mask[..., f + 1:f + N_POSITION_FEATURES] = False
    return mask


def _sc_transition(kwargs, expected):
    return {name: {"exact": _state_exact(kwargs, expected[name].shape)} for name in STATE_OUTPUTS}


def _c_transition(kwargs, outputs, poisoned) -> list[str]:
    """The ring grows by the transitions the windows emit (``nstep_counts`` of the step's
    ``done``), and every new row carries ``max_priority``."""
    cap = kwargs["priority"].size
    cursor, size = (int(v) for v in kwargs["ring_pos"])
    m = int(nstep_counts(kwargs["win_len"], outputs["done"], kwargs["n_step"]).sum())
    problems = []
    if outputs["ring_pos"].tolist() != [(cursor + m) % cap, min(size + m, cap)]:
        problems.append(f"ring_pos: {outputs['ring_pos'].tolist()} after {m} transitions from "
                        f"({cursor}, {size})")
    rows = (cursor + np.arange(m)) % cap
    if not np.array_equal(outputs["priority"][rows].view(np.uint32),
                          np.full(m, kwargs["max_priority"][0], F32).view(np.uint32)):
        problems.append("priority: a new row without max_priority")
    return problems


def _s_batch(d: Dims, rng) -> Kwargs:
    ring = _ring(d, rng)
    tiles = scan_tiles(ring["priority"])
    return {"s": tiles.s, "block_sums": tiles.block_sums, "ring_pos": ring.pop("ring_pos"),
            "key": KEY, "cycle": _cycle(rng), "n": d.batch, "priority": ring.pop("priority"),
            "beta": 0.4, **ring}


def _sc_batch(kwargs, expected):
    return {"w": reduction(1, 1.0)}  # one division and one powf per weight, weights in (0, 1]


ENTRIES: tuple[SpecEntry, ...] = (
    SpecEntry(
        name="collect_transition",
        outputs={name: (i32 if name in INT_OUTPUTS else f32)(
                     TANH_ULP if name in STATE_OUTPUTS else EXACT)
                 for name in ("t", "steps", "time_in_position", "position", "entry_price", "obs",
                              "actions", "r", "done", "s2", "next_ret", "regime_out", "win_s",
                              "win_a", "win_r", "win_next_ret", "win_regime", "win_len", "ring_s",
                              "ring_a", "ring_r", "ring_s2", "ring_done", "ring_next_ret",
                              "ring_regime", "ring_discount", "priority", "ring_pos")},
        sample=_s_transition,
        targets=("q", "close", "features", "obs", "win_r", "max_priority"),
        errors=error_cases(
            _s_transition,
            lambda k: wrong_dtype(k, "q"),
            lambda k: replace(k, t=np.full_like(k["t"], k["n_bars"])),
            lambda k: replace(k, win_len=np.full_like(k["win_len"], k["n_step"])),
            lambda k: replace(k, obs=k["obs"][:-1]),
            lambda k: replace(k, ring_pos=np.array([k["priority"].size, 0], I32)),
            lambda k: replace(k, gamma_ref=1.5),
        ),
        scales=_sc_transition,
        contract=_c_transition,
    ),
    SpecEntry(
        name="replay_batch",
        outputs={"idx": i32(EXACT), "w": f32(REDUCTION), "x": f32(EXACT), "a": i32(EXACT),
                 "r": f32(EXACT), "done": f32(EXACT), "next_ret": f32(EXACT),
                 "regime": i32(EXACT), "discount": f32(EXACT)},
        sample=_s_batch,
        targets=("priority", "ring_s", "ring_r"),
        errors=error_cases(
            _s_batch,
            lambda k: replace(k, ring_pos=np.array([0, k["s"].size + 1], I32)),
            lambda k: replace(k, block_sums=k["block_sums"][:-1]),
            lambda k: replace(k, priority=k["priority"][:-1]),
            lambda k: replace(k, beta=1.5),
            lambda k: wrong_dtype(k, "ring_s"),
        ),
        scales=_sc_batch,
    ),
)
