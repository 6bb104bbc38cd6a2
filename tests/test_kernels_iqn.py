"""The IQN head's reference kernels (``reference/kernels/iqn.py``) against independent
computations: the generator's draws, float64 cosines, explicit loops, and torch autograd
(float64) for the quantile Huber loss and its gradient. NaN contracts are checked by planting
non-finite values. (The CUDA twins are compared with these by the conformance suite on a GPU;
NVRTC compiles them in ``tests/test_fast_build.py``.)
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from foxhunt.conformance.tolerance import ulp_distance
from foxhunt.reference.kernels import dense, iqn, rng
from foxhunt.reference.kernels.fused import branch_offsets

F32 = np.float32
I32 = np.int32
BRANCHES = (3, 3, 2)


def _gen(seed=0):
    return np.random.default_rng(seed)


# ----------------------------------------------------------------------------- iqn_tau_cos
def test_tau_are_the_generators_draws_at_the_step_offset():
    out = iqn.iqn_tau_cos(np.array([41], np.int64), 7, 0, rng.STREAMS["iqn_tau_online"], 10, 4)
    assert np.array_equal(out.tau, rng.uniform(7, 1, 41, np.arange(10)))
    other_step = iqn.iqn_tau_cos(np.array([42], np.int64), 7, 0, 1, 10, 4).tau
    other_stream = iqn.iqn_tau_cos(np.array([41], np.int64), 7, 0, 2, 10, 4).tau
    assert not np.any(other_step == out.tau) and not np.any(other_stream == out.tau)


def test_cosines_are_the_rounded_float64_cosines():
    step = np.array([2**33 + 5], np.int64)
    out = iqn.iqn_tau_cos(step, 0xFFFFFFFF, 3, 2, 40, 64)
    assert out.cosines.shape == (40, 64) and out.cosines.dtype == F32
    want = np.array([[math.cos(math.pi * (k * float(t))) for k in range(64)] for t in out.tau], F32)
    # libm's cos and NumPy's float64 cos differ by a few float64 ulp at most: the float32
    # roundings agree but where a value sits that close to a rounding midpoint (one ulp then).
    assert ulp_distance(out.cosines, want).max() <= 1
    assert np.mean(out.cosines == want) > 0.999
    assert np.all(out.cosines[:, 0] == 1)


@pytest.mark.parametrize("kwargs, field", [
    (dict(step=np.array([-1], np.int64)), "step"),
    (dict(step=np.array([1, 2], np.int64)), "step"),
    (dict(step=np.array([1], np.int32)), "step"),
    (dict(key_lo=2**32), "key_lo"),
    (dict(stream=-1), "stream"),
    (dict(rows=0), "rows"),
    (dict(n_cos=0), "n_cos"),
])
def test_tau_cos_rejects_bad_arguments(kwargs, field):
    args = dict(step=np.array([0], np.int64), key_lo=0, key_hi=0, stream=1, rows=4, n_cos=8) | kwargs
    with pytest.raises(ValueError, match=field):
        iqn.iqn_tau_cos(**args)


# ---------------------------------------------------------------------------- iqn_modulate
def test_modulate_multiplies_each_quantile_row_by_its_samples_h2():
    gen = _gen(1)
    h2 = gen.standard_normal((3, 5)).astype(F32)
    phi = gen.standard_normal((6, 5)).astype(F32)
    out = iqn.iqn_modulate(h2, phi, 2, with_bf16=True)
    for m in range(6):
        for h in range(5):
            assert out.e[m, h] == F32(h2[m // 2, h] * phi[m, h])
    assert np.array_equal(out.e_bf16, dense.f32_to_bf16(out.e))
    assert iqn.iqn_modulate(h2, phi, 2).e_bf16.shape == (0,)


def test_modulate_propagates_nan_and_inf_times_zero():
    h2 = np.array([[np.inf, 1.0]], F32)
    phi = np.array([[0.0, np.nan]], F32)
    e = iqn.iqn_modulate(h2, phi, 1).e
    assert np.isnan(e).all()


def test_modulate_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="phi"):
        iqn.iqn_modulate(np.zeros((3, 5), F32), np.zeros((5, 5), F32), 2)
    with pytest.raises(ValueError, match="n_quantiles"):
        iqn.iqn_modulate(np.zeros((3, 5), F32), np.zeros((6, 5), F32), 0)


# ------------------------------------------------------------------- iqn_modulate_backward
def test_modulate_backward_is_the_product_rules_gradient():
    """Against torch autograd of ``sum(de * (h2[rep] * relu(phi_pre)))`` in float64."""
    gen = _gen(2)
    b, n, h = 4, 3, 7
    h2 = gen.standard_normal((b, h)).astype(F32)
    phi_pre = gen.standard_normal((b * n, h)).astype(F32)
    phi = np.maximum(phi_pre, 0).astype(F32)
    de = gen.standard_normal((b * n, h)).astype(F32)
    t_h2 = torch.tensor(h2, dtype=torch.float64, requires_grad=True)
    t_pre = torch.tensor(phi_pre, dtype=torch.float64, requires_grad=True)
    e = t_h2.repeat_interleave(n, dim=0) * torch.relu(t_pre)
    (e * torch.tensor(de, dtype=torch.float64)).sum().backward()
    got = iqn.iqn_modulate_backward(de, h2, phi, n)
    # d_h2 sums n products rounded to f32: error below (n + 1) f32 roundings of sum |terms|.
    bound = (n + 1) * 2.0**-24 * np.abs(de * phi).reshape(b, n, h).sum(axis=1)
    assert np.all(np.abs(got.d_h2 - t_h2.grad.numpy()) <= bound)
    # d_phi_pre is one product: correctly rounded.
    assert np.array_equal(got.d_phi_pre, t_pre.grad.numpy().astype(F32))


def test_modulate_backward_skips_non_finite_terms_of_d_h2():
    gen = _gen(3)
    b, n, h = 2, 4, 3
    h2 = gen.standard_normal((b, h)).astype(F32)
    phi = np.abs(gen.standard_normal((b * n, h))).astype(F32) + F32(0.5)
    de = gen.standard_normal((b * n, h)).astype(F32)
    de[1, 0], de[6, 2] = np.nan, np.inf
    got = iqn.iqn_modulate_backward(de, h2, phi, n)
    assert np.all(np.isfinite(got.d_h2))
    terms = (de * phi).reshape(b, n, h)
    # sample 0 unit 0 sums the three finite terms in order (i = 0, 2, 3), from +0.0
    want = F32(F32(F32(F32(0) + terms[0, 0, 0]) + terms[0, 2, 0]) + terms[0, 3, 0])
    assert got.d_h2[0, 0] == want
    assert np.isnan(got.d_phi_pre[1, 0]) and np.isposinf(got.d_phi_pre[6, 2]) == (h2[1, 2] > 0)


def test_modulate_backward_masks_where_phi_is_not_positive():
    de = np.full((2, 2), np.nan, F32)
    phi = np.array([[0.0, -0.0], [1.0, np.nan]], F32)
    h2 = np.ones((1, 2), F32)
    got = iqn.iqn_modulate_backward(de, h2, phi, 2)
    assert np.array_equal(got.d_phi_pre[0], [0.0, 0.0]) and np.isnan(got.d_phi_pre[1]).all()


# ---------------------------------------------------------------------- iqn_quantile_huber
def _huber_case(seed=4, b=6, n=5, scale=3.0):
    gen = _gen(seed)
    a = sum(BRANCHES)
    isv = np.zeros(4, F32)
    isv[2] = F32(1.7)
    return dict(
        q=(gen.standard_normal((b * n, a)) * scale).astype(F32),
        q_target=(gen.standard_normal((b * n, a)) * scale).astype(F32),
        tau=gen.uniform(0, 1, b * n).astype(F32),
        actions=np.stack([gen.integers(0, k, b) for k in BRANCHES]).astype(I32),
        a_star=np.stack([gen.integers(0, k, b) for k in BRANCHES]).astype(I32),
        r=gen.standard_normal(b).astype(F32), done=np.array([0, 1, 0, 0, 1, 0][:b], F32),
        gamma=np.array([0.99, 0.95, 0.9], F32), isw=gen.uniform(0.3, 1.4, b).astype(F32),
        isv=isv, q_abs_ref_index=2, k1=F32(2.0), branches=BRANCHES, n_quantiles=n)


def _torch_quantile_huber(c):
    """The contract's loss in float64 torch, from the clipped targets; returns (loss, dq, y)."""
    b, n = c["r"].shape[0], c["n_quantiles"]
    nb = len(BRANCHES)
    bound = float(c["k1"]) * max(float(c["isv"][c["q_abs_ref_index"]]), 1.0)
    q = torch.tensor(c["q"], dtype=torch.float64, requires_grad=True)
    qt = torch.tensor(c["q_target"], dtype=torch.float64)
    tau = torch.tensor(c["tau"], dtype=torch.float64).reshape(b, n)
    r, done, isw = (torch.tensor(c[k], dtype=torch.float64) for k in ("r", "done", "isw"))
    loss = torch.zeros((), dtype=torch.float64)
    ys = []
    rows = torch.arange(b)
    for d, off in enumerate(branch_offsets(BRANCHES)):
        sel = qt.reshape(b, n, -1)[rows, :, off + torch.from_numpy(c["a_star"][d]).long()]
        y = torch.clamp(r[:, None] + float(c["gamma"][d]) * (1 - done[:, None]) * sel, -bound, bound)
        ys.append(y)
        taken = q.reshape(b, n, -1)[rows, :, off + torch.from_numpy(c["actions"][d]).long()]
        u = y[:, None, :] - taken[:, :, None]                               # [B, i, j]
        w = torch.abs(tau[:, :, None] - (u < 0).double()).detach()
        huber = torch.where(u.abs() <= 1, 0.5 * u * u, u.abs() - 0.5)
        per_sample = (w * huber).sum(dim=(1, 2)) / n
        loss = loss + (isw * per_sample).sum() / b / nb
    loss.backward()
    return loss.item(), q.grad.numpy(), torch.stack(ys).numpy()


