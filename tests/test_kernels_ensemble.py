"""``reference.kernels.ensemble.ens_kl_grad`` against torch autograd (float64) and hand-built NaN
cases. (The CUDA twin runs against it in conformance, on a GPU.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from foxhunt.reference.kernels.ensemble import ENS_SOFTMAX_EPS, ens_kl_grad

F32 = np.float32
U = 2.0 ** -24


def _torch_diversity(v: np.ndarray, priors: np.ndarray):
    """``-(1/(B P)) sum_b sum_k KL(p_k || softmax(v))`` and its gradient w.r.t. ``v`` (the priors
    are constants), float64; also each sample's KL summed over the priors."""
    t = torch.from_numpy(v.astype(np.float64)).requires_grad_(True)
    logp0 = torch.log_softmax(t, dim=-1)
    logpk = torch.log_softmax(torch.from_numpy(priors.astype(np.float64)), dim=-1)
    terms = logpk.exp() * (logpk - logp0.unsqueeze(0))  # [P, B, NA]
    kl = terms.sum(dim=-1)  # [P, B]
    loss = -kl.sum() / (v.shape[0] * priors.shape[0])
    loss.backward()
    size = terms.detach().abs().sum(dim=(0, 2)).numpy()  # sum of |terms| per sample
    return loss.item(), t.grad.numpy(), kl.sum(dim=0).detach().numpy(), size


@pytest.mark.parametrize("n_priors", [1, 2, 4])
def test_ens_kl_grad_matches_autograd(n_priors):
    rng = np.random.default_rng(n_priors)
    v = (rng.standard_normal((32, 11)) * 2).astype(F32)
    priors = (rng.standard_normal((n_priors, 32, 11)) * 2).astype(F32)
    out = ens_kl_grad(v, priors, ENS_SOFTMAX_EPS)
    loss, grad, kl, size = _torch_diversity(v, priors)
    scale = 1.0 / (32 * n_priors)
    # d_v: P differences of probabilities (each a few ulp: exp, the row sum, a division) times
    # scale; kl: a float32 sum of 11 * P terms, each a few ulp of itself, so a few ulp of the
    # sum of their sizes; the loss sums those over the batch (measured: under 1/4 of each bound)
    np.testing.assert_allclose(out.d_v, grad, rtol=0, atol=16 * n_priors * U * scale)
    assert np.all(np.abs(out.kl - kl) <= 16 * U * size), np.abs(out.kl - kl) / (U * size)
    assert out.loss == pytest.approx(loss, abs=16 * U * scale * size.sum())
    assert out.loss < 0  # a diversity loss: minus a KL


def test_ens_gradient_pushes_head_zero_away_from_the_priors():
    """A small step against the gradient increases the KL from every prior."""
    rng = np.random.default_rng(7)
    v = rng.standard_normal((8, 5)).astype(F32)
    priors = rng.standard_normal((2, 8, 5)).astype(F32)
    out = ens_kl_grad(v, priors, ENS_SOFTMAX_EPS)
    stepped = ens_kl_grad((v - F32(0.5) * out.d_v / np.abs(out.d_v).max()).astype(F32), priors,
                          ENS_SOFTMAX_EPS)
    assert np.all(stepped.kl >= out.kl) and stepped.loss < out.loss


def test_ens_softmax_floor_never_binds_on_finite_rows():
    """A finite max-shifted row sums to at least 1: the eps floor changes no bit."""
    rng = np.random.default_rng(8)
    v = (rng.standard_normal((6, 7)) * 30).astype(F32)
    priors = (rng.standard_normal((2, 6, 7)) * 30).astype(F32)
    a, b = ens_kl_grad(v, priors, ENS_SOFTMAX_EPS), ens_kl_grad(v, priors, 0.5)
    assert all(np.asarray(x).tobytes() == np.asarray(y).tobytes() for x, y in zip(a, b))


def test_ens_nan_poisons_its_sample_only():
    v = np.zeros((3, 4), F32)
    priors = np.ones((2, 3, 4), F32) * np.arange(4, dtype=F32)
    priors[1, 1, 2] = np.nan  # sample 1 of the second prior
    v[2, 0] = np.inf  # sample 2 of head 0 (Inf - Inf in the shift)
    out = ens_kl_grad(v, priors, ENS_SOFTMAX_EPS)
    assert np.all(np.isfinite(out.d_v[0])) and np.isfinite(out.kl[0])
    assert np.all(np.isnan(out.d_v[1:])) and np.all(np.isnan(out.kl[1:]))
    assert np.isnan(out.loss)


def test_ens_minus_inf_logit_has_probability_zero():
    v = np.array([[0.0, -np.inf, 1.0]], F32)
    priors = np.array([[[0.0, 0.0, 0.0]]], F32)  # uniform prior: mass where p_0 = 0
    out = ens_kl_grad(v, priors, ENS_SOFTMAX_EPS)
    assert out.kl[0] == np.inf  # KL(p_1 || p_0) with p_0 = 0 where p_1 > 0
    assert np.all(np.isfinite(out.d_v)) and out.d_v[0, 1] == F32(1 / 3)


def test_ens_rejects_bad_arguments():
    v = np.zeros((3, 4), F32)
    with pytest.raises(ValueError, match="priors"):
        ens_kl_grad(v, np.zeros((2, 3, 5), F32), ENS_SOFTMAX_EPS)
    with pytest.raises(ValueError, match="priors"):
        ens_kl_grad(v, np.zeros((0, 3, 4), F32), ENS_SOFTMAX_EPS)
    with pytest.raises(ValueError, match="eps"):
        ens_kl_grad(v, np.zeros((1, 3, 4), F32), 0.0)
    with pytest.raises(ValueError, match="v"):
        ens_kl_grad(v.astype(np.float64), np.zeros((1, 3, 4), F32), ENS_SOFTMAX_EPS)
