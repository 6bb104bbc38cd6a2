"""Reference fused kernels: one launch over every action branch (the fast step's fusion plan,
SPEC 11). Each is the composition of the per-branch reference kernels of
:mod:`foxhunt.reference.kernels.distributional`, under the fused kernel's name; the numerics,
shapes per branch and NaN/Inf contracts are exactly those of the per-branch kernel
(``dueling_log_softmax_q_branches`` also composes ``log_softmax_expected_q`` over the combined
rows).

Branch-packed layout: ``branches = (n_0, ..., n_{D-1})`` (actions per branch, each >= 1,
``A_total = sum_d n_d``); an array ``x [R * A_total, NA]`` holds branch d's ``[R, n_d, NA]``
block in rows ``[R * off_d, R * (off_d + n_d))`` with ``off_d = n_0 + ... + n_{d-1}`` (the
trainer's packed logits / log-probabilities / logit gradients). ``R`` (samples per block) is
``x.shape[0] / A_total``. The CUDA kernels take the tables ``n_actions [D]`` and
``action_offset [D]`` (int32) and run branch d as ``blockIdx.y = d``.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from foxhunt.reference.kernels.argcheck import ieee, require_array, require_shape
from foxhunt.reference.kernels.distributional import (
    F32,
    I32,
    CqlGrad,
    DuelingGrads,
    LogSoftmaxQ,
    c51_loss,
    cql_logit_grad,
    dueling_combine,
    dueling_combine_backward,
    log_softmax_expected_q,
    validate_c51_loss,
)


class DuelingLogSoftmaxQ(NamedTuple):
    """Outputs of ``dueling_log_softmax_q_branches``: branch-packed ``logits [R * A_total, NA]``
    and ``logp [R * A_total, NA]``, and ``q [R * A_total]`` (one Q per packed row) with
    ``with_q``, else an empty ``q [0]``."""

    logits: np.ndarray
    logp: np.ndarray
    q: np.ndarray


class DuelingGradsSum(NamedTuple):
    """Outputs of ``dueling_combine_backward_sum_branches``: ``dv [B, NA]`` (summed over the
    branches) and the branch-packed ``dadv [B * A_total, NA]``."""

    dv: np.ndarray
    dadv: np.ndarray


class C51LossBranches(NamedTuple):
    """Outputs of ``c51_loss_branches``: ``ce [D, B]`` and the per-branch totals ``total [D]``."""

    ce: np.ndarray
    total: np.ndarray


def require_branches(branches) -> tuple[int, ...]:
    ok = isinstance(branches, (tuple, list)) and len(branches) > 0 and all(
        isinstance(n, (int, np.integer)) and not isinstance(n, bool) and int(n) >= 1 for n in branches)
    if not ok:
        raise ValueError(f"branches: {branches!r} is not allowed; expected a non-empty tuple of "
                         "action counts >= 1, e.g. (3, 3, 2)")
    return tuple(int(n) for n in branches)


def branch_offsets(branches) -> tuple[int, ...]:
    """``off_d = n_0 + ... + n_{d-1}`` for every branch d."""
    branches = require_branches(branches)
    return tuple(int(sum(branches[:d])) for d in range(len(branches)))


def require_packed(name: str, x, branches: tuple[int, ...]) -> int:
    """Check a branch-packed ``[R * A_total, NA]`` float32 array; return ``R``."""
    require_array(name, x, F32, ndim=2)
    total = sum(branches)
    if x.shape[0] % total or x.shape[1] < 1:
        raise ValueError(f"{name}: shape {x.shape} is not allowed; expected [R * A_total, NA] with "
                         f"A_total = {total} (branches {branches}) and NA >= 1")
    return x.shape[0] // total


def split_branches(x: np.ndarray, branches) -> list[np.ndarray]:
    """The per-branch ``[R, n_d, NA]`` blocks of a branch-packed array (views)."""
    branches = require_branches(branches)
    rows = require_packed("x", x, branches)
    na = x.shape[1]
    return [x[rows * off:rows * (off + n)].reshape(rows, n, na)
            for off, n in zip(branch_offsets(branches), branches)]


def validate_dueling_combine_branches(v, adv, branches) -> tuple[int, ...]:
    """The argument checks of ``dueling_combine_branches``; returns ``branches`` as a tuple."""
    branches = require_branches(branches)
    require_array("v", v, F32, ndim=2)
    require_packed("adv", adv, branches)
    require_shape("adv", adv, (v.shape[0] * sum(branches), v.shape[1]),
                  "[v.shape[0] * A_total, v.shape[1]]")
    return branches


def validate_dueling_log_softmax_q_branches(v, adv, z, branches,
                                            with_q) -> tuple[tuple[int, ...], bool]:
    """The argument checks of ``dueling_log_softmax_q_branches``: ``dueling_combine_branches``'
    (``v``, ``adv``, ``branches``), ``z [NA]`` float32, ``with_q`` a bool; returns
    ``(branches, with_q)``."""
    branches = validate_dueling_combine_branches(v, adv, branches)
    require_array("z", z, F32, ndim=1)
    require_shape("z", z, (v.shape[1],), "[NA] with NA = v.shape[1]")
    if not isinstance(with_q, (bool, np.bool_)):
        raise ValueError(f"with_q: {with_q!r} is not allowed; expected True or False")
    return branches, bool(with_q)


def validate_cql_logit_grad_branches(logp, actions, branches) -> tuple[tuple[int, ...], int]:
    """The layout checks of ``cql_logit_grad_branches`` (``z``, ``alpha``, ``scale`` and the
    action ranges are ``cql_logit_grad``'s per branch); returns ``(branches, R)``."""
    branches = require_branches(branches)
    rows = require_packed("logp", logp, branches)
    require_array("actions", actions, I32, ndim=2)
    if actions.shape[0] != len(branches) or actions.shape[1] > rows:
        raise ValueError(f"actions: shape {actions.shape} is not allowed; expected [D, B] with "
                         f"D = {len(branches)} branches and B <= R = {rows}")
    return branches, rows


def validate_c51_loss_branches(logp, actions, m, isw, scale,
                               branches) -> tuple[tuple[int, ...], int, np.float32]:
    """The argument checks of ``c51_loss_branches``: the layout (``logp`` branch-packed,
    ``actions [D, B]`` with ``B <= R``, ``m [D, B, NA]``), then ``c51_loss``'s checks on every
    branch (actions in ``[0, n_d)``, ``isw [B]``, ``scale``); returns ``(branches, R, scale)``."""
    branches, rows = validate_cql_logit_grad_branches(logp, actions, branches)
    batch, num_atoms = actions.shape[1], logp.shape[1]
    require_array("m", m, F32, ndim=3)
    require_shape("m", m, (len(branches), batch, num_atoms), "[D, B, NA] (actions is [D, B])")
    s = scale
    for d, x in enumerate(split_branches(logp, branches)):
        s = validate_c51_loss(x[:batch], actions[d], m[d], isw, scale)
    return branches, rows, s


def _pack(blocks: list[np.ndarray], num_atoms: int) -> np.ndarray:
    return np.concatenate([b.reshape(-1, num_atoms) for b in blocks], axis=0).astype(F32, copy=False)


@ieee
def dueling_combine_branches(v: np.ndarray, adv: np.ndarray, branches) -> np.ndarray:
    """``dueling_combine(v, adv_d)`` for every branch d, in one launch.

    Shapes: ``v [B, NA]`` float32 (shared by every branch), ``adv [B * A_total, NA]``
    branch-packed (module docstring) float32; returns ``logits [B * A_total, NA]`` float32,
    branch-packed the same way. NaN/Inf contract: ``dueling_combine``'s, per branch.
    """
    branches = validate_dueling_combine_branches(v, adv, branches)
    blocks = [dueling_combine(v, a) for a in split_branches(adv, branches)]
    return _pack(blocks, v.shape[1])


@ieee
def dueling_log_softmax_q_branches(v: np.ndarray, adv: np.ndarray, z: np.ndarray, branches,
                                   with_q) -> DuelingLogSoftmaxQ:
    """``dueling_combine_branches`` then ``log_softmax_expected_q`` on its rows, in one launch.

    ``logits = dueling_combine_branches(v, adv, branches)``;
    ``logp, q = log_softmax_expected_q(logits, z, q_rows)`` with ``q_rows = R * A_total`` (every
    packed row) if ``with_q``, else ``q_rows = 0`` (``q`` is empty; the kernel writes no Q).
    Per packed row r = (branch d, sample b, action a):
    ``logits[r, j] = v[b, j] + (adv[r, j] - mean_a adv_d[b, :, j])``,
    ``logp[r, :] = log_softmax(logits[r, :])``, ``q[r] = sum_j exp(logp[r, j]) * z_j``.
    The step calls it once per forward pass: the online pass (``R = 2B``, ``with_q=True``: the
    online Q of every branch and action, packed like ``logits``) and the target pass (``R = B``,
    ``with_q=False``).

    Shapes: ``v [R, NA]`` float32 (shared by every branch), ``adv [R * A_total, NA]``
    branch-packed (module docstring) float32, ``z [NA]`` float32, ``branches`` a non-empty tuple
    of action counts >= 1, ``with_q`` a bool (else ValueError); returns
    ``DuelingLogSoftmaxQ(logits [R * A_total, NA], logp [R * A_total, NA], q [R * A_total] or
    [0])`` float32, ``logits`` and ``logp`` branch-packed, ``q`` in the same row order.
    NaN/Inf contract: the two kernels' contracts composed, per branch. A NaN in
    ``adv[b, a, j]`` (branch d) makes ``logits_d[b, :, j]`` NaN for every action of that branch,
    hence those rows' ``logp`` and ``q`` NaN; a NaN in ``v[b, j]`` makes ``logits[b, :, j]`` NaN
    in every branch (and their rows' ``logp``, ``q``); an Inf advantage makes the mean that Inf:
    ``Inf - Inf = NaN`` at its own action (a NaN row) and the opposite Inf at the branch's other
    actions; an Inf ``v[b, j]`` makes ``logits[b, :, j]`` that Inf. Then, per row, a ``+Inf``
    logit makes the ``logp`` row (and its ``q``) NaN, a ``-Inf`` logit gives ``logp = -Inf``
    there and contributes exactly 0 to ``q`` (a row of all ``-Inf`` is NaN). A NaN in ``z``
    makes every ``q`` NaN; ``logits`` and ``logp`` do not read ``z``.
    """
    branches, with_q = validate_dueling_log_softmax_q_branches(v, adv, z, branches, with_q)
    logits = dueling_combine_branches(v, adv, branches)
    q_rows = logits.shape[0] if with_q else 0
    lq: LogSoftmaxQ = log_softmax_expected_q(logits, z, q_rows)
    return DuelingLogSoftmaxQ(logits=logits, logp=lq.logp, q=lq.q)


@ieee
def dueling_combine_backward_branches(dlogits: np.ndarray, branches) -> DuelingGrads:
    """``dueling_combine_backward(dlogits_d)`` for every branch d, in one launch.

    Shapes: ``dlogits [B * A_total, NA]`` branch-packed float32; returns
    ``DuelingGrads(dv [D, B, NA], dadv [B * A_total, NA] branch-packed)`` float32 (``dv[d]`` is
    branch d's ``dv``; the caller sums them over branches). NaN/Inf contract:
    ``dueling_combine_backward``'s, per branch.
    """
    branches = require_branches(branches)
    require_packed("dlogits", dlogits, branches)
    grads = [dueling_combine_backward(x) for x in split_branches(dlogits, branches)]
    dv = np.stack([g.dv for g in grads]).astype(F32, copy=False)
    return DuelingGrads(dv=dv, dadv=_pack([g.dadv for g in grads], dlogits.shape[1]))


@ieee
def dueling_combine_backward_sum_branches(dlogits: np.ndarray, branches) -> DuelingGradsSum:
    """``dueling_combine_backward_branches`` with its ``dv`` summed over the branches, in one
    launch (the network backward's ``dv = dv + dv_d`` from zeros, before the value head).

    Per branch d (``dueling_combine_backward(dlogits_d)``):
    ``dv_d[b, j] = sum_a dlogits_d[b, a, j]`` (action order),
    ``dadv_d[b, a, j] = dlogits_d[b, a, j] - dv_d[b, j] / n_d``; then
    ``dv[b, j] = ((+0.0 + dv_0[b, j]) + dv_1[b, j]) + ... + dv_{D-1}[b, j]`` in branch order
    (``+0.0 + -0.0 = +0.0``: an all-``-0`` cell gives ``+0``).

    Shapes: ``dlogits [B * A_total, NA]`` branch-packed (module docstring) float32,
    ``branches`` a non-empty tuple of action counts >= 1 (else ValueError); returns
    ``DuelingGradsSum(dv [B, NA], dadv [B * A_total, NA] branch-packed)`` float32.
    NaN/Inf contract: IEEE, unguarded, ``dueling_combine_backward``'s per branch: a NaN in
    ``dlogits_d[b, a, j]`` makes ``dadv_d[b, :, j]`` (every action of that branch) and
    ``dv[b, j]`` NaN; an Inf makes ``dv_d[b, j]`` that Inf (``+Inf`` and ``-Inf`` in one cell
    of a branch: NaN), hence ``dadv_d[b, a, j] = NaN`` at its own action (``Inf - Inf``) and the
    opposite Inf at the branch's other actions; ``dv[b, j]`` is NaN where the branches' ``dv_d``
    hold opposite Infs, else that Inf.
    """
    branches = require_branches(branches)
    batch = require_packed("dlogits", dlogits, branches)
    dv = np.zeros((batch, dlogits.shape[1]), dtype=F32)
    dadvs = []
    for x in split_branches(dlogits, branches):
        dv_d, dadv = dueling_combine_backward(x)
        dv = dv + dv_d
        dadvs.append(dadv)
    return DuelingGradsSum(dv=dv.astype(F32, copy=False), dadv=_pack(dadvs, dlogits.shape[1]))


@ieee
def cql_logit_grad_branches(logp: np.ndarray, actions: np.ndarray, z: np.ndarray, alpha, scale,
                            branches) -> CqlGrad:
    """``cql_logit_grad(logp_d[:B], actions[d], z, alpha, scale)`` for every branch d, in one
    launch.

    Shapes: ``logp [R * A_total, NA]`` branch-packed float32 with ``R >= B`` samples per block
    (the online pass over ``[s; s2]`` has ``R = 2B``; samples ``0..B`` of each block are used),
    ``actions [D, B]`` int32 (row d in ``[0, n_d)``), ``z [NA]``, ``alpha``, ``scale`` as
    ``cql_logit_grad``; returns ``CqlGrad(dlogits [B * A_total, NA] branch-packed, terms [D, B])``
    float32. NaN/Inf contract: ``cql_logit_grad``'s, per branch (samples past ``B`` of each
    block are not read).
    """
    branches, _ = validate_cql_logit_grad_branches(logp, actions, branches)
    batch = actions.shape[1]
    grads = [cql_logit_grad(np.ascontiguousarray(x[:batch]), actions[d], z, alpha, scale)
             for d, x in enumerate(split_branches(logp, branches))]
    terms = np.stack([g.terms for g in grads]).reshape(len(branches), batch).astype(F32, copy=False)
    return CqlGrad(dlogits=_pack([g.dlogits for g in grads], logp.shape[1]), terms=terms)


@ieee
def c51_loss_branches(logp: np.ndarray, actions: np.ndarray, m: np.ndarray, isw: np.ndarray,
                      scale, branches) -> C51LossBranches:
    """``c51_loss(logp_d[:B], actions[d], m[d], isw, scale)`` for every branch d, in one launch.

    ``ce[d, b] = -sum_j m[d, b, j] * logp_d[b, a_{d,b}, j]``;
    ``total[d] = scale * sum_b (isw_b * ce[d, b])`` (the sum first, then one multiply).

    Shapes: ``logp [R * A_total, NA]`` branch-packed float32 with ``R >= B`` samples per block
    (the online pass over ``[s; s2]`` has ``R = 2B``; samples ``0..B`` of each block are used),
    ``actions [D, B]`` int32 (row d in ``[0, n_d)``, else ValueError), ``m [D, B, NA]`` float32
    (branch d's projected target), ``isw [B]`` float32 (shared by every branch), ``scale`` a
    real scalar; returns ``C51LossBranches(ce [D, B] float32, total [D] float32)``.
    NaN/Inf contract: ``c51_loss``'s, per branch: IEEE, unguarded; only the taken action's row
    of each block is read (NaN in other actions, and in samples past ``B``, does not matter);
    NaN in ``m[d, b]`` or the taken row makes ``ce[d, b]`` NaN; ``m = 0`` against
    ``logp = -Inf`` gives NaN; any NaN ``ce[d, b]``, ``isw_b`` or ``scale`` makes ``total[d]``
    NaN.
    """
    branches, _, _ = validate_c51_loss_branches(logp, actions, m, isw, scale, branches)
    batch = actions.shape[1]
    losses = [c51_loss(np.ascontiguousarray(x[:batch]), actions[d], m[d], isw, scale)
              for d, x in enumerate(split_branches(logp, branches))]
    ce = np.stack([r.ce for r in losses]).reshape(len(branches), batch).astype(F32, copy=False)
    total = np.array([r.total for r in losses], dtype=F32)
    return C51LossBranches(ce=ce, total=total)


KERNELS = {
    "dueling_combine_branches": dueling_combine_branches,
    "dueling_log_softmax_q_branches": dueling_log_softmax_q_branches,
    "dueling_combine_backward_branches": dueling_combine_backward_branches,
    "dueling_combine_backward_sum_branches": dueling_combine_backward_sum_branches,
    "cql_logit_grad_branches": cql_logit_grad_branches,
    "c51_loss_branches": c51_loss_branches,
}
