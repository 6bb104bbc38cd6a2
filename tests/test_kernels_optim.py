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

from foxhunt.reference.kernels import KERNELS, dense, optim

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


# --- fused kernels: the budget tail and Polyak + BF16 mirrors ------------------------------


def clip_saxpy_contract(base: float, inject: float, s_base: float, a: float,
                        s_inject: float) -> float:
    """One element of the budget tail from Python doubles, each float32 rounding spelled out:
    c = fl(base * s_base); fl(c + fl(a * fl(inject * s_inject))) if inject is finite, else c."""
    def f(v: float) -> float:  # round a double (an exact f32 product) to float32
        return float(np.float32(v))

    c = f(base * s_base)
    if not math.isfinite(inject):
        return c
    return f(c + f(a * f(inject * s_inject)))


#: Specials of the partial arrays: NaN, +/-Inf and values whose sum overflows.
PARTIAL_SPECIALS = (math.nan, math.inf, -math.inf, F32_MAX, 3.0e38, -F32_MAX, 0.0, -0.0, 1e-45)


def norm_partials(data, x: np.ndarray, specials: bool):
    """Phase-1 partials of ``x``'s norm over a drawn segment size, with specials injected at
    drawn positions when ``specials`` (NaN, Inf, overflowing values: the phase-2 contract)."""
    segment = data.draw(st.sampled_from([1, 5, 64, 4096]))
    partials = optim.grad_norm_partial(x, segment)
    if specials and partials.size:
        positions = data.draw(st.lists(st.integers(0, partials.size - 1), min_size=1,
                                       max_size=min(partials.size, 4), unique=True))
        for pos in positions:
            partials[pos] = data.draw(st.sampled_from(PARTIAL_SPECIALS))
    return partials


def budget_tail_args(data, n_max: int = 300):
    base = data.draw(f32_with_specials(max_size=n_max))
    inject = data.draw(f32_with_specials(size=base.size))
    base_max = data.draw(st.sampled_from([0.0, 0.7, 7.0, 1e4]))
    inject_max = data.draw(st.sampled_from([0.0, 0.15, 1.5, 1e4]))
    a = data.draw(st.sampled_from([1.0, 0.5, -2.0]))
    block = data.draw(st.sampled_from([1, 3, 32, 256, 4096]))
    # the partials are data: usually the inputs' own, sometimes with NaN / Inf / huge values;
    # both arrays have one length (the kernel takes one count)
    base_partials = norm_partials(data, base, data.draw(st.booleans()))
    inject_partials = optim.grad_norm_partial(inject, max(1, -(-inject.size // max(
        base_partials.size, 1))))
    if inject_partials.size != base_partials.size:  # pad/trim to base's count: still data
        inject_partials = np.resize(inject_partials, base_partials.shape).astype(np.float32)
    if data.draw(st.booleans()) and inject_partials.size:
        pos = data.draw(st.integers(0, inject_partials.size - 1))
        inject_partials[pos] = data.draw(st.sampled_from(PARTIAL_SPECIALS))
    return {"base": base, "inject": inject, "base_max_norm": base_max,
            "base_partials": base_partials, "a": a, "inject_max_norm": inject_max,
            "inject_partials": inject_partials, "block_size": block}


def composition(kw) -> tuple:
    """The fused kernel's twin written as the separate reference launches of the step."""
    base_sq = optim.grad_norm_final(kw["base_partials"])
    inject_sq = optim.grad_norm_final(kw["inject_partials"])
    clipped = optim.clip_grad_inplace(kw["base"], kw["base_max_norm"], base_sq)
    out = optim.clipped_saxpy(clipped, kw["inject"], kw["a"], kw["inject_max_norm"], inject_sq)
    return out, optim.grad_norm_partial(out, kw["block_size"]), base_sq, inject_sq


def bits(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float32).view(np.uint32)


@given(data=st.data())
def test_clip_saxpy_norm_partial_is_the_composition_bitwise(data):
    kw = budget_tail_args(data)
    before = {k: v.copy() for k, v in kw.items() if isinstance(v, np.ndarray)}
    got = optim.clip_saxpy_norm_partial(**kw)
    for k, v in before.items():
        assert np.array_equal(kw[k].view(np.uint32), v.view(np.uint32))  # inputs untouched
    assert isinstance(got, optim.ClipSaxpyPartial)
    out, partials, base_sq, inject_sq = composition(kw)
    assert got.out.dtype == got.partials.dtype == np.float32
    assert isinstance(got.base_norm_sq, np.float32) and isinstance(got.inject_norm_sq, np.float32)
    assert np.array_equal(bits(got.out), bits(out))
    assert np.array_equal(bits(got.partials), bits(partials))
    assert bits(got.base_norm_sq) == bits(base_sq) and bits(got.inject_norm_sq) == bits(inject_sq)


