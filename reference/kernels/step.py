"""Reference kernels of the training step's own bookkeeping (``cuda_src/step.cu``): the step's
ISV-driven bounds, the Mech 10 clamp with its bound read from the ISV, the double-DQN choice
with its gathers, the scalar targets, the TD errors' branch mean, the trunk gradient's sum and
masks, the step scalars, and the merge of sentinel pieces. Each is the plain-NumPy twin of the
CUDA kernel of the same name, in the kernel's float32 order (``-fmad=false``: every product
and sum rounded on its own). The reference ``Trainer`` / ``loss_and_grads`` call these twins
where the orders agree; two compute the same values in another order and keep it (their
results are reductions within the step-conformance bounds): the scalar targets' expectation
(``p_next @ z`` there, atom by atom in ``scalar_target_q_branches``) and the loss scalars'
means (NumPy's pairwise ``mean`` there, ``block_total`` in ``loss_scalars``).

Branch-packed arrays follow ``foxhunt.reference.kernels.fused``: branch ``d`` of an array with
``R`` samples per block sits at element ``R * off_d * inner`` (``off_d`` the actions of the
branches before it, ``inner`` the per-action width: ``NA`` for log-probabilities, 1 for Q).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from foxhunt.reference.backend import READBACK_FIELDS
from foxhunt.reference.kernels import dense, distributional, optim, safety
from foxhunt.reference.kernels.argcheck import check_f32_array, check_int, require_array
from foxhunt.reference.kernels import fused
from foxhunt.reference.kernels.fused import require_branches, branch_offsets

F32 = np.float32
I32 = np.int32

#: Position of each step scalar in the device ``readback`` block (``backend.READBACK_FIELDS``'s
#: order; ``loss_scalars`` and ``step_scalars`` write them; ``safety_clip_fired`` is 1.0 or 0.0).
READBACK_INDEX = {name: i for i, name in enumerate(READBACK_FIELDS)}


def _f32(name: str, value) -> np.float32:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{name}: {value!r} is not a real scalar")
    return F32(value)


def _isv_bound(mult: np.float32, value: np.float32) -> np.float32:
    """``mult * fmaxf(value, 1)`` (``safety.isv_bound`` without its argument checks: the
    kernels take any float32 multiplier)."""
    with np.errstate(all="ignore"):
        return F32(mult * np.fmax(F32(value), F32(1)))


# --------------------------------------------------------------------------------------------
# Step bounds (graph 1's first kernel)
# --------------------------------------------------------------------------------------------


class StepBounds(NamedTuple):
    """Outputs of ``step_bounds``: ``adam_t`` (int64 [1], advanced), ``weight_clamp``,
    ``clip_bound`` (float32 [1] each) and ``thresholds`` (float32 [K])."""

    adam_t: np.ndarray
    weight_clamp: np.ndarray
    clip_bound: np.ndarray
    thresholds: np.ndarray


def validate_step_bounds(isv, adam_t, thr_mult, thr_isv_index, thr_power, q_abs_ref_index,
                         slow_ema_index, weight_clamp_mult, max_grad_norm, anchor_mult):
    """The argument checks of ``step_bounds``; returns ``(q_abs_ref_index, slow_ema_index,
    weight_clamp_mult, max_grad_norm, anchor_mult)`` as the kernel receives them."""
    check_f32_array("isv", isv, ndim=1)
    require_array("adam_t", adam_t, np.int64, ndim=1)
    if adam_t.shape != (1,):
        raise ValueError(f"adam_t: shape {adam_t.shape}; expected [1] (Adam's step counter)")
    check_f32_array("thr_mult", thr_mult, ndim=1)
    require_array("thr_isv_index", thr_isv_index, I32, ndim=1)
    require_array("thr_power", thr_power, I32, ndim=1)
    n = isv.shape[0]
    if thr_isv_index.shape != thr_mult.shape or thr_power.shape != thr_mult.shape:
        raise ValueError(f"thr_isv_index, thr_power: shapes {thr_isv_index.shape}, "
                         f"{thr_power.shape}; expected {thr_mult.shape} (one per threshold)")
    if np.any(thr_isv_index >= n):
        raise ValueError(f"thr_isv_index: {thr_isv_index.max()} is not an ISV slot (ISV length {n})")
    if np.any((thr_power != 1) & (thr_power != 2)):
        raise ValueError(f"thr_power: {sorted(set(thr_power.tolist()))}; allowed powers are 1 and 2")
    return (check_int("q_abs_ref_index", q_abs_ref_index, minimum=0, maximum=n - 1),
            check_int("slow_ema_index", slow_ema_index, minimum=0, maximum=n - 1),
            _f32("weight_clamp_mult", weight_clamp_mult), _f32("max_grad_norm", max_grad_norm),
            _f32("anchor_mult", anchor_mult))


def step_bounds(isv: np.ndarray, adam_t: np.ndarray, thr_mult: np.ndarray,
                thr_isv_index: np.ndarray, thr_power: np.ndarray, q_abs_ref_index: int,
                slow_ema_index: int, weight_clamp_mult, max_grad_norm, anchor_mult) -> StepBounds:
    """The step's ISV-driven bounds, from the ISV at the start of the step:

    - ``weight_clamp = weight_clamp_mult * fmaxf(isv[q_abs_ref_index], 1)`` (Mech 9);
    - ``clip_bound = fminf(max_grad_norm, anchor_mult * fmaxf(isv[slow_ema_index], 1))``
      (Mech 6's anchored safety clip);
    - ``thresholds[k] = thr_mult[k] * e`` (``thr_power[k] == 1``) or ``thr_mult[k] * (e * e)``
      (power 2) with ``e = fmaxf(isv[thr_isv_index[k]], 1)``, and 0 where ``thr_isv_index[k] <
      0`` (``sentinels.sentinel_thresholds``; 0 means "non-finite test only");
    - ``adam_t + 1`` (Adam's step counter).

    Shapes: ``isv`` float32 [L]; ``adam_t`` int64 [1]; ``thr_*`` [K] (float32, int32, int32).
    NaN contract: ``fmaxf`` takes the non-NaN operand, so a NaN ISV slot gives the bare
    multiplier; ``fminf`` likewise; +Inf gives +Inf (no bound).
    """
    q_index, slow_index, wc_mult, mgn, anchor = validate_step_bounds(
        isv, adam_t, thr_mult, thr_isv_index, thr_power, q_abs_ref_index, slow_ema_index,
        weight_clamp_mult, max_grad_norm, anchor_mult)
    with np.errstate(all="ignore"):
        e = np.fmax(isv[np.maximum(thr_isv_index, 0)], F32(1))
        base = np.where(thr_power == 2, e * e, e).astype(F32)
        thresholds = np.where(thr_isv_index >= 0, thr_mult * base, F32(0)).astype(F32)
    weight_clamp = _isv_bound(wc_mult, isv[q_index])
    clip_bound = F32(np.fmin(mgn, _isv_bound(anchor, isv[slow_index])))
    return StepBounds(adam_t + 1, np.array([weight_clamp], F32), np.array([clip_bound], F32),
                      thresholds)


# --------------------------------------------------------------------------------------------
# Mech 10's clamp with its bound from the ISV
# --------------------------------------------------------------------------------------------


class ClampMirror(NamedTuple):
    """Outputs of ``clamp_finite_isv``: ``out`` (float32) and its BF16 bits ``out_bf16``
    (uint16, same shape; empty unless asked for: the kernel skips a null mirror pointer)."""

    out: np.ndarray
    out_bf16: np.ndarray


def validate_clamp_finite_isv(x, isv, index, mult) -> tuple[int, np.float32]:
    """The argument checks of ``clamp_finite_isv``; returns ``(index, mult)``."""
    check_f32_array("x", x)
    check_f32_array("isv", isv, ndim=1)
    return check_int("index", index, minimum=0, maximum=isv.shape[0] - 1), _f32("mult", mult)


def clamp_finite_isv(x: np.ndarray, isv: np.ndarray, index: int, mult, with_bf16: bool = False
                     ) -> ClampMirror:
    """``out = clamp_finite(x, mult * fmaxf(isv[index], 1))`` and, with ``with_bf16``, its BF16
    mirror ``f32_to_bf16(out)`` (the next BF16 GEMM's operand). Mech 10 with the bound read
    from the ISV slot inside the step graph.

    Shapes: ``x`` float32, any shape; ``isv`` float32 [L]. NaN contract: ``clamp_finite``'s
    (NaN and +/-Inf become +0.0); a NaN ISV value gives the bound ``mult``.
    """
    index, mult = validate_clamp_finite_isv(x, isv, index, mult)
    bound = _isv_bound(mult, isv[index])
    out = safety.clamp_finite(x, bound)
    return ClampMirror(out, dense.f32_to_bf16(out) if with_bf16 else np.zeros(0, np.uint16))


# --------------------------------------------------------------------------------------------
# Double-DQN choice, gathers, scalar targets, TD errors
# --------------------------------------------------------------------------------------------


class DoubleDqnGather(NamedTuple):
    """Outputs of ``double_dqn_gather_branches``: ``a_star`` int32 [D, B], ``p_next`` float32
    [D, B, NA], ``q_taken`` float32 [D, B]."""

    a_star: np.ndarray
    p_next: np.ndarray
    q_taken: np.ndarray


def validate_double_dqn_gather_branches(logp_target, q_online, actions, branches, batch):
    """The argument checks of ``double_dqn_gather_branches``; returns ``(branches, batch,
    q_rows)``."""
    branches = require_branches(branches)
    batch = check_int("batch", batch, minimum=1)
    a_total = sum(branches)
    require_array("logp_target", logp_target, F32, ndim=2)
    if logp_target.shape[0] != batch * a_total:
        raise ValueError(f"logp_target: shape {logp_target.shape}; expected [batch * A_total = "
                         f"{batch * a_total}, NA]")
    require_array("q_online", q_online, F32, ndim=1)
    if q_online.shape[0] % a_total or q_online.shape[0] // a_total < 2 * batch:
        raise ValueError(f"q_online: shape {q_online.shape}; expected [q_rows * A_total] with "
                         f"q_rows >= 2 batch = {2 * batch}")
    q_rows = q_online.shape[0] // a_total
    require_array("actions", actions, I32, ndim=2)
    if actions.shape != (len(branches), batch):
        raise ValueError(f"actions: shape {actions.shape}; expected [D, batch] = {(len(branches), batch)}")
    for d, n in enumerate(branches):
        if np.any((actions[d] < 0) | (actions[d] >= n)):
            raise ValueError(f"actions: row {d} holds an action outside [0, {n})")
    return branches, batch, q_rows


def double_dqn_gather_branches(logp_target: np.ndarray, q_online: np.ndarray, actions: np.ndarray,
                               branches, batch: int) -> DoubleDqnGather:
    """Every branch's double-DQN choice and the gathers of ``loss_and_grads``:

    - ``a_star[d, b] = double_dqn_select(Q_d(s2))[b]``, ``Q_d(s2)`` the rows ``batch..2 batch``
      of branch d's block of ``q_online`` (lowest index on ties);
    - ``p_next[d, b, :] = exp(logp_target_d[b, a_star[d, b], :])`` (float32 ``np.exp``);
    - ``q_taken[d, b] = Q_d(s)[b, actions[d, b]]`` (rows ``0..batch``).

    Shapes: ``logp_target`` float32 [batch * A_total, NA] (branch-packed, ``batch`` samples per
    block); ``q_online`` float32 [q_rows * A_total] (branch-packed, ``q_rows >= 2 batch``
    samples per block); ``actions`` int32 [D, batch], each in ``[0, n_d)``. NaN contract:
    ``double_dqn_select``'s (a NaN Q never wins a comparison); ``exp`` propagates NaN.
    """
    branches, batch, q_rows = validate_double_dqn_gather_branches(logp_target, q_online, actions,
                                                                  branches, batch)
    na = logp_target.shape[1]
    rows = np.arange(batch)
    a_star = np.zeros((len(branches), batch), I32)
    p_next = np.zeros((len(branches), batch, na), F32)
    q_taken = np.zeros((len(branches), batch), F32)
    for d, (n, off) in enumerate(zip(branches, branch_offsets(branches))):
        q = q_online[q_rows * off:q_rows * (off + n)].reshape(q_rows, n)
        a_star[d] = distributional.double_dqn_select(q[batch:2 * batch].copy())
        logp = logp_target[batch * off:batch * (off + n)].reshape(batch, n, na)
        with np.errstate(all="ignore"):
            p_next[d] = np.exp(logp[rows, a_star[d]])
        q_taken[d] = q[rows, actions[d]]
    return DoubleDqnGather(a_star, p_next, q_taken)


class C51GatherProjectDueling(NamedTuple):
    """Outputs of ``c51_gather_project_dueling_branches``: ``double_dqn_gather_branches``'
    ``a_star`` int32 [D, B], ``p_next`` [D, B, NA], ``q_taken`` [D, B]; the projections' ``m``
    [D, B, NA] and branch-packed logit gradients ``dlogits`` [B * A_total, NA]; the dueling
    backward's ``dv`` [B, NA] and branch-packed ``dadv`` [B * A_total, NA] (float32)."""

    a_star: np.ndarray
    p_next: np.ndarray
    q_taken: np.ndarray
    m: np.ndarray
    dlogits: np.ndarray
    dv: np.ndarray
    dadv: np.ndarray


def validate_c51_gather_project_dueling_branches(logp_target, q_online, actions, logp, r, done,
                                                 gamma, z, v_min, v_max, isw, scale, branches,
                                                 batch, discount=None, gamma_ref=None):
    """The argument checks of ``c51_gather_project_dueling_branches``, all before any work:
    ``double_dqn_gather_branches``', ``logp`` with ``q_rows`` samples per block and
    ``logp_target``'s atoms, ``gamma [D]`` float32, then ``c51_project_grad``'s for every branch
    (on a stand-in ``p_next``). Returns ``(branches, batch, q_rows, (lo, hi, dz), scale)`` (the
    projection's float32 clip range and spacing, and ``scale``)."""
    branches, batch, q_rows = validate_double_dqn_gather_branches(logp_target, q_online, actions,
                                                                  branches, batch)
    rows = fused.require_packed("logp", logp, branches)
    na = logp_target.shape[1]
    if rows != q_rows or logp.shape[1] != na:
        raise ValueError(f"logp: shape {logp.shape}; expected [q_rows * A_total, NA] = "
                         f"[{q_rows * sum(branches)}, {na}] (q_online's rows, logp_target's "
                         "atoms)")
    require_array("gamma", gamma, F32, ndim=1)
    if gamma.shape[0] != len(branches):
        raise ValueError(f"gamma: shape {gamma.shape}; expected [D] = [{len(branches)}]")
    stand_in = np.zeros((batch, na), F32)
    for d, logp_d in enumerate(fused.split_branches(logp, branches)):
        (_, lo, hi, dz), s = distributional.validate_c51_project_grad(
            stand_in, r, done, gamma[d], z, v_min, v_max, logp_d[:batch], actions[d], isw, scale,
            discount, gamma_ref)
    return branches, batch, q_rows, (lo, hi, dz), s


def c51_gather_project_dueling_branches(logp_target: np.ndarray, q_online: np.ndarray,
                                        actions: np.ndarray, logp: np.ndarray, r: np.ndarray,
                                        done: np.ndarray, gamma: np.ndarray, z: np.ndarray, v_min,
                                        v_max, isw: np.ndarray, scale, branches, batch: int,
                                        discount: np.ndarray | None = None,
                                        gamma_ref=None) -> C51GatherProjectDueling:
    """The C51 chain's front in one launch, the composition of three kernels:

    - ``g = double_dqn_gather_branches(logp_target, q_online, actions, branches, batch)``;
    - per branch d: ``c51_project_grad(g.p_next[d], r, done, gamma[d], z, v_min, v_max,
      logp_d[:batch], actions[d], isw, scale, discount, gamma_ref)`` (``logp_d`` branch d's
      ``[q_rows, n_d, NA]`` block of the online pass's log-probabilities; its rows ``0..batch``,
      online(s)), giving ``m[d]`` and branch d's block of ``dlogits``;
    - ``dueling_combine_backward_sum_branches(dlogits, branches)``: ``dv`` and ``dadv``.

    Shapes: ``logp_target [batch * A_total, NA]``, ``q_online [q_rows * A_total]`` and
    ``actions [D, batch]`` as ``double_dqn_gather_branches``; ``logp [q_rows * A_total, NA]``
    branch-packed float32; ``gamma [D]`` float32; ``r``, ``done``, ``z``, ``v_min``, ``v_max``,
    ``isw``, ``scale``, ``discount``, ``gamma_ref`` as ``c51_project_grad`` (ValueError naming
    the argument otherwise). NaN/Inf contract: the three kernels' composed (a NaN Q never wins
    the choice; ``exp`` propagates NaN into ``p_next[d, b]``, hence ``m[d, b]``, the taken row
    of ``dlogits``, every action's ``dadv`` of that branch at those atoms, and ``dv``).
    """
    branches, batch, *_ = validate_c51_gather_project_dueling_branches(
        logp_target, q_online, actions, logp, r, done, gamma, z, v_min, v_max, isw, scale,
        branches, batch, discount, gamma_ref)
    g = double_dqn_gather_branches(logp_target, q_online, actions, branches, batch)
    na = logp.shape[1]
    m = np.zeros((len(branches), batch, na), F32)
    blocks = []
    for d, logp_d in enumerate(fused.split_branches(logp, branches)):
        pg = distributional.c51_project_grad(g.p_next[d], r, done, gamma[d], z, v_min, v_max,
                                             np.ascontiguousarray(logp_d[:batch]), actions[d],
                                             isw, scale, discount, gamma_ref)
        m[d] = pg.m
        blocks.append(pg.dlogits.reshape(-1, na))
    dlogits = np.concatenate(blocks).astype(F32, copy=False)
    duel = fused.dueling_combine_backward_sum_branches(dlogits, branches)
    return C51GatherProjectDueling(g.a_star, g.p_next, g.q_taken, m, dlogits, duel.dv, duel.dadv)


def validate_scalar_target_q_branches(p_next, z, r, done, gamma, discount=None,
                                      gamma_ref=None) -> None:
    """The argument checks of ``scalar_target_q_branches``."""
    require_array("p_next", p_next, F32, ndim=3)
    n_d, b, na = p_next.shape
    for name, x, n in (("z", z, na), ("r", r, b), ("done", done, b), ("gamma", gamma, n_d)):
        require_array(name, x, F32, ndim=1)
        if x.shape[0] != n:
            raise ValueError(f"{name}: shape {x.shape}; expected [{n}]")
    distributional.validate_discount(discount, gamma_ref, b)


def scalar_target_q_branches(p_next: np.ndarray, z: np.ndarray, r: np.ndarray, done: np.ndarray,
                             gamma: np.ndarray, discount: np.ndarray | None = None,
                             gamma_ref=None) -> np.ndarray:
    """Scalar targets before Mech 1: ``target_q[d, b] = r[b] + (g[d, b] * (1 - done[b])) * e``,
    ``e = sum_j p_next[d, b, j] * z[j]`` accumulated from 0 in atom order (each product and sum
    rounded to float32: the kernel's loop); ``g[d, b] = gamma[d]`` for 1-step transitions
    (``discount`` None), else ``distributional.effective_gamma(gamma[d], discount[b],
    gamma_ref)`` (n-step, issue 22; the MSE warm-up's target too).

    Shapes: ``p_next`` float32 [D, B, NA]; ``z`` [NA]; ``r``, ``done`` [B]; ``gamma`` [D];
    ``discount`` [B] or None, ``gamma_ref`` in (0, 1). Returns float32 [D, B]. NaN contract:
    IEEE; NaN and Inf propagate through the sum (``effective_gamma`` floors NaN bases).
    """
    validate_scalar_target_q_branches(p_next, z, r, done, gamma, discount, gamma_ref)
    n_d, b, na = p_next.shape
    with np.errstate(all="ignore"):
        e = np.zeros((n_d, b), F32)
        for j in range(na):
            e = (e + p_next[:, :, j] * z[j]).astype(F32)
        g = distributional.effective_gamma(gamma[:, None], discount, gamma_ref)  # [D, 1 or B]
        step_discount = (g * (F32(1) - done[None, :])).astype(F32)
        return (r[None, :] + step_discount * e).astype(F32)


def validate_branch_mean(parts, divisor) -> np.float32:
    """The argument checks of ``branch_mean``; returns ``divisor`` as float32."""
    require_array("parts", parts, F32, ndim=2)
    if parts.shape[0] < 1:
        raise ValueError(f"parts: shape {parts.shape}; expected at least one part")
    return _f32("divisor", divisor)


def branch_mean(parts: np.ndarray, divisor) -> np.ndarray:
    """``out[i] = ((0 + parts[0, i] / divisor) + parts[1, i] / divisor) + ...`` (float32,
    left to right): the TD errors ``td = td + ce / nb`` of ``loss_and_grads`` with ``divisor``
    the branch count (a divisor of 1 is exact).

    Shapes: ``parts`` float32 [D, N]. Returns float32 [N]. NaN contract: IEEE.
    """
    div = validate_branch_mean(parts, divisor)
    with np.errstate(all="ignore"):
        acc = np.zeros(parts.shape[1], F32)
        for d in range(parts.shape[0]):
            acc = (acc + parts[d] / div).astype(F32)
    return acc


class TrunkGrad(NamedTuple):
    """Outputs of ``h2_grad_sum_mask``: ``dh2`` (the summed trunk gradient) and ``out`` (masked
    by the clamp and the ReLU), float32 of ``h2``'s shape."""

    dh2: np.ndarray
    out: np.ndarray


def validate_h2_grad_sum_mask(parts, h2, h2_pre) -> None:
    """The argument checks of ``h2_grad_sum_mask``."""
    require_array("parts", parts, F32)
    check_f32_array("h2", h2)
    check_f32_array("h2_pre", h2_pre)
    if parts.ndim < 1 or parts.shape[1:] != h2.shape or h2_pre.shape != h2.shape:
        raise ValueError(f"parts, h2, h2_pre: shapes {parts.shape}, {h2.shape}, {h2_pre.shape}; "
                         "expected [K, *S], [*S], [*S]")


def h2_grad_sum_mask(parts: np.ndarray, h2: np.ndarray, h2_pre: np.ndarray) -> TrunkGrad:
    """The heads' parts of ``dh2`` summed in the reference's order (``dh2 = dh2 + part`` from
    zeros, parts in order), then the backward through Mech 10's clamp and the trunk ReLU:
    ``passed = (h2 == h2_pre) ? dh2 : 0`` (the clamp left the value unchanged) and ``out =
    (h2_pre <= 0) ? 0 : passed`` (``dense.relu_mask`` on the pre-clamp activation).

    Shapes: ``parts`` float32 [K, *S]; ``h2`` and ``h2_pre`` float32 [*S]. NaN contract: the
    sum is IEEE; a NaN ``h2_pre`` fails both comparisons (passed 0, then not ``<= 0``: 0 out).
    """
    validate_h2_grad_sum_mask(parts, h2, h2_pre)
    with np.errstate(all="ignore"):
        total = np.zeros(h2.shape, F32)
        for part in parts:
            total = (total + part).astype(F32)
    passed = np.where(h2 == h2_pre, total, F32(0)).astype(F32)
    return TrunkGrad(total, np.where(h2_pre <= 0, F32(0), passed).astype(F32))


def validate_h2_guard_mask(x, m, h2, h2_pre) -> np.float32:
    """The argument checks of ``h2_guard_mask``; returns the bound ``m`` in float32."""
    bound = safety.validate_clamp_finite(x, m)
    check_f32_array("h2", h2)
    check_f32_array("h2_pre", h2_pre)
    if h2.shape != x.shape or h2_pre.shape != x.shape:
        raise ValueError(f"x, h2, h2_pre: shapes {x.shape}, {h2.shape}, {h2_pre.shape}; "
                         "expected one shape")
    return bound


def h2_guard_mask(x: np.ndarray, m: float, h2: np.ndarray, h2_pre: np.ndarray) -> TrunkGrad:
    """An auxiliary trunk's guarded ``d h2`` and its masks in one launch (the IQN and ensemble
    trunks): the composition of the two kernels the step ran for it, ``clamp_finite`` with the
    guard's bound and ``h2_grad_sum_mask`` of that one part::

        TrunkGrad = h2_grad_sum_mask(clamp_finite(x, m)[None], h2, h2_pre)

    (``dh2`` is ``0 + clamp_finite(x, m)``: a -0.0 becomes +0.0). Shapes: ``x``, ``h2``,
    ``h2_pre`` float32 of one shape; ``m`` a float32 bound ``>= 0`` (``+Inf`` allowed; the
    kernel forms it on the device as ``multiplier * fmaxf(*signal, 1)``, as ``clamp_finite``).

    NaN contract: the composition's: a non-finite ``x`` gives +0.0 in both outputs; a NaN
    ``h2_pre`` masks to 0."""
    bound = validate_h2_guard_mask(x, m, h2, h2_pre)
    return h2_grad_sum_mask(safety.clamp_finite(x, bound)[None], h2, h2_pre)


class AuxTrunkGrad(NamedTuple):
    """Outputs of ``h2_grad_sum_aux_mask``, float32 of ``h2``'s shape: ``dh2_main`` (the heads'
    sum: sentinel slot 33's), ``dh2`` (with the auxiliary heads' ``d h2`` added: slot 34's) and
    ``out`` (``dh2`` masked by the clamp and the ReLU)."""

    dh2_main: np.ndarray
    dh2: np.ndarray
    out: np.ndarray


def validate_h2_grad_sum_aux_mask(parts, aux, h2, h2_pre) -> None:
    """The argument checks of ``h2_grad_sum_aux_mask``."""
    validate_h2_grad_sum_mask(parts, h2, h2_pre)
    require_array("aux", aux, F32)
    if aux.ndim < 1 or aux.shape[0] not in (1, 2) or aux.shape[1:] != h2.shape:
        raise ValueError(f"aux: shape {aux.shape}; expected [1 or 2, *S] with S = h2's {h2.shape} "
                         "(one auxiliary head's d h2, or the two heads')")


def h2_grad_sum_aux_mask(parts: np.ndarray, aux: np.ndarray, h2: np.ndarray,
                         h2_pre: np.ndarray) -> AuxTrunkGrad:
    """The C51 trunk gradient with the auxiliary heads on, in one launch: the composition of
    the four kernels the step ran for it (``fast.step_program``'s ``_dh2_sum`` and
    ``fast.wave_plan.aux_chain``'s guarded sum), in their order::

        dh2_main = h2_grad_sum_mask(parts, h2, h2_pre).dh2      # the heads' sum (slot 33)
        a        = aux[0]                                       # one head, or the two heads'
                   saxpy(clamp_finite(aux[0], +Inf), aux[1], 1)  #   guarded sum
        dh2      = saxpy(dh2_main, a, 1)                        # slot 34
        out      = h2_grad_sum_mask(dh2[None], h2, h2_pre).out  # the masks of that sum

    Shapes: ``parts`` float32 [K, *S]; ``aux`` float32 [1 or 2, *S] (next bar first, then
    regime, as ``wave_layout.aux_heads``); ``h2``, ``h2_pre`` float32 [*S].

    NaN contract: the composition's. The heads' sum is IEEE (a NaN part reaches ``dh2_main``,
    ``dh2`` and, unless masked, ``out``); a non-finite auxiliary value never reaches ``dh2``
    (the guarded SAXPYs skip it; the first of two heads' becomes +0 first); the masks as
    ``h2_grad_sum_mask`` (a NaN ``h2_pre`` gives 0)."""
    validate_h2_grad_sum_aux_mask(parts, aux, h2, h2_pre)
    main = h2_grad_sum_mask(parts, h2, h2_pre).dh2
    total = aux[0] if aux.shape[0] == 1 else optim.saxpy(
        safety.clamp_finite(aux[0], F32(np.inf)), aux[1], F32(1))
    dh2 = optim.saxpy(main, total, F32(1))
    return AuxTrunkGrad(main, dh2, h2_grad_sum_mask(dh2[None], h2, h2_pre).out)


# --------------------------------------------------------------------------------------------
# Step scalars
# --------------------------------------------------------------------------------------------


class LossScalars(NamedTuple):
    c51_loss: np.float32
    cql_loss: np.float32
    mean_q: np.float32
    mean_target_q: np.float32


def validate_loss_scalars(c51_total, terms, q_taken, target_q, alpha) -> np.float32:
    """The argument checks of ``loss_scalars``; returns ``alpha`` as float32."""
    require_array("c51_total", c51_total, F32, ndim=1)
    shape = (c51_total.shape[0], None)
    for name, x in (("terms", terms), ("q_taken", q_taken), ("target_q", target_q)):
        require_array(name, x, F32, ndim=2)
        if x.shape[0] != shape[0] or (shape[1] is not None and x.shape[1] != shape[1]) or x.shape[1] < 1:
            raise ValueError(f"{name}: shape {x.shape}; expected [D = {shape[0]}, B] with B >= 1 "
                             "shared by terms, q_taken and target_q")
        shape = x.shape
    return _f32("alpha", alpha)


#: Threads of the one block ``loss_scalars`` runs on (``STEP_THREADS`` in ``cuda_src/step.cu``).
LOSS_SCALARS_THREADS = 256
_WARP = 32


def _warp_sum_halving(v: np.ndarray) -> np.ndarray:
    """``reduce.cuh``'s ``warp_sum_halving`` on rows of 32 lanes: ``v[l] += v[l ^ off]`` for
    ``off`` = 16, 8, 4, 2, 1 (float32, each sum rounded); returns lane 0 of every row."""
    lanes = np.arange(_WARP)
    for off in (16, 8, 4, 2, 1):
        v = (v + v[..., lanes ^ off]).astype(F32)
    return v[..., 0]


def block_total(x: np.ndarray, threads: int = LOSS_SCALARS_THREADS) -> np.float32:
    """The float32 sum of ``x`` in ``step_block_total``'s order: thread ``t`` adds ``x[t],
    x[t + threads], ...`` in turn from -0.0; each warp's partials are summed by
    ``_warp_sum_halving``, then the warp sums (padded to 32 with -0.0) by it again; finally
    ``+ 0.0`` (an empty sum is +0.0). The same order as the kernel, so an overflow (a sum of
    huge values of both signs) happens in both or in neither."""
    flat = np.ravel(x).astype(F32)
    rows = np.full((-(-flat.size // threads), threads), F32(-0.0), F32)
    rows.reshape(-1)[:flat.size] = flat
    acc = np.full(threads, F32(-0.0), F32)
    with np.errstate(over="ignore", invalid="ignore"):  # IEEE: overflow gives +-Inf, as on the GPU
        for row in rows:  # each thread's partial, sequential over its strided elements
            acc = (acc + row).astype(F32)
        warps = np.full(_WARP, F32(-0.0), F32)
        warps[:threads // _WARP] = _warp_sum_halving(acc.reshape(-1, _WARP))
        return F32(_warp_sum_halving(warps) + F32(0.0))


def loss_scalars(c51_total: np.ndarray, terms: np.ndarray, q_taken: np.ndarray,
                 target_q: np.ndarray, alpha) -> LossScalars:
    """The loss scalars and means of the readback, in ``loss_and_grads``' order:
    ``c51_loss = ((0 + c51_total[0]) + c51_total[1]) + ...``; ``cql_loss = ((0 + (alpha *
    mean(terms[0])) / D) + (alpha * mean(terms[1])) / D) + ...``; ``mean_q = mean(q_taken)``,
    ``mean_target_q = mean(target_q)``.

    Each mean is ``block_total`` (the kernel's summation order, so bitwise the kernel's sums,
    overflow included) divided by the count in float32.
    Shapes: ``c51_total`` [D]; ``terms``, ``q_taken``, ``target_q`` [D, B]; all float32.
    NaN contract: IEEE; a NaN anywhere in an input makes that scalar NaN; a sum that overflows
    in the kernel's order is +-Inf here too.
    """
    a = validate_loss_scalars(c51_total, terms, q_taken, target_q, alpha)
    n_d = F32(c51_total.shape[0])
    with np.errstate(all="ignore"):
        c51 = cql = F32(0)
        for d in range(c51_total.shape[0]):
            c51 = F32(c51 + c51_total[d])
            mean = F32(block_total(terms[d]) / F32(terms.shape[1]))
            cql = F32(cql + F32(a * mean) / n_d)
        count = F32(q_taken.size)
        return LossScalars(c51, cql, F32(block_total(q_taken) / count),
                           F32(block_total(target_q) / count))


def loss_scalars_ptr(c51_total: np.ndarray, terms: np.ndarray, q_taken: np.ndarray,
                     target_q: np.ndarray, alpha) -> LossScalars:
    """``loss_scalars`` whose CUDA kernel reads ``alpha`` through a device pointer (the CQL-alpha
    ramp's ``ISV[CQL_ALPHA]`` at the step's start, so no host value enters the step). Same
    contract, bit for bit."""
    return loss_scalars(c51_total, terms, q_taken, target_q, alpha)


class StepScalarsOut(NamedTuple):
    """Outputs of ``step_scalars``: ``total_sq``, ``safety_scale`` (float32), the ``readback``
    block (float32 [len(READBACK_FIELDS)]) and the ``isv`` with its slow EMA updated."""

    total_sq: np.float32
    safety_scale: np.float32
    readback: np.ndarray
    isv: np.ndarray


def validate_step_scalars(total_partials, c51_sq, cql_sq, clip_bound, isv, readback, budget_c51,
                          budget_cql, slow_ema_index, slow_alpha):
    """The argument checks of ``step_scalars``; returns ``(c51_sq, cql_sq, clip_bound,
    budget_c51, budget_cql, slow_ema_index, slow_alpha)`` as the kernel receives them."""
    check_f32_array("total_partials", total_partials, ndim=1)
    check_f32_array("isv", isv, ndim=1)
    check_f32_array("readback", readback, ndim=1)
    if readback.shape[0] != len(READBACK_FIELDS):
        raise ValueError(f"readback: shape {readback.shape}; expected [{len(READBACK_FIELDS)}]")
    return (_f32("c51_sq", c51_sq), _f32("cql_sq", cql_sq), _f32("clip_bound", clip_bound),
            _f32("budget_c51", budget_c51), _f32("budget_cql", budget_cql),
            check_int("slow_ema_index", slow_ema_index, minimum=0, maximum=isv.shape[0] - 1),
            _f32("slow_alpha", slow_alpha))


def step_scalars(total_partials: np.ndarray, c51_sq, cql_sq, clip_bound, isv: np.ndarray,
                 readback: np.ndarray, budget_c51, budget_cql, slow_ema_index: int,
                 slow_alpha) -> StepScalarsOut:
    """The step's scalars (beside graph 2's Adam, or at graph 1's end: the fast plan's
    ``graph2_plan.scalars_beside_adam``): ``total_sq = grad_norm_final(total_partials)``, then
    (norms ``n(sq) = sqrtf(fmaxf(sq, 0))``; ``clip_scale`` as ``optim.data_clip_scale``: the
    bound taken as data):

    - ``safety_scale = clip_scale(total_sq, clip_bound)`` (Adam's Mech 6 clip factor);
    - ``readback`` (``READBACK_FIELDS``): ``loss = c51_loss + cql_loss`` (the two entries
      ``loss_scalars`` wrote), ``grad_norm = n(total_sq)``, each loss's norm before its budget
      clip and after it (``n(sq) * clip_scale(sq, budget)``: an overflowed norm gives
      ``inf * 0 = NaN``), ``clip_bound``, ``safety_clip_fired = grad_norm > clip_bound``;
      the other entries are kept;
    - ``isv[slow_ema_index] = (1 - a) * slow + a * grad_norm`` where ``grad_norm`` is finite
      (Mech 6's slow EMA, rate ``grad_slow_ema_alpha``).

    Shapes: ``total_partials`` float32 [P]; ``isv`` float32 [L]; ``readback`` float32 [12].
    NaN contract: the norms take ``fmaxf(sq, 0)`` (NaN gives 0); a NaN ``clip_bound`` never
    fires the clip.
    """
    c51_sq, cql_sq, bound, b_c51, b_cql, slow, a = validate_step_scalars(
        total_partials, c51_sq, cql_sq, clip_bound, isv, readback, budget_c51, budget_cql,
        slow_ema_index, slow_alpha)
    total_sq = optim.grad_norm_final(total_partials)
    rb, ix = readback.copy(), READBACK_INDEX
    with np.errstate(all="ignore"):
        norm = optim.norm_from_sq(total_sq)
        n_c51, n_cql = optim.norm_from_sq(c51_sq), optim.norm_from_sq(cql_sq)
        rb[ix["loss"]] = F32(rb[ix["c51_loss"]] + rb[ix["cql_loss"]])
        rb[ix["grad_norm"]] = norm
        rb[ix["c51_norm_pre"]] = n_c51
        rb[ix["c51_norm_post"]] = F32(n_c51 * optim.data_clip_scale(c51_sq, b_c51))
        rb[ix["cql_norm_pre"]] = n_cql
        rb[ix["cql_norm_post"]] = F32(n_cql * optim.data_clip_scale(cql_sq, b_cql))
        rb[ix["clip_bound"]] = bound
        rb[ix["safety_clip_fired"]] = F32(1) if norm > bound else F32(0)
        out_isv = isv.copy()
        if np.isfinite(norm):
            out_isv[slow] = F32(F32(F32(1) - a) * isv[slow] + F32(a * norm))
    return StepScalarsOut(total_sq, optim.data_clip_scale(total_sq, bound), rb, out_isv)


# --------------------------------------------------------------------------------------------
# Sentinel pieces
# --------------------------------------------------------------------------------------------


def validate_merge_piece_flags(flags, piece_slot, n_slots) -> int:
    """The argument checks of ``merge_piece_flags``; returns ``n_slots``."""
    require_array("flags", flags, I32, ndim=1)
    require_array("piece_slot", piece_slot, I32, ndim=1)
    n_slots = check_int("n_slots", n_slots, minimum=0, maximum=flags.shape[0])
    if n_slots + piece_slot.shape[0] != flags.shape[0]:
        raise ValueError(f"flags: shape {flags.shape}; expected [n_slots + pieces = "
                         f"{n_slots + piece_slot.shape[0]}]")
    if np.any((piece_slot < 0) | (piece_slot >= n_slots)):
        raise ValueError(f"piece_slot: {piece_slot.tolist()} holds a slot outside [0, {n_slots})")
    return n_slots


def merge_piece_flags(flags: np.ndarray, piece_slot: np.ndarray, n_slots: int) -> np.ndarray:
    """A sentinel slot checked as several pieces: ``flags[piece_slot[k]] = 1`` where the extra
    piece's flag ``flags[n_slots + k]`` is set (sticky OR into the slot's flag).

    Shapes: ``flags`` int32 [n_slots + P]; ``piece_slot`` int32 [P], each in ``[0, n_slots)``.
    Returns the new flags (int32, same shape); the pieces' own flags are kept.
    """
    n_slots = validate_merge_piece_flags(flags, piece_slot, n_slots)
    out = flags.copy()
    for k, slot in enumerate(piece_slot):
        if flags[n_slots + k] != 0:
            out[slot] = 1
    return out


KERNELS = {
    "step_bounds": step_bounds,
    "clamp_finite_isv": clamp_finite_isv,
    "double_dqn_gather_branches": double_dqn_gather_branches,
    "c51_gather_project_dueling_branches": c51_gather_project_dueling_branches,
    "scalar_target_q_branches": scalar_target_q_branches,
    "branch_mean": branch_mean,
    "h2_grad_sum_mask": h2_grad_sum_mask,
    "h2_grad_sum_aux_mask": h2_grad_sum_aux_mask,
    "h2_guard_mask": h2_guard_mask,
    "loss_scalars": loss_scalars,
    "loss_scalars_ptr": loss_scalars_ptr,
    "step_scalars": step_scalars,
    "merge_piece_flags": merge_piece_flags,
}
