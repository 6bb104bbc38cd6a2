"""n-step targets (issue 22): ``Batch.discount``, the per-sample effective discount
``effective_gamma`` and every target that uses it (C51 projection, scalar / MSE warm-up target,
IQN target), on the reference and on the fast step's plan run by the CPU executor.

Expectations are computed independently: by hand, in float64, or through the 1-step kernels
called with the per-sample gamma as a scalar (whose bits the 1-step tests pin down)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest

from foxhunt.conformance.step_compare import compare_step, run_step
from foxhunt.conformance.step_harness import SOURCES, assert_all, shared_case
from foxhunt.fast.cpu_executor import CpuTrainer
from foxhunt.reference.batch import Batch
from foxhunt.reference.config import DQNConfig
from foxhunt.reference.kernels import distributional as dist
from foxhunt.reference.kernels import iqn
from foxhunt.reference.kernels import step as rstep
from foxhunt.reference.step import check_n_step, loss_and_grads
from foxhunt.reference.trainer import Trainer

F32 = np.float32
TINY = DQNConfig.preset("tiny")  # gammas (0.99, 0.99), batch 32
CUDA_HEADER = Path(dist.__file__).resolve().parents[2] / "cuda_src" / "distributional.cuh"


def powers(gamma_ref, ks) -> np.ndarray:
    """The contract's discount: ``gamma_ref`` multiplied k times in float32 (not ``**``)."""
    out = []
    for k in ks:
        d = F32(gamma_ref)
        for _ in range(int(k) - 1):
            d = F32(d * F32(gamma_ref))
        out.append(d)
    return np.array(out, F32)


def with_discount(batch: Batch, discount) -> Batch:
    return dataclasses.replace(batch, discount=None if discount is None else
                               np.asarray(discount, F32))


# ------------------------------------------------------------------------------- the batch
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf, 0.0, -0.0, -0.5, 1.0000001, 2.0])
def test_bad_discount_is_refused_naming_index_and_value(value):
    batch = Batch.random(TINY, np.random.default_rng(0))
    disc = np.full(TINY.batch_size, F32(0.9), F32)
    disc[7] = value
    with pytest.raises(ValueError, match=r"^batch\.discount\[7\]=.*finite and in \(0, 1\]$"):
        with_discount(batch, disc).validate(TINY)


@pytest.mark.parametrize("bad", [np.zeros(3, F32), np.full(TINY.batch_size, 0.5, np.float64)])
def test_discount_shape_and_dtype_are_checked(bad):
    batch = with_discount(Batch.random(TINY, np.random.default_rng(0)), None)
    with pytest.raises(ValueError, match=r"^batch\.discount: (shape|dtype)"):
        dataclasses.replace(batch, discount=bad).validate(TINY)


def test_extreme_valid_discounts_pass_and_none_is_one_step():
    batch = Batch.random(TINY, np.random.default_rng(0))
    assert batch.discount is None
    disc = np.full(TINY.batch_size, F32(1.0), F32)
    disc[0] = F32(1e-30)
    disc[1] = np.finfo(F32).tiny
    assert with_discount(batch, disc).validate(TINY).discount is not None


@pytest.mark.parametrize("n_step, gamma, pattern", [
    (0, 0.99, r"^n_step: 0; allowed an int >= 1$"),
    (True, 0.99, r"^n_step: True"),
    (3, 1.0, r"^gamma: 1\.0 .*n_step=3 needs it in \(0, 1\)$"),
    (2, 0.0, r"^gamma: 0\.0 .*n_step=2"),
])
def test_check_n_step_errors(n_step, gamma, pattern):
    with pytest.raises(ValueError, match=pattern):
        check_n_step(TINY.replace(gamma=gamma), n_step)


def test_check_n_step_allows_gamma_one_for_one_step():
    assert check_n_step(TINY.replace(gamma=1.0), 1) is False
    assert check_n_step(TINY, 16) is True