@given(data=st.data())
def test_clip_saxpy_norm_partial_elementwise_contract(data):
    kw = budget_tail_args(data, n_max=120)
    got = optim.clip_saxpy_norm_partial(**kw)
    # the norms: plain sums of the partials (NaN if a NaN or both infinities, else +/-Inf if
    # any infinity or the exact sum is beyond float32, else within rounding of the exact sum)
    for name in ("base", "inject"):
        parts = [float(p) for p in kw[f"{name}_partials"]]
        norm = float(getattr(got, f"{name}_norm_sq"))
        if any(math.isnan(p) for p in parts) or {math.inf, -math.inf} <= set(parts):
            assert math.isnan(norm)
        elif math.inf in parts:
            assert norm == math.inf
        elif -math.inf in parts:
            assert norm == -math.inf
        elif not math.isfinite(norm):  # only an overflowing sum of huge partials
            assert max(abs(p) for p in parts) >= 1e38
        else:
            exact = math.fsum(parts)
            bound = gamma(len(parts) + 1) * math.fsum(abs(p) for p in parts)
            assert abs(norm - exact) <= bound
            assert norm != 0.0 or math.copysign(1.0, norm) > 0  # never -0.0
    s_base = float(optim.clip_scale(got.base_norm_sq, kw["base_max_norm"]))
    s_inject = float(optim.clip_scale(got.inject_norm_sq, kw["inject_max_norm"]))
    a = float(np.float32(kw["a"]))
    for b, y, o in zip(kw["base"].tolist(), kw["inject"].tolist(), got.out.tolist()):
        expected = clip_saxpy_contract(b, y, s_base, a, s_inject)
        assert o == expected or (math.isnan(o) and math.isnan(expected))
    bs = kw["block_size"]
    assert got.partials.shape == (math.ceil(kw["base"].size / bs),)
    assert not np.any(np.isnan(got.partials))  # partials skip non-finite out_i: never NaN
    for k, part in enumerate(got.partials.tolist()):
        chunk = got.out[k * bs:(k + 1) * bs]
        exact = exact_finite_sq(chunk)
        if math.isinf(part):  # only a finite square that overflowed
            assert any(math.isfinite(v) and v * v > F32_MAX for v in chunk.tolist())
        else:
            assert abs(part - exact) <= gamma(chunk.size + 1) * exact + 1e-45


@pytest.mark.parametrize(("partials", "scale"), [
    ([1.0, math.nan, 2.0], 1.0),           # NaN norm: scale 1 (fmaxf rule)
    ([1.0, math.inf, 2.0], 0.0),           # +Inf partial: +Inf norm, component discarded
    ([F32_MAX, F32_MAX], 0.0),             # finite partials whose sum overflows: +Inf
    ([math.inf, -math.inf], 1.0),          # Inf - Inf: NaN norm, scale 1
    ([-4.0, 1.0], 1.0),                    # a negative norm (not produced by phase 1): n = 0
])
def test_clip_saxpy_norm_partial_special_partials(partials, scale):
    base = np.array([3.0, -4.0, np.inf], np.float32)
    inject = np.array([2.0, np.nan, 1.0], np.float32)
    p = np.array(partials, np.float32)
    ok = np.array([4.0] * p.size, np.float32) / p.size  # inject norm 4: n = 2, scale 1 at 2.5
    got = optim.clip_saxpy_norm_partial(base, inject, 1.0, p, 1.0, 2.5, ok, 2)
    assert got.inject_norm_sq == 4.0
    with np.errstate(invalid="ignore"):
        expected_base = np.float32(scale) * base
    want = expected_base + np.array([2.0, 0.0, 1.0], np.float32)
    assert np.array_equal(got.out, want, equal_nan=True)
    assert got.partials.dtype == np.float32 and not np.any(np.isnan(got.partials))


