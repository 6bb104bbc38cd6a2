"""Tests for foxhunt.reference.kernels.safety: exact clamps, sticky sentinel flags, fmaxf-style
reductions and the Mech 1 ISV-driven bound. Oracles are element-by-element Python (math.isfinite,
float comparisons), never the NumPy expressions under test."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from foxhunt.reference.kernels import KERNELS, safety

F32_MAX = float(np.finfo(np.float32).max)
SPECIALS = [math.nan, math.inf, -math.inf, F32_MAX, -F32_MAX, 3.0e38, 1e-45, -1e-40, 0.0, -0.0]


@st.composite
def f32_with_specials(draw, max_size: int = 48, min_size: int = 0) -> np.ndarray:
    """float32 vector of moderate values with specials written at explicit drawn positions
    (hnp.arrays shares one fill value, so specials are injected by hand)."""
    n = draw(st.integers(min_size, max_size))
    x = draw(hnp.arrays(np.float32, n, elements=st.floats(-1e4, 1e4, width=32)))
    if n:
        positions = draw(st.lists(st.integers(0, n - 1), max_size=min(n, 6), unique=True))
        for pos in positions:
            x[pos] = draw(st.sampled_from(SPECIALS))
    return x


def _any_nonfinite(x: np.ndarray) -> bool:
    return any(not math.isfinite(float(e)) for e in x.ravel())


# --- clamp_finite --------------------------------------------------------------------------


@given(x=f32_with_specials(), m=st.sampled_from([0.0, 1.0, 7.5, 1e30, math.inf]))
def test_clamp_finite_exact_and_never_nonfinite(x, m):
    x_before = x.copy()
    out = safety.clamp_finite(x, m)
    m = float(np.float32(m))  # the kernel argument is a float32
    assert out.dtype == np.float32 and out.shape == x.shape
    assert np.array_equal(x, x_before, equal_nan=True)  # input untouched
    for xi, oi in zip(x.tolist(), out.tolist()):
        assert math.isfinite(oi)
        if not math.isfinite(xi):
            assert oi == 0.0 and math.copysign(1.0, oi) == 1.0  # +0.0
        else:
            expected = min(max(xi, -m), m)
            assert oi == expected
            if xi == 0.0:  # sign of zero kept
                assert math.copysign(1.0, oi) == math.copysign(1.0, xi)


@pytest.mark.parametrize("m", [-1.0, math.nan])
def test_clamp_finite_rejects_bad_bound(m):
    with pytest.raises(ValueError, match="m="):
        safety.clamp_finite(np.zeros(3, np.float32), m)


def test_clamp_finite_rejects_float64():
    with pytest.raises(ValueError, match="x: dtype float64"):
        safety.clamp_finite(np.zeros(3), 1.0)


# --- nan_check / nan_check_fused -----------------------------------------------------------


@given(x=f32_with_specials(), flag=st.sampled_from([0, 1]))
def test_nan_check_flags_exactly_on_nonfinite(x, flag):
    out = safety.nan_check(x, flag)
    assert isinstance(out, np.int32)
    assert out == (1 if flag or _any_nonfinite(x) else 0)


def test_nan_check_large_finite_and_subnormal_do_not_fire():
    x = np.array([F32_MAX, -F32_MAX, 1e-45, -0.0], np.float32)
    assert safety.nan_check(x, 0) == 0
    assert safety.nan_check(np.zeros(0, np.float32), 0) == 0


@pytest.mark.parametrize("flag", [2, -1, True, 0.0])
def test_nan_check_rejects_bad_flag(flag):
    with pytest.raises(ValueError, match="flag="):
        safety.nan_check(np.zeros(2, np.float32), flag)


@given(data=st.data())
def test_nan_check_fused_matches_per_slot_rule(data):
    n = data.draw(st.integers(1, 6))
    buffers = [data.draw(st.one_of(st.none(), f32_with_specials(max_size=16))) for _ in range(n)]
    flags = np.array(data.draw(st.lists(st.sampled_from([0, 1]), min_size=n, max_size=n)),
                     np.int32)
    thresholds = np.array(
        data.draw(st.lists(st.sampled_from([0.0, -1.0, math.nan, 5.0, 100.0, 1e4, math.inf]),
                           min_size=n, max_size=n)), np.float32)
    flags_before = flags.copy()
    out = safety.nan_check_fused(buffers, flags, thresholds)
    assert out.dtype == np.int32 and out.shape == (n,)
    assert np.array_equal(flags, flags_before)
    for k in range(n):
        buf, thr = buffers[k], float(thresholds[k])
        fires = False
        if buf is not None and buf.size:
            fires = _any_nonfinite(buf)
            if thr > 0 and not fires:
                fires = max(abs(float(e)) for e in buf) >= thr
        assert out[k] == (1 if flags_before[k] or fires else 0), (k, buf, thr)


def test_nan_check_fused_threshold_is_inclusive():
    buf = np.array([1.0, -4.0], np.float32)
    flags = np.zeros(3, np.int32)
    out = safety.nan_check_fused([buf, buf, buf], flags, np.array([4.0, 4.5, 0.0], np.float32))
    assert out.tolist() == [1, 0, 0]


def test_nan_check_fused_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="one entry per buffer"):
        safety.nan_check_fused([None, None], np.zeros(3, np.int32), np.zeros(2, np.float32))
    with pytest.raises(ValueError, match="flags"):
        safety.nan_check_fused([None], np.full(1, 3, np.int32), np.zeros(1, np.float32))
    with pytest.raises(ValueError, match=r"buffers\[0\]"):
        safety.nan_check_fused([np.zeros(2)], np.zeros(1, np.int32), np.zeros(1, np.float32))


# --- max_abs (fmaxf reduction) ---------------------------------------------------------------


@given(x=f32_with_specials())
def test_max_abs_ignores_nan(x):
    out = safety.max_abs(x)
    assert isinstance(out, np.float32)
    vals = [abs(e) for e in x.tolist() if not math.isnan(e)]
    assert out == (max(vals) if vals else 0.0)


def test_max_abs_all_nan_and_inf():
    assert safety.max_abs(np.full(4, np.nan, np.float32)) == 0.0
    assert safety.max_abs(np.array([np.nan, -np.inf, 1.0], np.float32)) == np.inf


# --- isv_bound / target_q_clip (Mech 1) ----------------------------------------------------


@pytest.mark.parametrize(
    ("isv", "expected_factor"),
    [(0.0, 1.0), (0.5, 1.0), (1.0, 1.0), (2.0, 2.0), (math.nan, 1.0), (-math.inf, 1.0),
     (-3.0, 1.0), (math.inf, math.inf)],
)
def test_isv_bound_floors_the_signal_not_the_bound(isv, expected_factor):
    # fmaxf returns the non-NaN operand: NaN ISV behaves like a cold-start signal.
    assert safety.isv_bound(10.0, isv) == np.float32(10.0 * expected_factor)


def test_isv_bound_is_multiplier_times_signal_not_a_floor_on_the_bound():
    # bound.max(const) would give max(0.5*0.1, 1) = 1; the rule gives 0.5 * max(0.1, 1) = 0.5.
    assert safety.isv_bound(0.5, 0.1) == np.float32(0.5)


@pytest.mark.parametrize("mult", [0.0, -1.0, math.nan, math.inf])
def test_isv_bound_rejects_bad_multiplier(mult):
    with pytest.raises(ValueError, match="multiplier="):
        safety.isv_bound(mult, 1.0)


@given(q=f32_with_specials(), k1=st.sampled_from([1.0, 9.5, 100.0]),
       q_abs_ref=st.sampled_from([0.0, 0.3, 1.0, 4.0, 1e3, math.nan, math.inf]))
def test_target_q_clip(q, k1, q_abs_ref):
    out = safety.target_q_clip(q, k1, q_abs_ref)
    assert out.dtype == np.float32 and out.shape == q.shape
    signal = 1.0 if math.isnan(q_abs_ref) else max(q_abs_ref, 1.0)
    bound = float(np.float32(k1 * signal)) if math.isfinite(signal) else math.inf
    for qi, oi in zip(q.tolist(), out.tolist()):
        if math.isnan(qi):
            assert math.isnan(oi)  # NaN stays visible
        else:
            assert oi == min(max(qi, -bound), bound)


def test_target_q_clip_infinities_become_bounds():
    out = safety.target_q_clip(np.array([np.inf, -np.inf], np.float32), 2.0, 3.0)
    assert out.tolist() == [6.0, -6.0]


# --- registry -------------------------------------------------------------------------------


def test_kernels_registered_under_their_names():
    for name, fn in safety.KERNELS.items():
        assert fn.__name__ == name and KERNELS[name] is fn
    assert "isv_bound" not in safety.KERNELS  # a helper, not a kernel


def test_nan_check_fused_chunk_is_safety_cu_s():
    """plan_nan_check_fused sizes its grid with safety.cu's elements per thread of a chunk."""
    import re
    from importlib import resources

    from foxhunt.fast.kernels import safety as fast_safety

    text = (resources.files("foxhunt.cuda_src") / "safety.cu").read_text()
    per_thread = int(re.search(r"#define NAN_CHECK_PER_THREAD (\d+)", text).group(1))
    assert fast_safety.FUSED_PER_THREAD == per_thread
    assert per_thread % 4 == 0  # its vector path loads whole float4s
