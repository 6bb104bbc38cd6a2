"""The budget pipeline (SPEC 4 step 5) and Mech 6's anchored safety clip.

Invariant under test: each source is clipped to ``fraction * max_grad_norm`` and the fractions
sum to 1, so the finite part of the combined gradient never exceeds ``max_grad_norm`` (here,
with IQN and ensemble unused, ``0.85 * max_grad_norm``) and Adam's safety clip never fires when
C51 and CQL are the only sources, whatever the batch. The oracle is float64 arithmetic written
here from SPEC 4; the pipeline itself is float32.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from foxhunt.reference import isv as isv_mod
from foxhunt.reference.backend import StepScalars
from foxhunt.reference.batch import Batch
from foxhunt.reference.backend import READBACK_FIELDS
from foxhunt.reference.budgets import budget_pipeline
from foxhunt.reference.kernels.step import step_bounds, step_scalars
from foxhunt.reference.config import DQNConfig
from foxhunt.reference.step import loss_and_grads
from foxhunt.reference.trainer import Trainer

BUDGET_RTOL = 1e-6  # the invariant: norm <= max_grad_norm * (1 + 1e-6)
SPECIALS = (np.nan, np.inf, -np.inf)


def finite_norm64(x: np.ndarray) -> float:
    """L2 norm of the finite elements, in float64."""
    x64 = x.astype(np.float64)
    return float(np.sqrt(np.sum(np.where(np.isfinite(x64), x64, 0.0) ** 2)))


def clip_factor64(norm: float, budget: float) -> float:
    """SPEC 4: ``m / n if n > m and n > 0 else 1``."""
    return budget / norm if norm > budget and norm > 0 else 1.0


def oracle_pipeline(config: DQNConfig, c51: np.ndarray, cql: np.ndarray):
    """float64 ``clip(c51, 0.70 mgn) + guarded clipped(cql, 0.15 mgn)`` and the four norms."""
    b1, b2 = config.budget("c51"), config.budget("cql")
    n1, n2 = finite_norm64(c51), finite_norm64(cql)
    s1, s2 = clip_factor64(n1, b1), clip_factor64(n2, b2)
    with np.errstate(invalid="ignore", over="ignore"):
        grad = c51.astype(np.float64) * s1 + np.where(np.isfinite(cql), cql.astype(np.float64) * s2, 0.0)
    return grad, (n1, n1 * s1, n2, n2 * s2)


@st.composite
def gradient_buffers(draw):
    """Two same-length f32 buffers with magnitudes 1e-6 .. 1e6 and explicitly injected specials."""
    n = draw(st.integers(1, 400))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    bufs = []
    for _ in range(2):
        scale = 10.0 ** draw(st.integers(-6, 6))
        x = (rng.standard_normal(n) * scale).astype(np.float32)
        positions = draw(st.lists(st.integers(0, n - 1), max_size=4))
        for p in positions:
            x[p] = draw(st.sampled_from(SPECIALS))
        bufs.append(x)
    return bufs


@settings(max_examples=60)
@given(bufs=gradient_buffers(), mgn=st.sampled_from([1e-3, 0.5, 10.0, 1e4]))
def test_budget_pipeline_bounds_finite_norm_and_matches_oracle(bufs, mgn):
    c51, cql = bufs
    config = DQNConfig.preset("tiny", max_grad_norm=mgn)
    c51_in, cql_in = c51.copy(), cql.copy()
    grad, norms = budget_pipeline(config, c51, cql)

    assert grad.dtype == np.float32 and grad.shape == c51.shape
    np.testing.assert_array_equal(c51, c51_in)  # inputs are not modified
    np.testing.assert_array_equal(cql, cql_in)

    # The invariant: the finite part is within the C51 + CQL budgets, hence within mgn.
    finite_norm = finite_norm64(grad)
    used = config.budget("c51") + config.budget("cql")
    assert finite_norm <= used * (1 + BUDGET_RTOL)
    assert finite_norm <= mgn * (1 + BUDGET_RTOL)

    # NaN map: C51's non-finite elements stay non-finite (a multiply by a finite scale > 0);
    # CQL's are skipped by the guarded SAXPY, so they never reach the result.
    np.testing.assert_array_equal(np.isfinite(grad), np.isfinite(c51))
    bad = ~np.isfinite(c51)
    np.testing.assert_array_equal(np.isnan(grad[bad]), np.isnan(c51[bad]))

    expected, (n1, p1, n2, p2) = oracle_pipeline(config, c51, cql)
    fin = np.isfinite(grad)
    np.testing.assert_allclose(grad[fin], expected[fin], rtol=1e-5, atol=1e-6 * mgn)
    np.testing.assert_allclose(
        [norms.c51_pre, norms.c51_post, norms.cql_pre, norms.cql_post], [n1, p1, n2, p2], rtol=1e-5)
    assert norms.c51_post <= config.budget("c51") * (1 + BUDGET_RTOL)
    assert norms.cql_post <= config.budget("cql") * (1 + BUDGET_RTOL)


def test_budget_pipeline_below_budget_is_a_plain_sum():
    """Components within their budgets pass unscaled (factor exactly 1)."""
    config = DQNConfig.preset("tiny")  # mgn 10: budgets 7 and 1.5
    c51 = np.array([3.0, 4.0, 0.0], np.float32)  # norm 5 < 7
    cql = np.array([0.5, 0.0, -1.0], np.float32)  # norm 1.118 < 1.5
    grad, norms = budget_pipeline(config, c51, cql)
    np.testing.assert_array_equal(grad, np.array([3.5, 4.0, -1.0], np.float32))
    assert norms.c51_pre == norms.c51_post == np.float32(5.0)
    assert norms.cql_post == norms.cql_pre


def test_budget_pipeline_clips_each_component_to_its_own_budget():
    config = DQNConfig.preset("tiny", max_grad_norm=1.0)  # budgets 0.70 and 0.15
    c51 = np.array([30.0, 40.0], np.float32)  # norm 50 -> scaled by 0.7/50
    cql = np.array([0.0, -6.0], np.float32)  # norm 6 -> scaled by 0.15/6
    grad, norms = budget_pipeline(config, c51, cql)
    np.testing.assert_allclose(grad, [0.42, 0.56 - 0.15], rtol=1e-6)
    np.testing.assert_allclose([norms.c51_pre, norms.c51_post, norms.cql_pre, norms.cql_post],
                               [50.0, 0.7, 6.0, 0.15], rtol=1e-6)


def test_budget_pipeline_overflowing_component_is_discarded_and_reported_as_zero():
    """A finite element whose square overflows makes the clip scale 0 (SPEC: component discarded
    for the step); the other component still enters within its budget."""
    config = DQNConfig.preset("tiny", max_grad_norm=1.0)
    c51 = np.ones(8, np.float32)
    c51[3] = np.float32(1e20)
    cql = np.full(8, 0.5, np.float32)  # norm sqrt(2) -> clipped to 0.15
    with np.errstate(invalid="ignore"):
        grad, norms = budget_pipeline(config, c51, cql)
    assert finite_norm64(grad) <= config.budget("cql") * (1 + BUDGET_RTOL)
    assert norms.c51_pre == np.inf
    assert norms.c51_post == 0.0


# ------------------------------------------------------------------ the second-wave budgets
def _layout_sized(layout, rng, scale, end, specials=()):
    x = layout.zeros()
    x[:end] = (rng.standard_normal(end) * scale).astype(np.float32)
    for i in specials:
        x[i] = np.nan
    return x


@pytest.mark.parametrize("scales", [(10.0, 10.0), (1e-3, 1e-3), (10.0, 1e-3)])
@pytest.mark.parametrize("weights", [(1.0, 0.5), (0.25, 2.0)])
def test_second_wave_budgets_match_the_float64_pipeline(scales, weights):
    """grad + lambda * clipped(iqn[0:trunk_end], 0.10 mgn) + w * clipped(ens[0:value_end], 0.05
    mgn), guarded, recomputed here in float64."""
    from foxhunt.reference.budgets import second_wave_budgets
    from foxhunt.reference.layout import ParamLayout

    config = DQNConfig.preset("tiny", lambda_iqn=weights[0], ens_weight=weights[1])
    lay = ParamLayout(config)
    rng = np.random.default_rng(4)
    grad = (rng.standard_normal(lay.num_elements) * 0.1).astype(np.float32)
    grad[lay.padding_mask()] = 0
    iqn = _layout_sized(lay, rng, scales[0], lay.trunk_end, specials=(3,))
    ens = _layout_sized(lay, rng, scales[1], lay.value_end, specials=(lay.value_end - 1,))
    grad_in = grad.copy()
    out, norms = second_wave_budgets(config, lay, grad, iqn_trunk=iqn, ens_trunk=ens)
    assert np.array_equal(grad, grad_in)  # inputs are not modified
    expect = grad.astype(np.float64)
    for buf, end, w, src in ((iqn, lay.trunk_end, weights[0], "iqn"),
                             (ens, lay.value_end, weights[1], "ens")):
        n = finite_norm64(buf[:end])
        s = clip_factor64(n, config.budget(src))
        x = buf[:end].astype(np.float64)
        expect[:end] += np.where(np.isfinite(x), w * x * s, 0.0)
        np.testing.assert_allclose([getattr(norms, f"{src}_pre"), getattr(norms, f"{src}_post")],
                                   [n, n * s], rtol=1e-5)
        assert getattr(norms, f"{src}_post") <= config.budget(src) * (1 + BUDGET_RTOL)
    np.testing.assert_allclose(out, expect, rtol=1e-5, atol=1e-7)
    assert np.isfinite(out).all()  # the NaNs of both scratches were skipped
    assert np.array_equal(out[lay.value_end:], grad[lay.value_end:])  # outside the ranges


def test_second_wave_budgets_refuse_a_source_that_does_not_match_its_weight():
    from foxhunt.reference.budgets import SourceNorms, second_wave_budgets
    from foxhunt.reference.layout import ParamLayout

    config = DQNConfig.preset("tiny", lambda_iqn=1.0)
    lay = ParamLayout(config)
    g = lay.zeros()
    with pytest.raises(ValueError, match=r"iqn trunk gradient missing with lambda_iqn=1.0"):
        second_wave_budgets(config, lay, g)
    with pytest.raises(ValueError, match=r"ens trunk gradient given with ens_weight=0.0"):
        second_wave_budgets(config, lay, g, iqn_trunk=g, ens_trunk=g)
    core = DQNConfig.preset("tiny")
    out, norms = second_wave_budgets(core, ParamLayout(core), g[:ParamLayout(core).num_elements])
    assert norms == SourceNorms() and norms.iqn_pre == 0 and norms.ens_post == 0


# ------------------------------------------------------------------ Mech 6
@pytest.mark.parametrize("mgn, slow_ema, expected", [
    (10.0, 0.0, 10.0),       # cold start: the floor on the signal gives 100 * 1 > mgn
    (1e3, 0.05, 100.0),      # signal below 1 floors to 1: bound 100, never 100 * 0.05
    (1e3, 2.5, 250.0),       # anchored: 100 * slow_ema
    (1e4, 500.0, 1e4),       # capped at mgn
    (1e3, np.nan, 100.0),    # NaN signal counts as 1 (fmaxf)
])
def test_safety_clip_bound_is_min_of_mgn_and_anchored_ema(mgn, slow_ema, expected):
    """Mech 6's bound as the step computes it (``step_bounds``, from the ISV at step start)."""
    config = DQNConfig.preset("tiny", max_grad_norm=mgn)
    isv = np.zeros(8, np.float32)
    isv[3] = slow_ema
    out = step_bounds(isv, np.zeros(1, np.int64), np.zeros(0, np.float32), np.zeros(0, np.int32),
                      np.zeros(0, np.int32), q_abs_ref_index=0, slow_ema_index=3,
                      weight_clamp_mult=np.float32(100), max_grad_norm=np.float32(mgn),
                      anchor_mult=np.float32(config.grad_clip_anchor_mult))
    assert out.clip_bound.dtype == np.float32 and out.clip_bound[0] == np.float32(expected)