def test_clip_saxpy_norm_partial_step_budgets():
    # The step's use: C51 base over 0.70 mgn, CQL inject over 0.15 mgn, a = 1: the clipped
    # components are on their budgets, so the total is within their sum (triangle inequality).
    rng = np.random.default_rng(11)
    base = rng.standard_normal(10_007).astype(np.float32)
    inject = (rng.standard_normal(10_007) * 3).astype(np.float32)
    mgn = 2.0
    got = optim.clip_saxpy_norm_partial(base, inject, 0.7 * mgn,
                                        optim.grad_norm_partial(base, 4096), 1.0, 0.15 * mgn,
                                        optim.grad_norm_partial(inject, 4096), 4096)
    assert got.partials.shape == (3,)
    assert float(got.base_norm_sq) == pytest.approx(exact_finite_sq(base), rel=1e-6)
    assert float(got.inject_norm_sq) == pytest.approx(exact_finite_sq(inject), rel=1e-6)
    total = math.sqrt(math.fsum(float(p) for p in got.partials))
    assert total <= 0.85 * mgn * (1 + 1e-5)
    assert total == pytest.approx(finite_norm64(got.out), rel=1e-5)


def test_clip_saxpy_norm_partial_skips_nonfinite_inject_and_keeps_base_nan():
    base = np.array([3.0, np.nan, 4.0, np.inf], np.float32)
    inject = np.array([np.nan, 1.0, np.inf, 1.0], np.float32)
    # base norm 5 (finite part: partials 9 + 16) clipped to 2.5: s_b = 0.5; inject unclipped
    parts = np.array([9.0, 16.0], np.float32)
    inject_parts = np.array([1.0, 1.0], np.float32)
    got = optim.clip_saxpy_norm_partial(base, inject, 2.5, parts, 1.0, 1e6, inject_parts, 2)
    assert got.base_norm_sq == 25.0 and got.inject_norm_sq == 2.0
    assert got.out[[0, 2]].tolist() == [1.5, 2.0]  # the clipped base alone
    assert math.isnan(got.out[1]) and got.out[3] == np.inf
    assert got.partials.tolist() == [2.25, 4.0]  # non-finite out skipped
    # A +Inf base norm discards the base (scale 0): Inf * 0 is NaN, finite values become 0.
    inf_parts = np.array([9.0, np.inf], np.float32)
    zero = optim.clip_saxpy_norm_partial(base, inject, 2.5, inf_parts, 1.0, 1e6, inject_parts, 4)
    assert zero.base_norm_sq == np.inf
    assert zero.out[0] == 0.0 and zero.out[2] == 0.0 and math.isnan(zero.out[3])


def test_clip_saxpy_norm_partial_empty():
    z = np.zeros(0, np.float32)
    got = optim.clip_saxpy_norm_partial(z, z, 1.0, z, 1.0, 1.0, z, 4096)
    assert got.out.shape == (0,) and got.partials.shape == (0,)
    assert bits(got.base_norm_sq) == bits(got.inject_norm_sq) == 0  # +0.0
    # empty partials with data: norms 0, no clip
    x = np.array([3.0, 4.0], np.float32)
    got = optim.clip_saxpy_norm_partial(x, x, 1.0, z, 1.0, 1.0, z, 1)
    assert got.out.tolist() == [6.0, 8.0] and got.partials.tolist() == [36.0, 64.0]


@pytest.mark.parametrize(
    ("name", "value"),
    [("base", np.zeros((2, 3), np.float32)), ("base", np.zeros(6)), ("base", [0.0] * 6),
     ("inject", np.zeros(5, np.float32)), ("inject", np.zeros(6)),
     ("base_max_norm", -1.0), ("base_max_norm", math.inf),
     ("base_partials", np.zeros(2)), ("base_partials", np.zeros((1, 2), np.float32)),
     ("base_partials", 6.0), ("a", math.nan), ("inject_max_norm", math.nan),
     ("inject_partials", None), ("inject_partials", np.zeros(3, np.float32)),
     ("inject_partials", np.zeros(2, np.float16)),
     ("block_size", 0), ("block_size", 2.0), ("block_size", True)],
)
def test_clip_saxpy_norm_partial_rejects_bad_input(name, value):
    kw = {"base": np.ones(6, np.float32), "inject": np.ones(6, np.float32), "base_max_norm": 1.0,
          "base_partials": np.full(2, 3.0, np.float32), "a": 1.0, "inject_max_norm": 1.0,
          "inject_partials": np.full(2, 3.0, np.float32), "block_size": 4}
    kw[name] = value
    with pytest.raises(ValueError, match=rf"^{name}[:=]"):
        optim.clip_saxpy_norm_partial(**kw)


