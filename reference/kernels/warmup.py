"""Reference kernel of the MSE warm-up (SPEC 4, second wave; ``cuda_src/warmup.cu``): the
expected-Q MSE against the Mech 1 clipped scalar target, its logit gradient, and the blend with
the C51 logit gradient over the first ``c51_warmup_epochs`` epochs.

Branch-packed arrays follow ``foxhunt.reference.kernels.fused``: branch ``d``'s ``[R, n_d, NA]``
block sits in rows ``[R * off_d, R * (off_d + n_d))`` of an ``[R * A_total, NA]`` array. The
online log-probabilities have ``R = block_rows >= B`` samples per block (the fast step's online
pass over ``[s; s2]`` has ``R = 2B``; its first ``B`` samples are read); the C51 logit gradients
have ``R = B``.

All arithmetic is float32 in the order of the docstring (the CUDA twin rounds each operation on
its own, ``-fmad=false``); ``exp`` is NumPy's float32 ``exp`` here and ``expf`` there, and the
loss is a block-tree sum there (conformance tolerances).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from foxhunt.reference.kernels.argcheck import check_f32_array, check_int, ieee, require_array
from foxhunt.reference.kernels.fused import require_branches, require_packed, split_branches

F32 = np.dtype(np.float32)
I32 = np.dtype(np.int32)


class MseWarmup(NamedTuple):
    """Outputs of ``mse_warmup``: the blended logit gradient ``dlogits`` (branch-packed, like
    ``dlogits_c51``), the MSE loss and the blend weight ``w`` (float32)."""

    dlogits: np.ndarray
    loss: np.float32
    w: np.float32


def validate_mse_warmup(logp, actions, q_taken, target_q, isw, z, dlogits_c51, isv, epoch_index,
                        warmup_epochs, branches) -> tuple[tuple[int, ...], int, int, int]:
    """The argument checks of ``mse_warmup``; returns ``(branches, block_rows, epoch_index,
    warmup_epochs)``."""
    branches = require_branches(branches)
    rows = require_packed("logp", logp, branches)
    num_atoms = logp.shape[1]
    require_array("actions", actions, I32, ndim=2)
    nb = len(branches)
    if actions.shape[0] != nb or not 1 <= actions.shape[1] <= rows:
        raise ValueError(f"actions: shape {actions.shape}; expected [D, B] with D = {nb} branches "
                         f"and 1 <= B <= R = {rows} (logp's samples per block)")
    batch = actions.shape[1]
    for d, n in enumerate(branches):
        if np.any((actions[d] < 0) | (actions[d] >= n)):
            raise ValueError(f"actions: row {d} holds an action outside [0, {n})")
    for name, x, shape in (("q_taken", q_taken, (nb, batch)), ("target_q", target_q, (nb, batch)),
                           ("isw", isw, (batch,)), ("z", z, (num_atoms,)),
                           ("dlogits_c51", dlogits_c51, (batch * sum(branches), num_atoms))):
        require_array(name, x, F32, ndim=len(shape))
        if x.shape != shape:
            raise ValueError(f"{name}: shape {x.shape}; expected {shape}")
    check_f32_array("isv", isv, ndim=1)
    return (branches, rows,
            check_int("epoch_index", epoch_index, minimum=0, maximum=isv.shape[0] - 1),
            check_int("warmup_epochs", warmup_epochs, minimum=1))


def warmup_weight(epoch: np.float32, warmup_epochs: int) -> np.float32:
    """The blend weight ``w = fmaxf(0, 1 - epoch / W)`` (float32; the division and the difference
    rounded once each). A NaN epoch gives 0 (``fmaxf`` takes the non-NaN operand): no MSE."""
    with np.errstate(all="ignore"):
        ratio = np.float32(epoch) / np.float32(warmup_epochs)
        return np.float32(np.fmax(np.float32(0), np.float32(1) - ratio))


@ieee
def mse_warmup(logp: np.ndarray, actions: np.ndarray, q_taken: np.ndarray, target_q: np.ndarray,
               isw: np.ndarray, z: np.ndarray, dlogits_c51: np.ndarray, isv: np.ndarray,
               epoch_index: int, warmup_epochs: int, branches) -> MseWarmup:
    """The MSE warm-up of every branch in one launch. With ``B`` samples, ``nb`` branches,
    ``scale = 1 / (B * nb)`` (rounded once), ``E = q_taken[d, b]`` (the online expected Q of the
    taken action, ``sum_j p_j z_j``) and ``y = target_q[d, b]`` (the Mech 1 clipped target; for
    n-step batches formed with each sample's effective gamma by ``step.scalar_target_q_branches``,
    issue 22: nothing here reads a gamma):

    - ``td = E - y``; ``loss = (sum_{d, b} isw_b * (0.5 * (td * td))) * scale``;
    - ``w = warmup_weight(isv[epoch_index], warmup_epochs)`` (the epoch counter ISV 39);
    - at the taken action ``a = actions[d, b]``, with ``p_j = exp(logp_d[b, a, j])``:
      ``g_j = ((isw_b * scale) * td) * (p_j * (z_j - E))`` (the gradient of
      ``isw_b * 0.5 * td^2 * scale`` w.r.t. the logits); ``g = 0`` at every other action;
    - ``w > 0``: ``dlogits = (1 - w) * dlogits_c51 + w * g`` over every element (each product
      and the sum rounded); otherwise ``dlogits = dlogits_c51`` bit for bit (the CUDA kernel
      writes nothing).

    The loss is computed whatever ``w`` (the reported ``mse_loss``); the reported C51 loss is
    ``(1 - w) * c51 + w * mse`` for ``w > 0`` (the caller blends it).
    Shapes: ``logp [R * A_total, NA]`` branch-packed, ``R >= B`` samples per block (the first
    ``B`` are read); ``actions [D, B]`` int32 (row d in ``[0, n_d)``); ``q_taken``, ``target_q``
    ``[D, B]``; ``isw [B]``; ``z [NA]``; ``dlogits_c51 [B * A_total, NA]`` branch-packed
    (``R = B``); ``isv [L]``, all float32; ``warmup_epochs`` ``W >= 1``. Returns
    ``MseWarmup(dlogits, loss, w)``.
    NaN/Inf contract: IEEE. A NaN in the taken ``logp`` row, ``E``, ``y`` or ``isw_b`` makes the
    taken row's ``g`` (and, through ``td``, the loss) NaN; at ``w = 1`` (epoch 0) a non-finite
    ``dlogits_c51`` element still poisons its output (``0 * NaN``).
    """
    branches, _, epoch_index, warmup_epochs = validate_mse_warmup(
        logp, actions, q_taken, target_q, isw, z, dlogits_c51, isv, epoch_index, warmup_epochs,
        branches)
    nb, batch = actions.shape
    num_atoms = logp.shape[1]
    scale = np.float32(1) / np.float32(batch * nb)
    td = (q_taken - target_q).astype(F32)
    parts = (isw[np.newaxis, :] * (np.float32(0.5) * (td * td))).astype(F32)
    loss = np.float32(np.sum(parts, dtype=F32) * scale)
    w = warmup_weight(isv[epoch_index], warmup_epochs)
    if not w > 0:
        return MseWarmup(dlogits_c51.copy(), loss, w)
    rows = np.arange(batch)
    coef = ((isw * scale)[np.newaxis, :] * td).astype(F32)  # [D, B]
    blocks = []
    for d, x in enumerate(split_branches(logp, branches)):
        a = actions[d]
        p = np.exp(x[rows, a]).astype(F32)  # [B, NA]
        e = q_taken[d][:, np.newaxis]
        g = np.zeros((batch, branches[d], num_atoms), F32)
        g[rows, a] = coef[d][:, np.newaxis] * (p * (z[np.newaxis, :] - e))
        blocks.append(g)
    g_packed = np.concatenate([g.reshape(-1, num_atoms) for g in blocks])
    out = (np.float32(1) - w) * dlogits_c51 + w * g_packed
    return MseWarmup(out.astype(F32, copy=False), loss, w)


KERNELS = {
    "mse_warmup": mse_warmup,
}
