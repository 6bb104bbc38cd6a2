"""Reference twin of walk.cu's ``greedy_walk_round``: the chunked (speculative) greedy walk
(issue 20). :func:`greedy_walk_round` is one round (one launch); its rounds composed,
:func:`greedy_walk_chunked`, give :func:`~foxhunt.reference.kernels.walk.greedy_walk`'s
records with the ``n_steps`` steps cut into ``n_chunks`` chunks (:func:`chunk_steps`) that walk
in parallel: round 0 walks every chunk from the guess flat, and each later round reruns a chunk
from its predecessor's end until it meets (merges with) its previous run's trace. After
``n_chunks`` rounds the records equal ``greedy_walk``'s bit for bit (:func:`greedy_walk_round`
states the algorithm and why it is exact). A state is carried as its key (:func:`walk_key`: time
in position, the position's and entry price's bits; :func:`key_state` its inverse), which with
the step index determines the rest of the walk.

Every step is :mod:`foxhunt.reference.kernels.walk`'s loop body (``walk._step``: the forward,
the margin, the greedy action, ``env_step``), so the float order, the conformance rule and the
NaN contract are that module's.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from foxhunt.reference.kernels.argcheck import check_int, require_array, require_shape
from foxhunt.reference.kernels.env import EnvState
from foxhunt.reference.kernels.walk import (
    WalkRecord,
    _observe,
    _records_in,
    _records_out,
    _step,
    _Walk,
    _walk,
    validate_greedy_walk,
)

F32, I32 = np.float32, np.int32


class WalkRoundState(NamedTuple):
    """The buffers one round of :func:`greedy_walk_round` reads and writes: ``trace`` int32
    ``[n_steps, 3]`` (the state key each step ran from), ``ends`` int32 ``[2, n_chunks, 3]``
    (each chunk's end key, double-buffered by round parity), the records float32 ``[n_steps]``
    (``rec_margin`` may be None: not written)."""

    trace: np.ndarray
    ends: np.ndarray
    rec_reward: np.ndarray
    rec_held: np.ndarray
    rec_cost: np.ndarray
    rec_margin: np.ndarray | None


#: The key of the flat state (the walk's start, and every chunk's guess in round 0).
FLAT_KEY = (0, 0, 0)


def walk_key(state: EnvState) -> np.ndarray:
    """int32 ``[3]``: ``(time_in_position, bits(position), bits(entry_price) if position != 0
    else 0)`` of the one env, floats as their bit patterns.

    Together with the step index ``k`` (``t = start + k``, ``steps = k``) the key determines the
    rest of the walk: ``steps`` only indexes the record rows (no episode length here), and the
    entry price of a flat env is dead. ``env_observe``'s unrealised PnL uses ``close`` in place
    of the entry when ``position == 0``, and ``env_step`` only copies the entry while flat
    (``entry' = filled ? P : fallback ? C' : entry``; a position opens only through a fill or a
    fallback, which overwrite it). Flat also implies ``time_in_position == 0`` on every walked
    state: the reset sets 0, and a live step ending flat has ``time' = (target != 0) = 0`` (a
    fill to flat), ``0`` (a fallback) or ``position != 0 ? time + 1 : 0 = 0`` (no trade from
    flat); the walk never steps a frozen env (``start + n_steps <= T - 1``). A flat position is
    +0.0 (``target = exposure - 1`` is an integer made float32). So every flat state has the
    key :data:`FLAT_KEY`."""
    position = state.position[0]
    entry = state.entry_price[:1].view(I32)[0] if position != 0 else 0
    return np.array([state.time_in_position[0], state.position[:1].view(I32)[0], entry], I32)


def key_state(key: np.ndarray, start: int, k: int) -> EnvState:
    """The env state of step ``k`` with ``key`` (:func:`walk_key`'s inverse): ``t = start + k``,
    ``steps = k``, the time, position and entry price from the key."""
    key = np.asarray(key, I32)
    one = np.ones(1, I32)
    return EnvState(one * (start + k), one * k, key[:1].copy(), key[1:2].view(F32).copy(),
                    key[2:3].view(F32).copy())


def chunk_steps(n_steps: int, n_chunks: int, g: int) -> tuple[int, int]:
    """Chunk ``g``'s steps ``[k0, k1)``: ``L = ceil(n_steps / n_chunks)``, ``k0 = min(g L,
    n_steps)``, ``k1 = min((g + 1) L, n_steps)`` (empty for the chunks past the walk's end)."""
    length = -(-n_steps // n_chunks)
    return min(g * length, n_steps), min((g + 1) * length, n_steps)


def validate_greedy_walk_round(params, param_offsets, dims, branches, bf16, z, isv, isv_index,
                               h2_clamp_mult, close, high, low, features, costs, start, n_steps,
                               n_chunks, round, trace, ends, rec_reward, rec_held, rec_cost,
                               rec_margin):
    """:func:`validate_greedy_walk`, then the round's own arguments; returns ``(T, start,
    n_steps, n_chunks, round)``. Shared with the fast test entry."""
    T, start, n_steps = validate_greedy_walk(
        params, param_offsets, dims, branches, bf16, z, isv, isv_index, h2_clamp_mult, close,
        high, low, features, costs, start, n_steps)
    n_chunks = check_int("n_chunks", n_chunks, minimum=1)
    round = check_int("round", round, minimum=0)
    require_array("trace", trace, np.dtype(I32), ndim=2)
    require_shape("trace", trace, (n_steps, 3), "[n_steps, 3]")
    require_array("ends", ends, np.dtype(I32), ndim=3)
    require_shape("ends", ends, (2, n_chunks, 3), "[2, n_chunks, 3]")
    records = (("rec_reward", rec_reward), ("rec_held", rec_held), ("rec_cost", rec_cost))
    if rec_margin is not None:
        records += (("rec_margin", rec_margin),)
    for name, rec in records:
        require_array(name, rec, np.dtype(F32), ndim=1)
        require_shape(name, rec, (n_steps,), "[n_steps]")
    return T, start, n_steps, n_chunks, round


def _run_chunk(walk: _Walk, start: int, key: np.ndarray, k0: int, k1: int, merge: bool,
               trace: np.ndarray, previous_end: np.ndarray, rec: list[np.ndarray],
               margins: np.ndarray | None) -> tuple[np.ndarray, list[np.ndarray]]:
    """Walk steps ``[k0, k1)`` from ``key`` (``trace``, ``margins`` in place); with ``merge``,
    stop at the first step ``k > k0`` whose key is ``trace[k]`` (the previous run's), ending as
    it ended. Returns ``(end key, rec)``."""
    state = key_state(key, start, k0)
    obs = _observe(walk, state)
    for k in range(k0, k1):
        now = walk_key(state)
        if merge and k > k0 and np.array_equal(now, trace[k]):
            return previous_end.copy(), rec
        trace[k] = now
        state, obs, rec, margin = _step(walk, state, obs, rec)
        if margins is not None:
            margins[k] = margin
    return walk_key(state), rec


def greedy_walk_round(params, param_offsets, dims, branches, bf16, z, isv, isv_index,
                      h2_clamp_mult, close, high, low, features, costs, start, n_steps, n_chunks,
                      round, trace, ends, rec_reward, rec_held, rec_cost,
                      rec_margin) -> WalkRoundState:
    """One round (one launch of walk.cu's ``greedy_walk_round``) of the chunked walk: new
    arrays, the inputs untouched. :func:`greedy_walk`'s arguments, then ``n_chunks >= 1``,
    ``round >= 0`` and the buffers (:class:`WalkRoundState`).

    **Algorithm.** The ``n_steps`` steps are cut into ``n_chunks`` chunks (:func:`chunk_steps`)
    that walk in parallel. ``p = round & 1``, ``q = 1 - p``. Round 0: every non-empty chunk
    ``g`` walks its steps from the guess flat (:data:`FLAT_KEY` at ``k0``), writing
    ``trace[k] = key`` before step ``k`` (:func:`walk_key`) and the records of step ``k``
    (:func:`greedy_walk`'s loop body), then ``ends[0][g] = key`` after its last step. Round
    ``r > 0``: chunk 0 (it started flat, as the true walk: exact since round 0) copies
    ``ends[p][0] = ends[q][0]``; chunk ``g > 0`` takes ``inp = ends[q][g - 1]``, its
    predecessor's end after the previous round. If ``inp == trace[k0]`` it already ran from that
    state: ``ends[p][g] = ends[q][g]``. Else it walks again from ``inp`` and stops (merges) at
    the first ``k > k0`` with ``key == trace[k]``: from there the previous run's trace, records
    and end are what this run would write (the walk is deterministic, and the key with ``k``
    determines the state: :func:`walk_key`), so ``ends[p][g] = ends[q][g]``; unmerged, ``ends[p]
    [g]`` is its final key. A round reads only ``ends[q]`` and each chunk's own rows, and writes
    ``ends[p]`` and its own rows, so the chunks are independent within a round (here they run
    in order; on the device in parallel). Empty chunks do nothing.

    **Exactness.** Induction on the round: after round ``r`` chunks ``0 .. r`` hold exactly
    :func:`greedy_walk`'s rows (chunk 0 after round 0; chunk ``g = r`` starts in round ``r``
    from its predecessor's end, exact after round ``r - 1``). More precisely: after every round
    each chunk's rows, trace and end are the walk over its steps from its start state ``S_g``
    (a merge keeps the previous run's tail, which is that same walk from the merge step on),
    where ``S_g`` is flat after round 0 and, after round ``r > 0``, ``inp``: chunk ``g - 1``'s
    end after round ``r - 1`` (a skipped chunk's ``S_g`` already was ``inp``). By induction,
    after ``R`` rounds chunk ``g`` holds the sequential walk that starts flat at chunk
    ``max(0, g - R + 1)``. So after ``n_chunks`` rounds (rounds ``0 .. n_chunks - 1``) the
    records equal :func:`greedy_walk`'s bit for bit; later rounds change nothing. A chunk whose
    true start is flat (the guess) is skipped in round 1; a rerun stops as soon as it meets its
    previous run's state (both flat at the same step, say), so most walks converge in 2-3
    rounds and the later rounds are no-ops.

    **NaN contract.** A NaN market feature flows as in :func:`greedy_walk` (Mech 10's clamp).
    The keys compare as integers (bit patterns): a non-finite entry price (a fill at a NaN
    price) merges only with the same bits, which is the same state; where its bits differ,
    merging is disabled and the chunk just walks to its end, still exact.
    """
    T, start, n_steps, n_chunks, round = validate_greedy_walk_round(
        params, param_offsets, dims, branches, bf16, z, isv, isv_index, h2_clamp_mult, close,
        high, low, features, costs, start, n_steps, n_chunks, round, trace, ends, rec_reward,
        rec_held, rec_cost, rec_margin)
    walk = _walk(params, param_offsets, dims, branches, bf16, z, isv, isv_index, h2_clamp_mult,
                 close, high, low, features, costs, T)
    trace, ends = trace.copy(), ends.copy()
    rec, margins = _records_in(rec_reward, rec_held, rec_cost, rec_margin)
    p = round & 1
    q = 1 - p
    for g in range(n_chunks):
        k0, k1 = chunk_steps(n_steps, n_chunks, g)
        if k0 == k1:
            continue
        if round == 0:
            key = np.array(FLAT_KEY, I32)
        elif g == 0:
            ends[p, 0] = ends[q, 0]
            continue
        else:
            key = ends[q, g - 1].copy()
            if np.array_equal(key, trace[k0]):
                ends[p, g] = ends[q, g]
                continue
        ends[p, g], rec = _run_chunk(walk, start, key, k0, k1, round > 0, trace, ends[q, g], rec,
                                     margins)
    return WalkRoundState(trace, ends, *_records_out(rec), margins)


def greedy_walk_chunked(params, param_offsets, dims, branches, bf16, z, isv, isv_index,
                        h2_clamp_mult, close, high, low, features, costs, start, n_steps,
                        n_chunks, rounds) -> WalkRecord:
    """:func:`greedy_walk_round` for ``round = 0 .. rounds - 1`` (``rounds >= 1``) on buffers
    that start as zeros; returns the records (margins included). ``rounds >= n_chunks`` gives
    :func:`greedy_walk`'s records bit for bit; fewer rounds give, per chunk ``g``, the
    sequential walk from flat at chunk ``max(0, g - rounds + 1)`` (greedy_walk_round's
    docstring)."""
    T, start, n_steps = validate_greedy_walk(
        params, param_offsets, dims, branches, bf16, z, isv, isv_index, h2_clamp_mult, close,
        high, low, features, costs, start, n_steps)
    n_chunks = check_int("n_chunks", n_chunks, minimum=1)
    rounds = check_int("rounds", rounds, minimum=1)
    buffers = WalkRoundState(np.zeros((n_steps, 3), I32), np.zeros((2, n_chunks, 3), I32),
                             *(np.zeros(n_steps, F32) for _ in range(4)))
    for r in range(rounds):
        buffers = greedy_walk_round(params, param_offsets, dims, branches, bf16, z, isv,
                                    isv_index, h2_clamp_mult, close, high, low, features, costs,
                                    start, n_steps, n_chunks, r, *buffers)
    return WalkRecord(buffers.rec_reward, buffers.rec_held, buffers.rec_cost, buffers.rec_margin)


#: walk.cu's ``greedy_walk_round`` is conformance-tested as the evaluator runs it, its rounds
#: composed: its registry twin is :func:`greedy_walk_chunked` (the CPU executor's per-launch
#: twin is :func:`greedy_walk_round`, :data:`ROUND_KERNELS`).
KERNELS = {"greedy_walk_round": greedy_walk_chunked}
#: walk.cu's ``greedy_walk_round``: one round of the chunked walk (its own signature; the
#: conformance entries run :data:`CHUNKED`, the rounds composed).
ROUND_KERNELS = {"greedy_walk_round": greedy_walk_round}
#: The chunked walk as a whole, ``greedy_walk``'s signature plus ``n_chunks, rounds``.
CHUNKED = {"greedy_walk_chunked": greedy_walk_chunked}

__all__ = ["CHUNKED", "FLAT_KEY", "KERNELS", "ROUND_KERNELS", "WalkRoundState", "chunk_steps",
           "greedy_walk_chunked", "greedy_walk_round", "key_state", "validate_greedy_walk_round",
           "walk_key"]
