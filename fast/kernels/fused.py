"""Fast fused kernels (one launch over every action branch): launch plans and numpy-in/numpy-out
test entries for ``cuda_src/fused.cu``, with the names, signatures, validation and return
structures of their twins in :mod:`foxhunt.reference.kernels.fused`.

The CUDA kernels take the tables ``n_actions [D]`` / ``action_offset [D]`` (int32) of the
branch-packed layout and run branch d as ``blockIdx.y = d``; the trainer passes its arena's
tables, the test entries upload them. Numerics: those of the per-branch kernels
(``foxhunt.fast.kernels.distributional``; conformance tolerances alike).
"""

from __future__ import annotations

import numpy as np

from foxhunt.fast.kernels._runtime import In, Out, blocks, call, check_elements, device_scalar
from foxhunt.fast.kernels.distributional import (
    F32_BYTES,
    LOSS_THREADS,
    SHARED_LIMIT,
    THREADS,
    WARP,
    cql_warps,
)
from foxhunt.reference.kernels.distributional import CqlGrad, DuelingGrads
from foxhunt.reference.kernels.fused import (
    F32,
    I32,
    C51LossBranches,
    DuelingGradsSum,
    DuelingLogSoftmaxQ,
    require_branches,
    require_packed,
    branch_offsets,
    split_branches,
    validate_c51_loss_branches,
    validate_cql_logit_grad_branches,
    validate_dueling_combine_branches,
    validate_dueling_log_softmax_q_branches,
)

Plan = tuple[tuple[int, int, int], int, int]  # ((grid x, D, 1), block, dynamic shared bytes)

#: dueling_log_softmax_q_branches: warps per block (one warp per sample of a branch; small
#: blocks so that a single trainer's 256-sample target pass spreads over 192 blocks). Also the
#: kernel's launch bound (``kDuelingMaxWarps``): a block of more warps would not launch.
DUELING_WARPS = 4
#: dueling_log_softmax_q_branches: rows of a sample staged at once (``kDuelingRowGroup``).
DUELING_ROW_GROUP = 4

#: dueling_combine_backward_sum_branches: threads per block (one thread per (b, j) cell looping
#: over the branches; small blocks so the seed's B * NA = 13,056 cells spread over 102 blocks).
SUM_THREADS = 128


def _tables(branches: tuple[int, ...]) -> tuple[In, In]:
    return (In(np.array(branches, dtype=I32)), In(np.array(branch_offsets(branches), dtype=I32)))


def plan_dueling_combine_branches(batch: int, branches, num_atoms: int) -> Plan:
    """One thread per ``(b, j)`` cell of each branch (``blockIdx.y`` = branch)."""
    return (blocks(batch * num_atoms, THREADS), len(branches), 1), THREADS, 0


plan_dueling_combine_backward_branches = plan_dueling_combine_branches


