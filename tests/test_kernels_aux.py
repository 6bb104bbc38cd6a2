"""Reference kernels of the auxiliary heads (``reference.kernels.aux``) against independent
oracles: float64 math and torch autograd for the values and gradients, hand-built cases for the
NaN contracts. (The CUDA twins run against these in conformance, on a GPU.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from foxhunt.reference import isv as isv_mod
from foxhunt.reference.kernels.aux import (
    LABEL_SCALE_FLOOR,
    add_bias_elu,
    aux_next_bar_loss_grad,
    aux_regime_loss_grad,
    elu_backward,
    isv_label_scale_update,
)

F32 = np.float32
SLOT = isv_mod.AUX_LABEL_SCALE_EMA_INDEX
U = 2.0 ** -24  # float32 unit roundoff


def _isv(scale: float) -> np.ndarray:
    isv = isv_mod.ISVBus().to_array().astype(F32, copy=True)
    isv[SLOT] = F32(scale)
    return isv


# ------------------------------------------------------------------------------ ELU
def test_add_bias_elu_matches_float64_elu():
    rng = np.random.default_rng(0)
    y = (rng.standard_normal((33, 7)) * 3).astype(F32)
    b = rng.standard_normal(7).astype(F32)
    got = add_bias_elu(y, b)
    t = torch.from_numpy((y + b).astype(np.float64))  # the f32 sum, then float64 ELU
    want = torch.nn.functional.elu(t).numpy()
    assert got.dtype == F32
    np.testing.assert_allclose(got, want, rtol=8 * U, atol=0)
    assert np.array_equal(got[(y + b) > 0], (y + b)[(y + b) > 0])  # the positive side is exact


def test_add_bias_elu_nan_contract():
    y = np.array([[np.nan, np.inf, -np.inf, -0.0, 0.0, -1e-30]], F32)
    got = add_bias_elu(y, np.full(6, -0.0, F32))  # -0.0 keeps every y's sign of zero
    assert np.isnan(got[0, 0])
    assert got[0, 1] == np.inf and got[0, 2] == -1.0
    assert got[0, 3] == 0 and np.signbit(got[0, 3])  # expm1(-0) = -0
    assert got[0, 4] == 0 and not np.signbit(got[0, 4])
    assert got[0, 5] == F32(-1e-30)  # expm1 of a tiny value is the value


def test_elu_backward_is_the_autograd_of_elu():
    rng = np.random.default_rng(1)
    t = torch.from_numpy(rng.standard_normal((40, 9)) * 3).requires_grad_(True)
    dy = rng.standard_normal((40, 9))
    torch.nn.functional.elu(t).backward(torch.from_numpy(dy))
    h = torch.nn.functional.elu(t.detach()).numpy().astype(F32)
    got = elu_backward(dy.astype(F32), h)
    # h + 1 stands for exp(t) where t <= 0: one rounding of h (|h| <= 1) and of the sum and the
    # product: within 3 ulp of 1, times |dy|
    np.testing.assert_allclose(got, t.grad.numpy(), rtol=4 * U, atol=3 * 2 * U * np.abs(dy).max())


def test_elu_backward_nan_contract():
    dy = np.array([[1.0, np.nan, 2.0, np.inf, 3.0]], F32)
    h = np.array([[np.nan, 0.5, -0.5, -1.0, np.inf]], F32)
    got = elu_backward(dy, h)
    assert np.isnan(got[0, 0])  # a NaN activation stays visible
    assert np.isnan(got[0, 1])  # h > 0 passes dy (NaN) through
    assert got[0, 2] == F32(1.0)  # 2 * (1 - 0.5)
    assert np.isnan(got[0, 3])  # Inf * 0 at a saturated unit
    assert got[0, 4] == 3.0


# ------------------------------------------------------------------------------ next-bar head
def _torch_next_bar(pred, next_ret, scale):
    p = torch.from_numpy(pred.astype(np.float64)).requires_grad_(True)
    label = next_ret.astype(np.float64) / scale
    valid = np.isfinite(label)
    diff = p[torch.from_numpy(valid)] - torch.from_numpy(label[valid])
    loss = (diff * diff).mean()
    loss.backward()
    return loss.item(), p.grad.numpy()


def test_next_bar_loss_and_gradient_match_autograd():
    rng = np.random.default_rng(2)
    pred = rng.standard_normal(64).astype(F32)
    next_ret = (rng.standard_normal(64) * 0.01).astype(F32)
    next_ret[[3, 17, 40]] = [np.nan, np.inf, -np.inf]  # NaN-flagged returns: masked out
    pred[3] = np.nan  # whatever a masked sample predicts does not matter
    out = aux_next_bar_loss_grad(pred, next_ret, _isv(0.01), SLOT, LABEL_SCALE_FLOOR, 0.3)
    loss, grad = _torch_next_bar(pred, next_ret, float(F32(0.01)))
    grad = grad * float(F32(0.3))  # the gradient of weight * loss; the loss is unweighted
    # label, diff and square: a few roundings per term; the mean of 61 terms
    assert out.loss == pytest.approx(loss, rel=200 * U)
    np.testing.assert_allclose(out.d_pred, grad, rtol=8 * U, atol=0)
    assert np.all(out.d_pred[[3, 17, 40]] == 0) and not np.any(np.signbit(out.d_pred[[3, 17, 40]]))


def test_next_bar_label_scale_is_floored():
    pred = np.zeros(4, F32)
    next_ret = np.full(4, 2e-6, F32)
    for slot_value in (0.0, -5.0, np.nan):  # cold start, nonsense, poisoned: the floor 1e-6
        out = aux_next_bar_loss_grad(pred, next_ret, _isv(slot_value), SLOT, LABEL_SCALE_FLOOR, 1.0)
        label = F32(2e-6) / LABEL_SCALE_FLOOR
        assert out.loss == pytest.approx(float(label) ** 2, rel=4 * U)
        assert np.all(out.d_pred == F32(-label) * (F32(2) / F32(4)))


def test_next_bar_all_masked_gives_zero_not_nan():
    out = aux_next_bar_loss_grad(np.ones(5, F32), np.full(5, np.nan, F32), _isv(0.01), SLOT,
                                 LABEL_SCALE_FLOOR, 1.0)
    assert out.loss == 0 and np.all(out.d_pred == 0)


def test_next_bar_overflowing_label_is_masked():
    """A finite return whose label overflows float32 is not finite: masked like a NaN."""
    next_ret = np.array([1e38, 0.01], F32)
    out = aux_next_bar_loss_grad(np.zeros(2, F32), next_ret, _isv(1e-3), SLOT, LABEL_SCALE_FLOOR, 1.0)
    label = F32(0.01) / F32(1e-3)
    assert out.d_pred[0] == 0 and out.d_pred[1] == -label * F32(2.0)  # n = 1 valid sample
    assert out.loss == label * label


def test_next_bar_nonfinite_prediction_propagates():
    pred = np.array([np.nan, 0.0], F32)
    out = aux_next_bar_loss_grad(pred, np.zeros(2, F32), _isv(0.01), SLOT, LABEL_SCALE_FLOOR, 1.0)
    assert np.isnan(out.d_pred[0]) and out.d_pred[1] == 0 and np.isnan(out.loss)


def test_next_bar_rejects_bad_arguments():
    pred = np.zeros(3, F32)
    with pytest.raises(ValueError, match="next_ret"):
        aux_next_bar_loss_grad(pred, np.zeros(4, F32), _isv(1), SLOT, LABEL_SCALE_FLOOR, 1.0)
    with pytest.raises(ValueError, match="label_scale_index"):
        aux_next_bar_loss_grad(pred, pred, _isv(1), isv_mod.ISV_LEN, LABEL_SCALE_FLOOR, 1.0)
    with pytest.raises(ValueError, match="scale_floor"):
        aux_next_bar_loss_grad(pred, pred, _isv(1), SLOT, 0.0, 1.0)
    with pytest.raises(ValueError, match="weight"):
        aux_next_bar_loss_grad(pred, pred, _isv(1), SLOT, LABEL_SCALE_FLOOR, -0.5)


# ------------------------------------------------------------------------------ regime head
def test_regime_loss_and_gradient_match_torch_cross_entropy():
    rng = np.random.default_rng(3)
    logits = (rng.standard_normal((50, 4)) * 3).astype(F32)
    regime = rng.integers(0, 4, 50).astype(np.int32)
    out = aux_regime_loss_grad(logits, regime, 0.1)
    t = torch.from_numpy(logits.astype(np.float64)).requires_grad_(True)
    loss = torch.nn.functional.cross_entropy(t, torch.from_numpy(regime.astype(np.int64)))
    (float(F32(0.1)) * loss).backward()  # the weighted loss's gradient; the loss unweighted
    # exp/log to a few ulp, sums of 4 terms; the loss a mean of 50 such terms
    assert out.loss == pytest.approx(loss.item(), rel=100 * U)
    np.testing.assert_allclose(out.d_logits, t.grad.numpy(), rtol=0, atol=32 * U * 0.1 / 50)
    np.testing.assert_allclose(out.d_logits.sum(axis=1), 0, atol=8 * U * 0.1 / 50)


def test_regime_nan_row_is_poisoned_alone():
    logits = np.zeros((3, 3), F32)
    logits[1, 2] = np.nan
    logits[2] = [-np.inf, -np.inf, -np.inf]  # no finite logit: NaN too
    out = aux_regime_loss_grad(logits, np.zeros(3, np.int32), 1.0)
    assert np.all(np.isfinite(out.d_logits[0])) and np.all(np.isnan(out.d_logits[1:]))
    assert np.isnan(out.loss)
    one_inf = aux_regime_loss_grad(np.array([[0.0, -np.inf, 1.0]], F32), np.zeros(1, np.int32),
                                   1.0)
    assert one_inf.d_logits[0, 1] == 0 and np.isfinite(one_inf.loss)  # probability 0


def test_regime_rejects_labels_outside_the_range():
    with pytest.raises(ValueError, match=r"regime\[1\]=3"):
        aux_regime_loss_grad(np.zeros((2, 3), F32), np.array([0, 3], np.int32), 1.0)
    with pytest.raises(ValueError, match="regime"):
        aux_regime_loss_grad(np.zeros((2, 3), F32), np.array([0, 1], np.int64), 1.0)
    with pytest.raises(ValueError, match="weight"):
        aux_regime_loss_grad(np.zeros((2, 3), F32), np.array([0, 1], np.int32), np.inf)


# ------------------------------------------------------------------------------ ISV 117
def _rms64(x):
    x = x[np.isfinite(x)].astype(np.float64)
    return float(np.sqrt(np.mean(x * x)))


def test_label_scale_cold_start_takes_the_first_batch_rms():
    assert isv_mod.ISVBus().to_array()[SLOT] == 0  # the registry's cold start
    next_ret = np.array([0.01, -0.02, np.nan, 0.03, np.inf], F32)
    isv = _isv(0.0)
    out = isv_label_scale_update(isv, next_ret, 0.0, 0.05)
    assert out[SLOT] == pytest.approx(_rms64(next_ret), rel=4 * U)
    copied = np.arange(isv_mod.ISV_LEN) != SLOT
    assert out[copied].tobytes() == isv[copied].tobytes()  # every other slot bit for bit
    assert isv[SLOT] == 0  # the input is not mutated


@pytest.mark.parametrize("sharpe, alpha", [(0.0, 0.05), (np.nan, 0.05), (1.0, 0.075), (-9.0, 0.1)])
def test_label_scale_is_an_adaptive_ema(sharpe, alpha):
    rng = np.random.default_rng(4)
    next_ret = (rng.standard_normal(100) * 0.02).astype(F32)
    out = isv_label_scale_update(_isv(0.01), next_ret, sharpe, 0.05)
    want = (1 - alpha) * float(F32(0.01)) + alpha * _rms64(next_ret)
    assert out[SLOT] == pytest.approx(want, rel=20 * U)


def test_label_scale_without_a_finite_return_is_unchanged():
    isv = _isv(0.01)
    out = isv_label_scale_update(isv, np.array([np.nan, np.inf], F32), 0.0, 0.05)
    assert out.tobytes() == isv.tobytes()
    out = isv_label_scale_update(isv, np.zeros(0, F32), 0.0, 0.05)
    assert out.tobytes() == isv.tobytes()


def test_label_scale_reseeds_a_poisoned_slot():
    out = isv_label_scale_update(_isv(np.nan), np.array([0.03, -0.04], F32), 0.0, 0.05)
    assert out[SLOT] == pytest.approx(_rms64(np.array([0.03, -0.04])), rel=4 * U)


def test_label_scale_rejects_bad_arguments():
    with pytest.raises(ValueError, match="isv"):
        isv_label_scale_update(np.zeros(5, F32), np.zeros(3, F32), 0.0, 0.05)
    with pytest.raises(ValueError, match="alpha_base"):
        isv_label_scale_update(_isv(1), np.zeros(3, F32), 0.0, 0.9)
    with pytest.raises(ValueError, match="sharpe"):
        isv_label_scale_update(_isv(1), np.zeros(3, F32), "high", 0.05)
