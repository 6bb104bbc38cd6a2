"""Reference twin of walk.cu's ``greedy_walk_spans``: the span walk (issue 20).
:func:`greedy_walk_spans_pass` is one launch: a pass that checks spans of held steps in
parallel, or the tail; composed, :func:`greedy_walk_spans_walk`, they give
:func:`~foxhunt.reference.kernels.walk.greedy_walk`'s records bit for bit. While the greedy
exposure equals the position held nothing trades, and the next states are known without the
network (:func:`held`, :func:`hold_exposure`), so ``n_chunks`` clusters check consecutive spans
of them at once, each stopping at its first row that does not hold (its break, :data:`SPAN_BREAK`);
the next launch commits the first break and starts from the state after it
(:func:`greedy_walk_spans_pass` states the algorithm, why it is exact and the NaN contract). The
launches hand the base state on in ``state`` (:data:`SPAN_STATE`, :func:`state_row` /
:func:`row_state`) and the breaks in ``brk``, double-buffered by pass parity
(:class:`WalkSpansState`).

Every step is :mod:`foxhunt.reference.kernels.walk`'s loop body (the forward, the margin, the
greedy action, ``env_step``), so the float order and the conformance rule are that module's.
The kernel's registry twin is ``walk.greedy_walk`` (``walk.KERNELS``): the launches composed
give its records.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from foxhunt.reference.kernels.argcheck import check_int, require_array, require_shape
from foxhunt.reference.kernels.env import BRANCH_DEFAULTS, EnvState
from foxhunt.reference.kernels.walk import (
    WalkRecord,
    check_records,
    _advance,
    _choose,
    _flat_state,
    _observe,
    _records_in,
    _records_out,
    _Walk,
    _walk,
    _walk_from,
    validate_greedy_walk,
)

F32, I32 = np.float32, np.int32

#: ``brk``'s break index of a cluster with no break (int32 max): it held through its span, or
#: had no rows.
NONE = 2147483647
#: Most state rows the hold kernels run through the network at once (``WALK_HOLD_MAX`` in
#: walk.cu): ``hold_rows``' range.
HOLD_MAX = 16
#: ``state``'s entries per parity (floats as their bit patterns).
SPAN_STATE = ("t", "steps", "time_in_position", "position", "entry_price")
#: ``brk``'s entries per parity and cluster: the break's row offset, its full greedy action
#: (exposure, order type, urgency), its margin's bits.
SPAN_BREAK = ("r", "a0", "a1", "a2", "margin")
_NO_BREAK = (NONE, 0, 0, 0, 0)


class WalkSpansState(NamedTuple):
    """The buffers one pass of :func:`greedy_walk_spans_pass` reads and writes: ``state`` int32
    ``[2, 5]`` (:data:`SPAN_STATE` per parity), ``brk`` int32 ``[2, n_chunks, 5]``
    (:data:`SPAN_BREAK` per parity and cluster), the records float32 ``[n_steps]``
    (``rec_margin`` may be None: not written)."""

    state: np.ndarray
    brk: np.ndarray
    rec_reward: np.ndarray
    rec_held: np.ndarray
    rec_cost: np.ndarray
    rec_margin: np.ndarray | None


def state_row(state: EnvState) -> np.ndarray:
    """The one env's ``state`` as a ``state`` buffer row, int32 ``[5]`` (:data:`SPAN_STATE`)."""
    floats = np.concatenate([state.position[:1], state.entry_price[:1]]).astype(F32)
    return np.concatenate([state.t[:1], state.steps[:1], state.time_in_position[:1],
                           floats.view(I32)]).astype(I32)


def row_state(row: np.ndarray) -> EnvState:
    """:func:`state_row`'s inverse."""
    row = np.asarray(row, I32)
    return EnvState(row[0:1].copy(), row[1:2].copy(), row[2:3].copy(), row[3:4].view(F32).copy(),
                    row[4:5].view(F32).copy())


