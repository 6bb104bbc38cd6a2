"""Fast-path launchers of the prioritised-replay kernels (``cuda_src/replay.cu``; reference:
``foxhunt.reference.kernels.replay``).

Each public function has the reference's name and signature, validates with the reference's
``validate_<name>`` (or check; same ``ValueError``), runs the CUDA kernel once and returns the
reference's shapes and dtypes. ``plan_<name>(...)`` gives ``(grid, block, shared_mem)``.
Kernel parameters (C order):

- ``prefix_sum(p, s, n)``: ONE block of ``SCAN_THREADS`` threads (the kernel's launch bound)
  scanning tiles of ``SCAN_THREADS * 8`` elements in order, chained by a carry.
- ``scan_tiles(p, s, block_sums, n)`` then ``scan_offsets(s, block_sums, n)``: the collection
  cycle's prefix sum, one block of ``RING_SCAN_THREADS`` per tile of ``RING_SCAN_TILE``
  elements (grid ``scan_blocks(n)``, the same for both); bit-exact against their reference
  twins (``ring_prefix_sum`` is the pair).
- ``sample_proportional(prefix, n_items, u, out, n)``: one thread per uniform, any grid; the
  total is ``prefix[n_items - 1]``, read on the device.
- ``importance_weights(priorities, n_items, idx, w, n, beta)``: ONE block (fminf tree, then a
  division and a ``powf`` per weight); the caller guarantees ``0 <= idx < n_valid <= n_items``
  (``n_items``: the length of ``priorities``).
- ``replay_add(s, a, r, s2, done, next_ret, regime, discount, n_valid, n_given, state_dim,
  n_branches, ring_s, ring_a, ring_r, ring_s2, ring_done, ring_next_ret, ring_regime,
  ring_discount, priority, ring_pos, max_priority, capacity)``: ONE block (its thread 0
  advances ``ring_pos`` after the barrier); ``n_valid`` may be null (all ``n_given`` rows).
- ``nstep_window(obs, actions, r, done, s2, next_ret, regime, n_envs, state_dim, n_branches,
  n_step, gamma_ref, win_s, win_a, win_r, win_next_ret, win_regime, win_len, out_s, out_a,
  out_r, out_s2, out_done, out_next_ret, out_regime, out_discount, n_out)``: ONE block with
  ``2 * n_envs`` ints of dynamic shared memory (``plan_nstep_window``).
- ``replay_sample(prefix, capacity, ring_pos, key_lo, key_hi, stream, cycle, idx, n)``: one
  thread per sample, any grid; ``stream`` is ``rng.STREAMS["replay_sample"]``.
- ``replay_gather(idx, n, capacity, state_dim, n_branches, ring_s, ..., ring_discount, x, a,
  r, done, next_ret, regime, discount)``: grid-stride over the ``n * state_dim`` state
  elements; ``next_ret``, ``regime`` and ``discount`` may be null (not gathered).
- ``replay_update_priorities(td, idx, n, priority, capacity, max_priority, alpha, eps,
  cycle)``: ONE block; ``cycle`` may be null, else its thread 0 also advances the counter
  (``cycle_advance`` fused: the collector's cycle ends there).
- ``cycle_advance(cycle)``: one thread (the collector's int64 counter plus one).

Numerics: ``sample_proportional``, ``replay_sample``, ``replay_add``, ``replay_gather`` and
``nstep_window`` (its sums in the reference's order, rounded per operation) are exact. ``prefix_sum`` associates differently from the
reference's sequential sum: results differ by rounding (conformance: reduction tolerance, with
length ``n`` and magnitude ``max|p|``). ``importance_weights`` uses CUDA ``powf`` (not correctly
rounded, a few ULP; glibc's ``powf`` on the reference side is within 1 ULP), compared under the
reduction tolerance (relative 1e-5); so is ``replay_update_priorities``' ``powf`` (its maximum
follows the priorities).
"""

from __future__ import annotations

import numpy as np

from foxhunt.fast.kernels._runtime import In, InOut, Out, blocks, launch, plan_flat
from foxhunt.reference.kernels.argcheck import check_f32_array
from foxhunt.reference.kernels.replay import (
    Gathered,
    NStepWindow,
    RING_SCAN_THREADS,
    Priorities,
    RingAdd,
    ScanTiles,
    scan_blocks,
    validate_cycle,
    validate_importance_weights,
    validate_nstep_window,
    validate_replay_add,
    validate_replay_gather,
    validate_replay_sample,
    validate_replay_update_priorities,
    validate_sample_proportional,
    validate_scan_offsets,
    validate_scan_tiles,
)
from foxhunt.reference.kernels.rng import STREAMS, split_u64

F32 = np.dtype(np.float32)
I32 = np.dtype(np.int32)

#: prefix_sum's block size: fixed by the kernel (__launch_bounds__, 32 warps for the warp-total
#: scan); do not change one without the other.
SCAN_THREADS = 1024
#: importance_weights: one block, up to this many threads, a multiple of the warp size.
WEIGHTS_MAX_THREADS = 1024
WARP = 32