def test_quantile_huber_matches_torch_autograd():
    c = _huber_case()
    got = iqn.iqn_quantile_huber(**c)
    loss64, dq64, y64 = _torch_quantile_huber(c)
    # y: r + discount * q' has three f32 roundings of terms below 1 + 1 * |q'|.
    assert np.allclose(got.y, y64, rtol=0, atol=4 * 2.0**-24 * (1 + np.abs(c["q_target"]).max()))
    # loss: 2 N^2 B D f32 operations on non-negative terms; each rounding is relative 2^-24.
    assert abs(float(got.loss) - loss64) <= 2 * 25 * 6 * 3 * 2.0**-24 * abs(loss64) + 1e-12
    # dq: N-term sums of |w clip(u)| <= 1, times isw / (B D N); a few roundings each.
    assert np.all(np.abs(got.dq - dq64) <= 8 * 5 * 2.0**-24 * np.abs(c["isw"]).max() / (6 * 3 * 5))
    assert np.count_nonzero(got.dq) == np.count_nonzero(dq64) > 0


def test_quantile_huber_clips_targets_at_the_isv_bound():
    c = _huber_case(scale=50.0)
    got = iqn.iqn_quantile_huber(**c)
    bound = F32(2.0) * F32(1.7)
    assert np.all(np.abs(got.y) <= bound) and np.any(np.abs(got.y) == bound)
    c_nan = dict(c, isv=np.full(4, np.nan, F32))  # NaN signal: the floor gives the bare k1
    assert np.abs(iqn.iqn_quantile_huber(**c_nan).y).max() == F32(2.0)


