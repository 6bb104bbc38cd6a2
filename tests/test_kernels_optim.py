"""Tests for foxhunt.reference.kernels.optim: finite-only gradient norms (one-shot vs two-phase),
budget clips, guarded SAXPYs, Adam (vs torch.optim.Adam / AdamW in float64), Polyak/hard sync.

Oracles: exact float64 / Python-float arithmetic, torch in float64, and the float32 contract
written out element by element; never the NumPy expressions under test."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from foxhunt.reference.kernels import KERNELS, optim

U32 = 2.0 ** -24
F32_MAX = float(np.finfo(np.float32).max)
#: Specials whose squares do not overflow float32 (overflow is tested separately).
SPECIALS = [math.nan, math.inf, -math.inf, 1e15, -1e15, 1e-45, -1e-40, 0.0, -0.0]
HUGE = [3.0e38, -F32_MAX, 1e20]
ADAM = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8)


@st.composite
def f32_with_specials(draw, specials=tuple(SPECIALS), max_size: int = 64, min_size: int = 0,
                      size: int | None = None) -> np.ndarray:
    """float32 vector with specials written at explicit drawn positions (hnp.arrays shares one
    fill value, so specials are injected by hand)."""
    n = size if size is not None else draw(st.integers(min_size, max_size))
    x = draw(hnp.arrays(np.float32, n, elements=st.floats(-1e3, 1e3, width=32)))
    if n:
        positions = draw(st.lists(st.integers(0, n - 1), max_size=min(n, 6), unique=True))
        for pos in positions:
            x[pos] = draw(st.sampled_from(specials))
    return x


def gamma(k: int) -> float:
    return k * U32 / (1 - k * U32)


def exact_finite_sq(x: np.ndarray) -> float:
    return math.fsum(float(e) ** 2 for e in x.ravel() if math.isfinite(float(e)))


def finite_norm64(x: np.ndarray) -> float:
    return math.sqrt(exact_finite_sq(x))


# --- gradient norms ------------------------------------------------------------------------


@given(x=f32_with_specials(max_size=300))
def test_grad_norm_sq_skips_nonfinite_within_rounding(x):
    out = optim.grad_norm_sq(x)
    assert isinstance(out, np.float32)
    exact = exact_finite_sq(x)
    # each square rounds (u) and the sum of n non-negative terms is within gamma_{n-1}.
    assert abs(float(out) - exact) <= gamma(x.size + 1) * exact + 1e-45


@given(x=f32_with_specials(max_size=400), block=st.sampled_from([1, 3, 32, 256, 1000]))
def test_two_phase_norm_matches_one_shot_within_bound(x, block):
    partials = optim.grad_norm_partial(x, block)
    assert partials.dtype == np.float32
    assert partials.shape == (math.ceil(x.size / block),)
    for k, part in enumerate(partials):
        chunk = x[k * block:(k + 1) * block]
        chunk_exact = exact_finite_sq(chunk)
        assert abs(float(part) - chunk_exact) <= gamma(chunk.size + 1) * chunk_exact + 1e-45
    one_shot = float(optim.grad_norm_sq(x))
    two_phase = float(optim.grad_norm_final(partials))
    exact = exact_finite_sq(x)
    assert abs(one_shot - two_phase) <= 2 * gamma(x.size + 1) * exact + 1e-45


def test_two_phase_differs_by_rounding_only():
    # A case where the orders really differ: the bound above, not equality, is the contract.
    x = np.random.default_rng(3).standard_normal(100_003).astype(np.float32) * 1e3
    exact = exact_finite_sq(x)
    one, two = optim.grad_norm_sq(x), optim.grad_norm_final(optim.grad_norm_partial(x, 256))
    assert abs(float(one) - float(two)) <= 2 * gamma(x.size) * exact


def test_norm_of_empty_is_zero():
    empty = np.zeros(0, np.float32)
    assert optim.grad_norm_sq(empty) == 0.0
    assert optim.grad_norm_partial(empty, 8).shape == (0,)
    assert optim.grad_norm_final(np.zeros(0, np.float32)) == 0.0


@pytest.mark.parametrize("huge", HUGE)
def test_overflowing_square_gives_inf_norm_and_zero_clip(huge):
    x = np.array([1.0, huge, np.nan, -2.0], np.float32)
    norm_sq = optim.grad_norm_sq(x)
    assert norm_sq == np.inf
    assert optim.grad_norm_final(optim.grad_norm_partial(x, 2)) == np.inf
    clipped = optim.clip_grad_inplace(x, 7.0, norm_sq)
    assert clipped[[0, 1, 3]].tolist() == [0.0, 0.0, 0.0]  # component discarded this step
    assert math.isnan(clipped[2])


@pytest.mark.parametrize("block", [0, -3, 2.0, True])
def test_grad_norm_partial_rejects_bad_block(block):
    with pytest.raises(ValueError, match="block_size="):
        optim.grad_norm_partial(np.ones(4, np.float32), block)


# --- clip scale and budget clip ------------------------------------------------------------


@pytest.mark.parametrize(
    ("norm_sq", "max_norm", "expected"),
    [(4.0, 3.0, 1.0), (9.0, 3.0, 1.0), (16.0, 2.0, 0.5), (0.0, 0.0, 1.0), (1.0, 0.0, 0.0),
     (math.nan, 1.0, 1.0), (-5.0, 1.0, 1.0), (math.inf, 1.0, 0.0), (-math.inf, 1.0, 1.0)],
)
def test_clip_scale_rule(norm_sq, max_norm, expected):
    assert optim.clip_scale(norm_sq, max_norm) == np.float32(expected)
    assert optim.safety_clip_scale(norm_sq, max_norm) == np.float32(expected)


@pytest.mark.parametrize("max_norm", [-1.0, math.nan, math.inf])
def test_clip_scale_rejects_bad_max_norm(max_norm):
    with pytest.raises(ValueError, match="max_norm="):
        optim.clip_grad_inplace(np.ones(3, np.float32), max_norm, 3.0)


@given(x=f32_with_specials(max_size=200), max_norm=st.sampled_from([0.0, 1e-3, 0.7, 7.0, 1e3]))
def test_clip_budget_property(x, max_norm):
    x_before = x.copy()
    out = optim.clip_grad_inplace(x, max_norm, optim.grad_norm_sq(x))
    assert np.array_equal(x, x_before, equal_nan=True)
    assert out.dtype == np.float32 and out.shape == x.shape
    mn = float(np.float32(max_norm))
    # squares below 2^-149 underflow: the computed norm misses at most sqrt(N * 2^-149)
    assert finite_norm64(out) <= mn * (1 + 1e-6) + math.sqrt(x.size * 2.0 ** -149)
    n = finite_norm64(x)
    if n <= mn * (1 - 1e-6):  # clearly inside the budget: untouched
        assert np.array_equal(out, x, equal_nan=True)
    elif n > mn * (1 + 1e-6) + math.sqrt(x.size * 2.0 ** -149):
        # clearly outside even after underflowed squares: rescaled onto the budget, direction kept
        for xi, oi in zip(x.tolist(), out.tolist()):
            if math.isfinite(xi):
                assert abs(oi - xi * mn / n) <= 1e-6 * abs(xi) * mn / n + 1e-45
            elif math.isnan(xi) or mn == 0.0:
                assert math.isnan(oi)
            else:
                assert oi == xi  # +-Inf times a positive finite scale


# --- SAXPY ---------------------------------------------------------------------------------


def saxpy_contract(y: float, x: float, a: float) -> float:
    """fl32(fl32(a*x) + y) from Python doubles (a*x of two float32 is exact in a double)."""
    return float(np.float32(float(np.float32(a * x)) + y))


@given(data=st.data(), a=st.sampled_from([1.0, -0.5, 0.1, 3.0, 0.0]))
def test_saxpy_skips_nonfinite_x(data, a):
    y = data.draw(f32_with_specials(max_size=48))
    x = data.draw(f32_with_specials(size=y.size))
    y_before, x_before = y.copy(), x.copy()
    out = optim.saxpy(y, x, a)
    assert np.array_equal(y, y_before, equal_nan=True)
    assert np.array_equal(x, x_before, equal_nan=True)
    assert out.dtype == np.float32
    for yi, xi, oi, y_bits, o_bits in zip(y.tolist(), x.tolist(), out.tolist(),
                                          y.view(np.uint32).tolist(), out.view(np.uint32).tolist()):
        if not math.isfinite(xi):
            assert o_bits == y_bits  # y kept bit for bit: a non-finite x never reaches y
        elif math.isnan(yi):
            assert math.isnan(oi)
        else:
            expected = saxpy_contract(yi, xi, float(np.float32(a)))
            assert oi == expected or (math.isnan(oi) and math.isnan(expected))


def test_saxpy_never_writes_nonfinite_from_nonfinite_x():
    y = np.array([1.0, -2.0, 0.0], np.float32)
    x = np.array([np.nan, np.inf, -np.inf], np.float32)
    assert optim.saxpy(y, x, 2.0).tolist() == [1.0, -2.0, 0.0]


@pytest.mark.parametrize("a", [math.nan, math.inf])
def test_saxpy_rejects_nonfinite_coefficient(a):
    with pytest.raises(ValueError, match="a="):
        optim.saxpy(np.zeros(2, np.float32), np.zeros(2, np.float32), a)


def test_saxpy_rejects_shape_mismatch():
    with pytest.raises(ValueError, match=r"x: shape \(3,\) differs from y shape \(2,\)"):
        optim.saxpy(np.zeros(2, np.float32), np.zeros(3, np.float32), 1.0)


@given(data=st.data(), a=st.sampled_from([1.0, 0.5, -2.0]),
       max_norm=st.sampled_from([0.0, 0.15, 1.5, 1e3]))
def test_clipped_saxpy_is_saxpy_of_clipped(data, a, max_norm):
    y = data.draw(f32_with_specials(max_size=64))
    x = data.draw(f32_with_specials(size=y.size))
    norm_sq = optim.grad_norm_sq(x)
    out = optim.clipped_saxpy(y, x, a, max_norm, norm_sq)
    composed = optim.saxpy(y, optim.clip_grad_inplace(x, max_norm, norm_sq), a)
    assert np.array_equal(out.view(np.uint32), composed.view(np.uint32))


@given(x=f32_with_specials(max_size=200), max_norm=st.sampled_from([0.15, 1.5, 7.0]))
def test_clipped_saxpy_budget(x, max_norm):
    # Into a zero buffer with a = 1 the injected increment is the clipped component itself.
    out = optim.clipped_saxpy(np.zeros_like(x), x, 1.0, max_norm, optim.grad_norm_sq(x))
    assert np.all(np.isfinite(out))
    assert finite_norm64(out) <= float(np.float32(max_norm)) * (1 + 1e-6)


# --- Adam ----------------------------------------------------------------------------------


def run_torch_adam(param, grads, *, lr, beta1, beta2, eps, weight_decay, decoupled):
    p = torch.tensor(param, dtype=torch.float64, requires_grad=True)
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    opt = cls([p], lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay)
    for g in grads:
        p.grad = torch.tensor(g, dtype=torch.float64)
        opt.step()
    st_ = opt.state[p]
    return p.detach().numpy(), st_["exp_avg"].numpy(), st_["exp_avg_sq"].numpy()


def run_ref_adam(param, grads, *, weight_decay, weight_clamp=math.inf, **hp):
    m = np.zeros_like(param)
    v = np.zeros_like(param)
    for t, g in enumerate(grads, start=1):
        param, m, v = optim.adam_update(param, g, m, v, step=t, weight_decay=weight_decay,
                                        grad_scale=1.0, weight_clamp=weight_clamp, **hp)
    return param, m, v


@pytest.mark.parametrize(("weight_decay", "decoupled"), [(0.0, False), (0.01, True)])
@pytest.mark.parametrize("size", [1, 257])
def test_adam_matches_torch_float64(weight_decay, decoupled, size):
    rng = np.random.default_rng(size)
    param = rng.standard_normal(size).astype(np.float32)
    scales = [1.0, 0.1, 3.0, 1e-3, 0.5, 2.0]
    grads = [(rng.standard_normal(size) * s).astype(np.float32) for s in scales]
    p_ref, m_ref, v_ref = run_ref_adam(param, grads, weight_decay=weight_decay, **ADAM)
    # torch gets the hyperparameters the kernel sees: rounded to float32 (1 - 0.999f is not
    # 0.001 to 1e-5, and must not count as kernel error).
    hp32 = {k: float(np.float32(val)) for k, val in ADAM.items()}
    p_t, m_t, v_t = run_torch_adam(param.astype(np.float64), [g.astype(np.float64) for g in grads],
                                   weight_decay=float(np.float32(weight_decay)),
                                   decoupled=decoupled, **hp32)
    steps = len(grads)
    # each step moves the parameter by at most ~lr; f32 error per step ~ a few ulp of |p|
    # plus a relative 1e-5 of the step (the bias-corrected ratio through sqrt and division).
    p_tol = steps * (4 * U32 * np.abs(p_t) + 1e-5 * ADAM["lr"])
    assert np.all(np.abs(p_ref - p_t) <= p_tol)
    np.testing.assert_allclose(m_ref, m_t, rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(v_ref, v_t, rtol=1e-5, atol=1e-12)
    assert p_ref.dtype == m_ref.dtype == v_ref.dtype == np.float32


def test_adam_first_step_moves_by_lr_times_sign():
    # t = 1 from zero moments: mhat = g, vhat = g^2, so the step is lr * g / (|g| + eps).
    param = np.array([0.5, -1.0, 2.0, 0.0], np.float32)
    grad = np.array([3.0, -0.25, 1e-3, 0.0], np.float32)
    out = optim.adam_update(param, grad, np.zeros(4, np.float32), np.zeros(4, np.float32),
                            step=1, weight_decay=0.0, grad_scale=1.0, weight_clamp=math.inf,
                            **ADAM)
    for p, g, o in zip(param.tolist(), grad.tolist(), out.param.tolist()):
        expected = p - ADAM["lr"] * g / (abs(g) + ADAM["eps"])
        assert abs(o - expected) <= 4 * U32 * max(abs(expected), ADAM["lr"])


@given(data=st.data(), grad_scale=st.sampled_from([1.0, 0.25, 0.0]),
       weight_clamp=st.sampled_from([0.5, 3.0, math.inf]), step=st.sampled_from([1, 2, 1000]))
def test_adam_never_writes_nonfinite_and_skips_nonfinite_grads(data, grad_scale, weight_clamp,
                                                                step):
    n = data.draw(st.integers(0, 40))
    param = data.draw(hnp.arrays(np.float32, n, elements=st.floats(-5, 5, width=32)))
    grad = data.draw(f32_with_specials(specials=tuple(SPECIALS + HUGE), size=n))
    m = data.draw(hnp.arrays(np.float32, n, elements=st.floats(-1e3, 1e3, width=32)))
    v = data.draw(hnp.arrays(np.float32, n, elements=st.floats(0, 1e6, width=32)))
    before = [a.copy() for a in (param, grad, m, v)]
    out = optim.adam_update(param, grad, m, v, step=step, weight_decay=0.01,
                            grad_scale=grad_scale, weight_clamp=weight_clamp, **ADAM)
    for a, b in zip((param, grad, m, v), before):
        assert np.array_equal(a, b, equal_nan=True)
    assert np.all(np.isfinite(out.param))
    wc = float(np.float32(weight_clamp))
    for i in range(n):
        g = float(np.float32(float(grad[i]) * float(np.float32(grad_scale))))
        if not math.isfinite(g):
            for new, old in ((out.param, param), (out.m, m), (out.v, v)):
                assert new[i:i + 1].view(np.uint32) == old[i:i + 1].view(np.uint32)
        else:
            assert abs(float(out.param[i])) <= wc  # Mech 9 on every updated element
            assert not math.isnan(out.m[i]) and out.v[i] >= 0


def test_adam_mech9_nonfinite_result_becomes_zero():
    # A non-finite input parameter with a finite gradient: the update's result is non-finite,
    # Mech 9's clamp_finite writes 0 instead.
    param = np.array([np.inf, np.nan, 100.0], np.float32)
    grad = np.array([1.0, 1.0, 1.0], np.float32)
    z = np.zeros(3, np.float32)
    out = optim.adam_update(param, grad, z, z, step=1, weight_decay=0.0, grad_scale=1.0,
                            weight_clamp=10.0, **ADAM)
    assert out.param.tolist() == [0.0, 0.0, 10.0]


def test_adam_grad_scale_is_a_prescale():
    rng = np.random.default_rng(7)
    param, grad, m = (rng.standard_normal(33).astype(np.float32) for _ in range(3))
    v = np.abs(rng.standard_normal(33)).astype(np.float32)
    kw = dict(step=5, weight_decay=0.0, weight_clamp=math.inf, **ADAM)
    scaled = optim.adam_update(param, grad, m, v, grad_scale=0.375, **kw)
    prescaled = optim.adam_update(param, grad * np.float32(0.375), m, v, grad_scale=1.0, **kw)
    for a, b in zip(scaled, prescaled):
        assert np.array_equal(a, b)
    # A NaN scale (never produced by safety_clip_scale) skips every element.
    skipped = optim.adam_update(param, grad, m, v, grad_scale=math.nan, **kw)
    assert np.array_equal(skipped.param, param) and np.array_equal(skipped.m, m)


@pytest.mark.parametrize(
    ("name", "value"),
    [("step", 0), ("step", -1), ("step", 1.0), ("step", True), ("lr", -1e-3), ("lr", math.nan),
     ("beta1", 1.0), ("beta2", -0.1), ("eps", 0.0), ("weight_decay", math.inf),
     ("weight_clamp", 0.0), ("weight_clamp", math.nan)],
)
def test_adam_rejects_bad_scalars(name, value):
    z = np.zeros(3, np.float32)
    kw = dict(step=1, weight_decay=0.0, grad_scale=1.0, weight_clamp=1.0, **ADAM)
    kw[name] = value
    with pytest.raises(ValueError, match=f"{name}="):
        optim.adam_update(z, z, z, z, **kw)


def test_adam_rejects_shape_and_dtype():
    z = np.zeros(3, np.float32)
    kw = dict(step=1, weight_decay=0.0, grad_scale=1.0, weight_clamp=1.0, **ADAM)
    with pytest.raises(ValueError, match="v: shape"):
        optim.adam_update(z, z, z, np.zeros(4, np.float32), **kw)
    with pytest.raises(ValueError, match="grad: dtype float64"):
        optim.adam_update(z, np.zeros(3), z, z, **kw)


# --- target network ------------------------------------------------------------------------


@given(data=st.data(), tau=st.sampled_from([0.005, 0.3, 0.5, 1.0 - 1e-6]))
def test_polyak_update_within_rounding(data, tau):
    n = data.draw(st.integers(0, 40))
    elems = st.floats(-1e3, 1e3, width=32)
    target = data.draw(hnp.arrays(np.float32, n, elements=elems))
    online = data.draw(hnp.arrays(np.float32, n, elements=elems))
    out = optim.polyak_update(target, online, tau)
    assert out.dtype == np.float32
    t32 = float(np.float32(tau))
    for t, o, r in zip(target.tolist(), online.tolist(), out.tolist()):
        exact = (1 - t32) * t + t32 * o
        # three roundings of terms bounded by |t| + |o|; in the subnormal range each rounding
        # errs by up to half the smallest subnormal (2^-150) instead of a relative amount
        assert abs(r - exact) <= 3 * U32 * (abs(t) + abs(o)) + 3 * 2.0 ** -150


def test_polyak_endpoints_and_nan():
    target = np.array([1.0, -2.0, 3.0], np.float32)
    online = np.array([4.0, np.nan, -6.0], np.float32)
    assert np.array_equal(optim.polyak_update(target, online, 0.0)[[0, 2]], target[[0, 2]])
    assert np.array_equal(optim.polyak_update(target, online, 1.0), online, equal_nan=True)
    assert math.isnan(optim.polyak_update(target, online, 0.005)[1])  # NaN propagates
    with pytest.raises(ValueError, match="tau="):
        optim.polyak_update(target, online, 1.5)


def test_hard_sync_copies_bits():
    target = np.zeros(3, np.float32)
    online = np.array([1.0, np.nan, -0.0], np.float32)
    out = optim.hard_sync(target, online)
    assert np.array_equal(out.view(np.uint32), online.view(np.uint32))
    assert not np.shares_memory(out, online) and target.tolist() == [0.0, 0.0, 0.0]
    assert "hard_sync" not in optim.KERNELS  # a device-to-device copy, not a kernel


def test_kernels_registered_under_their_names():
    for name, fn in optim.KERNELS.items():
        assert fn.__name__ == name and KERNELS[name] is fn
