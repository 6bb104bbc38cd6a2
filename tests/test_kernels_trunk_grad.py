"""The trunk gradients of the second-wave sources in fewer launches: the C51 trunk's with the
auxiliary heads' ``d h2`` (``h2_grad_sum_aux_mask``) and an auxiliary trunk's guarded one
(``h2_guard_mask``, IQN and ensemble). Each reference twin against an element-by-element oracle
written from the launches it fuses (each value a Python float rounded to float32 at every
operation, as IEEE binary32 does), on hypothesis-drawn values with NaN, +/-Inf, signed zeros and
subnormals; their argument checks; and, on a GPU (skipped without one, with the reason), the
CUDA kernels bit for bit against the twins on the same draws, on the vector path and the scalar
one.

NVRTC compiles ``cuda_src/step.cu`` in ``tests/test_fast_build.py`` (every source file); the
step with the kernel switched on runs in ``conformance/test_step_cpu_executor.py`` (CPU
executor) and ``conformance/test_step.py`` (GPU).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from foxhunt.fast.device import cuda_available
from foxhunt.reference.kernels import step as ref_step

F32 = np.float32
_GPU, _WHY = cuda_available()
gpu = pytest.mark.skipif(not _GPU, reason=f"no CUDA device/driver: {_WHY}")

#: Values the draws mix: the non-finite ones, signed zeros, a subnormal, the largest finite
#: float32 (its sums overflow), and ordinary values.
SPECIAL = [math.nan, math.inf, -math.inf, 0.0, -0.0, 1e-45, -1e-45, 3.4028235e38, -3.4028235e38,
           1.0, -1.0, 0.5, -2.0]


def _f(x) -> float:
    """Round to float32 (the value a float32 register holds)."""
    return float(F32(x))


def _add(a: float, b: float) -> float:
    with np.errstate(all="ignore"):
        return float(F32(a) + F32(b))


def _oracle(parts, aux, h2, h2_pre):
    """The six launches element by element (the plan's order): the heads' sum from +0, part by
    part; the first auxiliary head's finite map and the second's guarded add (two heads); the
    guarded add into the sum; the masks of ``0 + y``."""
    n = h2.size
    main, dh2, out = (np.empty(n, F32) for _ in range(3))
    for i in range(n):
        s = 0.0
        for part in parts.reshape(parts.shape[0], -1):
            s = _add(s, part[i])
        a = float(aux.reshape(aux.shape[0], -1)[0, i])
        if aux.shape[0] == 2:
            a = a if math.isfinite(a) else 0.0
            b = float(aux.reshape(2, -1)[1, i])
            a = _add(a, b) if math.isfinite(b) else a
        y = _add(s, a) if math.isfinite(a) else s
        z = _add(0.0, y)
        h, pre = float(h2.reshape(-1)[i]), float(h2_pre.reshape(-1)[i])
        main[i], dh2[i] = s, y
        out[i] = 0.0 if pre <= 0.0 else (z if h == pre else 0.0)
    shape = h2.shape
    return main.reshape(shape), dh2.reshape(shape), out.reshape(shape)


def _values(count: int):
    return st.lists(st.one_of(st.sampled_from(SPECIAL), st.floats(-4.0, 4.0, width=32)),
                    min_size=count, max_size=count).map(lambda v: np.array(v, F32))


@st.composite
def _inputs(draw, max_n: int = 9):
    n = draw(st.integers(1, max_n))
    k = draw(st.integers(1, 4))
    heads = draw(st.sampled_from([1, 2]))
    parts = draw(_values(k * n)).reshape(k, n)
    aux = draw(_values(heads * n)).reshape(heads, n)
    h2_pre = draw(_values(n))
    # h2: the clamp passed the value (equal) or changed it (a clamped copy), per element
    same = np.array(draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    h2 = np.where(same, h2_pre, np.clip(h2_pre, F32(-1.5), F32(1.5)) + F32(0.25)).astype(F32)
    return parts, aux, h2, h2_pre


def _bits(x: np.ndarray) -> np.ndarray:
    """Bit patterns, with every NaN as one pattern (the sign and payload of a NaN are not part
    of the contract)."""
    return np.where(np.isnan(x), np.uint32(0x7FC00000), np.asarray(x, F32).view(np.uint32))


def _assert_same_bits(got, want) -> None:
    """Each field of the NamedTuple ``got`` bit for bit the same-position array of ``want``."""
    for name, expected in zip(got._fields, want):
        assert np.array_equal(_bits(getattr(got, name)), _bits(expected)), name


@settings(max_examples=60, deadline=None)
@given(_inputs())
def test_the_twin_is_the_six_launches_element_by_element(args):
    _assert_same_bits(ref_step.h2_grad_sum_aux_mask(*args), _oracle(*args))


def test_a_non_finite_auxiliary_value_never_reaches_the_trunk_gradient():
    parts = np.array([[1.0, 2.0, 3.0, 4.0]], F32)
    aux = np.array([[np.nan, np.inf, 5.0, -np.inf], [7.0, np.nan, -np.inf, 8.0]], F32)
    h2 = h2_pre = np.ones(4, F32)
    r = ref_step.h2_grad_sum_aux_mask(parts, aux, h2, h2_pre)
    # the first head's non-finite values count as 0; the second's are skipped
    assert r.dh2.tolist() == [1.0 + 7.0, 2.0 + 0.0, 3.0 + 5.0, 4.0 + 8.0]
    assert r.dh2_main.tolist() == [1.0, 2.0, 3.0, 4.0]
    one = ref_step.h2_grad_sum_aux_mask(parts, aux[:1], h2, h2_pre)  # one head: skipped
    assert one.dh2.tolist() == [1.0, 2.0, 8.0, 4.0]


def test_a_nan_part_reaches_both_sums_and_the_unmasked_output_only():
    parts = np.array([[np.nan, np.nan, 1.0]], F32)
    aux = np.zeros((1, 3), F32)
    h2_pre = np.array([1.0, -1.0, np.nan], F32)
    r = ref_step.h2_grad_sum_aux_mask(parts, aux, h2_pre.copy(), h2_pre)
    assert np.isnan(r.dh2_main[:2]).all() and np.isnan(r.dh2[:2]).all()
    assert np.isnan(r.out[0]) and r.out[1] == 0.0 and r.out[2] == 0.0  # masked: ReLU, NaN pre


@pytest.mark.parametrize("bad, message", [
    (lambda k: {**k, "aux": k["aux"].astype(np.float64)}, "aux"),
    (lambda k: {**k, "aux": np.concatenate([k["aux"]] * 3)}, r"aux: shape \(6, 2, 3\)"),
    (lambda k: {**k, "aux": k["aux"][:, :, :-1]}, r"aux: shape \(2, 2, 2\)"),
    (lambda k: {**k, "h2": k["h2"][:, :-1]}, "parts, h2, h2_pre: shapes"),
])
def test_bad_arguments_are_one_line_errors_naming_the_field(bad, message):
    rng = np.random.default_rng(0)
    ok = {"parts": rng.standard_normal((4, 2, 3)).astype(F32),
          "aux": rng.standard_normal((2, 2, 3)).astype(F32),
          "h2": np.zeros((2, 3), F32), "h2_pre": np.zeros((2, 3), F32)}
    with pytest.raises((ValueError, TypeError), match=message) as info:
        ref_step.h2_grad_sum_aux_mask(**bad(ok))
    assert "\n" not in str(info.value)


def _guard_oracle(x, m, h2, h2_pre):
    """``clamp_finite`` with bound ``m``, then ``h2_grad_sum_mask`` of the one part, element by
    element."""
    dh2, out = np.empty(x.size, F32), np.empty(x.size, F32)
    m = float(m)
    for i, v in enumerate(x.reshape(-1).tolist()):
        g = (m if v > m else (-m if v < -m else v)) if math.isfinite(v) else 0.0
        s = _add(0.0, g)
        h, pre = float(h2.reshape(-1)[i]), float(h2_pre.reshape(-1)[i])
        dh2[i], out[i] = s, 0.0 if pre <= 0.0 else (s if h == pre else 0.0)
    return dh2.reshape(x.shape), out.reshape(x.shape)


@st.composite
def _guard_inputs(draw, max_n: int = 9):
    parts, _, h2, h2_pre = draw(_inputs(max_n))
    m = draw(st.sampled_from([0.0, 0.5, 1.0, 3.4028235e38, math.inf]))
    return parts[0], F32(m), h2, h2_pre


@settings(max_examples=60, deadline=None)
@given(_guard_inputs())
def test_the_guard_twin_is_the_two_launches_element_by_element(args):
    _assert_same_bits(ref_step.h2_guard_mask(*args), _guard_oracle(*args))


def test_the_guard_clips_and_zeroes_what_is_not_finite():
    x = np.array([0.5, -3.0, 3.0, np.nan, -np.inf, -0.0], F32)
    r = ref_step.h2_guard_mask(x, F32(2.0), np.ones(6, F32), np.ones(6, F32))
    assert r.dh2.tolist() == [0.5, -2.0, 2.0, 0.0, 0.0, 0.0] and r.out.tolist() == r.dh2.tolist()
    assert not np.signbit(r.dh2[5])  # 0 + -0.0


@pytest.mark.parametrize("bad, message", [
    (lambda k: {**k, "x": k["x"].astype(np.float64)}, "x"),
    (lambda k: {**k, "m": F32(-1.0)}, "m"),
    (lambda k: {**k, "h2": k["h2"][:, :-1]}, r"x, h2, h2_pre: shapes \(2, 3\), \(2, 2\)"),
])
def test_bad_guard_arguments_are_one_line_errors_naming_the_field(bad, message):
    ok = {"x": np.zeros((2, 3), F32), "m": F32(1.0), "h2": np.zeros((2, 3), F32),
          "h2_pre": np.zeros((2, 3), F32)}
    with pytest.raises((ValueError, TypeError), match=message) as info:
        ref_step.h2_guard_mask(**bad(ok))
    assert "\n" not in str(info.value)


# -------------------------------------------------------------------------------- on a GPU


@gpu
@settings(max_examples=60, deadline=None)
@given(_inputs(max_n=70))
def test_the_kernel_is_the_twin_bit_for_bit(args):
    from foxhunt.fast.kernels import step as fast_step

    _assert_same_bits(fast_step.h2_grad_sum_aux_mask(*args), ref_step.h2_grad_sum_aux_mask(*args))


@gpu
@pytest.mark.parametrize("heads", [1, 2])
@pytest.mark.parametrize("n", [4096, 4099])  # the vector path, and the scalar one (n % 4, stride)
def test_the_kernel_is_the_twin_on_both_paths(heads, n):
    from foxhunt.fast.kernels import step as fast_step

    rng = np.random.default_rng(n + heads)
    parts = rng.standard_normal((4, n)).astype(F32)
    aux = rng.standard_normal((heads, n)).astype(F32)
    aux[0, ::7], aux[-1, 3::11] = np.nan, np.inf
    h2_pre = rng.standard_normal(n).astype(F32)
    h2 = np.clip(h2_pre, F32(-1.0), F32(1.0))
    _assert_same_bits(fast_step.h2_grad_sum_aux_mask(parts, aux, h2, h2_pre),
                      ref_step.h2_grad_sum_aux_mask(parts, aux, h2, h2_pre))


@gpu
@settings(max_examples=60, deadline=None)
@given(_guard_inputs(max_n=70))
def test_the_guard_kernel_is_the_twin_bit_for_bit(args):
    from foxhunt.fast.kernels import step as fast_step

    _assert_same_bits(fast_step.h2_guard_mask(*args), ref_step.h2_guard_mask(*args))
