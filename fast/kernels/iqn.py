"""Fast launchers of the IQN head's kernels (``cuda_src/iqn.cu``), twins of
``foxhunt.reference.kernels.iqn`` under the same names and signatures.

Each public function is a numpy-in/numpy-out test entry (conformance and debugging): it
validates with the reference's ``validate_<name>`` (same ``ValueError``), launches the CUDA
kernel once through ``_runtime.call`` and returns what the reference returns. The step plan
launches the same kernels on arena pointers with the ``plan_*`` launch shapes below.

Kernel arguments: arrays as pointers plus their sizes; the generator's offset (the step count)
and the ISV are read through pointers (a test entry uploads them); the branch layout goes as
the tables ``n_actions`` / ``action_offset`` (``foxhunt.reference.kernels.fused``);
``iqn_modulate``'s BF16 output is skipped when its pointer is null.
"""

from __future__ import annotations

import numpy as np

from foxhunt.fast.kernels._runtime import In, Out, blocks, cluster_blocks, launch
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
#: rest).
IQN_THREADS = 256
IQN_MAX_BLOCKS = 1024

Plan = tuple[int, int, int]


# ---------------------------------------------------------------------------------------------
# Launch plans
# ---------------------------------------------------------------------------------------------


def plan_flat(n: int) -> Plan:
    """A flat grid-stride launch over ``n`` elements."""
    return min(blocks(n, IQN_THREADS), IQN_MAX_BLOCKS), IQN_THREADS, 0


def plan_iqn_tau_cos(rows: int, n_cos: int) -> Plan:
    """Flat over the ``rows * n_cos`` features."""
    return plan_flat(rows * n_cos)


def plan_iqn_modulate(rows: int, hidden: int) -> Plan:
    """Flat over the ``rows * hidden`` products."""
    return plan_flat(rows * hidden)


def plan_iqn_modulate_backward(batch: int, hidden: int) -> Plan:
    """Flat, one thread per ``(sample, unit)`` (each loops over the quantiles)."""
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
    tau, cosines = launch("iqn_tau_cos", plan_iqn_tau_cos(rows, n_cos), In(step), k_lo, k_hi, s,
                          Out((rows,), F32), Out((rows, n_cos), F32), rows, n_cos)
    return TauCos(tau, cosines)


def iqn_modulate(h2, phi, n_quantiles, with_bf16: bool = False) -> Modulated:
    """Test entry of the CUDA ``iqn_modulate`` (contract as the reference twin); without
    ``with_bf16`` the kernel gets a null BF16 pointer."""
    n = validate_iqn_modulate(h2, phi, n_quantiles)
    rows, hidden = phi.shape
    mirror = Out(phi.shape, U16) if with_bf16 else 0
    outs = launch("iqn_modulate", plan_iqn_modulate(rows, hidden), In(h2), In(phi),
                  Out(phi.shape, F32), mirror, rows, hidden, n)
    return Modulated(outs[0], outs[1] if with_bf16 else np.zeros(0, U16))


def iqn_modulate_backward(de, h2, phi, n_quantiles) -> ModulateGrads:
    """Test entry of the CUDA ``iqn_modulate_backward`` (contract as the reference twin)."""
    n = validate_iqn_modulate_backward(de, h2, phi, n_quantiles)
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