# ------------------------------------------------------------------------- effective gamma
def test_floors_match_the_cuda_header():
    text = CUDA_HEADER.read_text()
    for name, value in (("kDiscountFloor", dist.DISCOUNT_FLOOR), ("kGammaFloor", dist.GAMMA_FLOOR)):
        match = re.search(rf"constexpr float {name} = ([0-9.e+-]+)f;", text)
        assert match, name
        assert F32(float(match.group(1))) == value


@pytest.mark.parametrize("gamma_ref", [0.99, 0.9, 0.5])
@pytest.mark.parametrize("gamma", [0.99, 0.95, 0.5])
def test_effective_gamma_is_gamma_to_the_k(gamma_ref, gamma):
    ks = np.arange(1, 17)
    disc = powers(gamma_ref, ks)
    got = dist.effective_gamma(F32(gamma), disc, F32(gamma_ref))
    assert got.dtype == F32 and got.shape == (16,)
    # Float64 of the contract's formula on the float32 discounts (k only up to their rounding).
    n_eff = np.log(disc.astype(np.float64)) / np.log(np.float64(F32(gamma_ref)))
    np.testing.assert_allclose(n_eff, ks, rtol=2e-5)
    want = np.float64(F32(gamma)) ** n_eff
    np.testing.assert_allclose(got, want, rtol=8 * np.finfo(F32).eps * 16)
    # k = 1: n_eff is exactly 1, so gamma_eff is gamma bit for bit.
    assert got[0] == F32(gamma)


def test_effective_gamma_floors_and_nan_contract():
    ref = F32(0.9)
    floor = dist.effective_gamma(F32(0.99), np.array([1e-9], F32), ref)[0]
    for d in (0.0, -1.0, -np.inf, np.nan, 1e-30):
        got = dist.effective_gamma(F32(0.99), np.array([d], F32), ref)[0]
        assert got == floor and np.isfinite(got)
    # log(1e-9) / log(0.9) = 196.7: 0.99 ** 196.7 by hand (float64) = 0.1386.
    assert abs(float(floor) - 0.99 ** (np.log(1e-9) / np.log(0.9))) < 1e-6
    # A NaN or non-positive gamma is floored to 1e-6: 1e-6 ** 2 = 1e-12.
    two = powers(ref, [2])
    for g in (np.nan, 0.0, -3.0):
        got = dist.effective_gamma(F32(g), two, ref)[0]
        assert abs(float(got) - 1e-12) < 1e-17
    # discount = 1 means no discounting at all: n_eff = 0, gamma_eff = 1.
    assert dist.effective_gamma(F32(0.7), np.array([1.0], F32), ref)[0] == F32(1)
    # Above 1 (an invalid batch), +Inf and f32 max included, the discount counts as 1: n_eff = 0,
    # gamma_eff = 1, instead of 0.99 ** -8828 at float32's overflow edge; other samples unchanged.
    got = dist.effective_gamma(F32(0.99), np.array([np.inf, np.finfo(F32).max, 1.5, 0.81], F32), ref)
    assert list(got[:3]) == [F32(1)] * 3
    assert got[3] == dist.effective_gamma(F32(0.99), powers(ref, [2]), ref)[0]
    # 1-step: gamma itself, the discount not read.
    assert dist.effective_gamma(F32(0.99), None, None) == F32(0.99)


@pytest.mark.parametrize("gamma_ref", [0.0, 1.0, np.nan, 1.5])
def test_kernels_refuse_a_bad_gamma_ref(gamma_ref):
    p = np.full((2, 5), 0.2, F32)
    z = dist.support(-2.0, 2.0, 5)
    zeros = np.zeros(2, F32)
    with pytest.raises(ValueError, match=r"^gamma_ref="):
        dist.c51_project(p, zeros, zeros, 0.9, z, -2.0, 2.0, np.full(2, 0.5, F32), gamma_ref)


