"""Fast launcher of the MSE warm-up kernel (``cuda_src/warmup.cu``), twin of
``foxhunt.reference.kernels.warmup.mse_warmup`` under the same name and signature.

Kernel parameters (C order): ``mse_warmup(logp, actions, q_taken, target_q, isw, z, dlogits,
isv, epoch_index, warmup_epochs, n_actions, action_offset, loss, weight, n_branches, batch,
block_rows, num_atoms)``: a grid-stride launch over the ``batch * A_total`` rows of
``dlogits``, ``G = warmup_group(num_atoms)`` threads per row (each finds the row's branch,
sample and action once and blends atoms ``lane, lane + G, ...``); ``dlogits`` holds the C51
logit gradient on entry and the blended one on exit (in place; untouched when ``w == 0``);
block 0 also writes the loss and ``w`` (one float each: the step binds them to its readback
entries). The epoch is read from the ISV on the device (``isv[epoch_index]``, EPOCH_IDX), so
the captured graph needs no update between epochs.

Numerics: ``expf`` against NumPy's float32 ``exp`` at the taken actions (every other element is
the exact ``(1 - w) * c + w * 0``); the loss is a block-tree sum (reduction).
"""

from __future__ import annotations

import numpy as np

from foxhunt.fast.kernels._runtime import In, InOut, Out, check_elements, launch, plan_flat
from foxhunt.reference.kernels.fused import branch_offsets
from foxhunt.reference.kernels.warmup import MseWarmup, validate_mse_warmup

F32, I32 = np.float32, np.int32

#: Threads per row of the blend at most (a warp; ``WARMUP_GROUP_MAX_SHIFT`` in warmup.cu).
WARMUP_GROUP_MAX = 32


def warmup_group(num_atoms: int) -> int:
    """Threads per row of ``dlogits`` in the blend: the smallest power of two ``>= num_atoms``,
    at most ``WARMUP_GROUP_MAX`` (the kernel's ``warmup_group_shift``)."""
    g = 1
    while g < WARMUP_GROUP_MAX and g < num_atoms:
        g *= 2
    return g


def plan_mse_warmup(batch: int, branches, num_atoms: int) -> tuple:
    """Flat over the ``batch * A_total`` rows of ``dlogits``, ``warmup_group(num_atoms)`` threads
    per row, in blocks of ``FLAT_THREADS`` (256: block 0's loss tree; a multiple of the group)."""
    return plan_flat(batch * sum(branches) * warmup_group(num_atoms))


def mse_warmup(logp, actions, q_taken, target_q, isw, z, dlogits_c51, isv, epoch_index,
               warmup_epochs, branches) -> MseWarmup:
    """Test entry of the CUDA ``mse_warmup`` (contract as the reference twin)."""
    branches, rows, epoch_index, warmup_epochs = validate_mse_warmup(
        logp, actions, q_taken, target_q, isw, z, dlogits_c51, isv, epoch_index, warmup_epochs,
        branches)
    check_elements("logp", logp)
    check_elements("dlogits_c51", dlogits_c51)
    nb, batch = actions.shape
    num_atoms = logp.shape[1]
    dlogits, loss, w = launch(
        "mse_warmup", plan_mse_warmup(batch, branches, num_atoms), In(logp), In(actions),
        In(q_taken), In(target_q), In(isw), In(z), InOut(dlogits_c51), In(isv), epoch_index,
        warmup_epochs, In(np.array(branches, I32)), In(np.array(branch_offsets(branches), I32)),
        Out((1,), F32), Out((1,), F32), nb, batch, rows, num_atoms)
    return MseWarmup(dlogits, F32(loss[0]), F32(w[0]))


KERNELS = {
    "mse_warmup": mse_warmup,
}
