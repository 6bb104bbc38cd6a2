"""The greedy walk over a segment in the device loop's order, on the environment kernels' twins
(``reference/kernels/env.py``): the blueprint of the fast path's evaluation (a captured loop of
the network's forward, ``env_act`` with eps 0 and ``env_step`` on one env, or one fused kernel
calling ``cuda_src/env.cuh``), and its reference. Not a kernel (no ``KERNELS`` here).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np

from foxhunt.reference.env import ExecutionCosts
from foxhunt.reference.kernels.env import (
    EnvState,
    MarketTables,
    cost_table,
    env_act,
    env_observe,
    env_reset,
    env_step,
    pack_q,
)

F32, I32 = np.float32, np.int32


class Walk(NamedTuple):
    """A walk's record: per-bar ``rewards`` (unscaled), ``positions`` held and ``costs``,
    float32 ``[stop - start - 1]`` each."""

    rewards: np.ndarray
    positions: np.ndarray
    costs: np.ndarray


def greedy_walk(q_values: Callable[[np.ndarray], list], tables: MarketTables,
                costs: ExecutionCosts, branches, state_dim: int, start: int, stop: int) -> Walk:
    """The greedy policy of ``q_values`` (``Trainer.q_values``) over bars ``[start, stop)`` in
    the kernels' loop: ``env_reset`` at ``start`` and ``env_observe``, then per bar
    ``q_values`` / ``env_act(eps=0)`` / ``env_step`` (one env, no auto-reset, recording bar k
    at row k; its ``obs`` is the next bar's input). The twin of ``loop.evaluate`` for the
    greedy policy (``tests/test_env_twin.py``); ``eval_metrics`` of the record gives
    ``loop.evaluate_segment``'s metrics."""
    n_steps = stop - start - 1
    cost_arr = cost_table(costs)
    no_cycle = np.zeros(1, np.int64)  # no draws: eps = 0 and no auto-reset
    state = env_reset(np.array([start], I32), 1, 0, stop - 2, 0, no_cycle)
    rec = [np.zeros((n_steps, 1), F32) for _ in range(3)]
    obs = env_observe(tables.features, tables.close, state.t, state.position,
                      state.entry_price, state.time_in_position, state_dim)
    for _ in range(n_steps):
        actions = env_act(pack_q(q_values(obs)), branches, 0.0, 0, no_cycle)
        out = env_step(*tables, *state, actions, *rec, cost_arr, n_bars=stop, min_start=0,
                       last_start=stop - 2, episode_len=0, auto_reset=0, reward_scale=1.0,
                       state_dim=state_dim, key=0, cycle=no_cycle)
        state, obs, rec = EnvState(*out[:5]), out.obs, [out.rec_reward, out.rec_held,
                                                         out.rec_cost]
    return Walk(*(x[:, 0].copy() for x in rec))


__all__ = ["Walk", "greedy_walk"]
