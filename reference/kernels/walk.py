"""Reference twin of ``cuda_src/walk.cu``: ``greedy_walk``, the greedy policy over a whole
segment in one launch (issue 20, SPEC 10's device evaluation); also the twin of
``greedy_walk_cluster``, the same walk on a thread-block cluster (bitwise the one-block kernel's),
and of ``greedy_walk_round``, one round of the chunked (speculative) walk whose rounds composed,
:func:`greedy_walk_chunked`, give the same records with the steps cut into chunks that walk in
parallel (:func:`greedy_walk_round` states the algorithm and why it is exact), and of
``greedy_walk_spans``, one launch of the span walk (:func:`greedy_walk_spans_pass`: passes
that check spans of held steps in parallel, then a tail; composed,
:func:`greedy_walk_spans_walk`, the same records).

Per bar (the composition of the existing reference functions, one state row at a time): the
env's state row (``env.env_observe``), the network's forward on it (``network.forward``'s
layers, Mech 10's ``safety.clamp_finite`` with ``safety.isv_bound(h2_clamp_mult,
isv[isv_index])``, ``distributional.dueling_combine``, ``log_softmax_atoms``, ``expected_q``),
the greedy action (``env.env_act`` with eps 0: lowest index on ties, NaN never wins) and
``env.env_step`` (one env, no auto-reset) recording bar k's reward (unscaled), position held and
cost at row k. The walk starts flat at bar ``start`` and takes ``n_steps`` steps (``start +
n_steps <= T - 1``: every step has its next bar).

**Float order of the dot products** (the kernel's, reproduced here): every layer's output
``y_n = sum_k x_k w_nk`` is summed by 32 lanes, lane ``l`` adding its terms ``k = l, l + 32, ...``
in order from ``+0.0`` in float32 (product rounded, then sum rounded: no FMA), then the lanes
by the halving tree ``s[:16] + s[16:]``, ``[:8] + [8:16]``, ... (``dot_lanes``), then ``+ b``
(float32). In ``bf16`` precision both operands are BF16-rounded (``dense.round_for``: the
activation as ``add_bias_relu_bf16`` / ``clamp_finite_isv`` round it, the weights as the BF16
mirror), so each product is exact. The dense layers are therefore bitwise the kernel's; what
differs is only the transcendental functions: ``tanh`` in the state row (CUDA ``tanhf``, 2 ulp)
and ``exp`` / ``log`` in the log-softmax and expected Q (CUDA ``expf`` / ``logf``, NumPy's
float32 sums). In ``bf16`` precision such an ulp can flip an activation's BF16 rounding (one
element moves by 2^-8 of itself), hence the larger bound of that mode.

**Conformance rule** (:func:`q_error_bound`, :func:`first_near_tie`): the two paths' expected Q
agree within ``q_error_bound``; a bar whose top-two Q (``margins``: per branch the best minus
the best of the others, then the minimum over the branches) differ by less than
``NEAR_TIE_FACTOR`` times that bound may pick either action, so the walks are compared exactly
(rewards, positions held, costs) only on the bars before the first such bar, and not after.

NaN contract: a NaN/Inf market feature reaches the state row's column, then every h1 (NaN x w);
Mech 10's clamp maps the non-finite h2 to 0, so the heads and Q stay finite and the walk goes
on (the same on both paths). Prices are finite by contract here (the rewards are compared
exactly).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from foxhunt.reference.kernels import distributional, safety
from foxhunt.reference.kernels.argcheck import (
    check_int,
    ieee,
    require_array,
    require_shape,
)
from foxhunt.reference.kernels.dense import add_bias_relu, round_for
from foxhunt.reference.kernels.env import (
    BRANCH_DEFAULTS,
    EnvState,
    env_act,
    env_observe,
    env_reset,
    env_step,
    pack_q,
)
from foxhunt.reference.layout import branch_name

F32, I32 = np.float32, np.int32

#: Lanes of the kernel's dot products (a warp).
LANES = 32
#: ``param_offsets``' entries in order (``WALK_*`` in walk.cu): the trunk and value head, then
#: :data:`BRANCH_TENSORS` per branch.
TRUNK_TENSORS = ("w_s1", "b_s1", "w_s2", "b_s2", "w_v1", "b_v1", "w_v2", "b_v2")
BRANCH_TENSORS = ("w_{br}1", "b_{br}1", "w_{br}2", "b_{br}2")
#: ``dims``' entries in order.
DIMS = ("state_dim", "h1", "h2", "value_h", "adv_h", "num_atoms")
#: Expected-Q error bound per precision, relative to the support's span ``max|z|``.
Q_ERROR_REL = {"f32": 2.0**-18, "bf16": 2.0**-14}
#: A bar is a near tie when its margin is below this many Q error bounds (two Q values move).
NEAR_TIE_FACTOR = 2.0


class WalkRecord(NamedTuple):
    """``greedy_walk``'s record, float32 ``[n_steps]`` each: per-bar ``rewards`` (unscaled),
    ``positions`` held, ``costs`` and the action choice's ``margins`` (module docstring)."""

    rewards: np.ndarray
    positions: np.ndarray
    costs: np.ndarray
    margins: np.ndarray