# ----------------------------------------------------------------------------- the targets
def test_c51_projection_by_hand():
    """One sample, support {-2, -1, 0, 1, 2}, all mass on z = 2, r = 0.5, a 2-step transition
    with gamma_ref = 0.5 (discount 0.25). Branch gamma 0.5: gamma_eff = 0.25, Tz = 0.5 + 0.5 =
    1.0, all mass on atom 1. Branch gamma 0.8 (a scheduled gamma): gamma_eff = 0.64, Tz = 1.78,
    mass 0.22 on atom 1 and 0.78 on atom 2. Done: Tz = r = 0.5, half on atoms 0 and 1."""
    z = dist.support(-2.0, 2.0, 5)
    p = np.array([[0, 0, 0, 0, 1]], F32)
    r, disc = np.array([0.5], F32), np.array([0.25], F32)
    not_done, done = np.zeros(1, F32), np.ones(1, F32)
    m = dist.c51_project(p, r, not_done, 0.5, z, -2.0, 2.0, disc, 0.5)
    np.testing.assert_array_equal(m, [[0, 0, 0, 1, 0]])
    m = dist.c51_project(p, r, not_done, 0.8, z, -2.0, 2.0, disc, 0.5)
    np.testing.assert_allclose(m, [[0, 0, 0, 0.22, 0.78]], atol=1e-6)
    m = dist.c51_project(p, r, done, 0.8, z, -2.0, 2.0, disc, 0.5)
    np.testing.assert_allclose(m, [[0, 0, 0.5, 0.5, 0]], atol=1e-6)


def _per_sample(fn, gamma_eff: np.ndarray, batch: int):
    """``fn(b, gamma_b)`` for every sample: the 1-step kernel with the sample's own gamma."""
    return [fn(b, F32(gamma_eff[b])) for b in range(batch)]


def _target_inputs(rng, batch=9, atoms=11, gamma_ref=0.9):
    p = rng.random((batch, atoms)).astype(F32)
    p /= p.sum(axis=1, keepdims=True)
    ks = rng.integers(1, 17, size=batch)
    disc = powers(gamma_ref, ks)
    disc[0], disc[1] = F32(1e-30), F32(1)  # the extremes
    return dict(p=p.astype(F32), r=rng.normal(0, 2, batch).astype(F32),
                done=(rng.random(batch) < 0.3).astype(F32), disc=disc, ref=F32(gamma_ref),
                z=dist.support(-10.0, 10.0, atoms))


def test_c51_project_grad_uses_each_samples_gamma():
    rng = np.random.default_rng(1)
    a = _target_inputs(rng)
    B, NA = a["p"].shape
    logp = np.log(rng.dirichlet(np.ones(NA), size=(B, 3))).astype(F32)
    actions = rng.integers(0, 3, B).astype(np.int32)
    isw = rng.uniform(0.5, 1, B).astype(F32)
    g = F32(0.97)
    out = dist.c51_project_grad(a["p"], a["r"], a["done"], g, a["z"], -10.0, 10.0, logp, actions,
                                isw, F32(0.01), a["disc"], a["ref"])
    geff = dist.effective_gamma(g, a["disc"], a["ref"])
    rows = _per_sample(lambda b, gb: dist.c51_project(
        a["p"][b:b + 1], a["r"][b:b + 1], a["done"][b:b + 1], gb, a["z"], -10.0, 10.0), geff, B)
    np.testing.assert_array_equal(out.m, np.concatenate(rows))
    assert np.array_equal(out.dlogits, dist.c51_grad(logp, actions, out.m, isw, F32(0.01)))
    # 1-step: bit for bit the projection without the n-step arguments.
    one = dist.c51_project_grad(a["p"], a["r"], a["done"], g, a["z"], -10.0, 10.0, logp, actions,
                                isw, F32(0.01))
    assert np.array_equal(one.m, dist.c51_project(a["p"], a["r"], a["done"], g, a["z"], -10.0,
                                                  10.0))
    # discount == gamma_ref everywhere: n_eff = 1 exactly, the 1-step bits.
    same = dist.c51_project_grad(a["p"], a["r"], a["done"], g, a["z"], -10.0, 10.0, logp, actions,
                                 isw, F32(0.01), np.full(B, a["ref"], F32), a["ref"])
    assert np.array_equal(same.m, one.m) and np.array_equal(same.dlogits, one.dlogits)


