"""Tests for foxhunt.reference.kernels.distributional: dueling combination, log-softmax, expected
Q, double-DQN selection, the dense C51 projection, the C51 loss/gradient and the CQL gradient.

Oracles: torch (CPU) autograd on float64-promoted inputs (the loss is computed from the logits
with log_softmax; autograd gives dlogits), a classic floor/ceil C51 projection written here in
float64, and golden cases from google/dopamine's project_distribution tests.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from foxhunt.reference.kernels import distributional as dist

F32_EPS = 2.0**-24

# (B, A, NA, v_min, v_max): the tiny preset's branches (3, 2) with 11 atoms, and the seed shape.
SHAPES = {
    "tiny-A3": (4, 3, 11, -10.0, 10.0),
    "tiny-A2": (4, 2, 11, -10.0, 10.0),
    "seed": (256, 3, 51, -10.0, 10.0),
}
shape_ids = pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))


def make_case(shape: str, seed: int = 0):
    """Random float32 inputs of one branch: logits, actions, a target distribution m (rows sum
    to 1 in float64 as closely as float32 allows), non-uniform isw, and the support."""
    batch, actions_n, atoms, v_min, v_max = SHAPES[shape]
    rng = np.random.default_rng(seed + 17 * batch + actions_n)
    logits = (2.0 * rng.standard_normal((batch, actions_n, atoms))).astype(np.float32)
    actions = rng.integers(0, actions_n, batch).astype(np.int32)
    m64 = rng.dirichlet(np.full(atoms, 0.5), batch)
    m = m64.astype(np.float32)
    isw = rng.uniform(0.2, 1.8, batch).astype(np.float32)
    z = dist.support(v_min, v_max, atoms)
    return logits, actions, m, isw, z


def t64(x: np.ndarray, grad: bool = False) -> torch.Tensor:
    t = torch.from_numpy(np.asarray(x)).double()
    return t.requires_grad_() if grad else t


def assert_close(actual, expected, *, rtol, atol, what):
    """float32 result vs float64 oracle; rtol and atol always given together."""
    assert actual.dtype == np.float32, f"{what}: dtype {actual.dtype}"
    np.testing.assert_allclose(actual.astype(np.float64), expected, rtol=rtol, atol=atol,
                               err_msg=what)


def equal_with_nan(a, b) -> bool:
    return np.array_equal(a, b, equal_nan=True)


# ---------------------------------------------------------------------------------------------
# support
# ---------------------------------------------------------------------------------------------


def test_support_values_dtype_and_errors():
    z = dist.support(-10.0, 10.0, 51)
    assert z.dtype == np.float32 and z.shape == (51,)
    assert z[0] == -10.0 and abs(float(z[-1]) - 10.0) <= 1e-5
    np.testing.assert_allclose(z, np.linspace(-10.0, 10.0, 51), rtol=0, atol=2e-6)
    assert np.array_equal(dist.support(-5, 5, 11), np.arange(-5, 6, dtype=np.float32))
    for bad in [(1.0, 1.0, 5), (2.0, 1.0, 5), (-np.inf, 1.0, 5), (0.0, np.nan, 5)]:
        with pytest.raises(ValueError, match=r"^v_min, v_max:"):
            dist.support(*bad)
    for atoms in (1, 0, 2.5, True):
        with pytest.raises(ValueError, match=r"^num_atoms:"):
            dist.support(-1.0, 1.0, atoms)


# ---------------------------------------------------------------------------------------------
# Dueling combination and its backward
# ---------------------------------------------------------------------------------------------


@shape_ids
def test_dueling_combine_and_backward_vs_torch_autograd(shape):
    batch, actions_n, atoms, _, _ = SHAPES[shape]
    rng = np.random.default_rng(3)
    v = rng.standard_normal((batch, atoms)).astype(np.float32)
    adv = rng.standard_normal((batch, actions_n, atoms)).astype(np.float32)
    dlogits = rng.standard_normal((batch, actions_n, atoms)).astype(np.float32)
    v_t, adv_t = t64(v, grad=True), t64(adv, grad=True)
    logits_t = v_t[:, None, :] + adv_t - adv_t.mean(dim=1, keepdim=True)
    logits_t.backward(t64(dlogits))

    logits = dist.dueling_combine(v, adv)
    # Three roundings on values of magnitude ~|v| + 2 max|adv|.
    scale = np.abs(v)[:, None, :] + 2 * np.abs(adv).max(axis=1, keepdims=True)
    assert_close(logits, logits_t.detach().numpy(), rtol=0, atol=4 * F32_EPS * scale.max(),
                 what="logits")
    dv, dadv = dist.dueling_combine_backward(dlogits)
    g = np.abs(dlogits).max()
    assert_close(dv, v_t.grad.numpy(), rtol=0, atol=actions_n * F32_EPS * actions_n * g,
                 what="dv")
    assert_close(dadv, adv_t.grad.numpy(), rtol=0, atol=(actions_n + 2) * F32_EPS * 2 * g,
                 what="dadv")
    assert dv.shape == (batch, atoms) and dadv.shape == dlogits.shape


def test_dueling_nan_contract():
    v = np.zeros((2, 3), np.float32)
    adv = np.ones((2, 2, 3), np.float32)
    adv[0, 1, 2] = np.nan
    v[1, 0] = np.nan
    logits = dist.dueling_combine(v, adv)
    nan = np.isnan(logits)
    assert nan[0, :, 2].all() and nan[1, :, 0].all() and nan.sum() == 4
    dlogits = np.ones((2, 2, 3), np.float32)
    dlogits[1, 0, 1] = np.nan
    dv, dadv = dist.dueling_combine_backward(dlogits)
    assert np.isnan(dv).sum() == 1 and np.isnan(dv[1, 1])
    assert np.isnan(dadv).sum() == 2 and np.isnan(dadv[1, :, 1]).all()


# ---------------------------------------------------------------------------------------------
# log-softmax and expected Q
# ---------------------------------------------------------------------------------------------


@shape_ids
def test_log_softmax_and_expected_q_vs_torch(shape):
    logits, _, _, _, z = make_case(shape)
    logp = dist.log_softmax_atoms(logits)
    ref = torch.log_softmax(t64(logits), dim=-1).numpy()
    # max-subtraction and log of a sum >= 1: absolute error a few ulp of |logp| ~ 10-20.
    assert_close(logp, ref, rtol=0, atol=8 * F32_EPS * np.abs(ref).max(), what="logp")
    q = dist.expected_q(logp, z)
    q_ref = (np.exp(ref) * z.astype(np.float64)).sum(-1)
    assert q.shape == logits.shape[:2]
    assert_close(q, q_ref, rtol=0, atol=1e-5 * np.abs(z).max(), what="q")
    assert np.all(logp <= 0)


@st.composite
def rows_with_specials(draw):
    rows = draw(st.integers(1, 5))
    atoms = draw(st.integers(1, 9))
    x = draw(hnp.arrays(np.float32, (rows, atoms), elements=st.floats(-30, 30, width=32))).copy()
    for _ in range(draw(st.integers(0, rows * atoms))):
        x.flat[draw(st.integers(0, x.size - 1))] = draw(
            st.sampled_from([np.nan, np.inf, -np.inf]))
    return x


@settings(max_examples=60)
@given(x=rows_with_specials())
def test_log_softmax_nan_inf_contract(x):
    logp = dist.log_softmax_atoms(x)
    assert logp.dtype == np.float32 and logp.shape == x.shape
    for row_in, row_out in zip(x, logp):
        poisoned = np.isnan(row_in).any() or np.isposinf(row_in).any() or np.isneginf(row_in).all()
        if poisoned:
            assert np.isnan(row_out).all()
        else:
            assert np.array_equal(np.isneginf(row_out), np.isneginf(row_in))
            finite = np.isfinite(row_in)
            assert np.isfinite(row_out[finite]).all()
            ref = torch.log_softmax(t64(row_in), dim=-1).numpy()
            np.testing.assert_allclose(row_out[finite], ref[finite], rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Double-DQN selection
# ---------------------------------------------------------------------------------------------


def argmax_oracle(row) -> int:
    """Lowest index among the largest non-NaN values; 0 when every entry is NaN."""
    candidates = [(i, v) for i, v in enumerate(row.tolist()) if not math.isnan(v)]
    if not candidates:
        return 0
    best = max(v for _, v in candidates)
    return min(i for i, v in candidates if v == best)


def test_double_dqn_select_ties_and_nan_rules():
    q = np.array(
        [
            [1.0, 3.0, 3.0],  # tie -> lowest index
            [2.0, 2.0, 2.0],  # all tied -> 0
            [np.nan, 1.0, 5.0],  # NaN never wins
            [np.nan, np.nan, np.nan],  # all NaN -> 0
            [-np.inf, np.nan, -np.inf],  # -Inf beats NaN, first -Inf on ties
            [0.0, -0.0, 0.0],  # signed zeros tie -> 0
            [1.0, np.inf, np.inf],  # first +Inf
            [np.nan, np.nan, -1.0],
        ],
        dtype=np.float32,
    )
    out = dist.double_dqn_select(q)
    assert out.dtype == np.int32
    assert out.tolist() == [1, 0, 2, 0, 0, 0, 1, 2]


@settings(max_examples=60)
@given(data=st.data(), batch=st.integers(1, 6), actions_n=st.integers(1, 5))
def test_double_dqn_select_matches_oracle_with_specials(data, batch, actions_n):
    # A small value set forces ties; specials are injected at drawn positions.
    q = data.draw(hnp.arrays(np.float32, (batch, actions_n),
                             elements=st.sampled_from([-1.0, 0.0, -0.0, 2.0]))).copy()
    for _ in range(data.draw(st.integers(0, q.size))):
        q.flat[data.draw(st.integers(0, q.size - 1))] = data.draw(
            st.sampled_from([np.nan, np.inf, -np.inf]))
    out = dist.double_dqn_select(q)
    assert out.tolist() == [argmax_oracle(row) for row in q]


# ---------------------------------------------------------------------------------------------
# C51 projection
# ---------------------------------------------------------------------------------------------


def classic_projection(p, r, done, gamma, v_min, v_max, atoms):
    """The classic floor/ceil C51 projection (Bellemare et al. 2017, Alg. 1) in float64 on an
    exactly spaced float64 support, with the b == l == u case handled (all mass to atom l)
    and b clamped into [0, NA - 1]."""
    dz = (v_max - v_min) / (atoms - 1)
    z = v_min + dz * np.arange(atoms)
    m = np.zeros((len(r), atoms))
    for b_idx in range(len(r)):
        for j in range(atoms):
            tz = min(max(r[b_idx] + gamma * (1.0 - done[b_idx]) * z[j], v_min), v_max)
            pos = min(max((tz - v_min) / dz, 0.0), atoms - 1.0)
            lower, upper = math.floor(pos), math.ceil(pos)
            if lower == upper:
                m[b_idx, lower] += p[b_idx, j]
            else:
                m[b_idx, lower] += p[b_idx, j] * (upper - pos)
                m[b_idx, upper] += p[b_idx, j] * (pos - lower)
    return m


def random_projection_inputs(batch, atoms, seed, r_scale=4.0):
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.full(atoms, 0.7), batch).astype(np.float32)
    r = (r_scale * rng.standard_normal(batch)).astype(np.float32)
    done = (rng.random(batch) < 0.25).astype(np.float32)
    return p, r, done


@pytest.mark.parametrize(("atoms", "gamma"), [(11, 0.99), (51, 0.99), (51, 0.5), (5, 1.0)])
def test_c51_project_matches_classic_floor_ceil_projection(atoms, gamma):
    v_min, v_max = -10.0, 10.0
    p, r, done = random_projection_inputs(64, atoms, seed=atoms)
    r[:3] = [25.0, -25.0, 0.0]  # beyond both ends, and one with targets on atoms when gamma=1
    z = dist.support(v_min, v_max, atoms)
    m = dist.c51_project(p, r, done, gamma, z, v_min, v_max)
    assert m.dtype == np.float32 and m.shape == p.shape
    expected = classic_projection(p.astype(np.float64), r.astype(np.float64),
                                  done.astype(np.float64), gamma, v_min, v_max, atoms)
    # Positions (Tz, z_i) carry float32 rounding of a few ulp of max|z|; a weight is a
    # position difference in units of dz, so each unit of mass may move by ~4 ulp / dz.
    atol = 4 * F32_EPS * 2 * max(abs(v_min), abs(v_max)) / ((v_max - v_min) / (atoms - 1))
    assert_close(m, expected, rtol=0, atol=atol, what="m")


@pytest.mark.parametrize("shape", ["tiny-A3", "seed"])
def test_c51_project_properties(shape):
    batch, _, atoms, v_min, v_max = SHAPES[shape]
    p, r, done = random_projection_inputs(batch, atoms, seed=1)
    z = dist.support(v_min, v_max, atoms)
    m = dist.c51_project(p, r, done, 0.99, z, v_min, v_max)
    assert np.all(m >= 0)
    np.testing.assert_allclose(m.astype(np.float64).sum(-1), 1.0, rtol=0, atol=atoms * 4e-7)
    # Mean preservation when nothing clips: r in [-4, 4], gamma 0.5 keeps Tz inside [-9, 9].
    r_in = np.clip(r, -4, 4).astype(np.float32)
    m_in = dist.c51_project(p, r_in, done, 0.5, z, v_min, v_max)
    z64 = z.astype(np.float64)
    target_mean = r_in + 0.5 * (1.0 - done) * (p.astype(np.float64) @ z64)
    np.testing.assert_allclose(m_in.astype(np.float64) @ z64, target_mean, rtol=0, atol=1e-5)


def test_c51_project_targets_exactly_on_atoms():
    # dz = 1 on [-5, 5]: every support point and every target below is exact in float32.
    z = dist.support(-5.0, 5.0, 11)
    rng = np.random.default_rng(5)
    p = rng.dirichlet(np.ones(11), 3).astype(np.float32)
    zeros = np.zeros(3, np.float32)
    # r = 0, gamma = 1: the identity.
    assert np.array_equal(dist.c51_project(p, zeros, zeros, 1.0, z, -5.0, 5.0), p)
    # r = k * dz: a shift by k atoms, mass beyond the end piling onto the end atom.
    shifted = dist.c51_project(p, np.full(3, 2.0, np.float32), zeros, 1.0, z, -5.0, 5.0)
    expected = np.zeros_like(p)
    expected[:, 2:] = p[:, :-2]
    expected[:, -1] += p[:, -2:].sum(-1)
    np.testing.assert_allclose(shifted, expected, rtol=0, atol=2 * F32_EPS)
    assert np.array_equal(shifted[:, :-1], expected[:, :-1])
    # Seed support (dz = 0.4 is inexact): r = 0, gamma = 1 is still the identity up to the
    # sub-ulp spacing errors of the float32 support.
    z51 = dist.support(-10.0, 10.0, 51)
    p51 = rng.dirichlet(np.ones(51), 3).astype(np.float32)
    m51 = dist.c51_project(p51, zeros, zeros, 1.0, z51, -10.0, 10.0)
    np.testing.assert_allclose(m51, p51, rtol=0, atol=1e-6)


def test_c51_project_done_gamma_zero_and_outside_support():
    z = dist.support(-5.0, 5.0, 11)
    p = np.random.default_rng(6).dirichlet(np.ones(11), 4).astype(np.float32)
    r = np.array([3.25, -100.0, 100.0, -5.0], np.float32)
    ones, zeros = np.ones(4, np.float32), np.zeros(4, np.float32)
    expected = np.zeros((4, 11))
    expected[0, 8], expected[0, 9] = 0.75, 0.25  # 3.25 between atoms 3 and 4
    expected[1, 0] = expected[3, 0] = 1.0  # clipped to v_min / exactly v_min
    expected[2, 10] = 1.0  # clipped to v_max
    done_case = dist.c51_project(p, r, ones, 0.99, z, -5.0, 5.0)
    gamma0_case = dist.c51_project(p, r, zeros, 0.0, z, -5.0, 5.0)
    for m in (done_case, gamma0_case):
        assert_close(m, expected, rtol=0, atol=4 * F32_EPS, what="all mass at clip(r)")


# Golden cases from google/dopamine, tests/dopamine/agents/rainbow/rainbow_agent_test.py
# (ProjectDistributionTest): supports, weights, target_support and the expected projections
# are theirs. Their support of target values is written here as r + gamma * z_j on our
# support z = target_support (gamma may be 2 or -1 there: our kernel accepts any gamma).
DOPAMINE_CASES = [
    # testProjectSingleIdenticalDistribution: supports [0..4] onto [0..4]
    ((0.0, 4.0), 0.0, 1.0, [0.1, 0.2, 0.1, 0.3, 0.3], [0.1, 0.2, 0.1, 0.3, 0.3]),
    # testProjectSingleDifferentDistribution: supports [0..4] onto [3..7]
    ((3.0, 7.0), -3.0, 1.0, [0.1, 0.2, 0.1, 0.3, 0.3], [0.7, 0.3, 0.0, 0.0, 0.0]),
    # testProjectFromNonMonotonicSupport: supports [4, 3, 2, 1, 0] onto [3..7]
    ((3.0, 7.0), 7.0, -1.0, [0.1, 0.2, 0.1, 0.3, 0.3], [0.9, 0.1, 0.0, 0.0, 0.0]),
    # testExampleFromCodeComments, row 0: supports [0, 2, 4, 6, 8] onto [4..8]
    ((4.0, 8.0), -8.0, 2.0, [0.1, 0.6, 0.1, 0.1, 0.1], [0.8, 0.0, 0.1, 0.0, 0.1]),
    # testProjectBatchOfDifferentDistributions, row 0: supports [0, 2, 4, 6, 8] onto [3..7]
    ((3.0, 7.0), -6.0, 2.0, [0.1, 0.2, 0.3, 0.2, 0.2], [0.3, 0.3, 0.0, 0.2, 0.2]),
    # testProjectBatchOfDifferentDistributions, row 2: supports [3..7] onto [3..7]
    ((3.0, 7.0), 0.0, 1.0, [0.1, 0.2, 0.3, 0.2, 0.2], [0.1, 0.2, 0.3, 0.2, 0.2]),
    # testProjectBatchOfDifferentDistributionsWithLargerDelta, row 0: [0, 2, 4, 6, 8] onto
    # [0, 4, 8, 12, 16]
    ((0.0, 16.0), 0.0, 0.5, [0.1, 0.2, 0.2, 0.2, 0.3], [0.2, 0.4, 0.4, 0.0, 0.0]),
]


@pytest.mark.parametrize(("bounds", "r", "gamma", "weights", "expected"), DOPAMINE_CASES)
def test_c51_project_dopamine_golden_cases(bounds, r, gamma, weights, expected):
    v_min, v_max = bounds
    z = dist.support(v_min, v_max, 5)
    m = dist.c51_project(np.array([weights], np.float32), np.array([r], np.float32),
                         np.zeros(1, np.float32), gamma, z, v_min, v_max)
    np.testing.assert_allclose(m[0], expected, rtol=0, atol=1e-6)


@settings(max_examples=40)
@given(data=st.data(), batch=st.integers(1, 5), atoms=st.integers(2, 9))
def test_c51_project_nan_inf_contract(data, batch, atoms):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    p, r, done = random_projection_inputs(batch, atoms, seed=int(rng.integers(1 << 30)))
    rows = np.arange(batch)
    kinds = data.draw(st.lists(st.sampled_from(["clean", "nan_r", "nan_done", "nan_p", "inf_r",
                                                "-inf_r"]), min_size=batch, max_size=batch))
    for b_idx, kind in zip(rows, kinds):
        if kind == "nan_r":
            r[b_idx] = np.nan
        elif kind == "nan_done":
            done[b_idx] = np.nan
        elif kind == "nan_p":
            p[b_idx, data.draw(st.integers(0, atoms - 1))] = np.nan
        elif kind in ("inf_r", "-inf_r"):
            r[b_idx] = np.inf if kind == "inf_r" else -np.inf
    z = dist.support(-10.0, 10.0, atoms)
    m = dist.c51_project(p, r, done, 0.9, z, -10.0, 10.0)
    for b_idx, kind in zip(rows, kinds):
        if kind.startswith("nan"):
            assert np.isnan(m[b_idx]).all(), kind
        else:
            assert np.isfinite(m[b_idx]).all(), kind
            assert abs(float(m[b_idx].astype(np.float64).sum()) - 1.0) <= atoms * 4e-7
        if kind == "inf_r" and done[b_idx] == 1.0:
            assert m[b_idx, -1] == pytest.approx(1.0, abs=1e-6)
        if kind == "-inf_r" and done[b_idx] == 1.0:
            assert m[b_idx, 0] == pytest.approx(1.0, abs=1e-6)
    all_nan_gamma = dist.c51_project(p, r, done, np.array(np.nan, np.float32), z, -10.0, 10.0)
    assert np.isnan(all_nan_gamma).all()


# ---------------------------------------------------------------------------------------------
# C51 loss and gradient vs torch autograd
# ---------------------------------------------------------------------------------------------


def c51_oracle(logits, actions, m, isw, scale):
    """Total loss and dlogits from torch autograd (float64), the loss built from the logits."""
    logits_t = t64(logits, grad=True)
    logp_t = torch.log_softmax(logits_t, dim=-1)
    taken = logp_t[torch.arange(len(actions)), torch.from_numpy(actions).long()]
    ce_t = -(t64(m) * taken).sum(-1)
    total_t = scale * (t64(isw) * ce_t).sum()
    total_t.backward()
    return ce_t.detach().numpy(), total_t.item(), logits_t.grad.numpy()


@shape_ids
def test_c51_loss_and_grad_vs_torch_autograd(shape):
    logits, actions, m, isw, _ = make_case(shape)
    batch = logits.shape[0]
    scale = 1.0 / (batch * 3)
    ce_ref, total_ref, grad_ref = c51_oracle(logits, actions, m, isw, scale)
    logp = dist.log_softmax_atoms(logits)
    ce, total = dist.c51_loss(logp, actions, m, isw, scale)
    assert ce.dtype == np.float32 and isinstance(total, np.float32)
    assert_close(ce, ce_ref, rtol=2e-6, atol=1e-6, what="ce")
    assert_close(np.array([total]), np.array([total_ref]), rtol=1e-5, atol=1e-7, what="total")
    dlogits = dist.c51_grad(logp, actions, m, isw, scale)
    assert dlogits.dtype == np.float32 and dlogits.shape == logits.shape
    # p carries the log-softmax's absolute error (~1e-6 for |logp| ~ 15); sum(m) = 1 up to
    # float32 rounding of m.
    atol = 2e-6 * float(np.max(isw)) * scale
    assert_close(dlogits, grad_ref, rtol=1e-5, atol=atol, what="dlogits")
    other = np.ones(logits.shape[:2], bool)
    other[np.arange(batch), actions] = False
    assert np.all(dlogits[other] == 0) and not np.signbit(dlogits[other]).any()


def test_c51_grad_oracle_comparison_detects_a_dropped_isw():
    """Mutation sensitivity: the tolerance used above must reject a c51_grad that ignores isw
    (the isw-free variant is computed with isw = 1)."""
    logits, actions, m, isw, _ = make_case("seed")
    assert isw.std() > 0.3, "isw must be non-uniform for this test to mean anything"
    scale = 1.0 / (logits.shape[0] * 3)
    _, _, grad_ref = c51_oracle(logits, actions, m, isw, scale)
    logp = dist.log_softmax_atoms(logits)
    atol = 2e-6 * float(np.max(isw)) * scale
    mutated = dist.c51_grad(logp, actions, m, np.ones_like(isw), scale)
    with pytest.raises(AssertionError):
        assert_close(mutated, grad_ref, rtol=1e-5, atol=atol, what="isw-free dlogits")
    assert_close(dist.c51_grad(logp, actions, m, isw, scale), grad_ref, rtol=1e-5, atol=atol,
                 what="dlogits")


def test_c51_loss_and_grad_nan_contract():
    logits, actions, m, isw, _ = make_case("tiny-A3")
    logp = dist.log_softmax_atoms(logits)
    other_action = (actions[0] + 1) % 3
    logp[0, other_action, :] = np.nan  # not read by sample 0's loss or gradient
    ce, total = dist.c51_loss(logp, actions, m, isw, 0.25)
    grad = dist.c51_grad(logp, actions, m, isw, 0.25)
    assert np.isfinite(ce).all() and np.isfinite(total) and np.isfinite(grad).all()
    assert np.all(grad[0, other_action] == 0)
    logp[1, actions[1], 4] = np.nan  # the taken row of sample 1
    isw[2] = np.nan
    ce, total = dist.c51_loss(logp, actions, m, isw, 0.25)
    grad = dist.c51_grad(logp, actions, m, isw, 0.25)
    assert np.isnan(ce).tolist() == [False, True, False, False] and np.isnan(total)
    assert np.isnan(grad[1, actions[1], 4]) and np.isnan(grad[1]).sum() == 1
    assert np.isnan(grad[2, actions[2]]).all() and np.isnan(grad[2]).sum() == grad.shape[2]
    assert np.isfinite(grad[[0, 3]]).all()


# ---------------------------------------------------------------------------------------------
# CQL gradient vs torch autograd
# ---------------------------------------------------------------------------------------------


def cql_oracle(logits, actions, z, alpha, scale):
    logits_t = t64(logits, grad=True)
    p_t = torch.softmax(logits_t, dim=-1)
    q_t = (p_t * t64(z)).sum(-1)
    terms_t = torch.logsumexp(q_t, dim=1) - q_t[torch.arange(len(actions)),
                                                torch.from_numpy(actions).long()]
    (alpha * scale * terms_t.sum()).backward()
    return terms_t.detach().numpy(), logits_t.grad.numpy()


@shape_ids
@pytest.mark.parametrize("alpha", [1.0, 0.3])
def test_cql_logit_grad_vs_torch_autograd(shape, alpha):
    logits, actions, _, _, z = make_case(shape, seed=9)
    batch = logits.shape[0]
    scale = 1.0 / (batch * 3)
    terms_ref, grad_ref = cql_oracle(logits, actions, z, alpha, scale)
    dlogits, terms = dist.cql_logit_grad(dist.log_softmax_atoms(logits), actions, z, alpha, scale)
    assert dlogits.dtype == np.float32 and terms.dtype == np.float32
    assert terms.shape == (batch,) and dlogits.shape == logits.shape
    zmax = float(np.abs(z).max())
    assert_close(terms, terms_ref, rtol=0, atol=2e-6 * zmax, what="terms")
    # dlogits = dQ * p * (z - Q): Q carries ~1e-6 * |z| absolute error.
    assert_close(dlogits, grad_ref, rtol=1e-4, atol=2e-6 * alpha * scale * zmax, what="dlogits")
    assert np.abs(grad_ref).max() > 100 * 2e-6 * alpha * scale * zmax, "gradient not trivial"


def test_cql_nan_contract():
    logits, actions, _, _, z = make_case("tiny-A3", seed=2)
    logp = dist.log_softmax_atoms(logits)
    logp[1, (actions[1] + 1) % 3, 0] = np.nan  # a non-taken action still poisons the sample
    dlogits, terms = dist.cql_logit_grad(logp, actions, z, 1.0, 0.25)
    assert np.isnan(terms).tolist() == [False, True, False, False]
    assert np.isnan(dlogits[1]).all()
    assert np.isfinite(dlogits[[0, 2, 3]]).all()
    dlogits_nan_alpha, terms_nan_alpha = dist.cql_logit_grad(
        dist.log_softmax_atoms(logits), actions, z, np.nan, 0.25)
    assert np.isnan(dlogits_nan_alpha).all() and np.isfinite(terms_nan_alpha).all()


# ---------------------------------------------------------------------------------------------
# Fused kernels: log_softmax_expected_q, c51_project_grad
# ---------------------------------------------------------------------------------------------


def same_bits(a, b) -> bool:
    """Equal dtype, shape and bit patterns (NaN payloads and signed zeros included)."""
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(
        a.view(np.uint32), b.view(np.uint32))


def composed_log_softmax_q(logits, z, q_rows):
    logp = dist.log_softmax_atoms(logits)
    na = logits.shape[1]
    return logp, dist.expected_q(logp[:q_rows].reshape(q_rows, 1, na), z).reshape(q_rows)


def composed_project_grad(p_next, r, done, gamma, z, v_min, v_max, logp, actions, isw, scale):
    m = dist.c51_project(p_next, r, done, gamma, z, v_min, v_max)
    return m, dist.c51_grad(logp, actions, m, isw, scale)


def project_grad_case(batch, actions_n, atoms, seed):
    rng = np.random.default_rng(seed)
    p, r, done = random_projection_inputs(batch, atoms, seed=seed)
    logits = (2.0 * rng.standard_normal((batch, actions_n, atoms))).astype(np.float32)
    logp = dist.log_softmax_atoms(logits)
    actions = rng.integers(0, actions_n, batch).astype(np.int32)
    isw = rng.uniform(0.2, 1.8, batch).astype(np.float32)
    return {"p_next": p, "r": r, "done": done, "gamma": np.float32(0.99),
            "z": dist.support(-10.0, 10.0, atoms), "v_min": -10.0, "v_max": 10.0,
            "logp": logp, "actions": actions, "isw": isw, "scale": np.float32(1.0 / (3 * batch))}


@pytest.mark.parametrize(("rows", "atoms", "q_rows"),
                         [(6 * 256 + 3, 51, 4 * 256 + 2), (12, 11, 0), (12, 11, 12), (7, 1, 3)])
def test_log_softmax_expected_q_is_the_composition(rows, atoms, q_rows):
    rng = np.random.default_rng(rows + atoms)
    logits = (3.0 * rng.standard_normal((rows, atoms))).astype(np.float32)
    z = dist.support(-10.0, 10.0, atoms) if atoms > 1 else np.array([2.5], np.float32)
    out = dist.log_softmax_expected_q(logits, z, q_rows)
    assert isinstance(out, dist.LogSoftmaxQ)
    logp, q = composed_log_softmax_q(logits, z, q_rows)
    assert same_bits(out.logp, logp) and same_bits(out.q, q)
    assert out.q.shape == (q_rows,)
    # Independent oracle: Q of the first q_rows rows from torch's softmax in float64.
    q_ref = (torch.softmax(t64(logits[:q_rows]), dim=-1).numpy() * z.astype(np.float64)).sum(-1)
    assert_close(out.q, q_ref, rtol=0, atol=1e-5 * float(np.abs(z).max()), what="q")


@st.composite
def logits_z_with_specials(draw):
    rows = draw(st.integers(1, 6))
    atoms = draw(st.integers(1, 9))
    x = draw(hnp.arrays(np.float32, (rows, atoms), elements=st.floats(-30, 30, width=32))).copy()
    z = draw(hnp.arrays(np.float32, atoms, elements=st.floats(-10, 10, width=32))).copy()
    specials = st.sampled_from([np.nan, np.inf, -np.inf, -0.0, 3.4028235e38])
    for _ in range(draw(st.integers(0, rows * atoms))):
        x.flat[draw(st.integers(0, x.size - 1))] = draw(specials)
    for _ in range(draw(st.integers(0, 2))):
        z[draw(st.integers(0, atoms - 1))] = draw(specials)
    return x, z, draw(st.integers(0, rows))


@settings(max_examples=60)
@given(case=logits_z_with_specials())
def test_log_softmax_expected_q_is_the_composition_with_specials(case):
    logits, z, q_rows = case
    out = dist.log_softmax_expected_q(logits, z, q_rows)
    logp, q = composed_log_softmax_q(logits, z, q_rows)
    assert same_bits(out.logp, logp) and same_bits(out.q, q)
    poisoned = (np.isnan(logits).any(axis=1) | np.isposinf(logits).any(axis=1)
                | np.isneginf(logits).all(axis=1))
    assert np.isnan(out.logp[poisoned]).all()
    if np.isnan(z).any():
        assert np.isnan(out.q).all()
    elif np.isfinite(z).all():
        assert np.array_equal(np.isnan(out.q), poisoned[:q_rows])


def test_log_softmax_expected_q_nan_contract():
    logits = np.zeros((4, 5), np.float32)
    logits[1, 2] = np.nan  # a q row
    logits[3, 0] = np.inf  # a row past q_rows: logp only
    logits[2, 4] = -np.inf  # probability 0, finite elsewhere
    z = dist.support(-2.0, 2.0, 5)
    logp, q = dist.log_softmax_expected_q(logits, z, 3)
    assert np.isnan(logp[1]).all() and np.isnan(logp[3]).all()
    assert np.isneginf(logp[2, 4]) and np.isfinite(logp[2, :4]).all()
    assert np.isnan(q).tolist() == [False, True, False]
    assert q[0] == pytest.approx(0.0, abs=1e-6) and q[2] == pytest.approx(-0.5, abs=1e-6)


@pytest.mark.parametrize(("batch", "actions_n", "atoms"), [(256, 3, 51), (5, 2, 11), (3, 1, 2),
                                                             (4, 4, 300)])
def test_c51_project_grad_is_the_composition(batch, actions_n, atoms):
    kw = project_grad_case(batch, actions_n, atoms, seed=batch + atoms)
    out = dist.c51_project_grad(**kw)
    assert isinstance(out, dist.C51ProjectGrad)
    m, dlogits = composed_project_grad(**kw)
    assert same_bits(out.m, m) and same_bits(out.dlogits, dlogits)
    assert out.m.shape == (batch, atoms) and out.dlogits.shape == (batch, actions_n, atoms)
    # Independent oracle: the classic floor/ceil projection for m, torch autograd of the C51
    # loss (from the logits that give logp, with m as the target) for dlogits.
    m_ref = classic_projection(kw["p_next"], kw["r"], kw["done"], 0.99, -10.0, 10.0, atoms)
    assert_close(out.m, m_ref, rtol=0, atol=atoms * 1e-5, what="m")
    _, _, grad_ref = c51_oracle(kw["logp"], kw["actions"], out.m, kw["isw"], float(kw["scale"]))
    atol = 2e-6 * float(np.max(kw["isw"])) * float(kw["scale"])
    assert_close(out.dlogits, grad_ref, rtol=1e-5, atol=atol, what="dlogits")


@settings(max_examples=40)
@given(data=st.data(), batch=st.integers(1, 5), actions_n=st.integers(1, 4),
       atoms=st.integers(2, 9))
def test_c51_project_grad_is_the_composition_with_specials(data, batch, actions_n, atoms):
    kw = project_grad_case(batch, actions_n, atoms, seed=data.draw(st.integers(0, 2**16)))
    specials = st.sampled_from([np.nan, np.inf, -np.inf, -0.0, 3.4028235e38])
    for name in ("p_next", "r", "done", "logp", "isw"):
        arr = kw[name]
        for _ in range(data.draw(st.integers(0, 2))):
            arr.flat[data.draw(st.integers(0, arr.size - 1))] = data.draw(specials)
    for name in ("gamma", "scale"):
        if data.draw(st.booleans()):
            kw[name] = np.float32(data.draw(specials))
    out = dist.c51_project_grad(**kw)
    m, dlogits = composed_project_grad(**kw)
    assert same_bits(out.m, m) and same_bits(out.dlogits, dlogits)
    not_taken = np.ones((batch, actions_n), bool)
    not_taken[np.arange(batch), kw["actions"]] = False
    assert same_bits(out.dlogits[not_taken], np.zeros_like(out.dlogits[not_taken]))


def test_c51_project_grad_nan_contract():
    kw = project_grad_case(4, 3, 11, seed=5)
    a = kw["actions"]
    kw["r"][0] = np.nan  # m[0] NaN, so sample 0's taken row
    kw["logp"][1, (a[1] + 1) % 3, :] = np.nan  # an action not taken: no effect
    kw["logp"][2, a[2], 3] = np.nan  # one element of the taken row
    kw["r"][3] = np.inf  # clipped to v_max: finite
    m, dlogits = dist.c51_project_grad(**kw)
    assert np.isnan(m[0]).all() and np.isfinite(m[1:]).all()
    assert np.isnan(dlogits[0, a[0]]).all() and np.isnan(dlogits[0]).sum() == 11
    assert np.isfinite(dlogits[1]).all() and np.isfinite(dlogits[3]).all()
    assert np.isnan(dlogits[2, a[2], 3]) and np.isnan(dlogits).sum() == 12


# ---------------------------------------------------------------------------------------------
# Errors, immutability and registry
# ---------------------------------------------------------------------------------------------

_LOGP = np.full((2, 3, 5), -np.log(5.0), np.float32)
_ACT = np.array([0, 2], np.int32)
_M = np.full((2, 5), 0.2, np.float32)
_ISW = np.ones(2, np.float32)
_Z = dist.support(-2.0, 2.0, 5)


def fused_bad_calls(module):
    """Bad calls of the fused kernels of ``module`` (the reference or the fast test entries)."""
    good = {"p_next": _M, "r": _ISW, "done": _ISW, "gamma": 0.99, "z": _Z, "v_min": -2.0,
            "v_max": 2.0, "logp": _LOGP, "actions": _ACT, "isw": _ISW, "scale": 0.5}

    def project_grad(**bad):
        return lambda: module.c51_project_grad(**{**good, **bad})

    logits = _LOGP.reshape(6, 5)
    return [
        (lambda: module.log_softmax_expected_q(_LOGP, _Z, 2), "logits"),
        (lambda: module.log_softmax_expected_q(logits.astype(np.float64), _Z, 2), "logits"),
        (lambda: module.log_softmax_expected_q(logits, _Z[:4], 2), "z"),
        (lambda: module.log_softmax_expected_q(logits, _Z, 7), "q_rows"),
        (lambda: module.log_softmax_expected_q(logits, _Z, -1), "q_rows"),
        (lambda: module.log_softmax_expected_q(logits, _Z, 2.0), "q_rows"),
        (lambda: module.log_softmax_expected_q(logits, _Z, True), "q_rows"),
        (project_grad(r=_ISW[:1]), "r"),
        (project_grad(v_min=3.0), "v_min, v_max"),
        (project_grad(gamma="0.99"), "gamma"),
        (project_grad(z=_Z[:4]), "z"),
        (project_grad(logp=_LOGP[:, :, :4]), "logp"),
        (project_grad(logp=_LOGP[:1]), "logp"),
        (project_grad(logp=_LOGP[0]), "logp"),
        (project_grad(actions=np.array([0, 3], np.int32)), "actions"),
        (project_grad(actions=_ACT.astype(np.int64)), "actions"),
        (project_grad(isw=_ISW[:1]), "isw"),
        (project_grad(scale=None), "scale"),
    ]


@pytest.mark.parametrize(
    ("call", "argument"),
    [
        (lambda: dist.dueling_combine(_M, _LOGP[:, :, :4]), "adv"),
        (lambda: dist.dueling_combine(_M.astype(np.float64), _LOGP), "v"),
        (lambda: dist.dueling_combine_backward(_M), "dlogits"),
        (lambda: dist.log_softmax_atoms(_M.astype(np.float16)), "logits"),
        (lambda: dist.expected_q(_LOGP, _Z[:4]), "z"),
        (lambda: dist.double_dqn_select(_LOGP), "q"),
        (lambda: dist.c51_project(_M, _ISW, _ISW, 0.99, _Z[:4], -2.0, 2.0), "z"),
        (lambda: dist.c51_project(_M, _ISW[:1], _ISW, 0.99, _Z, -2.0, 2.0), "r"),
        (lambda: dist.c51_project(_M, _ISW, _ISW.astype(np.int32), 0.99, _Z, -2.0, 2.0), "done"),
        (lambda: dist.c51_project(_M, _ISW, _ISW, "0.99", _Z, -2.0, 2.0), "gamma"),
        (lambda: dist.c51_project(_M, _ISW, _ISW, 0.99, _Z, 2.0, -2.0), "v_min, v_max"),
        (lambda: dist.c51_loss(_LOGP, np.array([0, 3], np.int32), _M, _ISW, 0.5), "actions"),
        (lambda: dist.c51_loss(_LOGP, np.array([-1, 0], np.int32), _M, _ISW, 0.5), "actions"),
        (lambda: dist.c51_loss(_LOGP, _ACT.astype(np.int64), _M, _ISW, 0.5), "actions"),
        (lambda: dist.c51_loss(_LOGP, _ACT, _M[:, :4], _ISW, 0.5), "m"),
        (lambda: dist.c51_grad(_LOGP, _ACT, _M, _ISW[:1], 0.5), "isw"),
        (lambda: dist.c51_grad(_LOGP, _ACT, _M, _ISW, None), "scale"),
        (lambda: dist.cql_logit_grad(_LOGP, _ACT, _Z, [1.0], 0.5), "alpha"),
        (lambda: dist.cql_logit_grad(_LOGP[0], _ACT, _Z, 1.0, 0.5), "logp"),
        (lambda: dist.cql_logit_grad(_LOGP, _ACT, _Z, np.ones(1, np.float32), 0.5), "alpha"),
        (lambda: dist.c51_project(_M[:, :1], _ISW, _ISW, 0.9, _Z[:1], -2.0, 2.0), "p_next"),
    ] + fused_bad_calls(dist),
)
def test_bad_arguments_raise_value_error_naming_the_argument(call, argument):
    with pytest.raises(ValueError, match=rf"^{argument}:"):
        call()


@pytest.mark.parametrize(("index", "argument"),
                         list(enumerate(arg for _, arg in fused_bad_calls(dist))))
def test_fast_fused_entries_raise_the_reference_errors(index, argument):
    """The fast test entries validate before touching a device: same class, same message."""
    from foxhunt.fast.kernels import distributional as fast_dist

    ref_call, _ = fused_bad_calls(dist)[index]
    fast_call, _ = fused_bad_calls(fast_dist)[index]
    with pytest.raises(ValueError, match=rf"^{argument}:") as ref_error:
        ref_call()
    with pytest.raises(ValueError) as fast_error:
        fast_call()
    assert str(fast_error.value) == str(ref_error.value)


def test_kernels_do_not_mutate_inputs():
    logits, actions, m, isw, z = make_case("tiny-A3")
    logp = dist.log_softmax_atoms(logits)
    p, r, done = random_projection_inputs(4, 11, seed=4)
    inputs = [logits, actions, m, isw, z, logp, p, r, done]
    before = [x.copy() for x in inputs]
    dist.dueling_combine(m, logits)
    dist.dueling_combine_backward(logits)
    dist.log_softmax_atoms(logits)
    dist.expected_q(logp, z)
    dist.double_dqn_select(logits[:, :, 0])
    dist.c51_project(p, r, done, 0.99, z, -10.0, 10.0)
    dist.c51_loss(logp, actions, m, isw, 0.1)
    dist.c51_grad(logp, actions, m, isw, 0.1)
    dist.cql_logit_grad(logp, actions, z, 1.0, 0.1)
    dist.log_softmax_expected_q(logits.reshape(-1, 11), z, 5)
    dist.c51_project_grad(p, r, done, 0.99, z, -10.0, 10.0, logp, actions, isw, 0.1)
    for x, x0 in zip(inputs, before):
        assert equal_with_nan(x, x0)


def test_kernels_registry():
    assert set(dist.KERNELS) == {
        "dueling_combine", "dueling_combine_backward", "log_softmax_atoms", "expected_q",
        "double_dqn_select", "c51_project", "c51_loss", "c51_grad", "cql_logit_grad",
        "log_softmax_expected_q", "c51_project_grad", "c51_project_grad_live",
    }
    for name, fn in dist.KERNELS.items():
        assert fn.__name__ == name and fn is getattr(dist, name)
    assert "support" not in dist.KERNELS


# ---------------------------------------------------------------------------------------------
# The fused CUDA kernels compile (NVRTC, no GPU needed) with the documented parameter lists
# ---------------------------------------------------------------------------------------------

#: PTX parameter types in order: pointers (u64), then ints (u32 in PTX), then float configuration.
FUSED_PTX_PARAMS = {
    "log_softmax_expected_q": ("u64",) * 4 + ("u32",) * 3,
    # ... then the n-step scalars gamma_ref (f32) and n_step_on (u32) after the configuration.
    "c51_project_grad": ("u64",) * 12 + ("u32",) * 3 + ("f32",) * 4 + ("u32",),
    # adaptive_atoms: the support's bounds through a pointer (no v_min / v_max / dz values).
    "c51_project_grad_live": ("u64",) * 13 + ("u32",) * 3 + ("f32", "u32"),
    "live_support_build": ("u64",) * 4 + ("u32",) * 5 + ("f32",),
}


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_fused_cuda_kernels_compile_with_their_parameter_lists(arch, tmp_path):
    pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-bindings (the test extra) is not installed")
    from foxhunt.fast._build import HEADER_SUFFIXES, compile_sources, source_files

    sources = source_files()
    headers = {n: b for n, b in sources.items() if n.endswith(HEADER_SUFFIXES)}
    module = compile_sources(arch, "ptx", cache_root=tmp_path,
                             sources={"distributional.cu": sources["distributional.cu"], **headers})
    assert module.logs["distributional.cu"] == ""
    for name, types in FUSED_PTX_PARAMS.items():
        assert module.kernels[name] == "distributional.cu"
        assert tuple(p.ptx_type for p in module.params[name]) == types, name
    assert "atom." not in module.ptx["distributional.cu"]  # no atomics anywhere in the file