def walk_tensors(n_branches: int) -> tuple[str, ...]:
    """The parameter tensors ``param_offsets`` locates, in order."""
    per_branch = tuple(name.format(br=branch_name(d))
                       for d in range(n_branches) for name in BRANCH_TENSORS)
    return TRUNK_TENSORS + per_branch


def walk_offsets(layout, n_branches: int) -> np.ndarray:
    """``param_offsets`` of a ``layout.ParamLayout``: int32 ``[8 + 4 n_branches]``."""
    return np.array([layout[name].offset for name in walk_tensors(n_branches)], I32)


def walk_dims(config) -> tuple[int, ...]:
    """``dims`` of a ``DQNConfig`` (:data:`DIMS` order)."""
    return (config.state_dim, config.shared_h1, config.shared_h2, config.value_h, config.adv_h,
            config.num_atoms)


def q_error_bound(z: np.ndarray, bf16: bool) -> float:
    """How far the kernel's expected Q may be from the twin's (module docstring)."""
    return Q_ERROR_REL["bf16" if bf16 else "f32"] * float(np.max(np.abs(z)))


def first_near_tie(margins: np.ndarray, z: np.ndarray, bf16: bool) -> int:
    """The first bar whose margin is below ``NEAR_TIE_FACTOR * q_error_bound`` (NaN counts);
    ``len(margins)`` when there is none."""
    near = ~(margins >= NEAR_TIE_FACTOR * q_error_bound(z, bf16))
    return int(np.argmax(near)) if near.any() else int(margins.shape[0])


