"""Fast launchers of the IQN head's kernels (``cuda_src/iqn.cu``), twins of
``foxhunt.reference.kernels.iqn`` under the same names and signatures.

Each public function is a numpy-in/numpy-out test entry (conformance and debugging): it
validates with the reference's ``validate_<name>`` (same ``ValueError``), launches the CUDA
kernel once through ``_runtime.call`` and returns what the reference returns. The step plan
launches the same kernels on arena pointers with the ``plan_*`` launch shapes below.

Kernel arguments: arrays as pointers plus their sizes; the generator's offset (the step count)
and the ISV are read through pointers (a test entry uploads them); the branch layout goes as
the tables ``n_actions`` / ``action_offset`` (``foxhunt.reference.kernels.fused``);
``iqn_modulate``'s BF16 output (and its float32 one) is skipped when its pointer is null.
"""

from __future__ import annotations

import numpy as np

from foxhunt.fast.kernels._runtime import (
    FLAT_VEC_WIDTH,
    In,
    Out,
    blocks,
    check_elements,
    cluster_blocks,
    launch,
)
from foxhunt.reference.kernels.fused import branch_offsets
from foxhunt.reference.kernels.iqn import (
    IQN_LOSS_THREADS,
    ModulateGrads,
    Modulated,
    QuantileHuber,
    TauCos,
    validate_iqn_modulate,
    validate_iqn_modulate_backward,
    validate_iqn_quantile_huber,
    validate_iqn_tau_cos,
)

F32, I32, I64, U16 = np.float32, np.int32, np.int64, np.uint16

#: Threads per block of the flat IQN kernels, and their grid cap (grid-stride loops cover the
#: rest). ``iqn_tau_cos`` takes at most ``IQN_COS_SPAN // IQN_COS_CHUNKS`` (its shared draws).
IQN_THREADS = 256
IQN_MAX_BLOCKS = 1024
#: Threads per block of ``iqn_modulate_backward``'s vector path: a quarter of the threads in
#: smaller blocks, so a single trainer's launch still spreads over the SMs.
IQN_BACKWARD_VEC_THREADS = 128
#: Features per thread and block span of ``iqn_tau_cos`` (``IQN_COS_CHUNKS`` in iqn.cu), and
#: the most features a span may cover (``IQN_COS_SPAN``): a block draws each row of its span once.
IQN_COS_CHUNKS = 2
IQN_COS_SPAN = 512

Plan = tuple[int, int, int]


# ---------------------------------------------------------------------------------------------
# Launch plans
# ---------------------------------------------------------------------------------------------


def plan_flat(n: int, threads: int = IQN_THREADS) -> Plan:
    """A flat grid-stride launch over ``n`` items, ``threads`` per block."""
    return min(blocks(n, threads), IQN_MAX_BLOCKS), threads, 0


