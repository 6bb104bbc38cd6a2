"""Fast launchers of the collection cycle's fused kernels (``cuda_src/collect.cu``), twins of
``foxhunt.reference.kernels.collect`` under the same names and signatures (numpy-in/numpy-out
test entries: the reference's validation, one launch, the reference's outputs). The collector
launches the same kernels on arena buffers with the ``plan_*`` shapes below (every parameter by
its name in ``collect.cu``):

- ``collect_transition(q, n_actions, action_offset, n_branches, eps, key_lo, key_hi,
  explore_stream, action_stream, start_stream, cycle, close, high, low, features, n_features,
  regime, costs, n_bars, min_start, last_start, episode_len, reward_scale, state_dim, t, steps,
  time_in_position, position, entry_price, n_envs, obs, actions, r, done, s2, obs_next,
  next_ret, regime_out, n_step, gamma_ref, win_s, win_a, win_r, win_next_ret, win_regime,
  win_len, ring_s, ring_a, ring_r, ring_s2, ring_done, ring_next_ret, ring_regime,
  ring_discount, priority, ring_pos, max_priority, capacity)``: ONE block, ``2 n_envs + 1``
  ints of dynamic shared memory; ``actions`` ... ``regime_out`` and ``obs_next`` are per-env
  scratch it writes and reads back;
- ``replay_batch(s, block_sums, capacity, ring_pos, key_lo, key_hi, stream, cycle, n, priority,
  beta, state_dim, n_branches, ring_s, ..., ring_discount, idx, w, x, a, r, done, next_ret,
  regime, discount)``: any grid, ``n`` ints and ``scan_blocks(capacity)`` floats of dynamic
  shared memory; ``s``, ``block_sums``: ``scan_tiles``' outputs (the offsets are applied where
  the search reads); ``next_ret``, ``regime`` and ``discount`` may be null.

Numerics: exact but for the states' two ``tanh`` columns (CUDA ``tanhf``) and the weights'
``powf``, as the kernels they fuse.
"""

from __future__ import annotations

import numpy as np

from foxhunt.fast.kernels._runtime import In, InOut, Out, blocks, device_scalar, launch
from foxhunt.fast.kernels.env import STREAM_ARGS
from foxhunt.reference.kernels.collect import (
    RING_PARAMS,
    WINDOW_PARAMS,
    CollectTransition,
    ReplayBatch,
    validate_collect_transition,
    validate_replay_batch,
)
from foxhunt.reference.kernels.env import EnvState
from foxhunt.reference.kernels.fused import branch_offsets
from foxhunt.reference.kernels.replay import scan_blocks
from foxhunt.reference.kernels.rng import STREAMS, split_u64

F32, I32 = np.float32, np.int32

#: collect_transition's block: one thread per env for the step, whole warps, at most this many
#: (the n-step copies loop over the state elements).
COLLECT_MAX_THREADS = 1024
#: replay_batch's blocks (each draws the whole batch) and their most (the gather's grid).
BATCH_THREADS = 256
BATCH_MAX_BLOCKS = 32
#: Dynamic shared memory without the opt-in (the default per-block limit).
SHARED_LIMIT = 48 * 1024
WARP = 32

Plan = tuple


def plan_collect_transition(n_envs: int, state_dim: int) -> Plan:
    """ONE block, one thread per state element up to ``COLLECT_MAX_THREADS``, whole warps;
    ``2 n_envs + 1`` ints of shared memory."""
    shared = 4 * (2 * int(n_envs) + 1)
    if shared > SHARED_LIMIT:
        raise ValueError(f"n_envs={n_envs}: collect_transition holds 2 ints per env in shared "
                         f"memory; allowed at most {(SHARED_LIMIT // 4 - 1) // 2} envs")
    threads = min(COLLECT_MAX_THREADS, WARP * blocks(int(n_envs) * int(state_dim), WARP))
    return (1,), (threads,), shared


def plan_replay_batch(n: int, state_dim: int, capacity: int) -> Plan:
    """Blocks of ``BATCH_THREADS`` over the ``n * state_dim`` gathered state elements, at most
    ``BATCH_MAX_BLOCKS``; shared memory: ``n`` ints (the drawn rows) and the ring scan's tile
    offsets (``scan_blocks(capacity)`` floats)."""
    shared = 4 * (int(n) + scan_blocks(capacity))
    if shared > SHARED_LIMIT:
        raise ValueError(f"n={n}, capacity={capacity}: replay_batch holds the batch's rows and "
                         f"the ring's tile offsets in shared memory, {shared} bytes; allowed "
                         f"at most {SHARED_LIMIT}")
    grid = min(blocks(int(n) * int(state_dim), BATCH_THREADS), BATCH_MAX_BLOCKS)
    return (grid,), (BATCH_THREADS,), shared


