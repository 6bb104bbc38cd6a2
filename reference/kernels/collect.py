"""The collection cycle's fused kernels (``cuda_src/collect.cu``; issue 20), each the
composition of the reference kernels it fuses (SPEC 9-11: a fused kernel's twin is that
composition, so the fused cycle gives the unfused cycle's results):

- ``collect_transition``: ``env.env_act`` -> ``env.env_step`` (auto-reset, no records) ->
  ``replay.nstep_window`` -> ``replay.replay_add`` of the ``n_out`` transitions it emitted ->
  the post-reset states as the next ``obs``;
- ``replay_batch``: ``replay.scan_offsets`` (the ring scan's second half) ->
  ``replay.replay_sample`` -> ``replay.importance_weights`` (over the whole ``priority``
  array) and ``replay.replay_gather`` of the sampled rows.

Both are exact against their kernels but for what the fused kernels' parts are not: the two
``tanh`` columns of the states (CUDA ``tanhf``) and the weights' ``powf``.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from foxhunt.reference.kernels import env as env_kernels
from foxhunt.reference.kernels import replay

F32, I32 = np.float32, np.int32

#: The ring's arrays by parameter name (``replay.RING_FIELDS`` order).
RING_PARAMS = tuple(f"ring_{name}" for name, _, _ in replay.RING_FIELDS)
#: The n-step windows (``replay.nstep_buffers``' ``win_*`` entries), in its order.
WINDOW_PARAMS = ("win_s", "win_a", "win_r", "win_next_ret", "win_regime", "win_len")


class CollectTransition(NamedTuple):
    """Outputs of ``collect_transition``: the walks after the step (``EnvState`` fields), the
    next states ``obs`` (after any reset), the step's ``actions``, ``r`` (scaled), ``done``,
    ``s2`` (before any reset), ``next_ret``, ``regime_out`` (the kernel's per-env scratch,
    compared too), the windows, the ring, ``priority`` and ``ring_pos``."""

    t: np.ndarray
    steps: np.ndarray
    time_in_position: np.ndarray
    position: np.ndarray
    entry_price: np.ndarray
    obs: np.ndarray
    actions: np.ndarray
    r: np.ndarray
    done: np.ndarray
    s2: np.ndarray
    next_ret: np.ndarray
    regime_out: np.ndarray
    win_s: np.ndarray
    win_a: np.ndarray
    win_r: np.ndarray
    win_next_ret: np.ndarray
    win_regime: np.ndarray
    win_len: np.ndarray
    ring_s: np.ndarray
    ring_a: np.ndarray
    ring_r: np.ndarray
    ring_s2: np.ndarray
    ring_done: np.ndarray
    ring_next_ret: np.ndarray
    ring_regime: np.ndarray
    ring_discount: np.ndarray
    priority: np.ndarray
    ring_pos: np.ndarray


def _no_records(n_envs: int) -> np.ndarray:
    return np.zeros((0, n_envs), F32)


def _nstep_outputs(n_envs: int, n_step: int, state_dim: int, n_branches: int) -> dict:
    """``nstep_window``'s ``out_*`` rows, zeroed (the fused kernel writes the ring directly)."""
    shapes = replay.nstep_buffers(n_envs, n_step, state_dim, n_branches)
    return {name: np.zeros(shape, dtype) for name, (dtype, shape) in shapes.items()
            if name.startswith("out_")}