def bf16_contract(v: float) -> int:
    """BF16 RNE of a float32 on its bit pattern, from Python ints (NaN: quiet, sign and high
    payload kept): the f32_to_bf16 formula written independently."""
    u = int(np.array([v], np.float32).view(np.uint32)[0])
    if (u & 0x7FFFFFFF) > 0x7F800000:
        return (u >> 16) | 0x0040
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF


@given(data=st.data(), tau=st.sampled_from([0.0, 0.005, 0.5, 1.0]))
def test_polyak_update_mirror_is_the_composition_bitwise(data, tau):
    specials = tuple(SPECIALS + HUGE + [3.3895314e38])  # rounds to +Inf in BF16
    target = data.draw(f32_with_specials(specials=specials, max_size=100))
    online = data.draw(f32_with_specials(specials=specials, size=target.size))
    before = (target.copy(), online.copy())
    got = optim.polyak_update_mirror(target, online, tau)
    assert np.array_equal(target.view(np.uint32), before[0].view(np.uint32))
    assert np.array_equal(online.view(np.uint32), before[1].view(np.uint32))
    assert isinstance(got, optim.PolyakMirror)
    new_target = optim.polyak_update(target, online, tau)
    assert got.target.dtype == np.float32
    assert got.online_bf16.dtype == got.target_bf16.dtype == np.uint16
    assert np.array_equal(got.target.view(np.uint32), new_target.view(np.uint32))
    assert np.array_equal(got.online_bf16, dense.f32_to_bf16(online))
    assert np.array_equal(got.target_bf16, dense.f32_to_bf16(new_target))
    # and the mirrors against the bit formula written out, element by element
    assert got.online_bf16.tolist() == [bf16_contract(v) for v in online.tolist()]
    assert got.target_bf16.tolist() == [bf16_contract(v) for v in got.target.tolist()]


def test_polyak_update_mirror_mirrors_the_new_target():
    target = np.array([1.0, -2.0, 0.0], np.float32)
    online = np.array([3.0, np.nan, -np.inf], np.float32)
    got = optim.polyak_update_mirror(target, online, 0.5)
    assert got.target[0] == 2.0 and math.isnan(got.target[1]) and got.target[2] == -np.inf
    widened = dense.bf16_to_f32(got.target_bf16)
    assert widened[0] == 2.0 and math.isnan(widened[1]) and widened[2] == -np.inf
    assert dense.bf16_to_f32(got.online_bf16)[0] == 3.0  # the online value, not the blend


@pytest.mark.parametrize(
    ("name", "value"),
    [("target", np.zeros(4)), ("online", np.zeros(3, np.float32)), ("online", np.zeros(4)),
     ("tau", 1.5), ("tau", -0.1), ("tau", math.nan)],
)
def test_polyak_update_mirror_rejects_bad_input(name, value):
    kw = {"target": np.zeros(4, np.float32), "online": np.ones(4, np.float32), "tau": 0.005}
    kw[name] = value
    with pytest.raises(ValueError, match=rf"^{name}[:=]"):
        optim.polyak_update_mirror(**kw)


def _check_flags_by_hand(online, new_target, entries, flags, thresholds) -> list[int]:
    """The post-Polyak flags written out independently: an entry fires on a non-finite element
    or, with a positive threshold, on an element of magnitude at least the threshold."""
    out = [int(f) for f in flags]
    for k, entry in enumerate(entries):
        if entry is None:
            continue
        source, offset, count = entry
        values = (online if source == "online" else new_target)[offset:offset + count].tolist()
        thr = float(thresholds[k])
        if any(not math.isfinite(x) or (thr > 0 and abs(x) >= thr) for x in values):
            out[k] = 1
    return out


@st.composite
def polyak_check_entries(draw, n: int):
    """A table of post-Polyak entries over buffers of ``n`` elements, with None, empty, online
    and target entries, flags already set and thresholds that are positive, zero, negative,
    NaN and infinite."""
    k = draw(st.integers(1, 6))
    entries = []
    for _ in range(k):
        if draw(st.booleans()) and n:
            offset = draw(st.integers(0, n - 1))
            count = draw(st.integers(0, n - offset))
            entries.append((draw(st.sampled_from(optim.POLYAK_CHECK_SOURCES)), offset, count))
        else:
            entries.append(None)
    flags = np.array(draw(st.lists(st.sampled_from([0, 0, 1]), min_size=k, max_size=k)), np.int32)
    thresholds = np.array(draw(st.lists(st.sampled_from([0.0, -1.0, 0.05, 1.0, 1e16, math.nan,
                                                          math.inf]), min_size=k, max_size=k)),
                          np.float32)
    return entries, flags, thresholds


