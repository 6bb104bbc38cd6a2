"""Reference kernels of the auxiliary heads (SPEC 4, second wave; ``cuda_src/aux.cu``): the ELU
hidden layer and its backward, the next-bar return regression's loss and gradient, the regime
classification's cross-entropy and gradient, and the ISV 117 label-scale producer.

Each head is ``hidden = elu(h2 W1^T + b1)`` ([B, AXH]) then a linear output (``pred [B]`` for the
next-bar head, ``logits [B, R]`` for the regime head). The GEMMs (with the output layers' bias
epilogues) are the existing ``dense.gemm`` / cuBLAS calls; the kernels here are what sits
between them::

    hidden = add_bias_elu(h2 W1^T, b1)                    (forward, after the first GEMM)
    d_pred, loss_nb = aux_next_bar_loss_grad(pred, next_ret, isv, ...)
    d_logits, loss_rg = aux_regime_loss_grad(logits, regime)
    d_pre = elu_backward(d_hidden, hidden)               (backward, before W1's GEMMs)

The gradient kernels take the head's weight (``aux_next_bar_weight``, ``aux_regime_weight``):
their output gradients, hence every gradient the backward GEMMs derive from them (the head's
parameters and its ``d h2``), are those of the weighted loss; the reported losses are unweighted.

All arithmetic is float32 in the order written in each docstring (the CUDA twins round each
product and sum on its own, ``-fmad=false``). ``expm1``, ``exp`` and ``log`` are NumPy's float32
functions here and CUDA's ``expm1f``/``expf``/``logf`` there (a few ulp apart: conformance
declares the tolerance); the loss scalars are block-tree sums there and NumPy's pairwise sums
here (reductions).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from foxhunt.reference.isv import AUX_LABEL_SCALE_EMA_INDEX, ISV_LEN, adaptive_ema_rate
from foxhunt.reference.kernels.argcheck import (
    check_f32_array,
    check_f32_scalar,
    check_int,
    ieee,
    require_array,
    require_shape,
)
from foxhunt.reference.kernels.isv import _ema  # the bus's one guarded EMA rule

F32 = np.dtype(np.float32)
I32 = np.dtype(np.int32)

#: Floor of the next-bar label's divisor: ``label = next_ret / fmaxf(ISV[117], LABEL_SCALE_FLOOR)``
#: (seeds: ``1 / fmaxf(label_scale, 1e-6f)``).
LABEL_SCALE_FLOOR = np.float32(1e-6)


# --------------------------------------------------------------------------------------------
# Validation shared with the fast test entries (foxhunt.fast.kernels.aux)
# --------------------------------------------------------------------------------------------


def validate_add_bias_elu(y, b) -> None:
    """The argument checks of ``add_bias_elu``."""
    require_array("y", y, F32, ndim=2)
    require_array("b", b, F32, ndim=1)
    require_shape("b", b, (y.shape[1],), "[N] with N = y.shape[1]")


def validate_elu_backward(dy, h) -> None:
    """The argument checks of ``elu_backward``."""
    require_array("dy", dy, F32, ndim=2)
    require_array("h", h, F32, ndim=2)
    require_shape("h", h, dy.shape, "dy.shape [M, N]")


def validate_aux_next_bar_loss_grad(pred, next_ret, isv, label_scale_index, scale_floor,
                                    weight) -> tuple[int, np.float32, np.float32]:
    """The argument checks of ``aux_next_bar_loss_grad``; returns ``(label_scale_index,
    scale_floor, weight)`` as the kernel receives them."""
    require_array("pred", pred, F32, ndim=1)
    require_array("next_ret", next_ret, F32, ndim=1)
    require_shape("next_ret", next_ret, pred.shape, "[B] with B = pred.shape[0]")
    check_f32_array("isv", isv, ndim=1)
    index = check_int("label_scale_index", label_scale_index, minimum=0, maximum=isv.shape[0] - 1)
    return (index, check_f32_scalar("scale_floor", scale_floor, lo=0.0, lo_open=True),
            check_f32_scalar("weight", weight, lo=0.0))


def validate_aux_regime_loss_grad(logits, regime, weight) -> np.float32:
    """The argument checks of ``aux_regime_loss_grad``: ``logits [B, R]`` float32 with R >= 1,
    ``regime [B]`` int32, every label in ``[0, R)``, ``weight`` finite >= 0; returns ``weight``
    as float32."""
    require_array("logits", logits, F32, ndim=2)
    if logits.shape[0] < 1 or logits.shape[1] < 1:
        raise ValueError(f"logits: shape {logits.shape}; expected [B, R] with B >= 1, R >= 1")
    require_array("regime", regime, I32, ndim=1)
    require_shape("regime", regime, (logits.shape[0],), "[B] with B = logits.shape[0]")
    bad = np.flatnonzero((regime < 0) | (regime >= logits.shape[1]))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"regime[{i}]={int(regime[i])}: allowed range is [0, {logits.shape[1] - 1}]"
                         f" (R = {logits.shape[1]} regimes)")
    return check_f32_scalar("weight", weight, lo=0.0)


def validate_isv_label_scale_update(isv, next_ret, sharpe, alpha_base) -> np.float32:
    """The argument checks of ``isv_label_scale_update``; returns the EMA rate
    (``isv.adaptive_ema_rate(sharpe, alpha_base)``, which checks ``alpha_base``)."""
    check_f32_array("isv", isv, ndim=1)
    if isv.shape != (ISV_LEN,):
        raise ValueError(f"isv: shape {isv.shape}; expected ({ISV_LEN},) (the whole ISV bus)")
    check_f32_array("next_ret", next_ret, ndim=1)
    if isinstance(sharpe, (bool, np.bool_)) or not isinstance(sharpe, (int, float, np.integer,
                                                                         np.floating)):
        raise ValueError(f"sharpe={sharpe!r}: need a real scalar (NaN allowed)")
    return adaptive_ema_rate(sharpe, alpha_base)


# --------------------------------------------------------------------------------------------
# ELU hidden layer
# --------------------------------------------------------------------------------------------


@ieee
def add_bias_elu(y: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Bias + ELU epilogue (alpha = 1): ``t = y[i, n] + b[n]``, ``out = t > 0 ? t : expm1(t)``.

    Shapes: ``y [M, N]`` float32 (the GEMM output), ``b [N]`` float32; returns ``[M, N]``
    float32. The sum is one rounded f32 add; ``expm1`` is float32 (CUDA ``expm1f``).
    NaN/Inf contract: a NaN ``t`` fails ``t > 0`` and ``expm1(NaN)`` is NaN (propagated, visible
    to the sentinels); ``+Inf`` stays ``+Inf``; ``-Inf`` gives ``-1``; ``-0.0`` gives ``-0.0``.
    In BF16 mode the next GEMM multiplies ``round_for(out, "bf16")`` (``dense.f32_to_bf16``).
    """
    validate_add_bias_elu(y, b)
    t = (y + b[np.newaxis, :]).astype(F32, copy=False)
    return np.where(t > 0, t, np.expm1(t)).astype(F32, copy=False)