def _slow_ema_after(slow: float, grad_norm: float, alpha: float) -> np.float32:
    """The slow EMA slot after ``step_scalars`` sees a total gradient norm of ``grad_norm``."""
    isv = np.zeros(4, np.float32)
    isv[2] = slow
    partials = np.array([np.float32(grad_norm) ** 2], np.float32)
    with np.errstate(all="ignore"):
        out = step_scalars(partials, np.float32(0), np.float32(0), np.float32(10), isv,
                           np.zeros(len(READBACK_FIELDS), np.float32), np.float32(7),
                           np.float32(1.5), slow_ema_index=2, slow_alpha=np.float32(alpha))
    return out.isv[2]


def test_slow_ema_update_rate_and_nonfinite_guard():
    alpha = DQNConfig.preset("tiny").grad_slow_ema_alpha  # 0.001
    got = _slow_ema_after(2.0, 12.0, alpha)
    assert isinstance(got, np.float32)
    np.testing.assert_allclose(got, 0.999 * 2.0 + 0.001 * 12.0, rtol=1e-6)
    assert _slow_ema_after(2.0, np.inf, alpha) == np.float32(2.0)  # a non-finite norm keeps it
    # a NaN sum of squares is a norm of 0 (sqrtf(fmaxf(sq, 0)): the norms' NaN contract), which
    # is finite: the EMA decays by (1 - a)
    assert _slow_ema_after(2.0, np.nan, alpha) == np.float32(np.float32(0.999) * np.float32(2.0))


