"""Prioritised-replay kernels (SPEC 10: proportional sampling by prefix sums and binary search,
importance weights; Schaul et al. 2016), and the device-resident ring they work on.

Priorities are data: the kernels define what happens for zero, NaN or Inf priorities and for
out-of-range uniforms instead of raising; only shapes, dtypes, configuration scalars and indices
that would read outside the buffer raise ``ValueError``.

The ring (issue 20: the replay buffer lives on the device, in the trainer's arena): one array
per stored field (``RING_FIELDS``: ``s``, ``s2`` f32 ``[capacity, state_dim]``, ``a`` int32
``[capacity, n_branches]``, ``r``, ``done``, ``next_ret`` f32 ``[capacity]``, ``regime`` int32
``[capacity]``, ``discount`` f32 ``[capacity]``: the n-step transition's ``gamma_ref ** k``), ``priority`` f32 ``[capacity]`` (stored already raised to ``alpha``; zero
beyond the filled rows), ``ring_pos`` int32 ``[2]`` = ``(cursor, size)`` and ``max_priority``
f32 ``[1]`` (the running maximum, 1 at the start). ``nstep_window`` turns the environment steps into n-step
transitions (issue 22); ``replay_add`` writes ``N`` transitions at the cursor; ``prefix_sum`` + ``replay_sample`` + ``importance_weights`` + ``replay_gather`` make
a batch; ``replay_update_priorities`` writes the step's new priorities. Every position and
count is read on the device: nothing in a cycle needs the host.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from foxhunt.reference.kernels import rng
from foxhunt.reference.kernels.argcheck import (
    check_array,
    check_f32_array,
    check_f32_scalar,
    check_int,
)

F32 = np.dtype(np.float32)
I32 = np.dtype(np.int32)
I64 = np.dtype(np.int64)

#: The ring's stored fields in kernel-parameter order: (name, dtype, True for a row of
#: ``state_dim`` / ``n_branches`` values, False for one value per transition).
RING_FIELDS = (("s", F32, True), ("a", I32, True), ("r", F32, False), ("s2", F32, True),
               ("done", F32, False), ("next_ret", F32, False), ("regime", I32, False),
               ("discount", F32, False))
#: The longest n-step window (``LoopSettings.n_step``'s upper bound; the kernel's loops).
MAX_N_STEP = 16


# ---------------------------------------------------------------------------------------------
# Validation shared with the fast test entries (foxhunt.fast.kernels.replay)
# ---------------------------------------------------------------------------------------------


def validate_sample_proportional(prefix, u) -> int:
    """The argument checks of ``sample_proportional``; returns the item count N."""
    check_f32_array("prefix", prefix, ndim=1)
    check_f32_array("u", u, ndim=1)
    n_items = prefix.shape[0]
    if n_items == 0:
        raise ValueError("prefix: shape (0,) is empty; need at least one item to sample")
    return n_items


def validate_importance_weights(priorities, idx, beta, n_valid) -> tuple[np.float32, int]:
    """The argument checks of ``importance_weights``; returns ``(beta, n_valid)`` as float32 and
    int."""
    check_f32_array("priorities", priorities, ndim=1)
    check_array("idx", idx, np.int32, ndim=1)
    capacity = priorities.shape[0]
    if capacity == 0:
        raise ValueError("priorities: shape (0,) is empty; need at least one item")
    n = check_int("n_valid", n_valid, minimum=1, maximum=capacity)
    beta32 = check_f32_scalar("beta", beta, lo=0.0, hi=1.0)
    if idx.size and (idx.min() < 0 or idx.max() >= n):
        raise ValueError(f"idx: values in [{idx.min()}, {idx.max()}] not allowed; every index "
                         f"must lie in [0, n_valid={n})")
    return beta32, n


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------


def prefix_sum(p: np.ndarray) -> np.ndarray:
    """Inclusive prefix sums ``s_i = p_0 + ... + p_i`` in float32.

    Accumulation order: sequential, left to right, one float32 rounding per addition
    (``s_i = fl(s_{i-1} + p_i)``). The fast scan associates differently; for non-negative
    priorities both are within ``gamma_i * s_i`` (``gamma_i = i u / (1 - i u)``, ``u = 2^-24``)
    of the exact prefix sum.

    Shapes: ``p`` float32[N] (N >= 0). Returns float32[N].
    NaN contract: plain sums; a NaN (or +Inf) priority makes every later prefix NaN (or +Inf).
    """
    check_f32_array("p", p, ndim=1)
    with np.errstate(over="ignore", invalid="ignore"):
        return np.cumsum(p, dtype=np.float32)


#: The collection cycle's scan (``scan_tiles``/``scan_offsets``; ``cuda_src/replay.cu``'s
#: ``RING_SCAN_*``): threads per block, elements per thread, elements per block (a tile).
RING_SCAN_THREADS, RING_SCAN_ITEMS = 256, 4
RING_SCAN_TILE = RING_SCAN_THREADS * RING_SCAN_ITEMS
WARP = 32


class ScanTiles(NamedTuple):
    """Outputs of ``scan_tiles``: ``s`` f32 ``[n]`` (each tile's own inclusive scan) and
    ``block_sums`` f32 ``[ceil(n / RING_SCAN_TILE)]`` (each tile's total)."""

    s: np.ndarray
    block_sums: np.ndarray


def scan_blocks(n: int) -> int:
    """The tiles (blocks) of the ring scan over ``n`` elements: ``ceil(n / RING_SCAN_TILE)``."""
    return -(-n // RING_SCAN_TILE)


def _warp_tree(v: np.ndarray) -> np.ndarray:
    """The kernel's inclusive Hillis-Steele scan along the last axis (lanes): at step ``d``,
    lane ``i >= d`` becomes ``fl(v[i - d] + v[i])``, with the values of the step before."""
    v = v.copy()
    d = 1
    while d < v.shape[-1]:
        v[..., d:] = v[..., :-d] + v[..., d:]
        d *= 2
    return v


def _exclusive(incl: np.ndarray) -> np.ndarray:
    """The exclusive scan by shifting the inclusive one a lane (lane 0: -0.0, the identity)."""
    out = np.empty_like(incl)
    out[..., 0] = -0.0
    out[..., 1:] = incl[..., :-1]
    return out


def validate_scan_tiles(p) -> int:
    check_f32_array("p", p, ndim=1)
    if p.shape[0] == 0:
        raise ValueError("p: shape (0,) is empty; need at least one priority to scan")
    return p.shape[0]


def scan_tiles(p: np.ndarray) -> ScanTiles:
    """Each tile's own inclusive scan and total: the first of the ring's two scan kernels.

    Tile ``b`` holds ``p[b*T : (b+1)*T]`` (``T = RING_SCAN_TILE = 1024``; missing elements read
    as ``-0.0``, the additive identity that leaves every sum bit for bit). Within a tile, thread
    ``t`` owns the ``RING_SCAN_ITEMS`` consecutive elements from ``t * RING_SCAN_ITEMS``:
    ``loc_k`` their sequential sums; the thread totals of each warp go through the Hillis-Steele
    tree (``_warp_tree``), the warp totals through the same tree; with the exclusive scans
    (shifts) ``lane_excl``, ``warp_excl``:
    ``l = fl( fl(warp_excl + lane_excl) + loc_k )``. ``block_sums[b]`` is ``l`` at the tile's
    last element (bit for bit the value the kernel wrote there).

    Shapes: ``p`` f32 ``[n]``, ``n >= 1``. Returns ``ScanTiles``. Exact twin of the kernel (the
    same additions in the same association; NaN/Inf propagate as IEEE additions do).
    """
    n = validate_scan_tiles(p)
    nb = scan_blocks(n)
    x = np.full(nb * RING_SCAN_TILE, -0.0, F32)
    x[:n] = p
    x = x.reshape(nb, RING_SCAN_THREADS // WARP, WARP, RING_SCAN_ITEMS)
    with np.errstate(over="ignore", invalid="ignore"):
        loc = np.add.accumulate(x, axis=-1, dtype=F32)
        lane_incl = _warp_tree(loc[..., -1])
        warp_excl = _exclusive(_warp_tree(lane_incl[..., -1]))
        base = warp_excl[..., None] + _exclusive(lane_incl)
        s = (base[..., None] + loc).reshape(-1)[:n]
    ends = np.minimum(np.arange(1, nb + 1) * RING_SCAN_TILE, n) - 1
    return ScanTiles(s=s, block_sums=s[ends].copy())


def validate_scan_offsets(s, block_sums) -> int:
    n = validate_scan_tiles(s)
    check_f32_array("block_sums", block_sums, ndim=1)
    if block_sums.shape != (scan_blocks(n),):
        raise ValueError(f"block_sums: shape {block_sums.shape} not allowed; expected "
                         f"({scan_blocks(n)},) = ceil(n / {RING_SCAN_TILE}) for n = {n}")
    return n


def scan_offsets(s: np.ndarray, block_sums: np.ndarray) -> np.ndarray:
    """The second of the ring's scan kernels: each tile's scan plus the sum of the tiles before.

    ``off_b = fl(...fl(fl(-0.0 + T_0) + T_1)... + T_{b-1})`` (sequential over ``block_sums``;
    ``off_0 = -0.0``) and ``out_i = fl(off_b + s_i)`` for ``i`` in tile ``b``. With non-negative
    priorities no sum decreases across a tile boundary: the last sum of tile ``b`` is
    ``fl(off_b + T_b) = off_{b+1}``.

    Shapes: ``s`` f32 ``[n]`` (``scan_tiles``' ``s``), ``block_sums`` f32
    ``[ceil(n / RING_SCAN_TILE)]``. Returns f32 ``[n]`` (new). Exact twin of the kernel.
    (Within a tile, a thread's first sum can round an ulp below the previous thread's last, as
    in ``prefix_sum``'s kernel; ``sample_proportional`` then still returns a row ``i`` with
    ``prefix[i - 1] <= target < prefix[i]``.)
    """
    n = validate_scan_offsets(s, block_sums)
    off = np.empty(block_sums.shape, F32)
    off[0] = -0.0
    with np.errstate(over="ignore", invalid="ignore"):
        off[1:] = np.add.accumulate(block_sums, dtype=F32)[:-1]
        return np.repeat(off, RING_SCAN_TILE)[:n] + s


def ring_prefix_sum(p: np.ndarray) -> np.ndarray:
    """The collection cycle's prefix sums of the ring's priorities: ``scan_offsets`` of
    ``scan_tiles(p)`` (the order of both kernels; within ``gamma_n * s_i`` of the exact sum for
    non-negative priorities, like ``prefix_sum``'s, whose sequential order it does not follow).

    NaN contract: ``s_j`` is a float32 sum of ``p_0 .. p_j``, so a NaN ``p_i`` makes every
    ``s_j``, ``j >= i``, NaN; a +Inf gives +Inf (NaN with a -Inf or NaN term); a finite overflow
    follows this association. Shapes: ``p`` f32 ``[n]``, ``n >= 1``; returns f32 ``[n]``.
    """
    tiles = scan_tiles(p)
    return scan_offsets(tiles.s, tiles.block_sums)


def sample_proportional(prefix: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Proportional sampling: index ``i`` with probability ``p_i / total``.

    ``target = u_k * total`` (float32, ``total = prefix[N-1]``); the sample is the first ``i``
    with ``prefix[i] > target``, found by the binary search::

        lo, hi = 0, N - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if prefix[mid] > target: hi = mid
            else:                     lo = mid + 1

    which returns ``N - 1`` when no prefix exceeds the target (the clamp to ``N - 1``).

    Shapes: ``prefix`` float32[N], N >= 1 (from ``prefix_sum``); ``u`` float32[n] uniforms in
    [0, 1). Returns int32[n].

    Contract: an item with zero priority is never sampled while ``total > 0`` (its prefix equals
    the previous one, so an earlier index already exceeds the target; for ``i = 0``,
    ``prefix[0] = 0 > target`` is false). ``u < 1`` gives ``target < total`` in float32, so the
    clamp never fires for valid uniforms. Degenerate inputs, defined rather than raised:
    ``total = 0``, a NaN target (NaN ``u`` or NaN total) or ``u >= 1`` give ``N - 1`` (every
    comparison with NaN is false); ``u < 0`` gives the first index whose prefix exceeds the
    negative target (0 for non-negative priorities).
    """
    n_items = validate_sample_proportional(prefix, u)
    with np.errstate(over="ignore", invalid="ignore"):
        target = u * prefix[-1]
    lo = np.zeros(u.shape, dtype=np.int64)
    hi = np.full(u.shape, n_items - 1, dtype=np.int64)
    active = lo < hi
    while np.any(active):
        mid = (lo + hi) // 2
        with np.errstate(invalid="ignore"):
            right_of_target = prefix[mid] > target
        hi = np.where(active & right_of_target, mid, hi)
        lo = np.where(active & ~right_of_target, mid + 1, lo)
        active = lo < hi
    return lo.astype(np.int32)


def importance_weights(priorities: np.ndarray, idx: np.ndarray, beta: float,
                       n_valid: int) -> np.ndarray:
    """PER importance weights ``w_k = (N P(i_k))^-beta / max_j (N P(i_j))^-beta``.

    ``P(i) = p_i / total``, ``N = n_valid``. Normalisation choice: by the maximum over the
    *sampled batch* (not over the whole buffer, which would need a second reduction over all
    N priorities each step), so the largest weight of every batch is exactly 1 and all weights
    lie in (0, 1] (for positive priorities). Since ``x^-beta`` decreases, the batch maximum is at
    the smallest sampled priority, and ``N`` and ``total`` cancel exactly::

        w_k = (p_min / p_{i_k}) ^ beta,   p_min = fminf-reduce_k p_{i_k}

    which is what the kernel computes in float32 (one division, one ``powf`` per sample): no
    dependency on the total, and no overflow of ``(N P)^-beta`` for tiny probabilities.

    Shapes: ``priorities`` float32[capacity]; ``idx`` int32[n] with ``0 <= idx < n_valid``
    (raise otherwise: the kernel would read outside the valid items); ``beta`` in [0, 1];
    ``n_valid`` an int in [1, capacity]. Returns float32[n].

    NaN contract: ``beta = 0`` gives exactly 1 everywhere (``powf(x, 0) = 1``). ``p_min`` is an
    ``fminf`` reduction, so a NaN priority only affects its own weight (NaN). A sampled zero
    priority (only when the whole buffer has total 0) gives ``0/0 = NaN`` for itself and weight
    0 for the others, as the unsimplified formula does (Inf / Inf and x / Inf).
    """
    beta32, _ = validate_importance_weights(priorities, idx, beta, n_valid)
    p = priorities[idx]
    if p.size == 0:
        return np.zeros(0, dtype=np.float32)
    p_min = np.fmin.reduce(p)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        return np.power(p_min / p, beta32).astype(np.float32, copy=False)


# ---------------------------------------------------------------------------------------------
# The device-resident ring
# ---------------------------------------------------------------------------------------------


class RingAdd(NamedTuple):
    """Outputs of ``replay_add``: the ring's arrays after the write (``RING_FIELDS`` order, each
    ``ring_<field>``), ``priority`` and the advanced ``ring_pos``."""

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


class Gathered(NamedTuple):
    """Outputs of ``replay_gather``, laid out as the step's batch buffers: ``x`` f32
    ``[2n, state_dim]`` (``s`` rows, then ``s2`` rows), ``a`` int32 ``[n_branches, n]``
    (transposed: one row per branch), ``r``, ``done``, ``next_ret`` f32 ``[n]``, ``regime``
    int32 ``[n]``, ``discount`` f32 ``[n]``."""

    x: np.ndarray
    a: np.ndarray
    r: np.ndarray
    done: np.ndarray
    next_ret: np.ndarray
    regime: np.ndarray
    discount: np.ndarray


class Priorities(NamedTuple):
    """Outputs of ``replay_update_priorities``: ``priority`` f32 ``[capacity]`` and
    ``max_priority`` f32 ``[1]``."""

    priority: np.ndarray
    max_priority: np.ndarray


def validate_ring(**ring) -> tuple[int, int, int]:
    """The ring arrays given as ``ring_<field>=array`` (every field of ``RING_FIELDS``): dtypes
    and shapes agree; returns ``(capacity, state_dim, n_branches)``."""
    for name, dtype, row in RING_FIELDS:
        check_array(f"ring_{name}", ring[f"ring_{name}"], dtype, ndim=2 if row else 1)
    capacity, state_dim = ring["ring_s"].shape
    n_branches = ring["ring_a"].shape[1]
    if capacity == 0 or state_dim == 0 or n_branches == 0:
        raise ValueError(f"ring_s, ring_a: shapes {ring['ring_s'].shape}, {ring['ring_a'].shape}"
                         " are empty; need capacity, state_dim and n_branches >= 1")
    for name, _, row in RING_FIELDS:
        want = (capacity, {"s": state_dim, "s2": state_dim, "a": n_branches}[name]) if row else (capacity,)
        got = ring[f"ring_{name}"].shape
        if got != want:
            raise ValueError(f"ring_{name}: shape {got} not allowed; expected {want} (the ring's "
                             "capacity, state_dim and n_branches)")
    return capacity, state_dim, n_branches


def validate_ring_pos(ring_pos, capacity: int) -> tuple[int, int]:
    """``ring_pos`` int32 ``[2]`` = ``(cursor, size)`` with ``0 <= cursor < capacity`` and
    ``0 <= size <= capacity`` (raise otherwise: a kernel would write or read outside the ring);
    returns them."""
    check_array("ring_pos", ring_pos, I32, ndim=1)
    if ring_pos.shape != (2,):
        raise ValueError(f"ring_pos: shape {ring_pos.shape} not allowed; expected (2,) = (cursor, size)")
    cursor, size = int(ring_pos[0]), int(ring_pos[1])
    if not (0 <= cursor < capacity and 0 <= size <= capacity):
        raise ValueError(f"ring_pos: (cursor, size) = ({cursor}, {size}) not allowed; need 0 <= "
                         f"cursor < capacity = {capacity} and 0 <= size <= capacity")
    return cursor, size


def _check_items(name: str, x, dtype, shape: tuple) -> None:
    check_array(name, x, dtype, ndim=len(shape))
    if x.shape != shape:
        raise ValueError(f"{name}: shape {x.shape} not allowed; expected {shape}")


def validate_replay_add(s, a, r, s2, done, next_ret, regime, discount, ring, priority, ring_pos,
                        max_priority, n_valid=None) -> tuple[int, int]:
    """The argument checks of ``replay_add`` (``ring``: the ring arrays by parameter name);
    returns ``(n, cursor)`` (``n``: the rows given; ``n_valid`` may write fewer)."""
    capacity, state_dim, n_branches = validate_ring(**ring)
    check_f32_array("s", s, ndim=2)
    n = s.shape[0]
    if not 1 <= n <= capacity:
        raise ValueError(f"s: {n} transitions not allowed; expected 1 to capacity = {capacity}")
    for name, x, dtype, shape in (("s", s, F32, (n, state_dim)), ("a", a, I32, (n, n_branches)),
                                  ("r", r, F32, (n,)), ("s2", s2, F32, (n, state_dim)),
                                  ("done", done, F32, (n,)), ("next_ret", next_ret, F32, (n,)),
                                  ("regime", regime, I32, (n,)), ("discount", discount, F32, (n,)),
                                  ("priority", priority, F32, (capacity,)),
                                  ("max_priority", max_priority, F32, (1,))):
        _check_items(name, x, dtype, shape)
    cursor, _ = validate_ring_pos(ring_pos, capacity)
    if n_valid is not None:
        _check_items("n_valid", n_valid, I32, (1,))
        if not 0 <= int(n_valid[0]) <= n:
            raise ValueError(f"n_valid: {int(n_valid[0])} not allowed; need 0 <= n_valid <= n = {n} "
                             "(the rows given)")
    return n, cursor


def replay_add(s: np.ndarray, a: np.ndarray, r: np.ndarray, s2: np.ndarray, done: np.ndarray,
               next_ret: np.ndarray, regime: np.ndarray, discount: np.ndarray, ring_s: np.ndarray,
               ring_a: np.ndarray, ring_r: np.ndarray, ring_s2: np.ndarray,
               ring_done: np.ndarray, ring_next_ret: np.ndarray, ring_regime: np.ndarray,
               ring_discount: np.ndarray, priority: np.ndarray, ring_pos: np.ndarray,
               max_priority: np.ndarray, n_valid: np.ndarray | None = None) -> RingAdd:
    """Write the first ``m`` of ``n`` transitions into the ring at its cursor: ``m = n``, or
    ``m = n_valid[0]`` where ``n_valid`` (int32 ``[1]``, read on the device: ``nstep_window``'s
    count) is given.

    Transition ``k < m`` goes to row ``(cursor + k) % capacity`` of every ``ring_<field>``, with
    priority ``max_priority[0]`` (the running maximum: a new transition is sampled with high
    probability before its TD error is known); then ``cursor <- (cursor + m) % capacity``,
    ``size <- min(size + m, capacity)``. A full ring overwrites its oldest rows.

    Shapes: ``s``, ``s2`` f32 ``[n, state_dim]``, ``a`` int32 ``[n, n_branches]``, ``r``,
    ``done``, ``next_ret``, ``discount`` f32 ``[n]``, ``regime`` int32 ``[n]`` with
    ``1 <= n <= capacity``, ``0 <= n_valid[0] <= n``; the ring as in the module docstring.
    Returns ``RingAdd`` (new arrays; inputs unchanged).
    Exact: copies only. NaN contract: values are stored as given (NaN/Inf states and rewards
    included: the step's sentinels flag them); ``ring_pos`` outside its range raises.
    """
    ring = dict(ring_s=ring_s, ring_a=ring_a, ring_r=ring_r, ring_s2=ring_s2, ring_done=ring_done,
                ring_next_ret=ring_next_ret, ring_regime=ring_regime, ring_discount=ring_discount)
    n, _ = validate_replay_add(s, a, r, s2, done, next_ret, regime, discount, ring, priority,
                               ring_pos, max_priority, n_valid)
    m = n if n_valid is None else int(n_valid[0])
    new = {key: arr.copy() for key, arr in ring.items()}
    prio, pos = priority.copy(), ring_pos.copy()
    given = dict(s=s, a=a, r=r, s2=s2, done=done, next_ret=next_ret, regime=regime,
                 discount=discount)
    write_transitions({name: new[f"ring_{name}"] for name, _, _ in RING_FIELDS}, prio, pos,
                      max_priority, {name: x[:m] for name, x in given.items()})
    return RingAdd(**new, priority=prio, ring_pos=pos)


def write_transitions(ring: dict, priority: np.ndarray, ring_pos: np.ndarray,
                      max_priority: np.ndarray, transitions: dict) -> None:
    """``replay_add`` in place, on checked arguments: ``ring`` and ``transitions`` keyed by the
    ``RING_FIELDS`` names (the host ring of ``foxhunt.reference.collector`` writes through this,
    without copying the whole ring per cycle)."""
    capacity = priority.shape[0]
    cursor, size = int(ring_pos[0]), int(ring_pos[1])
    n = transitions["r"].shape[0]
    rows = (cursor + np.arange(n)) % capacity
    for name, _, _ in RING_FIELDS:
        ring[name][rows] = transitions[name]
    priority[rows] = max_priority[0]
    ring_pos[:] = (cursor + n) % capacity, min(size + n, capacity)


# ---------------------------------------------------------------------------------------------
# n-step transitions (issue 22)
# ---------------------------------------------------------------------------------------------


class NStepWindow(NamedTuple):
    """Outputs of ``nstep_window``: the windows after the step (``win_*``, ``win_len``), the
    emitted transitions in rows ``[0, n_out)`` of ``out_*`` (later rows keep their values) and
    their count ``n_out`` int32 ``[1]``."""

    win_s: np.ndarray
    win_a: np.ndarray
    win_r: np.ndarray
    win_next_ret: np.ndarray
    win_regime: np.ndarray
    win_len: np.ndarray
    out_s: np.ndarray
    out_a: np.ndarray
    out_r: np.ndarray
    out_s2: np.ndarray
    out_done: np.ndarray
    out_next_ret: np.ndarray
    out_regime: np.ndarray
    out_discount: np.ndarray
    n_out: np.ndarray


def nstep_buffers(n_envs: int, n_step: int, state_dim: int,
                  n_branches: int) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
    """``nstep_window``'s windows (``win_*``: the state a collector keeps between steps) and
    outputs (``out_*``: ``n_envs * n_step`` rows, the most one step can emit): name ->
    ``(dtype, shape)``."""
    N, n, SD, nb = n_envs, n_step, state_dim, n_branches
    return {"win_s": (F32, (N, n, SD)), "win_a": (I32, (N, n, nb)), "win_r": (F32, (N, n)),
            "win_next_ret": (F32, (N, n)), "win_regime": (I32, (N, n)), "win_len": (I32, (N,)),
            "out_s": (F32, (N * n, SD)), "out_a": (I32, (N * n, nb)), "out_r": (F32, (N * n,)),
            "out_s2": (F32, (N * n, SD)), "out_done": (F32, (N * n,)),
            "out_next_ret": (F32, (N * n,)), "out_regime": (I32, (N * n,)),
            "out_discount": (F32, (N * n,))}


def nstep_counts(win_len: np.ndarray, done: np.ndarray, n_step: int) -> np.ndarray:
    """Transitions each env emits this step (int64 ``[n_envs]``): with ``L = win_len + 1``
    entries after the step, all ``L`` if the episode ended (``done != 0``), else 1 if
    ``L == n_step``, else 0."""
    L = win_len.astype(np.int64) + 1
    return np.where(done != 0, L, np.where(L == n_step, 1, 0))


def validate_nstep_window(obs, actions, r, done, s2, next_ret, regime, win, out, n_step,
                          gamma_ref) -> tuple[int, int, int, np.float32]:
    """The argument checks of ``nstep_window`` (``win``/``out``: its window and output arrays
    by parameter name); returns ``(n_envs, state_dim, n_branches, gamma_ref)``."""
    check_f32_array("obs", obs, ndim=2)
    check_array("actions", actions, I32, ndim=2)
    N, SD = obs.shape
    nb = actions.shape[1]
    if N == 0 or SD == 0 or nb == 0:
        raise ValueError(f"obs, actions: shapes {obs.shape}, {actions.shape} are empty; need "
                         "n_envs, state_dim and n_branches >= 1")
    n = check_int("n_step", n_step, minimum=1, maximum=MAX_N_STEP)
    g = check_f32_scalar("gamma_ref", gamma_ref, lo=0.0, hi=1.0)
    shapes = {"actions": (I32, (N, nb)), "r": (F32, (N,)), "done": (F32, (N,)),
              "s2": (F32, (N, SD)), "next_ret": (F32, (N,)), "regime": (I32, (N,)),
              **nstep_buffers(N, n, SD, nb)}
    given = dict(actions=actions, r=r, done=done, s2=s2, next_ret=next_ret, regime=regime,
                 **win, **out)
    for name, (dtype, shape) in shapes.items():
        _check_items(name, given[name], dtype, shape)
    bad = (win["win_len"] < 0) | (win["win_len"] >= n)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"win_len[{i}]={int(win['win_len'][i])} not allowed; a window holds "
                         f"0 to n_step - 1 = {n - 1} pending steps between steps")
    return N, SD, nb, g


def nstep_window(obs: np.ndarray, actions: np.ndarray, r: np.ndarray, done: np.ndarray,
                 s2: np.ndarray, next_ret: np.ndarray, regime: np.ndarray, win_s: np.ndarray,
                 win_a: np.ndarray, win_r: np.ndarray, win_next_ret: np.ndarray,
                 win_regime: np.ndarray, win_len: np.ndarray, out_s: np.ndarray,
                 out_a: np.ndarray, out_r: np.ndarray, out_s2: np.ndarray, out_done: np.ndarray,
                 out_next_ret: np.ndarray, out_regime: np.ndarray, out_discount: np.ndarray,
                 n_step: int, gamma_ref: float) -> NStepWindow:
    """One environment step of every env into its n-step window; the finished transitions out.

    Env ``e``'s window holds its last ``win_len[e] < n_step`` steps not yet emitted (slot 0 the
    oldest: ``win_s`` the state, ``win_a`` the actions, ``win_r`` the scaled reward,
    ``win_next_ret``/``win_regime`` the auxiliary labels of that step). This step
    (``obs``: the state it started from, ``actions``, ``r``, ``done``, ``s2``, the labels) joins
    as entry ``L - 1``, ``L = win_len[e] + 1``. Then ``count_e`` entries are emitted
    (``nstep_counts``): all ``L`` when the episode ended (``done[e] != 0``; each entry ``j`` with
    its own ``k = L - j``), else the oldest (``k = n_step``) once ``L = n_step``, else none.
    Entry ``j`` emitted with ``k`` steps (``rw_i`` the reward of entry ``i``)::

        r        = fl(...fl(fl(rw_j + fl(g_1 rw_{j+1})) + fl(g_2 rw_{j+2}))... + fl(g_{k-1} rw_{j+k-1}))
        discount = g_k,   g_1 = gamma_ref,  g_{i+1} = fl(g_i * gamma_ref)   (gamma_ref ** k)
        s2 = s2[e] (the state k steps on: this step's, before any reset), done = done[e],
        s, a, next_ret, regime = entry j's

    (float32, no fused multiply-add; ``r = rw_j`` exactly when ``k = 1``). Rows: env by env,
    each env's entries oldest first, from row ``sum_{e' < e} count_e'``; ``n_out[0]`` the total;
    rows from ``n_out`` on keep their values. The window after the step: empty when the episode
    ended (its slots keep their stale values), the entries ``1 .. n_step - 1`` moved to slots
    ``0 .. n_step - 2`` when the oldest left, else the new entry in slot ``L - 1``.
    ``n_step = 1`` emits every step as it is (``r``, ``done``, ``s2``; ``discount =
    gamma_ref``), in env order: the 1-step transitions.

    Shapes: ``obs``, ``s2`` f32 ``[N, state_dim]``, ``actions`` int32 ``[N, n_branches]``,
    ``r``, ``done``, ``next_ret`` f32 ``[N]``, ``regime`` int32 ``[N]``; ``win_s`` f32
    ``[N, n_step, state_dim]``, ``win_a`` int32 ``[N, n_step, n_branches]``, ``win_r``,
    ``win_next_ret`` f32 / ``win_regime`` int32 ``[N, n_step]``, ``win_len`` int32 ``[N]`` in
    ``[0, n_step)``; ``out_*`` ``[N * n_step, ...]`` (the most one step can emit); ``n_step`` in
    ``[1, MAX_N_STEP]``, ``gamma_ref`` in ``[0, 1]``. Returns ``NStepWindow`` (new arrays).
    NaN contract: values are moved as given; a NaN or Inf reward makes the ``r`` of every
    transition whose window holds it NaN/Inf (the step's sentinels flag it), nothing else.
    """
    win = dict(win_s=win_s, win_a=win_a, win_r=win_r, win_next_ret=win_next_ret,
               win_regime=win_regime, win_len=win_len)
    out = dict(out_s=out_s, out_a=out_a, out_r=out_r, out_s2=out_s2, out_done=out_done,
               out_next_ret=out_next_ret, out_regime=out_regime, out_discount=out_discount)
    N, _, _, g = validate_nstep_window(obs, actions, r, done, s2, next_ret, regime, win, out,
                                       n_step, gamma_ref)
    win = {k: v.copy() for k, v in win.items()}
    out = {k: v.copy() for k, v in out.items()}
    counts = nstep_counts(win_len, done, n_step)
    step = dict(s=obs, a=actions, r=r, next_ret=next_ret, regime=regime)
    row = 0
    with np.errstate(over="ignore", invalid="ignore"):
        for e in range(N):
            L0 = int(win_len[e])
            # the window's L0 pending entries, then this step's: entries 0 .. L0
            ent = {k: np.concatenate([win[f"win_{k}"][e, :L0], step[k][e][None]])
                   for k in step}
            for j in range(int(counts[e])):
                k = L0 + 1 - j
                acc, gk = ent["r"][j], g
                for i in range(1, k):
                    acc = np.float32(acc + np.float32(gk * ent["r"][j + i]))
                    gk = np.float32(gk * g)
                out["out_s"][row], out["out_a"][row] = ent["s"][j], ent["a"][j]
                out["out_r"][row], out["out_s2"][row], out["out_done"][row] = acc, s2[e], done[e]
                out["out_next_ret"][row], out["out_regime"][row] = ent["next_ret"][j], ent["regime"][j]
                out["out_discount"][row] = gk
                row += 1
            if done[e] != 0:
                win["win_len"][e] = 0
            elif counts[e]:  # the oldest left: entries 1 .. L0 move down a slot
                for key in step:
                    win[f"win_{key}"][e, :L0] = ent[key][1:]
                win["win_len"][e] = L0
            else:
                for key in step:
                    win[f"win_{key}"][e, L0] = ent[key][L0]
                win["win_len"][e] = L0 + 1
    return NStepWindow(**win, **out, n_out=np.array([row], I32))


def validate_cycle(cycle) -> int:
    """The collector's cycle counter: int64 ``[1]``, non-negative (the draws' offset); returns
    it."""
    _check_items("cycle", cycle, I64, (1,))
    if cycle[0] < 0:
        raise ValueError(f"cycle: {int(cycle[0])} not allowed; the counter is >= 0")
    return int(cycle[0])


def cycle_advance(cycle: np.ndarray) -> np.ndarray:
    """``cycle + 1`` (int64 ``[1]``): the collector's counter, advanced at the end of every
    collection cycle. Exact (the counter never gets near 2**63)."""
    return np.array([validate_cycle(cycle) + 1], I64)


def validate_replay_sample(prefix, ring_pos, key, cycle, n) -> tuple[int, int, int]:
    """The argument checks of ``replay_sample``; returns ``(n, key, cycle)``."""
    check_f32_array("prefix", prefix, ndim=1)
    if prefix.shape[0] == 0:
        raise ValueError("prefix: shape (0,) is empty; need the ring's prefix sums")
    validate_ring_pos(ring_pos, prefix.shape[0])
    key = check_int("key", key, minimum=0, maximum=rng.MAX_U64 - 1)
    offset = validate_cycle(cycle)
    n = check_int("n", n, minimum=0, maximum=2**31 - 1)
    return n, key, offset


def replay_sample(prefix: np.ndarray, ring_pos: np.ndarray, key: int, cycle: np.ndarray,
                  n: int) -> np.ndarray:
    """Proportional sampling of ``n`` ring rows with the counter-based generator.

    ``u_k = rng.uniform(key, STREAMS["replay_sample"], cycle[0], k)`` and
    ``idx = sample_proportional(prefix[:max(size, 1)], u)`` with ``size = ring_pos[1]``: the
    search runs over the filled rows only, so the clamp of ``sample_proportional`` (a NaN
    total, or every priority zero) lands on a filled row. ``prefix`` is ``prefix_sum`` of the
    whole ring's priorities (zero beyond ``size``, so ``prefix[size - 1]`` is the total).

    Shapes: ``prefix`` f32 ``[capacity]``, ``ring_pos`` int32 ``[2]``, ``key`` the run's seed
    (an integer in ``[0, 2**64)``), ``cycle`` int64 ``[1]`` (the collector's cycle counter, read
    on the device; ``validate_cycle``). Returns int32 ``[n]``. Exact (the draws are exact; the search is
    ``sample_proportional``'s). NaN contract: ``sample_proportional``'s.
    """
    n, key, offset = validate_replay_sample(prefix, ring_pos, key, cycle, n)
    u = rng.uniform(key, rng.STREAMS["replay_sample"], offset, np.arange(n, dtype=np.int64))
    return sample_proportional(prefix[:max(int(ring_pos[1]), 1)], u)


def validate_replay_gather(idx, ring) -> tuple[int, int, int]:
    """The argument checks of ``replay_gather``; returns ``(n, state_dim, n_branches)``."""
    capacity, state_dim, n_branches = validate_ring(**ring)
    check_array("idx", idx, I32, ndim=1)
    if idx.size and (idx.min() < 0 or idx.max() >= capacity):
        raise ValueError(f"idx: values in [{idx.min()}, {idx.max()}] not allowed; every index "
                         f"must lie in [0, capacity={capacity})")
    return idx.shape[0], state_dim, n_branches


def replay_gather(idx: np.ndarray, ring_s: np.ndarray, ring_a: np.ndarray, ring_r: np.ndarray,
                  ring_s2: np.ndarray, ring_done: np.ndarray, ring_next_ret: np.ndarray,
                  ring_regime: np.ndarray, ring_discount: np.ndarray) -> Gathered:
    """The sampled rows ``idx`` of the ring, in the step's batch layout (``Gathered``):
    ``x = [ring_s[idx]; ring_s2[idx]]``, ``a = ring_a[idx]^T``, ``r``, ``done``, ``next_ret``,
    ``regime``, ``discount`` gathered.

    Shapes: ``idx`` int32 ``[n]`` in ``[0, capacity)`` (raise otherwise: the kernel would read
    outside the ring). Exact: copies only; values (NaN included) are copied as stored.
    """
    ring = dict(ring_s=ring_s, ring_a=ring_a, ring_r=ring_r, ring_s2=ring_s2, ring_done=ring_done,
                ring_next_ret=ring_next_ret, ring_regime=ring_regime, ring_discount=ring_discount)
    validate_replay_gather(idx, ring)
    return Gathered(x=np.concatenate([ring_s[idx], ring_s2[idx]]),
                    a=np.ascontiguousarray(ring_a[idx].T), r=ring_r[idx], done=ring_done[idx],
                    next_ret=ring_next_ret[idx], regime=ring_regime[idx],
                    discount=ring_discount[idx])


def validate_replay_update_priorities(td, idx, priority, max_priority, alpha,
                                      eps) -> tuple[np.float32, np.float32]:
    """The argument checks of ``replay_update_priorities``; returns ``(alpha, eps)`` as
    float32."""
    check_f32_array("td", td, ndim=1)
    check_f32_array("priority", priority, ndim=1)
    capacity = priority.shape[0]
    if capacity == 0:
        raise ValueError("priority: shape (0,) is empty; need the ring's priorities")
    _check_items("idx", idx, I32, td.shape)
    _check_items("max_priority", max_priority, F32, (1,))
    if idx.size and (idx.min() < 0 or idx.max() >= capacity):
        raise ValueError(f"idx: values in [{idx.min()}, {idx.max()}] not allowed; every index "
                         f"must lie in [0, capacity={capacity})")
    alpha32 = check_f32_scalar("alpha", alpha, lo=0.0, hi=1.0)
    eps32 = check_f32_scalar("eps", eps, lo=0.0, lo_open=True)
    return alpha32, eps32


def last_occurrence(idx: np.ndarray) -> np.ndarray:
    """Boolean mask of the positions ``k`` whose ``idx[k]`` does not occur again after ``k``
    (the write that lands when a batch samples one row several times)."""
    later = np.zeros(idx.shape, bool)
    _, first_from_end = np.unique(idx[::-1], return_index=True)
    later[idx.shape[0] - 1 - first_from_end] = True
    return later


def replay_update_priorities(td: np.ndarray, idx: np.ndarray, priority: np.ndarray,
                             max_priority: np.ndarray, alpha: float, eps: float) -> Priorities:
    """New priorities of the sampled rows from the step's TD errors.

    ``p_k = (|td_k| + eps)^alpha`` in float32 (one rounding for the sum, one ``powf``) for a
    finite ``td_k``; a non-finite ``td_k`` gives ``p_k = m0``, the running maximum before this
    update (the row stays likely to be sampled again, instead of keeping a stale priority).
    ``priority[idx_k] = p_k``, where a row sampled several times takes the value of its last
    occurrence in the batch (``last_occurrence``); ``max_priority = fmax(m0, max_k p_k)``
    (``fmaxf`` reduction: a NaN ``m0`` is replaced).

    Shapes: ``td`` f32 ``[n]`` (the step's TD errors), ``idx`` int32 ``[n]`` in
    ``[0, capacity)``, ``priority`` f32 ``[capacity]``, ``max_priority`` f32 ``[1]``, ``alpha``
    in ``[0, 1]``, ``eps > 0``. Returns ``Priorities`` (new arrays).
    Numerics: the kernel's ``powf`` is within a few ulp of NumPy's; the maximum and the writes
    are exact.
    """
    alpha32, eps32 = validate_replay_update_priorities(td, idx, priority, max_priority, alpha, eps)
    out, top = priority.copy(), max_priority.copy()
    write_priorities(td, idx, out, top, alpha32, eps32)
    return Priorities(priority=out, max_priority=top)


def write_priorities(td: np.ndarray, idx: np.ndarray, priority: np.ndarray,
                     max_priority: np.ndarray, alpha: np.float32, eps: np.float32) -> None:
    """``replay_update_priorities`` in place, on checked arguments (float32 ``alpha``, ``eps``)."""
    m0 = max_priority[0]
    with np.errstate(over="ignore", invalid="ignore"):
        new = np.power(np.abs(td) + eps, alpha, dtype=F32)
    new = np.where(np.isfinite(td), new, m0).astype(F32)
    last = last_occurrence(idx)
    priority[idx[last]] = new[last]
    max_priority[0] = np.fmax.reduce(np.concatenate([max_priority, new]))


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

__all__ = [
    "Gathered", "KERNELS", "MAX_N_STEP", "NStepWindow", "Priorities", "RING_FIELDS", "RingAdd", "cycle_advance",
    "importance_weights",
    "last_occurrence", "nstep_buffers", "nstep_counts", "nstep_window", "prefix_sum", "replay_add", "ring_prefix_sum", "RING_SCAN_ITEMS",
    "RING_SCAN_THREADS", "RING_SCAN_TILE",
    "ScanTiles", "scan_blocks", "scan_offsets", "scan_tiles", "validate_scan_offsets",
    "validate_scan_tiles", "replay_gather", "replay_sample",
    "replay_update_priorities", "sample_proportional", "validate_importance_weights",
    "validate_cycle", "validate_nstep_window", "validate_replay_add", "validate_replay_gather", "validate_replay_sample",
    "validate_replay_update_priorities", "validate_ring", "validate_ring_pos",
    "validate_sample_proportional", "write_priorities", "write_transitions",
]