@ieee
def dot_lanes(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``w @ x`` for ``w [N, K]``, ``x [K]`` float32 in the kernel's order (module docstring)."""
    n, k = w.shape
    chunks = -(-k // LANES)
    prod = np.zeros((n, chunks * LANES), F32)
    prod[:, :k] = w * x[np.newaxis, :]
    prod = prod.reshape(n, chunks, LANES)
    acc = np.zeros((n, LANES), F32)
    for c in range(chunks):
        acc = acc + prod[:, c, :]
    width = LANES
    while width > 1:
        width //= 2
        acc = acc[:, :width] + acc[:, width:2 * width]
    return acc[:, 0]


def forward_row(params, offsets, dims, branches, bf16, z, bound, x) -> list[np.ndarray]:
    """Expected Q per branch (``[1, n_d]`` each) of one state row ``x [SD]``."""
    sd, h1, h2, value_h, adv_h, na = dims
    mode = "bf16" if bf16 else "f32"
    table = dict(zip(walk_tensors(len(branches)), (int(o) for o in offsets)))

    def tensor(name, shape):
        start = table[name]
        return params[start:start + int(np.prod(shape))].reshape(shape)

    def layer(x_in, w, b, shape, relu):
        y = dot_lanes(round_for(x_in, mode), round_for(tensor(w, shape), mode))
        bias = tensor(b, (shape[0],))
        return add_bias_relu(y[np.newaxis], bias)[0] if relu else (y + bias).astype(F32)

    h1_v = layer(x, "w_s1", "b_s1", (h1, sd), True)
    h2_v = safety.clamp_finite(layer(h1_v, "w_s2", "b_s2", (h2, h1), True), bound)
    hv = layer(h2_v, "w_v1", "b_v1", (value_h, h2), True)
    v = layer(hv, "w_v2", "b_v2", (na, value_h), False)
    qs = []
    for d, n in enumerate(branches):
        br = branch_name(d)
        ha = layer(h2_v, f"w_{br}1", f"b_{br}1", (adv_h, h2), True)
        adv = layer(ha, f"w_{br}2", f"b_{br}2", (n * na, adv_h), False)
        logits = distributional.dueling_combine(v[np.newaxis], adv.reshape(1, n, na))
        qs.append(distributional.expected_q(distributional.log_softmax_atoms(logits), z))
    return qs


def choice_margin(qs: list[np.ndarray]) -> np.float32:
    """The bar's margin (walk.cu's walk_choose, then the minimum over the branches)."""
    margin = np.float32(np.inf)
    for q in qs:
        row = q.reshape(-1)
        best_index = int(distributional.double_dqn_select(row[np.newaxis])[0])
        best = row[best_index]
        others = [c for a, c in enumerate(row) if a != best_index and not np.isnan(c)]
        if np.isnan(best) or not others:
            gap = np.float32(np.inf)
        else:
            with np.errstate(invalid="ignore"):
                gap = np.float32(best - max(others))
            gap = np.float32(0) if np.isnan(gap) else gap
        margin = min(margin, gap)
    return np.float32(margin)


def validate_greedy_walk(params, param_offsets, dims, branches, bf16, z, isv, isv_index,
                         h2_clamp_mult, close, high, low, features, costs, start, n_steps):
    """Argument checks shared with the fast test entry; returns ``(T, start, n_steps)``."""
    require_array("params", params, np.dtype(F32), ndim=1)
    require_array("param_offsets", param_offsets, np.dtype(I32), ndim=1)
    branches = tuple(int(n) for n in branches)
    if not 1 <= len(branches) <= 3 or min(branches) < 1:
        raise ValueError(f"branches={branches!r}: need 1 to 3 branches of >= 1 action each")
    if param_offsets.shape[0] != len(walk_tensors(len(branches))):
        raise ValueError(f"param_offsets: {param_offsets.shape[0]} entries; need "
                         f"{len(walk_tensors(len(branches)))} (walk_tensors order)")
    if len(dims) != len(DIMS) or min(int(d) for d in dims) < 1:
        raise ValueError(f"dims={tuple(dims)!r}: need {len(DIMS)} sizes >= 1 ({', '.join(DIMS)})")
    require_array("z", z, np.dtype(F32), ndim=1)
    if z.shape[0] != int(dims[5]):
        raise ValueError(f"z: {z.shape[0]} atoms; need num_atoms={dims[5]}")
    require_array("isv", isv, np.dtype(F32), ndim=1)
    check_int("isv_index", isv_index, minimum=0, maximum=isv.shape[0] - 1)
    require_array("close", close, np.dtype(F32), ndim=1)
    T = close.shape[0]
    for name, arr in (("high", high), ("low", low)):
        require_array(name, arr, np.dtype(F32), ndim=1)
        if arr.shape[0] != T:
            raise ValueError(f"{name}: {arr.shape[0]} bars; need {T} (as close)")
    require_array("features", features, np.dtype(F32), ndim=2)
    if features.shape[0] != T or features.shape[1] + 3 > int(dims[0]):
        raise ValueError(f"features: shape {features.shape}; need [{T}, F] with F + 3 <= "
                         f"state_dim={dims[0]}")
    require_array("costs", costs, np.dtype(F32), ndim=1)
    start = check_int("start", start, minimum=0, maximum=T - 2)
    n_steps = check_int("n_steps", n_steps, minimum=0, maximum=T - 1 - start)
    return T, start, n_steps


class _Walk(NamedTuple):
    """A walk's constants: the validated arguments and Mech 10's bound."""

    params: np.ndarray
    offsets: np.ndarray
    dims: tuple[int, ...]
    branches: tuple[int, ...]
    bf16: bool
    z: np.ndarray
    bound: np.float32
    close: np.ndarray
    high: np.ndarray
    low: np.ndarray
    features: np.ndarray
    costs: np.ndarray
    n_bars: int


def _walk(params, param_offsets, dims, branches, bf16, z, isv, isv_index, h2_clamp_mult, close,
          high, low, features, costs, n_bars) -> _Walk:
    return _Walk(params, param_offsets, tuple(int(d) for d in dims),
                 tuple(int(n) for n in branches), bool(bf16), z,
                 safety.isv_bound(np.float32(h2_clamp_mult), isv[isv_index]), close, high, low,
                 features, costs, n_bars)


def _no_cycle() -> np.ndarray:
    return np.zeros(1, np.int64)  # no draws: eps = 0 and no auto-reset


def _observe(walk: _Walk, state: EnvState) -> np.ndarray:
    """The state row ``[1, state_dim]`` of ``state`` (``env.env_observe``)."""
    return env_observe(walk.features, walk.close, state.t, state.position, state.entry_price,
                       state.time_in_position, walk.dims[0])


def _flat_state(start: int, n_bars: int) -> EnvState:
    """The walk's first state: flat at bar ``start``, step 0 (``env.env_reset``)."""
    return env_reset(np.array([start], I32), 1, 0, n_bars - 2, 0, _no_cycle())


def _choose(walk: _Walk, obs: np.ndarray) -> tuple[np.ndarray, np.float32]:
    """The forward on ``obs`` (``[1, state_dim]``), its greedy action (``env_act`` with eps 0:
    int32 ``[1, n_branches]``) and the bar's margin (:func:`choice_margin`)."""
    qs = forward_row(walk.params, walk.offsets, walk.dims, walk.branches, walk.bf16, walk.z,
                     walk.bound, obs[0])
    return env_act(pack_q(qs), walk.branches, 0.0, 0, _no_cycle()), choice_margin(qs)


def _advance(walk: _Walk, state: EnvState, actions: np.ndarray, rec: list[np.ndarray]):
    """``env_step`` of the one env with ``actions`` (``[1, nb]``), writing row ``state.steps``
    of ``rec``; returns ``(state', obs', rec')``."""
    T = walk.n_bars
    out = env_step(walk.close, walk.high, walk.low, walk.features, np.zeros(T, I32), *state,
                   actions, *rec, walk.costs, n_bars=T, min_start=0, last_start=T - 2,
                   episode_len=0, auto_reset=0, reward_scale=1.0, state_dim=walk.dims[0], key=0,
                   cycle=_no_cycle())
    return EnvState(*out[:5]), out.obs, [out.rec_reward, out.rec_held, out.rec_cost]


def _step(walk: _Walk, state: EnvState, obs: np.ndarray, rec: list[np.ndarray]):
    """ONE bar of the walk (every walk's loop body, the module docstring's per-bar composition):
    the forward on ``obs``, the margin, the greedy action and ``env_step`` of the one env, which
    writes row ``state.steps`` of ``rec`` (``[reward, held, cost]``, ``[R, 1]`` each). Returns
    ``(state', obs', rec', margin)``."""
    actions, margin = _choose(walk, obs)
    return (*_advance(walk, state, actions, rec), margin)


def _walk_from(walk: _Walk, state: EnvState, n_steps: int, rec: list[np.ndarray],
               margins: np.ndarray | None) -> list[np.ndarray]:
    """The sequential walk from ``state`` to step ``n_steps`` (rows ``state.steps ..
    n_steps - 1`` of ``rec`` and ``margins``, which may be None)."""
    obs = _observe(walk, state)
    for k in range(int(state.steps[0]), n_steps):
        state, obs, rec, margin = _step(walk, state, obs, rec)
        if margins is not None:
            margins[k] = margin
    return rec


def greedy_walk(params, param_offsets, dims, branches, bf16, z, isv, isv_index, h2_clamp_mult,
                close, high, low, features, costs, start, n_steps) -> WalkRecord:
    """The walk of the module docstring. ``params`` float32 flat (the f32 master; BF16 rounding
    per ``bf16``), ``param_offsets`` int32 (:func:`walk_offsets`), ``dims`` (:data:`DIMS`),
    ``branches`` (actions per branch), ``z [NA]``, ``isv`` float32 with Mech 10's signal at
    ``isv_index``, market tables ``[T]`` / ``features [T, F]``, ``costs`` (``env.cost_table``)."""
    T, start, n_steps = validate_greedy_walk(
        params, param_offsets, dims, branches, bf16, z, isv, isv_index, h2_clamp_mult, close,
        high, low, features, costs, start, n_steps)
    walk = _walk(params, param_offsets, dims, branches, bf16, z, isv, isv_index, h2_clamp_mult,
                 close, high, low, features, costs, T)
    rec = [np.zeros((n_steps, 1), F32) for _ in range(3)]
    margins = np.zeros(n_steps, F32)
    rec = _walk_from(walk, _flat_state(start, T), n_steps, rec, margins)
    return WalkRecord(*(r[:, 0].copy() for r in rec), margins)


# ------------------------------------------------------------------ the chunked walk (rounds)


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
    rec = [r[:, np.newaxis].copy() for r in (rec_reward, rec_held, rec_cost)]
    margins = None if rec_margin is None else rec_margin.copy()
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
    return WalkRoundState(trace, ends, *(r[:, 0].copy() for r in rec), margins)


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


# ------------------------------------------------------------------ the span walk (passes)

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
                         state: np.ndarray, brk: np.ndarray) -> None:
    """What a pass ``> 0`` reads of the previous pass (``state[prev]``, ``brk[prev]``) is a
    state of this walk and breaks inside its remaining steps."""
    prev = 1 - (pass_index & 1)
    s = row_state(state[prev])
    steps, t = int(s.steps[0]), int(s.t[0])
    positions = {0.0} | {float(e - 1) for e in range(branches[0])}
    if not (0 <= steps <= n_steps and t == start + steps and s.time_in_position[0] >= 0
            and float(s.position[0]) in positions):
        raise ValueError(f"state[{prev}]={state[prev].tolist()}: not a state of this walk; need "
                         f"0 <= steps <= n_steps={n_steps}, t = start={start} + steps, time >= 0, "
                         f"position in {sorted(positions)} (bits)")
    if steps >= n_steps:
        return
    rows = brk[prev]
    rem = n_steps - steps
    bad = [g for g, r in enumerate(rows[:, 0]) if r != NONE and not 0 <= r < rem]
    if bad:
        raise ValueError(f"brk[{prev}][:, 0]={rows[:, 0].tolist()}: need {NONE} (none) or a row "
                         f"offset in [0, {rem}) (the steps left after state[{prev}])")
    g = int(np.argmin(rows[:, 0]))
    if rows[g, 0] == NONE:
        return
    allowed = [range(n) for n in branches] + [range(d, d + 1) for d in
                                              BRANCH_DEFAULTS[len(branches):]]
    if any(int(a) not in ok for a, ok in zip(rows[g, 1:4], allowed)):
        raise ValueError(f"brk[{prev}][{g}]={rows[g].tolist()}: actions (a0, a1, a2) not allowed; "
                         f"need a_d < n_d for branches={branches}, the default "
                         f"{BRANCH_DEFAULTS} for a missing branch")


def validate_greedy_walk_spans_pass(params, param_offsets, dims, branches, bf16, z, isv,
                                    isv_index, h2_clamp_mult, close, high, low, features, costs,
                                    start, n_steps, n_chunks, n_passes, pass_index, hold_rows,
                                    state, brk, rec_reward, rec_held, rec_cost, rec_margin):
    """:func:`validate_greedy_walk`, then the pass's own arguments (for ``pass_index > 0`` also
    what it reads of the previous pass: :func:`_check_spans_buffers`); returns ``(T, start,
    n_steps, n_chunks, n_passes, pass_index, hold_rows)``. Shared with the fast test entry."""
    T, start, n_steps = validate_greedy_walk(
        params, param_offsets, dims, branches, bf16, z, isv, isv_index, h2_clamp_mult, close,
        high, low, features, costs, start, n_steps)
    n_chunks = check_int("n_chunks", n_chunks, minimum=1)
    n_passes = check_int("n_passes", n_passes, minimum=0)
    pass_index = check_int("pass_index", pass_index, minimum=0, maximum=n_passes)
    hold_rows = check_int("hold_rows", hold_rows, minimum=1, maximum=HOLD_MAX)
    require_array("state", state, np.dtype(I32), ndim=2)
    require_shape("state", state, (2, len(SPAN_STATE)), "[2, 5]")
    require_array("brk", brk, np.dtype(I32), ndim=3)
    require_shape("brk", brk, (2, n_chunks, len(SPAN_BREAK)), "[2, n_chunks, 5]")
    records = (("rec_reward", rec_reward), ("rec_held", rec_held), ("rec_cost", rec_cost))
    if rec_margin is not None:
        records += (("rec_margin", rec_margin),)
    for name, rec in records:
        require_array(name, rec, np.dtype(F32), ndim=1)
        require_shape(name, rec, (n_steps,), "[n_steps]")
    if pass_index > 0:
        _check_spans_buffers(n_steps, start, tuple(int(n) for n in branches), pass_index, state,
                             brk)
    return T, start, n_steps, n_chunks, n_passes, pass_index, hold_rows


def _commit(walk: _Walk, n_steps: int, prior: EnvState, breaks: np.ndarray,
            rec: list[np.ndarray], margins: np.ndarray | None):
    """The previous pass's outcome from its base ``prior`` and its ``breaks`` (``brk[prev]``):
    every step before the first break held, the break's step walked with its stored action
    (its record row written). Returns ``(the next base, rec)``."""
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


def greedy_walk_spans_pass(params, param_offsets, dims, branches, bf16, z, isv, isv_index,
                           h2_clamp_mult, close, high, low, features, costs, start, n_steps,
                           n_chunks, n_passes, pass_index, hold_rows, state, brk, rec_reward,
                           rec_held, rec_cost, rec_margin) -> WalkSpansState:
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
        params, param_offsets, dims, branches, bf16, z, isv, isv_index, h2_clamp_mult, close,
        high, low, features, costs, start, n_steps, n_chunks, n_passes, pass_index, hold_rows,
        state, brk, rec_reward, rec_held, rec_cost, rec_margin)
    walk = _walk(params, param_offsets, dims, branches, bf16, z, isv, isv_index, h2_clamp_mult,
                 close, high, low, features, costs, T)
    state, brk = state.copy(), brk.copy()
    rec = [r[:, np.newaxis].copy() for r in (rec_reward, rec_held, rec_cost)]
    margins = None if rec_margin is None else rec_margin.copy()
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
    return WalkSpansState(state, brk, *(r[:, 0].copy() for r in rec), margins)


