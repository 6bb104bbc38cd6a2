"""Fast launchers of the training step's own kernels (``cuda_src/step.cu``), twins of
``foxhunt.reference.kernels.step`` under the same names and signatures.

Each public function is a numpy-in/numpy-out test entry (conformance and debugging): it
validates with the reference's ``validate_<name>`` (same ``ValueError``), launches the CUDA
kernel once through ``_runtime.call`` and returns what the reference returns. The step plan
launches the same kernels on arena pointers with the ``plan_*`` launch shapes below.

Kernel arguments: arrays as pointers plus their sizes; values that change on the device from
step to step (norms, the clip bound, Adam's step, the ISV) are read through pointers (a test
entry uploads them); branch-packed arrays take the tables ``n_actions`` / ``action_offset``
(``foxhunt.reference.kernels.fused``); ``clamp_finite_isv``'s BF16 output is skipped when its
pointer is null, ``h2_grad_sum_aux_mask``'s second auxiliary head where its pointer is null.
``clamp_finite_isv``, ``h2_grad_sum_mask``, ``h2_grad_sum_aux_mask`` and ``h2_guard_mask``
take 4 elements per thread where their pointers (and ``part_stride``) are aligned for float4
accesses, a scalar loop otherwise, so their plans launch a quarter of the threads. Numerics: each kernel rounds
where its reference does (``__fadd_rn`` and friends, ``-fmad=false``): exact, but for ``expf``
(a few ulp) and the block-tree means of ``loss_scalars`` and the total norm of
``step_scalars`` (reductions).
"""

from __future__ import annotations

import numpy as np

from foxhunt.fast.kernels._runtime import (
    FLAT_VEC_WIDTH,
    In,
    InOut,
    Out,
    blocks,
    check_elements,
    device_scalar,
    launch,
)
from foxhunt.fast.kernels.optim import plan_grad_norm_final
from foxhunt.reference.kernels.fused import branch_offsets
from foxhunt.reference.kernels.step import (
    READBACK_FIELDS,
    READBACK_INDEX,
    AuxTrunkGrad,
    ClampMirror,
    C51GatherProjectDueling,
    DoubleDqnGather,
    LossScalars,
    StepBounds,
    StepScalarsOut,
    TrunkGrad,
    validate_branch_mean,
    validate_c51_gather_project_dueling_branches,
    validate_clamp_finite_isv,
    validate_double_dqn_gather_branches,
    validate_h2_grad_sum_aux_mask,
    validate_h2_grad_sum_mask,
    validate_h2_guard_mask,
    validate_loss_scalars,
    validate_merge_piece_flags,
    validate_scalar_target_q_branches,
    validate_step_bounds,
    validate_step_scalars,
)

F32, I32, U16 = np.float32, np.int32, np.uint16

#: Threads of the one-block step kernels and the flat ones' block (STEP_THREADS in step.cu).
STEP_THREADS = 256
#: Grid cap of the flat step kernels (grid-stride loops cover the rest).
STEP_MAX_BLOCKS = 1024
#: Threads per ``(branch, sample)`` row of ``double_dqn_gather_branches`` (DDQN_ROW_THREADS in
#: step.cu).
DDQN_ROW_THREADS = 16
#: Lanes per ``(branch, sample)`` row of ``scalar_target_q_branches`` (STQ_GROUP in step.cu).
STQ_GROUP = 16

Plan = tuple[int, int, int]


# ---------------------------------------------------------------------------------------------
# Launch plans
# ---------------------------------------------------------------------------------------------


def plan_flat(n: int) -> Plan:
    """A flat grid-stride launch over ``n`` elements."""
    return min(blocks(n, STEP_THREADS), STEP_MAX_BLOCKS), STEP_THREADS, 0


def plan_flat_vec4(n: int) -> Plan:
    """``plan_flat`` over the ``ceil(n / 4)`` groups of 4 elements: one thread per group (the
    kernel's vector path; its scalar fallback strides over the same grid), the same block and
    grid cap."""
    return plan_flat(blocks(n, FLAT_VEC_WIDTH))


def plan_one_block() -> Plan:
    """ONE block of ``STEP_THREADS`` (the kernels' block reductions assume it)."""
    return 1, STEP_THREADS, 0


plan_step_bounds = plan_one_block
plan_clamp_finite_isv = plan_flat_vec4
plan_branch_mean = plan_flat
plan_h2_grad_sum_mask = plan_flat_vec4
plan_h2_grad_sum_aux_mask = plan_flat_vec4
plan_h2_guard_mask = plan_flat_vec4
plan_loss_scalars = plan_one_block
plan_merge_piece_flags = plan_one_block