@given(data=st.data(), tau=st.sampled_from([0.0, 0.005, 0.5, 1.0]))
def test_polyak_update_mirror_check_is_the_composition_bitwise(data, tau):
    # The fused kernel's twin: polyak_update_mirror, then nan_check_fused of the entries (online
    # as given, the target as updated), and the flags against the rule written out by hand.
    specials = tuple(SPECIALS + HUGE)
    target = data.draw(f32_with_specials(specials=specials, max_size=60))
    online = data.draw(f32_with_specials(specials=specials, size=target.size))
    entries, flags, thresholds = data.draw(polyak_check_entries(target.size))
    before = (target.copy(), online.copy(), flags.copy())
    got = optim.polyak_update_mirror_check(target, online, tau, entries, flags, thresholds)
    for x, y in zip((target, online, flags), before):
        assert x.tobytes() == y.tobytes()  # inputs untouched
    plain = optim.polyak_update_mirror(target, online, tau)
    assert isinstance(got, optim.PolyakMirrorCheck)
    assert np.array_equal(got.target.view(np.uint32), plain.target.view(np.uint32))
    assert np.array_equal(got.online_bf16, plain.online_bf16)
    assert np.array_equal(got.target_bf16, plain.target_bf16)
    assert got.flags.dtype == np.int32
    assert got.flags.tolist() == _check_flags_by_hand(online, plain.target, entries, flags,
                                                      thresholds)


def test_polyak_update_mirror_check_sees_the_new_target():
    # The target entry tests the blended values: an old target over the threshold that the
    # blend replaces (tau = 1) does not fire, the same kept (tau = 0) does; the online entry
    # tests online as given; a None entry keeps its flag.
    target = np.array([5.0, 0.5], np.float32)
    online = np.array([0.0, 0.5], np.float32)
    entries = [("target", 0, 2), None, ("online", 0, 1)]
    thresholds = np.array([1.0, 1.0, 1.0], np.float32)
    flags = np.array([0, 1, 0], np.int32)
    replaced = optim.polyak_update_mirror_check(target, online, 1.0, entries, flags, thresholds)
    assert replaced.target.tolist() == [0.0, 0.5] and replaced.flags.tolist() == [0, 1, 0]
    kept = optim.polyak_update_mirror_check(target, online, 0.0, entries[:2] + [None], flags,
                                            thresholds)
    assert kept.target.tolist() == [5.0, 0.5] and kept.flags.tolist() == [1, 1, 0]
    low = np.array([0.5, 0.5], np.float32)
    assert optim.polyak_update_mirror_check(low, np.zeros(2, np.float32), 1.0, entries, flags * 0,
                                            thresholds).flags.tolist() == [0, 0, 0]


@pytest.mark.parametrize(("entries", "match"), [
    ([("params", 0, 1)], r"^entries\[0\]: source 'params'"),
    ([("online", 3, 2)], r"^entries\[0\]: offset 3, count 2"),
    ([("online", -1, 1)], r"^entries\[0\]: offset -1"),
    ([("online", 0)], r"^entries\[0\]: "),
    ([("online", 0, 1)] * 33, r"^entries: 33 active entries"),
])
def test_polyak_update_mirror_check_rejects_bad_entries(entries, match):
    x = np.zeros(4, np.float32)
    k = len(entries)
    with pytest.raises(ValueError, match=match):
        optim.polyak_update_mirror_check(x, x, 0.5, entries, np.zeros(k, np.int32),
                                         np.zeros(k, np.float32))


def test_polyak_check_max_is_the_kernels():
    from foxhunt.fast._build import source_files

    text = source_files()["optim.cu"].decode()
    assert f"#define POLYAK_CHECK_MAX {optim.POLYAK_CHECK_MAX}\n" in text


def _step_scalars_scale(partials, bound) -> np.float32:
    """``step_scalars``' ``safety_scale`` for these partials and bound (the other inputs do not
    reach it)."""
    from foxhunt.reference.kernels import step as rstep

    isv = np.zeros(64, np.float32)
    return rstep.step_scalars(partials, np.float32(1), np.float32(1), bound, isv,
                              np.zeros(len(rstep.READBACK_INDEX), np.float32), 1.0, 1.0, 0,
                              0.1).safety_scale


@given(data=st.data(),
       bound=st.sampled_from([0.0, 0.5, 3.0, 1e30, math.inf, math.nan, -1.0]))
