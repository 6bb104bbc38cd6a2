"""Entries of the auxiliary heads' kernels: the ELU hidden layer and its backward, the next-bar
regression's loss and gradient, the regime cross-entropy and its gradient, and the ISV 117
label-scale producer.

Tolerances: ``elu_backward`` and the next-bar ``d_pred`` are exact (the same roundings in the
same order); ``add_bias_elu`` is ``expm1f`` against NumPy's float32 ``expm1`` (CUDA's is within 1
ulp, NumPy's SIMD/libm float32 ``expm1`` within 4: 5 ulp apart at most); the regime gradient is
``expf``/``logf`` against NumPy's (reduction bound over the row); every loss and the label scale
are block-tree sums against NumPy's pairwise ones (reductions); the ISV slots the producer does
not write are copied bit for bit.
"""

from __future__ import annotations

import math

import numpy as np

from foxhunt.conformance.kernel_spec import Dims, Kwargs, SpecEntry
from foxhunt.conformance.specs.inputs import (
    F32,
    I32,
    error_cases,
    f32,
    isv_vector,
    maxabs,
    normal,
    reduction,
    replace,
    wrong_dtype,
)
from foxhunt.conformance.tolerance import EXACT, REDUCTION, Tolerance
from foxhunt.reference import isv as isv_mod
from foxhunt.reference.kernels.aux import LABEL_SCALE_FLOOR

#: CUDA ``expm1f`` (1 ulp) against NumPy's float32 ``expm1`` (up to 4 ulp with SVML).
EXPM1_ULP = Tolerance.ulp(5)
#: Share of the sample returns that are NaN-flagged (masked out of the next-bar loss).
NAN_RETURN_SHARE = 0.05


def _n_regimes(d: Dims) -> int:
    return max(2, d.actions)


def _returns(d: Dims, rng) -> np.ndarray:
    """Next-bar returns of a realistic scale (1%), a few NaN-flagged."""
    r = normal(rng, d.batch, 0.01)
    r[rng.random(d.batch) < NAN_RETURN_SHARE] = F32(np.nan)
    return r


def _isv_scaled(d: Dims, rng) -> np.ndarray:
    """The ISV with a warm label scale, except in ``odd`` (the cold start 0)."""
    isv = isv_vector(rng)
    cold = d.case == "odd"
    isv[isv_mod.AUX_LABEL_SCALE_EMA_INDEX] = F32(0.0) if cold else F32(rng.uniform(0.005, 0.02))
    return isv


# ------------------------------------------------------------------------------ samples
def _s_bias_elu(d: Dims, rng) -> Kwargs:
    return {"y": normal(rng, (d.batch, d.hidden), 2.0), "b": normal(rng, d.hidden)}


def _s_elu_backward(d: Dims, rng) -> Kwargs:
    t = normal(rng, (d.batch, d.hidden), 2.0)
    return {"dy": normal(rng, (d.batch, d.hidden), 1e-2),
            "h": np.where(t > 0, t, np.expm1(t)).astype(F32)}


def _s_next_bar(d: Dims, rng) -> Kwargs:
    return {"pred": normal(rng, d.batch, 0.5), "next_ret": _returns(d, rng), "isv": _isv_scaled(d, rng),
            "label_scale_index": isv_mod.AUX_LABEL_SCALE_EMA_INDEX, "scale_floor": LABEL_SCALE_FLOOR,
            "weight": F32(0.1)}


def _s_regime(d: Dims, rng) -> Kwargs:
    r = _n_regimes(d)
    return {"logits": normal(rng, (d.batch, r), 2.0),
            "regime": rng.integers(0, r, d.batch).astype(I32), "weight": F32(0.1)}


def _s_label_scale(d: Dims, rng) -> Kwargs:
    return {"isv": _isv_scaled(d, rng), "next_ret": _returns(d, rng),
            "sharpe": F32(rng.standard_normal()), "alpha_base": 0.05}


# ------------------------------------------------------------------------------ scales
def _labels64(kwargs) -> np.ndarray:
    isv = kwargs["isv"].astype(np.float64)
    denom = max(np.nan_to_num(isv[kwargs["label_scale_index"]], nan=0.0), float(kwargs["scale_floor"]))
    with np.errstate(all="ignore"):
        return kwargs["next_ret"].astype(np.float64) / denom


def _sc_next_bar(kwargs, expected):
    """The loss sums ``n`` squared differences, each divided by ``n`` (an element's size is its
    square over ``n``)."""
    label = _labels64(kwargs)
    valid = np.isfinite(label)
    n = max(int(valid.sum()), 1)
    with np.errstate(all="ignore"):
        diff = kwargs["pred"].astype(np.float64)[valid] - label[valid]
    return {"loss": reduction(n, maxabs(diff) ** 2 / n)}