def collect_transition(q, branches, eps, key, cycle, close, high, low, features, regime, t,
                       steps, time_in_position, position, entry_price, costs, n_bars, min_start,
                       last_start, episode_len, reward_scale, state_dim, obs, win_s, win_a,
                       win_r, win_next_ret, win_regime, win_len, n_step, gamma_ref, ring_s,
                       ring_a, ring_r, ring_s2, ring_done, ring_next_ret, ring_regime,
                       ring_discount, priority, ring_pos, max_priority) -> CollectTransition:
    """Test entry of the CUDA ``collect_transition`` (contract: the reference twin's)."""
    win = dict(win_s=win_s, win_a=win_a, win_r=win_r, win_next_ret=win_next_ret,
               win_regime=win_regime, win_len=win_len)
    ring = dict(ring_s=ring_s, ring_a=ring_a, ring_r=ring_r, ring_s2=ring_s2,
                ring_done=ring_done, ring_next_ret=ring_next_ret, ring_regime=ring_regime,
                ring_discount=ring_discount)
    br, n, sd, nb = validate_collect_transition(
        q, branches, eps, key, cycle, close, high, low, features, regime, t, steps,
        time_in_position, position, entry_price, costs, n_bars, min_start, last_start,
        episode_len, reward_scale, state_dim, obs, win, n_step, gamma_ref, ring, priority,
        ring_pos, max_priority)
    key_lo, key_hi = split_u64("key", key)
    state = (t, steps, time_in_position, position, entry_price)
    outs = launch(
        "collect_transition", plan_collect_transition(n, sd), In(q), In(np.array(br, I32)),
        In(np.array(branch_offsets(br), I32)), nb, device_scalar(eps, F32), key_lo, key_hi,
        STREAM_ARGS["explore_stream"], STREAM_ARGS["action_stream"],
        STREAM_ARGS["start_stream"], In(cycle), In(close), In(high), In(low), In(features),
        features.shape[1], In(regime), In(costs), int(n_bars), int(min_start), int(last_start),
        int(episode_len), F32(reward_scale), sd, *(InOut(x) for x in state), n, InOut(obs),
        Out((n, nb), I32), Out((n,), F32), Out((n,), F32), Out((n, sd), F32), Out((n, sd), F32),
        Out((n,), F32), Out((n,), I32), int(n_step), F32(gamma_ref),
        *(InOut(win[name]) for name in WINDOW_PARAMS), *(InOut(ring[name]) for name in RING_PARAMS),
        InOut(priority), InOut(ring_pos), In(max_priority), priority.shape[0])
    env = EnvState(*outs[:5])
    obs_out, actions, r, done, s2, _obs_next, next_ret, regime_out = outs[5:13]
    return CollectTransition(*env, obs_out, actions, r, done, s2, next_ret, regime_out,
                             *outs[13:])


def replay_batch(s, block_sums, ring_pos, key, cycle, n, priority, beta, ring_s, ring_a, ring_r,
                 ring_s2, ring_done, ring_next_ret, ring_regime, ring_discount) -> ReplayBatch:
    """Test entry of the CUDA ``replay_batch`` (contract: the reference twin's)."""
    ring = dict(ring_s=ring_s, ring_a=ring_a, ring_r=ring_r, ring_s2=ring_s2,
                ring_done=ring_done, ring_next_ret=ring_next_ret, ring_regime=ring_regime,
                ring_discount=ring_discount)
    n = validate_replay_batch(s, block_sums, ring_pos, key, cycle, n, priority, beta, ring)
    key_lo, key_hi = split_u64("key", key)
    capacity, sd = ring_s.shape
    nb = ring_a.shape[1]
    outs = launch("replay_batch", plan_replay_batch(n, sd, capacity), In(s), In(block_sums),
                  capacity, In(ring_pos), key_lo, key_hi, STREAMS["replay_sample"], In(cycle), n,
                  In(priority), F32(beta), sd, nb, *(In(ring[name]) for name in RING_PARAMS),
                  Out((n,), I32), Out((n,), F32), Out((2 * n, sd), F32), Out((nb, n), I32),
                  Out((n,), F32), Out((n,), F32), Out((n,), F32), Out((n,), I32),
                  Out((n,), F32))
    return ReplayBatch(*outs)


KERNELS = {"collect_transition": collect_transition, "replay_batch": replay_batch}