# ------------------------------------------------------------------ the trainer's step
def scaled_batch(config: DQNConfig, seed: int, reward_scale: float, state_scale: float) -> Batch:
    b = Batch.random(config, np.random.default_rng(seed))
    return Batch(s=(b.s * np.float32(state_scale)).astype(np.float32), a=b.a,
                 r=(b.r * np.float32(reward_scale)).astype(np.float32),
                 s2=(b.s2 * np.float32(state_scale)).astype(np.float32), done=b.done, isw=b.isw)


@settings(max_examples=25)
@given(seed=st.integers(0, 2**16), reward_exp=st.integers(0, 6), state_exp=st.integers(0, 6),
       mgn=st.sampled_from([1e-3, 0.1, 10.0]))
def test_trainer_step_never_fires_the_safety_clip(seed, reward_exp, state_exp, mgn):
    """Rewards and states scaled up to 1e6: the budgets hold the total norm under the safety
    clip's bound, step after step; the reported norms match a float64 recombination of
    ``loss_and_grads``' raw components."""
    config = DQNConfig.preset("tiny", max_grad_norm=mgn, readback_interval=1)
    trainer = Trainer(config, seed=seed % 7)
    for k in range(3):
        batch = scaled_batch(config, seed + k, 10.0 ** reward_exp, 10.0 ** state_exp)
        q_abs_ref = trainer.isv.get("Q_ABS_REF")
        h2_bound = np.float32(config.h2_clamp_mult) * max(trainer.isv.get("H_S2_RMS_EMA"), np.float32(1))
        with np.errstate(all="ignore"):
            raw = loss_and_grads(config, trainer.params, trainer.target, batch,
                                 q_abs_ref=q_abs_ref, h2_bound=h2_bound)
            slow_ema = trainer.isv.get("GRAD_NORM_SLOW_EMA")
            out: StepScalars = trainer.step(batch)
        assert out.fresh and out.read_at == k + 1
        expected_bound = min(mgn, 100.0 * max(float(slow_ema), 1.0))
        np.testing.assert_allclose(out.clip_bound, expected_bound, rtol=1e-6)
        assert out.safety_clip_fired is False
        assert out.grad_norm <= mgn * (1 + BUDGET_RTOL)
        assert out.c51_norm_post <= config.budget("c51") * (1 + BUDGET_RTOL)
        assert out.cql_norm_post <= config.budget("cql") * (1 + BUDGET_RTOL)

        grad64, (n1, p1, n2, p2) = oracle_pipeline(config, raw["grad_c51"], raw["grad_cql"])
        np.testing.assert_allclose([out.c51_norm_pre, out.c51_norm_post, out.cql_norm_pre,
                                    out.cql_norm_post], [n1, p1, n2, p2], rtol=1e-5)
        np.testing.assert_allclose(out.grad_norm, finite_norm64(grad64.astype(np.float32)),
                                   rtol=1e-5, atol=1e-7 * mgn)
        assert np.isfinite(trainer.params).all()


