"""Reference distributional (C51) kernels: dueling combination, log-softmax over atoms, expected
Q, double-DQN action choice, the dense triangular C51 projection, the C51 loss and gradient,
and the CQL logit gradient (SPEC sections 3 and 4).

Shapes, per branch d: ``B`` samples, ``A = n_d`` actions, ``NA`` atoms, ``z [NA]`` the support
(``support(v_min, v_max, NA)``), ``dz = (v_max - v_min) / (NA - 1)``. Everything is float32
(int32 action indices); no kernel mutates its inputs.

NaN policy: a NaN in the data is never silently turned into a number here. It propagates to the
outputs named in each docstring, where the sentinel slots (SPEC section 6: 7 save_current_lp,
8 save_projected, 24/25 d_value/d_adv logits) can see it. The only masking is structural:
outputs that do not read a value (other actions' gradient rows, a row's unused logp) do not
inherit its NaN. Scalars that the device reads from the ISV bus (``gamma``, ``alpha``,
``scale``) may be non-finite and then propagate like data; support bounds are configuration
and are validated.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from foxhunt.reference.kernels.argcheck import (
    check_f32_scalar,
    f32_scalar,
    ieee,
    require_array,
    require_shape,
)
from foxhunt.reference.kernels.dense import F32

I32 = np.dtype(np.int32)

#: Floors of the effective discount's bases (seed 000, ``c51_loss_batched``; issue 22): the
#: transition's discount before its logarithm, the branch gamma before its power. The CUDA twins
#: are ``kDiscountFloor`` / ``kGammaFloor`` in ``cuda_src/distributional.cuh`` (a test reads them).
DISCOUNT_FLOOR = np.float32(1e-9)
GAMMA_FLOOR = np.float32(1e-6)


# --------------------------------------------------------------------------------------------
# Helpers (not kernels).
# --------------------------------------------------------------------------------------------


def _check_support_bounds(v_min, v_max, num_atoms: int) -> tuple[np.float32, np.float32]:
    lo = f32_scalar("v_min", v_min)
    hi = f32_scalar("v_max", v_max)
    if not (np.isfinite(lo) and np.isfinite(hi) and lo < hi):
        raise ValueError(
            f"v_min, v_max: ({v_min!r}, {v_max!r}) is not allowed; "
            f"expected finite float32 values with v_min < v_max"
        )
    if num_atoms < 2:
        raise ValueError(f"num_atoms: {num_atoms!r} is not allowed; expected an int >= 2")
    return lo, hi


def atom_spacing(lo: np.float32, hi: np.float32, num_atoms: int) -> np.float32:
    """``dz = (v_max - v_min) / (NA - 1)``, each operation rounded to float32."""
    return (hi - lo) / np.float32(num_atoms - 1)


def support(v_min, v_max, num_atoms: int) -> np.ndarray:
    """The C51 support ``z_j = v_min + j * dz`` for ``j = 0..NA-1``, float32 ``[NA]``.

    ``dz = (v_max - v_min) / (NA - 1)``; the product and the sum are each rounded to float32
    (no fused multiply-add), so ``z[-1]`` may differ from ``v_max`` by rounding. The device
    receives this array; kernels never recompute ``z``. Raises ValueError unless
    ``v_min < v_max`` are finite and ``num_atoms >= 2``.
    """
    if isinstance(num_atoms, bool) or not isinstance(num_atoms, (int, np.integer)):
        raise ValueError(f"num_atoms: {num_atoms!r} is not allowed; expected an int >= 2")
    lo, hi = _check_support_bounds(v_min, v_max, int(num_atoms))
    dz = atom_spacing(lo, hi, int(num_atoms))
    return (lo + np.arange(num_atoms, dtype=F32) * dz).astype(F32, copy=False)


def _require_actions(actions, batch: int, num_actions: int) -> np.ndarray:
    require_array("actions", actions, I32, ndim=1)
    require_shape("actions", actions, (batch,), "[B]")
    if actions.size and (actions.min() < 0 or actions.max() >= num_actions):
        bad = actions[(actions < 0) | (actions >= num_actions)]
        raise ValueError(
            f"actions: value(s) {bad[:8].tolist()} out of range; expected 0 <= a < A = "
            f"{num_actions}"
        )
    return actions


def _require_logp(logp) -> np.ndarray:
    require_array("logp", logp, F32, ndim=3)
    return logp


def _require_vector(name: str, x, length: int, meaning: str) -> np.ndarray:
    require_array(name, x, F32, ndim=1)
    require_shape(name, x, (length,), meaning)
    return x


def _sum_over_actions(x: np.ndarray) -> np.ndarray:
    """``sum_a x[:, a, :]`` accumulated in action order (as the kernel's loop does)."""
    acc = x[:, 0, :].copy()
    for a in range(1, x.shape[1]):
        acc = acc + x[:, a, :]
    return acc


def _taken(x: np.ndarray, actions: np.ndarray) -> np.ndarray:
    """``x[b, actions[b], ...]`` for every b."""
    return x[np.arange(x.shape[0]), actions]


def validate_discount(discount, gamma_ref, batch: int) -> np.float32 | None:
    """The checks of the n-step arguments every target kernel takes (issue 22): ``discount``
    ``None`` (1-step: ``gamma_ref`` is then not read) or float32 ``[B]`` (values are data: any,
    see ``effective_gamma``); with a discount, ``gamma_ref`` a finite float32 in ``(0, 1)``.
    Returns ``gamma_ref`` in float32 (None without a discount)."""
    if discount is None:
        return None
    _require_vector("discount", discount, batch, "[B], one effective discount per sample")
    return check_f32_scalar("gamma_ref", gamma_ref, lo=0.0, hi=1.0, lo_open=True, hi_open=True)


@ieee
def effective_gamma(gamma, discount: np.ndarray | None, gamma_ref) -> np.ndarray:
    """The per-sample discount of an n-step transition, for a branch whose gamma is ``gamma``.

    ``n_eff = log(fmin(fmax(discount, DISCOUNT_FLOOR), 1)) / log(gamma_ref)``;
    ``gamma_eff = fmax(gamma, GAMMA_FLOOR) ** n_eff``, each operation in float32 (``np.log`` /
    ``np.power`` here, ``logf`` / ``powf`` in the CUDA twin ``effective_gamma``: conformance
    bounds cover their ulps). A transition of ``k`` steps has ``discount = gamma_ref ** k``, so
    ``n_eff ~ k`` and ``gamma_eff ~ gamma ** k``; with ``discount == gamma_ref`` ``n_eff`` is
    exactly 1 and ``gamma_eff == gamma`` bit for bit (for ``gamma >= GAMMA_FLOOR``).
    ``discount is None`` (1-step, ``n_step_on = 0`` on the device): returns ``gamma`` unchanged
    (float32), ``discount`` not read.

    Shapes: ``gamma`` a scalar or ``[D, 1]`` (per branch), ``discount [B]``; returns their
    broadcast float32 (``[B]`` or ``[D, B]``). ``gamma_ref`` in ``(0, 1)`` (``validate_discount``).
    NaN/Inf contract: ``fmax`` takes the non-NaN operand, so a NaN ``discount`` or ``gamma``
    is floored (``discount -> 1e-9``, ``gamma -> 1e-6``) and the result stays finite; the floors
    also keep it finite for ``discount <= 0`` (including -Inf) and ``gamma <= 0``. A discount
    above 1 (including +Inf) is clamped to 1 (``n_eff = 0``, ``gamma_eff = 1``): without the
    clamp ``n_eff < 0`` puts ``gamma_eff`` at float32's overflow edge, where ``powf`` and
    ``np.power`` may round to Inf or not (seen on the H200 with ``discount = f32 max``).
    ``gamma = +Inf`` gives ``+Inf`` or 0: it reaches that branch's targets only. A valid batch
    never holds a discount outside ``(0, 1]`` (``Batch.validate``).
    """
    g = np.asarray(gamma, dtype=F32)
    if discount is None:
        return g
    ref = np.float32(gamma_ref)
    n_eff = np.log(np.fmin(np.fmax(discount, DISCOUNT_FLOOR), np.float32(1))) / np.log(ref)
    return np.power(np.fmax(g, GAMMA_FLOOR), n_eff).astype(F32, copy=False)


# --------------------------------------------------------------------------------------------
# Validation shared with the fast test entries (foxhunt.fast.kernels.distributional).
# --------------------------------------------------------------------------------------------


def validate_dueling_combine(v, adv) -> None:
    """The argument checks of ``dueling_combine``."""
    require_array("v", v, F32, ndim=2)
    require_array("adv", adv, F32, ndim=3)
    require_shape("adv", adv, (v.shape[0], adv.shape[1], v.shape[1]), "[B, A, NA] (v is [B, NA])")
    if adv.shape[1] < 1:
        raise ValueError(f"adv: shape {adv.shape} has no actions; expected A >= 1")


def validate_dueling_combine_backward(dlogits) -> None:
    """The argument checks of ``dueling_combine_backward``."""
    require_array("dlogits", dlogits, F32, ndim=3)
    if dlogits.shape[1] < 1:
        raise ValueError(f"dlogits: shape {dlogits.shape} has no actions; expected A >= 1")


def validate_log_softmax_atoms(logits) -> None:
    """The argument checks of ``log_softmax_atoms``."""
    require_array("logits", logits, F32)
    if logits.ndim < 1 or logits.shape[-1] < 1:
        raise ValueError(
            f"logits: shape {logits.shape} is not allowed; expected [..., NA] with NA >= 1"
        )


def validate_expected_q(logp, z) -> None:
    """The argument checks of ``expected_q``."""
    _require_logp(logp)
    _require_vector("z", z, logp.shape[2], "[NA] with NA = logp.shape[2]")


def validate_double_dqn_select(q) -> None:
    """The argument checks of ``double_dqn_select``."""
    require_array("q", q, F32, ndim=2)
    if q.shape[1] < 1:
        raise ValueError(f"q: shape {q.shape} has no actions; expected A >= 1")


class ProjectArgs(NamedTuple):
    """``c51_project``'s checked scalars as the kernel receives them: ``gamma``, ``v_min``,
    ``v_max`` in float32 and the atom spacing ``dz`` (``atom_spacing``)."""

    gamma: np.float32
    v_min: np.float32
    v_max: np.float32
    dz: np.float32


def validate_c51_project(p_next, r, done, gamma, z, v_min, v_max, discount=None,
                         gamma_ref=None) -> ProjectArgs:
    """The argument checks of ``c51_project``; returns its scalars (``ProjectArgs``; the n-step
    arguments are checked by ``validate_discount``, their float32 ``gamma_ref`` is not
    returned: ``validate_discount`` gives it)."""
    require_array("p_next", p_next, F32, ndim=2)
    batch, num_atoms = p_next.shape
    _require_vector("r", r, batch, "[B] with B = p_next.shape[0]")
    _require_vector("done", done, batch, "[B] with B = p_next.shape[0]")
    validate_discount(discount, gamma_ref, batch)
    if num_atoms < 2:
        raise ValueError(f"p_next: shape {p_next.shape} is not allowed; expected [B, NA], NA >= 2")
    _require_vector("z", z, num_atoms, "[NA] with NA = p_next.shape[1]")
    g = f32_scalar("gamma", gamma)
    lo, hi = _check_support_bounds(v_min, v_max, num_atoms)
    return ProjectArgs(gamma=g, v_min=lo, v_max=hi, dz=atom_spacing(lo, hi, num_atoms))


def validate_c51_loss(logp, actions, m, isw, scale) -> np.float32:
    """The argument checks of ``c51_loss`` (and ``c51_grad``); returns ``scale`` in float32."""
    _require_logp(logp)
    batch, num_actions, num_atoms = logp.shape
    _require_actions(actions, batch, num_actions)
    require_array("m", m, F32, ndim=2)
    require_shape("m", m, (batch, num_atoms), "[B, NA] (logp is [B, A, NA])")
    _require_vector("isw", isw, batch, "[B] with B = logp.shape[0]")
    return f32_scalar("scale", scale)


validate_c51_grad = validate_c51_loss


def validate_log_softmax_expected_q(logits, z, q_rows) -> int:
    """The argument checks of ``log_softmax_expected_q``; returns ``q_rows`` as an int."""
    require_array("logits", logits, F32, ndim=2)
    rows, num_atoms = logits.shape
    if num_atoms < 1:
        raise ValueError(
            f"logits: shape {logits.shape} is not allowed; expected [R, NA] with NA >= 1"
        )
    _require_vector("z", z, num_atoms, "[NA] with NA = logits.shape[1]")
    if (isinstance(q_rows, (bool, np.bool_)) or not isinstance(q_rows, (int, np.integer))
            or not 0 <= q_rows <= rows):
        raise ValueError(
            f"q_rows: {q_rows!r} is not allowed; expected an int with 0 <= q_rows <= R = {rows}"
        )
    return int(q_rows)


def validate_c51_project_grad(
    p_next, r, done, gamma, z, v_min, v_max, logp, actions, isw, scale, discount=None,
    gamma_ref=None
) -> tuple[ProjectArgs, np.float32]:
    """The argument checks of ``c51_project_grad`` (``c51_project``'s, then ``c51_grad``'s with
    ``B``, ``NA`` taken from ``p_next``); returns ``(ProjectArgs, scale)``."""
    args = validate_c51_project(p_next, r, done, gamma, z, v_min, v_max, discount, gamma_ref)
    batch, num_atoms = p_next.shape
    _require_logp(logp)
    require_shape("logp", logp, (batch, logp.shape[1], num_atoms), "[B, A, NA] (p_next is [B, NA])")
    _require_actions(actions, batch, logp.shape[1])
    _require_vector("isw", isw, batch, "[B] with B = p_next.shape[0]")
    return args, f32_scalar("scale", scale)


def validate_cql_logit_grad(logp, actions, z, alpha, scale) -> tuple[np.float32, np.float32]:
    """The argument checks of ``cql_logit_grad``; returns ``(alpha, scale)`` in float32."""
    _require_logp(logp)
    batch, num_actions, num_atoms = logp.shape
    _require_actions(actions, batch, num_actions)
    _require_vector("z", z, num_atoms, "[NA] with NA = logp.shape[2]")
    return f32_scalar("alpha", alpha), f32_scalar("scale", scale)


# --------------------------------------------------------------------------------------------
# Kernels.
# --------------------------------------------------------------------------------------------


@ieee
def dueling_combine(v: np.ndarray, adv: np.ndarray) -> np.ndarray:
    """Dueling combination: ``logits[b, a, j] = v[b, j] + (adv[b, a, j] - mean_a adv[b, :, j])``.

    Shapes: ``v [B, NA]``, ``adv [B, A, NA]`` float32; returns ``logits [B, A, NA]`` float32.
    ``mean_a = (sum over a in order) / A``; evaluation order as written (the centred advantage
    first, then ``+ v``).
    NaN/Inf contract: IEEE, unguarded. A NaN in ``adv[b, a, j]`` makes the mean NaN, so
    ``logits[b, :, j]`` is NaN for every action; a NaN in ``v[b, j]`` makes ``logits[b, :, j]``
    NaN; an Inf advantage gives ``Inf - Inf = NaN`` at its own action.
    """
    validate_dueling_combine(v, adv)
    mean = _sum_over_actions(adv) / np.float32(adv.shape[1])
    return (v[:, np.newaxis, :] + (adv - mean[:, np.newaxis, :])).astype(F32, copy=False)


class DuelingGrads(NamedTuple):
    """Outputs of ``dueling_combine_backward``: ``dv [B, NA]`` and ``dadv [B, A, NA]``."""

    dv: np.ndarray
    dadv: np.ndarray


@ieee
def dueling_combine_backward(dlogits: np.ndarray) -> DuelingGrads:
    """Backward of ``dueling_combine``: ``dv = sum_a dlogits``, ``dadv = dlogits - mean_a dlogits``.

    Shapes: ``dlogits [B, A, NA]`` float32; returns ``DuelingGrads(dv [B, NA], dadv [B, A, NA])``
    float32. Sums run in action order; ``mean_a = dv / A``. The caller sums ``dv`` over branches.
    NaN/Inf contract: IEEE, unguarded: a NaN in ``dlogits[b, a, j]`` makes ``dv[b, j]`` and
    ``dadv[b, :, j]`` (every action) NaN.
    """
    validate_dueling_combine_backward(dlogits)
    dv = _sum_over_actions(dlogits)
    mean = dv / np.float32(dlogits.shape[1])
    dadv = (dlogits - mean[:, np.newaxis, :]).astype(F32, copy=False)
    return DuelingGrads(dv=dv.astype(F32, copy=False), dadv=dadv)


@ieee
def log_softmax_atoms(logits: np.ndarray) -> np.ndarray:
    """Max-subtracted log-softmax over the last (atom) axis.

    ``logp_j = (x_j - m) - log(sum_k exp(x_k - m))`` with ``m = max_k x_k``. Shapes:
    ``logits [..., NA]`` float32 (NA >= 1); returns float32 of the same shape. Finite rows give
    ``logp <= 0`` exactly (``x - m <= 0`` and ``log(sum) >= 0``), so ``exp(logp) <= 1``
    downstream (seed audit, c51_grad).
    NaN/Inf contract, per row: a NaN anywhere, a ``+Inf`` anywhere (``Inf - Inf``), or every
    entry ``-Inf`` makes the whole row NaN; otherwise a ``-Inf`` entry gives ``logp = -Inf``
    (probability 0) and the other entries are finite. The fast kernel may take the max with
    ``fmaxf`` (skipping NaN): the NaN then reaches the sum through ``exp(NaN - m)``, so the
    outcome is the same. No epsilon is needed: the shifted sum is ``>= 1``.
    """
    validate_log_softmax_atoms(logits)
    m = np.max(logits, axis=-1, keepdims=True)
    shifted = logits - m
    log_sum = np.log(np.sum(np.exp(shifted), axis=-1, keepdims=True, dtype=F32))
    return (shifted - log_sum).astype(F32, copy=False)


@ieee
def expected_q(logp: np.ndarray, z: np.ndarray) -> np.ndarray:
    """Expected Q per action: ``q[b, a] = sum_j exp(logp[b, a, j]) * z_j``.

    Shapes: ``logp [B, A, NA]`` float32, ``z [NA]`` float32; returns ``q [B, A]`` float32.
    NaN/Inf contract: IEEE, unguarded: a NaN in ``logp[b, a]`` (or in ``z``) makes ``q[b, a]``
    NaN; ``logp = -Inf`` contributes exactly 0.
    """
    validate_expected_q(logp, z)
    return np.sum(np.exp(logp) * z, axis=-1, dtype=F32)


def double_dqn_select(q: np.ndarray) -> np.ndarray:
    """Double-DQN action choice: ``a*[b] = argmax_a q[b, a]``, lowest index on ties.

    Shapes: ``q [B, A]`` float32 (A >= 1); returns ``int32 [B]``. Exact. Scan in action order,
    replacing the incumbent when ``q[a] > best`` or the incumbent is NaN and ``q[a]`` is not.
    NaN contract: NaN entries never win; a row of all NaN selects action 0. ``+Inf`` wins like
    any value (the first ``+Inf`` on ties); ``-0.0 == +0.0`` is a tie.
    """
    validate_double_dqn_select(q)
    best_index = np.zeros(q.shape[0], dtype=I32)
    best = q[:, 0].copy()
    for a in range(1, q.shape[1]):
        candidate = q[:, a]
        take = (candidate > best) | (np.isnan(best) & ~np.isnan(candidate))
        best = np.where(take, candidate, best)
        best_index = np.where(take, np.int32(a), best_index)
    return best_index.astype(I32, copy=False)


@ieee
def c51_project(
    p_next: np.ndarray,
    r: np.ndarray,
    done: np.ndarray,
    gamma,
    z: np.ndarray,
    v_min,
    v_max,
    discount: np.ndarray | None = None,
    gamma_ref=None,
) -> np.ndarray:
    """C51 Bellman projection, dense triangular form (SPEC section 4).

    ``g_b = gamma_b * (1 - done_b)`` with ``gamma_b = effective_gamma(gamma, discount,
    gamma_ref)[b]`` (n-step transitions, issue 22; ``gamma`` itself when ``discount`` is None,
    bit for bit today's projection); ``Tz_bj = clip(r_b + g_b * z_j, v_min, v_max)``;
    ``m_bi = sum_j p_next_bj * clip(1 - |Tz_bj - z_i| / dz, 0, 1)``,
    ``dz = (v_max - v_min) / (NA - 1)`` (float32). Each operation is rounded to float32 in the
    order written (the kernel uses ``__fmul_rn``/``__fadd_rn``, no fused multiply-add); the sum
    over j is the reduction. No floor/ceil, no atomics. Mass preserving up to the rounding of
    the positions (a weight moves by about ``ulp(max|z|) / dz``); a ``Tz`` exactly on an atom
    puts weight 1 there (neighbours get at most that rounding leak).

    Shapes: ``p_next [B, NA]``, ``r [B]``, ``done [B]``, ``z [NA]`` float32; ``gamma`` a real
    scalar (any value; it may come from the ISV bus); ``v_min < v_max`` finite scalars (else
    ValueError); returns ``m [B, NA]`` float32.

    NaN/Inf contract: the clips propagate NaN (``isnan(t) ? t : fminf(fmaxf(t, lo), hi)``, not a
    bare ``fminf(fmaxf())`` that would map a NaN target to ``v_min``): a NaN in ``r_b``,
    ``done_b``, ``gamma`` or anywhere in ``p_next[b]`` makes the whole row ``m[b]`` NaN (a NaN
    ``p_j`` times a zero weight is still NaN). ``r_b = +/-Inf`` is clipped to ``v_max``/``v_min``
    (a finite, mass-preserving row); ``gamma = +/-Inf`` with ``done_b = 1`` gives ``Inf * 0 =
    NaN``. With a ``discount`` (``[B]``, ``gamma_ref`` in ``(0, 1)``; ``n_step_on = 1`` on the
    device), ``gamma`` and ``discount`` enter through ``effective_gamma`` and its floors (a NaN
    there is floored to a finite value, see it); an infinite ``gamma_b`` reaches row b only.
    """
    g, lo, hi, dz = validate_c51_project(p_next, r, done, gamma, z, v_min, v_max, discount,
                                         gamma_ref)
    g_b = effective_gamma(g, discount, gamma_ref)  # scalar (1-step) or [B]
    step_discount = g_b * (np.float32(1) - done)  # [B]
    target = r[:, np.newaxis] + step_discount[:, np.newaxis] * z[np.newaxis, :]  # [B, NA_j]
    target = np.minimum(np.maximum(target, lo), hi)  # NaN-propagating clip
    distance = np.abs(target[:, :, np.newaxis] - z[np.newaxis, np.newaxis, :])  # [B, j, i]
    weight = np.minimum(np.maximum(np.float32(1) - distance / dz, np.float32(0)), np.float32(1))
    m = np.sum(p_next[:, :, np.newaxis] * weight, axis=1, dtype=F32)
    return m.astype(F32, copy=False)


class C51Loss(NamedTuple):
    """Outputs of ``c51_loss``: per-sample cross-entropy ``ce [B]`` and the weighted total."""

    ce: np.ndarray
    total: np.float32


@ieee
def c51_loss(
    logp: np.ndarray,
    actions: np.ndarray,
    m: np.ndarray,
    isw: np.ndarray,
    scale,
) -> C51Loss:
    """C51 cross-entropy at the taken actions.

    ``ce_b = -sum_j m[b, j] * logp[b, a_b, j]``; ``total = scale * sum_b (isw_b * ce_b)`` (the
    sum first, then one multiply). The caller passes ``scale = 1 / (B * n_branches)`` so that
    summing the branch totals gives SPEC's mean over branches of the isw-weighted batch mean.

    Shapes: ``logp [B, A, NA]`` float32, ``actions [B]`` int32 in ``[0, A)`` (else ValueError),
    ``m [B, NA]``, ``isw [B]`` float32, ``scale`` a real scalar; returns
    ``C51Loss(ce [B] float32, total float32 scalar)``.
    NaN/Inf contract: IEEE, unguarded; only the taken action's row of ``logp`` is read (NaN in
    other actions does not matter). NaN in ``m[b]`` or the taken ``logp`` row makes ``ce_b``
    NaN; ``m = 0`` against ``logp = -Inf`` gives ``0 * -Inf = NaN`` (as torch's soft-target
    cross-entropy). Any NaN ``ce_b``, ``isw_b`` or ``scale`` makes ``total`` NaN.
    """
    s = validate_c51_loss(logp, actions, m, isw, scale)
    ce = -np.sum(m * _taken(logp, actions), axis=-1, dtype=F32)
    total = s * np.sum(isw * ce, dtype=F32)
    return C51Loss(ce=ce.astype(F32, copy=False), total=np.float32(total))


@ieee
def c51_grad(
    logp: np.ndarray,
    actions: np.ndarray,
    m: np.ndarray,
    isw: np.ndarray,
    scale,
) -> np.ndarray:
    """Gradient of ``c51_loss``'s total w.r.t. the logits (through the log-softmax).

    ``dlogits[b, a_b, j] = (isw_b * scale) * (exp(logp[b, a_b, j]) - m[b, j])``; exactly ``+0.0``
    for every other action (assuming ``sum_j m[b, j] = 1``, which ``c51_project`` gives).

    Shapes: as ``c51_loss``; returns ``dlogits [B, A, NA]`` float32.
    NaN/Inf contract: IEEE at the taken action (NaN in the taken ``logp`` row, ``m[b]``,
    ``isw_b`` or ``scale`` gives NaN there); other actions are written 0 regardless of their
    ``logp``. ``logp <= 0`` keeps ``exp`` from overflowing (seed audit).
    """
    s = validate_c51_grad(logp, actions, m, isw, scale)
    batch = logp.shape[0]
    weight = isw * s  # [B]
    taken_grad = weight[:, np.newaxis] * (np.exp(_taken(logp, actions)) - m)
    dlogits = np.zeros(logp.shape, dtype=F32)
    dlogits[np.arange(batch), actions] = taken_grad
    return dlogits


class CqlGrad(NamedTuple):
    """Outputs of ``cql_logit_grad``: ``dlogits [B, A, NA]`` and ``terms [B]``."""

    dlogits: np.ndarray
    terms: np.ndarray


@ieee
def cql_logit_grad(
    logp: np.ndarray,
    actions: np.ndarray,
    z: np.ndarray,
    alpha,
    scale,
) -> CqlGrad:
    """CQL penalty per sample and its gradient w.r.t. the logits, for one branch.

    ``Q = expected_q(logp, z)`` ``[B, A]``; ``mQ_b = max_a Q[b, a]``;
    ``e = exp(Q - mQ)``, ``s_b = sum_a e`` (action order; ``s >= 1``, so no epsilon);
    ``terms_b = (mQ_b + log s_b) - Q[b, a_b]`` (logsumexp minus the taken action's Q);
    ``dQ[b, a] = (alpha * scale) * (e[b, a] / s_b - 1[a = a_b])``;
    ``dlogits[b, a, j] = dQ[b, a] * (p[b, a, j] * (z_j - Q[b, a]))`` with ``p = exp(logp)``.
    The caller passes ``scale = 1 / (B * n_branches)``; the branch loss is
    ``alpha * mean_b terms`` (caller).

    Shapes: ``logp [B, A, NA]`` float32, ``actions [B]`` int32 in ``[0, A)`` (else ValueError),
    ``z [NA]`` float32, ``alpha`` and ``scale`` real scalars (may be non-finite, ISV slot 48);
    returns ``CqlGrad(dlogits [B, A, NA] float32, terms [B] float32)``.
    NaN/Inf contract: per sample, IEEE, unguarded. A NaN anywhere in ``logp[b]`` (any action)
    makes ``Q[b, .]`` partly NaN, hence ``s_b``, ``terms_b`` and all of ``dlogits[b]`` NaN
    (the max is NaN-propagating; an ``fmaxf`` max gives the same result through ``exp(NaN)``).
    A NaN ``alpha``/``scale`` makes ``dlogits`` NaN but leaves ``terms`` finite.
    """
    a_, s_ = validate_cql_logit_grad(logp, actions, z, alpha, scale)
    batch, num_actions = logp.shape[:2]
    q = expected_q(logp, z)  # [B, A]
    q_max = np.max(q, axis=1)  # [B], NaN-propagating
    e = np.exp(q - q_max[:, np.newaxis])
    s = e[:, 0].copy()
    for a in range(1, num_actions):
        s = s + e[:, a]
    terms = (q_max + np.log(s)) - _taken(q, actions)
    one_hot = np.zeros((batch, num_actions), dtype=F32)
    one_hot[np.arange(batch), actions] = np.float32(1)
    d_q = (a_ * s_) * (e / s[:, np.newaxis] - one_hot)  # [B, A]
    p = np.exp(logp)
    dlogits = d_q[:, :, np.newaxis] * (p * (z[np.newaxis, np.newaxis, :] - q[:, :, np.newaxis]))
    return CqlGrad(dlogits=dlogits.astype(F32, copy=False), terms=terms.astype(F32, copy=False))


# --------------------------------------------------------------------------------------------
# Fused kernels: compositions of the kernels above, one launch each on the device.
# --------------------------------------------------------------------------------------------


class LogSoftmaxQ(NamedTuple):
    """Outputs of ``log_softmax_expected_q``: ``logp [R, NA]`` and ``q [q_rows]``."""

    logp: np.ndarray
    q: np.ndarray


@ieee
def log_softmax_expected_q(logits: np.ndarray, z: np.ndarray, q_rows) -> LogSoftmaxQ:
    """``log_softmax_atoms`` over every row, then ``expected_q`` over the first ``q_rows`` rows.

    ``logp = log_softmax_atoms(logits)``;
    ``q[r] = expected_q(logp[:q_rows] as [q_rows, 1, NA], z)[r, 0] = sum_j exp(logp[r, j]) * z_j``
    for ``r < q_rows``. One row is one (sample, action) atom vector of the packed logits (the
    step's online rows come first, so ``q`` is the online Q of every action).

    Shapes: ``logits [R, NA]`` float32 (NA >= 1), ``z [NA]`` float32, ``q_rows`` an int with
    ``0 <= q_rows <= R`` (else ValueError); returns ``LogSoftmaxQ(logp [R, NA], q [q_rows])``
    float32.
    NaN/Inf contract: the two kernels' contracts composed. Per row, a NaN or ``+Inf`` logit
    anywhere, or a row of all ``-Inf``, makes the whole ``logp`` row NaN, hence its ``q`` NaN;
    otherwise a ``-Inf`` logit gives ``logp = -Inf`` and contributes exactly 0 to ``q``. A NaN in
    ``z`` makes every ``q`` NaN (``logp`` does not read ``z``); rows ``>= q_rows`` reach ``logp``
    only.
    """
    rows = validate_log_softmax_expected_q(logits, z, q_rows)
    logp = log_softmax_atoms(logits)
    num_atoms = logits.shape[1]
    q = expected_q(np.ascontiguousarray(logp[:rows]).reshape(rows, 1, num_atoms), z)
    return LogSoftmaxQ(logp=logp, q=q.reshape(rows).astype(F32, copy=False))


class C51ProjectGrad(NamedTuple):
    """Outputs of ``c51_project_grad``: ``m [B, NA]`` and ``dlogits [B, A, NA]``."""

    m: np.ndarray
    dlogits: np.ndarray


@ieee
def c51_project_grad(
    p_next: np.ndarray,
    r: np.ndarray,
    done: np.ndarray,
    gamma,
    z: np.ndarray,
    v_min,
    v_max,
    logp: np.ndarray,
    actions: np.ndarray,
    isw: np.ndarray,
    scale,
    discount: np.ndarray | None = None,
    gamma_ref=None,
) -> C51ProjectGrad:
    """``c51_project`` followed by ``c51_grad`` on the projected target, in one launch.

    ``m = c51_project(p_next, r, done, gamma, z, v_min, v_max, discount, gamma_ref)``;
    ``dlogits = c51_grad(logp, actions, m, isw, scale)``, i.e.
    ``dlogits[b, a_b, j] = (isw_b * scale) * (exp(logp[b, a_b, j]) - m[b, j])`` and ``+0.0``
    at every other action. Formulas and rounding order are the two kernels' (see them).

    Shapes: ``p_next [B, NA]`` (NA >= 2), ``r [B]``, ``done [B]``, ``z [NA]``, ``isw [B]``
    float32; ``logp [B, A, NA]`` float32; ``actions [B]`` int32 in ``[0, A)``; ``gamma``,
    ``scale`` real scalars (any value; ISV bus / arena); ``v_min < v_max`` finite (else
    ValueError, as every shape or dtype mismatch); returns ``C51ProjectGrad(m [B, NA],
    dlogits [B, A, NA])`` float32.
    NaN/Inf contract: the two kernels' contracts composed. A NaN in ``r_b``, ``done_b``,
    ``gamma`` or anywhere in ``p_next[b]`` (or ``gamma = +/-Inf`` with ``done_b = 1``) makes
    ``m[b]`` NaN, hence the taken row ``dlogits[b, a_b]`` NaN; ``r_b = +/-Inf`` is clipped (a
    finite row). A NaN in the taken ``logp`` row (elementwise), ``isw_b`` or ``scale`` makes the
    taken gradient NaN there; the other actions' rows are ``+0.0`` whatever ``logp``, ``m`` or
    the scalars hold.
    """
    validate_c51_project_grad(p_next, r, done, gamma, z, v_min, v_max, logp, actions, isw, scale,
                              discount, gamma_ref)
    m = c51_project(p_next, r, done, gamma, z, v_min, v_max, discount, gamma_ref)
    return C51ProjectGrad(m=m, dlogits=c51_grad(logp, actions, m, isw, scale))


def validate_c51_project_grad_live(
    p_next, r, done, gamma, z, bounds, logp, actions, isw, scale, discount=None, gamma_ref=None
) -> tuple[ProjectArgs, np.float32]:
    """The argument checks of ``c51_project_grad_live``: ``bounds`` float32 ``[3]`` holding a
    live support's ``(v_min, v_max, dz)`` (``live_support_build``: finite, ``v_min < v_max``,
    ``dz = atom_spacing(v_min, v_max, NA)``, else ValueError), then ``c51_project_grad``'s
    checks with ``v_min, v_max = bounds[:2]``."""
    _require_vector("bounds", bounds, 3, "[3], a live support's (v_min, v_max, dz)")
    out = validate_c51_project_grad(p_next, r, done, gamma, z, bounds[0], bounds[1], logp,
                                    actions, isw, scale, discount, gamma_ref)
    if bounds[2] != out[0].dz:
        raise ValueError(f"bounds: dz {bounds[2]!r} is not the spacing {out[0].dz!r} of "
                         f"[{bounds[0]!r}, {bounds[1]!r}] (live_support_build writes it)")
    return out


@ieee
def c51_project_grad_live(
    p_next: np.ndarray,
    r: np.ndarray,
    done: np.ndarray,
    gamma,
    z: np.ndarray,
    bounds: np.ndarray,
    logp: np.ndarray,
    actions: np.ndarray,
    isw: np.ndarray,
    scale,
    discount: np.ndarray | None = None,
    gamma_ref=None,
) -> C51ProjectGrad:
    """``c51_project_grad`` on a live support (``DQNConfig.adaptive_atoms``): ``z [NA]`` one
    branch's row of ``live_support_build``'s ``z`` and ``bounds [3]`` its ``(v_min, v_max,
    dz)``, which the device reads through a pointer (no host value). Formulas, shapes and the
    NaN contract are ``c51_project_grad``'s with ``v_min, v_max = bounds[0], bounds[1]`` (the
    targets clipped into the branch's live range)."""
    validate_c51_project_grad_live(p_next, r, done, gamma, z, bounds, logp, actions, isw, scale,
                                   discount, gamma_ref)
    return c51_project_grad(p_next, r, done, gamma, z, bounds[0], bounds[1], logp, actions, isw,
                            scale, discount, gamma_ref)


KERNELS = {
    "dueling_combine": dueling_combine,
    "dueling_combine_backward": dueling_combine_backward,
    "log_softmax_atoms": log_softmax_atoms,
    "expected_q": expected_q,
    "double_dqn_select": double_dqn_select,
    "c51_project": c51_project,
    "c51_loss": c51_loss,
    "c51_grad": c51_grad,
    "cql_logit_grad": cql_logit_grad,
    "log_softmax_expected_q": log_softmax_expected_q,
    "c51_project_grad": c51_project_grad,
    "c51_project_grad_live": c51_project_grad_live,
}
