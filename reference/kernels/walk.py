"""Reference twin of ``cuda_src/walk.cu``: ``greedy_walk``, the greedy policy over a whole
segment in one launch (issue 20, SPEC 10's device evaluation); also the twin of
``greedy_walk_cluster``, the same walk on a thread-block cluster (bitwise the one-block kernel's),
and the conformance twin of ``greedy_walk_hold``, ``greedy_walk_spans`` and the evaluator's
span-then-rounds walk, ``greedy_walk_span_rounds`` (:data:`KERNELS`).
The walks that cut the steps into pieces walked in parallel have their own modules, built on this
one's per-step helpers (every walk's loop body is :func:`_step`): the chunked (speculative) walk,
``greedy_walk_round``, in :mod:`foxhunt.reference.kernels.walk_rounds`, and the span walk,
``greedy_walk_spans``'s launches, in :mod:`foxhunt.reference.kernels.walk_spans`; both give
:func:`greedy_walk`'s records bit for bit, and so do the evaluator's span launches followed by
rounds on their base (``walk_rounds.greedy_walk_spans_and_rounds``).

Per bar (the composition of the existing reference functions, one state row at a time): the
env's state row (``env.env_observe``), the network's forward on it (``network.forward``'s
layers, Mech 10's ``safety.clamp_finite`` with ``safety.isv_bound(h2_clamp_mult,
isv[isv_index])``, ``distributional.dueling_combine``, ``log_softmax_atoms``, ``expected_q``
on branch d's support ``z + d * z_stride``: one support ``[NA]`` for every branch with
``z_stride = 0``, the live per-branch support ``[n_branches, NA]`` (``DQNConfig.adaptive_atoms``,
``kernels.live_support``) with ``z_stride = NA``; :func:`check_support`), the greedy action
(``env.env_act`` with eps 0: lowest index on ties, NaN never wins) and ``env.env_step`` (one
env, no auto-reset) recording bar k's reward (unscaled), position held and cost at row k. The
walk starts flat at bar ``start`` and takes ``n_steps`` steps (``start + n_steps <= T - 1``:
every step has its next bar). The support only selects which atoms' values an expected Q sums:
``z_stride`` changes no float order.

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
from foxhunt.reference.kernels.argcheck import check_int, ieee, require_array, require_shape
from foxhunt.reference.kernels.dense import add_bias_relu, round_for
from foxhunt.reference.kernels.env import (
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
    """How far the kernel's expected Q may be from the twin's (module docstring); ``z``: the
    walk's support, one or per branch (the largest ``|z|`` of any branch bounds them all)."""
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
    """Expected Q per branch (``[1, n_d]`` each) of one state row ``x [SD]``; ``z``: one support
    ``[NA]`` for every branch, or ``[n_branches, NA]`` (branch d's support is row d)."""
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
        z_d = z[d] if z.ndim == 2 else z
        qs.append(distributional.expected_q(distributional.log_softmax_atoms(logits), z_d))
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


def check_support(z, z_stride, n_branches: int, num_atoms: int) -> int:
    """The walk's support: ``z_stride`` 0 with ``z`` float32 ``[num_atoms]`` (one support for
    every branch) or ``num_atoms`` with ``z`` float32 ``[n_branches, num_atoms]`` (branch d's at
    ``z + d * z_stride``: row d, the live per-branch support); one-line ``ValueError`` else.
    Returns ``z_stride``."""
    allowed = (0, num_atoms)
    if isinstance(z_stride, bool) or not isinstance(z_stride, (int, np.integer)) \
            or int(z_stride) not in allowed:
        raise ValueError(f"z_stride={z_stride!r}: allowed 0 (one support z [num_atoms] for every "
                         f"branch) or num_atoms={num_atoms} (z [n_branches, num_atoms], a row per "
                         "branch)")
    shape = (num_atoms,) if z_stride == 0 else (n_branches, num_atoms)
    require_array("z", z, np.dtype(F32))
    if z.shape != shape:
        raise ValueError(f"z: shape {tuple(z.shape)}; need {list(shape)} with "
                         f"z_stride={int(z_stride)} (num_atoms={num_atoms}, "
                         f"n_branches={n_branches})")
    return int(z_stride)


def validate_greedy_walk(params, param_offsets, dims, branches, bf16, z, z_stride, isv,
                         isv_index, h2_clamp_mult, close, high, low, features, costs, start,
                         n_steps):
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
    check_support(z, z_stride, len(branches), int(dims[5]))
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