Plan = tuple  # (grid, block, shared_mem)


# --------------------------------------------------------------------------------------------
# Launch plans
# --------------------------------------------------------------------------------------------


def plan_prefix_sum(n: int) -> Plan:
    """One block of ``SCAN_THREADS`` (any ``n``; the kernel loops over tiles)."""
    del n
    return (1,), (SCAN_THREADS,), 0


def plan_scan_tiles(n: int) -> Plan:
    """One block of ``RING_SCAN_THREADS`` per tile (``scan_blocks(n)``); ``scan_offsets`` too."""
    return (scan_blocks(n),), (RING_SCAN_THREADS,), 0


plan_scan_offsets = plan_scan_tiles

#: One thread per uniform (grid-stride).
plan_sample_proportional = plan_flat


def plan_importance_weights(n: int) -> Plan:
    """One block: one thread per sample up to ``WEIGHTS_MAX_THREADS``, in whole warps."""
    threads = min(WEIGHTS_MAX_THREADS, WARP * blocks(n, WARP))
    return (1,), (threads,), 0


#: The one-block ring kernels: one thread per sample (or transition) up to this many.
plan_replay_update_priorities = plan_importance_weights


def plan_replay_add(n: int, state_dim: int) -> Plan:
    """ONE block, one thread per state element up to ``WEIGHTS_MAX_THREADS``, whole warps."""
    return plan_importance_weights(n * state_dim)


#: One thread per sample (grid-stride).
plan_replay_sample = plan_flat

#: nstep_window's dynamic shared memory limit (the default per-block limit, no opt-in).
SHARED_LIMIT = 48 * 1024


def plan_nstep_window(n_envs: int, state_dim: int) -> Plan:
    """ONE block, one thread per state element up to ``WEIGHTS_MAX_THREADS``, whole warps;
    ``2 * n_envs`` ints of shared memory (at most ``SHARED_LIMIT`` bytes: 6144 envs)."""
    shared = 2 * 4 * int(n_envs)
    if shared > SHARED_LIMIT:
        raise ValueError(f"n_envs={n_envs}: nstep_window holds 2 ints per env in shared memory; "
                         f"allowed at most {SHARED_LIMIT // 8} envs")
    grid, block, _ = plan_importance_weights(n_envs * state_dim)
    return grid, block, shared


def plan_replay_gather(n: int, state_dim: int) -> Plan:
    """Flat over the ``n * state_dim`` gathered state elements (the other fields are fewer)."""
    return plan_flat(n * state_dim)


# --------------------------------------------------------------------------------------------
# Test entries (reference signatures)
# --------------------------------------------------------------------------------------------


def prefix_sum(p: np.ndarray) -> np.ndarray:
    """Inclusive prefix sums of ``p`` (float32[N]) on the GPU (single-block scan)."""
    check_f32_array("p", p, ndim=1)
    (s,) = launch("prefix_sum", plan_prefix_sum(p.size), In(p), Out(p.shape, F32), p.size)
    return s


def scan_tiles(p: np.ndarray) -> ScanTiles:
    """Each tile's own inclusive scan and total (``ScanTiles``), on the GPU."""
    n = validate_scan_tiles(p)
    out = launch("scan_tiles", plan_scan_tiles(n), In(p), Out((n,), F32),
                 Out((scan_blocks(n),), F32), n)
    return ScanTiles(*out)


def scan_offsets(s: np.ndarray, block_sums: np.ndarray) -> np.ndarray:
    """Each tile's scan plus the sequential sum of the tiles before (float32[n]), on the GPU."""
    n = validate_scan_offsets(s, block_sums)
    (out,) = launch("scan_offsets", plan_scan_offsets(n), InOut(s), In(block_sums), n)
    return out