@ieee
def elu_backward(dy: np.ndarray, h: np.ndarray) -> np.ndarray:
    """Backward through the ELU from its output ``h``: ``dx = h > 0 ? dy : dy * (h + 1)``
    (``d elu / dt = exp(t) = h + 1`` where ``t <= 0``; the seeds' ``aux_elu_bwd_from_post``).

    Shapes: ``dy [M, N]`` and ``h [M, N]`` float32; returns ``[M, N]`` float32; the sum
    ``h + 1`` and the product are each rounded to float32 (exact twin).
    NaN/Inf contract: IEEE. Where ``h > 0`` (``+Inf`` included) ``dy`` passes unchanged; a NaN
    ``h`` makes ``dx`` NaN (the forward's NaN stays visible to the gradient sentinels); a NaN
    or Inf ``dy`` propagates, except that ``Inf * 0`` (``h = -1``, a saturated unit) is NaN.
    """
    validate_elu_backward(dy, h)
    return np.where(h > 0, dy, dy * (h + np.float32(1))).astype(F32, copy=False)


# --------------------------------------------------------------------------------------------
# Loss kernels
# --------------------------------------------------------------------------------------------


class NextBarLossGrad(NamedTuple):
    """Outputs of ``aux_next_bar_loss_grad``: ``d_pred [B]`` and the loss (float32)."""

    d_pred: np.ndarray
    loss: np.float32