def _walk(params, param_offsets, dims, branches, bf16, z, z_stride, isv, isv_index,
          h2_clamp_mult, close, high, low, features, costs, n_bars) -> _Walk:
    """(``z`` as validated: ``[NA]`` with ``z_stride`` 0, ``[n_branches, NA]`` with ``NA``; so
    branch d's support ``z + d * z_stride`` is ``forward_row``'s row d or the one row.)"""
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


def check_records(n_steps: int, rec_reward, rec_held, rec_cost, rec_margin) -> None:
    """A per-launch twin's record buffers: float32 ``[n_steps]`` each (``rec_margin`` may be
    None: not written); ``ValueError`` naming the first one that is not."""
    records = (("rec_reward", rec_reward), ("rec_held", rec_held), ("rec_cost", rec_cost))
    if rec_margin is not None:
        records += (("rec_margin", rec_margin),)
    for name, rec in records:
        require_array(name, rec, np.dtype(F32), ndim=1)
        require_shape(name, rec, (n_steps,), "[n_steps]")


def _records_in(rec_reward, rec_held, rec_cost, rec_margin):
    """A per-launch twin's record buffers as ``_step`` writes them: copies of the rewards, held
    positions and costs as ``[n, 1]`` columns, and of the margins (None stays None)."""
    rec = [r[:, np.newaxis].copy() for r in (rec_reward, rec_held, rec_cost)]
    return rec, None if rec_margin is None else rec_margin.copy()


def _records_out(rec: list[np.ndarray]) -> tuple[np.ndarray, ...]:
    """``_records_in``'s columns back as the rows ``[n]`` of rewards, held positions, costs."""
    return tuple(r[:, 0].copy() for r in rec)


def greedy_walk(params, param_offsets, dims, branches, bf16, z, z_stride, isv, isv_index,
                h2_clamp_mult, close, high, low, features, costs, start, n_steps) -> WalkRecord:
    """The walk of the module docstring. ``params`` float32 flat (the f32 master; BF16 rounding
    per ``bf16``), ``param_offsets`` int32 (:func:`walk_offsets`), ``dims`` (:data:`DIMS`),
    ``branches`` (actions per branch), the support ``z`` and ``z_stride`` (:func:`check_support`:
    ``[NA]`` with 0, shared by the branches; ``[n_branches, NA]`` with ``NA``, branch d's support
    row d), ``isv`` float32 with Mech 10's signal at
    ``isv_index``, market tables ``[T]`` / ``features [T, F]``, ``costs`` (``env.cost_table``)."""
    T, start, n_steps = validate_greedy_walk(
        params, param_offsets, dims, branches, bf16, z, z_stride, isv, isv_index, h2_clamp_mult,
        close, high, low, features, costs, start, n_steps)
    walk = _walk(params, param_offsets, dims, branches, bf16, z, z_stride, isv, isv_index,
                 h2_clamp_mult, close, high, low, features, costs, T)
    rec = [np.zeros((n_steps, 1), F32) for _ in range(3)]
    margins = np.zeros(n_steps, F32)
    rec = _walk_from(walk, _flat_state(start, T), n_steps, rec, margins)
    return WalkRecord(*_records_out(rec), margins)


#: The single-launch CUDA kernels of walk.cu (one block; one thread-block cluster; the cluster
#: walk W rows at a time where the policy holds, greedy_walk_hold) have this one twin: their
#: records are bitwise equal (walk.cu's comments). ``greedy_walk_spans`` (one launch a pass) is
#: conformance-tested its launches composed (span passes, then its tail): the same records (its
#: per-launch twin is ``walk_spans.SPANS_KERNELS``). ``greedy_walk_span_rounds`` is no kernel
#: but the evaluator's fused walk, a test entry (``conformance.registry.DIVERGENCES``): the
#: span passes, then ``greedy_walk_round``'s rounds on their base
#: (``walk_rounds.greedy_walk_spans_and_rounds``); the same records. ``greedy_walk_round``'s
#: own twin is in ``walk_rounds.KERNELS``.
KERNELS = {"greedy_walk": greedy_walk, "greedy_walk_cluster": greedy_walk,
           "greedy_walk_hold": greedy_walk, "greedy_walk_spans": greedy_walk,
           "greedy_walk_span_rounds": greedy_walk}

__all__ = ["DIMS", "KERNELS", "LANES", "NEAR_TIE_FACTOR", "Q_ERROR_REL", "WalkRecord",
           "check_records", "check_support", "choice_margin", "dot_lanes", "first_near_tie",
           "forward_row", "greedy_walk", "q_error_bound", "validate_greedy_walk", "walk_dims",
           "walk_offsets", "walk_tensors"]