def held(state: EnvState, j: int) -> EnvState:
    """``held(S, j)``: the env ``j`` steps after ``state`` if its position is held (nothing
    trades): ``t + j``, ``steps + j``, ``time_in_position + j`` (0 when flat), the same position
    and entry price (``env_step`` without a trade, ``j`` times)."""
    time = state.time_in_position + j if state.position[0] != 0 else np.zeros(1, I32)
    return EnvState((state.t + j).astype(I32), (state.steps + j).astype(I32), time.astype(I32),
                    state.position.copy(), state.entry_price.copy())


def hold_exposure(state: EnvState) -> int:
    """The exposure index that holds ``state``'s position (``target = exposure - 1``)."""
    return int(state.position[0]) + 1


def _full_actions(actions: np.ndarray) -> list[int]:
    """An ``env_act`` row ``[1, nb]`` as the three branches' actions (a missing branch: its
    default, as ``env_step`` reads it)."""
    nb = actions.shape[1]
    return [int(actions[0, d]) if d < nb else BRANCH_DEFAULTS[d]
            for d in range(len(BRANCH_DEFAULTS))]


def _check_spans_buffers(n_steps: int, start: int, branches: tuple[int, ...], pass_index: int,
                         state: np.ndarray, brk: np.ndarray, names=("state", "brk")) -> None:
    """What a pass ``> 0`` reads of the previous pass (``state[prev]``, ``brk[prev]``) is a
    state of this walk and breaks inside its remaining steps. ``names``: the two buffers'
    parameter names in the messages (``greedy_walk_round`` reads them as ``span_state``,
    ``span_brk``)."""
    state_name, brk_name = names
    prev = 1 - (pass_index & 1)
    s = row_state(state[prev])
    steps, t = int(s.steps[0]), int(s.t[0])
    positions = {0.0} | {float(e - 1) for e in range(branches[0])}
    if not (0 <= steps <= n_steps and t == start + steps and s.time_in_position[0] >= 0
            and float(s.position[0]) in positions):
        raise ValueError(f"{state_name}[{prev}]={state[prev].tolist()}: not a state of this walk; "
                         f"need 0 <= steps <= n_steps={n_steps}, t = start={start} + steps, "
                         f"time >= 0, position in {sorted(positions)} (bits)")
    if steps >= n_steps:
        return
    rows = brk[prev]
    rem = n_steps - steps
    bad = [g for g, r in enumerate(rows[:, 0]) if r != NONE and not 0 <= r < rem]
    if bad:
        raise ValueError(f"{brk_name}[{prev}][:, 0]={rows[:, 0].tolist()}: need {NONE} (none) or "
                         f"a row offset in [0, {rem}) (the steps left after {state_name}[{prev}])")
    g = int(np.argmin(rows[:, 0]))
    if rows[g, 0] == NONE:
        return
    allowed = [range(n) for n in branches] + [range(d, d + 1) for d in
                                              BRANCH_DEFAULTS[len(branches):]]
    if any(int(a) not in ok for a, ok in zip(rows[g, 1:4], allowed)):
        raise ValueError(f"{brk_name}[{prev}][{g}]={rows[g].tolist()}: actions (a0, a1, a2) not "
                         f"allowed; need a_d < n_d for branches={branches}, the default "
                         f"{BRANCH_DEFAULTS} for a missing branch")