def plan_iqn_tau_cos(rows: int, n_cos: int) -> Plan:
    """Block-stride over spans of ``IQN_COS_CHUNKS * IQN_THREADS`` consecutive features (each
    thread computes ``IQN_COS_CHUNKS`` features per span; the block draws the span's fractions
    once per row): one block per span, capped like ``plan_flat``. The outputs do not depend on
    the grid (``GRID_SHARED_KERNELS``)."""
    return plan_flat(-(-int(rows) * int(n_cos) // IQN_COS_CHUNKS))


def plan_iqn_modulate(rows: int, hidden: int) -> Plan:
    """Flat over the ``rows * hidden / 4`` groups of four products (the vector path) when
    ``hidden % 4 == 0``, else over the ``rows * hidden`` products (the scalar path; with
    misaligned pointers the kernel takes it on the vector plan too: the grid-stride loop covers
    the rest)."""
    if hidden % FLAT_VEC_WIDTH == 0:
        return plan_flat(rows * hidden // FLAT_VEC_WIDTH)
    return plan_flat(rows * hidden)


def plan_iqn_modulate_backward(batch: int, hidden: int) -> Plan:
    """Flat, one thread per ``(sample, four units)`` in blocks of ``IQN_BACKWARD_VEC_THREADS``
    when ``hidden % 4 == 0`` (the vector path), else one per ``(sample, unit)``; each thread
    loops over the quantiles."""
    if hidden % FLAT_VEC_WIDTH == 0:
        return plan_flat(batch * hidden // FLAT_VEC_WIDTH, IQN_BACKWARD_VEC_THREADS)
    return plan_flat(batch * hidden)


#: Shared floats of ``iqn_quantile_huber``'s rho tile (``IQN_RHO_FLOATS`` in iqn.cu).
IQN_RHO_FLOATS = 8192


def plan_iqn_quantile_huber(pairs: int, n_quantiles: int, arch=None) -> Plan:
    """ONE thread-block cluster (``cluster_blocks(arch)``) of ``IQN_LOSS_THREADS`` (the loss total
    is block 0's tree over the ``pairs = n_branches * batch`` terms); dynamic shared memory for
    a block's terms, ``ceil(pairs / cluster)`` floats, and its rho tile, ``max(1, IQN_RHO_FLOATS
    // N^2) * N^2`` floats (``N = n_quantiles``)."""
    c = cluster_blocks(arch)
    n2 = int(n_quantiles) ** 2
    floats = -(-int(pairs) // c) + max(1, IQN_RHO_FLOATS // n2) * n2
    return c, IQN_LOSS_THREADS, 4 * floats


# ---------------------------------------------------------------------------------------------
# Test entries (reference signatures)
# ---------------------------------------------------------------------------------------------


def iqn_tau_cos(step, key_lo, key_hi, stream, rows, n_cos) -> TauCos:
    """Test entry of the CUDA ``iqn_tau_cos`` (contract as the reference twin)."""
    _, k_lo, k_hi, s, rows, n_cos = validate_iqn_tau_cos(step, key_lo, key_hi, stream, rows, n_cos)
    check_elements("cosines", np.broadcast_to(F32(0), (rows, n_cos)))
    tau, cosines = launch("iqn_tau_cos", plan_iqn_tau_cos(rows, n_cos), In(step), k_lo, k_hi, s,
                          Out((rows,), F32), Out((rows, n_cos), F32), rows, n_cos)
    return TauCos(tau, cosines)


def iqn_modulate(h2, phi, n_quantiles, with_bf16: bool = False) -> Modulated:
    """Test entry of the CUDA ``iqn_modulate`` (contract as the reference twin); without
    ``with_bf16`` the kernel gets a null BF16 pointer."""
    n = validate_iqn_modulate(h2, phi, n_quantiles)
    check_elements("phi", phi)
    rows, hidden = phi.shape
    mirror = Out(phi.shape, U16) if with_bf16 else 0
    outs = launch("iqn_modulate", plan_iqn_modulate(rows, hidden), In(h2), In(phi),
                  Out(phi.shape, F32), mirror, rows, hidden, n)
    return Modulated(outs[0], outs[1] if with_bf16 else np.zeros(0, U16))


def iqn_modulate_backward(de, h2, phi, n_quantiles) -> ModulateGrads:
    """Test entry of the CUDA ``iqn_modulate_backward`` (contract as the reference twin)."""
    n = validate_iqn_modulate_backward(de, h2, phi, n_quantiles)
    check_elements("phi", phi)
    batch, hidden = h2.shape
    d_h2, d_phi_pre = launch("iqn_modulate_backward", plan_iqn_modulate_backward(batch, hidden),
                             In(de), In(h2), In(phi), Out(h2.shape, F32), Out(phi.shape, F32),
                             batch, hidden, n)
    return ModulateGrads(d_h2, d_phi_pre)


def iqn_quantile_huber(q, q_target, tau, actions, a_star, r, done, gamma, isw, isv,
                       q_abs_ref_index, k1, branches, n_quantiles, discount=None,
                       gamma_ref=None) -> QuantileHuber:
    """Test entry of the CUDA ``iqn_quantile_huber`` (contract as the reference twin)."""
    from foxhunt.fast.kernels.distributional import n_step_args

    branches, n, batch, index, k1 = validate_iqn_quantile_huber(
        q, q_target, tau, actions, a_star, r, done, gamma, isw, isv, q_abs_ref_index, k1,
        branches, n_quantiles, discount, gamma_ref)
    nb = len(branches)
    disc, ref, on = n_step_args(discount, gamma_ref, batch)
    y, dq, loss = launch(
        "iqn_quantile_huber", plan_iqn_quantile_huber(nb * batch, n), In(q), In(q_target), In(tau),
        In(actions), In(a_star), In(r), In(done), In(gamma), In(isw), In(isv), index, k1,
        In(np.array(branches, I32)), In(np.array(branch_offsets(branches), I32)), disc,
        Out((nb, batch, n), F32), Out(q.shape, F32), Out((1,), F32), nb, batch, n, q.shape[1],
        ref, on)
    return QuantileHuber(y, dq, F32(loss[0]))


KERNELS = {
    "iqn_tau_cos": iqn_tau_cos,
    "iqn_modulate": iqn_modulate,
    "iqn_quantile_huber": iqn_quantile_huber,
    "iqn_modulate_backward": iqn_modulate_backward,
}