def plan_double_dqn_gather_branches(n_branches: int, batch: int, num_atoms: int) -> Plan:
    """``plan_flat`` over ``DDQN_ROW_THREADS`` threads per ``(branch, sample)`` row (the
    kernel's threads per row: each computes the row's choice once and gathers every
    ``DDQN_ROW_THREADS``-th atom; any grid gives the same bits). Seed shapes (3 branches,
    ``batch = 256``): 48 blocks of 256 threads."""
    del num_atoms  # a row's threads stride over its atoms
    return plan_flat(n_branches * batch * DDQN_ROW_THREADS)


#: Threads per block of any launch (CUDA's limit; c51_gather_project_dueling_branches' T * D).
MAX_BLOCK_THREADS = 1024


def gather_project_dueling_fits(n_branches: int, num_atoms: int) -> bool:
    """Whether ``c51_gather_project_dueling_branches`` can run ``n_branches`` branches of
    ``num_atoms`` atoms: one projection block's threads per branch in one block (at most
    ``MAX_BLOCK_THREADS``). Else the step runs its three kernels."""
    from foxhunt.fast.kernels.distributional import plan_c51_project

    return plan_c51_project(1, num_atoms)[1] * int(n_branches) <= MAX_BLOCK_THREADS


def plan_c51_gather_project_dueling_branches(n_branches: int, batch: int, num_atoms: int) -> Plan:
    """One block per sample, block ``(T, D)``: ``c51_project_grad``'s ``T`` threads (whole warps
    covering the atoms, at most 256) for each of the ``D`` branches; dynamic shared memory: each
    branch's two projection tiles and its dueling sums, ``T`` floats each. ``T * D`` at most
    ``MAX_BLOCK_THREADS`` (else ValueError; ``gather_project_dueling_fits``). Seed shapes (3
    branches, ``batch = 256``, 51 atoms): 256 blocks of (64, 3) threads, 2,304 bytes."""
    from foxhunt.fast.kernels.distributional import plan_c51_project

    _, tile, _ = plan_c51_project(batch, num_atoms)
    if not gather_project_dueling_fits(n_branches, num_atoms):
        raise ValueError(f"branches: {n_branches} branches of {num_atoms} atoms need "
                         f"{tile * n_branches} threads per block of "
                         f"c51_gather_project_dueling_branches; at most {MAX_BLOCK_THREADS}")
    return (max(1, int(batch)), 1, 1), (tile, int(n_branches), 1), 3 * tile * int(n_branches) * 4


def plan_scalar_target_q_branches(n_branches: int, batch: int) -> Plan:
    """``plan_flat`` over ``STQ_GROUP`` threads per ``(branch, sample)`` row (the kernel's lanes
    per row: they load the row's atoms together and add their products in atom order; any
    grid gives the same bits). Seed shapes (3 branches, ``batch = 256``): 48 blocks."""
    return plan_flat(n_branches * batch * STQ_GROUP)


def plan_step_scalars(n_partials: int) -> Plan:
    """``grad_norm_final``'s launch over the partials: the total norm is its tree and bits."""
    return plan_grad_norm_final(n_partials)


def _scalar(value, dtype=F32) -> In:
    return In(np.array([value], dtype=dtype))


# ---------------------------------------------------------------------------------------------
# Test entries (reference signatures)
# ---------------------------------------------------------------------------------------------


def step_bounds(isv, adam_t, thr_mult, thr_isv_index, thr_power, q_abs_ref_index, slow_ema_index,
                weight_clamp_mult, max_grad_norm, anchor_mult) -> StepBounds:
    """Test entry of the CUDA ``step_bounds`` (contract as the reference twin)."""
    q, slow, wc, mgn, anchor = validate_step_bounds(
        isv, adam_t, thr_mult, thr_isv_index, thr_power, q_abs_ref_index, slow_ema_index,
        weight_clamp_mult, max_grad_norm, anchor_mult)
    k = thr_mult.shape[0]
    adam, weight_clamp, clip_bound, thresholds = launch(
        "step_bounds", plan_step_bounds(), In(isv), InOut(adam_t), Out((1,), F32), Out((1,), F32),
        In(thr_mult), In(thr_isv_index), In(thr_power), Out((k,), F32), k, q, slow, wc, mgn, anchor)
    return StepBounds(adam, weight_clamp, clip_bound, thresholds)