def test_scalar_target_q_branches_uses_each_samples_gamma():
    rng = np.random.default_rng(2)
    a = _target_inputs(rng)
    B, NA = a["p"].shape
    gammas = np.array([0.99, 0.9, 0.5], F32)
    p3 = np.stack([a["p"], a["p"][::-1], a["p"]])
    got = rstep.scalar_target_q_branches(p3, a["z"], a["r"], a["done"], gammas, a["disc"], a["ref"])
    e = (p3.astype(np.float64) @ a["z"].astype(np.float64))  # [D, B]
    floored = np.maximum(a["disc"].astype(np.float64), 1e-9)  # the 1e-30 sample
    n_eff = np.log(floored) / np.log(np.float64(a["ref"]))
    want = a["r"] + (gammas[:, None].astype(np.float64) ** n_eff) * (1 - a["done"]) * e
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    one = rstep.scalar_target_q_branches(p3, a["z"], a["r"], a["done"], gammas)
    same = rstep.scalar_target_q_branches(p3, a["z"], a["r"], a["done"], gammas,
                                          np.full(B, a["ref"], F32), a["ref"])
    assert np.array_equal(one, same)


def test_iqn_target_uses_each_samples_gamma():
    rng = np.random.default_rng(3)
    B, N, branches = 6, 4, (3, 2)
    A = sum(branches)
    ref = F32(0.9)
    disc = powers(ref, [1, 3, 16, 2, 5, 1])
    disc[5] = F32(1e-30)
    q = rng.normal(size=(B * N, A)).astype(F32)
    qt = rng.normal(size=(B * N, A)).astype(F32)
    tau = rng.random(B * N).astype(F32)
    acts = np.stack([rng.integers(0, n, B) for n in branches]).astype(np.int32)
    star = np.stack([rng.integers(0, n, B) for n in branches]).astype(np.int32)
    r = rng.normal(size=B).astype(F32)
    done = np.array([0, 1, 0, 0, 0, 0], F32)
    gammas = np.array([0.99, 0.8], F32)
    isw = np.ones(B, F32)
    isv = np.array([0.0], F32)
    args = (q, qt, tau, acts, star, r, done, gammas, isw, isv, 0, F32(100.0), branches, N)
    got = iqn.iqn_quantile_huber(*args, disc, ref)
    n_eff = np.log(np.maximum(disc.astype(np.float64), 1e-9)) / np.log(np.float64(ref))
    off = (0, 3)
    for d in range(2):
        for b in range(B):
            g = np.float64(gammas[d]) ** n_eff[b]
            sel = qt[b * N:(b + 1) * N, off[d] + star[d, b]].astype(np.float64)
            want = r[b] + g * (1 - done[b]) * sel
            np.testing.assert_allclose(got.y[d, b], want, rtol=1e-5, atol=1e-6)
    same = iqn.iqn_quantile_huber(*args, np.full(B, ref, F32), ref)
    one = iqn.iqn_quantile_huber(*args)
    assert all(np.array_equal(x, y) for x, y in zip(same, one))


# ------------------------------------------------------------------------------ the steps
CONFIG = DQNConfig.preset("tiny", gamma=(0.99, 0.9), **SOURCES["all"])


def _case_batch(config, seed=5, ks=None):
    rng = np.random.default_rng(seed)
    batch = Batch.random(config, rng)
    ks = rng.integers(1, 17, size=config.batch_size) if ks is None else ks
    disc = powers(config.gammas[0], ks)
    disc[0] = F32(1e-30)
    return batch, disc


def test_reference_step_with_discount_equal_to_gamma_ref_is_the_one_step():
    config = CONFIG
    trainer = Trainer(config, seed=1)
    trainer.set_epoch(1)  # the MSE warm-up blends (w = 3/4)
    state = trainer.state_dict()
    batch, _ = _case_batch(config)
    kw = dict(q_abs_ref=0.0, isv=trainer.isv.to_array(), step=0, seed=1)
    one = loss_and_grads(config, state["params"], state["target"], batch, **kw)
    same = loss_and_grads(config, state["params"], state["target"],
                          with_discount(batch, np.full(config.batch_size, F32(0.99), F32)), **kw)
    for key in ("c51_loss", "td_errors", "grad_c51", "target_q"):
        assert np.array_equal(one[key], same[key]), key
    assert np.array_equal(one["iqn"].loss, same["iqn"].loss)
    assert np.array_equal(one["iqn"].y, same["iqn"].y)
    _, disc = _case_batch(config)
    three = loss_and_grads(config, state["params"], state["target"], with_discount(batch, disc),
                           **kw)
    assert not np.array_equal(one["target_q"], three["target_q"])
    assert not np.array_equal(one["iqn"].y, three["iqn"].y)
    assert not np.array_equal(one["grad_c51"], three["grad_c51"])


