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

The rounds may also start where the span walk's launches stopped (``greedy_walk_spans``, twin
:mod:`foxhunt.reference.kernels.walk_spans`): given the spans' buffers (``span_state``,
``span_brk``) a round commits the last span launch's first break (``walk_spans._commit``, the
same helper as the span launches') and cuts only the steps after it into chunks, chunk 0 starting
exact from that state. The evaluator's fused walk runs it so: ``SPAN_PASSES`` span launches,
then ``n_chunks`` rounds (:func:`greedy_walk_spans_and_rounds`): a policy that holds is done by
the spans (the rounds find no step left), one that trades every few bars by the chunks (two
rounds converge; the later ones only compare keys).

Every step is :mod:`foxhunt.reference.kernels.walk`'s loop body (``walk._step``: the forward,
the margin, the greedy action, ``env_step``), so the float order, the conformance rule and the
NaN contract are that module's.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import NamedTuple

import numpy as np

from foxhunt.reference.kernels.argcheck import check_int, require_array, require_shape
from foxhunt.reference.kernels.env import EnvState
from foxhunt.reference.kernels.walk import (
    WalkRecord,
    check_records,
    _flat_state,
    _observe,
    _records_in,
    _records_out,
    _step,
    _Walk,
    _walk,
    validate_greedy_walk,
)
from foxhunt.reference.kernels.walk_spans import (
    SPAN_BREAK,
    SPAN_STATE,
    WalkSpansState,
    _check_spans_buffers,
    _commit,
    greedy_walk_spans_pass,
    row_state,
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
#: :func:`greedy_walk_round`'s span arguments without a span base (the steps from 0, flat).
NO_SPAN_BASE = MappingProxyType(dict(span_chunks=0, span_passes=0, span_state=None,
                                     span_brk=None))


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


def chunk_steps(n_steps: int, n_chunks: int, g: int, first: int = 0) -> tuple[int, int]:
    """Chunk ``g``'s steps ``[k0, k1)`` of the steps ``[first, n_steps)`` (``first <=
    n_steps``): ``L = ceil((n_steps - first) / n_chunks)``, ``k0 = min(first + g L, n_steps)``,
    ``k1 = min(first + (g + 1) L, n_steps)`` (empty for the chunks past the walk's end, and
    every chunk when ``first == n_steps``)."""
    length = -(-(n_steps - first) // n_chunks)
    return min(first + g * length, n_steps), min(first + (g + 1) * length, n_steps)


def _validate_span_base(n_steps, start, branches, span_chunks, span_passes, span_state,
                        span_brk) -> tuple[int, int]:
    """The span base's arguments: none (``span_state`` and ``span_brk`` None, the counts 0) or
    the spans' buffers after launch ``span_passes - 1`` of ``span_chunks`` clusters; returns
    ``(span_chunks, span_passes)``."""
    if span_state is None and span_brk is None:
        for name, value in (("span_chunks", span_chunks), ("span_passes", span_passes)):
            if check_int(name, value, minimum=0) != 0:
                raise ValueError(f"{name}={value!r} without span_state and span_brk: need 0 "
                                 "(no span base: the rounds walk from step 0)")
        return 0, 0
    if span_state is None or span_brk is None:
        given, missing = ("span_state", "span_brk") if span_brk is None else ("span_brk",
                                                                               "span_state")
        raise ValueError(f"{missing}=None with {given} given: need both (a span base) or neither")
    span_chunks = check_int("span_chunks", span_chunks, minimum=1)
    span_passes = check_int("span_passes", span_passes, minimum=1)
    require_array("span_state", span_state, np.dtype(I32), ndim=2)
    require_shape("span_state", span_state, (2, len(SPAN_STATE)), "[2, 5]")
    require_array("span_brk", span_brk, np.dtype(I32), ndim=3)
    require_shape("span_brk", span_brk, (2, span_chunks, len(SPAN_BREAK)), "[2, span_chunks, 5]")
    _check_spans_buffers(n_steps, start, tuple(int(n) for n in branches), span_passes, span_state,
                         span_brk, names=("span_state", "span_brk"))
    return span_chunks, span_passes


def validate_greedy_walk_round(params, param_offsets, dims, branches, bf16, z, z_stride, isv,
                               isv_index, h2_clamp_mult, close, high, low, features, costs,
                               start, n_steps, n_chunks, round, span_chunks, span_passes,
                               span_state, span_brk, trace, ends, rec_reward, rec_held, rec_cost,
                               rec_margin):
    """:func:`validate_greedy_walk`, then the round's own arguments (the span base's by
    :func:`_validate_span_base`); returns ``(T, start, n_steps, n_chunks, round, span_chunks,
    span_passes)``. Shared with the fast test entry."""
    T, start, n_steps = validate_greedy_walk(
        params, param_offsets, dims, branches, bf16, z, z_stride, isv, isv_index, h2_clamp_mult,
        close, high, low, features, costs, start, n_steps)
    n_chunks = check_int("n_chunks", n_chunks, minimum=1)
    round = check_int("round", round, minimum=0)
    span_chunks, span_passes = _validate_span_base(n_steps, start, branches, span_chunks,
                                                   span_passes, span_state, span_brk)
    require_array("trace", trace, np.dtype(I32), ndim=2)
    require_shape("trace", trace, (n_steps, 3), "[n_steps, 3]")
    require_array("ends", ends, np.dtype(I32), ndim=3)
    require_shape("ends", ends, (2, n_chunks, 3), "[2, n_chunks, 3]")
    check_records(n_steps, rec_reward, rec_held, rec_cost, rec_margin)
    return T, start, n_steps, n_chunks, round, span_chunks, span_passes


def _run_chunk(walk: _Walk, state: EnvState, k0: int, k1: int, merge: bool, trace: np.ndarray,
               previous_end: np.ndarray, rec: list[np.ndarray],
               margins: np.ndarray | None) -> tuple[np.ndarray, list[np.ndarray]]:
    """Walk steps ``[k0, k1)`` from ``state`` (step ``k0``; ``trace``, ``margins`` in place);
    with ``merge``, stop at the first step ``k > k0`` whose key is ``trace[k]`` (the previous
    run's), ending as it ended. Returns ``(end key, rec)``."""
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


def greedy_walk_round(params, param_offsets, dims, branches, bf16, z, z_stride, isv, isv_index,
                      h2_clamp_mult, close, high, low, features, costs, start, n_steps, n_chunks,
                      round, span_chunks, span_passes, span_state, span_brk, trace, ends,
                      rec_reward, rec_held, rec_cost, rec_margin) -> WalkRoundState:
    """One round (one launch of walk.cu's ``greedy_walk_round``) of the chunked walk: new
    arrays, the inputs untouched. :func:`greedy_walk`'s arguments, then ``n_chunks >= 1``,
    ``round >= 0``, the span base (``span_chunks``, ``span_passes``, ``span_state``,
    ``span_brk``: :data:`NO_SPAN_BASE` for none) and the buffers (:class:`WalkRoundState`).

    **The base** ``S`` and the first step ``k_S``. Without a span base: flat at step ``k_S =
    0``. With one (``span_state`` int32 ``[2, 5]``, ``span_brk`` int32 ``[2, span_chunks, 5]``:
    ``walk_spans.greedy_walk_spans_pass``'s buffers after its launches ``0 .. span_passes - 1``,
    ``span_passes >= 1``): ``S`` is what that walk's launch ``span_passes`` would commit
    (``walk_spans._commit`` of ``span_state[src]`` and ``span_brk[src]``, ``src =
    (span_passes - 1) & 1``: the steps before the first break held, the break's step walked
    with its stored action), ``k_S = S.steps``; round 0 writes the break step's record row (the
    commit's; later rounds compute ``S`` alike and write nothing of it).

    **Algorithm.** The steps ``[k_S, n_steps)`` are cut into ``n_chunks`` chunks
    (:func:`chunk_steps` with ``first = k_S``) that walk in parallel. ``p = round & 1``, ``q =
    1 - p``. Round 0: every non-empty chunk ``g`` walks its steps from its guess (chunk 0 from
    ``S``, exact; the others flat, :data:`FLAT_KEY` at ``k0``), writing ``trace[k] = key``
    before step ``k`` (:func:`walk_key`) and the records of step ``k`` (:func:`greedy_walk`'s
    loop body), then ``ends[0][g] = key`` after its last step. Round ``r > 0``: chunk 0
    (it started from the true state: exact since round 0) copies ``ends[p][0] = ends[q][0]``;
    chunk ``g > 0`` takes ``inp = ends[q][g - 1]``, its predecessor's end after the previous
    round. If ``inp == trace[k0]`` it already ran from that state: ``ends[p][g] = ends[q][g]``.
    Else it walks again from ``inp`` and stops (merges) at the first ``k > k0`` with ``key ==
    trace[k]``: from there the previous run's trace, records and end are what this run would
    write (the walk is deterministic, and the key with ``k`` determines the state:
    :func:`walk_key`), so ``ends[p][g] = ends[q][g]``; unmerged, ``ends[p][g]`` is its final
    key. A round reads only ``ends[q]`` and each chunk's own rows, and writes ``ends[p]`` and
    its own rows, so the chunks are independent within a round (here they run in order; on the
    device in parallel). Empty chunks do nothing (every chunk when ``k_S == n_steps``: the
    spans walked everything; only round 0's commit row is then written). Trace rows and record
    rows are steps of the segment (rows below ``k_S`` are never read or written but for the
    commit's).

    **Exactness.** Induction on the round: after round ``r`` chunks ``0 .. r`` hold exactly
    :func:`greedy_walk`'s rows (chunk 0 after round 0: ``S`` is the true walk's state at
    ``k_S``, by the span walk's exactness; chunk ``g = r`` starts in round ``r`` from its
    predecessor's end, exact after round ``r - 1``). More precisely: after every round each
    chunk's rows, trace and end are the walk over its steps from its start state ``S_g`` (a
    merge keeps the previous run's tail, which is that same walk from the merge step on), where
    ``S_g`` is the guess after round 0 and, after round ``r > 0``, ``inp``: chunk ``g - 1``'s
    end after round ``r - 1`` (a skipped chunk's ``S_g`` already was ``inp``). By induction,
    after ``R`` rounds chunk ``g`` holds the sequential walk that starts from chunk ``h =
    max(0, g - R + 1)``'s guess at its first step. So after ``n_chunks`` rounds (rounds ``0 ..
    n_chunks - 1``) the records from ``k_S`` on equal :func:`greedy_walk`'s bit for bit (and
    with the spans' rows below ``k_S``, the whole walk's); later rounds change nothing. A chunk
    whose true start is flat (the guess) is skipped in round 1; a rerun stops as soon as it
    meets its previous run's state (both flat at the same step, say), so most walks converge in
    2-3 rounds and the later rounds are no-ops.

    **NaN contract.** A NaN market feature flows as in :func:`greedy_walk` (Mech 10's clamp).
    The keys compare as integers (bit patterns): a non-finite entry price (a fill at a NaN
    price) merges only with the same bits, which is the same state; where its bits differ,
    merging is disabled and the chunk just walks to its end, still exact.
    """
    T, start, n_steps, n_chunks, round, span_chunks, span_passes = validate_greedy_walk_round(
        params, param_offsets, dims, branches, bf16, z, z_stride, isv, isv_index, h2_clamp_mult,
        close, high, low, features, costs, start, n_steps, n_chunks, round, span_chunks,
        span_passes, span_state, span_brk, trace, ends, rec_reward, rec_held, rec_cost,
        rec_margin)
    walk = _walk(params, param_offsets, dims, branches, bf16, z, z_stride, isv, isv_index,
                 h2_clamp_mult, close, high, low, features, costs, T)
    trace, ends = trace.copy(), ends.copy()
    rec, margins = _records_in(rec_reward, rec_held, rec_cost, rec_margin)
    base = _flat_state(start, T)
    if span_state is not None:
        src = (span_passes - 1) & 1
        if round == 0:
            base, rec = _commit(walk, n_steps, row_state(span_state[src]), span_brk[src], rec,
                                margins)
        else:  # the same base; its row was written by round 0
            base, _ = _commit(walk, n_steps, row_state(span_state[src]), span_brk[src], rec,
                              None)
    first = int(base.steps[0])
    p = round & 1
    q = 1 - p
    for g in range(n_chunks):
        k0, k1 = chunk_steps(n_steps, n_chunks, g, first)
        if k0 == k1:
            continue
        if round == 0:
            state = base if g == 0 else key_state(np.array(FLAT_KEY, I32), start, k0)
        elif g == 0:
            ends[p, 0] = ends[q, 0]
            continue
        else:
            key = ends[q, g - 1].copy()
            if np.array_equal(key, trace[k0]):
                ends[p, g] = ends[q, g]
                continue
            state = key_state(key, start, k0)
        ends[p, g], rec = _run_chunk(walk, state, k0, k1, round > 0, trace, ends[q, g], rec,
                                     margins)
    return WalkRoundState(trace, ends, *_records_out(rec), margins)


def _round_buffers(n_steps: int, n_chunks: int) -> WalkRoundState:
    """The round's buffers as the compositions start them: zeros."""
    return WalkRoundState(np.zeros((n_steps, 3), I32), np.zeros((2, n_chunks, 3), I32),
                          *(np.zeros(n_steps, F32) for _ in range(4)))


def greedy_walk_chunked(params, param_offsets, dims, branches, bf16, z, z_stride, isv,
                        isv_index, h2_clamp_mult, close, high, low, features, costs, start,
                        n_steps, n_chunks, rounds) -> WalkRecord:
    """:func:`greedy_walk_round` for ``round = 0 .. rounds - 1`` (``rounds >= 1``), without a
    span base, on buffers that start as zeros; returns the records (margins included).
    ``rounds >= n_chunks`` gives :func:`greedy_walk`'s records bit for bit; fewer rounds give,
    per chunk ``g``, the sequential walk from flat at chunk ``max(0, g - rounds + 1)``
    (greedy_walk_round's docstring)."""
    T, start, n_steps = validate_greedy_walk(
        params, param_offsets, dims, branches, bf16, z, z_stride, isv, isv_index, h2_clamp_mult,
        close, high, low, features, costs, start, n_steps)
    n_chunks = check_int("n_chunks", n_chunks, minimum=1)
    rounds = check_int("rounds", rounds, minimum=1)
    buffers = _round_buffers(n_steps, n_chunks)
    for r in range(rounds):
        buffers = greedy_walk_round(params, param_offsets, dims, branches, bf16, z, z_stride,
                                    isv, isv_index, h2_clamp_mult, close, high, low, features,
                                    costs, start, n_steps, n_chunks, r, **NO_SPAN_BASE,
                                    **buffers._asdict())
    return WalkRecord(buffers.rec_reward, buffers.rec_held, buffers.rec_cost, buffers.rec_margin)


def greedy_walk_spans_and_rounds(params, param_offsets, dims, branches, bf16, z, z_stride, isv,
                                 isv_index, h2_clamp_mult, close, high, low, features, costs,
                                 start, n_steps, span_chunks, span_passes, hold_rows, n_chunks,
                                 rounds) -> WalkRecord:
    """The evaluator's fused walk: ``walk_spans.greedy_walk_spans_pass`` for ``pass_index = 0
    .. span_passes - 1`` (``span_chunks`` clusters, ``span_passes >= 1``, ``hold_rows`` as
    there; its tail is not launched), then :func:`greedy_walk_round` for ``round = 0 .. rounds
    - 1`` with the spans' buffers as its base, every buffer starting as zeros; returns the
    records (margins included). ``rounds >= n_chunks`` gives :func:`greedy_walk`'s records bit
    for bit (both docstrings)."""
    T, start, n_steps = validate_greedy_walk(
        params, param_offsets, dims, branches, bf16, z, z_stride, isv, isv_index, h2_clamp_mult,
        close, high, low, features, costs, start, n_steps)
    span_chunks = check_int("span_chunks", span_chunks, minimum=1)
    span_passes = check_int("span_passes", span_passes, minimum=1)
    n_chunks = check_int("n_chunks", n_chunks, minimum=1)
    rounds = check_int("rounds", rounds, minimum=1)
    args = (params, param_offsets, dims, branches, bf16, z, z_stride, isv, isv_index,
            h2_clamp_mult, close, high, low, features, costs, start, n_steps)
    spans = WalkSpansState(np.zeros((2, len(SPAN_STATE)), I32),
                           np.zeros((2, span_chunks, len(SPAN_BREAK)), I32),
                           *(np.zeros(n_steps, F32) for _ in range(4)))
    for p in range(span_passes):
        spans = greedy_walk_spans_pass(*args, span_chunks, span_passes, p, hold_rows, *spans)
    buffers = _round_buffers(n_steps, n_chunks)._replace(
        rec_reward=spans.rec_reward, rec_held=spans.rec_held, rec_cost=spans.rec_cost,
        rec_margin=spans.rec_margin)
    for r in range(rounds):
        buffers = greedy_walk_round(*args, n_chunks, r, span_chunks, span_passes, spans.state,
                                    spans.brk, *buffers)
    return WalkRecord(buffers.rec_reward, buffers.rec_held, buffers.rec_cost, buffers.rec_margin)


#: walk.cu's ``greedy_walk_round`` is conformance-tested its rounds composed from flat: its
#: registry twin is :func:`greedy_walk_chunked` (the CPU executor's per-launch twin is
#: :func:`greedy_walk_round`, :data:`ROUND_KERNELS`). The evaluator's composition, span
#: launches then rounds on their base (:func:`greedy_walk_spans_and_rounds`), is the test
#: entry ``greedy_walk_span_rounds`` (``walk.KERNELS``: twin ``greedy_walk``).
KERNELS = {"greedy_walk_round": greedy_walk_chunked}
#: walk.cu's ``greedy_walk_round``: one round of the chunked walk (its own signature; the
#: conformance entries run :data:`CHUNKED`, the rounds composed).
ROUND_KERNELS = {"greedy_walk_round": greedy_walk_round}
#: The chunked walk as a whole, ``greedy_walk``'s signature plus ``n_chunks, rounds``.
CHUNKED = {"greedy_walk_chunked": greedy_walk_chunked}

__all__ = ["CHUNKED", "FLAT_KEY", "KERNELS", "NO_SPAN_BASE", "ROUND_KERNELS", "WalkRoundState",
           "chunk_steps", "greedy_walk_chunked", "greedy_walk_round",
           "greedy_walk_spans_and_rounds", "key_state", "validate_greedy_walk_round", "walk_key"]