def validate_greedy_walk_spans_pass(params, param_offsets, dims, branches, bf16, z, z_stride,
                                    isv, isv_index, h2_clamp_mult, close, high, low, features,
                                    costs, start, n_steps, n_chunks, n_passes, pass_index,
                                    hold_rows, state, brk, rec_reward, rec_held, rec_cost,
                                    rec_margin):
    """:func:`validate_greedy_walk`, then the pass's own arguments (for ``pass_index > 0`` also
    what it reads of the previous pass: :func:`_check_spans_buffers`); returns ``(T, start,
    n_steps, n_chunks, n_passes, pass_index, hold_rows)``. Shared with the fast test entry."""
    T, start, n_steps = validate_greedy_walk(
        params, param_offsets, dims, branches, bf16, z, z_stride, isv, isv_index, h2_clamp_mult,
        close, high, low, features, costs, start, n_steps)
    n_chunks = check_int("n_chunks", n_chunks, minimum=1)
    n_passes = check_int("n_passes", n_passes, minimum=0)
    pass_index = check_int("pass_index", pass_index, minimum=0, maximum=n_passes)
    hold_rows = check_int("hold_rows", hold_rows, minimum=1, maximum=HOLD_MAX)
    require_array("state", state, np.dtype(I32), ndim=2)
    require_shape("state", state, (2, len(SPAN_STATE)), "[2, 5]")
    require_array("brk", brk, np.dtype(I32), ndim=3)
    require_shape("brk", brk, (2, n_chunks, len(SPAN_BREAK)), "[2, n_chunks, 5]")
    check_records(n_steps, rec_reward, rec_held, rec_cost, rec_margin)
    if pass_index > 0:
        _check_spans_buffers(n_steps, start, tuple(int(n) for n in branches), pass_index, state,
                             brk)
    return T, start, n_steps, n_chunks, n_passes, pass_index, hold_rows


def _commit(walk: _Walk, n_steps: int, prior: EnvState, breaks: np.ndarray,
            rec: list[np.ndarray], margins: np.ndarray | None):
    """The previous pass's outcome from its base ``prior`` and its ``breaks`` (``brk[prev]``):
    every step before the first break held, the break's step walked with its stored action
    (its record row written). Returns ``(the next base, rec)``. Step 1 of
    :func:`greedy_walk_spans_pass` and the span base of ``walk_rounds.greedy_walk_round`` (one
    helper, as walk.cu's ``walk_span_commit``)."""
    k = int(prior.steps[0])
    if k >= n_steps:
        return prior, rec
    m = int(breaks[:, 0].min())
    if m >= n_steps - k:
        return held(prior, n_steps - k), rec
    g = int(np.argmin(breaks[:, 0]))  # the first cluster with the minimum
    actions = breaks[g, 1:1 + len(walk.branches)][np.newaxis].astype(I32)
    state, _, rec = _advance(walk, held(prior, m), actions, rec)
    if margins is not None:
        margins[k + m] = breaks[g, 4:5].view(F32)[0]
    return state, rec


def _check_span(walk: _Walk, base: EnvState, j0: int, length: int, rec: list[np.ndarray],
                margins: np.ndarray | None):
    """One cluster: rows ``base.steps + j`` for ``j0 <= j < j0 + length`` under "held from
    ``base``": each row that holds is recorded; the first that does not is returned as the
    cluster's ``brk`` row (:data:`SPAN_BREAK`), unrecorded. Returns ``(brk row, rec)``."""
    hold = hold_exposure(base)
    for j in range(j0, j0 + length):
        state = held(base, j)
        actions, margin = _choose(walk, _observe(walk, state))
        if actions[0, 0] != hold:
            bits = np.array([margin], F32).view(I32)[0]
            return np.array([j, *_full_actions(actions), bits], I32), rec
        _, _, rec = _advance(walk, state, actions, rec)  # no trade: the next row is held(j + 1)
        if margins is not None:
            margins[state.steps[0]] = margin
    return np.array(_NO_BREAK, I32), rec