def validate_collect_transition(q, branches, eps, key, cycle, close, high, low, features, regime,
                                t, steps, time_in_position, position, entry_price, costs, n_bars,
                                min_start, last_start, episode_len, reward_scale, state_dim, obs,
                                win, n_step, gamma_ref, ring, priority, ring_pos,
                                max_priority) -> tuple:
    """The argument checks of ``collect_transition``: those of the kernels it fuses, on
    stand-in intermediates of the right shapes (``win``, ``ring``: the arrays by parameter
    name). Returns ``(branches, n_envs, state_dim, n_branches)``."""
    br, n, _, _, _ = env_kernels.validate_env_act(q, branches, eps, key, cycle)
    nb = len(br)
    actions = np.zeros((n, nb), I32)
    env_kernels.validate_env_step(close, high, low, features, regime, t, steps, time_in_position,
                                  position, entry_price, actions, _no_records(n),
                                  _no_records(n), _no_records(n), costs, n_bars, min_start,
                                  last_start, episode_len, 1, reward_scale, state_dim, key, cycle)
    zeros = np.zeros(n, F32)
    _, sd, _, _ = replay.validate_nstep_window(obs, actions, zeros, zeros, obs, zeros,
                                               np.zeros(n, I32), win, _nstep_outputs(
                                                   n, n_step, obs.shape[1], nb), n_step,
                                               gamma_ref)
    out = _nstep_outputs(n, n_step, sd, nb)
    replay.validate_replay_add(*(out[f"out_{name}"] for name, _, _ in replay.RING_FIELDS), ring,
                               priority, ring_pos, max_priority, np.zeros(1, I32))
    return br, n, sd, nb


def collect_transition(q: np.ndarray, branches, eps, key: int, cycle: np.ndarray,
                       close: np.ndarray, high: np.ndarray, low: np.ndarray,
                       features: np.ndarray, regime: np.ndarray, t: np.ndarray,
                       steps: np.ndarray, time_in_position: np.ndarray, position: np.ndarray,
                       entry_price: np.ndarray, costs: np.ndarray, n_bars: int, min_start: int,
                       last_start: int, episode_len: int, reward_scale, state_dim: int,
                       obs: np.ndarray, win_s: np.ndarray, win_a: np.ndarray, win_r: np.ndarray,
                       win_next_ret: np.ndarray, win_regime: np.ndarray, win_len: np.ndarray,
                       n_step: int, gamma_ref, ring_s: np.ndarray, ring_a: np.ndarray,
                       ring_r: np.ndarray, ring_s2: np.ndarray, ring_done: np.ndarray,
                       ring_next_ret: np.ndarray, ring_regime: np.ndarray,
                       ring_discount: np.ndarray, priority: np.ndarray, ring_pos: np.ndarray,
                       max_priority: np.ndarray) -> CollectTransition:
    """One collection step of every env into the ring: ``env_act(q, branches, eps, key, cycle)``
    -> ``env_step(..., actions, no records, ..., auto_reset=1, ...)`` -> ``nstep_window(obs,
    actions, r, done, s2, next_ret, regime, windows, n_step, gamma_ref)`` -> ``replay_add`` of
    its first ``n_out`` rows at the ring's cursor (priority ``max_priority[0]``); ``obs`` <- the
    step's post-reset states. Arguments and contracts as those kernels' (``q`` branch-packed
    expected Q ``[N * A_total]``; ``obs`` ``[N, state_dim]`` the states the step starts from;
    the windows ``replay.nstep_buffers``' shapes; the ring ``replay_add``'s, with
    ``N * n_step <= capacity``). Returns ``CollectTransition`` (new arrays; inputs unchanged).
    """
    win = dict(win_s=win_s, win_a=win_a, win_r=win_r, win_next_ret=win_next_ret,
               win_regime=win_regime, win_len=win_len)
    ring = dict(ring_s=ring_s, ring_a=ring_a, ring_r=ring_r, ring_s2=ring_s2,
                ring_done=ring_done, ring_next_ret=ring_next_ret, ring_regime=ring_regime,
                ring_discount=ring_discount)
    _, n, sd, nb = validate_collect_transition(
        q, branches, eps, key, cycle, close, high, low, features, regime, t, steps,
        time_in_position, position, entry_price, costs, n_bars, min_start, last_start,
        episode_len, reward_scale, state_dim, obs, win, n_step, gamma_ref, ring, priority,
        ring_pos, max_priority)
    actions = env_kernels.env_act(q, branches, eps, key, cycle)
    step = env_kernels.env_step(close, high, low, features, regime, t, steps, time_in_position,
                                position, entry_price, actions, _no_records(n), _no_records(n),
                                _no_records(n), costs, n_bars, min_start, last_start,
                                episode_len, 1, reward_scale, state_dim, key, cycle)
    window = replay.nstep_window(obs, actions, step.r, step.done, step.s2, step.next_ret,
                                 step.regime, **win, **_nstep_outputs(n, n_step, sd, nb),
                                 n_step=n_step, gamma_ref=gamma_ref)
    emitted = (getattr(window, f"out_{name}") for name, _, _ in replay.RING_FIELDS)
    added = replay.replay_add(*emitted, **ring, priority=priority, ring_pos=ring_pos,
                              max_priority=max_priority, n_valid=window.n_out)
    return CollectTransition(step.t, step.steps, step.time_in_position, step.position,
                             step.entry_price, step.obs, actions, step.r, step.done, step.s2,
                             step.next_ret, step.regime,
                             *(getattr(window, name) for name in WINDOW_PARAMS), *added)