def test_adam_update_norm_is_adam_at_step_scalars_safety_scale_bitwise(data, bound):
    # The fused kernel's twin: Adam at the safety scale step_scalars computes from the same
    # partials and bound (NaN and +Inf partials, a NaN, infinite, zero or negative bound).
    partials = np.abs(data.draw(f32_with_specials(specials=(math.nan, math.inf, 0.0, 1e30),
                                                  max_size=80)))
    n = data.draw(st.integers(1, 40))
    grad = data.draw(f32_with_specials(size=n))
    rng = np.random.default_rng(n)
    param, m = (rng.standard_normal((2, n)) * 0.1).astype(np.float32)
    v = rng.uniform(0, 1e-3, n).astype(np.float32)
    kw = dict(step=4, weight_decay=0.01, weight_clamp=10.0, **ADAM)
    got = optim.adam_update_norm(param, grad, m, v, partials, np.float32(bound), **kw)
    want = optim.adam_update(param, grad, m, v, grad_scale=_step_scalars_scale(partials, bound),
                             **kw)
    for g, w in zip(got, want):
        assert np.array_equal(g.view(np.uint32), w.view(np.uint32))


@pytest.mark.parametrize(("name", "value", "match"), [
    ("total_partials", np.zeros((2, 3), np.float32), r"^total_partials"),
    ("total_partials", np.zeros(3, np.float64), r"^total_partials"),
    ("clip_bound", "x", r"^clip_bound"),
    ("step", 0, r"^step"),
])
def test_adam_update_norm_rejects_bad_input(name, value, match):
    x = np.zeros(4, np.float32)
    kw = dict(param=x, grad=x, m=x, v=x, total_partials=np.ones(3, np.float32),
              clip_bound=np.float32(1), step=1, weight_decay=0.0, weight_clamp=1.0, **ADAM)
    kw[name] = value
    with pytest.raises((ValueError, TypeError), match=match):
        optim.adam_update_norm(**kw)


# --- the fused CUDA sources: NVRTC builds (CPU) and fused == unfused launches (GPU) --------


FUSED = ("clip_saxpy_norm_partial", "polyak_update_mirror", "adam_update_norm",
         "polyak_update_mirror_check")
#: PTX parameter types the launchers pack: pointers u64, n / block_size s64, scalars f32.
FUSED_PARAMS = {
    "clip_saxpy_norm_partial": ("u64", "u64", "s64", "f32", "u64", "f32", "f32", "u64", "s64",
                                "s64", "s64", "u64", "u64", "u64", "u64"),
    "polyak_update_mirror": ("u64", "u64", "s64", "f32", "u64", "u64"),
    "polyak_update_mirror_check": ("u64", "u64", "s64", "f32", "u64", "u64", "u64", "u64", "u64",
                                   "u64", "u32"),
    "adam_update_norm": ("u64", "u64", "u64", "u64", "s64", "u64", "f32", "f32", "f32", "f32",
                         "f32", "u64", "s64", "s64", "u64", "u64"),
}


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_fused_optim_kernels_compile_with_nvrtc(arch, tmp_path):
    pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-bindings is not installed")
    from foxhunt.fast._build import HEADER_SUFFIXES, compile_sources, source_files

    files = source_files()
    sources = {n: b for n, b in files.items() if n == "optim.cu" or n.endswith(HEADER_SUFFIXES)}
    module = compile_sources(arch, "ptx", cache_root=tmp_path, sources=sources)
    assert module.logs["optim.cu"] == ""
    for name in FUSED:
        assert module.kernels[name] == "optim.cu"
        types = tuple(p.ptx_type for p in module.params[name])
        # PTX spells long long as .u64 or .s64 depending on the NVRTC version (int: .u32)
        assert len(types) == len(FUSED_PARAMS[name])
        for got, want in zip(types, FUSED_PARAMS[name]):
            assert got == want or {got, want} <= {"u64", "s64"}, (name, types)


def _gpu_or_skip():
    from foxhunt.fast.device import cuda_available

    ok, reason = cuda_available()
    if not ok:
        pytest.skip(f"no CUDA device/driver: {reason}")