def _sc_regime(kwargs, expected):
    """``d_logits``: a softmax over the row (R terms) times ``weight / B``; the loss: ``B`` cross
    entropies (each below ``log R + 2 max|logit|``) over ``B``."""
    b, r = kwargs["logits"].shape
    ce_mag = math.log(r) + 2 * maxabs(kwargs["logits"])
    return {"d_logits": reduction(r, float(kwargs["weight"]) / b), "loss": reduction(b, ce_mag / b)}


def _sc_label_scale(kwargs, expected):
    """Slot 117 follows a sum of squares (relative to the larger of the returns and the old
    value); every other slot is copied."""
    index = isv_mod.AUX_LABEL_SCALE_EMA_INDEX
    copied = np.ones(isv_mod.ISV_LEN, bool)
    copied[index] = False
    x = kwargs["next_ret"]
    return {"out": {**reduction(max(x.size, 1), max(maxabs(x), maxabs(kwargs["isv"][index]))),
                    "exact": copied}}


# ------------------------------------------------------------------------------ contracts
def _masked_samples_zero(kwargs, outputs, poisoned):
    """A sample whose label is not finite gets ``d_pred = +0.0``."""
    with np.errstate(over="ignore"):  # a label beyond float32 is +-Inf, as in the kernel
        masked = ~np.isfinite(_labels64(kwargs).astype(F32))
    got = outputs["d_pred"][masked]
    if np.all(got.view(np.uint32) == 0):
        return []
    return [f"d_pred is not +0.0 at masked samples {np.flatnonzero(masked).tolist()} "
            f"(poisoned: {poisoned})"]


def _slot_stays_finite(kwargs, outputs, poisoned):
    """A label scale that held a finite value still does (the EMA guards)."""
    index = isv_mod.AUX_LABEL_SCALE_EMA_INDEX
    if np.isfinite(kwargs["isv"][index]) and not np.isfinite(outputs["out"][index]):
        return [f"ISV slot {index} turned non-finite (poisoned: {poisoned})"]
    return []


# ------------------------------------------------------------------------------ entries
ENTRIES: tuple[SpecEntry, ...] = (
    SpecEntry(
        name="add_bias_elu",
        outputs={"out": f32(EXPM1_ULP)},
        sample=_s_bias_elu,
        targets=("y", "b"),
        errors=error_cases(
            _s_bias_elu,
            lambda k: wrong_dtype(k, "y"),
            lambda k: replace(k, b=k["b"][:-1]),
        ),
    ),
    SpecEntry(
        name="elu_backward",
        outputs={"out": f32(EXACT)},
        sample=_s_elu_backward,
        targets=("dy", "h"),
        errors=error_cases(
            _s_elu_backward,
            lambda k: wrong_dtype(k, "h"),
            lambda k: replace(k, h=k["h"][:-1]),
        ),
    ),
    SpecEntry(
        name="aux_next_bar_loss_grad",
        outputs={"d_pred": f32(EXACT), "loss": f32(REDUCTION)},
        sample=_s_next_bar,
        targets=("pred", "next_ret"),
        errors=error_cases(
            _s_next_bar,
            lambda k: wrong_dtype(k, "pred"),
            lambda k: replace(k, next_ret=k["next_ret"][:-1]),
            lambda k: replace(k, label_scale_index=isv_mod.ISV_LEN),
            lambda k: replace(k, scale_floor=F32(0.0)),
            lambda k: replace(k, weight=F32(-1.0)),
        ),
        scales=_sc_next_bar,
        contract=_masked_samples_zero,
    ),
    SpecEntry(
        name="aux_regime_loss_grad",
        outputs={"d_logits": f32(REDUCTION), "loss": f32(REDUCTION)},
        sample=_s_regime,
        targets=("logits",),
        errors=error_cases(
            _s_regime,
            lambda k: wrong_dtype(k, "logits"),
            lambda k: replace(k, regime=np.full_like(k["regime"], k["logits"].shape[1])),
            lambda k: replace(k, regime=k["regime"].astype(np.int64)),
            lambda k: replace(k, weight=F32(np.nan)),
        ),
        scales=_sc_regime,
    ),
    SpecEntry(
        name="isv_label_scale_update",
        outputs={"out": f32(REDUCTION)},
        sample=_s_label_scale,
        targets=("next_ret", "sharpe"),
        errors=error_cases(
            _s_label_scale,
            lambda k: replace(k, isv=k["isv"][:-1]),
            lambda k: wrong_dtype(k, "next_ret"),
            lambda k: replace(k, alpha_base=0.9),
        ),
        scales=_sc_label_scale,
        contract=_slot_stays_finite,
    ),
)