class ReplayBatch(NamedTuple):
    """Outputs of ``replay_batch``: the sampled rows ``idx``, their weights ``w`` and the
    gathered batch (``replay.Gathered``'s fields)."""

    idx: np.ndarray
    w: np.ndarray
    x: np.ndarray
    a: np.ndarray
    r: np.ndarray
    done: np.ndarray
    next_ret: np.ndarray
    regime: np.ndarray
    discount: np.ndarray


def validate_replay_batch(s, block_sums, ring_pos, key, cycle, n, priority, beta, ring) -> int:
    """The argument checks of ``replay_batch`` (``ring``: the ring arrays by parameter name);
    returns ``n``."""
    capacity, _, _ = replay.validate_ring(**ring)
    replay.validate_scan_offsets(s, block_sums)
    if priority.shape != (capacity,) or s.shape != (capacity,):
        raise ValueError(f"priority, s: shapes {priority.shape}, {s.shape} are not allowed; "
                         f"need [{capacity}] (the ring's capacity)")
    n, _, _ = replay.validate_replay_sample(s, ring_pos, key, cycle, n)
    replay.validate_importance_weights(priority, np.zeros(n, I32), beta, capacity)
    return n


def replay_batch(s: np.ndarray, block_sums: np.ndarray, ring_pos: np.ndarray, key: int,
                 cycle: np.ndarray, n: int, priority: np.ndarray, beta, ring_s: np.ndarray,
                 ring_a: np.ndarray, ring_r: np.ndarray, ring_s2: np.ndarray,
                 ring_done: np.ndarray, ring_next_ret: np.ndarray, ring_regime: np.ndarray,
                 ring_discount: np.ndarray) -> ReplayBatch:
    """The step's batch from the ring scan's tiles (``s``, ``block_sums``: ``replay.scan_tiles``
    of the priorities): ``prefix = scan_offsets(s, block_sums)``, ``idx = replay_sample(prefix,
    ring_pos, key, cycle, n)``, ``w = importance_weights(priority, idx, beta, capacity)`` and
    ``replay_gather(idx, ring)`` (contracts and shapes: those kernels'; ``s`` and ``priority``
    ``[capacity]``)."""
    ring = dict(ring_s=ring_s, ring_a=ring_a, ring_r=ring_r, ring_s2=ring_s2,
                ring_done=ring_done, ring_next_ret=ring_next_ret, ring_regime=ring_regime,
                ring_discount=ring_discount)
    validate_replay_batch(s, block_sums, ring_pos, key, cycle, n, priority, beta, ring)
    prefix = replay.scan_offsets(s, block_sums)
    idx = replay.replay_sample(prefix, ring_pos, key, cycle, n)
    w = replay.importance_weights(priority, idx, beta, priority.shape[0])
    return ReplayBatch(idx, w, *replay.replay_gather(idx, **ring))


KERNELS = {"collect_transition": collect_transition, "replay_batch": replay_batch}

__all__ = ["CollectTransition", "KERNELS", "ReplayBatch", "collect_transition", "replay_batch",
           "validate_collect_transition", "validate_replay_batch"]