def clamp_finite_isv(x, isv, index, mult, with_bf16: bool = False) -> ClampMirror:
    """Test entry of the CUDA ``clamp_finite_isv`` (contract as the reference twin); without
    ``with_bf16`` the kernel gets a null BF16 pointer."""
    index, mult = validate_clamp_finite_isv(x, isv, index, mult)
    mirror = Out(x.shape, U16) if with_bf16 else 0
    outs = launch("clamp_finite_isv", plan_clamp_finite_isv(x.size), In(x), Out(x.shape, F32),
                  mirror, x.size, In(isv), index, mult)
    return ClampMirror(outs[0], outs[1] if with_bf16 else np.zeros(0, U16))


def double_dqn_gather_branches(logp_target, q_online, actions, branches, batch) -> DoubleDqnGather:
    """Test entry of the CUDA ``double_dqn_gather_branches`` (contract as the reference twin)."""
    branches, batch, q_rows = validate_double_dqn_gather_branches(logp_target, q_online, actions,
                                                                  branches, batch)
    nb, na = len(branches), logp_target.shape[1]
    a_star, p_next, q_taken = launch(
        "double_dqn_gather_branches", plan_double_dqn_gather_branches(nb, batch, na),
        In(logp_target), Out((nb, batch), I32), In(q_online), In(actions),
        In(np.array(branches, I32)), In(np.array(branch_offsets(branches), I32)),
        Out((nb, batch, na), F32), Out((nb, batch), F32), nb, batch, na, q_rows)
    return DoubleDqnGather(a_star, p_next, q_taken)


def c51_gather_project_dueling_branches(logp_target, q_online, actions, logp, r, done, gamma, z,
                                        v_min, v_max, isw, scale, branches, batch, discount=None,
                                        gamma_ref=None) -> C51GatherProjectDueling:
    """Test entry of the CUDA ``c51_gather_project_dueling_branches`` (contract as the reference
    twin)."""
    from foxhunt.fast.kernels.distributional import n_step_args

    branches, batch, q_rows, (lo, hi, dz), s = validate_c51_gather_project_dueling_branches(
        logp_target, q_online, actions, logp, r, done, gamma, z, v_min, v_max, isw, scale,
        branches, batch, discount, gamma_ref)
    for name, x in (("logp_target", logp_target), ("logp", logp)):
        check_elements(name, x)
    nb, na = len(branches), logp_target.shape[1]
    rows = batch * sum(branches)
    disc, ref, on = n_step_args(discount, gamma_ref, batch)
    plan = plan_c51_gather_project_dueling_branches(nb, batch, na)
    out = launch(
        "c51_gather_project_dueling_branches", plan,
        In(logp_target), In(q_online), In(actions), In(np.array(branches, I32)),
        In(np.array(branch_offsets(branches), I32)), In(logp), In(r), In(done), In(gamma), In(z),
        In(isw), device_scalar(s), disc, Out((nb, batch), I32), Out((nb, batch, na), F32),
        Out((nb, batch), F32), Out((nb, batch, na), F32), Out((rows, na), F32),
        Out((batch, na), F32), Out((rows, na), F32), nb, batch, na, q_rows, lo, hi, dz, ref, on)
    return C51GatherProjectDueling(*out)


def scalar_target_q_branches(p_next, z, r, done, gamma, discount=None,
                             gamma_ref=None) -> np.ndarray:
    """Test entry of the CUDA ``scalar_target_q_branches`` (contract as the reference twin)."""
    from foxhunt.fast.kernels.distributional import n_step_args

    validate_scalar_target_q_branches(p_next, z, r, done, gamma, discount, gamma_ref)
    nb, b, na = p_next.shape
    disc, ref, on = n_step_args(discount, gamma_ref, b)
    (out,) = launch("scalar_target_q_branches", plan_scalar_target_q_branches(nb, b), In(p_next),
                    In(z), In(r), In(done), In(gamma), disc, Out((nb, b), F32), nb, b, na, ref,
                    on)
    return out


def branch_mean(parts, divisor) -> np.ndarray:
    """Test entry of the CUDA ``branch_mean`` (contract as the reference twin)."""
    div = validate_branch_mean(parts, divisor)
    d, n = parts.shape
    (out,) = launch("branch_mean", plan_branch_mean(n), In(parts), Out((n,), F32), n, d, n, div)
    return out


