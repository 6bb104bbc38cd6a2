"""Fast launcher of the MSE warm-up kernel (``cuda_src/warmup.cu``), twin of
``foxhunt.reference.kernels.warmup.mse_warmup`` under the same name and signature.

Kernel parameters (C order): ``mse_warmup(logp, actions, q_taken, target_q, isw, z, dlogits,
isv, epoch_index, warmup_epochs, n_actions, action_offset, loss, weight, n_branches, batch,
block_rows, num_atoms)``: a grid-stride launch over the ``n_branches * batch`` samples, a warp
per sample (its ``n_d`` rows of ``dlogits`` are one contiguous span: the warp blends the span's
elements off the taken row, then the taken row's atoms); ``dlogits`` holds the C51 logit
gradient on entry and the blended one on exit (in place; untouched when ``w == 0``); block 0
also writes the loss and ``w`` (one float each: the step binds them to its readback entries).
The bits depend on no launch dimension but ``blockDim.x`` (the loss tree): any ``gridDim.x >=
1`` gives the same outputs. The epoch is read from the ISV on the device (``isv[epoch_index]``,
EPOCH_IDX), so the captured graph needs no update between epochs.

Numerics: ``expf`` against NumPy's float32 ``exp`` at the taken actions (every other element is
the exact ``(1 - w) * c + w * 0``); the loss is a block-tree sum (reduction).
"""

from __future__ import annotations

import numpy as np

from foxhunt.fast.kernels._runtime import (
    FLAT_MAX_BLOCKS,
    In,
    InOut,
    Out,
    blocks,
    check_elements,
    launch,
)
from foxhunt.reference.kernels.fused import branch_offsets
from foxhunt.reference.kernels.warmup import MseWarmup, validate_mse_warmup

F32, I32 = np.float32, np.int32

#: Threads per block (``WARMUP_THREADS`` in warmup.cu: its ``__launch_bounds__``) and per
#: sample (a warp).
WARMUP_THREADS = 256
WARMUP_SAMPLE_THREADS = 32


def plan_mse_warmup(batch: int, branches, num_atoms: int) -> tuple:
    """A warp per ``(branch, sample)`` of the blend (at most ``FLAT_MAX_BLOCKS`` blocks: the
    warps stride over the rest), in blocks of ``WARMUP_THREADS`` (256: block 0's loss tree):
    seed shapes (3 branches, ``batch = 256``) take 96 blocks. ``num_atoms`` does not change the
    grid (a warp strides over its sample's span)."""
    del num_atoms  # a warp strides over its sample's span
    grid = min(blocks(len(branches) * batch * WARMUP_SAMPLE_THREADS, WARMUP_THREADS),
               FLAT_MAX_BLOCKS)
    return (grid,), (WARMUP_THREADS,), 0


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