def test_mech6_slow_ema_follows_the_step_norm():
    config = DQNConfig.preset("tiny", readback_interval=1)
    trainer = Trainer(config, seed=3)
    rng = np.random.default_rng(0)
    ema = 0.0
    for _ in range(5):
        out = trainer.step(Batch.random(config, rng))
        ema = 0.999 * ema + 0.001 * out.grad_norm
    np.testing.assert_allclose(trainer.isv.get("GRAD_NORM_SLOW_EMA"), ema, rtol=1e-5)
    assert trainer.isv.get("GRAD_NORM_SLOW_EMA") > 0
    assert isv_mod.slot("GRAD_NORM_SLOW_EMA").reset.kind == "CrossFold"


def test_safety_clip_fires_when_the_anchored_bound_is_below_the_budgets():
    """Control for the test above: the flag is wired. With the anchor multiplier tiny, Mech 6's
    bound (anchor * max(slow_ema, 1)) is below the C51 norm, so Adam's clip scales the step."""
    config = DQNConfig.preset("tiny", readback_interval=1, grad_clip_anchor_mult=1e-4)
    trainer = Trainer(config, seed=0)
    out = trainer.step(Batch.random(config, np.random.default_rng(1)))
    assert out.clip_bound == np.float32(1e-4)
    assert out.grad_norm > out.clip_bound
    assert out.safety_clip_fired is True
