"""Tests for foxhunt.reference.kernels.spectral: one power iteration against
torch.nn.utils.parametrizations.spectral_norm (float64, same u and v), the bound after enough
iterations against numpy's SVD, unit vectors, and batched == individual bit for bit."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from foxhunt.reference.kernels import KERNELS, spectral

#: Weight shapes [out, in]: the tiny preset's matrices, odd tails, degenerate 1 x n.
SHAPES = [(32, 16), (32, 32), (16, 32), (11, 16), (33, 16), (22, 16), (1, 7), (7, 1), (257, 259)]


def random_case(shape, seed, scale=1.0):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal(shape) * scale / math.sqrt(shape[1])).astype(np.float32)
    u, v = spectral.init_spectral_vectors(shape, seed + 1000)
    return w, u, v


def torch_power_iteration(w, u, v):
    """One training-mode forward of torch's spectral_norm parametrization, float64, with its
    _u/_v buffers set to (u, v). Returns (u, v, sigma, normalised weight W / sigma)."""
    out_dim, in_dim = w.shape
    lin = torch.nn.Linear(in_dim, out_dim, bias=False, dtype=torch.float64)
    with torch.no_grad():
        lin.weight.copy_(torch.from_numpy(w.astype(np.float64)))
    torch.nn.utils.parametrizations.spectral_norm(lin, n_power_iterations=1, eps=1e-12)
    param = lin.parametrizations.weight[0]
    with torch.no_grad():
        param._u.copy_(torch.from_numpy(u.astype(np.float64)))
        param._v.copy_(torch.from_numpy(v.astype(np.float64)))
    lin.train()
    w_normed = lin.weight.detach().numpy().copy()  # runs the power iteration
    original = lin.parametrizations.weight.original.detach().numpy()
    k = np.unravel_index(np.argmax(np.abs(original)), original.shape)
    sigma = original[k] / w_normed[k]  # torch returns W / sigma
    return param._u.numpy().copy(), param._v.numpy().copy(), sigma, w_normed


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("sigma_max", [0.25, 1e3])
def test_one_iteration_matches_torch(shape, sigma_max):
    w, u, v = random_case(shape, seed=shape[0] * 1000 + shape[1])
    before = [a.copy() for a in (w, u, v)]
    out = spectral.spectral_norm(w, u, v, sigma_max)
    for a, b in zip((w, u, v), before):
        assert np.array_equal(a, b)
    assert out.w.dtype == out.u.dtype == out.v.dtype == np.float32
    assert isinstance(out.sigma, np.float32)
    u_t, v_t, sigma_t, w_normed = torch_power_iteration(w, u, v)
    np.testing.assert_allclose(out.u, u_t, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out.v, v_t, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out.sigma, sigma_t, rtol=1e-5)
    if sigma_t > sigma_max:  # rescaled: W * sigma_max / sigma == torch's W / sigma * sigma_max
        np.testing.assert_allclose(out.w, w_normed * sigma_max, rtol=2e-5, atol=1e-7)
    else:
        assert np.array_equal(out.w, w)


def test_converges_onto_the_bound_known_spectrum():
    rng = np.random.default_rng(5)
    left, _ = np.linalg.qr(rng.standard_normal((40, 40)))
    right, _ = np.linalg.qr(rng.standard_normal((24, 24)))
    singular = np.array([12.0, 6.0, 3.0] + [1.0] * 21)
    w = (left[:, :24] * singular) @ right.T
    w = w.astype(np.float32)
    u, v = spectral.init_spectral_vectors(w.shape, 9)
    for _ in range(40):
        w, u, v, sigma = spectral.spectral_norm(w, u, v, 3.0)
    top = np.linalg.svd(w.astype(np.float64), compute_uv=False)[0]
    assert top <= 3.0 * (1 + 1e-3)
    assert top >= 3.0 * (1 - 1e-3)  # and not needlessly below it
    assert abs(float(sigma) - top) <= 1e-3 * top
    for vec in (u, v):
        assert abs(np.linalg.norm(vec.astype(np.float64)) - 1.0) <= 1e-6


@pytest.mark.parametrize("shape", [(32, 16), (64, 48), (11, 32)])
def test_random_matrix_bounded_after_enough_iterations(shape):
    w, u, v = random_case(shape, seed=17, scale=10.0)
    for _ in range(300):
        w, u, v, _sigma = spectral.spectral_norm(w, u, v, 3.0)
    top = np.linalg.svd(w.astype(np.float64), compute_uv=False)[0]
    assert top <= 3.0 * (1 + 1e-3)
    for vec in (u, v):
        assert abs(np.linalg.norm(vec.astype(np.float64)) - 1.0) <= 1e-6


def test_zero_matrix_no_nan_no_rescale():
    w = np.zeros((5, 3), np.float32)
    u, v = spectral.init_spectral_vectors(w.shape, 0)
    out = spectral.spectral_norm(w, u, v, 3.0)
    assert out.sigma == 0.0
    assert np.array_equal(out.u, np.zeros(5, np.float32))
    assert np.array_equal(out.v, np.zeros(3, np.float32))
    assert np.array_equal(out.w, w)


def test_nan_weight_left_unchanged():
    w, u, v = random_case((6, 4), seed=2, scale=100.0)
    w[2, 1] = np.nan
    out = spectral.spectral_norm(w, u, v, 0.1)
    assert math.isnan(out.sigma)
    assert np.array_equal(out.w, w, equal_nan=True)
    # W v has a NaN entry; its norm is NaN and the fmaxf floor turns it into 1e-12, so u is
    # NaN there (and huge elsewhere); every entry of W^T u then meets the NaN.
    assert math.isnan(out.u[2]) and np.all(np.isnan(out.v))


def test_batched_is_bitwise_individual():
    cases = [random_case(shape, seed=i, scale=[0.5, 5.0][i % 2]) for i, shape in enumerate(SHAPES)]
    ws, us, vs = (list(c) for c in zip(*cases))
    batched = spectral.batched_spectral_norm(ws, us, vs, 3.0)
    assert [len(part) for part in batched] == [len(SHAPES)] * 4
    rescaled = 0
    for k, (w, u, v) in enumerate(cases):
        single = spectral.spectral_norm(w, u, v, 3.0)
        for a, b in zip((batched.ws[k], batched.us[k], batched.vs[k]),
                        (single.w, single.u, single.v)):
            assert a.dtype == b.dtype and a.shape == b.shape
            assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
        assert batched.sigmas[k].view(np.uint32) == single.sigma.view(np.uint32)
        rescaled += not np.array_equal(single.w, w)
    assert 0 < rescaled < len(SHAPES)  # both branches exercised


def test_init_vectors_deterministic_unit():
    u1, v1 = spectral.init_spectral_vectors((10, 7), 3)
    u2, v2 = spectral.init_spectral_vectors((10, 7), 3)
    u3, _ = spectral.init_spectral_vectors((10, 7), 4)
    assert u1.dtype == v1.dtype == np.float32 and u1.shape == (10,) and v1.shape == (7,)
    assert np.array_equal(u1, u2) and np.array_equal(v1, v2)
    assert not np.array_equal(u1, u3)
    for vec in (u1, v1):
        assert abs(np.linalg.norm(vec.astype(np.float64)) - 1.0) <= 1e-6


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((np.zeros((3, 2), np.float32), np.zeros(2, np.float32), np.zeros(2, np.float32), 1.0),
         "u shape"),
        ((np.zeros((3, 2)), np.zeros(3, np.float32), np.zeros(2, np.float32), 1.0),
         "w: dtype float64"),
        ((np.zeros((0, 2), np.float32), np.zeros(0, np.float32), np.zeros(2, np.float32), 1.0),
         "empty"),
        ((np.zeros(3, np.float32), np.zeros(3, np.float32), np.zeros(1, np.float32), 1.0),
         "w: shape"),
        ((np.zeros((3, 2), np.float32), np.zeros(3, np.float32), np.zeros(2, np.float32), 0.0),
         "sigma_max="),
        ((np.zeros((3, 2), np.float32), np.zeros(3, np.float32), np.zeros(2, np.float32),
          math.nan), "sigma_max="),
    ],
)
def test_spectral_norm_rejects_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        spectral.spectral_norm(*args)


def test_batched_rejects_bad_lists():
    w, u, v = random_case((4, 3), seed=0)
    with pytest.raises(ValueError, match="len"):
        spectral.batched_spectral_norm([w, w], [u], [v, v], 1.0)
    with pytest.raises(ValueError, match="len"):
        spectral.batched_spectral_norm([], [], [], 1.0)
    with pytest.raises(ValueError, match=r"us\[1\]"):
        spectral.batched_spectral_norm([w, w], [u, v], [v, v], 1.0)


@pytest.mark.parametrize(("shape", "seed"), [((3,), 0), ((0, 2), 0), ((2, 2), -1), ([2, 2], 0)])
def test_init_rejects_bad_arguments(shape, seed):
    with pytest.raises(ValueError):
        spectral.init_spectral_vectors(shape, seed)


def test_kernels_registered_under_their_names():
    for name, fn in spectral.KERNELS.items():
        assert fn.__name__ == name and KERNELS[name] is fn