def greedy_walk_spans_walk(params, param_offsets, dims, branches, bf16, z, isv, isv_index,
                           h2_clamp_mult, close, high, low, features, costs, start, n_steps,
                           n_chunks, n_passes, hold_rows) -> WalkRecord:
    """:func:`greedy_walk_spans_pass` for ``pass_index = 0 .. n_passes`` (``n_passes + 1``
    launches) on buffers that start as zeros; returns the records (margins included), equal to
    :func:`greedy_walk`'s bit for bit (the pass's docstring)."""
    T, start, n_steps = validate_greedy_walk(
        params, param_offsets, dims, branches, bf16, z, isv, isv_index, h2_clamp_mult, close,
        high, low, features, costs, start, n_steps)
    n_chunks = check_int("n_chunks", n_chunks, minimum=1)
    n_passes = check_int("n_passes", n_passes, minimum=0)
    buffers = WalkSpansState(np.zeros((2, len(SPAN_STATE)), I32),
                             np.zeros((2, n_chunks, len(SPAN_BREAK)), I32),
                             *(np.zeros(n_steps, F32) for _ in range(4)))
    for p in range(n_passes + 1):
        buffers = greedy_walk_spans_pass(params, param_offsets, dims, branches, bf16, z, isv,
                                         isv_index, h2_clamp_mult, close, high, low, features,
                                         costs, start, n_steps, n_chunks, n_passes, p, hold_rows,
                                         *buffers)
    return WalkRecord(buffers.rec_reward, buffers.rec_held, buffers.rec_cost, buffers.rec_margin)


