"""Fast launchers of the environment kernels (``cuda_src/env.cu``), twins of
``foxhunt.reference.kernels.env`` under the same names and signatures.

Each public function is a numpy-in/numpy-out test entry: it validates with the reference's
``validate_<name>`` (same ``ValueError``), launches the kernel once and returns what the
reference returns. The collector and the evaluation graph launch the same kernels on arena
buffers with the ``plan_*`` shapes below (every parameter by its name in ``env.cu``):

- ``env_reset(start, n_envs, min_start, last_start, key_lo, key_hi, start_stream, cycle, t,
  steps, time_in_position, position, entry_price)``; ``start`` may be null (drawn offsets);
- ``env_observe(features, n_features, close, t, position, entry_price, time_in_position,
  n_envs, states, state_dim)``;
- ``env_step(close, high, low, features, n_features, regime, t, steps, time_in_position,
  position, entry_price, n_envs, actions, n_branches, rec_reward, rec_held, rec_cost,
  record_len, costs, n_bars, min_start, last_start, episode_len, auto_reset, reward_scale,
  state_dim, key_lo, key_hi, start_stream, cycle, r, done, s2, obs, next_ret, regime_out)``;
  ``s2`` may be
  null or alias ``obs``; the ``rec_*`` pointers are unused when ``record_len`` is 0;
- ``env_act(q, n_actions, action_offset, n_branches, n_envs, eps, key_lo, key_hi,
  explore_stream, action_stream, cycle, actions)``;
- ``eval_metrics(rewards, positions, costs, n, bars_per_year, out)``: ONE block of
  ``EVAL_THREADS`` (the kernel's launch bound).

``cycle`` (the collector's int64 ``[1]`` counter) and ``eps`` (float32 ``[1]``) are read through
pointers (they change between graph replays); the seed is passed as its two 32-bit words
(``rng.split_u64``) and the stream ids as ``rng.STREAMS`` gives them (:data:`STREAM_ARGS`).
Numerics: exact but for the ``tanh`` columns of the states (CUDA ``tanhf``) and
``eval_metrics``' float64 sums.
"""

from __future__ import annotations

import numpy as np

from foxhunt.fast.kernels._runtime import In, InOut, Out, device_scalar, launch, plan_flat
from foxhunt.reference.kernels.env import (
    EVAL_FIELDS,
    EnvState,
    EnvStep,
    validate_env_act,
    validate_env_observe,
    validate_env_reset,
    validate_env_step,
    validate_eval_metrics,
)
from foxhunt.reference.kernels.fused import branch_offsets
from foxhunt.reference.kernels.rng import STREAMS, split_u64

F32, I32 = np.float32, np.int32

#: The stream-id parameters of the env kernels and the ``rng.STREAMS`` entry each takes.
STREAM_ARGS = {"start_stream": STREAMS["episode_start"], "explore_stream": STREAMS["explore"],
               "action_stream": STREAMS["explore_action"]}

#: Threads per block of the per-env kernels (env_step's launch bound, ENV_THREADS in env.cu).
ENV_THREADS = 128
#: eval_metrics: one block of this many threads (EVAL_THREADS in env.cu).
EVAL_THREADS = 256

Plan = tuple


# --------------------------------------------------------------------------------------------
# Launch plans
# --------------------------------------------------------------------------------------------


