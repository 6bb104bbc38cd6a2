"""Tests for foxhunt.reference.kernels.replay: sequential float32 prefix sums, the binary search
(against a linear scan), empirical frequencies vs priorities (chi-square, fixed seed), zero
priorities never sampled, and importance weights against the unsimplified float64 formula."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from foxhunt.reference.kernels import KERNELS, replay

U32 = 2.0 ** -24


def gamma(k: int) -> float:
    return k * U32 / (1 - k * U32)


@st.composite
def priorities(draw, min_size=1, max_size=60, specials=(0.0,)):
    """Non-negative float32 priorities with specials (zeros by default) at drawn positions."""
    n = draw(st.integers(min_size, max_size))
    p = draw(hnp.arrays(np.float32, n, elements=st.floats(2.0 ** -10, 1024.0, width=32)))
    positions = draw(st.lists(st.integers(0, n - 1), max_size=n, unique=True)) if n else []
    for pos in positions:
        p[pos] = draw(st.sampled_from(specials))
    return p


# --- prefix_sum ----------------------------------------------------------------------------


@given(p=priorities(min_size=0, max_size=200))
def test_prefix_sum_sequential_order_and_bound(p):
    out = replay.prefix_sum(p)
    assert out.dtype == np.float32 and out.shape == p.shape
    running = 0.0
    exact = 0.0
    for i, pi in enumerate(p.tolist()):
        # one float32 rounding per addition, left to right (a double sum of two float32 rounds
        # to float32 correctly: double rounding is innocuous for +)
        running = float(np.float32(running + pi))
        exact += pi
        assert out[i] == running
        assert abs(float(out[i]) - exact) <= gamma(i + 1) * exact


def test_prefix_sum_nan_and_inf_propagate_forward():
    out = replay.prefix_sum(np.array([1.0, 2.0, np.nan, 4.0, np.inf], np.float32))
    assert out[:2].tolist() == [1.0, 3.0]
    assert np.all(np.isnan(out[2:]))
    out = replay.prefix_sum(np.array([1.0, np.inf, 4.0], np.float32))
    assert out.tolist() == [1.0, math.inf, math.inf]


# --- sample_proportional -------------------------------------------------------------------


def scan_oracle(prefix: np.ndarray, u: float) -> int:
    target = float(np.float32(u * float(prefix[-1])))  # the float32 product
    for i, s in enumerate(prefix.tolist()):
        if s > target:
            return i
    return prefix.size - 1


@given(p=priorities(specials=(0.0, math.nan, math.inf)),
       u=hnp.arrays(np.float32, st.integers(0, 30),
                    elements=st.one_of(st.floats(0.0, 1.0, exclude_max=True, width=32),
                                       st.sampled_from([math.nan, 1.0, 2.0, -0.5, 1 - 2 ** -24]))))
def test_sample_proportional_is_first_prefix_above_target(p, u):
    prefix = replay.prefix_sum(p)
    idx = replay.sample_proportional(prefix, u)
    assert idx.dtype == np.int32 and idx.shape == u.shape
    for k, uk in enumerate(u.tolist()):
        assert idx[k] == scan_oracle(prefix, uk), (k, uk)


@given(p=priorities(specials=(0.0,)),
       u=hnp.arrays(np.float32, 40, elements=st.floats(0.0, 1.0, exclude_max=True, width=32)))
def test_zero_priority_never_sampled(p, u):
    prefix = replay.prefix_sum(p)
    idx = replay.sample_proportional(prefix, u)
    if prefix[-1] > 0:
        assert np.all(p[idx] > 0)
    else:  # all-zero buffer: defined degenerate result
        assert np.all(idx == p.size - 1)


def test_u_just_below_one_hits_last_nonzero_item():
    p = np.array([1.0, 2.0, 3.0, 0.0, 0.0], np.float32)
    u = np.array([1 - 2 ** -24, 0.0], np.float32)
    idx = replay.sample_proportional(replay.prefix_sum(p), u)
    assert idx.tolist() == [2, 0]


def test_empirical_frequencies_match_priorities():
    rng = np.random.default_rng(2024)
    p = rng.gamma(0.7, size=48).astype(np.float32)
    p[[3, 17, 40]] = 0.0
    n = 200_000
    idx = replay.sample_proportional(replay.prefix_sum(p), rng.random(n, dtype=np.float32))
    counts = np.bincount(idx, minlength=p.size)
    assert np.all(counts[p == 0] == 0)
    live = p > 0
    expected = n * p[live].astype(np.float64) / p.astype(np.float64).sum()
    chi2 = float(np.sum((counts[live] - expected) ** 2 / expected))
    df = int(live.sum()) - 1
    # chi2 has mean df and sd sqrt(2 df); 5 sd is a 1-in-10^6 false alarm (seed fixed anyway),
    # while a wrong mapping (e.g. off by one item) gives chi2 in the tens of thousands.
    assert chi2 < df + 5 * math.sqrt(2 * df)


def test_sample_proportional_rejects_bad_inputs():
    with pytest.raises(ValueError, match="prefix: shape"):
        replay.sample_proportional(np.zeros(0, np.float32), np.zeros(2, np.float32))
    with pytest.raises(ValueError, match="u: dtype float64"):
        replay.sample_proportional(np.ones(3, np.float32), np.zeros(2))


# --- importance_weights --------------------------------------------------------------------


def literal_weights(p: np.ndarray, idx: np.ndarray, beta: float, n_valid: int) -> np.ndarray:
    """w = (N P(i))^-beta / max_j w_j over the batch, float64, unsimplified."""
    p64 = p[:n_valid].astype(np.float64)
    prob = p64[idx] / p64.sum()
    w = (n_valid * prob) ** (-beta)
    return w / w.max()


@given(data=st.data(), beta=st.sampled_from([0.0, 0.4, 0.6, 1.0]))
def test_importance_weights_match_formula(data, beta):
    p = data.draw(priorities(specials=(1e-3,)))
    n_valid = data.draw(st.integers(1, p.size))
    idx = np.array(data.draw(st.lists(st.integers(0, n_valid - 1), min_size=1, max_size=32)),
                   np.int32)
    w = replay.importance_weights(p, idx, beta, n_valid)
    assert w.dtype == np.float32 and w.shape == idx.shape
    np.testing.assert_allclose(w, literal_weights(p, idx, float(np.float32(beta)), n_valid),
                               rtol=2e-6)
    assert np.all(w > 0) and np.all(w <= 1)
    assert w[np.argmin(p[idx])] == 1.0  # the batch maximum is exactly 1


def test_importance_weights_beta_zero_is_one_even_for_nan():
    p = np.array([1.0, np.nan, 3.0], np.float32)
    w = replay.importance_weights(p, np.array([0, 1, 2], np.int32), 0.0, 3)
    assert w.tolist() == [1.0, 1.0, 1.0]


def test_importance_weights_nan_priority_only_poisons_itself():
    p = np.array([1.0, np.nan, 4.0], np.float32)
    w = replay.importance_weights(p, np.array([0, 1, 2], np.int32), 0.5, 3)
    assert w[0] == 1.0 and math.isnan(w[1]) and w[2] == 0.5


def test_importance_weights_zero_priority_sample():
    # Only reachable when the whole buffer has total 0 (the sampler then returns N - 1).
    p = np.array([0.0, 2.0], np.float32)
    w = replay.importance_weights(p, np.array([0, 1], np.int32), 0.5, 2)
    assert math.isnan(w[0]) and w[1] == 0.0


def test_importance_weights_empty_batch():
    w = replay.importance_weights(np.ones(4, np.float32), np.zeros(0, np.int32), 0.5, 4)
    assert w.dtype == np.float32 and w.shape == (0,)


@pytest.mark.parametrize(
    ("idx", "beta", "n_valid", "match"),
    [([0, 3], 0.5, 3, "idx: values"), ([-1], 0.5, 3, "idx: values"), ([0], 1.5, 3, "beta="),
     ([0], math.nan, 3, "beta="), ([0], 0.5, 5, "n_valid="), ([0], 0.5, 0, "n_valid=")],
)
def test_importance_weights_rejects_bad_arguments(idx, beta, n_valid, match):
    with pytest.raises(ValueError, match=match):
        replay.importance_weights(np.ones(4, np.float32), np.array(idx, np.int32), beta, n_valid)


def test_importance_weights_rejects_int64_idx():
    with pytest.raises(ValueError, match="idx: dtype int64"):
        replay.importance_weights(np.ones(4, np.float32), np.zeros(2, np.int64), 0.5, 4)


def test_kernels_registered_under_their_names():
    for name, fn in replay.KERNELS.items():
        assert fn.__name__ == name and KERNELS[name] is fn
