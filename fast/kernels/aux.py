"""Fast launchers of the auxiliary heads' kernels (``cuda_src/aux.cu``), twins of
``foxhunt.reference.kernels.aux`` under the same names and signatures.

Each public function is a numpy-in/numpy-out test entry: it validates with the reference's
``validate_<name>`` (same ``ValueError``), launches the CUDA kernel once and returns what the
reference returns. The step plan launches the same kernels on arena pointers with the
``plan_*`` shapes below. Kernel parameters (C order):

- ``add_bias_elu(y, b, out, rows, cols)``: ``add_bias_relu``'s 2-D grid; ``out`` may alias ``y``;
- ``elu_backward(dy, h, dx, n)``: flat grid-stride; ``dx`` may alias ``dy``;
- ``aux_next_bar_loss_grad(pred, next_ret, isv, d_pred, loss, batch, label_scale_index,
  scale_floor, weight)``, ``aux_regime_loss_grad(logits, regime, d_logits, loss, batch,
  n_regimes, weight)``:
  ONE block (the loss is a block reduction); ``loss`` points at one float (the step binds it to
  its readback entry); the label scale is read from the ISV on the device;
- ``isv_label_scale_update(isv, slot, next_ret, n, sharpe, alpha_base, sharpe_clamp,
  sharpe_gain)``: ONE block, in place on the ISV; ``sharpe`` points at one float (the bus's
  Sharpe slot in the trainer); the slot index and the adaptive-rate constants come from the ISV
  registry (``foxhunt.reference.isv``).

Numerics: ``elu_backward`` and ``d_pred`` are exact; ``add_bias_elu`` is ``expm1f`` against
NumPy's float32 ``expm1``; the regime gradient ``expf``/``logf``; the losses and the label
scale are block-tree sums (reductions).
"""

from __future__ import annotations

import numpy as np

from foxhunt.fast.kernels._runtime import In, InOut, Out, device_scalar, launch, plan_flat
from foxhunt.fast.kernels.dense import plan_add_bias_relu
from foxhunt.reference.isv import AUX_LABEL_SCALE_EMA_INDEX, SHARPE_CLAMP, SHARPE_GAIN
from foxhunt.reference.kernels.aux import (
    NextBarLossGrad,
    RegimeLossGrad,
    validate_add_bias_elu,
    validate_aux_next_bar_loss_grad,
    validate_aux_regime_loss_grad,
    validate_elu_backward,
    validate_isv_label_scale_update,
)

F32, I32 = np.float32, np.int32

#: Largest block of the one-block kernels (CUDA's limit; REDUCE_MAX_THREADS in reduce.cuh).
AUX_MAX_THREADS = 1024
WARP = 32

Plan = tuple[int, int, int]


def plan_one_block(n: int) -> Plan:
    """ONE block of whole warps, one thread per item up to ``AUX_MAX_THREADS`` (threads stride
    the rest); the block size, hence the loss's reduction tree, depends on ``n`` only."""
    return 1, min(AUX_MAX_THREADS, max(WARP, -(-int(n) // WARP) * WARP)), 0


plan_add_bias_elu = plan_add_bias_relu
plan_elu_backward = plan_flat
plan_aux_next_bar_loss_grad = plan_one_block
plan_aux_regime_loss_grad = plan_one_block
plan_isv_label_scale_update = plan_one_block


def add_bias_elu(y, b) -> np.ndarray:
    """Test entry of the CUDA ``add_bias_elu`` (contract as the reference twin)."""
    validate_add_bias_elu(y, b)
    rows, cols = y.shape
    (out,) = launch("add_bias_elu", plan_add_bias_elu(rows, cols), In(y), In(b),
                    Out(y.shape, F32), rows, cols)
    return out


def elu_backward(dy, h) -> np.ndarray:
    """Test entry of the CUDA ``elu_backward`` (contract as the reference twin)."""
    validate_elu_backward(dy, h)
    (dx,) = launch("elu_backward", plan_elu_backward(dy.size), In(dy), In(h), Out(dy.shape, F32),
                   dy.size)
    return dx


def aux_next_bar_loss_grad(pred, next_ret, isv, label_scale_index, scale_floor,
                           weight) -> NextBarLossGrad:
    """Test entry of the CUDA ``aux_next_bar_loss_grad`` (contract as the reference twin)."""
    index, floor, w = validate_aux_next_bar_loss_grad(pred, next_ret, isv, label_scale_index,
                                                      scale_floor, weight)
    batch = pred.shape[0]
    d_pred, loss = launch("aux_next_bar_loss_grad", plan_aux_next_bar_loss_grad(batch), In(pred),
                          In(next_ret), In(isv), Out((batch,), F32), Out((1,), F32), batch, index,
                          floor, w)
    return NextBarLossGrad(d_pred, F32(loss[0]))


def aux_regime_loss_grad(logits, regime, weight) -> RegimeLossGrad:
    """Test entry of the CUDA ``aux_regime_loss_grad`` (contract as the reference twin)."""
    w = validate_aux_regime_loss_grad(logits, regime, weight)
    batch, n_regimes = logits.shape
    d_logits, loss = launch("aux_regime_loss_grad", plan_aux_regime_loss_grad(batch), In(logits),
                            In(regime), Out(logits.shape, F32), Out((1,), F32), batch, n_regimes,
                            w)
    return RegimeLossGrad(d_logits, F32(loss[0]))


def isv_label_scale_update(isv, next_ret, sharpe, alpha_base) -> np.ndarray:
    """Test entry of the CUDA ``isv_label_scale_update`` (contract as the reference twin)."""
    validate_isv_label_scale_update(isv, next_ret, sharpe, alpha_base)
    with np.errstate(over="ignore"):  # a huge float64 Sharpe becomes +/-inf, as in the reference
        sharpe32 = F32(sharpe)
    (out,) = launch("isv_label_scale_update", plan_isv_label_scale_update(next_ret.size),
                    InOut(isv), AUX_LABEL_SCALE_EMA_INDEX, In(next_ret), next_ret.size,
                    device_scalar(sharpe32), F32(alpha_base), F32(SHARPE_CLAMP), F32(SHARPE_GAIN))
    return out


KERNELS = {
    "add_bias_elu": add_bias_elu,
    "elu_backward": elu_backward,
    "aux_next_bar_loss_grad": aux_next_bar_loss_grad,
    "aux_regime_loss_grad": aux_regime_loss_grad,
    "isv_label_scale_update": isv_label_scale_update,
}