def plan_dueling_log_softmax_q_branches(batch: int, branches, num_atoms: int) -> Plan:
    """One warp per sample of each branch (``blockIdx.y`` = branch; grid-stride over the
    batch): the warp computes the sample's ``num_atoms`` cell means once, then runs its ``n_d``
    rows (``log_softmax_expected_q``'s warp per row; in registers for ``n_d <= 4`` and
    ``num_atoms <= 64``, else through shared memory, up to ``DUELING_ROW_GROUP`` rows at once).
    The results do not depend on the grid or on the block's warps. Blocks of ``DUELING_WARPS``
    warps (fewer when a warp's shared memory, ``(1 +
    DUELING_ROW_GROUP) * num_atoms`` floats, would pass ``SHARED_LIMIT`` for the block:
    ``num_atoms <= SHARED_LIMIT / (4 * (1 + DUELING_ROW_GROUP))``, 2457); grid x covers the
    batch. Seed shapes (branches (3, 3, 2), 51 atoms): online ``batch = 512`` -> grid (128, 3),
    target ``batch = 256`` -> grid (64, 3); 128 threads, 4080 bytes."""
    per_warp = (1 + DUELING_ROW_GROUP) * int(num_atoms) * F32_BYTES
    warps = min(DUELING_WARPS, SHARED_LIMIT // per_warp)
    if warps < 1:
        raise ValueError(f"num_atoms: {num_atoms} needs {per_warp} bytes of shared memory per "
                         f"warp in dueling_log_softmax_q_branches; expected at most "
                         f"{SHARED_LIMIT // ((1 + DUELING_ROW_GROUP) * F32_BYTES)} atoms")
    return (blocks(int(batch), warps), len(branches), 1), WARP * warps, warps * per_warp


def plan_dueling_combine_backward_sum_branches(batch: int, branches, num_atoms: int) -> Plan:
    """One thread per ``(b, j)`` cell looping over every branch (grid y = 1), blocks of
    ``SUM_THREADS``. Seed shapes (``batch = 256``, 51 atoms): grid (102, 1), 128 threads."""
    return (blocks(int(batch) * int(num_atoms), SUM_THREADS), 1, 1), SUM_THREADS, 0


def plan_cql_logit_grad_branches(batch: int, branches, num_atoms: int) -> Plan:
    """``cql_logit_grad``'s warp per sample on every branch (``blockIdx.y`` = branch) with one
    block size, ``cql_warps`` of the largest branch (the results do not depend on it); shared
    memory: each warp's Q row of the largest branch. Seed shapes (``batch = 256``, branches
    (3, 3, 2)): grid (64, 3), 128 threads, 48 bytes."""
    widest = max(branches)
    warps = cql_warps(widest)
    if warps < 1:
        raise ValueError(f"branches: {tuple(branches)} needs {widest * F32_BYTES} bytes of shared "
                         f"memory per warp in cql_logit_grad_branches; expected at most "
                         f"{SHARED_LIMIT}")
    return (blocks(batch, warps), len(branches), 1), WARP * warps, warps * widest * F32_BYTES


def plan_c51_loss_branches(batch: int, branches, num_atoms: int) -> Plan:
    """One block per branch (grid ``(1, D)``) of ``c51_loss``'s block size, so each branch's
    fixed reduction order, hence its ``ce``/``total`` bits, are those of ``plan_c51_loss``."""
    return (1, len(branches), 1), LOSS_THREADS, 0


def dueling_combine_branches(v: np.ndarray, adv: np.ndarray, branches) -> np.ndarray:
    """Fast ``dueling_combine_branches``: branch-packed ``logits [B * A_total, NA]``."""
    branches = validate_dueling_combine_branches(v, adv, branches)
    check_elements("adv", adv)
    batch, num_atoms = v.shape
    if adv.size == 0:
        return np.zeros(adv.shape, dtype=F32)
    grid, block, shared = plan_dueling_combine_branches(batch, branches, num_atoms)
    (logits,) = call("dueling_combine_branches", grid, block, In(v), In(adv), *_tables(branches),
                     Out(adv.shape, F32), batch, num_atoms, shared_mem=shared)
    return logits


def dueling_log_softmax_q_branches(v: np.ndarray, adv: np.ndarray, z: np.ndarray, branches,
                                   with_q) -> DuelingLogSoftmaxQ:
    """Fast ``dueling_log_softmax_q_branches``: ``DuelingLogSoftmaxQ(logits, logp`` (both
    branch-packed ``[B * A_total, NA]``), ``q [B * A_total]`` with ``with_q``, else ``q [0]``)."""
    branches, with_q = validate_dueling_log_softmax_q_branches(v, adv, z, branches, with_q)
    check_elements("adv", adv)
    batch, num_atoms = v.shape
    q_rows = adv.shape[0] if with_q else 0
    if adv.size == 0:
        return DuelingLogSoftmaxQ(logits=np.zeros(adv.shape, dtype=F32),
                                  logp=np.zeros(adv.shape, dtype=F32),
                                  q=np.zeros(q_rows, dtype=F32))
    grid, block, shared = plan_dueling_log_softmax_q_branches(batch, branches, num_atoms)
    logits, logp, q = call("dueling_log_softmax_q_branches", grid, block, In(v), In(adv), In(z),
                           *_tables(branches), Out(adv.shape, F32), Out(adv.shape, F32),
                           Out((q_rows,), F32), batch, num_atoms, int(with_q),
                           shared_mem=shared)
    return DuelingLogSoftmaxQ(logits=logits, logp=logp, q=q)


def dueling_combine_backward_branches(dlogits: np.ndarray, branches) -> DuelingGrads:
    """Fast ``dueling_combine_backward_branches``: ``DuelingGrads(dv [D, B, NA], dadv packed)``."""
    branches = require_branches(branches)
    batch = require_packed("dlogits", dlogits, branches)
    check_elements("dlogits", dlogits)
    num_atoms = dlogits.shape[1]
    if dlogits.size == 0:
        return DuelingGrads(dv=np.zeros((len(branches), batch, num_atoms), dtype=F32),
                            dadv=np.zeros(dlogits.shape, dtype=F32))
    grid, block, shared = plan_dueling_combine_backward_branches(batch, branches, num_atoms)
    dv, dadv = call("dueling_combine_backward_branches", grid, block, In(dlogits),
                    *_tables(branches), Out((len(branches), batch, num_atoms), F32),
                    Out(dlogits.shape, F32), batch, num_atoms, shared_mem=shared)
    return DuelingGrads(dv=dv, dadv=dadv)


def dueling_combine_backward_sum_branches(dlogits: np.ndarray, branches) -> DuelingGradsSum:
    """Fast ``dueling_combine_backward_sum_branches``: ``DuelingGradsSum(dv [B, NA]`` summed over
    the branches from +0.0 in branch order, ``dadv`` branch-packed ``[B * A_total, NA])``."""
    branches = require_branches(branches)
    batch = require_packed("dlogits", dlogits, branches)
    check_elements("dlogits", dlogits)
    num_atoms = dlogits.shape[1]
    if dlogits.size == 0:
        return DuelingGradsSum(dv=np.zeros((batch, num_atoms), dtype=F32),
                               dadv=np.zeros(dlogits.shape, dtype=F32))
    grid, block, shared = plan_dueling_combine_backward_sum_branches(batch, branches, num_atoms)
    dv, dadv = call("dueling_combine_backward_sum_branches", grid, block, In(dlogits),
                    *_tables(branches), Out((batch, num_atoms), F32), Out(dlogits.shape, F32),
                    batch, num_atoms, len(branches), shared_mem=shared)
    return DuelingGradsSum(dv=dv, dadv=dadv)


def cql_logit_grad_branches(logp: np.ndarray, actions: np.ndarray, z: np.ndarray, alpha, scale,
                            branches) -> CqlGrad:
    """Fast ``cql_logit_grad_branches``: ``CqlGrad(dlogits packed [B * A_total, NA], terms [D, B])``."""
    from foxhunt.reference.kernels.fused import cql_logit_grad_branches as reference

    branches, rows = validate_cql_logit_grad_branches(logp, actions, branches)
    batch, num_atoms = actions.shape[1], logp.shape[1]
    # The reference's own checks (actions in range per branch, z, alpha, scale) on one sample.
    reference(np.ascontiguousarray(np.concatenate([x[:1].reshape(-1, num_atoms) for x in
                                                   split_branches(logp, branches)])),
              np.ascontiguousarray(actions[:, :1]), z, alpha, scale, branches)
    for d, n in enumerate(branches):
        if actions[d].size and (actions[d].min() < 0 or actions[d].max() >= n):
            raise ValueError(f"actions: row {d} holds values outside [0, {n})")
    a_, s_ = F32.type(alpha), F32.type(scale)
    check_elements("logp", logp)
    total = sum(branches)
    if batch == 0:
        return CqlGrad(dlogits=np.zeros((0, num_atoms), dtype=F32),
                       terms=np.zeros((len(branches), 0), dtype=F32))
    grid, block, shared = plan_cql_logit_grad_branches(batch, branches, num_atoms)
    dlogits, terms = call("cql_logit_grad_branches", grid, block, In(logp),
                          In(np.ascontiguousarray(actions)), In(z), device_scalar(a_),
                          device_scalar(s_), *_tables(branches),
                          Out((batch * total, num_atoms), F32), Out((len(branches), batch), F32),
                          batch, rows, num_atoms, shared_mem=shared)
    return CqlGrad(dlogits=dlogits, terms=terms)


def c51_loss_branches(logp: np.ndarray, actions: np.ndarray, m: np.ndarray, isw: np.ndarray,
                      scale, branches) -> C51LossBranches:
    """Fast ``c51_loss_branches``: ``C51LossBranches(ce [D, B], total [D])`` (one block per
    branch; each branch's total in c51_loss's fixed order)."""
    branches, rows, s = validate_c51_loss_branches(logp, actions, m, isw, scale, branches)
    check_elements("logp", logp)
    batch, num_atoms = actions.shape[1], logp.shape[1]
    grid, block, shared = plan_c51_loss_branches(batch, branches, num_atoms)
    ce, total = call("c51_loss_branches", grid, block, In(logp), In(np.ascontiguousarray(actions)),
                     In(m), In(isw), device_scalar(s), *_tables(branches),
                     Out((len(branches), batch), F32), Out((len(branches),), F32),
                     batch, rows, num_atoms, shared_mem=shared)
    return C51LossBranches(ce=ce, total=total)


KERNELS = {
    "dueling_combine_branches": dueling_combine_branches,
    "dueling_log_softmax_q_branches": dueling_log_softmax_q_branches,
    "dueling_combine_backward_branches": dueling_combine_backward_branches,
    "dueling_combine_backward_sum_branches": dueling_combine_backward_sum_branches,
    "cql_logit_grad_branches": cql_logit_grad_branches,
    "c51_loss_branches": c51_loss_branches,
}