def h2_grad_sum_mask(parts, h2, h2_pre) -> TrunkGrad:
    """Test entry of the CUDA ``h2_grad_sum_mask`` (contract as the reference twin)."""
    validate_h2_grad_sum_mask(parts, h2, h2_pre)
    n = h2.size
    dh2, out = launch("h2_grad_sum_mask", plan_h2_grad_sum_mask(n), In(parts), parts.shape[0], n,
                      In(h2), In(h2_pre), Out(h2.shape, F32), Out(h2.shape, F32), n)
    return TrunkGrad(dh2, out)


def h2_grad_sum_aux_mask(parts, aux, h2, h2_pre) -> AuxTrunkGrad:
    """Test entry of the CUDA ``h2_grad_sum_aux_mask`` (contract as the reference twin); with
    one auxiliary head the kernel gets a null second pointer."""
    validate_h2_grad_sum_aux_mask(parts, aux, h2, h2_pre)
    n = h2.size
    second = In(aux[1]) if aux.shape[0] == 2 else 0
    return AuxTrunkGrad(*launch("h2_grad_sum_aux_mask", plan_h2_grad_sum_aux_mask(n), In(parts),
                                parts.shape[0], n, In(aux[0]), second, In(h2), In(h2_pre),
                                Out(h2.shape, F32), Out(h2.shape, F32), Out(h2.shape, F32), n))


def h2_guard_mask(x, m, h2, h2_pre) -> TrunkGrad:
    """Test entry of the CUDA ``h2_guard_mask`` (contract as the reference twin): the bound as
    ``multiplier = m`` with a signal of 1 (``m * fmaxf(1, 1) == m`` exactly, +Inf included)."""
    bound = validate_h2_guard_mask(x, m, h2, h2_pre)
    n = x.size
    return TrunkGrad(*launch("h2_guard_mask", plan_h2_guard_mask(n), In(x), In(h2), In(h2_pre),
                             Out(x.shape, F32), Out(x.shape, F32), n, bound,
                             In(np.ones(1, F32))))


def loss_scalars(c51_total, terms, q_taken, target_q, alpha) -> LossScalars:
    """Test entry of the CUDA ``loss_scalars`` (contract as the reference twin): the four
    entries it writes of the readback block."""
    a = validate_loss_scalars(c51_total, terms, q_taken, target_q, alpha)
    nb, b = terms.shape
    (readback,) = launch("loss_scalars", plan_loss_scalars(), In(c51_total), In(terms), In(q_taken),
                         In(target_q), Out((len(READBACK_FIELDS),), F32), nb, b, a)
    return LossScalars(*(F32(readback[READBACK_INDEX[f]]) for f in LossScalars._fields))


def loss_scalars_ptr(c51_total, terms, q_taken, target_q, alpha) -> LossScalars:
    """Test entry of the CUDA ``loss_scalars_ptr`` (``alpha`` passed in device memory;
    contract as the reference twin)."""
    a = validate_loss_scalars(c51_total, terms, q_taken, target_q, alpha)
    nb, b = terms.shape
    (readback,) = launch("loss_scalars_ptr", plan_loss_scalars(), In(c51_total), In(terms),
                         In(q_taken), In(target_q), Out((len(READBACK_FIELDS),), F32), nb, b,
                         device_scalar(a))
    return LossScalars(*(F32(readback[READBACK_INDEX[f]]) for f in LossScalars._fields))


def step_scalars(total_partials, c51_sq, cql_sq, clip_bound, isv, readback, budget_c51, budget_cql,
                 slow_ema_index, slow_alpha) -> StepScalarsOut:
    """Test entry of the CUDA ``step_scalars`` (contract as the reference twin)."""
    c51, cql, bound, b_c51, b_cql, slow, a = validate_step_scalars(
        total_partials, c51_sq, cql_sq, clip_bound, isv, readback, budget_c51, budget_cql,
        slow_ema_index, slow_alpha)
    count = total_partials.shape[0]
    total_sq, isv_out, scale, rb = launch(
        "step_scalars", plan_step_scalars(count), In(total_partials), count, Out((1,), F32),
        _scalar(c51), _scalar(cql), _scalar(bound), InOut(isv), Out((1,), F32), InOut(readback),
        b_c51, b_cql, slow, a)
    return StepScalarsOut(F32(total_sq[0]), F32(scale[0]), rb, isv_out)


def merge_piece_flags(flags, piece_slot, n_slots) -> np.ndarray:
    """Test entry of the CUDA ``merge_piece_flags`` (contract as the reference twin)."""
    n_slots = validate_merge_piece_flags(flags, piece_slot, n_slots)
    (out,) = launch("merge_piece_flags", plan_merge_piece_flags(), InOut(flags), In(piece_slot),
                    n_slots, piece_slot.shape[0])
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