def sample_proportional(prefix: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Proportional sampling by binary search on ``prefix`` (int32[n]), exactly the reference's."""
    n_items = validate_sample_proportional(prefix, u)
    (out,) = launch("sample_proportional", plan_sample_proportional(u.size), In(prefix), n_items,
                     In(u), Out(u.shape, I32), u.size)
    return out


def importance_weights(priorities: np.ndarray, idx: np.ndarray, beta: float,
                       n_valid: int) -> np.ndarray:
    """PER importance weights ``(p_min / p_{idx_k}) ** beta`` (float32[n]) on the GPU."""
    beta32, _ = validate_importance_weights(priorities, idx, beta, n_valid)
    (w,) = launch("importance_weights", plan_importance_weights(idx.size), In(priorities),
                   priorities.size, In(idx), Out(idx.shape, F32), idx.size, beta32)
    return w


def replay_add(s, a, r, s2, done, next_ret, regime, discount, ring_s, ring_a, ring_r, ring_s2,
               ring_done, ring_next_ret, ring_regime, ring_discount, priority, ring_pos,
               max_priority, n_valid=None) -> RingAdd:
    """The first ``n_valid[0]`` (else all ``n``) transitions into the ring at its device cursor
    (``RingAdd``), on the GPU."""
    ring = dict(ring_s=ring_s, ring_a=ring_a, ring_r=ring_r, ring_s2=ring_s2, ring_done=ring_done,
                ring_next_ret=ring_next_ret, ring_regime=ring_regime, ring_discount=ring_discount)
    n, _ = validate_replay_add(s, a, r, s2, done, next_ret, regime, discount, ring, priority,
                               ring_pos, max_priority, n_valid)
    capacity, state_dim = ring_s.shape
    out = launch("replay_add", plan_replay_add(n, state_dim), In(s), In(a), In(r), In(s2),
                 In(done), In(next_ret), In(regime), In(discount),
                 0 if n_valid is None else In(n_valid), n, state_dim, ring_a.shape[1],
                 *(InOut(x) for x in ring.values()), InOut(priority), InOut(ring_pos),
                 In(max_priority), capacity)
    return RingAdd(*out)


def nstep_window(obs, actions, r, done, s2, next_ret, regime, win_s, win_a, win_r, win_next_ret,
                 win_regime, win_len, out_s, out_a, out_r, out_s2, out_done, out_next_ret,
                 out_regime, out_discount, n_step, gamma_ref) -> NStepWindow:
    """One step into the n-step windows and the finished transitions (``NStepWindow``), on
    the GPU."""
    win = dict(win_s=win_s, win_a=win_a, win_r=win_r, win_next_ret=win_next_ret,
               win_regime=win_regime, win_len=win_len)
    out = dict(out_s=out_s, out_a=out_a, out_r=out_r, out_s2=out_s2, out_done=out_done,
               out_next_ret=out_next_ret, out_regime=out_regime, out_discount=out_discount)
    N, SD, nb, g = validate_nstep_window(obs, actions, r, done, s2, next_ret, regime, win, out,
                                         n_step, gamma_ref)
    res = launch("nstep_window", plan_nstep_window(N, SD), In(obs), In(actions), In(r), In(done),
                 In(s2), In(next_ret), In(regime), N, SD, nb, int(n_step), g,
                 *(InOut(x) for x in win.values()), *(InOut(x) for x in out.values()),
                 Out((1,), I32))
    return NStepWindow(*res)


def replay_sample(prefix, ring_pos, key, cycle, n) -> np.ndarray:
    """Proportional sampling of ``n`` filled ring rows with the Philox draws (int32[n])."""
    n, key, _ = validate_replay_sample(prefix, ring_pos, key, cycle, n)
    key_lo, key_hi = split_u64("key", key)
    (idx,) = launch("replay_sample", plan_replay_sample(n), In(prefix), prefix.size, In(ring_pos),
                    key_lo, key_hi, STREAMS["replay_sample"], In(cycle), Out((n,), I32), n)
    return idx


def replay_gather(idx, ring_s, ring_a, ring_r, ring_s2, ring_done, ring_next_ret,
                  ring_regime, ring_discount) -> Gathered:
    """The sampled ring rows in the step's batch layout (``Gathered``), on the GPU."""
    ring = dict(ring_s=ring_s, ring_a=ring_a, ring_r=ring_r, ring_s2=ring_s2, ring_done=ring_done,
                ring_next_ret=ring_next_ret, ring_regime=ring_regime, ring_discount=ring_discount)
    n, state_dim, n_branches = validate_replay_gather(idx, ring)
    out = launch("replay_gather", plan_replay_gather(n, state_dim), In(idx), n,
                 ring_s.shape[0], state_dim, n_branches, *(In(x) for x in ring.values()), Out((2 * n, state_dim), F32),
                 Out((n_branches, n), I32), Out((n,), F32), Out((n,), F32), Out((n,), F32),
                 Out((n,), I32), Out((n,), F32))
    return Gathered(*out)


def replay_update_priorities(td, idx, priority, max_priority, alpha, eps) -> Priorities:
    """The sampled rows' new priorities and the running maximum (``Priorities``), on the GPU."""
    alpha32, eps32 = validate_replay_update_priorities(td, idx, priority, max_priority, alpha, eps)
    out = launch("replay_update_priorities", plan_replay_update_priorities(td.size), In(td),
                 In(idx), td.size, InOut(priority), priority.size, InOut(max_priority), alpha32,
                 eps32, 0)
    return Priorities(*out)


def plan_cycle_advance() -> Plan:
    """One thread."""
    return (1,), (WARP,), 0


def cycle_advance(cycle) -> np.ndarray:
    """The collector's counter plus one (int64[1]), on the GPU."""
    validate_cycle(cycle)
    (out,) = launch("cycle_advance", plan_cycle_advance(), InOut(cycle))
    return out


KERNELS = {
    "prefix_sum": prefix_sum,
    "scan_tiles": scan_tiles,
    "scan_offsets": scan_offsets,
    "sample_proportional": sample_proportional,
    "importance_weights": importance_weights,
    "replay_add": replay_add,
    "replay_sample": replay_sample,
    "replay_gather": replay_gather,
    "replay_update_priorities": replay_update_priorities,
    "cycle_advance": cycle_advance,
    "nstep_window": nstep_window,
}