def test_fast_trainer_refuses_a_batch_of_the_other_kind():
    batch, disc = _case_batch(TINY)
    with pytest.raises(ValueError, match=r"^batch\.discount: given, but this trainer was built "
                                         r"with n_step=1"):
        CpuTrainer(TINY).step(with_discount(batch, disc))
    with pytest.raises(ValueError, match=r"^batch\.discount: missing"):
        CpuTrainer(TINY, n_step=3).step(batch)
    with pytest.raises(ValueError, match=r"^gamma: 1\.0 .*n_step=3"):
        CpuTrainer(TINY.replace(gamma=1.0), n_step=3)


@pytest.mark.parametrize("source", ["core", "all"])
def test_cpu_executor_n_step_step_matches_reference(source):
    """A reference step on a batch with per-sample discounts (k in 1..16, one 1e-30) against
    the fast plan on the CPU executor (n_step=3), under the step-conformance bounds."""
    case = shared_case("tiny", "f32", "warm", source)
    _, disc = _case_batch(case.config)
    batch = with_discount(case.batch, disc)
    ref = Trainer(case.config, n_step=3)
    ref.load_state_dict({k: np.array(v, copy=True) for k, v in case.state.items()})
    fast = CpuTrainer(case.config, n_step=3)
    fast.load_state_dict({k: np.array(v, copy=True) for k, v in case.state.items()})
    ref_out, fast_out = run_step(ref, batch), run_step(fast, batch)
    assert_all(compare_step(case.config, case.state, ref_out, fast_out))


def test_cpu_executor_n_step_with_unit_discounts_is_bitwise_the_one_step():
    """n_step_on = 1 with every discount = gamma_ref (n_eff = 1 exactly) and n_step_on = 0 give
    the same bits on the CPU executor: the flag's branch is the only difference."""
    case = shared_case("tiny", "f32", "warm", "all")
    gref = F32(case.config.gammas[0])
    outs = []
    for n_step, disc in ((1, None), (3, np.full(case.config.batch_size, gref, F32))):
        t = CpuTrainer(case.config, n_step=n_step)
        t.load_state_dict({k: np.array(v, copy=True) for k, v in case.state.items()})
        t.step(with_discount(case.batch, disc))
        outs.append({k: t.debug_buffer(k) for k in ("target_q", "m", "grad", "iqn_y", "td")})
    for key in outs[0]:
        assert np.array_equal(outs[0][key], outs[1][key], equal_nan=True), key


def test_reference_trainer_takes_only_batches_of_its_kind():
    """``Trainer(n_step=)`` as ``fast.Trainer(n_step=)``: an n-step trainer needs
    ``batch.discount``, a 1-step trainer refuses one (it would be ignored); gamma 1 cannot be
    the base of n-step discounts. Nothing of the trainer changes on a refused batch."""
    case = shared_case("tiny", "f32", "warm", "core")
    _, disc = _case_batch(case.config)
    one, three = Trainer(case.config), Trainer(case.config, n_step=3)
    before = one.params.copy()
    with pytest.raises(ValueError, match=r"^batch\.discount: given, but this trainer was built "
                                         r"with n_step=1"):
        one.step(with_discount(case.batch, disc))
    with pytest.raises(ValueError, match=r"^batch\.discount: missing; this trainer trains on "
                                         r"n-step transitions"):
        three.step(case.batch)
    assert np.array_equal(one.params, before) and one.adam_t == 0
    with pytest.raises(ValueError, match=r"^gamma: 1\.0 .*n_step=3"):
        Trainer(case.config.replace(gamma=1.0), n_step=3)