@ieee
def aux_next_bar_loss_grad(pred: np.ndarray, next_ret: np.ndarray, isv: np.ndarray,
                           label_scale_index: int, scale_floor, weight) -> NextBarLossGrad:
    """Next-bar return regression, loss and the weighted loss's gradient w.r.t. the prediction:

    - ``label_b = next_ret_b / fmaxf(isv[label_scale_index], scale_floor)`` (ISV 117's label
      scale, floored; a NaN slot gives the floor);
    - ``valid_b = isfinite(label_b)`` (a non-finite label, e.g. a NaN-flagged return, masks
      its sample out); ``n = count(valid)``;
    - ``diff_b = pred_b - label_b``; ``loss = (sum_{valid} diff_b * diff_b) / n``;
    - ``d_pred_b = valid_b ? diff_b * ((2 * weight) / n) : +0.0`` (the gradient of ``weight *
      loss``; the factor rounded once).

    ``n = 0`` gives ``loss = 0`` and ``d_pred = 0``.
    Shapes: ``pred``, ``next_ret`` float32 [B]; ``isv`` float32 [L]; ``weight`` finite >= 0 (the
    head's ``aux_next_bar_weight``). Returns
    ``NextBarLossGrad(d_pred [B] float32, loss float32)``. ``d_pred`` is exact (elementwise);
    the loss's sum is a reduction (block tree on the GPU).
    NaN/Inf contract: a masked sample contributes nothing (whatever ``pred_b`` holds); a
    non-finite ``pred_b`` at a valid sample makes ``d_pred_b`` and the loss non-finite.
    """
    index, floor, w = validate_aux_next_bar_loss_grad(pred, next_ret, isv, label_scale_index,
                                                      scale_floor, weight)
    denom = np.fmax(isv[index], floor)
    label = (next_ret / denom).astype(F32)
    valid = np.isfinite(label)
    n = int(np.count_nonzero(valid))
    if n == 0:
        return NextBarLossGrad(np.zeros(pred.shape, F32), np.float32(0))
    diff = (pred - label).astype(F32)
    coef = (np.float32(2) * w) / np.float32(n)
    d_pred = np.where(valid, diff * coef, np.float32(0)).astype(F32)
    total = np.sum(np.where(valid, diff * diff, np.float32(0)), dtype=F32)
    return NextBarLossGrad(d_pred, np.float32(total / np.float32(n)))


class RegimeLossGrad(NamedTuple):
    """Outputs of ``aux_regime_loss_grad``: ``d_logits [B, R]`` and the loss (float32)."""

    d_logits: np.ndarray
    loss: np.float32


def softmax_shifted(x: np.ndarray):
    """The max-shifted softmax pieces of every row of ``x [..., K]``, in the kernels' order:
    ``m = fmax over the row`` (from ``-Inf``; NaN skipped), ``e = exp(x - m)``, ``s = ((0 + e_0)
    + e_1) + ...`` (sequential). Returns ``(shifted, e, s)`` float32 (``shifted = x - m``). A
    NaN or ``+Inf`` in a row, or a row of ``-Inf``, makes ``s`` NaN; a finite row has ``s >= 1``.
    Helper of the loss kernels here and in ``ensemble`` (not a kernel)."""
    m = np.fmax.reduce(x, axis=-1, initial=-np.inf).astype(F32)
    shifted = (x - m[..., np.newaxis]).astype(F32)
    e = np.exp(shifted).astype(F32)
    s = np.zeros(x.shape[:-1], F32)
    for k in range(x.shape[-1]):
        s = (s + e[..., k]).astype(F32)
    return shifted, e, s