def plan_env(n_envs: int) -> Plan:
    """One thread per env, blocks of ``ENV_THREADS`` (env_reset, env_observe, env_step)."""
    return (max(1, -(-int(n_envs) // ENV_THREADS)),), (ENV_THREADS,), 0


plan_env_reset = plan_env_observe = plan_env_step = plan_env


def plan_env_act(n_envs: int, n_branches: int) -> Plan:
    """One thread per (env, branch) (grid-stride)."""
    return plan_flat(n_envs * n_branches)


def plan_eval_metrics() -> Plan:
    """ONE block of ``EVAL_THREADS``."""
    return (1,), (EVAL_THREADS,), 0


# --------------------------------------------------------------------------------------------
# Test entries (reference signatures)
# --------------------------------------------------------------------------------------------


def env_reset(start, n_envs, min_start, last_start, key, cycle) -> EnvState:
    """Test entry of the CUDA ``env_reset`` (contract as the reference twin)."""
    n, lo, hi, key, _ = validate_env_reset(start, n_envs, min_start, last_start, key, cycle)
    key_lo, key_hi = split_u64("key", key)
    outs = launch("env_reset", plan_env_reset(n), 0 if start is None else In(start), n, lo, hi,
                  key_lo, key_hi, STREAM_ARGS["start_stream"], In(cycle), Out((n,), I32),
                  Out((n,), I32), Out((n,), I32), Out((n,), F32), Out((n,), F32))
    return EnvState(*outs)


def env_observe(features, close, t, position, entry_price, time_in_position,
                state_dim) -> np.ndarray:
    """Test entry of the CUDA ``env_observe``."""
    sd = validate_env_observe(features, close, t, position, entry_price, time_in_position,
                              state_dim)
    n = t.shape[0]
    (states,) = launch("env_observe", plan_env_observe(n), In(features), features.shape[1],
                       In(close), In(t), In(position), In(entry_price), In(time_in_position), n,
                       Out((n, sd), F32), sd)
    return states


def env_step(close, high, low, features, regime, t, steps, time_in_position, position,
             entry_price, actions, rec_reward, rec_held, rec_cost, costs, n_bars, min_start,
             last_start, episode_len, auto_reset, reward_scale, state_dim, key,
             cycle) -> EnvStep:
    """Test entry of the CUDA ``env_step``: state and records in/out, the rest out."""
    n, nb, record_len, scalars = validate_env_step(
        close, high, low, features, regime, t, steps, time_in_position, position, entry_price,
        actions, rec_reward, rec_held, rec_cost, costs, n_bars, min_start, last_start,
        episode_len, auto_reset, reward_scale, state_dim, key, cycle)
    lo, hi, ep_len, auto, scale, sd, key, _ = scalars
    key_lo, key_hi = split_u64("key", key)
    outs = launch(
        "env_step", plan_env_step(n), In(close), In(high), In(low), In(features),
        features.shape[1], In(regime), InOut(t), InOut(steps), InOut(time_in_position),
        InOut(position), InOut(entry_price), n, In(actions), nb, InOut(rec_reward),
        InOut(rec_held), InOut(rec_cost), record_len, In(costs), n_bars, lo, hi, ep_len, auto,
        scale, sd, key_lo, key_hi, STREAM_ARGS["start_stream"], In(cycle), Out((n,), F32),
        Out((n,), F32),
        Out((n, sd), F32), Out((n, sd), F32), Out((n,), F32), Out((n,), I32))
    state, recs, (r, done, s2, obs, next_ret, regime_out) = outs[:5], outs[5:8], outs[8:]
    return EnvStep(*state, r, done, s2, obs, next_ret, regime_out, *recs)


def env_act(q, branches, eps, key, cycle) -> np.ndarray:
    """Test entry of the CUDA ``env_act``."""
    br, n, eps, key, _ = validate_env_act(q, branches, eps, key, cycle)
    key_lo, key_hi = split_u64("key", key)
    nb = len(br)
    (actions,) = launch("env_act", plan_env_act(n, nb), In(q), In(np.array(br, I32)),
                        In(np.array(branch_offsets(br), I32)), nb, n, device_scalar(eps, F32),
                        key_lo, key_hi, STREAM_ARGS["explore_stream"],
                        STREAM_ARGS["action_stream"], In(cycle), Out((n, nb), I32))
    return actions


def eval_metrics(rewards, positions, costs, bars_per_year) -> np.ndarray:
    """Test entry of the CUDA ``eval_metrics``."""
    per_year = validate_eval_metrics(rewards, positions, costs, bars_per_year)
    (out,) = launch("eval_metrics", plan_eval_metrics(), In(rewards), In(positions), In(costs),
                    rewards.shape[0], np.float64(per_year), Out((len(EVAL_FIELDS),), F32))
    return out


KERNELS = {
    "env_reset": env_reset,
    "env_observe": env_observe,
    "env_step": env_step,
    "env_act": env_act,
    "eval_metrics": eval_metrics,
}