def test_quantile_huber_propagates_a_nan_target_to_that_sample_only():
    c = _huber_case()
    n, d, b = 5, 1, 2
    col = branch_offsets(BRANCHES)[d] + c["a_star"][d, b]
    c["q_target"][b * n + 3, col] = np.nan
    got = iqn.iqn_quantile_huber(**c)
    assert np.isnan(got.loss)
    assert np.isnan(got.y[d, b, 3]) and np.isfinite(np.delete(got.y.ravel(), (d * 6 + b) * n + 3)).all()
    taken = branch_offsets(BRANCHES)[d] + c["actions"][d, b]
    nan_at = np.argwhere(np.isnan(got.dq))
    assert sorted(map(tuple, nan_at)) == [(b * n + i, taken) for i in range(n)]


def test_quantile_huber_with_a_single_quantile_is_the_huber_regression():
    """N = 1, tau = 1/2: rho = huber(u) / 2, the loss is the isw-weighted mean over samples and
    branches of that (a closed form to check the normalisation by hand)."""
    c = _huber_case(b=4, n=1)
    c["tau"] = np.full(4, 0.5, F32)
    got = iqn.iqn_quantile_huber(**c)
    rows = np.arange(4)
    total = 0.0
    for d, off in enumerate(branch_offsets(BRANCHES)):
        u = got.y[d, :, 0].astype(np.float64) - c["q"][rows, off + c["actions"][d]]
        hub = np.where(np.abs(u) <= 1, 0.5 * u * u, np.abs(u) - 0.5)
        total += np.sum(c["isw"] * 0.5 * hub) / 4 / 3
    assert abs(float(got.loss) - total) <= 1e-6 * total


@pytest.mark.parametrize("change, field", [
    (lambda c: dict(c, q=c["q"].astype(np.float64)), "q"),
    (lambda c: dict(c, tau=c["tau"][:-1]), "tau"),
    (lambda c: dict(c, actions=c["actions"] + 5), "actions"),
    (lambda c: dict(c, a_star=c["a_star"][:, :-1]), "a_star"),
    (lambda c: dict(c, gamma=c["gamma"][:2]), "gamma"),
    (lambda c: dict(c, q_abs_ref_index=4), "q_abs_ref_index"),
    (lambda c: dict(c, branches=(3, 3)), "q"),
    (lambda c: dict(c, k1="2"), "k1"),
])
def test_quantile_huber_rejects_bad_arguments(change, field):
    with pytest.raises(ValueError, match=field):
        iqn.iqn_quantile_huber(**change(_huber_case()))