def greedy_walk_spans_pass(params, param_offsets, dims, branches, bf16, z, z_stride, isv,
                           isv_index, h2_clamp_mult, close, high, low, features, costs, start,
                           n_steps, n_chunks, n_passes, pass_index, hold_rows, state, brk,
                           rec_reward, rec_held, rec_cost, rec_margin) -> WalkSpansState:
    """One launch of walk.cu's ``greedy_walk_spans``: new arrays, the inputs untouched.
    :func:`greedy_walk`'s arguments, then ``n_chunks = G >= 1`` clusters, ``n_passes = P >=
    0``, ``pass_index = p`` in ``[0, P]``, ``hold_rows`` in ``[1, HOLD_MAX]`` (the kernel's rows
    per network pass: it changes nothing here, validated only) and the buffers
    (:class:`WalkSpansState`). ``cur = p & 1``, ``prev = 1 - cur``; ``held(S, j)``:
    :func:`held`; ``hold(S)``: :func:`hold_exposure`; "step k's record": :func:`_step`'s.

    **Algorithm.** While the greedy exposure equals the position held nothing trades, and the
    next states are known without the network, so they can be checked in parallel.
    1. The pass's base ``S``: flat at step 0 for ``p == 0``. For ``p > 0`` the previous pass is
       committed: ``Sp = state[prev]``; if ``Sp.steps >= n``, ``S = Sp``; else ``m = min_g
       brk[prev][g][0]``, ``rem = n - Sp.steps``: ``m >= rem`` (no break) gives ``S =
       held(Sp, rem)``; else step ``Sp.steps + m`` is walked from ``held(Sp, m)`` with the
       stored action of the first cluster ``g`` with that minimum (``env_step``; record row
       written, its margin the stored bits) and ``S`` is the state after it. ``state[cur] =
       S``.
    2. ``p == P`` (the tail): every step from ``S.steps`` to ``n - 1`` walked sequentially
       (:func:`greedy_walk`'s loop); ``brk`` is not written.
    3. ``p < P`` (a span pass): ``rem = n - S.steps``, ``span = ceil(rem / G)``; cluster ``g``
       takes ``j`` in ``[g span, min((g + 1) span, rem))``: the forward on ``held(S, j)``'s
       state row; if branch 0's greedy choice is ``hold(S)`` the row's record is written (the
       env does not trade whatever the other branches chose) and it goes on; else
       ``brk[cur][g] = [j, a0, a1, a2, bits(margin)]`` (the row's full greedy action, the
       default for a missing branch; :func:`choice_margin`) and the cluster stops, the row
       unrecorded (the next launch commits it). A cluster that held throughout, or has no
       rows, writes ``[NONE, 0, 0, 0, 0]``. Clusters read only ``S``: independent (here in
       order; on the device in parallel).

    **Exactness.** The bases ``k_0 = 0 < k_1 < ...`` of the passes: ``k_{p+1} = k_p + b_p +
    1``, ``b_p`` the pass's global break (the minimum over its clusters: the clusters' rows are
    consecutive, each stops at its first break, so the minimum is the first row of the span
    pass that does not hold), or ``n`` without one. By induction on ``j``, the true walk's state
    at step ``k_p + j`` is ``held(S, j)`` for ``j <= b_p`` (a row whose greedy exposure is the
    hold does not trade: ``env_step``'s next state is ``held(S, j + 1)``), so the pass's records
    of rows ``k_p .. k_p + b_p - 1`` are :func:`greedy_walk`'s, as is the commit of row ``k_p +
    b_p`` (the same row's action and margin) and the base it hands on. A row ``r`` is last
    written by the pass whose base ``k_p <= r < k_p + b_p``, by the commit (``r = k_p + b_p``,
    the next launch) or by the tail (``r >= k_P``): the rows past a break that a later cluster
    wrote under a false hypothesis are ``>= k_{p+1}``, so a later pass or the tail rewrites
    them, and no later pass writes below its own base ``> r``. So after launches ``0 .. P`` the
    records equal :func:`greedy_walk`'s bit for bit, for any ``G >= 1``, ``P >= 0``
    (:func:`greedy_walk_spans_walk`); the passes only move work from the tail.

    **NaN contract.** A NaN Q follows ``env_act``'s argmax (lowest index on ties, NaN never
    wins, an all-NaN branch gives 0), for the hold test as for the actions; a non-finite
    feature flows as in :func:`greedy_walk` (Mech 10's clamp keeps Q finite). Positions are
    integers made float32, so ``hold(S)`` is exact; entry prices are carried as bits.
    """
    T, start, n_steps, n_chunks, n_passes, pass_index, _ = validate_greedy_walk_spans_pass(
        params, param_offsets, dims, branches, bf16, z, z_stride, isv, isv_index, h2_clamp_mult,
        close, high, low, features, costs, start, n_steps, n_chunks, n_passes, pass_index,
        hold_rows, state, brk, rec_reward, rec_held, rec_cost, rec_margin)
    walk = _walk(params, param_offsets, dims, branches, bf16, z, z_stride, isv, isv_index,
                 h2_clamp_mult, close, high, low, features, costs, T)
    state, brk = state.copy(), brk.copy()
    rec, margins = _records_in(rec_reward, rec_held, rec_cost, rec_margin)
    cur = pass_index & 1
    prev = 1 - cur
    if pass_index == 0:
        base = _flat_state(start, T)
    else:
        base, rec = _commit(walk, n_steps, row_state(state[prev]), brk[prev], rec, margins)
    state[cur] = state_row(base)
    if pass_index == n_passes:
        rec = _walk_from(walk, base, n_steps, rec, margins)
    else:
        rem = n_steps - int(base.steps[0])
        span = -(-rem // n_chunks) if rem > 0 else 0
        for g in range(n_chunks):
            j0 = g * span
            length = min(span, rem - j0)
            brk[cur, g] = _NO_BREAK
            if length > 0:
                brk[cur, g], rec = _check_span(walk, base, j0, length, rec, margins)
    return WalkSpansState(state, brk, *_records_out(rec), margins)


def greedy_walk_spans_walk(params, param_offsets, dims, branches, bf16, z, z_stride, isv,
                           isv_index, h2_clamp_mult, close, high, low, features, costs, start,
                           n_steps, n_chunks, n_passes, hold_rows) -> WalkRecord:
    """:func:`greedy_walk_spans_pass` for ``pass_index = 0 .. n_passes`` (``n_passes + 1``
    launches) on buffers that start as zeros; returns the records (margins included), equal to
    :func:`greedy_walk`'s bit for bit (the pass's docstring)."""
    T, start, n_steps = validate_greedy_walk(
        params, param_offsets, dims, branches, bf16, z, z_stride, isv, isv_index, h2_clamp_mult,
        close, high, low, features, costs, start, n_steps)
    n_chunks = check_int("n_chunks", n_chunks, minimum=1)
    n_passes = check_int("n_passes", n_passes, minimum=0)
    buffers = WalkSpansState(np.zeros((2, len(SPAN_STATE)), I32),
                             np.zeros((2, n_chunks, len(SPAN_BREAK)), I32),
                             *(np.zeros(n_steps, F32) for _ in range(4)))
    for p in range(n_passes + 1):
        buffers = greedy_walk_spans_pass(params, param_offsets, dims, branches, bf16, z,
                                         z_stride, isv, isv_index, h2_clamp_mult, close, high,
                                         low, features, costs, start, n_steps, n_chunks,
                                         n_passes, p, hold_rows, *buffers)
    return WalkRecord(buffers.rec_reward, buffers.rec_held, buffers.rec_cost, buffers.rec_margin)


#: walk.cu's ``greedy_walk_spans``: one launch (a span pass, or the tail) of the span walk;
#: the launches composed are :func:`greedy_walk_spans_walk` (registered by the lead).
SPANS_KERNELS = {"greedy_walk_spans": greedy_walk_spans_pass}

__all__ = ["HOLD_MAX", "NONE", "SPANS_KERNELS", "SPAN_BREAK", "SPAN_STATE", "WalkSpansState",
           "greedy_walk_spans_pass", "greedy_walk_spans_walk", "held", "hold_exposure",
           "row_state", "state_row", "validate_greedy_walk_spans_pass"]
