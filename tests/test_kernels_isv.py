"""ISV producer kernels: EMA values against hand-computed and float64 oracles, NaN/Inf guards."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, strategies as st
from hypothesis.extra import numpy as hnp

from foxhunt.reference import isv
from foxhunt.reference.kernels import KERNELS as ALL_KERNELS
from foxhunt.reference.kernels import isv as kisv

F32_MAX = float(np.finfo(np.float32).max)
SPECIALS = (math.nan, math.inf, -math.inf)
# A fingerprint whose halves are NaN bit patterns (signalling and quiet with payload): the
# kernels must copy them bit for bit.
NAN_FINGERPRINT = (0x7F800001 << 32) | 0x7FC0BEEF


def _isv(**values: float) -> np.ndarray:
    vec = isv.ISVBus().to_array()
    for name, v in values.items():
        vec[isv.slot(name).index] = np.float32(v)
    isv.write_fingerprint(vec, NAN_FINGERPRINT)
    return vec


def _assert_only_changed(before: np.ndarray, after: np.ndarray, changed: set[int]) -> None:
    assert after.dtype == np.float32 and after.shape == before.shape
    keep = np.array([i not in changed for i in range(before.size)])
    assert np.array_equal(before.view(np.uint32)[keep], after.view(np.uint32)[keep])


def _ema64(old: float, x: float, alpha: float) -> float:
    return (1.0 - alpha) * old + alpha * x


def test_kernels_registry():
    assert set(kisv.KERNELS) == {"isv_signal_update", "isv_q_abs_ref_update", "isv_h2_rms_update"}
    for name, fn in kisv.KERNELS.items():
        assert fn.__name__ == name and ALL_KERNELS[name] is fn


# --------------------------------------------------------------------------- isv_signal_update
@pytest.mark.parametrize("sharpe, expected", [
    (0.0, 5.0),        # alpha = 0.25: 0.75*4 + 0.25*8
    (2.0, 6.0),        # alpha = 0.25*(1+0.5*2) = 0.5
    (-9.0, 6.0),       # clamped to -2
    (math.nan, 5.0),   # NaN Sharpe counts as 0
])
def test_signal_update_hand_computed(sharpe, expected):
    vec = _isv()
    vec[:13] = 4.0
    signals = np.full(13, 8.0, np.float32)
    out = kisv.isv_signal_update(vec, signals, sharpe, 0.25)
    assert np.all(out[:13] == np.float32(expected))
    _assert_only_changed(vec, out, set(range(13)))


@given(hnp.arrays(np.float32, 13, elements=st.floats(-1e6, 1e6, width=32)),
       hnp.arrays(np.float32, 13, elements=st.floats(-1e6, 1e6, width=32)),
       st.floats(-5, 5), st.floats(0.0, 0.5))
def test_signal_update_matches_float64_oracle(old, signals, sharpe, alpha_base):
    vec = _isv()
    vec[:13] = old
    before = vec.copy()
    sig_before = signals.copy()
    out = kisv.isv_signal_update(vec, signals, sharpe, alpha_base)
    assert np.array_equal(vec.view(np.uint32), before.view(np.uint32))  # inputs not mutated
    assert np.array_equal(signals, sig_before)
    a = float(np.float32(alpha_base)) * (1 + 0.5 * min(abs(float(np.float32(sharpe))), 2.0))
    for i in range(13):
        o, x = float(old[i]), float(signals[i])
        ref = _ema64(o, x, a)
        # two rounded products and a rounded sum, plus the rounding of alpha itself
        bound = 4 * 2.0**-24 * ((1 - a) * abs(o) + a * abs(x)) + 1e-40
        assert abs(float(out[i]) - ref) <= bound, (i, o, x, a)
    _assert_only_changed(vec, out, set(range(13)))


@st.composite
def _with_specials(draw, n: int, lo: float = -1e6, hi: float = 1e6):
    """A float32 [n] array with NaN/+Inf/-Inf injected at explicitly drawn positions."""
    arr = draw(hnp.arrays(np.float32, n, elements=st.floats(lo, hi, width=32)))
    positions = draw(st.lists(st.integers(0, n - 1), max_size=n, unique=True))
    for p in positions:
        arr[p] = draw(st.sampled_from(SPECIALS))
    return arr


@given(_with_specials(13), _with_specials(13), st.floats(allow_nan=True), st.floats(0.0, 0.5))
def test_signal_update_nan_guards(old, signals, sharpe, alpha_base):
    vec = _isv()
    vec[:13] = old
    out = kisv.isv_signal_update(vec, signals, sharpe, alpha_base)
    for i in range(13):
        if not np.isfinite(signals[i]):
            # non-finite signal: slot unchanged, bit for bit (even if it was NaN)
            assert out.view(np.uint32)[i] == vec.view(np.uint32)[i]
        elif not np.isfinite(old[i]):
            assert out[i] == signals[i]  # a poisoned slot is re-seeded by the signal
        else:
            assert np.isfinite(out[i])
            lo, hi = sorted((float(old[i]), float(signals[i])))
            tol = 1e-6 * max(abs(lo), abs(hi)) + 1e-38
            assert lo - tol <= float(out[i]) <= hi + tol  # a convex blend of old and signal
    _assert_only_changed(vec, out, set(range(13)))


def test_signal_update_never_overflows_at_the_float32_limit():
    vec = _isv()
    vec[:13] = np.float32(F32_MAX)
    signals = np.full(13, F32_MAX, np.float32)
    signals[1::2] = -F32_MAX
    out = kisv.isv_signal_update(vec, signals, 0.0, 0.5)  # alpha = 0.5
    assert np.all(out[0:13:2] == np.float32(F32_MAX))  # 0.5*M + 0.5*M, no overflow
    assert np.all(out[1:13:2] == 0.0)                  # 0.5*M - 0.5*M


@pytest.mark.parametrize("kwargs, match", [
    (dict(isv=np.zeros(285, np.float32)), r"isv: .*\(286,\)"),
    (dict(isv=np.zeros(286, np.float64)), "isv: .*float64"),
    (dict(signals=np.zeros(12, np.float32)), r"signals: shape \(12,\)"),
    (dict(signals=np.zeros(13, np.float64)), "signals: .*float64"),
    (dict(alpha_base=0.6), "alpha_base=0.6"),
    (dict(alpha_base=math.nan), "alpha_base=nan"),
    (dict(alpha_base=-0.1), "alpha_base=-0.1"),
    (dict(sharpe="1.0"), "sharpe"),
])
def test_signal_update_bad_inputs_raise(kwargs, match):
    args = dict(isv=_isv(), signals=np.zeros(13, np.float32), sharpe=0.0, alpha_base=0.05)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        kisv.isv_signal_update(**args)


# --------------------------------------------------------------------------- Q_ABS_REF
def test_q_abs_ref_hand_computed():
    vec = _isv(Q_ABS_REF=4.0)
    q = np.array([[1.0, -3.0], [2.0, -2.0]], np.float32)  # mean |q| = 2
    out = kisv.isv_q_abs_ref_update(vec, q, 0.5)
    assert out[isv.Q_ABS_REF_INDEX] == np.float32(3.0)
    _assert_only_changed(vec, out, {isv.Q_ABS_REF_INDEX})


def test_q_abs_ref_skips_non_finite_elements():
    vec = _isv(Q_ABS_REF=0.0)
    q = np.array([math.nan, 6.0, -math.inf, -2.0, math.inf], np.float32)  # finite mean |q| = 4
    out = kisv.isv_q_abs_ref_update(vec, q, 0.25)
    assert out[isv.Q_ABS_REF_INDEX] == np.float32(1.0)


@pytest.mark.parametrize("q", [
    np.array([math.nan, math.inf], np.float32),      # nothing finite
    np.zeros((0, 3), np.float32),                    # empty batch
    np.array([F32_MAX, F32_MAX], np.float32),        # the sum overflows
])
def test_q_abs_ref_keeps_old_value_without_a_finite_mean(q):
    vec = _isv(Q_ABS_REF=7.0)
    out = kisv.isv_q_abs_ref_update(vec, q, 0.5)
    assert np.array_equal(out.view(np.uint32), vec.view(np.uint32))


def test_q_abs_ref_reseeds_a_poisoned_slot():
    vec = _isv(Q_ABS_REF=math.nan)
    out = kisv.isv_q_abs_ref_update(vec, np.array([-3.0, 3.0], np.float32), 0.1)
    assert out[isv.Q_ABS_REF_INDEX] == np.float32(3.0)


@given(st.integers(1, 64), st.integers(1, 9), st.floats(0.0, 1.0), st.floats(0.0, 100.0),
       st.integers(0, 2**32 - 1))
def test_q_abs_ref_matches_float64_oracle(rows, cols, alpha, old, seed):
    rng = np.random.default_rng(seed)
    q = (rng.standard_normal((rows, cols)) * 10).astype(np.float32)
    mask = rng.random(q.shape) < 0.2
    q[mask] = rng.choice(np.array(SPECIALS, np.float32), size=int(mask.sum()))
    vec = _isv(Q_ABS_REF=old)
    out = kisv.isv_q_abs_ref_update(vec, q, alpha)
    finite = q[np.isfinite(q)].astype(np.float64)
    o = float(np.float32(old))
    if finite.size == 0:
        assert out[isv.Q_ABS_REF_INDEX] == vec[isv.Q_ABS_REF_INDEX]
    else:
        ref = _ema64(o, float(np.mean(np.abs(finite))), float(np.float32(alpha)))
        assert float(out[isv.Q_ABS_REF_INDEX]) == pytest.approx(ref, rel=1e-5, abs=1e-6)
    _assert_only_changed(vec, out, {isv.Q_ABS_REF_INDEX})


# --------------------------------------------------------------------------- H_S2_RMS_EMA
def test_h2_rms_hand_computed():
    vec = _isv(H_S2_RMS_EMA=1.0)
    h2 = np.array([[3.0, -3.0], [-3.0, 3.0]], np.float32)  # RMS = 3
    out = kisv.isv_h2_rms_update(vec, h2, 0.25)
    assert out[isv.H_S2_RMS_EMA_INDEX] == np.float32(1.5)  # 0.75*1 + 0.25*3
    _assert_only_changed(vec, out, {isv.H_S2_RMS_EMA_INDEX})


def test_h2_rms_skips_non_finite_and_keeps_old_on_overflow():
    vec = _isv(H_S2_RMS_EMA=2.0)
    h2 = np.array([[math.nan, 4.0], [-4.0, math.inf]], np.float32)  # RMS of finite = 4
    out = kisv.isv_h2_rms_update(vec, h2, 0.5)
    assert out[isv.H_S2_RMS_EMA_INDEX] == np.float32(3.0)
    big = np.array([[1e20, 1.0]], np.float32)  # finite, but the squares overflow float32
    assert kisv.isv_h2_rms_update(vec, big, 0.5)[isv.H_S2_RMS_EMA_INDEX] == np.float32(2.0)
    nothing = np.full((2, 2), math.nan, np.float32)
    assert kisv.isv_h2_rms_update(vec, nothing, 0.5)[isv.H_S2_RMS_EMA_INDEX] == np.float32(2.0)


@given(st.integers(1, 32), st.integers(1, 40), st.floats(0.0, 1.0), st.floats(0.0, 50.0),
       st.integers(0, 2**32 - 1))
def test_h2_rms_matches_float64_oracle(rows, cols, alpha, old, seed):
    rng = np.random.default_rng(seed)
    h2 = np.maximum(rng.standard_normal((rows, cols)) * 3, 0).astype(np.float32)  # relu-like
    mask = rng.random(h2.shape) < 0.1
    h2[mask] = rng.choice(np.array(SPECIALS, np.float32), size=int(mask.sum()))
    vec = _isv(H_S2_RMS_EMA=old)
    h2_before = h2.copy()
    out = kisv.isv_h2_rms_update(vec, h2, alpha)
    assert np.array_equal(h2, h2_before, equal_nan=True)
    finite = h2[np.isfinite(h2)].astype(np.float64)
    if finite.size == 0:
        assert out[isv.H_S2_RMS_EMA_INDEX] == vec[isv.H_S2_RMS_EMA_INDEX]
    else:
        rms = math.sqrt(float(np.mean(finite**2)))
        ref = _ema64(float(np.float32(old)), rms, float(np.float32(alpha)))
        assert float(out[isv.H_S2_RMS_EMA_INDEX]) == pytest.approx(ref, rel=1e-5, abs=1e-6)
    _assert_only_changed(vec, out, {isv.H_S2_RMS_EMA_INDEX})


@pytest.mark.parametrize("kernel", [kisv.isv_q_abs_ref_update, kisv.isv_h2_rms_update])
@pytest.mark.parametrize("kwargs, match", [
    (dict(x=np.zeros(4, np.float64)), "float64"),
    (dict(x=np.float32(1.0)), "need a float32 array"),
    (dict(x=np.zeros((), np.float32)), "0-d"),
    (dict(alpha=1.5), "alpha=1.5"),
    (dict(alpha=math.nan), "alpha=nan"),
    (dict(isv=np.zeros(10, np.float32)), r"isv: .*\(286,\)"),
])
def test_reduction_kernels_bad_inputs_raise(kernel, kwargs, match):
    args = dict(isv=_isv(), x=np.ones(4, np.float32), alpha=0.1)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        kernel(args["isv"], args["x"], args["alpha"])