#: The single-launch CUDA kernels of walk.cu (one block; one thread-block cluster; the cluster
#: walk W rows at a time where the policy holds, greedy_walk_hold) have this one twin: their
#: records are bitwise equal (walk.cu's comments). ``greedy_walk_round`` (one
#: round a launch) is conformance-tested as the evaluator runs it, its rounds composed: its
#: entry's twin is :func:`greedy_walk_chunked` (the CPU executor's per-launch twin is
#: :func:`greedy_walk_round`, :data:`ROUND_KERNELS`).
KERNELS = {"greedy_walk": greedy_walk, "greedy_walk_cluster": greedy_walk,
           "greedy_walk_round": greedy_walk_chunked, "greedy_walk_hold": greedy_walk,
           "greedy_walk_spans": greedy_walk}

#: walk.cu's ``greedy_walk_round``: one round of the chunked walk (its own signature; the
#: conformance entries run :data:`CHUNKED`, the rounds composed).
ROUND_KERNELS = {"greedy_walk_round": greedy_walk_round}
#: The chunked walk as a whole, ``greedy_walk``'s signature plus ``n_chunks, rounds``.
CHUNKED = {"greedy_walk_chunked": greedy_walk_chunked}
#: walk.cu's ``greedy_walk_spans``: one launch (a span pass, or the tail) of the span walk;
#: the launches composed are :func:`greedy_walk_spans_walk` (registered by the lead).
SPANS_KERNELS = {"greedy_walk_spans": greedy_walk_spans_pass}

__all__ = ["CHUNKED", "DIMS", "FLAT_KEY", "HOLD_MAX", "KERNELS", "LANES", "NEAR_TIE_FACTOR",
           "NONE", "Q_ERROR_REL", "ROUND_KERNELS", "SPANS_KERNELS", "SPAN_BREAK", "SPAN_STATE",
           "WalkRecord", "WalkRoundState", "WalkSpansState", "choice_margin", "chunk_steps",
           "dot_lanes", "first_near_tie", "forward_row", "greedy_walk", "greedy_walk_chunked",
           "greedy_walk_round", "greedy_walk_spans_pass", "greedy_walk_spans_walk", "held",
           "hold_exposure", "key_state", "q_error_bound", "row_state", "state_row",
           "validate_greedy_walk", "validate_greedy_walk_round", "validate_greedy_walk_spans_pass",
           "walk_dims", "walk_key", "walk_offsets", "walk_tensors"]