def _with_specials(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    x = x.copy()
    pos = rng.choice(x.size, size=min(x.size, 24), replace=False)
    x[pos] = np.array([np.nan, np.inf, -np.inf, -0.0, 1e-45, 0.0] * 4, np.float32)[:pos.size]
    return x


@pytest.mark.gpu
@pytest.mark.parametrize(("n", "block_size", "segment"),
                         [(289_611, 4096, 4096), (257 * 259, 256, 256), (515, 256, 7),
                          (1001, 3, 3), (1000, 6, 1), (0, 4096, 4096)])
@pytest.mark.parametrize("specials", [False, True])
def test_gpu_fused_budget_tail_equals_unfused_launches_bitwise(n, block_size, segment, specials):
    # The step's claim: replacing grad_norm_final x 2 -> clip_grad_inplace -> clipped_saxpy ->
    # grad_norm_partial by the fused launch changes no bit. The norms' partials come from
    # `segment`-element segments: 71 (the step: a 96-thread final tree inside 256-thread
    # blocks), 74, 334 and 1000 partials (final trees of 96 to 1024 threads replayed by
    # 32-thread blocks); odd block sizes take the unaligned element path.
    _gpu_or_skip()
    from foxhunt.fast.kernels import optim as fast

    rng = np.random.default_rng(n)
    base = (rng.standard_normal(n) * 0.1).astype(np.float32)
    inject = (rng.standard_normal(n) * 0.3).astype(np.float32)
    if specials and n:
        base, inject = _with_specials(base, rng), _with_specials(inject, rng)
    base_parts = fast.grad_norm_partial(base, segment)
    inject_parts = fast.grad_norm_partial(inject, segment)
    base_sq, inject_sq = fast.grad_norm_final(base_parts), fast.grad_norm_final(inject_parts)
    base_max, inject_max = 0.7 * math.sqrt(base_sq), 0.15 * math.sqrt(inject_sq)
    got = fast.clip_saxpy_norm_partial(base, inject, base_max, base_parts, 1.0, inject_max,
                                       inject_parts, block_size)
    clipped = fast.clip_grad_inplace(base, base_max, base_sq)
    out = fast.clipped_saxpy(clipped, inject, 1.0, inject_max, inject_sq)
    partials = fast.grad_norm_partial(out, block_size)
    assert bits(got.base_norm_sq) == bits(base_sq)
    assert bits(got.inject_norm_sq) == bits(inject_sq)
    assert np.array_equal(got.out.view(np.uint32), out.view(np.uint32))
    assert np.array_equal(got.partials.view(np.uint32), partials.view(np.uint32))


@pytest.mark.gpu
@pytest.mark.parametrize("count", [0, 1, 3, 71, 200, 1500, 5000])
def test_gpu_fused_budget_tail_norms_equal_grad_norm_final_bitwise(count):
    # Partials with specials and mixed magnitudes (order-sensitive sums), any count: the fused
    # norms are grad_norm_final's launch bits, whatever the fused block size.
    _gpu_or_skip()
    from foxhunt.fast.kernels import optim as fast

    rng = np.random.default_rng(count)
    parts = (rng.uniform(0, 1, count) * 10.0 ** rng.integers(-8, 8, count)).astype(np.float32)
    spiked = parts.copy()
    if count >= 3:
        spiked[[0, count // 2, count - 1]] = [F32_MAX, 1e-45, F32_MAX / 2]
    x = np.ones(700, np.float32)
    for base_parts, inject_parts in ((parts, spiked), (spiked, parts)):
        for block_size in (3, 256, 4096):
            got = fast.clip_saxpy_norm_partial(x, x, 1.0, base_parts, 1.0, 1.0, inject_parts,
                                               block_size)
            assert bits(got.base_norm_sq) == bits(fast.grad_norm_final(base_parts))
            assert bits(got.inject_norm_sq) == bits(fast.grad_norm_final(inject_parts))


@pytest.mark.gpu
@pytest.mark.parametrize("n", [289_611, 515])
def test_gpu_fused_polyak_mirror_equals_unfused_launches_bitwise(n):
    _gpu_or_skip()
    from foxhunt.fast.kernels import dense as fast_dense
    from foxhunt.fast.kernels import optim as fast

    rng = np.random.default_rng(n)
    target = _with_specials((rng.standard_normal(n) * 0.1).astype(np.float32), rng)
    online = _with_specials((rng.standard_normal(n) * 0.1).astype(np.float32), rng)
    got = fast.polyak_update_mirror(target, online, 0.005)
    new_target = fast.polyak_update(target, online, 0.005)
    assert np.array_equal(got.target.view(np.uint32), new_target.view(np.uint32))
    assert np.array_equal(got.online_bf16, fast_dense.f32_to_bf16(online))
    assert np.array_equal(got.target_bf16, fast_dense.f32_to_bf16(new_target))


@pytest.mark.gpu
@pytest.mark.parametrize("n", [289_728, 515, 3])
def test_gpu_polyak_update_mirror_check_equals_polyak_then_nan_check_bitwise(n):
    # The step's claim: graph 2's Polyak with the post-Polyak check in its pass writes what
    # polyak_update_mirror then nan_check_fused write, flags included (the step's entries:
    # all of online, all of target, two thresholded ranges of online; plus a None entry, and
    # each entry clean and poisoned).
    _gpu_or_skip()
    from foxhunt.fast.kernels import optim as fast
    from foxhunt.fast.kernels import safety as fast_safety

    rng = np.random.default_rng(n)
    clean_t = (rng.standard_normal(n) * 0.1).astype(np.float32)
    clean_o = (rng.standard_normal(n) * 0.1).astype(np.float32)
    split = n // 3
    entries = [("online", 0, n), None, ("target", 0, n), ("online", 0, split),
               ("online", split, n - split)]
    thresholds = np.array([0.0, 0.0, 0.0, 0.3, 100.0], np.float32)
    for poison in range(4):
        target, online = clean_t.copy(), clean_o.copy()
        if poison == 1:
            online[n - 1] = np.nan  # online's entries (0 and 4) fire
        if poison == 2:
            target[n // 2] = np.inf  # the new target's entry fires
        if poison == 3:
            target[0] = 3.0e38  # finite, but the blend of a big target
            online[0] = 3.0e38
        for flags in (np.zeros(5, np.int32), np.array([0, 1, 0, 0, 1], np.int32)):
            got = fast.polyak_update_mirror_check(target, online, 0.005, entries, flags,
                                                  thresholds)
            plain = fast.polyak_update_mirror(target, online, 0.005)
            sources = {"online": online, "target": plain.target}
            buffers = [None if e is None else sources[e[0]][e[1]:e[1] + e[2]] for e in entries]
            want = fast_safety.nan_check_fused(buffers, flags, thresholds)
            assert np.array_equal(got.target.view(np.uint32), plain.target.view(np.uint32))
            assert np.array_equal(got.online_bf16, plain.online_bf16)
            assert np.array_equal(got.target_bf16, plain.target_bf16)
            assert got.flags.tolist() == want.tolist(), (poison, flags)
            ref = optim.polyak_update_mirror_check(target, online, 0.005, entries, flags,
                                                   thresholds)
            assert got.flags.tolist() == ref.flags.tolist()


@pytest.mark.gpu
@pytest.mark.parametrize("count", [0, 1, 3, 71, 200, 1500])
def test_gpu_adam_update_norm_equals_step_scalars_then_adam_bitwise(count):
    # The step's claim: graph 2's Adam computes step_scalars' safety_scale itself, bit for bit
    # (partials of mixed magnitudes, so the summation order shows; with the clip acting, not
    # acting, and a NaN bound), so the step's parameters do not change.
    _gpu_or_skip()
    from foxhunt.fast.kernels import optim as fast
    from foxhunt.fast.kernels import step as fast_step
    from foxhunt.reference.kernels.step import READBACK_INDEX

    rng = np.random.default_rng(count)
    parts = (rng.uniform(0, 1, count) * 10.0 ** rng.integers(-6, 6, count)).astype(np.float32)
    n = 289_611
    param = (rng.standard_normal(n) * 0.1).astype(np.float32)
    grad = _with_specials((rng.standard_normal(n) * 0.01).astype(np.float32), rng)
    m = (rng.standard_normal(n) * 1e-3).astype(np.float32)
    v = rng.uniform(0, 1e-4, n).astype(np.float32)
    total = float(np.sum(parts, dtype=np.float64))
    kw = dict(step=7, weight_decay=0.01, weight_clamp=10.0, **ADAM)
    for bound in (0.5 * math.sqrt(total), 2.0 * math.sqrt(total) + 1.0, math.nan):
        scalars = fast_step.step_scalars(parts, np.float32(1), np.float32(1), np.float32(bound),
                                         np.zeros(64, np.float32),
                                         np.zeros(len(READBACK_INDEX), np.float32), 1.0, 1.0, 0,
                                         0.1)
        want = fast.adam_update(param, grad, m, v, grad_scale=scalars.safety_scale, **kw)
        got = fast.adam_update_norm(param, grad, m, v, parts, np.float32(bound), **kw)
        for g, w in zip(got, want):
            assert np.array_equal(g.view(np.uint32), w.view(np.uint32)), (count, bound)