@ieee
def aux_regime_loss_grad(logits: np.ndarray, regime: np.ndarray, weight) -> RegimeLossGrad:
    """Regime classification: mean cross-entropy and the weighted loss's gradient w.r.t. the
    logits.

    Per sample (``softmax_shifted``'s max-shifted sums, ``s >= 1`` for a finite row, so no
    epsilon): ``ce_b = log(s_b) - (logits[b, y_b] - m_b)`` with ``y_b = regime[b]``;
    ``loss = (sum_b ce_b) / B``; ``d_logits[b, r] = (e[b, r] / s_b - 1[r = y_b]) * (weight / B)``
    (the gradient of ``weight * loss``; the factor rounded once).

    Shapes: ``logits [B, R]`` float32, ``regime [B]`` int32 in ``[0, R)`` (else ValueError; the
    CUDA kernel never reads outside a row), ``weight`` finite >= 0 (``aux_regime_weight``).
    Returns ``RegimeLossGrad(d_logits [B, R], loss)`` float32; the loss's sum over samples is a
    reduction.
    NaN/Inf contract, per row: a NaN or ``+Inf`` logit, or a row of ``-Inf``, makes the row's
    ``d_logits`` and ``ce`` NaN (hence the loss); a ``-Inf`` logit in a finite row has
    probability 0.
    """
    w = validate_aux_regime_loss_grad(logits, regime, weight)
    batch, n_regimes = logits.shape
    shifted, e, s = softmax_shifted(logits)
    rows = np.arange(batch)
    ce = (np.log(s) - shifted[rows, regime]).astype(F32)
    one_hot = (np.arange(n_regimes)[np.newaxis, :] == regime[:, np.newaxis]).astype(F32)
    coef = w / np.float32(batch)
    d_logits = ((e / s[:, np.newaxis] - one_hot) * coef).astype(F32)
    return RegimeLossGrad(d_logits, np.float32(np.sum(ce, dtype=F32) / np.float32(batch)))


# --------------------------------------------------------------------------------------------
# ISV 117 producer
# --------------------------------------------------------------------------------------------


@ieee
def isv_label_scale_update(isv: np.ndarray, next_ret: np.ndarray, sharpe,
                           alpha_base) -> np.ndarray:
    """EMA of the batch RMS of the finite next-bar returns into ``ISV[AUX_LABEL_SCALE_EMA]``
    (slot 117), the next-bar head's label scale.

    ``rms = sqrt(max(sum(r_i^2 for finite r_i) / count(finite r_i), 0))`` (float32), then with
    ``alpha = isv.adaptive_ema_rate(sharpe, alpha_base)`` (SPEC 7; a NaN Sharpe gives
    ``alpha_base``) and ``old = isv[117]``:

    - ``rms`` finite and ``old`` not ``> 0`` (the cold start 0, or a NaN): ``new = rms`` (the
      first batch replaces the cold start, so the label divisor never sits at its floor);
    - otherwise the bus's guarded EMA ``(1 - alpha) * old + alpha * rms`` (``kernels.isv``: a
      non-finite ``rms`` keeps ``old``, a non-finite ``old`` takes ``rms``, an overflowing blend
      keeps ``old``).

    No finite return (or an empty ``next_ret``): the slot is unchanged.
    Shapes: ``isv`` float32 ``[ISV_LEN]``; ``next_ret`` float32 [B]; ``sharpe`` a scalar (the
    bus's Sharpe slot on the device); ``alpha_base`` in ``[0, 0.5]``. Returns the new ``isv``;
    every other slot is copied bit for bit. The sum is a reduction (block tree on the GPU).
    """
    alpha = validate_isv_label_scale_update(isv, next_ret, sharpe, alpha_base)
    finite = next_ret[np.isfinite(next_ret)]
    out = isv.copy()
    if finite.size == 0:
        return out
    total = np.sum(np.square(finite), dtype=F32)
    rms = np.sqrt(np.fmax(np.float32(total / np.float32(finite.size)), np.float32(0)), dtype=F32)
    old = isv[AUX_LABEL_SCALE_EMA_INDEX]
    cold = np.isfinite(rms) and not old > 0
    out[AUX_LABEL_SCALE_EMA_INDEX] = rms if cold else _ema(old, rms, alpha)
    return out


KERNELS = {
    "add_bias_elu": add_bias_elu,
    "elu_backward": elu_backward,
    "aux_next_bar_loss_grad": aux_next_bar_loss_grad,
    "aux_regime_loss_grad": aux_regime_loss_grad,
    "isv_label_scale_update": isv_label_scale_update,
}
